"""The .tinygpt file: round trip and every way a file can be wrong."""

import json
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tinygpt_mlx import format as fmt
from tinygpt_mlx.errors import ModelFormatError
from tinygpt_mlx.loading import load


def test_round_trip(native_path, tokenizer_json):
    model, tok, _ = fmt.load(native_path)
    model2, tok2, _ = fmt.load(fmt.save(native_path.parent / "copy.tinygpt", model, tok))
    assert tok2 == tokenizer_json
    for (n1, a), (n2, b) in zip(tree_flatten(model.parameters()), tree_flatten(model2.parameters())):
        assert n1 == n2 and mx.array_equal(a, b)
    x = mx.array([[1, 2, 3, 4]])
    assert mx.array_equal(model(x), model2(x))


def test_tokenizer_round_trips_utf8(native):
    text = "Café naïve 東京 🙂 and numbers 48213."
    assert native.tokenizer.decode(native.tokenizer.encode(text)) == text


def _rewrite(path, out, mutate_meta=None, mutate_header=None, cut=None):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if mutate_meta:
        mutate_meta(header["__metadata__"])
    if mutate_header:
        mutate_header(header)
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + raw[8 + n:]
    out.write_bytes(data[:cut] if cut else data)
    return out


@pytest.mark.parametrize("case, message", [
    ("missing", "no such"),
    ("empty", "not a safetensors file"),
    ("text", "not a safetensors file"),
    ("truncated", "truncated"),
    ("format", "not a .tinygpt file"),
    ("version", "unsupported .tinygpt version"),
    ("config", "invalid model config"),
    ("shape", "has shape"),
    ("missing_tensor", "missing tensors"),
    ("no_tokenizer", "no tokenizer"),
])
def test_corrupt_files(native_path, tmp_path, case, message):
    bad = tmp_path / f"{case}.tinygpt"
    if case == "missing":
        bad = tmp_path / "nope.tinygpt"
    elif case == "empty":
        bad.write_bytes(b"")
    elif case == "text":
        bad.write_text("hello, I am not a model at all, just some words")
    elif case == "truncated":
        _rewrite(native_path, bad, cut=native_path.stat().st_size - 100)
    elif case == "format":
        _rewrite(native_path, bad, mutate_meta=lambda m: m.update(format="gguf"))
    elif case == "version":
        _rewrite(native_path, bad, mutate_meta=lambda m: m.update(format_version="99"))
    elif case == "config":
        _rewrite(native_path, bad, mutate_meta=lambda m: m.update(config='{"vocab_size": -3}'))
    elif case == "shape":
        def grow(m):
            cfg = json.loads(m["config"])
            cfg["d_ff"] = 256
            m["config"] = json.dumps(cfg)
        _rewrite(native_path, bad, mutate_meta=grow)
    elif case == "missing_tensor":
        _rewrite(native_path, bad, mutate_header=lambda h: h.pop("norm.weight"))
    elif case == "no_tokenizer":
        _rewrite(native_path, bad, mutate_meta=lambda m: m.pop("tokenizer"))
    with pytest.raises(ModelFormatError, match=message):
        load(bad)


def test_model_dir_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="no config.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="invalid JSON"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="safetensors"):
        load(tmp_path)
