"""Top-k selection for the KIVI refinement: one argpartition over every token against
`shadow.top_k_indices` (best blocks, then candidates), on decode-shaped scores
[1, Hkv, rep, 1, T] of random normals. Checks both give the same index sets. Not a test.
Usage: python -m benchmarks.bench_topk [--tokens 32768] [--k 64] [--heads 4 --rep 2]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from benchmarks._timing import ms_per_call as _ms
from tinygpt_mlx.cache.shadow import top_k_indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rep", type=int, default=2)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    scores = mx.random.normal((1, a.heads, a.rep, 1, a.tokens), key=mx.random.key(0))
    mx.eval(scores)
    full = lambda: mx.argpartition(-scores, a.k - 1, axis=-1)[..., :a.k]   # noqa: E731
    two = lambda: top_k_indices(scores, a.k, a.block)                       # noqa: E731
    same = np.array_equal(np.sort(np.array(full()), -1), np.sort(np.array(two()), -1))
    print(f"{a.heads * a.rep} query heads x {a.tokens} tokens, k={a.k}: full argpartition "
          f"{_ms(full, a.reps):.2f} ms, two-stage {_ms(two, a.reps):.2f} ms, same indices: {same}")


if __name__ == "__main__":
    main()
