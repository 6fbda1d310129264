"""serve's batched decode step of this tree against another tree's, in one process (issue #56).

Loads --before's `tinygpt_mlx/server/batch.py` beside this tree's (as module
`tinygpt_mlx.server.batch_before`, its compiled steps kept on the model under their own
attribute), the rest of the package shared: only for trees whose other modules agree with this
one's (check with `git diff BEFORE -- tinygpt_mlx ':!tinygpt_mlx/server/batch.py'`). Each round,
for each side in the order before, now, now, before, makes --rows caches of the policy with
bench_server_parallel's prompts, runs --warm batched steps (not timed), then times --steps
batched steps (`decode_step`, greedy tokens, as batch_rows times them): CPU ms of this process
and wall ms per step. Per side the median over the rounds (after one not counted: the traces),
and now / before per round, its median. Both sides' greedy tokens are checked equal.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python -m benchmarks.batch_ab \\
      models/tinygpt-base.tinygpt --before /tmp/before --policies int4,full --json OUT.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks._args import at_least
from benchmarks.batch_rows import chosen_policies, setup
from tinygpt_mlx import blas
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch


def load_before(tree: Path):
    """`tree`'s server/batch.py as module tinygpt_mlx.server.batch_before (relative imports: this
    tree's package), its compiled steps under an attribute of its own."""
    path = tree / "tinygpt_mlx" / "server" / "batch.py"
    spec = importlib.util.spec_from_file_location("tinygpt_mlx.server.batch_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod._ATTR = batch._ATTR + "_before"
    return mod


def run(loaded, config, mod, rows: int, warm: int, steps: int, threads) -> tuple[float, float, list]:
    """(CPU ms, wall ms) per batched step of `mod`'s decode_step, and the greedy tokens."""
    m = loaded.model
    caches, tokens = setup_with(mod, loaded, config, rows, warm)
    threads.for_decode()
    seen = []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _, tokens = mod.decode_step(m, tokens, caches, argmax=True)
        seen.append(tuple(tokens))
    cpu, wall = (time.process_time() - c0) / steps * 1e3, (time.perf_counter() - t0) / steps * 1e3
    mod.drop_kept()
    threads.for_prefill()
    for c in caches:
        c.close()
    return cpu, wall, seen


def setup_with(mod, loaded, config, rows, warm):
    """batch_rows.setup with `mod`'s decode_step for the warm steps."""
    real = batch.decode_step
    batch.decode_step = mod.decode_step        # (setup calls batch.decode_step)
    try:
        return setup(loaded, config, rows, warm, 0)
    finally:
        batch.decode_step = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--before", type=Path, required=True, help="the other tree (its tinygpt_mlx/server/batch.py)")
    ap.add_argument("--policies", default="int4", help="comma-separated labels of bench_server_parallel's policies")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    at_least(ap, ("--rows", args.rows, 1), ("--warm", args.warm, 0), ("--steps", args.steps, 1),
             ("--rounds", args.rounds, 1))
    if not (args.before / "tinygpt_mlx" / "server" / "batch.py").is_file():
        ap.error(f"--before {args.before}: no tinygpt_mlx/server/batch.py there")
    table, chosen = chosen_policies(ap, args.policies, args.model)
    loaded = load(args.model)
    before = load_before(args.before)
    threads = blas.Threads()
    res = {"model": Path(args.model).stem, "command": " ".join(sys.argv), "rows": args.rows, "warm": args.warm,
           "steps": args.steps, "rounds": args.rounds, "load_average_at_start": list(os.getloadavg()), "policies": {}}
    for label in chosen:
        got = {"before": [], "now": []}
        same = True
        for r in range(args.rounds + 1):
            out = {}
            for side in ("before", "now", "now", "before"):
                cpu, wall, seen = run(loaded, table[label], before if side == "before" else batch, args.rows,
                                      args.warm, args.steps, threads)
                out.setdefault(side, []).append((cpu, wall))
                same &= out.setdefault("seen", seen) == seen
            if r:
                for side in ("before", "now"):
                    got[side] += out[side]
        cpu = {s: round(statistics.median(x[0] for x in v), 3) for s, v in got.items()}
        wall = {s: round(statistics.median(x[1] for x in v), 3) for s, v in got.items()}
        ratios = [n[0] / b[0] for n, b in zip(got["now"], got["before"])]
        row = {"cpu_ms_per_step": cpu, "wall_ms_per_step": wall,
               "cpu_ms_samples": {s: [round(x[0], 3) for x in v] for s, v in got.items()},
               "now_over_before_cpu_median": round(statistics.median(ratios), 3),
               "now_faster_in": f"{sum(q < 1 for q in ratios)} of {len(ratios)}", "same_tokens": same}
        res["policies"][label] = row
        print(f"{label:<24} CPU ms per {args.rows}-row step: before {cpu['before']:.3f}, now {cpu['now']:.3f}; "
              f"now/before {row['now_over_before_cpu_median']:.3f} (faster in {row['now_faster_in']}); "
              f"same tokens {same} | load average {os.getloadavg()[0]:.1f}", flush=True)
    res["load_average_at_end"] = list(os.getloadavg())
    if args.json:
        write_atomic(args.json, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
