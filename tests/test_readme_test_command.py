"""README's test command (the second line of its first ```bash block, which `.ci/run` runs) runs
the suite on two pytest-xdist workers, so the `[dev]` extra it installs must bring pytest-xdist:
on a fresh machine `pip install -e ".[dev]"` is all the set-up there is (docs/testing.md)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(text: str) -> list[str]:
    """The non-comment lines of the first ```bash block, as `.ci/run` reads them."""
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def xdist_pin() -> str | None:
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pins = [r for r in dev if re.match(r"pytest-xdist\b", r)]
    assert len(pins) <= 1, pins
    return pins[0] if pins else None


def test_the_test_command_installs_what_its_workers_need():
    main_job, tests = readme_commands((ROOT / "README.md").read_text())[:2]
    parts = [shlex.split(p) for p in tests.split("&&")]
    assert ["pip", "install", "-e", ".[dev]"] in parts, tests
    pytest_args = next(p for p in parts if p[:3] == ["python", "-m", "pytest"])
    if "-n" in pytest_args:
        pin = xdist_pin()
        assert pin is not None and re.fullmatch(r"pytest-xdist==[\d.]+", pin), \
            f"README's test command runs `{shlex.join(pytest_args)}`; [dev] must pin pytest-xdist (has {pin})"
        # tests/test_distributed.py's module-scoped two-rank runs are made once: one file, one worker
        assert "--dist" in pytest_args and pytest_args[pytest_args.index("--dist") + 1] == "loadfile", pytest_args


def test_an_installed_xdist_is_the_pinned_one():
    pin = xdist_pin()
    try:
        installed = importlib.metadata.version("pytest-xdist")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pytest-xdist is not installed (a venv set up before the pin): `python -m pytest` runs serially")
    assert pin is None or pin == f"pytest-xdist=={installed}", (pin, installed)
