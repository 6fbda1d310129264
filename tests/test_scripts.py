"""Measurement scripts refuse bad arguments before any work: exit 2, the flag and the value named
in the last line (argparse's usage line above it)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args, says", [
    (["--context", "33"], "--context must be a positive multiple of 32, got 33"),
    (["--steps", "3"], "--steps must be at least 10, got 3"),
    (["--model", "/no/such/model.tinygpt"], "--model /no/such/model.tinygpt: no such file or directory"),
    (["--parts", "kernels,speed"], "--parts 'kernels,speed': expected some of attention,python,kernels,far,retrieval"),
    (["--retrieval-context", "100"], "--retrieval-context must be at least 512, got 100"),
])
def test_decode_costs_refuses_bad_arguments(args, says):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_costs.py"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == f"decode_costs.py: error: {says}"
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("script, args, says", [
    ("needle_step_probe.py", ["--policies", "sink4/hot256+expand0"],
     "--policies: policy 'sink4/hot256+expand0': index_expand must be an integer >= 1, got 0"),
    ("chat_reach_grid.py", ["--policies", "retrieval,foo"],
     "--policies 'retrieval,foo': unknown foo (choose from full cache, streaming, retrieval)"),
])
def test_retrieval_probes_refuse_bad_policies(script, args, says):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == f"{script}: error: {says}"
    assert "Traceback" not in r.stderr
