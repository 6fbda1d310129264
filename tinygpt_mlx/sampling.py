"""`make_sampler`: a closure from logits to a token id (greedy at temperature 0)."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from .config import random_seed


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: Optional[int] = None) -> Callable[[mx.array], mx.array]:
    """Sampler over logits [..., V] (computed in fp32). Deterministic for a given `seed`."""
    if temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    key = [mx.random.key(seed if seed is not None else random_seed())]

    def sample(logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32) / temperature
        if top_k and top_k < logits.shape[-1]:
            kth = mx.sort(logits, axis=-1)[..., -top_k][..., None]
            logits = mx.where(logits < kth, -mx.inf, logits)
        if top_p < 1.0:
            order = mx.argsort(-logits, axis=-1)
            sorted_logits = mx.take_along_axis(logits, order, axis=-1)
            probs = mx.softmax(sorted_logits, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop_sorted = (mx.cumsum(probs, axis=-1) - probs) >= top_p
            drop = mx.put_along_axis(mx.zeros_like(drop_sorted), order, drop_sorted, axis=-1)
            logits = mx.where(drop, -mx.inf, logits)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logits, axis=-1, key=sub)

    return sample
