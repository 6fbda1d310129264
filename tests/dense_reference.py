"""The dense reference path that attention over our caches is tested against (tests only).

Our layer caches attend over their own segments (`LayerCache.attend`: packed blocks scored with
`mx.quantized_matmul`, a ring read as it lies, a full layer through mlx-lm's fused kernel).
`reference_path()` swaps, within its block, every layer's attention for mlx's dense kernel over
`fetch()` (every stored token dense, in position order, packed blocks dequantised, keys at their
RoPE positions), and keeps every decode step eager (the compiled step reads the stores itself).
Retrieval has no reference here (the dense K/V hold only the sink and the hot window).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import mlx.core as mx
import pytest

from tinygpt_mlx import attention
from tinygpt_mlx.cache import compiled
from tinygpt_mlx.cache.layer import LayerCache
from tinygpt_mlx.cache.ring import RingLayer


def dense_attend(layer: Any, queries: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention of `queries` over `layer.fetch()`: mlx-lm's dense attention (the function our
    routing replaced in the model's modules, looked up now so that a test's spy on it sees it;
    taken from mlx-lm on first need, as the routing's fallback takes it)."""
    keys, values = layer.fetch()
    return attention._mlx_sdpa()(queries, keys, values, cache=None, scale=scale, mask=mask)


@contextlib.contextmanager
def reference_path() -> Iterator[None]:
    """Within the block, attention over our caches is `dense_attend` and no decode step runs
    compiled (module doc)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LayerCache, "attend", dense_attend)
        patch.setattr(RingLayer, "attend", dense_attend)
        patch.setattr(compiled, "decode", lambda model, tokens, cache: None)
        yield
