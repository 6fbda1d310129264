"""Where one layer's attention of a retrieval prefill chunk goes, piece by piece, beside
StreamingLLM's whole attention at the same hot window (issue 53's prefill target), at the shipped
model's sizes under `sink4/hot1024`: 512 queries (8 heads over 4 KV heads of dim 32), a pool of
545 pages of 8 tokens (2 x 256 top pages, the unfinished page, 32 sticky pages: 4,360 tokens),
32 pages picked per query, the sink's 4 tokens and the hot window's 1,024 + the chunk's 511.
Random keys and queries; each piece is evaluated alone on inputs evaluated before it, the pieces
interleaved round by round; the median of `--reps` rounds. glibc's thresholds are set as
`posttrainllm` sets them (tinygpt_mlx/heap.py); `--glibc-heap` leaves glibc's own.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.pool_attention_parts [--reps 7] [--glibc-heap] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx import heap
from tinygpt_mlx.cache.segments import DenseSegment, PoolSegment, attend, mask_array

B, HQ, HKV, L, D = 1, 8, 4, 512, 32
REP = HQ // HKV
UNIT, UNITS, POOL_PAGES = 8, 32, 545
U = POOL_PAGES * UNIT
WINDOW = 1024


def pieces() -> dict:
    """Named () -> array functions, every input evaluated beforehand."""
    key = mx.random.key
    q = mx.random.normal((B, HQ, L, D), key=key(0)) * D ** -0.5
    kw, vw = (mx.random.normal((B, HKV, WINDOW + L, D), key=key(i)) for i in (1, 2))
    kp, vp = (mx.random.normal((B, HKV, U, D), key=key(i)) for i in (3, 4))
    valid = mx.ones((B, HKV, U), dtype=mx.bool_)
    sink, body = DenseSegment(kw[:, :, :4], vw[:, :, :4]), DenseSegment(kw[:, :, 4:], vw[:, :, 4:])
    qq = q.reshape(B, HKV, REP, L, D)
    pool = PoolSegment(kp, vp, valid, UNITS, UNIT)
    scores = [pool.scores(qq), sink.scores(qq), body.scores(qq)]
    joined = mx.concatenate(scores, axis=-1)
    n_picked = scores[0].shape[-1]
    mask = mask_array("causal", L, joined.shape[-1], n_picked)
    masked = mx.where(mask, joined, -mx.inf)
    probs = mx.softmax(masked, axis=-1)
    p_pool, p_body = probs[..., :n_picked], probs[..., n_picked + 4:]
    raw = (qq.reshape(B, HKV, REP * L, D) @ kp.swapaxes(-1, -2)).reshape(B, HKV, REP, L, U)
    best = mx.maximum(raw[:, :, 0], raw[:, :, 1])
    per_page = best.reshape(B, HKV, L, POOL_PAGES, UNIT).max(axis=-1)
    window_mask = mask_array("causal", L, WINDOW + L, 0)
    mx.eval(q, kw, vw, kp, vp, valid, scores, joined, mask, masked, probs, p_pool, p_body, raw, best, per_page,
            window_mask, pool.picked, pool.top)
    return {
        "StreamingLLM: fused attention over sink + window + chunk": lambda: mx.fast.scaled_dot_product_attention(
            q, kw, vw, scale=1.0, mask=window_mask),
        "retrieval: the whole attention": lambda: attend(
            [PoolSegment(kp, vp, valid, UNITS, UNIT), sink, body], 1, q * D ** 0.5, D ** -0.5, "causal"),
        "pool: scores and pick (all of PoolSegment.scores)": lambda: PoolSegment(kp, vp, valid, UNITS, UNIT).scores(qq),
        "  pool: q.k matmul": lambda: qq.reshape(B, HKV, REP * L, D) @ kp.swapaxes(-1, -2),
        "  pool: max over the query group": lambda: mx.maximum(raw[:, :, 0], raw[:, :, 1]),
        "  pool: max per page": lambda: best.reshape(B, HKV, L, POOL_PAGES, UNIT).max(axis=-1),
        "  pool: argpartition of the pages": lambda: mx.argpartition(-per_page, UNITS - 1, axis=-1)[..., :UNITS],
        "sink and window scores": lambda: (sink.scores(qq), body.scores(qq)),
        "scores joined": lambda: mx.concatenate(scores, axis=-1),
        "mask applied": lambda: mx.where(mask, joined, -mx.inf),
        "softmax (picked + sink + window)": lambda: mx.softmax(masked, axis=-1),
        "pool output (PoolSegment.output)": lambda: pool.output(p_pool),
        "window output": lambda: body.output(p_body),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="rounds (each times every piece once)")
    ap.add_argument("--glibc-heap", action="store_true", help="leave glibc's mmap and trim thresholds as they are")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    kept = False if a.glibc_heap else heap.keep_large_blocks()
    from tinygpt_mlx.cli.common import write_atomic

    fns = pieces()
    for f in fns.values():      # warm-up
        mx.eval(f())
    times: dict = {name: [] for name in fns}
    for _ in range(a.reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            mx.eval(f())
            times[name].append(time.perf_counter() - t0)
    rows = [{"piece": name, "ms": round(statistics.median(ts) * 1e3, 2)} for name, ts in times.items()]
    for r in rows:
        print(f"{r['piece']:58s} {r['ms']:8.1f} ms", flush=True)
    if a.json is not None:
        write_atomic(a.json, json.dumps({"reps": a.reps, "load": os.getloadavg(), "pool_tokens": U, "heap_kept": kept,
                                         "rows": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
