"""Cache checkpoints and rollback (issue #32): a warm slot restores a turn boundary exactly.

* every policy and composition of the prompt-cache tests, on the native TinyGPT and on mlx-lm's
  Llama: prefill a document, checkpoint, continue with one question, restore, continue with
  another: bit-identical logits, tokens and report to a fresh cache fed the document and the
  second question; restored again, decoding straight from the document's logits (regenerate)
  twice and the first question's run are reproduced (the checkpoint is not changed by what ran
  after it);
* a checkpoint is bounded: it holds no more after three times the document than after it, for
  every policy but the full ones (whose `trimmable` rolls back without one);
* `trimmable`: how far each policy can roll back in place, and a trimmed full KIVI cache
  continues as a fresh one does (within KIVI's own tolerance: where the residual froze differs).

Mutations checked to fail here (one at a time, then reverted): `restore` not resetting `start`;
the cold store's `rewind` not cutting its summaries and positions.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.generate import prefill

from test_prompt_cache import CHUNK, DOC, POLICIES, QUESTION, _continue, _report, loaded_models  # noqa: F401

OTHER = np.random.RandomState(2).randint(1, 300, 24).tolist()
FULL = {"fp32", "bf16"}       # trimmable all the way: the slot pool takes no checkpoint of them


@pytest.mark.parametrize("model_name", ("native", "llama"))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.slow
def test_restore_continues_as_a_fresh_cache(loaded_models, model_name, policy):
    loaded, cfg = loaded_models[model_name], POLICIES[policy]
    model = loaded.model
    with make_cache(model, cfg) as ref:
        want_other = _continue(model, ref, prefill(model, DOC, ref, CHUNK), OTHER)
    with make_cache(model, cfg) as ref:
        want_first = _continue(model, ref, prefill(model, DOC, ref, CHUNK), QUESTION)
    with make_cache(model, cfg) as ref:      # regenerate: decoding straight from the saved logits
        want_again = _continue(model, ref, prefill(model, DOC, ref, CHUNK), [])

    with make_cache(model, cfg) as cache:
        logits = prefill(model, DOC, cache, CHUNK)
        before = _report(cache)
        cp = cache.checkpoint()
        assert cp is not None and cp.length == len(DOC)
        assert _report(cache) == before                      # taking it changes nothing
        first = _continue(model, cache, logits, QUESTION)
        assert first[0] == want_first[0]
        for question, want in ((OTHER, want_other), ([], want_again), ([], want_again), (QUESTION, want_first)):
            cache.restore(cp)
            assert _report(cache) == before, policy
            got = _continue(model, cache, logits, question)
            assert got[0] == want[0], (policy, got[0], want[0])
            assert bool(mx.array_equal(got[1], want[1])), policy
            assert got[2] == want[2], policy


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - FULL))
@pytest.mark.slow
def test_a_checkpoint_is_bounded(loaded_models, policy):
    loaded, cfg = loaded_models["native"], POLICIES[policy]
    # 4 chunks, then 8 more: the same chunk pattern at the end (KIVI's residual depends on it)
    tokens = np.random.RandomState(3).randint(1, 300, 12 * CHUNK).tolist()
    def tier() -> int:       # a near tier sized to the context is held whole: 1/S of the frozen tokens
        return sum(layer.body.tiers.near.nbytes for layer in cache.owned) if cfg.tier_share else 0

    with make_cache(loaded.model, cfg) as cache:
        prefill(loaded.model, tokens[:4 * CHUNK], cache, CHUNK)
        small, small_tier = cache.checkpoint().nbytes, tier()
        prefill(loaded.model, tokens[4 * CHUNK:], cache, CHUNK)
        large, large_tier = cache.checkpoint().nbytes, tier()
        assert small > 0
        assert large - large_tier <= small - small_tier, (policy, small, large, cache.nbytes)
        assert large_tier >= small_tier * 2 if cfg.tier_share else large_tier == 0
        assert large < cache.nbytes or cfg.streaming, (policy, large, cache.nbytes)


@pytest.mark.parametrize("policy,expected", [
    ("full", "all"), ("int4", "residual"), ("k8v4", "residual"),
    ("sink4/window64", 0), ("int4+sink4/window64", 0), ("hot64", 0)])
def test_how_far_each_policy_can_trim(loaded_models, policy, expected):
    loaded = loaded_models["native"]
    with make_cache(loaded.model, parse_policy(policy)) as cache:
        prefill(loaded.model, DOC, cache, CHUNK)
        n = cache.trimmable()
        if expected == "all":
            assert n == len(DOC)
        elif expected == "residual":
            residual = {len(c.body.residual) for c in cache.owned}
            assert residual == {n} and 0 < n < len(DOC)
        else:
            assert n == 0
        assert cache.trim(n + 5) == n and cache.current_length == len(DOC) - n


def test_trimmed_kivi_continues_as_a_fresh_cache(loaded_models):
    loaded, cfg = loaded_models["native"], parse_policy("int4")
    model = loaded.model
    with make_cache(model, cfg) as cache:
        prefill(model, DOC, cache, CHUNK)
        prefill(model, QUESTION[:4], cache, CHUNK)     # a reply's first tokens, then regenerate
        assert cache.trimmable() >= 4 and cache.trim(4) == 4
        got = prefill(model, OTHER, cache, CHUNK)
    with make_cache(model, cfg) as fresh:
        prefill(model, DOC, fresh, CHUNK)
        want = prefill(model, OTHER, fresh, CHUNK)
    with make_cache(model, parse_policy("full")) as exact:
        prefill(model, DOC, exact, CHUNK)
        ref = prefill(model, OTHER, exact, CHUNK)
    # where the residual froze differs, so the trimmed cache is a KIVI cache of the same tokens:
    # as close to the fresh one as either is to the exact cache
    err_fresh = float(mx.abs(want - ref).max())
    assert float(mx.abs(got - want).max()) <= 2 * err_fresh + 1e-5
    assert int(mx.argmax(got)) == int(mx.argmax(want))
