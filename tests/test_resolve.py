"""MODEL resolution: paths (GGUF by magic bytes), ollama names from an ollama store layout, Hugging
Face repo ids from a hub cache layout, and a one-line error for each way it can fail."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import build_llama_dir
from tests.gguf_writer import write_gguf
from tinygpt_mlx.errors import ModelFormatError
from tinygpt_mlx.resolve import MODELS_DIR, ollama_names, resolve


def make_ollama_store(root: Path, gguf_file: Path, name: str, tag: str = "latest", ns: str = "library",
                      link: bool = False) -> Path:
    """An ollama store as ollama lays it out: a manifest naming the model layer's blob."""
    digest = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{digest}"
    if not blob.exists():
        blob.symlink_to(gguf_file) if link else shutil.copy(gguf_file, blob)
    template = blobs / ("sha256-" + "f" * 64)
    template.write_text("{{ .Prompt }}")
    manifest = root / "manifests" / "registry.ollama.ai" / ns / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "1" * 64},
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                    "size": gguf_file.stat().st_size},
                   {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "f" * 64}]}))
    return manifest


def make_hf_cache(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """A hub cache entry as huggingface_hub lays it out: blobs, a snapshot of links, refs/main."""
    base = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for name, src in files.items():
        blob = base / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copy(src, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer_json):
    root = tmp_path_factory.mktemp("resolve")
    src = build_llama_dir(root / "src", tokenizer_json)
    return src, write_gguf(src, root / "tiny.gguf", "llama")


def test_gguf_by_magic_whatever_its_name(tmp_path, tiny_gguf):
    _, gguf = tiny_gguf
    odd = tmp_path / "weights.bin"
    shutil.copy(gguf, odd)
    r = resolve(odd)
    assert (r.format, r.source, r.path) == ("gguf", "file", odd)


def test_directory_with_one_gguf(tmp_path, tiny_gguf):
    _, gguf = tiny_gguf
    shutil.copy(gguf, tmp_path / "m.gguf")
    assert resolve(tmp_path).path == tmp_path / "m.gguf"
    shutil.copy(gguf, tmp_path / "n.gguf")
    with pytest.raises(ModelFormatError, match="holds 2 GGUF files"):
        resolve(tmp_path)


EXPECTED = ('not a model file: expected a GGUF file (magic "GGUF") or a safetensors file such as a .tinygpt model '
            '(not a safetensors file: ')


@pytest.mark.parametrize("name, content, tail", [
    ("x.gguf", b"hello world, just some text\n", 'bad header length); it starts with "hello world, just some t" (text)'),
    ("x.tinygpt", b"", "only 0 bytes); it is empty"),
    ("x.tinygpt", b"GGU", "only 3 bytes); it starts with \"GGU\" (text)"),
    ("x.tinygpt", bytes(64), "bad header length); it starts with 24 zero bytes"),
    ("model.bin", b"PK\x03\x04" + bytes(40), "bad header length); it starts with bytes 50 4b 03 04 00 00 00 00 00 00 "
                                              "00 00 00 00 00 00 (a ZIP archive, e.g. a PyTorch checkpoint)"),
    ("x.gguf", b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n",
     "bad header length); it is a Git LFS pointer, not the file itself (fetch it with `git lfs pull`)"),
    ("x.tinygpt", (5).to_bytes(8, "little") + b"[1,2]", "header is not JSON); it starts with bytes 05 00 00 00 00 00 00 00 "
                                                      "5b 31 2c 32 5d"),
])
def test_a_file_of_no_known_kind_names_both_kinds_and_its_start(tmp_path, name, content, tail):
    """GGUF is told by its magic, safetensors (.tinygpt) by its header's shape; anything else is
    one line naming both and what the file starts with (a text file named x.gguf used to get
    'not a safetensors file (bad header length)', which named neither)."""
    bad = tmp_path / name
    bad.write_bytes(content)
    with pytest.raises(ModelFormatError) as e:
        resolve(bad)
    assert str(e.value) == f"{bad}: {EXPECTED}{tail}"


def test_a_file_that_looks_like_safetensors_goes_to_the_tinygpt_reader(tmp_path, native_path):
    """A truncated .tinygpt file keeps the reader's precise message (not the sniffing one)."""
    raw = native_path.read_bytes()
    cut = tmp_path / "cut.tinygpt"
    cut.write_bytes(raw[:-100])
    assert resolve(cut).format == "tinygpt"
    from tinygpt_mlx.loading import load
    with pytest.raises(ModelFormatError, match="truncated"):
        load(cut)


def test_a_directory_without_config_names_what_was_expected_and_what_it_holds(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    expected = ("not a model directory (no config.json): expected config.json and *.safetensors weights "
                "(an mlx-lm / Hugging Face model) or one GGUF file; ")
    with pytest.raises(ModelFormatError) as e:
        resolve(empty)
    assert str(e.value) == f"{empty}: {expected}it is empty"
    held = tmp_path / "held"
    (held / "sub").mkdir(parents=True)
    for i in range(7):
        (held / f"f{i}.txt").write_text("x")
    with pytest.raises(ModelFormatError) as e:
        resolve(held)
    assert str(e.value) == f"{held}: {expected}it holds f0.txt, f1.txt, f2.txt, f3.txt, f4.txt, f5.txt and 2 more"


def test_cli_names_a_text_file_posing_as_gguf_in_one_line(tmp_path):
    from tinygpt_mlx.cli.main import app

    bad = tmp_path / "x.gguf"
    bad.write_text("hello world, just some text\n")
    for command in (["sample", str(bad), "--prompt", "x"], ["info", str(bad)]):
        r = CliRunner().invoke(app, command)
        assert r.exit_code == 1 and r.stdout == ""
        assert r.stderr.splitlines() == [f"error: {bad}: {EXPECTED}bad header length); it starts with "
                                         '"hello world, just some t" (text)'], r.stderr


def test_ollama_names(tmp_path, monkeypatch, tiny_gguf):
    _, gguf = tiny_gguf
    make_ollama_store(tmp_path, gguf, "tiny", "1b")
    make_ollama_store(tmp_path, gguf, "tiny")
    make_ollama_store(tmp_path, gguf, "other", "q4", ns="someone")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    blob = tmp_path / "blobs" / f"sha256-{hashlib.sha256(gguf.read_bytes()).hexdigest()}"
    for spec, label in [("tiny:1b", "tiny:1b"), ("tiny", "tiny:latest"), ("tiny:latest", "tiny:latest"),
                        ("library/tiny:1b", "tiny:1b"), ("registry.ollama.ai/library/tiny:1b", "tiny:1b"),
                        ("someone/other:q4", "someone/other:q4")]:
        r = resolve(spec)
        assert (r.format, r.source, r.name, r.path) == ("gguf", "ollama", label, blob), spec
    assert ollama_names() == ["tiny:1b", "tiny:latest", "someone/other:q4"]
    with pytest.raises(ModelFormatError, match=r"tiny:7b: .*no ollama model library/tiny:7b in .*"
                                               r"installed: tiny:1b, tiny:latest, someone/other:q4"):
        resolve("tiny:7b")


def test_ollama_model_loads_and_writes_nothing(tmp_path, monkeypatch, tiny_gguf):
    from tinygpt_mlx.loading import load

    _, gguf = tiny_gguf
    make_ollama_store(tmp_path, gguf, "tiny", "1b")
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    with load("tiny:1b") as loaded:
        assert loaded.name == "tiny:1b" and loaded.format == "gguf" and loaded.resolved.source == "ollama"
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


def test_ollama_broken_store(tmp_path, monkeypatch, tiny_gguf):
    _, gguf = tiny_gguf
    manifest = make_ollama_store(tmp_path, gguf, "tiny")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    (tmp_path / "blobs" / f"sha256-{hashlib.sha256(gguf.read_bytes()).hexdigest()}").unlink()
    with pytest.raises(ModelFormatError, match=r"tiny: the manifest names sha256-\w+, which is missing"):
        resolve("tiny")
    manifest.write_text("{not json")
    with pytest.raises(ModelFormatError, match="not a readable ollama manifest"):
        resolve("tiny")


def test_huggingface_cache_offline(tmp_path, monkeypatch, tiny_gguf):
    from tinygpt_mlx.loading import load

    src, gguf = tiny_gguf
    make_hf_cache(tmp_path, "someorg/tiny-llama", {p.name: p for p in src.iterdir()})
    make_hf_cache(tmp_path, "someorg/tiny-GGUF", {"tiny.Q8_0.gguf": gguf, "README.md": src / "config.json"})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    r = resolve("someorg/tiny-llama")
    assert (r.format, r.source, r.name) == ("mlx-lm", "huggingface", "someorg/tiny-llama")
    r = resolve("someorg/tiny-GGUF")
    assert (r.format, r.source, r.path.name) == ("gguf", "huggingface", "tiny.Q8_0.gguf")
    with load("someorg/tiny-llama") as a, load(src) as b:
        assert a.name == "someorg/tiny-llama"
        assert a.tokenizer.encode("hello world") == b.tokenizer.encode("hello world")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    with pytest.raises(ModelFormatError, match=r"someorg/absent: .*not in the Hugging Face cache \(.*\); "
                                               r"downloads are off \(HF_HUB_OFFLINE=1\)"):
        resolve("someorg/absent")


@pytest.mark.parametrize("spec, message", [
    ("./missing.gguf", r"^\./missing\.gguf: no such file or directory$"),
    ("missing.tinygpt", r"^missing\.tinygpt: no such file or directory$"),
    ("nomodel", r"^nomodel: no such file or directory, and no ollama model library/nomodel:latest in "),
])
def test_missing_models(tmp_path, monkeypatch, spec, message):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFormatError, match=message):
        resolve(spec)


@pytest.mark.parametrize("spec, hint", [
    ("models/tinygpt-bse.tinygpt", "; did you mean models/tinygpt-base.tinygpt?"),       # a typo
    ("models/tinygpt-base.gguf", "; did you mean models/tinygpt-base.tinygpt?"),         # another extension
    ("tinygpt-keyed", "; did you mean models/tinygpt-keyed.tinygpt?"),                   # the name serve lists
    ("mymodel.gguf", "; did you mean mymodel.tinygpt?"),                                 # one beside it
    ("And God said", "; MODEL is the first argument: give the prompt with --prompt"),    # a prompt
    ("models/nothing.tinygpt", ""),
    ("nomodel", ""),
])
def test_missing_model_suggests_what_is_there(tmp_path, monkeypatch, spec, hint):
    """A MODEL that names nothing says what it nearly names (it said only `no such file or
    directory`, and `sample "And God said"` gave no clue that the prompt needs --prompt)."""
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel.tinygpt").write_bytes(b"")
    with pytest.raises(ModelFormatError) as e:
        resolve(spec)
    message = str(e.value)
    assert message.startswith(f"{spec}: no such file or directory"), message
    assert message.endswith(hint) and message.count("; did you mean") <= 1, message
    if not hint:
        assert "did you mean" not in message and "--prompt" not in message, message


def test_readme_models_path_outside_the_checkout_is_the_shipped_model(tmp_path, monkeypatch):
    """README's `models/tinygpt-keyed.tinygpt`, run where there is no models/ folder (a wheel or
    pipx install: the models are package data), is the shipped file; a models/ file here wins; a
    name the package does not ship is still no such file."""
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    r = resolve("models/tinygpt-keyed.tinygpt")
    assert (r.path, r.format, r.source, r.name) == (MODELS_DIR / "tinygpt-keyed.tinygpt", "tinygpt", "file",
                                                    "tinygpt-keyed")
    assert "the shipped models/tinygpt-keyed.tinygpt" in r.origin
    with pytest.raises(ModelFormatError, match=r"^models/nothing\.tinygpt: no such file or directory$"):
        resolve("models/nothing.tinygpt")
    with pytest.raises(ModelFormatError, match=r"^other/tinygpt-keyed\.tinygpt: no such file or directory$"):
        resolve("other/tinygpt-keyed.tinygpt")
    (tmp_path / "models").mkdir()
    shutil.copy(MODELS_DIR / "tinygpt-base.tinygpt", tmp_path / "models" / "tinygpt-keyed.tinygpt")
    assert resolve("models/tinygpt-keyed.tinygpt").path == Path("models/tinygpt-keyed.tinygpt")


def test_cli_bad_model_is_one_line(tmp_path, monkeypatch):
    from tinygpt_mlx.cli.main import app

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    r = CliRunner().invoke(app, ["sample", "llama3.2:1b", "--prompt", "x"])
    assert r.exit_code == 1
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "llama3.2:1b" in lines[0] and "no models installed there" in lines[0], r.stderr
