"""Pass-key accuracy: greedy retrieval of a needle with the full (unevicted, fp32) cache, the
probe training reports (benchmarks/model_report.py); documents from `corpus.make_needle_doc_tokens`."""

from __future__ import annotations

import random
from typing import Any, Optional

from ..cache import make_cache
from ..corpus import PASSKEY_TEMPLATE, make_needle_doc_tokens, random_value
from ..generate import greedy_tokens
from .needle import passed


def passkey_accuracy(model: Any, tokenizer: Any, filler: str, n_tokens: int, trials: int = 50,
                     seed: int = 0, template: Optional[int] = PASSKEY_TEMPLATE,
                     digits: int = 5) -> dict:
    """Greedy pass-key retrieval with an MLX model and the full (unevicted, fp32) cache.

    model      any model `tinygpt_mlx.make_cache` serves (native TinyGPT or mlx-lm); the prompt
               is prefilled in one chunk, then `digits + 1` tokens are decoded greedily
    tokenizer  anything with `encode(str) -> ids` and `decode(ids) -> str`
    filler     held-out text; n_tokens the prompt length; depths spread evenly over [0, 1]
    Returns {"accuracy", "trials", "n_tokens", "results": [(depth, answer, output), ...]}.
    """
    rng = random.Random(seed)
    results, correct = [], 0
    for i in range(trials):
        depth = i / max(1, trials - 1)
        prompt, answer = make_needle_doc_tokens(
            rng, filler, tokenizer.encode, n_tokens - (digits + 2), depth, template=template,
            value=random_value(rng, digits))
        ids = list(tokenizer.encode(prompt))
        with make_cache(model) as cache:
            text = tokenizer.decode(greedy_tokens(model, ids, cache, digits + 1, len(ids)))
        ok = passed(text, answer)
        correct += ok
        results.append((round(depth, 3), answer, text))
    return {"accuracy": correct / trials, "trials": trials, "n_tokens": n_tokens, "results": results}
