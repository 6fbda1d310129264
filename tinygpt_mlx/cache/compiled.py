"""A decode step over full StreamingLLM caches (the exact ring, and KIVI's quiet steps) as one
compiled MLX function.

Once every layer's ring (ring.py) holds its whole window, a decode step has fixed shapes: the
buffers [B, H, S + W, D] do not grow, the new token is written in place at the ring's pointer
and the one query attends over the buffer as it lies. What changes from step to step (the
pointer, the RoPE position, in shifted mode the sink's placed rows) can be handed over as
arrays, so the model's whole step, its projections, RoPE, the ring writes, attention and the
MLP, is traced once by `mx.compile` and replayed: MLX fuses the element-wise work of the trace
into a few kernels and skips building the graph in Python each step. mlx-lm's caches keep their
state in Python integers (slicing by `offset` and `_idx`), which a trace would freeze, so a step
over them cannot be compiled; ours can.

KIVI under StreamingLLM on frame positions (kivi.py) gets the same for its quiet steps, once
the window is full: the steps that neither freeze a block, evict one, grow the residual's
buffer nor re-base (G - 1 of every G here). The trace (`_TracedKivi`) takes the placed sink,
the packed blocks, the residual and the step's mask as `LayerCache.segments` and `make_mask`
would hand them to attention, runs the same `segments.attend`, and hands the new token back to
be written into the residual's buffer (in the trace, at an array index). Its shapes repeat every G steps, so each of the ~2G shapes
is traced once (a few ms each) and reused; while the body still grows every step would be a new
shape, so those steps stay eager.

`decode(model, tokens, cache)` runs such a step when the cache and model allow it and returns
None otherwise (the caller then runs the eager model call, `generate.forward`). It traces the
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
from types import SimpleNamespace
from typing import Any, Optional

import mlx.core as mx

from .. import attention
from ..model import Model
from . import compiled_retrieval
from .packed import PackedRun, PackedSegment
from .segments import DenseSegment, attend

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
    """One layer of KIVI under StreamingLLM (frame positions) during the trace of a quiet step
    (no block frozen or evicted): the sink placed, the packed blocks, the near tier's blocks if
    it holds any, and the residual (its buffer and its live tokens) as inputs; the new token is written into the residual's buffer
    at `slot`, in the trace, so the buffer comes out with the logits (evaluated with them, on
    the thread that steps)."""

    reads_own_segments = True

    def __init__(self, sink: tuple, packed: tuple, near: tuple, residual: tuple, head: mx.array, slot: mx.array,
                 mask: Optional[mx.array],
                 offset: mx.array, config: Any, positions: Any, storage: mx.Dtype, compute_dtype: mx.Dtype):
        self.sink, self.packed, self.near, self.mask = sink, packed, near, mask
        self.buffers, self.live = residual[:2], residual[2:]
        self.head, self.slot, self.offset, self.config, self.positions = head, slot, offset, config, positions
        self.storage, self.compute_dtype = storage, compute_dtype
        self.new: Optional[tuple] = None

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:
            raise ValueError("a windowed mask is not traced")
        return self.mask      # `LayerCache.make_mask`'s, made before the step

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.new = (keys.astype(self.storage), values.astype(self.storage))
        self.buffers = tuple(mx.slice_update(b, n, self.slot, axes=(2,)) for b, n in zip(self.buffers, self.new))
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        cfg = self.config
        body = [PackedSegment(PackedRun.of(*self.packed, cfg), self.positions)]
        if self.near:     # the near tier, as the eager step reads it (packed.FrozenTiers.segments)
            body.append(PackedSegment(PackedRun.of(*self.near, cfg, near=True), self.positions))
        # the live tokens and the new one, read back from the written buffers (so the buffers are
        # part of the logits' graph); the live views' shapes give the length, a shape of the trace
        res_k, res_v = (mx.slice(b, self.head, (2,), (*live.shape[:2], live.shape[2] + 1, live.shape[3]))
                        for b, live in zip(self.buffers, self.live))
        dt = self.compute_dtype
        segments = [DenseSegment(*self.sink), *body, DenseSegment(res_k.astype(dt), res_v.astype(dt))]
        return attend(segments, 0, queries, scale, mask)


def _retrieval_decode(model: Any, tokens: mx.array, layers: list, plans: list, owners: tuple, steps: dict
                      ) -> Optional[mx.array]:
    """`decode` for retrieval on the device (compiled_retrieval.py), with this module's failure rule."""
    return compiled_retrieval.decode(model, tokens, layers, plans, owners, steps, _FAILED, _failed)


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


def _kivi_ready(layer: Any, plan: Any) -> bool:
    """Whether this layer's next decode step (KIVI under StreamingLLM on frame positions, the
    layer's `compiles`), planned as `plan`, is a quiet step: the window full (blocks evicted
    before), the sink full, and neither a block to evict before the token (`plan.drop`) nor one
    to freeze after it, nor a residual buffer to grow (`KiviStore.quiet`), nor a re-base."""
    # only once the window is full and blocks are evicted: then the step's shapes come back every
    # G steps and each trace is reused; while the body grows every step would be a new trace
    return (plan.drop == 0 and plan.rebase == 0 and layer.dtype is not None and layer.start > layer.config.sink
            and len(layer.sink_store) == layer.config.sink and layer.body.quiet())


def _kivi_step_fn(model: Any, steps: dict, key: tuple):
    """The compiled quiet step of KIVI under StreamingLLM for `key` = ("kivi", owners, masked,
    compute dtype, storage, the layers' config, whether the near tier holds tokens)."""
    if key not in steps:
        _, owners, masked, compute_dtype, storage, config, _ = key
        positions = SimpleNamespace(pre_rope=False)     # frame positions: the query is not turned

        def step(tokens, offset, sinks, packed, nears, residuals, head, slot, mask):
            traced = [_TracedKivi(sinks[i], packed[i], nears[i], residuals[i], head, slot, mask if masked else None,
                                  offset, config, positions, storage, compute_dtype) for i in range(len(sinks))]
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
    (module doc); the logits [B, 1, vocab] otherwise, the cache advanced by one token."""
    kind = getattr(cache, "compiled_step", None)   # decided when a KVCache is made (kv_cache.py)
    if kind is None or not cache.compile_decode or tokens.ndim != 2 or tokens.shape[1] != 1:
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
        return _retrieval_decode(model, tokens, layers, plans, owners, steps)
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
    """`decode` for KIVI under StreamingLLM (`_kivi_ready`): the segments' arrays go in as the
    eager step would read them (`KiviStore.step_inputs`, `LayerReads.placed_sink`), the new
    tokens come out and join each residual, eagerly."""
    first = layers[0]
    layout = first.body.layout()     # (packed tokens, frozen held, residual head, residual tokens)
    if any(c.seen != first.seen or c.positions.base != first.positions.base or c.body.layout() != layout
           for c in layers):
        return None
    mask = first.make_mask(1, return_array=False, window_size=None)   # as the model asks, before the step
    if isinstance(mask, str):
        return None
    n_packed, held, head, n_res = layout
    key = ("kivi", owners, mask is not None, first.dtype, first.body.storage, first.config, held > n_packed)
    step = steps.get(key)
    if step is _FAILED:
        return None
    if step is None:
        step = _kivi_step_fn(model, steps, key)
    sinks, packed, nears, residuals = [], [], [], []
    for c in layers:
        sinks.append(c.placed_sink())
        p, n, r = c.body.step_inputs()
        packed.append(p)
        nears.append(n)
        residuals.append(r)
    try:
        logits, new = step(tokens, mx.array(plans[0].offset, mx.int32), sinks, packed, nears, residuals,
                           mx.array([head], mx.int32), mx.array([head + n_res], mx.int32),
                           mask if mask is not None else mx.zeros((0,), mx.bool_))
    except Exception as e:     # as in `decode`: eager from now on for this layout; nothing has moved
        _failed(steps, key, e)
        return None
    for c, p, (k, v) in zip(layers, plans, new):    # the eager step's commit (nothing frozen), the token written
        c.commit(p, None, None, written=(k, v))
    return logits
