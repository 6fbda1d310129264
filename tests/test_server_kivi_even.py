"""Stacked int4 rows read packed runs evened outside the trace (issue 56, int4 four streams).

In serve's compiled batched KIVI step the rows attend as one over their packed runs padded to the
longest row's. Padded inside the trace, every row's freeze (its run one block longer) was a new
set of input shapes: a trace, or an eager step where the freeze was done ahead. Padded before
the step (`batch._even_runs` until session 44, now `batch._joined_runs`, which also joins them
along the rows), the inputs change shape only when the longest run grows; the joined runs are
kept while no row's run changes. These tests hold the rows to their solo steps and check the
mechanism.
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import call, prefill
from tinygpt_mlx.server import batch

from prefilled import prefilled_pairs

PROMPTS = ["The quick brown fox jumps over", "In the beginning was the word, and",
           "Café, naïve, 東京 and emoji", "the keeper of numbers 0123456789 was"]


@pytest.fixture(scope="module")
def native32(native32_path):
    from tinygpt_mlx.loading import load
    return load(native32_path)


def _shapes(run) -> tuple:
    return tuple(tuple(a.shape) for side in run for a in side) if run else ()


def test_stacked_kivi_rows_read_runs_of_one_length_kept_between_steps(native32, monkeypatch):
    """Four full int4 rows at their own lengths (packed runs of different lengths), 64 steps in
    lockstep with each row alone: every row's logits within 1e-5 of its solo step's, the same
    greedy token; every stacked compiled call got, in each layer, the rows' runs joined along the
    rows at the longest's length (`_joined_runs`: row i its own run, zero-padded), the joined run
    the same arrays from step to step while no row froze, and the runs kept are only those of the
    last step's rows; a stacked step where a row froze ahead ran compiled (traced where its shapes
    were new: with the runs joined at the longest's, only the longest row's freeze brings new
    shapes), never eager."""
    m, tok = native32.model, native32.tokenizer
    cfg = CacheConfig(key_bits=4, value_bits=4)
    prompts = [tok.encode(p * k) for p, k in zip(PROMPTS, (3, 5, 7, 9))]
    solo, together, tokens = prefilled_pairs(m, prompts, cfg)
    calls: list = []
    real = batch._Compiled.__call__

    def spy(self, *args):
        if self.kind == "kivi":     # the packed runs as passed (stacked: per layer joined; else per row),
            # and each row's own runs' arrays in its cache, per row a list over the layers
            own = [[(c.body.tiers.packed.keys, c.body.tiers.packed.values) if c.body.n_packed else ()
                    for c in cache.owned] for cache in together]
            calls.append((args[3], own))
        return real(self, *args)
    monkeypatch.setattr(batch._Compiled, "__call__", spy)
    batch.forget(m)
    batch.drop_kept()
    before = batch.taken.copy()
    ahead_stacked = 0
    for _ in range(64):
        packed = all(c.owned[0].body.n_packed for c in together)     # every row has blocks: the rows stack
        was = batch.taken.copy()
        rows = batch.decode_step(m, tokens, together)
        step = batch.taken - was
        if packed and step["kivi_frozen_ahead"]:      # a row froze ahead: compiled even with new shapes
            assert step["compiled_kivi_stacked"] == 1 and not step["kivi_ahead_eager"], step
            ahead_stacked += 1
        want = [call(m, [t], c) for t, c in zip(tokens, solo)]
        for row, w in zip(rows, want):
            assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item()
            assert mx.argmax(row).item() == mx.argmax(w).item()
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
    done = batch.taken - before
    assert done["compiled_kivi_stacked"] >= 32 and ahead_stacked >= 2, (done, ahead_stacked)
    # stacked calls with every row holding blocks: per layer one joined run (a tuple of two sides)
    stacked = [c for c in calls if all(run for row in c[1] for run in row) and len(c[0]) == len(c[1][0])
               and all(len(run) == 2 and run[1][0].shape[0] == 4 for run in c[0])]
    assert len(stacked) >= 32
    for passed, own in stacked:
        for j, run in enumerate(passed):
            longest = max(row[j][1][0].shape[-2] for row in own)
            assert run[1][0].shape[-2] == longest, "the joined run not at the longest row's length"
            for i, row in enumerate(own):       # row i of the joined run: its own run, then zeros
                n = row[j][1][0].shape[-2]
                assert mx.array_equal(run[1][0][i:i + 1, :, :n], row[j][1][0]).item()
                assert not mx.any(run[1][0][i:i + 1, :, n:]).item()
    # no row's run changed over two steps: the same joined arrays passed (kept, not made anew)
    same = reused = 0
    for (a, own_a), (b, own_b) in zip(stacked, stacked[1:]):
        for j in range(len(a)):
            if all(ra[j][1][0] is rb[j][1][0] for ra, rb in zip(own_a, own_b)):
                same += 1
                reused += all(x is y for sa, sb in zip(a[j], b[j]) for x, y in zip(sa, sb))
    assert same and reused == same, (reused, same)
    # only the last step's runs are held
    last = {id(run[1][0]) for run in stacked[-1][0]}
    assert all(id(held[1][1][0]) in last for key, held in batch._EVENED.items() if key[0] == "packed")
    assert len({c.current_length for c in together}) == 4
    assert batch._EVENED
    batch.drop_kept()                       # (what an idle worker does)
    assert not batch._EVENED
    for c in solo + together:
        c.close()


def test_an_idle_worker_drops_the_padded_runs(native32, monkeypatch):
    """serve's worker, two int4 requests of unlike lengths batched (their runs padded to the longer's
    and kept between steps): once both are done and the worker goes idle, the padded copies are
    dropped (`batch.drop_kept`), not held until the next batch."""
    from tinygpt_mlx.server.slots import SlotPool
    from tinygpt_mlx.server.worker import Job, Worker

    tok = native32.tokenizer
    held: list = []
    real = batch.drop_kept
    monkeypatch.setattr(batch, "drop_kept", lambda: (held.append(len(batch._EVENED)), real())[1])
    w = Worker(native32, SlotPool(native32.model, CacheConfig(key_bits=4, value_bits=4), max_slots=2), 512, parallel=2)
    jobs = [Job(tok.encode(p * k), 48, temperature=0) for p, k in ((PROMPTS[1], 4), (PROMPTS[3], 8))]
    got: list = [[], []]
    for job, g in zip(jobs, got):
        job.emit = lambda kind, payload, g=g: g.append(kind)
    try:
        for job in jobs:
            w.submit(job)
        deadline = time.time() + 60
        while not (all(g and g[-1] == "done" for g in got) and held):
            assert time.time() < deadline, (got, held)
            time.sleep(0.01)
    finally:
        w.stop()
    assert w.batched_steps > 8 and held[0] > 0 and not batch._EVENED


def test_the_admission_counts_the_padded_runs(native32, monkeypatch):
    """serve's memory admission counts the stacked KIVI rows' padded runs (`_even_runs`' copies,
    kept between steps): for an int4 policy a request that fits with its cache and the running
    caches' growth but not with the padded copies waits (the log line names them); at the bound
    it starts; the copies held now are subtracted (the OS counts them used already); a full-cache
    policy and retrieval count none. The bound: one copy per row (the runs joined along the rows,
    `_joined_runs`), each of the longest row's tokens (at most STACK_TOKENS) at the compute
    precision."""
    from types import SimpleNamespace

    from tinygpt_mlx.server import worker
    from tinygpt_mlx.server.worker import Admission, Job

    tok = native32.tokenizer
    jobs = [Job(tok.encode(p), n, temperature=0) for p, n in zip(PROMPTS, (40, 90, 20, 60))]
    running = [SimpleNamespace(job=j, slot=SimpleNamespace(tokens=j.ids)) for j in jobs[1:]]
    new = jobs[0]
    monkeypatch.setattr(worker, "padded_held", lambda: 0)
    for cfg, pads in ((CacheConfig(key_bits=4, value_bits=4), True), (CacheConfig(), False),
                      (CacheConfig(key_bits=4, value_bits=4, hot_budget=64, sink=4), False)):
        a = Admission(native32, cfg)
        need, grow = a.worst(new), sum(a.growth(s) for s in running)
        longest = max(len(j.ids) + j.max_tokens for j in jobs)
        pad = 4 * min(longest, batch.STACK_TOKENS) * a.per_token if pads else 0
        assert a.padded([len(j.ids) + j.max_tokens for j in jobs]) == pad
        a.available = lambda: a.RESERVE + need + grow + pad - 1
        ok, why = a.fits(new, running)
        assert not ok and ("padded KIVI runs" in why) == pads, why
        a.available = lambda: a.RESERVE + need + grow + pad
        assert a.fits(new, running) == (True, "")
    # the copies held now are counted used: the bound less them is what must still fit
    a = Admission(native32, CacheConfig(key_bits=4, value_bits=4))
    pad = a.padded([len(j.ids) + j.max_tokens for j in jobs])
    monkeypatch.setattr(worker, "padded_held", lambda: 5000)
    a.available = lambda: a.RESERVE + a.worst(new) + sum(a.growth(s) for s in running) + pad - 5000
    assert a.fits(new, running) == (True, "")
    # one request alone: nothing padded
    assert a.padded([500]) == 0


def test_the_padded_runs_held_stay_within_the_admission_bound(native32):
    """Four int4 rows of unlike lengths stepped stacked: the padded copies held after each step
    (`worker.padded_held`, the bytes of `batch._EVENED`) are some, and never more than the admission
    bound for the rows' lengths then (`Admission.padded`)."""
    from tinygpt_mlx.server.worker import Admission, padded_held

    m, tok = native32.model, native32.tokenizer
    cfg = CacheConfig(key_bits=4, value_bits=4)
    a = Admission(native32, cfg)
    caches = [make_cache(m, cfg) for _ in PROMPTS]
    tokens = [int(mx.argmax(prefill(m, tok.encode(p * k), c, 16)).item()) for p, k, c in zip(PROMPTS, (3, 5, 7, 9), caches)]
    batch.forget(m)
    batch.drop_kept()
    seen = 0
    for _ in range(40):
        rows = batch.decode_step(m, tokens, caches)
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
        held = padded_held()
        assert held == sum(a.nbytes for _, run in batch._EVENED.values() for side in run for a in side)
        assert held <= a.padded([c.current_length for c in caches]), (held, [c.current_length for c in caches])
        seen = max(seen, held)
    assert seen > 0
    batch.drop_kept()
    assert padded_held() == 0
    for c in caches:
        c.close()
