"""Stacked int4 rows read batch-owned residual buffers (issue 56, int4 four streams).

serve's compiled stacked KIVI step joined every row's residual buffers along the rows in every
layer and step. Now the step's written buffers stay joined (`batch._JOINT`): each row's residual
holds a view of its own row of them, and the next step reads the joined buffers as they lie
where no row's buffers changed since (`batch._joined_buffers`), else joins them anew. These
tests hold the rows to their solo steps through what can change a row's buffers between steps:
its blocks freezing, a turn's tokens appended to it eagerly, a row leaving the batch, and check
that what a reader of a row's cache finds (its bytes for a warm slot or a prompt-cache file) is
its own.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import call, prefill
from tinygpt_mlx.server import batch

from prefilled import prefilled_pairs

PROMPTS = ["The quick brown fox jumps over", "In the beginning was the word, and",
           "Café, naïve, 東京 and emoji", "the keeper of numbers 0123456789 was"]
INT4 = CacheConfig(key_bits=4, value_bits=4)


@pytest.fixture(scope="module")
def native32(native32_path):
    from tinygpt_mlx.loading import load
    return load(native32_path)


def _start(m, tok, reps=(3, 4, 5, 6)):
    """Four int4 caches prefilled with prompts of their own lengths, twice (batched, solo)."""
    prompts = [tok.encode(p * k) for p, k in zip(PROMPTS, reps)]
    return prefilled_pairs(m, prompts, INT4, fresh=True, kept=True)


def _lockstep(m, tokens, together, solo):
    rows = batch.decode_step(m, tokens, together)
    want = [call(m, [t], c) for t, c in zip(tokens, solo)]
    for i, (row, w) in enumerate(zip(rows, want)):
        assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item(), i
        assert mx.argmax(row).item() == mx.argmax(w).item(), i
    return [int(t) for t in mx.argmax(rows, axis=-1).tolist()]


def _same_state(a, b):
    """Two caches hold the same tokens: each layer's residual (live tokens, within 1e-5: the
    batched projections may differ from the solo ones in the last bits), its layout, and its
    packed run's arrays (a file's and a warm slot's bytes, `KiviStore.state`)."""
    for x, y in zip(a.owned, b.owned):
        rx, ry = x.body.residual, y.body.residual
        assert (rx.n, rx.head, rx.keys.shape, x.body.n_packed) == (ry.n, ry.head, ry.keys.shape, y.body.n_packed)
        for p, q in zip(rx.fetch(), ry.fetch()):
            assert mx.allclose(p, q, rtol=1e-5, atol=1e-5).item()
        sx, sy = x.body.state()[0], y.body.state()[0]
        assert sorted(sx) == sorted(sy)
        for name in sx:
            assert sx[name].shape == sy[name].shape, name


def test_stacked_int4_rows_read_the_batch_owned_buffers_as_each_alone(native32):
    """Four int4 rows at their own lengths, 80 steps in lockstep with each row alone: every
    row's logits within 1e-5 of its solo step's and the same greedy token; most stacked steps
    read the last step's joined buffers as they lie (`kivi_joined_kept`), the joins made anew
    are few (the rows' freezes and buffer growths); every row's cache holds what its solo cache
    holds (its residual's tokens: its own row of the joined buffers, not a neighbour's)."""
    m, tok = native32.model, native32.tokenizer
    solo, together, tokens = _start(m, tok)
    before = batch.taken.copy()
    for _ in range(80):
        tokens = _lockstep(m, tokens, together, solo)
    done = batch.taken - before
    layers = len(together[0].owned)
    assert done["compiled_kivi_stacked"] >= 60, done
    assert done["kivi_joined_kept"] >= 40 * layers, done
    assert 0 < done["kivi_joined_made"] <= 40 * layers, done
    assert done["kivi_joined_kept"] + done["kivi_joined_made"] == done["compiled_kivi_stacked"] * layers, done
    for a, b in zip(solo, together):
        _same_state(a, b)


def test_a_rows_tokens_appended_between_stacked_steps_are_read(native32):
    """Between stacked steps a row's residual is written in place, its buffers' arrays kept (a
    turn's tokens appended eagerly, `DenseStore.append`'s slice write: the same array objects,
    their `version` moved): the next stacked step joins that row anew (its view is no longer
    what the joined buffers hold) and every row still steps as alone."""
    m, tok = native32.model, native32.tokenizer
    solo, together, tokens = _start(m, tok, (8, 9, 10, 11))
    for _ in range(6):
        tokens = _lockstep(m, tokens, together, solo)
    assert all(c.owned[0].body.n_packed for c in together)     # (rows with blocks frozen: they stack)
    more = tok.encode(" and then")
    res = together[1].owned[0].body.residual
    if res.head + res.n + len(more) + 1 > res.keys.shape[2]:
        pytest.skip("the appended tokens would not fit the buffers in place")
    keys = res.keys
    for c in (solo[1], together[1]):
        tokens[1] = int(mx.argmax(prefill(m, more, c, 16)).item())
    assert together[1].owned[0].body.residual.keys is keys      # written in place
    before = batch.taken.copy()
    tokens = _lockstep(m, tokens, together, solo)
    done = batch.taken - before
    assert done["compiled_kivi_stacked"] == 1 and done["kivi_joined_made"] == len(together[0].owned), done
    for _ in range(6):
        tokens = _lockstep(m, tokens, together, solo)
    assert (batch.taken - before)["kivi_joined_kept"] > 0
    for a, b in zip(solo, together):
        _same_state(a, b)


def test_a_row_that_leaves_the_batch_gets_its_own_buffers(native32):
    """A row that finishes (the batch steps on without it) is given its own copy of its view of
    the joined buffers (`kivi_joined_released`: not the joined buffers held alive by a warm slot),
    the same tokens; read then (a warm slot's or a file's bytes) and stepped alone after, it
    matches its solo cache; the three rows left step on as alone."""
    m, tok = native32.model, native32.tokenizer
    solo, together, tokens = _start(m, tok, (8, 9, 10, 11))
    for _ in range(8):
        tokens = _lockstep(m, tokens, together, solo)
    assert batch._JOINT and all(batch._unchanged(h) for h in batch._JOINT["rows"][3])   # (its views held)
    left = together[3]
    views = [(c.body.residual.keys, c.body.residual.values) for c in left.owned]
    before = batch.taken.copy()
    t3 = tokens[3]
    tokens = _lockstep(m, tokens[:3], together[:3], solo[:3])
    assert (batch.taken - before)["kivi_joined_released"] == len(left.owned)
    for c, (k, v) in zip(left.owned, views):
        assert c.body.residual.keys is not k and c.body.residual.values is not v
        assert mx.array_equal(c.body.residual.keys, k).item() and mx.array_equal(c.body.residual.values, v).item()
    _same_state(solo[3], left)
    for _ in range(4):
        w, g = call(m, [t3], solo[3]), call(m, [t3], left)
        assert mx.allclose(w, g, rtol=1e-5, atol=1e-5).item() and mx.argmax(w).item() == mx.argmax(g).item()
        t3 = int(mx.argmax(w).item())
    for _ in range(4):
        tokens = _lockstep(m, tokens, together[:3], solo[:3])
    batch.drop_kept()       # an idle worker: the rest given their own copies too
    assert not batch._JOINT
    for a, b in zip(solo, together):
        _same_state(a, b)
