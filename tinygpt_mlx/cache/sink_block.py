"""A shifted StreamingLLM sink placed ahead of time: the sink's keys before RoPE, and their
rotations to the slots just before the window for the next SINK_STEPS steps (ring.py's doc).

The sink is placed for SINK_STEPS steps at once (a block of SINK_STEPS * S rows; each step reads
its S rows). The next block is the previous one turned by SINK_STEPS positions: RoPE at offset
a + b is RoPE at b applied after RoPE at a, a fixed linear map of the head dim, so an fp32 block
advances by one [D, D] matmul (`advance`) instead of a RoPE call (unfused on this CPU backend: 19
kernels). Every REFRESH_BLOCKS blocks, and for a non-fp32 buffer always, the block is computed
from the pre-RoPE keys again (`rotate`), so rounding never accumulates.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .positions import Positions

__all__ = ["REFRESH_BLOCKS", "SINK_STEPS", "SinkBlock"]

#: the sink is placed for this many consecutive steps at once (each step then only writes its
#: precomputed rows into the buffer; the next block is one matmul away, `SinkBlock.advance`)
SINK_STEPS = 8
#: a block advanced by `SinkBlock.advance` this many times in a row is computed exactly again
REFRESH_BLOCKS = 64


class SinkBlock:
    """The sink's pre-RoPE keys [B, H, S, D] and their block of placements (module doc)."""

    def __init__(self, dtype: mx.Dtype, positions: Positions):
        self.dtype, self.positions = dtype, positions
        self.keys: Optional[mx.array] = None       # the sink's keys before RoPE
        self.block: Optional[mx.array] = None      # [B, H, SINK_STEPS * S, D]: the sink placed
        self.block_at = 0                          # at first_slot block_at + t
        self.advanced = 0                          # blocks advanced since the last exact one
        self.turn: Optional[mx.array] = None       # [D, D]: RoPE by SINK_STEPS positions, row form
        self.turn_checked = False                  # whether `rope_turn` ran (None: no turn)

    def add(self, raw: mx.array) -> None:
        """More sink keys before RoPE; the block is made with them (bytes never depend on reads)."""
        raw = raw.astype(self.dtype)
        self.keys = raw if self.keys is None else mx.concatenate([self.keys, raw], axis=2)
        self.rotate(self.block_at)

    def placed(self, at: int) -> mx.array:
        """The sink's keys rotated to their slots in the query's frame (sink slot 0 at frame
        position `at`): a view of the block, advanced or made again where `at` is past it."""
        if not 0 <= at - self.block_at < SINK_STEPS:
            if SINK_STEPS <= at - self.block_at < 2 * SINK_STEPS and self._can_advance():
                self.advance()
            else:
                self.rotate(at)
        t, S = at - self.block_at, self.keys.shape[2]
        return self.block[..., t * S:(t + 1) * S, :]     # a view: no gather

    def rotate(self, at: int) -> None:
        """The sink's keys rotated for sink slot 0 at `at`, `at + 1`, ... (SINK_STEPS of them)."""
        B, H, S, D = self.keys.shape
        flat = mx.broadcast_to(self.keys.astype(mx.float32).reshape(1, B * H, S, D), (SINK_STEPS, B * H, S, D))
        offsets = mx.repeat(at + mx.arange(SINK_STEPS), B * H)
        block = self.positions.rope(flat.reshape(SINK_STEPS * B * H, S, D), offset=offsets)
        block = block.reshape(SINK_STEPS, B, H, S, D).transpose(1, 2, 0, 3, 4).reshape(B, H, SINK_STEPS * S, D)
        self.block, self.block_at = block.astype(self.dtype), at   # step t: rows [t*S, (t+1)*S)
        self.advanced = 0
        if not self.turn_checked and self.dtype == mx.float32:    # made with the sink, like the block
            self.turn, self.turn_checked = self.rope_turn(D, SINK_STEPS), True

    def _can_advance(self) -> bool:
        return self.turn is not None and self.advanced < REFRESH_BLOCKS - 1

    def advance(self) -> None:
        """The next block (sink slot 0 at `block_at + SINK_STEPS` ...) from this one: one matmul
        by the RoPE turn of SINK_STEPS positions (module doc)."""
        self.block = self.block @ self.turn
        self.block_at += SINK_STEPS
        self.advanced += 1

    def rope_turn(self, D: int, by: int) -> Optional[mx.array]:
        """The [D, D] matrix M with rope(x, a + by) == rope(x, a) @ M for every row x and offset a:
        RoPE's map at `by` after undoing its map at 0 (RoPE is linear in x; any scaling it applies
        at every offset, as YaRN's does, cancels), from the rope applied to the unit vectors.
        None where the rope is seen not to be one rotation per offset, checked from offset `by`
        to `2 * by` (a rope whose frequencies move within those offsets; dynamic NTK scaling's
        move only past its trained length, where this check cannot see it, but such a rope
        takes no per-row offsets, so shifted mode cannot use it at all)."""
        eye = mx.eye(D, dtype=mx.float32).reshape(D, 1, D)

        def at(offset: int) -> np.ndarray:
            return np.array(self.positions.rope(eye, offset=offset).reshape(D, D), dtype=np.float64)
        at0, atb = at(0), at(by)
        turn = np.linalg.solve(at0, atb)        # rows: x @ at0 == rope(x, 0)
        if not np.allclose(atb @ turn, at(2 * by), atol=1e-5 * max(1.0, np.abs(atb).max())):
            return None
        return mx.array(turn.astype(np.float32))

    @property
    def nbytes(self) -> int:
        # the [D, D] turn is a constant of the model's RoPE (4 KiB at head dim 32, like a RoPE's
        # frequency table), not of what the cache holds: not counted
        return sum(a.nbytes for a in (self.keys, self.block) if a is not None)

    def load(self, keys: mx.array) -> None:
        """The saved pre-RoPE keys, placed at slot 0 (a prompt-cache file)."""
        self.keys = keys
        self.rotate(0)
