"""A decode step's retrieval selection as one compiled MLX function (cold_device.py).

The device cold store's search, for one query row per KV-head group, is a fixed chain of array
ops: the coarse pass over the page summaries (or the two-level index), the pool's union with
the unfinished page and the sticky pages, the pool's tokens, the fine pass that picks
`units` tokens or pages, and the gathers. Built op by op in Python it costs the host about
100 graph nodes per layer and step; `mx.compile` replays it from one call. Its shapes depend
only on the arrays' capacities (which double) and on a few regimes (fewer pages than the coarse
pass keeps, the index engaged), not on the token count: the counts (tokens, pages, blocks) are
array inputs, and the scans run over every allocated summary with those past the count masked.
So a function is traced once per regime and power-of-two bucket of those counts, and every
layer of a model shares it (the `page` rule's, which turns keys by the layer's RoPE: one per
layer).

The selection is the same as `DeviceColdStore`'s uncompiled path (and so the host store's):
tests/test_retrieval_device.py compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from .device_pages import bound, hybrid_pages, iota, pool_tokens, union

__all__ = ["Static", "select", "select_in_trace", "fine_pick", "pick_spans"]


@dataclass(frozen=True)
class Static:
    """What a compiled selection is specialised on (besides its inputs' shapes)."""

    summary: str            # minmax | mean | hybrid
    top_pages: int          # k of the coarse pass (min(top_pages, pages) is top_pages here)
    few: bool               # no more pages than top_pages: the pool holds every page
    index: bool             # the two-level index is engaged
    index_block: int
    blocks_kept: int        # kb: blocks the index expands (min(index_expand x top_pages, blocks))
    page_size: int
    units: int              # pages (spans) or tokens a query picks
    unit: int               # page_size (spans) or 1
    span_score: str
    page_rule: bool         # `page`: token j of a page sits j slots after the retrieved slot
    sticky: bool            # a sticky part is given
    packed: Optional[tuple]  # (bits, group) of packed cold rows, or None


_COMPILED: dict[tuple, Callable] = {}


def select(static: Static, codec: Any, rope: Optional[Callable], rows: mx.array, counts: mx.array,
           summaries: dict, keys: tuple, values: tuple, recent: Optional[mx.array]) -> tuple:
    """(picked cold indices [G, T], their keys [G, T, D] as stored, values [G, T, Dv], which are
    real tokens [G, T], the coarse pass's pages [G, k], tokens scored [1, 1], the pages of the picked
    tokens [G, S] (-1: none; the next pass's sticky pages)) for query rows [G, rep, D]
    (turned to the retrieved slot); `counts` = [tokens, pages, blocks] as an int32 array;
    `summaries` the index's capacity arrays by name; `keys`/`values` the rows' capacity arrays
    (codes, scale, zero where packed); `recent` the sticky pages [G, S] or None."""
    key = (static, codec, rope)    # a trace keeps its codec and RoPE (one per model; None off the page rule)
    fn = _COMPILED.get(key)
    if fn is None:
        def run(rows, counts, summaries, keys, values, recent):
            return _select(static, codec, rope, rows, counts, summaries, keys, values, recent)
        fn = _COMPILED[key] = mx.compile(run)
    return fn(rows, counts, summaries, keys, values, recent if recent is not None else mx.zeros((1,), mx.int32))


def select_in_trace(static: Static, codec: Any, rope: Optional[Callable], rows: mx.array, counts: mx.array,
                    summaries: dict, keys: tuple, values: tuple, recent: Optional[mx.array]) -> tuple:
    """`select`'s chain built op by op, for a caller that is itself being traced by `mx.compile`
    (a compiled decode step of the whole model, cache/compiled.py): the same outputs."""
    return _select(static, codec, rope, rows, counts, summaries, keys, values,
                   recent if recent is not None else mx.zeros((1,), mx.int32))


def select_rows(static: Static, codec: Any, rope: Optional[Callable], rows: mx.array, counts: mx.array,
                summaries: dict, keys: list, values: list, recent: Optional[mx.array]) -> tuple:
    """`select_in_trace` for the query rows of several sequences at once (serve's batched step,
    server/batch.py): `rows` [G, rep, D] holds each sequence's G / S rows in turn, `counts`
    [3, G, 1] each row's sequence's (tokens, pages, blocks), `summaries` their summaries stacked
    along the rows (one width: `static` and the widths are the sequences' common ones), `recent`
    their sticky pages stacked; `keys` / `values` each sequence's own capacity arrays (a row's
    tokens are gathered from its own store: no copy of the cold stores). Every row's ops are the
    solo chain's on that row, so each sequence picks what it picks alone. The same outputs as
    `select_in_trace` but the tokens scored per row [G] (a sequence's count is the max over its rows)."""
    S = len(keys)
    g = rows.shape[0] // S

    def gather(stores: list, idx: mx.array) -> mx.array:
        if static.packed is not None or S == 1:
            got = [_gather(codec, static.packed, parts, idx[i * g:(i + 1) * g]) for i, parts in enumerate(stores)]
        else:
            got = _gather_stacked([parts[0] for parts in stores], idx, g)
        return mx.concatenate(got, axis=0) if S > 1 else got[0]
    return _select(static, codec, rope, rows, counts, summaries, keys, values,
                   recent if recent is not None else mx.zeros((1,), mx.int32), gather=gather, per_row=True)


def _select(st: Static, codec: Any, rope: Optional[Callable], q: mx.array, counts: mx.array,
            summaries: dict, keys: Any, values: Any, recent: mx.array,
            gather: Optional[Callable] = None, per_row: bool = False) -> tuple:
    if per_row:     # several stores' rows (select_rows): counts [3, G, 1]
        n, P, NB = counts[0][..., None], counts[1], counts[2]
    else:
        n, P, NB = counts[0:1], counts[1:2], counts[2:3]      # (slices of [1]: a node each, not two)
    if gather is None:
        def gather(parts: tuple, idx: mx.array) -> mx.array:
            return _gather(codec, st.packed, parts, idx)
    G = q.shape[0]
    cap = next(iter(summaries.values())).shape[1] if summaries else 0
    if st.few:
        pages = iota(cap)
        last = mx.broadcast_to(mx.where(pages < P, pages, -1), (G, cap))
    elif st.summary == "hybrid":
        last = hybrid_pages([_ranked(st, q, s, summaries, P, NB, ordered=True) for s in ("minmax", "mean")],
                            st.top_pages)
    else:
        last = _ranked(st, q, st.summary, summaries, P, NB)
    parts = [last, mx.broadcast_to(P.astype(mx.int32), (G, 1))]          # the unfinished page (maybe empty)
    if st.sticky:
        parts.append(recent)
    pool = union(parts)
    ps = st.page_size
    idx, valid = pool_tokens(pool, n, ps)
    if per_row:
        scored = valid.sum(axis=1)                                          # [G]
    else:
        scored = valid.sum(axis=1, keepdims=True).max(axis=0, keepdims=True)    # [1, 1] (kept dims: no squeezes)
    k = gather(keys, idx)                                                   # [G, U, D]
    if st.unit > 1:     # spans: the picked pages' tokens made again from their ids (`pick_spans`)
        idx, valid, recent = pick_spans(q, pool, n, idx, k, valid, st.units, st.unit, st.span_score, ps,
                                        rope if st.page_rule else None)
        k = gather(keys, idx)
    else:
        idx, k, valid = fine_pick(q, idx, k, valid, st.units, st.unit, st.span_score, ps, rope if st.page_rule else None)
        recent = mx.where(valid, idx // ps, -1)                           # the next pass's sticky pages
    return idx, k, gather(values, idx), valid, last, scored, recent


def _ranked(st: Static, q: mx.array, summary: str, summaries: dict, P: mx.array, NB: mx.array,
            ordered: bool = False) -> mx.array:
    """The `top_pages` best pages [G, k] by one summary, over every allocated summary with those
    past the count masked (the two-level index: over the blocks, then the kept blocks' pages and
    the unfinished block's)."""
    k = st.top_pages
    if st.index:
        bs = _bound(q, summary, summaries, "b")                               # [G, capB]
        bs = mx.where(iota(bs.shape[-1]) < NB, bs, -mx.inf)
        kb, Bp = st.blocks_kept, st.index_block
        blocks = mx.argpartition(-bs, kb - 1, axis=-1)[:, :kb].astype(mx.int32)
        # the kept blocks and the unfinished block (NB), whose pages are the candidates, block by block
        blocks = mx.concatenate([blocks, mx.broadcast_to(NB.astype(mx.int32), (blocks.shape[0], 1))], axis=-1)
        cand = (blocks[..., None] * Bp + iota(Bp)).reshape(blocks.shape[0], -1)
        cap = summaries["s" + ("mean" if summary == "mean" else "min")].shape[1]
        sc = (_bound_blocks(q, summary, summaries, blocks, Bp) if cap % Bp == 0
              else _bound_at(q, summary, summaries, mx.minimum(cand, cap - 1)))
        sc = mx.where(cand < P, sc, -mx.inf)
    else:
        cand = None
        sc = _bound(q, summary, summaries, "s")
        sc = mx.where(iota(sc.shape[-1]) < P, sc, -mx.inf)
    top = mx.argpartition(-sc, k - 1, axis=-1)[:, :k].astype(mx.int32)
    if ordered:
        top = mx.take_along_axis(top, mx.argsort(-mx.take_along_axis(sc, top, axis=-1), axis=-1).astype(mx.int32),
                                 axis=-1)
    return top if cand is None else mx.take_along_axis(cand, top, axis=-1)


def _bound(q: mx.array, summary: str, summaries: dict, level: str) -> mx.array:
    """Scores [G, cap] of query rows [G, rep, D] against every allocated summary of a level
    ("s" pages, "b" blocks): Quest's bound (minmax) or the mean key's product, max over rep.
    (The summaries [G, cap, D] times the rows, not the rows times the summaries turned: the
    same products, read in the summaries' own layout; about half the time of a scan of 16K
    blocks under OpenBLAS, where a long context's decode step spent most of its growth.)"""
    # (the rows turned once, [G, D, rep], then split by sign: one transpose per level, not one per summary)
    return bound(q.swapaxes(1, 2), summary, lambda x, name: summaries[level + name] @ x).max(axis=2)


def _bound_blocks(q: mx.array, summary: str, summaries: dict, blocks: mx.array, Bp: int) -> mx.array:
    """`_bound_at` of the pages of `blocks` [G, K] (blocks of `Bp` pages, a capacity that is a
    multiple of Bp), scores [G, K x Bp] block by block: each block's page summaries are one
    gather of a row of Bp x D values (the summaries seen as [G, cap / Bp, Bp x D]), where
    `take_along_axis` of the pages gathered value by value: the same values and products, about
    a third of the time at 2,056 candidates (the index's 256 blocks of 8 pages and the unfinished
    block, 64K-1M tokens). A block past the arrays reads the last one: its pages are past the
    count (masked by the caller)."""
    def score(x: mx.array, name: str) -> mx.array:
        s = summaries["s" + name]
        G, cap, D = s.shape
        rows = s.reshape(G, cap // Bp, Bp * D)[iota(G)[:, None], mx.minimum(blocks, cap // Bp - 1)]
        return rows.reshape(G, -1, D) @ x.swapaxes(1, 2)                         # [G, K x Bp, rep]
    return bound(q, summary, score).max(axis=2)


def _bound_at(q: mx.array, summary: str, summaries: dict, pages: mx.array) -> mx.array:
    """Scores [G, C] of query rows [G, rep, D] against the page summaries at `pages` [G, C]."""
    def score(x: mx.array, name: str) -> mx.array:
        return mx.take_along_axis(summaries["s" + name], pages[..., None], axis=1) @ x.swapaxes(1, 2)   # [G, C, rep]
    return bound(q, summary, score).max(axis=2)


def _gather_stacked(stores: list, idx: mx.array, g: int) -> list:
    """`_gather` of exact stores (fp32 or another float, not packed), each of `g` rows
    [g, cap_i, D], at their rows' indices stacked in `idx` [S g, U]: the indices made the
    gather's shape [S g, U, D] once (one expansion, broadcast and split for all the stores, not
    one per store), then each store's rows taken with its own part of them: the same values as
    `_gather` per store ([g, U, D] each, fp32)."""
    widths = {a.shape[2:] for a in stores}
    if len(widths) != 1 or len(widths.pop()) != 1:
        return [_gather(None, None, (a,), idx[i * g:(i + 1) * g]) for i, a in enumerate(stores)]
    at = mx.broadcast_to(idx[..., None], idx.shape + stores[0].shape[2:])
    at = mx.split(at, len(stores), axis=0) if len(stores) > 1 else [at]     # (one node for every store's part)
    got = [mx.take_along_axis(a, part, axis=1) for a, part in zip(stores, at)]
    return [x if x.dtype == mx.float32 else x.astype(mx.float32) for x in got]


def _gather(codec: Any, packed: Optional[tuple], parts: tuple, idx: mx.array) -> mx.array:
    """Rows at `idx` [G, U] from capacity arrays [G, cap, *] (dequantised where packed), fp32."""
    got = [mx.take_along_axis(a, idx[..., None], axis=1) for a in parts]
    if packed is None:
        return got[0].astype(mx.float32)
    return codec.dequantise_v(*got, *packed)


def _span_scores(q: mx.array, idx: mx.array, keys: mx.array, valid: mx.array, unit: int, span_score: str,
                 page_size: int, rope: Optional[Callable]) -> mx.array:
    """Each pool page's score [G, K] for query rows [G, rep, D] (`fine_pick`'s rule; -inf: a
    page with no real token), or each token's where `unit` is 1."""
    G, rep = q.shape[:2]
    ranked = keys
    if rope is not None:
        at = (idx % page_size).reshape(-1).astype(mx.int32)
        ranked = rope(keys.reshape(-1, 1, keys.shape[-1]), offset=at).reshape(keys.shape)
    scores = q @ ranked.swapaxes(-1, -2)                                             # [G, rep, U]
    if unit > 1 and span_score == "mean":
        w = valid.reshape(G, 1, -1, unit).astype(mx.float32)
        exact = ((scores.reshape(G, rep, -1, unit) * w).sum(axis=-1) / mx.maximum(w.sum(axis=-1), 1)).max(axis=1)
        return mx.where(w[:, 0].sum(axis=-1) > 0, exact, -mx.inf)
    exact = mx.where(valid, scores.max(axis=1), -mx.inf)
    return exact.reshape(G, -1, unit).max(axis=-1) if unit > 1 else exact


def _best(exact: mx.array, units: int, int32: bool = True) -> mx.array:
    """The positions [G, k] of the `units` best scores of `exact` [G, K] (all of them if fewer),
    int32, or (`int32` False: positions only gathered with, `pick_spans`) argpartition's own
    unsigned ints, without a cast."""
    G, K = exact.shape
    k = min(units, K)
    if k == K:
        return mx.broadcast_to(iota(k), (G, k))
    pick = mx.argpartition(-exact, k - 1, axis=-1)[:, :k]
    return pick.astype(mx.int32) if int32 else pick


def pick_spans(q: mx.array, pool: mx.array, n: Any, idx: mx.array, keys: mx.array, valid: mx.array, units: int,
               unit: int, span_score: str, page_size: int, rope: Optional[Callable] = None) -> tuple:
    """`fine_pick` of spans (`unit` = page_size) over a pool of pages [G, K] (-1: none) whose
    tokens `pool_tokens` made (`idx`, `valid` [G, K * unit], their keys [G, U, D]) from a store of
    `n` tokens: the picked cold indices and which are real tokens, the same as `fine_pick`'s, and
    the next pass's sticky pages [G, units] (a picked page whose first token is real, else -1).
    The picked pages' tokens are made again from their ids (`pool_tokens` of the picked pages),
    not taken from the pool's: fewer nodes for a compiled step to replay. (A page `fine_pick`
    marks not `ok` holds no real token, so its tokens are not real here either.)"""
    pick = _best(_span_scores(q, idx, keys, valid, unit, span_score, page_size, rope), units, int32=False)
    pages = mx.take_along_axis(pool, pick, axis=-1)                                  # [G, k]
    idx, valid = pool_tokens(pages, n, page_size)
    # (a page's first token is real where the page is one and starts below n: `valid[:, ::unit]`
    # without the strided slice, a node per layer; fused into the select)
    # (`n` as pool_tokens reads it, [1] or [G, 1, 1] (several stores' rows): as a column here)
    last = n if isinstance(n, int) else n.reshape(-1, 1)
    return idx, valid, mx.where((pages >= 0) & (pages * page_size < last), pages, -1)


def fine_pick(q: mx.array, idx: mx.array, keys: mx.array, valid: mx.array, units: int, unit: int,
              span_score: str, page_size: int, rope: Optional[Callable] = None) -> tuple:
    """A decode step's fine pass (`PoolSegment`'s rule, as the host store's `_pick`): query rows
    [G, rep, D] (turned to the retrieved slot) against a pool's keys [G, U, D] (cold indices
    `idx`, real tokens `valid` [G, U]), scored where they will sit (`rope`: the `page` rule, token j
    of a page j slots on); the `units` best tokens, or pages of `unit` tokens by their best token
    (or their tokens' mean with `span_score` "mean"). Returns the picked cold indices, their keys
    (as stored) and whether each is a real token."""
    G = q.shape[0]
    exact = _span_scores(q, idx, keys, valid, unit, span_score, page_size, rope)
    pick = _best(exact, units)
    ok = mx.take_along_axis(exact, pick, axis=-1) > -mx.inf
    if unit > 1:
        pick = (pick[..., None] * unit + iota(unit)).reshape(G, -1)
        ok = mx.repeat(ok, unit, axis=1)
    return (mx.take_along_axis(idx, pick, axis=-1), mx.take_along_axis(keys, pick[..., None], axis=1),
            ok & mx.take_along_axis(valid, pick, axis=-1))
