"""Evaluation: prefix match, perplexity through the cached path, KL, bench, and the CLI."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest
from conftest import recorded_bench_caches
from typer.testing import CliRunner

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate import bench, compare, perplexity
from tinygpt_mlx.evaluate.compare import prefix_match
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.evaluate.modes import parse_policies

TEXT = "And it came to pass that the keeper of numbers 0123456789 went forth. The quick brown fox. "


@pytest.mark.parametrize("ref, cand, expected", [
    ([1, 2, 3, 4], [1, 2, 3, 4], (4, 1.0)),        # identical
    ([1, 2, 3, 4], [1, 2, 9, 4], (2, 0.5)),        # diverges at k = 2
    ([1, 2, 3, 4], [7, 2, 3, 4], (0, 0.0)),        # diverges at once
    ([], [], (0, 1.0)),                            # nothing generated: nothing diverged
    ([1, 2], [1, 2, 3, 4], (2, 0.5)),              # a shorter run counts as diverging where it ends
])
def test_prefix_match(ref, cand, expected):
    assert prefix_match(ref, cand) == expected


def test_policy_specs():
    assert parse_policy("fp32") == CacheConfig() == parse_policy("full")
    assert parse_policy("int4") == CacheConfig(key_bits=4, value_bits=4)
    assert parse_policy("bf16") == CacheConfig(storage="bf16")
    assert parse_policy("k8v4") == CacheConfig(key_bits=8, value_bits=4)
    assert parse_policy("int8+sink4/window256") == CacheConfig(key_bits=8, value_bits=8, sink=4, window=256)
    assert parse_policy("window64:absolute") == CacheConfig(window=64, rope_mode="absolute")
    assert parse_policy("int4+g64+r128") == CacheConfig(key_bits=4, value_bits=4, group_size=64, residual=128)
    assert list(parse_policies("int8, bf16")) == ["int8", "bf16"]
    for bad in ("int3", "int4+int8", "sink4", "window0", "int4+r40"):
        with pytest.raises(ValueError, match="policy"):
            parse_policy(bad)


def _tokens(native, n):
    ids = native.tokenizer.encode(TEXT * 4)[:n]
    assert len(ids) == n
    return ids


def test_cached_perplexity_equals_full_forward(native):
    ids = _tokens(native, 48)
    logits = native.model(mx.array(ids)[None])[0, :-1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1).mean().item()
    r = perplexity.perplexity(native.model, ids, CacheConfig(), baseline=None, prefill_tokens=8)
    assert r.tokens == 47 and r.kl_mean is None
    assert r.perplexity == pytest.approx(math.exp(nll), rel=1e-4)


def _captured_caches(monkeypatch):
    """The caches perplexity() makes, kept to look at their bytes and counts afterwards."""
    made = []

    def make(model, config):
        cache = make_cache(model, config)
        made.append(cache)
        return cache
    monkeypatch.setattr(perplexity, "make_cache", make)
    return made


@pytest.mark.parametrize("spec", ["int4", "sink4/window16"])
def test_policy_against_itself(wide, spec, monkeypatch):
    # 80 tokens: past KIVI's R + G = 64 (a block is packed) and past sink + window = 20
    ids = _tokens(wide, 80)
    config = parse_policy(spec)
    made = _captured_caches(monkeypatch)
    r = perplexity.perplexity(wide.model, ids, config, baseline=config, prefill_tokens=8)
    assert r.kl_mean == pytest.approx(0.0, abs=1e-6)
    assert r.top1_agreement == 1.0
    assert r.perplexity == pytest.approx(r.baseline_perplexity, rel=1e-6)
    for cache in made:
        if config.quantised:
            assert cache.nbytes_breakdown()["body_packed"] > 0 and cache.owned[0].body.n_packed == 32
        else:
            assert cache.stored_count == 20 and cache.current_length == 79


# KL(fp32 || policy) per position on `wide`, 80 tokens, measured: int8 1.95e-7, int4 3.24e-5
@pytest.mark.parametrize("spec, kl_max", [("int8", 4e-7), ("int4", 6.5e-5)])
def test_quantised_policy_against_fp32(wide, spec, kl_max, monkeypatch):
    ids = _tokens(wide, 80)
    made = _captured_caches(monkeypatch)
    r = perplexity.perplexity(wide.model, ids, parse_policy(spec), prefill_tokens=8)
    policy_cache, base_cache = made
    assert policy_cache.nbytes_breakdown()["body_packed"] > 0
    assert policy_cache.nbytes < base_cache.nbytes
    assert 0 < r.kl_mean < kl_max, r.kl_mean   # > 0: the packed block is in the scored logits
    assert r.perplexity != r.baseline_perplexity


@pytest.mark.parametrize("prefill", [8, 48])
def test_windowed_perplexity_equals_from_scratch_reference(wide, prefill):
    """Absolute-mode StreamingLLM scored through the cache (a prefill chunk, then token by
    token, evicting) against one uncached forward with the sink + window mask: the same NLL,
    and KL / top-1 against the uncached full forward. Prefill 48 > sink + window: the mask
    windows the chunk; prefill 8: eviction alone does."""
    from conftest import streaming_reference_logits

    def logp_of(logits):
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    ids = _tokens(wide, 80)
    target = mx.array(ids[1:])[:, None]
    win = logp_of(streaming_reference_logits(wide.model, ids, 4, 16)[:-1])
    full = logp_of(wide.model(mx.array([ids]))[0, :-1].astype(mx.float32))
    nll = -mx.take_along_axis(win, target, axis=-1).mean().item()
    kl = (mx.exp(full) * (full - win)).sum(-1).mean().item()
    top1 = (win.argmax(-1) == full.argmax(-1)).astype(mx.float32).mean().item()
    r = perplexity.perplexity(wide.model, ids, parse_policy("sink4/window16:absolute"), prefill_tokens=prefill)
    assert r.stored_count == 20 and kl > 0.01 and top1 < 0.9   # it evicted, and that mattered
    assert r.perplexity == pytest.approx(math.exp(nll), rel=3e-7)   # measured rel 1.2e-7
    assert r.baseline_perplexity == pytest.approx(math.exp(-mx.take_along_axis(full, target, axis=-1).mean().item()),
                                                  rel=3e-7)
    assert r.kl_mean == pytest.approx(kl, rel=6e-7)                  # measured rel 3.0e-7
    assert r.top1_agreement == pytest.approx(top1, abs=1e-6)         # 57/79 both (fp32 mean)


def test_compare_identical_policy_matches(native):
    result = compare.compare(native, ["In the beginning", "The fox"], {"fp32": CacheConfig()}, tokens=5)
    assert result["modes"]["fp32"]["mean_prefix_match"] == 1.0
    assert result["modes"]["fp32"]["prompts"][1]["matched_tokens"] == 5


def test_default_prompts_ship():
    prompts = compare.default_prompts()
    assert len(prompts) >= 16 and all(prompts)


def test_bench_rows(wide, native):
    policies = ["int4", "mlx", "mlx-rotating12", "mlx-q4", "sink4/window8:absolute@eager", "sink4/window8@eager",
                "sink4/window8:absolute", "sink4/window8"]
    r = bench.bench(wide.model, policies, [16, 96], decode_steps=2)
    assert {(row["policy"], row["context"]) for row in r["rows"]} == {
        (p, c) for p in ["fp32"] + policies for c in (16, 96)}
    assert not r["skipped"]
    at96 = {row["policy"]: row for row in r["rows"] if row["context"] == 96}
    assert at96["mlx-q4"]["cache_bytes"] < at96["mlx"]["cache_bytes"]  # both allocate 256-token steps
    assert at96["int4"]["cache_bytes_vs_fp32"] < 1  # beyond the exact residual of 32 tokens
    assert at96["fp32"]["decode_tokens_per_s_vs_fp32"] == 1.0 and at96["fp32"]["cache_bytes"] > 0
    # what one decode step runs: our full cache and mlx-lm's the same graph; our absolute ring,
    # stepped eagerly, the same as RotatingKVCache; the shifted ring a few more per layer
    # (test_ring.py); compiled (cache/compiled.py), both rings far fewer
    kernels = {p: row["decode_kernels"] for p, row in at96.items()}
    assert kernels["fp32"] == kernels["mlx"] and kernels["sink4/window8:absolute@eager"] == kernels["mlx-rotating12"]
    assert 0 < kernels["sink4/window8@eager"] - kernels["sink4/window8:absolute@eager"] <= 8 * len(wide.model.layers)
    assert kernels["sink4/window8:absolute"] < 0.75 * kernels["mlx-rotating12"]     # measured 86 vs 139
    assert kernels["sink4/window8"] < 0.75 * kernels["sink4/window8@eager"]
    assert at96["sink4/window8@eager"]["label"].endswith("(eager steps)")
    assert sum(at96["int4"]["decode_ops_by_primitive"].values()) == at96["int4"]["decode_ops"] > kernels["int4"]
    # head_dim 16 cannot be quantised (KIVI value groups, mx.quantize): skipped, not fatal
    r = bench.bench(native.model, ["int4", "mlx-q4"], [16], decode_steps=1)
    assert set(r["skipped"]) == {"int4", "mlx-q4"} and len(r["rows"]) == 1


def test_bench_measures_every_policy_it_can(native, native_path, monkeypatch, tmp_path):
    """A policy that fails on this backend (MLX raises at evaluation: a kernel missing for a
    shape, as mlx-lm's quantised cache did on CUDA) gets its row marked with the one-line reason
    and the others are still measured; one that fails in the warm-up is listed as skipped; the
    CLI prints the reason in the table and writes the rest to JSON."""
    from mlx_lm.models.cache import KVCache as MlxKVCache

    class Failing(MlxKVCache):
        def __init__(self, after):
            super().__init__()
            self.after = after

        def update_and_fetch(self, keys, values):
            if self.offset + keys.shape[2] > self.after:
                raise RuntimeError("[quantized_matmul] No implementation for problem shape: 8x8x64x9\nmore")
            return super().update_and_fetch(keys, values)

    plain = bench.make_policy

    def make_policy(spec, model):
        if spec in ("mlx", "mlx-q4"):   # a failure past the warm-up's tokens (at 40 only) / at once
            after = 30 if spec == "mlx" else 0
            return bench.Policy(spec, f"failing {spec}", lambda: bench.MlxLmCache(Failing(after) for _ in model.layers))
        return plain(spec, model)
    monkeypatch.setattr(bench, "make_policy", make_policy)
    r = bench.bench(native.model, ["mlx", "mlx-q4", "sink4/window8"], [16, 40], decode_steps=2)
    assert r["skipped"] == {"mlx-q4": "RuntimeError: [quantized_matmul] No implementation for problem shape: 8x8x64x9"}
    rows = {(row["policy"], row["context"]): row for row in r["rows"]}
    assert set(rows) == {(p, c) for p in ("fp32", "mlx", "sink4/window8") for c in (16, 40)}
    assert rows[("mlx", 16)]["decode_tokens_per_s_vs_fp32"] > 0 and "error" not in rows[("mlx", 16)]
    assert rows[("mlx", 40)]["error"] == "RuntimeError: [quantized_matmul] No implementation for problem shape: 8x8x64x9"
    assert "decode_tokens_per_s" not in rows[("mlx", 40)]
    for c in (16, 40):
        assert rows[("sink4/window8", c)]["decode_tokens_per_s_vs_fp32"] > 0
    out = tmp_path / "b.json"
    monkeypatch.setattr(bench, "bench", lambda *a, **k: r)
    res = _run("bench", native_path, "--contexts", "16", "--policies", "mlx", "--json", out)
    assert res.exit_code == 0, res.output
    assert "failed" in res.output and "skipped mlx-q4" in res.output
    assert json.loads(out.read_text())["rows"] == r["rows"]


# ----- CLI ------------------------------------------------------------------------------------

def _run(*args):
    from tinygpt_mlx.cli.main import app
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_compare_json(native_path, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("In the beginning\n\nThe quick brown fox\n")
    out = tmp_path / "c.json"
    r = _run("compare", native_path, "--prompts", prompts, "--tokens", 4, "--modes", "bf16,sink2/window4",
             "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["baseline"] == "fp32" and d["tokens"] == 4 and list(d["modes"]) == ["bf16", "sink2/window4"]
    row = d["modes"]["bf16"]["prompts"][0]
    assert set(row) >= {"prompt", "prefix_match", "matched_tokens"}
    # the numbers against an independent greedy loop: uncached fp32, and the window policy
    # through the cache one token at a time (test_policies pins the window to a reference)
    from tinygpt_mlx.loading import load
    loaded = load(native_path)
    rates = []
    for i, prompt in enumerate(["In the beginning", "The quick brown fox"]):
        ids = loaded.tokenizer.encode(prompt)
        ref = _greedy_uncached(loaded.model, ids, 4)
        assert d["baseline_texts"][i] == loaded.tokenizer.decode(ref)
        got = _greedy_cached(loaded.model, ids, parse_policy("sink2/window4"), 4)
        matched, rate = prefix_match(ref, got)
        row = d["modes"]["sink2/window4"]["prompts"][i]
        assert (row["matched_tokens"], row["prefix_match"]) == (matched, rate)
        rates.append(rate)
    assert d["modes"]["sink2/window4"]["mean_prefix_match"] == pytest.approx(sum(rates) / 2)
    assert rates != [1.0, 1.0]   # the window changed something: the numbers are not trivially 1


def _greedy_uncached(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(ids):]


def _greedy_cached(model, ids, config, n):
    from tinygpt_mlx.generate import forward
    cache = make_cache(model, config)
    logits, out = forward(model, mx.array([ids]), cache)[0, -1], []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = forward(model, mx.array([out[-1:]]), cache)[0, -1]
    return out


def test_cli_compare_bad_mode(native_path):
    r = _run("compare", native_path, "--modes", "int8,int3")
    assert r.exit_code == 2     # a usage error, before the model loads (session 44; it was 1)
    errors = [line for line in r.output.splitlines() if "error" in line]
    assert len(errors) == 1 and "int3" in errors[0]


def test_cli_perplexity_json(native_path, wide_path, wide, tmp_path):
    # 80 tokens: KIVI packs a block (R + G = 64; the first chunk is 64, then token by token)
    text, out = tmp_path / "t.txt", tmp_path / "p.json"
    text.write_text(TEXT * 4)
    ids = wide.tokenizer.encode(TEXT * 4)[:80]
    r = _run("perplexity", wide_path, "--text", text, "--max-tokens", 80, "--kv-quantize", "int8",
             "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    # the library's numbers for the same text and policy (prefill 64, the CLI default) ...
    lib = perplexity.perplexity(wide.model, ids, parse_policy("int8"), prefill_tokens=64)
    assert d["tokens"] == lib.tokens == 79
    for key in ("perplexity", "baseline_perplexity", "kl_mean", "top1_agreement"):
        assert d[key] == pytest.approx(getattr(lib, key), rel=1e-6, abs=1e-12), key
    # ... whose baseline is the uncached model, and int8 moved the logits a little
    logits = wide.model(mx.array([ids]))[0, :-1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1).mean().item()
    assert d["baseline_perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
    assert 0 < d["kl_mean"] < 4e-7 and d["top1_agreement"] == 1.0   # measured KL 1.8e-7
    assert d["cache_bytes"] < d["stored_count"] * 2 * 2 * 2 * 32 * 4   # < fp32 (layers, K/V, heads, dim)
    r = _run("perplexity", native_path, "--text", text, "--max-tokens", 30, "--baseline", "none",
             "--streaming-llm-sink", 2, "--streaming-llm-window", 8, "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["kl_mean"] is None and d["stored_count"] == 10
    r = _run("perplexity", wide_path, "--text", text, "--max-tokens", 80, "--modes", "fp32,int4", "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert list(d["modes"]) == ["fp32", "int4"] and d["modes"]["fp32"]["kl_mean"] == pytest.approx(0, abs=1e-9)
    assert d["modes"]["int4"]["baseline_perplexity"] == d["baseline_perplexity"]
    # int4 really quantised: fewer bytes than fp32 for the same tokens, and KL > 0
    assert d["modes"]["int4"]["cache_bytes"] < d["modes"]["fp32"]["cache_bytes"]
    assert d["modes"]["int4"]["stored_count"] == d["modes"]["fp32"]["stored_count"] == 79
    assert d["modes"]["int4"]["kl_mean"] > 1e-6


def test_cli_perplexity_retrieval_flags_take_positions_by_the_runs_length(native_path, tmp_path):
    """Retrieval flags without --streaming-llm-rope: 30 tokens inside the 256-token context
    score at original positions, as the spec naming them does; a spec keeps its own rule."""
    text, out = tmp_path / "t.txt", tmp_path / "p.json"
    text.write_text(TEXT * 4)

    def scored(*args):
        r = _run("perplexity", native_path, "--text", text, "--max-tokens", 30, "--baseline", "none",
                 "--json", out, *args)
        assert r.exit_code == 0, r.output
        return json.loads(out.read_text())

    auto = scored("--streaming-llm-sink", 2, "--kiv-hot-budget", 8)
    assert auto["policy"]["retrieval"]["rope_mode"] == "absolute" and "original positions" in auto["label"]
    named = scored("--modes", "sink2/hot8:absolute,sink2/hot8")["modes"]
    # the same computation to the bit; the random tiny model moves only in the 7th digit with the rule
    assert auto["perplexity"] == named["sink2/hot8:absolute"]["perplexity"]
    assert named["sink2/hot8"]["policy"]["retrieval"]["rope_mode"] == "shifted"
    assert named["sink2/hot8"]["perplexity"] != auto["perplexity"]


def test_bench_stage_split_of_retrieval(wide, native):
    """--stages: a retrieval row says where its prefill and decode time went (every stage ran,
    and the parts add up to the measured time); other rows and runs without it have no split."""
    r = bench.bench(wide.model, ["sink2/hot16"], [96], decode_steps=2, prefill_chunk=16, stages=True)
    row = {x["policy"]: x for x in r["rows"]}
    assert "prefill_stage_ms_per_token" not in row["fp32"]
    for kind, per_s in (("prefill", "prefill_tokens_per_s"), ("decode", None)):
        ms = row["sink2/hot16"][f"{kind}_stage_ms_per_token"]
        assert set(ms) == {"model", "coarse", "gather", "attend", "other"}
        assert all(ms[k] > 0 for k in ("coarse", "gather", "attend"))
        if per_s:
            assert sum(ms.values()) == pytest.approx(1e3 / row["sink2/hot16"][per_s], rel=1e-6)
    plain = bench.bench(wide.model, ["sink2/hot16"], [96], decode_steps=2, prefill_chunk=16)
    assert all("prefill_stage_ms_per_token" not in x for x in plain["rows"])


def test_bench_parts_split_each_decode_step(wide, native):
    """--parts: every row (ours and mlx-lm's) gets its decode step split into graph build and
    evaluation, which add up to the whole step; `step_parts` steps every cache once per step
    (interleaved), warm-up included; runs without it have no split."""
    r = bench.bench(wide.model, ["int4", "sink2/window8", "mlx"], [40], decode_steps=3, prefill_chunk=16, parts=True)
    assert r["parts"] and len(r["rows"]) == 4
    for row in r["rows"]:
        us = row["decode_step_us"]
        assert us["build"] > 0 and us["eval"] > 0 and us["build"] + us["eval"] == pytest.approx(us["whole"])
    caches = [bench.make_policy(s, wide.model).make() for s in ("fp32", "sink2/window8")]
    for cache in caches:
        mx.eval(wide.model(mx.array([list(range(1, 21))]), cache=cache))
    parts = bench.step_parts(wide.model, caches, steps=4, warmup=2)
    assert len(parts) == 2 and [c.current_length for c in caches] == [26, 26]
    plain = bench.bench(wide.model, ["int4"], [40], decode_steps=2, prefill_chunk=16)
    assert not plain["parts"] and all("decode_step_us" not in x for x in plain["rows"])


@pytest.mark.parametrize("own", [False, True])
def test_bench_progress_covers_the_parts_phase(wide, own):
    """The bar follows `--parts` too (it sat at the end of the timed steps while the split ran
    minutes at 32K): the last call says total of total, after calls that name the parts phase,
    one per policy and round (warm-up included), never past the total."""
    calls = []
    bench.bench(wide.model, ["sink2/window8"], [40], decode_steps=3, prefill_chunk=16, parts=not own,
                parts_own=own, progress=lambda done, total, what: calls.append((done, total, what)))
    total = calls[-1][1]
    assert [d for d, _, _ in calls] == list(range(1, total + 1)) and {t for _, t, _ in calls} == {total}
    named = [w for _, _, w in calls if w.endswith("(decode step parts)")]
    assert len(named) == 2 * (bench.PARTS_WARMUP + 3) and calls[-1][2] in named


def test_bench_parts_builds_follow_every_other_cache(wide, monkeypatch):
    """`step_parts` shuffles the caches' order every round: each cache's step follows each other
    cache's (at 8K a build after a long cache's evaluation was up to a third slower, so a fixed
    cyclic order measured a neighbour, not the policy: docs/results.md); every cache still stepped
    once per round."""
    calls, caches = recorded_bench_caches(wide, monkeypatch)
    bench.step_parts(wide.model, caches, steps=10, warmup=2)
    assert [c.current_length for c in caches] == [32, 32, 32]
    rounds = [calls[k:k + 3] for k in range(0, len(calls), 3)]
    assert all(sorted(r) == sorted(id(c) for c in caches) for r in rounds)    # once per round
    before = {id(c): set() for c in caches}
    for a, b in zip(calls, calls[1:]):
        if a != b:
            before[b].add(a)
    assert all(len(v) == 2 for v in before.values()), before     # each followed both others


def test_bench_parts_own_times_each_build_after_its_own_step(wide, monkeypatch):
    """`step_parts(after_own=True)` (`bench --parts-own`): each cache's timed build follows an
    untimed step of its own (a decode loop's order), the caches still shuffled every round, so
    the untimed steps follow every other cache; `bench` says which order its parts measured."""
    calls, timed = [], []
    real = bench.forward
    monkeypatch.setattr(bench, "forward", lambda m, t, c: calls.append(id(c)) or real(m, t, c))
    clock = bench.time.perf_counter
    caches = [bench.make_policy(s, wide.model).make() for s in ("fp32", "sink2/window8", "int8")]
    for cache in caches:
        mx.eval(wide.model(mx.array([list(range(1, 21))]), cache=cache))

    def perf_counter():     # the call a timed build starts after: the last one made
        timed.append(len(calls))
        return clock()
    monkeypatch.setattr(bench.time, "perf_counter", perf_counter)
    bench.step_parts(wide.model, caches, steps=10, warmup=2, after_own=True)
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    assert [c.current_length for c in caches] == [44, 44, 44]       # two steps per cache and round
    starts = timed[0::3]      # (three clock reads per timed step: before, after the build, after eval)
    assert len(starts) == 12 * 3 and all(calls[k - 1] == calls[k] for k in starts)   # after its own step
    pairs = [calls[k:k + 2] for k in range(0, len(calls), 2)]
    assert all(a == b for a, b in pairs)
    firsts = [a for a, _ in pairs]
    before = {id(c): set() for c in caches}
    for a, b in zip(firsts, firsts[1:]):
        if a != b:
            before[b].add(a)
    assert all(len(v) == 2 for v in before.values()), before     # the untimed steps follow every other
    asked = []
    real_parts = bench.step_parts
    monkeypatch.setattr(bench, "step_parts", lambda *a, **k: asked.append(k.get("after_own")) or real_parts(*a, **k))
    r = bench.bench(wide.model, ["int8"], [24], decode_steps=2, prefill_chunk=16, parts_own=True)
    assert r["parts"] and r["parts_order"] == "own" and all("decode_step_us" in x for x in r["rows"])
    assert bench.bench(wide.model, ["int8"], [24], decode_steps=2, prefill_chunk=16, parts=True)["parts_order"] == "shuffled"
    assert asked == [True, False]


def test_bench_steps_follow_every_other_cache(wide, monkeypatch):
    """`measure` shuffles the policies' order every round of prefill chunks and decode steps:
    within a round each policy's step follows each other policy's (a rotating order made a
    policy always follow the same neighbour: the 8K window cells of docs/results.md's 7-policy
    table followed the full caches' steps); every policy still runs once per round, and the same
    seed gives the same order."""
    real = bench.steps

    def orders(seed):
        calls, index = [], {}

        def recorded(model, tokens, cache, *a, **k):    # called once per policy, in their order
            index[id(cache)] = len(index)

            def run():
                for x in real(model, tokens, cache, *a, **k):
                    calls.append(index[id(cache)])
                    yield x
            return run()
        monkeypatch.setattr(bench, "steps", recorded)
        policies = [bench.make_policy(s, wide.model) for s in ("fp32", "sink2/window8", "int8")]
        rows = bench.measure(wide.model, policies, list(range(1, 41)), 12, prefill_chunk=8, seed=seed)
        assert [r["policy"] for r in rows] == ["fp32", "sink2/window8", "int8"]
        return calls

    calls = orders(0)
    rounds = [calls[k:k + 3] for k in range(0, len(calls), 3)]
    assert len(rounds) == 5 + 12 and all(len(set(r)) == 3 for r in rounds)    # once per round
    before: dict = {}
    for r in rounds:
        for a, b in zip(r, r[1:]):
            before.setdefault(b, set()).add(a)
    assert len(before) == 3 and all(len(v) == 2 for v in before.values()), before
    assert orders(0) == calls and orders(1) != calls


def test_cli_bench_parts_table_and_json(wide_path, tmp_path):
    out = tmp_path / "b.json"
    r = _run("bench", wide_path, "--contexts", "16", "--policies", "int8", "--decode-steps", 2, "--parts",
             "--json", out)
    assert r.exit_code == 0, r.output
    assert "decode step parts" in r.output and "graph build" in r.output
    d = json.loads(out.read_text())
    assert d["parts"] and all(set(x["decode_step_us"]) == {"build", "eval", "whole"} for x in d["rows"])


def test_cli_bench_parts_own_says_its_order(wide_path, tmp_path):
    """`bench --parts-own`: the parts measured after each policy's own step, and said so in the
    table and the JSON (plain --parts: after whichever policy ran before)."""
    out = tmp_path / "b.json"
    r = _run("bench", wide_path, "--contexts", "16", "--policies", "int8", "--decode-steps", 2, "--parts-own",
             "--json", out)
    assert r.exit_code == 0, r.output
    assert "each build after its own step" in " ".join(r.output.split())
    d = json.loads(out.read_text())
    assert d["parts"] and d["parts_order"] == "own" and all("decode_step_us" in x for x in d["rows"])


def test_cli_bench_json_and_plot(wide_path, tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    r = _run("bench", wide_path, "--contexts", "16,32", "--policies", "int8,sink2/window8,mlx",
             "--decode-steps", 2, "--json", out, "--plot", png)
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8  # fp32 always runs: the ratios are against it
    for row in rows:
        assert set(row) >= {"policy", "context", "prefill_tokens_per_s", "decode_tokens_per_s", "cache_bytes"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perplexity_segments_and_score_chunk(native):
    """Per-segment perplexities recombine into the whole text's; feeding the full cache 37 tokens
    per call scores exactly what one token per call scores (a cached path against itself fed
    differently); an evicting cache fed in chunks differs (so the check can fail)."""
    import math

    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.evaluate.perplexity import perplexities

    ids = native.tokenizer.encode("In the beginning God created the heaven and the earth. " * 12)[:200]
    full, window = CacheConfig(), CacheConfig(sink=4, window=28)
    one = perplexities(native.model, ids, {"full": full, "win": window}, None, 16, segment=50)
    many = perplexities(native.model, ids, {"full": full, "win": window}, None, 16, segment=50, score_chunk=37)
    for r in one.values():
        segs = r.segment_perplexity
        assert [(s["start"], s["end"]) for s in segs] == [(0, 50), (50, 100), (100, 150), (150, 199)]
        whole = math.exp(sum(math.log(s["perplexity"]) * (s["end"] - s["start"]) for s in segs) / r.tokens)
        assert abs(whole - r.perplexity) < 1e-3 * r.perplexity
    assert abs(one["full"].perplexity - many["full"].perplexity) < 1e-4 * one["full"].perplexity
    for a, b in zip(one["full"].segment_perplexity, many["full"].segment_perplexity):
        assert abs(a["perplexity"] - b["perplexity"]) < 1e-4 * a["perplexity"]
    assert abs(one["win"].perplexity - many["win"].perplexity) > 1e-3
    with pytest.raises(ValueError, match="score_chunk"):
        perplexities(native.model, ids, {"full": full}, None, 16, score_chunk=0)


@pytest.mark.parametrize("args, named", [
    (["--segment", "0"], "Invalid value for '--segment': Input should be greater than or equal to 1"),
    (["--score-chunk", "0"], "Invalid value for '--score-chunk': Input should be greater than or equal to 1"),
])
def test_cli_perplexity_bad_segment_and_chunk_are_one_line(native_path, args, named):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    r = CliRunner().invoke(app, ["perplexity", str(native_path), "--max-tokens", "40", *args])
    assert r.exit_code == 2       # a usage error, before the model loads
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and named in lines[0], r.stderr


def test_read_prompts_jsonl_keeps_newlines_and_names_a_bad_line(tmp_path):
    from tinygpt_mlx.evaluate.compare import read_prompts
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps("def f():\n    return 1\n") + "\n\n" + json.dumps("Line one.\nLine two.") + "\n")
    assert read_prompts(good) == ["def f():\n    return 1\n", "Line one.\nLine two."]
    plain = tmp_path / "p.txt"      # the same text as a plain file: a prompt per line, as before
    plain.write_text(good.read_text())
    assert read_prompts(plain) == [json.dumps("def f():\n    return 1\n"), json.dumps("Line one.\nLine two.")]
    for body, what in ((json.dumps("ok") + "\n{not json\n", "p.jsonl:2: not JSON"),
                       (json.dumps({"prompt": "x"}) + "\n", "p.jsonl:1: a .jsonl prompt file holds one"),
                       (json.dumps("  ") + "\n", "p.jsonl:1: a .jsonl prompt file holds one")):
        good.write_text(body)
        with pytest.raises(ValueError, match=what):
            read_prompts(good)


def test_bench_rows_say_what_is_on_disk(wide):
    """A row's `cache_disk_bytes`: the host cold store's files (all its cold rows), none for the
    ram store; the bytes in all are the same (placement is not policy)."""
    r = bench.bench(wide.model, ["sink2/hot16", "sink2/hot16+colddisk"], [96], decode_steps=1, prefill_chunk=16)
    row = {x["policy"]: x for x in r["rows"]}
    assert row["fp32"]["cache_disk_bytes"] == row["sink2/hot16"]["cache_disk_bytes"] == 0
    assert 0 < row["sink2/hot16+colddisk"]["cache_disk_bytes"] < row["sink2/hot16+colddisk"]["cache_bytes"]
    assert row["sink2/hot16+colddisk"]["cache_bytes"] == row["sink2/hot16"]["cache_bytes"]
