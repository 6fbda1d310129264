"""`posttrainllm cache-prompt`: prefill a document once under a cache policy and write the cache
to a prompt-cache file, for `sample --prompt-cache` to continue from (docs/prompt-cache.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err
from .sample import read_prompt_file

caches = lazy("tinygpt_mlx.cache")
generate = lazy("tinygpt_mlx.generate")
persist = lazy("tinygpt_mlx.cache.persist")


@c.with_cache_options
def cache_prompt(
    cache_config: CacheConfig,
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    prompt_file: Annotated[Path, typer.Option(
        "--prompt-file", help="The document to prefill (UTF-8, not empty).", exists=True, dir_okay=False,
        show_default=False)] = ...,
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="The prompt-cache file to write (replaced atomically: an interrupted save leaves "
        "an existing file whole).", dir_okay=False, show_default=False)] = ...,
    prefill_chunk: c.PrefillChunk = None,
    report_json: Annotated[Optional[Path], typer.Option(
        "--report-json", help="Also write what was saved (tokens, bytes, timings) as JSON to this path.",
        dir_okay=False)] = None,
) -> None:
    """Prefill --prompt-file under the cache policy (with progress) and save the cache to --out.

    The file holds the stored K/V as the policy stores them (packed KIVI blocks stay packed, a
    disk cold store or shadow is written into it), the policy, the model's fingerprint, the
    token ids and the logits after the last one. Continue with
    `posttrainllm sample MODEL --prompt-cache FILE --prompt "question"`.
    """
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    chunk = prefill_chunk if prefill_chunk is not None else SampleConfig().prefill_chunk
    try:
        SampleConfig(prefill_chunk=chunk)
    except ValueError as e:
        raise c.config_error(e) from None
    c.check_writable(out, "--out")
    c.check_writable(report_json, "--report-json")
    text = read_prompt_file(prompt_file)
    with c.guarded():
        loaded = c.load_model(model, weights)
        ids = loaded.tokenizer.encode(text)
        if not ids:
            raise ValueError(f"{prompt_file} encodes to no tokens")
        generate.check_context(len(ids), loaded.context_length, cache_config)
        err.print(f"[bold]posttrainllm cache-prompt[/bold] · model [cyan]{escape(loaded.name)}[/cyan] · "
                  f"policy [green]{escape(cache_config.label())}[/green] · {len(ids)} tokens")
        with caches.make_cache(loaded.model, cache_config) as cache:
            t0 = time.perf_counter()
            with c.Progress("prefill", total=len(ids), unit="tok") as bar:
                logits = generate.prefill(loaded.model, ids, cache,
                                 cache_config.fitted_chunk(chunk, loaded.context_length, len(ids)), bar.update)
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            persist.save_prompt_cache(out, cache, loaded, ids, logits)
            t_save = time.perf_counter() - t0
            report = {"path": str(out), "tokens": len(ids), "current_length": cache.current_length,
                      "stored_count": cache.stored_count, "cache_bytes": cache.nbytes,
                      "cache_bytes_breakdown": cache.nbytes_breakdown(), "file_bytes": out.stat().st_size,
                      "prefill_seconds": t_prefill, "save_seconds": t_save, "policy": cache_config.describe()}
        err.print(f"saved {len(ids)} tokens (stored {report['stored_count']}, cache {c.fmt_bytes(report['cache_bytes'])}) "
                  f"to {escape(str(out))}: {c.fmt_bytes(report['file_bytes'])}; prefill {t_prefill:.2f} s, "
                  f"save {t_save:.2f} s")
        if report_json is not None:
            c.write_atomic(report_json, json.dumps(report, indent=2) + "\n")


def register(app: typer.Typer) -> None:
    app.command("cache-prompt")(cache_prompt)
