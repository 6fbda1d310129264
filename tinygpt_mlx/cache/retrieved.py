"""Attention of a layer that holds a cold store (retrieval): the tokens each query fetches back
from the cold store (cold.py), the sink and the hot window, under one softmax (segments.attend).

On frame positions the queries are turned back to the retrieved slot (which the coarse pass
scores cold keys with anyway): against them retrieved keys sit at slot 0 and the sink at fixed
slots before it, so neither is rotated per step; the window scores with the queries as given.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .segments import Reading, attend


def attend_retrieving(layer: Any, queries: mx.array, scale: float, mask: Any) -> mx.array:
    """`LayerCache.attend` for a layer whose cold store holds tokens (module doc); the layer's
    retrieval telemetry records what the queries picked (where asked: `KVCache.record_retrievals`)."""
    stages = layer.cold.stages
    with stages.timed("model"):     # (bench's stage split: the model up to this query)
        stages.sync(queries)
    slot = layer.positions.retrieved_slot(len(layer.sink_store), len(layer.cold))
    if layer.positions.frame:
        turned = layer.positions.rotate_to(queries.astype(mx.float32), -(layer.slot0() + slot))
        retrieved, selection = layer.cold.retrieve(Reading(layer.dtype, layer.positions, 0, turned, scale))
        sink = layer.sink_store.segments(Reading(layer.dtype, layer.positions, -slot))
        segments = retrieved + sink + layer.body.segments(layer.readings()[1])
        n_turned = len(retrieved) + len(sink)
    else:
        turned, n_turned = None, 0
        retrieved, selection = layer.cold.retrieve(Reading(layer.dtype, layer.positions, slot, queries, scale))
        segments = retrieved + layer.segments()
    with stages.timed("attend"):
        out = attend(segments, len(retrieved), queries, scale, mask, turned, n_turned)
        stages.sync(out)
    if layer.telemetry.on:      # (asked for: KVCache.record_retrievals)
        layer.telemetry.record(selection)   # after attention: what the last query picked is known there
    return out
