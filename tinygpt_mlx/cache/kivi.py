"""KIVI storage for the cache body (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache").

Keys are quantised per channel over blocks of G tokens, values per token over groups of G
channels (asymmetric affine, `quant.py`). The newest tokens stay exact in a residual of at
least R; when it holds R + G, its oldest G tokens are quantised once and frozen into the body.
R is the value in effect (`KiviStore.keep`): int8's grows from 32 to 64 on a long context.

Frozen blocks live in one contiguous array per side, concatenated along T when a block freezes
(every G decode steps), so decode scores the whole body with one `mx.quantized_matmul` and
never copies the store per step (a sliced view of a larger buffer costs a copy per step:
measured 1.18 ms vs 0.65 ms at 8K tokens, while the concatenation costs 0.05 ms per block).

RoPE: in absolute mode keys arrive rotated and are frozen as they are. In shifted mode keys
arrive before RoPE; a frozen key is rotated at its virtual slot u = slot + E, where E counts
the tokens evicted from the body so far (eviction shifts every body slot by the same amount),
and at read time the query is rotated by E instead: <R(p) q, R(u - E) k> = <R(p + E) q, R(u) k>.
So packed keys are never re-rotated, never re-quantised. Under StreamingLLM (no retrieval, no
exact top-k) shifted mode runs on frame positions instead (positions.py, as the ring does): keys
are kept as the model rotated them, at their position minus a base, and only the sink is
placed, so a decode step un-rotates, places and turns nothing. Every 65,536 tokens `rebase`
turns the body back by the base's growth: the residual exactly, the frozen blocks (at most a
window's worth) dequantised, turned and quantised again.

Rotation (`CacheConfig.rotate`, QuaRot's idea for the KV cache): a quantised side is stored in a
randomized Hadamard basis of the head dimension, k R and v R with R = diag(s) H / sqrt(D)
orthogonal. Scores are (q R)(k R)^T = q k^T and the packed output P (v R) is turned back by R^T,
so attention is unchanged while every channel of a rotated vector mixes all of the original
ones: an outlier channel no longer sets the range of its group alone. No bytes are added; a
decode step adds two [rows, D] x [D, D] matmuls per layer. The exact residual, sink and shadow
are never rotated; `_dense` (and everything that reads dequantised blocks) turns them back.

Exact top-k refinement (`CacheConfig.exact_topk` = K): a full-precision shadow copy of the frozen
tokens is kept outside the packed body (memory-mapped on disk by default, so RAM still holds only
the packed cache). Attention scores the packed body as usual, takes for every query head the K
tokens with the highest packed scores, re-scores them with their exact keys and re-values them
with their exact values: out = qmm(p with those K zeroed, V) + p_K . V_exact. A sharp head
(a copy head attends to one or a few earlier tokens) then sees exactly what an fp32 cache gives
it, and only the tail of the softmax, where weights are small, carries quantisation error.
With K >= the stored tokens the result equals exact attention (tested).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .. import quant
from ..config import CacheConfig
from .checkpoint import Held
from .packed import FrozenTiers
from .positions import Positions
from .segments import DenseSegment, Reading
from .shadow import NoShadow, ShadowStore
from .store import DenseStore, join, no_tokens

__all__ = ["KiviStore"]


class KiviStore:
    """The body store of a KIVI cache: frozen packed blocks of G tokens + an exact residual.

    An `Evictable` store (store.py). Bit widths are `key_bits` / `value_bits` (None = exact
    side). Frozen blocks are a `PackedRun` (packed.py), and with a near tier (`CacheConfig.near`)
    the newest of them a second run at more bits; positions come from `positions` (frame mode
    keeps keys as the model rotated them; the pre-RoPE path rotates them once, as they freeze).
    """

    #: no `step_mark` / `step_undo` (`LayerCache.undoable`)
    steps_undoable = False

    def __init__(self, config: CacheConfig, storage: mx.Dtype, positions: Positions, codec: Any,
                 exact_before: int = 0):
        # `CacheConfig` has checked the group size (MLX's set) and refused shifted retrieval.
        self.config, self.storage, self.positions, self.group = config, storage, positions, config.group_size
        # a full KIVI cache's exact sink (`exact_before` tokens, in the layer's sink store) counts
        # toward the R exact tokens: blocks freeze where they would without it, at the same bytes
        self.exact_before = exact_before
        self.residual = Residual(storage, self.group, exact_before)
        # the frozen blocks: the body's bits, and with a near tier its newest blocks at more bits
        self.tiers = FrozenTiers(config, storage, codec)
        self.frozen = 0     # tokens ever frozen (monotonic)
        self.evicted = 0    # frozen tokens dropped from the front (E in the module doc)
        self.shadow = (ShadowStore(config, storage, config.key_bits is not None, config.value_bits is not None)
                       if config.exact_topk else NoShadow())

    def __len__(self) -> int:
        return self.held + len(self.residual)

    @property
    def keep(self) -> int:   # the newest tokens held exact: R (grown on a long context) less the exact sink's
        stored = self.config.held_sink + self.frozen + len(self.residual)   # every token stored, the sink's too
        return max(0, self.config.exact_residual(stored) - self.exact_before)

    @property
    def n_packed(self) -> int:
        """Tokens in the body's frozen blocks (the near tier's not counted)."""
        return self.tiers.packed.n

    @property
    def held(self) -> int:
        """Frozen tokens held: the body's and the near tier's."""
        return self.tiers.n

    # ----- storage --------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add tokens to the residual, then freeze its oldest full groups.

        The newest max(R, L) tokens stay exact, so a prefill chunk attends to itself exactly
        (as KIVI's prefill does); its older groups freeze at the next append.
        """
        L = keys.shape[2]
        if L == 0:
            return
        if self.config.value_bits is not None and self.residual.keys is None:   # (D is fixed once held)
            _check_value_groups(values.shape[3], self.config.value_group_size, self.config.value_group is not None)
        self.residual.append(keys, values)
        n = (len(self.residual) - max(self.keep, L)) // self.group * self.group
        if n > 0:
            self._freeze(n)

    def took(self, keys: mx.array, values: mx.array) -> None:
        """`append` of one token that freezes nothing, already in the residual's buffers (compiled.py)."""
        self.residual.took(keys, values)

    # ----- what a compiled quiet step reads (compiled.py) -------------------------------------
    def quiet(self, unpacked: bool = False) -> bool:
        """Whether the next token's append is quiet: packed blocks held (`unpacked`: or nothing
        frozen yet, serve's batched step, server/batch.py), the token fits the residual's buffer
        and freezes no block (G - 1 of every G decode steps)."""
        res = self.residual
        return ((self.tiers.packed.n > 0 or unpacked and self.tiers.n == 0) and res.keys is not None
                and len(res) + 1 < max(self.keep, 1) + self.group and res.head + res.n + 1 <= res.keys.shape[2])

    def freezes_next(self) -> int:
        """Tokens the next one-token `append` freezes (its rule, `keep` counted with that token stored)."""
        n = len(self.residual) + 1
        keep = max(0, self.config.exact_residual(self.config.held_sink + self.frozen + n) - self.exact_before)
        return max(0, (n - max(keep, 1)) // self.group * self.group)

    def can_ready(self) -> bool:
        """Whether `ready_next` can make the next token's append quiet: exact tokens held in buffers
        with room before them (a full KIVI cache's, `Residual.room`), its token then fitting them."""
        res = self.residual
        return res.keys is not None and res.room > 0 and bool(res.n)

    def ready_next(self) -> Optional[str]:
        """What the next one-token `append` does to the tokens already stored, done now, before a
        compiled step writes that token into the residual's buffers (serve's batched step,
        server/batch.py): its oldest full groups frozen (`freezes_next`: never the new token,
        the newest max(keep, 1) stay exact), the buffers then fitted for it and G after it, as
        the eager step's freeze leaves them (`fit_ahead` with the token pending); or, where the
        token would not fit the buffers, the buffers made anew for it (`Residual.append`'s rule).
        Then its append is quiet (`took`), and the step reads what the eager step reads after
        its own freeze: the same blocks packed, the same exact tokens. An eager step after this
        one freezes nothing more (the same state). Only where `can_ready`; "froze", "grew" or None
        (nothing to do)."""
        n = self.freezes_next()
        if n > 0:
            self._freeze(n, pending=1)
            return "froze"
        return "grew" if self.residual.fit_next() else None

    def layout(self, lead: Optional[DenseStore] = None) -> Optional[tuple[int, int, int, int]]:
        """(tokens in the packed run, frozen tokens held in all, the first buffer slot a quiet
        step reads, the tokens it reads from there): what fixes a quiet step's shapes and where
        its token is written (the slot after them). Those slots are the residual's live tokens,
        or with `lead` (a full KIVI cache's exact sink, read with the residual as one segment,
        `segments_led`) the sink's copy before them too; None where the residual cannot lead it."""
        res, s = self.residual, len(lead) if lead is not None else 0
        if s and not res.can_lead(lead):
            return None
        return self.tiers.packed.n, self.tiers.n, res.head - s, res.n + s

    def step_inputs(self, lead: Optional[DenseStore] = None) -> tuple[tuple, tuple, tuple]:
        """A quiet step's arrays, as the eager step reads them: the packed run's sides, the near
        tier's (empty while it holds none) and the residual's whole buffers (the slots read are
        `layout`'s; with `lead` the sink's copy is written before the live tokens first, where
        it is not there yet)."""
        tiers, res = self.tiers, self.residual
        if lead is not None and len(lead):
            res.led(lead)
        near = (tiers.near.keys, tiers.near.values) if tiers.n > tiers.packed.n else ()
        packed = (tiers.packed.keys, tiers.packed.values) if tiers.packed.n else ()    # (() before a block froze)
        return packed, near, (res.keys, res.values)

    def _freeze(self, n: int, pending: int = 0) -> None:
        k, v = self.residual.drop_front(n)
        # the buffers moved now, in this step (eager: it freezes), where the next G tokens would
        # not fit after the live ones: else the next step would move them, eagerly (not quiet).
        # (`pending`: a token still to come in this step, `ready_next`: the same buffers as after)
        if pending:
            self.residual.fit_ahead(self.group, pending)
        else:
            self.residual.fit_ahead(self.group)
        if self.positions.pre_rope:
            k = self.positions.place(k.astype(mx.float32), self.positions.kivi_slot(self.frozen))
        self.shadow.append(k, v)
        self.tiers.add(k, v)
        self.frozen += n

    def droppable(self, n: int) -> int:
        """Eviction takes whole frozen blocks only: `n` rounded down to G, at most the body."""
        return min(n // self.group, self.held // self.group) * self.group

    def drop_front(self, n: int) -> tuple[mx.array, mx.array]:
        """Evict the oldest whole blocks (`droppable(n)` tokens); returns them dequantised
        (keys pre-RoPE on the pre-RoPE path, like every stored key there), or where keys are kept
        as rotated (absolute, frame) with a shadow the exact rows of the quantised sides."""
        m = self.droppable(n)
        if m == 0:
            return no_tokens(self.storage)
        k, v = self._dense(0, m, self.storage)
        if not self.positions.pre_rope:   # hand on the shadow's exact rows (a cold store keeps them)
            k, v = self.shadow.exact_front(m, k, v)
        self.tiers.cut_front(m)
        self.evicted += m
        self.shadow.drop_front(m)
        return k, v

    def truncate(self, n: int) -> None:
        """Keep only the first `n` tokens; frozen blocks can only be cut at a block boundary."""
        if n >= self.held:
            self.residual.truncate(n - self.held)
            return
        if n % self.group:
            raise ValueError(f"cannot truncate a KIVI body inside a frozen block ({n} tokens, G={self.group})")
        self.frozen -= self.held - n
        self.tiers.keep_first(n)
        self.shadow.truncate(n)
        self.residual = Residual(self.storage, self.group, self.exact_before)

    # ----- reading --------------------------------------------------------------------------
    def fetch(self, dtype: Optional[mx.Dtype] = None, exact: bool = False) -> tuple[mx.array, mx.array]:
        """Every stored token, dense: frozen blocks dequantised, then the residual (reference path).
        `exact`: the sides an exact top-k shadow holds are read from it instead (a prefill chunk's
        exact attention, as KIVI's prefill runs at full precision)."""
        dtype = dtype or self.storage
        parts = []
        if self.held:
            parts.append(self._dense(0, self.held, dtype, exact))
        if len(self.residual):
            parts.append(self.residual.fetch(dtype))
        return join(parts) if parts else no_tokens(self.storage)

    def _dense(self, lo: int, hi: int, dtype: mx.Dtype, exact: bool = False) -> tuple[mx.array, mx.array]:
        """Frozen tokens [lo, hi) (the body's, then the near tier's), dequantised; keys pre-RoPE
        on the pre-RoPE path. `exact` (from the first token, lo = 0): the sides the shadow holds
        are its exact rows (a dequantised side that is not used is never computed: MLX is lazy)."""
        k, v = self.tiers.dense(lo, hi)
        if exact:
            assert lo == 0, "the shadow's rows are read from the first frozen token"
            k, v = self.shadow.exact_front(hi, k, v)
        if self.positions.pre_rope:
            k = self.positions.unrotate(k.astype(mx.float32), self.positions.kivi_slot(self.evicted + lo))
        return k.astype(dtype), v.astype(dtype)

    def rebase(self, by: int) -> None:
        """Frame mode: turn every stored key back by `by` positions (the base grows by `by`): the
        residual's (exact in fp32; re-rounded once in half precision), the frozen blocks'
        dequantised, turned and quantised again (once per `Positions.rebase_every` tokens, over
        at most the window's blocks). Not with an exact top-k shadow (the factory keeps that on
        the pre-RoPE path)."""
        if self.config.exact_topk:
            raise ValueError("a KIVI body with an exact top-k shadow is not re-based (pre-RoPE path only)")
        def turn(k: mx.array) -> mx.array:
            return self.positions.rebased(k, by)
        self.residual.rotate(turn)
        self.tiers.rebase(turn)

    def segments(self, reading: Reading) -> list:
        """Attention segments, oldest first: the packed body, the near tier, then the exact
        residual (its first token sits right after the frozen ones)."""
        segs = self.tiers.segments(self.positions, self.evicted, self.shadow, self.config.exact_topk)
        if len(self.residual):
            k, v = self.residual.fetch(reading.dtype)
            if self.positions.pre_rope:
                k = self.positions.place(k, reading.first_slot + self.held)
            segs.append(DenseSegment(k, v))
        return segs

    def segments_led(self, reading: Reading, sink: DenseStore) -> Optional[list]:
        """`segments`, with the layer's exact `sink` (a full KIVI cache's first tokens, held as
        the model rotated them) read in one segment with the residual, the sink's tokens first
        (`Residual.led`): the segments of a query that sees every stored token (no mask), in
        no particular order. None where the residual cannot lead them (nothing held after the
        sink, a buffer without room before its tokens, the pre-RoPE path)."""
        if self.positions.pre_rope:
            return None
        led = self.residual.led(sink)
        if led is None:
            return None
        k, v = led
        if reading.dtype is not None and reading.dtype != self.storage:
            k, v = k.astype(reading.dtype), v.astype(reading.dtype)
        segs = self.tiers.segments(self.positions, self.evicted, self.shadow, self.config.exact_topk)
        segs.append(DenseSegment(k, v))
        return segs

    def close(self) -> None:
        self.tiers.clear()
        self.residual.close()
        self.shadow.close()

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    def state(self) -> tuple[dict, dict]:
        """Frozen blocks as stored (packed codes, scales, zeros, or the exact side), the residual,
        the near tier, the shadow, and the counters (n_packed, frozen, evicted: E of the module
        doc)."""
        arrays, meta = self.tiers.state()
        meta.update(frozen=self.frozen, evicted=self.evicted)
        for name, part in self._saved().items():
            pa, meta[name] = part.state()
            arrays.update({f"{name}.{k}": v for k, v in pa.items()})
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        self.tiers.load_state(arrays, meta)
        self.frozen, self.evicted = int(meta["frozen"]), int(meta["evicted"])
        for name, part in self._saved().items():
            part.load_state(arrays.scope(f"{name}."), meta[name])

    def _saved(self) -> dict:
        """The parts a file holds beside the frozen tiers: the residual, and a shadow's rows."""
        return {"residual": self.residual, **self.shadow.saved()}

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def mark(self) -> dict:
        """A full (never evicted, never re-based) body's extent: its frozen blocks only grow, so
        they are checkpointed as a count; the exact residual is held (at most R + a chunk)."""
        arrays, meta = self.residual.state()
        return {**self.tiers.mark(), "evicted": self.evicted, "residual": (Held.of(arrays), meta)}

    def rewind(self, mark: dict) -> None:
        """Back to `mark`: blocks frozen since are cut off (at their block boundary), the
        residual is restored."""
        if self.n_packed < mark["n_packed"] or self.evicted != mark["evicted"]:
            raise ValueError("a KIVI body can only be rewound to a mark it has grown from")
        self.truncate(mark["n_packed"])      # (`frozen` moves back with the blocks)
        self.residual.load_state(*mark["residual"])
        self.frozen += self.tiers.rewind_near(mark)

    # ----- bytes ----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes held: frozen blocks (codes, scales, zeros, an exact side), the near tier's once it
        holds any, the residual's tokens."""
        out = {"body_packed": self.tiers.packed.nbytes, "residual": self.residual.nbytes}
        if self.tiers.near is not None and self.tiers.near.n:
            out["body_near"] = self.tiers.near.nbytes
        return {**out, **self.shadow.breakdown()}


class Residual(DenseStore):
    """KIVI's exact residual: a `DenseStore` whose buffers keep `room` free slots before its
    live tokens whenever they are made, where `led` writes a copy of the layer's exact sink (a
    full KIVI cache's first tokens, `exact_before`), so a decode step reads the sink and the
    residual as one exact segment, one matmul each way, instead of two (kivi.py's `segments_led`).
    The copy is written again only when the sink changes, the buffers are made anew or the
    residual's front moves (a block freezes: once every G steps); the sink store keeps the
    tokens (their bytes, files, checkpoints), the copy is not counted."""

    def __init__(self, dtype: mx.Dtype, step: int, room: int):
        super().__init__(dtype, label="residual", step=step)
        self.room = room
        self.made = 0       # buffers made so far: the copy is written again for new ones
        self._led_for: Optional[tuple] = None

    def append(self, keys: mx.array, values: mx.array) -> None:
        L = keys.shape[2]
        if self.room and L and (self.keys is None or self.head + self.n + L > self.keys.shape[2]):
            self._remake(self.n + L, keys, values)
        super().append(keys, values)

    def fit_next(self) -> bool:
        """Where the next token would not fit the buffers (with `room`), new buffers for it now,
        as `append` would make them (`KiviStore.ready_next`); True where it made them."""
        if not self.room or self.keys is None or self.head + self.n + 1 <= self.keys.shape[2]:
            return False
        self._remake(self.n + 1, self.keys, self.values)
        return True

    def fit_ahead(self, ahead: int, pending: int = 0) -> None:
        """After a freeze (the front dropped): where `ahead` more tokens would not fit after the
        live ones, or the buffers are larger than that size (a prefill chunk's), new buffers now,
        sized as the next append that did not fit would size them (`append`'s rule for a store
        that drops its front: the same shapes every time, so a compiled quiet step traces no new
        one, and reads no more slots than it needs), the live tokens moved in; nothing stored
        changes. Buffers with `room` (a full KIVI cache's led sink) are made as `append` makes
        them (`_remake`), for the live tokens and the `ahead` to come: else the next step that
        did not fit would be eager only to make them (one in every G of a full int4 cache's
        steps was), and the quiet steps after a prompt would read its chunk's buffers."""
        n = self.n + pending    # (`pending`: a token of this step not written yet, `KiviStore.ready_next`)
        if self.keys is None or not n:
            return
        if self.room:
            size = self.room + -(-(n + ahead) // self.step) * self.step     # as `_remake`
            if self.head + n + ahead <= self.keys.shape[2] <= size:
                return
            self._remake(n + ahead, self.keys, self.values)
            return
        size = -(-(n + 1) // self.step) * self.step + self.step     # as `append` with a head
        if self.head + n + ahead <= self.keys.shape[2] <= size:
            return
        B, H, _, Dk = self.keys.shape
        new_k = mx.zeros((B, H, size, Dk), self.dtype)
        new_v = mx.zeros((B, H, size, self.values.shape[3]), self.dtype)
        new_k[:, :, : self.n], new_v[:, :, : self.n] = self.fetch()
        self.keys, self.values, self.head = new_k, new_v, 0
        self.made += 1
        self.version += 1

    def _remake(self, tokens: int, keys: mx.array, values: mx.array) -> None:
        """New buffers for `tokens` with `room` slots before them, the live tokens moved in."""
        B, H, _, Dk = keys.shape
        size = self.room + -(-tokens // self.step) * self.step
        new_k = mx.zeros((B, H, size, Dk), self.dtype)
        new_v = mx.zeros((B, H, size, values.shape[3]), self.dtype)
        r = self.room
        if self.n:
            new_k[..., r: r + self.n, :], new_v[..., r: r + self.n, :] = self.fetch()
        self.keys, self.values, self.head = new_k, new_v, r
        self.made += 1
        self.version += 1

    def load_state(self, arrays, meta: dict) -> None:
        super().load_state(arrays, meta)
        if self.room and self.n and self.head < self.room:
            self._remake(self.n, self.keys, self.values)

    def can_lead(self, lead: DenseStore) -> bool:
        """Whether `led` can read `lead`'s tokens before the live ones (there are some, and room)."""
        s = len(lead)
        return bool(s and self.n and s <= self.head and s <= self.room and lead.dtype == self.dtype)

    def led(self, lead: DenseStore) -> Optional[tuple[mx.array, mx.array]]:
        """The `lead` store's tokens (the sink, at most `room` of them) then the live ones, as
        one (keys, values) view of the buffers [B, H, s + n, D]; None where there is nothing live
        or no room before it."""
        if not self.can_lead(lead):
            return None
        s, h = len(lead), self.head
        mark = (lead.version, id(lead), self.made, h)
        if self._led_for != mark:
            k, v = lead.fetch()
            self.keys[..., h - s: h, :] = k
            self.values[..., h - s: h, :] = v
            self._led_for = mark
        e = h + self.n
        return self.keys[:, :, h - s: e], self.values[:, :, h - s: e]


def _check_value_groups(D: int, group: int, own: bool) -> None:
    """KIVI's value groups run along the head dimension `D`: refuse a `group` that does not divide
    it (`own`: set by --kv-value-group, else G's)."""
    if D % group:
        ok = [g for g in quant.GROUP_SIZES if D % g == 0]
        flag = "--kv-value-group" if own else "--kv-group-size"
        raise ValueError(f"KIVI value groups run along the head dimension: group size {group} does not divide "
                         f"head dim {D} (use {flag} {ok[0] if ok else '<none: head dim too small>'} "
                         "or exact values with --kv-quantize-values fp32)")
