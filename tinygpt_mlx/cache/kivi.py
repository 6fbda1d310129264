"""KIVI storage for the cache body (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache").

Keys are quantised per channel over blocks of G tokens, values per token over groups of G
channels (asymmetric affine, `quant.py`). The newest tokens stay exact in a residual of at
least R; when it holds R + G, its oldest G tokens are quantised once and frozen into the body.

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

import functools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from .. import quant
from ..config import CacheConfig
from .checkpoint import Held
from .positions import Positions
from .segments import DenseSegment, Reading
from .shadow import ShadowStore, by_query_slices, top_k_indices
from .store import DenseStore

# Each side of the frozen body: (packed, scale, zero) when quantised, (dense,) when exact.
Side = tuple
#: dtype of the frozen blocks' scales and zeros: float16 halves their bytes (int4 body 0.31x of
#: bf16 instead of 0.38x) at no measured cost in fidelity (docs/kivi.md)
PARAMS = mx.float16


@functools.lru_cache(maxsize=None)
def rotation(dim: int) -> mx.array:
    """The orthogonal [dim, dim] float32 matrix R a rotated side is stored in (x R; back: y R^T):
    a Sylvester Hadamard matrix scaled by 1/sqrt(dim) with its rows' signs flipped by a fixed
    random draw (seed 0, so every cache and every saved file agree), for a power-of-two head
    dimension; otherwise the Q of a seeded Gaussian's QR (a random orthogonal matrix)."""
    rng = np.random.default_rng(0)
    if dim & (dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        m = rng.choice([-1.0, 1.0], size=dim)[:, None] * h / np.sqrt(dim)
    else:
        m, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    return mx.array(m.astype(np.float32))


class KiviStore:
    """The body store of a KIVI cache: frozen packed blocks of G tokens + an exact residual.

    An `Evictable` store (store.py). Bit widths are `key_bits` / `value_bits` (None = exact
    side). Quantisation rounds through `codec` (the `KVCache` class: `quantise_affine`,
    `dequantise_k`, `dequantise_v`); positions come from `positions` (frame mode keeps keys as
    the model rotated them; the pre-RoPE path rotates them once, as they freeze).
    """

    def __init__(self, config: CacheConfig, storage: mx.Dtype, positions: Positions, codec: Any,
                 exact_before: int = 0):
        # `CacheConfig` has checked the group size (MLX's set) and refused shifted retrieval.
        self.config = config
        self.storage = storage
        self.codec = codec
        self.positions = positions
        self.key_bits, self.value_bits = config.key_bits, config.value_bits
        self.rotate = config.rotate     # quantised sides stored as x R (`rotation`)
        self.group = config.group_size
        # a full KIVI cache's exact sink (`exact_before` tokens, in the layer's sink store) counts
        # toward the R exact tokens: the blocks then freeze where they would without it, and the
        # cache holds the same bytes at every length (the sink's tokens instead of the residual's
        # oldest)
        self.keep = max(0, config.residual - exact_before)
        self.residual = DenseStore(storage, label="residual", step=self.group)
        self.keys: Optional[Side] = None
        self.values: Optional[Side] = None
        self.n_packed = 0   # tokens in frozen blocks
        self.frozen = 0     # tokens ever frozen (monotonic)
        self.evicted = 0    # frozen tokens dropped from the front (E in the module doc)
        self.shadow: Optional[ShadowStore] = (ShadowStore(config, storage, self.key_bits is not None,
                                                          self.value_bits is not None)
                                              if config.exact_topk else None)
        # the newest frozen tokens at more bits (`CacheConfig.near`): blocks freeze into it and
        # move on to the body, re-quantised, once more than `near` tokens are frozen after them
        self.near: Optional[NearTier] = NearTier(self, config.near, config.near_bits) if config.near else None

    def __len__(self) -> int:
        return self.held + len(self.residual)

    @property
    def held(self) -> int:
        """Frozen tokens held: the body's and the near tier's."""
        return self.n_packed + (self.near.n if self.near is not None else 0)

    # ----- storage --------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add tokens to the residual, then freeze its oldest full groups.

        The newest max(R, L) tokens stay exact, so a prefill chunk attends to itself exactly
        (as KIVI's prefill does); its older groups freeze at the next append.
        """
        L = keys.shape[2]
        if L == 0:
            return
        D = values.shape[3]
        if self.value_bits is not None and D % self.group:
            raise ValueError(f"KIVI value groups run along the head dimension: group size {self.group} "
                             f"does not divide head dim {D} (use --kv-group-size {_divisor(D)} or exact "
                             "values with --kv-quantize-values fp32)")
        self.residual.append(keys, values)
        n = (len(self.residual) - max(self.keep, L)) // self.group * self.group
        if n > 0:
            self._freeze(n)

    def took(self, keys: mx.array, values: mx.array) -> None:
        """`append` of one token that freezes nothing, already written into the residual's
        buffers `keys`, `values` (a compiled step's quiet step, compiled.py)."""
        self.residual.took(keys, values)

    def _freeze(self, n: int) -> None:
        k, v = self.residual.drop_front(n)
        if self.positions.pre_rope:
            k = self.positions.place(k.astype(mx.float32), self.positions.kivi_slot(self.frozen))
        if self.shadow is not None:
            self.shadow.append(k, v)
        k, v = self._turn(k, v, back=False)
        self.frozen += n
        if self.near is not None:
            self.near.add(k, v)
            over = self.near.n - self.near.cap
            if over <= 0:
                return
            k, v = self.near.take_front(over)
        self.keys, self.values = self.pack(self.keys, self.values, k, v, self.key_bits, self.value_bits)
        self.n_packed += k.shape[2]

    def pack(self, keys: Optional[Side], values: Optional[Side], k: mx.array, v: mx.array,
              key_bits: Optional[int], value_bits: Optional[int]) -> tuple[Side, Side]:
        """`keys`, `values` with the tokens k, v (in the stored basis) quantised and appended:
        keys per channel (groups of G tokens along K^T's last axis), values per token."""
        kpart = (self.codec.quantise_affine(mx.swapaxes(k, -1, -2), key_bits, self.group, PARAMS) if key_bits
                 else (k.astype(self.storage),))
        vpart = (self.codec.quantise_affine(v, value_bits, self.group, PARAMS) if value_bits
                 else (v.astype(self.storage),))
        return (_concat(keys, kpart, self._axes(key_bits, keys=True)),
                _concat(values, vpart, self._axes(value_bits, keys=False)))

    def unpack(self, keys: Side, values: Side, key_bits: Optional[int], value_bits: Optional[int],
                lo: int, hi: Optional[int]) -> tuple[mx.array, mx.array]:
        """Tokens [lo, hi) of packed sides, dequantised, in the stored basis."""
        ks = self.slice_side(keys, key_bits, True, lo, hi)
        vs = self.slice_side(values, value_bits, False, lo, hi)
        k = self.codec.dequantise_k(*ks, key_bits, self.group) if key_bits else ks[0]
        v = self.codec.dequantise_v(*vs, value_bits, self.group) if value_bits else vs[0]
        return k, v

    @staticmethod
    def _axes(bits: Optional[int], keys: bool) -> tuple[int, ...]:
        """The token axis of each array of a side: K^T packs tokens along its last axis."""
        if bits is None:
            return (-2,)
        return (-1, -1, -1) if keys else (-2, -2, -2)

    def droppable(self, n: int) -> int:
        """Eviction takes whole frozen blocks only: `n` rounded down to G, at most the body."""
        return min(n // self.group, self.held // self.group) * self.group

    def drop_front(self, n: int) -> tuple[mx.array, mx.array]:
        """Evict the oldest whole blocks (`droppable(n)` tokens); returns them dequantised
        (keys pre-RoPE on the pre-RoPE path, like every stored key there), or where keys are kept
        as rotated (absolute, frame) with a shadow the exact rows of the quantised sides."""
        m = self.droppable(n)
        if m == 0:
            return self._empty()
        k, v = self._dense(0, m, self.storage)
        if self.shadow is not None and not self.positions.pre_rope:   # hand on exact rows (a cold store keeps them)
            k = self.shadow.front(0, m) if self.shadow.has(0) else k
            v = self.shadow.front(1, m) if self.shadow.has(1) else v
        body = min(m, self.n_packed)
        if m > body:                        # the body is gone: the rest from the near tier's front
            self.near.take_front(m - body)
        if body:
            self.keys = self.slice_side(self.keys, self.key_bits, True, body, None)
            self.values = self.slice_side(self.values, self.value_bits, False, body, None)
            self.n_packed -= body
        self.evicted += m
        if self.shadow is not None:
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
        if self.near is not None:
            self.near.keep_front(max(0, n - self.n_packed))
        if n < self.n_packed:
            self.keys = self.slice_side(self.keys, self.key_bits, True, 0, n)
            self.values = self.slice_side(self.values, self.value_bits, False, 0, n)
            self.n_packed = n
        if self.shadow is not None:
            self.shadow.truncate(n)
        self.residual = DenseStore(self.storage, label="residual", step=self.group)

    def slice_side(self, side: Side, bits: Optional[int], keys: bool, lo: int, hi: Optional[int]) -> Side:
        """Tokens [lo, hi) of a frozen side, as contiguous arrays."""
        out = []
        for a, axis in zip(side, self._axes(bits, keys)):
            per = 1 if bits is None or not keys else (32 // bits if a.dtype == mx.uint32 else self.group)
            a = mx.swapaxes(a, axis, -1)[..., lo // per: None if hi is None else hi // per]
            out.append(mx.contiguous(mx.swapaxes(a, axis, -1)))
        return tuple(out)

    # ----- reading --------------------------------------------------------------------------
    def fetch(self, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]:
        """Every stored token, dense: frozen blocks dequantised, then the residual (reference path)."""
        dtype = dtype or self.storage
        parts = []
        if self.held:
            parts.append(self._dense(0, self.held, dtype))
        if len(self.residual):
            parts.append(self.residual.fetch(dtype))
        return _join(parts) if parts else self._empty()

    def _dense(self, lo: int, hi: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Frozen tokens [lo, hi) (the body's, then the near tier's), dequantised; keys pre-RoPE
        on the pre-RoPE path."""
        P = self.n_packed
        parts = [self.unpack(self.keys, self.values, self.key_bits, self.value_bits, lo, min(hi, P))] if lo < P else []
        if hi > P:
            parts.append(self.near.dense(max(lo, P) - P, hi - P))
        k, v = self._turn(*_join(parts), back=True)
        if self.positions.pre_rope:
            k = self.positions.unrotate(k.astype(mx.float32), self.positions.kivi_slot(self.evicted + lo))
        return k.astype(dtype), v.astype(dtype)

    def rebase(self, by: int) -> None:
        """Frame mode: turn every stored key back by `by` positions (the base grows by `by`): the
        residual's (exact in fp32; re-rounded once in half precision), the frozen blocks'
        dequantised, turned and quantised again (once per `Positions.rebase_every` tokens, over
        at most the window's blocks). Not with an exact top-k shadow (the factory keeps that on
        the pre-RoPE path)."""
        if self.shadow is not None:
            raise ValueError("a KIVI body with an exact top-k shadow is not re-based (pre-RoPE path only)")
        def turn(k: mx.array) -> mx.array:
            return self.positions.rebased(k, by)
        self.residual.rotate(turn)
        if self.near is not None:
            self.near.rebase(turn)
        if self.n_packed:
            self.keys = self.rebased_keys(self.keys, self.key_bits, turn)

    def rebased_keys(self, keys: Side, key_bits: Optional[int], turn: Any) -> Side:
        """A frozen key side with every key's RoPE angle turned by `turn` (in the model's basis):
        dequantised, turned and quantised again, or an exact side turned."""
        if not key_bits:
            return (turn(keys[0]).astype(self.storage),)
        k = self.codec.dequantise_k(*keys, key_bits, self.group)
        k = self.basis(turn(self.basis(k, key_bits, back=True)), key_bits, back=False)
        return self.codec.quantise_affine(mx.swapaxes(k, -1, -2), key_bits, self.group, PARAMS)

    def _turn(self, k: mx.array, v: mx.array, back: bool) -> tuple[mx.array, mx.array]:
        """Both sides into the stored basis or back from it (`_basis`)."""
        return self.basis(k, self.key_bits, back), self.basis(v, self.value_bits, back)

    def basis(self, x: mx.array, bits: Optional[int], back: bool) -> mx.array:
        """A quantised side into the rotated basis (x R) or back from it (x R^T); an exact side,
        or any side without rotation, as it is."""
        if not (self.rotate and bits):
            return x
        r = rotation(x.shape[-1])
        return x.astype(mx.float32) @ (r.T if back else r)

    def _empty(self) -> tuple[mx.array, mx.array]:
        z = mx.zeros((0,), self.storage)
        return z, z

    def segments(self, reading: Reading) -> list:
        """Attention segments, oldest first: the packed body, then the exact residual (its first
        token sits right after the packed ones)."""
        segs: list = []
        if self.n_packed:
            segs.append(PackedSegment(self))
        if self.near is not None and self.near.n:
            segs.append(PackedSegment(self.near.view()))
        if len(self.residual):
            k, v = self.residual.fetch(reading.dtype)
            if self.positions.pre_rope:
                k = self.positions.place(k, reading.first_slot + self.held)
            segs.append(DenseSegment(k, v))
        return segs

    def close(self) -> None:
        self.keys = self.values = None
        self.n_packed = 0
        if self.near is not None:
            self.near.clear()
        self.residual.close()
        if self.shadow is not None:
            self.shadow.close()

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    def state(self) -> tuple[dict, dict]:
        """Frozen blocks as stored (packed codes, scales, zeros, or the exact side), the residual,
        the shadow, and the counters (n_packed, frozen, evicted: E of the module doc)."""
        arrays, meta = _sides_state(self.keys, self.values)
        meta.update(n_packed=self.n_packed, frozen=self.frozen, evicted=self.evicted)
        ra, meta["residual"] = self.residual.state()
        arrays.update({f"residual.{k}": v for k, v in ra.items()})
        if self.near is not None:
            na, meta["near"] = self.near.state()
            arrays.update({f"near.{k}": v for k, v in na.items()})
        if self.shadow is not None:
            sa, meta["shadow"] = self.shadow.state()
            arrays.update({f"shadow.{k}": v for k, v in sa.items()})
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        self.keys, self.values = _sides_load(arrays, meta)
        self.n_packed, self.frozen, self.evicted = int(meta["n_packed"]), int(meta["frozen"]), int(meta["evicted"])
        self.residual.load_state(arrays.scope("residual."), meta["residual"])
        if self.near is not None:
            self.near.load_state(arrays.scope("near."), meta.get("near", {"n": 0}))
        if self.shadow is not None:
            self.shadow.load_state(arrays.scope("shadow."), meta["shadow"])

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def mark(self) -> dict:
        """A full (never evicted, never re-based) body's extent: its frozen blocks only grow, so
        they are checkpointed as a count; the exact residual is held (at most R + a chunk)."""
        arrays, meta = self.residual.state()
        mark = {"n_packed": self.n_packed, "evicted": self.evicted, "residual": (Held.of(arrays), meta)}
        if self.near is not None:       # bounded (at most `near` tokens): held
            arrays, meta = self.near.state()
            mark["near"] = (Held.of(arrays), meta)
        return mark

    def rewind(self, mark: dict) -> None:
        """Back to `mark`: blocks frozen since are cut off (at their block boundary), the
        residual is restored."""
        if self.n_packed < mark["n_packed"] or self.evicted != mark["evicted"]:
            raise ValueError("a KIVI body can only be rewound to a mark it has grown from")
        self.truncate(mark["n_packed"])      # (`frozen` moves back with the blocks)
        arrays, meta = mark["residual"]
        self.residual.load_state(arrays, meta)
        if self.near is not None:
            self.near.load_state(*mark["near"])
            self.frozen += self.near.n

    # ----- bytes ----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes of the arrays really held: frozen blocks (codes, scales, zeros, and an exact
        side if any) and the residual's stored tokens."""
        out = {"body_packed": _sides_bytes(self.keys, self.values), "residual": self.residual.nbytes}
        if self.near is not None:
            out["body_near"] = self.near.nbytes
        if self.shadow is not None:
            out[self.shadow.label] = self.shadow.nbytes
        return out


class NearTier:
    """KIVI's near tier (`CacheConfig.near`, `near_bits`): the newest `cap` frozen tokens of a
    `KiviStore`, packed at `bits` (8) instead of the body's. Attention reads recent tokens most,
    so their quantisation error costs most (docs/kivi.md); a block leaving the tier is
    dequantised and packed again at the body's bits (from 8-bit codes: the second rounding adds
    ~1/16 of a 4-bit step). Tokens are held in the store's basis (rotated where it rotates); an
    exact side of the store stays exact here."""

    def __init__(self, store: KiviStore, cap: int, bits: int):
        self.store, self.cap = store, cap
        self.key_bits = bits if store.key_bits else None
        self.value_bits = bits if store.value_bits else None
        self.keys: Optional[Side] = None
        self.values: Optional[Side] = None
        self.n = 0

    def add(self, k: mx.array, v: mx.array) -> None:
        self.keys, self.values = self.store.pack(self.keys, self.values, k, v, self.key_bits, self.value_bits)
        self.n += k.shape[2]

    def dense(self, lo: int, hi: int) -> tuple[mx.array, mx.array]:
        return self.store.unpack(self.keys, self.values, self.key_bits, self.value_bits, lo, hi)

    def take_front(self, m: int) -> tuple[mx.array, mx.array]:
        """Remove the oldest `m` tokens (whole blocks); returns them dequantised (stored basis)."""
        k, v = self.dense(0, m)
        self._cut(m, None)
        return k, v

    def keep_front(self, m: int) -> None:
        if m:
            self._cut(0, m)
        else:
            self.clear()

    def _cut(self, lo: int, hi: Optional[int]) -> None:
        s = self.store
        self.keys = s.slice_side(self.keys, self.key_bits, True, lo, hi)
        self.values = s.slice_side(self.values, self.value_bits, False, lo, hi)
        self.n = (self.n if hi is None else hi) - lo
        if not self.n:
            self.clear()

    def clear(self) -> None:
        self.keys = self.values = None
        self.n = 0

    def rebase(self, turn: Any) -> None:
        """Frame mode: keys turned back by the base's growth (`KiviStore.rebased_keys`)."""
        if self.n:
            self.keys = self.store.rebased_keys(self.keys, self.key_bits, turn)

    def view(self) -> Any:
        """What `PackedSegment` reads of a store, for this tier (no shadow: `near` refuses one)."""
        s = self.store
        return SimpleNamespace(keys=self.keys, values=self.values, key_bits=self.key_bits,
                               value_bits=self.value_bits, rotate=s.rotate, group=s.group,
                               positions=s.positions, evicted=s.evicted, shadow=None)

    @property
    def nbytes(self) -> int:
        return _sides_bytes(self.keys, self.values)

    def state(self) -> tuple[dict, dict]:
        arrays, meta = _sides_state(self.keys, self.values)
        return arrays, dict(meta, n=self.n)

    def load_state(self, arrays: Any, meta: dict) -> None:
        if not meta["n"]:
            self.clear()
            return
        self.keys, self.values = _sides_load(arrays, meta)
        self.n = int(meta["n"])


class PackedSegment:
    """The frozen body as an attention segment: scores and outputs straight from packed data
    with `mx.quantized_matmul`; a singleton axis broadcasts each KV head over its query group."""

    def __init__(self, store: KiviStore):
        self.store = store
        first = store.keys[0]
        self.n_heads = first.shape[1]
        self.chosen: Optional[mx.array] = None   # indices of the refined tokens [B, Hkv, rep, L, k]

    def scores(self, q: mx.array) -> mx.array:
        s = self.store
        if s.positions.pre_rope and s.evicted:
            q = s.positions.rotate_rows(q, s.evicted, 0)
        B, H, rep, L, D = q.shape
        rows = q.reshape(B, H, rep * L, D)      # a KV head's query group as rows: no broadcast copy
        if s.key_bits:
            if s.rotate:     # the keys are stored as k R: (q R)(k R)^T = q k^T
                rows = rows @ rotation(D)
            scores = quant.quantised_matmul(rows, *s.keys, bits=s.key_bits, group=s.group)
        else:
            scores = rows @ s.keys[0].astype(mx.float32).swapaxes(-1, -2)
        scores = scores.reshape(B, H, rep, L, -1)
        if s.shadow is not None:
            scores = self._refine_scores(q, scores)
        return scores

    def _refine_scores(self, q: mx.array, scores: mx.array) -> mx.array:
        """Replace the top-k packed scores of every query by exact ones (module doc)."""
        s = self.store
        idx = top_k_indices(scores, s.config.exact_topk, s.group)
        self.chosen = idx
        if not s.shadow.has(0):
            return scores
        exact = by_query_slices(idx, s.shadow, 0, lambda keys, lo, hi: (keys @ q[..., lo:hi, :, None])[..., 0])
        return mx.put_along_axis(scores, idx, exact, axis=-1)

    def output(self, p: mx.array) -> mx.array:
        s = self.store
        exact = None
        if self.chosen is not None and s.shadow.has(1):
            idx = self.chosen
            pk = mx.take_along_axis(p, idx, axis=-1)
            p = mx.put_along_axis(p, idx, mx.zeros_like(pk), axis=-1)
            exact = by_query_slices(idx, s.shadow, 1, lambda values, lo, hi: (pk[..., lo:hi, None, :] @ values)[..., 0, :])
        B, H, rep, L, T = p.shape
        rows = p.reshape(B, H, rep * L, T)
        if s.value_bits:
            out = quant.quantised_matmul(rows, *s.values, bits=s.value_bits, group=s.group)
            if s.rotate:     # the values are stored as v R: turned back by R^T
                out = out @ rotation(out.shape[-1]).T
        else:
            out = rows @ s.values[0].astype(mx.float32)
        out = out.reshape(B, H, rep, L, -1)
        return out if exact is None else out + exact


def _join(parts: list) -> tuple[mx.array, mx.array]:
    """(keys, values) pairs, oldest first, as one pair along the token axis."""
    if len(parts) == 1:
        return parts[0]
    return (mx.concatenate([p[0] for p in parts], axis=2), mx.concatenate([p[1] for p in parts], axis=2))


def _sides_state(keys: Optional[Side], values: Optional[Side]) -> tuple[dict, dict]:
    """Packed sides as a prompt-cache file holds them: arrays `k.i`, `v.i` and their counts."""
    arrays, meta = {}, {}
    for name, side in (("k", keys), ("v", values)):
        meta[f"{name}_parts"] = len(side or ())
        arrays.update({f"{name}.{i}": a for i, a in enumerate(side or ())})
    return arrays, meta


def _sides_load(arrays: Any, meta: dict) -> tuple[Optional[Side], Optional[Side]]:
    return tuple(tuple(arrays[f"{name}.{i}"].mx() for i in range(meta[f"{name}_parts"])) or None
                 for name in ("k", "v"))


def _sides_bytes(keys: Optional[Side], values: Optional[Side]) -> int:
    return sum(a.nbytes for side in (keys, values) if side for a in side)


def _concat(side: Optional[Side], part: Side, axes: tuple[int, ...]) -> Side:
    if side is None:
        return tuple(part)
    return tuple(mx.concatenate([a, b], axis=ax) for a, b, ax in zip(side, part, axes))


def _divisor(D: int) -> str:
    ok = [g for g in quant.GROUP_SIZES if D % g == 0]
    return str(ok[0]) if ok else "<none: head dim too small>"
