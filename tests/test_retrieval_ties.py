"""Issue 53's review: retrieval's compiled decode step against its eager step on the shipped
model. They differ by float rounding only (the model's RoPE and the turns as products, fused
kernels); a pick parts them only where rounding reaches a discrete choice between near-equal
scores, after which the two runs attend to different tokens and their logits part further
(docs/retrieval.md, "Compiled against eager: where they part"). Run here (reference BLAS) and
in a process of its own under OpenBLAS (tests/openblas.py), where they part at step 7."""

import mlx.core as mx
import numpy as np
import pytest

import openblas
from benchmarks.retrieval_parting import _gap, _scores
from tinygpt_mlx.cache.cold_device import DeviceColdStore
from tinygpt_mlx.generate import forward, prefill


def _cut_gaps(sel):
    """The gaps at a decode step's two cuts (device_select's chain, flat coarse pass) for the
    selection inputs `sel` of one layer (query rows, store, counts): per KV-head row the coarse
    pass's k-th best page bound less the (k+1)-th (None while every page is taken) and the fine
    pass's `units`-th best span score of the pool less the next (benchmarks/retrieval_parting.py's
    scores and gaps, one code for the probe and this test)."""
    st = sel["static"]
    assert not st.index and not st.few and st.summary == "minmax"     # (the cases the test builds)
    coarse, _, fine, _ = _scores(sel)
    return [(_gap(coarse[g], st.top_pages), _gap(fine[g], st.units)) for g in range(fine.shape[0])]


@pytest.mark.slow
def test_this_module_under_openblas():
    """The test below again in a pytest process with OpenBLAS preloaded (tests/openblas.py), where
    the compiled and eager steps round differently and part at a tie; in this process (MLX's
    reference BLAS) they give the same logits."""
    openblas.under_openblas("tests/test_retrieval_ties.py", timeout=900)


@pytest.mark.slow
def test_compiled_and_eager_retrieval_part_only_at_a_tie():
    """The compiled decode step (the model's RoPE as products, the turns as products, fused
    kernels) and the eager one differ by float rounding only, so they pick the same cold tokens
    until rounding reaches a discrete choice between near-equal scores (issue 53's review: on the
    shipped model, `sink4/hot128` after a 700-token prompt, the two runs' logits parted by up to
    0.465 later on). In lockstep on the same tokens: every step before the first one where any
    layer fetches other cold tokens has the eager step's logits within 2e-5 (the same picks: no
    more than rounding), and at that first step the lowest layer that picks otherwise does so
    only for KV-head rows whose eager scores are within 1e-5 of a tie at a cut (the coarse pass's
    k-th page or the fine pass's last span). With OpenBLAS preloaded they part at step 7, layer
    0, at the fine pass's 8th and 9th spans, two pages each holding token 852 (layer-0 keys
    before RoPE, equal up to the rounding of RoPE and its undoing: eager scores equal, the
    compiled ones 1 ulp apart); under the reference BLAS not within the 12 steps. Fails with the
    products' offset or the query's turn one position off, a span fewer picked in the trace, or
    the trace's span scores nudged by 1e-3 per page id (docs/retrieval.md, "Compiled against
    eager")."""
    from tinygpt_mlx.cache import compiled
    from tinygpt_mlx.cache.telemetry import RetrievalTelemetry
    from tinygpt_mlx.cli.common import load_model
    from tinygpt_mlx.evaluate.bench import make_policy

    m = load_model(None).model                  # the shipped model (4 layers)
    prompt = mx.random.randint(0, 1000, (700,), key=mx.random.key(1)).tolist()     # (repeats tokens)
    fast, eager = make_policy("sink4/hot128", m).make(), make_policy("sink4/hot128", m).make()
    eager.compile_decode = False
    eager_stores = {id(c.cold) for c in eager.owned}
    sels, fetched = {}, []
    real_pick, real_record, real_decode = DeviceColdStore._compiled_pick, RetrievalTelemetry.record, compiled._retrieval_decode
    ran = []

    def pick(self, q, units, unit, pos):      # the eager selection's inputs, by layer
        if id(self) in eager_stores:
            static, rope, buckets, summaries, keys, _, recent = self.select_inputs(units, unit, pos)
            sels[self.layer_index] = dict(q=q, static=static, rope=rope, keys=keys, recent=recent, codec=self.codec,
                                          summaries={k: a[:, :buckets[k]] for k, a in summaries.items()},
                                          counts=(self.n, self.n_pages, self.index.n_blocks))
        return real_pick(self, q, units, unit, pos)

    def record(self, s):
        fetched.append((s.layer, [sorted(np.asarray(r).tolist()) for r in s.fetched()]))
        real_record(self, s)
    DeviceColdStore._compiled_pick, RetrievalTelemetry.record = pick, record
    compiled._retrieval_decode = lambda *a: ran.append(real_decode(*a)) or ran[-1]
    try:
        for cache in (fast, eager):
            cache.record_retrievals()
            first = prefill(m, prompt, cache, 256)
        tok, parted = int(mx.argmax(first.reshape(-1, first.shape[-1])[-1]).item()), None
        for step in range(12):
            got = {}
            for name, cache in (("fast", fast), ("eager", eager)):
                fetched.clear()
                logits = forward(m, mx.array([[tok]]), cache)[0, -1]
                got[name] = (np.asarray(logits), dict(fetched))
            parts = {L: [g for g, (a, b) in enumerate(zip(got["fast"][1][L], rows)) if a != b]
                     for L, rows in got["eager"][1].items()}
            parts = {L: rows for L, rows in parts.items() if rows}
            if parts:
                parted = step
                L = min(parts)
                gaps = _cut_gaps(sels[L])
                for g in parts[L]:
                    assert min(x for x in gaps[g] if x is not None) <= 1e-5, (step, L, g, gaps[g])
                break
            np.testing.assert_allclose(got["fast"][0], got["eager"][0], rtol=0, atol=2e-5)
            tok = int(got["eager"][0].argmax())
    finally:
        DeviceColdStore._compiled_pick, RetrievalTelemetry.record = real_pick, real_record
        compiled._retrieval_decode = real_decode
    assert sum(r is not None for r in ran) >= min(6, len(ran)) and not compiled.trace_failures
    assert parted is None or parted >= 1, parted      # (the first step's picks are the same)
