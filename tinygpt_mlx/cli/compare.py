"""`posttrainllm compare`: greedy prefix match of cache policies against the fp32 full cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tinygpt_mlx.evaluate import defaults
from tinygpt_mlx.evaluate.modes import SPEC_HELP, parse_policies, parse_policy
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

cmp = lazy("tinygpt_mlx.evaluate.compare")

DEFAULT_MODES = "fp16,bf16,int8,int4"


def print_table(result: dict) -> None:
    modes = result["modes"]
    # "full cache" only where the baseline is one: a StreamingLLM or retrieval baseline evicts
    evicts = any(k in result.get("baseline_policy", {}) for k in ("streaming_llm", "retrieval"))
    table = Table(title=f"greedy prefix match vs {result['baseline']}{'' if evicts else ' full cache'}, "
                        f"{result['tokens']} tokens per prompt")
    table.add_column("prompt", overflow="ellipsis", max_width=40, no_wrap=True)
    for name in modes:
        table.add_column(name, justify="right", no_wrap=True, min_width=5)
    first = next(iter(modes.values()))
    for i, row in enumerate(first["prompts"]):
        # a prompt's first words on one line, as typed (a multi-line prompt or one with [brackets]
        # stays one row, not rich markup)
        table.add_row(Text(" ".join(row["prompt"].split())),
                      *(f"{m['prompts'][i]['prefix_match']:.2f}" for m in modes.values()))
    table.add_section()
    table.add_row("[bold]mean[/bold]", *(f"[bold]{m['mean_prefix_match']:.3f}[/bold]" for m in modes.values()))
    Console(highlight=False, width=48 + sum(max(len(n), 5) + 3 for n in modes)).print(table)


def compare(
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    prompts: Annotated[Optional[Path], typer.Option(
        "--prompts", help="UTF-8 text, one prompt per line, or a .jsonl file of one JSON string per line (prompts with newlines); default: the prompt set shipped with the package.",
        show_default=False)] = None,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", "-n", min=1, help=f"Greedy tokens per prompt and mode. Default {defaults.COMPARE_TOKENS}.",
        show_default=False)] = None,
    modes: Annotated[str, typer.Option(
        "--modes", help=f"Comma list of cache policies to compare. Each: {SPEC_HELP}.")] = DEFAULT_MODES,
    baseline: Annotated[str, typer.Option(
        "--baseline", help="The reference policy (same syntax as a mode).")] = "fp32",
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", help="Also write the results as JSON to this path.", dir_okay=False)] = None,
    prefill_chunk: c.PrefillChunk = None,
    prefill_tail: c.PrefillTail = None,
) -> None:
    """Greedy generation per prompt per mode; prefix-match rate against the baseline."""
    chunk = c.prefill_chunk(prefill_chunk)
    tail = c.prefill_tail(prefill_tail)
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    c.check_writable(json_path, "--json")
    with c.flag_value("--modes"):       # a bad spec: one short line, exit 2, before the model loads
        policies = parse_policies(modes)
    with c.flag_value("--baseline"):
        reference = (baseline, parse_policy(baseline))
    with c.guarded():
        with c.flag_file("--prompts" if prompts else None):
            texts = cmp.read_prompts(prompts) if prompts else cmp.default_prompts()
        loaded = c.load_model(model, weights)
        err.print(f"[bold]compare[/bold] · model [cyan]{loaded.name}[/cyan] · {c.counted(len(texts), 'prompt')} · "
                  f"baseline [green]{reference[1].label()}[/green]")
        for name, config in policies.items():
            err.print(f"  {name}: {config.label()}")
        n = tokens if tokens is not None else defaults.COMPARE_TOKENS
        runs = len(texts) * (1 + len(policies))
        with c.Progress(f"compare: {runs} greedy runs of {n} tokens", total=runs * n, unit="tok") as bar:
            result = cmp.compare(loaded, texts, policies, n, reference, progress=lambda: bar.advance(n),
                                 prefill_tail=tail, prefill_chunk=chunk)
        print_table(result)
        if json_path is not None:
            c.write_atomic(json_path, json.dumps(result, indent=2))


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
