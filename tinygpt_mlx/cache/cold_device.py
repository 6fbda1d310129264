"""Tiered retrieval on the device: the cold store in MLX arrays and its search in the step's graph.

The same store and the same selection rules as the host store (cold.py: Quest's min/max page
summaries or KIV's mean, the two-level index, sticky pages, spans or tokens, the `fixed`, `page`
and `slots` position rules, packed cold rows), with nothing read back to the host while a step
is built: evicted rows, summaries and the unfinished page's exact keys are written by slice
updates into arrays that double when full; the coarse pass is a matmul with the summaries and
`mx.argpartition`; the pool's union (its pages, the unfinished page, the sticky pages) is a sort
of a fixed number of page ids with repeats and padding pushed to the end; the gather is
`mx.take_along_axis`; the fine pass is attention's own (`segments.PoolSegment`). Every size that
shapes the graph (tokens, pages, blocks) is counted on the host as tokens are evicted, so a
step's graph is built while the previous one runs (`mx.async_eval`), layer after layer, without
waiting for any of them.

On Apple Silicon memory is unified: a cold page is already where the GPU reads it. A store
that must not grow in RAM spills its oldest rows to memory-mapped files past a budget
(`--kiv-cold-ram`, `DeviceRows.spill`): its summaries stay here and are searched as before, and
a picked spilled row is read back from its file (a wait per layer, only while rows are
spilled). The host store on disk (`--kiv-cold-store disk`, cold.py) searches on the host; it is
also the reference this one is tested against (tests/test_retrieval_device.py: the same tokens
for every query, prefill and decode).

Positions (absolute, one per token, not per head) are host data known when a token is evicted:
they stay in a host array for telemetry, the needle oracle and files.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..config import CacheConfig
from ..quant import GROUP_SIZES
from .arrays import GrowingArray, private_dir, remove_dir, remove_with
from .device_pages import NAMES as SUMMARIES, DevicePageIndex, DeviceRows, pool_tokens, union
from .device_select import Static, fine_pick, select
from .segments import PickedSegment, PoolSegment, Reading, RetrievedSegment
from .telemetry import Selection, StageTimes, pages_holding

__all__ = ["DeviceColdStore", "place"]

#: the cold rows' storage: the cache's storage precision (the host store keeps bf16 as fp32: numpy has none)
_DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}


class _PackedRows:
    """Cold rows quantised per token (KIVI's value layout) with the cache's codec: codes, scale
    and zero as `DeviceRows`."""

    def __init__(self, G: int, D: int, bits: int, codec: Any):
        groups = [g for g in sorted(GROUP_SIZES, reverse=True) if D % g == 0]
        if not groups:
            raise ValueError(f"cold_bits needs a head dimension that is a multiple of {min(GROUP_SIZES)}, got {D}")
        self.codec, self.bits, self.group = codec, bits, groups[0]
        self.codes = DeviceRows(G, (D * bits // 32,), mx.uint32)
        self.scale = DeviceRows(G, (D // self.group,), mx.float32)
        self.zero = DeviceRows(G, (D // self.group,), mx.float32)

    def append(self, rows: mx.array) -> None:
        packed, scale, zero = self.codec.quantise_affine(rows, self.bits, self.group)
        self.codes.append(packed)
        self.scale.append(scale)
        self.zero.append(zero)

    def gather(self, idx: mx.array) -> mx.array:
        parts = [a.gather(idx) for a in (self.codes, self.scale, self.zero)]
        return self.codec.dequantise_v(*parts, self.bits, self.group)

    def parts(self) -> dict:
        return {"codes": self.codes, "scale": self.scale, "zero": self.zero}

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes


class DeviceColdStore:
    """One layer's cold store on the device: rows, summaries and the retrieval over them."""

    def __init__(self, config: CacheConfig, codec: Any, layer_index: int = 0):
        self.config, self.codec, self.layer_index = config, codec, layer_index
        self.page_size, self.cold_bits = config.page_size, config.cold_bits
        self.top_pages = config.top_pages
        self.retrieve_tokens = config.retrieve_tokens
        self.stages = StageTimes()   # per-stage seconds of retrieval (off unless `enabled`)
        self.n = 0
        self.G: Optional[int] = None   # B * Hkv
        self.B: Optional[int] = None
        self.keys = self.values = None   # DeviceRows [G, n, D] or _PackedRows
        self.positions: Optional[GrowingArray] = None   # host: absolute position of each token
        self.index: Optional[DevicePageIndex] = None
        self._recent: Optional[mx.array] = None   # sticky: pages [G, S] the last pass's last query picked (-1: none)
        self.pinned: Optional[np.ndarray] = None   # an oracle (`KVCache.pin`): positions every pool holds
        self._rope_ready = False
        self._static_for: Optional[tuple] = None    # `select_static`'s last answer, by what it read
        # the RAM budget (config.cold_ram, MiB over all layers): `ram_layers` stores share it
        # (make_cache counts them); past it the oldest rows spill into `spill_dir`
        self.ram_layers = 1
        self.spill_dir: Optional[str] = None
        # a spilled store's decode step staged ahead (spill_stage.py): the pages [G, K] (-1: none)
        # the last decode step's pool held (the guess: host data, read at that step's end), the
        # staged step's (spilled, page table [G, spilled pages]) and its passes' checks (a list
        # while a step records them: per pass, whether it missed a staged page, and its pool)
        self.guess: Optional[np.ndarray] = None
        self.staging: Optional[tuple] = None
        self.checks: Optional[list] = None

    # ----- storage --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    @property
    def n_pages(self) -> int:
        return self.n // self.page_size

    def _init_arrays(self, B: int, H: int, Dk: int, Dv: int) -> None:
        self.B, self.G = B, B * H
        self.dims = (Dk, Dv)
        if self.config.cold_bits is None:
            dtype = _DTYPES[self.config.storage]
            self.keys, self.values = DeviceRows(self.G, (Dk,), dtype), DeviceRows(self.G, (Dv,), dtype)
        else:
            self.keys = _PackedRows(self.G, Dk, self.config.cold_bits, self.codec)
            self.values = _PackedRows(self.G, Dv, self.config.cold_bits, self.codec)
        self.positions = GrowingArray((), np.int64)
        self.index = DevicePageIndex(self.config, self.G, Dk)

    def append(self, keys: mx.array, values: mx.array, start_position: int) -> None:
        """Append evicted tokens [B, H, n, D] whose first has absolute position `start_position`:
        slice updates of the rows and of the summaries of the pages they complete."""
        B, H, n, Dk = keys.shape
        if n == 0:
            return
        if self.G is None:
            self._init_arrays(B, H, Dk, values.shape[3])
        k = keys.astype(mx.float32).reshape(self.G, n, Dk)
        self.keys.append(k)
        self.values.append(values.astype(mx.float32).reshape(self.G, n, -1))
        self.positions.append(np.arange(start_position, start_position + n, dtype=np.int64))
        self.index.add(k)   # summaries of the pages this completes (exact keys, before rounding)
        self.n += n
        if self.config.cold_ram is not None:
            self._spill_past_budget()

    # ----- the RAM budget: the oldest rows spilled to disk --------------------------------------
    def device_rows(self) -> list:
        """The `DeviceRows` of the cold rows (a packed side's codes, scale and zero)."""
        out = []
        for rows in (self.keys, self.values):
            out += list(rows.parts().values()) if isinstance(rows, _PackedRows) else [rows]
        return out

    @property
    def spilled(self) -> int:
        """The oldest tokens whose rows are on disk (their summaries and positions stay here)."""
        if self.keys is None:
            return 0
        return self.keys.codes.spilled if isinstance(self.keys, _PackedRows) else self.keys.spilled

    def budget_tokens(self) -> int:
        """Tokens whose rows this layer's share of `cold_ram` holds (at least one spill unit)."""
        per_token = sum(r.row_bytes() for r in self.device_rows())
        unit = self._spill_unit()
        return max(unit, int(self.config.cold_ram * 2 ** 20 / self.ram_layers / per_token) // unit * unit)

    def _spill_unit(self) -> int:
        return self.page_size * max(self.config.index_block, 1)     # whole blocks of pages

    def _spill_past_budget(self) -> None:
        """Past the budget, spill the oldest rows down to 3/4 of it, whole blocks at a time: a
        quarter of the budget moves at once (one read back and one copy per quarter)."""
        budget = self.budget_tokens()
        resident = self.n - self.spilled
        if resident <= budget:
            return
        unit = self._spill_unit()
        m = max(unit, (resident - budget * 3 // 4) // unit * unit)
        if self.spill_dir is None:
            self.spill_dir = private_dir(f"cold-spill-l{self.layer_index}", self.config.cold_path)
            remove_with(self, self.spill_dir)
        for i, rows in enumerate(self.device_rows()):
            rows.spill(m, os.path.join(self.spill_dir, f"rows{i}.bin"))

    def settle(self) -> None:
        """Evaluate what appends have queued (a bulk of them off the per-token path, such as a
        benchmark growing the store, would otherwise wait in one ever longer graph)."""
        if self.G is not None:
            mx.eval([a.array for name, a in self._row_arrays().items() if name != "positions"])

    def _gather(self, rows: Any, idx: mx.array) -> mx.array:
        return rows.gather(idx).astype(mx.float32)

    # ----- retrieval ------------------------------------------------------------------------
    def coarse(self, rows: mx.array) -> mx.array:
        """The coarse pass: `top_pages` pages [G, R, k] of each query row [G, rep, R, D] (every
        complete page while there are no more of them)."""
        P = self.n_pages
        if P > self.top_pages:
            return self.index.top_pages_of(rows)
        return mx.broadcast_to(mx.arange(P), (self.G, rows.shape[2], P))

    def _unfinished(self) -> Optional[mx.array]:
        """The unfinished page as a column [G, 1] of page ids, while it holds tokens."""
        P = self.n_pages
        return mx.full((self.G, 1), P, dtype=mx.int32) if self.n > P * self.page_size else None

    def pool(self, rows: mx.array) -> tuple[mx.array, mx.array]:
        """The pages a forward pass fetches [G, K] (ascending, -1: none, `union`) for its query
        rows [G, rep, R, D]: each row's `top_pages`, the unfinished page, the sticky pages of the
        last pass and the oracle's; and the last query's own pages [G, k] (telemetry)."""
        lists = self.coarse(rows)                                              # [G, R, k]
        last = lists[:, 0]
        parts = [lists.reshape(self.G, -1) if self.n_pages > self.top_pages else last]
        if (tail := self._unfinished()) is not None:
            parts.append(tail)
        if self.config.sticky and self._recent is not None:
            parts.append(_recent_array(self._recent))
        if self.pinned is not None:
            held = pages_holding(self.positions.view(), self.n, self.pinned, self.page_size)
            parts.append(mx.broadcast_to(mx.array(held.astype(np.int32)), (self.G, held.size)))
        plain = len(parts) == 1 and (lists.shape[1] == 1 or self.n_pages <= self.top_pages)
        return (parts[0] if plain else union(parts)), last

    def retrieve(self, reading: Reading) -> tuple[list, Selection]:
        """Attention segments of the cold tokens retrieved for `reading.queries` [B, Hq, L, D]
        and their `Selection`: one pool per forward pass, gathered once; every query picks its
        own tokens (or pages) from it inside attention (`PoolSegment`). The `slots` rule gives
        each query a pool of its own (`_retrieve_per_query`)."""
        if self.config.retrieves_per_query:
            return self._retrieve_per_query(reading)
        queries, pos = reading.queries, reading.positions
        B, Hq, L, D = queries.shape
        rep = Hq // (self.G // B)
        ps = self.page_size
        slot = reading.first_slot if pos.shifted else 0
        spans = self.config.retrieve_unit == "spans"
        units, unit = self.pick_units()
        with self.stages.timed("coarse"):
            q = queries.astype(mx.float32)
            if slot:    # score as the keys will be seen: q . R(slot) k  ==  R(-slot) q . k
                q = pos.rotate_to(q, -slot)
            rows = q[:, :, -1:] if L == 1 else mx.concatenate([q[:, :, -1:], q.mean(axis=2, keepdims=True)], axis=2)
            rows = rows.reshape(self.G, rep, -1, D)
            if L == 1 and self.pinned is None and not self.spilled:    # decode: the whole selection, compiled
                idx, keys, v, valid, last, scored, recent = self._compiled_pick(rows[:, :, 0], units, unit, pos)
                pool = None
            else:
                pool, last = self.pool(rows)
                if L == 1 and self.checks is not None:
                    self.checks.append(self._check(pool))
            self.stages.sync(last)
        with self.stages.timed("gather"):
            if pool is not None:
                idx, valid = pool_tokens(pool, self.n, ps)
                scored = valid.sum(axis=1).max()
                keys = self._gather(self.keys, idx)                                      # [G, U, D]
                if L == 1:    # decode: the fine pass first, then only the picked rows move on
                    idx, keys, valid = fine_pick(rows[:, :, 0], idx, keys, valid, units, unit, self.config.span_score,
                                                 ps, pos.rope if pos.shifted and not pos.fixed else None)
                v = self._gather(self.values, idx)
            if L == 1:
                units, unit = idx.shape[1], 1
            k = keys.reshape(B, -1, idx.shape[1], D)
            v = v.reshape(B, k.shape[1], idx.shape[1], -1)
            k = self._place(k, idx, slot, pos)
            self.stages.sync(k, v)
        if pool is None:   # picked already (and the next pass's sticky pages with it)
            segment = PickedSegment(k, v, valid.reshape(B, -1, idx.shape[1]))
            if self.config.sticky:
                self._recent = recent
        else:
            segment = PoolSegment(k, v, valid.reshape(B, -1, idx.shape[1]), units, unit, self.config.span_score)
            if self.config.sticky:
                self._recent = _PickedPages(idx, valid, segment, ps if spans else 1, ps)
        segment.rows = idx   # the cold index of each pool position [G, U] (telemetry, tests)
        return [segment], self._selection(L, idx, valid, last, scored, units, unit, segment)

    def _check(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        """A decode pass's check (spill_stage.py), lazy: how many of its pool's pages [G, K] (-1:
        none) are spilled pages the step did not stage (0: it hit) (every row it gathers lies in a pool page or,
        as padding, in page 0, which is always staged), and the pages themselves (the next
        step's guess). A pass not staged (nothing staged, or a spill since) misses nothing: it
        read its spilled rows back."""
        if self.staging is None or self.staging[0] != self.spilled:
            return mx.array(0), pages
        table = self.staging[1]
        spilled_pages = table.shape[1]
        at = mx.clip(pages, 0, spilled_pages - 1)
        unstaged = (pages >= 0) & (pages < spilled_pages) & (mx.take_along_axis(table, at, axis=1) < 0)
        return unstaged.sum(), pages

    def pick_units(self) -> tuple[int, int]:
        """(units, unit): a query picks `units` pages of `unit` = page_size tokens (spans) or
        `units` tokens (unit 1)."""
        if self.config.retrieve_unit == "spans":
            return max(1, self.retrieve_tokens // self.page_size), self.page_size
        return self.retrieve_tokens, 1

    def _selection(self, L: int, idx: mx.array, valid: mx.array, last: mx.array, scored: Any, units: int,
                   unit: int, segment: Any) -> Selection:
        """The `Selection` of a pass of `L` queries that fetched cold rows `idx` [G, T] (`valid`
        real), the last query's coarse pages `last`; `segment` the `PoolSegment` they attend
        through, or None where the pick was made before attention (a decode step's)."""
        P, ps = self.n_pages, self.page_size
        spans = self.config.retrieve_unit == "spans"
        return Selection(layer=self.layer_index, queries=L, cold_tokens=self.n, cold_pages=P,
                         page_size=ps, tokens_scored=scored, indexed=self.index.uses_index(),
                         pages=last[:, :P] if P <= self.top_pages else last, positions=self.positions.view(),
                         tokens_retrieved=min(units * unit, idx.shape[1], -(-self.n // ps) * ps if spans else self.n),
                         fetched=_fetched(idx, valid, segment))

    def _compiled_pick(self, q: mx.array, units: int, unit: int, pos: Any) -> tuple:
        """A decode step's selection for query rows [G, rep, D] through `device_select` (one
        compiled function per regime and capacity, shared by every layer): the picked cold
        indices, keys, values and validity, the coarse pass's pages and the tokens scored."""
        static, rope, buckets, summaries, keys, values, recent = self.select_inputs(units, unit, pos)
        summaries = {name: a[:, :buckets[name]] for name, a in summaries.items()}
        counts = mx.array([self.n, self.n_pages, self.index.n_blocks], dtype=mx.int32)
        return select(static, self.codec, rope, q, counts, summaries, keys, values, recent)

    def select_inputs(self, units: int, unit: int, pos: Any) -> tuple:
        """What a decode step's compiled selection takes from this store as it is now, but the
        query rows and the counts: `select_static`'s (static, rope, widths) and `select_arrays`'."""
        static, rope, buckets = self.select_static(units, unit, pos)
        return (static, rope, buckets, *self.select_arrays(static))

    def select_static(self, units: int, unit: int, pos: Any) -> tuple:
        """(`Static`, the `page` rule's RoPE or None, the summaries' widths scanned by name) of a
        decode step's selection now. The widths are a power of two past the count, not the
        capacity: a store cut back by a checkpoint then scores exactly as a fresh one."""
        cfg, index = self.config, self.index
        P = self.n_pages
        page_rule = pos.shifted and not pos.fixed
        # (the same until a page completes: kept for a decode step's sake, keyed by what it reads)
        key = (P, self._recent is not None, units, unit, page_rule, index,
               tuple(r.capacity for r in index.rows.values()))
        if self._static_for is not None and self._static_for[0] == key:
            return self._static_for[1]
        NB = index.n_blocks
        uses = index.uses_index()
        if page_rule and not self._rope_ready:   # (its first call measures the rope's scale: not in a trace)
            pos.rope(mx.zeros((1, 1, self.dims[0])), offset=0)
            self._rope_ready = True
        static = Static(summary=cfg.summary, top_pages=self.top_pages, few=P <= self.top_pages, index=uses,
                        index_block=cfg.index_block,
                        blocks_kept=min(cfg.index_expand * self.top_pages, NB) if uses else 0,
                        page_size=self.page_size, units=units, unit=unit, span_score=cfg.span_score,
                        page_rule=page_rule, sticky=cfg.sticky and self._recent is not None,
                        packed=None if self.config.cold_bits is None else (self.keys.bits, self.keys.group))
        buckets = {name: _bucket(len(r), r.capacity) for name, r in index.arrays().items()}
        self._static_for = (key, (static, pos.rope if page_rule else None, buckets))
        return self._static_for[1]

    def select_arrays(self, static: Static) -> tuple:
        """The arrays a decode step's selection reads, as they are now: the summaries' capacity
        arrays by name, the keys' and the values' capacity arrays (codes, scale and zero where
        packed), the sticky pages (None unless `static.sticky`)."""
        parts = (lambda rows: tuple(a.array for a in rows.parts().values()) if isinstance(rows, _PackedRows)
                 else (rows.array,))
        return ({name: r.array for name, r in self.index.rows.items()}, parts(self.keys), parts(self.values),
                _recent_array(self._recent) if static.sticky else None)

    def has_sticky(self) -> bool:
        """Whether the next pass joins the last one's sticky pages (`Static.sticky`)."""
        return self.config.sticky and self._recent is not None

    # ----- a compiled decode step of the whole model (cache/compiled.py) ------------------------
    def step_ready(self, ahead: bool = False) -> bool:
        """Whether the next decode step can evict into and search this store inside a compiled
        step of the whole model: it holds tokens, in RAM (nothing spilled, no budget to spill
        to), exact rows (not packed), no oracle's pages pinned, stages not timed, and room for one
        more row (a growth runs eager). (The `slots` rule never asks: its layers do not compile.)
        `ahead`: also a store that is still empty or has no room for one more row, which serve's
        batched step readies before the step (its first token evicted eagerly, its rows' capacity
        grown: compiled_retrieval.py `ready_ahead`, `make_room`)."""
        keys, values = self.keys, self.values
        if self.n == 0 and not ahead:
            return False
        return (self.pinned is None and self.config.cold_ram is None
                and self.config.cold_bits is None and not self.stages.enabled
                and (ahead or (keys.n < keys.capacity and values.n < values.capacity)))

    def make_room(self) -> None:
        """Room for one more row in the rows' arrays (`DeviceRows.make_room`: the growth `append`
        would make; exact rows, nothing spilled: `step_ready`), made ahead of a compiled step."""
        if self.keys is not None:
            self.keys.make_room(1)
            self.values.make_room(1)

    def completes_page(self, n: int = 1) -> bool:
        """Whether `n` more evicted tokens complete a page (whose summaries a compiled step does
        not make: such a step evicts eagerly first, `LayerCache.evict_ahead`)."""
        return (self.n % self.page_size) + n >= self.page_size

    def took(self, keys: mx.array, values: mx.array, k: mx.array, start_position: int) -> None:
        """`append`'s bookkeeping for one evicted token a compiled step wrote already (its fp32
        pre-RoPE key `k` [G, 1, D] at row n of the capacity arrays `keys`, `values`, which replace
        this store's), whose absolute position is `start_position`; it completes no page."""
        self.keys.took(keys, 1)
        self.values.took(values, 1)
        self.positions.append(np.arange(start_position, start_position + 1, dtype=np.int64))
        self.index.add(k)
        self.n += 1

    def keep_sticky(self, recent: mx.array) -> None:
        """A compiled step's next sticky pages [G, S] (`device_select`'s last output), kept where
        the pages are sticky."""
        if self.config.sticky:
            self._recent = recent

    def picked(self, idx: mx.array, valid: mx.array, last: mx.array, scored: mx.array,
               recent: mx.array) -> Selection:
        """A compiled step's pick (`device_select`'s outputs) as a `Selection` (telemetry; asked
        for only where it records, compiled_retrieval.commit, which keeps the sticky pages)."""
        return self._selection(1, idx, valid, last, scored, idx.shape[1], 1, None)

    def _place(self, k: mx.array, idx: mx.array, slot: int, pos: Any) -> mx.array:
        return place(k, idx, slot, pos, self.page_size)

    def _retrieve_per_query(self, reading: Reading) -> tuple[list, Selection]:
        """The `slots` rule: every query a pool of its own (its coarse pages and the unfinished
        page's tokens) and its own `retrieve_tokens` best tokens by exact score, gathered per
        query [B, Hkv, L, T, D] and placed at consecutive slots ending at `reading.first_slot`."""
        queries, pos = reading.queries, reading.positions
        B, Hq, L, D = queries.shape
        G, ps, P = self.G, self.page_size, self.n_pages
        rep = Hq // (G // B)
        q = queries.astype(mx.float32)
        slot = reading.first_slot if pos.shifted else 0
        if slot:
            q = pos.rotate_to(q, -slot)
        qn = q.reshape(G, rep, L, D)
        pages = self.coarse(qn)                                                    # [G, L, k]
        if L == 1 and self.checks is not None:
            self.checks.append(self._check(pages.reshape(G, -1)))
        idx = (pages[..., None] * ps + mx.arange(ps)).reshape(G, L, -1)
        if self.n > P * ps:
            idx = mx.concatenate([idx, mx.broadcast_to(mx.arange(P * ps, self.n), (G, L, self.n - P * ps))], axis=-1)
        m = idx.shape[-1]
        T = min(self.retrieve_tokens, m)
        if T < m:
            keys = self._gather(self.keys, idx)                                    # [G, L, m, D]
            exact = (qn.transpose(0, 2, 1, 3) @ keys.swapaxes(-1, -2)).max(axis=2)  # [G, L, m]
            idx = mx.take_along_axis(idx, mx.argpartition(-exact, T - 1, axis=-1)[..., :T].astype(mx.int32), axis=-1)
        idx = mx.sort(idx, axis=-1)
        k = self._gather(self.keys, idx).reshape(B, -1, L, T, D)
        v = self._gather(self.values, idx).reshape(B, k.shape[1], L, T, -1)
        if pos.shifted:
            k = pos.place(k, slot - T + 1)
        last = idx[:, -1]
        selection = Selection(layer=self.layer_index, queries=L, cold_tokens=self.n, cold_pages=P,
                              page_size=ps, tokens_scored=m, indexed=self.index.uses_index(),
                              pages=pages[:, -1], positions=self.positions.view(), tokens_retrieved=T,
                              fetched=lambda: list(np.asarray(last)))
        return [RetrievedSegment(k, v)], selection

    def segments(self, reading: Reading) -> list:
        """The `Store` interface: the retrieved segments alone."""
        return self.retrieve(reading)[0] if self.n else []

    # ----- accounting -----------------------------------------------------------------------
    def _row_arrays(self) -> dict:
        """Every array of this store by name, as the host store names them."""
        out: dict = {}
        for side in ("keys", "values"):
            rows = getattr(self, side)
            if isinstance(rows, _PackedRows):
                out.update({f"{side}.{p}": a for p, a in rows.parts().items()})
            elif rows is not None:
                out[side] = rows
        out["positions"] = self.positions
        out.update(self.index.arrays())
        return out

    def nbytes_breakdown(self) -> dict[str, int]:
        if self.G is None:
            return {"cold": 0}
        out: dict[str, int] = {}
        for name, array in self._row_arrays().items():
            part = "cold_positions" if name == "positions" else "cold_summary" if name in SUMMARIES else "cold"
            out[part] = out.get(part, 0) + array.nbytes
            if getattr(array, "disk_nbytes", 0):      # spilled rows (the RAM budget)
                out["cold_disk"] = out.get("cold_disk", 0) + array.disk_nbytes
        return out

    # ----- prompt-cache files (cache/persist.py): the host store's names and layout ------------
    def state(self) -> tuple[dict, dict]:
        meta: dict = {"n": self.n, "G": self.G, "B": self.B}
        if self.G is None:
            return {}, meta
        meta["dims"] = list(self.dims)
        arrays: dict = {}
        for name, arr in self._row_arrays().items():
            arrays[name], meta[name] = arr.state()
        tail = self.index.tail
        arrays["tail_keys"] = (np.asarray(tail.swapaxes(0, 1)) if tail is not None
                               else np.zeros((0, self.G, self.dims[0]), np.float32))
        if self._recent is not None:
            meta["recent"] = [row[row >= 0].tolist() for row in np.asarray(_recent_array(self._recent))]
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        if meta["G"] is None:
            return
        G, B = int(meta["G"]), int(meta["B"])
        self._init_arrays(B, G // B, *meta["dims"])
        for name, arr in self._row_arrays().items():
            entry = arrays[name]
            if isinstance(arr, GrowingArray):
                arr.load_state(entry, meta[name])
            else:
                arr.load_state(entry.np(), meta[name])
        tail = arrays["tail_keys"].np()
        self.index.truncate(int(meta["n"]), mx.array(tail).swapaxes(0, 1) if len(tail) else None)
        self.n = int(meta["n"])
        if self.config.cold_ram is not None:
            self._spill_past_budget()
        if "recent" in meta:
            rows = meta["recent"]
            width = max([len(r) for r in rows] + [1])
            self._recent = mx.array(np.array([list(r) + [-1] * (width - len(r)) for r in rows], dtype=np.int32))

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def mark(self) -> dict:
        """This append-only store's extent, to cut it back to (`rewind`): its token count, the
        unfinished page's exact keys and the sticky pages (arrays are immutable: kept as they are)."""
        if self.G is None:
            return {"n": 0}
        return {"n": self.n, "tail": self.index.tail, "recent": self._recent}

    def rewind(self, mark: dict) -> None:
        if self.G is None:
            return
        n = mark["n"]
        for name, arr in self._row_arrays().items():
            if name not in SUMMARIES:
                arr.truncate(n)
        self.index.truncate(n, mark.get("tail"))
        self.n = n
        self._recent = mark.get("recent")

    def close(self) -> None:
        self.keys = self.values = None
        self.n = 0
        if self.spill_dir is not None:
            remove_dir(self.spill_dir)


def place(k: mx.array, idx: mx.array, slot: Any, pos: Any, page_size: int) -> mx.array:
    """Retrieved pre-RoPE keys [B, Hkv, T, D] (cold indices `idx` [G, T]) at their slots:
    every one at `slot` (fixed), token j of a page at slot + j (page); as stored (absolute).
    (A compiled decode step of the whole model places its picks with it too, at slot 0.)"""
    if not pos.shifted:
        return k
    if pos.fixed:     # (slot 0: the query was turned to their slot instead, layer.py)
        return pos.rotate_to(k, slot) if slot else k
    at = (slot + idx % page_size).reshape(-1).astype(mx.int32)
    return pos.rope(k.reshape(-1, 1, k.shape[-1]), offset=at).reshape(k.shape)


def _bucket(n: int, capacity: int) -> int:
    """The least power of two >= n (at least 16), at most `capacity`."""
    return min(capacity, max(16, 1 << max(n - 1, 0).bit_length()))


class _PickedPages:
    """The pages [G, S] (-1: none) holding the tokens a pass's last query picked, read from its
    `PoolSegment` once attention has scored (at the next pass: still lazy, never on the host)."""

    def __init__(self, idx: mx.array, valid: mx.array, segment: PoolSegment, unit: int, page_size: int):
        self.idx, self.valid, self.segment, self.unit, self.page_size = idx, valid, segment, unit, page_size
        self._pages: Optional[mx.array] = None

    def pages(self) -> mx.array:
        if self._pages is None:
            G = self.idx.shape[0]
            picked = self.segment.last_picked().reshape(G, -1)[:, :: self.unit]   # a span's first token
            tok = mx.take_along_axis(self.idx, picked, axis=-1)
            ok = mx.take_along_axis(self.valid, picked, axis=-1)
            self._pages = mx.where(ok, tok // self.page_size, -1)
            self.idx = self.valid = self.segment = None
        return self._pages


def _recent_array(recent: Any) -> mx.array:
    return recent.pages() if isinstance(recent, _PickedPages) else recent


def _fetched(idx: mx.array, valid: mx.array, segment: Optional[PoolSegment]):
    """() -> the cold indices each row's last query fetched (telemetry, asked where a needle is
    known: it reads them back)."""
    def fetched() -> list:
        G = idx.shape[0]
        rows, ok = np.asarray(idx), np.asarray(valid)
        if not isinstance(segment, PoolSegment):   # picked before attention (or None: in a compiled step): all of them
            return [row[o] for row, o in zip(rows, ok)]
        picked = np.asarray(segment.last_picked()).reshape(G, -1)
        return [row[i[o[i]]] for row, o, i in zip(rows, ok, picked)]
    return fetched
