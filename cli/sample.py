"""`posttrainllm sample`: stream text from a model under any cache policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from tinygpt_mlx.config import CacheConfig, SampleConfig, field_default
from tinygpt_mlx.generate import stream_generate
from tinygpt_mlx.loading import load

from . import common as c
from .common import err

_S = SampleConfig


def banner(loaded, cache_config, sample_config, prompt_tokens: int) -> None:
    info = loaded.info
    err.print(f"[bold]posttrainllm[/bold] · model [cyan]{loaded.name}[/cyan] ({loaded.kind}, "
              f"{info.get('parameters', 0) / 1e6:.2f}M parameters, context {loaded.context_length})")
    err.print(f"cache policy: [green]{cache_config.label()}[/green]")
    s = sample_config
    err.print(f"sampling: temperature {s.temperature}, top-p {s.top_p}, top-k {s.top_k}, seed {s.seed}, "
              f"prompt {prompt_tokens} tokens, up to {s.max_tokens} new, prefill chunk {s.prefill_chunk}")


def print_report(r: dict) -> None:
    stored = f"stored {r['stored_count']}"
    if r["stored_count"] != r["current_length"]:
        stored += " (StreamingLLM cap)" if "streaming_llm" in r["policy"] else " (policy cap)"
    parts = ", ".join(f"{k} {c.fmt_bytes(v)}" for k, v in r["cache_bytes_breakdown"].items() if v)
    err.print(f"\n[bold]report[/bold]: prompt {r['prompt_tokens']} tokens, generated {r['generated_tokens']} "
              f"({r['finish_reason']}); prefill {r['prefill_tokens_per_s']:.1f} tok/s, "
              f"decode {r['decode_tokens_per_s']:.1f} tok/s")
    disk = r["cache_disk_bytes"]
    where = (f", {c.fmt_bytes(r['cache_bytes'] - disk)} in RAM + {c.fmt_bytes(disk)} memory-mapped on disk"
             if disk else "")
    err.print(f"cache: {c.fmt_bytes(r['cache_bytes'])}{where} over {r['layers_with_kv']} layers"
              f"{' (' + parts + ')' if parts else ''}; peak RSS {c.fmt_bytes(r['peak_rss_bytes'])}; currentLength {r['current_length']}, {stored}")


@c.with_cache_options
def sample(
    cache_config: CacheConfig,
    model: c.ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", help="Read the prompt from this UTF-8 file.", exists=True, dir_okay=False)] = None,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", "-n", help=f"Tokens to generate. Default {field_default(_S, 'max_tokens')}.",
        show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(
        help=f"Sampling temperature; 0 is greedy. Default {field_default(_S, 'temperature')}.",
        show_default=False)] = None,
    top_p: Annotated[Optional[float], typer.Option(
        "--top-p", help=f"Nucleus sampling mass. Default {field_default(_S, 'top_p')}.", show_default=False)] = None,
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", help="Keep only the k most likely tokens (0 = off).", show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(help="Random seed for reproducible sampling.")] = None,
    prefill_chunk: c.PrefillChunk = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Keep generating past the end-of-text token (for long runs).")] = False,
    report_json: Annotated[Optional[Path], typer.Option(
        "--report-json", help="Also write the report as JSON to this path.", dir_okay=False)] = None,
) -> None:
    """Generate text: banner and report on stderr, only the generated text on stdout."""
    if prompt is not None and prompt_file is not None:
        raise typer.BadParameter("give --prompt or --prompt-file, not both")
    try:
        sample_config = SampleConfig(**{k: v for k, v in dict(
            max_tokens=tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            prefill_chunk=prefill_chunk, ignore_eos=ignore_eos).items() if v is not None})
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    with c.guarded():
        text = prompt_file.read_text(encoding="utf-8") if prompt_file else (prompt or "")
        loaded = load(model)
        ids = loaded.tokenizer.encode(text) if text else []
        if not ids:
            bos = loaded.tokenizer.eos_id
            if bos is None:
                raise ValueError("the prompt is empty and the model has no BOS/EOS token to start from")
            ids = [bos]
        banner(loaded, cache_config, sample_config, len(ids))
        report = None
        for chunk in stream_generate(loaded, ids, cache_config, sample_config):
            if chunk.text:
                c.write_stdout(chunk.text)
            if chunk.done:
                report = chunk.stats.report()
        c.write_stdout("\n")
        print_report(report)
        if report_json is not None:
            report_json.write_text(json.dumps(report, indent=2))


def register(app: typer.Typer) -> None:
    app.command("sample")(sample)
