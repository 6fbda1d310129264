"""What single MLX ops cost per element on this backend, at the sizes of retrieval's attention
over its pool (docs/retrieval.md): exp, softmax, argpartition (and numpy's partition beside it),
and the pool's q.k matmul. Shapes: 1 batch x 4 KV heads x 2 queries per head x 128 queries of a
prefill chunk x 1,032 pool tokens.

    python -m benchmarks.bench_attention_ops [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from benchmarks._timing import ms_per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    B, H, rep, L, U, D, T = 1, 4, 2, 128, 1032, 32, 64
    q = mx.random.normal((B, H, rep * L, D), key=mx.random.key(0))
    k = mx.random.normal((B, H, U, D), key=mx.random.key(1))
    s = (q @ k.swapaxes(-1, -2)).reshape(B, H, rep, L, U)
    pick = s.max(axis=2)
    mx.eval(s, pick)
    rows = {
        f"q.k matmul [{B},{H},{rep * L},{D}] x [{U},{D}]": (ms_per_call(lambda: q @ k.swapaxes(-1, -2), a.reps), s.size),
        f"mx.exp over {s.size:,} fp32": (ms_per_call(lambda: mx.exp(s), a.reps), s.size),
        f"mx.softmax over {s.size:,} fp32": (ms_per_call(lambda: mx.softmax(s, axis=-1), a.reps), s.size),
        f"mx.argpartition top {T} of {U}, {pick.size:,} fp32": (
            ms_per_call(lambda: mx.argpartition(pick, U - T, axis=-1), a.reps), pick.size),
    }
    p = np.asarray(pick)
    t0 = time.perf_counter()
    for _ in range(a.reps):
        np.argpartition(p, U - T, axis=-1)
    rows[f"np.argpartition, the same {p.size:,}"] = ((time.perf_counter() - t0) / a.reps * 1e3, p.size)
    for name, (ms, n) in rows.items():
        print(f"{name:55s} {ms:8.3f} ms  {ms * 1e6 / n:6.2f} ns/element")


if __name__ == "__main__":
    main()
