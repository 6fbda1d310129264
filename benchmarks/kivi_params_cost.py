"""What KIVI's float16 scales and zeros cost in speed on this backend, and how MLX's quantised
matmul compares with a dense one (docs/kivi.md, docs/results.md):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python -m benchmarks.kivi_params_cost --context 8192

(1) one decode step on the shipped model after `--context` tokens, median of interleaved steps:
int4 with float16 parameters (the default), int4 with float32 parameters, and the fp32 cache;
(2) q.K alone for one decode step of one layer (4 KV heads x 2 queries, head dim 32, the
context's keys): `mx.quantized_matmul` with float16 and float32 parameters, and a dense fp32
matmul. Prints milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from benchmarks._timing import ms_per_call
from tinygpt_mlx.cache import make_cache, packed as packed_runs
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward
from tinygpt_mlx.loading import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=150, help="decode steps timed; the first 10 are warm-up")
    a = ap.parse_args()
    if a.steps <= 10:
        ap.error(f"--steps {a.steps}: the first 10 steps are warm-up, give more than 10")
    model = load(None).model
    ids = [1 + i % 4000 for i in range(a.context)]
    caches = {}
    for name, params in (("int4, fp16 params", mx.float16), ("int4, fp32 params", mx.float32), ("fp32 cache", None)):
        packed_runs.PARAMS = params or mx.float32
        cache = make_cache(model, CacheConfig() if params is None else CacheConfig.from_flags("int4"))
        for i in range(0, a.context, 512):
            mx.eval(forward(model, mx.array([ids[i:i + 512]]), cache))
        caches[name] = cache
    packed_runs.PARAMS = mx.float16
    token, times = mx.array([[5]]), {name: [] for name in caches}
    for _ in range(a.steps):
        for name, cache in caches.items():
            t = time.perf_counter()
            mx.eval(forward(model, token, cache))
            times[name].append(time.perf_counter() - t)
    print(f"decode step after {a.context} tokens, median of {a.steps} interleaved steps:")
    for name, ts in times.items():
        print(f"  {name:18s} {1e3 * statistics.median(ts[10:]):.3f} ms")
    T = a.context
    keys = mx.random.normal((1, 4, 32, T), key=mx.random.key(0))
    q = mx.random.normal((1, 4, 2, 32), key=mx.random.key(1))
    packed, scale, zero = mx.quantize(keys, group_size=32, bits=4)
    s16, z16 = scale.astype(mx.float16), zero.astype(mx.float16)
    mx.eval(packed, scale, zero, s16, z16)
    print(f"q.K of one layer over {T} keys (4 KV heads x 2 queries, head dim 32):")
    print(f"  quantized_matmul, fp16 params  {ms_per_call(lambda: mx.quantized_matmul(q, packed, s16, z16, transpose=False, group_size=32, bits=4), 50):.3f} ms")
    print(f"  quantized_matmul, fp32 params  {ms_per_call(lambda: mx.quantized_matmul(q, packed, scale, zero, transpose=False, group_size=32, bits=4), 50):.3f} ms")
    print(f"  dense fp32 matmul              {ms_per_call(lambda: q @ keys, 50):.3f} ms")


if __name__ == "__main__":
    main()
