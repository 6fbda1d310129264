"""Reading a GGUF file's tensors and metadata.

Two readers, each for what it does best:
- MLX's own (`mx.load(path, return_metadata=True)`): F32/F16 and the block formats MLX holds
  natively (Q4_0, Q4_1, Q8_0), which come back as packed `(weight, scales, biases)` triples with
  group size 32, ready for `QuantizedLinear`; it also returns the metadata in a fraction of a second.
- ggml's own Python package (`gguf`), for every other type (K-quants, Q5_x, IQ*, BF16...): its
  reader parses the header and tensor table, and `gguf.quants.dequantize` turns each tensor into
  float32, a block of rows at a time written into the tensor's MLX array (`_tensor_from_file`).
  Whole, it held a tensor four times over (dequantize's pieces, its joined result, a float32
  copy, MLX's copy: 2.7 GB at once for Gemma 3 270M's 671 MB token embedding) and every page of
  the memory-mapped file it touched (docs/gguf.md, "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union

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


def read(path: Path, before_tensors: Optional[Callable[[dict], None]] = None) -> GGUFContents:
    """All tensors and metadata of a GGUF file; one-line errors for corrupt or unsupported files.

    `before_tensors(metadata)` runs once the metadata is read, before ggml's reader dequantises
    any tensor (MLX's reader reads both at once: after it): memory a caller needs only for a while
    (the loader builds the tokenizer there) is then free again before the float32 weights exist."""
    try:
        flat, md = mx.load(str(path), return_metadata=True)
    except Exception:   # a type MLX does not hold (K-quants, Q5_x, ...) or a damaged file:
        return _read_with_gguf(path, before_tensors)   # ggml's reader reads the first and names the second
    if before_tensors is not None:
        before_tensors(dict(md))
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


def _read_with_gguf(path: Path, before_tensors: Optional[Callable[[dict], None]] = None) -> GGUFContents:
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
    # the reader dropped before any tensor is made: its parsed fields are Python objects, several
    # per vocabulary entry (690 MB for Gemma 3's 262,144 tokens)
    table = [_Entry(t.name, t.tensor_type, tuple(int(x) for x in reversed(t.shape)), int(t.n_elements),
                    int(t.data_offset), t.data.dtype, tuple(t.data.shape)) for t in reader.tensors]
    del reader
    if before_tensors is not None:
        before_tensors(md)
    tensors: dict[str, Tensor] = {}
    with open(path, "rb") as f:
        for t in table:
            try:
                tensors[t.name] = _tensor_from_file(f, t, gguf)
            except NotImplementedError:
                raise ModelFormatError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which "
                                       "cannot be dequantised here") from None
            except EOFError:
                raise ModelFormatError(f"{path}: not a readable GGUF file, truncated or corrupt "
                                       f"(tensor {t.name} ends past the end of the file)") from None
    return GGUFContents(tensors, md, "gguf")


#: float32 bytes dequantised at a time: the most a tensor costs beyond its own MLX array
CHUNK_BYTES = 16 << 20


class _Entry(NamedTuple):
    """One tensor of ggml's reader, without the reader."""
    name: str
    tensor_type: Any       # gguf.GGMLQuantizationType
    shape: tuple           # slowest dimension first
    n_elements: int
    data_offset: int       # from the file's start
    dtype: np.dtype        # of the reader's view of its bytes (byte order included)
    layout: tuple          # that view's shape: rows of bytes for block types


def _tensor_from_file(f, t: _Entry, gguf) -> mx.array:
    """Tensor `t` of ggml's reader as an MLX array: float16 kept, float32 and every block type in
    float32 (`gguf.quants.dequantize`'s values), read from `f` and dequantised CHUNK_BYTES of
    output at a time into the array. Each block of rows is dequantised on its own, as the whole
    tensor would be, so the values are the same; the bytes are read with `f`, not through the
    reader's memory map, whose touched pages would stay in the process until it is closed."""
    qtype, shape = t.tensor_type, t.shape
    rows = int(np.prod(t.layout[:-1], dtype=np.int64))
    row_bytes = t.layout[-1] * t.dtype.itemsize
    per_row = t.n_elements // rows
    raw_float = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    out_dtype = mx.float16 if qtype == gguf.GGMLQuantizationType.F16 else mx.float32
    step = max(1, CHUNK_BYTES // (per_row * 4))

    def piece(first: int, n: int) -> np.ndarray:
        f.seek(t.data_offset + first * row_bytes)
        buf = f.read(n * row_bytes)
        if len(buf) != n * row_bytes:
            raise EOFError
        raw = np.frombuffer(buf, dtype=t.dtype).reshape(n, t.layout[-1])
        values = raw.astype(raw.dtype.newbyteorder("="), copy=False) if raw_float \
            else gguf.quants.dequantize(raw, qtype)
        return values.reshape(n, per_row)

    if rows <= step:
        return mx.array(piece(0, rows)).reshape(shape)
    out = mx.zeros((rows, per_row), out_dtype)
    mx.eval(out)
    for first in range(0, rows, step):
        n = min(step, rows - first)
        out[first:first + n] = mx.array(piece(first, n))
        mx.eval(out)    # written in place: `out` is the only reference to its buffer
    return out.reshape(shape)


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
