"""The design card's names are real methods on the real code path: `KVCache.quantise_affine`,
`dequantise_k`, `dequantise_v` (the KIVI store and the cold store's packed rows round through
them) and `evict_middle_if_needed`."""

import mlx.core as mx
import numpy as np
import pytest

from tinygpt_mlx.cache import KVCache, make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward, prefill

from conftest import build_native

TOKENS = [int(x) for x in np.random.RandomState(3).randint(1, 300, size=150)]


@pytest.fixture(scope="module")
def model32(tmp_path_factory, tokenizer_json):
    """Head dim 32: KIVI's value groups need it."""
    from tinygpt_mlx.loading import load
    return load(build_native(tmp_path_factory.mktemp("card") / "m.tinygpt", tokenizer_json, d_model=128,
                             n_heads=4, n_kv_heads=2)).model


class Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.fn(*args, **kw)


def _spies(monkeypatch):
    spies = {name: Spy(getattr(KVCache, name)) for name in ("quantise_affine", "dequantise_k", "dequantise_v")}
    for name, spy in spies.items():
        monkeypatch.setattr(KVCache, name, staticmethod(spy))
    return spies


def test_kivi_store_rounds_through_the_cards_methods(model32, monkeypatch):
    from tinygpt_mlx.cache.kivi import KiviStore

    spies = _spies(monkeypatch)
    freezes = Spy(KiviStore._freeze)
    monkeypatch.setattr(KiviStore, "_freeze", lambda self, n: freezes(self, n))
    cache = make_cache(model32, CacheConfig(key_bits=4, value_bits=4, rotate=False, kivi_sink=0))
    prefill(model32, TOKENS, cache, 48)
    body = cache.owned[0].body
    assert body.n_packed > 0 and freezes.calls >= len(cache.owned)
    # every freeze quantised its keys and its values through KVCache.quantise_affine
    assert spies["quantise_affine"].calls == 2 * freezes.calls
    k, v = body.fetch(mx.float32)                      # the reference path dequantises through them
    assert spies["dequantise_k"].calls > 0 and spies["dequantise_v"].calls > 0
    # and what they return is what the store holds: K^T packed per channel, V per token
    kq = KVCache.quantise_affine(mx.swapaxes(k[..., :32, :], -1, -2), 4, 32)
    assert mx.array_equal(kq[0], body.tiers.packed.keys[0][..., :32 * 4 // 32]).item()


def test_a_wrong_codec_changes_the_cache(model32, monkeypatch):
    """Not a bystander: a codec that zeroes the scale changes what attention sees."""
    ref = prefill(model32, TOKENS, make_cache(model32, CacheConfig(key_bits=4, value_bits=4)), 48)
    real = KVCache.quantise_affine

    def broken(x, bits, group, *params):
        packed, scale, zero = real(x, bits, group, *params)
        return packed, scale * 0, zero
    monkeypatch.setattr(KVCache, "quantise_affine", staticmethod(broken))
    out = prefill(model32, TOKENS, make_cache(model32, CacheConfig(key_bits=4, value_bits=4)), 48)
    assert mx.abs(out - ref).max().item() > 1e-3


def test_cold_store_packed_rows_round_through_the_codec(model32, monkeypatch):
    spies = _spies(monkeypatch)
    cache = make_cache(model32, CacheConfig(hot_budget=32, cold_bits=4, page_size=8, rope_mode="absolute"))
    logits = prefill(model32, TOKENS, cache, 48)
    forward(model32, mx.argmax(logits).reshape(1, 1), cache)
    assert len(cache.owned[0].cold) > 0
    assert spies["quantise_affine"].calls > 0 and spies["dequantise_v"].calls > 0


def test_evict_middle_if_needed_is_the_eviction(model32):
    cache = make_cache(model32, CacheConfig(sink=4, window=32))
    for i in range(0, 96, 16):               # chunks: each update keeps window - 1 + chunk tokens
        model32(mx.array([TOKENS[i:i + 16]]), cache=cache)
    assert cache.stored_count == 4 + 31 + 16
    dropped = cache.evict_middle_if_needed()  # after a step: keep exactly the window
    assert dropped == 15 and cache.stored_count == 4 + 32 and cache.current_length == 96
    assert cache.evict_middle_if_needed() == 0
