"""Packed runs of KV tokens, and the attention segment that reads them (KIVI, kivi.py).

A `PackedRun` holds tokens quantised the KIVI way: keys per channel (K^T packed along T in
groups of G tokens), values per token (groups of G channels), each side at its own bits or exact
in the storage dtype; a quantised side may be stored in a rotated basis (`rotation`, QuaRot).
A KIVI body holds its frozen blocks as one run and its near tier's newest blocks as another, at
more bits (`CacheConfig.near`); both read through `PackedSegment`, which scores and weighs
packed tokens with `mx.quantized_matmul` and never dequantises them.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .. import quant
from .checkpoint import Held
from .shadow import ShadowStore, by_query_slices, top_k_indices
from .store import join

# Each side of a run: (packed, scale, zero) when quantised, (dense,) when exact.
Side = tuple
#: dtype of the frozen blocks' scales and zeros where the cache grows with the context: float16
#: halves their bytes (int4 body 0.31x of bf16 instead of 0.38x) at no measured cost in fidelity
#: (docs/kivi.md); a StreamingLLM window keeps them in float32 (`params_dtype`)
PARAMS = mx.float16


def params_dtype(config: Any) -> mx.Dtype:
    """The dtype a KIVI body's runs keep their scales and zeros in: `PARAMS` (float16) where the
    cache grows with the context; float32 under StreamingLLM, whose window bounds the bytes (an
    int4 window of 252 tokens holds ~400 KiB on the shipped model): float32 is what the packed
    matmuls take with float32 queries, so a decode step casts no parameters (2 kernels per
    `quantized_matmul` with float16 ones, and twice its graph-build time; docs/results.md)."""
    return mx.float32 if config.streaming else PARAMS


@functools.lru_cache(maxsize=None)
def _rotation(dim: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dim & (dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        m = rng.choice([-1.0, 1.0], size=dim)[:, None] * h / np.sqrt(dim)
    else:
        m, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    return m.astype(np.float32)


@functools.lru_cache(maxsize=None)
def rotation(dim: int) -> mx.array:
    """The orthogonal [dim, dim] float32 matrix R a rotated side is stored in (x R; back: y R^T):
    a Sylvester Hadamard matrix scaled by 1/sqrt(dim) with its rows' signs flipped by a fixed
    random draw (seed 0, so every cache and every saved file agree), for a power-of-two head
    dimension; otherwise the Q of a seeded Gaussian's QR (a random orthogonal matrix)."""
    return mx.array(_rotation(dim))


@functools.lru_cache(maxsize=None)
def rotation_back(dim: int) -> mx.array:
    """R^T of `rotation(dim)`, contiguous: what turns an output in the rotated basis back."""
    return mx.array(np.ascontiguousarray(_rotation(dim).T))


class PackedRun:
    """`n` tokens packed at `key_bits` / `value_bits` (None: that side exact in `storage`), keys
    in blocks of `group` tokens, values in groups of `value_group` channels,
    quantised through `codec` (the `KVCache` class: `quantise_affine`, `dequantise_k`,
    `dequantise_v`); a quantised side is held as x R where `rotate`. Tokens come and go by whole
    groups, oldest first."""

    def __init__(self, key_bits: Optional[int], value_bits: Optional[int], group: int, storage: mx.Dtype,
                 codec: Any, rotate: bool, value_group: int, params: mx.Dtype = PARAMS):
        self.key_bits, self.value_bits, self.group = key_bits, value_bits, group
        self.value_group = value_group
        self.params = params    # the scales' and zeros' dtype (`params_dtype`)
        self.storage, self.codec, self.rotate = storage, codec, rotate
        #: how its packed matmuls run on this backend, decided once here (`quant.matmul_path`)
        self.path = quant.matmul_path(False)
        self.keys: Optional[Side] = None
        self.values: Optional[Side] = None
        self.n = 0

    @classmethod
    def of(cls, keys: Side, values: Side, config: Any, near: bool = False) -> "PackedRun":
        """A body's packed sides (`near`: its near tier's) as a run to read (a compiled step's
        inputs, compiled.py)."""
        run = cls(*run_bits(config, near), config.group_size, mx.float32, None, config.rotate, config.value_group_size)
        run.keys, run.values = keys, values
        return run

    # ----- tokens in, tokens out ------------------------------------------------------------
    def add(self, k: mx.array, v: mx.array) -> None:
        """Tokens k, v (in the stored basis: `turn` first) quantised and appended: keys per
        channel (groups of G tokens along K^T's last axis), values per token."""
        kpart = self._pack_keys(k) if self.key_bits else (k.astype(self.storage),)
        vpart = (self.codec.quantise_affine(v, self.value_bits, self.value_group, self.params) if self.value_bits
                 else (v.astype(self.storage),))
        self.keys = _concat(self.keys, kpart, _axes(self.key_bits, keys=True))
        self.values = _concat(self.values, vpart, _axes(self.value_bits, keys=False))
        self.n += k.shape[2]

    def dense(self, lo: int, hi: Optional[int] = None) -> tuple[mx.array, mx.array]:
        """Tokens [lo, hi) dequantised, in the stored basis."""
        ks, vs = self._slice(lo, hi)
        k = self.codec.dequantise_k(*ks, self.key_bits, self.group) if self.key_bits else ks[0]
        v = self.codec.dequantise_v(*vs, self.value_bits, self.value_group) if self.value_bits else vs[0]
        return k, v

    def take_front(self, m: int) -> tuple[mx.array, mx.array]:
        """Remove the oldest `m` tokens (whole groups); returns them dequantised (stored basis)."""
        k, v = self.dense(0, m)
        self.cut(m, None)
        return k, v

    def cut(self, lo: int, hi: Optional[int]) -> None:
        """Keep tokens [lo, hi) only (group boundaries), as contiguous arrays."""
        self.keys, self.values = self._slice(lo, hi)
        self.n = (self.n if hi is None else hi) - lo
        if not self.n:
            self.clear()

    def clear(self) -> None:
        self.keys = self.values = None
        self.n = 0

    def _slice(self, lo: int, hi: Optional[int]) -> tuple[Side, Side]:
        return (_slice_side(self.keys, self.key_bits, True, lo, hi, self.group),
                _slice_side(self.values, self.value_bits, False, lo, hi, self.group))

    # ----- the stored basis and RoPE ---------------------------------------------------------
    def basis(self, x: mx.array, bits: Optional[int], back: bool) -> mx.array:
        """A quantised side into the rotated basis (x R) or back from it (x R^T); an exact side,
        or any side without rotation, as it is."""
        if not (self.rotate and bits):
            return x
        r = rotation(x.shape[-1])
        return x.astype(mx.float32) @ (r.T if back else r)

    def turn(self, k: mx.array, v: mx.array, back: bool) -> tuple[mx.array, mx.array]:
        """Both sides into the stored basis or back from it (`basis`)."""
        return self.basis(k, self.key_bits, back), self.basis(v, self.value_bits, back)

    def rebase(self, turn: Any) -> None:
        """Every key's RoPE angle turned by `turn` (in the model's basis): a quantised side
        dequantised, turned and quantised again, an exact side turned (frame mode's re-base)."""
        if not self.n:
            return
        if not self.key_bits:
            self.keys = (turn(self.keys[0]).astype(self.storage),)
            return
        k = self.codec.dequantise_k(*self.keys, self.key_bits, self.group)
        k = self.basis(turn(self.basis(k, self.key_bits, back=True)), self.key_bits, back=False)
        self.keys = self._pack_keys(k)

    def _pack_keys(self, k: mx.array) -> Side:
        """Keys [B, H, T, D] quantised per channel: groups of G tokens along K^T's last axis."""
        return self.codec.quantise_affine(mx.swapaxes(k, -1, -2), self.key_bits, self.group, self.params)

    # ----- bytes and files -------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for side in (self.keys, self.values) if side for a in side)

    def state(self) -> tuple[dict, dict]:
        """The sides as a prompt-cache file holds them: arrays `k.i`, `v.i`, their counts, `n`."""
        arrays, meta = {}, {"n": self.n}
        for name, side in (("k", self.keys), ("v", self.values)):
            meta[f"{name}_parts"] = len(side or ())
            arrays.update({f"{name}.{i}": a for i, a in enumerate(side or ())})
        return arrays, meta

    def load_state(self, arrays: Any, meta: dict) -> None:
        self.keys, self.values = (tuple(arrays[f"{name}.{i}"].mx() for i in range(meta[f"{name}_parts"])) or None
                                  for name in ("k", "v"))
        self.n = int(meta["n"])
        if not self.n:
            self.clear()



def run_bits(config: Any, near: bool = False) -> tuple[Optional[int], Optional[int]]:
    """The key and value bits of a KIVI body's frozen run: the config's, or with `near` its near
    tier's (`near_bits` on each side the body quantises; an exact side stays exact)."""
    kb, vb = config.key_bits, config.value_bits
    return (config.near_bits if kb else None, config.near_bits if vb else None) if near else (kb, vb)


class NearTier(PackedRun):
    """A KIVI body's near tier: its newest frozen tokens at `near_bits` (`CacheConfig.near`
    tokens, or the newest 1/`near_share` of the frozen ones in whole groups), a `PackedRun` that
    blocks freeze into and leave, oldest first, once past its `cap`, to be packed again at the
    body's bits."""

    def __init__(self, config: Any, storage: mx.Dtype, codec: Any):
        super().__init__(*run_bits(config, near=True), config.group_size, storage, codec, config.rotate,
                         config.value_group_size, params_dtype(config))
        self.size, self.share = config.near, config.tier_share

    def cap(self, held: int) -> int:
        """The tier's size with `held` frozen tokens held in all (body and tier)."""
        return self.size or held // self.share // self.group * self.group

    def admit(self, k: mx.array, v: mx.array, body: int) -> list[tuple[mx.array, mx.array]]:
        """Add the newest frozen tokens (stored basis) beside a body of `body` tokens; returns
        the tokens past the cap, oldest first, for the body: the tier's oldest (dequantised from
        its codes), then the new ones it would not keep as they come (all of them while the cap
        is 0), never rounded at its bits, so below its first group a tier changes nothing."""
        new = k.shape[2]
        over = self.n + new - self.cap(body + self.n + new)
        held = min(max(over, 0), self.n)
        out = [self.take_front(held)] if held else []
        direct = max(over - held, 0)
        if direct:
            out.append((k[:, :, :direct], v[:, :, :direct]))
        if direct < new:
            self.add(k[:, :, direct:], v[:, :, direct:])
        return out

class PackedSegment:
    """A packed run as an attention segment: scores and outputs straight from packed data with
    `mx.quantized_matmul`; a singleton axis broadcasts each KV head over its query group. On the
    pre-RoPE path the queries turn by the `evicted` tokens (kivi.py's module doc); with an exact
    top-k `shadow`, the top `topk` packed scores of every query are re-scored exactly.

    A rotated side names its basis (`key_basis` R, `value_basis` R^T): `segments.attend` hands
    `scores` the queries already turned (q R) and turns `output`'s answer back (by R^T), once for
    every segment of that basis (the packed run and the near tier share it). Where the queries
    must first turn by the evicted tokens (the pre-RoPE path), or top-k refinement needs them
    as they are, the segment turns them itself (`key_basis` None)."""

    def __init__(self, run: PackedRun, positions: Any, evicted: int = 0,
                 shadow: Optional[ShadowStore] = None, topk: int = 0):
        self.run, self.positions, self.evicted = run, positions, evicted
        self.shadow, self.topk = shadow, topk
        self.n_heads = run.keys[0].shape[1]
        self.chosen: Optional[mx.array] = None   # indices of the refined tokens [B, Hkv, rep, L, k]
        turned = positions.pre_rope and evicted
        self.key_basis = (rotation(run.keys[0].shape[-2]) if run.rotate and run.key_bits and not turned
                          and not topk else None)
        self.value_basis = (rotation_back(run.values[1].shape[-1] * run.value_group)
                            if run.rotate and run.value_bits and not topk else None)

    def scores(self, q: mx.array) -> mx.array:
        """Scores of queries [B, Hkv, rep, L, D] (in `key_basis` where it is set) -> [B, Hkv, rep, L, T]."""
        s = self.run
        if self.positions.pre_rope and self.evicted:
            q = self.positions.rotate_rows(q, self.evicted, 0)
        B, H, rep, L, D = q.shape
        rows = q.reshape(B, H, rep * L, D)      # a KV head's query group as rows: no broadcast copy
        if s.key_bits:
            if s.rotate and self.key_basis is None:     # keys stored as k R: (q R)(k R)^T = q k^T
                rows = rows @ rotation(D)
            scores = quant.quantised_matmul(rows, *s.keys, bits=s.key_bits, group=s.group, path=s.path)
        else:
            scores = rows @ s.keys[0].astype(mx.float32).swapaxes(-1, -2)
        scores = scores.reshape(B, H, rep, L, -1)
        if self.topk:       # (an exact top-k shadow)
            scores = self._refine_scores(q, scores)
        return scores

    def _refine_scores(self, q: mx.array, scores: mx.array) -> mx.array:
        """Replace the top-k packed scores of every query by exact ones (kivi.py's module doc)."""
        idx = top_k_indices(scores, self.topk, self.run.group)
        self.chosen = idx
        if not self.shadow.has(0):
            return scores
        exact = by_query_slices(idx, self.shadow, 0, lambda keys, lo, hi: (keys @ q[..., lo:hi, :, None])[..., 0])
        return mx.put_along_axis(scores, idx, exact, axis=-1)

    def output(self, p: mx.array) -> mx.array:
        s = self.run
        exact = None
        if self.chosen is not None and self.shadow.has(1):
            idx = self.chosen
            pk = mx.take_along_axis(p, idx, axis=-1)
            p = mx.put_along_axis(p, idx, mx.zeros_like(pk), axis=-1)
            exact = by_query_slices(idx, self.shadow, 1,
                                    lambda values, lo, hi: (pk[..., lo:hi, None, :] @ values)[..., 0, :])
        B, H, rep, L, T = p.shape
        rows = p.reshape(B, H, rep * L, T)
        if s.value_bits:
            out = quant.quantised_matmul(rows, *s.values, bits=s.value_bits, group=s.value_group, path=s.path)
            if s.rotate and self.value_basis is None:   # values stored as v R: turned back by R^T
                out = out @ rotation(out.shape[-1]).T
        else:
            out = rows @ s.values[0].astype(mx.float32)
        out = out.reshape(B, H, rep, L, -1)
        return out if exact is None else out + exact


def _axes(bits: Optional[int], keys: bool) -> tuple[int, ...]:
    """The token axis of each array of a side: K^T packs tokens along its last axis."""
    if bits is None:
        return (-2,)
    return (-1, -1, -1) if keys else (-2, -2, -2)


def _slice_side(side: Optional[Side], bits: Optional[int], keys: bool, lo: int, hi: Optional[int],
                group: int) -> Optional[Side]:
    """Tokens [lo, hi) of a side, as contiguous arrays."""
    if side is None:
        return None
    out = []
    for a, axis in zip(side, _axes(bits, keys)):
        # entries per token along the axis, num / den: one (values, exact keys), bits / 32 (packed
        # key codes: cuts fall on group boundaries, so on whole words), 1 / group (key scales, zeros)
        num, den = (1, 1) if bits is None or not keys else (bits, 32) if a.dtype == mx.uint32 else (1, group)
        a = mx.swapaxes(a, axis, -1)[..., lo * num // den: None if hi is None else hi * num // den]
        out.append(mx.contiguous(mx.swapaxes(a, axis, -1)))
    return tuple(out)


def _concat(side: Optional[Side], part: Side, axes: tuple[int, ...]) -> Side:
    if side is None:
        return tuple(part)
    return tuple(mx.concatenate([a, b], axis=ax) for a, b, ax in zip(side, part, axes))


class FrozenTiers:
    """A KIVI body's frozen tokens, oldest first: the body's `PackedRun` at its bits, then with
    a near tier (`CacheConfig.near`, `near_share`) the newest blocks in a `NearTier`, which hands
    its oldest blocks on to the body once past its cap. An exact side stays exact in both."""

    def __init__(self, config: Any, storage: mx.Dtype, codec: Any):
        self.packed = PackedRun(*run_bits(config), config.group_size, storage, codec, config.rotate,
                                config.value_group_size, params_dtype(config))
        self.near: Optional[NearTier] = NearTier(config, storage, codec) if config.near_tier else None

    @property
    def n(self) -> int:
        """Frozen tokens held: the body's and the near tier's."""
        return self.packed.n + (self.near.n if self.near is not None else 0)

    def runs(self) -> list:
        return [self.packed] + ([self.near] if self.near is not None else [])

    def add(self, k: mx.array, v: mx.array) -> None:
        """Newly frozen tokens (the model's basis; both runs store the same basis) into the near
        tier, whose overflow (dequantised from its codes and packed again: ~1/16 of a 4-bit step
        more) goes on to the body, with the new tokens it would not keep (`NearTier.admit`)."""
        k, v = self.packed.turn(k, v, back=False)
        for part in (self.near.admit(k, v, self.packed.n) if self.near is not None else [(k, v)]):
            self.packed.add(*part)

    def dense(self, lo: int, hi: int) -> tuple[mx.array, mx.array]:
        """Frozen tokens [lo, hi) (the body's, then the near tier's), dequantised, in the model's basis."""
        P = self.packed.n
        parts = [self.packed.dense(lo, min(hi, P))] if lo < P else []
        if hi > P:
            parts.append(self.near.dense(max(lo, P) - P, hi - P))
        return self.packed.turn(*join(parts), back=True)

    def cut_front(self, m: int) -> None:
        """Forget the oldest `m` frozen tokens (whole blocks): the body's, then the tier's."""
        body = min(m, self.packed.n)
        if m > body:                        # the body is gone: the rest from the near tier's front
            self.near.cut(m - body, None)
        if body:
            self.packed.cut(body, None)

    def keep_first(self, n: int) -> None:
        """Keep only the first `n` frozen tokens (a block boundary)."""
        if self.near is not None:
            self.near.cut(0, max(0, n - self.packed.n))
        if n < self.packed.n:
            self.packed.cut(0, n)

    def rebase(self, turn: Any) -> None:
        """Every run's keys turned by `turn` (dequantised, turned, packed again: frame mode)."""
        for run in self.runs():
            run.rebase(turn)

    def clear(self) -> None:
        for run in self.runs():
            run.clear()

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    def state(self) -> tuple[dict, dict]:
        """The body's run as stored (its count as `n_packed`), the near tier's under `near`."""
        arrays, meta = self.packed.state()
        meta["n_packed"] = meta.pop("n")
        if self.near is not None:
            pa, meta["near"] = self.near.state()
            arrays.update({f"near.{k}": v for k, v in pa.items()})
        return arrays, meta

    def load_state(self, arrays: Any, meta: dict) -> None:
        self.packed.load_state(arrays, dict(meta, n=meta["n_packed"]))
        if self.near is not None:
            self.near.load_state(arrays.scope("near."), meta.get("near", {"n": 0, "k_parts": 0, "v_parts": 0}))

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def mark(self) -> dict:
        """The body run's count (it only grows where a checkpoint is taken); the near tier held
        whole (`near` tokens, or 1/`near_share` of those frozen)."""
        if self.near is None:
            return {"n_packed": self.packed.n}
        arrays, meta = self.near.state()
        return {"n_packed": self.packed.n, "near": (Held.of(arrays), meta)}

    def rewind_near(self, mark: dict) -> int:
        """The near tier back to `mark`'s (the body run cut back beside); returns its tokens."""
        if self.near is None:
            return 0
        self.near.load_state(*mark["near"])
        return self.near.n

    def segments(self, positions: Any, evicted: int, shadow: Any, topk: int) -> list:
        """The runs as attention segments (the shadow refines the body only: `near` refuses one)."""
        segs = [PackedSegment(self.packed, positions, evicted, shadow, topk)] if self.packed.n else []
        if self.near is not None and self.near.n:
            segs.append(PackedSegment(self.near, positions, evicted))
        return segs
