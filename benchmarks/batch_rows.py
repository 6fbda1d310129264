"""What one more row costs serve's batched decode step (issue #56): the server's batched step
(server/batch.py `decode_step`, greedy tokens from its own evaluation, as the worker calls it) of
1 to --rows rows against the lone step a request alone runs (the worker's one-row path:
generate.call, its argmax evaluated with it), per policy, at one state of the caches.

Each round makes --rows caches of the policy, prefills bench_server_parallel's prompts (one
each), runs --warm batched steps of all rows (the state measured: past a window or hot budget the
steady state) and then times --steps steps of one case: the lone steps (each cache in turn, --steps
each), or the batched step of the first n rows. The cases are shuffled every round; per case the
median over --rounds rounds (after one not counted: the traces) of the CPU time of this process and the wall time, per step (a lone
step: per token). From them: a row's marginal cost in the batched step (the slope from 1 to
--rows rows), and the ratio batching gives at --rows rows, n x lone / batched, by CPU time and by
the wall clock. --warm-slot first grows every cache's buffers as a warm slot's (a long request
prefilled, then trimmed back to the prompt: the buffers keep their capacity), for the caches that
can be trimmed (full).

--nodes also counts the graph nodes of one step (evaluate/opcount.py: what evaluating the step's
logits runs; a compiled step's outputs carry its replayed trace, so these are the trace's nodes,
after `mx.compile` merged and fused what it could): the lone step's (generate.forward) and the
batched step's of 1 to --rows rows, means over 4 steps each at the measured state, and a row's
marginal nodes (the slope from 1 to --rows rows). It runs first, not timed. To count a tree
without the flag, run this file in it (its package on the path: `cd TREE && python -m
benchmarks.batch_rows` after copying the file there).

On one OpenBLAS thread, as `serve` runs its decode steps (blas.Threads).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python -m benchmarks.batch_rows \\
      models/tinygpt-base.tinygpt --policies "retrieval sink4/hot128" --warm 180 \\
      --json docs/results/batch_rows_tinygpt_base.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx

from benchmarks._args import at_least
from benchmarks.bench_server_parallel import PROMPTS, policies
from tinygpt_mlx import blas
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.evaluate.opcount import graph_ops, summary
from tinygpt_mlx.generate import call, forward, prefill
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch


def setup(loaded, config, rows: int, warm: int, warm_slot: int) -> tuple[list, list[int]]:
    """`rows` caches of `config`, each a prompt prefilled (where the cache can be trimmed, first
    with `warm_slot` more tokens, trimmed away again with the prompt's last token, which is then
    fed: a warm slot rolled back), then `warm` batched steps; (the caches, their next tokens)."""
    m, tok = loaded.model, loaded.tokenizer
    caches, tokens = [], []
    filler = tok.encode(" ".join(PROMPTS) * 64)[:warm_slot]
    for p in PROMPTS[:rows]:
        ids, c = tok.encode(p), make_cache(m, config)
        if warm_slot:
            prefill(m, ids + filler, c, 256)
            if c.trimmable() >= len(filler) + 1:
                c.trim(len(filler) + 1)
                ids = ids[-1:]
            else:
                c = make_cache(m, config)           # (not trimmable that far: a fresh cache)
        caches.append(c)
        tokens.append(int(mx.argmax(call(m, ids, c)).item()))
    for _ in range(warm):
        _, tokens = batch.decode_step(m, tokens, caches, argmax=True)
    return caches, tokens


def measure(loaded, config, rows: int, warm: int, steps: int, rounds: int, warm_slot: int, seed: int) -> dict:
    m = loaded.model
    cases = ["lone"] + list(range(1, rows + 1))
    got = {c: [] for c in cases}
    rng = random.Random(seed)
    threads = blas.Threads()
    for r in range(rounds + 1):         # round 0 a warm-up, not counted: the traces of every case
        order = cases[:]
        rng.shuffle(order)
        for case in order:
            caches, tokens = setup(loaded, config, rows, warm, warm_slot)
            threads.for_decode()
            t0, c0 = time.perf_counter(), time.process_time()
            if case == "lone":
                for c, t in zip(caches, tokens):
                    for _ in range(steps):
                        logits = call(m, [t], c, wait=False)
                        pick = mx.argmax(logits)
                        mx.eval(logits, pick)
                        t = pick.item()
                n = rows * steps
            else:
                cs, ts = caches[:case], tokens[:case]
                for _ in range(steps):
                    _, ts = batch.decode_step(m, ts, cs, argmax=True)
                n = steps
            if r:
                got[case].append(((time.process_time() - c0) / n * 1e3, (time.perf_counter() - t0) / n * 1e3))
            threads.for_prefill()
    cpu = {str(c): round(statistics.median(x[0] for x in v), 3) for c, v in got.items()}
    wall = {str(c): round(statistics.median(x[1] for x in v), 3) for c, v in got.items()}
    R = str(rows)
    return {"cpu_ms_per_step": cpu, "wall_ms_per_step": wall,
            "cpu_ms_per_step_samples": {str(c): [round(x[0], 3) for x in v] for c, v in got.items()},
            "marginal_row_cpu_ms": round((cpu[R] - cpu["1"]) / (rows - 1), 3),
            "ratio_cpu": round(rows * cpu["lone"] / cpu[R], 2), "ratio_wall": round(rows * wall["lone"] / wall[R], 2)}


def nodes(loaded, config, rows: int, warm: int, warm_slot: int, steps: int = 4) -> dict:
    """Graph nodes of one step (`summary` of `graph_ops`, means over `steps` steps): the lone
    step's (the first cache alone, `forward`) and the batched step's of 1 to `rows` rows (the
    compiled one where the rows allow it, else the eager batched call), each from a fresh
    `setup`; and a row's marginal nodes from 1 to `rows` rows."""
    m = loaded.model
    out = {}
    for case in ["lone"] + list(range(1, rows + 1)):
        caches, tokens = setup(loaded, config, rows, warm, warm_slot)
        cs, ts = (caches[:1], tokens[:1]) if case == "lone" else (caches[:case], tokens[:case])
        total: Counter = Counter()
        for _ in range(steps):
            ids = mx.array(ts, dtype=mx.int32)[:, None]
            if case == "lone":
                logits = forward(m, ids, cs[0])
            else:
                logits = batch.compiled_decode(m, ids, cs)
                if logits is None:
                    logits = m(ids, cache=batch.batch_layers(cs))
            total += graph_ops(logits)
            best = mx.argmax(logits[:, -1], axis=-1)
            mx.eval(logits, best)
            ts = best.tolist()
        s = summary(total)
        out[str(case)] = {"nodes": s["ops"] / steps, "kernels": s["kernels"] / steps,
                          "by_primitive": {p: n / steps for p, n in s["by_primitive"].items()}}
    R = str(rows)
    return {"per_step": out, "marginal_row_nodes": round((out[R]["nodes"] - out["1"]["nodes"]) / (rows - 1), 1)}


def chosen_policies(ap: argparse.ArgumentParser, spec: str, model: str) -> tuple[dict, list[str]]:
    """bench_server_parallel's policies (window 128) and the labels `spec` names, after
    checking them and that `model` exists (an `ap.error` line naming what was typed)."""
    table = policies(128)
    chosen = [p.strip() for p in spec.split(",")]
    unknown = [p for p in chosen if p not in table]
    if unknown or not chosen:
        ap.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(table)}")
    if not Path(model).expanduser().exists():
        ap.error(f"model {model}: no such file or directory")
    return table, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--policies", default="full,retrieval sink4/hot128",
                    help="comma-separated labels of bench_server_parallel's policies (--window 128)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--warm", type=int, default=0, help="batched steps of all rows before the timed ones")
    ap.add_argument("--warm-slot", type=int, default=0,
                    help="tokens prefilled after each prompt and trimmed away again, as a warm slot's (full cache)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="the rounds' shuffles")
    ap.add_argument("--nodes", action="store_true", help="also count each step's graph nodes (not timed)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    at_least(ap, ("--rows", args.rows, 2), ("--warm", args.warm, 0), ("--warm-slot", args.warm_slot, 0),
             ("--steps", args.steps, 1), ("--rounds", args.rounds, 1))
    if args.rows > len(PROMPTS):
        ap.error(f"--rows must be at most {len(PROMPTS)}, got {args.rows}")
    table, chosen = chosen_policies(ap, args.policies, args.model)
    loaded = load(args.model)
    res = {"model": Path(args.model).stem, "command": " ".join(sys.argv), "rows": args.rows, "warm": args.warm,
           "warm_slot": args.warm_slot, "steps": args.steps, "rounds": args.rounds,
           "load_average_at_start": list(os.getloadavg()), "policies": {}}
    for label in chosen:
        counted = nodes(loaded, table[label], args.rows, args.warm, args.warm_slot) if args.nodes else None
        if counted:
            per = counted["per_step"]
            print(f"{label:<24} graph nodes per step: lone {per['lone']['nodes']:.0f}, batched "
                  + ", ".join(f"{n} rows {per[str(n)]['nodes']:.0f}" for n in range(1, args.rows + 1))
                  + f"; a row's marginal {counted['marginal_row_nodes']:.0f}", flush=True)
        before = batch.taken.copy()
        row = measure(loaded, table[label], args.rows, args.warm, args.steps, args.rounds, args.warm_slot, args.seed)
        row["taken"] = dict(batch.taken - before)
        if counted:
            row["graph_nodes"] = counted
        res["policies"][label] = row
        print(f"{label:<24} CPU ms per step: lone {row['cpu_ms_per_step']['lone']:.2f}, batched "
              + ", ".join(f"{n} rows {row['cpu_ms_per_step'][str(n)]:.2f}" for n in range(1, args.rows + 1))
              + f"; a row's marginal {row['marginal_row_cpu_ms']:.2f} ms; x{row['ratio_cpu']:.2f} per CPU, "
              f"x{row['ratio_wall']:.2f} wall  | load average {os.getloadavg()[0]:.1f}", flush=True)
    res["load_average_at_end"] = list(os.getloadavg())
    if args.json:
        write_atomic(args.json, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
