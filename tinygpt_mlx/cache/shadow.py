"""KIVI's exact top-k refinement, the parts outside the packed store: the exact shadow copy of
the frozen tokens (RAM or memory-mapped), the two-stage top-k selection, and gathering the
chosen rows in query slices under a memory budget (kivi.py's module doc describes the method).

Where the shadow lives decides who gathers: a RAM shadow is one MLX buffer (`ShadowRows`), so a
decode step takes its chosen rows on the device and its graph never waits for the host; a disk
shadow is a numpy memmap (`GrowingArray`), so each refined layer reads its top-k indices to the
host (one wait per layer and step) and gathers with numpy.

Heads are independent here: the shadow keeps rows per (batch, KV head) and the selection runs
per query head, so a rank holding a subset of the KV heads (tinygpt_mlx/distributed.py) needs
nothing from the others.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from ..config import CacheConfig
from .arrays import GrowingArray, LiveRows, private_dir, remove_dir, remove_with


#: Bytes of exact rows gathered at once: a prefill chunk's queries are refined in slices so that
#: [B, Hkv, rep, slice, K, D] stays under this (decode gathers one query's rows).
GATHER_BUDGET = 64 << 20


def by_query_slices(idx: mx.array, shadow: "ShadowStore", side: int, fn: Callable) -> mx.array:
    """fn(exact rows of idx[..., lo:hi, :], lo, hi) over slices of the query axis, concatenated."""
    B, H, rep, L, k = idx.shape
    per_query = B * H * rep * k * shadow.dim(side) * 4
    step = max(1, GATHER_BUDGET // max(per_query, 1))
    if step >= L:
        return fn(shadow.gather(side, idx), 0, L)
    parts = []
    for lo in range(0, L, step):
        hi = min(L, lo + step)
        part = fn(shadow.gather(side, idx[..., lo:hi, :]), lo, hi)
        mx.eval(part)       # frees this slice's rows before the next is gathered
        parts.append(part)
    return mx.concatenate(parts, axis=-2)


def top_k_indices(scores: mx.array, k: int, block: int) -> mx.array:
    """Indices of the k largest scores along the last axis (in no particular order).

    Over many tokens a full argpartition dominates a decode step, so it runs in two stages: the
    k blocks of `block` tokens with the largest maxima hold every one of the top k (each top-k
    token's block has a maximum >= the k-th score, and at most k blocks can), then the top k of
    those k * block candidates (3.3 ms -> 0.47 ms for 8 x 32K scores: benchmarks/bench_topk.py).
    """
    T = scores.shape[-1]
    if k >= T:
        return mx.broadcast_to(mx.arange(T, dtype=mx.uint32), scores.shape)
    if T % block or T // block <= 2 * k:
        return mx.argpartition(-scores, k - 1, axis=-1)[..., :k]
    blocks = scores.reshape(*scores.shape[:-1], T // block, block)
    best = mx.argpartition(-blocks.max(axis=-1), k - 1, axis=-1)[..., :k]          # [..., k]
    cand = mx.take_along_axis(blocks, best[..., None], axis=-2).reshape(*scores.shape[:-1], k * block)
    pick = mx.argpartition(-cand, k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(best, pick // block, axis=-1) * block + pick % block


class ShadowRows(LiveRows):
    """`GrowingArray`'s rows (`LiveRows`: token-major [capacity, *shape], doubling when full, the
    live rows `array[start:n]`) as one MLX buffer: what a RAM shadow keeps, so that gathers stay
    on the device. (Retrieval's cold store has its own, head-major and spillable, with no
    `drop_front`: device_pages.DeviceRows.) Appends write in place (a slice update); a growth or
    a compaction copies the live rows once into a fresh buffer."""

    def __init__(self, shape: tuple, dtype: mx.Dtype, initial: int = 256):
        self.shape, self.dtype = tuple(shape), dtype
        self.start = self.n = self.growths = 0
        self.array = mx.zeros((initial,) + self.shape, dtype)

    @property
    def itemsize(self) -> int:
        return self.dtype.size

    def _write(self, rows: mx.array) -> None:
        self.array[self.n: self.n + rows.shape[0]] = rows.astype(self.dtype)

    def _grow(self, capacity: int) -> None:
        self._moved(capacity)

    def _compact(self) -> None:
        if self.start:
            self._moved(self.capacity)

    def _moved(self, capacity: int) -> None:
        """The live rows, first, in a fresh buffer of `capacity` rows."""
        live = len(self)
        new = mx.zeros((capacity,) + self.shape, self.dtype)
        if live:
            new[:live] = self.array[self.start: self.n]
        self.array, self.start, self.n = new, 0, live

    def state(self) -> tuple[np.ndarray, dict]:
        """The live rows in RAM (bf16 as its 16-bit patterns, as a `GrowingArray` keeps them, so
        the file is the same whichever store wrote it) and the counters."""
        rows = self.view()
        rows = np.asarray(rows.view(mx.uint16) if self.dtype == mx.bfloat16 else rows)
        return rows, {"n": len(self), "capacity": self.capacity, "growths": self.growths}

    def load_state(self, entry: Any, meta: dict) -> None:
        n = int(meta["n"])
        if tuple(entry.shape) != (n,) + self.shape:
            raise ValueError(f"saved rows have shape {tuple(entry.shape)}, expected {(n,) + self.shape}")
        rows = mx.array(entry.np())
        rows = rows.view(mx.bfloat16) if self.dtype == mx.bfloat16 else rows
        self.array = mx.zeros((max(int(meta["capacity"]), n, 1),) + self.shape, self.dtype)
        self.array[:n] = rows
        self.start, self.n, self.growths = 0, n, int(meta.get("growths", 0))


class ShadowStore:
    """Exact copies of the frozen tokens of the quantised sides, token-major [n, B*H, D], in
    RAM or memory-mapped in a private directory (removed when the store is collected).

    Rows keep the storage dtype (bf16 as its 16-bit patterns: numpy has no bf16). Keys are kept
    as they were frozen (rotated to their virtual slot in shifted mode), so exact scores use the
    same rotated query as the packed scores.
    """

    #: no `step_mark` / `step_undo` (`LayerCache.undoable`)
    steps_undoable = False

    _NP = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}

    def __init__(self, config: CacheConfig, storage: mx.Dtype, keys: bool, values: bool):
        self.storage = storage
        self.directory = private_dir("shadow", config.cold_path) if config.shadow_store == "disk" else None
        #: a RAM shadow is an MLX buffer per side (`ShadowRows`: gathered on the device)
        self.device = self.directory is None
        if self.directory is not None:
            remove_with(self, self.directory)
        self.label = "shadow_disk" if self.directory is not None else "shadow"
        self.sides = (keys, values)
        self.arrays: list = [None, None]      # GrowingArray per side, made at the first append
        self.batch_heads = (0, 0)

    def has(self, side: int) -> bool:
        return self.sides[side]

    def dim(self, side: int) -> int:
        return self.arrays[side].shape[-1]

    def _mx(self, rows: np.ndarray) -> mx.array:
        """Stored rows as an MLX array in the storage dtype (bf16 is kept as its bit patterns)."""
        rows = mx.array(rows)
        return rows.view(mx.bfloat16) if self.storage == mx.bfloat16 else rows

    def append(self, keys: mx.array, values: mx.array) -> None:
        for i, x in enumerate((keys, values)):
            if not self.sides[i]:
                continue
            B, H, T, D = x.shape
            self.batch_heads = (B, H)
            x = x.astype(self.storage)
            if self.arrays[i] is None:
                self.arrays[i] = self._new_rows(i, (B * H, D))
            if self.device:
                self.arrays[i].append(x.reshape(B * H, T, D).transpose(1, 0, 2))
                continue
            rows = np.asarray(x.view(mx.uint16) if self.storage == mx.bfloat16 else x)
            self.arrays[i].append(rows.reshape(B * H, T, D).transpose(1, 0, 2))

    def _new_rows(self, side: int, shape: tuple) -> LiveRows:
        """The empty rows of a side: an MLX buffer (RAM) or a memory-mapped array (disk)."""
        if self.device:
            return ShadowRows(shape, self.storage)
        return GrowingArray(shape, self._NP[self.storage], f"{self.directory}/{'kv'[side]}.bin")

    def gather(self, side: int, idx: mx.array) -> mx.array:
        """Exact rows (fp32) of tokens `idx` [B, Hkv, rep, L, k] of one side -> [B, Hkv, rep, L, k, D]:
        on the device from a RAM shadow (row (start + t) * B*H + b*H + h of its flat buffer), with
        numpy from a disk one (the indices read to the host first)."""
        if self.device:
            rows = self.arrays[side]
            B, H = idx.shape[:2]
            bh = (mx.arange(B, dtype=mx.uint32)[:, None] * H + mx.arange(H, dtype=mx.uint32)[None, :])
            flat = (idx.astype(mx.uint32) + rows.start) * (B * H) + bh.reshape(B, H, 1, 1, 1)
            buf = rows.array.reshape(-1, rows.shape[-1])          # the whole buffer: contiguous, no copy
            return mx.take(buf, flat, axis=0).astype(mx.float32)
        t = np.asarray(idx).astype(np.int64)
        B, H = t.shape[:2]
        bh = (np.arange(B)[:, None] * H + np.arange(H)[None, :]).reshape(B, H, 1, 1, 1)
        return self._mx(self.arrays[side].view()[t, bh]).astype(mx.float32)

    def front(self, side: int, n: int) -> mx.array:
        """The oldest `n` rows of a side as [B, H, n, D] in the storage dtype."""
        live = self.arrays[side].view()[:n]
        rows = live if self.device else self._mx(live)              # [n, B*H, D]
        return rows.transpose(1, 0, 2).reshape(*self.batch_heads, n, self.dim(side))

    def exact_front(self, n: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """`keys`, `values` (the oldest `n` tokens, dequantised) with the sides this shadow holds
        replaced by their exact rows."""
        return (self.front(0, n) if self.has(0) else keys), (self.front(1, n) if self.has(1) else values)

    def drop_front(self, n: int) -> None:
        for arr in self.arrays:
            if arr is not None:
                arr.drop_front(n)

    def truncate(self, n: int) -> None:
        for arr in self.arrays:
            if arr is not None:
                arr.truncate(n)

    @property
    def nbytes(self) -> int:
        return sum(arr.nbytes for arr in self.arrays if arr is not None)

    def breakdown(self) -> dict[str, int]:
        """Its bytes under its label (`shadow`, or `shadow_disk` memory-mapped), for the body's."""
        return {self.label: self.nbytes}

    def saved(self) -> dict:
        """The parts of a prompt-cache file it writes, by name (the body's `state`)."""
        return {"shadow": self}

    def close(self) -> None:
        self.arrays = [None, None]
        if self.directory is not None:
            remove_dir(self.directory)

    def state(self) -> tuple[dict, dict]:
        arrays, sides = {}, []
        for i, arr in enumerate(self.arrays):
            if arr is None:
                sides.append(None)
                continue
            arrays["kv"[i]], m = arr.state()
            sides.append(m)
        return arrays, {"batch_heads": list(self.batch_heads), "sides": sides}

    def load_state(self, arrays, meta: dict) -> None:
        """Rows back into RAM, or copied into this store's private directory and mapped again.
        A side saved empty is emptied (a checkpoint's restore loads into a store that has grown
        since: its rows must not outlive the state loaded)."""
        self.batch_heads = tuple(meta["batch_heads"])
        for i, m in enumerate(meta["sides"]):
            if m is None:
                old, self.arrays[i] = self.arrays[i], None
                if getattr(old, "path", None) and os.path.exists(old.path):
                    os.unlink(old.path)    # its disk space back (a map still open keeps its own inode)
                continue
            entry = arrays["kv"[i]]
            self.arrays[i] = self._new_rows(i, tuple(entry.shape[1:]))
            self.arrays[i].load_state(entry, m)


class NoShadow:
    """The shadow of a KIVI body without exact top-k: holds nothing, so the body hands on its
    dequantised tokens as they are."""

    def has(self, side: int) -> bool:
        return False

    def append(self, keys: mx.array, values: mx.array) -> None:
        pass

    def exact_front(self, n: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values

    def drop_front(self, n: int) -> None:
        pass

    def truncate(self, n: int) -> None:
        pass

    def breakdown(self) -> dict[str, int]:
        return {}

    def saved(self) -> dict:
        return {}

    def close(self) -> None:
        pass
