"""What an idle `serve` worker hands back (issue #56): the resident memory after long-prompt
requests with the worker's idle release (MLX's cache of freed buffers emptied, glibc's free heap
pages trimmed: server/worker.py `Worker._idle`) against the same without it, and what the release
costs the next request (its prefill faults its temporaries in again).

Each mode runs in a process of its own (the RSS is the process's), as `serve` runs: glibc's heap
kept for MLX's large temporaries (heap.keep_large_blocks), one worker, --requests requests one
after the other, each a prompt of --prompt-tokens tokens of its own (no warm slot reused) and
--tokens greedy tokens. After each, once the worker is idle: the RSS, MLX's memory and glibc's
heap; and each request's prefill time (its Result's prompt_eval). The modes alternate (off, on,
on, off with --repeats 2).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python -m benchmarks.idle_release \\
      ~/.cache/posttrainllm/SmolLM2-135M-Instruct.Q4_1.gguf --json docs/results/idle_release_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_server_parallel import PROMPTS, policies
from tinygpt_mlx.cli.common import write_atomic

TEXT = " ".join(PROMPTS) + " "


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def run(model: str, label: str, window: int, prompt_tokens: int, tokens: int, requests: int, release: bool) -> dict:
    from tinygpt_mlx import heap
    heap.keep_large_blocks()
    import mlx.core as mx

    from tinygpt_mlx.loading import load
    from tinygpt_mlx.server.slots import SlotPool
    from tinygpt_mlx.server.worker import Job, Worker
    if not release:           # the worker as before the release: idle, only OpenBLAS's count restored
        Worker._idle = lambda self: self.blas.for_prefill()
    loaded = load(model)
    tok = loaded.tokenizer
    w = Worker(loaded, SlotPool(loaded.model, policies(window)[label], max_slots=requests), 512, parallel=4)
    out = {"release": release, "rss_mib_loaded": round(rss_mib(), 1), "requests": []}
    try:
        for i in range(requests):
            ids = tok.encode(f"{i} " + TEXT * (prompt_tokens // 8))[:prompt_tokens]
            job, got = Job(ids, tokens, temperature=0), []
            job.emit = lambda kind, payload: got.append((kind, payload))
            w.submit(job)
            while not got or got[-1][0] not in ("done", "error"):
                time.sleep(0.01)
            if got[-1][0] == "error":
                raise RuntimeError(got[-1][1])
            r = got[-1][1]
            time.sleep(0.5)              # (the worker goes idle: its release, where on, runs now)
            out["requests"].append({"prompt_tokens": len(ids), "generated": len(r.tokens),
                                    "prefill_s": round(r.prompt_eval_ns / 1e9, 3), "rss_mib": round(rss_mib(), 1),
                                    "mlx_mib": {"active": round(mx.get_active_memory() / 2 ** 20, 1),
                                                "cache": round(mx.get_cache_memory() / 2 ** 20, 1),
                                                "peak": round(mx.get_peak_memory() / 2 ** 20, 1)},
                                    "heap_mib": heap.usage()})
    finally:
        w.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--policy", default="full", help="full, int4, sink4/windowW or retrieval sink4/hotW")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens per request")
    ap.add_argument("--requests", type=int, default=3, help="requests one after the other per mode")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each mode (alternating: off, on, on, off, ...)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--mode", choices=("on", "off"), help=argparse.SUPPRESS)     # one mode's process
    args = ap.parse_args()
    for name, value, least in (("--prompt-tokens", args.prompt_tokens, 8), ("--tokens", args.tokens, 1),
                               ("--requests", args.requests, 1), ("--repeats", args.repeats, 1),
                               ("--window", args.window, 8)):
        if value < least:
            ap.error(f"{name} must be at least {least}, got {value}")
    if args.policy not in policies(args.window):
        ap.error(f"--policy: unknown {args.policy}; known: {', '.join(policies(args.window))}")
    if not Path(args.model).expanduser().exists():
        ap.error(f"model {args.model}: no such file or directory")
    if args.mode:
        print(json.dumps(run(str(Path(args.model).expanduser()), args.policy, args.window, args.prompt_tokens,
                             args.tokens, args.requests, args.mode == "on")), flush=True)
        os._exit(0)        # (MLX's worker stream at interpreter teardown may abort the process: the result is out)
    order = []
    for k in range(args.repeats):
        order += ["off", "on"] if k % 2 == 0 else ["on", "off"]
    res = {"model": Path(args.model).stem, "command": " ".join(sys.argv), "policy": args.policy,
           "load_average_at_start": list(os.getloadavg()), "runs": []}
    for mode in order:
        cmd = [sys.executable, "-m", "benchmarks.idle_release", *sys.argv[1:], "--mode", mode]
        cmd = [c for c in cmd if not c.startswith("--json")]
        if "--json" in sys.argv:
            j = sys.argv.index("--json")
            cmd = [sys.executable, "-m", "benchmarks.idle_release", *sys.argv[1:j], *sys.argv[j + 2:], "--mode", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:      # the mode's process failed: its last line (a bad model names itself)
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            ap.error(f"the release-{mode} run failed: {last}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        got["load_average"] = list(os.getloadavg())
        res["runs"].append(got)
        print(f"release {mode:<3}: RSS loaded {got['rss_mib_loaded']} MiB, after each request "
              f"{', '.join(str(r['rss_mib']) for r in got['requests'])} MiB; prefill "
              f"{', '.join(str(r['prefill_s']) for r in got['requests'])} s  | load average {got['load_average'][0]:.1f}",
              flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
