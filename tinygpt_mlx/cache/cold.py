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
  query (the question, in a needle prompt) keeps its own pages too. The `slots` rule numbers
  each query's own tokens, so there every query gets a pool of its own (its coarse pages) and
  the same fine pass on the host as a decode step; the per-query search that came before the
  pool is the tests' reference (tests/retrieval_reference.py).
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
* Rows, positions and page summaries, their growth, files, checkpoints and closing, are
  `cold_rows.ColdRows`, which `ColdStore` extends with the search.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..config import CacheConfig
from .cold_rows import ColdRows
from .segments import PoolSegment, Reading, RetrievedSegment
from .telemetry import Selection, StageTimes, pages_holding

__all__ = ["ColdStore"]

class ColdStore(ColdRows):
    """One layer's cold store: its rows (`ColdRows`) and the retrieval over them."""

    def __init__(self, config: CacheConfig, codec: Any, layer_index: int = 0):
        super().__init__(config, codec, layer_index)
        self.stages = StageTimes()   # per-stage seconds of retrieval (off unless `enabled`)
        self.top_pages = config.top_pages
        self.retrieve_tokens = config.retrieve_tokens
        self._recent: Optional[Any] = None   # sticky: () -> pages [G] the last pass's last query picked
        self.pinned: Optional[np.ndarray] = None   # an oracle (`KVCache.pin`): positions every pool holds

    def coarse(self, rows: np.ndarray) -> np.ndarray:
        """The coarse pass: the `top_pages` pages [G, R, k] of each query row [G, rep, R, D]
        (best first; every complete page, in order, while there are no more of them)."""
        P = self.n_pages
        if P > self.top_pages:
            return self.index.top_pages_of(rows)
        return np.broadcast_to(np.arange(P, dtype=np.int64), (self.G, rows.shape[2], P))

    def pool(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pages a forward pass fetches: for query rows [G, rep, R, D] (the pass's last query,
        and for a chunk the mean of its queries, positioned as the keys will be), the union of
        each row's `top_pages` pages (`top_pages_of`), plus the unfinished page (and the oracle's
        `pinned` pages: `KVCache.pin`). Returns page ids [G, K] in position order, padded with -1
        (rows may differ in how many distinct pages they have), and the last query's own pages
        [G, k] (telemetry)."""
        P = self.n_pages
        lists = self.coarse(rows)                                               # [G, R, k]
        if P > self.top_pages:
            pool = _union(np.empty((self.G, 0), dtype=np.int64), [rows.ravel() for rows in lists])
        else:
            pool = lists[:, 0]
        last = lists[:, 0]
        pool = self._with_unfinished(pool)
        if self.pinned is not None:   # the oracle: their pages in every row, however they rank
            pool = _union(pool, [pages_holding(self.positions.view(), self.n, self.pinned, self.page_size)] * self.G)
        return pool, last

    def retrieve(self, reading: Reading) -> tuple[list, Selection]:
        """Attention segments of the cold tokens retrieved for `reading.queries` [B, Hq, L, D]
        (post-RoPE; with `reading.first_slot` 0 on frame positions, already turned to the
        retrieved slot), and their `Selection` (telemetry): one pool per forward pass (`pool`),
        gathered once; every query picks its own `retrieve_tokens` tokens (or pages: "spans")
        from it by exact score inside attention (`PoolSegment`). The `slots` rule numbers each
        query's own tokens, so each query gets a pool of its own (`_retrieve_per_query`)."""
        if self.config.retrieves_per_query:
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
                ranked = keys
                if pos.shifted and not pos.fixed:   # `page`: token j sits j slots on
                    at = mx.array((idx % ps).reshape(-1).astype(np.int32))
                    ranked = np.asarray(pos.rope(mx.array(keys).reshape(-1, 1, D), offset=at)).reshape(keys.shape)
                pick, ok = self._pick(rows[:, :, 0], ranked, valid, units, ps if spans else 1)
                idx, keys = np.take_along_axis(idx, pick, axis=-1), np.take_along_axis(keys, pick[..., None], axis=1)
                valid = ok & np.take_along_axis(valid, pick, axis=-1)
                units, unit = idx.shape[1], 1
            else:
                unit = ps if spans else 1
            k = mx.array(keys.reshape(B, hkv, idx.shape[1], -1))
            v = mx.array(self._gather(self.values, idx).reshape(B, hkv, idx.shape[1], -1))
            k = self._place(k, idx, slot, pos)
            self.stages.sync(k, v)
        segment = PoolSegment(k, v, mx.array(valid.reshape(B, hkv, -1)), units, unit, self.config.span_score)
        segment.rows = idx   # the cold index of each pool position [G, U] (telemetry, tests)
        picked = segment.last_picked
        if self.config.sticky:
            self._recent = _picked_pages(idx, valid, picked, ps)
        selection = Selection(layer=self.layer_index, queries=L, cold_tokens=self.n, cold_pages=self.n_pages,
                              page_size=ps, tokens_scored=scored, indexed=self.index.uses_index(),
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
        or pages of `unit` tokens, by the exact score, max over the query group; a page by its best
        token, or by its tokens' mean with `span_score` "mean"): query [G, rep, D] against the
        pool's keys [G, U, D]; the picked pool positions [G, T], in pool order, and whether each
        was scored (not padding)."""
        exact = unit_scores(q, keys, valid, unit, self.config.span_score)
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

    def _with_unfinished(self, pool: np.ndarray) -> np.ndarray:
        """Pages [N, K] and, while it holds tokens, the unfinished page as one more column."""
        P = self.n_pages
        if self.n <= P * self.page_size:
            return pool
        return np.concatenate([pool, np.full((pool.shape[0], 1), P, dtype=np.int64)], axis=1)

    def _retrieve_per_query(self, reading: Reading) -> tuple[list, Selection]:
        """Every query a pool of its own (its coarse pages and the unfinished page) and its own
        fine pass on the host (`_pick`, tokens), its tokens gathered per query [B, Hkv, L, T, D]
        and placed at consecutive slots ending at `reading.first_slot`."""
        queries, pos = reading.queries, reading.positions
        B, Hq, L, D = queries.shape
        hkv = self.G // B
        rep = Hq // hkv
        q = queries.astype(mx.float32)
        slot = reading.first_slot if pos.shifted else 0
        if slot:
            q = pos.rotate_to(q, -slot)
        qn = np.asarray(q).reshape(self.G, rep, L, D)
        pages = self.coarse(qn)                                                    # [G, L, k]
        idx, valid = self.pool_tokens(self._with_unfinished(pages.reshape(self.G * L, -1)))
        idx = idx[:, valid[0]]   # every query's pool holds the same tokens: drop the unfinished page's padding
        m = idx.shape[1]
        T = min(self.retrieve_tokens, m)
        if T < m:
            keys = self._gather(self.keys, idx.reshape(self.G, L, m)).reshape(self.G * L, m, -1)
            pick, _ = self._pick(qn.transpose(0, 2, 1, 3).reshape(self.G * L, rep, D), keys,
                                 np.ones(idx.shape, dtype=bool), T, 1)
            idx = np.take_along_axis(idx, pick, axis=-1)
        idx = np.sort(idx, axis=-1).reshape(self.G, L, T)
        k = mx.array(self._gather(self.keys, idx).reshape(B, hkv, L, T, -1))
        v = mx.array(self._gather(self.values, idx).reshape(B, hkv, L, T, -1))
        if pos.shifted:
            k = pos.place(k, slot - T + 1)
        last = idx[:, -1]
        selection = Selection(layer=self.layer_index, queries=L, cold_tokens=self.n, cold_pages=self.n_pages,
                              page_size=self.page_size, tokens_scored=m, indexed=self.index.uses_index(),
                              pages=pages[:, -1], positions=self.positions.view(), tokens_retrieved=T,
                              fetched=lambda: list(last))
        return [RetrievedSegment(k, v)], selection

    def segments(self, reading: Reading) -> list:
        """The `Store` interface: the retrieved segments alone."""
        return self.retrieve(reading)[0] if self.n else []

    # ----- the sticky pages in files and checkpoints (the rows: `ColdRows`) -------------------
    def state(self) -> tuple[dict, dict]:
        """The rows' state and (sticky) the pages the last query picked (a few per head)."""
        arrays, meta = super().state()
        if self.G is not None and self._recent is not None:
            meta["recent"] = [row.tolist() for row in self._recent()]
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        super().load_state(arrays, meta)
        if "recent" in meta:
            recent = [np.asarray(row, dtype=np.int64) for row in meta["recent"]]
            self._recent = lambda: recent

    def mark(self) -> dict:
        return {**super().mark(), "recent": self._recent} if self.G is not None else super().mark()

    def rewind(self, mark: dict) -> None:
        super().rewind(mark)
        if self.G is not None:
            self._recent = mark.get("recent")


def unit_scores(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, unit: int, span_score: str = "max") -> np.ndarray:
    """The fine pass's score of each unit of a pool (`ColdStore._pick`): queries [G, rep, D]
    against keys [G, U, D] -> [G, U / unit], -inf where nothing is `valid` [G, U]; a token's
    score is the group's max; a page's its best token's ("max"), or the group's max of each
    head's mean score over the page's real tokens ("mean")."""
    G, rep = q.shape[:2]
    scores = np.matmul(q, keys.transpose(0, 2, 1))                                     # [G, rep, U]
    if unit > 1 and span_score == "mean":
        w = valid.reshape(G, 1, -1, unit)
        exact = ((scores.reshape(G, rep, -1, unit) * w).sum(axis=-1) / np.maximum(w.sum(axis=-1), 1)).max(axis=1)
        return np.where(w[:, 0].any(axis=-1), exact, -np.inf)
    exact = np.where(valid, scores.max(axis=1), -np.inf)
    return exact.reshape(G, -1, unit).max(axis=-1) if unit > 1 else exact


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
