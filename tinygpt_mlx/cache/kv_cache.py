"""`KVCache`: the single owner of KV storage policy, for every layer of a model.

Each layer's K/V is a sequence of stores, oldest first: the StreamingLLM sink (exact), the body
(exact, or KIVI-packed blocks) and, for retrieval, a cold store that receives what the body
evicts. One `CacheConfig` picks the precision, the eviction and the retrieval; the policies
compose here instead of living in parallel classes. The factory (`cache.make_cache`) builds the
stores; a `LayerCache` only calls them and hands them what they need (store.py).

StreamingLLM (Xiao et al. 2023): keep the first `sink` tokens and the newest `window`, drop
the middle (`evict_middle_if_needed`). Positions (absolute / shifted / retrieved slots) are
decided by one `Positions` object per layer (positions.py).

Naming, for readers who know mlx-lm: mlx-lm's `KVCache` is ONE layer's cache; here that is a
`LayerCache` (it implements mlx-lm's per-layer protocol), and `KVCache` is the whole model's.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import mlx.core as mx

from .. import quant
from ..config import CacheConfig
from .checkpoint import Held, held_nbytes
from .plan import Plan
from .positions import Positions
from .segments import Reading, attend
from .store import DenseStore, Evictable
from .telemetry import RetrievalTelemetry, summarise


def compile_by_default() -> bool:
    """A new cache's `compile_decode`: on unless `POSTTRAINLLM_COMPILE` is 0/false/no/off."""
    return os.environ.get("POSTTRAINLLM_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


class LayerCache:
    """One layer's cache (mlx-lm's per-layer protocol: `offset`, `update_and_fetch`,
    `make_mask`, `state`, `trim`), over the stores `[sink, body, cold?]`.

    `offset` is the RoPE position the next token gets: tokens seen (`current_length`) in
    absolute mode, its cache slot in shifted mode, its position minus the base in frame mode
    (a ring, KIVI under StreamingLLM, a retrieval hot window: it drops by the base's growth at
    a re-base).
    """

    def __init__(self, config: CacheConfig, positions: Positions, sink: Optional[DenseStore], body: Evictable,
                 cold: Optional[Any] = None):
        self.config = config
        self.positions = positions
        self.sink_store = sink   # None in a `RingLayer`: the ring holds the sink too (ring.py)
        self.body = body
        self.cold = cold
        self.telemetry = RetrievalTelemetry() if cold is not None else None
        self.seen = 0          # tokens ever appended (monotonic)
        self.start = 0         # position of the oldest token in the body
        self.dtype: Optional[mx.Dtype] = None  # compute dtype, taken from the model's keys
        self._step_masks: dict = {}   # make_mask's decode-step masks by shape (see there)

    # ----- policy ---------------------------------------------------------------------------
    @property
    def n_sink(self) -> int:
        """Sink tokens held."""
        return len(self.sink_store)

    def _window_len(self) -> int:
        """Tokens held after the sink (the window, or KIVI's body, or the hot window)."""
        return len(self.body)

    @property
    def needs_query(self) -> bool:
        """Whether attention must run inside the cache (packed keys, retrieval)."""
        return self.config.quantised or self.cold is not None

    def _cold_tokens(self) -> int:
        """Tokens in the cold store now."""
        return len(self.cold) if self.cold is not None else 0

    def _drop_to(self, pending: bool) -> int:
        """Body tokens to evict so that the next call's tokens each see exactly `window` (with
        `pending`: keep `window - 1`), or, between calls, so that exactly `window` are held
        (retrieval: the hot window `hot_budget` plays the window's part, also during prefill)."""
        limit = self.config.window if self.config.streaming else self.config.hot_budget
        if limit is None:
            return 0
        limit -= 1 if pending else 0
        held = self._window_len()
        return self.body.droppable(held - limit) if held > limit else 0

    def plan(self) -> Plan:
        """What the next model call (of any length) does to this layer (plan.py)."""
        rebase = self.positions.rebase_due(self.seen)
        drop = self._drop_to(pending=True)
        stored = self.stored_count - drop
        if self.positions.frame:    # the re-base is done by the commit; the query gets the new base
            offset = self.seen - self.positions.base - rebase
        else:
            offset = self.positions.query_offset(self.seen, stored, self._cold_after(drop))
        return Plan(rebase, drop, self.start + drop, stored, offset)

    def _cold_after(self, drop: int) -> int:
        """Tokens in the cold store once `drop` more are evicted to it."""
        return self._cold_tokens() + drop if self.cold is not None else 0

    def commit(self, plan: Plan, keys: Optional[mx.array], values: Optional[mx.array],
               written: Optional[tuple] = None) -> None:
        """Apply `plan` with the new tokens [B, H, L, D]: re-base, evict, append. `written`
        instead of keys and values: a compiled decode step's one token (compiled.py), already
        written by the trace into the body's buffers, which go to the body's `took` (with what
        else it needs to know of them) in place of the append."""
        if plan.rebase:
            self.body.rebase(plan.rebase)
            self.positions.base += plan.rebase
        self._evict(plan.drop)
        if written is not None:     # one token, and a layer that has seen tokens (a dtype)
            self.body.took(*written)
            self.seen += 1
            return
        L = keys.shape[2]
        if self.dtype is None:
            self.dtype = keys.dtype
        n_sink = max(0, min(L, self.config.held_sink - self.n_sink))
        if n_sink and self._window_len() == 0:
            self.start = self.seen + n_sink
        self._append(keys, values, n_sink)
        self.seen += L

    def _append(self, keys: mx.array, values: mx.array, n_sink: int) -> None:
        """The new tokens into the stores, the first `n_sink` of them into the sink."""
        stored = keys
        if self.positions.pre_rope:
            stored = self.positions.unrotate(keys, self.stored_count + self.positions.gap(self._cold_tokens()))
        if n_sink:
            sink = stored[..., :n_sink, :]
            if self.positions.frame:    # only the sink is kept before RoPE (placed when read)
                sink = self.positions.unrotate(sink, self.seen - self.positions.base)
            self.sink_store.append(sink, values[..., :n_sink, :])
        self.body.append(stored[..., n_sink:, :], values[..., n_sink:, :])

    def _evict(self, n: int) -> None:
        """Drop the body's oldest `n` tokens (`droppable` ones); retrieval hands them to the
        cold store."""
        if not n:
            return
        k, v = self.body.drop_front(n)
        if self.cold is not None:
            if self.positions.frame:    # a frame hot window: the cold store keeps keys before RoPE
                k = self.positions.unrotate(k.astype(mx.float32), self.start - self.positions.base)
            self.cold.append(k, v, self.start)
        self.start += n

    def evict_middle_if_needed(self) -> int:
        """StreamingLLM eviction between model calls: drop body tokens [sink, len - window) of
        this layer, so that it holds exactly its window (a call of L > 1 tokens leaves
        `window - 1 + L`, which the next call's commit evicts anyway: plan.py). Retrieval hands
        what it drops to the cold store. Returns the tokens dropped."""
        n = self._drop_to(pending=False)
        self._evict(n)
        return n

    def extend_cold(self, keys: mx.array, values: mx.array) -> None:
        """Take `keys`/`values` [B, H, n, D] (before RoPE) as already seen and evicted: they join
        the cold store at positions after its last one, and the hot window moves n positions on
        (a benchmark's way to reach long contexts fast). On frame positions the base moves on
        with it, so the window's keys keep their frame positions and are never turned."""
        n = keys.shape[2]
        positions = self.cold.positions.view()
        self.cold.append(keys, values, int(positions[-1]) + 1 if len(positions) else self.start)
        if self.positions.frame:
            self.positions.base += n
        self.start += n
        self.seen += n

    # ----- mlx-lm protocol ------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.plan().offset

    @property
    def current_length(self) -> int:
        return self.seen

    @property
    def stored_count(self) -> int:
        return len(self.body) + len(self.sink_store)

    #: tells `attention.scaled_dot_product_attention` to call `attend` (module doc there)
    reads_own_segments = True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new tokens [B, H, L, D] (`commit` of this call's `plan`) and return them as
        given, whatever the policy: attention reads the stored tokens itself (`attend`), and
        `fetch()` assembles them dense for the reference path."""
        self.commit(self.plan(), keys, values)
        return keys, values

    def _body_slot(self) -> int:
        return self.positions.body_slot(self.n_sink, self._cold_tokens())

    def readings(self) -> tuple[Reading, Reading]:
        """How the sink and the body are read now (compute dtype, positions, first slot)."""
        slot0 = self._slot0()
        return (Reading(self.dtype, self.positions, slot0), Reading(self.dtype, self.positions, slot0 + self._body_slot()))

    def sink_slot_during(self, plan: Plan, L: int = 1) -> int:
        """Frame mode: where sink slot 0 sits in the query's frame while a call of `L` tokens
        planned as `plan` attends (after its commit)."""
        return self.positions.frame_slot0(self.seen + L, plan.stored + L, self._cold_after(plan.drop)) - plan.rebase

    def _slot0(self) -> int:
        """Where slot 0 sits in the query's RoPE frame: 0, or in frame mode its frame position."""
        return self._sink_slot0() if self.positions.frame else 0

    def _sink_slot0(self) -> int:
        """Frame mode (a ring, a KIVI body under StreamingLLM, a retrieval hot window): the
        sink's slot 0 in the query's frame (read only in shifted mode)."""
        return self.positions.frame_slot0(self.seen, self.stored_count, self._cold_tokens())

    def fetch(self) -> tuple[mx.array, mx.array]:
        """All stored K/V, dense, in the compute dtype, keys rotated to their RoPE position:
        the reference path (packed blocks dequantised; attention tests compare against it)."""
        parts = []
        sink, body = self.readings()
        for store, reading, placed in ((self.sink_store, sink, self.positions.shifted),
                                       (self.body, body, self.positions.pre_rope)):
            if len(store):
                k, v = store.fetch(self.dtype)
                parts.append((self.positions.place(k, reading.first_slot) if placed else k, v))
        if not parts:
            return self._nothing()
        if len(parts) == 1:
            return parts[0]
        return mx.concatenate([p[0] for p in parts], axis=2), mx.concatenate([p[1] for p in parts], axis=2)

    def _nothing(self) -> tuple[mx.array, mx.array]:
        """`fetch` of a layer that holds no token."""
        z = mx.zeros((0,), self.dtype or mx.float32)
        return z, z

    def key_positions(self, pending: int = 0, plan: Optional[Plan] = None) -> mx.array:
        """Absolute positions of the stored tokens (after the next call's `pending` tokens, by
        its `plan`)."""
        first = (plan or self.plan()).first if pending else self.start
        return mx.concatenate([mx.arange(self.n_sink), mx.arange(first, self.seen + pending)])

    def _window_limits(self, N: int, plan: Plan) -> bool:
        """Whether some of the next `N` queries may not see some stored key (StreamingLLM)."""
        if not self.config.streaming:
            return False
        first_body = plan.first if self._window_len() > plan.drop else max(self.seen, self.config.sink)
        return (self.seen + N - 1) - first_body >= self.config.window

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask for the next `N` tokens (mlx-lm calls this before the update).

        None or "causal" where every query sees every earlier stored key, else a boolean
        [N, stored] array over absolute positions: causal, and for StreamingLLM limited to the
        sink plus the last `window` positions of each query.
        """
        plan = self.plan()
        if not self._window_limits(N, plan) and window_size is None:
            if N == 1:
                return None
            if not return_array:
                return "causal"
        step_key = None
        if N == 1 and window_size is None:
            # a decode step's mask depends only on the sink held and the body's distances to the
            # query (a KIVI body hides its oldest < G tokens): built once per shape, reused
            step_key = (self.n_sink, self.seen - plan.first)
            if step_key in self._step_masks:
                return self._step_masks[step_key]
        kpos = self.key_positions(N, plan)[None]
        qpos = mx.arange(self.seen, self.seen + N)[:, None]
        mask = kpos <= qpos
        if self.config.streaming:
            mask = mask & ((kpos < self.config.sink) | (qpos - kpos < self.config.window))
        if window_size is not None:
            mask = mask & (qpos - kpos < window_size)
        if step_key is not None:
            if len(self._step_masks) >= 256:
                self._step_masks.clear()
            mx.eval(mask)
            self._step_masks[step_key] = mask
        return mask

    def segments(self) -> list:
        """What attention reads, in key-position order matching `make_mask`'s columns."""
        sink, body = self.readings()
        return self.sink_store.segments(sink) + self.body.segments(body)

    #: a chunk of at least this many queries over a KIVI body attends over it dequantised
    DENSE_PREFILL = 16

    def _dense_prefill(self, L: int) -> bool:
        """Whether a chunk of `L` queries over packed blocks runs the fused dense kernel over
        the body dequantised once (`fetch()`): a prefill chunk's attention costs L times the
        body, its dequantisation once, so the dense kernel (BLAS here, MLX's on Metal) wins
        where many queries share the keys; decode steps score the packed codes directly. Not
        with exact top-k (it refines the packed scores) nor retrieval (no dense reference)."""
        return (L >= self.DENSE_PREFILL and self.cold is None and self.config.quantised
                and not self.config.exact_topk)

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention of `queries` [B, Hq, L, D] over what this layer holds. Exact stores (and a
        KIVI prefill chunk, `_dense_prefill`): the fused dense kernel over `fetch()`. Packed or
        retrieved data: retrieved cold tokens (if any), the sink and the body, one softmax over
        every segment's scores (segments.attend)."""
        if not self.needs_query or self._dense_prefill(queries.shape[2]):
            keys, values = self.fetch()
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        if self.cold is None or not len(self.cold):
            return attend(self.segments(), 0, queries, scale, mask)
        stages = self.cold.stages
        with stages.timed("model"):     # (bench's stage split: the model up to this query)
            stages.sync(queries)
        slot = self.positions.retrieved_slot(len(self.sink_store), len(self.cold))
        if self.positions.frame:
            # the queries turned back to the retrieved slot (which the coarse pass scores cold
            # keys with anyway): against them retrieved keys sit at slot 0 and the sink at fixed
            # slots before it, so neither is rotated per step; the window scores with `queries`
            turned = self.positions.rotate_to(queries.astype(mx.float32), -(self._slot0() + slot))
            retrieved, selection = self.cold.retrieve(Reading(self.dtype, self.positions, 0, turned, scale))
            sink = self.sink_store.segments(Reading(self.dtype, self.positions, -slot))
            segments = retrieved + sink + self.body.segments(self.readings()[1])
            n_turned = len(retrieved) + len(sink)
        else:
            turned, n_turned = None, 0
            retrieved, selection = self.cold.retrieve(Reading(self.dtype, self.positions, slot, queries, scale))
            segments = retrieved + self.segments()
        with stages.timed("attend"):
            out = attend(segments, len(retrieved), queries, scale, mask, turned, n_turned)
            stages.sync(out)
        self.telemetry.record(selection)   # after attention: what the last query picked is known there
        return out

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

    def _full_body(self) -> bool:
        """Whether the body only grows (no window, no hot window: nothing evicted or re-based)."""
        return not self.config.streaming and self.cold is None

    def is_trimmable(self) -> bool:
        """mlx-lm's protocol: whether `trim` can roll back any number of tokens (plain full
        caches). `trimmable()` says how far every policy can."""
        return self._full_body() and not self.config.quantised

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can forget, leaving what a cache fed only the
        rest would hold: every body token of a plain full cache; a full KIVI cache's exact
        residual (frozen blocks cannot be cut back token by token); nothing for a window, a
        hot window or a cache holding a cold store (what they evicted is gone or moved; a
        checkpoint restores them, `checkpoint`)."""
        if not self._full_body():
            return 0
        if self.config.quantised:
            return len(self.body.residual)
        return len(self.body)

    def trim(self, n: int) -> int:
        """Forget the newest `n` tokens, at most `trimmable()`; returns how many were forgotten."""
        n = min(n, self.trimmable())
        if n <= 0:
            return 0
        self.body.truncate(len(self.body) - n)
        self.seen -= n
        return n

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def checkpoint(self) -> dict:
        """This layer's state now, for `restore`: its counters, the sink and a bounded body held
        in memory, a full body and the cold store as marks (lengths to cut back to)."""
        cp: dict = {"seen": self.seen, "start": self.start, "base": self.positions.base, "dtype": self.dtype}
        for name, store in self._stores().items():
            if name == "cold" or (name == "body" and self._full_body()):
                cp[name] = ("mark", store.mark())
            else:
                arrays, meta = store.state()
                cp[name] = ("held", Held.of(arrays), meta)
        return cp

    def restore(self, cp: dict) -> None:
        """Back to the state `checkpoint` returned (taken on this cache, which has only grown or
        been restored to an earlier checkpoint since)."""
        for name, store in self._stores().items():
            kind, *rest = cp[name]
            if kind == "held":
                store.load_state(*rest)
            else:
                store.rewind(rest[0])
        self.seen, self.start, self.positions.base, self.dtype = cp["seen"], cp["start"], cp["base"], cp["dtype"]
        self._step_masks.clear()
        if self.telemetry is not None:
            self.telemetry.reset()

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def nbytes_breakdown(self) -> dict[str, int]:
        out = dict(self.sink_store.nbytes_breakdown())
        out.update(self.body.nbytes_breakdown())
        if self.cold is not None:
            out.update(self.cold.nbytes_breakdown())
        return out

    def close(self) -> None:
        """Release every store (a disk store's files are removed)."""
        for store in self._stores().values():
            store.close()

    # ----- prompt-cache files (cache/persist.py) --------------------------------------------
    def _stores(self) -> dict:
        """The stores by name (as prompt-cache files and checkpoints call them)."""
        return {"sink": self.sink_store, "body": self.body, **({"cold": self.cold} if self.cold is not None else {})}

    def saved_state(self) -> tuple[dict, dict]:
        """(arrays, metadata) of this layer for a prompt-cache file: its counters and each store's
        `state()`, asked store by store (named "sink.", "body.", "cold." in the arrays). Not
        `state`: that is mlx-lm's protocol (the stored K/V, dense)."""
        arrays: dict = {}
        meta: dict = {"seen": self.seen, "start": self.start, "base": self.positions.base,
                      "dtype": None if self.dtype is None else str(self.dtype).rsplit(".", 1)[-1]}
        for name, store in self._stores().items():
            a, meta[name] = store.state()
            arrays.update({f"{name}.{k}": v for k, v in a.items()})
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        """Refill this freshly built layer cache (same policy) from `state`'s output."""
        self.seen, self.start = int(meta["seen"]), int(meta["start"])
        self.positions.base = int(meta.get("base", 0))
        self.dtype = None if meta["dtype"] is None else getattr(mx, meta["dtype"])
        stores = self._stores()
        if set(stores) != {k for k in ("sink", "body", "cold") if k in meta}:
            raise ValueError(f"saved stores {sorted(k for k in ('sink', 'body', 'cold') if k in meta)} "
                             f"do not match this policy's {sorted(stores)}")
        for name, store in stores.items():
            store.load_state(arrays.scope(f"{name}."), meta[name])
        if self.telemetry is not None:
            self.telemetry.reset()


class RingLayer(LayerCache):
    """An exact StreamingLLM layer: the sink and the window in one ring (ring.py), on frame
    positions; the body holds the sink too, placing it itself, and no cold store."""

    def __init__(self, config: CacheConfig, positions: Positions, ring: Any):
        super().__init__(config, positions, None, ring)

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
            return self._nothing()
        return self.body.attention_kv(self._sink_slot0(), True, self.dtype)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if N == 1 and window_size is None:
            return None     # one query sees every stored token
        return super().make_mask(N, return_array, window_size)

    def segments(self) -> list:
        return self.body.segments(Reading(self.dtype, self.positions, self._sink_slot0()))

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The buffer as it lies for one unmasked query (ring.py), else in position order."""
        keys, values = self.body.attention_kv(self._sink_slot0(), mask is not None, self.dtype)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def nbytes_breakdown(self) -> dict[str, int]:
        return dict(self.body.nbytes_breakdown())

    def _stores(self) -> dict:
        return {"body": self.body}


class Checkpoint:
    """A whole cache's state at `length` tokens (`KVCache.checkpoint`); `nbytes`: what it holds."""

    def __init__(self, length: int, layers: list):
        self.length, self.layers = length, layers
        self.nbytes = held_nbytes(layers)


class KVCache(list):
    """Every layer's cache for one model, configured by one `CacheConfig`.

    It is a list of per-layer caches, so it can be passed as `cache=` to the native model and
    as `prompt_cache=` to mlx-lm's `generate`; layers that share K/V (YOCO) hold their owner's
    object, and layers with their own cache type (sliding-window layers) keep it. It owns the
    whole-cache operations (eviction, trimming, bytes, telemetry, closing) and the KIVI codec
    that the stores round through (`quantise_affine`, `dequantise_k`, `dequantise_v`).
    Use it as a context manager, or call `close()`, to remove disk stores at once.
    """

    def __init__(self, layers: list, config: CacheConfig):
        super().__init__(layers)
        self.config = config
        self._owned = [c for c in self.distinct() if isinstance(c, LayerCache)]
        #: whether a decode step over full StreamingLLM rings may run compiled (cache/compiled.py);
        #: the one switch, its default from the environment
        self.compile_decode = compile_by_default()

    # ----- the KIVI codec (the design card's names; quant.py holds the packing primitives) ----
    @staticmethod
    def quantise_affine(x: mx.array, bits: int, group: int, param_dtype: mx.Dtype = mx.float32
                        ) -> tuple[mx.array, mx.array, mx.array]:
        """Asymmetric affine quantisation of groups of `group` consecutive elements of x's last
        axis: zero = min(g), scale = max(eps, (max(g) - min(g)) / (2^bits - 1)),
        q = clip(round((x - zero) / scale), 0, 2^bits - 1), packed 32 // bits codes per uint32.
        KIVI keys go in as K^T (groups of G tokens per channel), values as V (groups of G
        channels per token). Returns (packed, scale, zero)."""
        return quant.quantise_affine(x, bits, group, param_dtype)

    @staticmethod
    def dequantise_k(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int,
                     dtype: mx.Dtype = mx.float32) -> mx.array:
        """Keys back from K^T codes: K_hat[t, d] = scale[d, t // G] * q[d, t] + zero[d, t // G],
        returned as [..., T, D]."""
        return quant.dequantise_k(packed, scale, zero, bits, group, dtype)

    @staticmethod
    def dequantise_v(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int,
                     dtype: mx.Dtype = mx.float32) -> mx.array:
        """Values back from per-token codes: V_hat[t, d] = scale[t, d // G] * q[t, d] + zero[t, d // G]."""
        return quant.dequantise_v(packed, scale, zero, bits, group, dtype)

    # ----- layers ---------------------------------------------------------------------------
    @property
    def owned(self) -> list[LayerCache]:
        """The distinct caches of ours (shared layers counted once)."""
        return self._owned

    def distinct(self) -> list:
        """Each layer's cache once (layers may share one), ours or the model's own."""
        seen, out = set(), []
        for c in self:
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                out.append(c)
        return out

    @property
    def layers_with_kv(self) -> int:
        return len(self.distinct())

    # ----- counts and bytes -----------------------------------------------------------------
    @property
    def current_length(self) -> int:
        return max((c.current_length for c in self.owned), default=0)

    @property
    def stored_count(self) -> int:
        return max((c.stored_count for c in self.owned), default=0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.distinct())

    @property
    def disk_nbytes(self) -> int:
        """The part of `nbytes` held in memory-mapped files (breakdown keys ending in "_disk")."""
        return sum(v for k, v in self.nbytes_breakdown().items() if k.endswith("_disk"))

    def nbytes_breakdown(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.distinct():
            parts = c.nbytes_breakdown() if isinstance(c, LayerCache) else {"model-owned": c.nbytes}
            for k, v in parts.items():
                total[k] = total.get(k, 0) + v
        return total

    # ----- whole-cache operations -----------------------------------------------------------
    def evict_middle_if_needed(self) -> int:
        """Trim every layer to exactly its policy between model calls (a call of several tokens
        leaves a window's layers `window - 1 + L`, plan.py); returns tokens dropped per layer."""
        return max((c.evict_middle_if_needed() for c in self._owned), default=0)

    def is_trimmable(self) -> bool:
        """Whether `trim` can roll any number of tokens back (plain full caches, ours or the
        model's own): mlx-lm's protocol."""
        return all(c.is_trimmable() for c in self.distinct())

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can forget in every layer (`LayerCache.trimmable`;
        a model-owned layer: all of them if it is trimmable, else none)."""
        return min((c.trimmable() if isinstance(c, LayerCache)
                    else (c.offset if c.is_trimmable() else 0) for c in self.distinct()), default=0)

    def trim(self, n: int) -> int:
        """Forget the newest `n` tokens of every layer, at most `trimmable()`; returns how many
        were forgotten."""
        n = min(n, self.trimmable())
        if n <= 0:
            return 0
        return max((c.trim(n) for c in self.distinct()), default=0)

    def checkpoint(self) -> Optional["Checkpoint"]:
        """The whole cache's state now (`LayerCache.checkpoint`), or None where a layer is the
        model's own (its cache cannot be checkpointed here)."""
        if len(self._owned) != len(self.distinct()):
            return None
        return Checkpoint(self.current_length, [c.checkpoint() for c in self._owned])

    def restore(self, cp: "Checkpoint") -> None:
        """Back to checkpoint `cp` (taken on this cache; later checkpoints are no longer valid)."""
        for c, layer in zip(self._owned, cp.layers):
            c.restore(layer)

    def set_truth(self, positions: Optional[list[int]]) -> None:
        """Tell the retrieval telemetry the absolute positions of a ground-truth needle."""
        for c in self.owned:
            if c.telemetry is not None:
                c.telemetry.truth = positions

    def reset_telemetry(self) -> None:
        for c in self.owned:
            if c.telemetry is not None:
                c.telemetry.reset()

    def retrieval_report(self, last_steps: Optional[int] = None) -> dict:
        """Retrieval telemetry summed over layers (telemetry.summarise)."""
        return summarise([c.telemetry for c in self.owned if c.telemetry is not None], last_steps)

    def close(self) -> None:
        """Release every layer's stores now (disk stores' files removed). Idempotent."""
        for c in self.owned:
            c.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
