"""Decode-style attention timing: quantised vs dequantise+dense vs dense fp32.

One query token (B=1, H=4, D=64, float32) attends to T stored tokens:
  (a) quantised_matmul on packed K^T + softmax + quantised_matmul on packed V
  (b) dequantise_k / dequantise_v, then dense matmuls
  (c) dense fp32 matmuls (baseline)
Not a test.  Usage: python -m benchmarks.bench_quant_matmul [--bits 4] [--group 64]
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from benchmarks._timing import ms_per_call
from tinygpt_mlx.quant import (
    dequantise_k,
    dequantise_v,
    quantise_k,
    quantise_v,
    quantised_matmul,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    args = ap.parse_args()
    bits, group = args.bits, args.group
    B, H, D = 1, 4, 64
    scale = D ** -0.5
    print(f"device={mx.default_device()} bits={bits} group={group} B={B} H={H} D={D} fp32")
    print(f"{'T':>7} {'(a) qmm ms':>11} {'(b) deq+mm ms':>14} {'(c) dense ms':>13} "
          f"{'a/c':>6} {'b/c':>6} {'a/b':>6} {'max|a-b|':>9}")
    for T in args.lengths:
        mx.random.seed(0)
        q = mx.random.normal((B, H, 1, D))
        k = mx.random.normal((B, H, T, D))
        v = mx.random.normal((B, H, T, D))
        kp, ks, kz = quantise_k(k, bits, group)
        vp, vs, vz = quantise_v(v, bits, group)
        mx.eval(q, k, v, kp, ks, kz, vp, vs, vz)

        def qattn():
            s = quantised_matmul(q * scale, kp, ks, kz, bits=bits, group=group)
            p = mx.softmax(s, axis=-1, precise=True)
            return quantised_matmul(p, vp, vs, vz, bits=bits, group=group)

        def deq_attn():
            kk = dequantise_k(kp, ks, kz, bits, group)
            vv = dequantise_v(vp, vs, vz, bits, group)
            p = mx.softmax((q * scale) @ mx.swapaxes(kk, -1, -2), axis=-1, precise=True)
            return p @ vv

        def dense():
            p = mx.softmax((q * scale) @ mx.swapaxes(k, -1, -2), axis=-1, precise=True)
            return p @ v

        reps = max(5, min(200, 200_000 // T))
        ta, tb, tc = (ms_per_call(f, reps, warmup=3) for f in (qattn, deq_attn, dense))
        diff = mx.abs(qattn() - deq_attn()).max().item()
        print(f"{T:>7} {ta:>11.3f} {tb:>14.3f} {tc:>13.3f} "
              f"{ta / tc:>6.2f} {tb / tc:>6.2f} {ta / tb:>6.2f} {diff:>9.1e}")


if __name__ == "__main__":
    main()
