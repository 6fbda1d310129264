"""Teacher-forced perplexity through the cached path, and KL / top-1 agreement to a baseline.

The text is fed as `sample` feeds a prompt and its continuation: a first chunk through
`generate.prefill`'s code (`generate.forward` on [1, P] tokens), then one token at a time
through `generate.forward`, so the noise of quantised storage and of eviction is in the
logits being scored. The baseline (the fp32 full cache by default) runs side by side, step by
step, on a second cache: only the running sums are kept, never the logits, so a text of any
length streams through in bounded memory (bounded by the caches themselves).

    perplexity      exp(mean NLL of token t+1 given tokens <= t) under the policy
    segment_perplexity  the same over each run of `segment` scored positions (StreamingLLM's
                    curve past the trained context), when asked for
    kl_mean         mean over positions of KL(p_baseline || p_policy), in nats
    top1_agreement  fraction of positions where both argmaxes agree
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from ..cache import make_cache
from ..config import CacheConfig
from ..errors import ContextLengthError
from ..generate import check_context, forward

from .defaults import PERPLEXITY_PREFILL_TOKENS as PREFILL_TOKENS



@dataclass
class PerplexityResult:
    tokens: int                      # positions scored (text tokens - 1)
    perplexity: float
    baseline_perplexity: Optional[float] = None
    kl_mean: Optional[float] = None
    top1_agreement: Optional[float] = None
    stored_count: int = 0            # as the policy's cache reports them at the end
    current_length: int = 0
    cache_bytes: int = 0
    segment_perplexity: Optional[list] = None

    def to_dict(self) -> dict:
        return asdict(self)


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _nll(logp: mx.array, targets: mx.array) -> mx.array:
    return -mx.take_along_axis(logp, targets[:, None], axis=-1).sum()


def perplexity(model: Any, tokens: list[int], config: CacheConfig,
               baseline: Optional[CacheConfig] = CacheConfig(), prefill_tokens: int = PREFILL_TOKENS,
               context_length: Optional[int] = None,
               progress: Optional[Callable[[int, int], None]] = None) -> PerplexityResult:
    """Score `tokens` under `config` (and `baseline` side by side unless None)."""
    return perplexities(model, tokens, {"policy": config}, baseline, prefill_tokens, context_length,
                        progress)["policy"]


def perplexities(model: Any, tokens: list[int], configs: dict[str, CacheConfig],
                 baseline: Optional[CacheConfig] = CacheConfig(), prefill_tokens: int = PREFILL_TOKENS,
                 context_length: Optional[int] = None,
                 progress: Optional[Callable[[int, int], None]] = None,
                 segment: Optional[int] = None, score_chunk: int = 1) -> dict[str, PerplexityResult]:
    """Score `tokens` under every policy in `configs`, all side by side with one baseline run.

    `context_length` (the model's) is checked as `sample` checks a prompt: a full cache cannot
    hold more, so a long text needs an evicting policy and `baseline=None` (None skips the check:
    the full cache past the trained context, to show how it fails).
    `progress(done, total)` is called as positions are scored. `segment`: also report the
    perplexity of each run of that many scored positions. `score_chunk`: after the prefill chunk,
    feed this many tokens per model call (1, the default, is how decoding feeds them; more is
    the same for a full cache and faster, but lets an evicting cache see a chunk's tokens before
    it evicts).
    """
    if score_chunk < 1:
        raise ValueError(f"score_chunk must be >= 1, got {score_chunk}")
    if segment is not None and segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    if len(tokens) < 2:
        raise ValueError(f"the text must have at least 2 tokens to score, got {len(tokens)}")
    if prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
    if not configs:
        raise ValueError("give at least one policy to score")
    for config in configs.values():
        check_context(len(tokens), context_length, config)
    if baseline is not None:
        try:
            check_context(len(tokens), context_length, baseline)
        except ContextLengthError as e:
            raise ContextLengthError(f"the full-cache baseline cannot hold the text ({e}); "
                                     "skip it with --baseline none") from None
    caches = {name: make_cache(model, config) for name, config in configs.items()}
    base_cache = make_cache(model, baseline) if baseline is not None else None
    zero = mx.array(0.0)
    sums = {name: {"nll": zero, "kl": zero, "agree": zero} for name in configs}
    base_nll, total = zero, len(tokens) - 1
    first = min(prefill_tokens, total)

    def score(x: list[int], y: list[int]) -> None:
        nonlocal base_nll
        x, y = mx.array(x)[None], mx.array(y)
        if base_cache is not None:
            blogp = _log_softmax(forward(model, x, base_cache)[0])
            base_nll = base_nll + _nll(blogp, y)
        for name, cache in caches.items():
            logp, acc = _log_softmax(forward(model, x, cache)[0]), sums[name]
            acc["nll"] = acc["nll"] + _nll(logp, y)
            if base_cache is not None:
                acc["kl"] = acc["kl"] + (mx.exp(blogp) * (blogp - logp)).sum()
                acc["agree"] = acc["agree"] + (mx.argmax(logp, -1) == mx.argmax(blogp, -1)).sum()
        mx.eval(base_nll, sums)  # only these scalars outlive the step

    marks: dict[str, list[tuple[int, float]]] = {name: [] for name in configs}   # (end, NLL sum)

    def mark(done: int) -> None:
        if segment is not None and (done % segment == 0 or done == total):
            for name in configs:
                marks[name].append((done, sums[name]["nll"].item()))

    score(tokens[:first], tokens[1:first + 1])        # the prefill chunk
    if progress is not None:
        progress(first, total)
    done = first
    while done < total:                               # then as decoding feeds them
        step = min(score_chunk, total - done)
        if segment is not None:                       # a chunk never straddles a segment end
            step = min(step, segment - done % segment)
        score(tokens[done:done + step], tokens[done + 1:done + step + 1])
        done += step
        mark(done)
        if progress is not None:
            progress(done, total)
    out = {}
    for name, cache in caches.items():
        acc = sums[name]
        r = PerplexityResult(tokens=total, perplexity=math.exp(acc["nll"].item() / total),
                             stored_count=cache.stored_count, current_length=cache.current_length,
                             cache_bytes=cache.nbytes)
        if segment is not None:
            r.segment_perplexity = _segments(marks[name])
        if base_cache is not None:
            r.baseline_perplexity = math.exp(base_nll.item() / total)
            r.kl_mean = max(0.0, acc["kl"].item() / total)
            r.top1_agreement = acc["agree"].item() / total
        out[name] = r
    return out


def _segments(marks: list[tuple[int, float]]) -> list[dict]:
    """Perplexity between consecutive marks (end position, running NLL sum), from position 0."""
    out, prev_end, prev_sum = [], 0, 0.0
    for end, nll in marks:
        out.append({"start": prev_end, "end": end, "perplexity": math.exp((nll - prev_sum) / (end - prev_end))})
        prev_end, prev_sum = end, nll
    return out
