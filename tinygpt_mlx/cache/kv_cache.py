"""`KVCache`: the single owner of KV storage policy, for every layer of a model.

Each layer's K/V is a sequence of segments, oldest first: the StreamingLLM sink (exact), the
body (exact, or KIVI-packed blocks) and, for retrieval, a cold store that receives what the
body evicts. One `CacheConfig` picks the precision, the eviction and the retrieval; the
policies compose here instead of living in parallel classes.

StreamingLLM (Xiao et al. 2023): keep the first `sink` tokens and the newest `window`, drop
the middle (`evict_middle_if_needed`). In "shifted" RoPE mode keys are stored before RoPE and
rotated to their cache slot on every read, so query-key distances stay inside the trained
range; in "absolute" mode keys keep their original rotation (mlx-lm's RotatingKVCache).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from ..config import CacheConfig
from .store import DTYPES, DenseStore


class LayerCache:
    """One layer's view of the cache; implements mlx-lm's per-layer cache protocol.

    `offset` is the RoPE position the next token gets: tokens seen (`current_length`) in
    absolute mode, its cache slot in shifted StreamingLLM mode. Neither ever decreases.
    """

    def __init__(self, config: CacheConfig, rope: Optional[Callable] = None):
        self.config = config
        self.rope = rope
        self.seen = 0          # tokens ever appended (monotonic)
        self.start = 0         # position of the oldest token in the body
        self.dtype: Optional[mx.Dtype] = None  # compute dtype, taken from the model's keys
        storage = DTYPES[config.storage]
        self.sink_store = DenseStore(storage)
        self.body = make_body_store(config, storage, rope)
        self.cold = None       # set by the retrieval policy
        # True when our attention is installed in the model: update_and_fetch may then return
        # only the new tokens and `attend` reads the segments itself (packed / retrieved data).
        self.attention_installed = False
        if self.shifted and rope is None:
            raise ValueError("shifted RoPE needs the model's RoPE; use rope_mode 'absolute'")

    # ----- policy ---------------------------------------------------------------------------
    @property
    def shifted(self) -> bool:
        return (self.config.streaming or self.config.retrieval) and self.config.rope_mode == "shifted"

    def _slot_gap(self, pending: int = 0) -> int:
        """Shifted retrieval: cache slots reserved between the sink and the hot window for the
        retrieved tokens (once anything is cold, or is about to be with `pending` tokens)."""
        if self.cold is None or not self.shifted:
            return 0
        if len(self.cold) or (pending and self._pending_drop(pending)):
            return self.cold.reserved_slots
        return 0

    @property
    def needs_query(self) -> bool:
        """Whether attention must run inside the cache (packed keys, retrieval)."""
        return self.config.quantised or self.cold is not None

    def _recent_limit(self, pending: int) -> Optional[int]:
        """Body tokens to keep so that the next `pending` tokens each see exactly `window`
        (retrieval: the hot window `hot_budget` plays the window's part, also during prefill)."""
        limit = self.config.window if self.config.streaming else self.config.hot_budget
        if limit is None:
            return None
        return limit - 1 if pending else limit

    def _pending_drop(self, pending: int) -> int:
        limit = self._recent_limit(pending)
        if limit is None or len(self.body) <= limit:
            return 0
        return self.body.droppable(len(self.body) - limit)

    def evict_middle_if_needed(self, pending: int = 0) -> int:
        """StreamingLLM eviction: drop body tokens [sink, len - window) of this layer.

        With `pending` new tokens about to be appended, keep `window - 1` old tokens, the
        ones the first new token can still see (attention inside a chunk is windowed by the
        mask); after a step (`pending == 0`) keep `window`. Returns the tokens dropped.
        """
        n = self._pending_drop(pending)
        if n:
            k, v = self.body.drop_front(n)
            if self.cold is not None:
                self.cold.add(k, v, self.start)
            self.start += n
        return n

    # ----- mlx-lm protocol ------------------------------------------------------------------
    @property
    def offset(self) -> int:
        if self.shifted:
            return self.stored_count - self._pending_drop(1) + self._slot_gap(1)
        return self.seen

    @property
    def current_length(self) -> int:
        return self.seen

    @property
    def stored_count(self) -> int:
        return len(self.sink_store) + len(self.body)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        L = keys.shape[2]
        self.evict_middle_if_needed(pending=L)
        if self.dtype is None:
            self.dtype = keys.dtype
        if self.shifted:
            keys = self._unrotate(keys, self.stored_count + self._slot_gap())
        n_sink = max(0, min(L, self.config.sink - len(self.sink_store)))
        if n_sink:
            self.sink_store.append(keys[..., :n_sink, :], values[..., :n_sink, :])
            if len(self.body) == 0:
                self.start = self.seen + n_sink
        self.body.append(keys[..., n_sink:, :], values[..., n_sink:, :])
        self.seen += L
        if self.needs_query and self.attention_installed:
            return keys, values
        return self.fetch()

    def fetch(self) -> tuple[mx.array, mx.array]:
        """All stored K/V, dense, in the compute dtype, keys rotated to their RoPE position."""
        parts = []
        for store, slot in ((self.sink_store, 0), (self.body, len(self.sink_store) + self._slot_gap())):
            if len(store):
                k, v = store.fetch(self.dtype)
                parts.append((self.rope(k, offset=slot) if self.shifted else k, v))
        if len(parts) == 1:
            return parts[0]
        return mx.concatenate([p[0] for p in parts], axis=2), mx.concatenate([p[1] for p in parts], axis=2)

    def _unrotate(self, keys: mx.array, first_slot: int) -> mx.array:
        """Undo the RoPE the model applied at slots first_slot.. (store keys pre-RoPE)."""
        B, H, L, D = keys.shape
        flat = keys.transpose(2, 0, 1, 3).reshape(L * B * H, 1, D)
        offs = -mx.repeat(mx.arange(first_slot, first_slot + L), B * H)
        return self.rope(flat, offset=offs).reshape(L, B, H, D).transpose(1, 2, 0, 3)

    def key_positions(self, pending: int = 0) -> mx.array:
        """Absolute positions of the stored tokens (after the next update of `pending`)."""
        drop = self._pending_drop(pending) if pending else 0
        sink = mx.arange(len(self.sink_store))
        body = mx.arange(self.start + drop, self.seen + pending)
        return mx.concatenate([sink, body])

    def _window_limits(self, N: int) -> bool:
        """Whether some of the next `N` queries may not see some stored key (StreamingLLM)."""
        if not self.config.streaming:
            return False
        drop = self._pending_drop(N)
        first_body = self.start + drop if len(self.body) > drop else max(self.seen, self.config.sink)
        return (self.seen + N - 1) - first_body >= self.config.window

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask for the next `N` tokens (mlx-lm calls this before the update).

        None or "causal" where every query sees every earlier stored key, else a boolean
        [N, stored] array over absolute positions: causal, and for StreamingLLM limited to the
        sink plus the last `window` positions of each query.
        """
        if not self._window_limits(N) and window_size is None:
            if N == 1:
                return None
            if not return_array:
                return "causal"
        kpos = self.key_positions(pending=N)[None]
        qpos = mx.arange(self.seen, self.seen + N)[:, None]
        mask = kpos <= qpos
        if self.config.streaming:
            mask = mask & ((kpos < self.config.sink) | (qpos - kpos < self.config.window))
        if window_size is not None:
            mask = mask & (qpos - kpos < window_size)
        return mask

    def segments(self) -> list:
        """What attention reads, in key-position order matching `make_mask`'s columns.

        Each segment offers `scores(q)` -> [B, Hkv, rep, L, T] for queries q [B, Hkv, rep, L, D]
        (already scaled) and `output(p)` -> [B, Hkv, rep, L, D] for probabilities over its T.
        """
        if hasattr(self.body, "segments"):
            segs = []
            if len(self.sink_store):
                k, v = self.sink_store.fetch(self.dtype)
                segs.append(DenseSegment(self.rope(k, offset=0) if self.shifted else k, v))
            return segs + self.body.segments(self)
        return [DenseSegment(*self.fetch())]

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """One softmax over the scores of every segment; the output sums segment outputs.

        Nothing is dequantised into a full-length temporary: packed segments score with
        `mx.quantized_matmul`. Computed in fp32 whatever the storage precision.
        """
        segs = self.segments()
        retrieved = self.cold.retrieve(queries, scale, self) if self.cold is not None else []
        segs = retrieved + segs
        B, Hq, L, D = queries.shape
        hkv = segs[-1].n_heads
        q = (queries.astype(mx.float32) * scale).reshape(B, hkv, Hq // hkv, L, D)
        scores = [sg.scores(q) for sg in segs]
        sizes = [sc.shape[-1] for sc in scores]
        scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
        mask = _mask_array(mask, L, sum(sizes), sum(sizes[:len(retrieved)]))
        if mask is not None:
            scores = mx.where(mask, scores, -mx.inf)
        probs = mx.softmax(scores, axis=-1, precise=True)
        out, start = None, 0
        for sg, n in zip(segs, sizes):
            part = sg.output(probs[..., start:start + n])
            out = part if out is None else out + part
            start += n
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)

    @property
    def state(self):
        if self.stored_count == 0:
            return []
        return self.fetch()

    @state.setter
    def state(self, v):
        raise NotImplementedError("restoring a posttrainllm cache from state is not supported")

    def size(self) -> int:
        return self.stored_count

    def empty(self) -> bool:
        return self.seen == 0

    def is_trimmable(self) -> bool:
        return not (self.config.streaming or self.config.quantised or self.cold is not None)

    def trim(self, n: int) -> int:
        """Forget the newest `n` tokens (only for plain full caches)."""
        if not self.is_trimmable():
            return 0
        n = min(n, len(self.body))
        self.body.truncate(len(self.body) - n)
        self.seen -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def nbytes_breakdown(self) -> dict[str, int]:
        out = {"sink": self.sink_store.nbytes}
        out.update(self.body.nbytes_breakdown() if hasattr(self.body, "nbytes_breakdown")
                   else {"body": self.body.nbytes})
        if self.cold is not None:
            out.update(self.cold.nbytes_breakdown())
        return out


class DenseSegment:
    """Exact keys/values [B, Hkv, T, D] as an attention segment."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys.astype(mx.float32), values.astype(mx.float32)
        self.n_heads = keys.shape[1]

    def scores(self, q: mx.array) -> mx.array:
        return q @ mx.expand_dims(self.keys, 2).swapaxes(-1, -2)

    def output(self, p: mx.array) -> mx.array:
        return p @ mx.expand_dims(self.values, 2)


def _mask_array(mask: Any, L: int, total: int, n_retrieved: int) -> Optional[mx.array]:
    """`make_mask`'s answer as a boolean [L, total] array (None = all visible); retrieved
    tokens come first and are visible to every query (they are all older)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        stored = total - n_retrieved
        q = mx.arange(stored - L, stored)[:, None]
        mask = mx.arange(stored)[None] <= q
    if n_retrieved:
        mask = mx.concatenate([mx.ones((L, n_retrieved), dtype=mx.bool_), mask], axis=-1)
    return mask


def make_body_store(config: CacheConfig, storage: mx.Dtype, rope: Optional[Callable] = None):
    """The body segment for a policy: exact, or KIVI-packed when bits are set (KIVI needs the
    model's RoPE in shifted mode, where it rotates keys as it freezes them)."""
    if config.quantised:
        try:
            from .kivi import KiviStore  # noqa: PLC0415
        except ImportError:
            raise ValueError("KIVI quantisation (int8/int4/int2) is not available in this build yet") from None
        return KiviStore(config, storage, rope)
    return DenseStore(storage)


class KVCache(list):
    """Every layer's cache for one model, configured by one `CacheConfig`.

    It is a list of per-layer caches, so it can be passed as `cache=` to the native model and
    as `prompt_cache=` to mlx-lm's `generate`; layers that share K/V (YOCO) hold their owner's
    object, and layers with their own cache type (sliding-window layers) keep it.
    """

    def __init__(self, layers: list, config: CacheConfig):
        super().__init__(layers)
        self.config = config

    @property
    def owned(self) -> list[LayerCache]:
        """The distinct caches of ours (shared layers counted once)."""
        seen, out = set(), []
        for c in self:
            if isinstance(c, LayerCache) and id(c) not in seen:
                seen.add(id(c))
                out.append(c)
        return out

    @property
    def current_length(self) -> int:
        return max((c.current_length for c in self.owned), default=0)

    @property
    def stored_count(self) -> int:
        return max((c.stored_count for c in self.owned), default=0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._distinct())

    def _distinct(self) -> list:
        seen, out = set(), []
        for c in self:
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                out.append(c)
        return out

    @property
    def disk_nbytes(self) -> int:
        """The part of `nbytes` held in memory-mapped files (breakdown keys ending in "_disk")."""
        return sum(v for k, v in self.nbytes_breakdown().items() if k.endswith("_disk"))

    def nbytes_breakdown(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self._distinct():
            parts = c.nbytes_breakdown() if isinstance(c, LayerCache) else {"model-owned": c.nbytes}
            for k, v in parts.items():
                total[k] = total.get(k, 0) + v
        return total

    def evict_middle_if_needed(self) -> int:
        """Trim every layer to its policy after a step; returns tokens dropped per layer."""
        return max((c.evict_middle_if_needed() for c in self.owned), default=0)

    @property
    def layers_with_kv(self) -> int:
        return len(self._distinct())
