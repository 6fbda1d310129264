"""benchmarks/needle_step_probe.py's answer-step options (docs/gguf.md, the 32K depth-0.3 probe):
`--decode-fetch` (one prefill, the answer fed once per fine-pass budget, the cache restored
between) and `--fetched` (which needle tokens each retrieval layer fetched at each step).

The reference: retrieval at original positions whose fine pass takes every cold token attends
to what the full cache attends to (tests/test_policies.py `test_retrieving_everything_equals_full`),
so with the prompt retrieved whole and the answer's steps given every cold token its
probabilities are the fp32 full cache's; a budget of one page at the answer's steps is not.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.needle_step_probe import ALL, probe_policy
from tinygpt_mlx.chat_template import encode_fragment
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.needle import DEFAULT_FILLER, cell_document, needle_positions

# sink 4 + hot 32 at original positions, 256 tokens fetched: a ~240-token cell's ~200 cold
# tokens are all fetched, by the prompt's chunks and by the answer's steps
EVERYTHING = "sink4/hot32:absolute+fetch256"


@pytest.fixture(scope="module", params=["native", "gemma3"])
def model(request, native, tmp_path_factory, tokenizer_json):
    """The tiny native TinyGPT, and a tiny gemma3_text (tests/test_sliding.py's: sliding-window
    layers of 16, every third layer global, which alone retrieve)."""
    if request.param == "native":
        return native
    from test_sliding import build_gemma3_dir
    from tinygpt_mlx.loading import load
    return load(build_gemma3_dir(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", tokenizer_json))


def needle_cell(tok):
    """A ~240-token needle cell (depth 0.3, seed 0): its prompt's ids, the answer's ids, the needle's positions."""
    prompt, answer = cell_document(tok, DEFAULT_FILLER.read_text(encoding="utf-8"), 240, 0.3, 0)
    ids = list(tok.encode(prompt))
    return ids, encode_fragment(tok, " " + answer + "."), np.asarray(needle_positions(tok.encode, prompt, answer))


@pytest.fixture(scope="module")
def cell(model):
    ids, target, truth = needle_cell(model.tokenizer)
    assert len(ids) < model.context_length and truth.max() < len(ids) - 36   # the needle goes cold
    return ids, target, truth


def _probs(rows):
    return np.array([p for _, p, *_ in rows])


def test_decode_fetch_reads_everything_as_the_full_cache_and_one_page_not(model, cell):
    ids, target, truth = cell
    full = probe_policy(model.model, ids, target, truth, CacheConfig.from_spec("full"), 64)[None]
    caches = []
    runs = probe_policy(model.model, ids, target, truth, CacheConfig.from_spec(EVERYTHING), 64,
                        fetches=(8, 256, None, ALL, 64), fetched=True, on_prefill=caches.append)
    assert [t for t, *_ in runs[256]] == target
    # every cold token at the answer's steps (after a run with one page, restored): the full cache
    np.testing.assert_allclose(_probs(runs[256]), _probs(full), atol=1e-4)
    np.testing.assert_allclose(_probs(runs[None]), _probs(full), atol=1e-4)   # the policy's own: 256
    np.testing.assert_allclose(_probs(runs[ALL]), _probs(full), atol=1e-4)
    # one page of 8 tokens at the answer's steps reads something else
    assert np.abs(_probs(runs[8]) - _probs(full))[1:].max() > 1e-3
    assert _probs(runs[8])[0] == _probs(runs[256])[0]    # the prefill's logits: one prefill for all

    layers = [c for c in caches[0].owned if c.telemetry is not None]   # the global layers (gemma3)
    assert layers and all(c.config.retrieval == (c.telemetry is not None) for c in caches[0].owned)
    for n, rows in runs.items():
        assert rows[0][-1] == {}     # the prefill's logits: nothing recorded
        for _, _, _, _, ms, got in rows[1:]:
            assert ms > 0 and sorted(got) == [c.cold.layer_index for c in layers]
            for heads in got.values():
                assert len(heads) == 2      # KV heads (both tiny models)
                for fetched, cold in heads:
                    assert np.array_equal(cold, truth)           # the whole needle is cold
                    assert set(fetched.tolist()) <= set(truth.tolist())
                    if n in (8, 64):
                        assert len(fetched) <= n                 # one page / 8 pages at most
                    else:
                        assert np.array_equal(fetched, truth)    # every cold token fetched
    # the same fetches as the telemetry's own recall, step by step (its records restart with
    # each restore: the last run's, 64 tokens, which fetch part of the needle at some steps)
    recall = {c.cold.layer_index: [float(np.mean([len(f) / len(k) for f, k in got[c.cold.layer_index]]))
                                   for *_, got in runs[64][1:]] for c in layers}
    assert 0 < np.mean(list(recall.values())) < 1
    for c in layers:
        np.testing.assert_allclose(recall[c.cold.layer_index], [r["token_recall"] for r in c.telemetry.records])


def test_decode_fetch_refuses_the_slots_rule(model, cell):
    ids, target, truth = cell
    with pytest.raises(ValueError, match="not 'slots'"):
        probe_policy(model.model, ids, target, truth, CacheConfig(
            hot_budget=32, sink=4, rope_mode="shifted", retrieved_position="slots"), 64, fetches=(8,))


def test_decode_fetch_all_reaches_past_the_coarse_pool(model, cell):
    """A pool of 2 pages (+ the unfinished and the sticky ones) misses the needle at some answer
    step, however large the fine pass; `all` keeps every page and fetches the whole needle at
    every step. `all` first: the budgets after it are the pool's again."""
    ids, target, truth = cell
    runs = probe_policy(model.model, ids, target, truth, CacheConfig.from_spec("sink4/hot32:absolute+fetch16+pages2"),
                        64, fetches=(ALL, 4096, None), fetched=True)
    heads = {n: [h for *_, got in rows[1:] for per_layer in got.values() for h in per_layer] for n, rows in runs.items()}
    assert all(np.array_equal(f, truth) and np.array_equal(c, truth) for f, c in heads[ALL])
    for n in (4096, None):
        assert any(len(f) < len(truth) for f, _ in heads[n])
