"""The public generation API: one call for either model kind (a native `.tinygpt` file or an
mlx-lm model directory), built on `generate.stream_generate`.

    from tinygpt_mlx import CacheConfig, generate_text, load, make_cache

    loaded = load()                                   # the shipped model
    cache = make_cache(loaded.model, CacheConfig(sink=4, window=64))
    text = generate_text(loaded, "In the beginning", max_tokens=50, cache=cache)
    print(cache.current_length, cache.stored_count, cache.nbytes)

For token ids, timings and the full report, use `generate.stream_generate` (what the CLI uses).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Union

from .cache import KVCache, make_cache
from .config import CacheConfig, SampleConfig
from .generate import stream_generate


def stream_text(loaded: Any, prompt: Union[str, Sequence[int]], *, max_tokens: int = 200,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                stop: Sequence[str] = (), cache: Optional[KVCache] = None,
                cache_config: Optional[CacheConfig] = None) -> Iterator[str]:
    """Yield the generated text piece by piece (never splitting a character).

    loaded        what `tinygpt_mlx.load(...)` returns, either model kind
    prompt        text, or token ids
    max_tokens    at most this many new tokens; generation also ends at the model's EOS
    temperature   0 (the default) is greedy and deterministic; above 0 samples, reproducibly
                  for a given `seed` (top_p / top_k narrow the choice)
    stop          strings that end generation; they are not part of the output
    cache         a KV cache from `make_cache(loaded.model, CacheConfig(...))`: pass one to read
                  `current_length`, `stored_count`, `nbytes` afterwards. It is extended, not
                  reset: reuse it to continue the same text, make a new one for a new prompt.
    cache_config  the policy for a fresh cache when `cache` is not given (default: full fp32)

    Raises `ContextLengthError` when the prompt exceeds a full cache's context, `ValueError`
    for a bad setting.
    """
    if cache is not None and cache_config is not None:
        raise ValueError("give cache or cache_config, not both (a cache carries its own config)")
    if cache is None:
        cache = make_cache(loaded.model, cache_config or CacheConfig())
    sample_config = SampleConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, seed=seed, stop=tuple(stop))
    ids = prompt if isinstance(prompt, str) else list(prompt)
    for chunk in stream_generate(loaded, ids, cache.config, sample_config, cache=cache):
        if chunk.text:
            yield chunk.text


def generate_text(loaded: Any, prompt: Union[str, Sequence[int]], *, max_tokens: int = 200,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  seed: Optional[int] = None, stop: Sequence[str] = (), cache: Optional[KVCache] = None,
                  cache_config: Optional[CacheConfig] = None) -> str:
    """Generate and return the new text (the prompt not included). Same arguments as
    `stream_text`; greedy by default, so the same call gives the same text."""
    return "".join(stream_text(loaded, prompt, max_tokens=max_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, seed=seed, stop=stop, cache=cache,
                               cache_config=cache_config))
