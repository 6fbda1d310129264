"""The server tests' common start: caches prefilled in pairs, one to step alone, one batched.

Imported by the lockstep tests (test_server_parallel, test_server_kivi_fill, _joined, _even,
test_retrieval_in_place), which hold every batched row to the same sequence stepped alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.generate import prefill
from tinygpt_mlx.server import batch


def prefilled_pairs(model: Any, prompts: list, cfg: Any, *, chunk: int = 16, fresh: bool = False,
                    kept: bool = False) -> tuple[list, list, list[int]]:
    """Two caches per prompt, each prefilled with it in chunks of `chunk`: `solo` (to step alone)
    and `together` (to step batched), and each prompt's first greedy token (from the solo
    prefill's logits). `cfg` is a CacheConfig, or a function of no argument making one cache (a
    cache set up past its config). `fresh`: the model's batched traces forgotten afterwards
    (`batch.forget`: a trace kept from another test would not be made again); `kept`: the joined
    KIVI runs and buffers kept between steps dropped too (`batch.drop_kept`)."""
    make = cfg if callable(cfg) else (lambda: make_cache(model, cfg))
    solo, together, tokens = [make() for _ in prompts], [make() for _ in prompts], []
    for ids, a, b in zip(prompts, solo, together):
        tokens.append(int(mx.argmax(prefill(model, ids, a, chunk)).item()))
        prefill(model, ids, b, chunk)
    if fresh:
        batch.forget(model)
    if kept:
        batch.drop_kept()
    return solo, together, tokens

