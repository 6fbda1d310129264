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

from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .. import quant, switches
from ..config import CacheConfig
from . import checkpoint as checkpoints
from . import spill_stage
from .layer import LayerCache
from .telemetry import summarise


def compile_by_default() -> bool:
    """A new cache's `compile_decode`: on unless `POSTTRAINLLM_COMPILE` is 0/false/no/off
    (tinygpt_mlx/switches.py: a value it does not take is refused)."""
    return switches.flag("POSTTRAINLLM_COMPILE")


def stage_spills_by_default() -> bool:
    """A new cache's `stage_spills`: off unless `POSTTRAINLLM_STAGE_SPILLS` is 1/true/yes/on (the
    guess missed nearly every step in the runs of docs/retrieval.md, "A spilled store's decode
    step staged ahead": a miss computes the step twice; tinygpt_mlx/switches.py: a value it does
    not take is refused)."""
    return switches.flag("POSTTRAINLLM_STAGE_SPILLS")


class Checkpoint:
    """A whole cache's state at `length` tokens (`KVCache.checkpoint`); `nbytes`: what it holds."""

    def __init__(self, length: int, layers: list):
        self.length, self.layers = length, layers
        self.nbytes = checkpoints.held_nbytes(layers)


class KVCache(list):
    """Every layer's cache for one model, configured by one `CacheConfig`.

    It is a list of per-layer caches, so it can be passed as `cache=` to the native model and
    as `prompt_cache=` to mlx-lm's `generate`; layers that share K/V (YOCO) hold their owner's
    object, sliding-window layers (Gemma 2/3's local layers) hold an exact ring of their own
    window whatever the policy (`LayerCache.sliding`, factory.sliding_layer), and layers with
    another cache type keep the model's. The policy is the global layers'. It owns the
    whole-cache operations (eviction, trimming, bytes, telemetry, closing) and the KIVI codec
    that the stores round through (`quantise_affine`, `dequantise_k`, `dequantise_v`).
    Use it as a context manager, or call `close()`, to remove disk stores at once.
    """

    def __init__(self, layers: list, config: CacheConfig):
        super().__init__(layers)
        self.config = config
        self._owned = [c for c in self.distinct() if isinstance(c, LayerCache)]
        #: the layers under the policy (not sliding-window rings): what the counts count
        self._global = [c for c in self._owned if getattr(c, "sliding", None) is None] or self._owned
        #: whether a decode step over full StreamingLLM rings may run compiled (cache/compiled.py);
        #: the one switch, its default from the environment
        self.compile_decode = compile_by_default()
        #: whether a decode step of a cache with spilled cold rows reads them in one bulk copy
        #: staged ahead (spill_stage.py; exact either way), and its counters
        self.stage_spills = stage_spills_by_default()
        self.spill_stats = spill_stage.new_stats()
        kinds = {c.compiles for c in self._owned}
        if kinds == {"ring", "retrieval"} and all(c.compiles == "ring" for c in self._owned if c.sliding is not None) \
                and all(c.compiles == "retrieval" for c in self._owned if c.sliding is None):
            kinds = {"retrieval"}    # retrieval's step traces sliding-window rings beside (compiled_retrieval.py)
        #: the compiled decode step every layer can run ("ring", "kivi" or "retrieval",
        #: cache/compiled.py; "retrieval" also for retrieval's global layers beside sliding-window
        #: rings, which its step traces too), or None (every step eager: a policy it does not
        #: cover, layers of other kinds, a model-owned layer), decided once here, so an eager
        #: policy's step never asks
        self.compiled_step: Optional[str] = (kinds.pop() if len(kinds) == 1 and self._owned
                                             and len(self._owned) == len(self.distinct()) else None)
        #: the sliding-window rings' indices among `owned` and the other layers', decided once
        #: here (the layers never change); None without sliding rings (compiled_retrieval.py
        #: `rings_ready`, server/batch.py). The rings share one count of their changes
        #: (`RingStore.changes`), by which `rings_checked` (that function's check of them as one,
        #: made when the count last moved) is known to hold
        rings = tuple(i for i, c in enumerate(self._owned) if getattr(c, "sliding", None) is not None)
        self.ring_layout: Optional[tuple] = None
        #: that shared count (a one-item list), decided here: None where a sliding layer's body is
        #: not a ring (`rings_ready` then checks every step, and declines such layers)
        self.ring_changes: Optional[list] = None
        if rings:
            self.ring_layout = (rings, tuple(i for i in range(len(self._owned)) if i not in rings))
            shared = [0]
            for i in rings:
                if hasattr(self._owned[i].body, "changes"):     # (a ring's: `rings_ready` declines others)
                    self._owned[i].body.changes = shared
            if all(hasattr(self._owned[i].body, "changes") for i in rings):
                self.ring_changes = shared
        self.rings_checked: Optional[tuple] = None

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

    @property
    def global_layers(self) -> list[LayerCache]:
        """Our distinct caches under the policy (every one but sliding-window layers' rings)."""
        return self._global

    def kinds(self) -> list[str]:
        """Each layer's kind, model layer by layer: "global" (the policy's cache), "sliding W"
        (an exact ring of its own window W), or "model-owned" (the model's own cache type)."""
        def kind(c: Any) -> str:
            if not isinstance(c, LayerCache):
                return "model-owned"
            return "global" if getattr(c, "sliding", None) is None else f"sliding {c.sliding}"
        return [kind(c) for c in self]

    @property
    def sliding_windows(self) -> dict[int, int]:
        """{window: distinct sliding-window layers holding it} (empty: no sliding layer)."""
        out: dict[int, int] = {}
        for c in self._owned:
            if getattr(c, "sliding", None) is not None:
                out[c.sliding] = out.get(c.sliding, 0) + 1
        return out

    # ----- counts and bytes -----------------------------------------------------------------
    @property
    def current_length(self) -> int:
        """Tokens seen (the global layers'; every layer has seen the same)."""
        return max((c.current_length for c in self._global), default=0)

    @property
    def stored_count(self) -> int:
        """Tokens a global layer holds (what the policy keeps; a sliding layer holds at most its
        window, `nbytes_split`)."""
        return max((c.stored_count for c in self._global), default=0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.distinct())

    @property
    def disk_nbytes(self) -> int:
        """The part of `nbytes` held in memory-mapped files (breakdown keys ending in "_disk")."""
        return sum(v for k, v in self.nbytes_breakdown().items() if k.endswith("_disk"))

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes by part, summed over layers (they add up to `nbytes`): the global layers' stores
        by name ("sink", "body", "packed", "cold"...), every sliding-window layer's ring as
        "sliding", a model-owned cache as "model-owned"."""
        total: dict[str, int] = {}
        for c in self.distinct():
            if not isinstance(c, LayerCache):
                parts = {"model-owned": c.nbytes}
            elif getattr(c, "sliding", None) is not None:
                parts = {"sliding": c.nbytes}
            else:
                parts = c.nbytes_breakdown()
            for k, v in parts.items():
                total[k] = total.get(k, 0) + v
        return total

    def nbytes_split(self) -> dict[str, int]:
        """Bytes of the global layers (the policy's) and of the sliding-window layers (their
        rings), and of any model-owned caches: `cache-report`'s and the report line's split."""
        parts = self.nbytes_breakdown()
        sliding, owned = parts.pop("sliding", 0), parts.pop("model-owned", 0)
        return {"global": sum(parts.values()), "sliding": sliding, **({"model-owned": owned} if owned else {})}

    # ----- whole-cache operations -----------------------------------------------------------
    def evict_middle_if_needed(self) -> int:
        """Trim every layer to exactly its policy between model calls (a call of several tokens
        leaves a window's layers `window - 1 + L`, plan.py; a sliding layer's ring its own
        window); returns tokens dropped per global layer."""
        dropped = {id(c): c.evict_middle_if_needed() for c in self._owned}
        return max((dropped[id(c)] for c in self._global), default=0)

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

    def record_retrievals(self, on: bool = True) -> None:
        """Keep a telemetry record of every retrieval from now on (`retrieval_report` sums them;
        `on=False` stops). Off by default: a decode step then makes and keeps nothing that
        nobody reads. Whoever reads the records asks first (telemetry.py)."""
        for c in self.owned:
            if c.telemetry is not None:
                c.telemetry.on = on

    def reset_telemetry(self) -> None:
        for c in self.owned:
            if c.telemetry is not None:
                c.telemetry.reset()

    def retrieval_report(self, last_steps: Optional[int] = None) -> dict:
        """Retrieval telemetry summed over layers (telemetry.summarise). A cache that was never
        asked to record (`record_retrievals`) has nothing to report: a RuntimeError, not zeros."""
        telemetries = [c.telemetry for c in self.owned if c.telemetry is not None]
        if telemetries and not any(t.on or t.steps for t in telemetries):
            raise RuntimeError("retrieval telemetry is recorded only when asked: call "
                               "KVCache.record_retrievals() before the steps to report")
        return summarise(telemetries, last_steps)

    def close(self) -> None:
        """Release every layer's stores now (disk stores' files removed). Idempotent."""
        for c in self.owned:
            c.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
