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
from tinygpt_mlx.resolve import ollama_names, resolve


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


def test_cli_bad_model_is_one_line(tmp_path, monkeypatch):
    from tinygpt_mlx.cli.main import app

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    r = CliRunner().invoke(app, ["sample", "llama3.2:1b", "--prompt", "x"])
    assert r.exit_code == 1
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "llama3.2:1b" in lines[0] and "no models installed there" in lines[0], r.stderr
