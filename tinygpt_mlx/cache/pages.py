"""The page index of a cold store (cold.py): per-page key summaries and the coarse pass.

Every `page_size` evicted tokens make a page, summarised from its exact keys by the per-channel
min and max (Quest: sum_i max(q_i min_i, q_i max_i) bounds q.k for every key of the page), the
mean key (KIV), or both ("hybrid"). Long stores add a second level: blocks of `index_block`
pages with the min of their mins and the max of their maxes (the mean of their means), so a
decode step scans P / index_block block summaries and expands only the best blocks' pages.
Summaries are kept in float32 `GrowingArray`s, page-major [pages, G, D] (G = batch x KV heads),
memory-mapped beside the cold rows where the store is on disk.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..config import CacheConfig
from .arrays import GrowingArray

#: the summary arrays each `summary` keeps, and their block-level counterparts
_WANTED = {"minmax": ("smin", "smax"), "mean": ("smean",), "hybrid": ("smin", "smax", "smean")}
_BLOCKS = {"smin": "bmin", "smax": "bmax", "smean": "bmean"}
NAMES = ("smin", "smax", "smean", "bmin", "bmax", "bmean")


class PageIndex:
    """Summaries of the completed pages of G rows of keys [n, G, D], and the ranking of pages
    for queries [G, rep, L, D] (the coarse pass). `path(name)` gives a summary's file (None:
    in RAM)."""

    def __init__(self, config: CacheConfig, G: int, D: int, path: Callable[[str], Optional[str]]):
        self.config, self.G = config, G
        self.page_size, self.top_pages, self.summary = config.page_size, config.top_pages, config.summary
        self.smin = self.smax = self.smean = None    # GrowingArray [pages, G, D]
        self.bmin = self.bmax = self.bmean = None    # the same per block of `index_block` pages
        for name in _WANTED[self.summary]:
            setattr(self, name, GrowingArray((G, D), np.float32, path(name), initial=16))
            if config.index_block:
                setattr(self, _BLOCKS[name], GrowingArray((G, D), np.float32, path(_BLOCKS[name]), initial=16))
        self.tail: list[np.ndarray] = []   # exact fp32 keys of the unfinished page

    @property
    def n_pages(self) -> int:
        """Pages summarised (completed)."""
        return (self.smin if self.smin is not None else self.smean).n

    @property
    def n_blocks(self) -> int:
        Bp = self.config.index_block
        return self.n_pages // Bp if Bp else 0

    def arrays(self) -> dict:
        """The summary arrays held, by name."""
        return {name: getattr(self, name) for name in NAMES if getattr(self, name) is not None}

    # ----- growth ---------------------------------------------------------------------------
    def add(self, k: np.ndarray) -> None:
        """Keys [n, G, D] (exact fp32, before any rounding of the stored rows) that follow the
        ones added before: the pages they complete are summarised, the rest wait in `tail`."""
        self.tail.append(k)
        tail = np.concatenate(self.tail, axis=0) if len(self.tail) > 1 else k
        ps = self.page_size
        full = tail.shape[0] // ps * ps
        if not full:
            return
        pages = tail[:full].reshape(full // ps, ps, self.G, tail.shape[-1])
        if self.smin is not None:
            self.smin.append(pages.min(axis=1))
            self.smax.append(pages.max(axis=1))
        if self.smean is not None:
            self.smean.append(pages.mean(axis=1))
        self.tail = [tail[full:]] if tail.shape[0] > full else []
        self._add_blocks()

    def _add_blocks(self) -> None:
        """Block summaries for every block of pages completed so far."""
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

    def tail_keys(self) -> Optional[np.ndarray]:
        """The unfinished page's exact keys [< page_size, G, D], or None."""
        return np.concatenate(self.tail, axis=0) if self.tail else None

    def set_tail(self, keys: Optional[np.ndarray]) -> None:
        self.tail = [keys] if keys is not None and len(keys) else []

    # ----- the coarse pass ------------------------------------------------------------------
    def page_scores(self, q: np.ndarray, summary: Optional[str] = None) -> np.ndarray:
        """Coarse pass over every page: queries [G, rep, L, D] x summaries -> [G, L, pages]
        (max over the GQA group: a page any head of the group wants is kept)."""
        return self.scan(q, summary or self.summary, self.smin, self.smax, self.smean)

    @staticmethod
    def scan(q: np.ndarray, summary: str, smin: Any, smax: Any, smean: Any) -> np.ndarray:
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

    def uses_index(self) -> bool:
        """The two-level index pays once the flat scan covers > 2x the pages it would score."""
        Bp = self.config.index_block
        return bool(Bp) and self.n_pages > 2 * self._expanded_blocks() * Bp

    def _expanded_blocks(self) -> int:
        return self.config.index_expand * self.top_pages

    def ranked_pages(self, q: np.ndarray, summary: str) -> np.ndarray:
        """The `top_pages` best pages [G, L, k] for each query, best first, by one summary.

        Short stores scan every page summary. Long ones use the two-level index: the
        `index_expand` x `top_pages` best blocks (a decode step; a chunk's rows: `top_pages`)
        are expanded and their pages ranked, with the pages of the unfinished block always among
        the candidates. Decode then reads P / index_block block summaries plus that many blocks'
        page summaries instead of all P."""
        n_pages = self.n_pages
        k = min(self.top_pages, n_pages)
        if self.uses_index():
            Bp = self.config.index_block
            NB = self.n_blocks
            bs = self.scan(q, summary, self.bmin, self.bmax, self.bmean)       # [G, L, NB]
            # a decode step (one query row) expands index_expand x top_pages blocks; a prefill
            # chunk's rows (its last and its mean query) top_pages, their pool being shared
            kb = min(self._expanded_blocks() if q.shape[2] == 1 else self.top_pages, NB)
            blocks = np.argpartition(-bs, kb - 1, axis=-1)[..., :kb]
            cand = (blocks[..., None] * Bp + np.arange(Bp)).reshape(*blocks.shape[:2], -1)
            if n_pages > NB * Bp:
                rest = np.broadcast_to(np.arange(NB * Bp, n_pages), cand.shape[:2] + (n_pages - NB * Bp,))
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


def _summary_scores(x: np.ndarray, summary: str, smin: Any, smax: Any, smean: Any, score: Any) -> np.ndarray:
    """Quest's bound sum_i max(x_i min_i, x_i max_i) (minmax) or x . mean (mean) of queries x
    against summary arrays, with `score(x, array)` doing the product (full scan or gather)."""
    if summary == "mean":
        return score(x, smean)
    return score(np.maximum(x, 0), smax) + score(np.minimum(x, 0), smin)
