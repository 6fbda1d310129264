"""A load run against `serve` (issue #56): rounds of --requests streamed requests from --clients
client threads, about --cancel of them abandoned mid-stream, against a server in its own process
(`--parallel` 4); after each round the server's resident memory (VmRSS) and its compiled steps'
traces (made so far, and held: /api/slots `compiled`, with MLX's memory) and glibc's heap
(/api/slots `heap_mib`: obtained, in use, free). Every reply that was not
abandoned must end with a final line (done_reason stop or length) and no error line; the first
round is the warm-up, and the RSS after the later rounds is compared with it.

  python -m benchmarks.bench_server_load models/tinygpt-base.tinygpt --json docs/results/server_load.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
from pathlib import Path

import httpx

from benchmarks.bench_server_parallel import PROMPTS, policies, server_rss_mib, start_server
from tinygpt_mlx.cli.common import write_atomic


def ask(url: str, model: str, prompt: str, tokens: int, cancel_after) -> str:
    """One streamed request: "complete", "cancelled" (left after `cancel_after` lines) or an error."""
    body = {"model": model, "prompt": prompt, "raw": True, "options": {"temperature": 0.7, "num_predict": tokens}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=600) as r:
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
    return "no final line"


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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for name, value, least in (("--requests", args.requests, 1), ("--clients", args.clients, 1),
                               ("--rounds", args.rounds, 2), ("--tokens", args.tokens, 1)):
        if value < least:
            ap.error(f"{name} must be at least {least}, got {value}")
    if not 0 <= args.cancel <= 1:
        ap.error(f"--cancel must be between 0 and 1, got {args.cancel}")
    if not Path(args.model).expanduser().exists():
        ap.error(f"model {args.model}: no such file or directory")
    if args.policy not in policies(args.window):
        ap.error(f"--policy: unknown {args.policy}; known: {', '.join(policies(args.window))}")
    proc, url = start_server(args.model, args.policy, args.window, 4)
    rng = random.Random(0)
    out = {"command": " ".join(sys.argv), "rounds": []}
    try:
        model = httpx.get(url + "/api/tags").json()["models"][0]["model"]
        for k in range(args.rounds):
            plan = [(rng.choice(PROMPTS), rng.randrange(1, 16) if rng.random() < args.cancel else None)
                    for _ in range(args.requests)]
            with concurrent.futures.ThreadPoolExecutor(args.clients) as ex:
                got = list(ex.map(lambda p: ask(url, model, p[0], args.tokens, p[1]), plan))
            counts = {x: got.count(x) for x in sorted(set(got))}
            state = httpx.get(url + "/api/slots").json()
            row = {"round": k, "outcomes": counts, "server_rss_mib": server_rss_mib(proc.pid),
                   "batched_steps": state["batched_steps"], "queued_after": state["queued"], "busy_after": state["busy"],
                   "compiled": state["compiled"], "heap_mib": state.get("heap_mib")}
            out["rounds"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    bad = [r for r in out["rounds"] if set(r["outcomes"]) - {"complete", "cancelled"}]
    warm = out["rounds"][0]["server_rss_mib"]
    print(f"{'errors in ' + str(len(bad)) + ' round(s)' if bad else 'no error'}; RSS after the warm-up {warm} MiB, "
          f"after the later rounds {', '.join(str(r['server_rss_mib']) for r in out['rounds'][1:])} MiB")
    if args.json:
        write_atomic(args.json, json.dumps(out, indent=1) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
