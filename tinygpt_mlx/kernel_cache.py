"""MLX's on-disk cache of compiled CPU kernels, counted so that a report can say when its speeds
include compiling them.

On its CPU backend (Linux, and a Mac told to use the CPU) MLX turns each fused graph of a compiled
function (`mx.compile`: our decode steps, the quantised and windowed attention) into C++, builds it
with the system's compiler the first time the machine sees that graph, and keeps the shared
library under `<temp dir>/mlx/<MLX version>/cpu` for every later run. So the first run of a policy
on a fresh machine spends seconds in the compiler inside its prefill and decode: the README's
first command (int8 + StreamingLLM on the shipped model) built 12 kernels and decoded 120 tokens at
8.1-8.5 tok/s against 146-165 tok/s the runs after (2026-12-07, this machine; a full cache
builds 1, int8 on 40 tokens 1: its packing starts past the residual). The count of
libraries in that folder before and after a phase says whether it happened (another MLX process
compiling at the same time is counted too). On Metal or CUDA there is no such folder: `count`
is None and nothing is said.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx


def folder() -> Optional[Path]:
    """Where MLX keeps the CPU kernels it builds (std::filesystem::temp_directory_path, i.e.
    $TMPDIR or /tmp, then mlx/<version>/cpu), or None when the default device is not the CPU."""
    if mx.default_device() != mx.cpu:
        return None
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def count(where: Optional[Path] = None) -> Optional[int]:
    """How many built kernels the folder holds (0 when it does not exist yet); None off the CPU.
    One directory listing: for the start and end of a phase, never per token."""
    where = folder() if where is None else where
    if where is None:
        return None
    try:
        with os.scandir(where) as entries:
            return sum(1 for e in entries if e.name.endswith(".so"))
    except OSError:
        return 0


def built(before: Optional[int], after: Optional[int]) -> int:
    """Kernels built between two counts (0 off the CPU)."""
    return max(0, after - before) if before is not None and after is not None else 0
