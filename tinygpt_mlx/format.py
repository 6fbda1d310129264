"""The `.tinygpt` file: one safetensors file with the weights and, in its metadata, the format
name and version, the model config as JSON and a Hugging Face `tokenizers` JSON (byte-level
BPE, so any UTF-8 text round-trips). `load` validates everything and raises
`ModelFormatError` with one clear line for every way a file can be wrong.

Integrity: `save` also stores, under the metadata key `checksum`, a JSON object
`{"algorithm": "sha256", "tensors": HEX, "metadata": HEX}`. `tensors` hashes every tensor in
name order (its name, dtype, shape and byte length, then its raw bytes as stored); `metadata`
hashes the config, tokenizer and extra strings. `load` recomputes both and refuses a file whose
bytes changed (about 25 ms for the shipped 17 MB model). Files saved before checksums existed
have no such key and still load (`NativeFile.checksum` is then None). The key is additive, so
the format version stays 1 and older readers load new files unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .config import ModelConfig
from .errors import ModelFormatError
from .model import Model

FORMAT_NAME = "tinygpt"
#: a prompt-cache file's format (cache/persist.py FORMAT_NAME), named where one is given as a model
PROMPT_CACHE_FORMAT = "posttrainllm-prompt-cache"
FORMAT_VERSION = 1
SUFFIX = ".tinygpt"
CHECKSUM_KEY = "checksum"
CHECKSUM_ALGORITHM = "sha256"
HASHED_METADATA = ("config", "tokenizer", "extra")  # every metadata string except format/version/checksum


@dataclass(frozen=True)
class Checksum:
    """The digests stored in (or computed for) a `.tinygpt` file."""
    algorithm: str
    tensors: str
    metadata: str

    def to_json(self) -> str:
        return json.dumps({"algorithm": self.algorithm, "tensors": self.tensors, "metadata": self.metadata})

    def describe(self) -> str:
        """For `info`: e.g. 'sha256 3f9a0c1b…' (the tensors digest, shortened)."""
        return f"{self.algorithm} {self.tensors[:16]}…"


@dataclass
class NativeFile:
    """What `load_file` returns: the model, its tokenizer JSON, the extra (training) metadata
    and the verified checksum, or None for a file saved before checksums existed."""
    model: Model
    tokenizer_json: str
    extra: dict = field(default_factory=dict)
    checksum: Optional[Checksum] = None


def tensor_digest(tensors: Iterable[tuple[str, str, list, "bytes | memoryview"]],
                  algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hash (name, safetensors dtype, shape, raw bytes) records in name order."""
    h = hashlib.new(algorithm)
    for name, dtype, shape, data in sorted(tensors, key=lambda t: t[0]):
        data = memoryview(data).cast("B")
        h.update(json.dumps([name, dtype, list(shape), data.nbytes]).encode() + b"\n")
        h.update(data)
    return h.hexdigest()


def metadata_digest(metadata: dict, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hash the metadata strings that `HASHED_METADATA` names (a missing one hashes as absent)."""
    h = hashlib.new(algorithm)
    for key in HASHED_METADATA:
        value = metadata.get(key)
        raw = b"" if value is None else str(value).encode("utf-8", "surrogatepass")
        h.update(json.dumps([key, value is not None, len(raw)]).encode() + b"\n")
        h.update(raw)
    return h.hexdigest()


def save(path: Union[str, Path], model: Model, tokenizer_json: str, extra: dict | None = None) -> Path:
    """Write `model` and its tokenizer to `path` (a `.tinygpt` safetensors file) with a checksum.

    Atomic: the file is written under a unique temporary name in the same folder, read back and
    verified, flushed to disk and only then renamed over `path`; on any error `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(model.config.to_dict()),
        "tokenizer": tokenizer_json,
        "extra": json.dumps(extra or {}),
    }
    arrays = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in weights.items()}
    digest = tensor_digest((k, "F32", list(a.shape), a.astype("<f4", copy=False).data) for k, a in arrays.items())
    metadata[CHECKSUM_KEY] = Checksum(CHECKSUM_ALGORITHM, digest, metadata_digest(metadata)).to_json()
    # mlx appends ".safetensors" to names without it, hence the suffix
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), weights, metadata=metadata)
        load_file(tmp)  # the bytes on disk must verify before they replace anything
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_header(path: Path) -> tuple[dict, dict, int]:
    """Parse a safetensors header by hand so that a bad file gives a precise error: (tensor
    entries, metadata, offset of the data region). Prompt-cache files are read with it too."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > min(size - 8, 1 << 30):
                raise ModelFormatError(f"{path}: not a safetensors file (bad header length)")
            raw = f.read(n)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read file ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFormatError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: not a safetensors file (header is not an object)")
    metadata = header.pop("__metadata__", {}) or {}
    end = 0
    for name, info in header.items():
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ModelFormatError(f"{path}: corrupt tensor entry {name!r} in header") from None
    if 8 + n + end > size:
        raise ModelFormatError(f"{path}: file is truncated ({size} bytes, header promises {8 + n + end})")
    return header, metadata, 8 + n


def _stored_checksum(path: Path, meta: dict) -> Optional[Checksum]:
    """The checksum the file declares; None for a file saved before checksums existed."""
    raw = meta.get(CHECKSUM_KEY)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        c = Checksum(str(d["algorithm"]), str(d["tensors"]), str(d["metadata"]))
    except (json.JSONDecodeError, TypeError, KeyError):
        raise ModelFormatError(f"{path}: unreadable checksum field in metadata; re-download or re-export "
                               "the model") from None
    if c.algorithm not in hashlib.algorithms_guaranteed:
        raise ModelFormatError(f"{path}: unsupported checksum algorithm {c.algorithm!r}")
    return c


def _verify(path: Path, header: dict, meta: dict, data_start: int, expected: Checksum) -> None:
    """Recompute the digests from the bytes on disk; a one-line error on any difference."""
    try:
        with open(path, "rb") as f:
            f.seek(data_start)
            data = memoryview(f.read())
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read file ({e.strerror})") from None
    records = []
    for name, info in header.items():
        start, end = (int(x) for x in info["data_offsets"])
        records.append((name, info.get("dtype"), info.get("shape", []), data[start:end]))
    got = tensor_digest(records, expected.algorithm)
    if got != expected.tensors:
        raise ModelFormatError(
            f"{path}: checksum mismatch: the weights are corrupted (expected {expected.algorithm} "
            f"{expected.tensors[:12]}…, got {got[:12]}…); re-download or re-export the model")
    got = metadata_digest(meta, expected.algorithm)
    if got != expected.metadata:
        raise ModelFormatError(
            f"{path}: checksum mismatch: the config/tokenizer metadata is corrupted (expected "
            f"{expected.algorithm} {expected.metadata[:12]}…, got {got[:12]}…); re-download or re-export the model")


def load(path: Union[str, Path]) -> tuple[Model, str, dict]:
    """Load a `.tinygpt` file: returns (model, tokenizer JSON, extra metadata). See `load_file`."""
    f = load_file(path)
    return f.model, f.tokenizer_json, f.extra


def load_file(path: Union[str, Path]) -> NativeFile:
    """Load and validate a `.tinygpt` file, verifying its checksum when it has one."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such model file")
    if path.is_dir():
        raise ModelFormatError(f"{path}: is a directory, not a .tinygpt file")
    header, meta, data_start = read_header(path)
    if meta.get("format") == PROMPT_CACHE_FORMAT:     # given as MODEL instead of to --prompt-cache
        raise ModelFormatError(f"{path}: a prompt-cache file (cache-prompt's), not a model; continue it with "
                               f"posttrainllm sample MODEL --prompt-cache {path} --prompt QUESTION")
    if meta.get("format") != FORMAT_NAME:
        raise ModelFormatError(f"{path}: not a .tinygpt file (format {meta.get('format')!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ModelFormatError(
            f"{path}: unsupported .tinygpt version {meta.get('format_version')!r} (this build reads {FORMAT_VERSION})")
    try:
        cfg = ModelConfig.from_dict(json.loads(meta["config"]))
    except KeyError:
        raise ModelFormatError(f"{path}: metadata has no model config") from None
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}: invalid model config ({e})") from None
    tokenizer_json = meta.get("tokenizer")
    if not tokenizer_json:
        raise ModelFormatError(f"{path}: metadata has no tokenizer")
    model = Model(cfg)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(header))
    if missing:
        raise ModelFormatError(f"{path}: missing tensors: {', '.join(missing[:5])}"
                               + (" ..." if len(missing) > 5 else ""))
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        raise ModelFormatError(f"{path}: unexpected tensors: {', '.join(unexpected[:5])}")
    for name, arr in expected.items():
        shape = list(header[name].get("shape", []))
        if shape != list(arr.shape):
            raise ModelFormatError(
                f"{path}: tensor {name} has shape {shape}, config says {list(arr.shape)}")
    checksum = _stored_checksum(path, meta)
    if checksum is not None:
        _verify(path, header, meta, data_start, checksum)
    try:
        weights = mx.load(str(path), format="safetensors")
    except Exception as e:  # mlx raises RuntimeError/ValueError with long messages
        raise ModelFormatError(f"{path}: corrupt safetensors data ({str(e).splitlines()[0]})") from None
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    try:
        extra = json.loads(meta.get("extra", "{}"))
    except json.JSONDecodeError:
        extra = {}
    return NativeFile(model, tokenizer_json, extra, checksum)
