"""Every RoPE position rule of a layer cache, in one place.

Two modes (`CacheConfig.rope_mode`, only meaningful under StreamingLLM or retrieval):

* absolute: keys are stored as the model rotated them, at their original positions, and the
  query sits at its own position (tokens seen). Beyond the trained context this is out of range.
* shifted (StreamingLLM's paper): positions are cache slots. Keys are stored before RoPE and
  rotated to their slot when read, the query at the slot after the stored tokens (`pre_rope`:
  the reference paths the tests build, tests/prerope.py, and KIVI with an exact top-k shadow); on
  frame positions (`frame` below: a ring, KIVI under StreamingLLM, a retrieval hot window) only
  the sink and retrieved keys are kept before RoPE and placed, the window keeps its rotation
  and the query sits at its position minus a base, at the same distances. Slots:

      [ sink 0 .. S )  [ retrieval slots, R' ]  [ body S+R' .. )

  so query-key distances never exceed what the cache holds, whatever the context length.
  Retrieved cold keys sit at one slot just before the hot window (`fixed`, as InfLLM gives
  every memory unit one distance: R' = 1 once anything is cold), at the slot of their place
  in their page (`page`: token j of any page at the j-th of R' = min(cold tokens, page_size)
  slots, so a fetched span keeps its inner distances) or at consecutive slots in their order
  (`slots`: R' = min(cold tokens, retrieve_tokens), so that when everything cold is retrieved
  it sits right after the sink and every relative distance is the full cache's).
  The body's keys are stored pre-RoPE and rotated when read, so R' may grow step by step
  (`pre_rope`). On frame positions (below) the hot window keeps the keys as the model rotated
  them instead; the sink and the retrieved keys are placed relative to it, and a key leaving
  the window is un-rotated once, as the cold store keeps keys before RoPE.

Stores never decide a position: the layer cache hands them this object, and they ask it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import CacheConfig


class Positions:
    """The position rules of one layer cache (module doc)."""

    #: frame mode re-bases positions by this many once the query gets this far from the base
    REBASE_EVERY = 65536

    def __init__(self, config: CacheConfig, rope: Optional[Callable], frame: bool = False):
        self.shifted = (config.streaming or config.retrieval) and config.rope_mode == "shifted"
        if self.shifted and rope is None:
            raise ValueError("shifted RoPE needs the model's RoPE; use rope_mode 'absolute'")
        #: the model's RoPE as a pure rotation (`PureRotation`): every extra rotation the cache
        #: applies (un-rotate, place, turn, re-base) must not scale the keys again
        self.rope = PureRotation(rope) if rope is not None else None
        #: shifted mode over a ring (ring.py), a KIVI body under StreamingLLM (kivi.py) or a
        #: retrieval hot window (layer.py): the window's keys are stored as the model rotated
        #: them, at their position minus `base`; the query sits at its position minus `base`,
        #: and only the sink (and retrieved keys) are placed at slots (`first_slot` of a reading:
        #: in the query's frame). Slot distances are unchanged (module doc of ring.py): the
        #: window is contiguous in positions.
        self.frame = self.shifted and frame
        #: stored keys are kept before RoPE and rotated to their slots when read (shifted mode
        #: without a frame); in a frame only the sink is, and every other key stays as rotated
        self.pre_rope = self.shifted and not self.frame
        self.base = 0
        self.rebase_every = self.REBASE_EVERY
        self.sink = config.held_sink
        self.rule = config.retrieved_position
        self.fixed = self.rule == "fixed"
        #: the most slots retrieved tokens ever take (shifted mode)
        self.reserved = config.retrieved_slots if config.retrieval else 0

    # ----- slots ----------------------------------------------------------------------------
    def gap(self, cold_tokens: int) -> int:
        """Slots between the sink and the body for retrieved tokens (shifted mode), given how
        many tokens are cold: none while nothing is, then R' (module doc)."""
        if not self.shifted or cold_tokens <= 0:
            return 0
        return min(cold_tokens, self.reserved)

    def body_slot(self, n_sink: int, cold_tokens: int) -> int:
        """The slot of the body's first token."""
        return n_sink + self.gap(cold_tokens)

    def query_offset(self, seen: int, stored_next: int, cold_tokens: int) -> int:
        """The RoPE position of the next token: its position (absolute), or its slot (shifted)
        given the tokens stored and cold once the next append has evicted what it must, or its
        position minus the base (frame)."""
        if self.frame:
            return seen - self.base
        return stored_next + self.gap(cold_tokens) if self.shifted else seen

    def frame_slot0(self, seen: int, stored: int, cold_tokens: int = 0) -> int:
        """Frame mode: the frame position of slot 0, once `stored` tokens are held of `seen` and
        `cold_tokens` are cold (retrieval: the retrieval slots sit between the sink and the hot
        window). The newest token sits at slot stored + gap - 1 and at frame position
        seen - 1 - base."""
        return seen - self.base - stored - self.gap(cold_tokens)

    def rebase_due(self, seen: int) -> int:
        """Frame mode: by how much the next update re-bases (0: not yet). Decided between steps
        from `seen` alone, so the query offset read before the update (by every layer, or once
        for all layers by the native model) already counts it, and the stored keys are turned
        back only when the update comes: never between an update and its attention."""
        ahead = seen - self.base
        if self.frame and ahead >= self.rebase_every:
            return ahead // self.rebase_every * self.rebase_every
        return 0

    def retrieved_slot(self, n_sink: int, cold_tokens: int) -> int:
        """Shifted retrieval: the slot of every retrieved key (`fixed`), of the first token of
        every page (`page`), or of the newest retrieved key, the last slot before the body
        (`slots`)."""
        return n_sink + (self.gap(cold_tokens) - 1 if self.rule == "slots" else 0)

    def kivi_slot(self, frozen: int) -> int:
        """Shifted KIVI on the pre-RoPE path: the virtual slot u = sink + frozen at which a frozen
        key is rotated once (eviction shifts every body slot alike, so the query is rotated
        instead)."""
        return self.sink + frozen

    # ----- rotations ------------------------------------------------------------------------
    def place(self, keys: mx.array, first_slot: int) -> mx.array:
        """Stored keys [B, H, T, D] as attention sees them: rotated to slots first_slot.. in
        shifted mode, as stored in absolute mode."""
        return self.rope(keys, offset=first_slot) if self.shifted else keys

    def unrotate(self, keys: mx.array, first_slot: int) -> mx.array:
        """Undo the RoPE the model applied at slots first_slot.. (store keys pre-RoPE)."""
        return self.rotate_rows(keys, -first_slot, -1)

    def rotate_rows(self, x: mx.array, first: int, step: int) -> mx.array:
        """Rotate row t (axis -2) of x by position first + step * t, whatever x's leading axes."""
        shape = x.shape
        T, D = shape[-2], shape[-1]
        lead = x.size // (T * D)
        flat = mx.swapaxes(x.reshape(lead, T, D), 0, 1).reshape(T * lead, 1, D)
        if step == 0:
            out = self.rope(flat, offset=first)
        else:
            out = self.rope(flat, offset=mx.repeat(first + step * mx.arange(T), lead))
        return mx.swapaxes(out.reshape(T, lead, D), 0, 1).reshape(shape)

    def rotate_to(self, x: mx.array, position: int) -> mx.array:
        """Every row of x [..., D] rotated by RoPE to one `position` (negative undoes)."""
        shape = x.shape
        return self.rope(x.reshape(-1, 1, shape[-1]), offset=position).reshape(shape)

    def rotations(self, offsets: mx.array, D: int) -> mx.array:
        """RoPE to each of `offsets` (an int32 array [k], e.g. a compiled step's angles) as
        matrices [k, D, D] (`identity_rope`): RoPE is linear in x, so rope(x, offset=o) is x @ M
        with row i of M the rotation of the i-th unit vector, made by the same RoPE call (the same
        cosines and sines, bit for bit). A compiled retrieval step turns every layer's query and leaving
        key by one step's two angles (cache/compiled_retrieval.py): one RoPE call per step and
        `rotation_key`, and a small matmul per layer, where a RoPE call per layer replays the
        angles' whole computation (MLX's CPU RoPE falls back to ~12 ops: its `arange`s are
        not merged across calls by `mx.compile`)."""
        return identity_rope(self.rope, offsets, D)

    def rotation_key(self) -> Any:
        """What makes two layers' `rotations` the same: an MLX `nn.RoPE`'s settings (a model's
        layers hold equal ones, or one per kind of layer), else this layer's own RoPE."""
        r = self.rope.rope if self.rope is not None else None
        if type(r) is nn.RoPE:     # (no input scale: `PureRotation` calls it as it is)
            return ("RoPE", r.dims, r.traditional, r.base, r.scale)
        return ("layer", id(self.rope))

    def rebased(self, keys: mx.array, by: int) -> mx.array:
        """Frame mode: stored keys turned back by `by` positions (in fp32), as a re-base by `by`
        needs them (the ring's window, a KIVI body, a retrieval hot window)."""
        return self.rotate_to(keys.astype(mx.float32), -by)


class PureRotation:
    """A model's RoPE without the input scale some variants fold into it.

    mlx-lm's YaRN (and similar ropes) multiply the rotated channels by an attention factor
    (`mscale`) before rotating: part of the model's own single rotation of each query and key.
    The cache rotates keys again (un-rotating, placing at slots, turning), and each such call
    would scale them again. This calls the rope on x divided by its per-channel input scale,
    measured once per head dim as the diagonal of rope(I) at offset 0 (RoPE at 0 is the
    identity), so every call here is a pure rotation; for ropes without a scale (all ones) it
    is the rope itself, with no extra op.
    """

    def __init__(self, rope: Callable):
        self.rope = rope
        self._inverse: dict[int, Optional[mx.array]] = {}

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        D = x.shape[-1]
        if D not in self._inverse:
            diag = mx.diagonal(self.rope(mx.eye(D).reshape(D, 1, D), offset=0).reshape(D, D))
            self._inverse[D] = None if bool(mx.all(diag == 1.0)) else (1.0 / diag).astype(mx.float32)
        inverse = self._inverse[D]
        return self.rope(x if inverse is None else (x * inverse).astype(x.dtype), offset=offset)


def identity_rope(rope: Callable, offset: mx.array, D: int) -> mx.array:
    """The RoPE of the identity [D, D] at `offset`, in one call of `rope`: a scalar array gives
    one matrix [D, D], a vector of k positions k matrices [k, D, D], each at its own. RoPE is
    linear in x, so x [.., 1, D] at that position times the matrix is `rope(x, offset=offset)`
    (row i: the RoPE of the i-th unit vector, each a sequence of one). The one rule behind
    `Positions.rotations` (a compiled retrieval step's turns) and rope_products.py's matrices
    (the model's own RoPE in that step); both forms give the same bits per position (checked
    against the scalar form at offsets -37 to 70,000: tests/test_retrieval_device.py)."""
    if offset.ndim == 0:
        return rope(_eye(D).reshape(D, 1, D), offset=offset).reshape(D, D)
    k = offset.shape[0]
    return rope(mx.broadcast_to(_eye(D).reshape(1, D, 1, D), (k, D, 1, D)), offset=offset).reshape(k, D, D)


_EYES: dict[int, mx.array] = {}


def _eye(D: int) -> mx.array:
    """The identity [D, D] (fp32), made once from numpy: a constant inside a compiled trace."""
    e = _EYES.get(D)
    if e is None:
        e = _EYES[D] = mx.array(np.eye(D, dtype=np.float32))
    return e
