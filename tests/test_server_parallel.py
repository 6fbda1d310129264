"""`serve` answers several requests at once (issue #56): continuous batching with every policy.

The scheduler (server/worker.py) against the same worker with `parallel=1` (one request at a
time: what each request gets alone on an idle server), and the batched decode step
(server/batch.py) against each sequence's solo steps: greedy texts equal token for token for
full, KIVI int4, StreamingLLM and retrieval caches; the queue past --parallel and past the memory
budget; cancellation freeing the place; the real `ollama` and `openai` clients firing at once; a
load run with random cancels.

Mutations checked to fail here (one at a time, then reverted): `BatchLayer.offset` giving every
row the first sequence's position (both equality tests fail for every policy); `BatchLayer.attend`
handing every row the first sequence's mask (int4+sink+window fails: the other policies' decode
steps need no mask); the scheduler admitting one past `parallel` (the queue test sees 3
running); the scheduler never retiring a cancelled request (the cancel test times out); the
prefill taking the oldest prompt first (the long prefill is answered first); no reload of a busy
pre-warmed document (the other questions prefill it); the stacked attention without its padding
mask, the compiled full row's mask one slot short, a ring's stacked length taken as its whole
buffer, a filling ring's compiled row unmasked, the compiled rows attending as one without their
masks or in another order (the lockstep tests fail for the policies concerned);
Gemma 3's sliding rings beside retrieval in the compiled batched step with a row's ring write
slot one on (mod the window), the rows' rings handed over rotated (each row another's), the rings
at the global layers' position, their commit skipped (the Gemma lockstep test fails at absolute);
gemma3_text left out of BATCHED_MODEL_TYPES (the Gemma tests fail);
the worker never switching OpenBLAS to one thread for decode; `render` not joining waiting text
pieces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from tinygpt_mlx import blas
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import call, prefill
from tinygpt_mlx.server import batch
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.streams import render
from tinygpt_mlx.server.worker import Job, Worker

from prefilled import prefilled_pairs

PROMPTS = ["The quick brown fox jumps over", "In the beginning was the word, and",
           "Café, naïve, 東京 and emoji", "the keeper of numbers 0123456789 was"]
SINK, WINDOW, HOT = 4, 24, 24

POLICIES = {
    "full": CacheConfig(),
    "int4": CacheConfig(key_bits=4, value_bits=4),
    "sink+window": CacheConfig(sink=SINK, window=WINDOW),
    "int4+sink+window": CacheConfig(key_bits=4, value_bits=4, sink=SINK, window=WINDOW),
    "retrieval": CacheConfig(sink=SINK, hot_budget=HOT, page_size=8, top_pages=2),
}


def _run_jobs(worker: Worker, jobs: list[Job], timeout: float = 120) -> list[list[tuple]]:
    """Submit `jobs` at once and wait for all; each job's events (kind, payload) in order."""
    events: list[list[tuple]] = []
    for job in jobs:
        got: list[tuple] = []
        job.emit = lambda kind, payload, got=got: got.append((kind, payload))
        events.append(got)
    for job in jobs:
        worker.submit(job)
    deadline = time.time() + timeout
    while not all(e and e[-1][0] in ("done", "error") for e in events):
        assert time.time() < deadline, "the worker stopped answering"
        time.sleep(0.01)
    return events


def _serve_jobs(loaded, cfg, prompts, parallel, max_tokens=24, max_slots=2, **job_kw):
    w = Worker(loaded, SlotPool(loaded.model, cfg, max_slots=max_slots), 16, parallel=parallel)
    try:
        events = _run_jobs(w, [Job(loaded.tokenizer.encode(p), max_tokens, temperature=0, **job_kw)
                               for p in prompts])
        return [e[-1][1] for e in events], w.batched_steps
    finally:
        w.stop()


def lockstep(m, tokens: list, together: list, solo: list, tag: str) -> list:
    """One batched decode step of `together` held to each sequence's solo step on `solo` (within
    1e-5, the same greedy token); the next greedy tokens."""
    rows = batch.decode_step(m, tokens, together)
    want = [call(m, [t], c) for t, c in zip(tokens, solo)]
    for row, w in zip(rows, want):
        assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item(), tag
        assert mx.argmax(row).item() == mx.argmax(w).item(), tag
    return [int(t) for t in mx.argmax(rows, axis=-1).tolist()]


# ----- the batched step on its own --------------------------------------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
def test_batched_decode_step_equals_each_sequence_alone(native32, policy):
    """Four sequences of different lengths, one batched call per step: each row's logits equal
    that sequence's own solo step (the compiled one where its policy has one) to the last bit
    with MLX's reference BLAS, which multiplies B rows as B single rows; with OpenBLAS (the
    suite preloads it where there is one) a product of four rows and one of a single row may
    differ in the last bits, so there within 1e-5 (measured: 2.4e-6 at most) and the same
    greedy token."""
    m, tok, cfg = native32.model, native32.tokenizer, POLICIES[policy]
    exact = blas.loaded_openblas() is None
    prompts = [tok.encode(p * 3) for p in PROMPTS]            # past the windows and hot budgets
    solo, together, tokens = prefilled_pairs(m, prompts, cfg)
    for _ in range(12):
        rows = batch.decode_step(m, tokens, together)
        want = [call(m, [t], c) for t, c in zip(tokens, solo)]
        for row, w in zip(rows, want):
            if exact:
                assert mx.array_equal(row, w), policy
            assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item(), policy
            assert mx.argmax(row).item() == mx.argmax(w).item(), policy
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
    assert len({c.current_length for c in together}) > 2      # the rows sit at their own positions


@pytest.mark.parametrize("policy", ["sink+window", "retrieval"])
def test_windows_filling_step_compiled_as_each_sequence_alone(native32, policy):
    """Four short prompts whose windows (a StreamingLLM ring, retrieval's hot window) fill during
    the steps, then evict: the batched step runs compiled while they fill (the solo steps run
    eager there), then in the steady state, each row's logits within 1e-5 of its solo step's
    (the masked buffer's sums run longer) with the same greedy token, at every step."""
    m, tok, cfg = native32.model, native32.tokenizer, POLICIES[policy]
    prompts = [tok.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) < min(WINDOW, HOT)
    solo, together, tokens = prefilled_pairs(m, prompts, cfg)
    before = batch.taken.copy()
    for _ in range(40):
        tokens = lockstep(m, tokens, together, solo, policy)
    counts = batch.taken - before
    filling = counts["compiled_ring_filling" if policy == "sink+window" else "compiled_hot_filling"]
    assert filling >= WINDOW - max(len(p) for p in prompts) - 2, counts    # all but the first step or so
    assert counts["compiled"] >= 40 - 8, counts     # and steady after (a few eager: rows filling at their own steps)


def test_compiled_full_rows_attend_over_their_span_not_the_whole_warm_buffer(native32, monkeypatch):
    """Full caches trimmed back after a long request (a warm slot rolled back to a short prompt
    keeps its 512-slot buffers): the compiled batched step reads only each buffer's first
    `attention_span` slots (the power of two above the furthest row's write slot, at least
    MIN_SPAN), not all 512, and each row stays within 1e-5 of its solo step with the same greedy
    token while the furthest row passes 64 (the span goes 64 -> 128). Checked to fail: the span
    ending at the write slot (the new token unread: the lockstep fails), the span left out of the
    step (the spy reads 512), the row's mask one slot short (the lockstep fails)."""
    m, tok = native32.model, native32.tokenizer
    batch.forget(m)                           # traced here: the spy sees each layout's keys
    read = []
    real_kv = batch._TracedFull.kv
    monkeypatch.setattr(batch._TracedFull, "kv", lambda self: read.append(real_kv(self)[0].shape[2]) or real_kv(self))
    prompts = [tok.encode(p * 4)[:n] for p, n in zip(PROMPTS, (20, 33, 47, 55))]
    assert [len(p) for p in prompts] == [20, 33, 47, 55]
    long = tok.encode(" ".join(PROMPTS) * 12)[:300]
    assert len(long) == 300
    solo, together = [make_cache(m, CacheConfig()) for _ in prompts], [make_cache(m, CacheConfig()) for _ in prompts]
    tokens = []
    for ids, a, b in zip(prompts, solo, together):
        tokens.append(int(mx.argmax(prefill(m, ids, a, 16)).item()))
        prefill(m, ids + long, b, 64)         # the buffers grow to 512 slots,
        assert b.trim(len(long)) == len(long)  # then the long tail goes: the prompt alone again
        assert b.current_length == len(ids)
    sizes = {c.owned[0].body.keys.shape[2] for c in together}
    assert sizes == {512}, sizes
    before = batch.taken.copy()
    for _ in range(16):
        tokens = lockstep(m, tokens, together, solo, "full")
    assert (batch.taken - before)["compiled"] == 16
    assert set(read) == {64, 128}, sorted(set(read))     # the spans, never the 512-slot buffer
    assert [batch.attention_span(s) for s in (0, 63, 64, 127, 128, 300)] == [64, 64, 128, 128, 256, 512]


@pytest.mark.parametrize("policy", ["sink+window", "retrieval"])
def test_every_row_checked_before_any_rows_sink_is_placed(native32, policy, monkeypatch):
    """A batch whose last row cannot step compiled (retrieval: two rows' hot windows filling, the
    third steady, which `_hot_row` declines; StreamingLLM: two rings filling, the third not laid
    out as a ring yet, before its first decode step) runs eager, and `compiled_decode` places no
    row's sink before it knows that: the rows' eligibility is decided first, the sinks built only
    once every row passed. The eager mixed steps still equal each sequence alone; the same rows
    without the last one do place their sinks and step compiled (the spy sees the work)."""
    m, tok, cfg = native32.model, native32.tokenizer, POLICIES[policy]
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[3] * 3]
    together, tokens = _prefilled(m, tok, cfg, texts)
    solo, _ = _prefilled(m, tok, cfg, texts)
    placed = []

    def spy(layer):
        if policy == "retrieval":
            keep = layer.sink_store.segments
            monkeypatch.setattr(layer.sink_store, "segments", lambda *a: placed.append(layer) or keep(*a))
        else:
            keep = layer.body.placed_sink
            monkeypatch.setattr(layer.body, "placed_sink", lambda *a: placed.append(layer) or keep(*a))
    if policy == "sink+window":       # the two short rings laid out as rings by a decode step each
        tokens[:2] = lockstep(m, tokens[:2], together[:2], solo[:2], policy)
    first, second, last = together
    for c in (first, second):
        assert batch._row(c) is not None                       # eligible on their own
        for layer in c.owned:
            spy(layer)
    assert batch._row(last) is None, policy
    if policy == "retrieval":
        assert batch._retrieval_checked(last) is not None      # steady
        assert batch._retrieval_checked(first) is None         # filling
    ids = mx.array(tokens, dtype=mx.int32)[:, None]
    for _ in range(3 if policy == "retrieval" else 1):      # (the eager step lays the third ring out)
        assert batch.compiled_decode(m, ids, together) is None, policy
        assert placed == [], policy                             # nothing built for a step that runs eager
        tokens = lockstep(m, tokens, together, solo, policy)    # (eager: the mixed rows as each alone)
        placed.clear()                                          # (the eager step reads the sinks itself)
        ids = mx.array(tokens, dtype=mx.int32)[:, None]
    before = batch.taken.copy()
    tokens[:2] = lockstep(m, tokens[:2], together[:2], solo[:2], policy)
    assert (batch.taken - before)["compiled"] == 1 and len(placed) == 2 * len(first.owned), policy


def _prefilled(m, tok, cfg, texts):
    caches = [make_cache(m, cfg) for _ in texts]
    first = [int(mx.argmax(prefill(m, tok.encode(t), c, 64)).item()) for t, c in zip(texts, caches)]
    return caches, first


@pytest.mark.parametrize("policy", list(POLICIES))
def test_attention_across_sequences_equals_the_per_sequence_path(native32, policy):
    """The batched attention (batch.py: the compiled step over full caches and steady rings, one
    fused attention call over the sequences' K/V stacked and padded otherwise) against the
    per-sequence attention it replaces (`compiled=False, dense=False`), in lockstep (the same
    tokens fed): four sequences of very different lengths, one of them past its full buffer's
    first 256 slots (the others padded to it with zeros, the compiled step's layouts of two
    buffer sizes), one whose buffer fills during the steps (it grows: an eager step), the
    windows filling and wrapping. Every step's logits agree within 1e-5
    (the padded sums run longer: the last bits may differ) and give the same greedy token, and
    each path is taken where its policy has it."""
    m, tok, cfg = native32.model, native32.tokenizer, POLICIES[policy]
    texts = [PROMPTS[0] * 20, PROMPTS[1], PROMPTS[0] * 17, PROMPTS[3]]
    lengths = [len(tok.encode(t)) for t in texts]
    assert lengths[0] > 256 > lengths[2] > 250 > 20 > lengths[1]
    ref, tokens = _prefilled(m, tok, cfg, texts)
    # (steady: the compiled step as it was before windows filling were compiled, the bench's A/B)
    paths = {"stacked": dict(compiled=False), "compiled": {}, "steady": dict(compiled="steady")}
    runs = {name: _prefilled(m, tok, cfg, texts)[0] for name in paths}
    counts = {}
    for _ in range(40):
        want = batch.decode_step(m, tokens, ref, compiled=False, dense=False)
        for name, kw in paths.items():
            before = batch.taken.copy()
            got = batch.decode_step(m, tokens, runs[name], **kw)
            counts[name] = counts.get(name, batch.taken - batch.taken) + (batch.taken - before)
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), (policy, name)
            assert mx.argmax(got, axis=-1).tolist() == mx.argmax(want, axis=-1).tolist(), (policy, name)
        tokens = [int(t) for t in mx.argmax(want, axis=-1).tolist()]
    dense = policy in ("full", "sink+window")
    assert (counts["stacked"]["stacked"] > 0) == dense, counts       # one fused call per layer
    # (a full int4 cache's steps run compiled since 2026-12-06: its first steps before any block
    # froze, and its freezes and buffer growths done ahead where their shapes are traced, else
    # eager, batch.py `_compiled_kivi`)
    compiles = dense or policy in ("retrieval", "int4")
    assert (counts["compiled"]["compiled"] > 0) == compiles, counts  # the compiled batched step
    assert (counts["compiled"]["compiled_kivi"] + counts["compiled"]["kivi_ahead_eager"] == 40) == (policy == "int4"), \
        counts
    assert (counts["compiled"]["compiled_retrieval"] > 0) == (policy == "retrieval"), counts
    # a ring whose window is still filling (the short prompt's) steps compiled too
    assert (counts["compiled"]["compiled_ring_filling"] > 0) == (policy == "sink+window"), counts
    assert counts["steady"]["compiled_ring_filling"] == 0 and counts["steady"]["compiled_hot_filling"] == 0, counts
    if not dense:      # packed or retrieved data: each sequence attends on its own, as before
        assert counts["stacked"]["per_sequence"] > 0 and counts["compiled"]["per_sequence"] > 0


#: the batched retrieval step's configurations (`select_rows` over rows of one layout, and of
#: several): the coarse pass by min/max (spans, retrieved keys at one fixed slot), by the hybrid
#: of min/max and mean, the two-level page index (blocks of 2 pages, engaged past 8 pages: every
#: store here passes it), the retrieved keys at their page's slots ("page"), and rows of several
#: layouts (one short store, every page of it in the pool, then scanned flat, beside three
#: stores on the index: two groups every step), and at original positions (absolute), flat and indexed.
#: Packed cold rows (`cold_bits`) are out: the solo compiled step declines them
#: (cold_device.py `step_ready`), so the batched one does too.
RETRIEVAL_STEPS = {
    "minmax": (dict(), (3, 4, 5, 6)),
    "hybrid": (dict(summary="hybrid"), (3, 4, 5, 6)),
    "index": (dict(index_block=2, index_expand=1), (7, 9, 7, 7)),
    "page": (dict(retrieved_position="page"), (3, 4, 5, 6)),
    "layouts": (dict(index_block=2, index_expand=1, summary="hybrid"), (3, 9, 7, 7)),
    # original positions (absolute): nothing turned, the cold rows as the model rotated them
    "absolute": (dict(rope_mode="absolute"), (3, 4, 5, 6)),
    "absolute-index": (dict(rope_mode="absolute", index_block=2, index_expand=1), (7, 9, 7, 7)),
}


@pytest.mark.parametrize("case", list(RETRIEVAL_STEPS))
def test_batched_retrieval_picks_what_each_sequence_picks_alone(native32, case):
    """Retrieval's steady steps of four sequences as one compiled batched call (batch.py
    `_compiled_retrieval`: each row evicts into its own cold store; the coarse pass, pool and
    fine pick run once over the rows stacked, each row gathering from its own store; one
    attention call) against each sequence stepped alone (its compiled solo step), in lockstep
    over 48 steps: pages complete at the rows' own phases (an eviction ahead in some rows and
    not others, rows reordered by layout), the cold stores grow past the coarse pass's pages.
    Every layer of every row picks the same cold tokens as alone and scores as many, its logits
    agree within 1e-5 and give the same greedy token; the batched call ran for most steps, its
    selection and attention stacked across the rows (one group) in most of them, where the rows
    share a layout, and in more than one group where they do not ("layouts"); it traced a few
    layouts, not one per step (`traced`)."""
    m, tok = native32.model, native32.tokenizer
    extra, repeats = RETRIEVAL_STEPS[case]
    cfg = CacheConfig(sink=SINK, hot_budget=HOT, page_size=8, top_pages=2, sticky=True, **extra)
    prompts = [tok.encode(p * k) for p, k in zip(PROMPTS, repeats)]
    solo, together, tokens = prefilled_pairs(m, prompts, cfg)
    assert all(c.compiled_step == "retrieval" for c in solo)
    picks: dict = {}

    def recording(cache, name):
        cache.record_retrievals()       # (off by default: the picks are read through the records)
        for j, layer in enumerate(cache.owned):
            def record(s, j=j, keep=layer.telemetry.record):
                picks.setdefault((name, j), []).append(([r.tolist() for r in s.fetched()], int(s.tokens_scored)))
                keep(s)
            layer.telemetry.record = record
    for i, (a, b) in enumerate(zip(solo, together)):
        recording(a, ("solo", i))
        recording(b, ("batch", i))
    assert len({len(c.owned[0].cold) % 8 for c in together}) > 1     # the rows' pages complete at their own steps
    indexed = [c.owned[0].cold.index.uses_index() for c in together]
    on_index = [False, True, True, True] if case == "layouts" else [case in ("index", "absolute-index")] * 4
    assert indexed == on_index, indexed
    batch.forget(m)         # (traces of this file's other tests would not be made again)
    before, failed, traced = batch.taken.copy(), dict(batch._failed), batch.traced.copy()
    several = 0         # steps whose rows selected and attended in more than one group
    for _ in range(48):
        was = batch.taken.copy()
        rows = batch.decode_step(m, tokens, together)
        want = [call(m, [t], c) for t, c in zip(tokens, solo)]
        step = batch.taken - was
        several += step["retrieval_groups"] > step["compiled_retrieval"]
        for row, w in zip(rows, want):
            assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item()
            assert mx.argmax(row).item() == mx.argmax(w).item()
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
    done = batch.taken - before
    assert done["compiled_retrieval"] >= 40, done
    if case == "layouts":
        assert several >= 40, (several, done)        # the short store's row in a group of its own
    else:
        assert done["retrieval_groups"] < 1.5 * done["compiled_retrieval"], done    # mostly all four as one
    assert batch._failed == failed                                          # no trace fell back
    # a trace per layout: a new one where a row's page completes (its step evicts ahead), a
    # summary's width doubles or a store passes a regime; four rows at their own phases, sorted by
    # layout: measured 3-7 traces over the 48 steps (one per step without the traces kept: 48)
    assert 0 < (batch.traced - traced)["retrieval"] <= 12, batch.traced - traced
    for i in range(len(prompts)):
        for j in range(len(together[i].owned)):
            got, alone = picks[(("batch", i), j)], picks[(("solo", i), j)]
            assert len(got) == len(alone) == 48
            assert got == alone, (i, j)
    assert min(len(c.owned[0].cold) for c in together) > 2 * 8 * cfg.top_pages   # past the coarse pass's pages


def _traced_layouts(monkeypatch) -> list:
    """The batched retrieval layouts (keys) traced from here on, in order (a spy on
    `batch._retrieval_step` that notes each key not yet cached)."""
    layouts: list = []
    make = batch._retrieval_step

    def traced(model, key, caches):
        if batch._cached(model, key) is None:
            layouts.append(key)
        return make(model, key, caches)
    monkeypatch.setattr(batch, "_retrieval_step", traced)
    return layouts


def _rows_completing_apart(native32) -> tuple:
    """Four retrieval rows (pages of 8, two top pages, sticky) whose pages complete at their own
    steps, each beside its solo twin, every layer's picks recorded: (model, solo, together,
    tokens, picks, prompts)."""
    m, tok = native32.model, native32.tokenizer
    cfg = CacheConfig(sink=SINK, hot_budget=HOT, page_size=8, top_pages=2, sticky=True)
    prompts = [tok.encode(p * k) for p, k in zip(PROMPTS, (2, 3, 4, 5))]
    solo, together, tokens = prefilled_pairs(m, prompts, cfg, fresh=True)
    assert len({len(c.owned[0].cold) % 8 for c in together}) > 1     # the rows' pages complete at their own steps
    picks: dict = {}
    for i, (a, b) in enumerate(zip(solo, together)):
        _recording_picks(a, ("solo", i), picks)
        _recording_picks(b, ("batch", i), picks)
    return m, solo, together, tokens, picks, prompts


def test_batched_retrieval_rows_evict_as_one_kind_per_step(native32, monkeypatch):
    """A row's eviction in the trace is part of the batched retrieval step's layout (the row key),
    so four rows whose pages complete at their own steps (a page-completing row evicts ahead, the
    others in the trace) made a layout, and a trace held, per mix of kinds (`_one_eviction_kind`).
    Now a step where any row evicts ahead evicts ahead for every row: in lockstep with each
    sequence alone over 48 steps, the same logits within 1e-5 and greedy tokens, every layer's
    picks and scored count equal to its solo step's, and every layout traced has rows of one
    eviction kind (8 layouts here, both kinds). (Fails with `ONE_EVICTION_KIND` False: layouts of
    mixed kinds.) The rule of steps without `SCRATCH_EVICTIONS` (turned off here), where a row
    evicted ahead steps as one that evicts nothing."""
    monkeypatch.setattr(batch, "SCRATCH_EVICTIONS", False)
    m, solo, together, tokens, picks, prompts = _rows_completing_apart(native32)
    layouts = _traced_layouts(monkeypatch)
    before, failed = batch.taken.copy(), dict(batch._failed)
    for _ in range(48):
        tokens = lockstep(m, tokens, together, solo, "one eviction kind")
    assert (batch.taken - before)["compiled_retrieval"] >= 40, batch.taken - before
    assert batch._failed == failed
    kinds = [tuple(row[3] for row in key[2]) for key in layouts]
    assert {True, False} <= {k for ks in kinds for k in ks}, kinds       # both kinds occurred
    assert all(len(set(ks)) == 1 for ks in kinds), kinds
    for i in range(len(prompts)):
        for j in range(len(together[i].owned)):
            assert picks[(("batch", i), j)] == picks[(("solo", i), j)], (i, j)


def test_batched_retrieval_rows_evicted_ahead_step_as_evicting_ones(native32, monkeypatch):
    """`SCRATCH_EVICTIONS`: a row whose page completes evicts its token eagerly (as its solo step
    does) and then steps as an evicting row all the same, its trace's eviction written as a scratch
    row past its cold store's count, so no other row of the step is evicted eagerly for it. Four
    rows whose pages complete at their own steps, 48 steps in lockstep with each sequence alone:
    the same logits within 1e-5 and greedy tokens, every layer's picks and scored counts equal to
    its solo step's; every layout traced has every row evicting in the trace; and each row
    evicts eagerly at exactly the steps its solo twin does (its own page completions), never at
    another row's. (Fails with the flag off: rows evicted eagerly at other rows' completions; with
    the scratch row written at the count's last row or counted: the logits and picks part.)"""
    m, solo, together, tokens, picks, prompts = _rows_completing_apart(native32)
    whose = {id(layer): (side, i) for side, caches in (("solo", solo), ("batch", together))
             for i, c in enumerate(caches) for layer in c.owned}
    eager: dict = {"solo": set(), "batch": set()}
    step = [0]
    evict_ahead = type(together[0].owned[0]).evict_ahead

    def spy(layer, plan):
        if plan.drop:
            side, i = whose[id(layer)]
            eager[side].add((i, step[0]))
        return evict_ahead(layer, plan)
    monkeypatch.setattr(type(together[0].owned[0]), "evict_ahead", spy)
    layouts = _traced_layouts(monkeypatch)
    before, failed = batch.taken.copy(), dict(batch._failed)
    for step[0] in range(48):
        tokens = lockstep(m, tokens, together, solo, "scratch evictions")
    assert (batch.taken - before)["compiled_retrieval"] >= 40, batch.taken - before
    assert batch._failed == failed
    assert layouts and all(row[3] for key in layouts for row in key[2]), layouts
    assert len({i for i, _ in eager["solo"]}) == 4, eager       # every row completed pages during the steps
    assert eager["batch"] == eager["solo"], (sorted(eager["batch"] - eager["solo"]), sorted(eager["solo"] - eager["batch"]))
    for i in range(len(prompts)):
        for j in range(len(together[i].owned)):
            assert picks[(("batch", i), j)] == picks[(("solo", i), j)], (i, j)


def test_bench_mixed_evictions_only_in_process(native32_path, monkeypatch, capsys):
    """bench_server_parallel --mixed-evictions (the A/B of `ONE_EVICTION_KIND`) sets the batched
    step's rule in the bench's own process only: with an HTTP part it is refused in one line naming
    it, before any part runs, the rule unchanged. (Fails without the check: the bench goes on.)"""
    from benchmarks import bench_server_parallel as bench

    def went_on(*args, **kwargs):
        raise AssertionError("the bench went on past --mixed-evictions")
    monkeypatch.setattr(bench, "start_server", went_on)
    monkeypatch.setattr(bench, "engine", went_on)
    # (the rule restored after the test whatever the bench did to it: broken, it turns it off)
    monkeypatch.setattr(batch, "ONE_EVICTION_KIND", batch.ONE_EVICTION_KIND)
    monkeypatch.setattr(batch, "SCRATCH_EVICTIONS", batch.SCRATCH_EVICTIONS)
    monkeypatch.setattr(sys, "argv", ["bench_server_parallel", str(native32_path), "--mixed-evictions"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--mixed-evictions applies to the in-process parts only: use it with --only worker or --only engine")
    assert batch.ONE_EVICTION_KIND and batch.SCRATCH_EVICTIONS


def test_batched_retrieval_rows_of_several_sticky_widths_step_compiled(native32, monkeypatch):
    """Four retrieval caches prefilled with prompts of 60 to 101 random tokens: their first passes
    picked sticky pages of several widths (a short store's pool holds fewer pages), which do not
    stack; each width selects as a group of its own (`_group`: the row key holds the width). In
    lockstep with each sequence alone over 24 steps: the same logits within 1e-5 and greedy
    tokens, no trace failed, the compiled batched retrieval step ran. (Fails without the width in
    the row key: the trace's concatenation of the sticky pages fails, the layout runs eager.)"""
    m = native32.model
    cfg = CacheConfig(sink=SINK, hot_budget=HOT, page_size=8, top_pages=2, sticky=True)
    rs = np.random.RandomState(0)
    prompts = [[int(x) for x in rs.randint(1, 300, size=n)] for n in (60, 77, 90, 101)]
    solo, together, tokens = prefilled_pairs(m, prompts, cfg, fresh=True)
    widths = set()
    real = batch.step_inputs

    def spy(layers, plans, *scratch):
        out = real(layers, plans, *scratch)
        widths.add(out[2][0]["recent"].shape)
        return out
    before, failed = batch.taken.copy(), dict(batch._failed)
    monkeypatch.setattr(batch, "step_inputs", spy)
    for _ in range(24):
        tokens = lockstep(m, tokens, together, solo, "widths")
    assert len(widths) > 1, widths              # (the case: rows of several sticky widths)
    assert batch._failed == failed
    assert (batch.taken - before)["compiled_retrieval"] >= 12, batch.taken - before



def _recording_picks(cache, name, picks: dict) -> None:
    """Record every retrieval pick of `cache`'s layers under (name, layer) in `picks`: the cold
    rows fetched and the tokens scored (the telemetry's records, on for this)."""
    cache.record_retrievals()
    for j, layer in enumerate(cache.owned):
        def record(s, j=j, keep=layer.telemetry.record):
            picks.setdefault((name, j), []).append(([r.tolist() for r in s.fetched()], int(s.tokens_scored)))
            keep(s)
        layer.telemetry.record = record


@pytest.mark.parametrize("case", ["first eviction", "body moved", "cold rows grown"])
def test_batched_retrieval_steps_ahead_compiled_as_each_alone(native32, case):
    """Three steps of a retrieval row that the solo step runs eager, and that sent the whole batched
    step eager (most of bench_server_parallel's 24 eager batched retrieval steps in 1,020, session 38): the first
    eviction into a still empty cold store ("first eviction": four short prompts whose hot windows
    fill at their own steps), a step whose hot window's buffers have no room for the token (the
    live tokens moved to the front of new buffers: "body moved", prompts that leave the window near
    its buffer's end) and one whose cold rows' arrays are full (their capacity doubled: "cold rows
    grown", prompts that leave the cold stores near their 256 rows). Serve's batched step now does
    that eagerly first (compiled_retrieval.py `ready_ahead`) and runs the step compiled: every step where no row's
    hot window is still filling runs the compiled batched retrieval step, the case occurred in
    it, and in lockstep with each sequence alone every row's logits are within 1e-5 with the same
    greedy token, and every layer picks the same cold tokens and scores as many. (Fails without
    `ready_ahead`: those steps eager; with the first eviction evicted again in the trace, the
    moved body's tokens not copied, or the rows grown ahead not copied: the logits part; without the
    cold rows grown ahead the process crashes, the trace writing past the arrays.)"""
    m, tok = native32.model, native32.tokenizer
    cfg = CacheConfig(sink=SINK, hot_budget=HOT, page_size=8, top_pages=2, sticky=True)
    if case == "first eviction":
        prompts = [tok.encode(p)[:n] for p, n in zip(PROMPTS, (6, 9, 12, 15))]
        assert max(len(p) for p in prompts) < HOT
        steps = 40
    else:       # (the body's buffers fill at 256 slots, the cold rows' arrays at 256 rows)
        rs = np.random.RandomState(2)
        sizes = (236, 241, 246, 250) if case == "body moved" else (262, 266, 270, 274)
        prompts = [[int(x) for x in rs.randint(1, 300, size=n)] for n in sizes]
        steps = 40
    solo, together, tokens = prefilled_pairs(m, prompts, cfg, fresh=True)
    picks: dict = {}
    for i, (a, b) in enumerate(zip(solo, together)):
        _recording_picks(a, ("solo", i), picks)
        _recording_picks(b, ("batch", i), picks)
    seen = {"first eviction": 0, "body moved": 0, "cold rows grown": 0}
    failed = dict(batch._failed)
    for _ in range(steps):
        filling = any(batch._hot_row(c.owned) is not None or len(c.owned[0].body) < HOT for c in together)
        for c in together:
            first = c.owned[0]
            if first.plan().drop == 1 and len(first.body) == HOT:
                seen["first eviction"] += len(first.cold) == 0
                seen["body moved"] += not first.body.fits(1)
                seen["cold rows grown"] += first.cold.keys is not None and len(first.cold) == first.cold.keys.capacity
        was = batch.taken.copy()
        tokens = lockstep(m, tokens, together, solo, case)
        if not filling:
            assert (batch.taken - was)["compiled_retrieval"] == 1, (case, batch.taken - was)
    assert seen[case] >= 4, seen           # (every row passed it during the steps)
    assert batch._failed == failed
    for i in range(len(prompts)):
        for j in range(len(together[i].owned)):
            assert picks[(("batch", i), j)] == picks[(("solo", i), j)], (i, j)


def test_batched_retrieval_step_turns_with_the_rope_products(native32, monkeypatch):
    """serve's compiled batched retrieval step traces the model's RoPE as products, each row by
    the matrix of its own position (rope_products with the rows' offsets [B], batch.py
    `_retrieval_step`), as the solo step does with its one offset: while four steady rows step
    compiled, `rope_matrix` is asked for the rows' matrices (a vector of offsets, one per row), and
    the rows keep each one's solo logits (`lockstep`). (Fails with the step traced outside
    `rope_products.products`: every call is then the RoPE's own, no matrix is made; the logits
    agree either way, so only this test sees it.)"""
    from tinygpt_mlx.cache import rope_products

    m = native32.model
    cfg = CacheConfig(sink=SINK, hot_budget=HOT, page_size=8, top_pages=2, sticky=True)
    rs = np.random.RandomState(1)
    prompts = [[int(x) for x in rs.randint(1, 300, size=90)] for _ in range(4)]
    solo, together, tokens = prefilled_pairs(m, prompts, cfg, fresh=True)
    rows_asked = []
    real = rope_products.rope_matrix

    def spy(rope, offset, D):
        rows_asked.append(offset.shape[0] if offset.ndim == 1 else 0)
        return real(rope, offset, D)
    before = batch.taken.copy()
    monkeypatch.setattr(rope_products, "rope_matrix", spy)
    for _ in range(8):
        tokens = lockstep(m, tokens, together, solo, "rope products")
    assert (batch.taken - before)["compiled_retrieval"] >= 4, batch.taken - before
    assert any(n > 1 for n in rows_asked), rows_asked       # a batched trace's rows' matrices

def test_stacked_gather_takes_each_rows_tokens_from_its_own_store():
    """serve's batched selection gathers each sequence's picked tokens from its own cold store
    (device_select.select_rows): the stacked gather (`_gather_stacked`: the indices of every
    store's rows expanded to the gather's shape once) against `_gather` per store, the path it
    replaced (kept: the packed stores' and one store's): stores of three capacities, one of
    them bf16, each row of a store its own indices; bit-equal values, in the stores' order, fp32.
    Stores of several widths take the per-store path. (Fails with every store gathering at the
    first store's indices, and with a store's indices one row on.)"""
    from tinygpt_mlx.cache.device_select import _gather, _gather_stacked

    rs = np.random.RandomState(5)
    g, U, D = 4, 6, 8
    caps = (16, 32, 32, 64)
    stores = [mx.array(rs.randn(g, cap, D).astype(np.float32)) for cap in caps]
    stores[2] = stores[2].astype(mx.bfloat16)
    idx = mx.array(np.concatenate([rs.randint(0, cap, size=(g, U)) for cap in caps]).astype(np.int32))
    want = [_gather(None, None, (a,), idx[i * g:(i + 1) * g]) for i, a in enumerate(stores)]
    got = _gather_stacked(stores, idx, g)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == mx.float32 and a.shape == b.shape == (g, U, D)
        assert mx.array_equal(a, b).item()
    # (the wide store as long as the one it replaces: its indices run to 63, and a gather out of
    # bounds reads whatever lies there: this case failed once in 2 runs with 16 rows)
    wide = stores[:3] + [mx.array(rs.randn(g, caps[3], 2 * D).astype(np.float32))]
    for a, w in zip(_gather_stacked(wide, idx, g), [_gather(None, None, (x,), idx[i * g:(i + 1) * g])
                                                    for i, x in enumerate(wide)]):
        assert mx.array_equal(a, w).item()


@pytest.mark.parametrize("rope", ["rope", "traditional"])
def test_rope_products_turn_each_row_at_its_own_position(rope):
    """serve's batched retrieval step turns each row's query and key by a product with its own
    RoPE matrix (rope_products with the rows' offsets [B], batch.py `_retrieval_step`): each
    row's result is bit-equal to the product with the matrix its position gives alone (the solo
    step's, `rope_matrix` of a scalar offset), and within 2e-6 of the RoPE at the rows' offsets;
    one matrix per setting and step; a call at other offsets, or of two tokens a row, is the
    RoPE's own result bit for bit. (Fails with every row turned at the first row's position.)"""
    import mlx.nn as nn
    from tinygpt_mlx.cache import rope_products

    r = nn.RoPE(16) if rope == "rope" else nn.RoPE(16, traditional=True, base=77.0)
    holder = nn.Module()
    holder.rope = r
    offsets = mx.array([0, 5, 1000, 70000], mx.int32)
    x = mx.array(np.random.RandomState(3).randn(4, 3, 1, 16).astype(np.float32))
    made = []
    real = rope_products.rope_matrix
    rope_products.rope_matrix = lambda *a: made.append(a) or real(*a)
    try:
        with rope_products.products(holder, offsets):
            got = holder.rope(x, offset=offsets)
            again = holder.rope(x * 2, offset=offsets)
            fewer = holder.rope(x[:2], offset=offsets[:2])                  # not the shared offsets
            two = holder.rope(mx.concatenate([x, x], axis=2), offset=offsets)  # two tokens a row
    finally:
        rope_products.rope_matrix = real
    assert len(made) == 1 and holder.rope is r
    for b in range(4):
        alone = x[b:b + 1] @ real(r, offsets[b], 16)
        assert mx.array_equal(got[b:b + 1], alone).item(), b
        assert mx.array_equal(again[b:b + 1], (x[b:b + 1] * 2) @ real(r, offsets[b], 16)).item(), b
    np.testing.assert_allclose(np.asarray(got), np.asarray(r(x, offset=offsets)), rtol=0, atol=2e-6)
    assert mx.array_equal(fewer, r(x[:2], offset=offsets[:2])).item()
    assert mx.array_equal(two, r(mx.concatenate([x, x], axis=2), offset=offsets)).item()


# ----- Gemma 3: sliding-window rings beside retrieval's global layers ---------------------------
@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer_json):
    """test_sliding.py's tiny mlx-lm gemma3_text (sliding window 16, every third layer global)."""
    from test_sliding import build_gemma3_dir
    from tinygpt_mlx.loading import load
    return load(build_gemma3_dir(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", tokenizer_json))


#: prompt lengths of distinct tokens: the rows sit at their own RoPE positions, their pages
#: complete at their own steps
GEMMA_LENGTHS = (58, 77, 96, 115)


def _gemma_rows(m, cfg, rebase_every=None):
    """Four caches of `cfg` on the tiny Gemma 3, prefilled with GEMMA_LENGTHS prompts, twice (the
    batch's and the solo reference's), and each prompt's first greedy token."""
    rs = np.random.RandomState(11)
    prompts = [[int(x) for x in rs.permutation(np.arange(1, 300))[:n]] for n in GEMMA_LENGTHS]

    def made():
        cache = make_cache(m, cfg)
        for c in cache.owned:
            if rebase_every is not None:
                c.positions.rebase_every = rebase_every
        return cache
    solo, together, tokens = prefilled_pairs(m, prompts, made)
    for i, (a, b) in enumerate(zip(solo, together)):
        # row i steps 5 i tokens alone first: a ring laid out after a prompt starts at one
        # pointer whatever the prompt's length, so these put the rows' pointers apart
        for _ in range(5 * i):
            logits = call(m, [tokens[i]], a)
            assert mx.array_equal(logits, call(m, [tokens[i]], b)).item()
            tokens[i] = int(mx.argmax(logits).item())
    return solo, together, tokens


@pytest.mark.parametrize("rope_mode", ["absolute", "shifted"])
def test_batched_retrieval_steps_gemma3_sliding_rings_as_each_alone(gemma, rope_mode):
    """Retrieval on Gemma 3's global layers beside its sliding-window rings (the tiny gemma3_text:
    two rings of 16 per global layer), four sequences at their own lengths in lockstep with each
    stepped alone (its compiled solo step, which steps the rings in the retrieval trace) over 48
    steps: the compiled batched retrieval step carries each row's rings (batch.py `_SlidingRows`:
    each row its own ring buffers, write slot and RoPE position), every row's logits within 1e-5 of
    its solo step's with the same greedy token at every step, most steps compiled with the rings
    (`compiled_retrieval_rings`), no trace failed, a few traces. At original positions (absolute)
    the layers re-base every 60 positions: the rings re-base (frame positions) and the global
    layers do not, so a row's rings and its global layers sit at different positions, and rows
    re-base at their own steps (those steps eager: `_rings_ready` declines a re-base)."""
    from tinygpt_mlx.cache import compiled

    m = gemma.model
    cfg = CacheConfig(sink=4, hot_budget=16, page_size=4, top_pages=2, retrieve_tokens=8, index_block=2,
                      index_expand=1, rope_mode=rope_mode)
    solo, together, tokens = _gemma_rows(m, cfg, 60 if rope_mode == "absolute" else None)
    assert all(c.compiled_step == "retrieval" for c in together)
    rings = [[c for c in cache.owned if c.sliding is not None] for cache in together]
    assert len(rings[0]) == 4 and all(r[0].sliding == 16 for r in rings)
    batch.forget(m)
    before, failed, traced = batch.taken.copy(), dict(batch._failed), batch.traced.copy()
    for step in range(48):
        tokens = lockstep(m, tokens, together, solo, rope_mode)
        if step == 0:
            assert len({r[0].body.write_slot for r in rings}) == 4      # each row's pointer its own
    done = batch.taken - before
    assert done["compiled_retrieval_rings"] == done["compiled_retrieval"] >= 40, done
    assert batch._failed == failed and not compiled.trace_failures
    assert 0 < (batch.traced - traced)["retrieval"] <= 12, batch.traced - traced
    if rope_mode == "absolute":     # the rings re-based apart from the global layers
        for cache in together:
            ring = next(c for c in cache.owned if c.sliding is not None)
            assert ring.positions.base > 0 and cache.global_layers[0].positions.base == 0
        assert len({next(c for c in cache.owned if c.sliding).positions.base for cache in together}) > 1


@pytest.mark.parametrize("policy", ["full", "int4", "streaming", "retrieval"])
def test_batched_step_on_gemma3_equals_each_alone(gemma, policy):
    """gemma3_text batches in serve (batch.BATCHED_MODEL_TYPES): its sliding layers ask the first
    layer for a windowed mask, which the eager batched step hands each row from its own cache
    (`BatchLayer.make_mask`). Four sequences of every policy, 24 lockstep steps: each row's logits
    within 1e-5 of its solo step's, the same greedy token (the batched step compiled or eager,
    as each policy's rows allow)."""
    assert batch.batches(gemma.model)
    cfg = {"full": CacheConfig(), "int4": CacheConfig(key_bits=4, value_bits=4),
           "streaming": CacheConfig(sink=4, window=24),
           "retrieval": CacheConfig(sink=4, hot_budget=24, retrieve_tokens=8, page_size=4)}[policy]
    solo, together, tokens = _gemma_rows(gemma.model, cfg)
    for _ in range(24):
        tokens = lockstep(gemma.model, tokens, together, solo, policy)


def test_gemma3_requests_with_retrieval_batch_compiled_in_serve(gemma):
    """serve's worker on the tiny Gemma 3 with retrieval: four requests at once get the tokens
    each gets alone, in batched steps, retrieval's steady steps compiled with the sliding rings
    beside (`compiled_retrieval_rings`), no trace failed."""
    cfg = CacheConfig(sink=4, hot_budget=16, page_size=4, top_pages=2, retrieve_tokens=8)
    prompts = [p * 3 for p in PROMPTS]
    alone, _ = _serve_jobs(gemma, cfg, prompts, parallel=1, max_tokens=32)
    before, failed = batch.taken.copy(), dict(batch._failed)
    together, batched = _serve_jobs(gemma, cfg, prompts, parallel=4, max_tokens=32)
    assert batched > 10 and [r.tokens for r in together] == [r.tokens for r in alone]
    assert (batch.taken - before)["compiled_retrieval_rings"] > 10 and batch._failed == failed


#: KIVI's quiet steps batched: the full int4 cache, and int4 under StreamingLLM with a window
#: past G (every prompt past sink + window + G, so the rows' blocks freeze and evict at their
#: own phases while the batch steps)
KIVI_STEPS = {
    "int4": CacheConfig(key_bits=4, value_bits=4),
    "int4+sink+window": CacheConfig(key_bits=4, value_bits=4, sink=SINK, window=96),
}


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-row"])
@pytest.mark.parametrize("case", list(KIVI_STEPS))
def test_batched_kivi_quiet_steps_equal_each_sequence_alone(native32, case, stacked, monkeypatch):
    """KIVI's quiet steps of four sequences as one compiled batched call (batch.py
    `_compiled_kivi`: the projections and MLP once over the rows; each row's sink, packed
    blocks, near tier and residual attended as the solo quiet step's trace does, the rows
    stacked and padded to the longest in one attention, or past STACK_TOKENS (here 0) each row
    on its own) against each sequence stepped alone (its compiled solo step where quiet), in
    lockstep over 96 steps: every row's logits within 1e-5 and the same greedy token; the
    batched call ran for most steps (a row freezing or evicting a block runs the step eager),
    on the path asked for, and its traces stay few: a new set of the rows' shapes (a row's
    packed run grown) is traced once, not one per step, and each function holds at most
    KEEP_SHAPES of them."""
    if not stacked:
        monkeypatch.setattr(batch, "STACK_TOKENS", 0)
    m, tok, cfg = native32.model, native32.tokenizer, KIVI_STEPS[case]
    prompts = [tok.encode(p * k) for p, k in zip(PROMPTS, (10, 12, 14, 16))]
    assert min(len(p) for p in prompts) > SINK + 96 + 32
    solo, together, tokens = prefilled_pairs(m, prompts, cfg, fresh=True)
    assert all(c.compiled_step == "kivi" for c in solo)
    before, failed, traced = batch.taken.copy(), dict(batch._failed), batch.traced.copy()
    held = []       # the shapes each step's compiled function has traced
    for _ in range(96):
        tokens = lockstep(m, tokens, together, solo, case)
        held += [s.traces for s in batch._steps(m)[0].values() if isinstance(s, batch._Compiled)]
    done = batch.taken - before
    assert done["compiled_kivi"] >= 64, done
    assert done["compiled_kivi_stacked"] == (done["compiled_kivi"] if stacked else 0), done
    assert batch._failed == failed                                          # no trace fell back
    # one trace per new set of shapes: a row's block frozen (full: every G steps in each row;
    # under a window the packed run's length cycles), not one per step
    assert 0 < (batch.traced - traced)["kivi"] <= 24, batch.traced - traced
    assert held and max(held) <= batch.KEEP_SHAPES
    assert len({c.current_length for c in together}) == 4


@pytest.mark.parametrize("ahead_traces", [True, False], ids=["ahead-traced", "ahead-replayed"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-row"])
def test_int4_first_steps_and_freezes_run_compiled_as_each_sequence_alone(native32, stacked, ahead_traces,
                                                                          monkeypatch):
    """A full int4 cache's steps before its first block froze, its freezes and its buffers'
    growths run in the compiled batched step too (batch.py `_compiled_kivi`: a row's freeze or
    growth due is done ahead, `KiviStore.ready_next`, then its step is a quiet one; a row with
    nothing frozen yet attends in the eager step's exact form, `_TracedKivi._attend_exact`, and
    stacks only with such rows). Four rows from short prompts of their own lengths, 96 steps in
    lockstep with each sequence alone (its solo step: eager until its first block froze, then
    compiled where quiet): every step compiled, every row's logits within 1e-5 of its solo step
    with the same greedy token (to the last bit with MLX's reference BLAS), each row's cache
    holding what its solo cache holds (blocks frozen, residual, the buffers' shapes), steps with
    rows before their first block, freezes and growths ahead all seen. By default
    (`KIVI_AHEAD_TRACES` False) a step whose freeze or growth was done ahead runs compiled only
    where its shapes are traced already, else eager (the same state: it freezes nothing more)."""
    if not stacked:
        monkeypatch.setattr(batch, "STACK_TOKENS", 0)
    monkeypatch.setattr(batch, "KIVI_AHEAD_TRACES", ahead_traces)
    m, tok, cfg = native32.model, native32.tokenizer, KIVI_STEPS["int4"]
    exact = blas.loaded_openblas() is None
    prompts = [tok.encode(p)[:n] for p, n in zip(PROMPTS, (5, 9, 14, 20))]
    solo, together, tokens = prefilled_pairs(m, prompts, cfg, fresh=True)
    assert all(c.owned[0].body.n_packed == 0 for c in together)         # nothing frozen yet
    before, failed, traced = batch.taken.copy(), dict(batch._failed), batch.traced.copy()
    for _ in range(96):
        rows = batch.decode_step(m, tokens, together)
        want = [call(m, [t], c) for t, c in zip(tokens, solo)]
        for row, w in zip(rows, want):
            if exact:
                assert mx.array_equal(row, w)
            assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item()
            assert mx.argmax(row).item() == mx.argmax(w).item()
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
        for a, b in zip(solo, together):
            for x, y in zip(a.owned, b.owned):
                rx, ry = x.body.residual, y.body.residual
                assert (x.body.n_packed, x.body.held, rx.n, rx.head, rx.keys.shape) == \
                       (y.body.n_packed, y.body.held, ry.n, ry.head, ry.keys.shape)
    done = batch.taken - before
    if ahead_traces:
        assert done["compiled_kivi"] == 96, done                             # every step
    else:       # each step done ahead with new shapes eager, every other compiled
        assert done["compiled_kivi"] + done["kivi_ahead_eager"] == 96 and done["kivi_ahead_eager"] > 0, done
    assert done["compiled_kivi_unpacked"] >= 30, done                        # rows before their first block
    assert done["kivi_frozen_ahead"] >= 8 and done["kivi_grown_ahead"] >= 4, done
    assert (done["compiled_kivi_stacked"] > 0) == stacked, done
    assert batch._failed == failed and 0 < (batch.traced - traced)["kivi"] <= 40, batch.traced - traced
    assert min(c.owned[0].body.n_packed for c in together) >= 64             # every row froze twice or more


def test_a_compiled_batched_step_is_made_anew_past_its_traces(native32, monkeypatch):
    """A compiled batched step holds at most KEEP_SHAPES traces (one per set of input shapes MLX
    has seen): past them it is made anew (MLX drops the old function's traces with it), so a
    long-running server's traces stay bounded (`trace_counts`). Two full int4 caches stepped
    together until their packed runs grew through more shapes than the bound (here 2)."""
    monkeypatch.setattr(batch, "KEEP_SHAPES", 2)
    m, tok = native32.model, native32.tokenizer
    caches = [make_cache(m, KIVI_STEPS["int4"]) for _ in range(2)]
    tokens = [int(mx.argmax(prefill(m, tok.encode(p * 6), c, 16)).item()) for p, c in zip(PROMPTS, caches)]
    batch.forget(m)
    traced = batch.traced["kivi"]
    for _ in range(160):
        rows = batch.decode_step(m, tokens, caches)
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
        (step,) = [s for s in batch._steps(m)[0].values() if isinstance(s, batch._Compiled)]
        assert step.traces <= 2
        assert batch.trace_counts(m)["batched_traces_held"] == step.traces
    made = batch.traced["kivi"] - traced
    assert made >= 5 and step.made >= 3 and step.made == -(-made // 2), (made, step.made)


def test_a_full_compiled_batched_step_replays_the_shapes_it_holds(monkeypatch):
    """Holding KEEP_SHAPES traces (here 2), a compiled batched step made anew only when a call
    brings a new set of input shapes: a call with shapes it has traced replays (it was made anew
    before such a call too, and traced the shapes it had just dropped again)."""
    monkeypatch.setattr(batch, "KEEP_SHAPES", 2)

    def make():
        def f(x, pair):
            batch.traced["probe"] += 1     # runs only while MLX traces
            return x * 2 + pair[0].sum() + pair[1][0].sum()
        return mx.compile(f)
    step, start = batch._Compiled(make, "probe"), batch.traced["probe"]
    a, b, c = (mx.ones((n,)) for n in (2, 3, 4))
    for x in (a, b, b, a, b):                            # two shape sets: traced once each
        mx.eval(step(x, (x, [x])))
    assert (batch.traced["probe"] - start, step.made, step.traces) == (2, 1, 2)
    mx.eval(step(c, (c, [c])))                          # a third: made anew, traced
    assert (batch.traced["probe"] - start, step.made, step.traces) == (3, 2, 1)
    mx.eval(step(c, (c, [c])))
    mx.eval(step(a, (a, [a])))                          # dropped with the old function: traced again
    assert (batch.traced["probe"] - start, step.made, step.traces) == (4, 2, 2)
    assert float(step(a, (a, [a]))[0]) == 6


def test_trace_counts_reads_a_model_without_steps_and_sets_nothing():
    """/api/slots may ask before the worker's first compiled step: `trace_counts` reads the model's
    steps without making them (making them there raced the worker's own)."""
    class Bare:
        pass
    m = Bare()
    counts = batch.trace_counts(m)
    assert counts["batched_functions_held"] == 0 and counts["batched_traces_held"] == 0
    assert not hasattr(m, batch._ATTR)


def test_a_layout_whose_trace_failed_stays_eager_past_the_kept_traces(native32_path, monkeypatch, caplog):
    """A layout whose compiled batched trace fails runs eager from then on, traced and logged
    once: its mark is kept apart from the newest KEEP_TRACES traces (here 1), so the layouts
    traced after it do not push it out (they did: it was traced, failed and logged again).
    Three full caches fail to trace (a stand-in fault); one and two make the other layouts."""
    from tinygpt_mlx.loading import load
    m = load(native32_path).model         # (its own model: the failed mark stays with it)
    monkeypatch.setattr(batch, "KEEP_TRACES", 1)
    tries = []
    real = batch._TracedRows.__init__

    def faulty(self, rows, offset, *rest):
        if len(rows) == 3:
            tries.append(1)
            raise RuntimeError("a stand-in fault of the three rows' trace")
        real(self, rows, offset, *rest)
    monkeypatch.setattr(batch._TracedRows, "__init__", faulty)
    caches = [make_cache(m, POLICIES["full"]) for _ in range(3)]
    ref = [make_cache(m, POLICIES["full"]) for _ in range(3)]
    for c, r in zip(caches, ref):
        prefill(m, [5, 6, 7], c, 16)
        prefill(m, [5, 6, 7], r, 16)
    before, failed = batch.taken["compiled"], dict(batch._failed)
    with caplog.at_level(logging.WARNING, logger="posttrainllm.server"):
        for step in range(6):
            rows = caches if step % 3 == 0 else caches[:step % 3]     # three, one, two, three, ...
            got = batch.decode_step(m, [9] * len(rows), rows)
            want = batch.decode_step(m, [9] * len(rows), ref[:len(rows)], compiled=False, dense=False)
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), step
    assert batch.taken["compiled"] - before == 4, batch.taken           # the one- and two-row steps
    assert len(batch._failed) == len(failed) + 1
    assert len(tries) == 1                                               # traced once (it fails at its first layer)
    assert caplog.text.count("tracing layout") == 1, caplog.text


# ----- the scheduler ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
def test_concurrent_requests_get_their_solo_text(native32, policy):
    """Four requests at once (batched decode steps, interleaved prefill chunks) get the tokens
    and text each gets alone (parallel=1), greedy, for every policy."""
    cfg = POLICIES[policy]
    prompts = [p * 3 for p in PROMPTS]
    alone, batched_alone = _serve_jobs(native32, cfg, prompts, parallel=1)
    together, batched = _serve_jobs(native32, cfg, prompts, parallel=4)
    assert batched_alone == 0 and batched > 10
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens and b.text == a.text and b.done_reason == a.done_reason
    assert sorted(r.slot_action for r in together) == ["new", "new", "scratch", "scratch"]


@pytest.mark.parametrize("policy", ["full", "sink+window", "retrieval"])
def test_mlx_lm_model_batches_too(llama, policy):
    """mlx-lm's Llama batches as the native model does, its steps compiled where the policy
    allows it (its code traced with the rows' stand-in caches: no trace fails; retrieval's
    steady steps too)."""
    prompts = [p * 2 for p in PROMPTS]
    alone, _ = _serve_jobs(llama, POLICIES[policy], prompts, parallel=1)
    before, failed = batch.taken["compiled"], dict(batch._failed)
    together, batched = _serve_jobs(llama, POLICIES[policy], prompts, parallel=4)
    assert batched > 10 and [r.tokens for r in together] == [r.tokens for r in alone]
    assert batch.taken["compiled"] > before and batch._failed == failed


def test_requests_past_parallel_wait_in_the_queue(native, caplog):
    """With --parallel 2, five requests run at most two at a time, the rest wait (logged), and
    each gets its solo text."""
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=2)
    seen = []
    real = w._step

    def step():
        seen.append(len(w.running))
        real()

    w._step = step
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    try:
        with caplog.at_level(logging.INFO, logger="posttrainllm.server"):
            together = [e[-1][1] for e in _run_jobs(w, [Job(native.tokenizer.encode(p), 12, temperature=0)
                                                       for p in prompts])]
    finally:
        w.stop()
    assert max(seen) == 2
    assert "waits in the queue: 2 requests are running (--parallel 2)" in caplog.text
    alone, _ = _serve_jobs(native, CacheConfig(), prompts, parallel=1, max_tokens=12)
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_an_idle_worker_hands_the_freed_memory_back_once(native, monkeypatch):
    """When nothing runs or waits, the worker empties MLX's cache of freed buffers and trims glibc's
    heap (`Worker._idle`), once per busy spell: not during the steps, not again while it stays
    idle, again after the next requests. Fails with the release left out, made at every loop, or
    made while requests still run."""
    from tinygpt_mlx.server import worker as worker_module
    calls, running_then, workers = [], [], []
    monkeypatch.setattr(worker_module.heap, "trim",
                        lambda: calls.append("trim") or running_then.append(len(workers[0].running)))
    monkeypatch.setattr(worker_module.mx, "clear_cache", lambda: calls.append("clear"))
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=2)
    workers.append(w)

    def settle(n):
        deadline = time.time() + 30
        while len(calls) < n and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)                   # (a second release would come now)
        return list(calls)
    try:
        assert settle(0) == []                                   # idle from the start: nothing ran
        _run_jobs(w, [Job(native.tokenizer.encode(p), 12, temperature=0) for p in PROMPTS])
        assert settle(2) == ["clear", "trim"]
        w.call(lambda: None)                                     # (the idle worker's loop runs again)
        assert settle(2) == ["clear", "trim"]
        _run_jobs(w, [Job(native.tokenizer.encode(PROMPTS[0]), 4, temperature=0)])
        assert settle(4) == ["clear", "trim"] * 2
    finally:
        w.stop()
    assert running_then == [0, 0] and w.steps > 12


def test_a_request_past_the_memory_budget_waits(native, caplog):
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=4)
    w.admission.available = lambda: w.admission.RESERVE + 10 * w.admission.per_token   # room for 10 tokens
    seen = []
    real = w._step
    w._step = lambda: (seen.append(len(w.running)), real())
    try:
        with caplog.at_level(logging.INFO, logger="posttrainllm.server"):
            done = _run_jobs(w, [Job(native.tokenizer.encode(p), 8, temperature=0) for p in PROMPTS[:3]])
    finally:
        w.stop()
    assert all(e[-1][0] == "done" and e[-1][1].done_reason in ("stop", "length") for e in done)
    assert max(seen) == 1 and "MiB are available" in caplog.text


def test_cancel_frees_the_place_at_once(native):
    """With --parallel 1, cancelling the running request starts the queued one at the next step."""
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=1)
    long = Job(native.tokenizer.encode(PROMPTS[0]), 10_000, temperature=0)
    short = Job(native.tokenizer.encode(PROMPTS[1]), 4, temperature=0)
    events: dict[str, list] = {"long": [], "short": []}
    long.emit = lambda k, p: events["long"].append((k, p))
    short.emit = lambda k, p: events["short"].append((k, p))
    try:
        w.submit(long)
        w.submit(short)
        deadline = time.time() + 30
        while len([e for e in events["long"] if e[0] == "text"]) < 5:
            assert time.time() < deadline
            time.sleep(0.005)
        assert not events["short"] and w.pending == 1
        steps = w.steps
        long.cancel()
        while not (events["short"] and events["short"][-1][0] == "done"):
            assert time.time() < deadline
            time.sleep(0.005)
    finally:
        w.stop()
    assert events["long"][-1][1].done_reason == "cancel"
    r = events["short"][-1][1]
    assert r.done_reason in ("stop", "length") and r.slot_action == "new"
    assert w.steps - steps <= len(r.tokens) + 3          # it started at once, not after the long reply


def test_events_reach_their_streams_in_order_one_wake_up_per_phase(native):
    """The worker hands a scheduler phase's events to the event loop at once (`Worker._flush`):
    four requests at once on a real asyncio loop, one of them cancelled by its reader after
    three text pieces. Every text piece reaches its own request's queue in order (the pieces
    join into its reply's text), the cancelled one ends as "cancel" and the others complete,
    and the loop is woken (`call_soon_threadsafe`) fewer times than half the events: one call
    per loop and phase, not one per token and stream."""
    loop = asyncio.new_event_loop()
    calls = []
    send = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (calls.append(1), send(*a))[1]
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=4), 16, parallel=4)

    async def run(job, cancel_after=None):
        job.loop, job.events = loop, asyncio.Queue()
        w.submit(job)
        got = []
        while True:
            kind, payload = await job.events.get()
            got.append((kind, payload))
            if cancel_after is not None and sum(k == "text" for k, _ in got) == cancel_after:
                job.cancel()
            if kind in ("done", "error"):
                return got
    async def main():
        jobs = [Job(native.tokenizer.encode(p * 2), 24, temperature=0) for p in PROMPTS]
        return await asyncio.wait_for(asyncio.gather(*(run(j, 3 if i == 0 else None) for i, j in enumerate(jobs))),
                                      120)
    try:
        got = loop.run_until_complete(main())
    finally:
        w.stop()
        loop.close()
    events = sum(len(g) for g in got)
    for i, g in enumerate(got):
        kind, r = g[-1]
        assert kind == "done" and all(k == "text" for k, _ in g[:-1])
        assert "".join(p for _, p in g[:-1]) == r.text
        assert r.done_reason == ("cancel" if i == 0 else "length"), (i, r.done_reason)
        assert len(r.tokens) < 24 if i == 0 else len(r.tokens) == 24
    assert w.batched_steps > 10
    assert len(calls) < events / 2, (len(calls), events)


class _FakeOpenBLAS:
    def __init__(self, threads: int):
        self.threads, self.calls = threads, []

    def openblas_get_num_threads(self) -> int:
        return self.threads

    def openblas_set_num_threads(self, n: int) -> None:
        self.calls.append(n)
        self.threads = n


def test_decode_steps_run_openblas_on_one_thread_and_prefill_on_its_own_count(native):
    """The worker switches OpenBLAS to one thread for decode steps and back to its own count for
    a prefill chunk, only when the count changes (blas.Threads); without OpenBLAS nothing."""
    lib = _FakeOpenBLAS(2)
    threads = blas.Threads(library=lib)
    assert threads.available and threads.default == 2 and threads.decode == 1
    threads.for_decode()
    threads.for_decode()
    threads.for_prefill()
    assert lib.calls == [1, 2]
    none = blas.Threads(library=object())
    none.for_decode()
    assert not none.available
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=4)
    lib = _FakeOpenBLAS(2)
    w.blas = blas.Threads(library=lib)
    try:
        texts = [p * 2 for p in PROMPTS[:2]]         # longer than one chunk: several prefill chunks each
        got = [e[-1][1] for e in _run_jobs(w, [Job(native.tokenizer.encode(t), 6, temperature=0) for t in texts])]
    finally:
        w.stop()
    assert all(r.done_reason in ("stop", "length") for r in got)
    assert lib.calls and set(lib.calls) == {1, 2} and 1 in lib.calls[lib.calls.index(2):]   # back and forth
    assert all(a != b for a, b in zip(lib.calls, lib.calls[1:]))    # set only when it changes
    assert lib.threads == 2              # the stopped worker left OpenBLAS at its own count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux")
def test_the_worker_thread_is_named_at_the_os_level_and_the_bench_counts_its_cpu(native):
    """The worker's thread carries its name at the OS level (worker.name_os_thread: Python 3.11
    keeps thread names to itself, /proc showed "python"), so bench_server_parallel's per-thread
    CPU (`thread_cpu`, read from /proc/<pid>/task/<tid>/stat) counts it as "worker": a thread named
    so that burns 0.3 s of CPU is counted there, not in "other". Fails with the name left unset
    (the bench's "worker" entry was always 0)."""
    from benchmarks.bench_server_parallel import thread_cpu
    from tinygpt_mlx.server.worker import name_os_thread

    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=1), 16)
    try:
        _run_jobs(w, [Job(native.tokenizer.encode(PROMPTS[0]), 2, temperature=0)])    # (it has started)
        tid = w._thread.native_id
        with open(f"/proc/self/task/{tid}/comm") as f:
            assert f.read().strip() == "posttrainllm-generate"[:15]
    finally:
        w.stop()
    burnt, release = threading.Event(), threading.Event()

    def burn():
        name_os_thread("posttrainllm-probe")
        while time.thread_time() < 0.3:
            pass
        burnt.set()
        release.wait()
    before = thread_cpu(os.getpid())
    t = threading.Thread(target=burn)
    t.start()
    try:
        assert burnt.wait(60)
        after = thread_cpu(os.getpid())
    finally:
        release.set()
        t.join()
    assert after["worker"] - before["worker"] >= 0.25, (before, after)


def test_text_pieces_that_arrived_together_go_out_as_one_chunk():
    """`render` joins the text pieces waiting in a job's queue into one chunk (the same text) and
    still ends with the final object; a piece arriving alone is its own chunk."""
    async def run():
        job = Job([1], 4)
        job.events = asyncio.Queue()
        for piece in ("a", "b", "c"):
            job.events.put_nowait(("text", piece))
        job.events.put_nowait(("done", "result"))
        out = [o async for o in render(job, lambda t: {"t": t}, lambda r: [{"done": r}], lambda e: {"e": e})]
        job2 = Job([1], 4)
        job2.events = asyncio.Queue()

        async def feed():
            for piece in ("x", "y"):
                await asyncio.sleep(0.01)
                job2.events.put_nowait(("text", piece))
            await asyncio.sleep(0.01)
            job2.events.put_nowait(("done", "r2"))
        task = asyncio.ensure_future(feed())
        out2 = [o async for o in render(job2, lambda t: {"t": t}, lambda r: [{"done": r}], lambda e: {"e": e})]
        await task
        return out, out2
    out, out2 = asyncio.run(run())
    assert out == [{"t": "abc"}, {"done": "result"}]
    assert out2 == [{"t": "x"}, {"t": "y"}, {"done": "r2"}]


def test_a_continuation_waits_for_its_running_slot(native):
    """A prompt that continues a running request's prompt waits for that slot and reuses it (here
    restored from the checkpoint taken at the end of that prompt: it does not hold the reply)."""
    tok = native.tokenizer
    first = tok.encode(PROMPTS[0] * 2)
    w = Worker(native, SlotPool(native.model, CacheConfig(sink=4, window=24), max_slots=2), 16, parallel=4)
    try:
        one, two = _run_jobs(w, [Job(first, 6, temperature=0), Job(first + tok.encode(" and more"), 6,
                                                                       temperature=0)])
    finally:
        w.stop()
    one, two = one[-1][1], two[-1][1]
    assert one.slot_action == "new" and (two.slot_action, two.slot, two.reused_tokens) == ("restore", one.slot, len(first))


def test_busy_slots_are_no_one_elses(native):
    """The pool never hands out, extends or evicts a slot held by a running request; past every
    slot a request runs in a scratch cache, whose bytes /api/ps counts while it runs."""
    tok = native.tokenizer
    a, b = tok.encode(PROMPTS[0] * 4), tok.encode(PROMPTS[1] * 4)
    pool = SlotPool(native.model, CacheConfig(), max_slots=1, small_tokens=0)
    lease = pool.acquire(a, hold=True)
    prefill(native.model, a, lease.slot.cache, 64)
    lease.slot.tokens = list(a)
    assert pool.waits_for(a + b) == 0 and pool.waits_for(b) is None
    other = pool.acquire(a + b, hold=True)            # would extend slot 0, were it idle
    assert other.action == "scratch"
    prefill(native.model, a + b, other.slot.cache, 64)
    running = pool.memory()["cache_bytes"]
    pool.release(other.slot)
    assert pool.memory()["cache_bytes"] < running
    pool.release(lease.slot)
    assert pool.acquire(a + b).action == "extend" and pool.waits_for(a + b) is None


# ----- through HTTP, with the real clients ------------------------------------------------------
@pytest.fixture(scope="module")
def server(native):
    pytest.importorskip("fastapi")
    from tinygpt_mlx.server.app import create_app, serve_in_thread

    srv, thread, url = serve_in_thread(create_app(native, CacheConfig(sink=4, window=64), prefill_chunk=16,
                                                  max_slots=2, small_tokens=0, parallel=4))
    yield url
    srv.should_exit = True
    thread.join(timeout=10)


def test_ollama_and_openai_clients_at_once(server, native):
    """Eight requests at once from the real clients (four ollama chats streamed and not, four
    OpenAI completions) get what each gets alone, and the server batched their decode steps."""
    ollama = pytest.importorskip("ollama")
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    name = native.name

    def one(i):
        prompt = f"{PROMPTS[i % 4]} {i}"
        if i < 4:
            c = ollama.Client(host=server)
            opts = {"temperature": 0, "num_predict": 16}
            msgs = [{"role": "user", "content": prompt}]
            if i % 2:
                return "".join(p.message.content for p in c.chat(name, msgs, stream=True, options=opts))
            return c.chat(name, msgs, options=opts).message.content
        c = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        if i % 2:
            chunks = c.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=16, stream=True)
            return "".join(ch.choices[0].text for ch in chunks if ch.choices)
        return c.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=16).choices[0].text

    alone = [one(i) for i in range(8)]
    before = httpx.get(server + "/api/slots").json()["batched_steps"]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(one, range(8)))
    assert together == alone and len(set(alone)) > 1
    assert httpx.get(server + "/api/slots").json()["batched_steps"] > before


def test_logprobs_and_usage_per_request_at_once(server, native):
    """Each concurrent request gets its own log-probabilities, prompt and reply counts, equal to
    what it gets alone."""
    httpx = pytest.importorskip("httpx")

    def one(i):
        r = httpx.post(server + "/api/generate", json={
            "model": native.name, "prompt": f"{PROMPTS[i]} {i}", "stream": False, "logprobs": True,
            "top_logprobs": 3, "options": {"temperature": 0, "num_predict": 10}}, timeout=60)
        assert r.status_code == 200, r.text
        d = r.json()
        return d["response"], d["logprobs"], d["prompt_eval_count"] + d["prompt_cached_tokens"], d["eval_count"]

    def close(a, b):
        """Equal, floats within 1e-5: with OpenBLAS a batched step's logits may differ from a
        lone one's in the last bits (test_batched_decode_step_equals_each_sequence_alone)."""
        if isinstance(a, float) and isinstance(b, float):
            return abs(a - b) <= 1e-5 * max(1.0, abs(b))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        return a == b

    alone = [one(i) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(one, range(4)))
    assert close(together, alone) and all(len(lp) == n for _, lp, _, n in alone)
    assert [t[0] for t in together] == [a[0] for a in alone]      # the texts exactly


def test_a_short_request_is_answered_while_a_long_one_streams(server, native):
    """A short request sent while a long answer streams finishes while the long one still runs
    (before, it waited for the whole answer)."""
    httpx = pytest.importorskip("httpx")
    name = native.name
    body = {"model": name, "prompt": PROMPTS[0], "options": {"temperature": 0, "num_predict": 400}}
    with httpx.stream("POST", server + "/api/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["done"] is False
        short = httpx.post(server + "/api/generate", json={
            "model": name, "prompt": PROMPTS[1], "stream": False, "options": {"temperature": 0, "num_predict": 4}},
            timeout=60).json()
        assert short["done"] and short["eval_count"] >= 1
        state = httpx.get(server + "/api/slots").json()
        assert state["running"] == 1 and state["busy"]          # the long answer is still streaming
    deadline = time.time() + 10
    while httpx.get(server + "/api/slots").json()["busy"]:       # leaving the stream cancelled it
        assert time.time() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_load_with_random_cancels(server, native):
    """64 requests from 8 client threads, about a quarter of them abandoned mid-stream: no error,
    every other reply complete and equal to its prompt's answer on the idle server."""
    httpx = pytest.importorskip("httpx")
    name = native.name
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]

    def ask(prompt, cancel_after=None):
        body = {"model": name, "prompt": prompt, "options": {"temperature": 0, "num_predict": 24}}
        text = ""
        with httpx.stream("POST", server + "/api/generate", json=body, timeout=120) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):
                d = json.loads(line)
                assert "error" not in d, d
                if cancel_after is not None and i >= cancel_after:
                    return None
                text += d.get("response", "")
                if d["done"]:
                    assert d["done_reason"] in ("stop", "length")
                    return text
        raise AssertionError("the stream ended without a final line")

    want = {p: ask(p) for p in prompts}
    rng = random.Random(0)
    plan = [(rng.choice(prompts), rng.randrange(1, 8) if rng.random() < 0.25 else None) for _ in range(64)]
    lock, got = threading.Lock(), []

    def client(k):
        for prompt, cancel in plan[k::8]:
            text = ask(prompt, cancel)
            with lock:
                got.append((prompt, cancel, text))

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(client, range(8)))
    assert len(got) == 64
    for prompt, cancel, text in got:
        if cancel is None:
            assert text == want[prompt]
    deadline = time.time() + 10
    while httpx.get(server + "/api/slots").json()["busy"]:
        assert time.time() < deadline
        time.sleep(0.05)


def test_serve_parallel_option(native_path, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(app))
    r = CliRunner().invoke(app, ["serve", str(native_path), "--parallel", "3"])
    assert r.exit_code == 0, r.output
    srv = calls[0].state.server
    try:
        assert srv.worker.parallel == 3 and "up to 3 request(s) at once" in r.output
    finally:
        srv.worker.stop()
        srv.pool.close()
    bad = CliRunner().invoke(app, ["serve", str(native_path), "--parallel", "0"])
    assert bad.exit_code != 0 and "'--parallel': must be an integer >= 1, got 0" in bad.output   # (the flag named)


@pytest.mark.parametrize("cfg", [CacheConfig(), CacheConfig(key_bits=4, sink=4, window=64)],
                         ids=["full", "int4keys+streaming"])
def test_questions_about_a_prewarmed_document_at_once(native, tmp_path, cfg):
    """Three questions about a pre-warmed document at once: the first runs on the document's
    slot, the others on the file loaded again into scratch caches; none prefills the document,
    and each answer is a cold server's."""
    httpx = pytest.importorskip("httpx")
    from test_server import DOC, _ptc
    from tinygpt_mlx.server.app import create_app, serve_in_thread

    doc_ids = _ptc(native, cfg, tmp_path / "doc.ptc")
    questions = [" Who keeps the lighthouse?", " What does she wind?", " Where is the cape?"]

    def ask(url, q):
        r = httpx.post(url + "/api/generate", json={"model": native.name, "prompt": DOC + q, "stream": False,
                                                   "options": {"temperature": 0, "num_predict": 12}}, timeout=60)
        return r.json()

    def run(**kw):
        srv, thread, url = serve_in_thread(create_app(native, cfg, prefill_chunk=64, max_slots=2, parallel=4, **kw))
        try:
            with concurrent.futures.ThreadPoolExecutor(3) as ex:
                out = list(ex.map(lambda q: ask(url, q), questions))
            return out, httpx.get(url + "/api/slots").json()["recent"]
        finally:
            srv.should_exit = True
            thread.join(timeout=10)

    warm, recent = run(prompt_caches=[tmp_path / "doc.ptc"])
    cold, _ = run()
    # one extends the document's slot; each other loads the file again, or, when it arrives after
    # the first has finished, rolls that slot back to the document (timing decides which): none
    # prefills the document (prompt_eval_count below)
    actions = sorted(r["action"] for r in recent)
    assert len(actions) == 3 and actions.count("extend") == 1, actions
    assert set(actions) - {"extend"} <= {"reload", "rollback"}, actions
    for w, c, q in zip(warm, cold, questions):
        # at most the question's tokens (a rolled-back slot may share a question's first tokens too)
        assert 0 < w["prompt_eval_count"] <= len(native.tokenizer.encode(DOC + q)) - len(doc_ids)
        assert w["response"] == c["response"] and w["eval_count"] == c["eval_count"] > 0


def test_a_short_prompt_passes_a_long_prefill(native):
    """A short request that arrives while a long prompt is being prefilled chunk by chunk is
    prefilled first and answered before the long prompt's first token."""
    tok = native.tokenizer
    long_ids = tok.encode(PROMPTS[0] * 12)[:200]             # 13 chunks of 16
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=2), 16, parallel=4)
    long, short = Job(long_ids, 4, temperature=0), Job(tok.encode(PROMPTS[1]), 3, temperature=0)
    order: list[str] = []
    long.emit = lambda k, p: order.append(f"long {k}")
    short.emit = lambda k, p: order.append(f"short {k}")
    real = w._prefill
    gate = threading.Event()

    def prefill_step(s):                  # hold the long prefill after its first chunk until the short one is in
        real(s)
        if s.job is long and s.pos == 16:
            gate.wait(10)

    w._prefill = prefill_step
    try:
        w.submit(long)
        deadline = time.time() + 30
        while not w.running or w.running[0].pos < 16:
            assert time.time() < deadline
            time.sleep(0.005)
        w.submit(short)
        gate.set()
        while "long done" not in order:
            assert time.time() < deadline
            time.sleep(0.005)
    finally:
        w.stop()
    assert order.index("short done") < min(i for i, e in enumerate(order) if e.startswith("long"))
