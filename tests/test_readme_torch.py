"""README says how to get PyTorch's CPU build for the `train` and `dev` extras: plain PyPI's
`torch==2.13.0` on Linux is the CUDA build (526.6 MB wheel, 2026-12-07), where README said
"PyTorch (CPU)"."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def test_readme_names_the_cpu_index_for_the_pinned_torch():
    readme = (ROOT / "README.md").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {extra: [r for r in extras[extra] if r.startswith("torch")] for extra in ("train", "dev")}
    assert pins["train"] == pins["dev"] and len(pins["train"]) == 1
    version = pins["train"][0].split("==")[1]
    assert f'pip install -e ".[train]" {CPU_INDEX}' in readme
    assert f"torch=={version}" in readme and f"{version}+cpu" in readme
    # the extras table no longer promises a CPU build that plain PyPI does not give on Linux
    row = next(line for line in readme.splitlines() if line.startswith('| `pip install -e ".[train]"`'))
    assert "(CPU)" not in row and re.search(r"PyTorch \d", row)
