"""The per-query retrieval search, written plainly: the reference for the cold store's pools.

Before one pool served a forward pass (2026-12-01), every query ran its own coarse pass (the
store's page ranking, `ColdStore.coarse`) and fine pass (its `retrieve_tokens` best cold tokens
by exact score, max over the KV head's query group). The product now gathers pools
(`ColdStore.pool`, `pool_tokens`) and picks from them (`ColdStore._pick`, `PoolSegment`); the
`slots` rule gives every query a pool of its own, which must pick exactly what this does.
"""

from __future__ import annotations

import numpy as np


def select(store, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Coarse + fine pass of `store` for queries [G, rep, L, D] (fp32, positioned as the keys
    will be): every query its own pages and tokens. Returns (cold indices [G, L, T] in position
    order, pages [G, L, k], tokens scored per query m)."""
    G, _, L, _ = q.shape
    P, ps = store.n_pages, store.page_size
    if P > store.top_pages:
        pages = store.index.top_pages_of(q)
    else:
        pages = np.broadcast_to(np.arange(P), (G, L, P))
    idx = (pages[..., None] * ps + np.arange(ps)).reshape(G, L, -1)
    if store.n > P * ps:
        tail = np.broadcast_to(np.arange(P * ps, store.n), (G, L, store.n - P * ps))
        idx = np.concatenate([idx, tail], axis=-1)
    m = idx.shape[-1]
    T = min(store.retrieve_tokens, m)
    if T < m:
        kk = store.keys.view()[idx, np.arange(G).reshape(G, 1, 1)].astype(np.float32)   # [G, L, m, D]
        exact = np.matmul(q.transpose(0, 2, 1, 3), kk.transpose(0, 1, 3, 2)).max(axis=2)  # [G, L, m]
        pick = np.argpartition(-exact, T - 1, axis=-1)[..., :T]
        idx = np.take_along_axis(idx, pick, axis=-1)
    return np.sort(idx, axis=-1), pages, m
