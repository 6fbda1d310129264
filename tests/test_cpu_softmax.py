"""cache/cpu_softmax.py: the softmax with a compiled polynomial exp against `mx.softmax` (the
reference it replaces in a retrieval chunk's attention), and `segments.attend` taking it only
for a retrieval chunk."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tinygpt_mlx.cache import cpu_softmax, segments
from tinygpt_mlx.cache.segments import DenseSegment, PoolSegment, RetrievedSegment, attend


def _scores(shape: tuple, spread: float, masked: float, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    s = rng.normal(size=shape).astype(np.float32) * spread
    s[rng.uniform(size=shape) < masked] = -np.inf
    s[..., 0] = rng.normal(size=shape[:-1]) * spread     # every row keeps a finite score
    return mx.array(s)


@pytest.mark.parametrize("shape,spread,masked", [
    ((2, 2, 3, 64, 1795), 3.0, 0.15),     # a retrieval chunk's rows: picked + sink + window, a causal mask
    ((1, 4, 2, 16, 300), 40.0, 0.0),      # most of each row below exp(-87) of its max
    ((1, 1, 1, 8, 7), 1.0, 0.5),          # short rows, half masked
    ((1, 1, 1, 4, 1), 5.0, 0.0),          # one score per row
])
def test_softmax_rows_is_mx_softmax_within_a_few_units_in_the_last_place(shape, spread, masked):
    s = _scores(shape, spread, masked, seed=len(shape) + int(spread))
    got, want = cpu_softmax.softmax_rows(s), mx.softmax(s, axis=-1)
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    # rows sum to 1 as closely as mx.softmax's do (both sum 1,795 floats in order)
    assert np.abs(got.sum(axis=-1) - 1).max() <= np.abs(want.sum(axis=-1) - 1).max() + 1e-6
    assert np.abs(got - want).max() <= 2e-7
    big = want > 1e-30      # (mx.softmax keeps exp(x) for x in [-88, -87]; these are 0 here: < 1e-37)
    assert (np.abs(got - want)[big] / want[big]).max() <= 1e-6
    assert (got[~big] <= 1e-30).all()
    assert (got[np.isneginf(np.asarray(s))] == 0).all()


class _Packed:
    """A stand-in for a KIVI-packed body segment (any type but `DenseSegment`)."""
    n_heads = 2


def _chunk(L: int = 24, hkv: int = 2, rep: int = 2, D: int = 16, pages: int = 12, unit: int = 4, seed: int = 0):
    k = mx.random.key(seed)
    ks = mx.random.split(k, 6)
    q = mx.random.normal((1, hkv * rep, L, D), key=ks[0])
    kp, vp = (mx.random.normal((1, hkv, pages * unit, D), key=ks[i]) for i in (1, 2))
    kw, vw = (mx.random.normal((1, hkv, 40 + L, D), key=ks[i]) for i in (3, 4))
    valid = mx.ones((1, hkv, pages * unit), dtype=mx.bool_)
    return q, kp, vp, valid, (DenseSegment(kw[:, :, :4], vw[:, :, :4]), DenseSegment(kw[:, :, 4:], vw[:, :, 4:])), unit


def test_a_retrieval_chunk_takes_it_and_attends_as_with_mx_softmax(monkeypatch):
    """The same picks (attention's own, before the softmax) and outputs within 1e-6 of the
    `mx.softmax` path; taken only for a retrieval chunk (retrieved segments, several queries)."""
    q, kp, vp, valid, (sink, body), unit = _chunk()
    D = q.shape[-1]
    calls = []
    real = cpu_softmax.softmax_rows
    monkeypatch.setattr(cpu_softmax, "softmax_rows", lambda s: calls.append(s.shape) or real(s))

    monkeypatch.setattr(cpu_softmax.heap, "KEPT", True)     # (as the CLI keeps it: `use_here`)

    def run(enabled: bool):
        monkeypatch.setattr(cpu_softmax, "ENABLED", enabled)
        pool = PoolSegment(kp, vp, valid, 3, unit)
        out = attend([pool, sink, body], 1, q, D ** -0.5, "causal")
        mx.eval(out, pool.picked)
        return np.asarray(out), np.asarray(pool.picked)

    with mx.stream(mx.cpu):
        plain, plain_picks = run(False)
        assert not calls
        fast, fast_picks = run(True)
    assert len(calls) == 1 and calls[0][-1] == 3 * unit + 4 + body.keys.shape[2]
    np.testing.assert_array_equal(fast_picks, plain_picks)
    assert np.abs(fast - plain).max() <= 1e-6
    # not for a layer without retrieved segments, nor one query (a decode step: `_attend_one`),
    # nor the `slots` rule's own keys per query, nor a window that is not exact (a KIVI body)
    calls.clear()
    L, T = q.shape[2], 5
    own = RetrievedSegment(*(mx.random.normal((1, 2, L, T, D), key=mx.random.key(i)) for i in (7, 8)))
    with mx.stream(mx.cpu):
        mx.eval(attend([sink, body], 0, q, D ** -0.5, "causal"))
        mx.eval(attend([PoolSegment(kp, vp, valid, 3, unit), sink, body], 1, q[:, :, -1:], D ** -0.5, None))
        mx.eval(attend([own, sink, body], 1, q, D ** -0.5, "causal"))
    assert not calls
    assert not segments._pool_over_exact([PoolSegment(kp, vp, valid, 3, unit), sink, _Packed()], 1)


def test_it_is_taken_only_on_x86_with_g_plus_plus_and_without_the_opt_out(monkeypatch):
    monkeypatch.delenv("POSTTRAINLLM_NO_FAST_EXP", raising=False)
    monkeypatch.setattr(cpu_softmax.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_softmax.shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert cpu_softmax.wanted()
    monkeypatch.setenv("POSTTRAINLLM_NO_FAST_EXP", "1")
    assert not cpu_softmax.wanted()
    monkeypatch.delenv("POSTTRAINLLM_NO_FAST_EXP")
    monkeypatch.setattr(cpu_softmax.platform, "machine", lambda: "arm64")
    assert not cpu_softmax.wanted()
    monkeypatch.setattr(cpu_softmax.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(cpu_softmax.shutil, "which", lambda name: None)
    assert not cpu_softmax.wanted()
    assert segments.cpu_softmax is cpu_softmax


def test_it_keeps_mx_softmax_off_a_cpu_default_device_and_for_half_precision(monkeypatch):
    """`use_here`: not where the default device is a GPU (a CUDA build's; a Mac is not `wanted`
    at all), nor where glibc's heap is not kept (`heap.KEPT`: its intermediates faulted in afresh,
    slower than `mx.softmax`); `softmax_rows`: half-precision scores take `mx.softmax` (its fp32
    constants would give NaN in fp16 and wrong rows in bf16)."""
    monkeypatch.setattr(cpu_softmax, "ENABLED", True)
    monkeypatch.setattr(cpu_softmax.heap, "KEPT", True)
    monkeypatch.setattr(cpu_softmax.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert cpu_softmax.use_here()
    monkeypatch.setattr(cpu_softmax.heap, "KEPT", False)
    assert not cpu_softmax.use_here()
    monkeypatch.setattr(cpu_softmax.heap, "KEPT", True)
    monkeypatch.setattr(cpu_softmax.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not cpu_softmax.use_here()
    monkeypatch.setattr(cpu_softmax, "ENABLED", False)
    monkeypatch.setattr(cpu_softmax.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert not cpu_softmax.use_here()
    monkeypatch.undo()
    s = _scores((1, 2, 1, 4, 9), 3.0, 0.3, seed=5)
    for dtype in (mx.float16, mx.bfloat16):
        got = cpu_softmax.softmax_rows(s.astype(dtype))
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)),
                                      np.asarray(mx.softmax(s.astype(dtype), axis=-1).astype(mx.float32)))
