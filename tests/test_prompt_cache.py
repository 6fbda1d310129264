"""Prompt-cache files (issue #18): prefill once, continue many times.

* every policy and composition, on the native TinyGPT and on mlx-lm's Llama: save -> load ->
  continue (a question prefilled, then greedy decoding) gives bit-identical logits, the same
  greedy tokens and the same report (stored count, current length, bytes and breakdown) as
  continuing in process; a file is reusable and never changed by a run from it;
* every bad file is one `PromptCacheError` line naming the file, raised before anything is
  built: another model, a policy flag that contradicts the file's, a truncated file, a
  corrupted byte, a newer format version, a file that is not a prompt cache;
* an interrupted save (an error mid-write, or the process killed mid-write) leaves the
  previous file whole and loadable;
* the CLI: `cache-prompt` then `sample --prompt-cache` (one-line errors, --save-prompt-cache).

Mutations checked to fail here (one at a time, then reverted): KiviStore.load_state dropping
`evicted`; LayerCache.load_state dropping `start`; the cold store's `tail_keys` not restored;
DenseStore restoring one token short; the fingerprint check skipped; the checksum check skipped;
the cache file replaced in place instead of via a temporary file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from tinygpt_mlx.cli.main import app
from conftest import TEXT, build_native
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.persist import (FORMAT_VERSION, READS_FROM, PromptCacheError, load_prompt_cache,
                                       save_prompt_cache)
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.generate import forward, prefill

from test_policies import build_llama

ROOT = Path(__file__).resolve().parent.parent
DOC = np.random.RandomState(0).randint(1, 300, 160).tolist()
QUESTION = np.random.RandomState(1).randint(1, 300, 20).tolist()
CHUNK = 48
DECODE = 16
S, W, HOT = 4, 64, 64


def _hot(**kw) -> CacheConfig:
    # retrieve_unit None: the default for the position rule given (tokens with slots)
    return dataclasses.replace(parse_policy(f"hot{HOT}"), retrieve_tokens=32, retrieve_unit=None, **kw)


POLICIES = {
    "fp32": parse_policy("full"),
    "bf16": parse_policy("bf16"),
    "int8": parse_policy("int8"),
    "int4": parse_policy("int4"),
    "int2": parse_policy("int2"),
    "k8v4": parse_policy("k8v4"),
    "int4+near64": parse_policy("int4+near64"),
    "int4+near/4": parse_policy("int4+near/4"),
    "int4+near/4b6": parse_policy("int4+near/4b6"),
    "int4+top16+shadowram": parse_policy("int4+top16+shadowram"),
    "int4+top16+shadowdisk": parse_policy("int4+top16+shadowdisk"),
    "sink/window:shifted": parse_policy(f"sink{S}/window{W}:shifted"),
    "sink/window:absolute": parse_policy(f"sink{S}/window{W}:absolute"),
    "bf16+sink/window:shifted": parse_policy(f"bf16+sink{S}/window{W}:shifted"),
    "int4+sink/window:shifted": parse_policy(f"int4+sink{S}/window{W}:shifted"),
    "int4+sink/window:absolute": parse_policy(f"int4+sink{S}/window{W}:absolute"),
    "int4+near32+sink/window:shifted": parse_policy(f"int4+near32+sink{S}/window{W}:shifted"),
    "int2+top16+shadowdisk+sink/window": parse_policy(f"int2+top16+shadowdisk+sink{S}/window{W}:shifted"),
    "hot:ram": _hot(),
    "hot:disk": _hot(cold_store="disk"),
    "hot:disk+slots+sink": _hot(cold_store="disk", retrieved_position="slots", sink=S),
    "hot:cold8:disk": _hot(cold_store="disk", cold_bits=8),
    "hot:absolute+int4": _hot(rope_mode="absolute", key_bits=4, value_bits=4),
    "hot:absolute+int4+near32": _hot(rope_mode="absolute", key_bits=4, value_bits=4, near=32),
    "hot:shifted+int4+sink": _hot(key_bits=4, value_bits=4, sink=S),
    "hot:sticky+sink": _hot(sticky=True, sink=S, top_pages=2, page_size=4),
}


@pytest.fixture(scope="session")
def loaded_models(tmp_path_factory, tokenizer_json) -> dict:
    """LoadedModels (for the fingerprint) with head dim 32 (KIVI value groups), plus a second
    native model of the same shape and other weights."""
    from tinygpt_mlx.loading import load

    d = tmp_path_factory.mktemp("pcache-models")
    kw = dict(d_model=128, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=256, context_length=512)
    return {"native": load(build_native(d / "a.tinygpt", tokenizer_json, **kw)),
            "llama": load(build_llama(d / "llama", tokenizer_json)),
            "other": load(build_native(d / "b.tinygpt", tokenizer_json, seed=1, **kw))}


def _report(cache) -> dict:
    return {"stored_count": cache.stored_count, "current_length": cache.current_length,
            "nbytes": cache.nbytes, "breakdown": cache.nbytes_breakdown(), "disk": cache.disk_nbytes}


def _continue(model, cache, logits, question=QUESTION):
    """Prefill the question (if any), then greedy-decode: (tokens, final logits, report)."""
    if question:
        logits = prefill(model, question, cache, CHUNK)
    out = []
    for _ in range(DECODE):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = forward(model, mx.array([[t]]), cache)[0, -1].astype(mx.float32)
    return out, logits, _report(cache)


def _prefilled(loaded, cfg):
    cache = make_cache(loaded.model, cfg)
    return cache, prefill(loaded.model, DOC, cache, CHUNK)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("model_name", ("native", "llama"))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.slow
def test_save_load_continue_equals_in_process(loaded_models, tmp_path, model_name, policy):
    loaded, cfg = loaded_models[model_name], POLICIES[policy]
    ref_cache, logits = _prefilled(loaded, cfg)
    want = _continue(loaded.model, ref_cache, logits)
    ref_cache.close()

    cache, logits = _prefilled(loaded, cfg)
    before = _report(cache)
    path = tmp_path / "doc.ptc"
    save_prompt_cache(path, cache, loaded, DOC, logits)
    assert _report(cache) == before              # saving changes nothing
    cache.close()
    digest = _sha(path)
    for question in (QUESTION, QUESTION):        # reusable: twice from the same file
        restored, info = load_prompt_cache(path, loaded)
        assert info.tokens == DOC and info.config == cfg
        assert _report(restored) == before
        got = _continue(loaded.model, restored, info.logits, question)
        restored.close()
        assert got[0] == want[0], (policy, got[0], want[0])
        assert bool(mx.array_equal(got[1], want[1])), policy
        assert got[2] == want[2], policy
        assert _sha(path) == digest              # a run from the file never changes it


@pytest.mark.parametrize("policy", ["hot:ram", "hot:disk", "hot:cold8:disk", "hot:sticky+sink"])
def test_a_file_loads_into_either_cold_store(loaded_models, tmp_path, policy):
    """The device store (ram) and the host store (disk) write the same rows: a file saved from one
    loads into the other (`cold_store=`, as `serve --kiv-cold-store` asks) and continues with the
    tokens and logits of the cache it was saved from (the two stores sum in another order). The
    document's tokens are distinct: DOC repeats tokens, whose equal keys tie page scores, which
    numpy and MLX break differently (an equally good page, another sticky page after it)."""
    from tinygpt_mlx.server.state import policy_difference
    loaded, cfg = loaded_models["native"], POLICIES[policy]
    other = "disk" if cfg.cold_store == "ram" else "ram"
    doc = np.random.RandomState(3).permutation(np.arange(1, 300))[:len(DOC)].tolist()
    ref_cache = make_cache(loaded.model, cfg)
    logits = prefill(loaded.model, doc, ref_cache, CHUNK)
    path = tmp_path / "doc.ptc"
    save_prompt_cache(path, ref_cache, loaded, doc, logits)
    want = _continue(loaded.model, ref_cache, logits)
    ref_cache.close()
    assert policy_difference(cfg, dataclasses.replace(cfg, cold_store=other)) is None
    restored, info = load_prompt_cache(path, loaded, cold_store=other)
    assert restored.owned[0].config.cold_store == other and info.config == cfg
    got = _continue(loaded.model, restored, info.logits)
    restored.close()
    assert got[0] == want[0]
    assert float(mx.abs(got[1] - want[1]).max()) < 1e-4
    assert got[2]["stored_count"] == want[2]["stored_count"]


@pytest.mark.parametrize("policy", ["int4", "hot:disk", "int4+sink/window:shifted"])
def test_continue_from_saved_logits_without_a_prompt(loaded_models, tmp_path, policy):
    loaded, cfg = loaded_models["native"], POLICIES[policy]
    ref, logits = _prefilled(loaded, cfg)
    want = _continue(loaded.model, ref, logits, question=None)
    cache, logits = _prefilled(loaded, cfg)
    save_prompt_cache(tmp_path / "c.ptc", cache, loaded, DOC, logits)
    restored, info = load_prompt_cache(tmp_path / "c.ptc", loaded)
    got = _continue(loaded.model, restored, info.logits, question=None)
    assert got[0] == want[0] and bool(mx.array_equal(got[1], want[1]))


def test_disk_rows_are_copied_not_read_and_live_in_the_new_private_dir(loaded_models, tmp_path):
    loaded = loaded_models["native"]
    cache, logits = _prefilled(loaded, POLICIES["hot:disk"])
    save_prompt_cache(tmp_path / "c.ptc", cache, loaded, DOC, logits)
    restored, _ = load_prompt_cache(tmp_path / "c.ptc", loaded, cold_path=str(tmp_path / "cold"))
    cold = restored.owned[0].cold
    assert isinstance(cold.keys.array, np.memmap)
    assert Path(cold.keys.path).parent.parent == tmp_path / "cold"
    assert restored.disk_nbytes == cache.disk_nbytes > 0
    directory = cold.directory
    restored.close()
    assert not os.path.exists(directory)


# ----- bad files: one line, naming the file, nothing built --------------------------------------

@pytest.fixture
def saved(loaded_models, tmp_path) -> Path:
    loaded = loaded_models["native"]
    cache, logits = _prefilled(loaded, POLICIES["int4"])
    path = save_prompt_cache(tmp_path / "doc.ptc", cache, loaded, DOC, logits)
    cache.close()
    return path


def _error(fn) -> str:
    with pytest.raises(PromptCacheError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_another_model_is_refused(loaded_models, saved):
    msg = _error(lambda: load_prompt_cache(saved, loaded_models["other"]))
    assert str(saved) in msg and "another model" in msg
    msg = _error(lambda: load_prompt_cache(saved, loaded_models["llama"]))
    assert "another model" in msg


def test_fingerprint_is_of_the_weights(loaded_models):
    from tinygpt_mlx.cache.persist import model_fingerprint

    a, b = loaded_models["native"], loaded_models["other"]
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(a.model)      # the file's digest == the weights'


def test_a_contradicting_policy_is_refused(loaded_models, saved):
    msg = _error(lambda: load_prompt_cache(saved, loaded_models["native"], config=parse_policy("int8")))
    assert "key_bits=4" in msg
    load_prompt_cache(saved, loaded_models["native"], config=CacheConfig(key_bits=4, value_bits=4))[0].close()


def test_truncated_file_is_refused(loaded_models, saved):
    data = saved.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 20, 4):
        saved.write_bytes(data[:cut])
        msg = _error(lambda: load_prompt_cache(saved, loaded_models["native"]))
        assert str(saved) in msg


def test_corrupted_byte_is_refused(loaded_models, saved):
    data = bytearray(saved.read_bytes())
    data[-100] ^= 0x10
    saved.write_bytes(bytes(data))
    assert "checksum mismatch" in _error(lambda: load_prompt_cache(saved, loaded_models["native"]))


def _edit_metadata(path: Path, **changes) -> None:
    """Rewrite metadata values (same header length: spaces pad the JSON, as safetensors allows)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"].update(changes)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n:])


def test_newer_format_version_is_refused(loaded_models, saved):
    _edit_metadata(saved, format_version=str(FORMAT_VERSION + 1))
    assert "newer" in _error(lambda: load_prompt_cache(saved, loaded_models["native"]))


def test_older_format_version_says_to_recreate(loaded_models, saved):
    _edit_metadata(saved, format_version=str(READS_FROM - 1))
    assert "older posttrainllm" in _error(lambda: load_prompt_cache(saved, loaded_models["native"]))


def test_version_4_files_load_as_todays_int8(loaded_models, tmp_path, monkeypatch):
    """A version-4 file (written before int8's long residual: its config lacks the field) loads as
    today's int8, whose residual grows from any int8 state, so `serve --kv-quantize int8` takes it
    as its own policy; this build writes version 5."""
    from tinygpt_mlx.server.state import policy_difference
    from tinygpt_mlx.cache import persist

    loaded = loaded_models["native"]
    cache, logits = _prefilled(loaded, POLICIES["int8"])
    asdict = dataclasses.asdict
    monkeypatch.setattr(persist, "FORMAT_VERSION", 4)
    monkeypatch.setattr(persist.dataclasses, "asdict",
                        lambda c: {k: v for k, v in asdict(c).items() if k != "long_residual"})
    path = save_prompt_cache(tmp_path / "v4.ptc", cache, loaded, DOC, logits)
    monkeypatch.undo()
    restored, info = load_prompt_cache(path, loaded)
    assert info.config == POLICIES["int8"] and policy_difference(info.config, POLICIES["int8"]) is None
    assert json.loads(persist.tinygpt_format.read_header(path)[1]["format_version"]) == 4 < FORMAT_VERSION == 7
    restored.close()
    cache.close()


def test_grown_residual_round_trips(loaded_models, tmp_path):
    """int8 past 1,024 tokens (its residual grown to 64) saved and loaded continues as in process."""
    loaded = loaded_models["native"]
    doc = np.random.RandomState(1).randint(1, 300, 1100).tolist()
    runs = []
    for save in (False, True):
        cache = make_cache(loaded.model, POLICIES["int8"])
        logits = prefill(loaded.model, doc, cache, 256)
        assert cache.owned[0].body.keep == 60
        if save:
            save_prompt_cache(tmp_path / "long.ptc", cache, loaded, doc, logits)
            cache.close()
            cache, info = load_prompt_cache(tmp_path / "long.ptc", loaded)
            logits = info.logits
        runs.append(_continue(loaded.model, cache, logits))
        cache.close()
    assert runs[0][0] == runs[1][0] and bool(mx.array_equal(runs[0][1], runs[1][1]))


def test_edited_metadata_fails_the_checksum(loaded_models, saved):
    toks = json.dumps([1] + DOC[1:])
    _edit_metadata(saved, tokens=toks)
    assert "checksum mismatch" in _error(lambda: load_prompt_cache(saved, loaded_models["native"]))


def test_not_a_prompt_cache(loaded_models, tmp_path):
    model_file = loaded_models["native"].path
    assert "not a prompt-cache file" in _error(lambda: load_prompt_cache(model_file, loaded_models["native"]))
    assert "no such" in _error(lambda: load_prompt_cache(tmp_path / "nope.ptc", loaded_models["native"]))
    (tmp_path / "junk.ptc").write_bytes(b"hello world, not safetensors at all")
    _error(lambda: load_prompt_cache(tmp_path / "junk.ptc", loaded_models["native"]))


# ----- interrupted saves ------------------------------------------------------------------------

def test_error_mid_write_leaves_the_old_file(loaded_models, saved, monkeypatch):
    from tinygpt_mlx.cache import cachefile

    loaded = loaded_models["native"]
    digest = _sha(saved)
    cache, logits = _prefilled(loaded, POLICIES["fp32"])
    calls, plain = [], cachefile.chunks

    def broken(a):
        for piece in plain(a):
            calls.append(1)
            if len(calls) > 3:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(cachefile, "chunks", broken)
    with pytest.raises(KeyboardInterrupt):
        save_prompt_cache(saved, cache, loaded, DOC, logits)
    assert _sha(saved) == digest
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]     # no temporary left
    load_prompt_cache(saved, loaded)[0].close()


KILLED_SAVE = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    from tinygpt_mlx.loading import load
    from tinygpt_mlx.cache import cachefile, make_cache, persist
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.generate import prefill
    loaded = load({model!r})
    cache = make_cache(loaded.model, CacheConfig())
    logits = prefill(loaded.model, list(range(1, 200)), cache, 64)
    plain = cachefile.chunks
    def slow(a):
        for piece in plain(a):
            print("writing", flush=True)
            time.sleep(0.2)
            yield piece
    cachefile.CHUNK = 4096
    cachefile.chunks = slow
    persist.save_prompt_cache({path!r}, cache, loaded, list(range(1, 200)), logits)
    print("finished", flush=True)
""")


def test_killed_mid_write_leaves_the_old_file_loadable(loaded_models, saved):
    loaded = loaded_models["native"]
    digest = _sha(saved)
    script = KILLED_SAVE.format(root=str(ROOT), tests=str(ROOT / "tests"), model=str(loaded.path), path=str(saved))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("writing"):
                break
        time.sleep(0.3)
        assert proc.poll() is None, "the save finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert _sha(saved) == digest
    cache, info = load_prompt_cache(saved, loaded)
    assert info.tokens == DOC
    # the killed save left its temporary file; the next save to that path removes it (its
    # process is gone) and keeps a live process's
    left = list(saved.parent.glob(f".{saved.name}.{proc.pid}-*.tmp"))
    assert len(left) == 1
    live = saved.parent / f".{saved.name}.{os.getpid()}-feedbeef.tmp"
    live.write_bytes(b"a save in progress")
    save_prompt_cache(saved, cache, loaded, DOC, info.logits)
    assert not left[0].exists() and live.exists()
    live.unlink()
    cache.close()


# ----- CLI --------------------------------------------------------------------------------------

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(r, *named):
    assert r.exit_code != 0, r.output
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in r.output, r.stderr
    for name in named:
        assert name in r.stderr, (name, r.stderr)


@pytest.mark.parametrize("flags", [["--streaming-llm-sink", "4", "--streaming-llm-window", "32"],
                                   ["--kiv-hot-budget", "32", "--kiv-cold-store", "disk", "--kiv-top-p", "16"]])
def test_cli_cache_prompt_then_sample(native_path, tmp_path, flags):
    from tinygpt_mlx.loading import load

    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT[:600])
    out = tmp_path / "doc.ptc"
    r = cli("cache-prompt", native_path, "--prompt-file", doc, "--out", out, "--prefill-chunk", "64", *flags,
            "--report-json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "r.json").read_text())
    digest = _sha(out)
    args = ["sample", native_path, "--prompt-cache", out, "--prompt", " The keeper", "-n", "12",
            "--temperature", "0", "--prefill-chunk", "64", "--report-json", tmp_path / "s.json"]
    first = cli(*args)
    assert first.exit_code == 0, first.output
    again = cli(*args)
    assert again.stdout == first.stdout and _sha(out) == digest
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["prompt_cache"]["cached_tokens"] == saved["tokens"]
    if "--kiv-cold-store" in flags:    # made on disk, continued in RAM (the default) or where the flag says
        assert report["policy"]["retrieval"]["cold_store"] == "ram"
        on_disk = cli(*args[:-2], "--kiv-cold-store", "disk", "--report-json", tmp_path / "d.json")
        assert on_disk.exit_code == 0 and on_disk.stdout == first.stdout, on_disk.output
        assert json.loads((tmp_path / "d.json").read_text())["policy"]["retrieval"]["cold_store"] == "disk"
    # the same as continuing in process: the document prefilled, then the question, then decoding
    loaded = load(native_path)
    info_cfg = load_prompt_cache(out, loaded)[1].config
    cache = make_cache(loaded.model, info_cfg)
    ids = loaded.tokenizer.encode(TEXT[:600])
    prefill(loaded.model, ids, cache, 64)
    logits = prefill(loaded.model, loaded.tokenizer.encode(" The keeper"), cache, 64)
    toks = []
    for i in range(12):
        toks.append(int(mx.argmax(logits).item()))
        if i < 11:      # the engine does not feed the last token it samples
            logits = forward(loaded.model, mx.array([toks[-1:]]), cache)[0, -1]
    assert first.stdout.rstrip("\n") == loaded.tokenizer.decode(toks)
    assert report["current_length"] == cache.current_length and report["stored_count"] == cache.stored_count
    assert report["cache_bytes"] == cache.nbytes
    # the whole document given again as the prompt: only what follows is fed
    full = cli("sample", native_path, "--prompt-cache", out, "--prompt", TEXT[:600] + " The keeper", "-n", "12",
               "--temperature", "0", "--prefill-chunk", "64")
    assert full.exit_code == 0 and "note: prompt cache" in full.stderr


def test_cache_prompt_takes_the_document_as_prompt_text(native_path, tmp_path):
    """`cache-prompt --prompt TEXT` saves the file `--prompt-file` saves for the same text (it took
    only a file: `--prompt`, as sample spells it, was 'No such option'); one of the two, not both,
    not empty; sample's report says the cached tokens once (the note before the text)."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT[:400])
    from_file, from_text = tmp_path / "file.ptc", tmp_path / "text.ptc"
    assert cli("cache-prompt", native_path, "--prompt-file", doc, "--out", from_file).exit_code == 0
    r = cli("cache-prompt", native_path, "--prompt", TEXT[:400], "--out", from_text)
    assert r.exit_code == 0, r.output
    from tinygpt_mlx.cache.persist import read_prompt_cache_info
    assert read_prompt_cache_info(from_text).tokens == read_prompt_cache_info(from_file).tokens
    asked = ["sample", native_path, "-p", " The keeper", "-n", "6", "--temperature", "0", "--prompt-cache"]
    one, other = cli(*asked, from_file), cli(*asked, from_text)
    assert one.exit_code == 0 and one.stdout == other.stdout, one.output
    assert one.stderr.count("cached tokens") == 1, one.stderr
    for flags, said in ((["--prompt", "x", "--prompt-file", doc], "not both"),
                        ([], "--prompt-file FILE or --prompt TEXT"),
                        (["--prompt", ""], "'--prompt': the document is empty")):
        failed = cli("cache-prompt", native_path, *flags, "--out", tmp_path / "x.ptc")
        assert failed.exit_code == 2
        one_line_error(failed, said)
    assert not (tmp_path / "x.ptc").exists()


def test_cli_errors_and_save_extended(native_path, tmp_path, tokenizer_json):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT[:400])
    out = tmp_path / "doc.ptc"
    assert cli("cache-prompt", native_path, "--prompt-file", doc, "--out", out).exit_code == 0
    one_line_error(cli("sample", native_path, "--prompt-cache", out, "--kv-quantize", "bf16", "-p", "x"),
                   "--kv-quantize", str(out))
    other = build_native(tmp_path / "other.tinygpt", tokenizer_json, seed=3)
    one_line_error(cli("sample", other, "--prompt-cache", out, "-p", "x"), "another model", str(out))
    bad = tmp_path / "bad.ptc"
    bad.write_bytes(out.read_bytes()[:-10])
    one_line_error(cli("sample", native_path, "--prompt-cache", bad, "-p", "x"), "--prompt-cache", "truncated")
    one_line_error(cli("cache-prompt", native_path, "--prompt-file", doc, "--out", tmp_path / "no" / "x.ptc"),
                   "--out")
    ext = tmp_path / "ext.ptc"
    r = cli("sample", native_path, "--prompt-cache", out, "-p", " and", "-n", "5", "--temperature", "0",
            "--save-prompt-cache", ext)
    assert r.exit_code == 0, r.output
    from tinygpt_mlx.cache.persist import read_prompt_cache_info
    base, extended = read_prompt_cache_info(out), read_prompt_cache_info(ext)
    assert extended.tokens[:len(base.tokens)] == base.tokens
    assert extended.current_length == len(extended.tokens) > len(base.tokens)
    # continuing the extended file without a prompt first re-samples the token the run printed last
    r2 = cli("sample", native_path, "--prompt-cache", ext, "-n", "1", "--temperature", "0")
    assert r2.exit_code == 0, r2.output


def test_positions_left_to_the_run_take_the_file_s(native_path, tmp_path):
    """Retrieval flags without --streaming-llm-rope (`auto`: the run's choice) continue a file
    made at either positions with the file's; a rule named on the command line must match it."""
    from tinygpt_mlx.cache.persist import config_mismatch

    auto = CacheConfig(hot_budget=16, rope_mode="auto")
    for mode in ("absolute", "shifted"):
        made = CacheConfig(hot_budget=16, rope_mode=mode)
        assert config_mismatch(made, auto) is None
    assert config_mismatch(CacheConfig(hot_budget=16, rope_mode="absolute"),
                           CacheConfig(hot_budget=16, rope_mode="shifted")) == "rope_mode"
    f, doc = tmp_path / "abs.ptc", tmp_path / "doc.txt"
    doc.write_text("the word of the keeper and the number " * 2)
    made = cli("cache-prompt", native_path, "--prompt-file", doc, "--kiv-hot-budget", "16",
               "--streaming-llm-rope", "absolute", "--out", f)
    assert made.exit_code == 0, made.output
    r = cli("sample", native_path, "--prompt-cache", f, "--kiv-hot-budget", "16", "-n", "2", "--temperature", "0")
    assert r.exit_code == 0, r.output
    named = cli("sample", native_path, "--prompt-cache", f, "--kiv-hot-budget", "16", "--streaming-llm-rope",
                "shifted", "-n", "2")
    assert named.exit_code != 0 and "was made with --streaming-llm-rope absolute, not shifted" in named.output


def test_a_policy_mismatch_names_flags_and_precisions_not_fields(native_path, tmp_path):
    """A file made with int8 keys continued with int4 keys: the line says so in the flags' terms
    (--kv-quantize sets both sides, so it is named beside --kv-quantize-keys), never `key_bits=8`."""
    f, doc = tmp_path / "k8.ptc", tmp_path / "doc.txt"
    doc.write_text("the word of the keeper and the number " * 2)
    made = cli("cache-prompt", native_path, "--prompt-file", doc, "--kv-quantize-keys", "int8", "--out", f)
    assert made.exit_code == 0, made.output
    r = cli("sample", native_path, "--prompt-cache", f, "--kv-quantize-keys", "int4", "-p", "x")
    one_line_error(r, "made with int8 keys, not int4", "leave --kv-quantize and --kv-quantize-keys out",
                   "'--kv-quantize' / '--kv-quantize-keys'")
    assert "key_bits" not in r.stderr, r.stderr


def test_int4_default_tier_matches_whether_named_or_not():
    """int4's default near tier is 1/8 whether a config names it or not: a file made with plain
    int4 serves `--kv-near-share 8` and the reverse (prompt caches and the server's slots); a file
    made without the tier (`int4+near/0`, or before it was the default: near_share 0) is another
    policy for the server, and for `sample` only when the flag is given."""
    from tinygpt_mlx.cache.persist import config_mismatch
    from tinygpt_mlx.server.state import policy_difference

    plain, named, off = (CacheConfig.from_spec(s) for s in ("int4", "int4+near/8", "int4+near/0"))
    assert plain.near_share is None and named.near_share == 8
    assert config_mismatch(plain, named) is None and config_mismatch(named, plain) is None
    assert policy_difference(plain, named) is None and policy_difference(named, plain) is None
    assert config_mismatch(plain, off) == "near_share" and policy_difference(plain, off) == "near_share"
    assert config_mismatch(off, plain) is None          # plain int4 given: the file's policy is used
    assert policy_difference(off, plain) == "near_share"
    # int8's long residual likewise; under a window it never grows, so there it is no difference
    grown, fixed = CacheConfig.from_spec("int8"), CacheConfig.from_spec("int8+lr0")
    assert config_mismatch(grown, fixed) == "long_residual" == policy_difference(fixed, grown)
    assert config_mismatch(grown, CacheConfig.from_spec("int8+lr64")) is None
    windowed = (CacheConfig.from_spec(s) for s in ("int8+sink4/window256", "int8+sink4/window256+lr0"))
    assert policy_difference(*windowed) is None


def test_a_prompt_cache_given_as_the_model_says_what_it_is(native_path, tmp_path):
    """`posttrainllm info FILE` / `sample FILE` with cache-prompt's file in MODEL's place: one line
    saying it is a prompt-cache file and how to continue it (before: "not a .tinygpt file (format
    'posttrainllm-prompt-cache')")."""
    from tinygpt_mlx import format as fmt
    from tinygpt_mlx.cache.persist import FORMAT_NAME

    assert fmt.PROMPT_CACHE_FORMAT == FORMAT_NAME
    doc, out = tmp_path / "doc.txt", tmp_path / "doc.ptc"
    doc.write_text(TEXT[:200])
    assert cli("cache-prompt", native_path, "--prompt-file", doc, "--out", out).exit_code == 0
    for args in (["info", out], ["sample", out, "-p", "x", "-n", "1"]):
        r = cli(*args)
        assert r.exit_code == 1, r.output
        one_line_error(r, f"{out}: a prompt-cache file", f"--prompt-cache {out}")
