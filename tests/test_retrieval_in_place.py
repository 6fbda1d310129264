"""The compiled retrieval step writes the hot window's and the cold store's buffers in place (issue #56,
session 43): `compiled_retrieval.DONATED_BODY` reads the leaving token from the written buffers, so the old
buffers' one reader is the write and MLX does it in place. Before, the leaving token was read from the
old buffers, a second reader that kept them alive, and the write copied a layer's hot-window buffers whole,
every step (docs/server.md "Retrieval's four-row step: where a row's cost goes; the hot window written in
place"). Checked by each buffer's data address before and after a step, on the steps where nothing was
done eagerly (no eviction ahead, no growth); the tokens and logits by lockstep with each sequence alone,
and against the old order. Fails with the old order (161 buffer moves on the checked steps) and with the
leaving token read one slot on (the logits differ from the old order's): both seen."""

from __future__ import annotations

import mlx.core as mx

from benchmarks.batch_retrieval_donate_ab import addresses
from tinygpt_mlx.cache import compiled_retrieval
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import call
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch

from prefilled import prefilled_pairs

PROMPTS = ["The quick brown fox jumps over", "In the beginning was the word, and",
           "Café, naïve, 東京 and emoji", "the keeper of numbers 0123456789 was"]
CONFIG = CacheConfig(sink=4, hot_budget=24, page_size=8, top_pages=2)


def _run(path, donated: bool, monkeypatch, steps: int = 32):
    """A fresh model (its own traces, made with `DONATED_BODY` = `donated`), four caches stepped batched and
    four alone, in lockstep (each row's logits within 1e-5 of its solo step's, the same greedy token): the
    batched rows' and the solo caches' count of in-place checks and moves on steps where no layer was
    evicted ahead and no buffer grew, and the logits of every step."""
    loaded = load(path)
    m, tok = loaded.model, loaded.tokenizer
    monkeypatch.setattr(compiled_retrieval, "DONATED_BODY", donated)
    prompts = [tok.encode(p * 3) for p in PROMPTS]
    solo, together, tokens = prefilled_pairs(m, prompts, CONFIG)
    checked = {"batch": [0, 0], "solo": [0, 0]}
    logits = []
    for _ in range(steps):
        quiet = [all(len(c.cold) % CONFIG.page_size != CONFIG.page_size - 1 for c in cache.owned)
                 for cache in together]
        before = [addresses(c) for c in together], [addresses(c) for c in solo]
        caps = [[(c.cold.keys.capacity, c.body.keys.shape) for c in cache.owned] for cache in together + solo]
        taken = batch.taken["compiled_retrieval"]
        rows = batch.decode_step(m, tokens, together)
        assert batch.taken["compiled_retrieval"] == taken + 1       # (steady: the compiled batched step)
        want = [call(m, [t], c) for t, c in zip(tokens, solo)]
        for row, w in zip(rows, want):
            assert mx.allclose(row, w, rtol=1e-5, atol=1e-5).item()
            assert mx.argmax(row).item() == mx.argmax(w).item()
        logits.append(rows)
        tokens = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
        grown = [[(c.cold.keys.capacity, c.body.keys.shape) for c in cache.owned] != cap
                 for cache, cap in zip(together + solo, caps)]
        after = [addresses(c) for c in together], [addresses(c) for c in solo]
        for side, k in (("batch", 0), ("solo", 1)):
            for i in range(len(prompts)):
                # (a step completing a page evicts ahead eagerly, as the solo step does: its slices of the
                # body read the old buffers; a solo twin completes its pages at its row's steps)
                if quiet[i] and not grown[i + 4 * k]:
                    checked[side][0] += 1
                    checked[side][1] += sum(x != y for x, y in zip(before[k][i], after[k][i]))
    return checked, logits


def test_compiled_retrieval_steps_write_their_buffers_in_place(native32_path, monkeypatch):
    """Four retrieval rows past their hot windows, 32 steps of the compiled batched step in lockstep with
    each sequence's compiled solo step: on every step where the row's layers evicted nothing ahead and no
    buffer grew (most steps), every layer's hot-window and cold keys and values kept their data's address
    (written in place), batched and alone; and the old order (the leaving token read before the write)
    gives the same logits, bit for bit, while its buffers moved (the copy this removes)."""
    checked, logits = _run(native32_path, True, monkeypatch)
    assert checked["batch"][0] >= 4 * 20 and checked["solo"][0] >= 4 * 20, checked     # most steps checked
    assert checked["batch"][1] == 0 and checked["solo"][1] == 0, checked
    before, old_logits = _run(native32_path, False, monkeypatch)
    assert before["batch"][1] > 0 and before["solo"][1] > 0, before    # the copies the change removes
    for a, b in zip(logits, old_logits):
        assert mx.array_equal(a, b).item()
