"""A GGUF's converted tokenizer kept on disk and in the process (tinygpt_mlx/ggml/tokenizer_cache.py):
the tokenizer read back encodes, decodes and detokenizes as the one transformers' converter
makes (`reference_tokenizer`, the loader's code before the cache, kept in tests/), a file changed in
size, mtime or tokenizer metadata is converted again, a damaged entry is rebuilt with one warning,
an entry appears whole or not at all, and one process converts a vocabulary once.

On the synthetic GGUF writer's files (tests/gguf_writer.py), so that it runs without the real
models; SmolLM2 too where its file is in the cache (Gemma 3's loaded tokenizer is compared with
the reference in tests/test_gemma3.py, whose process has it loaded already)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import TEXT, build_llama_dir, train_tokenizer
from tests.gguf_writer import write_gguf
from tests.tokenizer_reference import TEXTS, assert_same, reference_tokenizer
from tinygpt_mlx.ggml import tokenizer_cache as tc
from tinygpt_mlx.ggml.tokenizer import tokenizer_from_metadata


def metadata(path: Path) -> dict:
    import gguf

    from tinygpt_mlx.ggml.tensors import _field_value
    reader = gguf.GGUFReader(str(path))
    return {name: _field_value(f, gguf) for name, f in reader.fields.items()
            if name.startswith(("tokenizer.", "general.architecture"))}


@pytest.fixture
def conversions(monkeypatch):
    """The number of times transformers' converter has run since the test began."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    calls = []
    real = mapping.convert_gguf_tokenizer

    def counted(*a):
        calls.append(a[0])
        return real(*a)

    counted.real = real               # what reference_tokenizer calls: not counted
    monkeypatch.setattr(mapping, "convert_gguf_tokenizer", counted)
    return calls


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty cache directory, this process's conversions forgotten, every vocabulary kept on
    disk (the files here have 320 tokens, under MIN_TOKENS)."""
    monkeypatch.setenv("POSTTRAINLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(tc.OFF_VAR, raising=False)
    monkeypatch.setattr(tc, "_converted", {})
    monkeypatch.setattr(tc, "MIN_TOKENS", 0)
    return tmp_path / "cache" / "tokenizers"


def new_process(monkeypatch):
    """As a new process finds things: nothing converted yet (the disk cache stays)."""
    monkeypatch.setattr(tc, "_converted", {})


@pytest.fixture
def gguf_file(tmp_path, tokenizer_json):
    return write_gguf(build_llama_dir(tmp_path / "src", tokenizer_json), tmp_path / "m.gguf", "llama")


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def test_from_the_cache_it_is_the_converted_tokenizer(gguf_file, cache, conversions, monkeypatch, capsys):
    """A load converts and writes the entry; a new process's load reads it and converts nothing;
    both tokenizers are the reference's, through the loader (`load`) as `sample` gets them."""
    from tinygpt_mlx.loading import load

    ref = reference_tokenizer(metadata(gguf_file), "ref")
    conversions.clear()
    with load(gguf_file) as first:
        assert_same(first.tokenizer._wrapper, ref)
    assert len(conversions) == 1
    (entry,) = entries(cache)
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokenizer.json"]
    assert json.loads((entry / "meta.json").read_text())["gguf"] == str(gguf_file.resolve())
    new_process(monkeypatch)
    with load(gguf_file) as second:
        assert_same(second.tokenizer._wrapper, ref)
    assert len(conversions) == 1                       # read from the disk
    assert entries(cache) == [entry] and capsys.readouterr().err == ""


def test_one_conversion_per_process(gguf_file, cache, conversions, monkeypatch):
    """Without the disk (POSTTRAINLLM_NO_TOKENIZER_CACHE=1): two loads of the file and its metadata
    with a chat template added (what tests/test_gemma3.py does) convert once; the template is the
    second call's own, not kept with the conversion."""
    from tinygpt_mlx.chat_template import has_template
    from tinygpt_mlx.loading import load
    from tinygpt_mlx.tokenizer import Tokenizer

    monkeypatch.setenv(tc.OFF_VAR, "1")
    md = metadata(gguf_file)
    template = "{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"
    conversions.clear()
    with load(gguf_file) as a, load(gguf_file) as b:
        assert a.tokenizer.encode(TEXTS[0]) == b.tokenizer.encode(TEXTS[0])
    templated = tokenizer_from_metadata({**md, "tokenizer.chat_template": template}, "test")
    plain = tokenizer_from_metadata(md, "test")
    assert len(conversions) == 1 and entries(cache) == []
    assert has_template(Tokenizer(wrapper=templated)) and not has_template(Tokenizer(wrapper=plain))
    assert_same(templated, reference_tokenizer({**md, "tokenizer.chat_template": template}, "ref"))
    assert_same(plain, reference_tokenizer(md, "ref"))


def test_a_changed_file_is_converted_again(gguf_file, cache, conversions, monkeypatch, tmp_path):
    """Another tokenizer written at the same path, the same file touched (mtime), and the same
    file's metadata with one token respelled (size and mtime unchanged): each converts again and
    gets its own tokenizer; the path's older entry is removed when the new one is written."""
    tokenizer_from_metadata(metadata(gguf_file), "m", gguf_file)
    (old,) = entries(cache)

    other = train_tokenizer(300)
    other.add_special_tokens(["<|im_end|>"])
    src = build_llama_dir(tmp_path / "src2", other.to_str())
    write_gguf(src, gguf_file, "llama")                # the same path, a new vocabulary
    md = metadata(gguf_file)
    conversions.clear()
    new_process(monkeypatch)
    got = tokenizer_from_metadata(md, "m", gguf_file)
    assert len(conversions) == 1
    assert_same(got, reference_tokenizer(md, "ref"))
    assert "<|im_end|>" in got.get_vocab()
    (new,) = entries(cache)
    assert new != old

    st = gguf_file.stat()
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # touched: the same bytes
    new_process(monkeypatch)
    tokenizer_from_metadata(md, "m", gguf_file)
    assert len(conversions) == 2 and entries(cache) != [new] and len(entries(cache)) == 1

    tokens = list(md["tokenizer.ggml.tokens"])
    i = tokens.index("Ġquick") if "Ġquick" in tokens else len(tokens) - 1
    tokens[i] = "Ġquack"
    respelled = {**md, "tokenizer.ggml.tokens": tokens}
    new_process(monkeypatch)
    got = tokenizer_from_metadata(respelled, "m", gguf_file)    # same size and mtime as the entry's
    assert len(conversions) == 3
    assert "Ġquack" in got.get_vocab() and "Ġquick" not in got.get_vocab()
    assert_same(got, reference_tokenizer(respelled, "ref"))


def _truncate(entry):
    p = entry / "tokenizer.json"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _respell(entry):                                   # still valid JSON, another tokenizer
    p = entry / "tokenizer.json"
    p.write_text(p.read_text(encoding="utf-8").replace('"Ġthe"', '"Ġthy"', 1), encoding="utf-8")


DAMAGE = {"truncated": _truncate, "respelled": _respell,
          "meta garbage": lambda e: (e / "meta.json").write_bytes(b"\x00{not json"),
          "meta missing": lambda e: (e / "meta.json").unlink(),
          "tokenizer missing": lambda e: (e / "tokenizer.json").unlink(),
          "meta of another file": lambda e: (e / "meta.json").write_text(
              (e / "meta.json").read_text().replace('"size": ', '"size": 1'))}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_rebuilt_with_one_warning(damage, gguf_file, cache, conversions, monkeypatch, capsys):
    md = metadata(gguf_file)
    ref = reference_tokenizer(md, "ref")
    tokenizer_from_metadata(md, "m", gguf_file)
    (entry,) = entries(cache)
    good = (entry / "tokenizer.json").read_bytes()
    DAMAGE[damage](entry)
    conversions.clear()
    capsys.readouterr()
    new_process(monkeypatch)
    got = tokenizer_from_metadata(md, "m", gguf_file)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: tokenizer cache entry {entry} is unreadable"), err
    assert len(conversions) == 1
    assert_same(got, ref)
    assert entries(cache) == [entry] and (entry / "tokenizer.json").read_bytes() == good
    new_process(monkeypatch)
    tokenizer_from_metadata(md, "m", gguf_file)           # the rebuilt entry is read, quietly
    assert len(conversions) == 1 and capsys.readouterr().err == ""


def test_an_entry_appears_whole_or_not_at_all(gguf_file, cache, monkeypatch, capsys):
    """The entry is renamed into place from a temporary directory holding both files, whole; a
    second writer that finds the entry in place (another process was first) drops its own."""
    md = metadata(gguf_file)
    real_rename, seen = os.rename, []

    def rename(src, dst):
        src, dst = Path(src), Path(dst)
        if dst.parent == cache and not dst.name.startswith("."):
            assert not dst.exists() and src.name.startswith(".tmp-")
            meta = json.loads((src / "meta.json").read_text())
            import hashlib
            assert hashlib.sha256((src / "tokenizer.json").read_bytes()).hexdigest() == meta["sha256"]
            seen.append(dst)
        return real_rename(src, dst)

    monkeypatch.setattr(tc.os, "rename", rename)
    tokenizer_from_metadata(md, "m", gguf_file)
    assert len(seen) == 1 and entries(cache) == seen

    # a writer that lost the race: the entry appears while it converts
    (entry,) = seen
    monkeypatch.setattr(tc.os, "rename", real_rename)
    kept = entry.parent / ".kept"
    real_rename(entry, kept)

    def late_rename(src, dst):
        if Path(dst) == entry:
            real_rename(kept, entry)                 # the other process's entry, first
        return real_rename(src, dst)

    monkeypatch.setattr(tc.os, "rename", late_rename)
    new_process(monkeypatch)
    got = tokenizer_from_metadata(md, "m", gguf_file)
    assert_same(got, reference_tokenizer(md, "ref"))
    assert entries(cache) == [entry] and capsys.readouterr().err == ""
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] == []


def test_small_vocabularies_and_the_switch_stay_off_the_disk(gguf_file, cache, conversions, monkeypatch):
    """Under MIN_TOKENS tokens, or with POSTTRAINLLM_NO_TOKENIZER_CACHE=1, nothing is written;
    a bad value of the switch is refused naming it."""
    from tinygpt_mlx.switches import SwitchError

    md = metadata(gguf_file)
    monkeypatch.setattr(tc, "MIN_TOKENS", len(md["tokenizer.ggml.tokens"]) + 1)
    tokenizer_from_metadata(md, "m", gguf_file)
    assert entries(cache) == []
    monkeypatch.setattr(tc, "MIN_TOKENS", 0)
    monkeypatch.setenv(tc.OFF_VAR, "yes")
    new_process(monkeypatch)
    tokenizer_from_metadata(md, "m", gguf_file)
    assert entries(cache) == [] and len(conversions) == 2
    monkeypatch.setenv(tc.OFF_VAR, "maybe")
    with pytest.raises(SwitchError, match="POSTTRAINLLM_NO_TOKENIZER_CACHE='maybe'"):
        tokenizer_from_metadata(md, "m", gguf_file)


def test_an_unwritable_cache_is_one_warning_and_the_load_goes_on(gguf_file, cache, monkeypatch, capsys):
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the directory would be")
    md = metadata(gguf_file)
    got = tokenizer_from_metadata(md, "m", gguf_file)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: cannot write the tokenizer cache entry"), err
    assert_same(got, reference_tokenizer(md, "ref"))


@pytest.mark.slow
def test_smollm2_from_the_cache(monkeypatch, tmp_path, conversions):
    """SmolLM2 (49,152 tokens, GPT-2 byte-level BPE with merges) where its file is here: the
    tokenizer read from the cache is the converter's, on text, chat markers and bytes."""
    from tinygpt_mlx.realmodel import cache_dir

    path = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} not here")
    monkeypatch.setenv("POSTTRAINLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(tc.OFF_VAR, raising=False)
    monkeypatch.setattr(tc, "_converted", {})
    md = metadata(path)
    assert len(md["tokenizer.ggml.tokens"]) >= tc.MIN_TOKENS       # kept on disk without a patch
    ref = reference_tokenizer(md, "ref")
    tokenizer_from_metadata(md, "real", path)
    new_process(monkeypatch)
    conversions.clear()
    got = tokenizer_from_metadata(md, "real", path)
    assert conversions == [] and len(entries(tmp_path / "cache" / "tokenizers")) == 1
    assert_same(got, ref, TEXTS + ["<|im_start|>assistant\nHi<|im_end|>\n", "\x01\x7f tab\tand 😀🙂"])
