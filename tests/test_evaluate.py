"""Evaluation: prefix match, perplexity through the cached path, KL, bench, and the CLI."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate import bench, compare, perplexity
from tinygpt_mlx.evaluate.compare import prefix_match
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.evaluate.modes import parse_policies

@pytest.fixture(scope="module")
def wide_path(tmp_path_factory, tokenizer_json):
    """A tiny native model with head_dim 32, so KIVI and mlx-lm's quantised cache apply."""
    from conftest import build_native
    return build_native(tmp_path_factory.mktemp("wide") / "wide.tinygpt", tokenizer_json, d_model=128)


@pytest.fixture(scope="module")
def wide(wide_path):
    from tinygpt_mlx.loading import load
    return load(wide_path)


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


@pytest.mark.parametrize("spec", ["int4", "sink4/window16"])
def test_policy_against_itself(wide, spec):
    ids = _tokens(wide, 40)
    config = parse_policy(spec)
    r = perplexity.perplexity(wide.model, ids, config, baseline=config, prefill_tokens=8)
    assert r.kl_mean == pytest.approx(0.0, abs=1e-6)
    assert r.top1_agreement == 1.0
    assert r.perplexity == pytest.approx(r.baseline_perplexity, rel=1e-6)


def test_compare_identical_policy_matches(native):
    result = compare.compare(native, ["In the beginning", "The fox"], {"fp32": CacheConfig()}, tokens=5)
    assert result["modes"]["fp32"]["mean_prefix_match"] == 1.0
    assert result["modes"]["fp32"]["prompts"][1]["matched_tokens"] == 5


def test_default_prompts_ship():
    prompts = compare.default_prompts()
    assert len(prompts) >= 16 and all(prompts)


def test_bench_rows(wide, native):
    r = bench.bench(wide.model, ["int4", "mlx", "mlx-rotating12", "mlx-q4"], [16, 96], decode_steps=2)
    assert {(row["policy"], row["context"]) for row in r["rows"]} == {
        (p, c) for p in ("fp32", "int4", "mlx", "mlx-rotating12", "mlx-q4") for c in (16, 96)}
    assert not r["skipped"]
    at96 = {row["policy"]: row for row in r["rows"] if row["context"] == 96}
    assert at96["mlx-q4"]["cache_bytes"] < at96["mlx"]["cache_bytes"]  # both allocate 256-token steps
    assert at96["int4"]["cache_bytes_vs_fp32"] < 1  # beyond the exact residual of 32 tokens
    assert at96["fp32"]["decode_tokens_per_s_vs_fp32"] == 1.0 and at96["fp32"]["cache_bytes"] > 0
    # head_dim 16 cannot be quantised (KIVI value groups, mx.quantize): skipped, not fatal
    r = bench.bench(native.model, ["int4", "mlx-q4"], [16], decode_steps=1)
    assert set(r["skipped"]) == {"int4", "mlx-q4"} and len(r["rows"]) == 1


# ----- CLI ------------------------------------------------------------------------------------

def _run(*args):
    from cli.main import app
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
    assert 0.0 <= d["modes"]["sink2/window4"]["mean_prefix_match"] <= 1.0


def test_cli_compare_bad_mode(native_path):
    r = _run("compare", native_path, "--modes", "int8,int3")
    assert r.exit_code == 1
    errors = [line for line in r.output.splitlines() if "error" in line]
    assert len(errors) == 1 and "int3" in errors[0]


def test_cli_perplexity_json(native_path, wide_path, tmp_path):
    text, out = tmp_path / "t.txt", tmp_path / "p.json"
    text.write_text(TEXT * 4)
    r = _run("perplexity", wide_path, "--text", text, "--max-tokens", 30, "--kv-quantize", "int8",
             "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["tokens"] == 29 and d["perplexity"] > 1 and 0 <= d["top1_agreement"] <= 1
    assert {"baseline_perplexity", "kl_mean"} <= set(d)
    r = _run("perplexity", native_path, "--text", text, "--max-tokens", 30, "--baseline", "none",
             "--streaming-llm-sink", 2, "--streaming-llm-window", 8, "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["kl_mean"] is None and d["stored_count"] == 10
    r = _run("perplexity", wide_path, "--text", text, "--max-tokens", 30, "--modes", "fp32,int4", "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert list(d["modes"]) == ["fp32", "int4"] and d["modes"]["fp32"]["kl_mean"] == pytest.approx(0, abs=1e-9)
    assert d["modes"]["int4"]["baseline_perplexity"] == d["baseline_perplexity"]


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
