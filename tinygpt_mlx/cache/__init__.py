"""The KV cache: the single owner of storage policy (precision, eviction, retrieval)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..config import CacheConfig
from .kv_cache import KVCache, LayerCache
from .store import DenseStore

__all__ = ["KVCache", "LayerCache", "DenseStore", "make_cache", "find_rope"]


def find_rope(layer: Any) -> Optional[Callable]:
    """The RoPE module of a transformer layer (native TinyGPT or an mlx-lm model), if any."""
    for attn_name in ("attn", "self_attn", "attention"):
        attn = getattr(layer, attn_name, None)
        if attn is not None and callable(getattr(attn, "rope", None)):
            return attn.rope
    return None


def _kv_owner(model: Any) -> list[int]:
    owner = getattr(model, "kv_owner", None)
    return list(owner) if owner is not None else list(range(len(model.layers)))


def make_cache(model: Any, config: Optional[CacheConfig] = None) -> KVCache:
    """Per-layer caches for `model` under `config`, usable as `cache=` / `prompt_cache=`.

    Layers whose model-made cache is not a plain full-attention KVCache (sliding-window layers
    of Gemma 2/3 and similar) keep the model's own cache; our policy applies to the global
    attention layers. Where the policy needs the query (packed keys, retrieval), our attention
    is installed into the model's modules.
    """
    from mlx_lm.models.cache import KVCache as MlxKVCache  # noqa: PLC0415

    from . import retrieval_hook  # noqa: PLC0415
    from .. import attention  # noqa: PLC0415

    config = config or CacheConfig()
    layers = model.layers
    native = model.make_cache() if hasattr(model, "make_cache") and getattr(model, "model_type", "") != "tinygpt" else None
    owner = _kv_owner(model)
    out: list = []
    for i, layer in enumerate(layers):
        if owner[i] != i:
            out.append(out[owner[i]])
            continue
        if native is not None and type(native[i]) is not MlxKVCache:
            out.append(native[i])
            continue
        c = LayerCache(config, rope=find_rope(layer))
        retrieval_hook.attach(c, config, layer_index=i)
        out.append(c)
    cache = KVCache(out, config)
    if any(c.needs_query for c in cache.owned):
        attention.install(model)
        ready = attention.is_installed(model)
        if not ready and config.exact_topk:
            raise ValueError(f"--kv-exact-topk needs our attention in the model's code, which cannot be "
                             f"installed into {type(model).__module__}: use plain KIVI")
        for c in cache.owned:
            c.attention_installed = ready
    return cache
