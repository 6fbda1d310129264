"""A wheel that works (`pip install .`, `pipx install .`, `uv tool install .` all install the
wheel, not the source tree): built here without build isolation, installed without
dependencies into a folder of its own, it carries the shipped default model and the data files,
and its `posttrainllm sample` runs from there with no source tree in reach."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_carries_the_default_model_and_runs(tmp_path):
    # a copy without build outputs: setuptools builds in the tree and never empties build/
    src = tmp_path / "src"
    skip = {".git", ".venv", "build", "runs", "data", "docs", ".pytest_cache", "posttrainllm.egg-info"}
    shutil.copytree(ROOT, src, symlinks=True, ignore=lambda where, names: [
        n for n in names if n == "__pycache__" or (Path(where) == ROOT and n in skip)])
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("posttrainllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("tinygpt_mlx/models/tinygpt-base.tinygpt", "tinygpt_mlx/data/heldout_kjv.txt",
                    "tinygpt_mlx/data/prompts.txt"):
        assert shipped in names, shipped
    assert not any(n.startswith(("tests/", "scripts/", "benchmarks/", "docs/")) for n in names)

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    code = ("import sys, tinygpt_mlx\n"
            "assert tinygpt_mlx.__file__.startswith(sys.argv[1]), tinygpt_mlx.__file__\n"
            "sys.argv = ['posttrainllm', 'sample', '-p', 'And God said', '-n', '8', '--temperature', '0']\n"
            "from tinygpt_mlx.cli.main import app\napp()")
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tinygpt-base" in run.stderr and run.stdout.strip()
