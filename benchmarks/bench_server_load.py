"""A load run against `serve` (issue #56): rounds of --requests streamed requests from --clients
client threads, about --cancel of them abandoned mid-stream, against a server in its own process
(`--parallel` 4); after each round the server's resident memory (VmRSS) and its compiled steps'
traces (made so far, and held: /api/slots `compiled`, with MLX's memory) and glibc's heap
(/api/slots `heap_mib`: obtained, in use, free), with the load average at the round's start and
end. Every reply that was not abandoned must end with a final line (done_reason stop or length)
and no error line; the first round is the warm-up, and the RSS after the later rounds is compared
with it.

A long run meant to outlast others' work (nice 19, stopped while a quiet lock is held): the server
gets --start-timeout seconds of this benchmark's running time to answer (the seconds it was
stopped or given no CPU do not count: `PauseMeter`); a client waits --request-timeout seconds for
each line; a client-side failure is counted as that request's outcome (`client error: ...`), not a
crash; the JSON is rewritten after every round (and says `finished` false, and why, if the run
stopped early), so a late failure keeps the rounds before it. SIGTERM (`kill`) or SIGINT (Ctrl-C)
ends the run the same way: the server stopped, the streams in flight dropped, the JSON saying which
signal came during which round, one line, exit 1.

  python -m benchmarks.bench_server_load models/tinygpt-base.tinygpt --json docs/results/server_load.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks._args import at_least
from benchmarks.bench_server_parallel import PROMPTS, policies, server_rss_mib, spawn_server
from tinygpt_mlx.cli.common import write_atomic


class PauseMeter:
    """Seconds this process did not run since it was made: a ticker thread wakes every `every`
    seconds, and a gap over `gap` seconds between two wakeups (the process stopped by SIGSTOP, as
    the shared machine's quiet locks stop nice-19 work, or given no CPU) counts as paused, less the
    `every` it would have slept. `running(since)` is the time that ran since the clock read `since`,
    the gap still open (no wakeup yet after a stop) counted too."""

    def __init__(self, clock=time.monotonic, every: float = 1.0, gap: float = 5.0):
        self.clock, self.every, self.gap = clock, every, gap
        self.lock = threading.Lock()
        self.last = clock()
        self.paused = 0.0
        self.stops: list[tuple[float, float]] = []       # (clock at the wakeup after it, its length)

    def tick(self) -> None:
        with self.lock:
            now = self.clock()
            if now - self.last > self.gap:
                self.paused += now - self.last - self.every
                self.stops.append((now, now - self.last - self.every))
            self.last = now

    def paused_until_now(self) -> tuple[float, float]:
        """(the clock now, the seconds paused so far, the open gap included)."""
        with self.lock:
            now = self.clock()
            open_gap = now - self.last
            return now, self.paused + (open_gap - self.every if open_gap > self.gap else 0.0)

    def running(self, since: float, paused_then: float) -> float:
        now, paused = self.paused_until_now()
        return now - since - (paused - paused_then)

    def start(self) -> "PauseMeter":
        def loop():
            while True:
                time.sleep(self.every)
                self.tick()
        threading.Thread(target=loop, name="pause-meter", daemon=True).start()
        return self


class ServerDidNotStart(RuntimeError):
    pass


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived: the run ends early (a BaseException, as KeyboardInterrupt, so that
    no `except Exception` on the way takes it for a request's failure)."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals() -> dict:
    """SIGTERM and SIGINT raise `Stopped` in the main thread (where Python runs signal handlers, even
    while it waits for the clients), naming the signal; the handlers they had, to put back."""
    def handler(signum, frame):
        ignore_signals()
        raise Stopped(signal.Signals(signum).name)
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def ignore_signals() -> None:
    """During the clean-up (the server stopped, the JSON written) SIGTERM and SIGINT are ignored, so
    that a second one does not cut it short."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def wait_for_server(proc, url: str, label: str, timeout: float, meter: PauseMeter, probe=None,
                    sleep=time.sleep) -> float:
    """Wait until the server at `url` answers /api/version; the seconds it took (running time). The
    server gets `timeout` seconds of this process's running time (`meter`); past them, or if it
    exits first, it is killed and `ServerDidNotStart` says which, naming --start-timeout."""
    probe = probe or (lambda: httpx.get(url + "/api/version", timeout=2))
    since, paused_then = meter.paused_until_now()
    while True:
        try:
            probe()
            return meter.running(since, paused_then)
        except httpx.TransportError:
            pass
        code = proc.poll()
        if code is not None:
            raise ServerDidNotStart(f"the server for {label} exited with status {code} before answering "
                                    f"(its output above)")
        ran = meter.running(since, paused_then)
        if ran > timeout:
            proc.kill()
            wall = meter.paused_until_now()[0] - since
            raise ServerDidNotStart(f"the server for {label} did not answer within --start-timeout {timeout:g} s "
                                    f"(this benchmark ran {ran:.0f} s of {wall:.0f} s; the rest it was stopped): "
                                    f"give a longer --start-timeout")
        sleep(0.2)


def ask(url: str, model: str, prompt: str, tokens: int, cancel_after, timeout: float = 3600) -> str:
    """One streamed request: "complete", "cancelled" (left after `cancel_after` lines), the server's
    error, or "client error: ..." (the client's own failure, a read past `timeout` seconds among
    them), never an exception."""
    body = {"model": model, "prompt": prompt, "raw": True, "options": {"temperature": 0.7, "num_predict": tokens}}
    try:
        with httpx.stream("POST", url + "/api/generate", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            for i, line in enumerate(r.iter_lines()):
                d = json.loads(line)
                if "error" in d:
                    return f"error: {d['error']}"
                if cancel_after is not None and i >= cancel_after:
                    return "cancelled"
                if d["done"]:
                    return "complete" if d.get("done_reason") in ("stop", "length") else f"done_reason {d.get('done_reason')}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return f"client error: {type(e).__name__}: {e}"
    return "no final line"


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not gone in 60 s (a stopped process keeps SIGTERM pending)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--policy", default="full", help="full, int4, sink4/windowW, retrieval sink4/hotW or int4 sink4/windowW")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="the first is the warm-up")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request at most")
    ap.add_argument("--cancel", type=float, default=0.25, help="share of requests abandoned mid-stream")
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds the server may take to answer its first request, counting only the time this "
                         "benchmark ran (not the time it was stopped, as the quiet locks stop nice-19 work; default 900)")
    ap.add_argument("--request-timeout", type=float, default=3600,
                    help="seconds a client waits for each line of a reply and for /api/tags, /api/slots (default 3600); "
                         "past it the request counts as a client error")
    ap.add_argument("--json", type=Path, help="written after every round")
    args = ap.parse_args()
    at_least(ap, ("--requests", args.requests, 1), ("--clients", args.clients, 1),
             ("--rounds", args.rounds, 2), ("--tokens", args.tokens, 1))
    if not 0 <= args.cancel <= 1:
        ap.error(f"--cancel must be between 0 and 1, got {args.cancel}")
    for name, value in (("--start-timeout", args.start_timeout), ("--request-timeout", args.request_timeout)):
        if not value > 0:
            ap.error(f"{name} must be more than 0 seconds, got {value:g}")
    if not Path(args.model).expanduser().exists():
        ap.error(f"model {args.model}: no such file or directory")
    if args.policy not in policies(args.window):
        ap.error(f"--policy: unknown {args.policy}; known: {', '.join(policies(args.window))}")
    meter = PauseMeter().start()
    out = {"command": " ".join(sys.argv), "ld_preload": os.environ.get("LD_PRELOAD", ""),
           "load_average_at_start": list(os.getloadavg()), "finished": False, "rounds": []}

    def save():
        if args.json:
            write_atomic(args.json, json.dumps(out, indent=1) + "\n")

    rng = random.Random(0)
    where, proc, signalled = "the server's start", None, False
    handlers = stop_on_signals()
    try:
        proc, url = spawn_server(args.model, args.policy, args.window, 4)
        out["server_pid"] = proc.pid
        try:
            out["server_start_seconds"] = round(wait_for_server(proc, url, args.policy, args.start_timeout, meter), 1)
        except ServerDidNotStart as e:
            out["stopped"] = str(e)
            save()
            sys.exit(f"bench_server_load: {e}")
        model = httpx.get(url + "/api/tags", timeout=args.request_timeout).json()["models"][0]["model"]
        for k in range(args.rounds):
            where = f"round {k}"
            plan = [(rng.choice(PROMPTS), rng.randrange(1, 16) if rng.random() < args.cancel else None)
                    for _ in range(args.requests)]
            load0, (t0, paused0) = list(os.getloadavg()), meter.paused_until_now()
            ex = concurrent.futures.ThreadPoolExecutor(args.clients)
            try:
                got = list(ex.map(lambda p: ask(url, model, p[0], args.tokens, p[1], args.request_timeout), plan))
            finally:        # (all done here, but on a stop: the queued requests dropped, the server stopped next)
                ex.shutdown(wait=False, cancel_futures=True)
            counts = {x: got.count(x) for x in sorted(set(got))}
            t1, paused1 = meter.paused_until_now()
            row = {"round": k, "outcomes": counts, "load_average_at_start": load0,
                   "load_average_at_end": list(os.getloadavg()), "seconds": round(t1 - t0, 1),
                   "paused_seconds": round(paused1 - paused0, 1)}
            code = proc.poll()
            if code is not None:
                row["server_exited"] = code
                out["rounds"].append(row)
                out["stopped"] = f"the server exited with status {code} during round {k}"
                print(json.dumps(row), flush=True)
                break
            state = httpx.get(url + "/api/slots", timeout=args.request_timeout).json()
            row.update({"server_rss_mib": server_rss_mib(proc.pid), "batched_steps": state["batched_steps"],
                        "queued_after": state["queued"], "busy_after": state["busy"],
                        "compiled": state["compiled"], "heap_mib": state.get("heap_mib")})
            out["rounds"].append(row)
            save()
            print(json.dumps(row), flush=True)
        else:
            out["finished"] = True
    except Stopped as e:
        out["stopped"], signalled = f"{e} received during {where}", True
    except BaseException as e:
        if not isinstance(e, SystemExit):
            out["stopped"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        ignore_signals()
        if proc is not None:
            stop_server(proc)
        out["load_average_at_end"] = list(os.getloadavg())
        save()
        for s, h in handlers.items():
            signal.signal(s, h)
    if signalled:
        sys.exit(f"bench_server_load: {out['stopped']}; the server stopped, {len(out['rounds'])} round(s) kept"
                 + (f" in {args.json}" if args.json else ""))
    bad = [r for r in out["rounds"] if set(r["outcomes"]) - {"complete", "cancelled"} or "server_exited" in r]
    rss = [r["server_rss_mib"] for r in out["rounds"] if "server_rss_mib" in r]
    print(f"{'errors in ' + str(len(bad)) + ' round(s)' if bad else 'no error'}; RSS after the warm-up "
          f"{rss[0] if rss else '-'} MiB, after the later rounds {', '.join(map(str, rss[1:]))} MiB"
          + (f"; stopped: {out['stopped']}" if "stopped" in out else ""))
    sys.exit(1 if bad or not out["finished"] else 0)


if __name__ == "__main__":
    main()
