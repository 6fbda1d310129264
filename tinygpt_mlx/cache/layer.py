"""`LayerCache`: one layer's KV cache, as a sequence of stores (kv_cache.py's module doc).

The sink (exact), the body (exact, or KIVI-packed blocks) and, for retrieval, a cold store that
receives what the body evicts; one `Plan` per model call (plan.py) says what the call's tokens
evict, where they go and what they attend to, and `commit` applies it. A full StreamingLLM
cache on a ring is a `RingLayer` (ring.py). It implements mlx-lm's per-layer cache protocol
(`offset`, `update_and_fetch`, `make_mask`, `state`, `trim`), so mlx-lm's model code runs on it.

The layer also reads what its stores hold: the mask and key positions the next call's queries
see, where slot 0 sits in the query's RoPE frame, the segments attention reads (or one dense
copy of them, `fetch`, the reference path), `attend`, which picks the kernel (the fused dense
one over `fetch()` for exact stores and a KIVI prefill chunk, the segments' own,
segments.attend, for packed blocks, and retrieval's, retrieved.py, once the cold store holds
tokens), and the stores' bytes. (Until issue #54 that half was a base class of its own,
`LayerReads` in reads.py, split off only to keep each class under 200 lines: it held no state,
read every field of this class and called its `plan`, so it is back here.)
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter
from typing import Any, Optional

import mlx.core as mx

from ..config import CacheConfig
from .mask import Masks, key_positions
from .plan import Plan
from .positions import Positions
from .retrieved import attend_retrieving
from .segments import Reading, attend
from .store import DenseStore, Evictable, join, no_tokens
from .telemetry import RetrievalTelemetry


class LayerCache:
    """One layer's cache (mlx-lm's per-layer protocol: `offset`, `update_and_fetch`,
    `make_mask`, `state`, `trim`), over the stores `[sink, body, cold]`: what the next call
    does to them (plan, commit, eviction, trimming, counters) and how they are read (the mask,
    the segments, `attend`, `fetch`, the bytes: module doc).

    `offset` is the RoPE position the next token gets: tokens seen (`current_length`) in
    absolute mode, its cache slot in shifted mode, its position minus the base in frame mode
    (a ring, KIVI under StreamingLLM, a retrieval hot window: it drops by the base's growth at
    a re-base).
    """

    #: tells `attention.scaled_dot_product_attention` to call `attend` (module doc there)
    reads_own_segments = True

    #: a chunk of at least this many queries over a KIVI body attends over it dequantised
    DENSE_PREFILL = 16

    def __init__(self, config: CacheConfig, positions: Positions, sink: Optional[DenseStore], body: Evictable,
                 cold: Any):
        """`cold`: retrieval's cold store (cold.py); without retrieval, `Forgets` (store.py)."""
        self.config = config
        self.positions = positions
        self.sink_store = sink   # None in a `RingLayer`: the ring holds the sink too (ring.py)
        self.body = body
        self.cold = cold
        self.telemetry = RetrievalTelemetry() if config.retrieval else None
        #: how many body tokens a call may keep (the window, retrieval's hot window, None: all),
        #: decided here once (`_make_plan` runs per call)
        self._limit: Optional[int] = config.window if config.streaming else config.hot_budget
        self.seen = 0          # tokens ever appended (monotonic)
        self.start = 0         # position of the oldest token in the body
        self.dtype: Optional[mx.Dtype] = None  # compute dtype, taken from the model's keys
        self.masks = Masks(config)   # make_mask's, with the decode steps' masks kept by shape
        #: the next call's plan once worked out (`plan`): the model asks for it up to three times
        #: per call (offset, make_mask, update_and_fetch); every change of the layer forgets it
        self._planned: Optional[Plan] = None
        #: a compiled retrieval step's placed sink, by what it was placed for (`retrieval_sink`)
        self.sink_rows: Optional[tuple] = None
        #: a sliding-window layer's own window (factory.sliding_layer: Gemma 2/3's local layers,
        #: an exact ring whatever the policy), None for a global layer (the policy's cache)
        self.sliding: Optional[int] = None
        #: the compiled decode step that can run this layer (cache/compiled.py), decided here once:
        #: "kivi" for KIVI under StreamingLLM on frame positions or a full KIVI cache on absolute
        #: positions (their quiet steps), "ring" for a ring (ring.py), "retrieval" for retrieval
        #: over an exact hot window on frame positions or at original positions (absolute: keys
        #: as the model rotated them, nothing placed or turned) with its cold store in RAM, exact
        #: rows and no RAM budget (its steady steps), None for every other policy (its steps run eager)
        kivi = config.quantised and not config.exact_topk and not config.retrieval
        self.compiles: Optional[str] = ("kivi" if kivi and (positions.frame if config.streaming else not positions.shifted)
                                        else
                                        "retrieval" if (config.retrieval and (positions.frame or not positions.shifted)
                                                        and not config.quantised
                                                        and config.cold_store == "ram" and config.cold_bits is None
                                                        and config.cold_ram is None
                                                        and not config.retrieves_per_query) else None)

    # ----- policy ---------------------------------------------------------------------------
    @property
    def n_sink(self) -> int:
        """Sink tokens held."""
        return len(self.sink_store)

    def _window_len(self) -> int:
        """Tokens held after the sink (the window, or KIVI's body, or the hot window)."""
        return len(self.body)

    def _drop_to(self, pending: bool) -> int:
        """Body tokens to evict so that the next call's tokens each see exactly `window` (with
        `pending`: keep `window - 1`), or, between calls, so that exactly `window` are held
        (retrieval: the hot window `hot_budget` plays the window's part, also during prefill)."""
        limit = self._limit
        if limit is None:
            return 0
        limit -= 1 if pending else 0
        held = self._window_len()
        return self.body.droppable(held - limit) if held > limit else 0

    def plan(self) -> Plan:
        """What the next model call (of any length) does to this layer (plan.py), worked out once
        between changes of the layer (`_planned`)."""
        if self._planned is None:
            self._planned = self._make_plan()
        return self._planned

    def _make_plan(self) -> Plan:
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
        return len(self.cold) + drop if self.config.retrieval else 0

    def commit(self, plan: Plan, keys: Optional[mx.array], values: Optional[mx.array],
               written: Optional[tuple] = None) -> None:
        """Apply `plan` with the new tokens [B, H, L, D]: re-base, evict, append. `written`
        instead of keys and values: a compiled decode step's one token (compiled.py), already
        written by the trace into the body's buffers, which go to the body's `took` (with what
        else it needs to know of them) in place of the append."""
        self._planned = None
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

    def evict_ahead(self, plan: Plan) -> Plan:
        """Apply `plan`'s eviction now, eagerly (a compiled retrieval step whose eviction
        completes a page: the trace does not make page summaries, compiled.py); returns the plan
        left to commit, with nothing to evict."""
        self._evict(plan.drop)
        return replace(plan, drop=0)

    def took_step(self, plan: Plan, written: tuple, evicted: Optional[tuple]) -> None:
        """A compiled retrieval step's `commit` of `plan` (compiled.py; no re-base, the layer has
        seen tokens): the trace evicted the plan's one token into the cold store (`evicted`:
        what the cold store's `took` takes but the position; None where `evict_ahead` did it)
        and wrote the new token into the body's buffers (`written`)."""
        self._planned = None
        if evicted is not None:
            self.body.forget_front(plan.drop)
            self.cold.took(*evicted, self.start)
            self.start += plan.drop
        self.body.took(*written)
        self.seen += 1

    def _append(self, keys: mx.array, values: mx.array, n_sink: int) -> None:
        """The new tokens into the stores, the first `n_sink` of them into the sink."""
        stored = keys
        if self.positions.pre_rope:
            stored = self.positions.unrotate(keys, self.stored_count + self.positions.gap(len(self.cold)))
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
        self._planned = None
        k, v = self.body.drop_front(n)
        if self.config.retrieval and self.positions.frame:   # the cold store keeps keys before RoPE
            k = self.positions.unrotate(k.astype(mx.float32), self.start - self.positions.base)
        self.cold.append(k, v, self.start)   # (a layer without retrieval: `Forgets`)
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
        self._planned = None
        positions = self.cold.positions.view()
        self.cold.append(keys, values, int(positions[-1]) + 1 if len(positions) else self.start)
        if self.positions.frame:
            self.positions.base += n
        self.start += n
        self.seen += n

    # ----- one decode step undone (spill_stage.py: a staged step that missed) ----------------
    def undoable(self) -> bool:
        """Whether `step_mark` / `step_undo` can take back the next decode step: exact sink and
        hot window (dense stores), no re-base due, no telemetry recording, stages not timed."""
        return (type(self) is LayerCache and self.body.steps_undoable
                and self.sink_store.steps_undoable and not self.plan().rebase
                and not (self.telemetry is not None and self.telemetry.on)
                and not (self.cold is not None and self.cold.stages.enabled))

    def step_mark(self) -> tuple:
        """The state the next decode step changes (`undoable` ones): the counters, the sink's and
        the hot window's extents and the cold store's mark (its rows, unfinished page, sticky pages)."""
        return self.seen, self.start, self.sink_store.step_mark(), self.body.step_mark(), self.cold.mark()

    def step_undo(self, mark: tuple) -> None:
        """Back to `step_mark`'s state: the cache as if the step had not run."""
        self.seen, self.start, sink, body, cold = mark
        self.sink_store.step_undo(sink)
        self.body.step_undo(body)
        self.cold.rewind(cold)
        self._planned = None

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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new tokens [B, H, L, D] (`commit` of this call's `plan`) and return them as
        given, whatever the policy: attention reads the stored tokens itself (`attend`), and
        `fetch()` assembles them dense for the reference path."""
        self.commit(self.plan(), keys, values)
        return keys, values

    def full_body(self) -> bool:
        """Whether the body only grows (no window, no hot window: nothing evicted or re-based)."""
        return not self.config.streaming and not self.config.retrieval

    def is_trimmable(self) -> bool:
        """mlx-lm's protocol: whether `trim` can roll back any number of tokens (plain full
        caches). `trimmable()` says how far every policy can."""
        return self.full_body() and not self.config.quantised

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can forget, leaving what a cache fed only the
        rest would hold: every body token of a plain full cache; a full KIVI cache's exact
        residual (frozen blocks cannot be cut back token by token); nothing for a window, a
        hot window or a cache holding a cold store (what they evicted is gone or moved; a
        checkpoint restores them, `checkpoint`)."""
        if not self.full_body():
            return 0
        if self.config.quantised:
            return len(self.body.residual)
        return len(self.body)

    def trim(self, n: int) -> int:
        """Forget the newest `n` tokens, at most `trimmable()`; returns how many were forgotten."""
        n = min(n, self.trimmable())
        if n <= 0:
            return 0
        self._planned = None
        self.body.truncate(len(self.body) - n)
        self.seen -= n
        return n

    # ----- state (checkpoint.py, persist.py) --------------------------------------------------
    def counters(self) -> dict:
        """The layer's own counters (beside its stores' state): what checkpoints and files keep."""
        return {"seen": self.seen, "start": self.start, "base": self.positions.base, "dtype": self.dtype}

    def set_counters(self, seen: int, start: int, base: int, dtype: Optional[mx.Dtype]) -> None:
        """Counters back to `counters()`'s (the stores refilled beside): what was read off the old
        state (the kept decode masks, the retrieval telemetry) is forgotten."""
        self.seen, self.start, self.positions.base, self.dtype = seen, start, base, dtype
        self._planned = None
        self.masks.clear()
        if self.telemetry is not None:
            self.telemetry.reset()

    def close(self) -> None:
        """Release every store (a disk store's files are removed)."""
        self._planned = None
        for store in self.stores().values():
            store.close()

    def stores(self) -> dict:
        """The stores by name (as prompt-cache files and checkpoints call them)."""
        return {"sink": self.sink_store, "body": self.body, **({"cold": self.cold} if self.config.retrieval else {})}


    # ----- reading the stores ---------------------------------------------------------------
    @property
    def needs_query(self) -> bool:
        """Whether attention must run inside the cache (packed keys, retrieval)."""
        return self.config.quantised or self.config.retrieval

    def _body_slot(self) -> int:
        return self.positions.body_slot(self.n_sink, len(self.cold))

    def readings(self) -> tuple[Reading, Reading]:
        """How the sink and the body are read now (compute dtype, positions, first slot)."""
        slot0 = self.slot0()
        return (Reading(self.dtype, self.positions, slot0), Reading(self.dtype, self.positions, slot0 + self._body_slot()))

    def sink_slot_during(self, plan: Plan, L: int = 1) -> int:
        """Frame mode: where sink slot 0 sits in the query's frame while a call of `L` tokens
        planned as `plan` attends (after its commit)."""
        return self.positions.frame_slot0(self.seen + L, plan.stored + L, self._cold_after(plan.drop)) - plan.rebase

    def slot0(self) -> int:
        """Where slot 0 sits in the query's RoPE frame: 0, or in frame mode its frame position."""
        return self._sink_slot0() if self.positions.frame else 0

    def _sink_slot0(self) -> int:
        """Frame mode (a ring, a KIVI body under StreamingLLM, a retrieval hot window): the
        sink's slot 0 in the query's frame (read only in shifted mode)."""
        return self.positions.frame_slot0(self.seen, self.stored_count, len(self.cold))

    def placed_sink(self) -> tuple[mx.array, mx.array]:
        """The sink's keys placed at their slots in the query's frame and its values, in fp32, as
        a decode step's attention reads them (a compiled quiet step's input, compiled.py)."""
        slot0, sink = self.slot0(), self.sink_store
        key = (id(sink), sink.version, slot0, self.dtype)
        held = getattr(self, "_placed_sink", None)    # kept until the sink or its slot changes
        if held is None or held[0] != key:
            k, v = sink.fetch(self.dtype)
            reading = Reading(self.dtype, self.positions, slot0)
            held = (key, (sink.placed(k, reading).astype(mx.float32), v.astype(mx.float32)))
            self._placed_sink = held
        return held[1]

    def retrieval_sink(self, slot: int) -> tuple:
        """The sink's keys placed where retrieval's turned query sees them (at `-slot`,
        retrieved.py) and its values, in fp32, or () without a sink: a compiled retrieval step's
        input (compiled.py), kept until the sink, the slot or the dtype changes."""
        key = (slot, self.sink_store.version, self.dtype)
        if self.sink_rows is None or self.sink_rows[0] != key:
            segments = self.sink_store.segments(Reading(self.dtype, self.positions, -slot))
            self.sink_rows = (key, (segments[0].keys, segments[0].values) if segments else ())
        return self.sink_rows[1]

    def fetch(self, exact: bool = False) -> tuple[mx.array, mx.array]:
        """All stored K/V, dense, in the compute dtype, keys rotated to their RoPE position:
        the reference path (packed blocks dequantised; attention tests compare against it).
        `exact`: a KIVI body with an exact top-k shadow hands on the shadow's exact rows."""
        parts = []
        sink, body = self.readings()
        for store, reading, placed in ((self.sink_store, sink, self.positions.shifted),
                                       (self.body, body, self.positions.pre_rope)):
            if len(store):
                k, v = store.fetch(self.dtype, exact=True) if exact and store is self.body else store.fetch(self.dtype)
                parts.append((self.positions.place(k, reading.first_slot) if placed else k, v))
        return join(parts) if parts else no_tokens(self.dtype or mx.float32)

    def segments(self) -> list:
        """What attention reads, in key-position order matching `make_mask`'s columns."""
        sink, body = self.readings()
        return self.sink_store.segments(sink) + self.body.segments(body)

    def _dense_prefill(self, L: int) -> bool:
        """Whether a chunk of `L` queries over packed blocks runs the fused dense kernel over
        the body dequantised once (`fetch()`): a prefill chunk's attention costs L times the
        body, its dequantisation once, so the dense kernel (BLAS here, MLX's on Metal) wins
        where many queries share the keys; decode steps score the packed codes directly. With
        exact top-k the chunk reads the shadow's exact rows instead (`fetch(exact=True)`): exact
        attention, as KIVI's prefill runs at full precision, where refining each of L queries'
        top k gathered L * k rows per query head (x0.37 of plain int4's prefill at 16K on Gemma 3,
        session 48). Not with retrieval (no dense reference)."""
        return L >= self.DENSE_PREFILL and not self.config.retrieval and self.config.quantised

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention of `queries` [B, Hq, L, D] over what this layer holds. Exact stores (and a
        KIVI prefill chunk, `_dense_prefill`): the fused dense kernel over `fetch()`. Packed or
        retrieved data: retrieved cold tokens (if any), the sink and the body, one softmax over
        every segment's scores (segments.attend)."""
        if not self.needs_query or self._dense_prefill(queries.shape[2]):
            keys, values = self.fetch(exact=bool(self.config.exact_topk))
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        if not len(self.cold):
            return attend((mask is None and self._led_segments()) or self.segments(), 0, queries, scale, mask)
        return attend_retrieving(self, queries, scale, mask)

    def _led_segments(self) -> Optional[list]:
        """A full KIVI cache's segments with its exact first tokens read with the residual, in
        one segment (kivi.KiviStore.segments_led), for queries that see every stored token; None
        where that does not apply."""
        if not (self.config.exact_prefix and len(self.sink_store)) or self.positions.shifted:
            return None
        return self.body.segments_led(self.readings()[1], self.sink_store)

    def key_positions(self, pending: int = 0) -> mx.array:
        """Absolute positions of the stored tokens (after the next call's `pending` tokens)."""
        return key_positions(self.n_sink, self.plan().first if pending else self.start, self.seen + pending)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask for the next `N` tokens (mlx-lm calls this before the update):
        None or "causal" where every query sees every earlier stored key, else a boolean
        [N, stored] array over absolute positions (mask.py)."""
        plan = self.plan()
        return self.masks.make(N, plan, self.n_sink, self.seen, self._window_len() > plan.drop, return_array,
                               window_size)

    def size(self) -> int:
        return self.stored_count

    def empty(self) -> bool:
        return self.seen == 0

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def nbytes_breakdown(self) -> dict[str, int]:
        out = dict(self.sink_store.nbytes_breakdown())
        out.update(self.body.nbytes_breakdown())
        out.update(self.cold.nbytes_breakdown())
        return out

    @property
    def state(self):
        if self.stored_count == 0:
            return []
        return self.fetch()

    @state.setter
    def state(self, v):
        raise NotImplementedError("restoring a posttrainllm cache from state is not supported")


class FullLayer(LayerCache):
    """A full exact layer (no window, no hot window, no KIVI): its body only grows, and nothing is
    ever evicted, re-based, placed or held in a sink, so its plan is fixed (the next token at
    position `seen`, `plan`) and decided here once rather than worked out per call. Its
    `update_and_fetch` returns every stored token, as mlx-lm's `KVCache` does, and attention
    runs mlx-lm's (the fused kernel) over them (`reads_own_segments` False: attention.py); `attend`
    (a batched step calls it per sequence) reads the same tokens."""

    reads_own_segments = False

    def plan(self) -> Plan:
        return Plan(0, 0, self.start, len(self.body), self.seen)

    #: `seen` (the next token's position), read twice per layer and step by the model: a C getter
    offset = property(attrgetter("seen"), doc="The next token's position: `seen`.")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """`commit` of the fixed plan (an append), then every stored token in the compute dtype."""
        if self.dtype is None:
            self.dtype = keys.dtype
        self.seen += keys.shape[2]
        return self.body.append_fetch(keys, values, self.dtype)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """Every query sees every earlier stored key: None for one query, else "causal" (an
        array where asked, or under a model's sliding window: `Masks.make`)."""
        if window_size is None and (N == 1 or not return_array):
            return None if N == 1 else "causal"
        return super().make_mask(N, return_array, window_size)
