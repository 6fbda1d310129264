"""`posttrainllm bench`: prefill/decode speed and cache bytes per policy and context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tinygpt_mlx.evaluate import defaults, inputs
from tinygpt_mlx.evaluate.modes import SPEC_HELP
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

b = lazy("tinygpt_mlx.evaluate.bench")
mx = lazy("mlx.core")


def _ints(text: str, name: str) -> list[int]:
    """A comma list of positive integers; anything else a usage error naming `name` (exit 2)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise typer.BadParameter(f"must be a comma list of positive integers, got {text!r}", param_hint=f"'{name}'")
    return values


def _ratio(x: Optional[float]) -> str:
    return f" [dim]×{x:.2f}[/dim]" if x is not None else ""


def print_table(result: dict) -> None:
    ref = result.get("reference", defaults.BENCH_REFERENCE)
    grown = (f" of {result['grown_from']} tokens, each cache then filled to the context with copies of its rows"
             if result.get("grown_from") else "")
    # (a result without "device": written on the CPU, as every one before it was recorded)
    unfused = "; this CPU build unfuses RoPE and attention" if result.get("device", "cpu") == "cpu" else ""
    table = Table(title=f"bench: ×ratio vs {ref} in the same run; "
                        f"{result['decode_steps']} decode steps after each prefill{grown}",
                  caption="kernels/step: the nodes of one decode step's MLX graph that are not views "
                          f"(kernel launches on a GPU{unfused})")
    for col in ("policy", "context", "prefill tok/s", "decode tok/s", "kernels/step", "cache"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    last = None
    for r in sorted(result["rows"], key=lambda r: r["context"]):
        if last is not None and r["context"] != last:
            table.add_section()
        last = r["context"]
        if "error" in r:    # this backend could not run it: the reason, and the others measured
            table.add_row(r["policy"], str(r["context"]), f"[red]failed[/red]: {r['error']}", "", "", "")
            continue
        table.add_row(r["policy"], str(r["context"]),
                      f"{r['prefill_tokens_per_s']:.0f}{_ratio(r[f'prefill_tokens_per_s_vs_{ref}'])}",
                      f"{r['decode_tokens_per_s']:.1f}{_ratio(r[f'decode_tokens_per_s_vs_{ref}'])}",
                      f"{r['decode_kernels']:.1f}",
                      f"{c.fmt_bytes(r['cache_bytes'])}{_ratio(r[f'cache_bytes_vs_{ref}'])}"
                      + (f" ({c.fmt_bytes(r['cache_disk_bytes'])} on disk)" if r.get("cache_disk_bytes") else ""))
    Console(highlight=False, width=112).print(table)
    staged = [r for r in result["rows"] if "prefill_stage_ms_per_token" in r]
    if staged:
        split = Table(title="retrieval stages, ms per token (--stages: each stage ends in a sync)")
        for col in ("policy", "context", "pass", "model", "coarse", "gather", "attend", "other"):
            split.add_column(col, justify="left" if col == "policy" else "right")
        for r in sorted(staged, key=lambda r: r["context"]):
            for kind in ("prefill", "decode"):
                ms = r[f"{kind}_stage_ms_per_token"]
                split.add_row(r["policy"], str(r["context"]), kind,
                              *(f"{ms.get(k, 0.0):.3f}" for k in ("model", "coarse", "gather", "attend", "other")))
        Console(highlight=False, width=112).print(split)
    parted = [r for r in result["rows"] if "decode_step_us" in r]
    if parted:
        split = Table(title="decode step parts, median us (--parts: graph build on the host, then its evaluation; "
                      + ("each build after its own step" if result.get("parts_order") == "own"
                         else "each build after whichever policy ran before it")
                      + ("; rounds in ABBA order)" if result.get("parts_rounds") == "abba" else ")"))
        for col in ("policy", "context", "graph build", "evaluation", "whole step", "build share"):
            split.add_column(col, justify="left" if col == "policy" else "right")
        for r in sorted(parted, key=lambda r: r["context"]):
            us = r["decode_step_us"]
            split.add_row(r["policy"], str(r["context"]), f"{us['build']:.0f}", f"{us['eval']:.0f}",
                          f"{us['whole']:.0f}", f"{us['build'] / us['whole']:.0%}")
        Console(highlight=False, width=112).print(split)


def bench(
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    contexts: Annotated[str, typer.Option(
        "--contexts", help="Comma list of prompt lengths to prefill.")] = "1024,4096",
    policies: Annotated[str, typer.Option(
        "--policies", help=f"Comma list of policies. Ours: {SPEC_HELP}. mlx-lm's: mlx (KVCache), "
        "mlx-rotatingN (RotatingKVCache(N, keep=4)), mlx-q8 / mlx-q4 (QuantizedKVCache). A spec of ours "
        "ending in @eager (e.g. sink4/window252@eager) runs its decode steps eagerly, without the compiled "
        "step over full StreamingLLM rings. "
        "The --reference policy always runs: ratios are against it.")] = defaults.BENCH_POLICIES,
    reference: Annotated[str, typer.Option(
        "--reference", help="The policy every ratio is against, in the same run (e.g. mlx-rotating256 for "
        "long contexts, where our fp32 full cache is slow to prefill).")] = defaults.BENCH_REFERENCE,
    decode_steps: Annotated[int, typer.Option(
        "--decode-steps", min=1, help="Greedy decode steps timed after each prefill; decode tok/s = 1 / median step. A "
        "KIVI + window policy's compiled step traces each of its ~2G step shapes the first time it meets it, so "
        "fewer than ~4G steps (128 at G 32) bill those traces to it (docs/results.md).")] = defaults.BENCH_DECODE_STEPS,
    prefill_chunk: c.PrefillChunk = None,
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", help="Write the rows as JSON to this path.", dir_okay=False)] = None,
    plot_path: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write a PNG: decode ms/token and cache MiB against context.", dir_okay=False)] = None,
    stages: Annotated[bool, typer.Option(
        "--stages", help="Retrieval policies also time their stages (model up to the query, coarse pass, "
        "gather from the cold store, attention) and print ms per token of each; every stage then ends "
        "in a sync, which those rows' tokens/s include.")] = False,
    parts: Annotated[bool, typer.Option(
        "--parts", help="Then split each policy's decode step, in --decode-steps more steps run interleaved "
        "(the policies' order shuffled every round with a fixed seed, so each build follows every other "
        "policy's evaluation), into building its graph on the host (the Python of the model and the cache) "
        "and evaluating it (the kernels): median microseconds of each. A step mostly build is bound by the "
        "host (not so for a retrieval policy with its cold store on disk, colddisk, whose build reads the "
        "query on the host and so waits for the layers before it).")] = False,
    parts_own: Annotated[bool, typer.Option(
        "--parts-own", help="--parts with each policy's build timed right after that policy's own step (a "
        "decode loop's order), not after whichever policy the shuffle put before it; the policies still "
        "shuffled every round. The JSON's parts_order says which.")] = False,
    abba: Annotated[bool, typer.Option(
        "--abba", help="--parts with the rounds stepping the policies in their given order and in its reverse in "
        "turn (A B, B A, A B, ...), not shuffled: each policy first as often as last. The JSON's parts_rounds "
        "says which.")] = False,
    grow_from: Annotated[Optional[int], typer.Option(
        "--grow-from", help="Prefill only this many tokens, then fill each cache to every --contexts value "
        "directly with copies of its own rows (a full cache's rows tiled, a retrieval cache's cold pages "
        "copied; not timed), as benchmarks/retrieval_bench.py --full does: a decode step's graph build and "
        "its evaluation's size follow the cache's counts and shapes, not the values it holds "
        "(docs/retrieval.md), so --parts at 32K on a 30-layer model needs no hour of prefill. Prefill tok/s "
        "is then over these tokens. Only our full caches (no eviction, no quantisation) and retrieval "
        "policies with exact cold rows in memory; more tokens than a retrieval policy keeps hot.")] = None,
) -> None:
    """Speed and memory of our cache policies beside mlx-lm's caches, on one model."""
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    c.check_writable(json_path, "--json")
    c.check_writable(plot_path, "--plot")
    chunk = c.prefill_chunk(prefill_chunk)
    # every value checked before the model loads: a bad one is a usage error (exit 2)
    ctx = _ints(contexts, "--contexts")
    specs = [s.strip() for s in policies.split(",") if s.strip()]
    if not specs:
        raise typer.BadParameter(f"no policy in {policies!r}", param_hint="'--policies'")
    for flag, names in (("--reference", [reference]), ("--policies", specs)):
        for s in names:
            with c.flag_value(flag):
                b.parse_spec(s)
    if grow_from is not None:   # (every policy fillable; the messages name the flags)
        with c.flag_value():
            b.check_grow([reference, *specs], ctx, grow_from)
    with c.guarded():
        if plot_path is not None:
            inputs.require_plotting()
        loaded = c.load_model(model, weights)
        err.print(f"[bold]bench[/bold] · model [cyan]{loaded.name}[/cyan] (context {loaded.context_length}) · "
                  f"contexts {ctx}")
        for s in dict.fromkeys([reference, *specs]):
            err.print(f"  {s}: [green]{b.make_policy(s, loaded.model).label}[/green]")
        with c.Progress("bench (warm-up, then timed prefill chunks and decode steps)", unit="steps") as bar:
            def advance(done: int, total: int, what: str) -> None:  # the live bar names the cell
                bar.update(done, total, f"bench · {what}" if bar.live else None)
            result = b.bench(loaded.model, specs, ctx, decode_steps, chunk,
                             progress=advance, reference=reference, stages=stages, parts=parts,
                             parts_own=parts_own, grow_from=grow_from, abba=abba)
        result["device"] = "cpu" if mx.default_device().type == mx.cpu else "gpu"
        for name, why in result["skipped"].items():
            err.print(f"[yellow]skipped[/yellow] {name}: {why}")
        print_table(result)
        result["model"] = loaded.name
        if json_path is not None:
            c.write_atomic(json_path, json.dumps(result, indent=2))
        if plot_path is not None:
            b.plot(result["rows"], plot_path)
            err.print(f"plot written to {plot_path}")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
