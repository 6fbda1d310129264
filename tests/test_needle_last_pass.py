"""benchmarks/needle_last_pass.py (docs/gguf.md, the 32K depth-0.3 cell read with a shorter last pass).

The reference: with the full cache the chunking of a prompt changes nothing but rounding, so every
variant's answer probabilities equal one plain prefill's (`needle_step_probe.probe_policy`); a
variant that dropped, repeated or reordered a tail token would not. With retrieval the cache is
restored between variants: the second variant equals its parts fed to a fresh cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.needle_last_pass import probe_last_pass, variants
from benchmarks.needle_step_probe import answer, probe_policy
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import prefill
from test_needle_step_probe import needle_cell


@pytest.fixture(scope="module")
def cell(native):
    return needle_cell(native.tokenizer)


def _probs(rows):
    return np.array([p for _, p, *_ in rows])


def test_every_variant_equals_one_plain_prefill_with_the_full_cache(native, cell):
    ids, target, truth = cell
    plain = probe_policy(native.model, ids, target, truth, CacheConfig.from_spec("full"), 64)[None]
    runs = probe_last_pass(native.model, ids, target, CacheConfig.from_spec("full"), 64, 24, (8, 3))
    assert len(runs) == 4
    for label, rows in runs.items():
        assert [t for t, *_ in rows] == target
        np.testing.assert_allclose(_probs(rows), _probs(plain), atol=1e-4, err_msg=label)


def test_each_retrieval_variant_starts_from_the_prefix_alone(native, cell):
    """The second variant equals its parts fed to a fresh cache: the first variant's tail is undone."""
    ids, target, _ = cell
    config = CacheConfig.from_spec("sink4/hot32:absolute+fetch16")
    runs = probe_last_pass(native.model, ids, target, config, 64, 24)
    with make_cache(native.model, config) as cache:
        prefill(native.model, ids[:-24], cache, 64)
        alone = answer(native.model, cache, prefill(native.model, ids[-24:], cache, 1), target)
    np.testing.assert_allclose(_probs(runs["tail one per pass"]), _probs(alone), atol=1e-6)


def test_variants_cover_the_tail_and_refuse_bad_sizes():
    for label, parts in variants(64, (16, 8)):
        assert sum(n for n, _ in parts) == 64, label
    with pytest.raises(ValueError, match="--singles"):
        variants(64, (64,))
