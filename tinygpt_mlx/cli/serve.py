"""`posttrainllm serve`: the ollama- and OpenAI-compatible HTTP server (uvicorn)."""

from __future__ import annotations

import copy
import errno
import logging
import os
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from tinygpt_mlx.config import CacheConfig, field_default
from tinygpt_mlx.lazy import lazy
from tinygpt_mlx.server.config import ServerConfig, check_names, listen_address

from . import common as c
from .common import err

# the library and the web stack, imported once the names resolve (see tinygpt_mlx/lazy.py)
server_app = lazy("tinygpt_mlx.server.app")
uvicorn = lazy("uvicorn")


_V = ServerConfig


#: `--log-level`'s values: uvicorn's (its own "trace" below debug), as `logging` levels for ours
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
              "info": logging.INFO, "debug": logging.DEBUG, "trace": 5}


def _log_level(value: str) -> str:
    """`--log-level` checked as click parses it (any case), before the model loads; lower case."""
    if value.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"choose one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


@c.with_cache_options
def serve(
    cache_config: CacheConfig,
    model: Annotated[Optional[list[str]], typer.Argument(
        help="The model(s) to serve, each as `sample` takes MODEL (a .tinygpt, GGUF or model directory, an "
        "ollama name, a Hugging Face repo id); several are all listed in /api/tags and loaded one at a time, "
        "on demand, like ollama. Default: the shipped model.", show_default=False)] = None,
    weights: c.Weights = "auto",
    host: Annotated[Optional[str], typer.Option(
        help=f"Address to listen on. Default: OLLAMA_HOST's host as `ollama serve` reads it (e.g. 127.0.0.1:11500, "
        f":11434 = every interface), else {field_default(_V, 'host')} (keep loopback unless you mean to share).",
        show_default=False)] = None,
    port: Annotated[Optional[int], typer.Option(
        help=f"TCP port. Default: OLLAMA_HOST's port, else {field_default(_V, 'port')} (ollama's, which clients "
        "expect; the ollama clients read OLLAMA_HOST too).",
        show_default=False)] = None,
    max_slots: Annotated[Optional[int], typer.Option(
        "--max-slots", help=f"Warm KV-cache slots kept between requests. Default {field_default(_V, 'max_slots')}.",
        show_default=False)] = None,
    small_request: Annotated[Optional[int], typer.Option(
        "--small-request", help="Prompts shorter than this (tokens) never evict a conversation that long "
        f"(UI title/tag requests). Default {field_default(_V, 'small_request')}.", show_default=False)] = None,
    prefill_chunk: c.PrefillChunk = None,
    prefill_tail: c.PrefillTail = None,
    prompt_cache: Annotated[Optional[list[Path]], typer.Option(
        "--prompt-cache", help="A prompt-cache file (posttrainllm cache-prompt) to pre-warm a slot with; repeatable. "
        "Its slot is reserved for it: a prompt starting with its document is answered without prefilling the "
        "document (made with the chat template: a message that is the document, a blank line and a question). "
        "The file's policy must be the served one, its model and chat template this model's.", exists=True,
        dir_okay=False, show_default=False)] = None,
    slot_dir: Annotated[Optional[Path], typer.Option(
        "--slot-dir", help="Keep the warm slots across restarts: at shutdown every slot's conversation is saved "
        "here (slot-N.ptc, prompt-cache files), and at start the saved ones are loaded back, so a conversation "
        "continues without its prefill. Files of another policy or model are skipped with a warning.",
        show_default=False)] = None,
    name: Annotated[Optional[list[str]], typer.Option(
        "--name", help="Serve the model under this name instead of its own (clients that hard-code one, "
        "e.g. llama3.2 or gpt-4o-mini); repeatable, in the order of the models.", show_default=False)] = None,
    default_max_tokens: Annotated[Optional[int], typer.Option(
        "--default-max-tokens", help="Longest reply to a request that sets no length (ollama num_predict "
        "-1 or absent, OpenAI chat without max_tokens); 0 = up to the context, as ollama does. "
        f"Default {field_default(_V, 'default_max_tokens')}.", show_default=False)] = None,
    default_num_ctx: Annotated[Optional[int], typer.Option(
        "--default-num-ctx", help="Context of a request without num_ctx (ollama's OLLAMA_CONTEXT_LENGTH). "
        "Default: the model's trained context for a full cache, unlimited under StreamingLLM or retrieval.",
        show_default=False)] = None,
    stop_loops: Annotated[Optional[int], typer.Option(
        "--stop-loops", help="Stop a reply once its last N tokens repeat one n-gram (of up to 64 tokens), "
        "e.g. 256; 0 = never (the default: a loop is the model's output).", show_default=False)] = None,
    slot_checkpoints: Annotated[Optional[int], typer.Option(
        "--slot-checkpoints", help="Checkpoints kept per slot for caches that cannot roll back (StreamingLLM, "
        "KIVI, retrieval): the cache at the end of each of the last N prompts, so that a regenerated or edited "
        "reply restores one instead of prefilling the whole conversation again. Each costs at most the window "
        "(or hot budget) plus KIVI's residual, per layer (shown in /api/ps); 0 = off. "
        f"Default {field_default(_V, 'slot_checkpoints')}.", show_default=False)] = None,
    parallel: Annotated[Optional[int], typer.Option(
        "--parallel", help="Requests answered at once (ollama's OLLAMA_NUM_PARALLEL), decoded together in one "
        "batched step; more wait in the queue. Each running request holds a cache of its own (its warm slot's, "
        "or a scratch one past --max-slots), so the K/V memory grows up to N x a request's: its context's tokens "
        "(a window under StreamingLLM), at the rate per token the start-up line prints; a request that would not "
        f"fit in the available memory waits too. Default {field_default(_V, 'parallel')}.",
        show_default=False)] = None,
    log_level: Annotated[str, typer.Option(
        "--log-level", help=f"uvicorn / server log level: {', '.join(LOG_LEVELS)}.",
        callback=_log_level)] = "info",
) -> None:
    """Serve MODEL over HTTP: the ollama API (/api/*) and the OpenAI API (/v1/*)."""
    c.check_writable_dir(slot_dir, "--slot-dir")
    if os.environ.get("OLLAMA_HOST", "").strip() and (host is None or port is None):
        try:                           # where `ollama serve` would listen; --host and --port win
            env_host, env_port = listen_address(os.environ["OLLAMA_HOST"])
        except ValueError as e:
            c.fail(str(e))
            raise typer.Exit(2) from None
        host = env_host if host is None else host
        port = env_port if port is None else port
    try:
        cfg = ServerConfig(**{k: v for k, v in dict(
            host=host, port=port, max_slots=max_slots, small_request=small_request,
            prefill_chunk=prefill_chunk, default_max_tokens=default_max_tokens,
            default_num_ctx=default_num_ctx, stop_loops=stop_loops,
            slot_checkpoints=slot_checkpoints, parallel=parallel, prefill_tail=prefill_tail).items()
            if v is not None})
    except ValueError as e:
        raise c.config_error(e) from None
    # every name resolved before anything heavy is imported or loaded
    specs = [c.resolve_model(spec) for spec in (model or [None])]
    with c.flag_value():   # (the messages name --name)
        check_names(name or (), len(specs))
    check_listen(cfg.host, cfg.port)    # (and the address free: no model load for a port in use)
    with c.guarded():
        others = specs[1:]
        loaded = c.load_model(specs[0], weights)
        logging.basicConfig(level=LOG_LEVELS[log_level], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        app = server_app.create_app(loaded, cache_config, max_slots=cfg.max_slots, prefill_chunk=cfg.prefill_chunk,
                         small_tokens=cfg.small_request, prompt_caches=prompt_cache or (), slot_dir=slot_dir,
                         others=others, weights=weights, default_max_tokens=cfg.default_max_tokens,
                         default_num_ctx=cfg.default_num_ctx, names=name or (), stop_loops=cfg.stop_loops,
                         slot_checkpoints=cfg.slot_checkpoints, parallel=cfg.parallel,
                         prefill_tail=cfg.prefill_tail)
        names = app.state.server.names
        err.print(f"[bold]posttrainllm serve[/bold] · model [cyan]{escape(names[1])}[/cyan] "
                  f"(also '{escape(names[0])}'), cache policy [green]{cache_config.label()}[/green], "
                  f"{cfg.max_slots} warm slot(s), prefill chunk {cfg.prefill_chunk}"
                  + (f", a prompt's last {cfg.prefill_tail} tokens apart" if cfg.prefill_tail else ""))
        admission = app.state.server.worker.admission
        windows = sum(w * b for w, b in admission.sliding)
        err.print(f"up to {cfg.parallel} request(s) at once (--parallel), each with its own cache: "
                  f"{admission.per_token * 1000 / 2**20:.1f} MiB of K/V per 1,000 tokens held at full precision"
                  + (f", plus {windows / 2**20:.1f} MiB at most in {len(admission.sliding)} sliding-window layers"
                     if admission.sliding else ""))
        limit = app.state.server.context_limit(None)
        err.print(f"requests without a length get at most "
                  f"{cfg.default_max_tokens or 'the context'} tokens (--default-max-tokens); without num_ctx "
                  f"a context of {limit if limit is not None else 'any length'} (--default-num-ctx)")
        for e in app.state.models.entries[1:]:
            err.print(f"also offered: [cyan]{escape(e.names[1])}[/cyan] ({escape(e.resolved.origin)}; loaded on "
                      "first request, in place of the resident model)")
        for d in app.state.server.pool.describe():
            if "prompt_cache" in d:
                err.print(f"slot {d['slot']} pre-warmed from {escape(d['prompt_cache'])}: {d['tokens']} tokens")
        for line in app.state.server.prewarm_notes:
            err.print(f"[dim]note:[/dim] {escape(line)}")
        for path in app.state.server.restored:
            err.print(f"restored a conversation from {escape(path)}")
        err.print(f"ollama API: http://{cfg.host}:{cfg.port}/api  ·  OpenAI API: http://{cfg.host}:{cfg.port}/v1")
        if not cfg.loopback:
            err.print(f"[yellow]warning:[/yellow] listening on {cfg.host}: anyone who can reach this port can "
                      "use the model (there is no authentication)")
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=log_level.lower(), log_config=log_config())


def log_config() -> dict:
    """uvicorn's logging, every line on stderr: its own sends the access log (a line per request)
    to stdout, where none of the server's diagnostics go (they are on stderr)."""
    out = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for handler in out["handlers"].values():
        if "stream" in handler:
            handler["stream"] = "ext://sys.stderr"
    return out


def check_listen(host: str, port: int) -> None:
    """Whether the server could listen on host:port now: a socket bound to each of its addresses
    the way uvicorn binds (asyncio's create_server: SO_REUSEADDR, IPv6 sockets v6-only, an address
    not available here skipped, at least one bound) and closed again. A port in use or a host that is not this machine's is
    one line naming the address and where it came from, exit code 1, before the model loads
    (uvicorn would say so only after loading it, below the banner, and exit 3)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        c.fail(f"cannot listen on {host}:{port}: host {host!r} is not known ({e.strerror}; --host or OLLAMA_HOST)")
        raise typer.Exit(1) from None
    bound, skipped = 0, None
    for family, kind, proto, _, address in infos:      # every address, as asyncio's create_server binds
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue        # (a family this machine lacks: asyncio skips it too)
        try:
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            bound += 1
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                skipped = e     # (e.g. localhost's ::1 with IPv6 off: asyncio skips it and binds the rest)
                continue
            why = ("the port is in use (another server listens there: stop it, or give another --port)"
                   if e.errno == errno.EADDRINUSE else f"{e.strerror} (--host, --port or OLLAMA_HOST)")
            c.fail(f"cannot listen on {host}:{port}: {why}")
            raise typer.Exit(1) from None
    if not bound:
        why = skipped.strerror if skipped is not None else "no address to bind"
        c.fail(f"cannot listen on {host}:{port}: {why} (--host, --port or OLLAMA_HOST)")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
