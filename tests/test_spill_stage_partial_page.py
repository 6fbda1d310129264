"""A staged decode step (cache/spill_stage.py) after a rewind that leaves part of a page spilled.

Spills move whole blocks of pages, but a checkpoint restored into the spilled part (a warm slot
or a chat cut back to a shared prefix) cuts the files back to any token count, so the last
spilled page can be partly spilled: it must not be read from a staging buffer whose page table
covers whole pages only. Reference: the per-layer path (staging off) after the same rewind, with
every spilled page guessed before every step (so a staged step hits wherever its check lets it)."""

import mlx.core as mx
import numpy as np
import pytest

from test_spill_stage import BASE, _cache, _steps, _tokens
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward


def _after_rewind(model, staged: bool, extra: int) -> tuple[list, dict, int]:
    """Logits of 8 decode steps after a rewind to 300 prompt tokens and 4 + `extra` decode steps
    (page size 8, hot window 32: the cold store then holds 272 + `extra` tokens, all of them
    spilled), each step's guess every spilled page; the staging counters; the spilled count."""
    cache = _cache(model, CacheConfig(**BASE), staged=staged)
    tokens = _tokens(6)
    _steps(model, cache, tokens[:300], 4 + extra)
    mark = cache.checkpoint()
    _steps(model, cache, tokens[300:], 6)
    cache.restore(mark)
    spilled = cache[0].cold.spilled
    before = dict(cache.spill_stats)
    out = []
    for i in range(8):
        for layer in cache.owned:
            cold = layer.cold
            if cold.guess is not None:
                cold.guess = np.tile(np.arange(cold.spilled // cold.page_size + 1), (cold.guess.shape[0], 1))
        logits = forward(model, mx.array([[5 + i]]), cache)[0, -1]
        mx.eval(logits)
        out.append(np.asarray(logits))
    return out, {k: cache.spill_stats[k] - before[k] for k in before}, spilled


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_a_rewind_to_part_of_a_page(native, extra):
    want, _, spilled = _after_rewind(native.model, False, extra)
    got, stats, same = _after_rewind(native.model, True, extra)
    assert spilled == same == 272 + extra, (spilled, same)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
    if not extra:       # whole pages spilled: the forced guess hits (so the case above is staged where allowed)
        assert stats["hits"] >= 6, stats
