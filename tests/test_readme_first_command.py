"""README's first command prints what README says it prints.

The command is read from README's first ```bash block (the line CI runs), the expected output
from the ```text block after it. The generated text and the banner must match exactly; the
report must match except for the speeds and the peak RSS, which vary from run to run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks(kind: str) -> list[list[str]]:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    out, cur = [], None
    for line in lines:
        if cur is None and line.strip() == f"```{kind}":
            cur = []
        elif cur is not None and line.strip() == "```":
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def first_command_args() -> list[str]:
    command = next(line for line in _blocks("bash")[0] if line.strip() and not line.startswith("#"))
    tail = command.split("posttrainllm ", 1)[1]  # after the set-up steps, the CLI call itself
    return shlex.split(tail)


def _steady(lines: list[str]) -> list[str]:
    """The report without the note a machine's first run adds (MLX compiling its CPU kernels,
    tinygpt_mlx/kernel_cache.py; README says so under the block)."""
    return [line for line in lines if not line.startswith("note: MLX compiled ")]


def _variable(line: str) -> str:
    line = re.sub(r"[\d.]+ tok/s", "N tok/s", line)
    return re.sub(r"peak RSS [\d.]+ \w+", "peak RSS N", line)


@pytest.mark.slow
def test_readme_first_command_prints_what_readme_shows():
    args = first_command_args()
    assert args[0] == "sample" and "--seed" in args, "README's command must be reproducible (--seed)"
    shown = _blocks("text")[0]
    blank = shown.index("")
    banner, text, report = shown[:3], shown[3:blank], shown[blank + 1:]
    run = subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n").split("\n") == text
    err = [line for line in run.stderr.splitlines()]
    assert err[:3] == banner
    got_report = [_variable(line) for line in _steady(err[err.index("") + 1:])]
    assert got_report == [_variable(line) for line in report]
