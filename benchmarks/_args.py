"""Command-line arguments shared by the benchmarks in this package."""

from __future__ import annotations

import argparse


def token_counts(ap: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """`text`, a comma list of token counts given as `flag`, as ints; else one line naming what
    the user typed (`ap.error`: exit 2)."""
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        ap.error(f"{flag} {text!r}: give a comma list of token counts")
