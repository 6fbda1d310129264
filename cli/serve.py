"""`posttrainllm serve`: the ollama- and OpenAI-compatible HTTP server (uvicorn)."""

from __future__ import annotations

import logging
from typing import Annotated, Optional

import typer

from tinygpt_mlx.config import SampleConfig, field_default
from tinygpt_mlx.loading import load

from . import common as c
from .common import err


def serve(
    model: c.ModelArg = None,
    host: Annotated[str, typer.Option(help="Address to listen on (keep 127.0.0.1 unless you mean to share).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (11434 is ollama's, which clients expect).")] = 11434,
    max_slots: Annotated[int, typer.Option(
        "--max-slots", help="Warm KV-cache slots kept between requests (conversations served warm).")] = 2,
    small_request: Annotated[int, typer.Option(
        "--small-request", help="Prompts shorter than this (tokens) that match no slot never evict one "
        "(UI title/tag requests run in a scratch cache).")] = 256,
    prefill_chunk: c.PrefillChunk = None,
    kv_quantize: c.KvQuantize = None,
    kv_quantize_keys: c.KvKeys = None,
    kv_quantize_values: c.KvValues = None,
    kv_group_size: c.KvGroup = None,
    kv_residual: c.KvResidual = None,
    streaming_llm_sink: c.Sink = None,
    streaming_llm_window: c.Window = None,
    streaming_llm_rope: c.RopeMode = None,
    kiv_hot_budget: c.HotBudget = None,
    kiv_top_p: c.KivTopP = None,
    kiv_page_size: c.KivPage = None,
    kiv_top_pages: c.KivPages = None,
    kiv_summary: c.KivSummary = None,
    kiv_cold_store: c.KivColdStore = None,
    kiv_cold_path: c.KivColdPath = None,
    kiv_cold_bits: c.KivColdBits = None,
    kiv_positions: c.KivPositions = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn / server log level.")] = "info",
) -> None:
    """Serve MODEL over HTTP: the ollama API (/api/*) and the OpenAI API (/v1/*)."""
    cache_config = c.cache_config(
        kv_quantize, kv_quantize_keys, kv_quantize_values, kv_group_size, kv_residual,
        streaming_llm_sink, streaming_llm_window, streaming_llm_rope, kiv_hot_budget,
        kiv_top_p, kiv_page_size, kiv_top_pages, summary=kiv_summary, cold_store=kiv_cold_store,
        cold_path=kiv_cold_path, cold_bits=kiv_cold_bits, retrieved_position=kiv_positions)
    if max_slots < 1:
        raise typer.BadParameter("--max-slots must be >= 1")
    chunk = prefill_chunk if prefill_chunk is not None else field_default(SampleConfig, "prefill_chunk")
    if chunk < 1:
        raise typer.BadParameter("--prefill-chunk must be >= 1")
    with c.guarded():
        try:
            import uvicorn  # noqa: PLC0415

            from tinygpt_mlx.server import create_app  # noqa: PLC0415
        except ImportError as e:
            raise ValueError(f"the server needs its extras: pip install 'posttrainllm[serve]' ({e})") from None
        loaded = load(model)
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        app = create_app(loaded, cache_config, max_slots=max_slots, prefill_chunk=chunk,
                         small_tokens=small_request)
        err.print(f"[bold]posttrainllm serve[/bold] · model [cyan]{loaded.name}[/cyan] "
                  f"(also '{loaded.name}:latest'), cache policy [green]{cache_config.label()}[/green], "
                  f"{max_slots} warm slot(s), prefill chunk {chunk}")
        err.print(f"ollama API: http://{host}:{port}/api  ·  OpenAI API: http://{host}:{port}/v1")
        if host not in ("127.0.0.1", "localhost", "::1"):
            err.print(f"[yellow]warning:[/yellow] listening on {host}: anyone who can reach this port can use "
                      "the model (there is no authentication)")
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower())


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
