"""Attention over whatever the cache hands back, and its installation into mlx-lm models.

mlx-lm model modules call a module-level `scaled_dot_product_attention(queries, keys, values,
cache=, scale=, mask=)` after `cache.update_and_fetch`. The cache alone never sees the query,
but packed KIVI keys and retrieval need it, so `install(model)` puts this module's function in
place of that name in the model's modules (KIV does the same to Hugging Face models) and
`uninstall` restores the original. For caches that are not ours it calls the original.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import mlx.core as mx

from mlx_lm.models import base as _mlx_base

_original_sdpa = _mlx_base.scaled_dot_product_attention
_installed: dict[str, Any] = {}  # module name -> the function it had before


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                                 scale: float, mask: Optional[Any], sinks: Optional[mx.array] = None
                                 ) -> mx.array:
    """Dense attention, or the cache's own attention when it holds packed/retrieved data."""
    from .cache.kv_cache import LayerCache  # noqa: PLC0415 (cycle: cache imports config only)

    if isinstance(cache, LayerCache) and cache.needs_query and cache.attention_installed:
        if sinks is not None:
            raise ValueError("posttrainllm caches do not support learned attention sinks yet")
        return cache.attend(queries, scale, mask)
    return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _model_modules(model: Any) -> list[str]:
    names = set()
    for _, m in model.named_modules():
        mod = type(m).__module__
        if mod.startswith("mlx_lm.models.") and hasattr(sys.modules.get(mod), "scaled_dot_product_attention"):
            names.add(mod)
    return sorted(names)


def install(model: Any) -> list[str]:
    """Route the attention of `model`'s mlx-lm modules through this module. Idempotent."""
    done = []
    for name in _model_modules(model):
        mod = sys.modules[name]
        if name not in _installed:
            _installed[name] = mod.scaled_dot_product_attention
            mod.scaled_dot_product_attention = scaled_dot_product_attention
        done.append(name)
    return done


def uninstall() -> None:
    """Restore every module's original attention function."""
    for name, fn in list(_installed.items()):
        sys.modules[name].scaled_dot_product_attention = fn
        del _installed[name]


def is_installed(model: Any) -> bool:
    """True when attention of `model` goes through `scaled_dot_product_attention` here."""
    if getattr(model, "model_type", None) == "tinygpt":
        return True
    mods = _model_modules(model)
    return bool(mods) and all(m in _installed for m in mods)
