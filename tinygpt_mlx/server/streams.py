"""Turning a job's events into HTTP bodies: NDJSON (ollama), SSE (OpenAI) or one object."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from .worker import Job, Result


class ClientGone(Exception):
    """The client of a non-streamed request disconnected while it waited."""


class GenerationFailed(Exception):
    """The worker reported an error for this job."""


#: a streamed response with nothing to send for this long (a long prefill, a slow step) sends an
#: empty text chunk, so that clients and proxies with read timeouts keep the connection open
KEEPALIVE_S = 10.0


async def render(job: Job, text: Callable[[str], dict], done: Callable[[Result], list[dict]],
                 error: Callable[[str], dict]) -> AsyncIterator[dict]:
    """The job's events as response objects; closing this generator cancels the job. While the
    job is silent for `KEEPALIVE_S` (a multi-minute prefill of a long document), an empty text
    chunk (`text("")`) is sent each time: valid for ollama's NDJSON and OpenAI's SSE alike,
    and visible progress to a client that would otherwise time out. Text pieces that arrived
    together (the server's loop or the client fell behind the decode steps) go out as one
    chunk: one write instead of one per token, the same text. Once the first text chunk is
    written (this generator resumed after yielding it: the response has sent it), `job.shown`
    is set (the worker waits for it before its next decode step, `Worker._first_out`)."""
    events = job.events
    held = None          # an event taken while joining text pieces, handled next
    try:
        while True:
            if held is not None:
                (kind, payload), held = held, None
            elif not events.empty():
                kind, payload = events.get_nowait()
            else:
                try:
                    kind, payload = await asyncio.wait_for(events.get(), timeout=KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield text("")
                    continue
            if kind == "text":
                pieces = [payload]
                while held is None and not events.empty():
                    event = events.get_nowait()
                    if event[0] == "text":
                        pieces.append(event[1])
                    else:
                        held = event
                yield text(pieces[0] if len(pieces) == 1 else "".join(pieces))
                if job.shown is not None:
                    job.shown.set()         # (resumed: the chunk is written)
                continue
            for obj in (done(payload) if kind == "done" else [error(payload)]):
                yield obj
            return
    finally:
        if job.shown is not None:
            job.shown.set()                 # (nothing more will be written: never waited for)
        job.cancel()


async def collect(job: Job, request: Request, poll: float = 0.25) -> Result:
    """Wait for a non-streamed job; a client that goes away (checked every `poll` s) cancels it."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + poll
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=poll)
            except asyncio.TimeoutError:
                kind, payload = "", None
            if kind == "done":
                return payload
            if kind == "error":
                raise GenerationFailed(payload)
            if loop.time() >= next_check:
                next_check = loop.time() + poll
                if await request.is_disconnected():
                    raise ClientGone()
    finally:
        job.cancel()


def ndjson(gen: AsyncIterator[dict], headers: Optional[dict] = None) -> StreamingResponse:
    async def body():
        try:
            async for obj in gen:
                yield json.dumps(obj, ensure_ascii=False) + "\n"
        finally:
            await gen.aclose()          # runs the job's cancellation if the client went away
    return StreamingResponse(body(), media_type="application/x-ndjson", headers=headers)


def sse(gen: AsyncIterator[dict], headers: Optional[dict] = None) -> StreamingResponse:
    async def body():
        try:
            async for obj in gen:
                yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


def truncation_headers(truncated: Optional[dict]) -> dict:
    return {"X-Prompt-Truncated": json.dumps(truncated)} if truncated else {}
