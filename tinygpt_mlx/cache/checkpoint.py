"""In-memory checkpoints of a cache: restore a conversation's state at a turn boundary.

A bounded cache (a StreamingLLM window, a retrieval hot window, KIVI under either) cannot roll
tokens back: what it evicted to make room is gone (or, for retrieval, moved to the cold store).
So a warm slot takes a checkpoint at the end of each prompt (server/slots.py), and a request that
diverges after it (regenerate, an edited reply) restores it and prefills only from there.

A checkpoint reuses the stores' prompt-cache serialisation (`state()` / `load_state()`, store.py's
`Persistent`), held in memory instead of a file, for the parts of a layer that are bounded by
the policy (the sink, a window's body). Append-only parts, which only grow until the next
rollback, are checkpointed as a length and cut back on restore: the cold store (a mark of its
row counts) and a full (unbounded) KIVI body (its frozen block count and its exact residual).
A checkpoint therefore costs at most the window (or hot budget) plus KIVI's residual and the cold
store's unfinished page, per layer, whatever the context length.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


class HeldEntry:
    """One held array, read the way `persist.Entry` reads a file's tensor."""

    def __init__(self, array: Any):
        # mx arrays are values (a store's later in-place write re-points its own array object,
        # never this one); numpy arrays are copied (a GrowingArray writes into its buffer)
        self.array = mx.array(array) if isinstance(array, mx.array) else np.array(array, copy=True)
        self.shape = tuple(self.array.shape)

    def mx(self) -> mx.array:
        return mx.array(self.array)     # a new array object each time (see __init__)

    def np(self) -> np.ndarray:
        return np.array(self.array, copy=True)

    def copy_to(self, dest: str) -> None:
        """Write the rows into a new file `dest` (a disk store's own file, mapped afterwards)."""
        np.ascontiguousarray(self.np()).tofile(dest)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class Held:
    """A store's arrays held in memory, with `persist.Arrays`' interface (`[name]`, `in`,
    `scope(prefix)`), so `load_state` restores from it as it does from a file."""

    def __init__(self, entries: dict, prefix: str = ""):
        self.entries, self.prefix = entries, prefix

    @classmethod
    def of(cls, arrays: dict) -> "Held":
        return cls({k: HeldEntry(v) for k, v in arrays.items()})

    def __getitem__(self, name: str) -> HeldEntry:
        return self.entries[self.prefix + name]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.entries

    def scope(self, prefix: str) -> "Held":
        return Held(self.entries, self.prefix + prefix)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for k, e in self.entries.items() if k.startswith(self.prefix))


def held_nbytes(x: Any) -> int:
    """Bytes of the arrays a checkpoint holds (nested tuples, lists and dicts of Held,
    HeldEntry, numpy arrays; counters count nothing)."""
    if isinstance(x, (Held, HeldEntry)):
        return x.nbytes
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, dict):
        return sum(held_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(held_nbytes(v) for v in x)
    return 0


def take(layer: Any) -> dict:
    """A layer's state now, for `restore`: its counters, the sink and a bounded body held in
    memory, a full body and the cold store as marks (lengths to cut back to)."""
    cp: dict = layer.counters()
    for name, store in layer.stores().items():
        if name == "cold" or (name == "body" and layer.full_body()):
            cp[name] = ("mark", store.mark())
        else:
            arrays, meta = store.state()
            cp[name] = ("held", Held.of(arrays), meta)
    return cp


def restore(layer: Any, cp: dict) -> None:
    """A layer back to the state `take` returned (taken on this layer, which has only grown or
    been restored to an earlier checkpoint since)."""
    for name, store in layer.stores().items():
        kind, *rest = cp[name]
        if kind == "held":
            store.load_state(*rest)
        else:
            store.rewind(rest[0])
    layer.set_counters(cp["seen"], cp["start"], cp["base"], cp["dtype"])
