"""Tests for tinygpt_mlx.quant (KIVI asymmetric affine quantisation)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import pytest

from tinygpt_mlx.knobs import SIDE_BITS
from tinygpt_mlx import quant
from tinygpt_mlx.quant import (
    GROUP_SIZES,
    LEVELS,
    dequantise,
    dequantise_k,
    dequantise_v,
    packed_nbytes,
    quantise_affine,
    quantise_k,
    quantise_v,
    quantised_matmul,
    unpack_codes,
)

BITS = (8, 6, 5, 4, 3, 2)
GROUPS = (32, 64, 128)


def _finite(a: mx.array) -> bool:
    return bool(mx.all(mx.isfinite(a)).item())


def _half_step_ok(x: mx.array, x_hat: mx.array, step: mx.array) -> bool:
    """|x - x_hat| <= step/2 elementwise, plus float32 rounding slack."""
    x = x.astype(mx.float32)
    err = mx.abs(x - x_hat.astype(mx.float32))
    slack = 1e-6 * (1.0 + mx.abs(x)) + 1e-6 * step
    return bool(mx.all(err <= step / 2 + slack).item())


def _step_keys(scale: mx.array, group: int) -> mx.array:
    """Per-element step for quantise_k output, in [..., T, D] layout."""
    return mx.swapaxes(mx.repeat(scale, group, axis=-1), -1, -2)


def _step_vals(scale: mx.array, group: int) -> mx.array:
    return mx.repeat(scale, group, axis=-1)


# ----------------------------------------------------------------- constants


def test_levels_table():
    assert LEVELS == {8: (0, 255), 6: (0, 63), 5: (0, 31), 4: (0, 15), 3: (0, 7), 2: (0, 3)}
    assert sorted(SIDE_BITS.values()) == sorted(LEVELS)   # a side takes every width quant packs
    assert GROUP_SIZES == (32, 64, 128)


# ----------------------------------------------------------------- round trip


@pytest.mark.parametrize("bits,group", list(itertools.product(BITS, GROUPS)))
def test_round_trip_keys_per_channel(bits, group):
    mx.random.seed(bits * 1000 + group)
    B, H, T, D = 1, 2, 256, 64
    # channel-dependent magnitude, as with real key outliers
    keys = mx.random.normal((B, H, T, D)) * (1 + 10 * mx.random.uniform(shape=(D,)))
    packed, scale, zero = quantise_k(keys, bits, group)
    assert packed.dtype == mx.uint32 and scale.dtype == mx.float32
    assert packed.shape == (B, H, D, T * bits // 32)
    assert scale.shape == zero.shape == (B, H, D, T // group)
    k_hat = dequantise_k(packed, scale, zero, bits, group)
    assert k_hat.shape == keys.shape
    assert _half_step_ok(keys, k_hat, _step_keys(scale, group))


@pytest.mark.parametrize("bits,group", list(itertools.product(BITS, GROUPS)))
def test_round_trip_values_per_token(bits, group):
    mx.random.seed(bits * 1000 + group + 1)
    B, H, T, D = 1, 2, 48, 128
    vals = mx.random.normal((B, H, T, D)) * 3 + 0.5
    packed, scale, zero = quantise_v(vals, bits, group)
    assert packed.shape == (B, H, T, D * bits // 32)
    assert scale.shape == zero.shape == (B, H, T, D // group)
    v_hat = dequantise_v(packed, scale, zero, bits, group)
    assert v_hat.shape == vals.shape
    assert _half_step_ok(vals, v_hat, _step_vals(scale, group))


def test_step_matches_definition():
    x = mx.random.normal((4, 64))
    packed, scale, zero = quantise_affine(x, 4, 32)
    g = x.reshape(4, 2, 32)
    assert mx.allclose(zero, g.min(-1)).item()
    assert mx.allclose(scale, (g.max(-1) - g.min(-1)) / 15).item()


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_constant_channel_exact(bits, dtype):
    keys = mx.random.normal((1, 1, 64, 32)).astype(dtype)
    keys[..., 5] = 1.25  # constant channel (min == max)
    keys[..., 7] = 0.0
    packed, scale, zero = quantise_k(keys, bits, 32)
    assert _finite(scale) and bool(mx.all(scale > 0).item())
    k_hat = dequantise_k(packed, scale, zero, bits, 32)
    assert _finite(k_hat)
    assert bool(mx.all(k_hat[..., 5] == 1.25).item())
    assert bool(mx.all(k_hat[..., 7] == 0.0).item())
    # an all-constant tensor also works and is exact
    c = mx.full((2, 64), -3.5, dtype=dtype)
    p, s, z = quantise_affine(c, bits, 64)
    assert bool(mx.all(dequantise(p, s, z, bits, 64) == -3.5).item())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_low_precision_tiny_range(bits, dtype):
    mx.random.seed(7)
    # magnitude ~1e-3 with a spread of ~1e-5 (representable in fp16/bf16
    # only coarsely: several groups collapse to a handful of distinct values)
    x = (1e-3 + 1e-5 * mx.random.uniform(shape=(4, 8, 128))).astype(dtype)
    for group in GROUPS:
        p, s, z = quantise_affine(x, bits, group)
        assert _finite(s) and _finite(z) and bool(mx.all(s > 0).item())
        x_hat = dequantise(p, s, z, bits, group)
        assert _finite(x_hat)
        assert _half_step_ok(x, x_hat, _step_vals(s, group))
        assert _finite(dequantise(p, s, z, bits, group, dtype=dtype))
    # ranges of exactly 0 and ~1e-5 in the same tensor
    y = mx.zeros((2, 64), dtype=dtype)
    y[1] = (mx.arange(64) * 1.5e-7).astype(dtype)
    p, s, z = quantise_affine(y, bits, 32)
    y_hat = dequantise(p, s, z, bits, 32)
    assert _finite(y_hat)
    assert _half_step_ok(y, y_hat, _step_vals(s, 32))


@pytest.mark.parametrize("bits", BITS)
def test_ramp_uses_every_level(bits):
    q_min, q_max = LEVELS[bits]
    x = mx.linspace(-2.0, 5.0, 128).reshape(1, 128)
    p, s, z = quantise_affine(x, bits, 128)
    codes = unpack_codes(p, bits)
    assert int(codes.min().item()) == q_min
    assert int(codes.max().item()) == q_max
    if 128 >= q_max - q_min + 1:  # every level hit for int2/int4
        assert len(set(codes.tolist()[0])) == q_max - q_min + 1
    # extremes reconstruct exactly (within fp32 rounding)
    x_hat = dequantise(p, s, z, bits, 128)
    assert abs(x_hat[0, 0].item() + 2.0) < 1e-6
    assert abs(x_hat[0, -1].item() - 5.0) < 1e-5


def test_rope_rotated_keys():
    mx.random.seed(3)
    B, H, T, D = 1, 4, 128, 64
    keys = mx.random.normal((B, H, T, D))
    keys = nn.RoPE(D, traditional=False, base=10000.0)(keys, offset=1000)
    for bits in BITS:
        p, s, z = quantise_k(keys, bits, 64)
        k_hat = dequantise_k(p, s, z, bits, 64)
        assert _finite(s) and _finite(z) and _finite(k_hat)
        assert _half_step_ok(keys, k_hat, _step_keys(s, 64))


# ---------------------------------------------------------------- MLX layout


@pytest.mark.parametrize("bits,group", list(itertools.product(BITS, GROUPS)))
def test_layout_agrees_with_mlx(bits, group):
    mx.random.seed(11)
    x = mx.random.normal((3, 256)) * 2
    p, s, z = quantise_affine(x, bits, group)
    # our packing -> mx.dequantize is exactly codes * scale + zero
    codes = unpack_codes(p, bits).astype(mx.float32)
    ref = (codes.reshape(3, -1, group) * s[..., None] + z[..., None]).reshape(3, 256)
    got = mx.dequantize(p, s, z, group_size=group, bits=bits)
    assert mx.allclose(got, ref, rtol=1e-6, atol=1e-6).item()
    assert mx.allclose(dequantise(p, s, z, bits, group), ref, rtol=1e-6, atol=1e-6).item()
    # mx.quantize's packing -> our unpack agrees with mx.dequantize
    w, ws, wb = mx.quantize(x, group_size=group, bits=bits)
    wc = unpack_codes(w, bits).astype(mx.float32).reshape(3, -1, group)
    ref2 = (wc * ws[..., None] + wb[..., None]).reshape(3, 256)
    got2 = mx.dequantize(w, ws, wb, group_size=group, bits=bits)
    assert mx.allclose(got2, ref2, rtol=1e-6, atol=1e-6).item()


def test_element_order_within_word():
    # the words along the last axis form one little-endian bit stream and element
    # i sits in its bits [i*bits, (i+1)*bits) (inside one word where bits divides
    # 32); checked with plain Python ints, independent of unpack_codes.
    mx.random.seed(5)
    for bits in BITS:
        q_max = LEVELS[bits][1]
        x = mx.random.randint(0, q_max + 1, (2, 128))
        x[:, 0] = 0
        x[:, 1] = q_max  # range q_max -> scale 1, zero 0 -> codes == x
        x = x.astype(mx.float32)
        p, s, z = quantise_affine(x, bits, 128)
        assert mx.array_equal(s, mx.ones_like(s)).item()
        xs = [[int(v) for v in row] for row in x.tolist()]
        for r, row in enumerate(p.tolist()):
            stream = sum(word << (32 * w) for w, word in enumerate(row))
            for i in range(128):
                assert (stream >> (i * bits)) & q_max == xs[r][i]
        assert mx.array_equal(mx.dequantize(p, s, z, group_size=128, bits=bits), x).item()


# ------------------------------------------------------------ quantized matmul


@pytest.mark.parametrize("bits,group", [(8, 64), (6, 32), (5, 32), (4, 32), (4, 64), (3, 64), (2, 64), (2, 128)])
def test_quantized_matmul_keys_gqa(bits, group):
    mx.random.seed(21)
    B, n_kv, n_rep, L, T, D = 2, 2, 3, 4, 256, 64
    keys = mx.random.normal((B, n_kv, T, D))
    q = mx.random.normal((B, n_kv, n_rep, L, D))
    p, s, z = quantise_k(keys, bits, group)
    scores = quantised_matmul(
        q, p[:, :, None], s[:, :, None], z[:, :, None],
        bits=bits, group=group, transpose=False,
    )
    assert scores.shape == (B, n_kv, n_rep, L, T)
    assert scores.dtype == mx.float32
    k_hat = dequantise_k(p, s, z, bits, group)
    ref = q @ mx.swapaxes(k_hat, -1, -2)[:, :, None]
    assert mx.allclose(scores, ref, rtol=1e-4, atol=1e-4).item()
    # direct MLX call with the same layout, for the record
    direct = mx.quantized_matmul(
        q, p[:, :, None], s[:, :, None], z[:, :, None],
        transpose=False, group_size=group, bits=bits,
    )
    assert mx.allclose(direct, ref, rtol=1e-4, atol=1e-4).item()


@pytest.mark.parametrize("bits,group", [(8, 64), (6, 64), (5, 32), (4, 32), (4, 64), (3, 32), (2, 64)])
def test_quantized_matmul_values_gqa(bits, group):
    mx.random.seed(22)
    B, n_kv, n_rep, L, T, D = 1, 2, 2, 3, 96, 128
    vals = mx.random.normal((B, n_kv, T, D))
    pr = mx.softmax(mx.random.normal((B, n_kv, n_rep, L, T)), axis=-1)
    p, s, z = quantise_v(vals, bits, group)
    out = quantised_matmul(
        pr, p[:, :, None], s[:, :, None], z[:, :, None],
        bits=bits, group=group, transpose=False,
    )
    assert out.shape == (B, n_kv, n_rep, L, D)
    ref = pr @ dequantise_v(p, s, z, bits, group)[:, :, None]
    assert mx.allclose(out, ref, rtol=1e-4, atol=1e-4).item()


def test_quantised_matmul_rejects_integer_input():
    keys = mx.random.normal((1, 1, 64, 64))
    p, s, z = quantise_k(keys, 4, 64)
    for bad in (mx.ones((1, 1, 1, 64), dtype=mx.int32),
                mx.ones((1, 1, 1, 64), dtype=mx.uint32),
                mx.ones((1, 1, 1, 64), dtype=mx.bool_)):
        with pytest.raises(TypeError, match="floating"):
            quantised_matmul(bad, p, s, z, bits=4, group=64)
    # half-precision float queries are fine (result is float32: fp32 scales)
    out = quantised_matmul(mx.ones((1, 1, 1, 64), dtype=mx.float16), p, s, z,
                           bits=4, group=64)
    assert mx.issubdtype(out.dtype, mx.floating)


def test_module_never_passes_integers_to_quantized_matmul(monkeypatch):
    seen = []
    real = mx.quantized_matmul

    def spy(x, *a, **k):
        seen.append(x.dtype)
        return real(x, *a, **k)

    monkeypatch.setattr(quant.mx, "quantized_matmul", spy)
    keys = mx.random.normal((1, 2, 64, 64))
    p, s, z = quantise_k(keys, 2, 64)
    quantised_matmul(mx.random.normal((1, 2, 1, 64)), p, s, z, bits=2, group=64)
    assert seen and all(mx.issubdtype(d, mx.floating) for d in seen)


# ------------------------------------------------------------ block freezing


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 64), (2, 128)])
def test_blockwise_concat_equals_whole(bits, group):
    mx.random.seed(31)
    T = 4 * group
    keys = mx.random.normal((1, 2, T, 64))
    vals = mx.random.normal((1, 2, T, 64 if group <= 64 else 128))
    whole = quantise_k(keys, bits, group)
    parts = [quantise_k(keys[:, :, i:i + group], bits, group) for i in range(0, T, group)]
    for w, ps in zip(whole, zip(*parts)):
        assert mx.array_equal(w, mx.concatenate(ps, axis=-1)).item()
    # values are per token, so token blocks concatenate along T
    whole_v = quantise_v(vals, bits, group)
    parts_v = [quantise_v(vals[:, :, i:i + group], bits, group) for i in range(0, T, group)]
    for w, ps in zip(whole_v, zip(*parts_v)):
        assert mx.array_equal(w, mx.concatenate(ps, axis=-2)).item()


# ------------------------------------------------------------------- sizes


def test_byte_counts():
    keys = mx.random.normal((1, 2, 64, 64))
    p, s, z = quantise_k(keys, 4, 64)
    assert p.nbytes == 64 * 64 * 2 // 2  # half a byte per element
    assert s.nbytes == z.nbytes == 2 * 64 * 1 * 4  # one fp32 per group of 64 tokens
    assert packed_nbytes((1, 2, 64, 64), 4, 64) == p.nbytes + s.nbytes + z.nbytes
    p2, s2, z2 = quantise_v(keys, 2, 32)
    assert p2.nbytes == 64 * 64 * 2 // 4  # a quarter byte per element
    assert s2.nbytes == z2.nbytes == 2 * 64 * 2 * 4
    assert packed_nbytes((1, 2, 64, 64), 2, 32) == p2.nbytes + s2.nbytes + z2.nbytes
    p8, s8, z8 = quantise_v(keys, 8, 32)
    assert p8.nbytes == 64 * 64 * 2
    assert packed_nbytes((1, 2, 64, 64), 8, 32) == p8.nbytes + s8.nbytes + z8.nbytes


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_float16_parameters_stay_within_half_a_step(bits):
    """fp16 scale and zero: codes are computed against the rounded parameters, so every element
    is still reconstructed within half its step, plus fp16's rounding of a zero of this size."""
    x = mx.random.normal((4, 256), key=mx.random.key(bits)) * 3 + 1
    p, s, z = quantise_affine(x, bits, 32, mx.float16)
    assert s.dtype == z.dtype == mx.float16 and s.nbytes == x.size // 32 * 2
    back = dequantise(p, s, z, bits, 32)
    step = mx.repeat(s.astype(mx.float32), 32, axis=-1)
    zero = mx.abs(mx.repeat(z.astype(mx.float32), 32, axis=-1))
    assert (mx.abs(back - x) <= step / 2 + zero * 2 ** -11 + 1e-6).all().item()
    # and the same quantiser with fp32 parameters is no further from x than half its step
    p32, s32, z32 = quantise_affine(x, bits, 32)
    err16, err32 = mx.abs(back - x).max().item(), mx.abs(dequantise(p32, s32, z32, bits, 32) - x).max().item()
    assert err16 < err32 * 1.05 + 1e-3


# ------------------------------------------------------------------- errors


def test_invalid_arguments_raise():
    x = mx.random.normal((2, 128))
    with pytest.raises(ValueError, match="bits=7"):
        quantise_affine(x, 7, 64)
    with pytest.raises(ValueError, match="bits=16"):
        quantise_k(mx.zeros((1, 1, 64, 64)), 16, 64)
    with pytest.raises(ValueError, match="group=16"):
        quantise_affine(x, 4, 16)
    with pytest.raises(ValueError, match="group=48"):
        quantise_v(mx.zeros((1, 1, 4, 96)), 4, 48)
    with pytest.raises(ValueError, match="100"):
        quantise_affine(mx.zeros((2, 100)), 4, 32)
    with pytest.raises(ValueError, match="T.*96|96.*group=64"):
        quantise_k(mx.zeros((1, 1, 96, 64)), 4, 64)
    with pytest.raises(ValueError, match="64.*group=128"):
        quantise_v(mx.zeros((1, 1, 8, 64)), 4, 128)
    with pytest.raises(ValueError, match="bits=5"):
        dequantise(mx.zeros((1, 8), dtype=mx.uint32), mx.ones((1, 1)), mx.zeros((1, 1)), 5, 64)
    with pytest.raises(ValueError, match="group=256"):
        packed_nbytes((1, 256), 4, 256)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantise_path_equals_the_packed_matmul(monkeypatch, transpose, bits):
    """The dequantise-then-matmul path (MLX's CUDA backend, `quant.matmul_path`) computes what
    `mx.quantized_matmul` does on the codes, for KIVI's layout and the transposed one, with GQA
    broadcasting; a bad forced path is one line."""
    rng = mx.random.key(bits)
    w = mx.random.normal((2, 1, 64, 96), key=rng)               # [B, 1 (GQA), K, N], groups along N
    packed, scale, zero = quant.quantise_affine(w, bits, 32)
    x = mx.random.normal((2, 3, 5, 96 if transpose else 64), key=mx.random.key(7))
    got = {}
    for path in quant.MATMUL_PATHS:
        monkeypatch.setattr(quant, "FORCE_PATH", path)
        assert quant.matmul_path(transpose) == path
        got[path] = quant.quantised_matmul(x, packed, scale, zero, bits=bits, group=32, transpose=transpose)
    assert got["packed"].shape == got["dequantise"].shape == (2, 3, 5, 64 if transpose else 96)
    assert mx.allclose(got["packed"], got["dequantise"], atol=1e-4, rtol=1e-5)
    monkeypatch.setattr(quant, "FORCE_PATH", None)
    assert quant.matmul_path(False) == ("dequantise" if quant._on_cuda() else "packed")
    monkeypatch.setenv("POSTTRAINLLM_QMATMUL", "fast")
    with pytest.raises(ValueError, match="POSTTRAINLLM_QMATMUL must be one of packed, dequantise, got 'fast'"):
        quant.matmul_path(False)
