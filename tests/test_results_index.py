"""docs/results/ has an index (docs/results/README.md, by scripts/results_index.py) that is
current, and every result in it is cited by a page."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_results_index_is_current_and_every_result_is_cited():
    r = subprocess.run([sys.executable, "scripts/results_index.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
