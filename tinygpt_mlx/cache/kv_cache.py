"""`KVCache`: the single owner of KV storage policy, for every layer of a model.

Each layer's K/V is a sequence of stores, oldest first: the StreamingLLM sink (exact), the body
(exact, or KIVI-packed blocks) and, for retrieval, a cold store that receives what the body
evicts. One `CacheConfig` picks the precision, the eviction and the retrieval; the policies
compose here instead of living in parallel classes. The factory (`cache.make_cache`) builds the
stores; a `LayerCache` only calls them and hands them what they need (store.py).

StreamingLLM (Xiao et al. 2023): keep the first `sink` tokens and the newest `window`, drop
the middle (`evict_middle_if_needed`). Positions (absolute / shifted / retrieved slots) are
decided by one `Positions` object per layer (positions.py).

Naming, for readers who know mlx-lm: mlx-lm's `KVCache` is ONE layer's cache; here that is a
`LayerCache` (it implements mlx-lm's per-layer protocol), and `KVCache` is the whole model's.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import numpy as np

from .. import quant
from ..config import CacheConfig
from . import checkpoint as checkpoints
from .layer import LayerCache
from .telemetry import summarise


def compile_by_default() -> bool:
    """A new cache's `compile_decode`: on unless `POSTTRAINLLM_COMPILE` is 0/false/no/off."""
    return os.environ.get("POSTTRAINLLM_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


class Checkpoint:
    """A whole cache's state at `length` tokens (`KVCache.checkpoint`); `nbytes`: what it holds."""

    def __init__(self, length: int, layers: list):
        self.length, self.layers = length, layers
        self.nbytes = checkpoints.held_nbytes(layers)


class KVCache(list):
    """Every layer's cache for one model, configured by one `CacheConfig`.

    It is a list of per-layer caches, so it can be passed as `cache=` to the native model and
    as `prompt_cache=` to mlx-lm's `generate`; layers that share K/V (YOCO) hold their owner's
    object, and layers with their own cache type (sliding-window layers) keep it. It owns the
    whole-cache operations (eviction, trimming, bytes, telemetry, closing) and the KIVI codec
    that the stores round through (`quantise_affine`, `dequantise_k`, `dequantise_v`).
    Use it as a context manager, or call `close()`, to remove disk stores at once.
    """

    def __init__(self, layers: list, config: CacheConfig):
        super().__init__(layers)
        self.config = config
        self._owned = [c for c in self.distinct() if isinstance(c, LayerCache)]
        #: whether a decode step over full StreamingLLM rings may run compiled (cache/compiled.py);
        #: the one switch, its default from the environment
        self.compile_decode = compile_by_default()

    # ----- the KIVI codec (the design card's names; quant.py holds the packing primitives) ----
    @staticmethod
    def quantise_affine(x: mx.array, bits: int, group: int, param_dtype: mx.Dtype = mx.float32
                        ) -> tuple[mx.array, mx.array, mx.array]:
        """Asymmetric affine quantisation of groups of `group` consecutive elements of x's last
        axis: zero = min(g), scale = max(eps, (max(g) - min(g)) / (2^bits - 1)),
        q = clip(round((x - zero) / scale), 0, 2^bits - 1), packed 32 // bits codes per uint32.
        KIVI keys go in as K^T (groups of G tokens per channel), values as V (groups of G
        channels per token). Returns (packed, scale, zero)."""
        return quant.quantise_affine(x, bits, group, param_dtype)

    @staticmethod
    def dequantise_k(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int,
                     dtype: mx.Dtype = mx.float32) -> mx.array:
        """Keys back from K^T codes: K_hat[t, d] = scale[d, t // G] * q[d, t] + zero[d, t // G],
        returned as [..., T, D]."""
        return quant.dequantise_k(packed, scale, zero, bits, group, dtype)

    @staticmethod
    def dequantise_v(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int,
                     dtype: mx.Dtype = mx.float32) -> mx.array:
        """Values back from per-token codes: V_hat[t, d] = scale[t, d // G] * q[t, d] + zero[t, d // G]."""
        return quant.dequantise_v(packed, scale, zero, bits, group, dtype)

    # ----- layers ---------------------------------------------------------------------------
    @property
    def owned(self) -> list[LayerCache]:
        """The distinct caches of ours (shared layers counted once)."""
        return self._owned

    def distinct(self) -> list:
        """Each layer's cache once (layers may share one), ours or the model's own."""
        seen, out = set(), []
        for c in self:
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                out.append(c)
        return out

    @property
    def layers_with_kv(self) -> int:
        return len(self.distinct())

    # ----- counts and bytes -----------------------------------------------------------------
    @property
    def current_length(self) -> int:
        return max((c.current_length for c in self.owned), default=0)

    @property
    def stored_count(self) -> int:
        return max((c.stored_count for c in self.owned), default=0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.distinct())

    @property
    def disk_nbytes(self) -> int:
        """The part of `nbytes` held in memory-mapped files (breakdown keys ending in "_disk")."""
        return sum(v for k, v in self.nbytes_breakdown().items() if k.endswith("_disk"))

    def nbytes_breakdown(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.distinct():
            parts = c.nbytes_breakdown() if isinstance(c, LayerCache) else {"model-owned": c.nbytes}
            for k, v in parts.items():
                total[k] = total.get(k, 0) + v
        return total

    # ----- whole-cache operations -----------------------------------------------------------
    def evict_middle_if_needed(self) -> int:
        """Trim every layer to exactly its policy between model calls (a call of several tokens
        leaves a window's layers `window - 1 + L`, plan.py); returns tokens dropped per layer."""
        return max((c.evict_middle_if_needed() for c in self._owned), default=0)

    def is_trimmable(self) -> bool:
        """Whether `trim` can roll any number of tokens back (plain full caches, ours or the
        model's own): mlx-lm's protocol."""
        return all(c.is_trimmable() for c in self.distinct())

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can forget in every layer (`LayerCache.trimmable`;
        a model-owned layer: all of them if it is trimmable, else none)."""
        return min((c.trimmable() if isinstance(c, LayerCache)
                    else (c.offset if c.is_trimmable() else 0) for c in self.distinct()), default=0)

    def trim(self, n: int) -> int:
        """Forget the newest `n` tokens of every layer, at most `trimmable()`; returns how many
        were forgotten."""
        n = min(n, self.trimmable())
        if n <= 0:
            return 0
        return max((c.trim(n) for c in self.distinct()), default=0)

    def checkpoint(self) -> Optional["Checkpoint"]:
        """The whole cache's state now (`checkpoint.take`, layer by layer), or None where a layer is the
        model's own (its cache cannot be checkpointed here)."""
        if len(self._owned) != len(self.distinct()):
            return None
        return Checkpoint(self.current_length, [checkpoints.take(c) for c in self._owned])

    def restore(self, cp: "Checkpoint") -> None:
        """Back to checkpoint `cp` (taken on this cache; later checkpoints are no longer valid)."""
        for c, layer in zip(self._owned, cp.layers):
            checkpoints.restore(c, layer)

    def set_truth(self, positions: Optional[list[int]]) -> None:
        """Tell the retrieval telemetry the absolute positions of a ground-truth needle."""
        for c in self.owned:
            if c.telemetry is not None:
                c.telemetry.truth = positions

    def pin(self, positions: Optional[list[int]]) -> None:
        """An oracle for diagnosis: every retrieval pass of every layer also offers the pages
        holding these absolute positions (once cold) to its fine pass, whatever the coarse pass
        ranks them (`ColdStore.pinned`; None: off). The `slots` rule's per-query pools: refused."""
        pinned = None if positions is None else np.asarray(positions, dtype=np.int64)
        for c in self.owned:
            if c.config.retrieval:
                if c.config.retrieves_per_query:
                    raise ValueError("the oracle pins pages into the pass's pool; the 'slots' position rule "
                                     "gives each query a pool of its own")
                c.cold.pinned = pinned

    def reset_telemetry(self) -> None:
        for c in self.owned:
            if c.telemetry is not None:
                c.telemetry.reset()

    def retrieval_report(self, last_steps: Optional[int] = None) -> dict:
        """Retrieval telemetry summed over layers (telemetry.summarise)."""
        return summarise([c.telemetry for c in self.owned if c.telemetry is not None], last_steps)

    def close(self) -> None:
        """Release every layer's stores now (disk stores' files removed). Idempotent."""
        for c in self.owned:
            c.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
