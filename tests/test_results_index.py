"""docs/results/ has an index (docs/results/README.md, by scripts/results_index.py) that is
current, and every result in it is cited by a page."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parent.parent


def test_results_index_is_current_and_every_result_is_cited():
    r = subprocess.run([sys.executable, "scripts/results_index.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_benchmark_module_commands_are_read():
    """`python -m benchmarks.NAME` commands (with VAR=value before them) are commands the index shows."""
    ri = script_module("results_index")
    page = ("Measured (`LD_PRELOAD=x.so python -m benchmarks.decode_costs --json docs/results/a.json`).\n"
            "```bash\npython -m benchmarks.bench_step \\\n  --json docs/results/b.json\n```\n")
    assert sorted(ri._commands(page)) == ["LD_PRELOAD=x.so python -m benchmarks.decode_costs --json docs/results/a.json",
                                          "python -m benchmarks.bench_step --json docs/results/b.json"]
