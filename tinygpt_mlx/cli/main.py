"""The `posttrainllm` app: composes one typer module per command.

Imports: every import is at the top of its module. A command module imports light modules
(typer, rich, the configs, `tinygpt_mlx.evaluate.defaults`) as usual and declares the library
proper (`loading`, `generate`, `cache`, the evaluation modules) there too, to load on first use
(`caches = lazy("tinygpt_mlx.cache")`, tinygpt_mlx/lazy.py): mlx-lm's package imports
transformers (and torch where installed), seconds of start-up that `posttrainllm --help`, a typo
or a bad flag should not pay. tests/test_cli_imports.py keeps it so, and checks that every lazy
module imports and has each name read through it.

Help is click's plain layout (flags shown as flags; rich's panels mis-render them with the
click this project pins against), the cache flags grouped by the part of the policy they set
(`PanelledHelp`), and every usage error is one line on stderr:
`error: Invalid value for '--tokens' / '-n': ...`, exit code 2.

On Linux the command first re-executes itself once with the system's OpenBLAS preloaded, before
anything here imports MLX (tinygpt_mlx/blas.py), and keeps MLX's large temporaries on glibc's
heap instead of a fresh mmap each (tinygpt_mlx/heap.py); a program or a test importing this
module never.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
from importlib import metadata
from pathlib import Path
from typing import Annotated

from tinygpt_mlx import blas, heap, switches


def refuse_bad_switches(environ=os.environ) -> None:
    """An environment switch set to a value it does not take (tinygpt_mlx/switches.py): one
    `error:` line naming the variable and the value, exit code 2, before any work."""
    bad = switches.problem(environ)
    if bad is not None:
        sys.stderr.write(f"error: {bad}\n")
        sys.exit(2)


def interrupted_while_starting(signum, frame) -> None:
    """A Ctrl-C while the command's modules import (about half a second, before `guarded` or
    click can catch one): `interrupted`, exit code 130, as a Ctrl-C later says it (no traceback)."""
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)


if blas.started_as_command(__name__):
    signal.signal(signal.SIGINT, interrupted_while_starting)   # Python's own handler again below
    refuse_bad_switches()     # (before the re-execution and the heap's tuning read their switches)
    blas.reexec_with_openblas(sys.argv[1:])
    heap.keep_large_blocks()

import typer  # noqa: E402  (after the re-execution above: the imports below load MLX)
from typer._click import exceptions as cx  # noqa: E402  (typer vendors its own click)
from typer.core import TyperCommand, TyperGroup  # noqa: E402

from tinygpt_mlx import distributed  # noqa: E402

from .common import fail  # noqa: E402


class OneLineErrors(TyperGroup):
    """Runs the command with click's standalone handling off, so that a usage error becomes
    one `error:` line (the message kept verbatim) instead of a usage block and a boxed panel."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        refuse_bad_switches()
        refuse_ranks(sys.argv[1:] if args is None else list(args))
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help())
            sys.exit(0)
        except cx.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            fail(f"{e.format_message()}{typed_value(e, sys.argv[1:] if args is None else list(args))}{hint}")
            sys.exit(e.exit_code)
        except cx.ClickException as e:
            fail(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            fail("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def typed_value(e: Exception, args: list[str]) -> str:
    """`, got 'abc'`: what the user typed for the option a BadParameter names, where the message
    does not say it (click's own type conversion: "Input should be a valid integer"); else "".
    The command line is parsed again by click's own parsers, command by command, so the value is
    the one click converted: attached short options (`-nabc`) and `--opt=abc` included, a repeated
    option's last value (click keeps the last), and of a repeatable option's values the first that
    does not convert."""
    param, ctx = getattr(e, "param", None), getattr(e, "ctx", None)
    if param is None or ctx is None or not getattr(param, "opts", None):
        return ""
    chain = []
    while ctx is not None:
        chain.insert(0, ctx)
        ctx = ctx.parent
    rest = list(args)
    try:
        for level in chain:
            opts, rest, _ = level.command.make_parser(level).parse_args(args=rest)
            if level is not chain[-1]:
                rest = rest[1:]     # the subcommand's name, then its own arguments
    except cx.UsageError:
        return ""
    value = opts.get(param.name)
    if param.multiple and isinstance(value, (list, tuple)):
        value = next((v for v in value if not _converts(param, v, chain[-1])), None)
    if not isinstance(value, str):
        return ""
    message = e.format_message()
    return "" if repr(value) in message or f"got {value}" in message else f", got {value!r}"


def _converts(param, value: str, ctx) -> bool:
    """Whether `param` (a repeatable option: no callback of ours) takes `value` alone."""
    try:
        param.process_value(ctx, [value])
    except cx.BadParameter:
        return False
    return True


class PanelledHelp(TyperCommand):
    """click's plain help, with the options of each part of the cache policy under their own
    heading (a knob's `--help` panel, knobs.PANELS) after the command's own options."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                heading = ("Arguments" if param.param_type_name == "argument"
                           else getattr(param, "rich_help_panel", None) or "Options")
                sections.setdefault(heading, []).append(record)
        for heading, records in sections.items():
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)


def refuse_ranks(args: list[str]) -> None:
    """Under `mlx.launch` with several ranks only the commands in `distributed.COMMANDS`
    (sample) run; any other would run N times over or bind one port N times: one line, before
    any work (the world size is read from the launcher's environment, without MLX)."""
    command = next((a for a in args if not a.startswith("-")), None)
    if command is None or command in distributed.COMMANDS or command not in COMMAND_NAMES:
        return
    n = distributed.launched_ranks()
    if n > 1:
        if os.environ.get("MLX_RANK", "0") == "0":
            fail(f"'{command}' does not run under several ranks ({n} launched by mlx.launch); only "
                 f"{', '.join(distributed.COMMANDS)} does: run '{command}' without mlx.launch")
        sys.exit(2)


app = typer.Typer(
    name="posttrainllm",
    cls=OneLineErrors,
    help="Long-context LLM sampling with MLX: StreamingLLM, KIVI and tiered retrieval in one KV cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    add_completion=False,
)



def version() -> str:
    """The installed package's version (its metadata, `importlib.metadata`); where it is not
    installed (run from a checkout with `python -m`), the version pyproject.toml beside the
    package gives; else "unknown"."""
    try:
        return metadata.version("posttrainllm")
    except metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    m = re.search(r'^\[project\]\n(?:(?!\[).*\n)*?version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return m[1] if m else "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"posttrainllm {version()}")
        raise typer.Exit()


@app.callback()
def _options(_version: Annotated[bool, typer.Option(
        "--version", help="Print the version and exit.", is_eager=True, callback=_print_version)] = False) -> None:
    pass


COMMANDS = ("sample", "cache_prompt", "chat", "info", "train", "compare", "perplexity", "bench", "cache_report",
            "needle", "serve")
for _name in COMMANDS:
    importlib.import_module(f"tinygpt_mlx.cli.{_name}").register(app)
for _info in app.registered_commands:
    _info.cls = PanelledHelp if _info.cls in (None, TyperCommand) else _info.cls
COMMAND_NAMES = frozenset(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)

if blas.started_as_command(__name__):
    signal.signal(signal.SIGINT, signal.default_int_handler)   # the commands' own handling from here on

if __name__ == "__main__":
    app()
