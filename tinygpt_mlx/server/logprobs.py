"""Log-probabilities of the generated tokens (OpenAI's `logprobs`/`top_logprobs`, ollama's same
fields): parsed from the request, computed by the worker from each step's logits, written in each
API's shape.

A token's log-probability is taken from the model's distribution at that step (log-softmax of
its fp32 logits), before temperature, top-k and top-p shape the sampling, as OpenAI reports it.
The alternatives are the `top` most likely tokens, most likely first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

MAX_TOP = 20          # OpenAI's limit on top_logprobs (legacy completions: 5)


class LogprobError(ValueError):
    """A logprobs field of the wrong type or range (answered with 400)."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def parse(body: dict, legacy: bool = False) -> Optional[int]:
    """How many alternatives to report per token, or None when logprobs are off. `legacy`:
    /v1/completions, where `logprobs` itself is that count (0-5)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if legacy:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
            raise LogprobError(f"logprobs must be an integer in [0, 5] here, got {value!r}")
        return value
    if value is not None and not isinstance(value, bool):
        raise LogprobError(f"logprobs must be true or false, got {value!r}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP):
        raise LogprobError(f"top_logprobs must be an integer in [0, {MAX_TOP}], got {top!r}")
    if not value:
        if top:
            raise LogprobError("top_logprobs needs logprobs: true")
        return None
    return top or 0


def of(logits: mx.array, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` ([V]) and the `top` most likely alternatives."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp)
    alts: list[tuple[int, float]] = []
    if top:
        ids = mx.argpartition(-lp, kth=top - 1)[:top]
        vals = lp[ids]
        alts = sorted(zip(ids.tolist(), vals.tolist()), key=lambda a: -a[1])
    return TokenLogprob(token, float(lp[token].item()), alts)


def _piece(tokenizer: Any, token: int) -> dict:
    text = tokenizer.decode([token])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def openai_chat(entries: list[TokenLogprob], tokenizer: Any) -> dict:
    """OpenAI chat's `logprobs`: the same per-token entries as ollama's, under `content`."""
    return {"content": ollama(entries, tokenizer), "refusal": None}


def openai_completion(entries: list[TokenLogprob], tokenizer: Any) -> dict:
    tokens = [tokenizer.decode([e.token]) for e in entries]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def ollama(entries: list[TokenLogprob], tokenizer: Any) -> list[dict]:
    return [dict(_piece(tokenizer, e.token), logprob=e.logprob,
                 top_logprobs=[dict(_piece(tokenizer, t), logprob=v) for t, v in e.top]) for e in entries]
