"""Command-line arguments shared by the benchmarks in this package."""

from __future__ import annotations

import argparse
from pathlib import Path


def token_counts(ap: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """`text`, a comma list of token counts given as `flag`, as ints; else one line naming what
    the user typed (`ap.error`: exit 2)."""
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        ap.error(f"{flag} {text!r}: give a comma list of token counts")


def at_least(ap: argparse.ArgumentParser, *checks: tuple) -> None:
    """Each (flag, value, least) with value < least: one line naming the flag, its least and what
    the user gave (`ap.error`: exit 2), the first that fails."""
    for name, value, least in checks:
        if value < least:
            ap.error(f"{name} must be at least {least}, got {value}")


def model_or_exit(ap: argparse.ArgumentParser, name):
    """The model `name` (a path or name `load_model` takes; None: the shipped model) loaded, its
    `.model`; else one line naming what the user typed (`ap.error`: exit 2)."""
    from tinygpt_mlx.cli.common import load_model
    from tinygpt_mlx.errors import PosttrainError

    try:
        return load_model(name).model
    except (OSError, ValueError, PosttrainError) as e:
        ap.error(f"--model {name!r}: {e}")


def gguf_files(ap: argparse.ArgumentParser, models: list[str]) -> list[str]:
    """`models`, each a GGUF file (its first four bytes `GGUF`), as resolved paths; else one line
    naming the first that is missing or is not one (`ap.error`: exit 2)."""
    for m in models:
        path = Path(m).expanduser()
        if not path.exists():
            ap.error(f"model {m}: no such file or directory")
        if path.is_dir():
            ap.error(f"model {m}: not a GGUF file")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                ap.error(f"model {m}: not a GGUF file")
    return [str(Path(m).expanduser().resolve()) for m in models]
