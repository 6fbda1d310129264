"""`posttrainllm cache-prompt`: prefill a document once under a cache policy and write the cache
to a prompt-cache file, for `sample --prompt-cache` and `serve --prompt-cache` to continue from
(docs/prompt-cache.md). A model with a chat template gets the document as the opening of the
user's message (chat_template.open_turn), as `sample` and `chat` would send it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from tinygpt_mlx.chat_template import PromptTurn, has_template, open_turn
from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err
from .sample import note, read_prompt_file

caches = lazy("tinygpt_mlx.cache")
generate = lazy("tinygpt_mlx.generate")
persist = lazy("tinygpt_mlx.cache.persist")


@c.with_cache_options
def cache_prompt(
    cache_config: CacheConfig,
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", "-p", help="The document to prefill, as text (or --prompt-file).", show_default=False)] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", help="The document to prefill, from a file (UTF-8, not empty; or --prompt).", exists=True,
        dir_okay=False, show_default=False)] = None,
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="The prompt-cache file to write (replaced atomically: an interrupted save leaves "
        "an existing file whole).", dir_okay=False, show_default=False)] = ...,
    prefill_chunk: c.PrefillChunk = None,
    report_json: Annotated[Optional[Path], typer.Option(
        "--report-json", help="Also write what was saved (tokens, bytes, timings) as JSON to this path.",
        dir_okay=False)] = None,
    system: Annotated[Optional[str], typer.Option(
        "--system", help="A system prompt: the chat template's system message before the document where the "
        "model has a template, else written before the document and a blank line. Saved in the file.")] = None,
    no_chat_template: Annotated[bool, typer.Option(
        "--no-chat-template", help="Save the document as raw text, even where the model has a chat template "
        "(continue it with sample --no-chat-template). By default a templated model's document opens the "
        "user's message, which the question given to sample --prompt-cache completes.")] = False,
) -> None:
    """Prefill a document (--prompt-file or --prompt) under the cache policy (with progress) and
    save the cache to --out.

    Where the model has a chat template, the document (trailing whitespace dropped) opens the
    user's message, as `sample` would send it: `sample --prompt-cache FILE --prompt QUESTION`
    adds a blank line and the question, closes the turn and opens the assistant's, so its
    answer is that of `sample --prompt "DOCUMENT<blank line>QUESTION"`. The file records the
    template, the system prompt and where the turn stands. --no-chat-template (or a model
    without a template) saves the text as written.

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
    if (prompt is None) == (prompt_file is None):
        raise typer.BadParameter("give the document as --prompt-file FILE or --prompt TEXT" if prompt is None
                                 else "give --prompt or --prompt-file, not both", param_hint="'--prompt-file'")
    if prompt is not None and not prompt:
        raise typer.BadParameter("the document is empty: cache-prompt needs a document to prefill",
                                 param_hint="'--prompt'")
    text = prompt if prompt is not None else read_prompt_file(prompt_file, "cache-prompt needs a document to prefill")
    source = str(prompt_file) if prompt_file is not None else "--prompt"
    with c.guarded():
        loaded = c.load_model(model, weights)
        templated = not no_chat_template and has_template(loaded.tokenizer)
        if templated:
            if not text.strip():
                raise ValueError(f"{source} holds only whitespace: there is no document to open the "
                                 "user's message with")
            ids, turn = open_turn(loaded.tokenizer, text, system)
        else:
            ids, turn = loaded.tokenizer.encode(f"{system}\n\n{text}" if system else text), PromptTurn()
        if not ids:
            raise ValueError(f"{source} encodes to no tokens")
        generate.check_context(len(ids), loaded.context_length, cache_config)
        err.print(f"[bold]posttrainllm cache-prompt[/bold] · model [cyan]{escape(loaded.name)}[/cyan] · "
                  f"policy [green]{escape(cache_config.label())}[/green] · {c.counted(len(ids), 'token')}")
        if templated:
            note("the document opens the user's message in the model's chat template; sample --prompt-cache "
                 "--prompt QUESTION completes it after a blank line (--no-chat-template: raw text)")
        elif has_template(loaded.tokenizer):
            note("the document is saved as raw text (--no-chat-template): continue it with sample --no-chat-template")
        with caches.make_cache(loaded.model, cache_config) as cache:
            t0 = time.perf_counter()
            with c.Progress("prefill", total=len(ids), unit="tok") as bar:
                logits = generate.prefill(loaded.model, ids, cache,
                                 cache_config.fitted_chunk(chunk, loaded.context_length, len(ids)), bar.update)
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            persist.save_prompt_cache(out, cache, loaded, ids, logits, chat=turn.as_dict())
            t_save = time.perf_counter() - t0
            report = {"path": str(out), "tokens": len(ids), "current_length": cache.current_length,
                      "stored_count": cache.stored_count, "cache_bytes": cache.nbytes,
                      "cache_bytes_breakdown": cache.nbytes_breakdown(), "file_bytes": out.stat().st_size,
                      "prefill_seconds": t_prefill, "save_seconds": t_save, "policy": cache_config.describe(),
                      "chat": {"template": turn.template, "turn": turn.turn, "system": turn.system}}
        err.print(f"saved {c.counted(len(ids), 'token')} (stored {report['stored_count']}, cache {c.fmt_bytes(report['cache_bytes'])}) "
                  f"to {escape(str(out))}: {c.fmt_bytes(report['file_bytes'])}; prefill {t_prefill:.2f} s, "
                  f"save {t_save:.2f} s")
        if report_json is not None:
            c.write_atomic(report_json, json.dumps(report, indent=2) + "\n")


def register(app: typer.Typer) -> None:
    app.command("cache-prompt")(cache_prompt)
