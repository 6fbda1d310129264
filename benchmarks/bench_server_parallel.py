"""Continuous batching in `serve` (issue #56): aggregate decode tokens/s of concurrent streams
against one stream, and the time to first token of a short request sent while a long answer
streams against an idle server.

Starts the server in a process of its own per policy (uvicorn on a free 127.0.0.1 port,
`--parallel` --streams, as `posttrainllm serve` runs it: the clients' threads do not share its
interpreter) and talks to it over HTTP with ollama's /api/generate, streamed, greedy:

  one stream:   each prompt alone, --tokens tokens; tokens/s = its tokens / wall time (median)
  N streams:    --streams requests at once (different prompts), the same length; aggregate
                tokens/s = all their tokens / wall time from the first sent to the last done;
                each concurrent text is compared with that prompt's text on the idle server
  TTFT idle:    a short request (--short-tokens) on the idle server (median of --repeats, each
                a prompt of its own, so that none is served from another's warm slot)
  TTFT busy:    such requests sent while a --long-tokens answer streams (median of --repeats,
                each sent after the previous finished, all while the long answer runs)
  engine only:  in this process, without HTTP: the N prompts' decode steps run one model call
                each (as N lone requests would) against one batched call (server/batch.py),
                --engine-steps steps a round, 2 x --rounds rounds alternating (medians): what
                batching saves in the model call, apart from the server's per-token work; the
                decode steps on one OpenBLAS thread, as the server runs them (blas.Threads);
                by the wall clock and per CPU-second of this process. --engine-vs PATH times
                a second batched path in the same rounds (ratios in one run); the JSON
                counts how each batched path's steps ran (batch.taken: compiled, compiled_kivi, ...);
                --engine-prompt-tokens N repeats each prompt to N tokens or more (past a
                window or hot budget the steps start in the policy's steady state);
                in the same rounds, the ceiling batching has on this machine: mlx-lm's
                own KVCache, the prompts cut to the shortest one's length (no mask: its
                best case), N calls of one row against one call of N rows

  worker only:  (`--only worker`) the server's worker in this process, without HTTP: each prompt
                alone, one after the other, against all at once (greedy, --tokens each, 2 x
                --rounds rounds alternating), beside the engine-only part: what the scheduler
                costs apart from the event loop and the client; the throughput part also records
                the CPU per token of the server's threads (`thread_cpu`: its worker thread, its
                event loop, its other threads: MLX's and OpenBLAS's) and of the client

Wall times are measured at the client (request sent -> last NDJSON line; TTFT: -> first
non-empty text). The ratios are what count: each pair is measured in the same run, minutes
apart at most. Beside the wall-clock ratio, the ratio of tokens per CPU-second of the server
process (all its threads): the work a token costs, which the load of other processes on a
shared machine disturbs far less than the wall time. Run it with `nice` on a shared machine.

  python -m benchmarks.bench_server_parallel models/tinygpt-base.tinygpt
  python -m benchmarks.bench_server_parallel ~/.cache/posttrainllm/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --json docs/results/server_parallel_smollm2.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

from benchmarks._args import at_least
from tinygpt_mlx import blas
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load
from tinygpt_mlx.cli.common import write_atomic

#: the streams' prompts, then the TTFT part's two (the last two). Each stream's prompt must run its
#: --tokens tokens on the models measured (SmolLM2 greedy: all 256): a stream that stops early
#: leaves fewer rows in the batch's last steps ("A recipe for bread needs", the third before
#: 2026-12-05, stopped after 125 tokens on SmolLM2 and lowered its four-stream rate)
PROMPTS = ["The history of the city begins", "In the morning the old fisherman", "The old castle on the hill",
           "The theory of numbers studies", "Once upon a time in a small village", "The river flows from"]


def policies(window: int) -> dict[str, CacheConfig]:
    """The labels --policies and bench_server_load's --policy take: the issue's four (the default
    run, `DEFAULT_POLICIES`), then int4 under StreamingLLM (the composition; 2026-12-07, run only
    when named)."""
    return {"full": CacheConfig(), "int4": CacheConfig(key_bits=4, value_bits=4),
            f"sink4/window{window}": CacheConfig(sink=4, window=window),
            f"retrieval sink4/hot{window}": CacheConfig(sink=4, hot_budget=window),
            f"int4 sink4/window{window}": CacheConfig(key_bits=4, value_bits=4, sink=4, window=window)}


#: how many of `policies`' labels a run without --policies runs (the issue's four)
DEFAULT_POLICIES = 4


def generate(url: str, model: str, prompt: str, tokens: int, on_first=None, stop: threading.Event = None) -> dict:
    """One streamed greedy /api/generate: its text, token count, TTFT and wall time (client side)."""
    body = {"model": model, "prompt": prompt, "raw": True, "options": {"temperature": 0, "num_predict": tokens}}
    t0 = time.perf_counter()
    ttft, text, final = None, [], None
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            obj = json.loads(line)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("response") and ttft is None:
                ttft = time.perf_counter() - t0
                if on_first is not None:
                    on_first()
            text.append(obj.get("response", ""))
            if obj["done"]:
                final = obj
            if stop is not None and stop.is_set():
                break
    return {"text": "".join(text), "tokens": final["eval_count"] if final else None, "ttft_s": ttft,
            "wall_s": time.perf_counter() - t0, "t0": t0, "t1": time.perf_counter()}


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds the server process's threads have used, by part: its worker thread (the model's
    steps as Python issues them, sampling, detokenising, the events; found by its OS-level name,
    which the server sets since 2026-12-06, server/worker.py `name_os_thread`: before, the name
    stayed in Python, this entry was 0 and the worker's CPU was counted in "other"), its main
    thread (the event loop: HTTP, NDJSON lines), the rest (MLX's stream threads, OpenBLAS's:
    the matrix products and kernels the worker's steps hand them)."""
    out = {"worker": 0.0, "loop": 0.0, "other": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue                  # (a thread that ended)
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        part = "loop" if int(tid) == pid else "worker" if comm.startswith("posttrainllm") else "other"
        out[part] += (int(fields[11]) + int(fields[12])) / tick
    return out


def throughput(url: str, model: str, streams: int, tokens: int, rounds: int, pid: int) -> dict:
    """Each prompt alone, then `rounds` runs of all `streams` at once, each round after the first
    preceded by one more solo run (the machine's load drifts: both rates are medians). Beside
    the wall-clock rates, tokens per CPU-second of the server process: the work per token, which
    other processes' load on a shared machine changes far less than the wall time."""
    prompts = PROMPTS[:streams]

    # CPU ms per token by the server's parts and of this (client) process, one stream and N
    parts = {"one": {k: 0.0 for k in ("worker", "loop", "other", "client")}, "n": None}
    parts["n"] = dict(parts["one"])
    counted = {"one": 0, "n": 0}

    def account(which, t0, c0, n_tokens):
        t1 = thread_cpu(pid)
        for k in t1:
            parts[which][k] += t1[k] - t0[k]
        parts[which]["client"] += time.process_time() - c0
        counted[which] += n_tokens

    def solo_run(p):
        c0, t0, p0 = cpu_seconds(pid), thread_cpu(pid), time.process_time()
        r = generate(url, model, p, tokens)
        r["cpu_s"] = cpu_seconds(pid) - c0
        account("one", t0, p0, r["tokens"])
        return r

    alone = [solo_run(p) for p in prompts]
    solo = [r["tokens"] / r["wall_s"] for r in alone]
    solo_cpu = [r["tokens"] / r["cpu_s"] for r in alone]
    together_rates, together_cpu, same = [], [], [True] * streams
    for i in range(rounds):
        if i:
            r = solo_run(prompts[i % streams])
            solo.append(r["tokens"] / r["wall_s"])
            solo_cpu.append(r["tokens"] / r["cpu_s"])
        c0, t0, p0 = cpu_seconds(pid), thread_cpu(pid), time.process_time()
        with concurrent.futures.ThreadPoolExecutor(streams) as ex:
            together = list(ex.map(lambda p: generate(url, model, p, tokens), prompts))
        cpu = cpu_seconds(pid) - c0
        account("n", t0, p0, sum(r["tokens"] for r in together))
        wall = max(r["t1"] for r in together) - min(r["t0"] for r in together)
        together_rates.append(sum(r["tokens"] for r in together) / wall)
        together_cpu.append(sum(r["tokens"] for r in together) / cpu)
        same = [s and a["text"] == b["text"] for s, a, b in zip(same, alone, together)]
    short = [r["tokens"] for r in alone if r["tokens"] < tokens]
    if short:
        print(f"warning: {len(short)} of {streams} streams stopped before {tokens} tokens ({short}): the last "
              "steps of the concurrent runs batch fewer rows", file=sys.stderr)
    one, n = statistics.median(solo), statistics.median(together_rates)
    one_cpu, n_cpu = statistics.median(solo_cpu), statistics.median(together_cpu)
    return {"one_stream_tok_s": round(one, 2), "one_stream_samples": [round(x, 1) for x in solo],
            "tokens_per_stream": [r["tokens"] for r in alone],
            "n_streams_tok_s": round(n, 2), "n_streams_samples": [round(x, 1) for x in together_rates],
            "ratio": round(n / one, 2), "same_text": same,
            "one_stream_tok_per_cpu_s": round(one_cpu, 2), "n_streams_tok_per_cpu_s": round(n_cpu, 2),
            "cpu_ratio": round(n_cpu / one_cpu, 2),
            # CPU ms per token: the server's worker thread, its event loop, its other threads, and
            # the client (this process: the streams' HTTP reads), one stream against N
            "cpu_ms_per_token_one_stream": {k: round(1e3 * v / max(counted["one"], 1), 4) for k, v in parts["one"].items()},
            "cpu_ms_per_token_n_streams": {k: round(1e3 * v / max(counted["n"], 1), 4) for k, v in parts["n"].items()}}


#: the batched step's attention paths (`--engine-path`): server/batch.py's `decode_step` arguments
PATHS = {"compiled": {}, "compiled-steady": {"compiled": "steady"}, "stacked": {"compiled": False},
         "per-sequence": {"compiled": False, "dense": False}}


def engine(model_path: str, config: CacheConfig, streams: int, steps: int, rounds: int, decode_threads: int = 1,
           path: str = "compiled", vs: Optional[str] = None, prompt_tokens: int = 0) -> dict:
    """The decode step itself, without the server: `streams` sequences (the prompts, prefilled;
    each repeated to at least `prompt_tokens` tokens) stepped one model call each
    (`generate.call`, as a lone request runs) against one batched call for all
    (`batch.decode_step` on `path`), and where `vs` names another path, one batched call on it
    too, `steps` steps a round, alternating; tokens/s of each, by the wall clock and per
    CPU-second of this process (medians)."""
    import mlx.core as mx
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.generate import call, prefill
    from tinygpt_mlx.model import last_logits
    from mlx_lm.models import cache as mlx_cache
    from tinygpt_mlx.server import batch

    loaded = _loaded(model_path)
    m, tok = loaded.model, loaded.tokenizer
    prompts = []
    for p in PROMPTS[:streams]:
        ids = tok.encode(p)
        prompts.append(tok.encode(" ".join([p] * -(-prompt_tokens // len(ids)))) if len(ids) < prompt_tokens else ids)
    threads = blas.Threads(decode=decode_threads or 1 << 16)     # 0: OpenBLAS's own count
    threads.for_prefill()
    kinds = {"solo": None, "batched": PATHS[path], **({"vs": PATHS[vs]} if vs else {})}
    sets = {}
    for kind in kinds:
        caches = [make_cache(m, config) for _ in prompts]
        sets[kind] = (caches, [int(mx.argmax(prefill(m, ids, c, 512)).item()) for ids, c in zip(prompts, caches)])
    # the peer's ceiling: mlx-lm's own KVCache, the prompts cut to the shortest's length (one
    # length, so its B rows need no mask: its best case), B calls of one row against one of B
    cut = min(len(p) for p in prompts)
    for kind, rows in (("peer_solo", [[p[:cut]] for p in prompts]), ("peer_batched", [[p[:cut] for p in prompts]])):
        caches = [mlx_cache.make_prompt_cache(m) for _ in rows]
        sets[kind] = (caches, [mx.argmax(last_logits(m, mx.array(r), c), axis=-1) for r, c in zip(rows, caches)])
        mx.eval(sets[kind][1])
        kinds[kind] = None
    threads.for_decode()
    rates = {kind: [] for kind in kinds}
    cpu = {kind: [] for kind in kinds}
    order = list(kinds)
    paths = {kind: batch.taken - batch.taken for kind in kinds}     # how each batched kind's steps ran
    for r in range(rounds):
        for kind in (order if r % 2 == 0 else order[::-1]):
            caches, tokens = sets[kind]
            was = batch.taken.copy()      # (how the round's batched steps ran: counted outside the timer)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                if kind == "solo":
                    tokens = [int(mx.argmax(call(m, [t], c)).item()) for t, c in zip(tokens, caches)]
                elif kind.startswith("peer"):
                    tokens = [mx.argmax(m(t, cache=c)[:, -1:], axis=-1) for t, c in zip(tokens, caches)]
                    mx.eval(tokens)
                    [t.tolist() for t in tokens]      # read back, as the other paths do
                else:
                    tokens = [int(t) for t in mx.argmax(batch.decode_step(m, tokens, caches, **kinds[kind]),
                                                          axis=-1).tolist()]
            rates[kind].append(steps * streams / (time.perf_counter() - t0))
            cpu[kind].append(steps * streams / max(time.process_time() - c0, 1e-9))
            if kind != "solo" and not kind.startswith("peer"):
                paths[kind] += batch.taken - was
            sets[kind] = (caches, tokens)
    threads.for_prefill()
    for kind, (caches, _) in sets.items():
        for c in caches if not kind.startswith("peer") else ():
            c.close()
    med = {kind: statistics.median(v) for kind, v in rates.items()}
    per_cpu = {kind: statistics.median(v) for kind, v in cpu.items()}
    one, n = med["solo"], med["batched"]
    out = {"engine_one_at_a_time_tok_s": round(one, 1), "engine_batched_tok_s": round(n, 1),
           "engine_ratio": round(n / one, 2),
           "engine_one_at_a_time_tok_per_cpu_s": round(per_cpu["solo"], 1),
           "engine_batched_tok_per_cpu_s": round(per_cpu["batched"], 1),
           "engine_cpu_ratio": round(per_cpu["batched"] / per_cpu["solo"], 2),
           "engine_prompt_tokens": [len(p) for p in prompts],
           "engine_peer_one_at_a_time_tok_s": round(med["peer_solo"], 1),
           "engine_peer_batched_tok_s": round(med["peer_batched"], 1),
           "engine_peer_ratio": round(med["peer_batched"] / med["peer_solo"], 2),
           "engine_peer_cpu_ratio": round(per_cpu["peer_batched"] / per_cpu["peer_solo"], 2),
           "engine_peer_prompt_tokens": cut,
           "engine_batched_paths": dict(paths["batched"])}
    if vs:
        out.update(engine_vs_path=vs, engine_vs_tok_s=round(med["vs"], 1), engine_vs_ratio=round(med["vs"] / one, 2),
                   engine_vs_tok_per_cpu_s=round(per_cpu["vs"], 1),
                   engine_vs_cpu_ratio=round(per_cpu["vs"] / per_cpu["solo"], 2), engine_vs_paths=dict(paths["vs"]))
    return out


def worker_part(model_path: str, config: CacheConfig, streams: int, tokens: int, rounds: int) -> dict:
    """The server's worker without HTTP, in this process (`--only worker`): the prompts each alone,
    one after the other, against all at once, `rounds` rounds alternating (the order swapped every
    other round), greedy, `tokens` tokens each; tokens/s by the wall clock and per CPU-second of
    this process (every thread: the worker's, MLX's, OpenBLAS's; the main thread only polls), and
    the engine part's model calls in the same process beside it (`engine`). What the scheduler
    costs apart from HTTP, the event loop and the client."""
    from tinygpt_mlx.server import batch
    from tinygpt_mlx.server.slots import SlotPool
    from tinygpt_mlx.server.worker import Job, Worker

    loaded = _loaded(model_path)
    tok = loaded.tokenizer
    w = Worker(loaded, SlotPool(loaded.model, config, max_slots=streams), 512, parallel=streams)
    prompts = [tok.encode(p) for p in PROMPTS[:streams]]

    def run(batch_of: list) -> tuple[int, float, float, list]:
        got = [[] for _ in batch_of]
        jobs = []
        for ids, g in zip(batch_of, got):
            job = Job(list(ids), tokens, temperature=0)
            job.emit = lambda kind, payload, g=g: g.append((kind, payload))
            jobs.append(job)
        t0, c0 = time.perf_counter(), time.process_time()
        for job in jobs:
            w.submit(job)
        while not all(g and g[-1][0] in ("done", "error") for g in got):
            time.sleep(0.002)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if any(g[-1][0] == "error" for g in got):
            raise RuntimeError(next(g[-1][1] for g in got if g[-1][0] == "error"))
        return sum(len(g[-1][1].tokens) for g in got), wall, cpu, [g[-1][1].tokens for g in got]

    solo, together, solo_cpu, together_cpu, same = [], [], [], [], True
    paths = collections.Counter()      # how the together runs' batched steps ran (batch.taken)
    try:
        run(prompts)                                   # warm-up: the traces, the slots
        for r in range(rounds):
            for kind in (("solo", "together") if r % 2 == 0 else ("together", "solo")):
                if kind == "solo":
                    outs = [run([p]) for p in prompts]
                    n, wall, cpu = sum(o[0] for o in outs), sum(o[1] for o in outs), sum(o[2] for o in outs)
                    alone = [o[3][0] for o in outs]
                    solo.append(n / wall)
                    solo_cpu.append(n / cpu)
                else:
                    taken, stepped = batch.taken.copy(), w.batched_steps
                    n, wall, cpu, texts = run(prompts)
                    paths.update(batch.taken - taken)
                    paths["batched_steps"] += w.batched_steps - stepped
                    together.append(n / wall)
                    together_cpu.append(n / cpu)
            same = same and texts == alone
    finally:
        w.stop()
    one, four = statistics.median(solo), statistics.median(together)
    return {"worker_one_at_a_time_tok_s": round(one, 1), "worker_together_tok_s": round(four, 1),
            "worker_ratio": round(four / one, 2), "worker_solo_samples": [round(x, 1) for x in solo],
            "worker_together_samples": [round(x, 1) for x in together],
            "worker_cpu_ratio": round(statistics.median(together_cpu) / statistics.median(solo_cpu), 2),
            "worker_one_at_a_time_tok_per_cpu_s": round(statistics.median(solo_cpu), 1),
            "worker_together_tok_per_cpu_s": round(statistics.median(together_cpu), 1),
            "worker_same_tokens": same,
            # the together runs' batched steps (`batched_steps`: those of several rows) and how they
            # ran (batch.taken: compiled, compiled_kivi, ...; the rest eager)
            "worker_together_paths": dict(paths)}


_LOADED: dict = {}


def _loaded(path: str):
    if path not in _LOADED:
        _LOADED[path] = load(path)
    return _LOADED[path]


def ttft(url: str, model: str, long_tokens: int, short_tokens: int, repeats: int) -> dict:
    # each sample its own prompt, differing from its first token on: none reuses another's slot
    short = [f"{i} {PROMPTS[-1]}" for i in range(2 * repeats)]
    idle = [generate(url, model, short[i], short_tokens)["ttft_s"] for i in range(repeats)]
    started, stop, out = threading.Event(), threading.Event(), {}

    def long_answer():
        out["long"] = generate(url, model, PROMPTS[-2], long_tokens, on_first=started.set, stop=stop)

    th = threading.Thread(target=long_answer)
    th.start()
    started.wait(600)
    busy = []
    for i in range(repeats):
        r = generate(url, model, short[repeats + i], short_tokens)
        if not th.is_alive():
            break                      # the long answer ended: this one was not measured under load
        busy.append(r["ttft_s"])
    stop.set()
    th.join()
    i, b = statistics.median(idle), statistics.median(busy) if busy else float("nan")
    return {"idle_ttft_ms": round(1000 * i, 1), "busy_ttft_ms": round(1000 * b, 1), "ratio": round(b / i, 2),
            "busy_samples": len(busy), "idle_samples_ms": [round(1000 * x, 1) for x in idle],
            "busy_samples_ms": [round(1000 * x, 1) for x in busy]}


def serve(model: str, label: str, window: int, streams: int, port: int) -> None:
    """The server process: `label`'s policy, --parallel `streams`, on 127.0.0.1:`port`; glibc's
    heap kept for MLX's large temporaries as `posttrainllm serve` keeps it (tinygpt_mlx/heap.py;
    POSTTRAINLLM_NO_HEAP_TUNE=1 runs it without, to compare)."""
    from tinygpt_mlx import heap
    heap.keep_large_blocks()
    import uvicorn
    from tinygpt_mlx.server.app import create_app
    app = create_app(load(model), policies(window)[label], max_slots=streams, parallel=streams)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def spawn_server(model: str, label: str, window: int, streams: int) -> tuple[subprocess.Popen, str]:
    """The server process (`serve` above) started on a free port, and its URL; not yet answering
    (bench_server_load waits for it with its own --start-timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_server_parallel", model, "--serve", label,
                             "--window", str(window), "--streams", str(streams), "--port", str(port)])
    return proc, f"http://127.0.0.1:{port}"


def start_server(model: str, label: str, window: int, streams: int) -> tuple[subprocess.Popen, str]:
    proc, url = spawn_server(model, label, window, streams)
    deadline = time.time() + 300
    while True:
        try:
            httpx.get(url + "/api/version", timeout=2)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the server for {label} did not start") from None
            time.sleep(0.2)


def server_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="TTFT samples, idle and busy")
    ap.add_argument("--rounds", type=int, default=3, help="concurrent runs (and solo runs) per policy")
    ap.add_argument("--window", type=int, default=128, help="StreamingLLM window and retrieval hot budget")
    ap.add_argument("--policies", default=None, help="comma-separated labels to run (default: the issue's four: full, int4, sink4/windowW, "
                         "retrieval sink4/hotW; also int4 sink4/windowW)")
    ap.add_argument("--engine-steps", type=int, default=32, help="decode steps per round of the engine-only part")
    ap.add_argument("--only", choices=("throughput", "ttft", "engine", "worker"),
                    help="run one part (default: throughput and TTFT, each with the engine-only part); engine: "
                         "only the engine-only part, no server; worker: the server's worker in this process "
                         "without HTTP (--tokens each, --rounds rounds), with the engine-only part")
    ap.add_argument("--engine-path", choices=list(PATHS), default="compiled",
                    help="the engine-only part's batched step: compiled where the caches allow it, then attention "
                         "stacked across sequences (the server's, default); compiled-steady: the compiled step as it "
                         "ran before 2026-12-05 15:00 (no window still filling compiled, each row attending on its own "
                         "in the trace); stacked: never compiled; per-sequence: each sequence's own attention (the "
                         "path before attention was batched)")
    ap.add_argument("--engine-vs", choices=list(PATHS),
                    help="the engine-only part also times the batched step on this path, in the same rounds "
                         "(ratios in one run)")
    ap.add_argument("--engine-prompt-tokens", type=int, default=0,
                    help="the engine-only part's prompts, each repeated to at least this many tokens (default 0: "
                         "as they are; past a window or hot budget the steps start in its steady state)")
    ap.add_argument("--engine-blas-threads", type=int, default=1,
                    help="OpenBLAS threads for the engine-only part's decode steps (default 1, as the server "
                         "runs them; 0: OpenBLAS's own count)")
    ap.add_argument("--mixed-evictions", action="store_true",
                    help="the batched retrieval step as before 2026-12-06 (session 40): rows that evict in the "
                         "trace beside rows that evicted ahead, a layout per mix (server/batch.py ONE_EVICTION_KIND "
                         "and SCRATCH_EVICTIONS False); the in-process parts only (--only worker or engine), for an "
                         "A/B in one process kind")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--serve", metavar="POLICY", help=argparse.SUPPRESS)   # the server process
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.model, args.serve, args.window, args.streams, args.port)
        return
    at_least(ap, ("--streams", args.streams, 2), ("--tokens", args.tokens, 2),
             ("--long-tokens", args.long_tokens, 16), ("--short-tokens", args.short_tokens, 1),
             ("--repeats", args.repeats, 1), ("--rounds", args.rounds, 1), ("--engine-steps", args.engine_steps, 1),
             ("--window", args.window, 8), ("--engine-blas-threads", args.engine_blas_threads, 0),
             ("--engine-prompt-tokens", args.engine_prompt_tokens, 0))
    if args.mixed_evictions:
        if args.only not in ("worker", "engine"):
            ap.error("--mixed-evictions applies to the in-process parts only: use it with --only worker or --only engine")
        from tinygpt_mlx.server import batch
        batch.ONE_EVICTION_KIND = batch.SCRATCH_EVICTIONS = False
    if args.streams > len(PROMPTS) - 2:
        ap.error(f"--streams must be at most {len(PROMPTS) - 2}, got {args.streams}")
    if not Path(args.model).expanduser().exists():
        ap.error(f"model {args.model}: no such file or directory")
    table = policies(args.window)
    chosen = list(table)[:DEFAULT_POLICIES] if args.policies is None else [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in chosen if p not in table]
    if unknown:
        ap.error(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(table)}")
    name = Path(args.model).stem
    threads = blas.Threads()
    results = {"model": name, "streams": args.streams, "tokens": args.tokens, "command": " ".join(sys.argv),
               "openblas_threads": threads.default if threads.available else None,
               "engine_path": args.engine_path, "engine_vs": args.engine_vs,
               "engine_prompt_tokens": args.engine_prompt_tokens, "mixed_evictions": args.mixed_evictions,
               "engine_decode_openblas_threads": (args.engine_blas_threads or threads.default) if threads.available
               else None,
               "load_average_at_start": list(os.getloadavg()), "rows": []}
    print(f"model {name}: {args.streams} streams x {args.tokens} tokens vs one; TTFT of a {args.short_tokens}-"
          f"token request during a {args.long_tokens}-token answer vs idle")
    for label in chosen:
        before = list(os.getloadavg())
        eng = {} if args.only == "ttft" else engine(args.model, table[label], args.streams, args.engine_steps,
                                                    2 * args.rounds, args.engine_blas_threads, args.engine_path,
                                                    args.engine_vs, args.engine_prompt_tokens)
        row = {"policy": label}
        if args.only == "worker":
            row.update(worker_part(args.model, table[label], args.streams, args.tokens, 2 * args.rounds), **eng,
                       load_average_before=before, load_average_after=list(os.getloadavg()))
            results["rows"].append(row)
            print(f"{label:<24} worker without HTTP: one at a time {row['worker_one_at_a_time_tok_s']:.1f} tok/s, "
                  f"{args.streams} at once {row['worker_together_tok_s']:.1f} tok/s, x{row['worker_ratio']:.2f} "
                  f"(per CPU-s x{row['worker_cpu_ratio']:.2f}), same tokens {row['worker_same_tokens']}  | engine "
                  f"x{eng['engine_ratio']:.2f} (per CPU-s x{eng['engine_cpu_ratio']:.2f}); mlx-lm's KVCache "
                  f"x{eng['engine_peer_ratio']:.2f}  | load average {before[0]:.1f} -> {row['load_average_after'][0]:.1f}",
                  flush=True)
            continue
        if args.only == "engine":
            row.update(eng, load_average_before=before, load_average_after=list(os.getloadavg()))
            results["rows"].append(row)
            vs = (f"; {eng['engine_vs_path']} {eng['engine_vs_tok_s']:.1f} tok/s, x{eng['engine_vs_ratio']:.2f} "
                  f"(per CPU-s x{eng['engine_vs_cpu_ratio']:.2f})") if "engine_vs_path" in eng else ""
            print(f"{label:<24} engine only: one call each {eng['engine_one_at_a_time_tok_s']:.1f} tok/s, batched "
                  f"{eng['engine_batched_tok_s']:.1f} tok/s, x{eng['engine_ratio']:.2f} (per CPU-s "
                  f"x{eng['engine_cpu_ratio']:.2f}){vs}; mlx-lm's KVCache x{eng['engine_peer_ratio']:.2f}  | load average "
                  f"{before[0]:.1f} -> {row['load_average_after'][0]:.1f}", flush=True)
            continue
        proc, url = start_server(args.model, label, args.window, args.streams)
        try:
            model = httpx.get(url + "/api/tags").json()["models"][0]["model"]
            if args.only != "ttft":
                row.update(throughput(url, model, args.streams, args.tokens, args.rounds, proc.pid))
            if args.only != "throughput":
                row["ttft"] = ttft(url, model, args.long_tokens, args.short_tokens, args.repeats)
            row["server_rss_mib"] = server_rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        row.update(eng, load_average_before=before, load_average_after=list(os.getloadavg()))
        results["rows"].append(row)
        line = f"{label:<24}"
        if "ratio" in row:
            line += (f" one {row['one_stream_tok_s']:7.1f} tok/s  {args.streams} streams {row['n_streams_tok_s']:7.1f} "
                     f"tok/s  x{row['ratio']:.2f} (per CPU-s x{row['cpu_ratio']:.2f})  same text {all(row['same_text'])}"
                     f"  | engine only: one call each {eng['engine_one_at_a_time_tok_s']:.1f} tok/s, batched "
                     f"{eng['engine_batched_tok_s']:.1f} tok/s, x{eng['engine_ratio']:.2f}; mlx-lm's KVCache "
                     f"x{eng['engine_peer_ratio']:.2f}")
        if "ttft" in row:
            t = row["ttft"]
            line += (f"  | TTFT idle {t['idle_ttft_ms']:.0f} ms, during a long answer {t['busy_ttft_ms']:.0f} ms "
                     f"(x{t['ratio']:.2f}, {t['busy_samples']} samples)")
        print(line + f"  | server RSS {row['server_rss_mib']} MiB  | load average {before[0]:.1f} -> {row['load_average_after'][0]:.1f}", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
