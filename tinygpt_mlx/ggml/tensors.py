"""Reading a GGUF file's tensors and metadata.

Two readers, each for what it does best:
- MLX's own (`mx.load(path, return_metadata=True)`): F32/F16 and the block formats MLX holds
  natively (Q4_0, Q4_1, Q8_0), which come back as packed `(weight, scales, biases)` triples with
  group size 32, ready for `QuantizedLinear`; it also returns the metadata in a fraction of a second.
- ggml's own Python package (`gguf`), for every other type (K-quants, Q5_x, IQ*, BF16...): it
  memory-maps the file and `gguf.quants.dequantize` turns each tensor into float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import mlx.core as mx
import numpy as np

from ..errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
GROUP = 32   # every GGML block format MLX reads has 32 weights per block


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass
class Packed:
    """A GGML block tensor as MLX affine-quantised triples (w = scale * q + bias per 32 weights)."""
    weight: mx.array
    scales: mx.array
    biases: mx.array

    @property
    def bits(self) -> int:
        in_dims = self.scales.shape[-1] * GROUP
        return self.weight.shape[-1] * 32 // in_dims

    def dense(self, dtype) -> mx.array:
        # in float32: the file's fp16 scales times q are not all fp16 numbers
        return mx.dequantize(self.weight, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
                             group_size=GROUP, bits=self.bits).astype(dtype)

    def take_rows(self, order: np.ndarray) -> "Packed":
        idx = mx.array(order)
        return Packed(self.weight[idx], self.scales[idx], self.biases[idx])


Tensor = Union[mx.array, Packed]


@dataclass
class GGUFContents:
    tensors: dict[str, Tensor]
    metadata: dict
    reader: str = "mlx"     # which reader read the tensors: "mlx" or "gguf"


def read(path: Path) -> GGUFContents:
    """All tensors and metadata of a GGUF file; one-line errors for corrupt or unsupported files."""
    try:
        flat, md = mx.load(str(path), return_metadata=True)
    except Exception:   # a type MLX does not hold (K-quants, Q5_x, ...) or a damaged file:
        return _read_with_gguf(path)   # ggml's reader reads the first and names the second
    tensors: dict[str, Tensor] = {}
    for name, arr in flat.items():
        if name.endswith(".scales") or name.endswith(".biases"):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in flat:
            tensors[name] = Packed(arr, flat[f"{base}.scales"], flat[f"{base}.biases"])
        else:
            tensors[name] = arr
    return GGUFContents(tensors, dict(md), "mlx")


def _read_with_gguf(path: Path) -> GGUFContents:
    import gguf   # noqa: PLC0415 (only files MLX cannot read need it)

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelFormatError(f"{path}: not a readable GGUF file, truncated or corrupt "
                               f"({str(e).splitlines()[0]})") from None
    md: dict = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        md[name] = _field_value(f, gguf)
    tensors: dict[str, Tensor] = {}
    for t in reader.tensors:
        qtype = t.tensor_type
        shape = tuple(int(x) for x in reversed(t.shape))   # GGUF lists dimensions fastest first
        try:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                arr = np.asarray(t.data).reshape(shape)
            else:
                arr = gguf.quants.dequantize(t.data, qtype).reshape(shape)
        except NotImplementedError:
            raise ModelFormatError(f"{path}: tensor {t.name} has type {qtype.name}, which cannot be "
                                   "dequantised here") from None
        tensors[t.name] = mx.array(arr.astype(np.float32) if arr.dtype != np.float16 else arr)
    return GGUFContents(tensors, md, "gguf")


def _field_value(f, gguf):
    types = f.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return np.array([f.parts[i][0] for i in f.data])
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    return f.parts[f.data[0]][0].item()
