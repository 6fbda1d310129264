"""Asymmetric affine quantisation for KIVI KV caches.

KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
KV Cache") stores keys quantised *per channel* (groups run along the token
axis, because key outliers live in a few fixed channels) and values quantised
*per token* (groups run along the channel axis).  Both use asymmetric affine
quantisation: for every group of ``group`` consecutive elements

    zero  = min(group)
    scale = max(SCALE_EPS, (max(group) - min(group)) / (q_max - q_min))
    q     = clip(round((x - zero) / scale), q_min, q_max)
    x_hat = scale * q + zero

This module is the only place in the project that rounds.  Everything here is
a pure function; cache bookkeeping lives elsewhere.

The packed codes use MLX's own affine layout, so the triple
``(packed, scale, zero)`` can be handed straight to ``mx.dequantize`` and
``mx.quantized_matmul`` (MLX computes ``w = scale * q + bias``; our ``zero`` is
that bias).  Facts verified against mlx 0.32.4:

* ``bits`` in {2, 3, 4, 5, 6, 8} are accepted by MLX, and here (``--kv-quantize`` names
  8, 4 and 2; one side may take any, e.g. 5-bit keys; 6: the near tier's ``--kv-near-bits 6``).
* ``group_size`` must be 32, 64 or 128 (16 is rejected by ``mx.quantize``).
* Codes form one little-endian bit stream along the last axis: element ``i``
  occupies bits ``[i * bits, (i + 1) * bits)`` of it, 32 to a ``uint32`` word.
  Widths that divide 32 keep an element inside a word; a 3-, 5- or 6-bit
  element may straddle two (32 codes fill 3 or 5 words, 16 codes 3).
* Scales/biases have shape ``[..., N // group]``; the dequantised dtype follows
  the scale dtype.  We always keep scale/zero in float32.
* ``mx.quantized_matmul`` broadcasts batch dimensions of ``w`` (GQA works by
  adding a singleton axis), and silently accepts *integer* ``x`` (the result
  is float32).  :func:`quantised_matmul` guards against that.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import mlx.core as mx

from . import switches
from .config import GROUP_SIZES  # group sizes accepted by MLX's quantised kernels

__all__ = [
    "LEVELS",
    "GROUP_SIZES",
    "SCALE_EPS",
    "quantise_affine",
    "dequantise",
    "unpack_codes",
    "quantise_k",
    "dequantise_k",
    "quantise_v",
    "dequantise_v",
    "quantised_matmul",
    "packed_nbytes",
]

#: (q_min, q_max) of the unsigned code range for every supported bit width.
LEVELS: dict[int, tuple[int, int]] = {
    8: (0, 255),
    6: (0, 63),
    5: (0, 31),
    4: (0, 15),
    3: (0, 7),
    2: (0, 3),
}


#: Lower bound on the scale.  All arithmetic is float32, so a step of 1e-8 is
#: representable and (x - zero) / scale stays finite for constant groups
#: (giving q = 0, an exact reconstruction) and for fp16/bf16 groups whose
#: range is ~1e-5 (whose natural step, ~4e-8 at 8 bits, stays above it).
SCALE_EPS: float = 1e-8

_WORD_BITS = 32


def _check_bits(bits: int) -> tuple[int, int]:
    if bits not in LEVELS:
        raise ValueError(
            f"unsupported bits={bits!r}; supported bit widths are {sorted(LEVELS)}"
        )
    return LEVELS[bits]


def _check_group(group: int) -> None:
    if group not in GROUP_SIZES:
        raise ValueError(
            f"unsupported group={group!r}; MLX quantised kernels accept group sizes "
            f"{list(GROUP_SIZES)}"
        )


def _check_axis(n: int, group: int, what: str) -> None:
    if n % group != 0:
        raise ValueError(
            f"{what} length {n} is not divisible by group={group}"
        )


#: the largest finite float16: parameters stored in float16 are clamped to it
_FP16_MAX = 65504.0
#: float16's smallest normal number: the least scale a float16 parameter keeps exactly enough
_FP16_TINY = 2.0 ** -14


def quantise_affine(
    x: mx.array, bits: int, group: int, param_dtype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantise ``x`` in groups of ``group`` consecutive elements of its last axis.

    Args:
        x: Array of shape ``[..., N]`` (any float dtype; upcast to float32).
        bits: Code width, one of ``LEVELS`` (8, 4, 2).
        group: Group size, one of ``GROUP_SIZES`` (32, 64, 128); must divide N.
        param_dtype: dtype of the returned scale and zero: float32, or float16 (half the
            bytes; the parameters are rounded to float16 first and the codes computed
            against the rounded ones, so the reconstruction error stays within half a step
            plus float16's rounding of the zero, 2^-11 of its magnitude).

    Returns:
        ``(packed, scale, zero)`` where ``packed`` is uint32 of shape
        ``[..., N * bits // 32]`` in MLX's layout and ``scale``/``zero`` are
        float32 of shape ``[..., N // group]``.  ``mx.dequantize(packed, scale,
        zero, group_size=group, bits=bits)`` reconstructs ``x`` to within half a
        step (``scale / 2``) per element.

    Raises:
        ValueError: unsupported ``bits``/``group``, a 0-d input, or a last axis
        not divisible by ``group``.
    """
    q_min, q_max = _check_bits(bits)
    _check_group(group)
    if x.ndim == 0:
        raise ValueError("quantise_affine needs at least one axis to group along")
    n = x.shape[-1]
    _check_axis(n, group, "last-axis")

    lead = tuple(x.shape[:-1])
    xg = x.astype(mx.float32).reshape(*lead, n // group, group)
    lo = mx.min(xg, axis=-1, keepdims=True)
    hi = mx.max(xg, axis=-1, keepdims=True)
    scale = mx.maximum((hi - lo) / float(q_max - q_min), SCALE_EPS)
    if param_dtype == mx.float16:
        lo = mx.clip(lo, -_FP16_MAX, _FP16_MAX).astype(mx.float16).astype(mx.float32)
        scale = mx.clip(scale, _FP16_TINY, _FP16_MAX).astype(mx.float16).astype(mx.float32)
    elif param_dtype != mx.float32:
        raise ValueError(f"param_dtype must be float32 or float16, got {param_dtype}")
    q = mx.clip(mx.round((xg - lo) / scale), q_min, q_max)
    codes = q.astype(mx.uint32).reshape(*lead, n)

    packed = _pack(codes, bits)
    return packed, scale.squeeze(-1).astype(param_dtype), lo.squeeze(-1).astype(param_dtype)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """Return the integer codes (uint32, shape ``[..., W * 32 // bits]``) in ``packed``.

    Reference inverse of the packing in :func:`quantise_affine`; used by tests and
    diagnostics, not on the hot path.
    """
    _check_bits(bits)
    _, words = _chunk(bits)
    chunks = packed.reshape(*packed.shape[:-1], packed.shape[-1] // words, words)
    mask = (1 << bits) - 1
    codes = []
    for w, shift, straddles in _fields(bits):
        code = chunks[..., w] >> shift
        if straddles:
            code = code | (chunks[..., w + 1] << (_WORD_BITS - shift))
        codes.append(code & mask)
    return mx.stack(codes, axis=-1).reshape(*packed.shape[:-1], -1)


def _chunk(bits: int) -> tuple[int, int]:
    """(codes, words) of the shortest run of whole words that holds whole codes: (32 // bits,
    1) for widths dividing 32, (16, 3) for 6 bits, (32, 3) and (32, 5) for 3 and 5."""
    words = bits // math.gcd(bits, _WORD_BITS)
    return words * _WORD_BITS // bits, words


def _fields(bits: int) -> list[tuple[int, int, bool]]:
    """Where each code of a chunk (`_chunk`) lies in the bit stream: (word, shift, whether its
    high bits open the next word)."""
    out = []
    for i in range(_chunk(bits)[0]):
        w, shift = divmod(i * bits, _WORD_BITS)
        out.append((w, shift, shift + bits > _WORD_BITS))
    return out


def _pack(codes: mx.array, bits: int) -> mx.array:
    """Pack uint32 `codes` [..., n] (n a multiple of `_chunk(bits)[0]`) into the bit stream
    of the module doc, [..., n * bits // 32]."""
    per_chunk, words = _chunk(bits)
    lead, n = tuple(codes.shape[:-1]), codes.shape[-1]
    chunks = codes.reshape(*lead, n // per_chunk, per_chunk)
    if words == 1:      # bit fields are disjoint, so the sum is a bitwise OR
        shifts = mx.arange(per_chunk, dtype=mx.uint32) * bits
        return mx.sum(chunks << shifts, axis=-1).astype(mx.uint32)
    out = [None] * words
    for i, (w, shift, straddles) in enumerate(_fields(bits)):
        parts = [(w, chunks[..., i] << shift)]
        if straddles:
            parts.append((w + 1, chunks[..., i] >> (_WORD_BITS - shift)))
        for j, part in parts:
            out[j] = part if out[j] is None else out[j] | part
    return mx.stack(out, axis=-1).reshape(*lead, n * bits // _WORD_BITS)


def dequantise(
    packed: mx.array,
    scale: mx.array,
    zero: mx.array,
    bits: int,
    group: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """Reconstruct ``scale * q + zero`` with shape ``[..., N]`` in ``dtype``.

    Uses ``mx.dequantize`` (which tests check is identical to
    ``unpack_codes * scale + zero``); arithmetic happens in the scale dtype
    (float32) and only the result is cast to ``dtype``.
    """
    _check_bits(bits)
    _check_group(group)
    if scale.dtype != mx.float32:       # float16 parameters: the arithmetic stays float32
        scale, zero = scale.astype(mx.float32), zero.astype(mx.float32)
    out = mx.dequantize(packed, scale, zero, group_size=group, bits=bits)
    return out.astype(dtype) if out.dtype != dtype else out


def _check_kv(x: mx.array, name: str, bits: int, group: int, axis: int, what: str) -> None:
    """A K or V tensor [..., T, D] whose `axis` is grouped: shape, bits and group checked."""
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape [..., T, D], got {tuple(x.shape)}")
    _check_bits(bits)
    _check_group(group)
    _check_axis(x.shape[axis], group, what)


# --------------------------------------------------------------------------- keys


def quantise_k(keys: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """KIVI key quantisation: per channel, groups of ``group`` tokens.

    Args:
        keys: ``[..., T, D]`` (typically ``[B, H, T, D]``), T a multiple of group.

    Returns:
        ``(packed, scale, zero)`` for the transposed keys ``K^T`` of shape
        ``[..., D, T]``: ``packed`` is ``[..., D, T * bits // 32]`` and
        ``scale``/``zero`` are ``[..., D, T // group]``.  Scores are
        ``quantised_matmul(q, packed, scale, zero, bits=bits, group=group,
        transpose=False)`` == ``q @ K^T``.  Because groups never straddle
        ``group``-token blocks, quantising blocks separately and concatenating
        along the last axis equals quantising the whole.
    """
    _check_kv(keys, "keys", bits, group, -2, "key token (T)")
    return quantise_affine(mx.swapaxes(keys, -1, -2), bits, group)


def dequantise_k(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int,
                 dtype: mx.Dtype = mx.float32) -> mx.array:
    """Inverse of :func:`quantise_k`: returns keys ``[..., T, D]``."""
    return mx.swapaxes(dequantise(packed, scale, zero, bits, group, dtype), -1, -2)


# ------------------------------------------------------------------------- values


def quantise_v(values: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """KIVI value quantisation: per token, groups of ``group`` channels.

    Args:
        values: ``[..., T, D]`` (typically ``[B, H, T, D]``), D a multiple of group.

    Returns:
        ``(packed, scale, zero)`` with ``packed`` ``[..., T, D * bits // 32]`` and
        ``scale``/``zero`` ``[..., T, D // group]``.  Attention output is
        ``quantised_matmul(p, packed, scale, zero, bits=bits, group=group,
        transpose=False)`` == ``p @ V``.
    """
    _check_kv(values, "values", bits, group, -1, "value channel (D)")
    return quantise_affine(values, bits, group)


def dequantise_v(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int,
                 dtype: mx.Dtype = mx.float32) -> mx.array:
    """Inverse of :func:`quantise_v`: returns values ``[..., T, D]``."""
    return dequantise(packed, scale, zero, bits, group, dtype)


# ------------------------------------------------------------------------- matmul


#: how `quantised_matmul` runs: None = by backend (`matmul_path`), or "packed" / "dequantise" to
#: force one (tests; the POSTTRAINLLM_QMATMUL environment variable does the same for a run)
FORCE_PATH: Optional[str] = None
MATMUL_PATHS = switches.QMATMUL_PATHS


def matmul_path(transpose: bool) -> str:
    """How a packed matmul runs on this backend, chosen up front (MLX is lazy: a missing kernel
    raises at evaluation, where no `try` around the call can catch it).

    "packed": `mx.quantized_matmul` straight on the codes (Metal, CPU). "dequantise": the codes
    dequantised, then a plain matmul, on MLX's CUDA backend, whose `quantized_matmul` has only a
    naive kernel for `transpose=False` (KIVI's layout) and none for small-M shapes with
    `transpose=True` (mlx-lm's QuantizedKVCache died on 8x8x64x9 there); a cache's packed
    segment is small next to the weights, so dequantising it per step costs little there."""
    forced = FORCE_PATH or os.environ.get("POSTTRAINLLM_QMATMUL") or None
    if forced is not None:
        if forced not in MATMUL_PATHS:
            raise ValueError(f"POSTTRAINLLM_QMATMUL must be one of {', '.join(MATMUL_PATHS)}, got {forced!r}")
        return forced
    return "dequantise" if _on_cuda() else "packed"


def _on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu)


def quantised_matmul(
    x: mx.array,
    packed: mx.array,
    scale: mx.array,
    zero: mx.array,
    *,
    bits: int,
    group: int,
    transpose: bool = False,
    path: Optional[str] = None,
) -> mx.array:
    """``x @ W`` (``transpose=False``) or ``x @ W^T`` with W held as ``(packed, scale, zero)``.

    Thin guard around ``mx.quantized_matmul``: MLX silently accepts integer
    ``x`` (e.g. token ids passed by mistake) and returns float32, so non-float
    inputs raise ``TypeError`` here.  Batch dims of ``packed`` broadcast
    against ``x`` (insert a singleton axis for GQA).  ``path``: how it runs,
    "packed" or "dequantise", as a caller decided it once (a KIVI run decides
    it when it is made, so a decode step never asks); None asks
    :func:`matmul_path` now.
    """
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(
            f"quantised_matmul needs a floating-point input, got {x.dtype}"
        )
    _check_bits(bits)
    _check_group(group)
    if (path or matmul_path(transpose)) == "dequantise":
        w = dequantise(packed, scale, zero, bits, group)
        return x.astype(mx.float32) @ (mx.swapaxes(w, -1, -2) if transpose else w)
    return mx.quantized_matmul(
        x, packed, scale, zero, transpose=transpose, group_size=group, bits=bits
    )


# -------------------------------------------------------------------------- sizes


def packed_nbytes(shape: tuple[int, ...], bits: int, group: int) -> int:
    """Bytes held by ``quantise_affine`` of a float array of ``shape`` (grouped on the last axis).

    Packed codes take ``bits / 8`` bytes per element (int4: 1/2, int2: 1/4) and
    each group adds one float32 scale and one float32 zero.  Equals the sum of
    ``.nbytes`` of the three returned arrays.  The total depends only on the
    element count, so pass the stored layout (``[..., D, T]`` for keys from
    :func:`quantise_k`, ``[..., T, D]`` for values); the last axis must be a
    multiple of ``group``.
    """
    _check_bits(bits)
    _check_group(group)
    if not shape:
        raise ValueError("shape must have at least one axis")
    n = 1
    for s in shape:
        n *= int(s)
    _check_axis(int(shape[-1]), group, "last-axis")
    return n * bits // 8 + 2 * 4 * (n // group)
