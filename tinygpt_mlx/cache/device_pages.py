"""Retrieval's page index on the device: the page summaries of a cold store in MLX arrays and
the coarse pass as matmuls and `mx.argpartition`, built lazily into the step's graph.

The same rules as the host index (pages.py): every `page_size` evicted tokens make a page,
summarised from its exact keys by the per-channel min and max (Quest), the mean key (KIV), or
both ("hybrid"); long stores add blocks of `index_block` pages (the min of their mins, the max
of their maxes, the mean of their means) and a decode step expands only its best blocks.
Nothing here reads a value back to the host: the page counts that shape the graph are known
there already (they follow from the number of tokens evicted).

Summaries are [G, capacity, D] float32 (G = batch x KV heads), page-major within a row, grown
by doubling and written by slice updates (`DeviceRows`).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..config import CacheConfig
from .arrays import GrowingArray

__all__ = ["DeviceRows", "DevicePageIndex", "NONE", "iota"]

#: a page id greater than any real one: what sorting pushes to the end (then read as "none")
NONE = 2 ** 30

#: constants by shape (`iota`, `no_repeat`), made once from numpy
_CONSTANTS: dict = {}


def iota(n: int) -> mx.array:
    """`mx.arange(n)` (int32), made once from numpy and kept: inside a compiled trace a constant,
    not an op replayed every call."""
    a = _CONSTANTS.get(n)
    if a is None:
        a = _CONSTANTS[n] = mx.array(np.arange(n, dtype=np.int32))
    return a


def _below(shape: tuple) -> mx.array:
    """-2 (int32) in `shape`: less than every page id and the nones (`union`)."""
    a = _CONSTANTS.get(("below", shape))
    if a is None:
        a = _CONSTANTS[("below", shape)] = mx.array(np.full(shape, -2, dtype=np.int32))
    return a


class DeviceRows:
    """Rows [G, capacity, *shape] in one MLX array that doubles its capacity when full
    (amortised O(1) per row: a growth copies the live rows once); appends are slice updates,
    which MLX does in place when nothing else holds the old array.

    Spilled (`spill`, the ram cold store's RAM budget): the oldest `spilled` rows live in a
    memory-mapped file instead (token-major [spilled, G, *shape], bf16 as its bits), and `array`
    holds rows `spilled`..`n` from its start. `gather` then reads the picked indices back and
    takes the spilled ones from the file (the only host wait; none while nothing is spilled).
    Staged (`stage`, a decode step that guessed its spilled pages: spill_stage.py), it takes
    them from the step's staging buffer instead, inside the graph, without a wait."""

    def __init__(self, G: int, shape: tuple, dtype: mx.Dtype, initial: int = 256):
        self.G, self.shape, self.dtype = G, tuple(shape), dtype
        self.n = 0
        self.growths = 0
        self.array = mx.zeros((G, initial) + self.shape, dtype=dtype)
        self.spilled = 0
        self.disk: Any = None     # arrays.GrowingArray on disk, once something is spilled
        #: a decode step's staged spilled rows (spill_stage.py): (spilled when staged, the page
        #: table [G, spilled pages] (slot of each staged page, -1: not staged), the rows [G, S *
        #: page_size, *shape], page_size); None: not staged
        self.stage: Optional[tuple] = None

    @property
    def capacity(self) -> int:
        return self.array.shape[1]

    @property
    def resident(self) -> int:
        """Rows held in `array` (the newest `n - spilled`)."""
        return self.n - self.spilled

    def __len__(self) -> int:
        return self.n

    def append(self, rows: mx.array) -> None:
        """Rows [G, n, *shape] after the live ones."""
        n, r = rows.shape[1], self.resident
        self.make_room(n)
        self.array[:, r: r + n] = rows.astype(self.dtype)
        self.n += n

    def make_room(self, n: int) -> None:
        """Where `n` more rows do not fit, the capacity doubled until they do (the live rows copied
        once): `append`'s growth, also done ahead of a compiled step that then writes in place
        (compiled_retrieval.py `ready_ahead`); nothing where they fit."""
        r = self.resident
        if r + n > self.capacity:
            cap = self.capacity
            while cap < r + n:
                cap *= 2
            grown = mx.zeros((self.G, cap) + self.shape, dtype=self.dtype)
            grown[:, :r] = self.array[:, :r]
            self.array = grown
            self.growths += 1

    def took(self, array: mx.array, n: int) -> None:
        """`append`'s bookkeeping for `n` rows a compiled step already wrote after the live ones
        into `array` (this one's capacity, with nothing spilled), which replaces it."""
        self.array = array
        self.n += n

    def view(self) -> mx.array:
        """The rows held in `array` (all of them unless some are spilled)."""
        return self.array[:, : self.resident]

    def truncate(self, n: int) -> None:
        """Keep the oldest `n` rows (what follows is overwritten by later appends; cut back into
        the spilled ones, nothing stays resident and the file is cut back alike)."""
        if n < self.spilled:
            self.disk.truncate(n)
            self.spilled = n
        self.n = min(self.n, n)

    def spill(self, m: int, path: str) -> None:
        """Move the oldest `m` resident rows to the memory-mapped file at `path` (made on first
        use): one read back of them and one copy of the rest to the front of a fresh array (of
        the same capacity: what is freed is the old one)."""
        import numpy as np   # (off the per-token path: a spill moves a quarter of the budget at once)

        m = min(m, self.resident)
        if m <= 0:
            return
        if self.disk is None:
            self.disk = GrowingArray((self.G,) + self.shape, _np_dtype(self.dtype), path=path)
        out = self.array[:, :m]
        self.disk.append(np.asarray(out.view(mx.uint16) if self.dtype == mx.bfloat16 else out).swapaxes(0, 1))
        live = self.resident - m
        kept = mx.zeros(self.array.shape, dtype=self.dtype)
        kept[:, :live] = self.array[:, m: m + live]
        self.array = kept
        self.spilled += m

    def gather(self, idx: mx.array) -> mx.array:
        """Rows at `idx` [G, *I] (each row of G its own indices) -> [G, *I, *shape]."""
        flat = idx.reshape(self.G, -1)
        tail = (1,) * len(self.shape)
        if not self.spilled:
            out = mx.take_along_axis(self.array, flat.reshape(flat.shape + tail), axis=1)
            return out.reshape(idx.shape + self.shape)
        if self.staged():
            return self._gather_staged(flat, tail).reshape(idx.shape + self.shape)
        import numpy as np   # (spilled: the picked indices are read back, then the file)
        at = np.asarray(flat.astype(mx.int32))
        local = np.maximum(at - self.spilled, 0)
        out = mx.take_along_axis(self.array, mx.array(local).reshape(flat.shape + tail), axis=1)
        old = at < self.spilled
        if old.any():
            g, j = np.nonzero(old)
            rows = np.zeros(flat.shape + self.shape, self.disk.dtype)
            rows[g, j] = self.read_disk(at[g, j], g)     # only these rows are read from the file
            mask = mx.array(old).reshape(flat.shape + tail)
            out = mx.where(mask, self._from_disk(rows), out)
        return out.reshape(idx.shape + self.shape)

    def read_disk(self, tokens: Any, g: Any) -> Any:
        """Spilled rows from the file (numpy fancy indexing of the map: only these are read):
        token `tokens[i]` of row `g[i]` of G (or broadcast as numpy broadcasts them)."""
        return self.disk.view()[tokens, g]

    def staged(self) -> bool:
        """Whether a gather now takes the spilled rows from a step's staging buffer (`stage`,
        spill_stage.py): staged, and nothing spilled since (a spill during the step's eviction
        moves rows the buffer does not hold: the gather reads them back as before)."""
        return self.stage is not None and self.stage[0] == self.spilled

    def _gather_staged(self, flat: mx.array, tail: tuple) -> mx.array:
        """`gather` of a staged step, inside the graph: a spilled row from the staging buffer at
        its page's slot (a page not staged reads slot 0: the step's check finds the miss, and
        the step is computed again: spill_stage.py), a resident one from `array`; the same rows,
        as the same values, as the read back takes."""
        spilled, table, rows, page_size = self.stage
        page = mx.minimum(flat // page_size, table.shape[1] - 1)
        slot = mx.maximum(mx.take_along_axis(table, page, axis=1), 0)
        staged = mx.take_along_axis(rows, (slot * page_size + flat % page_size).reshape(flat.shape + tail), axis=1)
        out = mx.take_along_axis(self.array, mx.maximum(flat - spilled, 0).reshape(flat.shape + tail), axis=1)
        return mx.where((flat < spilled).reshape(flat.shape + tail), staged, out)

    def _from_disk(self, rows: Any) -> mx.array:
        """Rows read from the file as this array's dtype (bf16 is kept there as its bits)."""
        return mx.array(rows).view(mx.bfloat16) if self.dtype == mx.bfloat16 else mx.array(rows)

    @property
    def nbytes(self) -> int:
        """The bytes in RAM (`disk_nbytes`: the spilled rows' in their file)."""
        return self.resident * self.row_bytes()

    @property
    def disk_nbytes(self) -> int:
        return self.disk.nbytes if self.disk is not None else 0

    def row_bytes(self) -> int:
        size = 1
        for s in self.shape:
            size *= s
        return self.G * size * self.dtype.size

    # ----- files (the host store's layout: token-major [n, G, *shape]) ------------------------
    def state(self) -> tuple:
        import numpy as np   # (a file is written off the per-token path)
        rows = self.view().swapaxes(0, 1)    # bf16 as fp32, as the host store keeps it (numpy has no bf16)
        rows = np.asarray(rows.astype(mx.float32) if self.dtype == mx.bfloat16 else rows)
        if self.spilled:     # the spilled rows first, read from their file (a file holds them all)
            spilled = np.asarray(self._from_disk(np.asarray(self.disk.view())).astype(mx.float32)
                                 if self.dtype == mx.bfloat16 else self.disk.view())
            rows = np.concatenate([spilled, rows], axis=0)
        return rows, {"n": self.n, "capacity": max(self.capacity, 1), "growths": self.growths}

    def load_state(self, rows, meta: dict) -> None:
        n = int(meta["n"])
        cap = max(int(meta.get("capacity", n)), n, 1)
        if tuple(rows.shape) != (n, self.G) + self.shape:
            raise ValueError(f"saved rows have shape {tuple(rows.shape)}, expected {(n, self.G) + self.shape}")
        self.array = mx.zeros((self.G, cap) + self.shape, dtype=self.dtype)
        if n:
            self.array[:, :n] = mx.array(rows).swapaxes(0, 1).astype(self.dtype)
        self.n, self.growths = n, int(meta.get("growths", 0))
        self.spilled = 0
        if self.disk is not None:
            self.disk.truncate(0)


def _np_dtype(dtype: mx.Dtype) -> Any:
    import numpy as np
    return {mx.float16: np.float16, mx.bfloat16: np.uint16, mx.uint32: np.uint32}.get(dtype, np.float32)


#: the summary arrays each `summary` keeps, and their block-level counterparts
_WANTED = {"minmax": ("smin", "smax"), "mean": ("smean",), "hybrid": ("smin", "smax", "smean")}
_BLOCKS = {"smin": "bmin", "smax": "bmax", "smean": "bmean"}
NAMES = ("smin", "smax", "smean", "bmin", "bmax", "bmean")
_REDUCE = {"smin": mx.min, "smax": mx.max, "smean": mx.mean}


class DevicePageIndex:
    """Summaries of the completed pages of G rows of keys, and the coarse pass over them for
    queries [G, rep, R, D], on the device."""

    def __init__(self, config: CacheConfig, G: int, D: int):
        self.config, self.G, self.D = config, G, D
        self.page_size, self.top_pages, self.summary = config.page_size, config.top_pages, config.summary
        self.rows: dict[str, DeviceRows] = {}
        for name in _WANTED[self.summary]:
            self.rows[name] = DeviceRows(G, (D,), mx.float32, initial=16)
            if config.index_block:
                self.rows[_BLOCKS[name]] = DeviceRows(G, (D,), mx.float32, initial=16)
        self._tail: list = []   # exact fp32 keys [G, *, D] of the unfinished page, in pieces (`tail`)
        self.tail_n = 0
        self.block_tail: dict = {}   # page summaries [G, < index_block, D] of the unfinished block, by name

    @property
    def n_pages(self) -> int:
        return len(next(iter(self.rows.values())))

    @property
    def n_blocks(self) -> int:
        Bp = self.config.index_block
        return self.n_pages // Bp if Bp else 0

    def arrays(self) -> dict:
        """The summary arrays held, by name (smin, smax, smean and their blocks' bmin, ...)."""
        return dict(self.rows)

    # ----- growth ---------------------------------------------------------------------------
    @property
    def tail(self) -> Optional[mx.array]:
        """The exact fp32 keys [G, t, D] of the unfinished page (None while it holds none), its
        pieces joined once asked for."""
        if len(self._tail) > 1:
            self._tail = [mx.concatenate(self._tail, axis=1)]
        return self._tail[0] if self._tail else None

    def add(self, k: mx.array) -> None:
        """Exact fp32 keys [G, n, D] that follow the ones added before: the pages they complete
        are summarised (one reduction over all of them), the rest wait in `tail` (as pieces until
        a page completes or it is read: a decode step adds one key, and joins nothing)."""
        ps = self.page_size
        total = self.tail_n + k.shape[1]
        if total < ps:
            self._tail.append(k)
            self.tail_n = total
            return
        keys = k if not self.tail_n else mx.concatenate(self._tail + [k], axis=1)
        full = total // ps * ps
        if full:
            pages = keys[:, :full].reshape(self.G, full // ps, ps, self.D)
            for name in ("smin", "smax", "smean"):
                if name in self.rows:
                    summaries = _REDUCE[name](pages, axis=2)
                    self.rows[name].append(summaries)
                    self._add_blocks(name, summaries)
        self.tail_n = total - full
        self._tail = [keys[:, full:]] if self.tail_n else []

    def _add_blocks(self, name: str, summaries: mx.array) -> None:
        """The block summaries of the blocks that new page summaries [G, p, D] complete, from
        those and the unfinished block's pages (`block_tail`), never from the page array itself:
        a read of it would keep its old version alive, and its next append would copy it whole."""
        Bp = self.config.index_block
        if not Bp:
            return
        held = self.block_tail.get(name)
        seq = summaries if held is None else mx.concatenate([held, summaries], axis=1)
        full = seq.shape[1] // Bp * Bp
        if full:
            self.rows[_BLOCKS[name]].append(_REDUCE[name](seq[:, :full].reshape(self.G, full // Bp, Bp, self.D), axis=2))
        self.block_tail[name] = seq[:, full:] if seq.shape[1] > full else None

    def truncate(self, n_tokens: int, tail: Optional[mx.array]) -> None:
        """Back to what `n_tokens` evicted tokens make, with the unfinished page's exact `tail`
        (and the unfinished block's page summaries, read back from the pages)."""
        P = n_tokens // self.page_size
        Bp = self.config.index_block
        for name, rows in self.rows.items():
            rows.truncate(P if name.startswith("s") else (P // Bp))
        if Bp:
            done = P // Bp * Bp
            self.block_tail = {name: self.rows[name].array[:, done:P] if P > done else None
                               for name in ("smin", "smax", "smean") if name in self.rows}
        self._tail, self.tail_n = ([] if tail is None else [tail]), 0 if tail is None else tail.shape[1]

    def uses_index(self) -> bool:
        """The two-level index pays once the flat scan covers > 2x the pages it would score."""
        Bp = self.config.index_block
        return bool(Bp) and self.n_pages > 2 * self.config.index_expand * self.top_pages * Bp

    # ----- the coarse pass ------------------------------------------------------------------
    def _scan(self, q: mx.array, summary: str, prefix: str, count: int) -> mx.array:
        """Scores [G, R, count] of queries [G, rep, R, D] against the first `count` summaries
        ("s": pages, "b": blocks): matmuls, the max over the query group."""
        G, rep, R, D = q.shape
        x = q.reshape(G, rep * R, D)

        def score(x: mx.array, name: str) -> mx.array:   # (summaries times rows: device_select._bound)
            return self.rows[prefix + name].array[:, :count] @ x.swapaxes(1, 2)   # [G, count, rep * R]
        out = bound(x, summary, score)
        return out.reshape(G, count, rep, R).max(axis=2).swapaxes(1, 2)

    def _candidate_scores(self, q: mx.array, summary: str, cand: mx.array) -> mx.array:
        """Scores [G, R, C] of queries [G, rep, R, D] against the pages `cand` [G, R, C] only."""
        x = q.transpose(0, 2, 1, 3)                                           # [G, R, rep, D]

        def score(x: mx.array, name: str) -> mx.array:
            return self.rows["s" + name].gather(cand) @ x.swapaxes(-1, -2)    # [G, R, C, rep]
        return bound(x, summary, score).max(axis=3)

    def ranked_pages(self, q: mx.array, summary: str, ordered: bool = False) -> mx.array:
        """The `top_pages` best pages [G, R, k] of each query row, by one summary (best first
        when `ordered`; otherwise in no particular order). The two-level index as the host's."""
        P = self.n_pages
        k = min(self.top_pages, P)
        cand = None
        if self.uses_index():
            Bp, NB = self.config.index_block, self.n_blocks
            bs = self._scan(q, summary, "b", NB)                               # [G, R, NB]
            kb = min(self.config.index_expand * self.top_pages if q.shape[2] == 1 else self.top_pages, NB)
            blocks = mx.argpartition(-bs, kb - 1, axis=-1)[..., :kb].astype(mx.int32)
            cand = (blocks[..., None] * Bp + mx.arange(Bp)).reshape(*blocks.shape[:2], -1)
            if P > NB * Bp:
                rest = mx.broadcast_to(mx.arange(NB * Bp, P), cand.shape[:2] + (P - NB * Bp,))
                cand = mx.concatenate([cand, rest], axis=-1)
            sc = self._candidate_scores(q, summary, cand)
        else:
            sc = self._scan(q, summary, "s", P)
        top = mx.argpartition(-sc, k - 1, axis=-1)[..., :k].astype(mx.int32) if k < sc.shape[-1] else \
            mx.broadcast_to(mx.arange(sc.shape[-1]), sc.shape)
        if ordered:
            order = mx.argsort(-mx.take_along_axis(sc, top, axis=-1), axis=-1).astype(mx.int32)
            top = mx.take_along_axis(top, order, axis=-1)
        return top if cand is None else mx.take_along_axis(cand, top, axis=-1)

    def top_pages_of(self, q: mx.array) -> mx.array:
        """The `top_pages` pages [G, R, k] of each query row. "hybrid" interleaves the min/max
        ranking and the mean ranking and keeps the first k distinct pages (as a set, in id
        order)."""
        if self.summary != "hybrid":
            return self.ranked_pages(q, self.summary)
        return hybrid_pages([self.ranked_pages(q, s, ordered=True) for s in ("minmax", "mean")], self.top_pages)


def hybrid_pages(lists: list, k: int) -> mx.array:
    """The "hybrid" summary's pages [*, k] from the min/max and the mean rankings [*, k'] (best
    first): interleaved (mm0, mean0, mm1, ...), each page kept at its first place, the first k
    distinct kept, as a set in id order. The compiled decode selection and the chunk path share it."""
    both = mx.stack(lists, axis=-1).reshape(*lists[0].shape[:-1], -1)
    n = both.shape[-1]
    earlier = mx.tril(mx.ones((n, n), dtype=mx.bool_), k=-1)
    repeat = ((both[..., :, None] == both[..., None, :]) & earlier).any(axis=-1)
    rank = mx.cumsum((~repeat).astype(mx.int32), axis=-1)
    return mx.sort(mx.where(~repeat & (rank <= k), both, NONE), axis=-1)[..., :k]


def bound(x: mx.array, summary: str, score) -> mx.array:
    """Quest's bound sum_i max(x_i min_i, x_i max_i) (minmax) or x . mean (mean), through
    `score(x, name)`: x times the summaries `name` (max, min or mean) of the level scored."""
    if summary == "mean":
        return score(x, "mean")
    return score(mx.maximum(x, 0), "max") + score(mx.minimum(x, 0), "min")


def union(parts: list) -> mx.array:
    """Page ids [G, *] joined row by row: each row's pages in ascending order, once each, a
    repeat and a none (-1 or NONE in `parts`, arrays [G, *]) left as -1 where it sorted (the
    pool's holes: `pool_tokens` reads them as no page). Fixed size: the sum of the parts. (One
    sort: the rows are not packed to the front, which took a second sort, ~4 kernels per layer
    and decode step; the pages and their order are the same.)"""
    cat = (mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]).astype(mx.int32)
    s = mx.sort(cat, axis=-1)
    # each id against the one before it (-2 before the first: no page, and below every id and
    # the -1 nones): one slice and one concatenation, the comparison fused into the select
    before = mx.concatenate([_below(s.shape[:-1] + (1,)), s[..., :-1]], axis=-1)
    return mx.where((s == before) | (s < 0) | (s == NONE), -1, s)


def pool_tokens(pool: mx.array, n: Any, page_size: int) -> tuple[mx.array, mx.array]:
    """The cold-token rows [G, K * page_size] a pool of pages [G, K] (-1: none) gathers from a
    store of `n` tokens (an int, or an MLX scalar inside a compiled selection), and which are real
    tokens. Padding reads its page's first token (a real one wherever any of the page is, so a
    span's max needs no token-level mask: PoolSegment); a page holding none (the unfinished page
    offered while empty: its first row is n, maybe past the arrays) reads row n - 1."""
    # (laid out [G, K, page_size] and flattened once: a compiled selection replays fewer nodes
    # than with each page's values repeated along the flat axis)
    page = pool[..., None]
    first = mx.maximum(page, 0) * page_size
    idx = first + iota(page_size)
    valid = (page >= 0) & (idx < n)
    G = pool.shape[0]
    return mx.where(valid, idx, mx.minimum(first, n - 1)).reshape(G, -1), valid.reshape(G, -1)
