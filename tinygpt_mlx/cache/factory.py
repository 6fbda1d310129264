"""The factory: a `CacheConfig` and a model in, a `KVCache` of per-layer caches out. It builds
every store and hands it its position rules and the codec (cache/__init__.py's doc)."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from .. import attention
from ..config import CacheConfig
from ..lazy import lazy
from ..model import Model as NativeModel
from .cold import ColdStore
from .cold_device import DeviceColdStore
from .kivi import KiviStore
from .kv_cache import KVCache
from .layer import FullLayer, LayerCache
from .ring import RingLayer
from .positions import Positions
from .ring import RingStore
from .store import DTYPES, DenseStore, Forgets

mlx_caches = lazy("mlx_lm.models.cache")   # mlx-lm's package imports transformers (and torch): seconds


def find_rope(layer: Any) -> Optional[Callable]:
    """The RoPE module of a transformer layer (native TinyGPT or an mlx-lm model), if any."""
    for attn_name in ("attn", "self_attn", "attention"):
        attn = getattr(layer, attn_name, None)
        if attn is not None and callable(getattr(attn, "rope", None)):
            return attn.rope
    return None


def layer_cache(config: CacheConfig, rope: Optional[Callable], layer_index: int = 0) -> LayerCache:
    """One layer's cache under `config`: its position rules and its stores. An exact
    StreamingLLM cache is a ring (ring.py); KIVI under StreamingLLM (without an exact top-k
    shadow) and the exact hot window of retrieval keep the frame positions the ring uses, so no
    key of the window is placed or turned per step (kivi.py; a retrieval window un-rotates only
    what it hands the cold store, layer.py). KIVI with an exact top-k shadow keeps its keys
    before RoPE (positions.py), and `CacheConfig` refuses it with shifted retrieval. The
    pre-RoPE paths that frame positions replaced are built by the tests, which hold these to
    them (tests/prerope.py)."""
    storage = DTYPES[config.storage]
    if config.streaming and not config.quantised and not config.retrieval:
        positions = Positions(config, rope, frame=True)
        return RingLayer(config, positions, RingStore(storage, config.sink, config.window, positions))
    frame = not config.exact_topk and ((config.streaming and config.quantised) or config.retrieval)
    return segmented_layer(config, Positions(config, rope, frame=frame), layer_index)


def segmented_layer(config: CacheConfig, positions: Positions, layer_index: int = 0) -> LayerCache:
    """A layer cache of separate stores, the sink, the body (exact or KIVI) and for retrieval
    the cold store, under the position rules `positions`; a full exact one is a `FullLayer`
    (its plan fixed: layer.py)."""
    storage = DTYPES[config.storage]
    sink = DenseStore(storage, label="sink")
    body = (KiviStore(config, storage, positions, KVCache, config.exact_prefix) if config.quantised
            else DenseStore(storage, frame=positions if positions.frame else None))
    cold = cold_store(config, layer_index) if config.retrieval else Forgets()
    full = not (config.streaming or config.retrieval or config.quantised)
    return (FullLayer if full else LayerCache)(config, positions, sink, body, cold)


def cold_store(config: CacheConfig, layer_index: int = 0) -> Any:
    """Retrieval's cold store for one layer: in RAM on the device (its search in the step's graph,
    cold_device.py), or on disk with its search on the host (cold.py)."""
    if config.cold_store == "disk":
        return ColdStore(config, KVCache, layer_index)
    return DeviceColdStore(config, KVCache, layer_index)


def sliding_window(c: Any) -> Optional[int]:
    """The window of a model's own sliding-window layer cache (mlx-lm's `RotatingKVCache` with
    nothing kept at the front: Gemma 2/3's local layers), else None."""
    if _is_mlx_cache(c, "RotatingKVCache") and c.keep == 0:
        return int(c.max_size)
    return None


def _is_mlx_cache(c: Any, class_name: str) -> bool:
    """`c` is mlx-lm's cache class `class_name`; never while mlx-lm is not imported (nothing could
    have made one), so a native model's caches are told apart without importing it."""
    return "mlx_lm.models.cache" in sys.modules and type(c) is getattr(mlx_caches, class_name)


class _FullLayerSlot:
    """Stands for one plain full-attention layer cache of the native model (shared by the layers
    that share its keys and values), in place of the mlx-lm `KVCache` its `make_cache` gives:
    building ours needs only the layout, and importing mlx-lm costs seconds (transformers, torch)."""


def _model_caches(model: Any) -> list:
    """The caches the model itself makes, as `make_prompt_cache` gives them (the native model's
    as `_FullLayerSlot`s in its layout)."""
    if isinstance(model, NativeModel):
        return model.make_cache(_FullLayerSlot)
    return mlx_caches.make_prompt_cache(model)


def _plain_full(c: Any) -> bool:
    """A model's own plain full-attention layer cache (mlx-lm's `KVCache`, or the native slot)."""
    return type(c) is _FullLayerSlot or _is_mlx_cache(c, "KVCache")


def sliding_layer(config: CacheConfig, window: int, rope: Optional[Callable], layer_index: int = 0) -> LayerCache:
    """A sliding-window layer's cache under `config`: an exact ring of the layer's own `window`
    (`CacheConfig.sliding_layer`: no sink, KIVI or retrieval), on its own RoPE; `sliding` says
    so (kv_cache.py counts, reports and saves it apart from the global layers)."""
    cache = layer_cache(config.sliding_layer(window, rope is not None), rope, layer_index)
    cache.sliding = window
    return cache


def make_cache(model: Any, config: Optional[CacheConfig] = None, layer: Callable = layer_cache,
               windowed: bool = True) -> KVCache:
    """Per-layer caches for `model` under `config`, usable as `cache=` / `prompt_cache=`.

    Starts from the caches the model itself makes (mlx-lm's `make_prompt_cache`; the native
    model makes mlx-lm `KVCache`s too): each plain full-attention layer cache becomes ours under
    the policy, layers that share one (YOCO) share ours, and each sliding-window layer (a
    `RotatingKVCache` keeping nothing at the front: Gemma 2/3's local layers) becomes our exact
    ring of its own window whatever the policy (`sliding_layer`): the long-context policy
    applies to the global layers, and a sliding layer holds at most its window, as the model's
    own cache does. `windowed` False gives a sliding layer the policy's cache instead (its mask
    still limits it to the window: the "every layer under the policy" reference). Any other
    cache type the model makes stays the model's.

    Our layer caches attend over their own stores, so the model's attention must be routed
    through `tinygpt_mlx.attention` (the native model always is; `loading.load` routes an
    mlx-lm model, `attention.install(model)` does it by hand): a model that is not is refused
    here, whatever the policy, rather than silently attending to the new tokens only.
    `layer(config, rope, layer_index)` builds each global layer's cache (`layer_cache`; the tests
    build reference paths with their own).
    """
    config = config or CacheConfig()
    own = _model_caches(model)
    ours = [_plain_full(c) or sliding_window(c) is not None for c in own]
    if any(ours) and not attention.routes(model):
        raise ValueError(f"posttrainllm caches need our attention in the model's code, which is not routed "
                         f"for {type(model).__module__}: load the model with tinygpt_mlx.loading.load "
                         "(or call tinygpt_mlx.attention.install(model))")
    out: list = []
    made: dict[int, LayerCache] = {}
    for i, (model_layer, c, mine) in enumerate(zip(model.layers, own, ours)):
        if not mine:
            out.append(c)
        elif id(c) in made:
            out.append(made[id(c)])
        else:
            window = sliding_window(c)
            if window is not None and windowed:
                made[id(c)] = sliding_layer(config, window, find_rope(model_layer), i)
            else:
                made[id(c)] = layer(config, find_rope(model_layer), i)
                made[id(c)].sliding = window
            out.append(made[id(c)])
    stores = [c.cold for c in made.values() if isinstance(getattr(c, "cold", None), DeviceColdStore)]
    for store in stores:      # the ram store's budget (config.cold_ram) is shared by every layer's
        store.ram_layers = len(stores)
    return KVCache(out, config)
