"""A report says when its speeds include MLX compiling CPU kernels (tinygpt_mlx/kernel_cache.py).

MLX's CPU backend builds each compiled graph with the system's compiler the first time a machine
sees it and keeps the library under $TMPDIR/mlx/<version>/cpu. The README's first command on a
fresh machine decoded at ~8 tok/s against ~150 the run after, and said nothing about why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tinygpt_mlx import kernel_cache
from tinygpt_mlx.cli.sample import kernels_note
from tinygpt_mlx.generate import GenerationStats

ROOT = Path(__file__).resolve().parents[1]


def test_count_reads_only_built_libraries(tmp_path):
    assert kernel_cache.count(tmp_path / "absent") == 0
    for name in ("a.so", "a.cpp", "b.so", "notes.txt"):
        (tmp_path / name).write_text("")
    assert kernel_cache.count(tmp_path) == 2
    assert kernel_cache.built(2, 5) == 3 and kernel_cache.built(5, 2) == 0
    assert kernel_cache.built(None, 4) == 0 and kernel_cache.built(4, None) == 0


def test_folder_is_mlx_cpu_folder_under_the_temp_dir(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert kernel_cache.folder() == tmp_path / "mlx" / mx.__version__ / "cpu"
    monkeypatch.setattr(kernel_cache.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert kernel_cache.folder() is None and kernel_cache.count() is None


def test_stats_split_the_kernels_between_prefill_and_decode(monkeypatch):
    stats = GenerationStats()
    assert stats.kernels_built() == {"prefill": 0, "decode": 0}      # no generation ran
    stats.kernels_at_start, stats.kernels_after_prefill = 3, 5
    monkeypatch.setattr(kernel_cache, "count", lambda where=None: 12)
    assert stats.kernels_built() == {"prefill": 2, "decode": 7}
    stats.kernels_at_start = stats.kernels_after_prefill = None       # off the CPU
    monkeypatch.setattr(kernel_cache, "count", lambda where=None: None)
    assert stats.kernels_built() == {"prefill": 0, "decode": 0}


def test_note_names_the_count_the_phases_and_the_folder(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert kernels_note({"prefill": 0, "decode": 0}) == "" and kernels_note({}) == ""
    line = kernels_note({"prefill": 1, "decode": 11})
    assert line.startswith("MLX compiled 12 CPU kernels for this run (1 during the prefill and 11 during the decode)")
    assert str(tmp_path / "mlx") in line and "speeds above include compiling" in line
    assert "1 CPU kernel for this run (1 during the decode) and keeps it" in kernels_note({"decode": 1})


def test_a_chat_turn_says_it_compiled():
    from tinygpt_mlx.chat import Turn
    from tinygpt_mlx.cli.chat import turn_line
    turn = Turn(index=1, rule="full", new_tokens=14, generated=60, finish_reason="length", decode_seconds=11.0)
    assert "5.5 tok/s (with MLX compiling 11 CPU kernels, kept for later turns and runs)" in turn_line(
        Turn(**{**turn.__dict__, "kernels_built": 11}))
    assert "compiling" not in turn_line(turn)


def _sample(tmpdir: Path, report: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    return subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", "sample", "--prompt", "And God said",
                           "--tokens", "4", "--seed", "0", "--report-json", str(report)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_first_run_says_it_compiled_and_a_second_does_not(tmp_path):
    """Two runs of one command against an empty kernel folder: the first compiles (the note, the
    JSON's count equal to the libraries now in the folder), the second reuses them (neither)."""
    first = _sample(tmp_path, tmp_path / "first.json")
    assert first.returncode == 0, first.stderr
    built = json.loads((tmp_path / "first.json").read_text())["kernels_built"]
    libraries = kernel_cache.count(tmp_path / "mlx" / mx.__version__ / "cpu")
    assert libraries >= 1 and sum(built.values()) == libraries
    assert f"note: MLX compiled {libraries} CPU kernel" in first.stderr
    second = _sample(tmp_path, tmp_path / "second.json")
    assert second.returncode == 0, second.stderr
    assert json.loads((tmp_path / "second.json").read_text())["kernels_built"] == {"prefill": 0, "decode": 0}
    assert "MLX compiled" not in second.stderr
    assert first.stdout == second.stdout          # the same text either way


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
