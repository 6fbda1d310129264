"""int4 under StreamingLLM while its window fills steps compiled (issue 56, session 46).

A KIVI row under StreamingLLM took the compiled step (serve's batched one and the solo one) only
once its window was full and a block evicted (cache/compiled.py `_kivi_ready`); short prompts
(the benchmark's are a few tokens) stepped eager for about half of a 256-token stream under a
128-token window. Now a filling window's quiet steps compile as a full int4 cache's do: its
packed run grows by a block every G steps, its residual's live tokens are masked, and stacked
rows' runs are padded to the longest (`_joined_runs`). These tests hold the rows to each sequence
alone through the fill, the first freezes and the first evictions, and count the compiled steps
of the fill phase (none before this change).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from tinygpt_mlx import blas
from tinygpt_mlx.cache import compiled, make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import call
from tinygpt_mlx.server import batch
from test_server_parallel import _serve_jobs
from prefilled import prefilled_pairs

PROMPTS = ["The quick brown fox jumps over", "In the beginning was the word, and",
           "Café, naïve, 東京 and emoji", "the keeper of numbers 0123456789 was"]
SINK, WINDOW = 4, 96
STREAMING_INT4 = CacheConfig(key_bits=4, value_bits=4, sink=SINK, window=WINDOW)
# a window without a sink: its sink store never holds an array (the filling steps once read it)
NO_SINK_INT4 = CacheConfig(key_bits=4, value_bits=4, sink=0, window=WINDOW)
WINDOWS = pytest.mark.parametrize("config", [STREAMING_INT4, NO_SINK_INT4], ids=["sink4", "no-sink"])


def _filling(cache) -> bool:
    """Nothing evicted yet: the window still filling (the body's oldest token right after the sink)."""
    return all(c.start <= c.config.sink for c in cache.owned)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-row"])
def test_a_filling_int4_window_steps_compiled_in_the_batch_as_each_alone(native32, stacked, monkeypatch):
    """Four int4 + StreamingLLM rows from short prompts of their own lengths (5-20 tokens, the
    window 96, G 32), 160 steps in lockstep with each sequence alone (its solo step, compiled
    where quiet): every row's logits within 1e-5 of its solo step's (to the last bit with MLX's
    reference BLAS) with the same greedy token, each row's cache holding what its solo cache
    holds; while every row's window is still filling, most batched steps run compiled (rows
    before their first block too: `compiled_kivi_unpacked`), where before session 46 none did;
    the traces stay few (a new packed length or buffer size once, not one per step)."""
    if not stacked:
        monkeypatch.setattr(batch, "STACK_TOKENS", 0)
    m, tok = native32.model, native32.tokenizer
    exact = blas.loaded_openblas() is None
    prompts = [tok.encode(p)[:n] for p, n in zip(PROMPTS, (5, 9, 14, 20))]
    solo, together, tokens = prefilled_pairs(m, prompts, STREAMING_INT4, fresh=True, kept=True)
    assert all(c.compiled_step == "kivi" for c in together)
    before, failed, traced = batch.taken.copy(), dict(batch._failed), batch.traced.copy()
    fill_steps = fill_compiled = 0
    for _ in range(160):
        filling = all(_filling(c) for c in together)
        was = batch.taken["compiled_kivi"]
        rows = batch.decode_step(m, tokens, together)
        want = [call(m, [t], c) for t, c in zip(tokens, solo)]
        for i, (row, w) in enumerate(zip(rows, want)):
            if exact:
                assert mx.array_equal(row, w).item(), i
            assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item(), i
            assert mx.argmax(row).item() == mx.argmax(w).item(), i
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
        if filling:
            fill_steps += 1
            fill_compiled += batch.taken["compiled_kivi"] - was
        for a, b in zip(solo, together):
            for x, y in zip(a.owned, b.owned):
                rx, ry = x.body.residual, y.body.residual
                assert (x.seen, x.start, x.body.n_packed, x.body.held, rx.n, rx.head, rx.keys.shape) == \
                       (y.seen, y.start, y.body.n_packed, y.body.held, ry.n, ry.head, ry.keys.shape)
    done = batch.taken - before
    assert fill_steps >= 70, fill_steps                    # the fill phase was stepped through
    # a step where any row freezes a block runs eager (G = 32: four rows, about 4 in 32 steps)
    assert fill_compiled >= fill_steps * 2 // 3, (fill_compiled, fill_steps, done)
    assert done["compiled_kivi_unpacked"] >= 20, done     # rows with no block frozen yet, compiled
    assert (done["compiled_kivi_stacked"] > 0) == stacked, done
    assert not any(_filling(c) for c in together)          # and past the fill: blocks evicted
    assert batch._failed == failed and 0 < (batch.traced - traced)["kivi"] <= 40, batch.traced - traced


@WINDOWS
def test_a_filling_int4_window_steps_compiled_alone_as_eager(native32, config):
    """The solo compiled step (cache/compiled.py `decode`) takes a filling window's quiet steps
    once a block froze (before it, as a full cache's first steps, eager): over a 20-token prompt
    and 140 steps under a 96-token window, the compiled steps' logits those of the eager steps
    and the caches the same, and most of the fill phase's steps compiled (none before session 46)."""
    m = native32.model
    toks = [(i * 37 + 11) % 300 for i in range(160)]

    def run(use_compiled):
        compiled.forget(m)
        cache = make_cache(m, config)
        outs = [m(mx.array([toks[:20]]), cache=cache)]
        cache.evict_middle_if_needed()
        ran = fill = 0
        for t in toks[20:]:
            filling = _filling(cache)
            logits = compiled.decode(m, mx.array([[t]]), cache) if use_compiled else None
            if logits is None:
                logits = m(mx.array([[t]]), cache=cache)
                cache.evict_middle_if_needed()
            else:
                ran += 1
                fill += filling
            outs.append(logits)
            mx.eval(logits)
        return mx.concatenate(outs, axis=1), cache, fill

    fast, cache, fill = run(True)
    slow, ref, _ = run(False)
    assert fill >= 40, fill
    assert mx.abs(fast - slow).max().item() <= 1e-5
    assert mx.argmax(fast, axis=-1).tolist() == mx.argmax(slow, axis=-1).tolist()
    for x, y in zip(cache.owned, ref.owned):
        assert (x.seen, x.start, x.body.n_packed, len(x.body.residual)) == \
               (y.seen, y.start, y.body.n_packed, len(y.body.residual))
        (kx, vx), (ky, vy) = x.fetch(), y.fetch()
        assert mx.abs(kx - ky).max().item() <= 1e-5 and mx.abs(vx - vy).max().item() <= 1e-5


@WINDOWS
def test_serve_int4_window_streams_from_short_prompts_get_their_text_alone(native32, config):
    """serve's worker, int4 + StreamingLLM, four greedy requests from short prompts (their windows
    filling for most of the reply): each reply's tokens equal what it gets alone, in batched
    steps, the fill phase's steps compiled."""
    prompts = [p[:12] for p in PROMPTS]

    def serve(parallel):
        replies, batched = _serve_jobs(native32, config, prompts, parallel, max_tokens=120, max_slots=4)
        assert all(len(r.tokens) == 120 for r in replies)      # (no reply stopped early)
        return [r.tokens for r in replies], batched
    alone, _ = serve(1)
    before = batch.taken.copy()
    together, batched = serve(4)
    done = batch.taken - before
    assert batched > 60 and together == alone
    assert done["compiled_kivi"] >= 60, done
