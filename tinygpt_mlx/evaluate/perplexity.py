"""Teacher-forced perplexity through the cached path, and KL / top-1 agreement to a baseline.

The text is fed as `sample` feeds a prompt and its continuation: a first chunk through
`generate.prefill`'s code (`generate.forward` on [1, P] tokens), then one token at a time
through `generate.forward`, so the noise of quantised storage and of eviction is in the
logits being scored. The baseline (the fp32 full cache by default) runs side by side, step by
step, on a second cache: only the running sums are kept, never the logits, so a text of any
length streams through in bounded memory (bounded by the caches themselves).

    perplexity      exp(mean NLL of token t+1 given tokens <= t) under the policy
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

PREFILL_TOKENS = 64


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

    def to_dict(self) -> dict:
        return asdict(self)


class _Sums:
    """Running sums over scored positions, kept as lazy mx scalars (evaluated each step)."""

    def __init__(self) -> None:
        self.nll = mx.array(0.0)
        self.base_nll = mx.array(0.0)
        self.kl = mx.array(0.0)
        self.agree = mx.array(0)

    def add(self, logits: mx.array, targets: mx.array, base: Optional[mx.array]) -> None:
        """logits/base [T, V] predicting targets [T]."""
        logp = _log_softmax(logits)
        self.nll = self.nll - mx.take_along_axis(logp, targets[:, None], axis=-1).sum()
        if base is not None:
            blogp = _log_softmax(base)
            self.base_nll = self.base_nll - mx.take_along_axis(blogp, targets[:, None], axis=-1).sum()
            self.kl = self.kl + (mx.exp(blogp) * (blogp - logp)).sum()
            self.agree = self.agree + (mx.argmax(logp, axis=-1) == mx.argmax(blogp, axis=-1)).sum()
        mx.eval(self.nll, self.base_nll, self.kl, self.agree)


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def perplexity(model: Any, tokens: list[int], config: CacheConfig,
               baseline: Optional[CacheConfig] = CacheConfig(), prefill_tokens: int = PREFILL_TOKENS,
               context_length: Optional[int] = None,
               progress: Optional[Callable[[int, int], None]] = None) -> PerplexityResult:
    """Score `tokens` under `config` (and `baseline` side by side unless None).

    `context_length` (the model's) is checked as `sample` checks a prompt: a full cache cannot
    hold more, so a long text needs an evicting policy and `baseline=None`.
    `progress(done, total)` is called as positions are scored.
    """
    if len(tokens) < 2:
        raise ValueError(f"the text must have at least 2 tokens to score, got {len(tokens)}")
    if prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
    check_context(len(tokens), context_length, config)
    if baseline is not None:
        try:
            check_context(len(tokens), context_length, baseline)
        except ContextLengthError as e:
            raise ContextLengthError(f"the full-cache baseline cannot hold the text ({e}); "
                                     "skip it with --baseline none") from None
    caches = [make_cache(model, config)] + ([make_cache(model, baseline)] if baseline is not None else [])
    sums, total = _Sums(), len(tokens) - 1
    first = min(prefill_tokens, total)

    def score(x: list[int], y: list[int]) -> None:
        out = [forward(model, mx.array(x)[None], c)[0] for c in caches]
        sums.add(out[0], mx.array(y), out[1] if baseline is not None else None)

    score(tokens[:first], tokens[1:first + 1])        # the prefill chunk
    if progress is not None:
        progress(first, total)
    for i in range(first, total):                     # then token by token, as decoding does
        score(tokens[i:i + 1], tokens[i + 1:i + 2])
        if progress is not None:
            progress(i + 1, total)
    cache = caches[0]
    result = PerplexityResult(tokens=total, perplexity=math.exp(sums.nll.item() / total),
                              stored_count=cache.stored_count, current_length=cache.current_length,
                              cache_bytes=cache.nbytes)
    if baseline is not None:
        result.baseline_perplexity = math.exp(sums.base_nll.item() / total)
        result.kl_mean = max(0.0, sums.kl.item() / total)
        result.top1_agreement = sums.agree.item() / total
    return result
