"""The prompt-cache file's bytes: a standard safetensors file written by hand, so that rows of
memory-mapped stores stream from their files into it piece by piece (never all in RAM), with a
sha256 over the canonical header and the data (persist.py holds what goes into it)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

PLACEHOLDER = "?" * 64          # the digest's place in the header until the data is hashed
CHUNK = 16 << 20                # bytes written / hashed / copied at a time

NP_TAGS = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint32): "U32",
            np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint16): "U16",
            np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
TAG_NP = {v: k for k, v in NP_TAGS.items()} | {"BF16": np.dtype(np.uint16)}


def as_numpy(a: Any) -> tuple[np.ndarray, str]:
    """An array as (contiguous numpy, safetensors dtype tag); bf16 travels as its bit patterns."""
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            return np.ascontiguousarray(np.asarray(a.view(mx.uint16))), "BF16"
        a = np.asarray(a)
    a = np.ascontiguousarray(a)          # a contiguous slice of a memmap stays a view of it
    if a.dtype not in NP_TAGS:
        raise TypeError(f"cannot store a {a.dtype} array in a prompt-cache file")
    return a, NP_TAGS[a.dtype]


def chunks(a: np.ndarray):
    """The bytes of `a` in pieces of about CHUNK (rows of a memory-mapped array are read from
    its file piece by piece, never all at once)."""
    flat = a.reshape(-1) if a.size else a.reshape(0)
    step = max(1, CHUNK // max(a.itemsize, 1))
    for lo in range(0, flat.size, step):
        yield memoryview(flat[lo:lo + step]).cast("B")


def canonical(header: dict) -> bytes:
    """The header as hashed: tensors and metadata, without the checksum, in a fixed spelling."""
    h = dict(header)
    h["__metadata__"] = {k: v for k, v in h.get("__metadata__", {}).items() if k != "checksum"}
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()


def write(path: Path, tensors: dict, metadata: dict) -> None:
    """Write a safetensors file at `path` (already a temporary name) with a checksum."""
    header: dict = {"__metadata__": dict(metadata)}
    arrays, offset = [], 0
    for name, a in tensors.items():
        a, tag = as_numpy(a)
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    digest = hashlib.sha256(canonical(header))
    header["__metadata__"]["checksum"] = json.dumps({"algorithm": "sha256", "digest": PLACEHOLDER})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    at = raw.index(PLACEHOLDER.encode())
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            for piece in chunks(a):
                digest.update(piece)
                f.write(piece)
        f.seek(8 + at)
        f.write(digest.hexdigest().encode())
        f.flush()
        os.fsync(f.fileno())


def data_digest(path: Path, header: dict, meta: dict, data_start: int) -> str:
    """The sha256 of the canonical header (with `meta`) and the data region of the file."""
    digest = hashlib.sha256(canonical({**header, "__metadata__": meta}))
    end = data_start + max((int(h["data_offsets"][1]) for h in header.values()), default=0)
    with open(path, "rb") as f:
        f.seek(data_start)
        left = end - data_start
        while left > 0:
            piece = f.read(min(left, CHUNK))
            if not piece:
                break
            digest.update(piece)
            left -= len(piece)
    return digest.hexdigest()
