"""A layer's attention mask for its next model call (mlx-lm's `make_mask`), over absolute
positions: causal, and under StreamingLLM limited to the sink and each query's last `window`
positions. A decode step's mask depends only on the sink held and the body's distances to the
query, so `Masks` builds each such shape once and hands it out again."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .plan import Plan


def key_positions(n_sink: int, first: int, end: int) -> mx.array:
    """Absolute positions of the stored tokens: the sink's `n_sink`, then the body's [first, end)."""
    return mx.concatenate([mx.arange(n_sink), mx.arange(first, end)])


class Masks:
    """`make_mask` for one layer (its config), with the decode steps' masks kept by shape."""

    #: decode-step masks kept at most (a KIVI body's hidden tokens vary the shape: < G of them)
    KEEP = 256

    def __init__(self, config):
        self.config = config
        self.steps: dict = {}

    def clear(self) -> None:
        self.steps.clear()

    def _limited(self, N: int, plan: Plan, seen: int, body_kept: bool) -> bool:
        """Whether some of the next `N` queries may not see some stored key (StreamingLLM);
        `body_kept`: whether body tokens remain once `plan` has evicted."""
        if not self.config.streaming:
            return False
        first_body = plan.first if body_kept else max(seen, self.config.sink)
        return (seen + N - 1) - first_body >= self.config.window

    def make(self, N: int, plan: Plan, n_sink: int, seen: int, body_kept: bool, return_array: bool = False,
             window_size: Optional[int] = None):
        """The mask for the next `N` tokens of a layer that has `seen` tokens and holds `n_sink`
        sink tokens, whose call is planned as `plan`: None or "causal" where every query sees
        every earlier stored key, else a boolean [N, stored] array."""
        if not self._limited(N, plan, seen, body_kept) and window_size is None:
            if N == 1:
                return None
            if not return_array:
                return "causal"
        step_key = None
        if N == 1 and window_size is None:
            step_key = (n_sink, seen - plan.first)
            if step_key in self.steps:
                return self.steps[step_key]
        kpos = key_positions(n_sink, plan.first, seen + N)[None]
        qpos = mx.arange(seen, seen + N)[:, None]
        mask = kpos <= qpos
        if self.config.streaming:
            mask = mask & ((kpos < self.config.sink) | (qpos - kpos < self.config.window))
        if window_size is not None:
            mask = mask & (qpos - kpos < window_size)
        if step_key is not None:
            if len(self.steps) >= self.KEEP:
                self.steps.clear()
            mx.eval(mask)
            self.steps[step_key] = mask
        return mask
