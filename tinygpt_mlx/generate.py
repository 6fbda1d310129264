"""Generation against any cache: chunked prefill, then decode, yielding tokens and stats.

`steps` is the one generation loop (a `Step` per model call: prefill chunks, then sampled
tokens; hooks `progress` and `should_stop`); `generate_step` yields its token ids (compare,
needle, the pass-key probe, bench and the retrieval bench). `Reply` is the one text front end
over it (sampler, EOS, detokenization with stop strings, stats), which `sample` and the API
(`stream_generate`), the server's worker and the chat session all drive. Teacher-forced
scoring (perplexity) is not generation and does not use it. No printing here.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

from . import kernel_cache
from .cache import KVCache, compiled, make_cache
from .config import CacheConfig, SampleConfig
from .errors import ContextLengthError
from .model import last_logits
from .sampling import make_sampler
from .textstream import TextStream


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
    #: MLX's built CPU kernels (kernel_cache.count) as the prefill starts and ends: the report
    #: says how many this run had to compile (None off the CPU)
    kernels_at_start: Optional[int] = None
    kernels_after_prefill: Optional[int] = None

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
            # the global layers' bytes (the policy's) and the sliding-window layers' rings'
            "cache_bytes_split": c.nbytes_split() if c is not None else {},
            "sliding_windows": c.sliding_windows if c is not None else {},
            "cache_disk_bytes": c.disk_nbytes if c is not None else 0,
            "layers_with_kv": c.layers_with_kv if c is not None else 0,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "finish_reason": self.finish_reason,
            "peak_rss_bytes": peak_rss_bytes(),
            "policy": c.config.describe() if c is not None else {},
            # kernels MLX's CPU backend compiled during the prefill and the decode: their
            # seconds are inside the speeds above (a policy's first run on a machine)
            "kernels_built": self.kernels_built(),
        }

    def kernels_built(self) -> dict[str, int]:
        """MLX CPU kernels compiled during the prefill and during the decode so far (zeros on
        Metal or CUDA, and when no generation ran)."""
        if self.kernels_at_start is None:
            return {"prefill": 0, "decode": 0}
        return {"prefill": kernel_cache.built(self.kernels_at_start, self.kernels_after_prefill),
                "decode": kernel_cache.built(self.kernels_after_prefill, kernel_cache.count())}


def peak_rss_bytes() -> int:
    """The process's peak resident memory (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def rss_bytes() -> dict[str, int]:
    """Resident memory now: "anon" (the process's own pages) and "file" (pages of mapped files,
    e.g. a disk cold store, which the OS can drop and re-read), from /proc on Linux; elsewhere
    the peak, all counted as "anon"."""
    try:
        with open("/proc/self/status") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}
        return {"anon": kib["RssAnon"] * 1024, "file": kib["RssFile"] * 1024}
    except (OSError, KeyError, ValueError):
        return {"anon": peak_rss_bytes(), "file": 0}


def forward(model: Any, tokens: mx.array, cache: Any, last: bool = False) -> mx.array:
    """One model call on [1, L] tokens, the product's only one: each layer cache evicts what its
    policy drops as it takes the tokens (cache/plan.py), and a `KVCache` is then trimmed to hold
    exactly what its policy keeps between calls (a call of L > 1 tokens leaves a window's layers
    `window - 1 + L`: what reports, checkpoints and prompt-cache files see). A decode step over
    full StreamingLLM rings or KIVI's quiet steps runs as one compiled function
    (cache/compiled.py); an eager decode step before a quiet one of a shape not seen yet traces
    it (`compiled.prepare`), so the quiet steps replay traces. `last`: only the logits after the
    last token are wanted ([B, 1, V], `model.last_logits`), as a prefill pass or a decode step takes them."""
    logits = compiled.decode(model, tokens, cache)
    if logits is None:
        logits = last_logits(model, tokens, cache) if last and tokens.shape[1] > 1 else model(tokens, cache=cache)
        compiled.prepare(model, tokens, cache)
    if isinstance(cache, KVCache) and tokens.shape[1] > 1:
        cache.evict_middle_if_needed()
    return logits


def call(model: Any, tokens: list[int] | mx.array, cache: Any, wait: bool = True) -> mx.array:
    """`forward` on `tokens` (ids, or a sampled [1] array still on the device): the fp32 logits
    after the last token, shape [V], evaluated; with `wait=False` started (`mx.async_eval`) and
    not waited for (`steps`' pipeline; the server's worker)."""
    ids = tokens.astype(mx.int32).reshape(1, -1) if isinstance(tokens, mx.array) else mx.array(tokens)[None]
    logits = forward(model, ids, cache, last=True)[0, -1].astype(mx.float32)
    (mx.eval if wait else mx.async_eval)(logits)
    return logits


def check_context(prompt_tokens: int, context_length: Optional[int], config: CacheConfig) -> None:
    """A full cache cannot hold a prompt longer than the model's trained context."""
    if context_length and not (config.streaming or config.retrieval) and prompt_tokens > context_length:
        raise ContextLengthError(
            f"prompt has {prompt_tokens} tokens but the model's context is {context_length}; "
            "use --streaming-llm-window or retrieval (--kiv-hot-budget), or shorten the prompt")


def pass_end(start: int, total: int, chunk: int, tail: int = 0) -> int:
    """Where the prefill pass that starts at token `start` of a `total`-token prompt ends: `chunk`
    tokens on, except that no pass crosses into the prompt's last `tail` tokens, which are passes
    of their own (`SampleConfig.prefill_tail`, `--prefill-tail`; 0 or >= `total`: the plain
    chunking). With `tail` <= `chunk` the last pass is exactly those `tail` tokens: a retrieval
    policy picks one pool of cold pages per pass, and the answer is read off the last pass's last
    query (docs/gguf.md, "The 32K depth-0.3 cell read with a shorter last pass")."""
    head = total - min(tail, total)
    return min(start + chunk, head if start < head else total)


@dataclass
class Step:
    """One model call of a generation: the tokens it fed (`prompt`: a prefill chunk) and the
    token sampled from its logits; `token` is None after a prefill chunk that is not the
    prompt's last, and where generation ends (max_tokens, EOS, `should_stop`). `logits`: the
    call's fp32 logits after its last token, shape [V]."""
    fed: list[int]
    logits: mx.array
    token: Optional[int] = None
    prompt: bool = False


def steps(model: Any, prompt: list[int], cache: Any, sampler: Callable, max_tokens: int,
          prefill_chunk: int, stats: Optional[GenerationStats] = None, eos_ids: frozenset = frozenset(),
          progress: Optional[Callable[[int, int], None]] = None,
          should_stop: Optional[Callable[[], bool]] = None,
          first_logits: Optional[mx.array] = None, pipeline: bool = False,
          prefill_tail: int = 0) -> Iterator[Step]:
    """The generation engine, one `Step` per model call: the prompt in chunks of
    `prefill_chunk`, its last `prefill_tail` tokens apart from the rest (`pass_end`;
    `progress(done, total)` after each chunk), then up to `max_tokens` sampled
    tokens, each fed back except the last. It ends at an id in `eos_ids` (not yielded as a
    token; finish_reason "stop") or when `should_stop()` is true after a model call
    ("cancel"); a consumer that stops iterating feeds nothing more. `stats` (prompt and
    generated tokens, prefill and decode seconds, finish_reason) is kept current. A consumer
    that times each `next()` times one model call (plus the sampling of its token). With an
    empty `prompt` and `first_logits` (a loaded prompt cache's: the logits after its last
    token), decoding starts from those without a model call.

    `pipeline` (for a consumer that takes every step: no `eos_ids`, no `should_stop`): each
    sampled token is fed back before the host reads it, the model call started with
    `mx.async_eval`, so the host's work on a step (reading the token, the consumer's) overlaps
    the device's on the next, as mlx-lm's generate_step does. The tokens and the cache are the
    same (the last token is never fed); but a step's token is already fed when it is yielded (so
    a consumer that stops early leaves one more token fed than it took, `stats.logits` the logits
    after it, and timing a `next()` times no one model call), and the next call may still be
    running."""
    if not prompt and first_logits is None:
        raise ValueError("the prompt is empty: give at least one token")
    if prefill_tail < 0:
        raise ValueError(f"prefill_tail must be >= 0, got {prefill_tail}")
    if pipeline and (eos_ids or should_stop is not None):
        raise ValueError("a pipelined generation cannot end early: no eos_ids or should_stop")
    stats = stats if stats is not None else GenerationStats(cache=cache)
    stats.prompt_tokens = len(prompt)
    stopped = should_stop or (lambda: False)
    stats.kernels_at_start = kernel_cache.count()
    t0 = time.perf_counter()
    fed, logits = [], first_logits
    done = 0
    while done < len(prompt):
        i, done = done, pass_end(done, len(prompt), prefill_chunk, prefill_tail)
        fed = prompt[i:done]
        logits = call(model, fed, cache)
        if progress is not None:
            progress(done, len(prompt))
        if done < len(prompt):
            yield Step(fed, logits, prompt=True)
            if stopped():
                stats.finish_reason = "cancel"
                return
    stats.prefill_seconds = time.perf_counter() - t0
    stats.kernels_after_prefill = kernel_cache.count()
    stats.logits = logits
    t0 = time.perf_counter()
    stats.finish_reason = "length"
    is_prompt, ahead = True, None
    while True:
        token = None
        if stopped():
            stats.finish_reason = "cancel"
        elif stats.generated_tokens < max_tokens:
            sampled = sampler(logits[None])
            if pipeline and stats.generated_tokens + 1 < max_tokens:
                ahead = stats.logits = call(model, sampled, cache, wait=False)   # fed before the host reads it
            token = int(sampled[0].item())
            stats.generated_tokens += 1
            if token in eos_ids:
                token, stats.finish_reason = None, "stop"
            else:
                stats.tokens.append(token)
        stats.decode_seconds = time.perf_counter() - t0  # kept current: a consumer may stop early
        yield Step(fed, logits, token, is_prompt)
        if token is None or stats.generated_tokens == max_tokens:
            break
        fed, is_prompt = [token], False
        logits = stats.logits = ahead if ahead is not None else call(model, fed, cache)
        ahead = None
    stats.decode_seconds = time.perf_counter() - t0


def generate_step(model: Any, prompt: list[int], cache: Any, sampler: Callable, max_tokens: int,
                  prefill_chunk: int, stats: Optional[GenerationStats] = None,
                  eos_ids: frozenset = frozenset(), progress: Optional[Callable[[int, int], None]] = None,
                  should_stop: Optional[Callable[[], bool]] = None,
                  first_logits: Optional[mx.array] = None, pipeline: bool = False,
                  prefill_tail: int = 0) -> Iterator[int]:
    """The sampled token ids of `steps` (same arguments): up to `max_tokens`, EOS excluded."""
    for step in steps(model, prompt, cache, sampler, max_tokens, prefill_chunk, stats, eos_ids,
                      progress, should_stop, first_logits, pipeline, prefill_tail):
        if step.token is not None:
            yield step.token


def greedy_tokens(model: Any, prompt: list[int], cache: Any, max_tokens: int, prefill_chunk: int,
                  progress: Optional[Callable[[int, int], None]] = None,
                  stats: Optional[GenerationStats] = None, prefill_tail: int = 0) -> list[int]:
    """Exactly `max_tokens` greedy ids after `prompt` (EOS does not stop them): `greedy_steps`' tokens."""
    return [s.token for s in greedy_steps(model, prompt, cache, max_tokens, prefill_chunk, progress, stats,
                                          prefill_tail) if s.token is not None]


def greedy_steps(model: Any, prompt: list[int], cache: Any, max_tokens: int, prefill_chunk: int,
                 progress: Optional[Callable[[int, int], None]] = None,
                 stats: Optional[GenerationStats] = None, prefill_tail: int = 0) -> Iterator[Step]:
    """The `steps` of exactly `max_tokens` greedy tokens after `prompt` (EOS does not stop them),
    pipelined where the device runs apart from the host (`pipelines`)."""
    return steps(model, prompt, cache, make_sampler(0.0), max_tokens, prefill_chunk, stats,
                 progress=progress, pipeline=pipelines(), prefill_tail=prefill_tail)


def pipelines() -> bool:
    """Whether a generation that takes every step pipelines (`steps(pipeline=True)`): on a GPU,
    where the host's work on one step can overlap the device's on the next (mlx-lm's reason);
    not on the CPU backend, where both share the cores and it measured x0.86 to x1.01 of the
    stepwise loop (`python -m benchmarks.pipeline`, docs/architecture.md)."""
    return mx.default_device().type == mx.DeviceType.gpu


def prefill(model: Any, tokens: list[int], cache: Any, chunk: int,
            progress: Optional[Callable[[int, int], None]] = None, tail: int = 0) -> mx.array:
    """Feed `tokens` in chunks through the engine (no token sampled), the last `tail` apart
    (`pass_end`); the fp32 logits after the last one, shape [V]."""
    for step in steps(model, tokens, cache, make_sampler(0.0), 0, chunk, progress=progress, prefill_tail=tail):
        pass
    return step.logits


class Reply:
    """One reply's front end over `steps`, shared by `stream_generate` (`sample`, the API), the
    server's worker and the chat session: the sampler, the EOS set, detokenization with stop
    strings (`TextStream`) and the stats. Iterating gives `(step, text)` per model call, `text`
    the reply's text that step released (often ""); a stop string ends it with finish_reason
    "stop". A consumer may also stop early (`stop()` says why it was a stop); `finish()` then
    gives the text held back for a possible stop string."""

    def __init__(self, model: Any, tokenizer: Any, prompt: list[int], cache: Any, max_tokens: int,
                 prefill_chunk: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: Optional[int] = None, stop: tuple = (), ignore_eos: bool = False,
                 progress: Optional[Callable[[int, int], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None, first_logits: Optional[mx.array] = None,
                 prefill_tail: int = 0):
        self.stats = GenerationStats(cache=cache)
        self.text = TextStream(tokenizer, tuple(stop))
        eos = frozenset() if ignore_eos else frozenset(tokenizer.eos_ids)
        self._steps = steps(model, prompt, cache, make_sampler(temperature, top_p, top_k, seed), max_tokens,
                            prefill_chunk, self.stats, eos, progress, should_stop, first_logits,
                            prefill_tail=prefill_tail)

    def __iter__(self) -> Iterator[tuple[Step, str]]:
        for step in self._steps:
            piece = self.text.add(step.token) if step.token is not None else ""
            if self.stopped:
                self.stop()
            yield step, piece
            if self.stopped:
                return

    @property
    def stopped(self) -> bool:
        """Whether a stop string has ended the text (the last step's text is what precedes it)."""
        return self.text.stopped

    def stop(self) -> None:
        """The consumer ends the reply as a stop (a stop string, a loop), not a length."""
        self.stats.finish_reason = "stop"

    def finish(self) -> str:
        """The text held back at the end (none after a stop string)."""
        return self.text.finish()


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
    s = sample_config
    reply = Reply(loaded.model, tok, ids, cache, s.max_tokens, s.prefill_chunk, s.temperature, s.top_p, s.top_k,
                  s.seed, s.stop, s.ignore_eos, progress, first_logits=first_logits, prefill_tail=s.prefill_tail)
    for step, piece in reply:
        if piece:
            yield Chunk(piece, step.token)
    tail = reply.finish()
    if tail:
        yield Chunk(tail)
    yield Chunk("", done=True, stats=reply.stats)
