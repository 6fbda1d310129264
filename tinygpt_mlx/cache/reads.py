"""How a layer cache's stores are read: `LayerReads`, the reading half of `LayerCache` (layer.py).

`LayerCache` writes (one `Plan` per model call, applied by `commit`); this half reads what the
stores hold: the mask and key positions the next call's queries see, where slot 0 sits in the
query's RoPE frame, the segments attention reads (or one dense copy of them, `fetch`, the
reference path), `attend`, which picks the kernel (the fused dense one over `fetch()` for exact
stores and a KIVI prefill chunk, the segments' own, segments.attend, for packed blocks, and
retrieval's, retrieved.py, once the cold store holds tokens), and the stores' bytes.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .mask import key_positions
from .plan import Plan
from .retrieved import attend_retrieving
from .segments import Reading, attend
from .store import join, no_tokens


class LayerReads:
    """The reading half of `LayerCache` (module doc); it reads the layer's stores
    (`sink_store`, `body`, `cold`), its `positions`, `seen`, `dtype` and `config`."""

    #: tells `attention.scaled_dot_product_attention` to call `attend` (module doc there)
    reads_own_segments = True

    #: a chunk of at least this many queries over a KIVI body attends over it dequantised
    DENSE_PREFILL = 16

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
        return join(parts) if parts else no_tokens(self.dtype or mx.float32)

    def segments(self) -> list:
        """What attention reads, in key-position order matching `make_mask`'s columns."""
        sink, body = self.readings()
        return self.sink_store.segments(sink) + self.body.segments(body)

    def _dense_prefill(self, L: int) -> bool:
        """Whether a chunk of `L` queries over packed blocks runs the fused dense kernel over
        the body dequantised once (`fetch()`): a prefill chunk's attention costs L times the
        body, its dequantisation once, so the dense kernel (BLAS here, MLX's on Metal) wins
        where many queries share the keys; decode steps score the packed codes directly. Not
        with exact top-k (it refines the packed scores) nor retrieval (no dense reference)."""
        return (L >= self.DENSE_PREFILL and not self.config.retrieval and self.config.quantised
                and not self.config.exact_topk)

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention of `queries` [B, Hq, L, D] over what this layer holds. Exact stores (and a
        KIVI prefill chunk, `_dense_prefill`): the fused dense kernel over `fetch()`. Packed or
        retrieved data: retrieved cold tokens (if any), the sink and the body, one softmax over
        every segment's scores (segments.attend)."""
        if not self.needs_query or self._dense_prefill(queries.shape[2]):
            keys, values = self.fetch()
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
