"""One decode step over several sequences, each with its own cache: the batched forward.

The server's scheduler (worker.py) runs every active request's next token through one model
call: the embedding, the projections, RoPE, the MLP and the head run once over a batch of B
rows, and attention runs per sequence over that sequence's own cache, whatever its policy
(full, StreamingLLM, KIVI, retrieval and their compositions: each `LayerCache` keeps its own
plan, eviction, positions and kernels). The model code is unchanged: it sees, for each layer,
a `BatchLayer` that speaks the per-layer cache protocol (`offset`, `make_mask`,
`update_and_fetch`, `attend`) for all B sequences at once:

- `offset` is an array of B positions, which `mx.fast.rope` takes per row (each sequence
  rotates its query and key at its own position, as it would alone);
- `make_mask` (the models ask the first layer once per call) takes each sequence's own mask and
  hands the model a `PerSequence` holding them, which the model passes on unopened;
- `update_and_fetch` hands each sequence its row of the new keys and values (its own `commit`);
- `attend` (through `attention.scaled_dot_product_attention`, which calls it for any cache that
  `reads_own_segments`) runs each sequence's own attention on its row of the queries, with its
  own mask, and stacks the B outputs.

So each row's attention is exactly the computation the sequence runs alone (the eager path,
which agrees with the compiled decode step to the last bit: tests/test_compiled.py); only the
projections see B rows where they saw one. Only caches of ours batch (`batchable`): a layer
with a model-owned cache keeps the solo path.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from ..cache import KVCache
from ..cache.layer import LayerCache


class PerSequence:
    """The masks of a batched call, one per sequence (None where that sequence needs none)."""

    def __init__(self, masks: list):
        self.masks = masks


class BatchLayer:
    """One model layer's caches of B sequences behind the per-layer protocol (module doc)."""

    reads_own_segments = True     # attention.scaled_dot_product_attention calls `attend`

    def __init__(self, caches: Sequence[LayerCache]):
        self.caches = list(caches)

    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches], dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> PerSequence:
        return PerSequence([c.make_mask(N, return_array=return_array, window_size=window_size)
                            for c in self.caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        for i, c in enumerate(self.caches):
            c.update_and_fetch(keys[i:i + 1], values[i:i + 1])
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        masks = mask.masks if isinstance(mask, PerSequence) else [mask] * len(self.caches)
        outs = [c.attend(queries[i:i + 1], scale, m) for i, (c, m) in enumerate(zip(self.caches, masks))]
        return mx.concatenate(outs, axis=0)


#: model types whose code is known to batch this way (their layers read only `offset`, the mask
#: and `update_and_fetch` of the cache, and attend through attention.py): the native TinyGPT and
#: mlx-lm's Llama (SmolLM2); any other runs one call per sequence, still interleaved
BATCHED_MODEL_TYPES = frozenset({"tinygpt", "llama"})


def batches(model: Any) -> bool:
    """Whether `model`'s decode steps may run batched (`BATCHED_MODEL_TYPES`)."""
    return getattr(model, "model_type", None) in BATCHED_MODEL_TYPES


def batchable(cache: Any) -> bool:
    """Whether a sequence's cache can join a batched step: a `KVCache` whose every layer is ours."""
    return isinstance(cache, KVCache) and len(cache.owned) == len(cache.distinct()) and len(cache) > 0


def batch_layers(caches: Sequence[KVCache]) -> list[BatchLayer]:
    """The per-layer view of B sequences' caches: layer i's `BatchLayer` holds every sequence's
    layer-i cache; layers that share one cache (YOCO) share one `BatchLayer`, as they share
    the cache in each sequence."""
    first = caches[0]
    made: dict[int, BatchLayer] = {}
    out = []
    for i, layer in enumerate(first):
        key = id(layer)
        if key not in made:
            made[key] = BatchLayer([c[i] for c in caches])
        out.append(made[key])
    return out


def decode_step(model: Any, tokens: Sequence[int], caches: Sequence[KVCache]) -> mx.array:
    """One decode step of B sequences: `tokens[i]` fed to `caches[i]` (each advanced by one
    token); the fp32 logits after each, shape [B, V], evaluated."""
    ids = mx.array(list(tokens), dtype=mx.int32)[:, None]
    logits = model(ids, cache=batch_layers(caches))[:, -1].astype(mx.float32)
    mx.eval(logits)
    return logits
