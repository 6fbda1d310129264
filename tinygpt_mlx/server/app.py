"""The ASGI app: ollama and OpenAI routes over one generation worker and a warm slot pool.

`create_app(loaded, cache_config, max_slots, prefill_chunk)` returns a FastAPI app. Every
request is validated (JSON, model name, options) before anything is queued or streamed, so
errors are plain JSON with a 4xx status; generation errors after streaming began arrive as a
final `{"error": ...}` line (ollama) or SSE event (OpenAI). A client that disconnects cancels
its job: a queued job is skipped, a running one stops at the next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Optional

import mlx.core as mx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import ollama as ol
from . import openai as oa
from . import prompt as pr
from ..cache.arrays import remove_private_dirs
from .config import ServerConfig
from .slots import SlotPool
from .worker import Job, Worker

log = logging.getLogger("posttrainllm.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_json(request: Request) -> dict:
    body = await request.body()
    if not body.strip():
        raise ApiError(400, "missing request body")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def probe(loaded: Any, cache_config: Any) -> None:
    """Run one token through a fresh cache so a policy the model cannot use fails at startup
    (e.g. a KIVI group size that does not divide the head dimension), not on the first request."""
    from ..cache import make_cache  # noqa: PLC0415
    from ..generate import prefill  # noqa: PLC0415
    token = loaded.tokenizer.eos_id if loaded.tokenizer.eos_id is not None else 0
    prefill(loaded.model, [token], make_cache(loaded.model, cache_config), 1)


class Server:
    """State shared by the routes: the model, its names, the pool and the worker."""

    def __init__(self, loaded: Any, cache_config: Any, max_slots: int, prefill_chunk: int,
                 small_tokens: int):
        self.loaded, self.cache_config = loaded, cache_config
        mx.eval(loaded.model.parameters())     # materialise before another thread uses them
        probe(loaded, cache_config)
        self.names = (loaded.name, f"{loaded.name}:latest")
        self.pool = SlotPool(loaded.model, cache_config, max_slots, small_tokens)
        self.worker = Worker(loaded, self.pool, prefill_chunk)
        self.started = time.time()

    def check_model(self, body: dict) -> str:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        if name not in self.names:
            raise ApiError(404, f"model '{name}' not found")
        return name

    def job(self, p: "pr.Fitted", s: dict, unbounded_default: int) -> Job:
        if not p.ids:
            raise ApiError(400, "the prompt is empty")
        max_tokens = pr.max_new_tokens(s.get("num_predict", s.get("max_tokens")), p.limit, len(p.ids),
                                       unbounded_default)
        seed = s["seed"]
        seed = None if seed is None or seed < 0 else seed % 2**64     # -1: random (llama.cpp's convention)
        return Job(p.ids, max_tokens, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                   seed=seed, stop=tuple(s["stop"]), max_context=p.limit, max_prompt=p.budget, text=p.text,
                   loop=asyncio.get_running_loop(), events=asyncio.Queue())

    def submit(self, job: Job) -> None:
        self.worker.submit(job)


def create_app(loaded: Any, cache_config: Any, max_slots: Optional[int] = None,
               prefill_chunk: Optional[int] = None, small_tokens: Optional[int] = None) -> FastAPI:
    """The app for `loaded` under `cache_config`; None means the `ServerConfig` default."""
    cfg = ServerConfig(**{k: v for k, v in dict(max_slots=max_slots, prefill_chunk=prefill_chunk,
                                                 small_request=small_tokens).items() if v is not None})
    srv = Server(loaded, cache_config, cfg.max_slots, cfg.prefill_chunk, cfg.small_request)

    @asynccontextmanager
    async def lifespan(app):
        yield
        srv.worker.stop()
        removed = remove_private_dirs()     # disk cold stores / KIVI shadows of the slots
        if removed:
            log.info("removed %d disk store directories", removed)

    app = FastAPI(title="posttrainllm", lifespan=lifespan)
    app.state.server = srv

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

    from . import routes  # noqa: PLC0415
    routes.register(app, srv)
    return app
