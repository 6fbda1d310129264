"""What every command shares: cache-policy options, error handling and the stderr console."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import time
import typing
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from tinygpt_mlx import blas
from tinygpt_mlx.config import DEFAULT_ROPE_MODE, FETCH_FLOOR, KV_QUANTIZE_CHOICES, CacheConfig, SampleConfig, field_default
from tinygpt_mlx.knobs import KNOBS, PANELS, RETRIEVAL_ROPE_CHOICE, Knob
from tinygpt_mlx.errors import PosttrainError
from tinygpt_mlx.lazy import lazy

loading = lazy("tinygpt_mlx.loading")
resolving = lazy("tinygpt_mlx.resolve")   # numpy and the GGUF reader: not for --help

err = Console(stderr=True, highlight=False, soft_wrap=True)

_C, _S = CacheConfig, SampleConfig
ModelArg = Annotated[Optional[str], typer.Argument(
    help="A .tinygpt file, a GGUF file, an mlx-lm / Hugging Face model directory, an ollama model name "
    "(smollm2:135m, from $OLLAMA_MODELS or ~/.ollama/models) or a Hugging Face repo id (org/name, from its "
    "cache; HF_HUB_OFFLINE=1 keeps it offline). Default: the shipped model.",
    show_default=False)]
#: `--weights`' values (tinygpt_mlx/ggml/load.py WEIGHT_MODES, which imports MLX: not for a typo)
WEIGHT_MODES = ("auto", "packed", "dense")


def _weights(value: str) -> str:
    """`--weights` checked as click parses it: a value not in WEIGHT_MODES is a usage error."""
    if value not in WEIGHT_MODES:
        raise typer.BadParameter(f"choose one of {', '.join(WEIGHT_MODES)}, got {value!r}")
    return value


Weights = Annotated[str, typer.Option(
    "--weights", help="GGUF models: keep block-quantised weights packed (MLX quantised layers) or dequantise "
    "them to dense floats. auto = dense on the CPU backend (faster there, 4-8x the memory), packed on a GPU.",
    show_default=True, callback=_weights)]
Temperature = Annotated[Optional[float], typer.Option(
    "--temperature", help=f"Sampling temperature; 0 is greedy. Default {field_default(_S, 'temperature')}.",
    show_default=False)]
TopP = Annotated[Optional[float], typer.Option(
    "--top-p", help=f"Nucleus sampling mass. Default {field_default(_S, 'top_p')}.", show_default=False)]
TopK = Annotated[Optional[int], typer.Option(
    "--top-k", help=f"Keep only the k most likely tokens (0 = off). Default {field_default(_S, 'top_k')}.",
    show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for reproducible sampling.")]
PrefillChunk = Annotated[Optional[int], typer.Option(
    "--prefill-chunk", help=f"Prompt tokens per forward pass. Default {field_default(_S, 'prefill_chunk')}.",
    show_default=False)]
PREFILL_TAIL_HELP = (
    "Prefill the prompt's last N tokens as a forward pass of their own (in --prefill-chunk pieces if N is "
    "larger), after the rest in --prefill-chunk pieces; 0 = off (at most one more pass per prompt when on). "
    "With the full cache the result is the same up to float rounding; with retrieval (--kiv-hot-budget) each "
    "pass picks one pool of cold pages for all its queries, so the question at the prompt's end no longer "
    "shares its pass with hundreds of document tokens (docs/gguf.md).")
PrefillTail = Annotated[Optional[int], typer.Option(
    "--prefill-tail", help=f"{PREFILL_TAIL_HELP} Default {field_default(_S, 'prefill_tail')}.", show_default=False)]


def _sample_field(field: str, value: Optional[int]) -> int:
    """One SampleConfig field for a command without a SampleConfig: checked by SampleConfig's
    rule, a bad value a BadParameter naming the flag; None -> the default."""
    try:
        return getattr(SampleConfig(**({} if value is None else {field: value})), field)
    except ValueError as e:
        raise config_error(e) from None


def prefill_chunk(value: Optional[int]) -> int:
    """`--prefill-chunk` for bench, cache-report and compare (`_sample_field`)."""
    return _sample_field("prefill_chunk", value)


def prefill_tail(value: Optional[int]) -> int:
    """`--prefill-tail` for needle and compare (`_sample_field`)."""
    return _sample_field("prefill_tail", value)


def cache_config(kv_quantize=None, kv_quantize_keys=None, kv_quantize_values=None, group_size=None,
                 residual=None, sink=None, window=None, rope_mode=None, hot_budget=None,
                 retrieve_tokens=None, page_size=None, top_pages=None, **extra) -> CacheConfig:
    """One CacheConfig from command-line values; a bad value or combination (every rule is
    `CacheConfig`'s) is a BadParameter naming the flag. Retrieval without --streaming-llm-rope
    leaves its positions to the run (`RETRIEVAL_ROPE_CHOICE`, `CacheConfig.for_run`)."""
    if rope_mode is None and hot_budget is not None:
        rope_mode = RETRIEVAL_ROPE_CHOICE
    try:
        return CacheConfig.from_flags(
            kv_quantize=kv_quantize, kv_quantize_keys=kv_quantize_keys, kv_quantize_values=kv_quantize_values,
            group_size=group_size, residual=residual, sink=sink, window=window, rope_mode=rope_mode,
            hot_budget=hot_budget, retrieve_tokens=retrieve_tokens, page_size=page_size,
            top_pages=top_pages, **extra)
    except ValueError as e:
        raise config_error(e) from None


def _option(knob: Knob) -> Any:
    """The typer option of a cache knob (knobs.KNOBS): its flag, type, help (with the default
    filled in) and `--help` panel. None is "not given": `CacheConfig` fills its default."""
    field = "storage" if knob.keyword == "kv_quantize" else knob.keyword
    default = field_default(_C, field) if field in _C.__dataclass_fields__ else None
    shown = ("on" if default else "off") if knob.switch else default
    help = knob.help.format(default=shown, fetch_floor=FETCH_FLOOR, rope=DEFAULT_ROPE_MODE,
                            retrieval_rope=RETRIEVAL_ROPE_CHOICE,
                            precisions="|".join(KV_QUANTIZE_CHOICES))
    return Annotated[Optional[knob.kind], typer.Option(knob.flag, help=help, show_default=False,
                                                       rich_help_panel=PANELS[knob.part])]


# Every cache flag: command parameter name (the flag's: --kv-group-size -> kv_group_size) ->
# (its option type, the `cache_config` keyword), generated from knobs.KNOBS.
CACHE_OPTIONS = {knob.flag.split("/")[0][2:].replace("-", "_"): (_option(knob), knob.keyword) for knob in KNOBS}


def cache_option(keyword: str) -> Any:
    """The option type of one cache knob, for a command that takes it alone."""
    return next(ann for ann, kw in CACHE_OPTIONS.values() if kw == keyword)


KvGroup, KvResidual = cache_option("group_size"), cache_option("residual")   # cache-report's two


# Config field (or `CacheConfig.from_flags` keyword) -> the command-line flag that sets it: one
# table for every command, so that a config error names what the user typed (`config_error`).
CONFIG_FLAGS: dict[str, str] = {
    **{knob.keyword: knob.flag.split("/")[0] for knob in KNOBS},   # "--kiv-sticky/--no-kiv-sticky": the on switch
    "rope_auto": "--streaming-llm-rope",
    "storage": "--kv-quantize", "key_bits": "--kv-quantize-keys", "value_bits": "--kv-quantize-values",
    # SampleConfig
    "max_tokens": "--tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "seed": "--seed", "prefill_chunk": "--prefill-chunk",
    "prefill_tail": "--prefill-tail", "ignore_eos": "--ignore-eos",
    # ServerConfig
    "host": "--host", "port": "--port", "max_slots": "--max-slots", "small_request": "--small-request",
    "default_max_tokens": "--default-max-tokens", "default_num_ctx": "--default-num-ctx",
    "stop_loops": "--stop-loops", "slot_checkpoints": "--slot-checkpoints", "parallel": "--parallel",
}


def config_error(e: ValueError) -> typer.BadParameter:
    """A config's error as a usage error naming the flag: `Invalid value for '--tokens':
    must be an integer >= 0, got -1`. A `ConfigError` carries its field (Cache-, Sample- and
    ServerConfig raise one); the translation is all the CLI does."""
    field = getattr(e, "field", None)
    if field in CONFIG_FLAGS:
        return typer.BadParameter(e.describe(lambda f: CONFIG_FLAGS.get(f, f)),
                                  param_hint=f"'{CONFIG_FLAGS[field]}'")
    return typer.BadParameter(str(e))


def with_cache_options(fn=None, **defaults):
    """Give a typer command every cache flag; it receives them as one `cache_config` argument
    (a CacheConfig, validated: a bad value or combination is a BadParameter). `defaults`
    (cache_config keywords) apply where the user gave no flag, e.g.
    `@with_cache_options(hot_budget=256)`."""
    if fn is None:
        return lambda f: with_cache_options(f, **defaults)
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)  # resolve postponed annotations
    params = [p.replace(annotation=hints.get(p.name, p.annotation))
              for p in sig.parameters.values() if p.name != "cache_config"]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ann)
               for name, (ann, _) in CACHE_OPTIONS.items()]

    def command(**kwargs):
        flags = {kw: kwargs.pop(name) for name, (_, kw) in CACHE_OPTIONS.items()}
        flags.update({k: v for k, v in defaults.items() if flags.get(k) is None})
        return fn(cache_config=cache_config(**flags), **kwargs)

    command.__name__, command.__doc__, command.__module__ = fn.__name__, fn.__doc__, fn.__module__
    command.__signature__ = sig.replace(parameters=params, return_annotation=None)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Library errors become one red line on stderr and exit code 1; Ctrl-C says so."""
    try:
        yield
    except typer.Exit:
        raise
    except (PosttrainError, ValueError, TypeError, FileNotFoundError, ImportError) as e:
        fail(str(e))
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]")
        raise typer.Exit(130) from None


@contextlib.contextmanager
def flag_value(flag: Optional[str] = None) -> Iterator[None]:
    """A ValueError inside (a policy spec that does not parse, a list with a bad item) is what
    the user typed for `flag`: a usage error naming it, one line, exit code 2 (not `guarded`'s
    exit 1, which is for what goes wrong with valid input). No `flag`: the message names it."""
    try:
        yield
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=f"'{flag}'" if flag else None) from None


@contextlib.contextmanager
def flag_file(flag: Optional[str]) -> Iterator[None]:
    """A text file the user named for `flag` that cannot be read (missing, a folder, not UTF-8, a
    bad line: `evaluate.inputs.read_text`'s FileNotFoundError and ValueError) is what the user
    typed: a usage error naming the flag and the file, exit code 2, before the model loads, as
    `sample --prompt-file` says it. `flag` None (the shipped default file): left as it is."""
    try:
        yield
    except (FileNotFoundError, ValueError) as e:
        if flag is None:
            raise
        raise typer.BadParameter(str(e), param_hint=f"'{flag}'") from None


def fail(message: str) -> None:
    """One red `error:` line on stderr; the message is printed verbatim (no rich markup, so
    square brackets in paths and pip extras survive)."""
    err.print(f"[red]error:[/red] {escape(message)}")


def check_writable_dir(path: Optional[Path], flag: str) -> None:
    """Refuse a folder we will write into, before any work: it must be a writable folder, or
    creatable in a writable one. Raises BadParameter naming `flag` and the path."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is not a folder", param_hint=f"'{flag}'")
    probe = path if path.is_dir() else path.parent if str(path.parent) else Path(".")
    if not probe.is_dir():
        raise typer.BadParameter(f"folder {probe} does not exist", param_hint=f"'{flag}'")
    if not os.access(probe, os.W_OK):
        raise typer.BadParameter(f"{probe} is not writable", param_hint=f"'{flag}'")


def check_writable(path: Optional[Path], flag: str) -> None:
    """Refuse an output path before any work: its folder must exist and be writable, and the
    path itself must not be a folder. Raises BadParameter naming `flag` and the path."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory, not a file", param_hint=f"'{flag}'")
    if not parent.is_dir():
        raise typer.BadParameter(f"folder {parent} does not exist", param_hint=f"'{flag}'")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise typer.BadParameter(f"{path} is not writable", param_hint=f"'{flag}'")


def _new_file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file whole or not at all: a temporary file in the same folder, renamed into place."""
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            f.write(data)
        os.chmod(tmp, _new_file_mode())     # mkstemp makes it 0600; a written file gets the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Progress:
    """Progress of one long stage on stderr: a live bar (done / total, rate, ETA) on a terminal;
    otherwise a line when the stage starts, one at most every `every` seconds, and one at the end.

        with Progress("prefill", total=n, unit="tok") as p:
            p.update(done)          # or p.advance(1)
    """

    def __init__(self, description: str, total: Optional[int] = None, unit: str = "",
                 every: float = 10.0, console: Console = err, transient: bool = True):
        self.description, self.total, self.unit, self.every = description, total, unit, every
        self.console, self.transient = console, transient
        self.done = 0
        self._bar = self._task = None
        self._t0 = self._last = 0.0

    @property
    def live(self) -> bool:
        return self.console.is_terminal

    def __enter__(self) -> "Progress":
        self._t0 = self._last = time.perf_counter()
        if self.live:
            from rich import progress as rp
            columns = [rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                       rp.TextColumn("{task.fields[rate]}"), rp.TimeRemainingColumn()]
            self._bar = rp.Progress(*columns, console=self.console, transient=self.transient)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total, rate="")
        else:
            of = f" ({self.total} {self.unit})".replace(" )", ")") if self.total else ""
            self.console.print(f"{escape(self.description)}{of} ...")
        return self

    def _rate(self) -> str:
        dt = time.perf_counter() - self._t0
        return f"{self.done / dt:.1f} {self.unit}/s".strip() if dt > 0 and self.done else ""

    def update(self, done: int, total: Optional[int] = None, description: Optional[str] = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if description is not None:
            self.description = description
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=self.total, rate=self._rate(),
                             description=self.description)
            return
        now = time.perf_counter()
        if now - self._last >= self.every:
            self._last = now
            of = f"/{self.total}" if self.total else ""
            self.console.print(f"{escape(self.description)}: {done}{of} {self.unit}, {self._rate()}".rstrip(", "))

    def advance(self, n: int = 1, description: Optional[str] = None) -> None:
        self.update(self.done + n, description=description)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
        elif exc_type is None:
            dt = time.perf_counter() - self._t0
            self.console.print(f"{escape(self.description)}: done, {self.done} {self.unit} in {dt:.1f} s".replace("  ", " "))


def counted(n: int, noun: str) -> str:
    """`n` and the noun, plural unless n is 1: "1 token", "3 tokens"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def resolve_model(model):
    """MODEL resolved before the library's heavy imports (mlx-lm, transformers), so that a
    missing path or an unknown name is one line in a fraction of a second; a `Resolved` or
    None (the shipped model) passes through as it is."""
    if model is None or not isinstance(model, (str, Path)):
        return model
    with guarded():
        return resolving.resolve(model)


def load_model(model, weights: str = "auto", compute: bool = True):
    """Load MODEL (a name, a path or what `resolve_model` returned); a command that will
    compute with it (`compute`) then notes a missing OpenBLAS (`blas_note`). While it loads, a
    terminal shows what is loading (`loading_status`)."""
    with loading_status(model):
        loaded = loading.load(model, weights)
    if compute:
        blas_note()
    return loaded


def loading_status(model) -> typing.ContextManager:
    """On a terminal, a transient `loading NAME ...` line with a spinner while the model loads:
    a GGUF of a few hundred MB is read, dequantised and built for seconds, or minutes on a busy
    CPU, before the banner. Captured stderr (a script's, the tests') gets nothing."""
    if not err.is_terminal:
        return contextlib.nullcontext()
    name = getattr(model, "name", None) or (str(model) if model is not None else "the shipped model")
    return err.status(f"loading {escape(name)} ...")


def blas_note(stream: Optional[typing.TextIO] = None) -> None:
    """On a terminal, the one line saying that MLX runs its reference BLAS because this Linux
    has no OpenBLAS, how much faster prefill would be and the command that installs it
    (`blas.hint`). Captured stderr (a script's, the tests') stays as it was."""
    if (stream or sys.stderr).isatty():
        line = blas.hint()
        if line:
            err.print(escape(line))
