"""Measurement modules (benchmarks/, run as `python -m benchmarks.NAME` from the checkout's root)
refuse bad arguments before any work: exit 2, the flag and the value named in the last line
(argparse's usage line above it); and every module or script the docs name exists."""

import json
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_as_main(module: str, args: list[str], capfd, monkeypatch, timeout: float = 60) -> tuple[int, str, str]:
    """`python -m benchmarks.MODULE ARGS` from the checkout's root, in this process: the module run
    as `__main__` (runpy, as `-m` runs it: sys.argv[0] its file, so argparse's prog is MODULE.py);
    (exit code, stdout, stderr) as the process would give them. A refusal comes before any work;
    one that does not come in `timeout` seconds fails the test (as the subprocess's timeout did).
    (A subprocess per case spent its seconds importing mlx_lm, transformers and torch: ~3-12 s
    each, 39 cases; the refusal itself takes milliseconds.) An exception other than SystemExit,
    which the process would end on with a traceback, fails the test with it."""
    def too_long(signum, frame):
        raise TimeoutError(f"benchmarks.{module} {args}: no refusal within {timeout} s")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{module}", *args])
    monkeypatch.delitem(sys.modules, f"benchmarks.{module}", raising=False)   # run afresh, as `-m` does
    capfd.readouterr()
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        runpy.run_module(f"benchmarks.{module}", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):          # the interpreter prints the message and exits 1
            print(e.code, file=sys.stderr)
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, says", [
    (["--context", "33"], "--context must be a positive multiple of 32, got 33"),
    (["--steps", "3"], "--steps must be at least 10, got 3"),
    (["--model", "/no/such/model.tinygpt"], "--model /no/such/model.tinygpt: no such file or directory"),
    (["--parts", "kernels,speed"], "--parts 'kernels,speed': expected some of attention,python,kernels,far,retrieval"),
    (["--retrieval-context", "100"], "--retrieval-context must be at least 512, got 100"),
])
@pytest.mark.slow
def test_decode_costs_refuses_bad_arguments(args, says, capfd, monkeypatch):
    returncode, stdout, stderr = run_as_main("decode_costs", args, capfd, monkeypatch)
    assert returncode == 2 and stdout == ""
    assert stderr.strip().splitlines()[-1] == f"decode_costs.py: error: {says}"
    assert "Traceback" not in stderr


@pytest.mark.parametrize("module, args, says", [
    ("needle_step_probe", ["--policies", "sink4/hot256+expand0"],
     "--policies: policy 'sink4/hot256+expand0': index_expand must be an integer >= 1, got 0"),
    ("needle_step_probe", ["--rankers", "mean,bogus"], "--rankers: unknown ranker 'bogus' (mean, lowrankR, intB)"),
    ("needle_step_probe", ["--decode-fetch", "256,abc"],
     "--decode-fetch '256,abc': give token counts (or 'own', 'all'), comma-separated"),
    ("needle_step_probe", ["--decode-fetch", "own,0"], "--decode-fetch 'own,0': each budget must be at least 1 token"),
    ("chat_reach_grid", ["--policies", "retrieval,foo"],
     "--policies 'retrieval,foo': unknown foo (choose from full cache, streaming, retrieval)"),
    ("pipeline", ["/no/model", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("pipeline", ["/no/model", "--tokens", "1"], "--tokens must be at least 2, got 1"),
    ("distributed_table", ["--model", "/no/such/model.tinygpt"], "--model /no/such/model.tinygpt: no such file or directory"),
    ("batch_ceiling", ["/no/model", "--rounds", "1"], "--rounds must be at least 2, got 1"),
    ("batch_ceiling", ["/no/model", "--variants", "none,bogus"],
     "--variants: unknown bogus; known: none, fixed, fixed-compiled, kvcache"),
    ("batch_ceiling", ["/no/model"], "model /no/model: no such file or directory"),
    ("batch_rows", ["/no/model", "--rows", "1"], "--rows must be at least 2, got 1"),
    ("batch_rows", ["/no/model", "--policies", "full,bogus"],
     "--policies: unknown bogus; known: full, int4, sink4/window128, retrieval sink4/hot128, int4 sink4/window128"),
    ("batch_rows", ["/no/model"], "model /no/model: no such file or directory"),
    ("idle_release", ["/no/model", "--requests", "0"], "--requests must be at least 1, got 0"),
    ("idle_release", ["/no/model"], "model /no/model: no such file or directory"),
    ("rope_products_ab", ["--rounds", "0"], "--rounds 0: give at least 1"),
    ("rope_products_ab", ["--prompt", "500"], "--prompt 500: must be more than the hot window and sink (1,028 tokens)"),
    ("rope_products_ab", ["--context", "2000"], "--context 2000: must be at least --prompt (2048 tokens)"),
    ("rope_products_ab", ["--model", "/no/model"], "--model '/no/model': /no/model: no such file or directory"),
    ("retrieval_parting", ["--steps", "0"], "--steps 0: give at least 1"),
    ("retrieval_parting", ["--policy", "fp32"], "--policy 'fp32': not a retrieval policy"),
    ("retrieval_parting", ["--prompt", "50"], "--prompt 50: must be more than the hot window and a page"),
    ("retrieval_parting", ["--model", "/no/model"], "--model '/no/model': /no/model: no such file or directory"),
    ("kivi_window_attend_parts", ["/no/model", "--rounds", "2"], "--rounds 2: must be at least 3"),
    ("kivi_window_attend_parts", ["/no/model", "--policy", "int4"],
     "--policy 'int4': not a KIVI policy (rotated) under a StreamingLLM window"),
    ("kivi_window_attend_parts", ["/no/model"], "model /no/model: no such file or directory"),
    ("kivi_window_attend_parts", ["/no/model", "--peer-window", "0"], "--peer-window 0: must be at least 1"),
    ("retrieval_bench", ["/no/model", "--index-expand", "0"], "--index-expand 0: must be an integer >= 1, got 0"),
    ("retrieval_bench", ["/no/model", "--summary", "bogus"],
     "--summary 'bogus': must be one of minmax, mean, hybrid, got 'bogus'"),
    ("coarse_scan", ["--top-pages", "2"], "--top-pages 2: give at least 32 (4 spans of 8 pages, what a query picks)"),
    ("coarse_scan", ["--top-pages", "5"], "--top-pages 5: give at least 32 (4 spans of 8 pages, what a query picks)"),
    ("pool_attention_parts", ["--reps", "0"], "--reps 0: give at least 1"),
    ("pool_attention_parts", ["--chunk", "4"], "--chunk 4: give at least 8"),
    ("bench_server_load", ["/no/model", "--start-timeout", "0"], "--start-timeout must be more than 0 seconds, got 0"),
    ("bench_server_load", ["/no/model", "--start-timeout", "nan"], "--start-timeout must be more than 0 seconds, got nan"),
    ("bench_server_load", ["/no/model", "--request-timeout", "-5"],
     "--request-timeout must be more than 0 seconds, got -5"),
    ("bench_server_load", ["/no/model", "--rounds", "1"], "--rounds must be at least 2, got 1"),
    ("bench_server_load", ["/no/model", "--cancel", "1.5"], "--cancel must be between 0 and 1, got 1.5"),
    ("bench_server_load", ["/no/model"], "model /no/model: no such file or directory"),
    ("prefill_head_ab", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("prefill_head_ab", ["--tokens", "1"], "--tokens must be at least 2, got 1"),
    ("prefill_head_ab", ["--policies", "fp32,bogus"], "--policies 'bogus': policy 'bogus': unknown part 'bogus' (parts such as int8, int4, k8v4, "
     "sink4/window256, sink4/hot1024, joined by '+')"),
    ("prefill_head_ab", ["--model", "/no/model"], "--model '/no/model': /no/model: no such file or directory"),
    ("gguf_memory_stages", ["/no/model"], "model /no/model: no such file or directory"),
    ("gguf_memory_stages", ["README.md"], "model README.md: not a GGUF file"),
    ("gguf_memory_stages", ["README.md", "--tokens", "0"], "--tokens must be at least 1, got 0"),
    ("gguf_memory_stages", ["README.md", "--parts", "stages,bogus"],
     "--parts 'stages,bogus': expected some of stages,parse,sample"),
    ("startup_split", ["/no/model"], "model /no/model: no such file or directory"),
    ("startup_split", ["README.md"], "model README.md: not a GGUF file"),
    ("startup_split", ["README.md", "--order", "cold,hot"], "--order 'cold,hot': expected cold or warm, comma-separated"),
    ("startup_split", ["README.md", "--order", ""], "--order '': expected cold or warm, comma-separated"),
    ("startup_split", ["README.md", "--order", "warm,cold"],
     "--order 'warm,cold': the first run must be cold (the warm runs read the entry it writes)"),
    ("startup_split", ["README.md", "--prompt", ""], "--prompt: empty"),
    ("startup_split", ["README.md", "--json", "/no/dir/split.json"], "--json /no/dir/split.json: no such directory /no/dir"),
])
@pytest.mark.slow
def test_benchmarks_refuse_bad_arguments(module, args, says, capfd, monkeypatch):
    returncode, stdout, stderr = run_as_main(module, args, capfd, monkeypatch)
    assert returncode == 2 and stdout == ""
    assert stderr.strip().splitlines()[-1] == f"{module}.py: error: {says}"
    assert "Traceback" not in stderr


def benchmark_env() -> dict:
    """This environment with the system's OpenBLAS preloaded where `posttrainllm` would preload one
    (tinygpt_mlx/blas.py's plan; none found or turned off: unchanged), as the docs run the
    benchmarks (`LD_PRELOAD=... python -m benchmarks.NAME`). On MLX's reference BLAS these short
    runs' prefills took most of their time."""
    from tinygpt_mlx import blas

    library = blas.plan(["benchmark"], os.environ, sys.platform).library
    return blas.preload_environ(os.environ, library) if library else dict(os.environ)


@pytest.mark.slow
def test_rope_products_ab_writes_its_command_and_load(tmp_path):
    """benchmarks/rope_products_ab.py's JSON says how it was run (docs cite it: the command, the
    LD_PRELOAD, the load average at its start and end) beside its rows (a short run on the shipped
    model: one round, a 1,100-token prompt)."""
    out = tmp_path / "ab.json"
    args = ["--prompt", "1100", "--context", "1100", "--rounds", "1", "--json", str(out)]
    env = benchmark_env()
    r = subprocess.run([sys.executable, "-m", "benchmarks.rope_products_ab", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["command"] == " ".join(["python -m benchmarks.rope_products_ab", *args])
    assert "LD_PRELOAD" in got and got["LD_PRELOAD"] == env.get("LD_PRELOAD")
    for key in ("load_average_at_start", "load_average_at_end"):
        assert len(got[key]) == 3 and all(x >= 0 for x in got[key])
    assert [row["cache"] for row in got["rows"]] == ["fp32", "products", "rope"]


@pytest.mark.slow
def test_prefill_head_ab_times_both_heads_and_they_agree(tmp_path):
    """benchmarks/prefill_head_ab.py (docs/gguf.md's prefill numbers) times each policy both ways
    and says the logits after the prompt agree (a short run on the shipped model)."""
    out = tmp_path / "head.json"
    args = ["--tokens", "300", "--chunk", "128", "--rounds", "1", "--policies", "fp32,sink4/window64", "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "benchmarks.prefill_head_ab", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=benchmark_env())
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["command"] == " ".join(["python -m benchmarks.prefill_head_ab", *args])
    assert [row["policy"] for row in got["rows"]] == ["fp32", "sink4/window64"]
    for row in got["rows"]:
        assert len(row["seconds_last"]) == len(row["seconds_whole"]) == 2
        assert 0 <= row["max_logit_difference"] < 1e-4
        assert row["median_ratio"] > 0


@pytest.mark.slow
def test_kivi_window_attend_parts_writes_its_json_and_its_candidates_agree(tmp_path):
    """benchmarks/kivi_window_attend_parts.py writes its JSON (its --json once reached
    `write_atomic` as a str and failed there, after the timing) with each part's kernels per
    layer, and every candidate evaluation of the int4 window's attention it times computes what
    the step's own `_TracedKivi.attend` does (largest difference below 1e-5 on the shipped model:
    a candidate is timed only as a replacement of that path); the addmm candidate, compiled,
    runs fewer kernels per layer than ours."""
    out = tmp_path / "parts.json"
    args = [str(ROOT / "models" / "tinygpt-base.tinygpt"), "--context", "1024", "--rounds", "3", "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "benchmarks.kivi_window_attend_parts", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=benchmark_env())
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["command"] == " ".join(["python -m benchmarks.kivi_window_attend_parts", *args])
    diffs = got["variant_max_abs_difference"]
    assert len(diffs) == 7 and all(0 <= d < 1e-5 for d in diffs.values()), diffs
    kernels = {name: row["kernels_per_layer"]["compiled"] for name, row in got["parts"].items()}
    assert kernels["variant: scale in the mask's select, outputs summed by addmm"] < kernels[
        "ours: the whole attention (_TracedKivi.attend)"]


@pytest.mark.slow
def test_idle_release_names_a_bad_model_its_mode_process_met(tmp_path):
    """benchmarks/idle_release.py runs each mode in a process of its own: a path that exists but
    holds no model fails there, and the parent says so in one line naming the path (it used to end
    in a CalledProcessError traceback, the child's reason captured and dropped)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.idle_release", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("idle_release.py: error: the release-off run failed: ") and f"{tmp_path}: not a model" in last


def test_every_named_module_and_script_exists():
    """Each `python -m benchmarks.NAME`, `benchmarks/NAME` and `scripts/NAME` that README.md, a page
    of docs/ or the results index names is there (measurement code in benchmarks/, tools in scripts/)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "results" / "README.md"]
    named = set()
    for page in pages:
        text = page.read_text(encoding="utf-8")
        named |= {f"benchmarks/{m}.py" for m in re.findall(r"python -m benchmarks\.([a-z0-9_]+)\b", text)}
        named |= set(re.findall(r"\b(?:benchmarks|scripts)/[a-z0-9_]+\.(?:py|sh)\b", text))
    assert "benchmarks/decode_costs.py" in named and "scripts/fetch_corpus.sh" in named   # the grep works
    assert not [n for n in named if not (ROOT / n).is_file()]


def test_bench_server_ttft_builds_the_tests_tiny_model(tmp_path):
    """benchmarks/bench_server_ttft.py keeps its own copy of conftest's tokenizer and model
    builder (benchmarks import no tests.*): the same tokenizer and the same weights, byte for byte."""
    from benchmarks import bench_server_ttft as b
    from tests import conftest

    assert b.TOKENIZER_TEXT == conftest.TEXT
    tok = conftest.train_tokenizer().to_str()
    assert b.train_tokenizer().to_str() == tok
    ours = b.build_native(tmp_path / "b.tinygpt", tok, seed=3)
    theirs = conftest.build_native(tmp_path / "t.tinygpt", tok, seed=3)
    assert Path(ours).read_bytes() == Path(theirs).read_bytes()
