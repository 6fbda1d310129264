"""The HTTP routes: ollama (`/`, `/api/*`) and OpenAI (`/v1/*`), plus `/api/slots` (pool state)."""

from __future__ import annotations

import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from .. import heap
from . import logprobs as lp
from . import ollama as ol
from . import openai as oa
from . import prompt as pr
from .models import Models
from .state import ApiError, Server, read_json
from .streams import (ClientGone, GenerationFailed, collect, ndjson, render, sse,
                      truncation_headers)


def _messages(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, "messages must be a list")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message must be an object with a string 'role'")
        out.append({"role": m["role"], "content": oa.message_text(m.get("content"))})
    return out


def _token_list(srv: Server, value: Any, what: str) -> list[int]:
    vocab = srv.loaded.info.get("config", {}).get("vocab_size")
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"{what} must be a list of token ids")
    if any(t < 0 or (vocab and t >= vocab) for t in value):
        raise ApiError(400, f"{what} holds a token id outside the vocabulary")
    return value


def _stream_flag(body: dict, default: bool) -> bool:
    v = body.get("stream")
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, "stream must be true or false")
    return v


async def _wait(job, request: Request):
    try:
        return await collect(job, request)
    except ClientGone:
        raise ApiError(499, "client disconnected") from None
    except GenerationFailed as e:
        raise ApiError(500, str(e)) from None


def register(app: FastAPI, models: Models) -> None:
    """The routes over `models`: a request naming a model gets its server (swapped in if another
    is resident); listings read every offered model from its file."""

    @app.get("/")
    @app.head("/")
    async def root():
        return PlainTextResponse("Ollama is running")

    @app.get("/api/version")
    async def version():
        return {"version": ol.VERSION}

    @app.get("/api/tags")
    async def tags():
        srv = models.resident
        rows = []
        for e in models.entries:
            if e.names == srv.names:
                rows.append(ol.model_entry(srv.loaded, srv.names[1]))
            else:
                rows.append(ol.listed_entry(e.names[1], e.size, e.modified, e.details))
        return {"models": rows or [ol.model_entry(srv.loaded, srv.names[1])]}

    @app.get("/api/ps")
    async def ps():
        srv = models.resident
        limit = srv.context_limit(None)
        return {"models": [ol.ps_entry(srv.loaded, srv.names[1], srv.pool.memory(),
                                       limit if limit is not None else ol.UNBOUNDED_ACCEPTS)]}

    @app.get("/api/slots")
    async def slots():
        srv = models.resident
        return {"slots": srv.pool.describe(), "queued": srv.worker.pending, "busy": srv.worker.busy,
                "running": len(srv.worker.running), "parallel": srv.worker.parallel,
                "batched_steps": srv.worker.batched_steps, "compiled": srv.worker.trace_counts(),
                "heap_mib": heap.usage(),
                "cache_policy": srv.cache_config.label(), "recent": list(srv.worker.recent),
                "model": srv.names[1], "model_swaps": models.swaps}

    @app.post("/api/show")
    async def show(request: Request):
        body = await read_json(request)
        if body.get("model") is None and body.get("name") is not None:
            body["model"] = body["name"]
        srv = await models.server(body)
        return ol.show(srv.loaded, srv.cache_config.label(), pr.template_text(srv.loaded))

    def _submit(srv: Server, body: dict, p: pr.Fitted, opts: dict, stream_default: bool, legacy: bool = False):
        """Queue the job; (stream?, job, truncation record, response headers)."""
        stream = _stream_flag(body, stream_default)
        try:
            opts["logprobs"] = lp.parse(body, legacy)
        except lp.LogprobError as e:
            raise ApiError(400, str(e)) from None
        if stream and opts["logprobs"] is not None:
            raise ApiError(400, "logprobs are given with stream: false only")
        job = srv.job(p, opts, ol.UNBOUNDED_PREDICT)
        if stream:      # (its handler says when its first text is written: `Worker._first_out`)
            job.shown = threading.Event()
        srv.submit(job)
        return stream, job, p.truncated, truncation_headers(p.truncated)

    async def _ollama_run(srv: Server, request: Request, body: dict, model: str, opts: dict, p: pr.Fitted,
                          chat: bool):
        stream, job, truncated, headers = _submit(srv, body, p, opts, True)

        def final(r, text):
            out = (ol.chat_final(model, r, text, truncated) if chat
                   else ol.generate_final(model, r, text, r.prompt_ids + r.tokens, truncated))
            if job.logprobs is not None:
                out["logprobs"] = lp.ollama(r.logprobs, srv.loaded.tokenizer)
            return out

        if stream:
            chunk = ol.chat_chunk if chat else ol.generate_chunk
            return ndjson(render(job, lambda t: chunk(model, t), lambda r: [final(r, "")],
                                 lambda e: {"error": e}), headers)
        r = await _wait(job, request)
        return JSONResponse(final(r, r.text), headers=headers)

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await read_json(request)
        srv = await models.server(body)
        model, loaded = body["model"], srv.loaded
        opts = ol.parse_options(body.get("options"))
        opts["num_predict"] = srv.bounded(opts["num_predict"])
        prompt, system = body.get("prompt") or "", body.get("system")
        if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
            raise ApiError(400, "prompt and system must be strings")
        context = _token_list(srv, body["context"], "context") if body.get("context") else []
        if not prompt and not context:
            _stream_flag(body, True)
            return JSONResponse(ol.load_only(model, chat=False))
        ids, text = pr.generate_ids(loaded, prompt, system, bool(body.get("raw")), context)
        limit = srv.context_limit(opts["num_ctx"])
        p = pr.fit_tokens(ids, text, limit, opts["num_predict"], opts["num_keep"])
        return await _ollama_run(srv, request, body, model, opts, p, chat=False)

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await read_json(request)
        srv = await models.server(body)
        model, loaded = body["model"], srv.loaded
        opts = ol.parse_options(body.get("options"))
        opts["num_predict"] = srv.bounded(opts["num_predict"])
        messages = _messages(body.get("messages"))
        if not messages:
            _stream_flag(body, True)
            return JSONResponse(ol.load_only(model, chat=True))
        limit = srv.context_limit(opts["num_ctx"])
        p, stops = pr.fit_chat(loaded, messages, limit, opts["num_predict"])
        opts["stop"] = tuple(opts["stop"]) + stops
        return await _ollama_run(srv, request, body, model, opts, p, chat=True)

    @app.get("/v1/models")
    async def v1_models():
        names = [e.names[1] for e in models.entries] or [models.resident.names[1]]
        return oa.models(names, int(models.resident.started))

    @app.get("/v1/models/{name}")
    async def v1_model(name: str):
        models.entry(name)
        return oa.models([name], int(models.resident.started))["data"][0]

    async def _openai_run(srv: Server, request: Request, body: dict, model: str, s: dict, p: pr.Fitted,
                          chat: bool):
        stream, job, truncated, headers = _submit(srv, body, p, s, False, legacy=not chat)
        cid = oa.new_id("chatcmpl" if chat else "cmpl")
        if stream:
            opts = body.get("stream_options") or {}
            with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            obj = "chat.completion.chunk" if chat else "text_completion"

            def text(t):
                return (oa.chat_chunk(cid, model, {"content": t}) if chat
                        else oa.completion_chunk(cid, model, t))

            def done(r):
                fin = oa.finish_reason(r)
                last = oa.chat_chunk(cid, model, {}, fin) if chat else oa.completion_chunk(cid, model, "", fin)
                return [last] + ([oa.usage_chunk(cid, model, obj, r)] if with_usage else [])

            gen = render(job, text, done, lambda e: oa.error(e, 500))
            if chat:
                gen = _prepend(oa.chat_chunk(cid, model, {"role": "assistant", "content": ""}), gen)
            return sse(gen, headers)
        r = await _wait(job, request)
        out = oa.chat_completion(cid, model, r, r.text) if chat else oa.completion(cid, model, r, r.text)
        if job.logprobs is not None:
            tok = srv.loaded.tokenizer
            out["choices"][0]["logprobs"] = (lp.openai_chat(r.logprobs, tok) if chat
                                             else lp.openai_completion(r.logprobs, tok))
        if truncated:
            out["truncated"] = truncated
        return JSONResponse(out, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        srv = await models.server(body)
        model, loaded = body["model"], srv.loaded
        s = oa.parse_sampling(body, None)
        s["max_tokens"] = srv.bounded(s["max_tokens"])
        messages = _messages(body.get("messages"))
        if not messages:
            raise ApiError(400, "messages must not be empty")
        p, stops = pr.fit_chat(loaded, messages, srv.context_limit(None), s["max_tokens"])
        s["stop"] = tuple(s["stop"]) + stops
        return await _openai_run(srv, request, body, model, s, p, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        srv = await models.server(body)
        model, loaded = body["model"], srv.loaded
        s = oa.parse_sampling(body, oa.DEFAULT_COMPLETION_TOKENS)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str) and p:
            ids, text = loaded.tokenizer.encode(p), p
        elif isinstance(p, list) and p:
            ids, text = _token_list(srv, p, "prompt"), None
        else:
            raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt)")
        p = pr.fit_tokens(ids, text, srv.context_limit(None), s["max_tokens"])
        return await _openai_run(srv, request, body, model, s, p, chat=False)

    @app.api_route("/api/{rest:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def unsupported(rest: str):
        raise ApiError(404, f"/api/{rest} is not supported by this server")


async def _prepend(first: dict, gen):
    try:
        yield first
        async for obj in gen:
            yield obj
    finally:
        await gen.aclose()

