"""Count what one model call runs: the nodes of its lazy MLX graph, by primitive.

`mx.export_to_dot` writes the graph that evaluating the outputs would run (the inputs already
evaluated, e.g. the cache's buffers from earlier steps, are sources, not nodes). Every node is
one primitive; those that only change an array's view (reshape, broadcast, slice, transpose ...)
launch no kernel on a GPU, the rest are kernels there. On this CPU build the fused kernels
(`mx.fast.rope`, `scaled_dot_product_attention`) appear as the ops they fall back to, so counts
here are larger than on Metal; the difference between two caches on the same model is what the
caches add, on either backend.
"""

from __future__ import annotations

import io
import re
from collections import Counter

import mlx.core as mx

#: primitives that produce a view of their input (no kernel launch on a GPU)
VIEWS = frozenset({"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "AsStrided",
                   "StopGradient", "Flatten", "Unflatten", "Depends"})
_LABEL = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def graph_ops(*outputs: mx.array) -> Counter:
    """Primitive name -> how many nodes of that kind evaluating `outputs` would run. Call it
    before evaluating them (an evaluated array has no graph left)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return Counter(_LABEL.findall(buf.getvalue()))


def summary(ops: Counter) -> dict:
    """{"ops": every node, "kernels": the nodes that are not views, "by_primitive": counts}."""
    total = sum(ops.values())
    views = sum(n for name, n in ops.items() if name in VIEWS)
    return {"ops": total, "kernels": total - views, "by_primitive": dict(sorted(ops.items()))}
