"""What the routes share: the `Server` (model, names, slot pool, worker), `ApiError` and
request parsing. Imported by `app` (which builds the FastAPI app) and `routes`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import mlx.core as mx
from fastapi import Request

from . import prompt as pr
from ..cache import make_cache
from ..generate import prefill
from .slots import SlotPool
from .worker import Job, Worker


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
    token = loaded.tokenizer.eos_id if loaded.tokenizer.eos_id is not None else 0
    with make_cache(loaded.model, cache_config) as cache:
        prefill(loaded.model, [token], cache, 1)


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
