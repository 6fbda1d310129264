"""A streamed request's first token is written before the worker's next decode step (issue 56, TTFT).

The worker sends a request's first token to the event loop (`Worker._flush`) and then runs the
decode step of every stream, where a new batch layout may be traced: Python that holds the GIL,
which the loop needs at each iteration that takes the token to the socket. The worker now waits,
at most `worker.FIRST_OUT_S`, until the request's HTTP handler has written that text
(`Job.shown`, set by `streams.render`); these tests hold each part to it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.server import worker as worker_module
from tinygpt_mlx.server.app import create_app, serve_in_thread
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.streams import render
from tinygpt_mlx.server.worker import Job, Result, Worker

PROMPTS = ["The quick brown fox", "In the beginning was"]


@pytest.fixture(scope="module")
def native(native_path):
    from tinygpt_mlx.loading import load
    return load(native_path)


def _wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_the_next_decode_step_waits_until_the_first_token_is_written(native, monkeypatch):
    """A long answer streams; a short request's first token is sent; the worker runs no decode step
    (neither the long answer's nor the short one's) until the short request's text is written
    (`shown`, set here 0.2 s after its first text arrived), then both step on."""
    monkeypatch.setattr(worker_module, "FIRST_OUT_S", 30.0)
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=2)
    log: list = []
    real = w._decode
    w._decode = lambda feeding: (log.append(("decode", len(feeding))), real(feeding))[1]
    long = Job(native.tokenizer.encode(PROMPTS[0]), 10_000, temperature=0)
    long.emit = lambda kind, payload: None
    short = Job(native.tokenizer.encode(PROMPTS[1]), 6, temperature=0, shown=threading.Event())
    got: list = []
    helpers: list = []

    def written():          # the handler's part: the text written some time after it arrived
        time.sleep(0.2)
        log.append(("shown",))
        short.shown.set()

    def emit(kind, payload):
        got.append((kind, payload))
        if kind == "text" and sum(k == "text" for k, _ in got) == 1:
            log.append(("first text",))
            helpers.append(threading.Thread(target=written))
            helpers[-1].start()
    short.emit = emit
    try:
        w.submit(long)
        _wait_for(lambda: sum(e[0] == "decode" for e in log) >= 3, "the long answer's steps")
        w.submit(short)
        _wait_for(lambda: got and got[-1][0] == "done", "the short request")
    finally:
        long.cancel()
        w.stop()
        for h in helpers:
            h.join()
    first = log.index(("first text",))
    shown = log.index(("shown",))
    assert all(e[0] != "decode" for e in log[first:shown]), log[first:shown + 2]
    assert log[shown + 1] == ("decode", 2)            # then both step, as one batch
    assert got[-1][1].done_reason in ("stop", "length") and len(got[-1][1].tokens) >= 1


def test_the_wait_for_a_first_token_is_bounded(native, monkeypatch):
    """A handler that never says its text is written holds the worker `FIRST_OUT_S` at most: the
    request still runs to its end (a wait without its bound hangs here)."""
    monkeypatch.setattr(worker_module, "FIRST_OUT_S", 0.05)
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=2)
    job = Job(native.tokenizer.encode(PROMPTS[1]), 6, temperature=0, shown=threading.Event())
    got: list = []
    job.emit = lambda kind, payload: got.append((kind, payload))
    try:
        w.submit(job)
        _wait_for(lambda: got and got[-1][0] == "done", "the request", timeout=20.0)
    finally:
        if not (got and got[-1][0] == "done"):
            job.shown.set()     # free a worker that waits without a bound, so that this fails rather than hangs
        w.stop()
    assert not job.shown.is_set() and got[-1][1].done_reason in ("stop", "length")


def test_render_says_when_its_first_text_is_written():
    """`shown` is set once the consumer has taken the first text chunk and asked for the next (the
    response has sent it), not when it is yielded; set at the end too (nothing more to wait for)."""
    async def run():
        job = Job([1], 4, loop=asyncio.get_running_loop(), events=asyncio.Queue(), shown=threading.Event())
        for event in (("text", "a"), ("text", "b")):
            job.events.put_nowait(event)
        gen = render(job, lambda t: {"t": t}, lambda r: [{"done": True}], lambda e: {"error": e})
        first = await gen.__anext__()
        at_yield = job.shown.is_set()
        job.events.put_nowait(("done", Result()))
        rest = [obj async for obj in gen]
        return first, at_yield, job.shown.is_set(), rest
    first, at_yield, after, rest = asyncio.run(run())
    assert first == {"t": "ab"} and not at_yield and after and rest == [{"done": True}]

    async def silent():         # a request that ends with an error before any text: set at its end
        job = Job([1], 4, loop=asyncio.get_running_loop(), events=asyncio.Queue(), shown=threading.Event())
        job.events.put_nowait(("error", "boom"))
        out = [obj async for obj in render(job, lambda t: {"t": t}, lambda r: [], lambda e: {"error": e})]
        return out, job.shown.is_set()
    assert asyncio.run(silent()) == ([{"error": "boom"}], True)


def test_a_streamed_request_is_waited_for_and_one_not_streamed_is_not(native, monkeypatch):
    """Over HTTP: a streamed /api/generate's job carries `shown`, its handler sets it, and the
    worker's wait after its first token ends with it set (long before the bound); a request not
    streamed carries none and is not waited for."""
    monkeypatch.setattr(worker_module, "FIRST_OUT_S", 20.0)
    seen: list = []
    real = Worker._first_out

    def spy(self, started):
        t0 = time.perf_counter()
        real(self, started)
        for s in started:
            if s.out:
                seen.append((s.job.shown is not None and s.job.shown.is_set(), s.job.shown is None,
                             time.perf_counter() - t0))
    monkeypatch.setattr(Worker, "_first_out", spy)
    srv, thread, url = serve_in_thread(create_app(native, CacheConfig(), max_slots=2))
    try:
        body = {"model": native.name, "prompt": PROMPTS[0], "raw": True,
                "options": {"temperature": 0, "num_predict": 4}}
        with httpx.stream("POST", url + "/api/generate", json=body, timeout=60) as r:
            lines = list(r.iter_lines())
        assert lines and '"done":true' in lines[-1].replace(" ", "")
        streamed = list(seen)
        seen.clear()
        r = httpx.post(url + "/api/generate", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 200
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert len(streamed) == 1 and streamed[0][0] and streamed[0][2] < 10.0
    assert seen and all(not shown and none for shown, none, _ in seen)
