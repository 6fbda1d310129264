"""A retrieval decode step on the device (cold_device.py) as one compiled MLX function: the
`"retrieval"` kind of cache/compiled.py's `decode`, which hands its steady steps here.

A steady step (`_retrieval_ready`: the hot window full, one token evicted, no re-base, a cold
store the trace can search and write) has the shapes of its arrays' capacities, so the model's
whole step is traced once per shape and replayed: per layer the hot window's oldest token is
turned back before RoPE and written as the cold store's next row, the new token is written
after the window's live ones, the query is turned to the retrieved slot, `device_select`'s
chain picks the cold tokens and one softmax covers them, the placed sink and the window. Every
number that changes per step is one int32 array (`AT_OFFSET` ... `AT_TURN`). The host keeps the
counters and the bookkeeping (`LayerCache.took_step`, `DeviceColdStore.picked`). The compiled
module's failure rule holds: a layout whose trace fails runs eager from then on, counted and
logged (`failed`, given by compiled.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Optional

import mlx.core as mx

from . import rope_products
from .cold_device import place
from .device_select import select_in_trace, select_rows
from .segments import DenseSegment, PickedSegment, attend

__all__ = ["decode", "commit"]


#: the step's numbers a retrieval trace reads, one int32 array shared by every layer (they are
#: the same in each: one position, one body layout, one cold count), by index: the query's RoPE
#: offset, the leaving token's slot in the body's buffers, the new token's, the first live one's
#: after the step, the cold row the leaving token takes, the cold counts after the step (tokens,
#: pages, blocks), the angle that turns the leaving key back, the one that turns the query
AT_OFFSET, AT_SRC, AT_WRITE, AT_LIVE, AT_ROW, AT_COUNTS, AT_FIRST, AT_TURN = 0, 1, 2, 3, 4, 5, 8, 9

#: the leaving token read from the body's buffers after the new token's write (at another slot:
#: the same values), not before it: the old buffers' one reader is then the write, which MLX does
#: in place; read before it, a second reader kept them alive and the write copied each layer's
#: two buffers whole, every step (2026-12-06, session 43). False: the old order (the A/B's)
DONATED_BODY = True


class _TracedRetrieval:
    """One retrieval layer during the trace of a steady decode step (`_retrieval_ready`): the
    same work as the eager step's (`LayerCache.commit`, retrieved.py's `attend_retrieving`,
    `DeviceColdStore.retrieve`), on arrays. Unless a page completes (then the layer evicted
    before, `LayerCache.evict_ahead`), the body's oldest token is turned back before RoPE and
    written as row n of the cold store's rows (`DeviceColdStore.append`); the new token is
    written after the body's live ones (`DenseStore.append`); the query is turned to the
    retrieved slot, `device_select`'s chain picks the cold tokens (as `select`, not a nested
    compiled call), and one softmax covers them, the placed sink and the hot window
    (`segments.attend`). What changed comes out (`outputs`) for the eager bookkeeping."""

    reads_own_segments = True

    def __init__(self, spec: Any, at: mx.array, inputs: dict, turns: Optional[dict] = None):
        self.spec, self.at = spec, at
        #: the step's RoPE matrices by `Positions.rotation_key`, shared by the layers of one trace
        #: that read the same `at` (the solo step's; each row of serve's batched step its own)
        self.turns = {} if turns is None else turns
        self.body, self.sink = inputs["body"], inputs["sink"]
        self.keys, self.values = inputs["keys"], inputs["values"]
        self.summaries, self.recent = inputs["summaries"], inputs["recent"]
        self.leaving: Optional[tuple] = None     # the body's oldest keys and values, evicted by this step
        self.evicted: Optional[tuple] = None
        self.picked: Optional[tuple] = None

    @property
    def offset(self) -> mx.array:
        # (one array shared by the layers of a solo step's trace: `rope_products` keys on it)
        held = self.turns.get("offset")
        return self.at[AT_OFFSET] if held is None else held

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:
            raise ValueError("a windowed mask is not traced")
        return None     # one query sees every stored token (checked before the step: `make_mask` is None)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        sp, at = self.spec, self.at
        kb, vb = self.body
        B, H = kb.shape[:2]
        dt = kb.dtype       # DenseStore.append: the new token after the live ones
        self.body = (mx.slice_update(kb, keys if keys.dtype == dt else keys.astype(dt), at[AT_WRITE:AT_WRITE + 1],
                                     axes=(2,)),
                     mx.slice_update(vb, values if values.dtype == dt else values.astype(dt), at[AT_WRITE:AT_WRITE + 1],
                                     axes=(2,)))
        if sp.evicts:     # LayerCache._evict: the oldest body token leaves (turned back and stored in `attend`)
            # (read from the written buffers: its slot is not the written one, and the old buffers then
            # have the write as their one reader, so MLX writes them in place instead of copying them
            # whole each step, `DONATED_BODY`)
            src = self.body if DONATED_BODY else (kb, vb)
            self.leaving = tuple(mx.slice(b, at[AT_SRC:AT_SRC + 1], (2,), (B, H, 1, b.shape[3])) for b in src)
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        return attend_rows([self], queries, scale, mask, stacked=False)

    def outputs(self) -> dict:
        return {"body": self.body, "picked": self.picked, **({"evicted": self.evicted} if self.evicted else {})}


def attend_rows(rows: list, queries: mx.array, scale: float, mask: Any, stacked: bool) -> mx.array:
    """The attention of retrieval layers in a steady step's trace, `rows` (each a
    `_TracedRetrieval` after its `update_and_fetch`, all of one layout: one spec's `Static`,
    summary widths, hot window and sink), over their `queries` stacked in order: the solo step's
    one layer (`stacked` False) or serve's batched step's rows of one group (server/batch.py,
    `stacked` True). Each row's leaving key is turned back before RoPE and written as its cold
    store's next row (`DeviceColdStore.append`), with the queries turned to the retrieved slot, each
    row by its own angles (products with RoPE's matrices of the step's angles, `_turns`);
    `device_select`'s chain picks the cold tokens
    (`select_in_trace` for one layer, `select_rows` over the rows' summaries, counts and sticky
    pages stacked, each row gathering from its own store), and one softmax covers them, the
    placed sinks and the hot windows (`segments.attend`). Each row's picks (per row where
    stacked) and its cold store's writes are left on it for `outputs`."""
    first = rows[0]
    sp, n = first.spec, len(rows)
    B, H = first.body[0].shape[:2]
    Hq, D = queries.shape[1], queries.shape[3]
    frame = sp.positions.frame
    if frame:
        # the queries turned to the retrieved slot (retrieved.py) and the leaving keys turned back
        # before RoPE (positions.unrotate), each row by its own angles, as products with the
        # rotations of the step's two angles (`Positions.rotations`: made once per step and RoPE)
        # (made in the query rows' shape [n B H, rep, D], in which `attend` reads them too)
        turns = _turns(rows, D)
        if n == 1:      # (one row: the turn's matrix as a batch of one, shared by the layers)
            q_rows = queries.astype(mx.float32).reshape(B * H, Hq // H, D) @ turns[:, 1]
        else:
            q_rows = (queries.astype(mx.float32).reshape(n, -1, D) @ turns[:, 1]).reshape(n * B * H, Hq // H, D)
    else:
        # original positions (absolute): every key is kept as the model rotated it, the cold
        # rows too (LayerCache._evict), so nothing is turned and the query scores them as it is
        q_rows = queries.astype(mx.float32).reshape(n * B * H, Hq // H, D)
    # (each row's turn back, [1, D, D]: the rows' matrices split once, not sliced row by row)
    back = (mx.split(turns[:, 0], n, axis=0) if n > 1 else [turns[:, 0]]) if frame else None
    for j, r in enumerate(rows):
        if r.leaving is not None:
            # [G, 1, D] (DeviceColdStore.append)
            k = r.leaving[0].astype(mx.float32).reshape(B * H, 1, D)
            k = k @ back[j] if frame else k     # (a batch of one: no flatten around the product)
            v = r.leaving[1].astype(mx.float32).reshape(B * H, 1, -1)
            (ck,), (cv,) = r.keys, r.values
            row = r.at[AT_ROW:AT_ROW + 1]
            r.keys = (mx.slice_update(ck, k.astype(ck.dtype), row, axes=(1,)),)
            r.values = (mx.slice_update(cv, v.astype(cv.dtype), row, axes=(1,)),)
            r.evicted = (r.keys[0], r.values[0], k)
    stack = (lambda xs: mx.concatenate(xs, axis=0) if n > 1 else xs[0])
    if stacked:
        summaries = {name: stack([r.summaries[name][:, :sp.buckets[name]] for r in rows]) for name in first.summaries}
        counts = stack([mx.broadcast_to(r.at[AT_COUNTS:AT_COUNTS + 3][None, :, None], (H, 3, 1)) for r in rows])
        recent = stack([r.recent for r in rows]) if sp.static.sticky else None
        idx, k, v, valid, last, scored, recent = select_rows(
            sp.static, sp.codec, sp.rope, q_rows, counts.swapaxes(0, 1), summaries,
            [r.keys for r in rows], [r.values for r in rows], recent)
        # each row's parts (its H query rows): every output split once along the rows (one node
        # for all the rows, not a slice per row; the telemetry's parts only where it records:
        # `commit` then reads the sticky pages alone)
        outs = (idx, valid, last, scored, recent) if sp.records else (recent,)
        parts = [mx.split(a, n, axis=0) if n > 1 else [a] for a in outs]
        for j, r in enumerate(rows):
            got = tuple(p[j] for p in parts)
            r.picked = got[:3] + (got[3].max(),) + got[4:] if sp.records else got
    else:
        summaries = {name: a[:, :sp.buckets[name]] for name, a in first.summaries.items()}
        idx, k, v, valid, last, scored, recent = select_in_trace(
            sp.static, sp.codec, sp.rope, q_rows, first.at[AT_COUNTS:AT_COUNTS + 3], summaries, first.keys,
            first.values, first.recent)
        first.picked = (idx, valid, last, scored, recent) if sp.records else (recent,)
    T = idx.shape[1]
    k = place(k.reshape(n * B, -1, T, D), idx, 0, sp.positions, sp.static.page_size)
    # (the picks' mask as `_attend_one` reads it, [B, H, 1, T]: no axis added per layer)
    segments = [PickedSegment(k, v.reshape(n * B, H, T, -1), valid.reshape(n * B, -1, 1, T))]
    if first.sink:
        segments.append(DenseSegment(*(stack([r.sink[x] for r in rows]) for x in (0, 1))))
    live = [stack([mx.slice(r.body[x], r.at[AT_LIVE:AT_LIVE + 1], (2,), (B, H, sp.live, r.body[x].shape[3]))
                   for r in rows]) for x in (0, 1)]
    if live[0].dtype != sp.compute:     # DenseStore.fetch in the compute dtype
        live = [b.astype(sp.compute) for b in live]
    segments.append(DenseSegment(*live))
    # (one unmasked query over exact segments: `attend` takes its one-query form, `_attend_one`)
    return attend(segments, 1, queries, scale, mask, q_rows if frame else None, len(segments) - 1 if frame else 0)


def _turns(rows: list, D: int) -> mx.array:
    """The RoPE matrices [n, 2, D, D] of `rows`' step (`Positions.rotations` of each row's angles
    `at[AT_FIRST]`, `at[AT_TURN]`: the leaving key's turn back, the query's turn), in one RoPE
    call, made once per trace, rotation key and rows (their `at` arrays), shared by the layers
    that read the same `at` (`_TracedRetrieval.turns`: the solo step's layers share one dict, and
    so do all the layers and rows of serve's batched step, each group its own matrices)."""
    pos = rows[0].spec.positions
    if len(rows) > 1:
        # (serve's rows of one group: made once per trace, shared by the layers through the rows'
        # `turns`, which every layer's rows of the step share: keyed by the rows' own `at`)
        key = (pos.rotation_key(), D, tuple(id(r.at) for r in rows))
        m = rows[0].turns.get(key)
        if m is None:
            m = rows[0].turns[key] = pos.rotations(mx.concatenate([r.at[AT_FIRST:AT_TURN + 1] for r in rows]),
                                                   D).reshape(len(rows), 2, D, D)
        return m
    row = rows[0]
    key = (pos.rotation_key(), D, id(row.at))      # (serve's groups of one row share `turns` too)
    m = row.turns.get(key)
    if m is None:
        m = row.turns[key] = pos.rotations(row.at[AT_FIRST:AT_TURN + 1], D)[None]
    return m


def _retrieval_ready(layer: Any, plan: Any, ahead: bool = False) -> bool:
    """Whether this retrieval layer's next decode step, planned as `plan`, is a steady one: the
    hot window full (one token evicted), the sink full, no re-base, room in the body's buffers,
    and a cold store the step can search and write in a trace (`DeviceColdStore.step_ready`).
    `ahead`: also where what is missing can be done before the step (`ready_ahead`): the body's
    buffers without room for the token, the cold store still empty (its first eviction) or its
    rows' arrays full."""
    return (layer.dtype is not None and plan.rebase == 0 and plan.drop == 1
            and len(layer.sink_store) == layer.config.held_sink
            and (layer.body.fits(1) or (ahead and layer.body.keys is not None))
            and layer.cold.step_ready(ahead))


def ready_ahead(layers: list, plans: list) -> list:
    """Make the next step of retrieval layers that `steady(..., ahead=True)` accepts a steady one
    the compiled trace runs, doing eagerly first what the eager step would do in it, with the same
    values: the first eviction into a still empty cold store (`LayerCache.evict_ahead`, as a step
    completing a page does: the trace then only reads the store), the growth of a cold store's
    full rows (`DeviceColdStore.make_room`) and, where the body's buffers have no room for the
    token, the move of its live tokens to the front of the buffers the eager step's append would
    make (`DenseStore.make_room`). The plans left to commit (`step_inputs` takes them). Serve's
    batched step (server/batch.py) calls it once every row was found able to step so; the solo
    step runs these steps eager."""
    if len(layers[0].cold) == 0:
        plans = [c.evict_ahead(p) for c, p in zip(layers, plans)]
    for c in layers:
        c.cold.make_room()
        c.body.make_room(1)
    return plans


def layer_specs(layers: list, row: tuple) -> list:
    """What each layer's trace needs beside its arrays, from a step's key without the owners
    (`step_inputs`'s first output): its position rule and cold codec, the selection's `Static`,
    the summaries' widths scanned, the hot window's length, the compute dtype, whether it evicts,
    whether the telemetry records (the picks' outputs).
    The solo step and serve's batched step (server/batch.py) build their traces from it."""
    compute, evicts, static, buckets, live, records = row[1], row[3], row[4], dict(row[5]), row[6], row[8]
    return [SimpleNamespace(positions=c.positions, codec=c.cold.codec, static=static,
                            rope=c.positions.rope if static.page_rule else None, buckets=buckets, live=live,
                            compute=compute, evicts=evicts, records=records) for c in layers]


def _retrieval_step_fn(model: Any, steps: dict, key: tuple, layers: list, traced_ring: Any = None):
    """The compiled steady step of retrieval for `key` = ("retrieval", owners, the sliding rings'
    layout (`_rings_ready`'s key: () without them), the compute dtype, the layers' config, whether
    the trace evicts, the selection's `Static`, the summaries' widths scanned, the hot window's
    length after the step, whether a sink is held, whether the telemetry records), made once per
    model and key over these retrieval `layers`' position rules (their RoPE: the model's). Beside
    sliding-window rings (Gemma 3's local layers) the trace steps them as the ring's compiled step
    does (`traced_ring`: compiled.py's `_TracedRing`), at their own position and pointer (`ring_at`)."""
    if key not in steps:
        owners, rings, specs = key[1], key[2], layer_specs(layers, key[:1] + key[3:])

        def traced_retrieval(at, inputs):
            # (the layers read one `at`: their turns are shared, `_turns`, and so is their offset)
            turns: dict = {"offset": at[AT_OFFSET]}
            return [_TracedRetrieval(specs[i], at, inputs[i], turns) for i in range(len(inputs))]

        if not rings:
            def step(tokens, at, inputs):
                traced = traced_retrieval(at, inputs)
                with rope_products.products(model, traced[0].offset):    # (the model's RoPE: products)
                    logits = model(tokens, cache=[traced[i] for i in owners])
                return logits, [t.outputs() for t in traced]
        else:
            ring_index, window, compute = rings

            def step(tokens, at, inputs, ring_at, ring_buffers):
                traced = traced_retrieval(at, inputs)
                ring_layers = [traced_ring(k, v, None, ring_at[1:2], ring_at[0], compute, window)
                               for k, v in ring_buffers]
                owned = iter(traced)
                ring_of = dict(zip(ring_index, ring_layers))
                layer = [ring_of[i] if i in ring_of else next(owned) for i in range(len(traced) + len(ring_layers))]
                with rope_products.products(model, traced[0].offset):
                    logits = model(tokens, cache=[layer[i] for i in owners])
                return logits, [t.outputs() for t in traced], [(t.keys, t.values) for t in ring_layers]
        steps[key] = mx.compile(step)
    return steps[key]


def _rings_ready(rings: list, plans: list) -> Optional[tuple]:
    """Beside retrieval's global layers, the sliding-window layers' rings (Gemma 3's local layers:
    exact rings of the model's window, no sink), planned as `plans`: where every one is steady as
    the ring's compiled step wants it (full, no re-base; compiled.py `_ready`), at one position
    and pointer, holding one window that the model's own sliding mask then leaves whole for one
    query (`RingLayer.sees_all`), (their window, the compute dtype, the write slot, their RoPE
    position); else None."""
    if any(c.compiles != "ring" for c in rings):
        return None
    first = rings[0]
    window, slot = first.sliding, first.body.write_slot
    for c, p in zip(rings, plans):
        if not (c.sliding == window and c.config.sink == 0 and c.dtype is not None
                and c.dtype == first.dtype and p.rebase == 0 and c.body.steady() and c.seen == first.seen
                and c.positions.base == first.positions.base and c.body.write_slot == slot and c.sees_all(window)):
            return None
    return window, first.dtype, slot, plans[0].offset


def rings_ready(cache: Any, plans: list) -> Optional[tuple]:
    """`_rings_ready` of a cache's sliding-window rings (`KVCache.ring_layout`), planned as
    `plans` (every owned layer's), split by what changes when: whether the rings are ready as one
    (each a ring of one window with no sink, which the model's mask leaves whole, holding a
    compute dtype, at one position, base and pointer) is decided by the full check only when the
    rings' shared count of changes has moved since it last ran (`RingStore.changes`: a chunk,
    a layout, a cut, a re-base, a load; the count and the verdict kept in `KVCache.rings_checked`),
    and kept while only decode steps' tokens come (every ring of the cache takes each alike);
    per step only what a step changes: the re-base due, whether the ring is full, its write slot,
    its RoPE position, read off the first ring. (window, compute dtype, write slot, RoPE position)
    or None. Whether the rings share a count at all is decided once (`KVCache.ring_changes`);
    without one the check runs every step."""
    index = cache.ring_layout[0]
    layers = cache.owned
    first, plan = layers[index[0]], plans[index[0]]
    if plan.rebase or not first.body.steady():
        return None
    counter = cache.ring_changes     # (decided when the cache was made)
    mark = counter[0] if counter is not None else None
    checked = cache.rings_checked
    if checked is None or checked[0] != mark or mark is None:
        ready = _rings_ready([layers[i] for i in index], [plans[i] for i in index]) is not None
        checked = cache.rings_checked = (mark, ready)
    if not checked[1]:
        return None
    return first.sliding, first.dtype, first.body.write_slot, plan.offset


def steady(layers: list, plans: list, ahead: bool = False) -> bool:
    """Whether the next decode step of these retrieval layers, planned as `plans`, is one the
    compiled step runs: every layer steady (`_retrieval_ready`) at one position, with one body
    layout, one cold count and one sticky state (one selection serves every layer), and no mask.
    Nothing is changed. The solo step (`decode`) and serve's batched step (server/batch.py) ask it;
    a sliding-window ring among `layers` is not one (the solo step steps those apart, `decode`).
    `ahead`: also a step `ready_ahead` makes steady (serve's batched step)."""
    if any(c.sliding is not None for c in layers):
        return False
    first = layers[0]
    body, cold = first.body, first.cold
    seen, base, start, head, n_body, n_cold, sticky = (first.seen, first.positions.base, first.start, body.head,
                                                       len(body), len(cold), cold.has_sticky())
    for c, p in zip(layers, plans):
        if not (_retrieval_ready(c, p, ahead) and c.seen == seen and c.positions.base == base and c.start == start
                and c.body.head == head and len(c.body) == n_body and len(c.cold) == n_cold
                and c.cold.has_sticky() == sticky):
            return False
    return first.make_mask(1, return_array=False, window_size=None) is None


def step_inputs(layers: list, plans: list, scratch: bool = False) -> tuple:
    """(the step's key without the owners, the step numbers `at`, each layer's input arrays, the
    plans to commit) of layers `steady` says are ready; a step that completes a page evicts
    eagerly first (`evict_ahead`, what the eager step does too), so its trace only reads the store;
    so does one whose plans evict nothing more (`ready_ahead` evicted already).
    The key: ("retrieval", the compute dtype, the layers' config, whether the trace evicts, the
    selection's `Static`, the summaries' widths scanned, the hot window's length after the step,
    whether a sink is held, whether the telemetry records).
    `scratch` (serve's batched step, server/batch.py): a step whose token was evicted eagerly is
    laid out as an evicting one all the same, so that its row shares the evicting rows' layout:
    its trace's eviction reads a live token of the body and writes it as the cold row just past
    the store's count (room made for it here), which no count reaches and the next eviction
    overwrites; the counts, the live window and the written token are those of the step that
    evicts nothing, and `commit` takes no eviction from it (its plan drops nothing)."""
    first = layers[0]
    body, cold = first.body, first.cold
    evicts = plans[0].drop > 0 and not cold.completes_page(plans[0].drop)
    if not evicts:      # the page's summaries are made eagerly, then the trace only reads the store
        plans = [c.evict_ahead(p) for c, p in zip(layers, plans)]
        if scratch:     # (the row past the count that the trace's eviction writes)
            for c in layers:
                c.cold.make_room()
    n_after = len(cold) + (1 if evicts else 0)
    slot = first.positions.retrieved_slot(first.n_sink, n_after)
    units, unit = cold.pick_units()
    static, _, buckets = cold.select_static(units, unit, first.positions)    # (the same in every layer)
    inputs = []
    for c in layers:
        summaries, keys, values, recent = c.cold.select_arrays(static)
        inputs.append({"body": c.body.buffers(), "sink": c.retrieval_sink(slot), "keys": keys, "values": values,
                       "summaries": summaries, "recent": recent if recent is not None else mx.zeros((1,), mx.int32)})
    row = ("retrieval", first.dtype, first.config, evicts or scratch, static, tuple(sorted(buckets.items())),
           len(body) + (0 if evicts else 1), bool(inputs[0]["sink"]), any(c.telemetry.on for c in layers))
    head = body.head
    # (the two angles turn keys and the query on frame positions; at original positions none)
    turns = ([first.positions.base - first.start, -(first.sink_slot_during(plans[0]) + slot)]
             if first.positions.frame else [0, 0])
    at = [plans[0].offset, head, head + len(body), head + (1 if evicts else 0), len(cold),
          n_after, n_after // cold.page_size, cold.index.n_blocks, *turns]
    return row, at, inputs, plans


def decode(model: Any, tokens: mx.array, cache: Any, plans: list, owners: tuple, steps: dict, failed_mark: Any,
           failed: Callable[[dict, Any, BaseException], None], traced_ring: Any = None) -> Optional[mx.array]:
    """compiled.py's `decode` for retrieval on the device (`_retrieval_ready`), or None where the
    step cannot run compiled: the body's buffers, the placed sink and the cold store's arrays go
    in, the written buffers and the picks come out, and each layer's commit, sticky pages and
    (where asked) telemetry follow eagerly (`commit`). `steps` holds the model's compiled
    steps; an entry `failed_mark` is a layout whose trace failed, `failed(steps, key, error)`
    marks one; `traced_ring` steps sliding-window rings beside (compiled.py's `_TracedRing`);
    `cache` the `KVCache` (its owned layers, planned as `plans`)."""
    layers = cache.owned
    ring_index = ()
    rings, ring_plans, ring_state = [], [], None
    if cache.ring_layout is not None:      # sliding-window rings beside the retrieval layers (`rings_ready`)
        ring_index, kept = cache.ring_layout
        ring_state = rings_ready(cache, plans) if traced_ring is not None else None
        if ring_state is None:
            return None
        rings, ring_plans = [layers[i] for i in ring_index], [plans[i] for i in ring_index]
        layers, plans = [layers[i] for i in kept], [plans[i] for i in kept]
    if not steady(layers, plans):
        return None
    row, at, inputs, plans = step_inputs(layers, plans)
    key = row[:1] + (owners, (ring_index, *ring_state[:2]) if ring_index else ()) + row[1:]
    step = steps.get(key)
    if step is failed_mark:
        return None
    if step is None:
        step = _retrieval_step_fn(model, steps, key, layers, traced_ring)
    args = (tokens, mx.array(at, mx.int32), inputs)
    if ring_index:
        args += (mx.array([ring_state[3], ring_state[2]], mx.int32), [c.body.buffers() for c in rings])
    try:
        logits, outs, *ring_outs = step(*args)
    except Exception as e:     # as in `decode`: eager from now on for this layout (an eviction ahead is the eager one)
        failed(steps, key, e)
        return None
    for c, p, out in zip(layers, plans, outs):
        commit(c, p, out)
    for c, p, (k, v) in zip(rings, ring_plans, ring_outs[0] if ring_outs else ()):
        c.commit(p, None, None, written=(k, v, None))      # (the ring's compiled step's commit, compiled.py)
    return logits


def commit(layer: Any, plan: Any, out: dict) -> None:
    """One layer's eager part after a compiled retrieval step (the solo step's or serve's batched
    one, server/batch.py), from the trace's `out`puts: its commit of `plan` (`LayerCache.took_step`),
    the next pass's sticky pages (the last of `out["picked"]`) and, only where the telemetry
    records (`KVCache.record_retrievals`), its record of the pick (`DeviceColdStore.picked`:
    then `out["picked"]` holds the selection's five outputs)."""
    layer.took_step(plan, out["body"], out.get("evicted") if plan.drop else None)   # (`step_inputs`' scratch: none)
    picked = out["picked"]
    layer.cold.keep_sticky(picked[-1])
    if layer.telemetry.on:
        layer.telemetry.record(layer.cold.picked(*picked))
