"""The `posttrainllm` app: composes one typer module per command."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="posttrainllm",
    help="Long-context LLM sampling with MLX: StreamingLLM, KIVI and tiered retrieval in one KV cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Each module registers its command(s); a module that is not there yet simply adds none.
COMMANDS = ("sample", "info", "train", "compare", "perplexity", "bench", "cache_report", "needle", "serve")
for _name in COMMANDS:
    try:
        _mod = importlib.import_module(f"cli.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"cli.{_name}":
            raise
        continue
    _mod.register(app)

if __name__ == "__main__":
    app()
