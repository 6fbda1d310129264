"""The KVCache core: cached == uncached, storage precision, protocol, StreamingLLM eviction."""

import mlx.core as mx
import pytest

from tinygpt_mlx.cache import LayerCache, make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward

TOKENS = mx.array([[(i * 37 + 11) % 300 for i in range(96)]])


def run_cached(model, config, chunks=(17, 13), tokens=TOKENS):
    """Logits for every position: prefill in `chunks`, then one token at a time."""
    cache = make_cache(model, config)
    outs, i = [], 0
    for n in chunks:
        outs.append(forward(model, tokens[:, i:i + n], cache))
        i += n
    while i < tokens.shape[1]:
        outs.append(forward(model, tokens[:, i:i + 1], cache))
        i += 1
    return mx.concatenate(outs, axis=1), cache


def greedy(model, prompt, steps, config=None):
    cache = make_cache(model, config or CacheConfig())
    logits = forward(model, mx.array([prompt]), cache)[0, -1]
    out = []
    for _ in range(steps):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = forward(model, mx.array([[t]]), cache)[0, -1]
    return out


def greedy_uncached(model, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(prompt):]


def test_cached_equals_uncached(native):
    model = native.model
    full = model(TOKENS)
    cached, cache = run_cached(model, CacheConfig())
    assert mx.allclose(cached, full, atol=1e-4).item()
    assert cache.current_length == cache.stored_count == TOKENS.shape[1]


def test_greedy_64_steps_cached_equals_uncached(native):
    prompt = TOKENS[0, :8].tolist()
    assert greedy(native.model, prompt, 64) == greedy_uncached(native.model, prompt, 64)


# max |logit error| vs the uncached fp32 forward; measured 7.3e-4 (fp16) and 5.3e-3 (bf16):
# about 2x each, so fp16 storage that silently rounds through bf16 fails the fp16 case
@pytest.mark.parametrize("storage, tol", [("fp16", 1.5e-3), ("bf16", 1e-2)])
def test_half_precision_storage_is_half_the_bytes(native, storage, tol):
    _, c32 = run_cached(native.model, CacheConfig())
    logits, c16 = run_cached(native.model, CacheConfig(storage=storage))
    assert c16.nbytes * 2 == c32.nbytes > 0
    assert logits.dtype == mx.float32  # computed in fp32 whatever the storage
    err = mx.abs(logits - native.model(TOKENS)).max().item()
    assert 0 < err < tol, err   # 0: the storage really rounds


def test_protocol(native):
    model = native.model
    cache = make_cache(model, CacheConfig())
    layer = cache[0]
    assert isinstance(layer, LayerCache) and layer.empty() and layer.offset == 0
    assert layer.make_mask(1) is None and layer.make_mask(5) == "causal"
    assert layer.make_mask(5, return_array=True).shape == (5, 5)
    forward(model, TOKENS[:, :10], cache)
    assert layer.offset == 10 and layer.size() == 10 and not layer.empty()
    assert layer.is_trimmable() and layer.trim(3) == 3 and layer.offset == 7
    k, v = layer.state
    assert k.shape[2] == 7 and layer.nbytes == k.nbytes + v.nbytes
    assert not hasattr(layer, "bits") and not hasattr(layer, "group_size")


def test_streaming_window_longer_than_text_equals_full(native):
    full, _ = run_cached(native.model, CacheConfig())
    for mode in ("absolute", "shifted"):
        got, cache = run_cached(native.model, CacheConfig(sink=4, window=200, rope_mode=mode))
        assert mx.allclose(got, full, atol=1e-4).item()
        assert cache.stored_count == TOKENS.shape[1]


@pytest.mark.parametrize("mode", ["absolute", "shifted"])
@pytest.mark.parametrize("chunks", [(17, 13), (40,), (1,)])
def test_eviction_keeps_first_sink_and_last_window(native, mode, chunks):
    sink, window = 4, 16
    _, cache = run_cached(native.model, CacheConfig(sink=sink, window=window, rope_mode=mode), chunks)
    n = TOKENS.shape[1]
    assert cache.current_length == n and cache.stored_count == sink + window
    # The stored keys themselves. Layer 0's K/V depend only on token and position, so they
    # must equal the full cache's at the kept positions.
    _, ref = run_cached(native.model, CacheConfig(), chunks)
    keep = list(range(sink)) + list(range(n - window, n))
    layer, ref_layer = cache.owned[0], ref.owned[0]
    assert layer.key_positions().tolist() == keep
    k_ref, v_ref = ref_layer.fetch()
    k, v = layer.fetch()
    assert mx.allclose(v, v_ref[:, :, keep], atol=1e-5).item()
    expected = k_ref[:, :, keep]
    if mode == "shifted":  # the same keys, re-rotated from their positions to slots 0..S-1,
        # in the frame the query is rotated in (a ring's: slot 0 at offset - stored; ring.py)
        slot0 = layer.offset - layer.stored_count
        assert slot0 == n - sink - window and layer.offset == n   # the query at its own position
        expected = rotate_each(layer.positions.rope, expected, [slot0 + s - p for s, p in enumerate(keep)])
    assert mx.allclose(k, expected, atol=1e-4).item()


def rotate_each(rope, keys, deltas):
    B, H, L, D = keys.shape
    flat = keys.transpose(2, 0, 1, 3).reshape(L * B * H, 1, D)
    out = rope(flat, offset=mx.repeat(mx.array(deltas), B * H))
    return out.reshape(L, B, H, D).transpose(1, 2, 0, 3)


def test_shifted_equals_absolute_without_sinks(native):
    """RoPE is relative: with no sink, slot positions and original positions give the same
    attention, so the two modes must agree while eviction is active."""
    a, _ = run_cached(native.model, CacheConfig(sink=0, window=16, rope_mode="absolute"))
    s, _ = run_cached(native.model, CacheConfig(sink=0, window=16, rope_mode="shifted"))
    assert mx.allclose(a, s, atol=1e-3).item()


def test_chunk_longer_than_window_sees_exactly_its_window(native):
    """A prefill chunk longer than the window attends like token-by-token decoding."""
    cfg = CacheConfig(sink=4, window=16, rope_mode="absolute")
    chunked, _ = run_cached(native.model, cfg, chunks=(60,))
    stepwise, _ = run_cached(native.model, cfg, chunks=(1,))
    assert mx.allclose(chunked, stepwise, atol=1e-4).item()


@pytest.mark.parametrize("bad", [dict(sink=-1, window=4), dict(sink=4), dict(window=0),
                                 dict(storage="fp8"), dict(rope_mode="nope")])
def test_invalid_cache_configs(bad):
    with pytest.raises(ValueError):
        CacheConfig(**bad)


def test_yoco_holds_kv_for_half_the_layers(tokenizer_json, tmp_path):
    from tests.conftest import build_native
    from tinygpt_mlx.loading import load

    m = load(build_native(tmp_path / "yoco.tinygpt", tokenizer_json, n_layers=4, yoco=True)).model
    full = m(TOKENS)
    got, cache = run_cached(m, CacheConfig())
    assert mx.allclose(got, full, atol=1e-4).item()
    assert cache.layers_with_kv == 3 and cache[3] is cache[2]
    _, streaming = run_cached(m, CacheConfig(sink=4, window=16))
    assert streaming.stored_count == 20
