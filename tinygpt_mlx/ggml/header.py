"""A GGUF file's header without its tensors: the scalar and string metadata (arrays only counted)
and the tensor table's names and GGML types. Fast enough to list many models at a server's start
(`/api/tags`) and exact about tensor types, which the tensors MLX hands back do not name.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64,
then each metadata entry (key string, value type u32, value), then each tensor's name, dimension
count u32, dimensions u64 each, GGML type u32 and data offset u64.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelFormatError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGML type ids as ggml numbers them (gguf.GGMLQuantizationType, without importing it)
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
              17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
              24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
              35: "TQ2_0", 39: "MXFP4"}


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")   # the tensor types that are not block-quantised


def main_type(counts: dict) -> str:
    """The block type most tensors have (ollama's quantization_level), else F16 / F32."""
    blocks = {t: n for t, n in counts.items() if t not in FLOAT_TYPES}
    if blocks:
        return max(blocks, key=blocks.get)
    return "F16" if "F16" in counts else "F32"


@dataclass
class Header:
    version: int
    metadata: dict = field(default_factory=dict)      # arrays as {"array": type, "count": n}
    tensor_types: dict = field(default_factory=dict)  # tensor name -> GGML type name

    @property
    def type_counts(self) -> Counter:
        return Counter(self.tensor_types.values())

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def main_type(self) -> str:
        return main_type(self.type_counts)


class _Reader:
    def __init__(self, f, path):
        self.f, self.path = f, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ModelFormatError(f"{self.path}: GGUF header ends early (truncated file)")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.take("<Q")
        if n > 1 << 24:
            raise ModelFormatError(f"{self.path}: GGUF header is corrupt (a {n}-byte string)")
        data = self.f.read(n)
        if len(data) != n:
            raise ModelFormatError(f"{self.path}: GGUF header ends early (truncated file)")
        return data.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            if itype in _SCALARS:
                self.f.seek(struct.calcsize(_SCALARS[itype]) * count, 1)
            else:
                for _ in range(count):
                    self.value(itype)
            return {"array": itype, "count": count}
        raise ModelFormatError(f"{self.path}: GGUF header is corrupt (value type {vtype})")


def read_header(path: Path) -> Header:
    with open(path, "rb") as f:
        r = _Reader(f, path)
        if f.read(4) != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (no GGUF magic bytes)")
        version = r.take("<I")
        if version not in (2, 3):
            raise ModelFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        header = Header(version)
        for _ in range(n_kv):
            key = r.string()
            header.metadata[key] = r.value(r.take("<I"))
        for _ in range(n_tensors):
            name = r.string()
            dims = r.take("<I")
            f.seek(8 * dims, 1)
            gtype = r.take("<I")
            r.take("<Q")
            header.tensor_types[name] = GGML_TYPES.get(gtype, f"type {gtype}")
    return header
