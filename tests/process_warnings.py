"""The warnings a command run in pytest's process would have printed on stderr as a process.

A test that runs the CLI in pytest's process (typer's CliRunner) instead of a subprocess does not
see Python warnings in the command's stderr: pytest records every warning itself, so a
`UserWarning` that a user's run prints above the one error line never reaches `r.stderr`, and a
"one line on stderr" test passes where the process would print three. `as_a_process()` records
them under the interpreter's default filters (no -W, no PYTHONWARNINGS): what a process prints."""

from __future__ import annotations

import contextlib
import warnings

from typer.testing import CliRunner

from tinygpt_mlx.cli.main import app


@contextlib.contextmanager
def as_a_process():
    """Yields the list of warnings the block raised that a process would have printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        # Python's default filters, first match wins (each call below goes in front of the last)
        warnings.simplefilter("default")
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        yield caught


def printed(caught) -> list[str]:
    """The lines a process would have printed for `caught` (for an assertion's message)."""
    return [warnings.formatwarning(w.message, w.category, w.filename, w.lineno).rstrip() for w in caught]


def invoke(args):
    """`posttrainllm ARGS` in pytest's process (typer's CliRunner, stderr apart) checked as a
    process would be seen: no warning it would have printed, and no exception but the CLI's own
    exit (anything else would be a traceback in a real run). Returns the result."""
    with as_a_process() as shown:     # a process prints them on stderr; pytest keeps them
        r = CliRunner().invoke(app, [str(a) for a in args])
    assert not shown, printed(shown)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r
