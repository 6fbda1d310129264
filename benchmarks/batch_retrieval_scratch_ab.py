"""In-process A/B of serve's batched retrieval step, steady phase: three sets of four caches (shipped model,
retrieval sink4/hot128, bench_server_parallel's prompts), each warmed by WARM batched steps; then BLOCKS
blocks, in each (order shuffled per block) STEPS batched steps of set A with SCRATCH_EVICTIONS True, STEPS of
set B with it False (session 41's rule), and STEPS lone steps of each cache of set C (the worker's one-row
path). Process CPU (and calling-thread CPU) per token; medians over blocks; ratio = 4 x lone / batched.

    python -m benchmarks.batch_retrieval_scratch_ab --blocks 20 --json OUT.json

(session 42's quiet A/B of 1b0972d, docs/server.md; OpenBLAS preloaded by the caller)."""
import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.batch_rows import setup
from benchmarks.bench_server_parallel import policies
from tinygpt_mlx import blas
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.generate import call
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tinygpt-base.tinygpt")
    ap.add_argument("--warm", type=int, default=180, help="batched steps before the timed blocks")
    ap.add_argument("--steps", type=int, default=16, help="steps per set and block")
    ap.add_argument("--blocks", type=int, default=20, help="blocks, each set once per block in shuffled order")
    ap.add_argument("--json", required=True, help="where to write the result")
    a = ap.parse_args()
    if min(a.warm, a.steps, a.blocks) < 1:
        ap.error(f"--warm, --steps and --blocks must be positive (got {a.warm}, {a.steps}, {a.blocks})")
    WARM, STEPS, BLOCKS = a.warm, a.steps, a.blocks
    loaded = load(a.model)
    m = loaded.model
    cfg = policies(128)["retrieval sink4/hot128"]
    th = blas.Threads()
    sets = {}
    for name, flag in (("scratch", True), ("one_kind", False), ("lone", True)):
        batch.SCRATCH_EVICTIONS = flag
        sets[name] = list(setup(loaded, cfg, 4, WARM, 0))
    got = {k: [] for k in sets}
    calling = {k: [] for k in sets}
    rng = random.Random(0)
    load0 = os.getloadavg()
    for _ in range(BLOCKS):
        order = list(sets)
        rng.shuffle(order)
        for name in order:
            caches, tokens = sets[name]
            batch.SCRATCH_EVICTIONS = name != "one_kind"
            th.for_decode()
            c0, t0 = time.process_time(), time.thread_time()
            if name == "lone":
                for i, c in enumerate(caches):
                    t = tokens[i]
                    for _ in range(STEPS):
                        lg = call(m, [t], c, wait=False)
                        p = mx.argmax(lg)
                        mx.eval(lg, p)
                        t = p.item()
                    tokens[i] = t
                n = 4 * STEPS
            else:
                for _ in range(STEPS):
                    _, tokens = batch.decode_step(m, tokens, caches, argmax=True)
                sets[name][1] = tokens
                n = 4 * STEPS
            got[name].append((time.process_time() - c0) / n * 1e3)
            calling[name].append((time.thread_time() - t0) / n * 1e3)
            th.for_prefill()
    med = {k: statistics.median(v) for k, v in got.items()}
    out = {"warm": WARM, "steps": STEPS, "blocks": BLOCKS, "load_start": load0, "load_end": os.getloadavg(),
           "cpu_ms_per_token_median": med, "calling_thread_ms_per_token_median": {k: statistics.median(v) for k, v in calling.items()},
           "cpu_ms_per_token": got,
           "ratio_cpu_scratch": med["lone"] / med["scratch"], "ratio_cpu_one_kind": med["lone"] / med["one_kind"],
           "same_tokens_scratch_vs_one_kind": sets["scratch"][1] == sets["one_kind"][1],
           "cold_tokens_end": [len(c.owned[0].cold) for c in sets["scratch"][0]]}
    print(json.dumps({k: v for k, v in out.items() if k != "cpu_ms_per_token"}, indent=1))
    write_atomic(Path(a.json), json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
