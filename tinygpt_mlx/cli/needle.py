"""`posttrainllm needle`: needle-in-a-haystack grid for full cache, StreamingLLM and retrieval."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tinygpt_mlx.corpus import NAMES, TASKS
from tinygpt_mlx.evaluate import inputs
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

generate = lazy("tinygpt_mlx.generate")
nd = lazy("tinygpt_mlx.evaluate.needle")

#: --policies' names (evaluate/needle.py POLICIES, which imports MLX: not for a typo)
NEEDLE_POLICIES = ("full", "streaming", "retrieval")


def _list(text: str, name: str, kind=int) -> list:
    values = []
    for x in (x for x in text.split(",") if x.strip()):
        try:
            values.append(kind(x))
        except ValueError:
            what = "integers" if kind is int else "numbers"
            raise typer.BadParameter(f"must be a comma list of {what}, got {x.strip()!r} in {text!r}",
                                     param_hint=f"'{name}'") from None
    if not values:
        raise typer.BadParameter(f"no value in {text!r}", param_hint=f"'{name}'")
    return values


class PrefillReport:
    """A line on stderr every `every` seconds of a long prefill: tokens done, tokens/s, ETA,
    resident memory (the process's own and mapped files') and the cache's bytes (`stored`)."""

    def __init__(self, every: float = 30.0):
        self.every = every
        self.first = self.prev = 0     # tokens done at the cell's first report, at the last call
        self.start = self.last = 0.0

    def __call__(self, done: int, total: int, cache) -> None:
        now = time.monotonic()
        if done <= self.prev or not self.start:     # a new cell: rates count from its first chunk
            self.first, self.start, self.last = done, now, now
        self.prev = done
        if now - self.last < self.every or done >= total or done == self.first:
            return
        self.last = now
        rate = (done - self.first) / max(now - self.start, 1e-9)
        rss = generate.rss_bytes()
        err.print(f"    prefill {done:,}/{total:,} tokens · {rate:,.0f} tok/s · ETA {(total - done) / rate / 60:.1f} min · "
                  f"RSS {c.fmt_bytes(rss['anon'])} (+{c.fmt_bytes(rss['file'])} mapped) · "
                  f"{stored(cache)}")


def stored(cache) -> str:
    """The cache's bytes for a progress line: all of them, and the part on disk where some are
    (the host cold store's memory-mapped files; the device store, the default, holds all in RAM)."""
    total, disk = getattr(cache, "nbytes", 0), getattr(cache, "disk_nbytes", 0)
    return f"cache {c.fmt_bytes(total)}" + (f" ({c.fmt_bytes(disk)} of it on disk)" if disk else " in RAM")


def print_table(result: dict) -> None:
    policies = list(result["policies"])
    table = Table(title=f"needle grid: passed / seeds ({result['seeds']} seeds, greedy answer match)")
    table.add_column("context", justify="right")
    table.add_column("depth", justify="right")
    for p in policies:
        table.add_column(p, justify="center")
    for ctx in result["contexts"]:
        for d in result["depths"]:
            row = [str(ctx), f"{d:g}"]
            for p in policies:
                got = [x["passed"] for x in result["cells"]
                       if x["policy"] == p and x["context"] == ctx and x["depth"] == d]
                if not got:
                    row.append("[dim]-[/dim]")
                else:
                    colour = "green" if all(got) else ("red" if not any(got) else "yellow")
                    row.append(f"[{colour}]{sum(got)}/{len(got)}[/{colour}]")
            table.add_row(*row)
        table.add_section()
    total = ["all", ""]
    for p in policies:
        s = result["summary"][p]
        total.append("-" if not s["cells"] else f"{s['passed']}/{s['cells']} ({s['pass_rate']:.0%})"
                     + (f" · values {s['values_right']}/{s['values']}" if s["values"] > s["cells"] else ""))
    table.add_row(*total)
    Console().print(table)


def _reads(cfg) -> str:
    """What the label's "top N pages" means beside the JSON's `top_pages`: a query attends its
    best `retrieve_tokens` (whole pages: retrieve_tokens // page_size of them), chosen from the
    pool of `top_pages` pages per query row its pass fetches (the JSON's top_pages, 256 at a
    1,024 window, where the label says top 32 pages)."""
    what = (f"{cfg.retrieve_tokens} tokens" if cfg.retrieve_unit == "tokens" else
            f"{max(1, cfg.retrieve_tokens // cfg.page_size)} pages ({cfg.retrieve_tokens} tokens)")
    return (f" (a query reads its top {what} of a pool of {cfg.top_pages} pages of {cfg.page_size} per query "
            f"row: --kiv-top-pages, the JSON's top_pages)")


def _policies_line(configs: dict) -> str:
    """The banner's policies, each by its label, as the grid runs them (before 2026-12-07 it named
    the retrieval config alone, even for a grid that runs none)."""
    parts = []
    for name, cfg in configs.items():
        part = f"{name}: [green]{escape(cfg.label())}[/green]"
        if name == "retrieval":
            part += _reads(cfg) + (" · original RoPE positions where a cell fits the context, else shifted"
                                   if cfg.rope_auto else "")
        parts.append(part)
    return "policies " + "; ".join(parts)


@c.with_cache_options(hot_budget=256)
def needle(
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    contexts: Annotated[str, typer.Option("--contexts", help="Comma list of prompt lengths in tokens.")] = "1024,2048",
    depths: Annotated[str, typer.Option("--depths", help="Comma list of needle depths in [0, 1].")]
    = "0.1,0.3,0.5,0.7,0.9",
    seeds: Annotated[int, typer.Option("--seeds", help="Documents per (context, depth).")] = 3,
    first_seed: Annotated[int, typer.Option(
        "--first-seed", help="Seed of the first document (seeds run first..first+seeds-1), to add seeds "
        "to a grid already run.")] = 0,
    policies: Annotated[str, typer.Option(
        "--policies", help="Comma list of: full (where it fits; everywhere with --past-context), streaming "
        "(sink + hot budget as window), retrieval.")] = "full,streaming,retrieval",
    digits: Annotated[int, typer.Option("--digits", help="Digits of the pass key (of the asked value).")] = 5,
    task: Annotated[str, typer.Option(
        "--task", help="The documents: passkey (one fact in the filler), keyed (--facts secret numbers of "
        "different people, one asked), keyed-all (--facts of them, all asked, answered in turn; a cell "
        "passes when all are right) or phonebook (nothing but 'First Last: NNNNN' lines, one asked).")] = "passkey",
    facts: Annotated[int, typer.Option("--facts", help="Facts per document for --task keyed and keyed-all.")] = 4,
    filler: Annotated[Optional[Path], typer.Option(
        "--filler", help="Haystack UTF-8 text (default: the King James Bible's held-out tail shipped "
        "with the package; the docs' numbers used data/heldout.txt from scripts/fetch_corpus.sh).",
        show_default=False)] = None,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Prompt tokens per forward pass.")] = 128,
    prefill_tail: c.PrefillTail = None,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Ask each document through the model's chat template (an instruct model): the "
        "document and question as a user message, the answer's lead-in starting the reply.")] = False,
    lead_in: Annotated[Optional[str], typer.Option(
        "--lead-in", help="The answer's lead-in that ends each prompt, in place of the question's own "
        "('The pass key is'); e.g. 'The pass key is number' for a small instruct model that otherwise "
        "explains the phrase.", show_default=False)] = None,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Run each failed retrieval cell again with the needle's pages offered to every "
        "retrieval pass whatever their rank (an oracle coarse pass): 'ranking' where that answers (the "
        "page ranking lost the needle), 'reading' where it still fails. Costs a second prefill per "
        "failed cell.")] = False,
    past_context: Annotated[bool, typer.Option(
        "--past-context", help="Run the full cache on the contexts longer than the model's trained context "
        "too (to count what it finds there beside StreamingLLM and retrieval; skipped otherwise).")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the grid as JSON here.",
                                                      dir_okay=False)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Keep the cells already in --json (the grid is saved there cell by cell, so a "
        "stopped run can go on) and run only the others. The file must come from this grid: the same "
        "model, settings and policy flags, and no cell outside --contexts, --depths, --policies and "
        "the seeds; where it does not exist yet the grid starts afresh.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a heat map PNG here.",
                                                 dir_okay=False)] = None,
    *, cache_config,
) -> None:
    """Needle-in-a-haystack pass/fail grid per policy, context, depth and seed.

    The cache flags describe the retrieval policy (--kiv-hot-budget defaults to 256 here);
    StreamingLLM in the grid keeps the same sink and uses the hot budget as its window."""
    tail = c.prefill_tail(prefill_tail)
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    ctx_list = _list(contexts, "--contexts")
    depth_list = _list(depths, "--depths", float)
    # each a usage error naming the flag and what was typed
    if min(ctx_list) < 16:
        raise typer.BadParameter(f"must be at least 16 tokens, got {min(ctx_list)}", param_hint="'--contexts'")
    outside = [d for d in depth_list if not 0 <= d <= 1]
    if outside:
        raise typer.BadParameter(f"must lie in [0, 1], got {outside[0]:g}", param_hint="'--depths'")
    if lead_in is not None and not lead_in.strip():
        raise typer.BadParameter(f"--lead-in {lead_in!r}: give the words that start the answer")
    for flag, value in (("--seeds", seeds), ("--digits", digits), ("--prefill-chunk", prefill_chunk)):
        if value < 1:
            raise typer.BadParameter(f"must be positive, got {value}", param_hint=f"'{flag}'")
    if first_seed < 0:
        raise typer.BadParameter(f"--first-seed {first_seed}: must be 0 or more")
    if task not in TASKS:
        raise typer.BadParameter(f"--task {task!r}: choose from {', '.join(TASKS)}")
    if not 1 <= facts <= len(NAMES):
        raise typer.BadParameter(f"--facts {facts}: must be in 1..{len(NAMES)}")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise typer.BadParameter(f"no policy in {policies!r}", param_hint="'--policies'")
    unknown = [n for n in names if n not in NEEDLE_POLICIES]
    if unknown:
        raise typer.BadParameter(f"unknown needle policy {unknown[0]!r}; choose from {', '.join(NEEDLE_POLICIES)}",
                                 param_hint="'--policies'")
    cfg = cache_config
    if probe and "retrieval" not in names:
        raise typer.BadParameter(f"--probe re-runs failed retrieval cells: --policies {policies!r} has no retrieval")
    if probe and cfg.retrieves_per_query:
        raise typer.BadParameter("--probe pins the needle's pages into each pass's pool; --kiv-positions slots "
                                 "gives each query a pool of its own")
    if past_context and "full" not in names:
        raise typer.BadParameter(f"--past-context runs the full cache past the model's context: --policies "
                                 f"{policies!r} has no full")
    if resume and json_path is None:
        raise typer.BadParameter("--resume keeps the cells of the grid's --json file: give --json")
    c.check_writable(json_path, "--json")
    c.check_writable(plot, "--plot")
    previous = _read_grid(json_path) if resume else None
    with c.flag_value():    # the names checked before loading anything (the message names the choices)
        configs = nd.policy_configs(cfg, names)
    with c.guarded():
        if plot is not None:
            inputs.require_plotting()
        with c.flag_file("--filler" if filler else None):
            text = inputs.read_text(filler or nd.DEFAULT_FILLER)
        loaded = c.load_model(model, weights)
        done = _kept(json_path, previous, nd.grid_header(
            loaded, cfg, names, ctx_list, depth_list, seeds, text, chunk=prefill_chunk, digits=digits, task=task,
            facts=facts, chat=chat, lead_in=lead_in, first_seed=first_seed, probe=probe, tail=tail,
            past_context=past_context)) if resume else []
        err.print(f"[bold]needle[/bold] · model [cyan]{loaded.name}[/cyan] (context {loaded.context_length}) · "
                  + _policies_line(configs)
                  + f" · prefill chunk {prefill_chunk}" + (f", the last {tail} tokens apart" if tail else "")
                  + f" · task {task}"
                  + (f" ({facts} facts)" if task in ("keyed", "keyed-all") else ""))

        fits = [n for n in ctx_list if past_context or not loaded.context_length or n <= loaded.context_length]
        if "full" in configs and len(fits) < len(ctx_list):   # its '-' cells in the table, said why
            past = [n for n in ctx_list if n not in fits]
            err.print(f"note: the full cache skips context{'s' if len(past) > 1 else ''} "
                      f"{', '.join(map(str, past))}: past the model's context of {loaded.context_length} "
                      "tokens (--past-context runs it there too)")
        n_cells = len(depth_list) * seeds * sum(len(fits) if name == "full" else len(ctx_list) for name in configs)
        if resume:
            err.print(f"resuming {json_path}: {len(done)} cells kept, {n_cells - len(done)} to run")
            n_cells -= len(done)

        def progress(cell: dict) -> None:
            bar.advance(1)
            mark = "[green]pass[/green]" if cell["passed"] else "[red]fail[/red]"
            tel = cell.get("telemetry", {})
            # (token_recall: the share of the needle's tokens fetched; token_any: of layer-head steps
            # fetching any of them, as the JSON's telemetry names them)
            rec = (f" · needle token recall {tel['token_recall']:.2f} (any fetched {tel['token_any']:.2f})"
                   if "token_recall" in tel else "")
            miss = cell.get("first_miss")
            if miss:
                rec += f" · first miss {miss['want']!r} p {miss['p']:.2f} (rank {miss['rank']}, took {miss['got']!r})"
            if "probe" in cell:
                pr = cell["probe"]
                got, anyf = pr["oracle_token_recall"], pr.get("oracle_token_any")
                rec += (f" · oracle pages: {'pass' if pr['oracle_passed'] else 'fail'} ({pr['oracle_output']!r}"
                        + (f", recall {got:.2f}" if got is not None else "")
                        + (f", any fetched {anyf:.2f}" if anyf is not None else "") + f"), a {pr['verdict']} miss")
            err.print(f"  {cell['policy']:>9} ctx {cell['context']:>7} depth {cell['depth']:<4g} seed {cell['seed']}: "
                      f"{mark} ({cell['answer']!r} -> {cell['output']!r}) "
                      f"{cell['decode_ms_per_token']:.1f} ms/token{rec}")

        def partial(result: dict) -> None:   # a long grid is saved cell by cell
            if json_path is not None:
                c.write_atomic(json_path, json.dumps(result, indent=1))

        with c.Progress("needle grid", total=n_cells, unit="cells") as bar:
            result = nd.needle_grid(loaded, cfg, ctx_list, depth_list, seeds, names, text,
                                    chunk=prefill_chunk, digits=digits, task=task, facts=facts, progress=progress,
                                    on_chunk=PrefillReport(), partial=partial, chat=chat, lead_in=lead_in,
                                    first_seed=first_seed, probe=probe, tail=tail, past_context=past_context,
                                    done=done)
        print_table(result)
        if json_path is not None:
            c.write_atomic(json_path, json.dumps(result, indent=1))
            err.print(f"wrote {json_path}")
        if plot is not None:
            nd.plot_grid(result, plot)
            err.print(f"wrote {plot}")


def _read_grid(path: Path) -> Optional[dict]:
    """The grid JSON that `--resume` goes on from (None where it does not exist yet); one line
    naming the file where it is not a needle grid's (read before the model is loaded)."""
    if not path.exists():
        err.print(f"--resume: {path} does not exist yet; the grid starts afresh")
        return None
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict) or not isinstance(old.get("cells"), list) or "policies" not in old:
            raise ValueError("no cells and policies in it")
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"{path}: not a needle grid's JSON ({e})", param_hint="'--resume'") from None
    return old


def _kept(path: Path, old: Optional[dict], header: dict) -> list[dict]:
    """The cells of `old` that `--resume` keeps; one line naming what differs where `old` is not
    this grid's."""
    if old is None:
        return []
    why = nd.resume_check(old, header)
    if why:
        raise ValueError(f"--resume {path}: not this grid's file: {why}")
    unknown = nd.unrecorded(old)
    if unknown:
        err.print(f"--resume: {path} does not record its {', '.join(unknown)} (written by an older version); "
                  "taken to be this run's")
    return old["cells"]


def register(app: typer.Typer) -> None:
    app.command("needle")(needle)
