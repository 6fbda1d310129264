"""`posttrainllm cache-report`: bytes each cache policy really holds, measured through the model."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tinygpt_mlx.evaluate.modes import parse_policies
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

report = lazy("tinygpt_mlx.cache.report")

# Two lengths by default: 20 s on the shipped model here (256, 1024, 4096 took 2 min 6 s); the bytes grow
# linearly past the first frozen blocks, and -l 4096 (repeatable) measures any other length.
DEFAULT_LENGTHS = (256, 1024)


def cache_report(
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    lengths: Annotated[Optional[list[int]], typer.Option(
        "--length", "-l", help=f"Stored length to measure (repeatable). Default {', '.join(map(str, DEFAULT_LENGTHS))}.",
        show_default=False)] = None,
    policies: Annotated[Optional[str], typer.Option(
        "--policies", help="Comma-separated policy specs to measure instead of the default rows, e.g. "
        "int4,int4+near256 (see `posttrainllm compare --help` for the spec's parts).", show_default=False)] = None,
    kv_group_size: c.KvGroup = None,
    kv_residual: c.KvResidual = None,
    prefill_chunk: c.PrefillChunk = None,
) -> None:
    """Fill fp32 / bf16 / int8 / int4 / int2 / K8-V4 caches (or --policies) with random tokens and print
    their bytes."""
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    lengths = lengths or list(DEFAULT_LENGTHS)
    if any(n < 1 for n in lengths):
        raise typer.BadParameter("--length must be positive")
    c.cache_config(group_size=kv_group_size, residual=kv_residual)  # flag errors before loading
    chunk = c.prefill_chunk(prefill_chunk)
    with c.flag_value("--policies"):
        chosen = parse_policies(policies) if policies else None
    check_rows(chosen, kv_group_size, kv_residual)
    with c.guarded():
        loaded = c.load_model(model, weights)
        vocab = loaded.tokenizer.vocab_size or loaded.info.get("config", {}).get("vocab_size")
        err.print(f"model [cyan]{loaded.name}[/cyan]: prefilling random tokens into each cache "
                  f"({len(chosen or report.REPORT_POLICIES)} policies, up to {max(lengths)} tokens each)")
        longest, policies_done = max(lengths), []

        def measured(label: str, n: int) -> None:  # after each (policy, length)
            if label not in policies_done:
                policies_done.append(label)
            bar.update((len(policies_done) - 1) * longest + n,
                       description=f"cache-report · {label}" if bar.live else None)
            if not bar.live:
                err.print(f"  {label}: {n} tokens measured")

        with c.Progress("cache-report: filling caches", total=len(chosen or report.REPORT_POLICIES) * longest, unit="tok") as bar:
            rows = report.bytes_table(loaded.model, vocab, lengths, policies=chosen, chunk=chunk,
                               group_size=kv_group_size, residual=kv_residual, progress=measured)
    table = Table(title=f"KV cache bytes, {loaded.name} (measured: cache.nbytes after filling)")
    table.add_column("policy")
    for n in sorted(set(lengths)):
        table.add_column(f"{n} tokens", justify="right")
    base = [r.nbytes for r in rows[0]]
    sliding = any(r.split.get("sliding") for row in rows for r in row)

    def cell(r, b) -> str:
        text = f"{c.fmt_bytes(r.nbytes)} ({r.nbytes / b:.3f}x)"
        if sliding:     # the split: the policy's global layers + the sliding-window layers' own rings
            text += f"\nglobal {c.fmt_bytes(r.split['global'])} + sliding {c.fmt_bytes(r.split['sliding'])}"
        return text
    for row in rows:
        table.add_row(row[0].policy, *(cell(r, b) for r, b in zip(row, base)))
    Console(highlight=False, width=200).print(table)
    if sliding:
        err.print("global: the layers under each policy; sliding: the sliding-window layers, each an exact "
                  "ring of its own window whatever the policy")


def check_rows(chosen: Optional[dict], group_size: Optional[int], residual: Optional[int]) -> None:
    """--kv-group-size / --kv-residual as every row will take them (`report.bytes_table` applies
    them to each), before the model loads: `--kv-group-size 64` alone leaves the rows' residual of
    32, which a KIVI row refuses. A bad combination is a usage error naming the flag (it was an
    `error: residual must be a multiple of group_size` after the model loaded and the first rows
    were measured)."""
    if group_size is None and residual is None:
        return
    for label, row in (chosen or report.REPORT_POLICIES).items():
        try:
            report.row_config(row, group_size=group_size, residual=residual)
        except ValueError as e:
            bad = c.config_error(e)
            bad.message = f"{bad.message} (row {label})"
            raise bad from None


def register(app: typer.Typer) -> None:
    app.command("cache-report")(cache_report)
