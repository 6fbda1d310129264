"""Exact (full-precision) K/V storage: the building block of every cache segment."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}


class DenseStore:
    """Exact keys and values [B, H, T, D] in position order, kept in a preallocated buffer.

    Live tokens are `buffer[head : head + n]`. Appends are slice writes into spare capacity
    (grown in `step`-token increments, as mlx-lm's KVCache does) and `drop_front` only moves
    `head`, so StreamingLLM's per-step eviction copies nothing; the live part is moved to the
    front of a new buffer only when the end is reached (amortised O(1) per token).
    """

    step = 256

    def __init__(self, dtype: mx.Dtype = mx.float32):
        self.dtype = dtype
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.head = 0
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def append(self, keys: mx.array, values: mx.array) -> None:
        L = keys.shape[2]
        if L == 0:
            return
        if self.keys is None or self.head + self.n + L > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            size = ((self.n + L + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, size, Dk), self.dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), self.dtype)
            if self.n:
                new_k[..., : self.n, :], new_v[..., : self.n, :] = self.fetch()
            self.keys, self.values, self.head = new_k, new_v, 0
        end = self.head + self.n
        self.keys[..., end : end + L, :] = keys.astype(self.dtype)
        self.values[..., end : end + L, :] = values.astype(self.dtype)
        self.n += L

    def drop_front(self, n: int) -> tuple[mx.array, mx.array]:
        """Remove the oldest `n` tokens; returns them (the cold store may keep them)."""
        n = min(n, self.n)
        h = self.head
        dropped = (self.keys[..., h : h + n, :], self.values[..., h : h + n, :])
        self.head += n
        self.n -= n
        return dropped

    def droppable(self, n: int) -> int:
        """How many of the oldest `n` tokens `drop_front(n)` would really remove."""
        return min(n, self.n)

    def truncate(self, n: int) -> None:
        """Keep only the first `n` tokens (roll back a generation)."""
        self.n = min(self.n, n)

    def fetch(self, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]:
        h, e = self.head, self.head + self.n
        k, v = self.keys[..., h:e, :], self.values[..., h:e, :]
        if dtype is not None and dtype != self.dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return k, v

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tokens (the buffer's spare capacity, under `n + step`, not counted)."""
        if self.keys is None or self.n == 0:
            return 0
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[3]
        return B * H * self.n * (Dk + Dv) * self.keys.itemsize
