"""The public generation API (tinygpt_mlx.generate_text / stream_text) for both model kinds."""

import pytest

import tinygpt_mlx
from tinygpt_mlx import CacheConfig, SampleConfig, generate_text, load, make_cache, stream_text
from tinygpt_mlx.errors import ContextLengthError
from tinygpt_mlx.generate import stream_generate

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def shipped():
    return load()


@pytest.fixture(params=["shipped", "llama"])
def any_kind(request, shipped, llama):
    loaded = shipped if request.param == "shipped" else llama
    assert loaded.kind == ("tinygpt" if request.param == "shipped" else "mlx-lm")
    return loaded


def reference(loaded, cache_config=CacheConfig(), **sample):
    """What stream_generate gives (text, its cache) for the same settings."""
    cache = make_cache(loaded.model, cache_config)
    chunks = list(stream_generate(loaded, PROMPT, cache_config,
                                  SampleConfig(**{"temperature": 0.0, **sample}), cache=cache))
    return "".join(c.text for c in chunks), chunks[-1].stats


def test_exported():
    for name in ("load", "LoadedModel", "generate_text", "stream_text", "make_cache", "CacheConfig"):
        assert name in tinygpt_mlx.__all__ and getattr(tinygpt_mlx, name).__doc__


def test_greedy_equals_stream_generate(any_kind):
    want, _ = reference(any_kind, max_tokens=24)
    assert want.strip()
    assert generate_text(any_kind, PROMPT, max_tokens=24) == want
    assert "".join(stream_text(any_kind, PROMPT, max_tokens=24)) == want


def test_cache_passed_in_reports_its_numbers(any_kind):
    cfg = CacheConfig(sink=4, window=16)
    want, stats = reference(any_kind, cfg, max_tokens=40)
    cache = make_cache(any_kind.model, cfg)
    assert generate_text(any_kind, PROMPT, max_tokens=40, cache=cache) == want
    assert (cache.current_length, cache.stored_count, cache.nbytes) == \
        (stats.cache.current_length, stats.cache.stored_count, stats.cache.nbytes)
    assert cache.current_length >= stats.prompt_tokens
    assert 0 < cache.stored_count <= 20 and cache.nbytes > 0
    if stats.finish_reason == "length":
        assert cache.current_length > cache.stored_count  # the window evicted


def test_cache_config_without_cache(shipped, llama):
    cfg = CacheConfig(key_bits=8, value_bits=4)
    want, _ = reference(shipped, cfg, max_tokens=20)
    assert generate_text(shipped, PROMPT, max_tokens=20, cache_config=cfg) == want
    with pytest.raises(ValueError, match="not both"):
        generate_text(shipped, PROMPT, cache=make_cache(shipped.model, cfg), cache_config=cfg)
    # the policy is really used: a full cache refuses a prompt past the context, a window does not
    long_prompt = [5, 17, 42, 99] * 75  # 300 tokens, the tiny Llama's context is 256
    with pytest.raises(ContextLengthError):
        generate_text(llama, long_prompt, max_tokens=4)
    assert generate_text(llama, long_prompt, max_tokens=4, cache_config=CacheConfig(sink=4, window=60))


def test_token_ids_stop_and_seeded_sampling(shipped):
    ids = shipped.tokenizer.encode(PROMPT)
    assert generate_text(shipped, ids, max_tokens=16) == generate_text(shipped, PROMPT, max_tokens=16)
    full = generate_text(shipped, PROMPT, max_tokens=30)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = generate_text(shipped, PROMPT, max_tokens=30, stop=[stop])
    assert cut == full[:full.index(stop)]
    a = generate_text(shipped, PROMPT, max_tokens=30, temperature=1.0, seed=3)
    assert a == generate_text(shipped, PROMPT, max_tokens=30, temperature=1.0, seed=3)
    assert a != full  # temperature is not ignored


def test_mlx_tokenizer_only_for_mlx_lm_models(shipped, llama):
    from mlx_lm.generate import generate

    with pytest.raises(AttributeError, match="generate_text"):
        shipped.mlx_tokenizer
    kw = dict(prompt=PROMPT, max_tokens=16, verbose=False)
    ours = generate(llama.model, llama.mlx_tokenizer, prompt_cache=make_cache(llama.model, CacheConfig()), **kw)
    assert ours == generate(llama.model, llama.mlx_tokenizer, **kw) and ours
