"""Token-major arrays that grow in place, in RAM or memory-mapped on disk, and the private
directories that hold the disk ones (removed when their owner goes, or at a server's shutdown).

Used by every store that keeps rows outside MLX: retrieval's cold store and KIVI's exact shadow.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..quant import GROUP_SIZES

__all__ = ["LiveRows", "GrowingArray", "private_dir", "remove_with", "remove_dir", "remove_private_dirs"]


class LiveRows:
    """What every token-major row buffer [capacity, *shape] here shares: the live rows are
    `array[start:n]`; `append` doubles the capacity when full (after moving the live rows to the
    front, where that makes room); `drop_front` only moves `start`, and the live rows move to the
    front once the dropped ones outnumber them (amortised O(1) per dropped row). A subclass says
    how to write rows, move them (`_compact`), grow (`_grow`) and its element size (`itemsize`)."""

    shape: tuple
    array: Any
    start: int
    n: int
    growths: int

    @property
    def capacity(self) -> int:
        return self.array.shape[0]

    def __len__(self) -> int:
        return self.n - self.start

    def append(self, rows: Any) -> None:
        n = rows.shape[0]
        if self.n + n > self.capacity:
            self._compact()
        if self.n + n > self.capacity:
            cap = self.capacity
            while cap < self.n + n:
                cap *= 2
            self._grow(cap)
            self.growths += 1
        self._write(rows)
        self.n += n

    def view(self) -> Any:
        return self.array[self.start: self.n]

    def drop_front(self, n: int) -> None:
        """Forget the oldest `n` live rows."""
        self.start += min(n, len(self))
        if self.start >= len(self):
            self._compact()

    def truncate(self, n: int) -> None:
        """Keep only the oldest `n` live rows."""
        self.n = self.start + min(len(self), n)

    @property
    def nbytes(self) -> int:
        return len(self) * int(np.prod(self.shape)) * self.itemsize

    @property
    def itemsize(self) -> int:
        raise NotImplementedError

    def _write(self, rows: Any) -> None:
        """Rows into `array[n:n + len(rows)]` (room is there)."""
        raise NotImplementedError

    def _compact(self) -> None:
        """Move the live rows to the front (where `start` is not 0)."""
        raise NotImplementedError

    def _grow(self, capacity: int) -> None:
        """A buffer of `capacity` rows holding the live ones where they were."""
        raise NotImplementedError


class GrowingArray(LiveRows):
    """A token-major array [capacity, *shape] that doubles its capacity when full.

    RAM: a numpy array; a growth copies the live part once (amortised O(1) per row).
    Disk: a numpy memmap; a growth extends the file and maps it again (nothing is copied).
    `array` is the same object between growths (tests check this). Live rows are
    `array[start:n]`: `drop_front` only moves `start`, and the live rows move to the front once
    the dropped ones outnumber them (amortised O(1) per dropped row).
    """

    def __init__(self, shape: tuple, dtype: Any, path: Optional[str] = None, initial: int = 256):
        self.shape, self.dtype, self.path = tuple(shape), np.dtype(dtype), path
        self.start = 0
        self.n = 0
        self.growths = 0
        self.array = self._allocate(initial, None)

    def _allocate(self, capacity: int, old: Optional[np.ndarray]) -> np.ndarray:
        if self.path is None:
            new = np.empty((capacity,) + self.shape, self.dtype)
            if old is not None and self.n:
                new[: self.n] = old[: self.n]
            return new
        if old is not None:
            old.flush()
            del old
        mode = "r+" if os.path.exists(self.path) else "w+"
        return np.memmap(self.path, dtype=self.dtype, mode=mode, shape=(capacity,) + self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def _write(self, rows: np.ndarray) -> None:
        self.array[self.n: self.n + rows.shape[0]] = rows

    def _grow(self, capacity: int) -> None:
        self.array = self._allocate(capacity, self.array)

    def _compact(self) -> None:
        if self.start:
            live = len(self)
            self.array[:live] = self.array[self.start: self.n]
            self.start, self.n = 0, live

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    def state(self) -> tuple[np.ndarray, dict]:
        """The live rows (a view: a disk array's rows are streamed from its file when written)
        and the counters that `load_state` needs to continue exactly."""
        return self.view(), {"n": len(self), "capacity": self.capacity, "growths": self.growths}

    def load_state(self, entry: Any, meta: dict) -> None:
        """Take saved rows (`entry`: a persist.Entry). RAM: read into a fresh buffer of the saved
        capacity. Disk: the rows are copied file-to-file into this array's own file (the saved
        file is never mapped, so continuing can never modify it) and memory-mapped again; they
        are not read into RAM."""
        n = int(meta["n"])
        cap = max(int(meta["capacity"]), n, 1)
        if tuple(entry.shape) != (n,) + self.shape:
            raise ValueError(f"saved rows have shape {tuple(entry.shape)}, expected {(n,) + self.shape}")
        self.start, self.growths = 0, int(meta.get("growths", 0))
        if self.path is None:
            self.array = np.empty((cap,) + self.shape, self.dtype)
            self.array[:n] = entry.np()
        else:
            self.array = None
            if os.path.exists(self.path):
                os.unlink(self.path)      # an old map of it (if any) keeps its own inode
            entry.copy_to(self.path)
            self.array = np.memmap(self.path, dtype=self.dtype, mode="r+", shape=(cap,) + self.shape)
        self.n = n


_PRIVATE_DIRS: set = set()


def private_dir(name: str, base: Optional[str]) -> str:
    """A fresh directory for one store's memory-mapped files (under `base`, or a temp dir);
    `remove_with(owner, path)` removes it when the owner is collected, and
    `remove_private_dirs` removes every one still there (a server's shutdown: uvicorn re-raises
    SIGTERM after it, so exit-time finalizers never run)."""
    try:
        if base is not None:
            os.makedirs(base, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"posttrainllm-{name}-", dir=base)
    except OSError as e:
        raise ValueError(f"cannot create a disk store under {base or tempfile.gettempdir()}: "
                         f"{e.strerror or e}") from None
    _PRIVATE_DIRS.add(path)
    return path


def remove_with(owner: Any, path: str) -> None:
    """Remove the private directory `path` once `owner` is garbage-collected (or at exit)."""
    weakref.finalize(owner, _remove_private_dir, path)


def remove_dir(path: str) -> bool:
    """Remove a private directory now (a store's `close`); False if it was already gone."""
    return _remove_private_dir(path)


def _remove_private_dir(path: str) -> bool:
    _PRIVATE_DIRS.discard(path)
    if not os.path.isdir(path):
        return False
    shutil.rmtree(path, True)
    return True


def remove_private_dirs() -> int:
    """Delete every directory `private_dir` made in this process that still exists; returns how many."""
    return sum(_remove_private_dir(path) for path in list(_PRIVATE_DIRS))


class PackedRows:
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
