"""The StreamingLLM ring (cache/ring.py) against the simple path it replaced (`ring=False`: sink
and window as two position-ordered stores, shifted keys re-rotated to their slots on every read),
re-basing, and what one decode step runs."""

import dataclasses

import mlx.core as mx
import pytest

from prerope import make_cache
from tinygpt_mlx.cache.ring import RingStore
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.bench import step_ops
from tinygpt_mlx.generate import forward

TOKENS = [(i * 37 + 11) % 300 for i in range(260)]
SINK, WINDOW = 4, 16
# prefill chunks (the rest one token at a time); a chunk after decoding (a chat's next turn)
# sends a ring back to position order and the next step makes it a ring again
PATTERNS = {"chunks": [(17, 13)], "one-chunk": [(40,)], "tokens": [(1,)], "turns": [(7,), (30, 25), (50, 19)]}
# max |logit| difference ring vs simple path on these runs: measured 1.1e-5 .. 2.7e-5
TOL = 6e-5


def run(model, config, pattern, ring=True, rebase_every=None, tokens=TOKENS):
    """Logits [T, V] at every position: each group of `pattern` is prefill chunks at the token
    index it starts from (evenly spread), single tokens in between and after."""
    cache = make_cache(model, config, ring=ring)
    if rebase_every is not None:
        for c in cache.owned:
            c.positions.rebase_every = rebase_every
    starts = {len(tokens) * g // (len(pattern) + 1): chunks for g, chunks in enumerate(pattern)}
    outs, i = [], 0
    while i < len(tokens):
        for n in starts.pop(i, (1,)):
            outs.append(forward(model, mx.array([tokens[i:i + n]]), cache)[0])
            i += n
    return mx.concatenate(outs, axis=0), cache


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mode", ["shifted", "absolute"])
@pytest.mark.slow
def test_ring_equals_the_simple_path(native, mode, pattern):
    config = CacheConfig(sink=SINK, window=WINDOW, rope_mode=mode)
    ring, cache = run(native.model, config, PATTERNS[pattern])
    simple, ref = run(native.model, config, PATTERNS[pattern], ring=False)
    assert isinstance(cache.owned[0].body, RingStore) and not isinstance(ref.owned[0].body, RingStore)
    assert mx.abs(ring - simple).max().item() < TOL
    assert mx.argmax(ring, axis=-1).tolist() == mx.argmax(simple, axis=-1).tolist()
    assert (cache.stored_count, cache.current_length, cache.owned[0].key_positions().tolist()) == \
        (ref.stored_count, ref.current_length, ref.owned[0].key_positions().tolist())
    assert cache.owned[0].body.ring     # the last steps were decode steps: in place


@pytest.mark.parametrize("pattern", [[(2,)], [(1,)]])
def test_window_without_sink_and_storage_precision(native, pattern):
    for config in (CacheConfig(sink=0, window=WINDOW), CacheConfig(sink=0, window=WINDOW, rope_mode="absolute")):
        ring, _ = run(native.model, config, pattern, tokens=TOKENS[:80])
        simple, _ = run(native.model, config, pattern, ring=False, tokens=TOKENS[:80])
        assert mx.abs(ring - simple).max().item() < TOL
    # half-precision storage rounds rotated keys in the ring and pre-RoPE keys in the simple
    # path: both within bf16's error of the fp32 cache (measured 7.1e-3 and 7.3e-3)
    config = CacheConfig(sink=SINK, window=WINDOW)
    exact, _ = run(native.model, config, pattern, tokens=TOKENS[:80])
    for ring in (True, False):
        half, _ = run(native.model, dataclasses.replace(config, storage="bf16"), pattern, ring=ring, tokens=TOKENS[:80])
        assert mx.abs(half - exact).max().item() < 1.5e-2


@pytest.mark.parametrize("pattern", ["chunks", "turns"])
def test_rebase_is_exact(native, pattern):
    """Re-basing every 23 tokens over 260 (11 re-bases, inside decode and around chunks) gives
    the simple path's logits, and the query's RoPE position stays below the interval."""
    config = CacheConfig(sink=SINK, window=WINDOW)
    rebased, cache = run(native.model, config, PATTERNS[pattern], rebase_every=23)
    simple, _ = run(native.model, config, PATTERNS[pattern], ring=False)
    layer = cache.owned[0]
    assert layer.positions.base >= 23 * 10 and layer.positions.base % 23 == 0
    assert 0 <= layer.offset < 23
    assert mx.abs(rebased - simple).max().item() < TOL
    assert mx.argmax(rebased, axis=-1).tolist() == mx.argmax(simple, axis=-1).tolist()


def test_rebase_keeps_angles_exact_far_out(native):
    """2^24 tokens in, fp32 RoPE angles are off by up to a radian: a ring re-bases before its
    first step there, so it gives the logits of the same cache near position 0 (RoPE sees only
    distances), and without re-basing it does not."""
    config = CacheConfig(sink=SINK, window=WINDOW)

    def logits(seen, rebase_every=None):
        cache = make_cache(native.model, config)
        for c in cache.owned:       # as if `seen` tokens had gone by (nothing of them stored)
            c.seen = c.start = seen
            if rebase_every is not None:
                c.positions.rebase_every = rebase_every
        return mx.stack([forward(native.model, mx.array([[t]]), cache)[0, -1] for t in TOKENS[:60]])

    near = logits(40)
    assert mx.abs(logits(2 ** 24 + 40) - near).max().item() < TOL
    assert mx.abs(logits(2 ** 24 + 40, rebase_every=2 ** 40) - near).max().item() > 100 * TOL


def _decode_step_ops(model, config, ring=True, context=64, compiled=False):
    cache = make_cache(model, config, ring=ring)
    cache.compile_decode = compiled     # the eager step's graph unless asked (test_compiled.py)
    forward(model, mx.array([TOKENS[:context]]), cache)
    for t in TOKENS[context:context + 3]:
        mx.eval(forward(model, mx.array([[t]]), cache))
    return step_ops(model, cache)["ops"]      # the mean over SINK_STEPS steps


def test_shifted_ring_does_not_rerotate_the_window(native):
    """A shifted decode step on the ring runs a few more ops than the absolute ring (one write of
    the sink's rotation, and its rotation for the next SINK_STEPS steps now and then), where the
    simple path re-rotates every stored key on every step (dozens of ops per layer on this
    backend, where RoPE is unfused)."""
    layers = len(native.model.layers)
    absolute = _decode_step_ops(native.model, CacheConfig(sink=SINK, window=WINDOW, rope_mode="absolute"))
    shifted = _decode_step_ops(native.model, CacheConfig(sink=SINK, window=WINDOW))
    simple = _decode_step_ops(native.model, CacheConfig(sink=SINK, window=WINDOW), ring=False)
    print(f"ops per decode step: absolute {absolute}, shifted {shifted}, simple path {simple}")
    assert shifted - absolute <= 8 * layers < 2 * 8 * layers < simple - shifted


@pytest.mark.parametrize("rope", ["native", "traditional", "llama3", "yarn", "partial"])
def test_the_sink_turn_is_rope_by_sink_steps(native, rope):
    """The [D, D] turn that advances the shifted sink's block (ring.py) is RoPE by SINK_STEPS
    positions from any offset: rope(x, a + SINK_STEPS) == rope(x, a) @ turn, for the native RoPE
    and mlx-lm's variants (a YaRN scale cancels; partial rotary dims stay put); a rope whose
    frequencies move within the checked offsets (dynamic NTK with a trained length of 16) gets
    no turn, so its block is computed exactly every time."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import initialize_rope

    from tinygpt_mlx.cache.positions import Positions
    from tinygpt_mlx.cache.ring import SINK_STEPS
    D = 32
    ropes = {
        "native": native.model.layers[0].attn.rope,
        "traditional": nn.RoPE(D, traditional=True, base=10000.0),
        "llama3": initialize_rope(D, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  max_position_embeddings=4096),
        "yarn": initialize_rope(D, 10000.0, False, {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}, 4096),
        "partial": nn.RoPE(D // 2, traditional=False, base=10000.0),
    }
    store = RingStore(mx.float32, SINK, WINDOW, Positions(CacheConfig(sink=SINK, window=WINDOW), ropes[rope], frame=True))
    turn = store.sink_block.rope_turn(D, SINK_STEPS)
    x = mx.random.normal((1, 2, 5, D), key=mx.random.key(0))
    for a in (0, 13, 200):      # (farther out, RoPE's own fp32 angles differ by more than this)
        want = ropes[rope](x, offset=a + SINK_STEPS)
        err = mx.abs(ropes[rope](x, offset=a) @ turn - want).max().item()
        print(f"{rope} at {a}: {err:.1e}")
        assert err < (1.5e-6 if a < 100 else 2.5e-5)    # measured up to 7.7e-7 and 1.3e-5
    dynamic = initialize_rope(D, 10000.0, False, {"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=16)
    assert RingStore(mx.float32, SINK, WINDOW, Positions(CacheConfig(sink=SINK, window=WINDOW), dynamic,
                                                         frame=True)).sink_block.rope_turn(D, SINK_STEPS) is None


@pytest.mark.slow
def test_an_advanced_sink_block_equals_the_simple_path_past_a_refresh(native, monkeypatch):
    """900 tokens through a shifted ring (110 blocks of SINK_STEPS steps: advanced by the turn,
    computed exactly again after REFRESH_BLOCKS) give the simple path's logits; the blocks were
    advanced, and refreshed."""
    from tinygpt_mlx.cache import sink_block
    calls = {"advance": 0, "exact": 0}
    advance, exact = sink_block.SinkBlock.advance, sink_block.SinkBlock.rotate

    def counted(name, f):
        def g(self, *a):
            calls[name] += 1
            return f(self, *a)
        return g
    monkeypatch.setattr(sink_block.SinkBlock, "advance", counted("advance", advance))
    monkeypatch.setattr(sink_block.SinkBlock, "rotate", counted("exact", exact))
    tokens = [(i * 53 + 7) % 300 for i in range(900)]
    config = CacheConfig(sink=SINK, window=WINDOW)
    ring, _ = run(native.model, config, [(20,)], tokens=tokens)
    layers = len(native.model.layers)
    assert calls["advance"] >= layers * (880 // sink_block.SINK_STEPS - 3)
    # once per layer when the sink is made, then again within the 110 blocks (REFRESH_BLOCKS)
    assert calls["exact"] >= 2 * layers
    simple, _ = run(native.model, config, [(20,)], ring=False, tokens=tokens)
    err = mx.abs(ring - simple).max().item()
    print(f"max |logit| ring (advanced sink) - simple path over 900 tokens: {err:.2e}")
    assert err < TOL
    assert mx.argmax(ring, axis=-1).tolist() == mx.argmax(simple, axis=-1).tolist()


def test_a_yarn_scale_is_applied_once(tmp_path, tokenizer_json):
    """mlx-lm's YaRN rope scales what it rotates by its attention factor (mscale 1.14 here); the
    cache's own rotations (un-rotating, placing the sink, placing or turning for retrieval) are
    pure rotations (`positions.PureRotation`), so shifted caches that evict nothing, and a
    retrieval cache that brings everything back, give the full cache's logits (measured 5e-6
    .. 1.9e-5; with the scale applied again on each rotation they were 1.4-2.5 off)."""
    import json

    from conftest import build_llama_dir

    from tinygpt_mlx.generate import prefill
    from tinygpt_mlx.loading import load
    d = build_llama_dir(tmp_path / "yarn", tokenizer_json)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    m = load(d)
    assert getattr(m.model.model.layers[0].self_attn.rope, "mscale", 1.0) > 1.1
    toks = TOKENS[:200]
    full = prefill(m.model, toks, make_cache(m.model, CacheConfig()), 16)
    covering = dict(hot_budget=40, page_size=16, top_pages=64, retrieve_tokens=512, retrieved_position="slots",
                    retrieve_unit="tokens")
    configs = {"ring": CacheConfig(sink=SINK, window=300), "hot window": CacheConfig(sink=SINK, hot_budget=300),
               "retrieval, all back": CacheConfig(**covering)}
    for name, config in configs.items():
        for ring in (True, False):
            err = mx.abs(prefill(m.model, toks, make_cache(m.model, config, ring=ring), 16) - full).max().item()
            print(f"yarn, {name}, ring={ring}: {err:.1e}")
            assert err < 4e-5
