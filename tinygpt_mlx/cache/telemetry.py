"""Retrieval telemetry: what each retrieval fetched, and (when a ground-truth needle's positions
are known) whether its pages and tokens were among what was fetched.

The cold store describes each retrieval as a `Selection`; the layer cache hands it to its
`RetrievalTelemetry`, which keeps one record per retrieval. `KVCache.retrieval_report` sums
the records of every layer (`summarise`).

Recording is off by default (`RetrievalTelemetry.on`): a decode step builds no `Selection` and
keeps no record that nobody reads (about 36 us per step of the shipped model's compiled step,
issue 53). Whoever reads the records turns it on first (`KVCache.record_retrievals`): the needle
grid's recall and oracle (evaluate/needle.py), the decode-scaling bench (retrieval_bench.py),
benchmarks/chat_retrieval_reach.py and the tests that compare picks through the records.
"""

from __future__ import annotations

from dataclasses import dataclass
import contextlib
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import mlx.core as mx
import numpy as np


@dataclass
class Selection:
    """One retrieval of one layer: for the last query of the pass, the pages it ranked best
    [G, k] and (asked only where a needle is known: it waits for attention) the cold indices it
    fetched, one array per row of G = batch x KV heads."""

    layer: int
    queries: int
    cold_tokens: int
    cold_pages: int
    page_size: int
    tokens_scored: Any         # an int, or (the device store) a lazy MLX scalar read at `summarise`
    indexed: bool
    pages: np.ndarray
    positions: np.ndarray      # absolute position of every cold token, in cold order
    tokens_retrieved: int
    fetched: Callable[[], list]


#: what `StageTimes.timed` hands out while off: one shared context that does nothing
_UNTIMED = contextlib.nullcontext()


class StageTimes:
    """Seconds per stage of retrieval, summed over calls, when `enabled` (bench turns it on):
    each stage ends by evaluating what it built (`sync`), so the time is its own and not the
    lazily evaluated graph's. Off, `timed` hands out a shared context that does nothing (no
    generator is made per stage of a decode step) and `sync` syncs nothing."""

    def __init__(self):
        self.enabled = False
        self.seconds: dict[str, float] = {}

    def timed(self, stage: str) -> Any:
        """A context timing `stage` while enabled; off, one that does nothing."""
        return self._timed(stage) if self.enabled else _UNTIMED

    @contextlib.contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0

    def sync(self, *arrays: Any) -> None:
        if self.enabled:
            mx.eval(*arrays)


def cold_indices(positions: np.ndarray, n: int, wanted: Any) -> np.ndarray:
    """The cold-store rows that hold the absolute `wanted` positions (those that are cold), given
    the store's sorted `positions` of its `n` rows."""
    wanted = np.asarray(wanted)
    where = np.searchsorted(positions, wanted)
    ok = (where < n) & (positions[np.minimum(where, n - 1)] == wanted)
    return where[ok]


def pages_holding(positions: np.ndarray, n: int, wanted: Any, page_size: int) -> np.ndarray:
    """The pages (the unfinished one included) of a store's `n` rows at sorted `positions` that
    hold the absolute `wanted` positions (those that are cold), sorted."""
    return np.unique(cold_indices(positions, n, wanted) // page_size)


class RetrievalTelemetry:
    """Per-retrieval records of one layer; `truth` = absolute positions of a known needle."""

    #: records kept per layer (the newest): telemetry stays bounded on a long-lived server slot
    KEEP = 4096

    def __init__(self):
        self.records: list[dict] = []
        self.steps = 0    # retrievals recorded since the last reset (records keeps the newest KEEP..2 KEEP)
        self._truth: Optional[np.ndarray] = None
        #: whether the layer records its retrievals (`KVCache.record_retrievals`); off, the
        #: callers of `record` make no `Selection` for it (retrieved.py, compiled_retrieval.commit)
        self.on = False

    @property
    def truth(self) -> Optional[np.ndarray]:
        return self._truth

    @truth.setter
    def truth(self, positions: Optional[Iterable[int]]) -> None:
        self._truth = None if positions is None else np.asarray(sorted(positions), dtype=np.int64)

    def reset(self) -> None:
        self.records = []
        self.steps = 0

    def record(self, s: Selection) -> None:
        rec = dict(step=self.steps, layer=s.layer, queries=s.queries, cold_tokens=s.cold_tokens,
                   cold_pages=s.cold_pages, pages_selected=int(s.pages.shape[1]),
                   tokens_scored=s.tokens_scored, tokens_retrieved=int(s.tokens_retrieved),
                   indexed=s.indexed)
        if self._truth is not None:
            cold_idx = cold_indices(s.positions, s.cold_tokens, self._truth)
            if cold_idx.size:
                ps = s.page_size
                in_tail = cold_idx >= s.cold_pages * ps
                page_hit = np.array([[t or (c // ps) in set(pg.tolist()) for c, t in zip(cold_idx, in_tail)]
                                     for pg in s.pages])
                tok_hit = np.array([np.isin(cold_idx, row) for row in s.fetched()])
                rec.update(needle_tokens=int(cold_idx.size), page_recall=float(page_hit.mean()),
                           token_recall=float(tok_hit.mean()), token_any=float(tok_hit.any(axis=1).mean()))
        self.records.append(rec)
        self.steps += 1
        if len(self.records) > 2 * self.KEEP:     # amortised: drop the oldest half at once
            del self.records[:-self.KEEP]


def summarise(telemetries: Iterable[RetrievalTelemetry], last_steps: Optional[int] = None) -> dict:
    """Records summed over layers: retrievals, mean pages/tokens retrieved, and where a needle
    is known the page recall and token recall (mean over heads, layers and steps)."""
    recs = []
    for t in telemetries:
        recs.extend(t.records[-last_steps:] if last_steps else t.records)
    if not recs:
        return {"retrievals": 0}
    out = {"retrievals": len(recs),
           "cold_tokens": max(r["cold_tokens"] for r in recs),
           "pages_selected": float(np.mean([r["pages_selected"] for r in recs])),
           "tokens_scored": float(np.mean([int(r["tokens_scored"]) for r in recs])),
           "tokens_retrieved": float(np.mean([r["tokens_retrieved"] for r in recs])),
           "indexed": float(np.mean([r["indexed"] for r in recs]))}
    hits = [r for r in recs if "page_recall" in r]
    if hits:
        out.update(page_recall=float(np.mean([r["page_recall"] for r in hits])),
                   token_recall=float(np.mean([r["token_recall"] for r in hits])),
                   token_any=float(np.mean([r["token_any"] for r in hits])))
    return out
