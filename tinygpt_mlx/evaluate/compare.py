"""Greedy prefix match: how long a cache policy reproduces the fp32 full-cache generation.

For each prompt, greedy (temperature 0) decoding runs through `generate.greedy_tokens` (the
code `sample` uses) once with the baseline cache and once per policy. The metric is the number
of tokens reproduced before the first divergence over the tokens generated. End-of-text does
not stop the runs, so every run generates exactly `tokens` tokens and the rates compare.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Callable, Optional, Sequence

from ..cache import make_cache
from ..config import CacheConfig, SampleConfig, field_default
from .. import generate
from ..generate import check_context
from .defaults import COMPARE_TOKENS as DEFAULT_TOKENS
from .inputs import read_text

PREFILL_CHUNK = field_default(SampleConfig, "prefill_chunk")


def prefix_match(reference: Sequence[int], candidate: Sequence[int]) -> tuple[int, float]:
    """(matched, rate): tokens equal before the first divergence, over the longer length.

    Identical sequences give rate 1.0, a divergence at index k gives k / n, and two empty
    sequences give (0, 1.0): nothing was generated, so nothing diverged.
    """
    matched = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        matched += 1
    n = max(len(reference), len(candidate))
    return matched, (matched / n if n else 1.0)


def default_prompts() -> list[str]:
    """The prompt set shipped with the package (tinygpt_mlx/data/prompts.txt)."""
    return read_prompts(resources.files("tinygpt_mlx") / "data" / "prompts.txt")


def read_prompts(path) -> list[str]:
    """One prompt per non-blank line, or in a `.jsonl` file one JSON string per line (a prompt
    that keeps its newlines: code, licences); a missing or non-UTF-8 file, or a line that is not
    a JSON string, is one error naming it."""
    lines = [(i, line.strip()) for i, line in enumerate(read_text(path).splitlines(), 1)]
    lines = [(i, line) for i, line in lines if line]
    if str(path).endswith(".jsonl"):
        prompts = []
        for i, line in lines:
            try:
                prompt = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{i}: a .jsonl prompt file holds one non-empty JSON string per line")
            prompts.append(prompt)
    else:
        prompts = [line for _, line in lines]
    if not prompts:
        raise ValueError(f"{path}: no prompts (one per line)")
    return prompts


def greedy_tokens(model, prompt_ids: list[int], config: CacheConfig, tokens: int,
                  prefill_chunk: int = PREFILL_CHUNK, prefill_tail: int = 0) -> list[int]:
    """Exactly `tokens` greedy token ids after `prompt_ids` under the policy `config` (the prompt's
    last `prefill_tail` tokens prefilled apart: `generate.pass_end`)."""
    with make_cache(model, config) as cache:
        return generate.greedy_tokens(model, prompt_ids, cache, tokens, prefill_chunk, prefill_tail=prefill_tail)


def compare(loaded, prompts: list[str], modes: dict[str, CacheConfig], tokens: int = DEFAULT_TOKENS,
            baseline: tuple[str, CacheConfig] = ("fp32", CacheConfig()),
            progress: Optional[Callable[[], None]] = None, prefill_tail: int = 0,
            prefill_chunk: int = PREFILL_CHUNK) -> dict:
    """Prefix match of every mode against the baseline on every prompt (JSON-shaped result).

    `progress` is called after each generation (len(prompts) * (1 + len(modes)) calls).
    `prefill_tail`: every run (the baseline's too) prefills the prompt's last that many tokens as
    a pass of their own (`generate.pass_end`; 0 = off); the rest in passes of `prefill_chunk`.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    encoded = []
    for p in prompts:
        ids = loaded.tokenizer.encode(p)
        if not ids:
            raise ValueError(f"prompt {p!r} encodes to no tokens")
        for config in (baseline[1], *modes.values()):
            check_context(len(ids), loaded.context_length, config)
        encoded.append(ids)
    results = {name: [] for name in modes}
    references = []
    for prompt, ids in zip(prompts, encoded):
        ref = greedy_tokens(loaded.model, ids, baseline[1], tokens, prefill_chunk, prefill_tail)
        references.append(loaded.tokenizer.decode(ref))
        if progress:
            progress()
        for name, config in modes.items():
            matched, rate = prefix_match(ref, greedy_tokens(loaded.model, ids, config, tokens, prefill_chunk,
                                                            prefill_tail))
            results[name].append({"prompt": prompt, "prefix_match": rate, "matched_tokens": matched})
            if progress:
                progress()
    return {
        "baseline": baseline[0],
        "baseline_policy": baseline[1].describe(),
        "tokens": tokens,
        "prefill_tail": prefill_tail,
        "prefill_chunk": prefill_chunk,
        "baseline_texts": references,
        "modes": {name: {"policy": modes[name].describe(), "label": modes[name].label(),
                         "mean_prefix_match": sum(r["prefix_match"] for r in rows) / len(rows),
                         "prompts": rows}
                  for name, rows in results.items()},
    }
