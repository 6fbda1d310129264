"""The KV cache: the single owner of storage policy (precision, eviction, retrieval).

One-way flow: `CacheConfig` -> `make_cache` (factory.py) -> a `LayerCache` per layer -> its
stores `[sink, body, cold?]` -> the attention segments they contribute. Modules, leaves first:
arrays (growing/disk arrays), positions (RoPE rules), segments (attention over segments),
store (the interface, exact storage), kivi (packed body), cold (retrieval's cold store),
telemetry, kv_cache (LayerCache, KVCache), factory (make_cache), compiled (a decode step over
full rings as one compiled function; compiled_retrieval: retrieval's), report (bytes tables),
cachefile + persist (prompt-cache files).
"""

from __future__ import annotations

from .factory import find_rope, layer_cache, make_cache
from .kv_cache import KVCache
from .layer import LayerCache
from .persist import PromptCacheError, load_prompt_cache, save_prompt_cache
from .store import DenseStore

__all__ = ["KVCache", "LayerCache", "DenseStore", "make_cache", "layer_cache", "find_rope",
           "save_prompt_cache", "load_prompt_cache", "PromptCacheError"]
