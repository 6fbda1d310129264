"""Attention over segments: what each store contributes, and the one softmax across them.

A segment offers `scores(q)` -> [B, Hkv, rep, L, T] for queries q [B, Hkv, rep, L, D] (already
scaled) and `output(p)` -> [B, Hkv, rep, L, D] for probabilities over its T keys. Exact
segments score with a matmul, packed ones (kivi.py) with `mx.quantized_matmul`; nothing is
dequantised into a full-length temporary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from . import cpu_softmax
from .positions import Positions


@dataclass
class Reading:
    """What a store is handed to produce its attention segments: the compute dtype, the
    position rules and its first slot, and (for retrieval) the queries and their scale."""

    dtype: mx.Dtype
    positions: Positions
    first_slot: int = 0
    queries: Optional[mx.array] = None
    scale: float = 1.0


class DenseSegment:
    """Exact keys/values [B, Hkv, T, D] as an attention segment."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys.astype(mx.float32), values.astype(mx.float32)
        self.n_heads = keys.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        B, H, rep, L, D = q.shape     # a KV head's query group as rows: no broadcast copy
        return (q.reshape(B, H, rep * L, D) @ self.keys.swapaxes(-1, -2)).reshape(B, H, rep, L, -1)

    def output(self, p: mx.array) -> mx.array:
        B, H, rep, L, T = p.shape
        return (p.reshape(B, H, rep * L, T) @ self.values).reshape(B, H, rep, L, -1)


class PickedSegment(DenseSegment):
    """Retrieved keys/values [B, Hkv, T, D] a decode step has already picked (cold_device.py), of
    which `valid` [B, Hkv, T] are real tokens: a dense segment with the rest masked (no pick
    inside attention, as `PoolSegment` would make)."""

    def __init__(self, keys: mx.array, values: mx.array, valid: mx.array):
        super().__init__(keys, values)
        self.valid = valid

    def scores(self, q: mx.array) -> mx.array:
        return mx.where(self.mask()[:, :, None], super().scores(q), -mx.inf)

    def mask(self) -> mx.array:
        """`valid` as [B, Hkv, 1, T] (a compiled step hands it so: no node added per layer)."""
        return self.valid if self.valid.ndim == 4 else self.valid[:, :, None]


class RetrievedSegment:
    """Retrieved keys/values [B, Hkv, L, T, D]: each of the L queries has its own T tokens."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys.astype(mx.float32), values.astype(mx.float32)
        self.n_heads = keys.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        """q [B, Hkv, rep, L, D] -> [B, Hkv, rep, L, T]."""
        return (mx.expand_dims(q, -2) @ mx.expand_dims(self.keys, 2).swapaxes(-1, -2)).squeeze(-2)

    def output(self, p: mx.array) -> mx.array:
        """p [B, Hkv, rep, L, T] -> [B, Hkv, rep, L, D]."""
        return (mx.expand_dims(p, -2) @ mx.expand_dims(self.values, 2)).squeeze(-2)


class PoolSegment:
    """A retrieval pool [B, Hkv, U, D] shared by a pass's queries, each of which attends only to
    what it picks from it: its `units` best tokens (`unit` 1), or its `units` best pages of
    `unit` tokens ranked by the best token in them (spans), by the exact attention score (max
    over the KV head's query group, as the per-query search ranks tokens). Tokens not `valid`
    (padding) never count; with spans a page's padding must repeat one of its valid tokens
    (the cold store gathers it so), since pages are masked, not their tokens. The fine pass is
    attention's own q.k over the pool; the softmax and the values then cover only the picked
    tokens [B, Hkv, rep, L, T] (an exp per pool token would cost more than the model's own
    attention on a CPU)."""

    def __init__(self, keys: mx.array, values: mx.array, valid: mx.array, units: int, unit: int = 1,
                 span_score: str = "max"):
        self.keys, self.values = keys.astype(mx.float32), values.astype(mx.float32)
        self.n_heads = keys.shape[1]
        self.valid, self.units, self.unit = valid, units, unit
        self.span_score = span_score if unit > 1 else "max"   # how a page is ranked (spans)
        self.picked: Optional[mx.array] = None      # [B, Hkv, L, T] pool indices, once scored
        self.top: Optional[mx.array] = None         # spans: the picked pages [B, Hkv, L, units], once scored
        self.rows: Any = None    # the cold store's index of each pool position [B * Hkv, U] (its own to set)

    def scores(self, q: mx.array) -> mx.array:
        B, H, rep, L, D = q.shape
        U = self.keys.shape[2]
        s = (q.reshape(B, H, rep * L, D) @ self.keys.swapaxes(-1, -2)).reshape(B, H, rep, L, U)
        if self.span_score == "mean":    # per head, the mean over the page's real tokens; the group's max
            u = self.unit
            w = self.valid.reshape(B, H, 1, 1, U // u, u).astype(s.dtype)
            best = ((s.reshape(B, H, rep, L, U // u, u) * w).sum(axis=-1) / mx.maximum(w.sum(axis=-1), 1)).max(axis=2)
        else:
            best = s[:, :, 0]
            for r in range(1, rep):    # the group's max: elementwise, cheaper than a reduction here
                best = mx.maximum(best, s[:, :, r])
        if self.unit > 1:
            # a page's padding repeats one of its valid tokens (cold.py), so the page max needs
            # only the page-level mask (a masked copy of every score costs more here)
            u = self.unit
            page_valid = self.valid.reshape(B, H, 1, U // u, u).any(axis=-1)
            per_page = best if self.span_score == "mean" else best.reshape(B, H, L, U // u, u).max(axis=-1)
            pages = mx.where(page_valid, per_page, -mx.inf)
            k = min(self.units, pages.shape[-1])
            top = mx.argpartition(-pages, k - 1, axis=-1)[..., :k]                      # [B, H, L, k]
            idx = (top[..., None] * u + mx.arange(u)).reshape(B, H, L, k * u)
            self.top = top
            # whole pages gathered as pages (contiguous rows: faster than token by token)
            sel = mx.take_along_axis(s.reshape(B, H, rep, L, U // u, u),
                                     mx.broadcast_to(top[:, :, None, :, :, None], (B, H, rep, L, k, 1)),
                                     axis=-2).reshape(B, H, rep, L, k * u)
        else:
            pick = mx.where(self.valid[:, :, None], best, -mx.inf)                      # [B, H, L, U]
            k = min(self.units, U)
            idx = mx.argpartition(-pick, k - 1, axis=-1)[..., :k] if k < U else mx.broadcast_to(mx.arange(U), (B, H, L, U))
            sel = mx.take_along_axis(s, mx.broadcast_to(idx[:, :, None], (B, H, rep) + idx.shape[2:]), axis=-1)
        self.picked = idx
        ok = mx.take_along_axis(mx.broadcast_to(self.valid[:, :, None], (B, H, L, U)), idx, axis=-1)
        return mx.where(ok[:, :, None], sel, -mx.inf)

    def output(self, p: mx.array) -> mx.array:
        """p [B, Hkv, rep, L, T] over the picked tokens -> [B, Hkv, rep, L, D]. Spans: each
        query's picked pages of values, gathered as pages (one `take` of rows of `unit` x D
        values) and weighted by one batched matmul per query; tokens: the probabilities
        scattered into a [rep * L, U] matrix (zero where not picked) times the pool's values,
        one matmul (gathering T values per query token by token costs twice as much here).
        With spans at `sink4/hot1024` the scatter's [rep * L, U] matrix is 71 MB per layer and
        chunk, more than the page gather's whole work (docs/retrieval.md, "Prefill against
        StreamingLLM")."""
        B, H, rep, L, T = p.shape
        U = self.values.shape[2]
        if self.top is not None:     # spans: T = units x unit tokens, whole pages in pick order
            u, D = self.unit, self.values.shape[-1]
            P = U // u
            rows = (self.top + (mx.arange(B * H, dtype=self.top.dtype) * P).reshape(B, H, 1, 1)).reshape(-1)
            picked = mx.take(self.values.reshape(B * H * P, u * D), rows, axis=0).reshape(B, H, L, T, D)
            return (p.transpose(0, 1, 3, 2, 4) @ picked).transpose(0, 1, 3, 2, 4)
        idx = mx.broadcast_to(self.picked[:, :, None], (B, H, rep, L, T))
        dense = mx.put_along_axis(mx.zeros((B, H, rep, L, U), dtype=p.dtype), idx, p, axis=-1)
        return (dense.reshape(B, H, rep * L, U) @ self.values).reshape(B, H, rep, L, -1)

    def last_picked(self) -> mx.array:
        """The pool indices the pass's last query picked [B, Hkv, T] (after `scores`)."""
        return self.picked[:, :, -1]


def attend(segments: list, n_retrieved: int, queries: mx.array, scale: float, mask: Any,
           turned: Optional[mx.array] = None, n_turned: int = 0) -> mx.array:
    """One softmax over the scores of every segment; the output sums segment outputs.

    `segments` are in key order with the `n_retrieved` retrieved ones first (visible to every
    query: they are all older). The first `n_turned` segments are scored with `turned` (the
    same queries [B, Hq, L, D] turned by RoPE, so that keys placed relative to it need no
    rotation per step: a retrieval window on frame positions, layer.py), the rest with
    `queries`. Computed in fp32 whatever the storage precision.

    A segment whose keys are stored in a rotated basis names it (`key_basis`, a [D, D] matrix R:
    its scores take the queries as q R) and so does one whose values are (`value_basis`: the
    matrix R^T that turns its output back): the queries are turned once per basis, and the
    outputs of one basis summed before they are turned back once (a KIVI body's packed run and
    near tier share one rotation, packed.py), so a step turns two matrices per layer however
    many segments share the basis.

    One unmasked query over exact segments only (a retrieval decode step's picked cold tokens,
    sink and hot window, compiled or eager) takes the one-query form, `_attend_one`: the same
    products, softmax and sum with the query axis dropped.
    """
    B, Hq, L, D = queries.shape
    if L == 1 and mask is None and all(type(sg) in _EXACT for sg in segments):
        return _attend_one(segments, queries, scale, turned, n_turned)
    hkv = segments[-1].n_heads
    q = ((queries if queries.dtype == mx.float32 else queries.astype(mx.float32)) * scale).reshape(
        B, hkv, Hq // hkv, L, D)
    qt = (turned.astype(mx.float32) * scale).reshape(q.shape) if n_turned else q
    in_basis: dict = {}     # (id of the queries, id of R) -> the queries in that basis

    def query(i: int, sg: Any) -> mx.array:
        base = qt if i < n_turned else q
        basis = getattr(sg, "key_basis", None)
        if basis is None:
            return base
        key = (id(base), id(basis))
        if key not in in_basis:
            in_basis[key] = base @ basis
        return in_basis[key]

    scores = [sg.scores(query(i, sg)) for i, sg in enumerate(segments)]
    sizes = [sc.shape[-1] for sc in scores]
    scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    mask = mask_array(mask, L, sum(sizes), sum(sizes[:n_retrieved]))
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    if L > 1 and _pool_over_exact(segments, n_retrieved) and cpu_softmax.use_here():
        probs = cpu_softmax.softmax_rows(scores)     # a retrieval chunk on an x86 CPU (cpu_softmax.py)
    else:
        probs = mx.softmax(scores, axis=-1)    # (fp32 scores: `precise` gives the same bits, ~2x slower on a CPU)
    pieces, start = [], 0
    for n in sizes:     # (indexed on every axis: half the build time of probs[..., a:b])
        pieces.append(probs[:, :, :, :, start:start + n] if len(sizes) > 1 else probs)
        start += n
    out = None
    rotated: dict = {}      # id of R^T -> (R^T, the sum of the outputs in its basis)
    for sg, p in zip(segments, pieces):
        part = sg.output(p)
        back = getattr(sg, "value_basis", None)
        if back is not None:
            held = rotated.get(id(back))
            rotated[id(back)] = (back, part if held is None else held[1] + part)
            continue
        out = part if out is None else out + part
    for back, part in rotated.values():
        part = part @ back
        out = part if out is None else out + part
    out = out.reshape(B, Hq, L, -1)
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


#: segments whose keys and values are exact and in no rotated basis: one unmasked query over
#: nothing else takes `_attend_one`
_EXACT = (DenseSegment, PickedSegment)


def _pool_over_exact(segments: list, n_retrieved: int) -> bool:
    """A retrieval chunk's pool before exact segments only (a sink and an exact hot window): where
    `attend` may take cpu_softmax's softmax. Not over a KIVI-packed window: the next layer's
    values are quantised there, and a rounding's difference can flip a code (the full KIVI cache,
    on `mx.softmax`, is what tests/test_retrieval.py compares such a cache with)."""
    return (n_retrieved == 1 and type(segments[0]) is PoolSegment
            and all(type(sg) is DenseSegment for sg in segments[1:]))


def _attend_one(segments: list, queries: mx.array, scale: float, turned: Optional[mx.array],
                n_turned: int) -> mx.array:
    """`attend` of one query per row (L = 1), unmasked, over exact segments (`_EXACT`: a decode
    step's picked cold tokens, sink and hot window, each in no rotated basis), the first
    `n_turned` scored with `turned`: `attend_exact_one` over their keys and values, each picked
    segment's own mask applied to its scores. The query axis is dropped (scores [B, Hkv, rep, T])
    instead of reshaped into and out of every product: ~13 graph nodes fewer per retrieval layer
    and step (a compiled retrieval step's attention, compiled_retrieval.py, and the eager decode
    step's)."""
    return attend_exact_one([sg.keys for sg in segments], [sg.values for sg in segments], queries, scale,
                            turned=turned, n_turned=n_turned,
                            masks=[sg.mask() if type(sg) is PickedSegment else None for sg in segments])


def attend_exact_one(keys: list, values: list, queries: mx.array, scale: float, mask: Optional[mx.array] = None,
                     turned: Optional[mx.array] = None, n_turned: int = 0,
                     masks: Optional[list] = None) -> mx.array:
    """One query per row (queries [B, Hq, 1, D]) over exact keys and values [B, Hkv, T_i, D] in key
    order, in no rotated basis: the one-query form that `_attend_one` (retrieval's exact
    segments) and a KIVI step with nothing frozen yet (compiled.py `_TracedKivi`, serve's batched
    step) share. Each part scored with the queries (the first `n_turned` with `turned`) with a
    KV head's query group as rows, masked by its own mask (`masks[i]`, [B, Hkv, 1, T_i], where
    not None), the scores joined, masked by `mask` over the joined columns (where given),
    scaled, one softmax; the values joined in key order and one product (the same sum as a
    product per part, rounded once), the query axis dropped throughout."""
    B, Hq, _, D = queries.shape
    hkv = keys[-1].shape[1]
    # (the scale applied once to the joined scores, not to each query: exact where it is a power
    # of two, as 1 / sqrt(64) is; else within a rounding of the scaled queries' products)
    q = (queries if queries.dtype == mx.float32 else queries.astype(mx.float32)).reshape(B, hkv, -1, D)
    qt = turned.astype(mx.float32).reshape(q.shape) if n_turned else q
    scores = []
    for i, k in enumerate(keys):
        sc = (qt if i < n_turned else q) @ k.swapaxes(-1, -2)
        if masks is not None and masks[i] is not None:
            sc = mx.where(masks[i], sc, -mx.inf)
        scores.append(sc)
    scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    probs = mx.softmax(scores * scale, axis=-1)
    # the values joined in key order and one product (a concatenation and a matmul per layer
    # where a slice of the probabilities, a matmul and a sum per part took 8 nodes at three
    # parts; the same sum, rounded once)
    joined = mx.concatenate(values, axis=2) if len(values) > 1 else values[0]
    out = (probs @ joined).reshape(B, Hq, 1, -1)
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def mask_array(mask: Any, L: int, total: int, n_retrieved: int) -> Optional[mx.array]:
    """`make_mask`'s answer as a boolean [L, total] array (None = all visible); retrieved
    tokens come first and are visible to every query."""
    if mask is None:
        return None
    if isinstance(mask, str):
        stored = total - n_retrieved
        q = mx.arange(stored - L, stored)[:, None]
        mask = mx.arange(stored)[None] <= q
    if n_retrieved:
        mask = mx.concatenate([mx.ones((L, n_retrieved), dtype=mx.bool_), mask], axis=-1)
    return mask
