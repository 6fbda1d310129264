"""The `.tinygpt` file: one safetensors file with the weights and, in its metadata, the format
name and version, the model config as JSON and a Hugging Face `tokenizers` JSON (byte-level
BPE, so any UTF-8 text round-trips). `load` validates everything and raises
`ModelFormatError` with one clear line for every way a file can be wrong.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Union

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .config import ModelConfig
from .errors import ModelFormatError
from .model import Model

FORMAT_NAME = "tinygpt"
FORMAT_VERSION = 1
SUFFIX = ".tinygpt"


def save(path: Union[str, Path], model: Model, tokenizer_json: str, extra: dict | None = None) -> Path:
    """Write `model` and its tokenizer to `path` (a `.tinygpt` safetensors file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(model.config.to_dict()),
        "tokenizer": tokenizer_json,
        "extra": json.dumps(extra or {}),
    }
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), weights, metadata=metadata)
    tmp.replace(path)
    return path


def read_header(path: Path) -> tuple[dict, dict]:
    """Parse the safetensors header by hand so that a bad file gives a precise error."""
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
    return header, metadata


def load(path: Union[str, Path]) -> tuple[Model, str, dict]:
    """Load a `.tinygpt` file: returns (model, tokenizer JSON, extra metadata)."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such model file")
    if path.is_dir():
        raise ModelFormatError(f"{path}: is a directory, not a .tinygpt file")
    header, meta = read_header(path)
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
    return model, tokenizer_json, extra
