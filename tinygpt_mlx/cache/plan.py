"""A layer's plan for its next model call, and the one commit that applies it.

mlx-lm's per-layer protocol asks a cache three things around each model call, in this order:
the mask (`make_mask`, before any layer runs), the RoPE position of the first new token
(`offset`, in every layer) and then the tokens themselves (`update_and_fetch`), after which
attention reads what the layer holds. Each of these depends on what the call is about to do
to the layer: how many body tokens it evicts (StreamingLLM's window, retrieval's hot window),
whether frame positions re-base first, where the oldest kept token sits, how many tokens are
cold. `LayerCache.plan()` works that out once, from the layer's counters, and every reader
takes it from there; `LayerCache.commit(plan, keys, values)` applies it: the re-base, the
eviction (retrieval hands what leaves the window to the cold store) and the append. The
compiled decode step (compiled.py) runs the same commit, with the token already written into
the store's buffers by the trace.

The plan does not depend on the call's length L: before any call of L >= 1 tokens the body
keeps `window - 1` old tokens, the ones the first new token can still see (attention inside the
call is windowed by the mask). After a call of L > 1 tokens a window's layer therefore holds
`window - 1 + L` tokens, as mlx-lm's `RotatingKVCache` does, which the next commit evicts
anyway: no output depends on when. Between calls the product holds exactly what the policy
keeps (reports, checkpoints and prompt-cache files see that): its one model call,
`generate.forward`, trims a `KVCache` after a call of several tokens
(`evict_middle_if_needed`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """What the next model call does to one layer (module doc)."""

    #: frame positions: by how much the stored keys are turned back and the base grows first
    rebase: int
    #: body tokens evicted before the new tokens are appended (to the cold store, if any)
    drop: int
    #: absolute position of the oldest body token once they are
    first: int
    #: tokens held (sink and body) once they are
    stored: int
    #: the RoPE position the first new token gets (the layer's `offset`)
    offset: int
