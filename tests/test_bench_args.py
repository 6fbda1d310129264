"""benchmarks/_args.py: the argument checks the benchmarks share (one `at_least` for the
`--flag must be at least N, got V` refusals batch_rows, batch_ab and kivi_joins each wrote out)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks._args import at_least
from tests.test_scripts import run_as_main

ROOT = Path(__file__).resolve().parents[1]


def test_at_least_refuses_the_first_value_below_its_least(capsys):
    ap = argparse.ArgumentParser(prog="b.py")
    at_least(ap, ("--rows", 2, 2), ("--warm", 0, 0))      # each at its least: nothing said
    with pytest.raises(SystemExit) as e:
        at_least(ap, ("--rows", 2, 2), ("--steps", 0, 1), ("--rounds", -1, 1))
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "b.py: error: --steps must be at least 1, got 0"


@pytest.mark.parametrize("module", ["batch_rows", "batch_ab", "kivi_joins"])
def test_benchmarks_check_their_counts_with_at_least(module):
    """One check, not three copies of its loop (`duplicates --change` found them)."""
    text = (ROOT / "benchmarks" / f"{module}.py").read_text()
    assert "at_least(ap, " in text and "must be at least" not in text


@pytest.mark.slow
@pytest.mark.parametrize("module, args, says", [
    ("batch_rows", ["/no/model", "--warm-slot", "-1"], "--warm-slot must be at least 0, got -1"),
    ("batch_ab", ["/no/model", "--before", "/no/tree", "--rows", "0"], "--rows must be at least 1, got 0"),
    ("kivi_joins", ["/no/model", "--whole", "-1"], "--whole must be at least 0, got -1"),
])
def test_their_messages_and_exit_are_kept(module, args, says, capfd, monkeypatch):
    returncode, stdout, stderr = run_as_main(module, args, capfd, monkeypatch)
    assert returncode == 2 and stdout == ""
    assert stderr.strip().splitlines()[-1] == f"{module}.py: error: {says}"
