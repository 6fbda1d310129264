"""Tiered retrieval: the cold store that receives what the hot window evicts, and the
coarse-to-fine search that brings the best-matching cold tokens back into attention.

KIV (Babyhamsta/KIV) keeps a hot window of exact K/V, pages evicted tokens into a cold store,
summarises each page by its mean key, and at every decode step scores the query against the
summaries (coarse pass), scores the tokens of the best pages exactly (fine pass) and attends
over the top-P tokens plus the hot window. This module does the same with the weak points
fixed (../shared/REFERENCES.md):

* Page summary: Quest's per-channel key min and max by default. Its page score
  sum_i max(q_i * min_i, q_i * max_i) is an upper bound on q.k for every key in the page, so
  a page holding a key that matches the query is never ranked below a page whose keys all
  match it less; the mean key (KIV) dilutes a single needle token page_size-fold. Both are
  available (`summary`), see tests/test_retrieval.py and docs/retrieval.md for recall.
* Appends: tokens go into preallocated token-major arrays [capacity, B*Hkv, D] that double
  when full (amortised O(page) per page, never a whole-store copy per page); the disk store
  is a numpy memmap whose file grows in place (no copy at all). Summaries are kept in RAM
  (1/page_size of the keys).
* The partial last page has no summary yet: its tokens are always scored exactly, so a token
  is retrievable from the step it leaves the hot window.
* Retrieval runs for every forward pass, prefill chunks included, as one pool per pass
  (`pool`): the coarse pass ranks pages for the pass's last query and (a chunk) the mean of
  its queries, the union of their pages (and the unfinished page) is gathered once, and every
  query then picks its own `retrieve_tokens` tokens, or its best pages whole ("spans"), from
  the pool by exact score inside attention (`segments.PoolSegment`). A decode step's pool is
  its query's own pages, so it fetches exactly what a per-query search would; a chunk's last
  query (the question, in a needle prompt) keeps its own pages too. The per-query search
  (`select`) stays as the reference and serves the `slots` rule, which numbers each query's
  own tokens.
* Positions (the `rope_mode` of the policy, "shifted" by default): cold keys are stored
  before RoPE; the hot window sits at cache slots right after the sink and the retrieval
  slots, so query-key distances never exceed sink + retrieve slots + hot_budget + prefill
  chunk, whatever the context length (on frame positions the layer cache turns the queries
  to the retrieved slot instead and hands them here with slot 0, layer.py). `retrieved_position="fixed"` (InfLLM) rotates every
  retrieved key to ONE slot just before the hot window; "page" puts token j of every page at
  the j-th of `page_size` slots there (a span keeps its inner distances); "slots" gives them consecutive slots
  in their original order, min(cold tokens, retrieve_tokens) of them, so when everything is
  retrieved the distances equal the full cache's (positions.py decides every slot). With rope_mode "absolute"
  keys keep their original rotation and queries their true position (the naive baseline,
  outside the trained range once the context exceeds it). The fine pass ranks tokens by the
  score they will really get: the query is rotated back by the slot the token will occupy.
* Telemetry: every retrieval returns a `telemetry.Selection` (pages, tokens) beside its
  segments; the layer cache records it (telemetry.py).
* Rows are stored token-major in `arrays.GrowingArray`s (RAM, or memory-mapped in a private
  directory removed by `close()` or when the store is collected); `cold_bits` packs them with
  the cache's codec (`KVCache.quantise_affine`, values' per-token layout).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..config import CacheConfig
from ..quant import GROUP_SIZES
from .arrays import GrowingArray, private_dir, remove_dir, remove_with
from .segments import PoolSegment, Reading, RetrievedSegment
from .telemetry import Selection, StageTimes

__all__ = ["ColdStore"]

_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}  # numpy has no bf16


class _PackedRows:
    """Cold rows [n, G, D] quantised per token with `quant.quantise_v` (KIVI's value layout:
    asymmetric affine, groups of channels), stored as packed uint32 codes + scale + zero."""

    def __init__(self, G: int, D: int, bits: int, path: Optional[str], codec: Any):
        self.codec = codec
        groups = [g for g in sorted(GROUP_SIZES, reverse=True) if D % g == 0]
        if not groups:
            raise ValueError(f"cold_bits needs a head dimension that is a multiple of "
                             f"{min(GROUP_SIZES)}, got {D}")
        self.bits, self.group = bits, groups[0]
        name = (lambda s: None) if path is None else (lambda s: f"{path}-{s}")
        self.codes = GrowingArray((G, D * bits // 32), np.uint32, name("codes"))
        self.scale = GrowingArray((G, D // self.group), np.float32, name("scale"))
        self.zero = GrowingArray((G, D // self.group), np.float32, name("zero"))

    def append(self, rows: np.ndarray) -> None:
        packed, scale, zero = self.codec.quantise_affine(mx.array(rows), self.bits, self.group)
        self.codes.append(np.asarray(packed))
        self.scale.append(np.asarray(scale))
        self.zero.append(np.asarray(zero))

    def gather(self, idx: np.ndarray, gi: np.ndarray) -> np.ndarray:
        parts = [mx.array(a.array[idx, gi]) for a in (self.codes, self.scale, self.zero)]
        return np.asarray(self.codec.dequantise_v(*parts, self.bits, self.group))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes


class ColdStore:
    """One layer's cold store: pages of evicted tokens, summaries, and retrieval."""

    def __init__(self, config: CacheConfig, codec: Any, layer_index: int = 0):
        self.config = config
        self.codec = codec           # KVCache: the packing of `cold_bits` rounds through it
        self.layer_index = layer_index
        self.stages = StageTimes()   # per-stage seconds of retrieval (off unless `enabled`)
        self.page_size = config.page_size
        self.top_pages = config.top_pages
        self.retrieve_tokens = config.retrieve_tokens
        self.summary = config.summary
        self.cold_bits = config.cold_bits
        self.dtype = _NP_DTYPES[config.storage]
        # a private directory for the disk store, removed by close() or with this store
        self.directory = private_dir(f"cold-l{layer_index}", config.cold_path) if config.cold_store == "disk" else None
        if self.directory is not None:
            remove_with(self, self.directory)
        self.n = 0
        self.G: Optional[int] = None  # B * Hkv
        self.B: Optional[int] = None
        self.keys = self.values = None   # GrowingArray [n, G, D] or _PackedRows
        self.positions: Optional[GrowingArray] = None
        self.smin = self.smax = self.smean = None  # GrowingArray [pages, G, D]
        self.bmin = self.bmax = self.bmean = None  # the same per block of `index_block` pages
        self._recent: Optional[Any] = None   # sticky: () -> pages [G] the last pass's last query picked

    # ----- storage --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    @property
    def n_pages(self) -> int:
        return self.n // self.page_size

    @property
    def n_blocks(self) -> int:
        Bp = self.config.index_block
        return self.n_pages // Bp if Bp else 0

    def _path(self, name: str) -> Optional[str]:
        if self.directory is None:
            return None
        return os.path.join(self.directory, f"layer{self.layer_index}-{name}.bin")

    def _init_arrays(self, B: int, H: int, Dk: int, Dv: int) -> None:
        self.B, self.G = B, B * H
        self.dims = (Dk, Dv)
        G = self.G
        if self.cold_bits is None:
            self.keys = GrowingArray((G, Dk), self.dtype, self._path("keys"))
            self.values = GrowingArray((G, Dv), self.dtype, self._path("values"))
        else:
            self.keys = _PackedRows(G, Dk, self.cold_bits, self._path("keys"), self.codec)
            self.values = _PackedRows(G, Dv, self.cold_bits, self._path("values"), self.codec)
        # a disk store maps everything that grows with the document (positions and summaries
        # too), so its anonymous memory stays bounded by the hot window and the open page
        self.positions = GrowingArray((), np.int64, self._path("positions"))
        wanted = {"minmax": ("smin", "smax"), "mean": ("smean",), "hybrid": ("smin", "smax", "smean")}
        blocks = {"smin": "bmin", "smax": "bmax", "smean": "bmean"}
        for name in wanted[self.summary]:
            setattr(self, name, GrowingArray((G, Dk), np.float32, self._path(name), initial=16))
            if self.config.index_block:
                setattr(self, blocks[name], GrowingArray((G, Dk), np.float32, self._path(blocks[name]), initial=16))
        self._tail_keys: list[np.ndarray] = []  # exact fp32 keys of the unfinished page

    def append(self, keys: mx.array, values: mx.array, start_position: int) -> None:
        """Append evicted tokens [B, H, n, D] whose first has absolute position `start_position`."""
        B, H, n, Dk = keys.shape
        if n == 0:
            return
        if self.G is None:
            self._init_arrays(B, H, Dk, values.shape[3])
        k = np.asarray(keys.astype(mx.float32)).transpose(2, 0, 1, 3).reshape(n, B * H, Dk)
        v = np.asarray(values.astype(mx.float32)).transpose(2, 0, 1, 3).reshape(n, B * H, -1)
        self.keys.append(k.astype(self.dtype) if self.cold_bits is None else k)
        self.values.append(v.astype(self.dtype) if self.cold_bits is None else v)
        self.positions.append(np.arange(start_position, start_position + n, dtype=np.int64))
        # summaries of the pages this append completes (from the exact keys, before rounding)
        self._tail_keys.append(k)
        done_before = self.n // self.page_size
        self.n += n
        done_after = self.n // self.page_size
        if done_after > done_before:
            tail = np.concatenate(self._tail_keys, axis=0)
            full = (done_after - done_before) * self.page_size
            pages = tail[:full].reshape(done_after - done_before, self.page_size, self.G, Dk)
            if self.smin is not None:
                self.smin.append(pages.min(axis=1))
                self.smax.append(pages.max(axis=1))
            if self.smean is not None:
                self.smean.append(pages.mean(axis=1))
            self._tail_keys = [tail[full:]] if tail.shape[0] > full else []
            self._add_blocks()

    def _add_blocks(self) -> None:
        """Block summaries of the index for every block of pages completed so far."""
        Bp = self.config.index_block
        if not Bp:
            return
        done = (self.bmin if self.bmin is not None else self.bmean).n
        for b in range(done, self.n_blocks):
            sl = slice(b * Bp, (b + 1) * Bp)
            if self.bmin is not None:
                self.bmin.append(self.smin.view()[sl].min(axis=0, keepdims=True))
                self.bmax.append(self.smax.view()[sl].max(axis=0, keepdims=True))
            if self.bmean is not None:
                self.bmean.append(self.smean.view()[sl].mean(axis=0, keepdims=True))

    def _gather(self, store: Any, idx: np.ndarray) -> np.ndarray:
        gi = np.arange(self.G).reshape((self.G,) + (1,) * (idx.ndim - 1))
        if isinstance(store, GrowingArray):
            return store.array[idx, gi].astype(np.float32)
        return store.gather(idx, gi)

    # ----- retrieval ------------------------------------------------------------------------
    def page_scores(self, q: np.ndarray, summary: Optional[str] = None) -> np.ndarray:
        """Coarse pass over every page: queries [G, rep, L, D] x summaries -> [G, L, pages]
        (max over the GQA group: a page any head of the group wants is kept)."""
        return self._scan(q, summary or self.summary, self.smin, self.smax, self.smean)

    @staticmethod
    def _scan(q: np.ndarray, summary: str, smin, smax, smean) -> np.ndarray:
        """Scores of queries [G, rep, L, D] against every row of page-major summaries
        [P, G, D] (pages, or the index's blocks): BLAS matmuls over them seen as [G, D, P]."""
        G, rep, L, D = q.shape
        out = _summary_scores(q.reshape(G, rep * L, D), summary, smin, smax, smean,
                              lambda x, summ: np.matmul(x, summ.view().transpose(1, 2, 0)))
        return out.reshape(G, rep, L, -1).max(axis=1)

    def _candidate_scores(self, q: np.ndarray, summary: str, cand: np.ndarray) -> np.ndarray:
        """Scores [G, L, C] of queries [G, rep, L, D] against the pages `cand` [G, L, C] only."""
        gi = np.arange(self.G).reshape(self.G, 1, 1)
        out = _summary_scores(q.transpose(0, 2, 1, 3), summary, self.smin, self.smax, self.smean,
                              lambda x, summ: np.matmul(x, summ.array[cand, gi].transpose(0, 1, 3, 2)))
        return out.max(axis=2)                                         # [G, L, rep, C] -> [G, L, C]

    def _uses_index(self) -> bool:
        """The two-level index pays once the flat scan covers > 2x the pages it would score."""
        Bp = self.config.index_block
        return bool(Bp) and self.n_pages > 2 * self._expanded_blocks() * Bp

    def _expanded_blocks(self) -> int:
        return self.config.index_expand * self.top_pages

    def ranked_pages(self, q: np.ndarray, summary: str) -> np.ndarray:
        """The `top_pages` best pages [G, L, k] for each query, best first, by one summary.

        Short stores scan every page summary. Long ones use the two-level index: blocks of
        `index_block` pages carry the min of their pages' mins and the max of their maxes
        (still an upper bound on every key of the block; mean: the mean of the means), the
        `index_expand` x `top_pages` best blocks (a decode step; a chunk's rows: `top_pages`)
        are expanded and their pages ranked, with the pages of the unfinished block always among
        the candidates. Decode then reads P / index_block block summaries plus that many blocks'
        page summaries instead of all P."""
        k = min(self.top_pages, self.n_pages)
        if self._uses_index():
            Bp = self.config.index_block
            NB = self.n_blocks
            bs = self._scan(q, summary, self.bmin, self.bmax, self.bmean)       # [G, L, NB]
            # a decode step (one query row) expands index_expand x top_pages blocks; a prefill
            # chunk's rows (its last and its mean query) top_pages, their pool being shared
            kb = min(self._expanded_blocks() if q.shape[2] == 1 else self.top_pages, NB)
            blocks = np.argpartition(-bs, kb - 1, axis=-1)[..., :kb]
            cand = (blocks[..., None] * Bp + np.arange(Bp)).reshape(*blocks.shape[:2], -1)
            if self.n_pages > NB * Bp:
                rest = np.broadcast_to(np.arange(NB * Bp, self.n_pages), cand.shape[:2] + (self.n_pages - NB * Bp,))
                cand = np.concatenate([cand, rest], axis=-1)
            sc = self._candidate_scores(q, summary, cand)
        else:
            cand = None
            sc = self.page_scores(q, summary)
        top = np.argpartition(-sc, k - 1, axis=-1)[..., :k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(sc, top, axis=-1), axis=-1), axis=-1)
        return top if cand is None else np.take_along_axis(cand, top, axis=-1)

    def top_pages_of(self, q: np.ndarray) -> np.ndarray:
        """The `top_pages` pages [G, L, k] for each query. "hybrid" interleaves the min/max
        ranking and the mean ranking (a page counts at its better rank) and keeps the first
        k distinct pages."""
        k = self.top_pages
        if self.summary != "hybrid":
            return self.ranked_pages(q, self.summary)
        lists = [self.ranked_pages(q, summary) for summary in ("minmax", "mean")]
        both = np.stack(lists, axis=-1).reshape(*lists[0].shape[:-1], 2 * k)  # mm0, mean0, mm1, ...
        out = np.empty(lists[0].shape, dtype=both.dtype)
        flat_in, flat_out = both.reshape(-1, 2 * k), out.reshape(-1, k)
        for r in range(flat_in.shape[0]):
            _, first = np.unique(flat_in[r], return_index=True)
            flat_out[r] = flat_in[r][np.sort(first)[:k]]
        return out

    def select(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Coarse + fine pass for queries [G, rep, L, D] (fp32, positioned as the keys will be).

        Every query position gets its own pages and tokens (a prefill chunk retrieves per
        query, exactly as decode does). Returns (cold indices [G, L, T] in position order,
        pages [G, L, k], tokens scored per query m).
        """
        G, _, L, _ = q.shape
        P, ps = self.n_pages, self.page_size
        if P > self.top_pages:
            pages = self.top_pages_of(q)
        else:
            pages = np.broadcast_to(np.arange(P), (G, L, P))
        idx = (pages[..., None] * ps + np.arange(ps)).reshape(G, L, -1)
        if self.n > P * ps:
            tail = np.broadcast_to(np.arange(P * ps, self.n), (G, L, self.n - P * ps))
            idx = np.concatenate([idx, tail], axis=-1)
        m = idx.shape[-1]
        T = min(self.retrieve_tokens, m)
        if T < m:
            kk = self._gather(self.keys, idx)                        # [G, L, m, D]
            exact = np.matmul(q.transpose(0, 2, 1, 3), kk.transpose(0, 1, 3, 2)).max(axis=2)  # [G, L, m]
            pick = np.argpartition(-exact, T - 1, axis=-1)[..., :T]
            idx = np.take_along_axis(idx, pick, axis=-1)
        return np.sort(idx, axis=-1), pages, m

    def pool(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pages a forward pass fetches: for query rows [G, rep, R, D] (the pass's last query,
        and for a chunk the mean of its queries, positioned as the keys will be), the union of
        each row's `top_pages` pages (`top_pages_of`), plus the unfinished page. Returns page
        ids [G, K] in position order, padded with -1 (rows may differ in how many distinct pages
        they have), and the last query's own pages [G, k] (telemetry)."""
        P = self.n_pages
        if P > self.top_pages:
            lists = self.top_pages_of(rows)                                   # [G, R, k]
            rows_u = [np.unique(lists[g]) for g in range(self.G)]
            K = max(len(u) for u in rows_u)
            pool = np.full((self.G, K), -1, dtype=np.int64)
            for g, u in enumerate(rows_u):
                pool[g, :len(u)] = u
            last = lists[:, 0]
        else:
            pool = np.broadcast_to(np.arange(P, dtype=np.int64), (self.G, P))
            last = pool
        if self.n > P * self.page_size:
            pool = np.concatenate([pool, np.full((self.G, 1), P, dtype=np.int64)], axis=1)
        return pool, last

    def retrieve(self, reading: Reading) -> tuple[list, Selection]:
        """Attention segments of the cold tokens retrieved for `reading.queries` [B, Hq, L, D]
        (post-RoPE; with `reading.first_slot` 0 on frame positions, already turned to the
        retrieved slot), and the `Selection` that describes them (telemetry).

        One pool per forward pass (`pool`: a coarse pass for the last query and the chunk's
        mean query, never one per query), gathered once; every query then picks its own
        `retrieve_tokens` tokens (or pages: `retrieve_unit` "spans") from the pool by their
        exact scores, inside attention (`PoolSegment`: the fine pass's scores are the attention
        scores). A decode step's pool is its query's pages: the same tokens as the per-query
        search. The `slots` rule numbers each query's own tokens, so it keeps the per-query
        search (`select`, the reference)."""
        if reading.positions.shifted and reading.positions.rule == "slots":
            return self._retrieve_per_query(reading)
        queries, pos = reading.queries, reading.positions
        B, Hq, L, D = queries.shape
        hkv = self.G // B
        rep = Hq // hkv
        ps = self.page_size
        slot = reading.first_slot if pos.shifted else 0
        with self.stages.timed("coarse"):
            q = queries.astype(mx.float32)
            if slot:    # score as the keys will be seen: q . R(slot) k  ==  R(-slot) q . k
                q = pos.rotate_to(q, -slot)
            rows = q[:, :, -1:] if L == 1 else mx.concatenate([q[:, :, -1:], q.mean(axis=2, keepdims=True)], axis=2)
            rows = np.asarray(rows).reshape(self.G, rep, -1, D)
            pool, last = self.pool(rows)
            if self.config.sticky and self._recent is not None:
                pool = _union(pool, self._recent())
        spans = self.config.retrieve_unit == "spans"
        units = max(1, self.retrieve_tokens // ps) if spans else self.retrieve_tokens
        with self.stages.timed("gather"):
            idx, valid = self.pool_tokens(pool)
            scored = int(valid.sum(axis=1).max())
            keys = self._gather(self.keys, idx)                                   # [G, U, D]
            if L == 1:    # decode: the fine pass on the host, then only the picked rows move
                pick, ok = self._pick(rows[:, :, 0], keys, valid, units, ps if spans else 1)
                idx, keys = np.take_along_axis(idx, pick, axis=-1), np.take_along_axis(keys, pick[..., None], axis=1)
                valid = ok & np.take_along_axis(valid, pick, axis=-1)
                units, unit = idx.shape[1], 1
            else:
                unit = ps if spans else 1
            k = mx.array(keys.reshape(B, hkv, idx.shape[1], -1))
            v = mx.array(self._gather(self.values, idx).reshape(B, hkv, idx.shape[1], -1))
            k = self._place(k, idx, slot, pos)
            self.stages.sync(k, v)
        segment = PoolSegment(k, v, mx.array(valid.reshape(B, hkv, -1)), units, unit)
        picked = segment.last_picked
        if self.config.sticky:
            self._recent = _picked_pages(idx, valid, picked, ps)
        selection = Selection(layer=self.layer_index, queries=L, cold_tokens=self.n, cold_pages=self.n_pages,
                              page_size=ps, tokens_scored=scored, indexed=self._uses_index(),
                              pages=last, positions=self.positions.view(),
                              tokens_retrieved=min(units * unit, idx.shape[1]),
                              fetched=lambda: [row[i[ok[i]]] for row, ok, i in
                                               zip(idx, valid, np.asarray(picked()).reshape(self.G, -1))])
        return [segment], selection

    def pool_tokens(self, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The cold-token rows [G, K * page_size] that a pool of pages [G, K] (-1: none) gathers,
        and which of them are real tokens. Padding gathers its page's first token (a real one
        wherever any of the page is: a page's real tokens are a prefix), so the max over a
        page's rows is its real tokens' max and spans need no token-level mask (PoolSegment)."""
        ps = self.page_size
        first = np.maximum(pool, 0) * ps
        idx = (first[..., None] + np.arange(ps)).reshape(pool.shape[0], -1)
        valid = np.repeat(pool >= 0, ps, axis=1) & (idx < self.n)
        return np.where(valid, idx, np.repeat(first, ps, axis=1)), valid

    def _pick(self, q: np.ndarray, keys: np.ndarray, valid: np.ndarray, units: int, unit: int
              ) -> tuple[np.ndarray, np.ndarray]:
        """A decode step's fine pass on the host (`PoolSegment`'s rule: the `units` best tokens,
        or pages of `unit` tokens, by the exact score, max over the query group): query [G, rep, D]
        against the pool's keys [G, U, D]; the picked pool positions [G, T], in pool order, and
        whether each was scored (not padding)."""
        exact = np.matmul(q, keys.transpose(0, 2, 1)).max(axis=1)                          # [G, U]
        exact = np.where(valid, exact, -np.inf)
        if unit > 1:
            exact = exact.reshape(self.G, -1, unit).max(axis=-1)
        k = min(units, exact.shape[1])
        pick = np.sort(np.argpartition(-exact, k - 1, axis=-1)[:, :k], axis=-1)
        ok = np.isfinite(np.take_along_axis(exact, pick, axis=-1))
        if unit > 1:
            pick = (pick[..., None] * unit + np.arange(unit)).reshape(self.G, -1)
            ok = np.repeat(ok, unit, axis=1)
        return pick, ok

    def _place(self, k: mx.array, idx: np.ndarray, slot: int, pos: Any) -> mx.array:
        """Retrieved pre-RoPE keys [B, Hkv, T, D] (cold indices `idx` [G, T]) at their slots:
        every one at `slot` (fixed), token j of a page at slot + j (page); as stored (absolute)."""
        if not pos.shifted:
            return k
        if pos.fixed:     # (slot 0: the query was turned to their slot instead, layer.py)
            return pos.rotate_to(k, slot) if slot else k
        at = mx.array((slot + idx % self.page_size).reshape(-1).astype(np.int32))
        return pos.rope(k.reshape(-1, 1, k.shape[-1]), offset=at).reshape(k.shape)

    def _retrieve_per_query(self, reading: Reading) -> tuple[list, Selection]:
        """Every query its own coarse and fine pass (`select`), its tokens gathered per query
        [B, Hkv, L, T, D] and placed at consecutive slots ending at `reading.first_slot`."""
        queries, pos = reading.queries, reading.positions
        B, Hq, L, D = queries.shape
        hkv = self.G // B
        rep = Hq // hkv
        q = queries.astype(mx.float32)
        slot = reading.first_slot if pos.shifted else 0
        if slot:
            q = pos.rotate_to(q, -slot)
        qn = np.asarray(q).reshape(self.G, rep, L, D)
        idx, pages, m = self.select(qn)
        T = idx.shape[-1]
        k = mx.array(self._gather(self.keys, idx).reshape(B, hkv, L, T, -1))
        v = mx.array(self._gather(self.values, idx).reshape(B, hkv, L, T, -1))
        if pos.shifted:
            k = pos.place(k, slot - T + 1)
        last = idx[:, -1]
        selection = Selection(layer=self.layer_index, queries=L, cold_tokens=self.n, cold_pages=self.n_pages,
                              page_size=self.page_size, tokens_scored=m, indexed=self._uses_index(),
                              pages=pages[:, -1], positions=self.positions.view(), tokens_retrieved=T,
                              fetched=lambda: list(last))
        return [RetrievedSegment(k, v)], selection

    def segments(self, reading: Reading) -> list:
        """The `Store` interface: the retrieved segments alone."""
        return self.retrieve(reading)[0] if self.n else []

    # ----- accounting -----------------------------------------------------------------------
    def nbytes_breakdown(self) -> dict[str, int]:
        if self.G is None:
            return {"cold": 0}
        # rows under "cold", page summaries under "cold_summary", the token positions (one per
        # token, not per head) under "cold_positions"; "_disk" where mapped
        out: dict[str, int] = {}
        for name, array in self._row_arrays().items():
            part = ("cold_positions" if name == "positions" else "cold_summary" if name in self._SUMMARIES
                    else "cold") + ("_disk" if array.path else "")
            out[part] = out.get(part, 0) + array.nbytes
        return out

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    _SUMMARIES = ("positions", "smin", "smax", "smean", "bmin", "bmax", "bmean")

    def _row_arrays(self) -> dict:
        """Every GrowingArray of this store by name: cold rows (or their packed parts), the
        positions, the page summaries and the index's block summaries."""
        out = {}
        for side in ("keys", "values"):
            store = getattr(self, side)
            if isinstance(store, _PackedRows):
                out.update({f"{side}.{p}": getattr(store, p) for p in ("codes", "scale", "zero")})
            elif store is not None:
                out[side] = store
        out.update({name: getattr(self, name) for name in self._SUMMARIES if getattr(self, name) is not None})
        return out

    def state(self) -> tuple[dict, dict]:
        """Rows as stored (a disk store's rows streamed from its files), summaries, positions,
        the exact keys of the unfinished page, the counters, and (sticky) the pages the last
        query picked."""
        meta: dict = {"n": self.n, "G": self.G, "B": self.B}
        if self.G is None:
            return {}, meta
        meta["dims"] = list(self.dims)
        arrays: dict = {}
        for name, arr in self._row_arrays().items():
            arrays[name], meta[name] = arr.state()
        tail = (np.concatenate(self._tail_keys, axis=0) if self._tail_keys
                else np.zeros((0, self.G, self.dims[0]), np.float32))
        arrays["tail_keys"] = tail
        if self._recent is not None:    # sticky: the pages the last query picked (a few per head)
            meta["recent"] = [row.tolist() for row in self._recent()]
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        if meta["G"] is None:
            return
        G, B = int(meta["G"]), int(meta["B"])
        self._init_arrays(B, G // B, *meta["dims"])
        for name, arr in self._row_arrays().items():
            arr.load_state(arrays[name], meta[name])
        tail = arrays["tail_keys"].np()
        self._tail_keys = [tail] if len(tail) else []
        self.n = int(meta["n"])
        if "recent" in meta:
            recent = [np.asarray(row, dtype=np.int64) for row in meta["recent"]]
            self._recent = lambda: recent

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def mark(self) -> dict:
        """This append-only store's extent, to cut it back to (`rewind`): every array's row count,
        the exact keys of the unfinished page (fewer than a page) and (sticky) the last picks."""
        if self.G is None:
            return {"n": 0}
        tail = np.concatenate(self._tail_keys, axis=0) if self._tail_keys else None
        return {"n": self.n, "rows": {name: len(a) for name, a in self._row_arrays().items()},
                "tail": tail, "recent": self._recent}

    def rewind(self, mark: dict) -> None:
        """Cut the store back to what it held at `mark` (rows appended since are forgotten)."""
        if self.G is None:
            return
        rows = mark.get("rows", {})
        for name, arr in self._row_arrays().items():
            arr.truncate(rows.get(name, 0))
        self.n = mark["n"]
        self._tail_keys = [mark["tail"]] if mark.get("tail") is not None else []
        self._recent = mark.get("recent")

    def close(self) -> None:
        """Drop the arrays (and the disk store's files)."""
        self.keys = self.values = None
        self.n = 0
        if self.directory is not None:
            remove_dir(self.directory)


def _union(pool: np.ndarray, extra: list) -> np.ndarray:
    """Page ids [G, K] (-1: none; the pool) joined row by row with `extra` (a list of G arrays
    of page ids): each row sorted and without repeats, padded with -1."""
    rows = [np.unique(np.concatenate([p[p >= 0], e])) for p, e in zip(pool, extra)]
    out = np.full((len(rows), max(len(r) for r in rows)), -1, dtype=np.int64)
    for g, r in enumerate(rows):
        out[g, :len(r)] = r
    return out


def _picked_pages(idx: np.ndarray, valid: np.ndarray, picked: Any, page_size: int):
    """() -> the pages [G arrays] holding the cold tokens a pass's last query picked: `idx` and
    `valid` [G, U] the pool's rows, `picked()` [.., T] its pool positions (lazy: read after
    attention has run, at the next retrieval)."""
    def pages() -> list:
        pos = np.asarray(picked()).reshape(idx.shape[0], -1)
        return [np.unique(row[i[ok[i]]] // page_size) for row, ok, i in zip(idx, valid, pos)]
    return pages


def _summary_scores(x: np.ndarray, summary: str, smin, smax, smean, score) -> np.ndarray:
    """Quest's bound sum_i max(x_i min_i, x_i max_i) (minmax) or x . mean (mean) of queries x
    against summary arrays, with `score(x, array)` doing the product (full scan or gather)."""
    if summary == "mean":
        return score(x, smean)
    return score(np.maximum(x, 0), smax) + score(np.minimum(x, 0), smin)


