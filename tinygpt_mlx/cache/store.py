"""The store interface every cache segment implements, and exact (full-precision) storage.

A layer cache holds `[sink, body, cold]`, each a store. Data flows one way: the layer cache
calls its stores and hands them what they need (a `segments.Reading`: compute dtype, position
rules, first slot, and for retrieval the queries); no store sees the layer cache.

* `Store` (every tier): `append`, `segments(reading)`, `nbytes_breakdown`, `close`, `len`.
* `Persistent` (every store): `state()` and `load_state(arrays, meta)`, for prompt-cache files.
* `Evictable(Store)` (sink and body, exact or KIVI-packed): also `droppable`, `drop_front`
  (returns the dropped K/V, which the cold store may receive), `truncate`, and `fetch` (every
  stored token dense, in position order: the reference path that attention is tested against).

The cold store (cold.py) is a `Store` whose `append` also takes the first token's position; a
layer without retrieval holds `Forgets` in its place, which drops what it is handed.
Stores that only grow where they are used that way (a full body: `DenseStore`, `KiviStore`; the
cold store) also offer `mark()` and `rewind(mark)`: a checkpoint's length to cut back to
(cache/checkpoint.py).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import mlx.core as mx

from .segments import DenseSegment, Reading

DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}


def no_tokens(dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(keys, values) of a store or layer that holds no token: `fetch`'s empty answer."""
    z = mx.zeros((0,), dtype)
    return z, z


def join(parts: list) -> tuple[mx.array, mx.array]:
    """(keys, values) pairs, oldest first, as one pair along the token axis."""
    if len(parts) == 1:
        return parts[0]
    return (mx.concatenate([p[0] for p in parts], axis=2), mx.concatenate([p[1] for p in parts], axis=2))


class Store(Protocol):
    def __len__(self) -> int: ...
    def segments(self, reading: Reading) -> list: ...
    def nbytes_breakdown(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class Evictable(Store, Protocol):
    steps_undoable: bool     # whether `step_mark` / `step_undo` take a decode step back (`LayerCache.undoable`)

    def append(self, keys: mx.array, values: mx.array) -> None: ...
    def droppable(self, n: int) -> int: ...
    def drop_front(self, n: int) -> tuple[mx.array, mx.array]: ...
    def truncate(self, n: int) -> None: ...
    def fetch(self, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]: ...


class Persistent(Protocol):
    """Every store can be written to a prompt-cache file and restored (cache/persist.py):
    `state()` -> (arrays by name, JSON-able counters); `load_state(arrays, meta)` refills a
    freshly built store of the same policy (`arrays[name]` is a persist.Entry: `.mx()`,
    `.np()`, `.copy_to(path)`; `arrays.scope(prefix)` a sub-store's arrays)."""

    def state(self) -> tuple[dict, dict]: ...
    def load_state(self, arrays: Any, meta: dict) -> None: ...


class DenseStore:
    """Exact keys and values [B, H, T, D] in position order, kept in a preallocated buffer.

    Live tokens are `buffer[head : head + n]`. Appends are slice writes into spare capacity
    (grown in `step`-token increments, as mlx-lm's KVCache does) and `drop_front` only moves
    `head`, so StreamingLLM's per-step eviction copies nothing; the live part is moved to the
    front of a new buffer only when the end is reached (amortised O(1) per token).

    `frame`: the position rules of a layer whose keys this store holds as the model rotated them,
    at their position minus the base (a shifted retrieval hot window on frame positions,
    positions.py): they are never placed when read, and `rebase` turns them back. Otherwise, in
    shifted mode, keys are held before RoPE and placed at their slots when read (`placed`).
    """

    #: `step_mark` / `step_undo` take one decode step back (spill_stage.py, `LayerCache.undoable`)
    steps_undoable = True

    def __init__(self, dtype: mx.Dtype = mx.float32, label: str = "body", step: int = 256,
                 frame: Optional[Any] = None):
        self.dtype = dtype
        self.label = label      # its name in the bytes breakdown
        self.step = step
        self.frame = frame
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.head = 0
        self.n = 0
        self.version = 0     # changes with every mutation: what `_placed` caches is keyed by it
        self._placed_for: Optional[tuple] = None
        self._placed_keys: Optional[mx.array] = None

    def __len__(self) -> int:
        return self.n

    def append(self, keys: mx.array, values: mx.array) -> None:
        L = keys.shape[2]
        if L == 0:
            return
        if self.keys is None or self.head + self.n + L > self.keys.shape[2]:
            self._regrow(*keys.shape[:2], keys.shape[3], values.shape[3], L)
        end = self.head + self.n
        dtype = self.dtype
        self.keys[..., end : end + L, :] = keys if keys.dtype == dtype else keys.astype(dtype)
        self.values[..., end : end + L, :] = values if values.dtype == dtype else values.astype(dtype)
        self.n += L
        self.version += 1

    def _regrow(self, B: int, H: int, Dk: int, Dv: int, L: int) -> None:
        """New buffers with room for `L` more tokens, the live ones moved to their front (`append`)."""
        size = ((self.n + L + self.step - 1) // self.step) * self.step
        if self.head:   # a window that evicts from the front: a step of room, or every step would move it
            size += self.step
        new_k = mx.zeros((B, H, size, Dk), self.dtype)
        new_v = mx.zeros((B, H, size, Dv), self.dtype)
        if self.n:
            new_k[..., : self.n, :], new_v[..., : self.n, :] = self.fetch()
        self.keys, self.values, self.head = new_k, new_v, 0

    def make_room(self, L: int) -> None:
        """Where `L` more tokens do not fit after the live ones (`fits`), the buffers `append`
        would make for them now, the live tokens moved to their front: the same tokens, only
        where they lie (serve's batched retrieval step does it before a step that a compiled
        trace then writes in place, server/batch.py); nothing where they fit."""
        if self.keys is None or self.fits(L):
            return
        B, H, _, Dk = self.keys.shape
        self._regrow(B, H, Dk, self.values.shape[3], L)
        self.version += 1

    def append_fetch(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """`append` then `fetch(dtype)` in one call (a full layer's update, layer.FullLayer): a
        token that fits the buffer and needs no cast is written straight in."""
        L = keys.shape[2]
        end = self.head + self.n
        if (self.keys is None or end + L > self.keys.shape[2] or L == 0
                or keys.dtype != self.dtype or values.dtype != self.dtype):
            self.append(keys, values)
            return self.fetch(dtype)
        # [:, :, a:b] rather than [..., a:b, :]: the same slices of the [B, H, T, D] buffers, and
        # each about 0.5 us less to build here (an Ellipsis costs MLX's indexing a pass)
        self.keys[:, :, end : end + L] = keys
        self.values[:, :, end : end + L] = values
        self.n += L
        self.version += 1
        end += L
        k, v = self.keys[:, :, self.head:end], self.values[:, :, self.head:end]
        if dtype != self.dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return k, v

    def took(self, keys: mx.array, values: mx.array) -> None:
        """`append`'s bookkeeping for one token already written at `head + n` of buffers `keys`,
        `values` (a compiled step wrote it, compiled.py), which replace this store's."""
        self.keys, self.values = keys, values
        self.n += 1
        self.version += 1

    def fits(self, L: int) -> bool:
        """Whether `L` more tokens fit after the live ones in the buffers as they are (a compiled
        step writes them there in place, compiled.py)."""
        return self.keys is not None and self.head + self.n + L <= self.keys.shape[2]

    def buffers(self) -> tuple[mx.array, mx.array]:
        """The key and value buffers [B, H, capacity, D] (live tokens at `head`..`head + n`)."""
        return self.keys, self.values

    def forget_front(self, n: int) -> None:
        """`drop_front` of tokens something else has taken already (a compiled step's trace)."""
        n = min(n, self.n)
        self.head += n
        self.n -= n
        self.version += 1

    def drop_front(self, n: int) -> tuple[mx.array, mx.array]:
        """Remove the oldest `n` tokens; returns them (the cold store may keep them)."""
        n = min(n, self.n)
        h = self.head
        dropped = (self.keys[..., h : h + n, :], self.values[..., h : h + n, :])
        self.head += n
        self.n -= n
        self.version += 1
        return dropped

    def droppable(self, n: int) -> int:
        """How many of the oldest `n` tokens `drop_front(n)` would really remove."""
        return min(n, self.n)

    def truncate(self, n: int) -> None:
        """Keep only the first `n` tokens (roll back a generation)."""
        self.n = min(self.n, n)
        self.version += 1

    def mark(self) -> int:
        """A full (only growing) store's extent, for a checkpoint (cache/checkpoint.py)."""
        return self.n

    def rewind(self, mark: int) -> None:
        """Back to `mark`: the tokens appended since are forgotten."""
        self.truncate(mark)

    def step_mark(self) -> tuple:
        """What one decode step changes here, to undo it (`step_undo`): the buffers (a growth
        replaces them; an append writes after the live tokens, where nothing live is) and the
        live range (an eviction moves `head`). Not a re-base's turn of the keys (`rotate`):
        spill_stage.py stages no step that re-bases."""
        return self.keys, self.values, self.head, self.n

    def step_undo(self, mark: tuple) -> None:
        """Back to `step_mark`'s state: the step's token forgotten, its evicted ones live again."""
        self.keys, self.values, self.head, self.n = mark
        self.version += 1

    def rotate(self, turn) -> None:
        """Replace the live keys by `turn(keys)` (a re-base turns them back by RoPE)."""
        if not self.n:
            return
        h, e = self.head, self.head + self.n
        self.keys[..., h:e, :] = turn(self.keys[..., h:e, :]).astype(self.dtype)
        self.version += 1

    def rebase(self, by: int) -> None:
        """Frame positions: turn the held keys back by `by` positions (the base grows by `by`)."""
        self.rotate(lambda k: self.frame.rebased(k, by))

    def fetch(self, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]:
        h = self.head
        e = h + self.n
        k, v = self.keys[..., h:e, :], self.values[..., h:e, :]
        if dtype is not None and dtype != self.dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return k, v

    def segments(self, reading: Reading) -> list:
        """One exact segment, keys placed at their slots (shifted mode) or as stored."""
        if not self.n:
            return []
        k, v = self.fetch(reading.dtype)
        return [DenseSegment(self.placed(k, reading), v)]

    def placed(self, keys: mx.array, reading: Reading) -> mx.array:
        """`keys` (this store's, fetched) placed at their slots from `reading.first_slot`; the
        rotation is kept until the store or the slot changes, so a store that does not change
        between steps (a sink, whose slots are fixed) is rotated once, not every step."""
        if not reading.positions.shifted or self.frame is not None:
            return keys
        key = (reading.first_slot, self.version, reading.dtype)
        if self._placed_for != key:
            self._placed_keys, self._placed_for = reading.positions.place(keys, reading.first_slot), key
        return self._placed_keys

    def nbytes_breakdown(self) -> dict[str, int]:
        return {self.label: self.nbytes}

    def close(self) -> None:
        self.keys = self.values = self._placed_keys = None
        self.head = self.n = 0
        self.version += 1

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    def state(self) -> tuple[dict, dict]:
        """(arrays, metadata): the live tokens as stored (their dtype kept) and the counters."""
        meta = {"n": self.n, "capacity": 0 if self.keys is None else int(self.keys.shape[2])}
        if not self.n:
            return {}, meta
        k, v = self.fetch()
        return {"keys": k, "values": v}, meta

    def load_state(self, arrays: Any, meta: dict) -> None:
        """Restore what `state` returned into this (fresh) store: the live tokens at the front of
        a buffer of the saved capacity."""
        self.close()
        n = int(meta["n"])
        if not n:
            return
        k, v = arrays["keys"].mx(), arrays["values"].mx()
        if k.dtype != self.dtype or v.dtype != self.dtype or k.shape[2] != n or v.shape[2] != n:
            raise ValueError(f"saved {self.label} tokens are {k.dtype} x {k.shape[2]}, expected {self.dtype} x {n}")
        B, H, _, Dk = k.shape
        size = max(int(meta.get("capacity", 0)), ((n + self.step - 1) // self.step) * self.step)
        self.keys = mx.zeros((B, H, size, Dk), self.dtype)
        self.values = mx.zeros((B, H, size, v.shape[3]), self.dtype)
        self.keys[..., :n, :], self.values[..., :n, :] = k, v
        self.head, self.n = 0, n
        self.version += 1

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tokens (the buffer's spare capacity, under `n + step`, not counted)."""
        if self.keys is None or self.n == 0:
            return 0
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[3]
        return B * H * self.n * (Dk + Dv) * self.keys.itemsize


class Forgets:
    """The cold store of a layer without retrieval: what the body evicts is forgotten
    (StreamingLLM's eviction), so the layer hands evicted tokens on the same way whatever its
    policy. Holds nothing, costs nothing, and is not saved."""

    def __len__(self) -> int:
        return 0

    def append(self, keys: mx.array, values: mx.array, start_position: int) -> None:
        pass

    def segments(self, reading: Reading) -> list:
        return []

    def nbytes_breakdown(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
