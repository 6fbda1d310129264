"""Generation against any cache: chunked prefill, then decode, yielding tokens and stats.

`generate_step` is the engine (token ids in, token ids out); `stream_generate` adds the
tokenizer, incremental detokenization, stop strings and the report. No printing here.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

from .cache import KVCache, make_cache
from .config import CacheConfig, SampleConfig
from .errors import ContextLengthError
from .sampling import make_sampler


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = "length"
    cache: Optional[KVCache] = None
    notes: list[str] = field(default_factory=list)
    #: every token yielded, and the logits the next token would be sampled from (after the last
    #: token fed): what `--save-prompt-cache` writes (cache/persist.py); not in the report
    tokens: list[int] = field(default_factory=list)
    logits: Optional[mx.array] = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def report(self) -> dict:
        """The numbers the CLI and server show: all read from the cache, none recomputed."""
        c = self.cache
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "current_length": c.current_length if c is not None else 0,
            "stored_count": c.stored_count if c is not None else 0,
            "cache_bytes": c.nbytes if c is not None else 0,
            "cache_bytes_breakdown": c.nbytes_breakdown() if c is not None else {},
            "cache_disk_bytes": c.disk_nbytes if c is not None else 0,
            "layers_with_kv": c.layers_with_kv if c is not None else 0,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "finish_reason": self.finish_reason,
            "peak_rss_bytes": peak_rss_bytes(),
            "policy": c.config.describe() if c is not None else {},
        }


def peak_rss_bytes() -> int:
    """The process's peak resident memory (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def forward(model: Any, tokens: mx.array, cache: KVCache) -> mx.array:
    """One model call on [1, L] tokens; trims the cache to its policy afterwards."""
    logits = model(tokens, cache=cache)
    cache.evict_middle_if_needed()
    return logits


def prefill(model: Any, tokens: list[int], cache: KVCache, chunk: int,
            progress: Optional[Callable[[int, int], None]] = None) -> mx.array:
    """Feed `tokens` in chunks; returns the fp32 logits after the last one, shape [V]."""
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token")
    logits = None
    for i in range(0, len(tokens), chunk):
        piece = mx.array(tokens[i:i + chunk])[None]
        logits = forward(model, piece, cache)[:, -1, :]
        mx.eval(logits)
        if progress is not None:
            progress(min(i + chunk, len(tokens)), len(tokens))
    return logits[0].astype(mx.float32)


def check_context(prompt_tokens: int, context_length: Optional[int], config: CacheConfig) -> None:
    """A full cache cannot hold a prompt longer than the model's trained context."""
    if context_length and not (config.streaming or config.retrieval) and prompt_tokens > context_length:
        raise ContextLengthError(
            f"prompt has {prompt_tokens} tokens but the model's context is {context_length}; "
            "use --streaming-llm-window or retrieval (--kiv-hot-budget), or shorten the prompt")


def generate_step(model: Any, prompt: list[int], cache: KVCache, sampler: Callable,
                  max_tokens: int, prefill_chunk: int, stats: GenerationStats,
                  eos_ids: frozenset = frozenset(),
                  progress: Optional[Callable[[int, int], None]] = None,
                  first_logits: Optional[mx.array] = None) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids; fills `stats` as it goes. With an empty
    `prompt` and `first_logits` (a loaded prompt cache's), decoding starts from those."""
    t0 = time.perf_counter()
    logits = first_logits if (not prompt and first_logits is not None) else prefill(
        model, prompt, cache, prefill_chunk, progress)
    stats.logits = logits
    stats.prompt_tokens = len(prompt)
    stats.prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(max_tokens):
        token = int(sampler(logits[None])[0].item())
        stats.generated_tokens += 1
        stats.decode_seconds = time.perf_counter() - t0  # kept current: a consumer may stop early
        if token in eos_ids:
            stats.finish_reason = "stop"
            return
        stats.tokens.append(token)
        yield token
        if stats.generated_tokens == max_tokens:
            break
        logits = forward(model, mx.array([[token]]), cache)[0, -1].astype(mx.float32)
        stats.logits = logits
    stats.decode_seconds = time.perf_counter() - t0
    stats.finish_reason = "length"


@dataclass
class Chunk:
    """A piece of streamed output: `text` (may be empty), and `stats` once `done`."""
    text: str
    token: Optional[int] = None
    done: bool = False
    stats: Optional[GenerationStats] = None


def stream_generate(loaded: Any, prompt: str | list[int], cache_config: CacheConfig,
                    sample_config: SampleConfig, cache: Optional[KVCache] = None,
                    progress: Optional[Callable[[int, int], None]] = None,
                    first_logits: Optional[mx.array] = None) -> Iterator[Chunk]:
    """Generate text from a loaded model; the last chunk has `done=True` and the stats.
    A `cache` that already holds tokens (a loaded prompt cache) is continued: `prompt` is what
    follows them (may be empty with `first_logits`, the logits after its last token)."""
    tok = loaded.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    check_context(len(ids) + (cache.current_length if cache is not None else 0), loaded.context_length,
                  cache_config)
    cache = cache if cache is not None else make_cache(loaded.model, cache_config)
    stats = GenerationStats(cache=cache)
    sampler = make_sampler(sample_config.temperature, sample_config.top_p,
                           sample_config.top_k, sample_config.seed)
    detok = tok.detokenizer()
    stops = sample_config.stop
    eos = frozenset() if sample_config.ignore_eos else frozenset(tok.eos_ids)
    held = ""  # text held back while it might be the start of a stop string
    for token in generate_step(loaded.model, ids, cache, sampler, sample_config.max_tokens,
                               sample_config.prefill_chunk, stats, eos, progress, first_logits):
        held += detok.add(token)
        if stops:
            hit = min((held.find(s) for s in stops if s in held), default=-1)
            if hit >= 0:
                if held[:hit]:
                    yield Chunk(held[:hit], token)
                stats.finish_reason = "stop"
                yield Chunk("", done=True, stats=stats)
                return
        cut = len(held) - max((len(s) - 1 for s in stops), default=0)
        emit, held = (held[:cut], held[cut:]) if cut > 0 else ("", held)
        if emit:
            yield Chunk(emit, token)
    tail = held + detok.finalize()
    if tail:
        yield Chunk(tail)
    yield Chunk("", done=True, stats=stats)
