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


# --- checksums (issue #13) -------------------------------------------------------------------

def _data_start(path):
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


def _strip_checksum(path, out):
    return _rewrite(path, out, mutate_meta=lambda m: m.pop(fmt.CHECKSUM_KEY))


@pytest.fixture(scope="module")
def big_path(tmp_path_factory, tokenizer_json):
    """A model whose tensor data (~8 MiB) holds a 4 MiB zeroed region with room to spare."""
    from conftest import build_native
    return build_native(tmp_path_factory.mktemp("big") / "big.tinygpt", tokenizer_json,
                        d_model=256, n_heads=8, n_kv_heads=4, d_ff=1024)


def test_save_stores_a_checksum_and_load_verifies_it(native_path):
    f = fmt.load_file(native_path)
    assert f.checksum is not None and f.checksum.algorithm == "sha256"
    assert len(f.checksum.tensors) == 64 and len(f.checksum.metadata) == 64
    loaded = load(native_path)
    assert loaded.info["checksum"]["tensors"] == f.checksum.tensors
    assert loaded.checksum_state == f"verified sha256 {f.checksum.tensors[:16]}…"


def test_zeroed_4mib_region_is_caught(big_path, tmp_path):
    raw = bytearray(big_path.read_bytes())
    start = _data_start(big_path) + 12345           # inside the tensor data, not at a boundary
    region = 4 << 20
    assert len(raw) - start > region + 1024
    assert any(raw[start:start + region])           # there was something to destroy
    raw[start:start + region] = bytes(region)
    bad = tmp_path / "zeroed.tinygpt"
    bad.write_bytes(bytes(raw))
    assert bad.stat().st_size == big_path.stat().st_size
    with pytest.raises(ModelFormatError) as e:
        load(bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad}: checksum mismatch: the weights are corrupted (expected sha256 ")
    assert "re-download or re-export the model" in msg and "\n" not in msg
    load(big_path)  # the untouched original still verifies


def test_one_flipped_bit_in_the_last_byte_is_caught(native_path, tmp_path):
    raw = bytearray(native_path.read_bytes())
    raw[-1] ^= 1
    bad = tmp_path / "flip.tinygpt"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match="checksum mismatch: the weights are corrupted"):
        fmt.load(bad)


def test_swapped_tensors_are_caught(native_path, tmp_path):
    """The digest binds each name to its bytes: swapping two same-shaped tensors' offsets fails."""
    def swap(h):
        a, b = "layers.0.attn.q_proj.weight", "layers.0.attn.o_proj.weight"
        assert h[a]["shape"] == h[b]["shape"]
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    bad = _rewrite(native_path, tmp_path / "swap.tinygpt", mutate_header=swap)
    with pytest.raises(ModelFormatError, match="checksum mismatch: the weights are corrupted"):
        load(bad)


@pytest.mark.parametrize("key, value", [
    ("extra", '{"steps": 999}'),
    ("tokenizer", None),  # a valid tokenizer JSON, re-serialised (different bytes, same meaning)
])
def test_edited_metadata_is_caught(native_path, tmp_path, key, value):
    def edit(m):
        m[key] = value if value is not None else json.dumps(json.loads(m[key]), indent=1)
    bad = _rewrite(native_path, tmp_path / "meta.tinygpt", mutate_meta=edit)
    with pytest.raises(ModelFormatError, match="checksum mismatch: the config/tokenizer metadata is corrupted"):
        load(bad)


@pytest.mark.parametrize("value, message", [
    ("not json", "unreadable checksum field"),
    ('{"algorithm": "sha256"}', "unreadable checksum field"),
    ('{"algorithm": "crc-nope", "tensors": "00", "metadata": "00"}', "unsupported checksum algorithm"),
])
def test_malformed_checksum_field(native_path, tmp_path, value, message):
    bad = _rewrite(native_path, tmp_path / "ck.tinygpt", mutate_meta=lambda m: m.update(checksum=value))
    with pytest.raises(ModelFormatError, match=message):
        load(bad)


def test_file_saved_before_checksums_still_loads(native_path, tmp_path):
    old = _strip_checksum(native_path, tmp_path / "old.tinygpt")
    f = fmt.load_file(old)
    assert f.checksum is None
    new = fmt.load_file(native_path)
    for (n1, a), (n2, b) in zip(tree_flatten(f.model.parameters()), tree_flatten(new.model.parameters())):
        assert n1 == n2 and mx.array_equal(a, b)
    loaded = load(old)
    assert loaded.info["checksum"] is None
    assert loaded.checksum_state == "none (saved before checksums existed)"


def test_cli_info_shows_the_checksum_state(native_path, tmp_path):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app
    old = _strip_checksum(native_path, tmp_path / "old.tinygpt")
    r = CliRunner().invoke(app, ["info", str(old)])
    assert r.exit_code == 0, r.output
    assert "checksum        none (saved before checksums existed)" in r.stdout
    r = CliRunner().invoke(app, ["info", str(native_path)])
    digest = fmt.load_file(native_path).checksum.tensors
    assert f"checksum        verified sha256 {digest[:16]}…" in r.stdout
    r = CliRunner().invoke(app, ["info", str(native_path), "--json"])
    out = json.loads(r.stdout)
    assert out["checksum"].startswith("verified sha256 ") and out["checksum_digests"]["tensors"] == digest


@pytest.mark.parametrize("command", [["info"], ["sample", "--prompt", "hello", "--tokens", "2"]])
def test_cli_refuses_a_corrupted_file_in_one_line(big_path, tmp_path, command):
    """In pytest's process (typer's CliRunner, stderr apart; a subprocess spent seconds importing
    before the refusal): an exception other than the CLI's own exit would be a traceback in a
    real run, so it fails here."""
    from tests import process_warnings
    raw = bytearray(big_path.read_bytes())
    start = _data_start(big_path) + 4096
    raw[start:start + (4 << 20)] = bytes(4 << 20)
    bad = tmp_path / "zeroed.tinygpt"
    bad.write_bytes(bytes(raw))
    r = process_warnings.invoke([command[0], bad, *command[1:]])
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {bad}: checksum mismatch: the weights are corrupted")
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_shipped_model_verifies():
    from tinygpt_mlx.loading import default_model_path
    f = fmt.load_file(default_model_path())
    assert f.checksum is not None and f.checksum.algorithm == "sha256"
    assert load().checksum_state.startswith("verified sha256 ")


def test_save_is_atomic_and_verifies_before_replacing(native_path, tmp_path, monkeypatch):
    model, tok, extra = fmt.load(native_path)
    target = tmp_path / "m.tinygpt"
    fmt.save(target, model, tok)
    before = target.read_bytes()
    # save's in-memory digest disagrees with the bytes written: it must refuse, `target` untouched
    real, calls = fmt.tensor_digest, []

    def first_call_wrong(records, algorithm="sha256"):
        calls.append(1)
        return "0" * 64 if len(calls) == 1 else real(records, algorithm)
    monkeypatch.setattr(fmt, "tensor_digest", first_call_wrong)
    with pytest.raises(ModelFormatError, match="checksum mismatch"):
        fmt.save(target, model, tok)
    monkeypatch.undo()

    def half_write(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fmt.mx, "save_safetensors", half_write)
    with pytest.raises(OSError):
        fmt.save(target, model, tok)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.tinygpt"]  # no temp file left behind
