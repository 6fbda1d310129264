"""One decode step over several sequences, each with its own cache: the batched forward.

The server's scheduler (worker.py) runs every active request's next token through one model
call: the embedding, the projections, RoPE, the MLP and the head run once over a batch of B
rows, and attention runs per sequence over that sequence's own cache, whatever its policy
(full, StreamingLLM, KIVI, retrieval and their compositions: each `LayerCache` keeps its own
plan, eviction, positions and kernels). The model code is unchanged: it sees, for each layer,
a `BatchLayer` that speaks the per-layer cache protocol (`offset`, `make_mask`,
`update_and_fetch`, `attend`) for all B sequences at once:

- `offset` is an array of B positions, which `mx.fast.rope` takes per row (each sequence
  rotates its query and key at its own position, as it would alone);
- `make_mask` (the models ask the first layer once per call) takes each sequence's own mask and
  hands the model a `PerSequence` holding them, which the model passes on unopened;
- `update_and_fetch` hands each sequence its row of the new keys and values (its own `commit`);
- `attend` (through `attention.scaled_dot_product_attention`, which calls it for any cache that
  `reads_own_segments`) runs each sequence's own attention on its row of the queries, with its
  own mask, and stacks the B outputs.

So each row's attention is exactly the computation the sequence runs alone (the eager path,
which agrees with the compiled decode step to the last bit: tests/test_compiled.py); only the
projections see B rows where they saw one. Only caches of ours batch (`batchable`): a layer
with a model-owned cache keeps the solo path.

Attention across sequences (`dense=True`, the default): the sequences whose layer holds its
tokens dense and needs no mask for its one query (a full exact layer, `FullLayer`, and a
StreamingLLM ring, `RingLayer`) attend in **one** fused call over their K/V stacked to
[B', H, Lmax, D]: each sequence's buffer as it lies, read up to the longest one's length (a
view where its buffer has the room: a full layer's buffer grows in 256-token steps, a ring's is
sink + window; zeros appended where it has not), with a boolean mask [B', 1, 1, Lmax] hiding
each shorter row's padding (none when every row is as long). The padded keys score -inf and
add exact zeros, so the row is its solo attention over the same keys; the sums run over a
longer row, so the last bits may differ from the per-sequence call (the tests hold the two to
1e-5 and the greedy tokens equal). Only caches up to `STACK_TOKENS` stack (the stacking copies
every row). The other layers (KIVI's packed blocks outside its compiled quiet steps, retrieval outside
its compiled step, a step that needs a mask) keep the per-sequence call. `dense=False` is the per-sequence path for every layer (the tests'
reference).

The compiled batched step (`compiled_decode`, tried first): where every sequence's cache is a
full exact one with room for the token in its buffers, or a StreamingLLM ring in its steady
state (the compiled solo step's condition, cache/compiled.py) or still filling its window (laid
out as a ring, its sink full: the solo step runs these eager), or a retrieval cache whose hot
window is still filling (nothing cold yet: `_hot_row`, its sink placed outside the trace), the
whole step, embedding,
projections, RoPE, the B cache writes (at array positions), attention and MLP, is traced by
`mx.compile` once per layout (the rows' buffer sizes) and replayed: a full row, and a filling
ring's, attends over its whole buffer with the unwritten slots masked, a steady ring row over its
buffer as it lies; rows whose buffers share a shape attend in one fused call over the buffers
concatenated, each row's mask stacked. MLX fuses
the element-wise work and Python builds no graph per step. A layout's trace is reused until a
row's buffer grows (every 256 tokens of a full cache); the newest `KEEP_TRACES` are kept, and
apart from them the layouts whose trace failed (each runs eager from then on, logged once).

KIVI in the batch (`_compiled_kivi`): where every sequence's KIVI cache (full, or under
StreamingLLM on frame positions) is at a quiet step, the compiled solo step's condition
(cache/compiled.py `_kivi_ready`: no block frozen or evicted after the token, no residual
buffer grown, no re-base), the B rows' step is one compiled function too: each row's layer is
the solo quiet step's traced layer (`_TracedKivi`: its sink, packed run, near tier and residual
buffers, its new token written at its own slot), and the rows attend as one (`_KiviStacked`:
their segments stacked along the rows, each padded with zeros to the longest row's, one mask
[B, 1, 1, slots] showing each row its own slots, built from arrays) up to `STACK_TOKENS`, each
on its own past it (`_KiviRows`). MLX traces the function again for each new set of the rows'
shapes (a row's packed run grows by a block every G tokens); every compiled batched step holds
at most `KEEP_SHAPES` traces, then is made anew (`_Compiled`). A full cache's row whose step
would freeze a block or outgrow its buffers has that done ahead, before the step
(`KiviStore.ready_next`: the same blocks frozen, the same buffers, as after its eager step), once
every row is found able to step so; its step is then a quiet one, compiled where the step's
function has traced its shapes, else eager (`KIVI_AHEAD_TRACES`: a trace costs more than the
eager step; the eager step then freezes nothing more); rows that attend stacked have their packed
runs joined along the rows, each padded to the longest row's, before the step (`_joined_runs`, the
joined runs kept between steps while no row's run changes), so their shapes change only when the
longest run grows, and their ahead steps trace. Stacked rows' residual buffers are the batch's:
the step takes them joined along the rows and writes each row's token at its own slot; each row's
residual then holds a view of its row (its values, no copy), and the next step reads the joined
buffers as they lie where no row's buffers changed since (`_joined_buffers`: else it joins them
anew), so a quiet step copies no row's arrays to join them; a row that leaves gets its own copy
(`_release_joint`). A full cache's row with no
block frozen yet (its first R + G or so tokens) steps compiled too, attending over its exact
tokens in the eager step's exact form (`_TracedKivi._attend_exact`: the same bits), stacked only
with rows like it. Under StreamingLLM a row steps compiled while its window fills too (nothing
evicted yet: its packed run grows as a full cache's, padded to the longest row's where the rows
stack; before its first block froze, while the window shows every token it holds, in the exact
form: session 46; before, such rows ran the whole batch eager, 65% of four 256-token streams'
steps from short prompts under a 128-token window). Under StreamingLLM a step where any row
freezes or evicts a block runs eager for all (about one step in G per row).

Retrieval in the batch (`_compiled_retrieval`): where every sequence's retrieval cache is in
the steady state of the compiled solo step (cache/compiled_retrieval.py: hot window full, cold
store on the device, exact rows), the B rows' whole step is one compiled function too. Each
row's writes stay its own (the hot window's oldest token turned back and written into its cold
store, the new token into its hot window, at its own slots); the queries and leaving keys turn
in one RoPE call (made once per step and group, shared by the layers), and the model's own RoPE
turns each row's query and key by a product with its position's matrix (cache/rope_products.py, as the
solo step's: one RoPE call per step for all rows' matrices); the selection (`select_rows`: the coarse pass over the page summaries, the
pool's union with the unfinished and sticky pages, the fine pick) runs **once over the rows
stacked** (their summaries, counts and sticky pages stacked along the rows, each row gathering
its pool's keys and values from its own store: no copy of the cold stores), and so does the one
softmax over the picked tokens, the placed sinks and the hot windows. Rows stack where they
share the selection's layout (`Static`, the summaries' widths scanned); rows of another layout
form a group of their own in the same call. The code is the solo step's own
(compiled_retrieval.py `attend_rows`, in its per-row form; each row's layer its `_TracedRetrieval`,
`_RetrievalRows`). Every row's ops are the solo chain's on that row:
the tests hold each row's picks and tokens scored equal to its solo step's, its logits within
1e-5. A step that completes a page in a row evicts it eagerly first, as the solo step does, and
so does a row's first eviction into its empty cold store, the growth of its full cold rows and the
move of its hot window's live tokens to new buffers (`ready_ahead`: the solo step runs those steps
eager; here the batch steps compiled, the row within 1e-5 of its solo step's logits); the
rows are traced in an order sorted by layout, so four rows at their own phases make few traces.
Beside sliding-window rings (Gemma 3's local layers, exact rings of the model's window), the
rows' rings step in the same trace, as the solo retrieval step steps them
(cache/compiled_retrieval.py `rings_ready`, each row checked so): each row its own ring buffers,
write slot and RoPE position (the rings re-base apart from the global layers at original
positions), rings of one window attending as one (`_SlidingRows`); a step where any row's rings
are not steady (a re-base) runs eager for all.

Where the time of a small model's batched step goes on this CPU (docs/server.md, "Several
requests at once"): the B rows' matrix products cost about B times one row's (OpenBLAS's small
products gain nothing from more rows), so what batching saves is the per-operation overhead the
rows share; the two paths above shave some more of it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..cache import KVCache, rope_products
from ..cache.compiled import _ATTR as _SOLO_STEPS, _TracedKivi, _kivi_ready, _quiet_mask, kivi_inputs, kivi_layout, shape_key
from ..cache.compiled_retrieval import (_TracedRetrieval, attend_rows, commit, layer_specs, ready_ahead, rings_ready,
                                          steady, step_inputs)
from ..cache.layer import FullLayer, LayerCache
from ..cache.ring import RingLayer
from ..cache.segments import Reading


#: how the batched steps ran, for the tests and /api/slots: "compiled" steps (`compiled_decode`;
#: "compiled_ring_filling" those with a ring still filling its window, "compiled_hot_filling"
#: retrieval caches filling their hot windows), layer calls whose rows
#: attended "stacked" (one fused call) and rows attending "per_sequence"
taken: Counter = Counter()


class PerSequence:
    """The masks of a batched call, one per sequence (None where that sequence needs none)."""

    def __init__(self, masks: list):
        self.masks = masks


#: the longest cache whose K/V a batched step stacks with the others (a copy of every row per
#: layer and step, which pays for short caches, where a step is mostly per-operation overhead,
#: and would double the K/V read of long ones); past it each sequence attends on its own
STACK_TOKENS = 1024


class BatchLayer:
    """One model layer's caches of B sequences behind the per-layer protocol (module doc)."""

    reads_own_segments = True     # attention.scaled_dot_product_attention calls `attend`

    def __init__(self, caches: Sequence[LayerCache], dense: bool = True, masks: Optional[dict] = None):
        self.caches = list(caches)
        self.dense = dense
        #: the padding masks of this step by (Lmax, lengths), shared by the step's layers
        self.padding = {} if masks is None else masks

    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches], dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> PerSequence:
        return PerSequence([c.make_mask(N, return_array=return_array, window_size=window_size)
                            for c in self.caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        for i, c in enumerate(self.caches):
            c.update_and_fetch(keys[i:i + 1], values[i:i + 1])
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        masks = mask.masks if isinstance(mask, PerSequence) else [mask] * len(self.caches)
        stacked = [dense_kv(c, m) if self.dense and queries.shape[2] == 1 else None
                   for c, m in zip(self.caches, masks)]
        rows = [i for i, kv in enumerate(stacked) if kv is not None]
        if rows and max(stacked[i][2] for i in rows) > STACK_TOKENS:
            rows = []                      # long caches: the copy would cost more than it saves
        if len(rows) < 2:                  # nothing to share: each sequence's own attention
            taken["per_sequence"] += len(self.caches)
            outs = [c.attend(queries[i:i + 1], scale, m) for i, (c, m) in enumerate(zip(self.caches, masks))]
            return mx.concatenate(outs, axis=0)
        taken["stacked"] += 1
        taken["per_sequence"] += len(self.caches) - len(rows)
        shared = self._attend_stacked(queries, scale, rows, [stacked[i] for i in rows])
        if len(rows) == len(self.caches):
            return shared
        outs, j = [], 0
        for i, (c, m) in enumerate(zip(self.caches, masks)):
            if stacked[i] is not None:
                outs.append(shared[j:j + 1])
                j += 1
            else:
                outs.append(c.attend(queries[i:i + 1], scale, m))
        return mx.concatenate(outs, axis=0)

    def _attend_stacked(self, queries: mx.array, scale: float, rows: list[int], kvs: list[tuple]) -> mx.array:
        """One fused attention call for the sequences `rows`, their K/V (`dense_kv`) padded to
        the longest and stacked, a boolean mask hiding the padding (module doc)."""
        lengths = tuple(n for _, _, n, _ in kvs)
        L = max(lengths)
        ks, vs = [], []
        for k, v, n, _ in kvs:
            if k.shape[2] >= L:
                k, v = k[..., :L, :], v[..., :L, :]
            else:
                pad = L - k.shape[2]
                k = mx.concatenate([k, mx.zeros((*k.shape[:2], pad, k.shape[3]), k.dtype)], axis=2)
                v = mx.concatenate([v, mx.zeros((*v.shape[:2], pad, v.shape[3]), v.dtype)], axis=2)
            ks.append(k)
            vs.append(v)
        keys, values = mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)
        dtype = kvs[0][3]
        if keys.dtype != dtype:
            keys, values = keys.astype(dtype), values.astype(dtype)
        mask = None
        if min(lengths) < L:
            key = (L, lengths)
            mask = self.padding.get(key)
            if mask is None:
                valid = np.arange(L)[None, :] < np.array(lengths)[:, None]
                mask = self.padding[key] = mx.array(valid[:, None, None, :])
        q = queries if len(rows) == queries.shape[0] else mx.concatenate([queries[i:i + 1] for i in rows], axis=0)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def dense_kv(cache: Any, mask: Any) -> Optional[tuple[mx.array, mx.array, int, mx.Dtype]]:
    """(keys, values, n, compute dtype) of a layer whose one query attends to its first `n`
    stored tokens with no mask, as one fused attention call reads them: a buffer whose first `n`
    tokens are the live ones (in any order: one query's attention does not depend on it) and
    whose rest, if any, holds finite values (zeros or older tokens); after `update_and_fetch`.
    None for any other layer (it attends on its own: module doc)."""
    if mask is not None:
        return None
    if type(cache) is FullLayer:
        body = cache.body
        if body.keys is None:
            return None
        return body.keys[..., body.head:, :], body.values[..., body.head:, :], body.n, cache.dtype
    if type(cache) is RingLayer and cache.sees_all(None):
        ring = cache.body
        if not len(ring):
            return None
        k, v = ring.attention_kv(cache._sink_slot0(), False, None)    # as it lies (sink placed)
        n = k.shape[2]
        if ring.ring and ring.ptr == ring.n < ring.window:   # not wrapped yet: the buffer's first n slots
            k, v = ring.keys, ring.values
        return k, v, n, cache.dtype
    return None


#: model types whose code is known to batch this way (their layers read only `offset`, the mask
#: and `update_and_fetch` of the cache, and attend through attention.py): the native TinyGPT,
#: mlx-lm's Llama (SmolLM2) and Gemma 3 (gemma3_text: its sliding layers' windowed mask asked of
#: the first layer, each row's from its own cache); any other runs one call per sequence, still interleaved
BATCHED_MODEL_TYPES = frozenset({"tinygpt", "llama", "gemma3_text"})


def batches(model: Any) -> bool:
    """Whether `model`'s decode steps may run batched (`BATCHED_MODEL_TYPES`)."""
    return getattr(model, "model_type", None) in BATCHED_MODEL_TYPES


def batchable(cache: Any) -> bool:
    """Whether a sequence's cache can join a batched step: a `KVCache` whose every layer is ours."""
    return isinstance(cache, KVCache) and len(cache.owned) == len(cache.distinct()) and len(cache) > 0


def batch_layers(caches: Sequence[KVCache], dense: bool = True) -> list[BatchLayer]:
    """The per-layer view of B sequences' caches: layer i's `BatchLayer` holds every sequence's
    layer-i cache; layers that share one cache (YOCO) share one `BatchLayer`, as they share
    the cache in each sequence. `dense`: attention batched across the sequences where their
    layers allow it (module doc), else per sequence."""
    first = caches[0]
    made: dict[int, BatchLayer] = {}
    masks: dict = {}
    out = []
    for i, layer in enumerate(first):
        key = id(layer)
        if key not in made:
            made[key] = BatchLayer([c[i] for c in caches], dense, masks)
        out.append(made[key])
    return out


# ----- the compiled batched step -------------------------------------------------------------
class _TracedFull:
    """One sequence's full exact layer during the trace of a batched step: its buffers (capacity
    C), the new token written at `slot` (an array), one query over the buffer's first `slot + 1`
    tokens (a mask over the rest, which hold zeros or older tokens: finite). `span`: the query
    reads only the buffer's first `span` slots (`attention_span`: every row's `slot + 1` at most),
    not all C; None: all C (the step as it ran before 2026-12-06)."""

    def __init__(self, keys: mx.array, values: mx.array, slot: mx.array, compute_dtype: mx.Dtype,
                 span: Optional[int] = None):
        self.keys, self.values, self.slot, self.compute_dtype = keys, values, slot, compute_dtype
        self.span = span

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> None:
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), self.slot, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), self.slot, axes=(2,))

    def _read(self) -> int:
        """How many of the buffer's slots the query reads: `span`, or the whole buffer."""
        size = self.keys.shape[2]
        return size if self.span is None else min(self.span, size)

    def kv(self) -> tuple[mx.array, mx.array]:
        """The buffers' first `_read()` slots in the compute dtype (after this step's write);
        `_TracedRows.attend` reads them with the row's mask (`valid`)."""
        k, v = self.keys, self.values
        n = self._read()
        if n < k.shape[2]:
            k, v = k[..., :n, :], v[..., :n, :]
        if k.dtype != self.compute_dtype:
            k, v = k.astype(self.compute_dtype), v.astype(self.compute_dtype)
        return k, v

    def valid(self) -> Optional[mx.array]:
        """The slots this row's query sees, [1, 1, 1, read slots] (None: all of them)."""
        return (mx.arange(self._read()) <= self.slot)[None, None, None, :]


class _TracedRing(_TracedFull):
    """One sequence's StreamingLLM ring during the trace: the new token written at `slot` (over
    the oldest window token in a full ring), in shifted mode the sink placed for this step's
    query (`sink_rows`), one query over the buffer as it lies (ring.py, cache/compiled.py). A
    ring still `filling` (its window not full: the live tokens are the buffer's first `slot`
    slots, the rest zeros) masks the slots past the new token, as a full cache's row does."""

    def __init__(self, keys: mx.array, values: mx.array, slot: mx.array, compute_dtype: mx.Dtype,
                 sink_rows: Optional[mx.array], filling: bool = False):
        super().__init__(keys, values, slot, compute_dtype)
        self.sink_rows, self.filling = sink_rows, filling

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> None:
        super().update_and_fetch(keys, values)
        if self.sink_rows is not None:
            self.keys[..., :self.sink_rows.shape[2], :] = self.sink_rows

    def valid(self) -> Optional[mx.array]:
        return super().valid() if self.filling else None


class _TracedHot(_TracedFull):
    """One sequence's retrieval layer during the trace while its hot window fills (nothing evicted
    yet, its cold store empty): the new token written into the hot window's buffer at `slot`, one
    query over the sink (placed where the eager step reads it: `sink`, keys and values in the
    compute dtype, or () without one) and the buffer's first `slot + 1` slots, the rest masked."""

    def __init__(self, keys: mx.array, values: mx.array, slot: mx.array, compute_dtype: mx.Dtype, sink: tuple,
                 span: Optional[int] = None):
        super().__init__(keys, values, slot, compute_dtype, span)
        self.sink = sink

    def kv(self) -> tuple[mx.array, mx.array]:
        k, v = super().kv()
        if self.sink:
            k, v = mx.concatenate([self.sink[0], k], axis=2), mx.concatenate([self.sink[1], v], axis=2)
        return k, v

    def valid(self) -> Optional[mx.array]:
        n = self.sink[0].shape[2] if self.sink else 0
        return (mx.arange(n + self._read()) <= self.slot + n)[None, None, None, :]


class _TracedRows:
    """One model layer's B sequences during the trace (the per-layer protocol, as `BatchLayer`).
    Rows whose buffers share one shape (rings of one sink + window, full caches of one capacity)
    of at most `STACK_TOKENS` slots attend as one (`stack`): their buffers concatenated along the
    rows, one fused call, each row's mask (`valid`) stacked where any row has one; else (and
    with `stack` False) each row on its own."""

    reads_own_segments = True

    def __init__(self, rows: list, offset: mx.array, stack: bool = False):
        self.rows, self.offset, self.stack = rows, offset, stack

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> None:
        if window_size is not None:
            raise ValueError("a windowed mask is not traced")
        return None     # each row masks itself (`valid`, read by `attend`)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = len(self.rows)      # (each row its own key and value: split once, not sliced row by row)
        ks, vs = (mx.split(keys, n, axis=0), mx.split(values, n, axis=0)) if n > 1 else ([keys], [values])
        for r, k, v in zip(self.rows, ks, vs):
            r.update_and_fetch(k, v)
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        rows = self.rows
        ks, vs = zip(*(r.kv() for r in rows))
        valid = [r.valid() for r in rows]
        size = ks[0].shape[2]
        if not (self.stack and len(rows) > 1 and len({(k.shape, k.dtype, v.shape) for k, v in zip(ks, vs)}) == 1
                and size <= STACK_TOKENS):      # (the copy: as the eager step's)
            return mx.concatenate([mx.fast.scaled_dot_product_attention(queries[i:i + 1], k, v, scale=scale, mask=m)
                                   for i, (k, v, m) in enumerate(zip(ks, vs, valid))], axis=0)
        mask = None
        if any(m is not None for m in valid):
            ones = mx.ones((1, 1, 1, size), mx.bool_)
            mask = mx.concatenate([ones if m is None else m for m in valid], axis=0)
        return mx.fast.scaled_dot_product_attention(queries, mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0),
                                                    scale=scale, mask=mask)


#: every trace failure in this process, (layout, error), each also logged once; the model's
#: failed layouts (`_steps`) say so (`_FAILED`) and each runs eager from then on
_failed: dict = {}
_FAILED = "failed"
log = logging.getLogger("posttrainllm.server")

#: the compiled batched steps of a model, by layout (`_compiled_step`, `_retrieval_step`), the
#: newest last, and apart from them the layouts whose trace failed (`_steps`)
_ATTR = "_posttrainllm_batched_steps"
#: layouts kept per model (a full layer's buffer grows in 256-token steps: each sequence's
#: growth is a new layout, traced once); a failed layout is not one of them: it is kept for
#: good, or it would be traced, fail and be logged again once KEEP_TRACES others came after it
KEEP_TRACES = 32
#: traces MLX made of the batched steps, by kind ("compiled", "retrieval"): the step's Python
#: body runs only while MLX traces it (a new layout, or new input shapes under one), for the tests
traced: Counter = Counter()


#: whether a KIVI step whose freeze or buffer growth was done ahead (`_compiled_kivi`) runs
#: compiled when its shapes are new to the step's function, so that MLX traces it there. False:
#: such a step runs eager (it freezes nothing more: the state its own append would have made),
#: and the next quiet step traces the shapes, as before; only one whose shapes are traced already
#: replays. Measured (a probe in commit 5927810's message; not in docs/ nor docs/results/): four
#: rows from prompts of like lengths freeze within a few steps of each other, and a trace at each
#: freeze (32-42 ms a step on the shipped model, load ~7) cost more than the eager freeze steps
#: (15-27 ms) and one trace after them. Rows that attend stacked trace such a step all the same:
#: their packed runs joined at the longest's (`_joined_runs`), only the longest row's freeze brings
#: new shapes (one trace per G steps, then the other rows' freezes replay it)
KIVI_AHEAD_TRACES = False

#: traces one compiled batched step holds before it is made anew. MLX keeps a compiled
#: function's trace of every set of input shapes it has seen while the function lives, and the
#: shapes under one layout key keep changing: a full KIVI cache's packed run grows by a block
#: every G tokens in each row (a new set of shapes, never seen again), retrieval's cold stores
#: and buffers grow; so past KEEP_SHAPES traces a step is compiled anew (the old function and
#: its traces dropped) and the traces a server holds stay at most KEEP_TRACES x KEEP_SHAPES
KEEP_SHAPES = 8


class _Compiled:
    """A compiled batched step (`mx.compile` of a layout's step function, `make`) and the traces
    it holds, counted by the `traced` counter of its `kind` (its Python body runs only while MLX
    traces it), one per set of input shapes (`seen`); made anew when a call brings a new set
    while it holds KEEP_SHAPES of them (a call whose shapes it has traced replays, even then)."""

    def __init__(self, make: Any, kind: str):
        self.make, self.kind = make, kind
        self.fn, self.traces, self.made, self.seen = make(), 0, 1, set()

    def holds(self, args: tuple) -> bool:
        """Whether a call with `args` replays a trace this function holds (no trace to make)."""
        return shape_key(args) in self.seen

    def __call__(self, *args):
        # (the shapes are read only where they decide something: reading them costs ~0.6 ms a step
        # for four rows of a 30-layer KIVI cache, so a function not yet full never pays it per step)
        if self.traces >= KEEP_SHAPES and shape_key(args) not in self.seen:
            self.fn, self.traces, self.seen = self.make(), 0, set()
            self.made += 1
        before = traced[self.kind]
        try:
            return self.fn(*args)
        finally:
            if traced[self.kind] != before:
                self.traces += traced[self.kind] - before
                self.seen.add(shape_key(args))


def trace_counts(model: Any) -> dict:
    """The compiled steps' traces in this process, for /api/slots and the load benchmark: the
    batched steps' traces made so far by kind (`traced`), the batched functions `model` holds
    and the traces they hold, the solo compiled steps (cache/compiled.py) it holds; beside them
    MLX's memory in MiB: its arrays (active), its cache of freed buffers, its peak."""
    steps = getattr(model, _ATTR, None)     # read only: `_steps` would set it, racing the worker
    held = [s[0] if isinstance(s, tuple) else s for s in list(steps[0].values())] if steps else []  # (a copy)
    held = [s for s in held if isinstance(s, _Compiled)]
    solo = list((getattr(model, _SOLO_STEPS, None) or {}).values())
    return {"batched_traces_made": dict(traced), "batched_functions_held": len(held),
            "batched_traces_held": sum(s.traces for s in held),
            "solo_functions_held": sum(1 for v in solo if callable(v)),
            "mlx_mib": {"active": round(mx.get_active_memory() / 2 ** 20, 1),
                        "cache": round(mx.get_cache_memory() / 2 ** 20, 1),
                        "peak": round(mx.get_peak_memory() / 2 ** 20, 1)}}


def _steps(model: Any) -> tuple[dict, set]:
    """The model's compiled batched steps by layout (the LRU, newest last) and its failed layouts."""
    held = getattr(model, _ATTR, None)
    if held is None:
        held = ({}, set())
        object.__setattr__(model, _ATTR, held)    # not a parameter (nn.Module's setattr would keep it)
    return held


def forget(model: Any) -> None:
    """Drop the model's compiled batched steps and its failed layouts (the tests' fresh start)."""
    if getattr(model, _ATTR, None) is not None:
        object.__setattr__(model, _ATTR, None)


def _cached(model: Any, key: tuple) -> Any:
    """The model's compiled step for `key` (now the newest), `_FAILED` where its trace failed,
    or None where there is none yet."""
    steps, failed = _steps(model)
    if key in failed:
        return _FAILED
    if key in steps:
        steps[key] = steps.pop(key)                # the newest last
        return steps[key]
    return None


def _keep(model: Any, key: tuple, fn: Any) -> Any:
    """Keep `fn`, the compiled step of `key`, as the newest; the oldest past KEEP_TRACES go."""
    steps = _steps(model)[0]
    steps[key] = fn
    while len(steps) > KEEP_TRACES:
        steps.pop(next(iter(steps)))
    return fn


def _trace_failed(model: Any, key: tuple, error: BaseException, what: str) -> None:
    """`key`'s trace failed: eager from now on for that layout (kept apart from the LRU), counted
    and logged once."""
    steps, failed = _steps(model)
    steps.pop(key, None)
    failed.add(key)
    _failed[key] = repr(error)
    log.warning("%s: tracing layout %r failed (%r); it runs eager from now on", what, key, error)


def _row(cache: KVCache, filling: bool = True) -> Optional[tuple]:
    """What the compiled batched step needs of one sequence's cache for its next token: (layout
    key, slot, RoPE position, buffers per layer, a function that places the sink rows of every
    layer or None, the layers' plans, the sink's slot), or None where this step cannot run
    compiled for it (the sinks are placed by `compiled_decode` once every row has been found
    eligible: a later row that sends the step eager leaves none built): a full exact cache
    whose buffers have room for the token, or a StreamingLLM ring in its steady state (the
    compiled solo step's condition, cache/compiled.py) or filling its window (`_filling`), or
    a retrieval cache whose hot window is filling (`_hot_row`); every layer of it at one
    position, and in one state."""
    layers = cache.owned
    first = layers[0]
    if first.dtype is None or any(c.sliding is not None for c in layers):
        return None
    if all(type(c) is FullLayer for c in layers):
        body = first.body
        if body.keys is None:
            return None
        slot, size = body.head + body.n, body.keys.shape[2]
        if slot + 1 > size or any(c.seen != first.seen or c.body.keys is None or c.body.head + c.body.n != slot
                                  or c.body.keys.shape[2] != size or c.dtype != first.dtype for c in layers):
            return None
        key = ("full", size, body.keys.dtype, first.dtype)
        plans = [c.plan() for c in layers]
        return key, slot, first.seen, [(c.body.keys, c.body.values) for c in layers], None, plans, None
    if cache.compiled_step == "retrieval":
        return _hot_row(layers) if filling else None
    if cache.compiled_step != "ring" or not all(type(c) is RingLayer for c in layers):
        return None
    plans = [c.plan() for c in layers]
    filling = filling and _filling(first.body, plans[0])
    if not all(p.rebase == 0 and (_filling(c.body, p) if filling else c.body.steady()) for c, p in zip(layers, plans)):
        return None
    slot = first.body.write_slot
    if any(c.seen != first.seen or c.body.write_slot != slot or c.positions.base != first.positions.base
           or c.dtype != first.dtype for c in layers):
        return None
    shifted = first.positions.frame and first.config.sink > 0
    first_slot = first.sink_slot_during(plans[0])
    buffers = [c.body.buffers() for c in layers]
    sinks = (lambda: [c.body.placed_sink(first_slot) for c in layers]) if shifted else None
    key = ("ring", buffers[0][0].shape[2], shifted, filling, buffers[0][0].dtype, first.dtype)
    return key, slot, plans[0].offset, buffers, sinks, plans, first_slot if shifted else None


def _hot_row(layers: list) -> Optional[tuple]:
    """`_row` of a retrieval cache whose hot window is still filling (nothing evicted yet, its
    cold store empty: the eager step attends over the sink and the hot window alone, and the
    solo step too), its sink full, its buffers with room for the token, no re-base: every layer
    at one position with one buffer layout. The sink is placed as the eager step reads it after
    the commit (`sink_slot_during`); None for any other state (the steady one is
    `_compiled_retrieval`'s)."""
    first = layers[0]
    plans = [c.plan() for c in layers]
    body, n_sink = first.body, len(first.sink_store)
    if body.keys is None:
        return None
    size, slot = body.keys.shape[2], body.head + body.n
    for c, p in zip(layers, plans):
        b = c.body
        if not (p.rebase == 0 and p.drop == 0 and len(c.cold) == 0 and len(c.sink_store) == n_sink == c.config.held_sink
                and c.positions.frame and b.frame is not None and b.head == 0 and b.fits(1) and b.n == body.n
                and b.keys.shape[2] == size and c.seen == first.seen and c.dtype == first.dtype
                and c.positions.base == first.positions.base and c.make_mask(1) is None):
            return None
    def sinks():
        placed = []
        for c, p in zip(layers, plans):
            segments = c.sink_store.segments(Reading(c.dtype, c.positions, c.sink_slot_during(p)))
            placed.append((segments[0].keys, segments[0].values) if segments else ())
        return placed
    key = ("hot", size, n_sink, body.keys.dtype, first.dtype)
    return key, slot, plans[0].offset, [b.buffers() for b in (c.body for c in layers)], sinks, plans, None


def _filling(ring: Any, plan: Any) -> bool:
    """Whether a ring's next decode step writes its token after the live ones without evicting:
    laid out as a ring (after its first decode step), its sink full, its window not yet (the
    live tokens are the buffer's first sink + n slots, the pointer right after them)."""
    return ring.ring and ring.n_sink == ring.sink and ring.ptr == ring.n < ring.window and plan.drop == 0


#: the fewest buffer slots a compiled batched step's full or hot-window rows attend over
#: (`attention_span`)
MIN_SPAN = 64


def attention_span(slot: int) -> int:
    """How many of their buffers' first slots the compiled batched step's full and hot-window rows
    attend over when the furthest row writes its token at `slot`: the power of two above `slot`
    (at least MIN_SPAN; capped at each row's capacity in the trace). A full cache's buffer grows
    in 256-token steps and a warm slot rolled back keeps its capacity (a 512-slot buffer under
    a 9-token prompt), so reading the whole buffer, masked, cost the shipped model's four-row step
    a third of its time (docs/server.md, 2026-12-06); a power of two keeps the step's layouts
    few (one more trace each time the furthest row passes one) and reads at most about twice
    the live tokens."""
    return max(MIN_SPAN, 1 << slot.bit_length())


def _compiled_step(model: Any, key: tuple):
    """The compiled batched step for `key` = (owners, the rows' layout keys, whether rows stack,
    the full and hot-window rows' attention span or None), made once per model and layout (the
    newest KEEP_TRACES kept), or `_FAILED`."""
    known = _cached(model, key)
    if known is not None:
        return known
    owners, rows, stack, span = key

    def step(tokens, offsets, slots, buffers, sinks):
        traced["compiled"] += 1
        layers = []
        for j in range(len(buffers[0])):
            made = []
            for i, row in enumerate(rows):
                k, v = buffers[i][j]
                if row[0] == "full":
                    made.append(_TracedFull(k, v, slots[i:i + 1], row[-1], span))
                elif row[0] == "hot":
                    made.append(_TracedHot(k, v, slots[i:i + 1], row[-1], sinks[i][j], span))
                else:
                    made.append(_TracedRing(k, v, slots[i:i + 1], row[-1], sinks[i][j] if row[2] else None, row[3]))
            layers.append(_TracedRows(made, offsets, stack))
        logits = model(tokens, cache=[layers[i] for i in owners])
        return logits, [[(r.keys, r.values) for r in layer.rows] for layer in layers]
    # the weights are closed over, as in cache/compiled.py (constants of the trace)
    return _keep(model, key, _Compiled(lambda: mx.compile(step), "compiled"))


# ----- KIVI's quiet steps in one compiled batched step -------------------------------------------
class _KiviRows(_TracedRows):
    """One model layer's KIVI caches of B sequences during the trace of a batched quiet step:
    each row a `_TracedKivi` (cache/compiled.py: the solo quiet step's traced layer) with its
    own sink, packed run, near tier, residual buffers, slot and mask; the rows' writes and
    attention are each row's own, the model's projections, RoPE and MLP run once over the B rows."""

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        return mx.concatenate([r.attend(queries[i:i + 1], scale, None) for i, r in enumerate(self.rows)], axis=0)


class _KiviStacked(_TracedRows, _TracedKivi):
    """One model layer's KIVI caches of B sequences during the trace of a batched quiet step,
    attending as one: the rows' residual buffers come in joined along the rows (`buffers`, the
    batch's, `_joined_buffers`: each row's padded with zeros to the longest row's), each row's
    new token is written there at its own row and slot, then the rows' sinks, packed runs and
    near tiers (`rows`, each a `_TracedKivi`) are stacked along the rows, each padded with zeros
    to the longest row's (`_padded`), and `_TracedKivi.attend` runs once over the B rows with a
    mask [B, 1, 1, slots] that shows each row its own slots (`_stacked_mask`: the padding masked,
    as is every slot the row's solo step masks). A padded key scores -inf and adds an exact zero:
    each row is its solo attention over the same keys, its sums run over longer rows (the last
    bits may differ). The mask protocol is `_TracedRows`' (the rows' mask is built in the step,
    `_stacked_mask`); the attention `_TracedKivi`'s, once over the stacked rows; the written
    joined buffers come out of the step (`buffers`), each row's own a view of its row."""

    def __init__(self, rows: list, offset: mx.array, masks: mx.array, packed: tuple, near: tuple, buffers: tuple,
                 at: mx.array):
        first = rows[0]
        _TracedKivi.__init__(self, (), packed, near, buffers, None, masks, offset, first.config, first.storage,
                             first.compute_dtype)
        self.rows, self.at = rows, at

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # each row's token written into the batch's joined buffers at its own slot (`at` [B, 1, S, 1]:
        # true at each row's slot; one element-wise node per side, not a slice and a write per row),
        # the same values the row's own step writes into its buffer (`_TracedKivi.update_and_fetch`)
        self.buffers = tuple(mx.where(self.at, new.astype(self.storage), b) for b, new in zip(self.buffers, (keys, values)))
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        rows = self.rows
        stack = (lambda xs: mx.concatenate(xs, axis=0))
        self.sink = tuple(stack([r.sink[x] for r in rows]) for x in (0, 1)) if rows[0].sink else ()
        return _TracedKivi.attend(self, queries, scale, None)


def _pad(a: mx.array, axis: int, n: int) -> mx.array:
    """`a` with `n` zeros appended along `axis`."""
    if n == 0:
        return a
    shape = list(a.shape)
    shape[axis] = n
    return mx.concatenate([a, mx.zeros(shape, a.dtype)], axis=axis)


def _padded(runs: list) -> tuple:
    """The rows' packed runs (each `(keys side, values side)`, or () where a row's near tier holds
    none) stacked along the rows, each padded with zeros to the longest run: codes, scales and
    zeros of 0 (a key of 0 scores 0, then -inf under the mask; a value of 0 adds 0) along each
    array's token axis (packed.py `_axes`: a quantised key side, three arrays of K^T, along its
    last axis; values and exact keys along the next-to-last), as many entries as the longest's."""
    lengths = [run[1][0].shape[-2] if run else 0 for run in runs]
    if not max(lengths):
        return ()           # (no row holds a packed run yet: a full cache's first steps)
    like = runs[lengths.index(max(lengths))]
    out = []
    for side in (0, 1):
        axis = 3 if side == 0 and len(like[0]) == 3 else 2
        arrays = []
        for x, ref in enumerate(like[side]):
            parts = []
            for run in runs:
                parts.append(_pad(run[side][x], axis, ref.shape[axis] - run[side][x].shape[axis]) if run
                             else mx.zeros(ref.shape, ref.dtype))
            arrays.append(mx.concatenate(parts, axis=0))
        out.append(tuple(arrays))
    return tuple(out)


#: the stacked rows' packed runs and near tiers as the last stacked KIVI step read them, joined
#: along the rows (`_joined_runs`): (the rows' runs, their joined run) by (part, layer); each step
#: keeps only what it used, so rows that leave the batch, or whose runs changed, drop it; an idle
#: worker drops them all (`drop_kept`)
_EVENED: dict = {}


def kept_nbytes() -> int:
    """Bytes of the joined runs kept now for the next stacked KIVI step (`_EVENED`: made and
    dropped by the worker thread's steps; read on that thread)."""
    return sum(a.nbytes for _, run in _EVENED.values() for side in run for a in side)


def drop_kept() -> None:
    """Forget the joined runs kept for the next stacked KIVI step (`_EVENED`) and the batch-owned
    residual buffers (`_JOINT`, each row given its own copy): the worker calls it when it goes
    idle, so finished requests' runs and buffers are not held past their batch."""
    global _EVENED
    _EVENED = {}
    _release_joint()


def _joined_runs(runs_by_row: list, kept: dict, part: str) -> list:
    """The rows' packed runs (or near tiers, `part`) of a stacked KIVI step, per row a list over the
    layers (`kivi_inputs`), joined along the rows per layer, each zero-padded along its token axes
    to the longest row's (`_padded`, done outside the trace): the trace's inputs change shape only
    when the longest row's run grows, not at each row's freeze (a new set of shapes: a trace, or an
    eager step where the freeze was done ahead, `KIVI_AHEAD_TRACES`), and the trace joins nothing.
    The stacked attention reads the same arrays as when the trace joined them: the same bits. A
    joined run is kept from step to step while every row's run stays the same arrays (a run is
    replaced, never written, when a block freezes: `_EVENED`; the runs used are put in `kept`, the
    step's next `_EVENED`), so a quiet step makes no copy of any row's run."""
    out = []
    for j in range(len(runs_by_row[0])):
        runs = tuple(runs[j] for runs in runs_by_row)
        held = _EVENED.get((part, j))
        if held is None or len(held[0]) != len(runs) or not all(_same_run(a, b) for a, b in zip(held[0], runs)):
            held = (runs, _padded(list(runs)))
            taken["kivi_runs_joined"] += 1
        kept[(part, j)] = held
        out.append(held[1])
    return out


def _same_run(a: tuple, b: tuple) -> bool:
    """Whether two packed runs (each `(keys side, values side)`, or ()) are the same arrays."""
    if not a or not b:
        return not a and not b
    return all(len(x) == len(y) and all(p is q for p, q in zip(x, y)) for x, y in zip(a, b))


#: the batch-owned residual buffers of the last stacked KIVI step (`_joined_buffers`): per layer
#: the rows' buffers joined along the rows as that step wrote them ("joined"), and per row and
#: layer what each row's residual was handed then ("rows": the residual, its key and value views
#: of its row, its `version` and its led-sink mark after the step's commit)
_JOINT: dict = {}


def _joined_buffers(caches: Sequence[KVCache], buffers: list) -> list:
    """Per layer the stacked rows' residual buffers (`buffers`, per row and layer, as the rows'
    caches hold them) joined along the rows [B, H, S, D], each padded with zeros to the longest
    row's S. Where every row's residual in a layer still holds what the last stacked step handed
    it (`_hand_out`: a view of its row of that step's written joined buffers, nothing written
    since: the same arrays, `version` and led-sink mark), that step's joined buffers are the
    same values and are read as they lie, with no copy; else they are joined anew (the copy each
    step made before, now only after a row's buffers changed: a block frozen, a buffer grown, a
    row joined or left, its cache stepped or written elsewhere). Rows of the last step not in
    this one get their own copy of their views (`_release_joint`)."""
    held, handed = _JOINT.get("joined"), _JOINT.get("rows")
    same_rows = handed is not None and len(handed) == len(caches) and all(
        h[0][0] is cache.owned[0].body.residual for h, cache in zip(handed, caches))
    if handed is not None and not same_rows:
        _release_joint(keep={id(cache.owned[0].body.residual) for cache in caches})
    out = []
    for j in range(len(buffers[0])):
        if same_rows and all(_unchanged(h[j]) for h in handed):
            out.append(held[j])
            taken["kivi_joined_kept"] += 1
            continue
        size = max(b[j][0].shape[2] for b in buffers)
        out.append(tuple(mx.concatenate([_pad(b[j][x], 2, size - b[j][x].shape[2]) for b in buffers], axis=0)
                         for x in (0, 1)))
        taken["kivi_joined_made"] += 1
    return out


def _unchanged(h: tuple) -> bool:
    """Whether a residual holds what a stacked step handed it (`_JOINT`'s record `h`), unwritten."""
    res, k, v, version, led = h
    return res.keys is k and res.values is v and res.version == version and res._led_for == led


def _hand_out(caches: Sequence[KVCache], joined: list, buffers: list) -> list:
    """The written joined buffers of a stacked step (`joined`, per layer) as each row's own, per
    layer and row: a view of its row, cut to its own buffer's size (`buffers`, the step's inputs
    per row and layer), for its commit (no copy: a slice)."""
    B = len(caches)
    out = []
    for j, (jk, jv) in enumerate(joined):
        ks, vs = (mx.split(jk, B, axis=0), mx.split(jv, B, axis=0)) if B > 1 else ([jk], [jv])
        row = []
        for i in range(B):
            k, v = ks[i], vs[i]
            n = buffers[i][j][0].shape[2]
            if n != k.shape[2]:
                k, v = k[:, :, :n], v[:, :, :n]
            row.append((k, v))
        out.append(row)
    return out


def _keep_joint(caches: Sequence[KVCache], joined: list) -> None:
    """After a stacked step's commit: its joined buffers and what each row's residual now holds
    (`_JOINT`, one record made at once: the views it holds came from those buffers), for the next
    step (`_joined_buffers`)."""
    _JOINT["joined"] = joined
    _JOINT["rows"] = [[(r, r.keys, r.values, r.version, r._led_for) for r in (c.body.residual for c in cache.owned)]
                      for cache in caches]


def _release_joint(keep: frozenset = frozenset()) -> None:
    """Forget the batch-owned buffers (`_JOINT`): each row's residual still holding its view of
    them (unwritten since) gets its own copy (the same values; its residual's id not in `keep`),
    so a row that left the batch (a warm slot, a finished request) does not hold the whole
    joined buffers alive."""
    handed = _JOINT.get("rows") or []
    mine = [rec for h in handed if id(h[0][0]) not in keep for rec in h if _unchanged(rec)]
    copies = [(mx.array(rec[1]), mx.array(rec[2])) for rec in mine]
    _JOINT.clear()
    if not copies:
        return
    try:
        mx.eval(copies)
    except RuntimeError:    # (made on another thread's stream, a test's: they keep their views)
        return
    for rec, (k, v) in zip(mine, copies):
        rec[0].keys, rec[0].values = k, v
    taken["kivi_joined_released"] += len(copies)


def _kivi_quiet(cache: KVCache) -> Optional[tuple]:
    """(the layers' plans, their layout) of a KIVI cache whose next step is a quiet one in every
    layer at one position, as the solo quiet step requires (cache/compiled.py `_kivi_ready`,
    `kivi_layout`; a full cache also before its first block froze), or None (then the whole
    batch runs eager); nothing changed."""
    layers = cache.owned
    plans = [c.plan() for c in layers]
    if not all(_kivi_ready(c, p, unpacked=True) for c, p in zip(layers, plans)):
        return None
    layout = kivi_layout(layers)
    return None if layout is None else (plans, layout)


def _readies(cache: KVCache) -> bool:
    """Whether a full KIVI cache's next step, not a quiet one as it stands, can be made one by
    `KiviStore.ready_next` in every layer (its block freezing or its buffers too small, done
    before the step): nothing to evict or re-base, its exact first tokens held, its exact tokens
    in buffers with room before them (`can_ready`). Nothing changed."""
    for c in cache.owned:
        p = c.plan()
        if (c.compiles != "kivi" or c.config.streaming or p.drop or p.rebase or c.dtype is None
                or len(c.sink_store) != c.config.held_sink or not c.body.can_ready()):
            return False
    return True


def _kivi_row(cache: KVCache, plans: list, layout: tuple) -> tuple:
    """What the compiled batched KIVI step needs of one quiet sequence's cache (`_kivi_quiet`)
    for its next token, read as the solo quiet step reads it (cache/compiled.py `kivi_inputs`):
    (row key, RoPE position, the sinks, packed runs, near tiers and residual buffers per layer,
    the first residual slot read, the new token's slot, the body's tokens the window no longer
    shows)."""
    first = cache.owned[0]
    n_packed, held = layout[:2]
    key = ("kivi", first.dtype, first.body.storage, first.config, held > n_packed, n_packed > 0)
    return (key, *kivi_inputs(cache.owned, plans, layout))


def _stacked_mask(n_sink: int, shapes: tuple, counts: mx.array, firsts: mx.array, lasts: mx.array,
                  cuts: mx.array) -> mx.array:
    """The mask [B, 1, 1, slots] of B KIVI rows attending stacked (`_KiviStacked`), over the
    sink, the packed run, the near tier and the residual's buffer, each padded to the longest
    row's (`shapes`: their tokens, Tp, Tn, S): row i sees its sink; of its frozen tokens (packed
    run then near tier: `counts[i]` of each) the j-th where j >= `cuts[i]` (compiled.py
    `_quiet_mask`'s rule); of its buffer the slots `firsts[i]` .. `lasts[i]`; no padding. Every
    row's number comes in as an array (a Python number would be a constant of the fused kernel,
    compiled anew for each value: compiled.py `_quiet_mask`)."""
    Tp, Tn, S = shapes
    B = counts.shape[0]
    packed_n, near_n, cut = counts[:, :1], counts[:, 1:], cuts[:, None]
    parts = [mx.ones((B, n_sink), mx.bool_)] if n_sink else []
    j = mx.arange(Tp, dtype=mx.int32)[None]
    parts.append((j < packed_n) & (j >= cut))
    if Tn:
        j = mx.arange(Tn, dtype=mx.int32)[None]
        parts.append((j < near_n) & (j + packed_n >= cut))
    slots = mx.arange(S, dtype=mx.int32)[None]
    parts.append((slots >= firsts[:, None]) & (slots <= lasts[:, None]))
    return mx.concatenate(parts, axis=1)[:, None, None, :]


def _kivi_step(model: Any, key: tuple):
    """The compiled batched KIVI step for `key` = ("kivi", owners, the rows' keys, stacked), made
    once per model and layout (the newest KEEP_TRACES kept), or `_FAILED`; MLX traces it again
    for each new set of the rows' input shapes (`_Compiled`: KEEP_SHAPES per function). `stacked`:
    the rows attend as one (`_KiviStacked`), else each on its own (`_KiviRows`)."""
    known = _cached(model, key)
    if known is not None:
        return known
    _, owners, rows, stacked = key

    def step(tokens, offsets, sinks, packed, nears, buffers, firsts, slots, cuts, counts):
        # (`buffers`: stacked, per layer the rows' buffers joined, `_joined_buffers`; else per row and layer)
        traced["kivi"] += 1
        B, n_sink = len(rows), sinks[0][0][0].shape[2] if sinks[0][0] else 0
        if stacked:     # (`packed`, `nears`: per layer the rows' runs joined, `_joined_runs`)
            shapes = (packed[0][1][0].shape[2] if packed[0] else 0, nears[0][1][0].shape[2] if nears[0] else 0,
                      buffers[0][0].shape[2])
            masks = [_stacked_mask(n_sink, shapes, counts, firsts, slots, cuts)] * B
        else:
            masks = [_quiet_mask(n_sink, packed[i][0], nears[i][0], buffers[i][0], firsts[i:i + 1], slots[i:i + 1],
                                 cuts[i:i + 1]) for i in range(B)]
        if stacked:     # each row's slot in the joined buffers [B, 1, S, 1]
            at = (mx.arange(shapes[2], dtype=mx.int32)[None] == slots[:, None])[:, None, :, None]
        layers = []
        for j in range(len(sinks[0])):
            if stacked:
                made = [_TracedKivi(sinks[i][j], (), (), (), None, masks[i], None, row[3], row[2], row[1])
                        for i, row in enumerate(rows)]
                layers.append(_KiviStacked(made, offsets, masks[0], packed[j], nears[j], buffers[j], at))
                continue
            made = [_TracedKivi(sinks[i][j], packed[i][j], nears[i][j], buffers[i][j], slots[i:i + 1], masks[i],
                                None, row[3], row[2], row[1]) for i, row in enumerate(rows)]
            layers.append(_KiviRows(made, offsets))
        logits = model(tokens, cache=[layers[i] for i in owners])
        if stacked:
            return logits, [layer.buffers for layer in layers]
        return logits, [[r.buffers for r in layer.rows] for layer in layers]
    # the weights are closed over, as in cache/compiled.py (constants of the trace)
    return _keep(model, key, _Compiled(lambda: mx.compile(step), "kivi"))


def _compiled_kivi(model: Any, ids: mx.array, caches: Sequence[KVCache], owners: tuple) -> Optional[mx.array]:
    """`compiled_decode` for B KIVI caches (full, or under StreamingLLM on frame positions) whose
    next steps are quiet in every row (`_kivi_row`): one compiled function runs the model over
    the B rows, each row's layers attending over their own sink, packed blocks and residual as
    the solo quiet step's trace does (`_TracedKivi`, in `_KiviRows`); each new token comes out
    written into its residual's buffers and joins it by the eager step's commit. None where a
    row is not quiet (a block freezing or evicted, a buffer growing: the eager batched call)."""
    quiet = [_kivi_quiet(c) for c in caches]
    late = [i for i, q in enumerate(quiet) if q is None]
    if late:
        # a full cache whose step freezes a block or outgrows its buffers: what its append would
        # do first is done now (`KiviStore.ready_next`), once every such row can (nothing changed
        # before), then its step is a quiet one. (Should a row still not be quiet, the eager step
        # follows and freezes nothing more: it finds the state its own append would have made.)
        if not all(_readies(caches[i]) for i in late):
            return None             # nothing changed yet
        for i in late:
            done = {c.body.ready_next() for c in caches[i].owned}
            taken["kivi_frozen_ahead"] += "froze" in done
            taken["kivi_grown_ahead"] += "grew" in done
            quiet[i] = _kivi_quiet(caches[i])
        if any(q is None for q in quiet):
            return None
    rows = [_kivi_row(c, *q) for c, q in zip(caches, quiet)]
    # one attention for all rows where they share a layer's kind and their caches are short
    # (the stacking copies every row: `STACK_TOKENS`, as for dense layers)
    # (rows with no block frozen yet attend in the eager step's exact form, `_TracedKivi._attend_exact`:
    # they stack with each other, not with rows holding packed blocks)
    stacked = (len({r[0][:4] + r[0][5:] for r in rows}) == 1
               and max(q[1][1] + r[5][0][0].shape[2] for q, r in zip(quiet, rows)) <= STACK_TOKENS)
    if stacked:     # (the rows' packed runs and near tiers joined at the longest row's length: `_joined_runs`)
        global _EVENED
        kept: dict = {}
        packed, nears = _joined_runs([r[3] for r in rows], kept, "packed"), _joined_runs([r[4] for r in rows], kept, "near")
        _EVENED = kept
    elif _JOINT:
        _release_joint()        # (the rows attend one by one now: the joined buffers not read)
    key = ("kivi", owners, tuple(r[0] for r in rows), stacked)
    step = _kivi_step(model, key)
    if step is _FAILED:
        return None
    ints = (lambda n: mx.array([r[n] for r in rows], dtype=mx.int32))
    buffers = _joined_buffers(caches, [r[5] for r in rows]) if stacked else [r[5] for r in rows]
    if not stacked:
        packed, nears = [r[3] for r in rows], [r[4] for r in rows]
    args = (ids, ints(1), [r[2] for r in rows], packed, nears, buffers,
            ints(6), ints(7), ints(8), mx.array([(q[1][0], q[1][1] - q[1][0]) for q in quiet], dtype=mx.int32))
    if late and not (KIVI_AHEAD_TRACES or stacked) and not step.holds(args):     # (stacked: `_joined_runs`)
        taken["kivi_ahead_eager"] += 1
        return None     # new shapes (a trace): the eager step, which freezes nothing more (module doc)
    try:
        logits, new = step(*args)
    except Exception as e:      # as `compiled_decode`: eager from now on for this layout, nothing moved
        _trace_failed(model, key, e, "compiled batched KIVI step")
        return None
    taken["compiled"] += 1
    taken["compiled_kivi"] += 1
    taken["compiled_kivi_stacked"] += stacked
    taken["compiled_kivi_unpacked"] += any(not r[0][5] for r in rows)     # (a row with no block frozen yet)
    if stacked:     # each row's buffers a view of its row of the written joined ones, kept for the next step
        joined, new = new, _hand_out(caches, new, [r[5] for r in rows])
    for i, (cache, (plans, _)) in enumerate(zip(caches, quiet)):
        for j, (c, p) in enumerate(zip(cache.owned, plans)):
            c.commit(p, None, None, written=new[j][i])
    if stacked:
        _keep_joint(caches, joined)
    return logits


# ----- retrieval rows in one compiled batched step ----------------------------------------------
class _RetrievalRows(_TracedRows):
    """One model layer's retrieval caches of B sequences during the trace of a batched step: each
    row the compiled solo step's traced layer (cache/compiled_retrieval.py `_TracedRetrieval`,
    with its own `at`), which writes its own token (the body's oldest token leaving, the new one
    written into the hot window, at its own slots); the attention runs once per group of rows
    that share a layout (`groups`: contiguous ranges of rows with one `Static`, the same summary
    widths, hot window and sink) through the solo step's own code in its per-row form
    (`attend_rows`, stacked: the turns in one RoPE call, each row's leaving key written into its
    own cold store, the selection over the rows' arrays stacked, `select_rows`, each row
    gathering from its own store, one softmax). The rows' writes and the mask protocol (one
    query sees every stored token, checked before the step) are `_TracedRows`'."""

    def __init__(self, specs: list, at: list, inputs: list, offset: mx.array, groups: tuple, turns: dict):
        # (`turns`: one dict for every layer of the step, so a group's RoPE turns are made once)
        super().__init__([_TracedRetrieval(sp, a, x, turns) for sp, a, x in zip(specs, at, inputs)], offset)
        self.groups = groups

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        outs = [attend_rows(self.rows[a:b], queries[a:b] if b - a < queries.shape[0] else queries, scale, None,
                            stacked=True) for a, b in self.groups]
        return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]

    def outputs(self, i: int) -> dict:
        return self.rows[i].outputs()


class _SlidingRows(_TracedRows):
    """One model layer's sliding-window rings of B sequences (Gemma 3's local layers beside
    retrieval's global ones) during the trace of a batched retrieval step: each row the steady
    ring's traced layer (`_TracedRing`: its token written at its own pointer), at each row's own
    RoPE position (`offset`, [B]); rings of one window attend as one (`_TracedRows`). The model's
    sliding mask at least as wide as the rings' window masks nothing for one query (the solo
    step's rule, cache/compiled.py `_TracedRing.unmasked_within`, checked before the step:
    `RingLayer.sees_all`)."""

    def __init__(self, rows: list, offset: mx.array, window: int):
        super().__init__(rows, offset, stack=True)
        self.window = window

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> None:
        if window_size is not None and window_size < self.window:
            raise ValueError("a windowed mask is not traced")
        return None


def _retrieval_checked(cache: KVCache, ahead: bool = False) -> Optional[tuple]:
    """(the global layers' plans, the sliding rings' state) of a retrieval cache whose next decode
    step is a steady one the compiled solo step would run (cache/compiled_retrieval.py `steady`;
    beside sliding-window rings, Gemma 3's, those steady at their own position and pointer,
    `rings_ready`: (the rings' indices among the cache's layers, their plans, (window, compute
    dtype, write slot, RoPE position)), else None), or None; nothing changed. `ahead`: also a step
    that `ready_ahead` makes a steady one (a still empty cold store, cold rows or a body without
    room for the token: cache/compiled_retrieval.py `steady`)."""
    if cache.compiled_step != "retrieval":
        return None
    layers = cache.owned
    plans = [c.plan() for c in layers]
    rings = None
    if cache.ring_layout is not None:      # (the rings' indices decided once, `KVCache.ring_layout`)
        state = rings_ready(cache, plans)
        if state is None:
            return None
        ring_index, kept = cache.ring_layout
        rings = (ring_index, [plans[i] for i in ring_index], state)
        layers, plans = [layers[i] for i in kept], [plans[i] for i in kept]
    return (plans, rings) if steady(layers, plans, ahead) else None


def _global_layers(cache: KVCache) -> list:
    """A retrieval cache's layers but its sliding-window rings (its retrieval layers: the list
    `KVCache.global_layers` keeps, made once)."""
    return cache.global_layers


def _retrieval_step(model: Any, key: tuple, caches: Sequence[KVCache]):
    """The compiled batched retrieval step for `key` = ("retrieval", owners, the rows' keys, the
    sliding rings' layout: (their indices among the layers, window, compute dtype), () without),
    made once per model and layout over these `caches`' position rules (their RoPE: the model's,
    as the solo step's, cache/compiled_retrieval.py `_retrieval_step_fn`): (the compiled
    function, how many groups it runs), or `_FAILED`. Rows whose keys share their selection's
    layout (`_group`) are contiguous: one group each."""
    known = _cached(model, key)
    if known is not None:
        return known
    _, owners, rows, rings = key
    groups = _groups(rows)
    specs = [layer_specs(_global_layers(cache), row) for cache, row in zip(caches, rows)]

    def step(tokens, offsets, at, inputs, ring_at, ring_buffers):
        traced["retrieval"] += 1
        turns: dict = {}
        layers = [_RetrievalRows([specs[i][j] for i in range(len(rows))], at, [x[j] for x in inputs], offsets,
                                 tuple(groups), turns) for j in range(len(inputs[0]))]
        sliding = []
        if rings:       # the sliding-window rings beside (Gemma 3): each row at its own position and pointer
            ring_index, window, compute = rings
            sliding = [_SlidingRows([_TracedRing(ring_buffers[i][j][0], ring_buffers[i][j][1], ring_at[i, 1:2],
                                                 compute, None) for i in range(len(rows))], ring_at[:, 0], window)
                       for j in range(len(ring_index))]
            owned, ring_of = iter(layers), dict(zip(ring_index, sliding))
            layers = [ring_of[i] if i in ring_of else next(owned) for i in range(len(layers) + len(sliding))]
        with rope_products.products(model, offsets):    # (the model's RoPE: a product per row, as the solo step's)
            logits = model(tokens, cache=[layers[i] for i in owners])
        return (logits, [[layer.outputs(i) for i in range(len(rows))] for layer in layers if layer not in sliding],
                [[(r.keys, r.values) for r in layer.rows] for layer in sliding])
    return _keep(model, key, (_Compiled(lambda: mx.compile(step), "retrieval"), len(groups)))


def _groups(rows: tuple) -> list[tuple[int, int]]:
    """The contiguous ranges of rows (their keys `rows`) that select and attend as one group."""
    groups, a = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or _group(rows[i]) != _group(rows[a]):
            groups.append((a, i))
            a = i
    return groups


def _group(row_key: tuple) -> tuple:
    """What rows must share to select and attend as one group: the row key but whether the step
    evicts (the compute dtype, config, `Static`, summary widths, hot window, sink, telemetry and
    the sticky pages' width)."""
    return row_key[:3] + row_key[4:]


def _compiled_retrieval(model: Any, ids: mx.array, caches: Sequence[KVCache], owners: tuple) -> Optional[mx.array]:
    """`compiled_decode` for B retrieval caches whose next steps are steady ones (the compiled
    solo step's condition): one compiled function runs the model over the B rows, each row's
    layers evicting, searching its own cold store and attending as the solo step's trace does
    (`_RetrievalRows`); each layer's commit and telemetry follow eagerly, as after the solo step.
    The rows are traced in an order sorted by their layout (a step completing a page, a store's
    widths), so B rows at their own phases make few layouts; None where a row is not steady."""
    # (a row whose cold store is still empty, or whose cold rows or body have no room for the
    # token, steps compiled too: its first eviction, its rows' growth or its body's move done
    # ahead, once every row is found able to step so: `ready_ahead`; the solo step runs those
    # steps eager and so, before 2026-12-06 evening, did the whole batch)
    checked = [_retrieval_checked(c, ahead=True) for c in caches]
    if any(p is None for p in checked):
        return None                 # nothing changed yet
    rings = [r for _, r in checked]
    layouts = {None if r is None else (r[0], *r[2][:2]) for r in rings}
    if len(layouts) != 1:
        return None                 # (rows of one model: their rings differ only in state)
    ring_layout = layouts.pop() or ()
    checked = [(ready_ahead(_global_layers(c), p), r) for c, (p, r) in zip(caches, checked)]
    scratch = SCRATCH_EVICTIONS and all(_scratch_room(_global_layers(c), p) for c, (p, _) in zip(caches, checked))
    if not scratch:
        checked = _one_eviction_kind(caches, checked)
    made = [step_inputs(_global_layers(c), p, scratch) for c, (p, _) in zip(caches, checked)]   # (row key, at, inputs, plans)
    # each row's key with its sticky pages' width (`recent` [G, S]: S the pages its last pass
    # picked, fewer in a short store), which rows must share to select as one group
    made = [(m[0] + (m[2][0]["recent"].shape,),) + m[1:] for m in made]
    order = sorted(range(len(caches)), key=lambda i: (hash(_group(made[i][0])), hash(made[i][0])))
    key = ("retrieval", owners, tuple(made[i][0] for i in order), ring_layout)
    made_step = _retrieval_step(model, key, [caches[i] for i in order])
    if made_step is _FAILED:
        return None                 # (an eviction ahead is the eager step's own)
    step, n_groups = made_step
    in_order = order == sorted(order)
    ring_at, ring_buffers = mx.zeros((len(order), 2), mx.int32), []
    if ring_layout:     # each row's rings: their RoPE position and write slot, their buffers
        ring_at = mx.array([[rings[i][2][3], rings[i][2][2]] for i in order], dtype=mx.int32)
        ring_buffers = [[caches[i].owned[r].body.buffers() for r in ring_layout[0]] for i in order]
    try:
        logits, outs, ring_outs = step(ids if in_order else ids[mx.array(order)],
                                       mx.array([made[i][1][0] for i in order], dtype=mx.int32),
                                       [mx.array(made[i][1], mx.int32) for i in order], [made[i][2] for i in order],
                                       ring_at, ring_buffers)
    except Exception as e:
        _trace_failed(model, key, e, "compiled batched retrieval step")
        return None
    taken["compiled"] += 1
    taken["compiled_retrieval"] += 1
    taken["retrieval_groups"] += n_groups
    taken["compiled_retrieval_rings"] += bool(ring_layout)
    for j, i in enumerate(order):
        # (as after the solo step: the commit, the sticky pages, the telemetry where asked)
        for c, p, out in zip(_global_layers(caches[i]), made[i][3], [layer[j] for layer in outs]):
            commit(c, p, out)
        if ring_layout:     # (the ring's compiled step's commit, cache/compiled.py)
            for r, p, layer in zip(ring_layout[0], rings[i][1], ring_outs):
                caches[i].owned[r].commit(p, None, None, written=(*layer[j], None))
    if in_order:
        return logits
    back = [0] * len(order)
    for j, i in enumerate(order):
        back[i] = j
    return logits[mx.array(back)]


#: a batched retrieval step's rows all evict in the trace, or none does (`_one_eviction_kind`):
#: False, each row as its own step would (the layouts before 2026-12-06, session 40); only where
#: SCRATCH_EVICTIONS is False
ONE_EVICTION_KIND = True

#: every row of a batched retrieval step evicts in the trace: a row whose token was evicted eagerly
#: (its page completes, or its cold store's first token) is laid out as an evicting one all the same,
#: its trace's eviction written as a scratch row past its store's count
#: (compiled_retrieval.py `step_inputs`, `scratch`), so no other row is evicted eagerly for it
#: (`_one_eviction_kind`, which evicted every row of such a step eagerly: 1.5 of four rows per
#: steady step, about 160 more nodes each, 2026-12-06 session 42); False: `ONE_EVICTION_KIND`'s rule
SCRATCH_EVICTIONS = True


def _evicts_in_trace(layers: list, plans: list) -> bool:
    """Whether a retrieval row's trace evicts its token (`step_inputs`' rule): not where a page
    completes or the eviction was done ahead (`ready_ahead`'s first one)."""
    return plans[0].drop > 0 and not layers[0].cold.completes_page(plans[0].drop)


def _scratch_room(layers: list, plans: list) -> bool:
    """Whether a retrieval row can step as an evicting one (`SCRATCH_EVICTIONS`): its trace
    evicts, or its cold rows' arrays have room, after its eviction ahead, for the scratch row past
    the count (where they have none, the step keeps `_one_eviction_kind`'s rule: the rows' growth
    stays where the solo step makes it, at the next step, `ready_ahead`)."""
    if _evicts_in_trace(layers, plans):
        return True
    n = len(layers[0].cold) + plans[0].drop
    return all(c.cold.keys.capacity > n and c.cold.values.capacity > n for c in layers)


def _one_eviction_kind(caches: Sequence[KVCache], checked: list) -> list:
    """The rows' (plans, rings) with one eviction kind for the step: where some rows' traces evict
    and others' do not (a page completing, a first eviction done ahead), the evicting rows' token
    is evicted ahead too (`LayerCache.evict_ahead`: the eager step's own eviction, the same
    values), so no row's trace evicts. A row's eviction in the trace is part of the layout
    (`step_inputs`' row key), so four rows at their own phases made a layout per mix of kinds:
    each a trace held (about 0.8 MiB of the heap each, docs/server.md), made as new mixes met,
    round after round of a load run. With one kind per step the mixes are halved."""
    if not ONE_EVICTION_KIND:
        return checked
    evicting = [_evicts_in_trace(_global_layers(c), p) for c, (p, _) in zip(caches, checked)]
    if all(evicting) or not any(evicting):
        return checked
    return [([layer.evict_ahead(q) for layer, q in zip(_global_layers(c), p)] if e else p, r)
            for c, (p, r), e in zip(caches, checked, evicting)]


def compiled_decode(model: Any, ids: mx.array, caches: Sequence[KVCache], steady_only: bool = False
                    ) -> Optional[mx.array]:
    """One decode step of B sequences as one compiled function (the embedding, projections, RoPE,
    cache writes, attention and MLP traced once per layout and replayed), where every sequence
    allows it (`_row`: a full exact cache with room in its buffers, a StreamingLLM ring, steady
    or filling its window, a retrieval cache filling its hot window; retrieval's steady steps
    and KIVI's quiet ones are `_compiled_retrieval`'s and `_compiled_kivi`'s); the logits
    [B, 1, V], each cache advanced by one token as the eager step advances it; None where it cannot run (nothing changed: the caller runs the eager batched call).
    `steady_only`: the step as it ran before 2026-12-05 15:00, for the benchmark's A/B: no window
    still filling compiled, and each row attending on its own within the trace."""
    if not batches(model) or any(not getattr(c, "compile_decode", False) for c in caches):
        return None
    first = caches[0].owned
    index = {id(c): i for i, c in enumerate(first)}
    owners = tuple(index.get(id(c), -1) for c in caches[0])
    retrieval = all(c.compiled_step == "retrieval" for c in caches)
    kivi = all(c.compiled_step == "kivi" for c in caches)
    for cache in caches:
        layers = cache.owned
        if len(layers) != len(first) or tuple({id(c): i for i, c in enumerate(layers)}.get(id(c), -1)
                                              for c in cache) != owners:
            return None
    if retrieval:
        logits = _compiled_retrieval(model, ids, caches, owners)
        if logits is not None:
            return logits       # (else nothing changed, or only an eviction ahead: not a filling row then)
    if kivi:
        return _compiled_kivi(model, ids, caches, owners)
    rows = []
    for cache in caches:
        row = _row(cache, not steady_only)
        if row is None:
            return None         # (no row's sink placed yet: every row is checked before any is built)
        rows.append(row)
    rows = [r[:4] + (r[4]() if r[4] is not None else None,) + r[5:] for r in rows]
    reach = max((r[1] for r in rows if r[0][0] in ("full", "hot")), default=None)
    span = None if steady_only or reach is None else attention_span(reach)
    key = (owners, tuple(r[0] for r in rows), not steady_only, span)
    step = _compiled_step(model, key)
    if step is _FAILED:
        return None
    try:
        logits, new = step(ids, mx.array([r[2] for r in rows], dtype=mx.int32),
                           mx.array([r[1] for r in rows], dtype=mx.int32),
                           [r[3] for r in rows], [r[4] if r[4] is not None else [] for r in rows])
    except Exception as e:      # the model's code cannot be traced: eager from now on, nothing moved
        _trace_failed(model, key, e, "compiled batched step")
        return None
    taken["compiled"] += 1
    taken["compiled_ring_filling"] += any(r[0][0] == "ring" and r[0][3] for r in rows)
    taken["compiled_hot_filling"] += retrieval
    for i, (cache, row) in enumerate(zip(caches, rows)):
        for j, (c, p) in enumerate(zip(cache.owned, row[5])):
            k, v = new[j][i]
            c.commit(p, None, None, written=(k, v) if row[0][0] in ("full", "hot") else (k, v, row[6]))
    return logits


def decode_step(model: Any, tokens: Sequence[int], caches: Sequence[KVCache], dense: bool = True,
                compiled: Any = True, argmax: bool = False) -> Any:
    """One decode step of B sequences: `tokens[i]` fed to `caches[i]` (each advanced by one
    token); the fp32 logits after each, shape [B, V], evaluated. `dense` False: attention per
    sequence for every layer (the reference the batched attention is tested against); `compiled`
    False: never the compiled step, "steady": `compiled_decode`'s `steady_only`. `argmax`:
    (the logits, each row's argmax as a list of B ints), both from one evaluation (a second
    evaluation for the greedy rows' tokens cost the server ~0.5 ms a step on the shipped model)."""
    ids = mx.array(list(tokens), dtype=mx.int32)[:, None]
    logits = compiled_decode(model, ids, caches, compiled == "steady") if compiled else None
    if logits is None:
        logits = model(ids, cache=batch_layers(caches, dense))
    logits = logits[:, -1].astype(mx.float32)
    if argmax:
        best = mx.argmax(logits, axis=-1)
        mx.eval(logits, best)
        return logits, best.tolist()
    mx.eval(logits)
    return logits
