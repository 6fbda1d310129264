"""The pre-RoPE reference paths that frame positions replaced, built for the tests.

The product keeps a StreamingLLM window, a KIVI body under StreamingLLM and a retrieval hot
window on frame positions (cache/positions.py): the keys stay as the model rotated them, and
only the sink and retrieved keys are placed. The simple paths they replaced keep every key
before RoPE and rotate it to its slot on every read (sink and window as two position-ordered
stores; KIVI's keys frozen at virtual slots, the query turned; the hot window placed after
the retrieval slots): slower, and plainly right, so the frame paths are tested against them.

`make_cache(model, config, ring=False)` builds them (`ring=True`: the product's caches).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tinygpt_mlx.cache import factory
from tinygpt_mlx.cache.kv_cache import KVCache
from tinygpt_mlx.cache.layer import LayerCache
from tinygpt_mlx.cache.positions import Positions
from tinygpt_mlx.config import CacheConfig


def prerope_layer(config: CacheConfig, rope: Optional[Callable], layer_index: int = 0) -> LayerCache:
    """One layer's cache on the pre-RoPE path (module doc)."""
    positions = Positions(config, rope, frame=False)
    if config.quantised and config.retrieval and positions.shifted:
        raise ValueError("KIVI with shifted retrieval runs on frame positions only (no pre-RoPE path: "
                         "the retrieval slots would move the frozen body's slots)")
    return factory.segmented_layer(config, positions, layer_index)


def make_cache(model: Any, config: Optional[CacheConfig] = None, ring: bool = True) -> KVCache:
    """The product's cache (`ring=True`) or the pre-RoPE reference path (`ring=False`)."""
    return factory.make_cache(model, config, **({} if ring else {"layer": prerope_layer}))
