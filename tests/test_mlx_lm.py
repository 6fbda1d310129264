"""Our caches on mlx-lm's own model code: same tokens as mlx-lm's caches, drop-in generate."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache as MlxKVCache
from mlx_lm.models.cache import RotatingKVCache

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def greedy(model, cache, prompt, steps):
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(steps):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


def test_full_cache_matches_mlx_lm_kvcache(llama):
    m = llama.model
    ours = greedy(m, make_cache(m, CacheConfig()), PROMPT, 48)
    theirs = greedy(m, [MlxKVCache() for _ in m.layers], PROMPT, 48)
    assert ours == theirs
    assert len(set(ours)) > 3  # the tiny model does not just repeat one token


def test_absolute_streaming_matches_rotating_kvcache(llama):
    m = llama.model
    sink, window = 4, 12
    ours = greedy(m, make_cache(m, CacheConfig(sink=sink, window=window, rope_mode="absolute")), PROMPT, 48)
    theirs = greedy(m, [RotatingKVCache(max_size=sink + window, keep=sink) for _ in m.layers], PROMPT, 48)
    assert ours == theirs


def greedy_logits(model, cache, prompt, steps):
    logits = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for _ in range(steps):
        logits.append(model(mx.array([[int(mx.argmax(logits[-1]).item())]]), cache=cache)[0, -1])
    return mx.stack(logits).astype(mx.float32)


def test_shifted_streaming_runs_and_bounds_memory(llama):
    m = llama.model
    cache = make_cache(m, CacheConfig(sink=4, window=12, rope_mode="shifted"))
    out = greedy(m, cache, PROMPT, 40)
    assert len(out) == 40 and cache.stored_count == 16 and cache.current_length == len(PROMPT) + 40
    # the next token's RoPE position is its own (ring.py): RoPE sees only distances, and those
    # stay inside sink + window (test_ring.py)
    assert cache[0].offset == cache.current_length


def test_shifted_streaming_logits_on_mlx_lm_code(native, llama):
    """Shifted StreamingLLM on mlx-lm's Llama code, by logits: (1) a window longer than the
    text is the full cache; (2) after eviction, mlx-lm's code with the native model's weights
    gives the native model's logits step for step (the native path is pinned to a from-scratch
    reference in test_policies.py); (3) and they are not the absolute window's."""
    from tinygpt_mlx import attention

    m = llama.model
    shifted = CacheConfig(sink=4, window=12, rope_mode="shifted")
    full = greedy_logits(m, make_cache(m, CacheConfig()), PROMPT, 40)
    wide = greedy_logits(m, make_cache(m, CacheConfig(sink=4, window=100, rope_mode="shifted")), PROMPT, 40)
    assert mx.abs(wide - full).max().item() < 3.5e-5            # measured 1.6e-5
    mapped = mapped_llama(native)
    with attention.install(mapped):
        theirs = greedy_logits(mapped, make_cache(mapped, shifted), PROMPT, 40)
        absolute = greedy_logits(mapped, make_cache(mapped, dataclasses.replace(shifted, rope_mode="absolute")),
                                 PROMPT, 40)
    ours = greedy_logits(native.model, make_cache(native.model, shifted), PROMPT, 40)
    assert mx.abs(ours - theirs).max().item() < 1e-5            # measured 0.0
    assert mx.abs(ours - absolute).max().item() > 0.05          # measured 0.32: positions matter


def test_drop_in_prompt_cache_for_mlx_lm_generate(llama):
    from mlx_lm.generate import generate

    tok = llama.tokenizer._wrapper
    kw = dict(prompt="The quick brown fox", max_tokens=16, verbose=False)
    ours = generate(llama.model, tok, prompt_cache=make_cache(llama.model, CacheConfig()), **kw)
    theirs = generate(llama.model, tok, **kw)
    assert ours == theirs and len(ours) > 0


def mapped_llama(native):
    """The native TinyGPT's weights in mlx-lm's Llama code."""
    from mlx_lm.models import llama
    cfg = native.model.config
    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.d_ff, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "rms_norm_eps": cfg.norm_eps,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "tie_word_embeddings": True})
    m = llama.Model(args)
    rename = {"embed": "model.embed_tokens", "norm": "model.norm", "attn_norm": "input_layernorm",
              "mlp_norm": "post_attention_layernorm", "attn": "self_attn"}
    weights = []
    for name, v in tree_flatten(native.model.parameters()):
        parts = name.split(".")
        parts = [rename.get(p, p) if i != 0 or p != "layers" else "model.layers" for i, p in enumerate(parts)]
        weights.append((".".join(parts), v))
    m.update(tree_unflatten(weights))
    return m


def test_native_model_equals_mlx_lm_llama_with_mapped_weights(native):
    """The native TinyGPT is a Llama: mapped across, mlx-lm's code gives the same logits."""
    m = mapped_llama(native)
    x = mx.array([PROMPT * 4])
    assert mx.allclose(m(x), native.model(x), atol=1e-4).item()
    assert greedy(m, make_cache(m, CacheConfig()), PROMPT, 24) == \
        greedy(native.model, make_cache(native.model, CacheConfig()), PROMPT, 24)


def _gemma():
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs.from_dict({
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
        "sliding_window": 8, "sliding_window_pattern": 2, "rms_norm_eps": 1e-6})
    mx.random.seed(0)
    return gemma3_text.Model(args)


def _gemma_logits(m, cache):
    """20-token prefill (past the sliding window of 8), then 10 greedy steps; all logits."""
    out = [m(mx.array([list(range(1, 21))]), cache=cache)[0]]
    for _ in range(10):
        out.append(m(mx.array([[int(mx.argmax(out[-1][-1]).item())]]), cache=cache)[0])
    return mx.concatenate(out)


def test_sliding_window_layers_get_our_ring_of_their_window():
    """A sliding-window layer (mlx-lm's RotatingKVCache) becomes our exact ring of its own window
    (tests/test_sliding.py covers it under every policy), with the logits of mlx-lm's caches."""
    from tinygpt_mlx import attention

    m = _gemma()
    theirs = _gemma_logits(m, m.make_cache())       # mlx-lm's own caches
    with attention.install(m):
        cache = make_cache(m, CacheConfig())
        kinds = [type(c).__name__ for c in cache]
        assert kinds == ["RingLayer", "FullLayer"] and cache.kinds() == ["sliding 8", "global"]
        ours = _gemma_logits(m, cache)
    assert cache.current_length == 30
    assert mx.abs(ours - theirs).max().item() < 1e-5    # measured 2.4e-6 (the ring's key order)


def test_unrouted_model_gets_correct_logits_or_an_error():
    """Found by the audit: an mlx-lm model built directly (not through loading.load) used to get
    our LayerCache with its attention not routed, and attended to the current chunk only
    (Gemma: logits 5.3 off). make_cache now refuses it, for every policy."""
    m = _gemma()
    theirs = _gemma_logits(m, m.make_cache())
    try:
        ours = _gemma_logits(m, make_cache(m, CacheConfig()))
    except ValueError as e:
        assert "not routed" in str(e)
        return
    assert mx.abs(ours - theirs).max().item() < 1e-5


# ----- mlx-lm's RotatingKVCache vs our absolute window on a prompt longer than the window -----

SINK, WINDOW = 4, 12          # RotatingKVCache(max_size=SINK + WINDOW, keep=SINK)


def _masked_logits(model, ids, mask):
    from conftest import _MaskOnly
    return model(mx.array([ids]), cache=[_MaskOnly(mask) for _ in model.layers])[0].astype(mx.float32)


def streaming_mask(n):
    """StreamingLLM: query i sees the sink and its last WINDOW positions."""
    q, k = mx.arange(n)[:, None], mx.arange(n)[None]
    return (k <= q) & ((k < SINK) | (q - k < WINDOW))


def rotating_mask(prefilled):
    """What RotatingKVCache gives when the first `prefilled` tokens come in one multi-token
    call: those queries see a plain sliding window of max_size = SINK + WINDOW positions (no
    sink: `_update_concat` keeps the whole chunk and `make_mask` is create_causal_mask's
    window); later 1-token steps (`_update_in_place`, trimmed to keep + the newest) see the
    sink and the last WINDOW positions."""
    def mask(n):
        q, k = mx.arange(n)[:, None], mx.arange(n)[None]
        sliding = (k <= q) & (q - k < SINK + WINDOW)
        return mx.where(q < prefilled, sliding, streaming_mask(n))
    return mask


def greedy_from_scratch(model, prompt, steps, mask_of):
    """Greedy tokens, every step one uncached forward over the whole sequence with `mask_of(n)`."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(mx.argmax(_masked_logits(model, seq, mask_of(len(seq)))[-1]).item()))
    return seq[len(prompt):]


@pytest.mark.parametrize("n_prompt", [7, 16, 17, 31])
def test_rotating_kvcache_prefill_is_a_sliding_window_without_sink(llama, n_prompt):
    """One multi-token prefill: our absolute window equals StreamingLLM from scratch (sink +
    last WINDOW for every query); mlx-lm's RotatingKVCache equals a plain sliding window of
    SINK + WINDOW. The two agree while the prompt fits in SINK + WINDOW = 16 tokens and
    differ beyond (measured: exactly equal logits where they agree; 1.9 apart at 17, 12.7 at 31)."""
    m = llama.model
    prompt = np.random.RandomState(1).randint(1, 300, n_prompt).tolist()
    ours = m(mx.array([prompt]), cache=make_cache(m, CacheConfig(sink=SINK, window=WINDOW,
                                                                 rope_mode="absolute")))[0]
    theirs = m(mx.array([prompt]), cache=[RotatingKVCache(max_size=SINK + WINDOW, keep=SINK)
                                          for _ in m.layers])[0]
    assert mx.abs(ours - _masked_logits(m, prompt, streaming_mask(n_prompt))).max().item() < 1e-5
    assert mx.abs(theirs - _masked_logits(m, prompt, rotating_mask(n_prompt)(n_prompt))).max().item() < 1e-5
    gap = mx.abs(ours - theirs).max().item()
    if n_prompt <= SINK + WINDOW:
        assert gap < 1e-5
    else:
        assert gap > 1.0


@pytest.mark.parametrize("n_prompt", [7, 31])
def test_mlx_lm_generate_with_a_window_cache(llama, n_prompt):
    """mlx_lm's generate prefills prompt[:-1] in one call, then steps token by token. With a
    7-token prompt both caches give the same tokens; with 31 tokens they differ: ours are
    StreamingLLM's from scratch, mlx-lm's those of a sliding window over the first 30 tokens."""
    from mlx_lm.generate import stream_generate

    m, tok = llama.model, llama.tokenizer._wrapper
    prompt = np.random.RandomState(2).randint(1, 300, n_prompt).tolist()
    steps = 12

    def run(cache):
        return [r.token for r in stream_generate(m, tok, prompt, max_tokens=steps, prompt_cache=cache)]
    ours = run(make_cache(m, CacheConfig(sink=SINK, window=WINDOW, rope_mode="absolute")))
    theirs = run([RotatingKVCache(max_size=SINK + WINDOW, keep=SINK) for _ in m.layers])
    assert len(ours) == len(theirs) == steps
    assert ours == greedy_from_scratch(m, prompt, steps, streaming_mask)
    assert theirs == greedy_from_scratch(m, prompt, steps, rotating_mask(n_prompt - 1))
    assert (ours == theirs) is (n_prompt <= SINK + WINDOW)
