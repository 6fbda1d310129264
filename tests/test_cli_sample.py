"""`posttrainllm sample` edge cases: flag-named config errors (and the one field -> flag table
every command shares), prompt rules, output checks before work, prefill progress, context
warnings, escaping of user text, help. The tiny test model's context is 256 tokens."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.process_warnings import invoke
from tinygpt_mlx.cli.common import CONFIG_FLAGS
from tinygpt_mlx.cli.main import app
from tinygpt_mlx.config import CacheConfig, ConfigError, SampleConfig

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 256
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def refuse(*args):
    """A refusal or bad input run as `run` does, checked as a process would be seen
    (tests/process_warnings.py: no Python warning it would print above its one line)."""
    return invoke(args)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def assert_one_line_error(r, *named):
    """Non-zero exit, exactly one non-empty line on stderr, no traceback, `named` all in it."""
    assert r.exit_code != 0, r.output
    assert len(lines(r.stderr)) == 1, r.stderr
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    for name in named:
        assert name in r.stderr, (name, r.stderr)


# ----- 1. config errors name the flag ------------------------------------------------------------
# (command, arguments, the flag to name, the config field that used to be named instead)
BAD_FLAGS = [
    ("sample", ["--kv-quantize", "int3"], "--kv-quantize", "kv_quantize"),
    ("sample", ["--kv-quantize-keys", "int7"], "--kv-quantize-keys", "kv_quantize_keys"),
    ("sample", ["--kv-quantize-values", "fp8"], "--kv-quantize-values", "kv_quantize_values"),
    ("sample", ["--kv-group-size", "0"], "--kv-group-size", "group_size"),
    ("sample", ["--kv-quantize", "int4", "--kv-residual", "-1"], "--kv-residual", "residual"),
    ("sample", ["--kv-quantize", "int4", "--kv-residual", "48"], "--kv-residual", "residual"),
    ("sample", ["--kv-quantize", "int4", "--kv-exact-topk", "-1"], "--kv-exact-topk", "exact_topk"),
    ("sample", ["--kv-exact-topk", "16"], "--kv-exact-topk", "exact_topk"),
    ("sample", ["--kv-quantize", "int4", "--kv-exact-topk", "8", "--kv-shadow", "tape"], "--kv-shadow",
     "shadow_store"),
    ("sample", ["--kv-quantize", "int4", "--kv-shadow", "ram"], "--kv-shadow", "shadow_store"),
    ("sample", ["--streaming-llm-sink", "-1", "--streaming-llm-window", "8"], "--streaming-llm-sink", "sink"),
    ("sample", ["--streaming-llm-sink", "4"], "--streaming-llm-sink", "sink"),
    ("sample", ["--streaming-llm-window", "0"], "--streaming-llm-window", "window"),
    ("sample", ["--streaming-llm-window", "8", "--streaming-llm-rope", "sideways"], "--streaming-llm-rope",
     "rope_mode"),
    ("sample", ["--streaming-llm-rope", "absolute"], "--streaming-llm-rope", "rope_mode"),
    ("sample", ["--kv-quantize", "int4", "--streaming-llm-rope", "shifted"], "--streaming-llm-rope", "rope_mode"),
    ("sample", ["--streaming-llm-rope", "auto"], "--streaming-llm-rope", "rope_mode"),
    ("sample", ["--kv-quantize", "int4", "--kv-group-size", "48", "--kv-residual", "48"], "--kv-group-size",
     "group_size"),
    ("sample", ["--kv-group-size", "16"], "--kv-group-size", "group_size"),
    ("sample", ["--kv-quantize", "int4", "--kv-exact-topk", "8", "--kiv-hot-budget", "64"], "--streaming-llm-rope",
     "rope_mode"),
    ("sample", ["--kv-quantize-keys", "int8", "--kv-exact-topk", "8", "--kiv-hot-budget", "64",
                "--streaming-llm-rope", "shifted"], "--streaming-llm-rope", "rope_mode"),
    ("sample", ["--kiv-hot-budget", "0"], "--kiv-hot-budget", "hot_budget"),
    ("sample", ["--kiv-hot-budget", "8", "--streaming-llm-window", "8"], "--kiv-hot-budget", "hot_budget"),
    ("sample", ["--kiv-top-p", "0"], "--kiv-top-p", "retrieve_tokens"),
    ("sample", ["--kiv-page-size", "0"], "--kiv-page-size", "page_size"),
    ("sample", ["--kiv-top-pages", "0"], "--kiv-top-pages", "top_pages"),
    ("sample", ["--kiv-summary", "median"], "--kiv-summary", "summary"),
    ("sample", ["--kiv-cold-store", "tape"], "--kiv-cold-store", "cold_store"),
    ("sample", ["--kiv-cold-bits", "2"], "--kiv-cold-bits", "cold_bits"),
    ("sample", ["--kiv-positions", "middle"], "--kiv-positions", "retrieved_position"),
    ("sample", ["--kiv-index-block", "-1"], "--kiv-index-block", "index_block"),
    ("sample", ["--kiv-index-expand", "0"], "--kiv-index-expand", "index_expand"),
    ("sample", ["--kiv-unit", "words"], "--kiv-unit", "retrieve_unit"),
    ("sample", ["--kiv-unit", "spans", "--kiv-positions", "slots"], "--kiv-unit", "retrieve_unit"),
    ("sample", ["--tokens", "-1"], "--tokens", "max_tokens"),
    ("sample", ["--temperature", "-1"], "--temperature", "temperature"),
    ("sample", ["--top-p", "0"], "--top-p", "top_p"),
    ("sample", ["--top-p", "1.5"], "--top-p", "top_p"),
    ("sample", ["--top-k", "-1"], "--top-k", "top_k"),
    ("sample", ["--prefill-chunk", "0"], "--prefill-chunk", "prefill_chunk"),
    ("sample", ["--seed", "-5"], "--seed", "seed"),     # was mx.random.key's TypeError after the banner
    ("sample", ["--seed", str(2**64)], "--seed", "seed"),
    ("chat", ["--seed", "-1"], "--seed", "seed"),
    ("serve", ["--port", "0"], "--port", "port"),
    ("serve", ["--port", "70000"], "--port", "port"),
    ("serve", ["--max-slots", "0"], "--max-slots", "max_slots"),
    ("serve", ["--small-request", "-1"], "--small-request", "small_request"),
    ("serve", ["--prefill-chunk", "0"], "--prefill-chunk", "prefill_chunk"),
    # the cache flags of another command go through the same translation
    ("needle", ["--streaming-llm-window", "0"], "--streaming-llm-window", "window"),
    ("needle", ["--kv-quantize", "int4", "--kv-exact-topk", "8"], "--streaming-llm-rope", "rope_mode"),  # hot 256
    ("serve", ["--kv-group-size", "8"], "--kv-group-size", "group_size"),
]
FIELD_WORD = re.compile(r"(?<![-\w])(" + "|".join(k for k in CONFIG_FLAGS if "_" in k) + r")(?![-\w])")


@pytest.mark.parametrize("command, args, flag, field", BAD_FLAGS, ids=lambda x: x if isinstance(x, str) else None)
def test_config_errors_name_the_flag_not_the_field(tmp_path, command, args, flag, field):
    missing = tmp_path / "not-loaded.tinygpt"   # every check must come before the model loads
    extra = ["-p", "hi"] if command == "sample" else []
    r = refuse(command, missing, *extra, *args)
    assert_one_line_error(r, f"Invalid value for '{flag}': ")
    assert r.exit_code == 2
    problem = r.stderr.split(f"'{flag}': ", 1)[1]
    assert not problem.startswith(field) and f"{field} must" not in r.stderr
    assert not FIELD_WORD.search(r.stderr), r.stderr  # no snake_case field name anywhere


def test_every_config_field_has_a_real_flag():
    from typer.main import get_command

    commands = get_command(app).commands
    declared = {opt for name in ("sample", "serve") for p in commands[name].params for opt in p.opts}
    for cls in (CacheConfig, SampleConfig):
        for f in cls.__dataclass_fields__:
            if f != "stop":  # not a CLI setting
                assert f in CONFIG_FLAGS, f
    assert set(CONFIG_FLAGS.values()) <= declared, set(CONFIG_FLAGS.values()) - declared


def test_config_error_keeps_library_names():
    with pytest.raises(ConfigError) as e:
        CacheConfig(key_bits=4, value_bits=4, residual=48)
    assert e.value.field == "residual" and str(e.value).startswith("residual must be a multiple of group_size")
    assert e.value.describe(lambda f: f"--{f}") == "must be a multiple of --group_size (32), got 48"


# ----- 2 / 4. prompt rules -------------------------------------------------------------------------
def test_non_utf8_prompt_file_names_the_file(native_path, tmp_path):
    bad = tmp_path / "latin1[red]x.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    r = refuse("sample", native_path, "--prompt-file", bad, "-n", 2)
    assert_one_line_error(r, "--prompt-file", str(bad), "not UTF-8", "0xe9")


def test_refuse_sees_a_warning_the_in_process_run_misses(native_path, tmp_path, monkeypatch):
    """A `warnings.warn` planted in a refusal path (the prompt file's): a process prints it above
    the one error line. `run` (CliRunner in pytest's process) still sees one line, as the older
    tests did; `refuse` fails on it."""
    import warnings

    from tinygpt_mlx.cli import sample as sample_cli

    read = sample_cli.read_prompt_file

    def planted(path):
        warnings.warn("planted", UserWarning)
        return read(path)

    monkeypatch.setattr(sample_cli, "read_prompt_file", planted)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    with pytest.warns(UserWarning, match="planted"):     # raised, kept by pytest, not in r.stderr
        assert_one_line_error(run("sample", native_path, "--prompt-file", bad, "-n", 2), "not UTF-8")
    with pytest.raises(AssertionError, match="UserWarning: planted"):
        refuse("sample", native_path, "--prompt-file", bad, "-n", 2)


def test_empty_prompt_and_empty_prompt_file_are_errors(native_path, tmp_path):
    r = refuse("sample", native_path, "--prompt", "", "-n", 2)
    assert_one_line_error(r, "'--prompt'", "empty", "omit --prompt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = refuse("sample", native_path, "--prompt-file", empty, "-n", 2)
    assert_one_line_error(r, "'--prompt-file'", str(empty), "empty", "omit --prompt-file")


def test_cache_prompt_s_empty_prompt_file_is_not_told_to_omit_it(native_path, tmp_path):
    """cache-prompt requires --prompt-file: an empty one says what it needs (before: sample's
    'omit --prompt-file to sample unconditionally from the start token', which cache-prompt then
    refuses as a missing option)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = refuse("cache-prompt", native_path, "--prompt-file", empty, "--out", tmp_path / "x.ptc")
    assert_one_line_error(r, "'--prompt-file'", str(empty), "empty", "a document to prefill")
    assert "omit" not in r.stderr and "unconditionally" not in r.stderr


def test_no_prompt_samples_unconditionally_with_a_note(native_path):
    r = run("sample", native_path, "-n", 8, "--temperature", 0, "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert "note: no prompt given: sampling unconditionally" in r.stderr
    assert "prompt 1 token," in r.stderr and r.stdout.strip()
    r = run("sample", native_path, "-p", "The", "-n", 2)
    assert "unconditionally" not in r.stderr


def test_tokens_zero_is_prefill_only(native_path, tmp_path):
    out = tmp_path / "r.json"
    r = run("sample", native_path, "-p", "The quick brown fox", "-n", 0, "--report-json", out)
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert len([ln for ln in lines(r.stderr) if "prefill only" in ln]) == 1
    assert "posttrainllm" in r.stderr and "report" in r.stderr and "generated 0" in r.stderr
    rep = json.loads(out.read_text())
    assert rep["generated_tokens"] == 0 and rep["prompt_tokens"] > 1 and rep["current_length"] == rep["prompt_tokens"]
    assert rep["prefill_tokens_per_s"] > 0
    assert "prefill only" not in run("sample", native_path, "-p", "The", "-n", 1).stderr


# ----- 3. output paths are checked before the model loads ----------------------------------------
def test_report_json_checked_before_loading(tmp_path):
    missing_model = tmp_path / "missing.tinygpt"   # loading it would fail with a different error
    r = refuse("sample", missing_model, "-p", "hi", "--report-json", tmp_path / "no-such-dir" / "r.json")
    assert_one_line_error(r, "'--report-json'", "no-such-dir")
    assert "missing.tinygpt" not in r.stderr
    r = refuse("sample", missing_model, "-p", "hi", "--report-json", tmp_path)
    assert_one_line_error(r, "--report-json", "directory")


def test_report_json_written_whole(native_path, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("old")
    r = run("sample", native_path, "-p", "The", "-n", 3, "--report-json", out)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["generated_tokens"] <= 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]   # no temporary left behind


# ----- 5. prefill progress on stderr, stdout only the text -----------------------------------------
@pytest.mark.slow
def test_long_prompt_shows_prefill_progress_and_stdout_is_only_text(native, native_path):
    from tinygpt_mlx.generate import stream_generate

    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    n_prompt = len(native.tokenizer.encode(prompt))
    assert 64 < n_prompt < CONTEXT - 20
    args = ["-p", prompt, "-n", 12, "--temperature", 0, "--prefill-chunk", 64]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", "sample", str(native_path), *map(str, args)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    expected = "".join(ch.text for ch in stream_generate(
        native, prompt, CacheConfig(), SampleConfig(max_tokens=12, temperature=0, prefill_chunk=64)))
    assert expected and p.stdout == expected + "\n"
    assert f"prefill ({n_prompt} tok) ..." in p.stderr
    assert re.search(rf"prefill: done, {n_prompt} tok in [\d.]+ s", p.stderr), p.stderr
    assert p.stderr.index("prefill (") > p.stderr.index("posttrainllm")  # after the banner
    # a prompt within one chunk (and < 1024 tokens) stays quiet
    assert "prefill (" not in run("sample", native_path, *args[:-2]).stderr


# ----- 6. passing the trained context is never silent -----------------------------------------------
def count_warnings(r) -> int:
    return r.stderr.count("warning:")


def test_full_cache_warns_once_when_generation_passes_the_context(native_path):
    r = run("sample", native_path, "-p", "The", "-n", 300, "--temperature", 1.0, "--seed", 0, "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert count_warnings(r) == 1, r.stderr
    assert f"passed the model's trained context ({CONTEXT} tokens)" in r.stderr
    assert "--streaming-llm-window" in r.stderr and "--kiv-hot-budget" in r.stderr
    # at the moment it happens, not up front: text streamed before the warning, and after it
    before, after = r.output.split("warning:", 1)
    assert r.stdout[:40] in before and r.stdout.rstrip()[-40:] in after


def test_no_warning_inside_the_context_and_the_exact_boundary(native, native_path):
    prompt = "The quick"
    p = len(native.tokenizer.encode(prompt))
    # the model sees prompt + n - 1 tokens (the last sampled one is never fed)
    inside = run("sample", native_path, "-p", prompt, "-n", CONTEXT - p + 1, "--ignore-eos", "--seed", 0)
    assert inside.exit_code == 0 and count_warnings(inside) == 0, inside.stderr
    assert f"currentLength {CONTEXT}," in inside.stderr
    past = run("sample", native_path, "-p", prompt, "-n", CONTEXT - p + 2, "--ignore-eos", "--seed", 0)
    assert past.exit_code == 0 and count_warnings(past) == 1, past.stderr
    assert f"currentLength {CONTEXT + 1}," in past.stderr


@pytest.mark.parametrize("args, warned, named", [
    (["--streaming-llm-sink", 4, "--streaming-llm-window", CONTEXT - 3], True, "--streaming-llm-window"),
    (["--streaming-llm-sink", 4, "--streaming-llm-window", CONTEXT - 4], False, None),
    # retrieval's shifted slots named: its default picks original positions for a run this short
    (["--kiv-hot-budget", CONTEXT, "--streaming-llm-rope", "shifted"], True, "--kiv-hot-budget"),  # + 1 fixed slot
    (["--kiv-hot-budget", CONTEXT - 1, "--streaming-llm-rope", "shifted"], False, None),
    (["--kiv-hot-budget", CONTEXT - 64, "--kiv-positions", "slots", "--kiv-top-p", 65, "--streaming-llm-rope",
      "shifted"], True, "--kiv-hot-budget"),
    (["--kiv-hot-budget", CONTEXT], False, None),    # the default: original positions, none untrained
])
def test_span_wider_than_the_context_is_warned_up_front(native_path, args, warned, named):
    r = run("sample", native_path, "-p", "The", "-n", 2, *args)   # short run: only the config can warn
    assert r.exit_code == 0, r.output
    assert count_warnings(r) == (1 if warned else 0), r.stderr
    if warned:
        assert named in r.stderr and f"trained context ({CONTEXT})" in r.stderr


@pytest.mark.parametrize("chunk, warned", [(64, True), (CONTEXT - 4 - 200 + 2, True), (CONTEXT - 4 - 200 + 1, False)])
def test_prefill_chunks_past_the_context_are_warned_up_front(native_path, chunk, warned):
    """A long prompt through a shifted window: each chunk sees sink + window - 1 older tokens, so
    a chunk wider than what is left of the trained context puts queries past it."""
    prompt = "the word of the keeper and the number " * 40          # > CONTEXT tokens
    r = run("sample", native_path, "-p", prompt, "-n", 1, "--streaming-llm-sink", 4,
            "--streaming-llm-window", 200, "--prefill-chunk", chunk)
    assert r.exit_code == 0, r.output
    assert count_warnings(r) == (1 if warned else 0), r.stderr
    if warned:
        assert f"--prefill-chunk {CONTEXT - 4 - 200 + 1} or less" in r.stderr


def test_default_prefill_chunk_narrows_to_fit_the_context(native_path):
    """Without --prefill-chunk, a long prompt through a shifted window prefills in the widest
    chunks that stay inside the trained context, and says so; a short prompt keeps the default."""
    prompt = "the word of the keeper and the number " * 40
    r = run("sample", native_path, "-p", prompt, "-n", 1, "--streaming-llm-sink", 4, "--streaming-llm-window", 200)
    assert r.exit_code == 0 and count_warnings(r) == 0, r.stderr
    fit = CONTEXT - 4 - 200 + 1
    assert f"prefill chunk {fit}: the widest" in r.stderr and f"prefill chunk {fit}\n" in r.stderr
    short = run("sample", native_path, "-p", "The", "-n", 1, "--streaming-llm-sink", 4, "--streaming-llm-window", 200)
    assert "prefill chunk 512" in short.stderr and "the widest" not in short.stderr


def test_window_run_past_the_context_warns_only_with_absolute_positions(native_path):
    base = ("sample", native_path, "-p", "The", "-n", 300, "--ignore-eos", "--seed", 0,
            "--streaming-llm-sink", 4, "--streaming-llm-window", 32)
    r = run(*base)
    assert r.exit_code == 0 and count_warnings(r) == 0, r.stderr
    r = run(*base, "--streaming-llm-rope", "absolute")
    assert r.exit_code == 0 and count_warnings(r) == 1, r.stderr
    assert "--streaming-llm-rope shifted keeps them inside" in r.stderr


def test_retrieval_positions_follow_the_runs_length(native_path, tmp_path):
    """Retrieval's default (--streaming-llm-rope auto): original positions where the prompt and
    --tokens fit the trained context (the same text as naming absolute, and said), cache slots
    where the run may pass it (the same text as naming shifted), and for a cache saved to be
    continued later."""
    prompt = "the word of the keeper and the number " * 3    # past the hot window: cold tokens retrieved
    flags = ["-p", prompt, "--temperature", 1.0, "--seed", 3, "--ignore-eos", "--kiv-hot-budget", 16,
             "--streaming-llm-sink", 4, "--kiv-top-p", 8]      # sampled: the tiny model's greedy text is one digit

    def sample(n, *extra):
        out = tmp_path / "r.json"
        r = run("sample", native_path, *flags, "-n", n, "--report-json", out, *extra)
        assert r.exit_code == 0, r.output
        return r, json.loads(out.read_text())["policy"]["retrieval"]["rope_mode"]

    n = CONTEXT - 140          # prompt + n inside the context
    auto, mode = sample(n)
    assert mode == "absolute" and "original positions" in auto.stderr
    assert "note: original RoPE positions: prompt + --tokens" in auto.stderr
    absolute, mode = sample(n, "--streaming-llm-rope", "absolute")
    shifted, _ = sample(n, "--streaming-llm-rope", "shifted")
    assert auto.stdout == absolute.stdout and mode == "absolute"
    assert shifted.stdout != auto.stdout        # the positions change what this model says
    long, mode = sample(CONTEXT, "-n", CONTEXT)   # may pass the context: slots (the last -n wins)
    assert mode == "shifted" and "original RoPE" not in long.stderr
    saved, mode = sample(n, "--save-prompt-cache", tmp_path / "p.ptc")
    assert mode == "shifted" and saved.stdout == shifted.stdout


# ----- 7. user text is shown intact ------------------------------------------------------------------
def test_bracketed_missing_model_path_shown_intact(tmp_path):
    path = tmp_path / "a[red]b[/red].tinygpt"
    r = refuse("sample", path, "-p", "hi")
    assert_one_line_error(r, str(path))
    assert r.exit_code == 1


def test_banner_escapes_the_model_name(native_path, tmp_path):
    path = tmp_path / "m[bold]x[i].tinygpt"
    shutil.copy(native_path, path)
    r = run("sample", path, "-p", "hi", "-n", 2)
    assert r.exit_code == 0, r.output
    assert "model m[bold]x[i] (tinygpt" in r.stderr


# ----- 8. help -------------------------------------------------------------------------------------
def test_help_shows_flags_as_flags_and_explains_each():
    from typer.main import get_command

    r = run("sample", "--help")
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert "--ignore-eos Keep generating" in text and "<bool>" not in text
    for param in get_command(app).commands["sample"].params:
        assert param.help and param.help.strip(), param.name
        assert " ".join(param.help.split())[:30] in text, param.name
    for rule in ("unconditionally", "prefill only", "KIVI", "G - 1"):
        assert rule in text, rule


def test_a_run_without_seed_draws_one_and_the_banner_says_how_to_repeat_it(native_path):
    """With a temperature and no --seed the banner names the seed drawn (it said `seed None`),
    and --seed with it gives the same text; greedy runs say they need none."""
    first = run("sample", native_path, "--prompt", "ab", "--tokens", "12", "--temperature", "1.0")
    assert first.exit_code == 0, first.output
    m = re.search(r"seed (\d+) \(drawn: --seed \1 repeats the run\)", " ".join(first.stderr.split()))
    assert m, first.stderr
    again = run("sample", native_path, "--prompt", "ab", "--tokens", "12", "--temperature", "1.0", "--seed", m[1])
    assert again.exit_code == 0 and again.stdout == first.stdout, (first.stdout, again.stdout)
    assert "drawn" not in again.stderr and f"seed {m[1]}," in again.stderr
    greedy = run("sample", native_path, "--prompt", "ab", "--tokens", "4", "--temperature", "0")
    assert greedy.exit_code == 0 and "no seed (greedy)" in greedy.stderr, greedy.stderr
