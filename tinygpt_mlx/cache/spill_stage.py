"""A spilled cold store's decode step with its spilled rows read in one bulk copy per step.

Past `--kiv-cold-ram` the oldest cold rows live in memory-mapped files (`DeviceRows.spill`); a
pass that picks one of them reads its indices back and then the rows (`DeviceRows.gather`): a
host wait in every layer, since a layer's picks depend on its query and so on every layer below
it. Here a decode step guesses its spilled pages instead: the pages each layer's pool held at the
last decode step (the sticky rule carries a step's picks into the next one's pool; the coarse
pass's best pages move little between neighbouring queries). Before the step, the guessed pages'
rows of every layer are read from their files and uploaded in ONE bulk copy (with each layer's
page table); the step's gathers take spilled rows from that buffer inside the graph, with no
wait in the layer loop. Each pass also makes a lazy check: whether its pool held a spilled page
that was not staged. The step's one wait reads the checks and the pools together (the next
step's guess). A step whose every pass hit has gathered exactly the rows the read back would
have, so its logits are those of the per-layer path bit for bit; a step that missed is taken
back (`LayerCache.step_undo`) and computed again by the per-layer path, whose pools become the
next guess. So the tokens and logits are the per-layer path's in every case; a miss costs the
step twice.

Only where every layer can be taken back (`LayerCache.undoable`: exact sink and hot window, no
re-base due, no telemetry recording, stages untimed) and some store is spilled, in whole pages (a
checkpoint restored into the spilled part can leave a page partly spilled: not staged); the first step
after a prompt (no guess yet) runs the per-layer path and records its pools. `KVCache.stage_spills`
switches it: OFF by default (`POSTTRAINLLM_STAGE_SPILLS=1`: on), because the guess misses. On the
shipped model at 16K (`+spill32`, KJV text) a KV head's pool held about 150 spilled pages per step,
and not one of 240 head pools over 15 steps lay within the last step's pool (the coarse pass's best
pages move with every query; the sticky rule keeps only the picks); on bench's random prompt 0 and
1 of 15 staged steps hit, so almost every staged step missed in some layer and head and was computed twice
(docs/retrieval.md, "A spilled store's decode step staged ahead"; `benchmarks/spill_guess.py`
replays longer guesses). `KVCache.spill_stats` counts staged steps, hits, misses, steps recorded
by the per-layer path, pages staged and pool pages missed.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .cold_device import DeviceColdStore

__all__ = ["decode", "stores_of", "stage", "unstage", "new_stats"]


def new_stats() -> dict:
    """`KVCache.spill_stats`' counters: decode steps staged, their hits and misses, steps run
    by the per-layer path to record a guess, pages staged and pool pages missed (summed over
    layers, KV heads and steps)."""
    return {"staged": 0, "hits": 0, "misses": 0, "recorded": 0, "pages": 0, "missed_pages": 0}


def stores_of(cache: Any, tokens: mx.array) -> Optional[list]:
    """The cold stores of a decode step this module runs (module doc), or None; for a cache
    whose `stage_spills` is on (`compiled.decode` reads it, once a step, and calls `decode` only then)."""
    if tokens.ndim != 2 or tokens.shape != (1, 1):
        return None
    if cache.config.cold_ram is None or len(cache.owned) != len(cache.distinct()):
        return None
    stores = []
    for layer in cache.owned:
        cold = getattr(layer, "cold", None)
        if not isinstance(cold, DeviceColdStore) or not layer.undoable() or cold.pinned is not None:
            return None
        stores.append(cold)
    if any(s.spilled % s.page_size for s in stores):
        return None     # part of a page spilled (a rewind cut the files back there): the page table covers whole pages
    return stores if any(s.spilled for s in stores) else None


def decode(model: Any, tokens: mx.array, cache: Any) -> Optional[mx.array]:
    """One decode step of a spilled cache, staged (module doc): the logits [1, 1, vocab], the
    cache advanced by one token; None where this module does not run the step. Only for a cache
    whose `stage_spills` is on (`compiled.decode` asks)."""
    stores = stores_of(cache, tokens)
    if stores is None:
        return None
    stats = cache.spill_stats
    if any(s.guess is None for s in stores if s.spilled):
        return _recorded(model, tokens, cache, stores)
    marks = [layer.step_mark() for layer in cache.owned]
    stats["pages"] += stage(stores)
    logits, checks = _checked(model, tokens, cache, stores, unstage)
    missed, pools = _read(logits, checks)     # the step's one wait
    stats["staged"] += 1
    stats["missed_pages"] += missed
    if not missed:
        stats["hits"] += 1
        _guess(stores, pools)
        return logits
    stats["misses"] += 1
    for layer, mark in zip(reversed(cache.owned), reversed(marks)):
        layer.step_undo(mark)
    return _recorded(model, tokens, cache, stores)


def _recorded(model: Any, tokens: mx.array, cache: Any, stores: list) -> mx.array:
    """The step by the per-layer path (a wait per layer where rows are spilled), its pools kept
    as the next step's guess (read once, after the step)."""
    logits, checks = _checked(model, tokens, cache, stores, _unchecked)
    _, pools = _read(logits, checks)
    cache.spill_stats["recorded"] += 1
    _guess(stores, pools)
    return logits


def _checked(model: Any, tokens: mx.array, cache: Any, stores: list, done: Any) -> tuple[mx.array, list]:
    """Build the step's graph with every store collecting its passes' checks; `done(stores)`
    after the build, whatever happens. The logits and each store's checks (both lazy)."""
    for s in stores:
        s.checks = []
    try:
        logits = model(tokens, cache=cache)
        checks = [s.checks for s in stores]
    finally:
        done(stores)
    return logits, checks


def _unchecked(stores: list) -> None:
    """Stop every store collecting checks (the per-layer path stages nothing)."""
    for s in stores:
        s.checks = None


def _read(logits: mx.array, checks: list) -> tuple[int, list]:
    """Every pass's check and pool, read back in one wait (the logits' evaluation started
    first: the step runs as one graph): the pool pages missed, and each store's pools as host
    arrays (None for a store with no decode pass)."""
    parts, shapes = [], []
    for store_checks in checks:
        shapes.append([pages.shape for _, pages in store_checks])
        for miss, pages in store_checks:
            parts += [miss.astype(mx.int32).reshape(1), pages.astype(mx.int32).reshape(-1)]
    mx.async_eval(logits)
    if not parts:
        return 0, [None] * len(checks)
    flat = np.asarray(mx.concatenate(parts))
    missed, pools, at = 0, [], 0
    for store_shapes in shapes:
        mine = []
        for shape in store_shapes:
            missed += int(flat[at])
            size = int(np.prod(shape))
            mine.append(flat[at + 1: at + 1 + size].reshape(shape))
            at += 1 + size
        pools.append(mine[-1] if mine else None)
    return missed, pools


def _guess(stores: list, pools: list) -> None:
    for s, pool in zip(stores, pools):
        if pool is not None:
            s.guess = pool


def stage(stores: list) -> int:
    """Stage every spilled store's guessed pages (module doc): per store a page table [G, spilled
    pages] (the slot of each staged page, -1: none) and, per rows array, the staged pages' rows
    [G, S * page_size, *shape] read from its file; all of them uploaded as one array (one bulk
    copy), then cut into views. Page 0 is always staged (a pool's padding reads it). Returns
    the pages staged (summed over stores and their G rows)."""
    pieces, places, total = [], [], 0
    for s in stores:
        if not s.spilled or s.guess is None:
            continue
        ps, G = s.page_size, s.G
        spilled_pages = s.spilled // ps
        pages = [np.unique(np.concatenate([[0], row[(row >= 0) & (row < spilled_pages)]])) for row in s.guess]
        width = max(len(p) for p in pages)
        table = np.full((G, spilled_pages), -1, dtype=np.int32)
        padded = np.zeros((G, width), dtype=np.int64)
        for g, p in enumerate(pages):
            table[g, p] = np.arange(len(p), dtype=np.int32)
            padded[g, :len(p)] = p
            total += len(p)
        tokens = (padded[:, :, None] * ps + np.arange(ps)).reshape(G, -1)
        rows = s.device_rows()
        parts = [table] + [np.ascontiguousarray(r.read_disk(tokens, np.arange(G)[:, None])) for r in rows]
        places.append((s, rows, [(p.dtype, p.shape) for p in parts]))
        pieces += parts
    if not pieces:
        return 0
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += -(-p.nbytes // 16) * 16        # each part 16-byte aligned
    flat = np.zeros(at, dtype=np.uint8)
    for p, o in zip(pieces, offsets):
        flat[o: o + p.nbytes] = p.reshape(-1).view(np.uint8)
    bulk = mx.array(flat)                    # the step's one copy of its staged rows
    k = 0
    for s, rows, layout in places:
        views = []
        for dtype, shape in layout:
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            views.append(bulk[offsets[k]: offsets[k] + size].view(_mx_dtype(dtype)).reshape(shape))
            k += 1
        table, *staged = views
        s.staging = (s.spilled, table)
        for r, buf in zip(rows, staged):
            if r.dtype == mx.bfloat16:
                buf = buf.view(mx.bfloat16)
            r.stage = (r.spilled, table, buf, s.page_size)
    return total


def unstage(stores: list) -> None:
    """Drop every store's staging and checks (after the step's graph is built)."""
    for s in stores:
        s.staging, s.checks = None, None
        for r in s.device_rows() if s.G is not None else ():
            r.stage = None


def _mx_dtype(dtype: np.dtype) -> mx.Dtype:
    return {np.dtype(np.int32): mx.int32, np.dtype(np.float32): mx.float32, np.dtype(np.uint32): mx.uint32,
            np.dtype(np.uint16): mx.uint16, np.dtype(np.float16): mx.float16}[np.dtype(dtype)]

