"""A decode step over full StreamingLLM caches (the exact ring, and KIVI's quiet steps) and over
a full KIVI cache's quiet steps as one compiled MLX function.

Once every layer's ring (ring.py) holds its whole window, a decode step has fixed shapes: the
buffers [B, H, S + W, D] do not grow, the new token is written in place at the ring's pointer
and the one query attends over the buffer as it lies. What changes from step to step (the
pointer, the RoPE position, in shifted mode the sink's placed rows) can be handed over as
arrays, so the model's whole step, its projections, RoPE, the ring writes, attention and the
MLP, is traced once by `mx.compile` and replayed: MLX fuses the element-wise work of the trace
into a few kernels and skips building the graph in Python each step. mlx-lm's caches keep their
state in Python integers (slicing by `offset` and `_idx`), which a trace would freeze, so a step
over them cannot be compiled; ours can.

KIVI under StreamingLLM on frame positions (kivi.py) gets the same for its quiet steps, with
its window full or still filling (since session 46; before, only once a block was evicted): the
steps that neither freeze a block, evict one, grow the residual's buffer nor re-base (G - 1 of
every G here). The trace (`_TracedKivi`) takes the placed sink
and the packed blocks as `LayerCache.segments` would hand them to attention, the residual as its
whole buffers, and builds the step's mask from arrays (`_quiet_mask`: the residual's dead slots
and the body's tokens the window no longer shows masked, `Masks.make`'s rule), computes what
`segments.attend` would over those segments (the same products in the same order, the query
group kept as rows: fewer nodes to replay), and writes the new token into the residual's buffer
(in the trace, at an array index). Its shapes are the buffers' size and the packed run's length, not the residual's
live tokens, so a trace serves every quiet step between two freezes (a few traces in all, each
a few ms; it was one per residual length, about 2G). While the window fills, the packed run
grows by a block every G steps, as a full cache's does: about window / G lengths before
the first eviction, each traced once, so a few traces more (tests/test_server_kivi_fill.py bounds them). A full KIVI cache (no window) runs the same
trace for its quiet steps (G - 1 of every G), without a sink segment: its exact first tokens are
read with the residual from their copy in its buffers, as its eager step reads them
(`KiviStore.segments_led`), and nothing is masked but the buffers' dead slots. Its packed run
grows by a block every G steps, so each trace serves G - 1 steps and is then dropped
(`_kivi_decode`).

`decode(model, tokens, cache)` runs such a step when the cache and model allow it and returns
None otherwise (the caller then runs the eager model call, `generate.forward`). A KIVI quiet
step meets a new shape only after an eager step (a block frozen or evicted): `prepare`, called
after it, traces the next quiet step's shapes there, so the quiet steps replay traces. It traces the
model's own `__call__` with stand-in layer caches (`_TracedRing`, `_TracedKivi`) that follow the same
protocol as `LayerCache` (offset, make_mask, update_and_fetch, attend): the same code path as
eager, so the two agree to the last bit here (tests/test_compiled.py). The layers' plans
(cache/plan.py) decide whether the step can run (no eviction of a KIVI block, no re-base due) and
give the position it takes; afterwards each layer runs the same `commit` of its plan as the eager
step, with the token the trace wrote into its buffers (the store's `took`). Anything else runs
eager: a ring that is not full yet, a re-base due, a chunk of several tokens, other policies (a
cache's `compiled_step`, decided when it is made), a model sharded over ranks. Retrieval on the
device (kind "retrieval") has its own traced layer and step in compiled_retrieval.py. The trace reads
only what the stores expose for it (`RingStore.steady`/`write_slot`/`buffers`,
`KiviStore.quiet`/`layout`/`step_inputs`). An mlx-lm model is traced the same way (its code sees the position as an
array, as `mx.fast.rope` takes it); one whose code needs it as a Python number, or reads
something else of its cache, fails in the trace, before anything is changed, and runs eager from
then on. One switch turns it off: `cache.compile_decode = False`, whose default
`POSTTRAINLLM_COMPILE=0` in the environment sets (`kv_cache.compile_by_default`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import mlx.core as mx

from .. import attention, quant
from ..model import Model
from . import compiled_retrieval, spill_stage
from .packed import PackedRun, rotation, rotation_back
from .segments import attend_exact_one

#: the compiled steps of a model, by the layout of the caches they trace (see `_step_fn`)
_ATTR = "_posttrainllm_compiled_steps"


class _TracedRing:
    """One layer's ring during the trace: its buffers and the step's inputs as arrays."""

    reads_own_segments = True     # attention.scaled_dot_product_attention calls `attend`

    def __init__(self, keys: mx.array, values: mx.array, sink_rows: Optional[mx.array], slot: mx.array,
                 offset: mx.array, compute_dtype: mx.Dtype, unmasked_within: Optional[int] = None):
        self.keys, self.values, self.sink_rows = keys, values, sink_rows
        self.slot, self.offset, self.compute_dtype = slot, offset, compute_dtype
        #: a ring without a sink holds only its last `window` positions: a model's sliding-window
        #: mask at least that wide masks nothing (RingLayer.sees_all); None: any such mask would
        self.unmasked_within = unmasked_within

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None and (self.unmasked_within is None or window_size < self.unmasked_within):
            raise ValueError("a windowed mask is not traced")   # eager builds it
        return None     # one query over a full ring sees every stored token (a sliding layer's ring too)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        dtype = self.keys.dtype
        self.keys = mx.slice_update(self.keys, keys.astype(dtype), self.slot, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(dtype), self.slot, axes=(2,))
        if self.sink_rows is not None:      # shifted mode: the sink placed for this step's query
            self.keys[..., :self.sink_rows.shape[2], :] = self.sink_rows
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        k, v = self.keys, self.values
        if k.dtype != self.compute_dtype:
            k, v = k.astype(self.compute_dtype), v.astype(self.compute_dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


#: a model's entry for a layout whose trace failed (module doc): it runs eager
_FAILED = "failed"
#: every trace failure in this process, (layout, error), each also logged once: a fallback is
#: counted, never silent, and the tests fail on any (tests/conftest.py)
trace_failures: list[tuple[Any, str]] = []
log = logging.getLogger("posttrainllm.compiled")


def _failed(steps: dict, key: Any, error: BaseException) -> None:
    """Mark `key`'s layout eager from now on, count and log why."""
    steps[key] = _FAILED
    trace_failures.append((key, repr(error)))
    log.warning("compiled decode step: tracing layout %r failed (%r); it runs eager from now on", key, error)


class _TracedKivi:
    """One layer of KIVI under StreamingLLM (frame positions), or of a full KIVI cache, during the
    trace of a quiet step (no block frozen or evicted): the sink placed (a full cache: none, its
    exact first tokens being in the residual's buffers), the packed blocks, the near tier's
    blocks if it holds any, and the residual's whole buffers as inputs, and the step's mask over them
    (`_quiet_mask`: the residual's slots outside its live tokens and the new one masked, as are
    the body's tokens the window no longer shows), so every quiet step of one buffer size and
    one packed length replays one trace. The new token is written into the residual's buffer at
    `slot`, in the trace, so the buffers come out with the logits (evaluated with them, on the
    thread that steps)."""

    reads_own_segments = True

    def __init__(self, sink: tuple, packed: tuple, near: tuple, buffers: tuple, slot: mx.array,
                 mask: mx.array, offset: mx.array, config: Any, storage: mx.Dtype,
                 compute_dtype: mx.Dtype):
        self.sink, self.packed, self.near, self.buffers, self.mask = sink, packed, near, buffers, mask
        self.slot, self.offset, self.config = slot, offset, config
        self.storage, self.compute_dtype = storage, compute_dtype

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:
            raise ValueError("a windowed mask is not traced")
        return self.mask      # the step's, over every segment's slots (`_quiet_mask`)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        new = (keys.astype(self.storage), values.astype(self.storage))
        self.buffers = tuple(mx.slice_update(b, n, self.slot, axes=(2,)) for b, n in zip(self.buffers, new))
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """`segments.attend` over the sink, the packed run (and the near tier) and the residual's
        written buffers (so they are part of the logits' graph, their dead slots masked), for the
        one query of a decode step: the same products in the same order, with a KV head's query
        group kept as rows [B, Hkv, rep, D] throughout (no reshape per segment: a fifth fewer
        nodes for the trace to replay every step)."""
        cfg = self.config
        runs = [PackedRun.of(*self.packed, cfg)] if self.packed else []    # (none before a block froze: serve's batch)
        if self.near:     # the near tier, as the eager step reads it (packed.FrozenTiers.segments)
            runs.append(PackedRun.of(*self.near, cfg, near=True))
        dt, f32 = self.compute_dtype, mx.float32
        res_k, res_v = (b.astype(dt).astype(f32) for b in self.buffers)
        sink_k, sink_v = (a.astype(f32) for a in self.sink) if self.sink else (None, None)
        B, Hq, L, D = queries.shape
        hkv = res_k.shape[1]
        if not runs:        # nothing frozen yet: exact segments only, as the eager step reads them
            return self._attend_exact(queries, scale, (sink_k, sink_v), (res_k, res_v))
        rows = ((queries if queries.dtype == f32 else queries.astype(f32)) * scale).reshape(B, hkv, Hq // hkv * L, D)
        turned = rows @ rotation(D) if any(r.rotate and r.key_bits for r in runs) else None
        scores = [rows @ sink_k.swapaxes(-1, -2)] if self.sink else []
        for r in runs:
            if r.key_bits:
                scores.append(quant.quantised_matmul(turned if r.rotate else rows, *r.keys, bits=r.key_bits,
                                                     group=r.group, path=r.path))
            else:
                scores.append(rows @ r.keys[0].astype(f32).swapaxes(-1, -2))
        scores.append(rows @ res_k.swapaxes(-1, -2))
        sizes = [sc.shape[-1] for sc in scores]
        probs = mx.softmax(mx.where(self.mask, mx.concatenate(scores, axis=-1), -mx.inf), axis=-1)
        pieces, start = [], 0
        for n in sizes:
            pieces.append(probs[:, :, :, start:start + n])
            start += n
        out = pieces[0] @ sink_v if self.sink else None
        in_basis = None     # the outputs of the runs whose values are stored rotated, summed
        for r, p in zip(runs, pieces[1 if self.sink else 0:-1]):
            if r.value_bits:
                part = quant.quantised_matmul(p, *r.values, bits=r.value_bits, group=r.value_group, path=r.path)
                if r.rotate:
                    in_basis = part if in_basis is None else in_basis + part
                    continue
            else:
                part = p @ r.values[0].astype(f32)
            out = part if out is None else out + part
        part = pieces[-1] @ res_v
        out = part if out is None else out + part
        if in_basis is not None:
            out = out + in_basis @ rotation_back(D)
        out = out.reshape(B, Hq, L, -1)
        return out if out.dtype == queries.dtype else out.astype(queries.dtype)


    def _attend_exact(self, queries: mx.array, scale: float, sink: tuple, res: tuple) -> mx.array:
        """`attend` before any block froze (a full KIVI cache's first steps, in serve's batched
        step): the sink (if any) and the residual's buffers, exact, in the eager step's one-query
        form over exact segments (segments.py `attend_exact_one`, which `_attend_one` runs too:
        the scale applied to the joined scores, the values joined and one product), the buffers'
        dead slots masked, so the row agrees with its eager step to the last bit."""
        parts = [sink, res] if self.sink else [res]
        return attend_exact_one([k for k, _ in parts], [v for _, v in parts], queries, scale, self.mask)


def _tokens(side: tuple) -> int:
    """Tokens a packed run holds, from its arrays' shapes: its values keep one row per token
    (packed per token, or exact), along their next-to-last axis."""
    return side[1][0].shape[-2]


def _quiet_mask(n_sink: int, packed: tuple, near: tuple, buffers: tuple, first: mx.array, last: mx.array,
                cut: mx.array) -> mx.array:
    """A quiet step's mask [1, sink + frozen + buffer slots] over the segments `_TracedKivi`
    reads: the sink seen; of the body's frozen tokens the j-th seen where j >= `cut` (the
    window's first, `Masks.make`'s rule); of the residual's buffer the slots `first` .. `last`
    (its live tokens the window still shows, then the new one's; `_kivi_decode`), no other.
    Every number that moves between traces comes in as an array: a Python number here would be
    a constant of MLX's fused kernel, compiled anew (g++ on a CPU, about a second) for each value."""
    frozen = (_tokens(packed) if packed else 0) + (_tokens(near) if near else 0)
    slots = mx.arange(buffers[0].shape[2], dtype=mx.int32)
    live = (slots >= first) & (slots <= last)
    return mx.concatenate([mx.ones((n_sink,), mx.bool_), mx.arange(frozen, dtype=mx.int32) >= cut, live])[None]


def _retrieval_decode(model: Any, tokens: mx.array, cache: Any, plans: list, owners: tuple, steps: dict
                      ) -> Optional[mx.array]:
    """`decode` for retrieval on the device (compiled_retrieval.py), with this module's failure rule
    and its traced ring (sliding-window rings beside retrieval's layers: Gemma 3's local layers)."""
    return compiled_retrieval.decode(model, tokens, cache, plans, owners, steps, _FAILED, _failed, _TracedRing)


def _traceable(model: Any, steps: dict) -> bool:
    """The native model or a routed mlx-lm model, not sharded over ranks (its projections
    all-sum: not traced here); decided once per model."""
    if "traceable" not in steps:
        sharded = any("Sharded" in type(m).__name__ for _, m in model.named_modules())
        steps["traceable"] = not sharded and (type(model) is Model or attention.routes(model))
    return steps["traceable"]


def _ready(layer: Any, plan: Any) -> bool:
    """Whether this ring layer's next decode step, planned as `plan`, is the ring's steady hot
    path: a full ring (the step evicts its oldest window token and writes over it), no re-base."""
    return layer.dtype is not None and plan.rebase == 0 and layer.body.steady()


def _kivi_ready(layer: Any, plan: Any, unpacked: bool = False) -> bool:
    """Whether this layer's next decode step (KIVI under StreamingLLM on frame positions, or a
    full KIVI cache: the layer's `compiles`), planned as `plan`, is a quiet step: the sink full
    (under StreamingLLM the placed sink; in a full cache its exact first tokens all held,
    `exact_prefix`); and neither a block to evict before the token (`plan.drop`) nor one to
    freeze after it, nor a residual buffer to grow (`KiviStore.quiet`), nor a re-base. Under
    StreamingLLM also while the window fills (nothing evicted yet, session 46): the step's shapes
    are the residual's buffers and the packed run's length, which grows by G every G steps as a
    full cache's does, about window / G lengths before the first eviction, each traced once,
    so a filling window's quiet steps
    replay a few traces, not one per step (the residual's live tokens are masked, not shapes).
    `unpacked`: also before any block froze (a full cache's or a filling window's first steps:
    serve's batched step, server/batch.py; the solo step runs those eager); under StreamingLLM
    only while the window shows every body token (a window shorter than R + G can hold more
    before its first freeze: its eager step reads them under the window's mask, in
    `segments.attend`'s masked form, not the one-query form the trace's exact attention shares
    with the unmasked eager step, `_TracedKivi._attend_exact`, so the two would differ in the
    last bits)."""
    if plan.drop or plan.rebase or layer.dtype is None or len(layer.sink_store) != layer.config.held_sink:
        return False
    if unpacked and layer.config.streaming and layer.seen - plan.first >= layer.config.window:
        unpacked = False
    return layer.body.quiet(unpacked)


def _kivi_step_fn(model: Any, steps: dict, key: tuple):
    """The compiled quiet step of KIVI (under StreamingLLM, or a full cache) for `key` = ("kivi",
    owners, compute dtype, storage, the layers' config, whether the near tier holds tokens); MLX
    traces it again for each new set of input shapes (a residual buffer's size, the packed run's
    length)."""
    if key not in steps:
        _, owners, compute_dtype, storage, config, _ = key

        def step(tokens, offset, sinks, packed, nears, buffers, first, slot, cut):
            n_sink = sinks[0][0].shape[2] if sinks[0] else 0
            mask = _quiet_mask(n_sink, packed[0], nears[0], buffers[0], first, slot, cut)
            traced = [_TracedKivi(sinks[i], packed[i], nears[i], buffers[i], slot, mask, offset, config,
                                  storage, compute_dtype) for i in range(len(sinks))]
            logits = model(tokens, cache=[traced[i] for i in owners])
            return logits, [t.buffers for t in traced]
        steps[key] = mx.compile(step)
    return steps[key]


def _step_fn(model: Any, steps: dict, key: tuple):
    """The compiled step for caches laid out as `key` = (owners: for each model layer, the
    index of the distinct layer cache it uses; shifted; the compute dtype; the widest sliding
    mask that masks nothing, `_TracedRing.unmasked_within`), made once per model and layout."""
    if key not in steps:
        owners, shifted, compute_dtype, unmasked = key

        def step(tokens, offset, slot, buffers, sink_rows):
            traced = [_TracedRing(k, v, sink_rows[i] if shifted else None, slot, offset, compute_dtype, unmasked)
                      for i, (k, v) in enumerate(buffers)]
            logits = model(tokens, cache=[traced[i] for i in owners])
            return logits, [(t.keys, t.values) for t in traced]
        # the weights are closed over (constants of the trace), not `inputs=model.state`: MLX
        # swaps declared inputs for tracers while tracing and does not swap them back when the
        # trace raises, which would leave the model unusable for the eager fallback
        steps[key] = mx.compile(step)
    return steps[key]


def forget(model: Any) -> None:
    """Drop `model`'s compiled steps: they hold its weights as they were when traced, so a model
    whose parameters are replaced afterwards (nothing in this tool does) must call this."""
    _steps_of(model).clear()


def _steps_of(model: Any) -> dict:
    steps = getattr(model, _ATTR, None)
    if steps is None:
        steps = {}
        object.__setattr__(model, _ATTR, steps)    # not a parameter: nn.Module's setattr would keep it
    return steps


def decode(model: Any, tokens: mx.array, cache: Any) -> Optional[mx.array]:
    """One decode step ([B, 1] tokens) as a compiled function, or None where it cannot run
    (module doc); the logits [B, 1, vocab] otherwise, the cache advanced by one token. A cache
    that compiles no step but holds spilled cold rows runs its step with them staged ahead
    where it can (spill_stage.py: eager, one bulk copy and one wait per step)."""
    kind = getattr(cache, "compiled_step", None)   # decided when a KVCache is made (kv_cache.py)
    if kind is None:
        return spill_stage.decode(model, tokens, cache) if getattr(cache, "stage_spills", False) else None
    if not cache.compile_decode or tokens.ndim != 2 or tokens.shape[1] != 1:
        return None
    steps = _steps_of(model)
    if not _traceable(model, steps):
        return None
    layers = cache.owned
    index = {id(c): i for i, c in enumerate(layers)}
    owners = tuple(index[id(c)] for c in cache)
    plans = [c.plan() for c in layers]      # the step's plans: the trace's inputs, then its commits
    if kind == "kivi":
        if all(_kivi_ready(c, p) for c, p in zip(layers, plans)):
            return _kivi_decode(model, tokens, layers, plans, owners, steps)
        return None
    if kind == "retrieval":
        return _retrieval_decode(model, tokens, cache, plans, owners, steps)
    if not all(_ready(c, p) for c, p in zip(layers, plans)):
        return None
    first = layers[0]
    slot = first.body.write_slot
    if any(c.seen != first.seen or c.body.write_slot != slot or c.positions.base != first.positions.base
           for c in layers):
        return None     # one position and one pointer serve every layer in the trace
    shifted = first.positions.frame and first.config.sink > 0   # (a steady ring holds its whole sink)
    # every ring has one window and sink here (one pointer and one position serve them all)
    key = (owners, shifted, first.dtype, first.config.window if first.config.sink == 0 else None)
    if steps.get(key) is _FAILED:
        return None
    first_slot = first.sink_slot_during(plans[0])   # the same in every layer (one seen, base and ring)
    buffers = [c.body.buffers() for c in layers]
    rows = [c.body.placed_sink(first_slot) for c in layers] if shifted else []   # may advance a block
    step = _step_fn(model, steps, key)
    try:
        logits, new = step(tokens, mx.array(plans[0].offset, mx.int32), mx.array([slot], mx.int32),
                           buffers, rows)
    except Exception as e:
        # the model's code cannot be traced (module doc): this layout runs eager from now on,
        # where a real error shows itself. No counter has moved (a shifted sink block may have
        # been advanced to this step's slot, as the eager step would advance it).
        _failed(steps, key, e)
        return None
    for c, p, (k, v) in zip(layers, plans, new):      # the eager step's commit, the token written
        c.commit(p, None, None, written=(k, v, first_slot if shifted else None))
    return logits


def _kivi_decode(model: Any, tokens: mx.array, layers: list, plans: list, owners: tuple, steps: dict
                 ) -> Optional[mx.array]:
    """`decode` for KIVI's quiet steps (`_kivi_ready`): the segments' arrays go in as the eager
    step would read them (`KiviStore.step_inputs`; under StreamingLLM the placed sink,
    `LayerCache.placed_sink`), the residual as its whole buffers with the step's mask
    (`_quiet_mask`); the new tokens come out written into the buffers and join each residual,
    eagerly. A full KIVI cache reads its exact first tokens with the residual, from their copy in
    the residual's buffers (`KiviStore.segments_led`, as its eager step does), and sees every
    stored token. Its packed run only grows (by G every G steps), so a trace of an older length
    is never replayed again: the compiled function is made anew when the frozen tokens change,
    which lets MLX drop the old one's traces (one kept, not one per block frozen)."""
    call = _kivi_call(model, layers, plans, owners, steps)
    if call is None:
        return None
    key, step, args = call
    try:
        logits, new = step(tokens, *args)
    except Exception as e:     # as in `decode`: eager from now on for this layout; nothing has moved
        _failed(steps, key, e)
        return None
    for c, p, (k, v) in zip(layers, plans, new):    # the eager step's commit (nothing frozen), the token written
        c.commit(p, None, None, written=(k, v))
    return logits


def kivi_layout(layers: list) -> Optional[tuple]:
    """The body layout every layer shares for KIVI's quiet step, (packed tokens, frozen held,
    first buffer slot read, tokens read there), or None where the layers differ (then the step
    runs eager). Also serve's batched step's (server/batch.py)."""
    first = layers[0]
    full = not first.config.streaming
    leads = [c.sink_store if full else None for c in layers]
    layout = first.body.layout(leads[0])
    if layout is None or any(c.seen != first.seen or c.positions.base != first.positions.base
                             or c.body.layout(lead) != layout for c, lead in zip(layers, leads)):
        return None
    return layout


def kivi_inputs(layers: list, plans: list, layout: tuple) -> tuple:
    """What KIVI's quiet step reads of the layers for the next token, planned as `plans` with
    `layout` (`kivi_layout`): (RoPE position, the sinks, packed runs, near tiers and residual
    buffers per layer, the first residual slot read, the new token's slot, the body's tokens
    the window no longer shows), the numbers as Python ints. Also serve's batched step's."""
    first = layers[0]
    full = not first.config.streaming
    n_packed, held, head, n_res = layout
    # the body's tokens the query no longer sees (mask.py: position first + j, the query's `seen`)
    cut = 0 if full else max(0, first.seen - plans[0].first - first.config.window + 1)
    sinks, packed, nears, buffers = [], [], [], []
    for c in layers:
        # no sink segment in a full cache, nor under StreamingLLM without a sink (an empty store
        # holds no arrays: a window that never evicted, since session 46's filling steps)
        sinks.append(() if full or not len(c.sink_store) else c.placed_sink())
        p, n, r = c.body.step_inputs(c.sink_store if full else None)
        packed.append(p)
        nears.append(n)
        buffers.append(r)
    # the residual's slots read: from its first live token the window shows (frozen tokens
    # before it: `held`) to the new token's, written at `slot`
    return plans[0].offset, sinks, packed, nears, buffers, head + max(0, cut - held), head + n_res, cut


def _kivi_call(model: Any, layers: list, plans: list, owners: tuple, steps: dict) -> Optional[tuple]:
    """(layout key, compiled function, its inputs but the tokens) for KIVI's quiet step planned
    as `plans`, or None where it cannot run compiled (`_kivi_decode`)."""
    first = layers[0]
    full = not first.config.streaming
    layout = kivi_layout(layers)
    if layout is None:
        return None
    n_packed, held, head, n_res = layout
    key = ("kivi", owners, first.dtype, first.body.storage, first.config, held > n_packed)
    step = steps.get(key)
    if step is _FAILED:
        return None
    if full and steps.get(("kivi frozen", key[:-1])) != (n_packed, held):
        for near in (False, True):      # (the traces without the near tier go too, once it holds tokens)
            steps.pop(key[:-1] + (near,), None)
            steps.pop(("kivi traced", key[:-1] + (near,)), None)
        steps[("kivi frozen", key[:-1])] = (n_packed, held)
        step = None
    if step is None:
        step = _kivi_step_fn(model, steps, key)
    offset, sinks, packed, nears, buffers, read_from, slot, cut = kivi_inputs(layers, plans, layout)
    return key, step, (mx.array(offset, mx.int32), sinks, packed, nears, buffers,
                       mx.array(read_from, mx.int32), mx.array(slot, mx.int32), mx.array(cut, mx.int32))


def shape_key(tree: Any) -> Any:
    """What MLX traces a compiled function anew for: the shapes and dtypes of the arrays in
    nested tuples, lists and dicts, other arguments as they are (`prepare`; serve's batched
    steps, server/batch.py)."""
    if isinstance(tree, mx.array):
        return (tuple(tree.shape), tree.dtype)
    if isinstance(tree, (tuple, list)):
        return tuple(shape_key(t) for t in tree)
    if isinstance(tree, dict):
        return tuple((k, shape_key(v)) for k, v in tree.items())
    try:
        hash(tree)
        return tree
    except TypeError:
        return repr(tree)


def prepare(model: Any, tokens: mx.array, cache: Any) -> bool:
    """After an eager decode step of a cache whose quiet steps run compiled (KIVI's: a block
    frozen or evicted, a re-base): where the next step is a quiet one whose shapes its compiled
    function has not been traced for yet, trace it now, in this step, with the next step's inputs
    (its token a stand-in: a trace depends on shapes, not values), its outputs dropped
    unevaluated, nothing committed. A new shape comes only after such a step (the packed run
    changes at a freeze or an eviction, the residual's buffers at a freeze), so the quiet steps
    replay traces and the trace's cost (a few ms) joins a step that is slow anyway instead of
    making a quiet one slow. True where it traced.

    First, under StreamingLLM, the blocks that no longer fit the window are evicted now
    (`evict_middle_if_needed`: what the next step's plan would evict before its attention
    anyway, so it attends the same tokens): after a prompt, the first step freezes the prompt's
    blocks (KIVI keeps a chunk exact until the next append) and the next would evict most of
    them, eagerly; evicted here, that next step is a quiet one. This happens with the steps
    compiled or not (`compile_decode`), so what the cache holds between steps, and so what a
    prompt-cache file or checkpoint saves, does not depend on it."""
    if getattr(cache, "compiled_step", None) != "kivi" or tokens.ndim != 2 or tokens.shape[1] != 1:
        return False
    if cache.config.streaming:      # compiled or not: the cache holds the same between steps
        cache.evict_middle_if_needed()
    if not cache.compile_decode:
        return False
    steps = _steps_of(model)
    if not _traceable(model, steps):
        return False
    layers = cache.owned
    plans = [c.plan() for c in layers]
    if not all(_kivi_ready(c, p) for c, p in zip(layers, plans)):
        return False
    index = {id(c): i for i, c in enumerate(layers)}
    call = _kivi_call(model, layers, plans, tuple(index[id(c)] for c in cache), steps)
    if call is None:
        return False
    key, step, args = call
    token = mx.zeros(tokens.shape, tokens.dtype)
    held = steps.get(("kivi traced", key))      # (the function, the input shapes traced here)
    if held is None or held[0] is not step:
        held = steps[("kivi traced", key)] = (step, set())
    seen = held[1]
    shapes = shape_key((token, args))
    if shapes in seen:
        return False
    try:
        step(token, *args)
    except Exception as e:     # as in `decode`: eager from now on for this layout
        _failed(steps, key, e)
        return False
    seen.add(shapes)
    return True
