"""A test module whose work is a real model's forward passes runs under OpenBLAS, as
`posttrainllm` runs itself (tinygpt_mlx/blas.py), in a pytest process of its own.

The suite itself multiplies with MLX's reference BLAS on Linux: its exactness tests (a batched
step equal to each sequence alone bit for bit, chunked prefill equal to uncached) hold there and
not under OpenBLAS, whose kernels differ by shape. A real model's tests on the reference BLAS
spend most of their time in it: one Gemma 3 needle cell of 800 tokens took 586 s in process
against 25 s through OpenBLAS on the same machine. So such a module calls `under_openblas` from
a test of its own and skips its other tests in this process (`elsewhere()`); on a machine
without OpenBLAS, or with POSTTRAINLLM_NO_BLAS_PRELOAD set, they run here as before."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tinygpt_mlx import blas

ROOT = Path(__file__).resolve().parent.parent


def library() -> str | None:
    """The OpenBLAS a module's own pytest process would preload, or None (this process has one
    already, none is found, it is turned off, or not Linux)."""
    if blas.loaded_openblas() is not None:
        return None
    return blas.plan(["pytest"], os.environ, sys.platform).library


def elsewhere() -> bool:
    """Whether this process leaves a real model's tests to a process of their own."""
    return library() is not None


#: the reason `under_openblas` skips with in a process that has OpenBLAS: the inner run's own
#: skip of the module's wrapper test, which is not one of the module's tests
HERE = "this process multiplies with OpenBLAS, or none is found: the module's tests run here"


def under_openblas(module: str, timeout: float = 3600) -> None:
    """Run the tests of `module` (a path under tests/) in a pytest process with OpenBLAS
    preloaded; fail with its output's tail when any of them fails, or when it collected none
    (besides the wrapper test); skip, with the inner skip reasons, when it ran none (every one
    skipped: the real model missing, say), instead of passing for tests that did not run."""
    lib = library()
    if lib is None:
        pytest.skip(HERE)
    with tempfile.TemporaryDirectory(prefix="openblas-") as tmp:
        report = Path(tmp) / "inner.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", module, "-p", "no:cacheprovider", "-rs",
                              f"--junitxml={report}"],
                             cwd=ROOT, env=blas.preload_environ(os.environ, lib), capture_output=True,
                             text=True, timeout=timeout)
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-60:])
        assert run.returncode != pytest.ExitCode.NO_TESTS_COLLECTED, \
            f"{module} under OpenBLAS ({lib}) collected no tests:\n{tail}"
        assert run.returncode == 0, f"{module} under OpenBLAS ({lib}) failed:\n{tail}"
        ran, skipped = _outcomes(report)
    assert ran or skipped, f"{module} under OpenBLAS ({lib}) collected no tests but its wrapper:\n{tail}"
    print(tail)
    if not ran:
        pytest.skip(f"{module} under OpenBLAS ran none of its {len(skipped)} tests: "
                    + "; ".join(sorted(set(skipped))))


def _outcomes(report: Path) -> tuple[int, list[str]]:
    """(tests that ran, the skip reasons of those that did not) in a pytest JUnit XML report,
    leaving out the module's wrapper test (skipped inside with HERE)."""
    ran, skipped = 0, []
    for case in ET.parse(report).iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            ran += 1
        elif HERE not in skip.get("message", ""):
            skipped.append(skip.get("message", "").strip() or "(no reason given)")
    return ran, skipped
