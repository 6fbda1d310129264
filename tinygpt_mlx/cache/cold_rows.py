"""The cold store's rows: what the hot window evicts, stored token-major with its positions and
page summaries, grown, persisted, rewound and closed (`ColdRows`; the search over them is
`cold.ColdStore`, which extends it).

Rows are stored token-major in `arrays.GrowingArray`s [capacity, B*Hkv, D] that double when full
(amortised O(page) per page; on disk a numpy memmap whose file grows in place, in a private
directory removed by `close()` or when the store is collected); `cold_bits` packs them with the
cache's codec (`KVCache.quantise_affine`, values' per-token layout). Summaries are kept by the
page index (pages.py), in RAM or mapped beside the rows.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..config import CacheConfig
from .arrays import GrowingArray, PackedRows, private_dir, remove_dir, remove_with
from .pages import NAMES as SUMMARIES, PageIndex

__all__ = ["ColdRows"]

_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}  # numpy has no bf16


class ColdRows:
    """One layer's evicted rows (keys, values, absolute positions) and their page index."""

    def __init__(self, config: CacheConfig, codec: Any, layer_index: int = 0):
        self.config = config
        self.codec = codec           # KVCache: the packing of `cold_bits` rounds through it
        self.layer_index = layer_index
        self.page_size = config.page_size
        self.cold_bits = config.cold_bits
        self.dtype = _NP_DTYPES[config.storage]
        # a private directory for the disk store, removed by close() or with this store
        self.directory = private_dir(f"cold-l{layer_index}", config.cold_path) if config.cold_store == "disk" else None
        if self.directory is not None:
            remove_with(self, self.directory)
        self.n = 0
        self.G: Optional[int] = None  # B * Hkv
        self.B: Optional[int] = None
        self.keys = self.values = None   # GrowingArray [n, G, D] or PackedRows
        self.positions: Optional[GrowingArray] = None
        self.index: Optional[PageIndex] = None   # the page summaries and the coarse pass (pages.py)

    # ----- storage --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    @property
    def n_pages(self) -> int:
        return self.n // self.page_size

    def _path(self, name: str) -> Optional[str]:
        if self.directory is None:
            return None
        return os.path.join(self.directory, f"layer{self.layer_index}-{name}.bin")

    def _init_arrays(self, B: int, H: int, Dk: int, Dv: int) -> None:
        self.B, self.G = B, B * H
        self.dims = (Dk, Dv)
        G = self.G
        if self.cold_bits is None:
            self.keys = GrowingArray((G, Dk), self.dtype, self._path("keys"))
            self.values = GrowingArray((G, Dv), self.dtype, self._path("values"))
        else:
            self.keys = PackedRows(G, Dk, self.cold_bits, self._path("keys"), self.codec)
            self.values = PackedRows(G, Dv, self.cold_bits, self._path("values"), self.codec)
        # a disk store maps everything that grows with the document (positions and summaries
        # too), so its anonymous memory stays bounded by the hot window and the open page
        self.positions = GrowingArray((), np.int64, self._path("positions"))
        self.index = PageIndex(self.config, G, Dk, self._path)

    def append(self, keys: mx.array, values: mx.array, start_position: int) -> None:
        """Append evicted tokens [B, H, n, D] whose first has absolute position `start_position`."""
        B, H, n, Dk = keys.shape
        if n == 0:
            return
        if self.G is None:
            self._init_arrays(B, H, Dk, values.shape[3])
        k = np.asarray(keys.astype(mx.float32)).transpose(2, 0, 1, 3).reshape(n, B * H, Dk)
        v = np.asarray(values.astype(mx.float32)).transpose(2, 0, 1, 3).reshape(n, B * H, -1)
        self.keys.append(k.astype(self.dtype) if self.cold_bits is None else k)
        self.values.append(v.astype(self.dtype) if self.cold_bits is None else v)
        self.positions.append(np.arange(start_position, start_position + n, dtype=np.int64))
        self.index.add(k)   # summaries of the pages this completes (exact keys, before rounding)
        self.n += n

    def _gather(self, store: Any, idx: np.ndarray) -> np.ndarray:
        gi = np.arange(self.G).reshape((self.G,) + (1,) * (idx.ndim - 1))
        if isinstance(store, GrowingArray):
            return store.array[idx, gi].astype(np.float32)
        return store.gather(idx, gi)

    # ----- accounting -----------------------------------------------------------------------
    def nbytes_breakdown(self) -> dict[str, int]:
        if self.G is None:
            return {"cold": 0}
        # rows under "cold", page summaries under "cold_summary", the token positions (one per
        # token, not per head) under "cold_positions"; "_disk" where mapped
        out: dict[str, int] = {}
        for name, array in self._row_arrays().items():
            part = ("cold_positions" if name == "positions" else "cold_summary" if name in SUMMARIES
                    else "cold") + ("_disk" if array.path else "")
            out[part] = out.get(part, 0) + array.nbytes
        return out

    # ----- prompt-cache files (cache/persist.py) ----------------------------------------------
    def _row_arrays(self) -> dict:
        """Every GrowingArray of this store by name: cold rows (or their packed parts), the
        positions, the page summaries and the index's block summaries."""
        out = {}
        for side in ("keys", "values"):
            store = getattr(self, side)
            if isinstance(store, PackedRows):
                out.update({f"{side}.{p}": getattr(store, p) for p in ("codes", "scale", "zero")})
            elif store is not None:
                out[side] = store
        out["positions"] = self.positions
        out.update(self.index.arrays())
        return out

    def state(self) -> tuple[dict, dict]:
        """Rows as stored (a disk store's rows streamed from its files), summaries, positions,
        the exact keys of the unfinished page and the counters."""
        meta: dict = {"n": self.n, "G": self.G, "B": self.B}
        if self.G is None:
            return {}, meta
        meta["dims"] = list(self.dims)
        arrays: dict = {}
        for name, arr in self._row_arrays().items():
            arrays[name], meta[name] = arr.state()
        tail = self.index.tail_keys()
        arrays["tail_keys"] = tail if tail is not None else np.zeros((0, self.G, self.dims[0]), np.float32)
        return arrays, meta

    def load_state(self, arrays, meta: dict) -> None:
        if meta["G"] is None:
            return
        G, B = int(meta["G"]), int(meta["B"])
        self._init_arrays(B, G // B, *meta["dims"])
        for name, arr in self._row_arrays().items():
            arr.load_state(arrays[name], meta[name])
        self.index.set_tail(arrays["tail_keys"].np())
        self.n = int(meta["n"])

    # ----- checkpoints (cache/checkpoint.py) --------------------------------------------------
    def mark(self) -> dict:
        """This append-only store's extent, to cut it back to (`rewind`): every array's row count,
        and the exact keys of the unfinished page (fewer than a page)."""
        if self.G is None:
            return {"n": 0}
        return {"n": self.n, "rows": {name: len(a) for name, a in self._row_arrays().items()},
                "tail": self.index.tail_keys()}

    def rewind(self, mark: dict) -> None:
        """Cut the store back to what it held at `mark` (rows appended since are forgotten)."""
        if self.G is None:
            return
        rows = mark.get("rows", {})
        for name, arr in self._row_arrays().items():
            arr.truncate(rows.get(name, 0))
        self.n = mark["n"]
        self.index.set_tail(mark.get("tail"))

    def close(self) -> None:
        """Drop the arrays (and the disk store's files)."""
        self.keys = self.values = None
        self.n = 0
        if self.directory is not None:
            remove_dir(self.directory)

