"""The one generation engine and what the server builds on it: worker errors, warm-slot reuse
of untrimmable caches against a cold prefill, and the shared stop-string hold-back."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from tinygpt_mlx import generate as engine
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.worker import Job, Worker
from tinygpt_mlx.textstream import TextStream

LONG = "The quick brown fox jumps over the lazy dog. In the beginning was the word. " * 3


def _run_jobs(worker: Worker, jobs: list[Job], timeout: float = 60) -> list[list[tuple]]:
    """Submit `jobs` to `worker`, wait for all; each job's events (kind, payload) in order."""
    events: list[list[tuple]] = []
    for job in jobs:
        got: list[tuple] = []
        job.emit = lambda kind, payload, got=got: got.append((kind, payload))
        events.append(got)
        worker.submit(job)
    deadline = time.time() + timeout
    while not all(e and e[-1][0] in ("done", "error") for e in events):
        assert time.time() < deadline, "the worker stopped answering"
        time.sleep(0.02)
    return events


def test_worker_error_answers_that_request_and_keeps_serving(native, monkeypatch):
    ids = native.tokenizer.encode(LONG)[:40]
    pool = SlotPool(native.model, CacheConfig(), max_slots=1)
    w = Worker(native, pool, 16)
    real, calls = engine.forward, []

    def flaky(model, tokens, cache, **kw):
        calls.append(tokens.shape[1])
        if len(calls) == 2:                      # the second prefill chunk of the first job
            raise RuntimeError("boom")
        return real(model, tokens, cache, **kw)

    monkeypatch.setattr(engine, "forward", flaky)
    try:
        failed, ok = _run_jobs(w, [Job(list(ids), 6, temperature=0), Job(list(ids), 6, temperature=0)])
    finally:
        w.stop()
    assert failed == [("error", "generation failed: boom")]
    done = ok[-1][1]
    assert ok[-1][0] == "done" and done.slot_action == "new"   # the broken slot was not reused
    with engine.make_cache(native.model, CacheConfig()) as cache:
        ref = engine.greedy_tokens(native.model, ids, cache, 6, 16)
    assert done.tokens == ref and done.text == "".join(p for k, p in ok if k == "text")


@pytest.mark.parametrize("cfg", [CacheConfig(key_bits=4),  # head dim 16: values stay exact
                                 CacheConfig(sink=4, hot_budget=32, page_size=8, top_pages=2)],
                         ids=["kivi", "retrieval"])
def test_warm_untrimmable_slot_gives_the_tokens_of_a_cold_prefill(native, cfg):
    """A second request continuing a warm KIVI slot's conversation gets exactly the tokens a
    fresh cache prefilled with the whole prompt gives; a retrieval slot's, the tokens of a
    fresh cache fed the same forward passes."""
    tok = native.tokenizer
    first = tok.encode(LONG)[:100]             # KIVI: blocks of 32 keys are packed

    def serve(prompts: list[list[int]]) -> list:
        w = Worker(native, SlotPool(native.model, cfg, max_slots=2), 16)
        try:
            return [e[-1][1] for e in _run_jobs(w, [Job(list(p), 8, temperature=0) for p in prompts])]
        finally:
            w.stop()

    (r1,) = serve([first])
    second = first + r1.tokens + tok.encode(" And the keeper of numbers?")
    warm = serve([first, second])[1]
    (cold,) = serve([second])
    assert cold.slot_action == "new" and cold.tokens
    reused = len(first) + len(r1.tokens) - 1
    assert (warm.slot_action, warm.reused_tokens) == ("extend", reused)
    if not cfg.retrieval:
        assert warm.tokens == cold.tokens
        return
    # Retrieval fetches one pool per forward pass (cache/cold.py), so what a prefill chunk's
    # queries see depends on the chunk: the warm slot equals a fresh cache fed the same passes
    # (the first prompt's chunks, then the answer one token at a time, then the rest).
    with engine.make_cache(native.model, cfg) as cache:
        engine.prefill(native.model, first, cache, 16)
        for t in r1.tokens[:-1]:
            engine.forward(native.model, mx.array([[t]]), cache)
        replay = engine.greedy_tokens(native.model, second[reused:], cache, len(warm.tokens), 16)
    assert warm.tokens == replay


def test_stop_strings_hold_back_only_a_possible_start(native):
    tok = native.tokenizer
    ids = tok.encode("the word was with the keeper")
    s = TextStream(tok, ("keeper", "xyz"))
    pieces = [s.add(t) for t in ids]
    assert s.stopped and "".join(pieces) == "the word was with the "
    assert s.finish() == ""
    free = TextStream(tok, ("xyz",))
    out = [free.add(t) for t in ids]
    assert "".join(out) + free.finish() == "the word was with the keeper"
    assert all(p == tok.decode([t]) for p, t in zip(out, ids) if "x" not in tok.decode([t]))
