"""The evaluation commands (needle, bench, cache-report, compare, perplexity) on first contact:
defaults that need no fetched data, output paths and the plot extra checked before any work,
one-line errors naming the file, and progress on stderr only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tinygpt_mlx.cli.main import app
from tinygpt_mlx.evaluate import inputs

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = ROOT / "models" / "tinygpt-base.tinygpt"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(r, *needles: str) -> str:
    """A failed run printed exactly one line on stderr, no traceback, naming every needle."""
    assert r.exit_code != 0, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


class Spy:
    """Stands in for the model loader / the long-running function: records calls, does nothing."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *a, **k):
        self.calls += 1
        raise RuntimeError("the work started")


@pytest.fixture
def no_load(monkeypatch):
    spy = Spy()
    # the commands import the loader when they run (tinygpt_mlx/cli/main.py), so the spy replaces it at its source
    monkeypatch.setattr("tinygpt_mlx.loading.load", spy)
    return spy


@pytest.mark.parametrize("flag, value, named", [("--reference", "bogus", "'bogus'"),
                                                ("--policies", "fp32,int9", "'int9'"),
                                                ("--policies", "mlx-rotating3", "rotating size"),
                                                ("--policies", "mlx-rotating256@eager", "'mlx-rotating256@eager'"),
                                                ("--policies", "sink4/window9x@eager", "'sink4/window9x@eager'")])
def test_bench_bad_spec_is_one_line_before_the_model_loads(no_load, flag, value, named):
    line = one_line_error(run("bench", flag, value, "--contexts", 16), f"'{flag}'", named)
    assert line.startswith("error:") and no_load.calls == 0


# --- defaults that work with no data fetched -------------------------------------------------

def test_shipped_heldout_text_is_packaged_utf8_kjv():
    text = inputs.HELDOUT_KJV.read_text(encoding="utf-8")
    assert inputs.HELDOUT_KJV.parent == ROOT / "tinygpt_mlx" / "data"
    assert 20_000 < len(text.encode()) < 200_000
    # the held-out tail of the KJV: the last 2% of its lines end with the end of Revelation
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian's bible-kjv (apt-get install bible-kjv)")
def test_shipped_heldout_text_regenerates_byte_for_byte(tmp_path):
    out = tmp_path / "kjv.txt"
    subprocess.run(["bash", str(ROOT / "scripts" / "fetch_corpus.sh"), "--shipped-heldout", str(out)],
                   check=True, capture_output=True)
    assert out.read_bytes() == inputs.HELDOUT_KJV.read_bytes()


def test_needle_without_filler_runs_on_the_shipped_text(tmp_path, monkeypatch):
    """A fresh install has no data/: the grid runs on the shipped held-out text."""
    monkeypatch.chdir(tmp_path)  # no data/heldout.txt anywhere near
    read = []
    real = inputs.read_text
    monkeypatch.setattr(inputs, "read_text", lambda p: read.append(Path(p)) or real(p))
    out = tmp_path / "grid.json"
    r = run("needle", SHIPPED_MODEL, "--contexts", 96, "--depths", 0.5, "--seeds", 1, "--policies", "full",
            "--json", out)
    assert r.exit_code == 0, r.output
    assert read == [inputs.HELDOUT_KJV]
    grid = json.loads(out.read_text())
    assert len(grid["cells"]) == 1
    cell = grid["cells"][0]
    assert isinstance(cell["passed"], bool)
    assert cell["context"] == 96 and cell["policy"] == "full"
    assert 90 <= cell["prompt_tokens"] <= 96  # the document is cut to the asked length, +- a token


def test_needle_resume_keeps_the_saved_cells_and_runs_the_others(tmp_path, monkeypatch):
    """`--resume`: a grid stopped part way (its JSON saved cell by cell) goes on: the cells in the
    file are kept as they are (not run again), the others run, and the file ends as the whole
    grid's, in grid order, the new cells as a run from scratch gives them."""
    from tinygpt_mlx.evaluate import needle as nd

    out = tmp_path / "grid.json"
    grid = ["--contexts", 96, "--depths", "0.3,0.7", "--seeds", 1, "--policies", "full,streaming",
            "--streaming-llm-sink", 4, "--kiv-hot-budget", 32, "--json", out]
    r = run("needle", SHIPPED_MODEL, *grid)
    assert r.exit_code == 0, r.output
    whole = json.loads(out.read_text())
    assert [(c["policy"], c["depth"]) for c in whole["cells"]] == [
        ("full", 0.3), ("streaming", 0.3), ("full", 0.7), ("streaming", 0.7)]
    assert whole["filler"] == nd.filler_id(inputs.read_text(inputs.HELDOUT_KJV)) and whole["digits"] == 5

    stopped = dict(whole, cells=[dict(c, output="kept") for c in whole["cells"][:3]])   # as if stopped there
    out.write_text(json.dumps(stopped))
    runs = []
    real = nd.run_cell
    monkeypatch.setattr(nd, "run_cell", lambda *a, **k: runs.append(a[2]) or real(*a, **k))
    r = run("needle", SHIPPED_MODEL, *grid, "--resume")
    assert r.exit_code == 0, r.output
    assert f"resuming {out}: 3 cells kept, 1 to run" in r.stderr
    assert len(runs) == 1 and runs[0].window is not None           # only the streaming cell at 0.7 ran
    after = json.loads(out.read_text())
    assert [c["output"] for c in after["cells"][:3]] == ["kept"] * 3
    new, ref = after["cells"][3], whole["cells"][3]
    assert (new["policy"], new["depth"], new["output"], new["passed"]) == \
        (ref["policy"], ref["depth"], ref["output"], ref["passed"])
    assert after["summary"]["streaming"]["cells"] == 2 and after["summary"]["full"]["cells"] == 2

    # a file that does not exist yet: the grid starts afresh
    fresh = tmp_path / "fresh.json"
    r = run("needle", SHIPPED_MODEL, *grid[:-1], fresh, "--resume")
    assert r.exit_code == 0 and "does not exist yet" in r.stderr and len(json.loads(fresh.read_text())["cells"]) == 4


@pytest.mark.parametrize("change, needles", [
    (["--prefill-chunk", 64], ["--prefill-chunk 128", "64"]),
    (["--digits", 6], ["--digits 5", "6"]),
    (["--streaming-llm-sink", 2], ["policy 'streaming' was configured otherwise"]),
    (["--depths", "0.3"], ["a cell outside this grid", "depth 0.7"]),
    (["--lead-in", "The pass key is number"], ["--lead-in None"]),          # recorded as None: no lead-in
    (["--probe", None, "--policies", "full,streaming,retrieval"], ["--probe False"]),
    (["--seeds", 1, "CELLS", "values_right"], ["do not record values_right"]),
    (["--filler", ROOT / "README.md"], ["run on a --filler text hashing to", "this run's hashes to"]),
])
def test_needle_resume_refuses_another_grids_file_in_one_line(tmp_path, change, needles):
    out = tmp_path / "grid.json"
    grid = {"--contexts": 96, "--depths": "0.3,0.7", "--seeds": 1, "--policies": "full,streaming",
            "--streaming-llm-sink": 4, "--kiv-hot-budget": 32, "--json": out}
    r = run("needle", SHIPPED_MODEL, *[x for kv in grid.items() for x in kv])
    assert r.exit_code == 0, r.output
    if "CELLS" in change:             # a file whose cells lack a field the summary counts (an older version's)
        saved = json.loads(out.read_text())
        for cell in saved["cells"]:
            del cell[change[change.index("CELLS") + 1]]
        out.write_text(json.dumps(saved))
        change = change[:change.index("CELLS")]
    before = out.read_text()
    grid.update(dict(zip(change[::2], change[1::2])))
    r = run("needle", SHIPPED_MODEL, *[x for kv in grid.items() for x in kv if x is not None], "--resume")
    one_line_error(r, f"--resume {out}: not this grid's file", *needles)
    assert out.read_text() == before                                # nothing written


def test_needle_resume_of_an_older_file_says_what_it_does_not_record(tmp_path):
    """A grid JSON written before digits, chat, lead_in, the filler and --probe were recorded is
    resumed (they are taken to be this run's) with one line naming them, not refused as if it
    recorded the defaults."""
    out = tmp_path / "grid.json"
    grid = ["--contexts", 96, "--depths", "0.3,0.7", "--seeds", 1, "--policies", "full", "--digits", 6,
            "--json", out]
    assert run("needle", SHIPPED_MODEL, *grid).exit_code == 0
    saved = json.loads(out.read_text())
    old = {k: v for k, v in saved.items() if k not in ("digits", "chat", "lead_in", "filler", "probe")}
    old["cells"] = old["cells"][:1]
    out.write_text(json.dumps(old))
    r = run("needle", SHIPPED_MODEL, *grid, "--resume")
    assert r.exit_code == 0, r.output
    assert "does not record its digits, chat, lead_in, filler, probe" in r.stderr
    assert len(json.loads(out.read_text())["cells"]) == 2


def test_needle_resume_stopped_again_keeps_every_cell_of_its_file(tmp_path, monkeypatch):
    """A resume that widens the grid (a policy added) and is stopped part way: the file still
    holds every cell it held (each save carries the kept cells the run has not reached yet)."""
    from tinygpt_mlx.evaluate import needle as nd

    out = tmp_path / "grid.json"
    grid = ["--contexts", 96, "--depths", "0.3,0.7", "--seeds", 1, "--streaming-llm-sink", 4,
            "--kiv-hot-budget", 32, "--json", out]
    assert run("needle", SHIPPED_MODEL, *grid, "--policies", "full").exit_code == 0
    first = json.loads(out.read_text())["cells"]
    calls = []
    real = nd.run_cell

    def stop_on_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(nd, "run_cell", stop_on_second)
    r = run("needle", SHIPPED_MODEL, *grid, "--policies", "full,streaming", "--resume")
    assert r.exit_code == 130 and "interrupted" in r.stderr, r.output
    saved = json.loads(out.read_text())["cells"]
    assert [(c["policy"], c["depth"]) for c in saved] == [("full", 0.3), ("streaming", 0.3), ("full", 0.7)]
    assert [c for c in saved if c["policy"] == "full"] == first


@pytest.mark.parametrize("flag, value, named", [("--contexts", "1k,2k", "integers"),
                                                ("--contexts", "256,abc", "'abc'"),
                                                ("--depths", "0.5,deep", "numbers")])
def test_needle_non_numeric_list_says_what_it_needs_before_loading(no_load, flag, value, named):
    """`--contexts 1k,2k` is a comma list: the error says it must be one of integers and names
    the item (it said "must be a comma list, got '1k,2k'")."""
    line = one_line_error(run("needle", SHIPPED_MODEL, flag, value), f"'{flag}'", named, "comma list of")
    assert line.startswith("error:") and no_load.calls == 0


def test_needle_resume_needs_a_grid_json_before_loading(tmp_path, no_load):
    r = run("needle", SHIPPED_MODEL, "--contexts", 96, "--resume")
    one_line_error(r, "--resume", "--json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    r = run("needle", SHIPPED_MODEL, "--contexts", 96, "--json", bad, "--resume")
    one_line_error(r, "'--resume'", str(bad), "not a needle grid's JSON")
    bad.write_text("{not json")
    one_line_error(run("needle", SHIPPED_MODEL, "--contexts", 96, "--json", bad, "--resume"), str(bad))
    assert no_load.calls == 0


def test_needle_progress_line_prints_the_cells_token_recall(tmp_path):
    """The progress line's "needle token recall" is the JSON's telemetry token_recall (the share of
    the needle's tokens fetched), not token_any (of layer-head steps fetching any): docs quoted the
    line (session 43 found four tables that had copied token_any under that name)."""
    out = tmp_path / "grid.json"
    r = run("needle", SHIPPED_MODEL, "--contexts", 1024, "--depths", 0.3, "--seeds", 1, "--policies", "retrieval",
            "--streaming-llm-sink", 4, "--kiv-hot-budget", 128, "--json", out)
    assert r.exit_code == 0, r.output
    tel = json.loads(out.read_text())["cells"][0]["telemetry"]
    assert f"{tel['token_recall']:.2f}" != f"{tel['token_any']:.2f}", tel   # the case tells the two apart
    line = next(x for x in r.stderr.splitlines() if "needle token recall" in x)
    assert f"needle token recall {tel['token_recall']:.2f} (any fetched {tel['token_any']:.2f})" in line, line


@pytest.mark.parametrize("flags, needles", [(["--task", "phonebooks"], ["--task 'phonebooks'", "keyed-all"]),
                                           (["--task", "keyed", "--facts", "0"], ["--facts 0", "1..22"]),
                                           (["--task", "keyed", "--facts", "23"], ["--facts 23"])])
def test_needle_task_errors_name_the_value(no_load, flags, needles):
    r = run("needle", SHIPPED_MODEL, "--contexts", 96, *flags)
    one_line_error(r, *needles)
    assert no_load.calls == 0


def test_needle_keyed_all_grid_scores_every_value(tmp_path):
    out = tmp_path / "grid.json"
    r = run("needle", SHIPPED_MODEL, "--contexts", 300, "--depths", 0.5, "--seeds", 1, "--policies", "full",
            "--task", "keyed-all", "--facts", 3, "--json", out)
    assert r.exit_code == 0, r.output
    grid = json.loads(out.read_text())
    cell = grid["cells"][0]
    assert grid["task"] == "keyed-all" and grid["facts"] == 3 and cell["values"] == 3
    assert cell["answer"].count("The secret number of") == 2 and 0 <= cell["values_right"] <= 3


def test_missing_corpus_file_says_how_to_get_it(tmp_path, monkeypatch, no_load):
    monkeypatch.chdir(tmp_path)
    r = run("needle", SHIPPED_MODEL, "--contexts", 96, "--depths", 0.5, "--seeds", 1,
            "--filler", "data/heldout.txt")
    one_line_error(r, "'--filler'", "data/heldout.txt", "scripts/fetch_corpus.sh")
    r = run("perplexity", SHIPPED_MODEL, "--text", "data/heldout.txt")
    one_line_error(r, "'--text'", "data/heldout.txt", "scripts/fetch_corpus.sh")
    assert no_load.calls == 0


@pytest.mark.parametrize("command, flag", [("needle", "--filler"), ("perplexity", "--text"),
                                           ("compare", "--prompts")])
def test_a_text_file_that_is_not_there_is_a_usage_error_naming_the_flag(tmp_path, no_load, command, flag):
    """As `sample --prompt-file` says it: exit code 2, the flag and what was typed (these said
    `error: nope.txt: no such file`, exit code 1, the flag unnamed)."""
    for typed in (tmp_path / "nope.txt", tmp_path):
        r = run(command, SHIPPED_MODEL, flag, typed)
        assert r.exit_code == 2, r.output
        one_line_error(r, f"Invalid value for '{flag}': {typed}: ",
                       "no such file" if typed.name == "nope.txt" else "is a directory")
    assert no_load.calls == 0


# --- a non-UTF-8 text file names the file ----------------------------------------------------

@pytest.mark.parametrize("command, flag", [("needle", "--filler"), ("perplexity", "--text"),
                                           ("compare", "--prompts")])
def test_non_utf8_text_is_one_line_naming_the_file(tmp_path, no_load, command, flag):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Caf\u00e9 au lait\n".encode("latin-1"))
    r = run(command, SHIPPED_MODEL, flag, bad)
    assert r.exit_code == 2
    line = one_line_error(r, f"error: Invalid value for '{flag}': {bad}: not UTF-8 text (")
    assert "byte 3" in line
    assert no_load.calls == 0


# --- output paths and the plot extra, before any work ----------------------------------------

OUTPUTS = [("bench", "--json"), ("bench", "--plot"), ("needle", "--json"), ("needle", "--plot"),
           ("compare", "--json"), ("perplexity", "--json")]


@pytest.mark.parametrize("command, flag", OUTPUTS)
def test_output_path_in_a_missing_folder_fails_before_work(tmp_path, no_load, command, flag):
    target = tmp_path / "no-such-folder" / "out.file"
    r = run(command, SHIPPED_MODEL, flag, target)
    assert r.exit_code == 2
    one_line_error(r, f"'{flag}'", str(target.parent))
    assert no_load.calls == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_output_path_in_a_read_only_folder_fails_before_work(tmp_path, no_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        one_line_error(run("bench", SHIPPED_MODEL, "--json", ro / "b.json"), "'--json'", "not writable")
    finally:
        ro.chmod(0o700)
    assert no_load.calls == 0


@pytest.mark.parametrize("command", ["bench", "needle"])
def test_plot_without_matplotlib_fails_at_once_naming_the_extra(tmp_path, monkeypatch, no_load, command):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` raises ImportError
    grid = Spy()
    monkeypatch.setattr("tinygpt_mlx.evaluate.bench.bench", grid)
    monkeypatch.setattr("tinygpt_mlx.evaluate.needle.needle_grid", grid)
    r = run(command, SHIPPED_MODEL, "--plot", tmp_path / "p.png")
    line = one_line_error(r, "--plot", "matplotlib", "pip install 'posttrainllm[plot]'")
    assert line.startswith("error: ")
    assert no_load.calls == 0 and grid.calls == 0
    assert not (tmp_path / "p.png").exists()


# --- progress on stderr, stdout clean --------------------------------------------------------

@pytest.mark.slow
def test_cache_report_piped_prints_stage_lines_on_stderr_only():
    """stderr is a pipe (not a terminal): a start line, a line per policy and length, a done line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", "cache-report", str(SHIPPED_MODEL),
                        "--length", "8", "--length", "16", "--prefill-chunk", "8"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    err = p.stderr.splitlines()
    assert "cache-report: filling caches (96 tok) ..." in err          # 6 policies x 16 tokens
    assert "  int4: 8 tokens measured" in err and "  int4: 16 tokens measured" in err
    assert any(line.startswith("cache-report: filling caches: done, 96 tok in ") for line in err)
    assert "KV cache bytes" in p.stdout and "K int8 / V int4" in p.stdout
    for progress in ("cache-report:", "tokens measured", ": done,", "tok/s"):
        assert progress not in p.stdout


@pytest.mark.parametrize("command, args, stage", [
    ("bench", ["--contexts", "16", "--policies", "int8", "--decode-steps", "2"], "bench (warm-up"),
    ("compare", ["--tokens", "3", "--modes", "bf16"], "compare: "),
    ("perplexity", ["--max-tokens", "24", "--baseline", "none"], "perplexity: scoring (23 tok) ..."),
    ("needle", ["--contexts", "160", "--depths", "0.5", "--seeds", "1", "--policies", "full"], "needle grid (1 cells) ..."),
])
def test_progress_stage_lines_go_to_stderr_not_stdout(native_path, tmp_path, command, args, stage):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick\nIn the beginning\n")
    extra = ["--prompts", prompts] if command == "compare" else []
    r = run(command, native_path, *args, *extra)
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert any(line.startswith(stage) for line in err), r.stderr
    assert any(": done, " in line for line in err), r.stderr
    assert r.stdout.strip() and ": done, " not in r.stdout and " ..." not in r.stdout


def test_compare_table_prints_a_multi_line_prompt_on_one_row(capsys):
    """compare's table shows each prompt as one row: a document of several lines (a .jsonl prompt)
    or one with [brackets] is not spread over lines or read as rich markup."""
    from tinygpt_mlx.cli.compare import print_table

    prompts = [{"prompt": "First line\nsecond [bold]line\n\nthird", "prefix_match": 1.0},
               {"prompt": "short", "prefix_match": 0.5}]
    print_table({"baseline": "fp32", "tokens": 4,
                 "modes": {"int4": {"prompts": prompts, "mean_prefix_match": 0.75}}})
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "1.00" in line or "0.50" in line]
    assert len(rows) == 2, out
    assert "First line second [bold]" in rows[0] and "short" in rows[1], out


@pytest.mark.parametrize("baseline, title", [("fp32", "vs fp32 full cache,"), ("int4", "vs int4 full cache,"),
                                             ("sink4/window64", "vs sink4/window64,"), ("hot64", "vs hot64,")])
def test_compare_title_calls_only_a_full_cache_baseline_a_full_cache(capsys, baseline, title):
    """compare --baseline sink4/window64: the title said 'vs sink4/window64 full cache'."""
    from tinygpt_mlx.cli.compare import print_table
    from tinygpt_mlx.config import CacheConfig

    print_table({"baseline": baseline, "baseline_policy": CacheConfig.from_spec(baseline).describe(), "tokens": 4,
                 "modes": {"int4": {"prompts": [{"prompt": "p", "prefix_match": 1.0}], "mean_prefix_match": 1.0}}})
    out = " ".join(capsys.readouterr().out.split())     # the title may wrap
    assert title in out, out


@pytest.mark.parametrize("flags, named", [
    ([], ["the full cache (fp32)", "--streaming-llm-window or --kiv-hot-budget"]),
    (["--modes", "int4,sink4/window64"], ["the full cache (int4)", "in --modes"]),
    (["--streaming-llm-sink", "4", "--streaming-llm-window", "64"], ["baseline (fp32)", "--baseline none"])])
def test_perplexity_past_the_context_says_what_to_give(flags, named):
    """A text longer than the model's context under a full cache (the policy's or the baseline's):
    one line in perplexity's terms before the scoring starts (before: generate's 'prompt has 600
    tokens ...; use --streaming-llm-window or retrieval, or shorten the prompt', after 'scoring',
    which offered the window to a run that had one and named neither --max-tokens nor --past-context)."""
    r = run("perplexity", SHIPPED_MODEL, "--max-tokens", 600, *flags)
    assert r.exit_code == 1, r.output
    last = r.stderr.strip().splitlines()[-1]
    for n in ["error: the text has 600 tokens but the model's context is 512", "--max-tokens 512", "--past-context",
              *named]:
        assert n in last, last
    assert "scoring" not in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("device, said", [("cpu", True), ("gpu", False), (None, True)])
def test_bench_caption_says_cpu_only_of_a_cpu_run(capsys, device, said):
    """bench's kernels/step caption said 'this CPU build unfuses RoPE and attention' on every device;
    a GPU run (Metal, CUDA) has them fused. A result without "device" (JSON from before) was a CPU run."""
    from tinygpt_mlx.cli.bench import print_table

    row = {"policy": "fp32", "context": 64, "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0,
           "decode_kernels": 3.0, "cache_bytes": 1024, "prefill_tokens_per_s_vs_fp32": 1.0,
           "decode_tokens_per_s_vs_fp32": 1.0, "cache_bytes_vs_fp32": 1.0}
    print_table({"decode_steps": 2, "reference": "fp32", "rows": [row], **({"device": device} if device else {})})
    out = " ".join(capsys.readouterr().out.split())
    assert "kernel launches on a GPU" in out and ("this CPU build unfuses" in out) == said, out


def test_needle_says_why_the_full_cache_skips_a_context():
    """needle --contexts 600 --policies full on a 512-token model ran no cell and printed a table of
    '-' with exit 0, saying nothing of why; a note names the contexts skipped and --past-context."""
    r = run("needle", SHIPPED_MODEL, "--contexts", "600,1024", "--depths", 0.5, "--seeds", 1,
            "--kiv-hot-budget", 64, "--policies", "full")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert notes == ["note: the full cache skips contexts 600, 1024: past the model's context of 512 tokens "
                     "(--past-context runs it there too)"], r.stderr


# --- a bad value of an evaluation command: one short line, exit 2, before the model loads ------

@pytest.mark.parametrize("command, args, named", [
    ("bench", ["--contexts", "12x"], ["'--contexts'", "'12x'"]),
    ("bench", ["--contexts", "0"], ["'--contexts'", "'0'"]),
    ("bench", ["--policies", ","], ["'--policies'", "','"]),
    ("bench", ["--decode-steps", "0"], ["'--decode-steps'"]),
    ("bench", ["--prefill-chunk", "0"], ["'--prefill-chunk'", "got 0"]),
    ("bench", ["--grow-from", "0"], ["--grow-from 0"]),
    ("bench", ["--weights", "bogus"], ["'--weights'", "'bogus'", "dense"]),
    ("needle", ["--contexts", "12x"], ["--contexts", "'12x'"]),
    ("needle", ["--depths", "0.5,2"], ["--depths"]),
    ("needle", ["--policies", "bogus"], ["'bogus'", "retrieval"]),
    ("needle", ["--policies", ","], ["'--policies'"]),
    # each names the flag and what was typed (before: 'Invalid value: --depths must lie in [0, 1]',
    # '--seeds, --digits and --prefill-chunk must be positive', no flag for a bad policy name)
    ("needle", ["--depths", "0.5,1.5"], ["'--depths'", "got 1.5"]),
    ("needle", ["--contexts", "8"], ["'--contexts'", "got 8"]),
    ("needle", ["--contexts", ","], ["'--contexts'", "','"]),
    ("needle", ["--seeds", "0"], ["'--seeds'", "got 0"]),
    ("needle", ["--digits", "0"], ["'--digits'", "got 0"]),
    ("needle", ["--prefill-chunk", "0"], ["'--prefill-chunk'", "got 0"]),
    ("needle", ["--policies", "full,Retrieval"], ["'--policies'", "'Retrieval'", "streaming"]),
    ("compare", ["--tokens", "0"], ["'--tokens'"]),
    ("compare", ["--modes", "int4,int4"], ["'--modes'", "'int4' given twice"]),
    ("perplexity", ["--max-tokens", "1"], ["'--max-tokens'"]),
    ("perplexity", ["--prefill-tokens", "0"], ["'--prefill-tokens'"]),
    ("perplexity", ["--modes", "int4", "--kv-quantize", "int8"], ["--modes or cache flags"]),
    ("cache-report", ["--prefill-chunk", "0"], ["'--prefill-chunk'", "got 0"]),
    # the KIVI rows' residual of 32 under --kv-group-size 64: it measured two rows first, then exit 1
    ("cache-report", ["--kv-group-size", "64"], ["'--kv-residual'", "--kv-group-size (64)", "got 32"]),
    ("cache-report", ["--policies", "int4", "--kv-residual", "48"], ["'--kv-residual'", "got 48"]),
])
def test_a_bad_value_is_a_usage_error_before_the_model_loads(no_load, command, args, named):
    """Every bad value of bench, needle, compare, perplexity and cache-report exits 2 (a usage
    error, as click's own), in one line naming what was typed, before the model loads (until
    session 44 `bench --contexts 12x` and a bad policy spec of compare exited 1, bench's and
    cache-report's `--prefill-chunk 0` ran with the default chunk, and `compare --tokens 0` failed
    after loading the model)."""
    r = run(command, SHIPPED_MODEL, *args)
    assert r.exit_code == 2, r.output
    line = one_line_error(r, *named)
    assert line.startswith("error: Invalid value") and no_load.calls == 0


@pytest.mark.parametrize("command, flag", [("bench", "--policies"), ("bench", "--reference"),
                                           ("compare", "--modes"), ("compare", "--baseline"),
                                           ("perplexity", "--modes"), ("perplexity", "--baseline"),
                                           ("cache-report", "--policies")])
def test_an_unknown_policy_part_is_one_short_line(no_load, command, flag):
    """A policy spec with an unknown part names the part and a few that are accepted, in one line
    of a terminal's width or two (before session 44: the whole grammar, ~1,100 characters), exit 2."""
    r = run(command, SHIPPED_MODEL, flag, "fp32,int9" if flag in ("--policies", "--modes") else "int9")
    assert r.exit_code == 2, r.output
    line = one_line_error(r, f"'{flag}'", "unknown part 'int9'", "int4", "sink4/window256", f"{command} --help")
    assert len(line) < 240, (len(line), line)
    assert no_load.calls == 0


def test_the_brief_spec_examples_are_specs():
    """The parts an unknown part's error offers (policy_spec.SPEC_BRIEF) each parse, alone and joined."""
    import re

    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.policy_spec import SPEC_BRIEF

    examples = re.findall(r"[a-z0-9/]+\d", SPEC_BRIEF.split("joined")[0])
    assert len(examples) >= 4, examples
    for spec in examples:
        CacheConfig.from_spec(spec)
    CacheConfig.from_spec("int4+sink4/hot1024")


def test_needle_policy_names_are_the_grid_s():
    """needle's --policies names, checked before MLX imports (cli/needle.py), are the grid's own."""
    from tinygpt_mlx.cli.needle import NEEDLE_POLICIES
    from tinygpt_mlx.evaluate.needle import POLICIES

    assert NEEDLE_POLICIES == POLICIES


def test_weights_choices_are_the_loaders():
    """`--weights` is checked as click parses it (cli/common.py), against the loader's own list."""
    from tinygpt_mlx.cli.common import WEIGHT_MODES
    from tinygpt_mlx.ggml.load import WEIGHT_MODES as LOADER_MODES

    assert WEIGHT_MODES == LOADER_MODES


def test_perplexity_title_fits_80_columns():
    """perplexity's table on an 80-column terminal: the title is two whole lines (it wrapped inside
    the table's 79 columns before session 44, the baseline's number alone on a line), and a long
    policy name wraps in its column, not across the terminal."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from tinygpt_mlx.cli.perplexity import print_table

    def result(**k):
        return SimpleNamespace(**dict(tokens=32767, baseline_perplexity=54.5681, perplexity=54.5681, kl_mean=0.0,
                                      top1_agreement=1.0, stored_count=32767, current_length=32767,
                                      cache_bytes=123456789), **k)
    for name in ("fp32", "int8 + StreamingLLM sink 4 + window 256 (shifted RoPE)"):
        buf = io.StringIO()
        print_table({name: result()}, "fp32", console=Console(file=buf, width=80, highlight=False))
        lines = buf.getvalue().splitlines()
        assert max(len(line) for line in lines) <= 80, buf.getvalue()
        assert "perplexity over 32767 tokens, teacher-forced through the cache" in lines[0], lines[0]
        assert "baseline fp32: perplexity 54.5681" in lines[1], lines[1]


def test_perplexity_table_takes_the_terminals_width(monkeypatch):
    """On a terminal the table is laid out at its width (80 here: the policy column wraps); piped,
    at 110 columns as before."""
    import io

    from tinygpt_mlx.cli.perplexity import table_console

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert table_console().width == 80
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert table_console().width == 110
