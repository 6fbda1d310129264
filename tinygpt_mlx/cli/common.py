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
from typing import Annotated, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from tinygpt_mlx.config import DEFAULT_ROPE_MODE, FETCH_FLOOR, KV_QUANTIZE_CHOICES, CacheConfig, SampleConfig, field_default
from tinygpt_mlx.errors import PosttrainError

err = Console(stderr=True, highlight=False, soft_wrap=True)

_C, _S = CacheConfig, SampleConfig
ModelArg = Annotated[Optional[str], typer.Argument(
    help="A .tinygpt file, a GGUF file, an mlx-lm / Hugging Face model directory, an ollama model name "
    "(smollm2:135m, from $OLLAMA_MODELS or ~/.ollama/models) or a Hugging Face repo id (org/name, from its "
    "cache; HF_HUB_OFFLINE=1 keeps it offline). Default: the shipped model.",
    show_default=False)]
Weights = Annotated[str, typer.Option(
    "--weights", help="GGUF models: keep block-quantised weights packed (MLX quantised layers) or dequantise "
    "them to dense floats. auto = dense on the CPU backend (faster there, 4-8x the memory), packed on a GPU.",
    show_default=True)]
KvQuantize = Annotated[Optional[str], typer.Option(
    "--kv-quantize", help=f"KV precision: {'|'.join(KV_QUANTIZE_CHOICES)} (int* = KIVI: keys per channel, "
    f"values per token). Default {field_default(_C, 'storage')}.", show_default=False)]
KvKeys = Annotated[Optional[str], typer.Option(
    "--kv-quantize-keys", help="Key precision, overriding --kv-quantize (e.g. int8).", show_default=False)]
KvValues = Annotated[Optional[str], typer.Option(
    "--kv-quantize-values", help="Value precision, overriding --kv-quantize (e.g. int4).", show_default=False)]
KvGroup = Annotated[Optional[int], typer.Option(
    "--kv-group-size", help=f"KIVI group size G (tokens per key block). Default {field_default(_C, 'group_size')}.",
    show_default=False)]
KvResidual = Annotated[Optional[int], typer.Option(
    "--kv-residual", help=f"KIVI residual R: newest tokens kept exact (a multiple of G). "
    f"Default {field_default(_C, 'residual')}. Each exact token costs the storage dtype's bytes in place of "
    "packed ones: int8 with R 64 holds 1.07x int8's bytes at 1K tokens, 1.01x at 8K, and kept the greedy "
    "text of the long prompts int8 loses on SmolLM2 (docs/kivi.md).", show_default=False)]
KvExactTopk = Annotated[Optional[int], typer.Option(
    "--kv-exact-topk", help="KIVI: per query head, re-score and re-value the K packed tokens with the highest "
    "scores from an exact shadow copy (sharp heads then see exact K/V; 0 = off). "
    f"Default {field_default(_C, 'exact_topk')}.", show_default=False)]
KvShadow = Annotated[Optional[str], typer.Option(
    "--kv-shadow", help="KIVI --kv-exact-topk: keep the exact shadow copy on disk (memory-mapped, RAM holds "
    f"only the packed cache) or in ram. Default {field_default(_C, 'shadow_store')}.", show_default=False)]
KvExactSink = Annotated[Optional[int], typer.Option(
    "--kv-exact-sink", help="KIVI without a StreamingLLM window or retrieval: keep the first N tokens exact "
    "(attention sinks). They count toward --kv-residual, so the cache holds the same bytes (the newest R - N "
    "tokens stay exact instead of R). Under StreamingLLM and retrieval "
    f"the --streaming-llm-sink tokens are exact instead. Default {field_default(_C, 'kivi_sink')}.",
    show_default=False)]
KvRotate = Annotated[Optional[bool], typer.Option(
    "--kv-rotate/--no-kv-rotate", help="KIVI: quantise keys and values in a randomized Hadamard basis of the "
    "head dimension (queries are turned alike and the output turned back: no extra bytes, two small matmuls "
    f"per layer and step). Default {'on' if field_default(_C, 'rotate') else 'off'}.", show_default=False)]
KvNear = Annotated[Optional[int], typer.Option(
    "--kv-near", help="KIVI near tier: hold the newest N frozen tokens (a multiple of G) at --kv-near-bits "
    "and pack them again at the body's bits as they age (attention reads recent tokens most). Costs "
    "N x (near bits - body bits) more bits per channel per layer, e.g. +2.4% of an int4 cache at 8K tokens (+9.2% at 2K) "
    f"for N = 256 (see docs/kivi.md). Default {field_default(_C, 'near')} (off).", show_default=False)]
KvNearShare = Annotated[Optional[int], typer.Option(
    "--kv-near-share", help="KIVI near tier sized to the context, instead of --kv-near: hold the newest 1/S of "
    "the frozen tokens (whole groups of G) at --kv-near-bits. An int4 tier token costs 80% more bytes than a "
    "body token (an int2 one at 4 bits, 67%), so S = 8 keeps an int4 cache within +10% of its bytes at every "
    f"length (see docs/kivi.md). Default {field_default(_C, 'near_share')} (off).", show_default=False)]
KvNearBits = Annotated[Optional[int], typer.Option(
    "--kv-near-bits", help="KIVI near tier's bits, 8, 6 or 4 (above the body's). A 6-bit tier holds twice an 8-bit one's tokens "
    "above an int4 body for the same bytes (--kv-near-share 4 --kv-near-bits 6 costs what --kv-near-share 8 "
    f"does; see docs/kivi.md). Default {field_default(_C, 'near_bits')}.",
    show_default=False)]
Sink = Annotated[Optional[int], typer.Option(
    "--streaming-llm-sink", help="StreamingLLM: keep the first N tokens as attention sinks (needs a window, or "
    "--kiv-hot-budget for retrieval).",
    show_default=False)]
Window = Annotated[Optional[int], typer.Option(
    "--streaming-llm-window", help="StreamingLLM: attend to the sink and the last M tokens; the cache stops "
    "growing at N + M. With KIVI (--kv-quantize int*) only whole frozen groups of G are evicted, never the "
    "exact residual R, so up to max(M, R) + G - 1 tokens stay stored after the sink (those older than M "
    "are masked out). Keep N + M within the model's context (sample warns otherwise).",
    show_default=False)]
RopeMode = Annotated[Optional[str], typer.Option(
    "--streaming-llm-rope", help="StreamingLLM positions: shifted (cache slots, the paper) or absolute "
    f"(original positions, like mlx-lm's RotatingKVCache). Default {DEFAULT_ROPE_MODE}.",
    show_default=False)]
HotBudget = Annotated[Optional[int], typer.Option(
    "--kiv-hot-budget", help="Retrieval: exact hot window; older tokens go to a cold store and are fetched back.",
    show_default=False)]
KivTopP = Annotated[Optional[int], typer.Option(
    "--kiv-top-p", help="Retrieval: cold tokens fetched per step. Default a quarter of --kiv-hot-budget, at least "
    f"{FETCH_FLOOR} (64 up to a 256-token window, 256 for 1024).",
    show_default=False)]
KivPage = Annotated[Optional[int], typer.Option(
    "--kiv-page-size", help=f"Retrieval: tokens per cold page. Default {field_default(_C, 'page_size')}.",
    show_default=False)]
KivPages = Annotated[Optional[int], typer.Option(
    "--kiv-top-pages", help="Retrieval: pages the coarse pass keeps per step, whose tokens are scored exactly. Default as "
    f"many as --kiv-top-p, at least {FETCH_FLOOR}.",
    show_default=False)]
KivSummary = Annotated[Optional[str], typer.Option(
    "--kiv-summary", help=f"Retrieval: page summary, minmax (Quest's per-channel key bounds), mean (KIV) "
    f"or hybrid (a page kept by its better rank in either). Default {field_default(_C, 'summary')}.", show_default=False)]
KivColdStore = Annotated[Optional[str], typer.Option(
    "--kiv-cold-store", help=f"Retrieval: cold store in ram or on disk (memory-mapped files: evicted "
    f"tokens, page summaries and positions, so RAM stays bounded by the hot window). "
    f"Default {field_default(_C, 'cold_store')}.", show_default=False)]
KivColdPath = Annotated[Optional[str], typer.Option(
    "--kiv-cold-path", help="Directory for disk stores: retrieval's cold store, KIVI's exact shadow "
    "(default: a temp dir).",
    show_default=False)]
KivColdBits = Annotated[Optional[int], typer.Option(
    "--kiv-cold-bits", help="Retrieval: quantise the cold store to 8 or 4 bits (default exact).",
    show_default=False)]
KivPositions = Annotated[Optional[str], typer.Option(
    "--kiv-positions", help=f"Retrieval: RoPE slot of retrieved tokens, fixed (one slot before the hot window, "
    f"InfLLM), page (token j of every fetched page at the j-th of --kiv-page-size slots: spans keep their inner "
    f"distances) or slots (in order). Default {field_default(_C, 'retrieved_position')}.", show_default=False)]
KivUnit = Annotated[Optional[str], typer.Option(
    "--kiv-unit", help="Retrieval: what each query fetches from the cold store, its --kiv-top-p best tokens "
    "(tokens) or its --kiv-top-p / --kiv-page-size best pages whole (spans, InfLLM's blocks). "
    "Default spans (tokens with --kiv-positions slots).", show_default=False)]
KivIndexBlock = Annotated[Optional[int], typer.Option(
    "--kiv-index-block", help=f"Retrieval: pages per block of the two-level page index used on long cold stores "
    f"(0 = scan every page summary each step). Default {field_default(_C, 'index_block')}.", show_default=False)]
KivIndexExpand = Annotated[Optional[int], typer.Option(
    "--kiv-index-expand", help="Retrieval: a decode step's two-level page index expands this many times "
    "--kiv-top-pages of its best blocks and ranks their pages (a prefill chunk's: --kiv-top-pages). "
    f"Default {field_default(_C, 'index_expand')}.", show_default=False)]
KivSticky = Annotated[Optional[bool], typer.Option(
    "--kiv-sticky/--no-kiv-sticky", help="Retrieval: each step's pool also holds the pages the previous step's "
    "query picked, so the page a copy is reading stays in reach of the next query. "
    f"Default {'on' if field_default(_C, 'sticky') else 'off'}.", show_default=False)]
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


def cache_config(kv_quantize=None, kv_quantize_keys=None, kv_quantize_values=None, group_size=None,
                 residual=None, sink=None, window=None, rope_mode=None, hot_budget=None,
                 retrieve_tokens=None, page_size=None, top_pages=None, **extra) -> CacheConfig:
    """One CacheConfig from command-line values; a bad value or combination (every rule is
    `CacheConfig`'s) is a BadParameter naming the flag."""
    try:
        return CacheConfig.from_flags(
            kv_quantize=kv_quantize, kv_quantize_keys=kv_quantize_keys, kv_quantize_values=kv_quantize_values,
            group_size=group_size, residual=residual, sink=sink, window=window, rope_mode=rope_mode,
            hot_budget=hot_budget, retrieve_tokens=retrieve_tokens, page_size=page_size,
            top_pages=top_pages, **extra)
    except ValueError as e:
        raise config_error(e) from None


# Every cache flag: command parameter name -> (its option type, the `cache_config` keyword).
CACHE_OPTIONS = {
    "kv_quantize": (KvQuantize, "kv_quantize"),
    "kv_quantize_keys": (KvKeys, "kv_quantize_keys"),
    "kv_quantize_values": (KvValues, "kv_quantize_values"),
    "kv_group_size": (KvGroup, "group_size"),
    "kv_residual": (KvResidual, "residual"),
    "kv_exact_topk": (KvExactTopk, "exact_topk"),
    "kv_shadow": (KvShadow, "shadow_store"),
    "kv_exact_sink": (KvExactSink, "kivi_sink"),
    "kv_rotate": (KvRotate, "rotate"),
    "kv_near": (KvNear, "near"),
    "kv_near_share": (KvNearShare, "near_share"),
    "kv_near_bits": (KvNearBits, "near_bits"),
    "streaming_llm_sink": (Sink, "sink"),
    "streaming_llm_window": (Window, "window"),
    "streaming_llm_rope": (RopeMode, "rope_mode"),
    "kiv_hot_budget": (HotBudget, "hot_budget"),
    "kiv_top_p": (KivTopP, "retrieve_tokens"),
    "kiv_page_size": (KivPage, "page_size"),
    "kiv_top_pages": (KivPages, "top_pages"),
    "kiv_summary": (KivSummary, "summary"),
    "kiv_cold_store": (KivColdStore, "cold_store"),
    "kiv_cold_path": (KivColdPath, "cold_path"),
    "kiv_cold_bits": (KivColdBits, "cold_bits"),
    "kiv_positions": (KivPositions, "retrieved_position"),
    "kiv_unit": (KivUnit, "retrieve_unit"),
    "kiv_index_block": (KivIndexBlock, "index_block"),
    "kiv_sticky": (KivSticky, "sticky"),
    "kiv_index_expand": (KivIndexExpand, "index_expand"),
}


def _flag(annotation) -> str:
    """The long flag an `Annotated[..., typer.Option("--flag", ...)]` declares."""
    info = typing.get_args(annotation)[1]
    # With Annotated, typer takes the first declaration in the `default` slot.
    flag = next(d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("--"))
    return flag.split("/")[0]      # "--kiv-sticky/--no-kiv-sticky": the on switch names it


# Config field (or `CacheConfig.from_flags` keyword) -> the command-line flag that sets it: one
# table for every command, so that a config error names what the user typed (`config_error`).
CONFIG_FLAGS: dict[str, str] = {
    **{keyword: _flag(ann) for ann, keyword in CACHE_OPTIONS.values()},
    "storage": "--kv-quantize", "key_bits": "--kv-quantize-keys", "value_bits": "--kv-quantize-values",
    # SampleConfig
    "max_tokens": "--tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "seed": "--seed", "prefill_chunk": "--prefill-chunk", "ignore_eos": "--ignore-eos",
    # ServerConfig
    "host": "--host", "port": "--port", "max_slots": "--max-slots", "small_request": "--small-request",
    "default_max_tokens": "--default-max-tokens", "default_num_ctx": "--default-num-ctx",
    "stop_loops": "--stop-loops",
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
    from tinygpt_mlx.resolve import resolve  # noqa: PLC0415 (see tinygpt_mlx/cli/main.py)

    with guarded():
        return resolve(model)


def load_model(model, weights: str = "auto"):
    """Load MODEL (a name, a path or what `resolve_model` returned)."""
    from tinygpt_mlx.loading import load  # noqa: PLC0415

    return load(model, weights)
