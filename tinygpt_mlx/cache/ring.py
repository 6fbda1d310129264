"""StreamingLLM's exact cache as a ring: the sink and the window in one preallocated buffer.

The buffer is [B, H, S + W, D]: the sink's S slots, then W window slots used circularly. A
decode step writes its token in place over the oldest window token (as mlx-lm's
`RotatingKVCache._update_in_place` does) and attention reads the whole buffer in storage order:
for one query the order of the keys does not matter, so nothing is gathered, concatenated or
copied per step. A prefill chunk (several queries, a causal and windowed mask over positions)
lays the tokens out in position order instead ("linear": sink, window, new tokens), exactly as
the mask's columns expect; the next single-token step turns that back into a ring.

Positions (positions.py, `Positions.frame`): window keys are stored as the model rotated them,
at their position minus the layer's `base`, and the query sits at its own position minus `base`.
Within the window slot distances equal position distances, so in shifted mode only the sink
must move: its keys are kept before RoPE and rotated, S rows per step, to the slots just before
the window (`first_slot` of the reading is where sink slot 0 sits in that frame). Nothing in the
window is ever re-rotated, except once per `Positions.rebase_every` tokens, when `rebase` turns
the stored keys back by B and the base grows by B, so fp32 angles never lose precision.

The sink is placed for SINK_STEPS steps at once and advanced by one matmul (`sink_block.SinkBlock`).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from ..config import CacheConfig
from .layer import LayerCache
from .positions import Positions
from .segments import DenseSegment, Reading
from .sink_block import SINK_STEPS, SinkBlock
from .store import Forgets, no_tokens

__all__ = ["SINK_STEPS", "RingLayer", "RingStore"]

#: what `RingStore.drop_front` returns (built once: a full window evicts at every decode step)
_NOTHING = no_tokens(mx.float32)


class RingStore:
    """The sink and the window of an exact StreamingLLM cache (module doc), holding the sink
    too (its layer cache has no sink store and hands it every token). Of `Evictable` it has `append`,
    `droppable` and `drop_front`; no `truncate` (a StreamingLLM cache is not trimmable) and no
    `fetch`: `attention_kv(..., ordered=True)` is its dense reference, sink placed."""

    #: no `step_mark` / `step_undo` (`LayerCache.undoable`)
    steps_undoable = False

    def __init__(self, dtype: mx.Dtype, sink: int, window: int, positions: Positions):
        self.dtype, self.sink, self.window, self.positions = dtype, sink, window, positions
        self.keys: Optional[mx.array] = None      # ring: [B, H, S + W, D]; linear: [B, H, T, D]
        self.values: Optional[mx.array] = None
        self.sink_block = SinkBlock(dtype, positions)   # shifted mode: the sink before RoPE, placed
        self.ring = False
        self.n_sink = 0   # sink tokens held (the body is empty until the sink is full)
        self.n = 0        # window (body) tokens held
        self.head = 0     # linear: body tokens dropped from the front of keys[..., n_sink:]
        self.ptr = 0      # ring: the window slot the next token is written to
        self._sink_in_buffer: Optional[int] = None  # ring: the first_slot the buffer's sink has
        #: a count of the changes to the ring's layout other than a decode step's token (a chunk
        #: appended, laid out as a ring, cut back, re-based, loaded), in a cell a cache's sliding
        #: rings share (kv_cache.py): what compiled_retrieval.py `rings_ready` decided of them
        #: holds until it moves
        self.changes = [0]

    def __len__(self) -> int:
        return self.n_sink + self.n

    # ----- storage --------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array, first: int) -> None:
        """Store [B, H, L, D] new tokens (keys as the model rotated them, the first one at
        frame position `first`): the first S ever fill the sink, the rest the window, in place
        when L == 1. The layer cache has evicted first (`drop_front`), so the window has room."""
        L = keys.shape[2]
        if L == 0:
            return
        s = min(L, self.sink - self.n_sink)
        if s and self.positions.frame:
            self.sink_block.add(self.positions.unrotate(keys[..., :s, :], first))
        if L == 1 and s == 0:
            self._to_ring(keys)
            self.write_one(keys, values)
            return
        self.changes[0] += 1
        k, v = self._ordered()
        new_k, new_v = keys.astype(self.dtype), values.astype(self.dtype)
        self.keys = new_k if k is None else mx.concatenate([k, new_k], axis=2)
        self.values = new_v if v is None else mx.concatenate([v, new_v], axis=2)
        self.ring, self.head = False, 0
        self.n_sink += s
        self.n += L - s

    def write_one(self, keys: mx.array, values: mx.array) -> None:
        """A decode step's token into the ring (which has room), over the oldest window slot."""
        i = self.sink + self.ptr
        self.keys[..., i:i + 1, :] = keys if keys.dtype == self.dtype else keys.astype(self.dtype)
        self.values[..., i:i + 1, :] = values if values.dtype == self.dtype else values.astype(self.dtype)
        self.took(self.keys, self.values, None)

    def took(self, keys: mx.array, values: mx.array, sink_at: Optional[int]) -> None:
        """`write_one`'s bookkeeping for buffers [B, H, S + W, D] that already hold the new token
        at the pointer (a compiled step wrote it, compiled.py), with the sink placed for sink
        slot 0 at `sink_at` (shifted mode; None: unplaced)."""
        self.keys, self.values = keys, values
        self.ptr = (self.ptr + 1) % self.window
        self.n += 1
        if sink_at is not None:
            self._sink_in_buffer = sink_at

    # ----- what a compiled decode step reads (compiled.py) ---------------------------------------
    def steady(self) -> bool:
        """Whether the ring holds its whole sink and window laid out as a ring: a decode step then
        writes over its oldest window slot, and its shapes never change."""
        return self.ring and self.n == self.window and self.n_sink == self.sink

    @property
    def write_slot(self) -> int:
        """The buffer slot the next decode step's token is written to (the ring's pointer)."""
        return self.sink + self.ptr

    def buffers(self) -> tuple[mx.array, mx.array]:
        """The key and value buffers [B, H, S + W, D] as they lie (the sink's slots first)."""
        return self.keys, self.values

    def _to_ring(self, like: mx.array) -> None:
        """Lay the tokens out as a ring (sink slots, then the window from slot 0) if they are not."""
        if self.n >= self.window:
            raise ValueError(f"the window is full ({self.n} of {self.window}): evict before appending")
        if self.ring:
            return
        self.changes[0] += 1
        k, v = self._ordered()
        B, H, _, Dk = like.shape
        pad = self.sink + self.window - len(self)
        zk = mx.zeros((B, H, pad, Dk), self.dtype)
        zv = mx.zeros((B, H, pad, (v if v is not None else like).shape[3]), self.dtype)
        if k is None:
            self.keys, self.values = zk, zv
        else:
            self.keys, self.values = mx.concatenate([k, zk], axis=2), mx.concatenate([v, zv], axis=2)
        self.ring, self.ptr, self.head = True, self.n, 0
        self._sink_in_buffer = None

    def _ordered(self) -> tuple[Optional[mx.array], Optional[mx.array]]:
        """Every held token in position order (sink keys as stored in the buffer)."""
        if self.keys is None or len(self) == 0:
            return None, None
        S = self.n_sink
        if self.ring:
            lo = (self.ptr - self.n) % self.window
            if lo + self.n <= self.window:
                idx = [(S + lo, S + lo + self.n)]
            else:
                idx = [(S + lo, S + self.window), (S, S + self.ptr)]
        else:
            idx = [(S + self.head, S + self.head + self.n)]
        spans = ([(0, S)] if S else []) + [(a, b) for a, b in idx if b > a]
        if not spans:
            return None, None
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
            lo, hi = spans[0][0], spans[-1][1]
            return self.keys[..., lo:hi, :], self.values[..., lo:hi, :]
        return (mx.concatenate([self.keys[..., a:b, :] for a, b in spans], axis=2),
                mx.concatenate([self.values[..., a:b, :] for a, b in spans], axis=2))

    def droppable(self, n: int) -> int:
        return min(n, self.n)

    def truncate(self, length: int) -> None:
        """Keep the oldest `length` tokens (the sink's included): only for a ring that has never
        evicted (its window starts at slot 0, `RingLayer.trimmable`), whose next token then goes
        to the slot after the kept ones."""
        if length < self.n_sink or length > len(self):
            raise ValueError(f"cannot cut {len(self)} ring tokens back to {length} (sink {self.n_sink})")
        self.changes[0] += 1
        self.n = length - self.n_sink
        if self.ring:
            self.ptr = self.n % self.window

    def drop_front(self, n: int) -> tuple[mx.array, mx.array]:
        """Forget the oldest `n` window tokens (a ring slot is overwritten by the next token).
        Returns nothing: an exact StreamingLLM window has no cold tier to hand them to."""
        n = min(n, self.n)
        if not self.ring:
            self.head += n
        self.n -= n
        return _NOTHING

    def rebase(self, by: int) -> None:
        """Turn every stored window key back by `by` positions (the base grows by `by`)."""
        self.changes[0] += 1
        if self.keys is None:
            return
        S = self.n_sink
        self.keys[..., S:, :] = self.positions.rebased(self.keys[..., S:, :], by).astype(self.dtype)

    # ----- reading --------------------------------------------------------------------------
    def placed_sink(self, at: int) -> Optional[mx.array]:
        """Shifted mode: the sink's keys rotated to their slots in the query's frame (sink slot 0
        at frame position `at`), from a block computed for SINK_STEPS consecutive slots."""
        if not self.positions.frame or not self.n_sink:
            return None
        return self.sink_block.placed(at)

    def attention_kv(self, first_slot: int, ordered: bool, dtype: Optional[mx.Dtype] = None
                     ) -> tuple[mx.array, mx.array]:
        """Keys and values for one attention call, sink slot 0 at frame position `first_slot`
        (shifted mode): the buffer as it lies (ring order, for a single query with no mask), or
        in position order (`ordered`: what a mask's columns index)."""
        if self.ring and not ordered and (self.n == self.window or self.ptr == self.n):
            if self.positions.frame and self.n_sink and self._sink_in_buffer != first_slot:
                self.keys[..., :self.n_sink, :] = self.placed_sink(first_slot)
                self._sink_in_buffer = first_slot
            k, v = self.keys, self.values
            if self.n < self.window:      # not wrapped yet: the window is slots [0, n)
                k, v = k[..., :len(self), :], v[..., :len(self), :]
        else:                             # position order (or a ring evicted between steps)
            k, v = self._ordered()
            placed = self.placed_sink(first_slot)
            if placed is not None:
                k = mx.concatenate([placed, k[..., self.n_sink:, :]], axis=2)
        if dtype is not None and dtype != self.dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return k, v

    def segments(self, reading: Reading) -> list:
        if not len(self):
            return []
        return [DenseSegment(*self.attention_kv(reading.first_slot, True, reading.dtype))]

    # ----- bytes, closing, files ----------------------------------------------------------------
    def _per_token(self) -> int:
        B, H, _, Dk = self.keys.shape
        return B * H * (Dk + self.values.shape[3]) * self.keys.itemsize

    def nbytes_breakdown(self) -> dict[str, int]:
        """The sink (in shifted mode with its pre-RoPE keys and their rotations for the next
        steps) and the window's stored tokens."""
        if self.keys is None:
            return {"sink": 0, "body": 0}
        return {"sink": self.n_sink * self._per_token() + self.sink_block.nbytes, "body": self.n * self._per_token()}

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def close(self) -> None:
        self.changes[0] += 1
        self.keys = self.values = None
        self.sink_block = SinkBlock(self.dtype, self.positions)
        self._sink_in_buffer = None
        self.ring = False
        self.n_sink = self.n = self.head = self.ptr = 0

    def state(self) -> tuple[dict, dict]:
        """(arrays, metadata): the tokens in position order as stored, the sink's pre-RoPE keys,
        and the counters."""
        meta = {"n_sink": self.n_sink, "n": self.n}
        if not len(self):
            return {}, meta
        k, v = self._ordered()
        arrays = {"keys": k, "values": v}
        if self.sink_block.keys is not None:
            arrays["sink_keys"] = self.sink_block.keys
        return arrays, meta

    def load_state(self, arrays: Any, meta: dict) -> None:
        self.close()
        self.changes[0] += 1
        n_sink, n = int(meta["n_sink"]), int(meta["n"])
        if not n_sink + n:
            return
        k, v = arrays["keys"].mx(), arrays["values"].mx()
        if k.dtype != self.dtype or k.shape[2] != n_sink + n or v.shape[2] != n_sink + n:
            raise ValueError(f"saved window tokens are {k.dtype} x {k.shape[2]}, expected {self.dtype} x {n_sink + n}")
        if self.positions.frame and n_sink:
            self.sink_block.load(arrays["sink_keys"].mx())
        self.keys, self.values, self.n_sink, self.n = k, v, n_sink, n


class RingLayer(LayerCache):
    """An exact StreamingLLM layer: the sink and the window in one ring (ring.py), on frame
    positions; the body holds the sink too, placing it itself, and no cold store."""

    def __init__(self, config: CacheConfig, positions: Positions, ring: Any):
        super().__init__(config, positions, None, ring, Forgets())
        self.compiles = "ring"

    @property
    def n_sink(self) -> int:
        return self.body.n_sink

    def _window_len(self) -> int:
        return self.body.n

    @property
    def stored_count(self) -> int:
        return len(self.body)

    def _append(self, keys: mx.array, values: mx.array, n_sink: int) -> None:
        self.body.append(keys, values, self.seen - self.positions.base)   # the keys' frame position

    def fetch(self) -> tuple[mx.array, mx.array]:
        if not len(self.body):
            return no_tokens(self.dtype or mx.float32)
        return self.body.attention_kv(self._sink_slot0(), True, self.dtype)

    def sees_all(self, window_size: Optional[int]) -> bool:
        """Whether one query sees every stored token under the model's own sliding-window mask
        of `window_size` (None: no such mask): a ring with no sink holds only the last `window`
        positions, so a model window at least as wide masks nothing."""
        return window_size is None or (self.config.sink == 0 and window_size >= self.config.window)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if N == 1 and self.sees_all(window_size):
            return None     # one query sees every stored token (a sliding layer's ring too)
        return super().make_mask(N, return_array, window_size)

    def _never_evicted(self) -> bool:
        return self.seen == len(self.body) and self.positions.base == 0

    def is_trimmable(self) -> bool:
        """A sliding layer's ring, while it has evicted nothing (as mlx-lm's `RotatingKVCache`
        until it wraps); a StreamingLLM window never (layer.py)."""
        return self.sliding is not None and self.config.sink == 0 and self._never_evicted()

    def trimmable(self) -> int:
        """A sliding layer's ring that has evicted nothing: every token (what a ring fed only
        the rest would hold); else none."""
        return len(self.body) if self.is_trimmable() else 0

    def segments(self) -> list:
        return self.body.segments(Reading(self.dtype, self.positions, self._sink_slot0()))

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The buffer as it lies for one unmasked query (ring.py), else in position order."""
        keys, values = self.body.attention_kv(self._sink_slot0(), mask is not None, self.dtype)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def nbytes_breakdown(self) -> dict[str, int]:
        return dict(self.body.nbytes_breakdown())

    def stores(self) -> dict:
        return {"body": self.body}
