"""The model's own RoPE of a compiled retrieval decode step as products with one matrix per step
(cache/compiled_retrieval.py, issue 53: the host's graph build of `sink4/hot1024` on SmolLM2;
serve's batched retrieval step too, server/batch.py, one matrix per row at its own position).

In a decode step every layer turns its one query and its one key by RoPE at the same position,
the step's offset. MLX's CPU RoPE falls back to ~12 graph nodes per call (its angles made
again from `arange`s, cos and sin, the halves sliced, turned and joined), and a compiled step
replays every node of its trace: 25 nodes per layer and step for the query and the key, 750
per step on SmolLM2's 30 layers, about an eighth of the retrieval step's trace. RoPE is linear in
its input, so at one position it is a product with a [D, D] matrix, the RoPE of the identity at
that position (positions.py `identity_rope`, which `Positions.rotations` also makes its
matrices with: the same cosines and sines, made by the same RoPE call). `products(model, offset)` swaps each `nn.RoPE` of the model for `_RopeProduct` while a
compiled step is traced (trace time only; the modules are put back after it): a call at the
step's shared `offset` array with one fp32 token becomes one matmul with the matrix, made once
per trace and RoPE setting and shared by every layer; any other call (another offset, several
tokens, another dtype) is the RoPE itself. The products round differently from RoPE's
multiplies and subtractions, in the last bit (tests/test_retrieval_device.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from .positions import identity_rope

__all__ = ["products", "rope_matrix"]


def rope_matrix(rope: Any, offset: mx.array, D: int) -> mx.array:
    """RoPE at `offset` (a scalar array) as a matrix [D, D]: x [.., 1, D] times it is
    `rope(x, offset=offset)` (row i: the RoPE of the i-th unit vector, each a sequence of one).
    With `offset` a vector of B positions (serve's batched step, each row at its own), the B
    matrices [B, 1, D, D] in one RoPE call: x [B, H, 1, D] times them is `rope(x, offset=offset)`,
    each row's matrix the one its position gives alone."""
    m = identity_rope(rope, offset, D)     # (positions.py: the rule `Positions.rotations` uses too)
    return m if offset.ndim == 0 else m.reshape(offset.shape[0], 1, D, D)


class _RopeProduct:
    """An `nn.RoPE` during the trace of a compiled retrieval step: one fp32 token at the step's
    `offset` turned by the matrix of its settings (made once per trace, shared by the layers
    through `shared`; a vector `offset` of B rows' positions: each row by its own matrix); anything
    else by the RoPE itself."""

    def __init__(self, rope: nn.RoPE, offset: mx.array, shared: dict):
        self.rope, self.offset, self.shared = rope, offset, shared

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if (offset is not self.offset or x.dtype != mx.float32 or x.ndim < 2 or x.shape[-2] != 1
                or (offset.ndim == 1 and (x.ndim != 4 or x.shape[0] != offset.shape[0]))):
            return self.rope(x, offset=offset)
        r, D = self.rope, x.shape[-1]
        key = (r.dims, r.traditional, r.base, r.scale, D)
        m = self.shared.get(key)
        if m is None:
            m = self.shared[key] = rope_matrix(r, offset, D)
        return x @ m


@contextmanager
def products(model: Any, offset: mx.array) -> Iterator[None]:
    """While the block runs (a compiled step's trace), every `nn.RoPE` of `model` called at
    `offset` with one fp32 token turns it by a product (`_RopeProduct`); put back after."""
    shared: dict = {}
    swapped = []
    for _, module in model.named_modules():
        for name, child in list(module.items()):
            if type(child) is nn.RoPE:
                swapped.append((module, name, child))
    try:
        for module, name, child in swapped:
            module[name] = _RopeProduct(child, offset, shared)
        yield
    finally:
        for module, name, child in swapped:
            module[name] = child
