"""The ASGI app: ollama and OpenAI routes over one generation worker and a warm slot pool.

`create_app(loaded, cache_config, max_slots, prefill_chunk)` returns a FastAPI app; the worker
answers up to `parallel` requests at once (worker.py: continuous batching). Every
request is validated (JSON, model name, options) before anything is queued or streamed, so
errors are plain JSON with a 4xx status; generation errors after streaming began arrive as a
final `{"error": ...}` line (ollama) or SSE event (OpenAI). A client that disconnects cancels
its job: a queued job is skipped, a running one stops at the next token.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import ollama as ol
from . import openai as oa
from . import routes
from .config import ServerConfig, check_names
from ..loading import load
from .models import Models
from .state import ApiError, Server, names_for

log = logging.getLogger("posttrainllm.server")


def create_app(loaded: Any, cache_config: Any, max_slots: Optional[int] = None,
               prefill_chunk: Optional[int] = None, small_tokens: Optional[int] = None,
               prompt_caches: Sequence[Any] = (), slot_dir: Optional[Any] = None,
               others: Sequence[Any] = (), weights: str = "auto", default_max_tokens: Optional[int] = None,
               default_num_ctx: Optional[int] = None, names: Sequence[str] = (),
               stop_loops: Optional[int] = None, slot_checkpoints: Optional[int] = None,
               parallel: Optional[int] = None, prefill_tail: Optional[int] = None) -> FastAPI:
    """The app for `loaded` under `cache_config`; None means the `ServerConfig` default.
    `prompt_caches`: prompt-cache files, each loaded into a slot reserved for it (pre-warmed:
    a prompt that starts with its document is answered without prefilling the document); a file
    of another policy or model raises `PromptCacheError` (one line naming it) before serving.
    `slot_dir`: the conversations of the last run saved there are restored into slots now, and
    this run's are saved there at shutdown (`Server.save_slots`).
    `others`: more models to offer (`resolve.Resolved`), listed from their files and loaded on
    demand in place of the resident one (`models.Models`); `weights` is how GGUFs are held.
    `default_max_tokens`, `default_num_ctx`, `stop_loops`, `slot_checkpoints`, `parallel` (requests
    answered at once), `prefill_tail` (a prompt's last tokens as a pass of their own): see `ServerConfig`.
    `names`: what to call the models, in order (the rest keep their own names)."""
    cfg = ServerConfig(**{k: v for k, v in dict(max_slots=max_slots, prefill_chunk=prefill_chunk,
                                                 small_request=small_tokens, default_max_tokens=default_max_tokens,
                                                 default_num_ctx=default_num_ctx,
                                                 stop_loops=stop_loops, slot_checkpoints=slot_checkpoints,
                                                 parallel=parallel, prefill_tail=prefill_tail).items()
                                 if v is not None})
    renamed = rename(loaded, others, names)
    if renamed:
        loaded, others = renamed
    limits = dict(default_max_tokens=cfg.default_max_tokens, default_num_ctx=cfg.default_num_ctx,
                  stop_loops=cfg.stop_loops, slot_checkpoints=cfg.slot_checkpoints, parallel=cfg.parallel,
                  prefill_tail=cfg.prefill_tail)
    srv = Server(loaded, cache_config, cfg.max_slots, cfg.prefill_chunk, cfg.small_request, prompt_caches,
                 slot_dir, **limits)
    first = srv.names

    def make(resolved: Any) -> Server:
        again = names_for(resolved.name) == first        # the first model gets its slot files back
        loaded = load(resolved, weights)
        return Server(loaded, cache_config, cfg.max_slots, cfg.prefill_chunk, cfg.small_request, (),
                      slot_dir if again else None, **limits)

    models = Models(srv, others, make)

    @asynccontextmanager
    async def lifespan(app):
        yield
        # a swap in flight finished first (its thread's MLX work done, its server the resident)
        await models.settle()
        # the resident model's worker, slots (saved to --slot-dir) and caches (disk cold stores,
        # KIVI shadows removed); the model itself stays loaded for whoever passed it in
        resident = models.resident
        resident.worker.stop()
        try:
            resident.save_slots()
        finally:
            resident.pool.close()
            if resident is not srv:
                resident.loaded.close()

    app = FastAPI(title="posttrainllm", lifespan=lifespan)
    app.state.server = srv
    app.state.models = models

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        if request.url.path.startswith("/v1"):
            return JSONResponse(oa.error(e.message, e.status), status_code=e.status)
        return JSONResponse({"error": e.message}, status_code=e.status)

    @app.exception_handler(ol.OptionError)
    async def option_error(request: Request, e: ol.OptionError):
        return await api_error(request, ApiError(400, str(e)))

    @app.exception_handler(Exception)
    async def any_error(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return await api_error(request, ApiError(500, f"internal error: {e}"))

    routes.register(app, models)
    return app


def rename(loaded: Any, others: Sequence[Any], names: Sequence[str]):
    """(loaded, others) with the given names in place of their own (`serve --name`), or None."""
    if not names:
        return None
    check_names(names, 1 + len(others))
    if loaded.resolved is None:
        raise ValueError("--name needs a model loaded by tinygpt_mlx.loading.load")
    loaded.resolved = dataclasses.replace(loaded.resolved, name=names[0])
    others = [dataclasses.replace(r, name=n) for r, n in zip(others, names[1:])] + list(others[len(names) - 1:])
    return loaded, others


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", timeout: float = 20.0) -> tuple[Any, threading.Thread, str]:
    """Run `app` with uvicorn on a free port of `host` in a daemon thread (tests and benchmarks
    that talk to a live server): (the uvicorn server, its thread, the base URL), once it has
    started. Stop it with `server.should_exit = True` and `thread.join()`."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} did not start within {timeout:g} s")
        time.sleep(0.05)
    return server, thread, f"http://{host}:{port}"
