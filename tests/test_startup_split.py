"""benchmarks/startup_split.py (docs/gguf.md, "Start-up: the tokenizer converted once"): a run on a
tiny GGUF gives every part of the split, in a fresh process, with how it was run; warm runs need an
entry the first cold run wrote, and a vocabulary the tokenizer cache does not keep on disk is one
line, not warm runs that were cold ones. (Bad arguments: tests/test_scripts.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_llama_dir
from tests.gguf_writer import write_gguf

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer_json) -> Path:
    root = tmp_path_factory.mktemp("split")
    return write_gguf(build_llama_dir(root / "src", tokenizer_json), root / "tiny.gguf", "llama")


def split(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.startup_split", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_cold_run_gives_each_part_of_the_split(tiny_gguf, tmp_path):
    out = tmp_path / "split.json"
    r = split(str(tiny_gguf), "--order", "cold", "--json", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["command"] == f"python -m benchmarks.startup_split {tiny_gguf} --order cold --json {out}"
    assert len(got["load_average_at_start"]) == 3 and len(got["load_average_at_end"]) == 3
    (run,) = got["models"]["tiny.gguf"]["runs"]
    assert run["kind"] == "cold" and run["text"]
    for part in ("imports_s", "tokenizer_s", "weights_s", "first_forward_s"):
        assert run[part] > 0, part
    # the parts lie inside the time to the first token, inside the process's wall time
    assert run["imports_s"] + run["tokenizer_s"] + run["weights_s"] + run["first_forward_s"] <= run["to_first_token_s"]
    assert run["to_first_token_s"] < run["wall_s"] and run["cpu_user_s"] > 0 and run["peak_rss_kb"] > 0
    assert got["models"]["tiny.gguf"]["means"]["cold"]["tokenizer_s"] == run["tokenizer_s"]


@pytest.mark.slow
def test_warm_runs_of_a_vocabulary_kept_off_the_disk_are_refused(tiny_gguf):
    r = split(str(tiny_gguf), "--order", "cold,warm")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        f"{tiny_gguf}: the cold run wrote no tokenizer cache entry (a vocabulary under the cache's "
        f"MIN_TOKENS?): its warm runs would be cold ones")
