"""`posttrainllm perplexity`: teacher-forced perplexity through the cached path, KL to a baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate import defaults, inputs
from tinygpt_mlx.evaluate.modes import SPEC_HELP, parse_policies, parse_policy
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

ppl = lazy("tinygpt_mlx.evaluate.perplexity")


@c.with_cache_options
def perplexity(
    cache_config: CacheConfig,
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    text: Annotated[Optional[Path], typer.Option(
        "--text", help="UTF-8 text to score (default: the King James Bible's held-out tail shipped with "
        "the package, its first context-length tokens unless --max-tokens; the docs' numbers used "
        "data/heldout.txt from scripts/fetch_corpus.sh).",
        show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", min=2, help="Score only the first N tokens of the text.", show_default=False)] = None,
    baseline: Annotated[str, typer.Option(
        "--baseline", help="Reference run side by side for KL and top-1: fp32 (full cache), any policy "
        "spec as in compare --modes, or none (e.g. a text longer than the model's context).")] = "fp32",
    prefill_tokens: Annotated[Optional[int], typer.Option(
        "--prefill-tokens", min=1, help=f"Tokens in the first (prefill) chunk; the rest go one by one. "
        f"Default {defaults.PERPLEXITY_PREFILL_TOKENS}.", show_default=False)] = None,
    modes: Annotated[Optional[str], typer.Option(
        "--modes", help=f"Instead of the cache flags: a comma list of policies scored side by side "
        f"against one baseline run (a table; JSON under 'modes'). Each: {SPEC_HELP}.",
        show_default=False)] = None,
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", help="Also write the results as JSON to this path.", dir_okay=False)] = None,
    segment: Annotated[Optional[int], typer.Option(
        "--segment", help="Also report the perplexity of each run of N scored tokens (e.g. 2048: the "
        "StreamingLLM curve past the trained context).", show_default=False, min=1)] = None,
    score_chunk: Annotated[int, typer.Option(
        "--score-chunk", help="After the prefill chunk, tokens fed per model call: 1 feeds them as decoding "
        "does; more is the same for a full cache and faster, but lets an evicting cache attend over a "
        "whole chunk before it evicts.", min=1)] = 1,
    past_context: Annotated[bool, typer.Option(
        "--past-context", help="Let a full cache score past the model's trained context (to show how it "
        "degrades there; refused otherwise).")] = False,
) -> None:
    """Perplexity of a text under a cache policy, and KL / top-1 agreement against a baseline."""
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    config = cache_config
    flags_given = config != CacheConfig()
    c.check_writable(json_path, "--json")
    if modes is not None and flags_given:
        raise typer.BadParameter("give --modes or cache flags, not both", param_hint="'--modes'")
    with c.flag_value("--modes"):       # a bad spec: one short line, exit 2, before the model loads
        policies = parse_policies(modes) if modes is not None else None   # (the flags': once the text is known)
    with c.flag_value("--baseline"):
        reference = None if baseline.strip().lower() == "none" else parse_policy(baseline)
    with c.guarded():
        with c.flag_file("--text" if text else None):
            source = inputs.read_text(text or inputs.HELDOUT_KJV)
        loaded = c.load_model(model, weights)
        if text is None and max_tokens is None and loaded.context_length:
            max_tokens = loaded.context_length  # the shipped text is longer than a full cache holds
        ids = loaded.tokenizer.encode(source)[:max_tokens]
        if policies is None:   # the flags' positions where they are the run's to choose (CacheConfig.for_run)
            config = config.for_run(loaded.context_length, len(ids))
            policies = {config.label(): config}
        err.print(f"[bold]perplexity[/bold] · model [cyan]{loaded.name}[/cyan] (context "
                  f"{loaded.context_length}) · {len(ids)} tokens of {text or 'the shipped KJV held-out text'} · "
                  f"baseline "
                  f"{reference.label() if reference else 'none'}")
        for name, policy in policies.items():
            err.print(f"  {name}: [green]{policy.label()}[/green]")
        if not past_context:
            check_context(len(ids), loaded.context_length, policies, reference, modes is not None)
        with c.Progress("perplexity: scoring", total=max(len(ids) - 1, 0), unit="tok") as bar:
            results = ppl.perplexities(
                loaded.model, ids, policies, reference,
                prefill_tokens if prefill_tokens is not None else defaults.PERPLEXITY_PREFILL_TOKENS,
                None if past_context else loaded.context_length,
                progress=lambda done, total: bar.update(done, total), segment=segment, score_chunk=score_chunk)
        print_table(results, baseline if reference else None)
        if segment is not None:
            print_segments(results)
        if json_path is not None:
            rows = {name: dict(r.to_dict(), policy=policies[name].describe()) for name, r in results.items()}
            if modes is None:
                out = dict(next(iter(rows.values())), label=config.label(), baseline=baseline)
            else:
                first = next(iter(results.values()))
                out = {"tokens": first.tokens, "baseline": baseline,
                       "baseline_perplexity": first.baseline_perplexity, "modes": rows}
            c.write_atomic(json_path, json.dumps(out, indent=2))


def check_context(tokens: int, context: Optional[int], policies: dict, reference: Optional[CacheConfig],
                  modes: bool) -> None:
    """A full cache (a policy's or the baseline's) cannot score more tokens than the model's
    trained context: one line in perplexity's terms (the text, --max-tokens, --past-context,
    --baseline none), before the scoring starts. The library's own check (`generate.check_context`)
    speaks of a prompt to shorten and offers the window to a user who already gave one."""
    if not context or tokens <= context:
        return
    full = [name for name, p in policies.items() if not (p.streaming or p.retrieval)]
    what = f"the text has {tokens} tokens but the model's context is {context}"
    fewer = f"score at most {context} (--max-tokens {context}) or let it run past the context (--past-context)"
    if full:
        evicting = ("a window or hot part in --modes, e.g. sink4/window256 or hot256" if modes else
                    "--streaming-llm-window or --kiv-hot-budget")
        raise ValueError(f"{what}: the full cache ({', '.join(full)}) cannot hold it; take an evicting policy "
                         f"({evicting}), {fewer}")
    if reference is not None and not (reference.streaming or reference.retrieval):
        raise ValueError(f"{what}: the full-cache baseline ({reference.label()}) cannot hold it; skip it with "
                         f"--baseline none, or {fewer}")


def table_console() -> Console:
    """Where the table goes: on a terminal, a console of its width (a long policy name wraps in
    its column, not across the terminal's lines); piped, 110 columns."""
    out = Console(highlight=False)
    return out if out.is_terminal else Console(highlight=False, width=110)


def print_table(results: dict, baseline: Optional[str], console: Optional[Console] = None) -> None:
    first = next(iter(results.values()))
    # two short lines, each narrower than the narrowest table (79 columns): rich wraps a title at
    # the table's width, which left the baseline's number alone on a line of its own
    title = f"perplexity over {first.tokens} tokens, teacher-forced through the cache"
    if baseline is not None:
        title += f"\nbaseline {baseline}: perplexity {first.baseline_perplexity:.4f}"
    table = Table(title=title)
    for col in ("policy", "perplexity", "KL(base||policy)", "top-1 agree", "stored", "cache"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col != "policy")
    for name, r in results.items():
        kl = "-" if r.kl_mean is None else f"{r.kl_mean:.2e}"
        top1 = "-" if r.top1_agreement is None else f"{r.top1_agreement:.4f}"
        table.add_row(name, f"{r.perplexity:.4f}", kl, top1, f"{r.stored_count}/{r.current_length}",
                      c.fmt_bytes(r.cache_bytes))
    (console or table_console()).print(table)


def print_segments(results: dict) -> None:
    first = next(iter(results.values()))
    table = Table(title="perplexity per segment of scored tokens")
    table.add_column("policy")
    for seg in first.segment_perplexity:
        table.add_column(f"{seg['start']}-{seg['end']}", justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{seg['perplexity']:.2f}" for seg in r.segment_perplexity))
    Console(highlight=False, width=200).print(table)


def register(app: typer.Typer) -> None:
    app.command("perplexity")(perplexity)
