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


def test_a_command_is_shown_for_the_result_it_names_not_for_a_longer_name():
    """A result's command names it; one that writes a longer name of the same start
    (`..._448_compiled_r1.json` for `..._448.json`) is not its command (the index showed such
    commands for seven results)."""
    ri = script_module("results_index")
    cmd = "posttrainllm bench --json docs/results/bench_positions_448_compiled_r1.json # then _r2"
    assert ri._names(cmd, "bench_positions_448_compiled_r1.json")
    assert not ri._names(cmd, "bench_positions_448.json")
    assert ri._names("posttrainllm bench --json docs/results/bench_positions_448.json", "bench_positions_448.json")
    assert ri._names("python x.py --out docs/results/bench_positions_448 --plot", "bench_positions_448.png")
