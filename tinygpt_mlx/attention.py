"""Attention over whatever the cache holds, and its explicit, reversible routing into models.

Model code (mlx-lm's and the native TinyGPT's alike) calls a module-level
`scaled_dot_product_attention(queries, keys, values, cache=, scale=, mask=)` after
`cache.update_and_fetch`. Packed KIVI keys and retrieval need the query, which the cache alone
never sees, so a model's attention must be *routed* through this module's function: the native
model imports it; for an mlx-lm model `install(model)` puts it in place of that name in the
model's modules (KIV does the same to Hugging Face models) and returns a `Routing` handle whose
`close()` restores exactly what it replaced. `loading.load` does this and the loaded model owns
the handle; building a cache never installs anything.

The function dispatches on the cache: one of ours that `reads_own_segments` attends over its
own segments (`cache.attend`: packed and retrieved data scored straight from where they lie, a
ring read as it lies), so its `update_and_fetch` never has to assemble anything; any other
cache, a full exact layer of ours included (`FullLayer`, which returns its K/V as mlx-lm's
`KVCache` does), gets mlx-lm's attention over the keys and values `update_and_fetch` returned.
The dense reference the fast paths are tested against lives in the tests
(tests/dense_reference.py).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import mlx.core as mx

from .lazy import lazy

mlx_base = lazy("mlx_lm.models.base")   # mlx-lm's package imports transformers (and torch): seconds
#: mlx-lm's own attention function, taken on first need (`_mlx_sdpa`): a native model never needs it
_original_sdpa: Optional[Any] = None
#: module name -> [the function it had before, how many live Routings patched it]
_patched: dict[str, list] = {}


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                                 scale: float, mask: Optional[Any], sinks: Optional[mx.array] = None
                                 ) -> mx.array:
    """Attention for one layer call. A posttrainllm layer cache that `reads_own_segments`
    attends over its own segments (its `update_and_fetch` returned only the new tokens); any
    other cache, or none, gets mlx-lm's attention over the `keys`/`values` it was handed."""
    if not getattr(cache, "reads_own_segments", False):
        return _mlx_sdpa()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if sinks is not None:
        raise ValueError("posttrainllm caches do not support learned attention sinks yet")
    return cache.attend(queries, scale, mask)


def _mlx_sdpa() -> Any:
    """mlx-lm's `scaled_dot_product_attention`, imported the first time a cache that is not ours
    needs it (or an mlx-lm model is routed), before anything here could have replaced it. While
    mlx-lm is not loaded (a native model with a full exact cache, `FullLayer`: no cache here can
    be one of mlx-lm's quantised ones), `_dense_sdpa`, the very call mlx-lm's function makes for
    such a cache: importing mlx-lm for it cost seconds (transformers) and ~200 MB of RSS,
    billed to the first prefill of `posttrainllm sample` with no cache flags."""
    global _original_sdpa
    if _original_sdpa is None:
        if "mlx_lm" not in sys.modules:
            return _dense_sdpa
        _original_sdpa = mlx_base.scaled_dot_product_attention
    return _original_sdpa


def _dense_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                mask: Optional[Any], sinks: Optional[mx.array] = None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` for a cache without `bits` (mlx_lm/models/base.py):
    `mx.fast.scaled_dot_product_attention` over the keys and values as given."""
    if hasattr(cache, "bits"):      # an mlx-lm QuantizedKVCache: mlx-lm is loaded, take its own
        return mlx_base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                                     mask=mask, sinks=sinks)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _attention_modules(model: Any) -> list[str]:
    """The modules of `model`'s layers whose code calls a module-level attention function."""
    names = set()
    for _, m in model.named_modules():
        mod = type(m).__module__
        if hasattr(sys.modules.get(mod), "scaled_dot_product_attention"):
            names.add(mod)
    return sorted(names)


def routes(model: Any) -> bool:
    """True when every attention call of `model` goes through `scaled_dot_product_attention` here."""
    mods = _attention_modules(model)
    return bool(mods) and all(sys.modules[m].scaled_dot_product_attention is scaled_dot_product_attention
                              for m in mods)


class Routing:
    """The handle `install` returns: `close()` (or leaving a `with` block) undoes the install.
    Several handles may patch one module (two models of one architecture): the original comes
    back when the last of them closes."""

    def __init__(self, modules: list[str]):
        self.modules = modules
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for name in self.modules:
            entry = _patched[name]
            entry[1] -= 1
            if entry[1] == 0:
                sys.modules[name].scaled_dot_product_attention = entry[0]
                del _patched[name]

    def __enter__(self) -> "Routing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def install(model: Any) -> Routing:
    """Route the attention of `model`'s modules through this module; returns the handle that
    undoes it. Modules that already call our function (the native model's) are left alone."""
    done = []
    for name in _attention_modules(model):
        mod = sys.modules[name]
        if name in _patched:
            _patched[name][1] += 1
        elif mod.scaled_dot_product_attention is scaled_dot_product_attention:
            continue
        else:
            _mlx_sdpa()                  # mlx-lm's own, taken before any module's name is replaced
            _patched[name] = [mod.scaled_dot_product_attention, 1]
            mod.scaled_dot_product_attention = scaled_dot_product_attention
        done.append(name)
    return Routing(done)
