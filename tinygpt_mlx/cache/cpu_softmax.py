"""A softmax whose `exp` is a polynomial compiled with the rest, for MLX's x86 CPU build.

MLX's CPU `exp` (and so `mx.softmax`) is one scalar Cephes polynomial per element on x86: the
Linux wheel has no SIMD width there (`simd::max_size` 1) and each of its six polynomial steps is
a call to libm's `fmaf` (`objdump -d libmlx.so`: 221 calls to `fmaf@plt`). Measured here: 22-24
ns per element, as much as StreamingLLM's whole attention for a retrieval prefill chunk's
softmax (docs/retrieval.md, "The prefill's softmax, 2026-12-06"). `softmax_rows` computes the
same polynomial (the same Cephes constants, 2**f on f in [-1/2, 1/2], times 2**i built in the
exponent bits) with multiplies and adds that `mx.compile`'s CPU kernels (C++ built with g++
-O3) inline and vectorise: 10 ns per element for `exp`, the softmax 2.3x faster, within a few
units in the last place of `mx.softmax` (tests/test_cpu_softmax.py).

Only where it pays: on an x86 CPU, with g++ present (MLX's CPU compiler; without it
`mx.compile` runs the ops one by one), glibc's heap kept (`heap.keep_large_blocks`, as the CLI
does; `use_here`), the default device the CPU. A Mac's CPU has NEON and
its GPU fast exp, so there `mx.softmax` is kept. `POSTTRAINLLM_NO_FAST_EXP=1` turns it off.
Used by retrieval's prefill attention (segments.attend), the only softmax of ours over millions
of scores per layer that does not go through `mx.fast.scaled_dot_product_attention`.
"""

from __future__ import annotations

import platform
import shutil

import mlx.core as mx

from .. import heap, switches

#: 1.5 * 2**23: (y + MAGIC) - MAGIC is y rounded to the nearest integer (|y| < 2**22)
MAGIC = 12582912.0
LOG2E = 1.4426950408889634


def wanted() -> bool:
    """Whether this machine takes `softmax_rows` (module doc): x86, g++ on PATH, not opted out."""
    return (platform.machine().lower() in ("x86_64", "amd64") and shutil.which("g++") is not None
            and not switches.flag("POSTTRAINLLM_NO_FAST_EXP"))


#: decided once per process (module doc)
ENABLED = wanted()


def use_here() -> bool:
    """`ENABLED`, glibc's heap kept for large temporaries (`heap.KEPT`: the CLI sets it at its
    start) and the default device the CPU (a CUDA build's GPU keeps `mx.softmax`). `mx.compile`
    splits the polynomial into several kernels whose [rows, scores] intermediates a heap not kept
    maps and faults in afresh each time: a (1, 3, 3, 512, 1,795) chunk took 340-390 ms there
    against mx.softmax's 235-242 ms, 91-112 against 210-240 with the heap kept (review, s40)."""
    return ENABLED and heap.KEPT and mx.default_device().type == mx.cpu


def _mantissa_and_exponent(s: mx.array, m: mx.array) -> tuple[mx.array, mx.array]:
    """exp(s - m) for s <= m as 2**f (a polynomial, 0 below exp(-87)) and the bits of 2**i."""
    x = s - m
    y = x * LOG2E
    i = (y + MAGIC) - MAGIC
    f = y - i
    p = 1.535336188319500e-4      # (mlx/backend/cpu/simd/math.h's constants, from Cephes)
    p = p * f + 1.339887440266574e-3
    p = p * f + 9.618437357674640e-3
    p = p * f + 5.550332471162809e-2
    p = p * f + 2.402264791363012e-1
    p = p * f + 6.931472028550421e-1
    p = p * f + 1.0
    p = mx.where(x < -87.0, 0.0, p)     # (and a row's -inf: masked)
    bits = (mx.maximum(i, -126.0).astype(mx.int32) + 127) << 23
    return p, bits


_poly = mx.compile(_mantissa_and_exponent)
_times = mx.compile(lambda p, two: p * two)
_normalised = mx.compile(lambda e, z: e * (1.0 / z))


def softmax_rows(scores: mx.array) -> mx.array:
    """`mx.softmax(scores, axis=-1)` for fp32 scores (module doc). A row of only -inf gives NaN,
    as `mx.softmax` does. Other dtypes take `mx.softmax` (the constants are fp32's: MAGIC is
    inf in fp16, and bf16 cannot round y to an integer)."""
    if scores.dtype != mx.float32:
        return mx.softmax(scores, axis=-1)
    m = scores.max(axis=-1, keepdims=True)
    p, bits = _poly(scores, m)
    e = _times(p, bits.view(mx.float32))     # (a view: the bits are 2**i's float)
    return _normalised(e, e.sum(axis=-1, keepdims=True))
