"""What the evaluation commands read and need: text files with clear errors, the shipped
held-out text, and the plotting extra checked before any work.

`HELDOUT_KJV` (tinygpt_mlx/data/heldout_kjv.txt, ~89 KB) is the last 2% of the lines of the
King James Bible (2 Peter 1:10 to Revelation 22:21; public domain, Debian `bible-kjv`),
processed exactly as `scripts/fetch_corpus.sh` does: the shipped model never trained on it.
`scripts/fetch_corpus.sh --shipped-heldout` regenerates it byte for byte. It is the default
`needle --filler` and `perplexity --text`, so both run on a fresh install; the full held-out
split of all three sources (`data/heldout.txt`, which the numbers in docs/ used) is written by
`scripts/fetch_corpus.sh`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Union

from ..errors import PosttrainError

HELDOUT_KJV = Path(str(resources.files("tinygpt_mlx") / "data" / "heldout_kjv.txt"))
#: The full held-out split (KJV + fortunes + GCIDE), relative to the repository root.
CORPUS_HELDOUT = Path("data") / "heldout.txt"
FETCH_HINT = "run scripts/fetch_corpus.sh: it writes data/heldout.txt and data/corpus/"
PLOT_EXTRA = "pip install 'posttrainllm[plot]'"


def missing_hint(path: Union[str, Path]) -> str:
    """How to get a missing text file: the corpus files come from scripts/fetch_corpus.sh."""
    p = Path(path)
    if p.name == "heldout.txt" or "corpus" in p.parts or (p.parts and p.parts[0] == "data"):
        return f" ({FETCH_HINT})"
    return ""


def missing_message(path: Union[str, Path]) -> str:
    return f"{path}: no such file{missing_hint(path)}"


def read_text(path: Union[str, Path]) -> str:
    """A UTF-8 text file, or one clear error naming the file: missing (FileNotFoundError, with
    how to get the corpus files), a folder, unreadable, or not UTF-8 (ValueError)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(missing_message(p)) from None
    except IsADirectoryError:
        raise ValueError(f"{p}: is a directory, not a text file") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def require_plotting(flag: str = "--plot") -> None:
    """Raise (one line, naming the extra) unless matplotlib imports: checked before any work."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        raise PosttrainError(f"{flag} needs matplotlib: {PLOT_EXTRA}") from None
