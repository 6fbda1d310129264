"""Sliding-window layers (Gemma 2/3's local layers) as our exact rings of their own window,
under every policy (issue 55): the long-context policy applies to the global layers only.

On a tiny mlx-lm gemma3_text (sliding window 16, every third layer global) fed prompts longer
than the window, in chunks that cross it:

* under every policy (full, bf16, int4, StreamingLLM, retrieval) the logits and greedy tokens
  equal those of the same policy with mlx-lm's own `RotatingKVCache` on the sliding layers (the
  behaviour before: the policy already applied to the global layers only; bf16 storage: full
  bf16 sliding layers, which the model's mask limits), and under the full policy mlx-lm's own
  caches on every layer;
* a sliding layer holds at most W + L - 1 tokens during a call of L, exactly min(seen, W) between
  calls, whatever the policy's window; the counts and the bytes split count the global layers;
* a prompt-cache file and a checkpoint of it round-trip (same logits afterwards), a file
  records each layer's kind and one whose kinds differ from the model's is one line;
* trimming: a sliding ring trims as mlx-lm's RotatingKVCache does (everything until it
  evicts, nothing after);
* the CLI: `cache-prompt` then `sample --prompt-cache`, and the report line's split.

Mutations checked to fail here (one at a time, then reverted): the ring's sees_all ignoring the
sink (masks nothing with a sink); `KVCache.stored_count` over every layer; persist not checking
the kinds; the ring's truncate leaving its pointer one slot on.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache
from typer.testing import CliRunner

from conftest import build_mlx_lm_dir

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.kv_cache import KVCache
from tinygpt_mlx.cache.persist import PromptCacheError, load_prompt_cache, save_prompt_cache
from tinygpt_mlx.cache.ring import RingLayer
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.modes import parse_policy

W = 16            # the tiny model's sliding window
PATTERN = 3       # layers 0, 1 sliding, 2 global, ...
PROMPT = np.random.RandomState(3).randint(1, 300, 57).tolist()
CHUNK = 12        # prefill chunks that cross the window
DECODE = 20

POLICIES = {
    "full": CacheConfig(),
    "bf16": parse_policy("bf16"),
    "int4": parse_policy("int4"),
    "streaming": CacheConfig(sink=4, window=24),
    "streaming-narrow": CacheConfig(sink=2, window=8),      # the policy's window below the layer's
    "retrieval": CacheConfig(sink=4, hot_budget=24, retrieve_tokens=8, page_size=4),
}


def build_gemma3_dir(path: Path, tokenizer_json: str, seed: int = 0, n_layers: int = 6) -> Path:
    """A tiny mlx-lm gemma3_text checkpoint (conftest.build_mlx_lm_dir): sliding window W, every
    PATTERN-th layer global."""
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    config = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": n_layers,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "query_pre_attn_scalar": 32, "vocab_size": len(vocab) + 1, "sliding_window": W,
              "sliding_window_pattern": PATTERN, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
              "rope_theta": 10000.0, "rope_local_base_freq": 1000.0}
    return build_mlx_lm_dir(path, tokenizer_json, config, seed)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, tokenizer_json) -> Path:
    return build_gemma3_dir(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", tokenizer_json)


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    from tinygpt_mlx.loading import load
    return load(gemma_dir)


def with_rotating(model, cfg: CacheConfig) -> KVCache:
    """`cfg` on the global layers, mlx-lm's own RotatingKVCache on the sliding ones: how the
    sliding layers were held before (the reference). A policy storing bf16/fp16 stores the
    sliding rings so too (RotatingKVCache keeps the compute dtype): there the reference's
    sliding layers are full caches in that storage, which the model's mask limits to the window."""
    ours = make_cache(model, cfg)
    if cfg.storage == "fp32":
        return KVCache([RotatingKVCache(max_size=c.sliding) if c.sliding else c for c in ours], cfg)
    full = make_cache(model, CacheConfig(storage=cfg.storage), windowed=False)
    return KVCache([f if c.sliding else c for c, f in zip(ours, full)], cfg)


def evict(cache) -> None:
    """Between calls, as the engine does (mlx-lm's own caches have nothing to do)."""
    if isinstance(cache, KVCache):
        cache.evict_middle_if_needed()


def run(model, cache, prompt=PROMPT, decode=DECODE, watch=None) -> tuple[mx.array, list[int]]:
    """Prefill `prompt` in CHUNK chunks, then `decode` greedy steps; every call's last logits
    (fp32) and the greedy tokens. `watch(cache, L)` after every call."""
    logits, tokens = [], []
    for i in range(0, len(prompt), CHUNK):
        chunk = prompt[i:i + CHUNK]
        out = model(mx.array([chunk]), cache=cache)[0, -1].astype(mx.float32)
        if watch:
            watch(cache, len(chunk))
        evict(cache)
        logits.append(out)
    for _ in range(decode):
        tokens.append(int(mx.argmax(logits[-1]).item()))
        logits.append(model(mx.array([[tokens[-1]]]), cache=cache)[0, -1].astype(mx.float32))
        if watch:
            watch(cache, 1)
        evict(cache)
    return mx.stack(logits), tokens


def test_sliding_layers_are_rings_of_their_window(gemma):
    cache = make_cache(gemma.model, CacheConfig(sink=4, window=24))
    assert cache.kinds() == [f"sliding {W}", f"sliding {W}", "global"] * 2
    for c in cache:
        assert isinstance(c, RingLayer)
        assert (c.sliding, c.config.window, c.config.sink) == ((W, W, 0) if c.sliding else (None, 24, 4))
    assert cache.sliding_windows == {W: 4} and len(cache.global_layers) == 2
    run(gemma.model, cache, decode=2)
    sliding, global_ = cache[0], cache[2]
    # one query over a sliding ring: the model's own window masks nothing; a ring with a sink
    # holds tokens farther than a window of its own width, which such a mask must hide
    assert sliding.make_mask(1, window_size=W) is None and sliding.make_mask(1, window_size=W - 1) is not None
    mask = global_.make_mask(1, window_size=26)     # the sink's 4 far behind: hidden, the window's 24 seen
    assert mask is not None and mask.shape[-1] == 4 + 24 and mask.sum().item() == 24


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_equals_mlx_lm_rotating_sliding_layers(gemma, policy):
    """The same policy's logits and greedy tokens with mlx-lm's RotatingKVCache on the sliding
    layers; every sliding layer holds at most W + L - 1 during a call and min(seen, W) after."""
    cfg = POLICIES[policy]
    want, want_tokens = run(gemma.model, with_rotating(gemma.model, cfg))
    held = []

    def watch(cache, L):
        for c in cache.owned:
            if c.sliding:
                assert c.stored_count <= W + L - 1
        held.append(cache)

    cache = make_cache(gemma.model, cfg)
    got, tokens = run(gemma.model, cache, watch=watch)
    assert tokens == want_tokens
    assert mx.abs(got - want).max().item() < 1e-4
    seen = len(PROMPT) + DECODE
    assert cache.current_length == seen
    for c in cache.owned:
        if c.sliding:
            assert c.stored_count == W and c.current_length == seen
            assert c.body.keys.dtype == {"fp32": mx.float32, "bf16": mx.bfloat16}[cfg.storage]
    globals_ = cache.global_layers
    assert cache.stored_count == max(c.stored_count for c in globals_)
    if cfg.streaming:
        assert cache.stored_count == cfg.sink + cfg.window
    split = cache.nbytes_split()
    assert split["global"] + split["sliding"] == cache.nbytes == sum(cache.nbytes_breakdown().values())
    assert split["sliding"] == sum(c.nbytes for c in cache.owned if c.sliding) > 0
    cache.close()


def test_full_policy_equals_mlx_lm_own_caches(gemma):
    """Every layer on mlx-lm's own caches (the model's make_cache) against our full policy."""
    want, want_tokens = run(gemma.model, gemma.model.make_cache())
    got, tokens = run(gemma.model, make_cache(gemma.model, CacheConfig()))
    assert tokens == want_tokens and mx.abs(got - want).max().item() < 1e-4


def test_windowed_false_holds_every_token_with_the_same_logits(gemma):
    """The reference of "every layer under the policy": the sliding layers' masks still limit
    them to the window, so the logits are the same, and they hold everything (the bytes saved)."""
    cache = make_cache(gemma.model, CacheConfig(), windowed=False)
    assert cache.kinds()[:2] == [f"sliding {W}"] * 2 and not any(isinstance(c, RingLayer) for c in cache)
    got, _ = run(gemma.model, cache)
    ring = make_cache(gemma.model, CacheConfig())
    want, _ = run(gemma.model, ring)
    assert mx.abs(got - want).max().item() < 1e-4
    seen = len(PROMPT) + DECODE
    assert all(c.stored_count == seen for c in cache.owned)
    # 4 sliding layers at W of `seen` tokens, 2 global at all of them
    assert ring.nbytes * (6 * seen) == cache.nbytes * (4 * W + 2 * seen)


def test_trim_as_rotating_kv_cache(gemma):
    """Below the window a sliding ring trims everything (then decodes as if the tokens were never
    fed); once it has evicted, nothing (a checkpoint restores instead)."""
    m = gemma.model
    short = PROMPT[:10]
    cache = make_cache(m, CacheConfig())
    m(mx.array([short[:8]]), cache=cache)
    for t in short[8:10]:       # one token at a time: the sliding layers' buffers are rings now
        m(mx.array([[t]]), cache=cache)
    assert cache.trimmable() == 10 and cache.trim(4) == 4 and cache.current_length == 6
    for t in short[6:9]:
        after = m(mx.array([[t]]), cache=cache)[0, -1]
    fresh = make_cache(m, CacheConfig())
    want = m(mx.array([short[:9]]), cache=fresh)[0, -1]
    assert mx.abs(after - want).max().item() < 1e-4
    m(mx.array([PROMPT[:W + 3]]), cache=cache)
    cache.evict_middle_if_needed()
    assert cache.trimmable() == 0 and cache.trim(2) == 0


def test_checkpoint_restores_sliding_layers(gemma):
    m = gemma.model
    for cfg in (CacheConfig(), POLICIES["streaming"]):
        cache = make_cache(m, cfg)
        run(m, cache, decode=0)
        cp = cache.checkpoint()
        assert cp is not None
        first, tokens = run(m, cache, prompt=PROMPT[:5], decode=6)
        cache.restore(cp)
        again, tokens_again = run(m, cache, prompt=PROMPT[:5], decode=6)
        # a restored ring is laid out in position order (its keys summed in another order)
        assert tokens == tokens_again and mx.abs(first - again).max().item() < 1e-4


@pytest.mark.parametrize("policy", ["full", "int4", "streaming", "retrieval"])
def test_prompt_cache_round_trip(gemma, tmp_path, policy):
    """Save after the prompt, load, continue: the logits of continuing in process."""
    m, cfg = gemma.model, POLICIES[policy]
    cache = make_cache(m, cfg)
    logits, _ = run(m, cache, decode=0)
    want, want_tokens = run(m, cache, prompt=PROMPT[:7], decode=8)
    cache.close()
    cache = make_cache(m, cfg)
    logits, _ = run(m, cache, decode=0)
    path = save_prompt_cache(tmp_path / "g.ptc", cache, gemma, PROMPT, logits[-1])
    header = json.loads(__import__("tinygpt_mlx.format", fromlist=["x"]).read_header(path)[1]["layers"])
    assert header["kinds"] == cache.kinds()
    loaded, info = load_prompt_cache(path, gemma)
    assert loaded.kinds() == cache.kinds() and loaded.nbytes_split() == cache.nbytes_split()
    assert (loaded.current_length, loaded.stored_count) == (cache.current_length, cache.stored_count)
    for a, b in zip(cache.owned, loaded.owned):
        if a.sliding:     # the sliding rings come back as they were, bit for bit
            assert all(mx.array_equal(x, y).item() for x, y in zip(a.fetch(), b.fetch()))
    got, tokens = run(m, loaded, prompt=PROMPT[:7], decode=8)
    if cfg.streaming:     # a shifted sink is placed afresh from its block (1e-6 off; not the sliding layers')
        assert tokens == want_tokens and mx.abs(got - want).max().item() < 1e-4
    else:
        assert mx.array_equal(got, want).item()
    loaded.close()
    cache.close()


def test_a_file_whose_kinds_differ_is_one_line(gemma, tmp_path, monkeypatch):
    from tinygpt_mlx.cache import persist

    cache = make_cache(gemma.model, CacheConfig())
    logits, _ = run(gemma.model, cache, decode=0)
    monkeypatch.setattr(KVCache, "kinds", lambda self: ["global"] * len(self))
    path = save_prompt_cache(tmp_path / "g.ptc", cache, gemma, PROMPT, logits[-1])
    monkeypatch.undo()
    with pytest.raises(PromptCacheError, match=r"layer kinds \(global x6\) do not match the model's "
                                               rf"\(sliding {W} x2, global x1, sliding {W} x2, global x1\)"):
        load_prompt_cache(path, gemma)
    assert persist.FORMAT_VERSION == 7


def test_cli_cache_prompt_then_sample(gemma_dir, tmp_path):
    """`cache-prompt` then `sample --prompt-cache` on a model with sliding layers (refused before),
    and the report line's split."""
    from tinygpt_mlx.cli.main import app

    runner = CliRunner()
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox jumps over the lazy dog " * 6)
    out = tmp_path / "doc.ptc"
    r = runner.invoke(app, ["cache-prompt", str(gemma_dir), "--prompt-file", str(doc), "--out", str(out),
                            "--prefill-chunk", "12", "--no-chat-template"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["sample", str(gemma_dir), "--prompt-cache", str(out), "--prompt", " and then",
                            "--temperature", "0", "--tokens", "8", "--no-chat-template"])
    assert r.exit_code == 0, r.output
    assert "cached tokens" in r.output
    assert f"2 global" in r.output and f"4 sliding-window (4 at {W})" in r.output


def test_server_slot_extends_a_warm_gemma3_conversation(gemma):
    """A server slot over sliding layers past their window (untrimmable: not a plain full cache)
    extends a warm conversation with the tokens of a cold prefill of the whole prompt."""
    from tinygpt_mlx.server.slots import SlotPool
    from tinygpt_mlx.server.worker import Job, Worker
    from test_engine import _run_jobs

    first = PROMPT[:40]

    def serve(prompts: list[list[int]]) -> list:
        w = Worker(gemma, SlotPool(gemma.model, CacheConfig(), max_slots=2), 12)
        try:
            return [e[-1][1] for e in _run_jobs(w, [Job(list(p), 8, temperature=0) for p in prompts])]
        finally:
            w.stop()

    (r1,) = serve([first])
    second = first + r1.tokens + PROMPT[40:50]
    warm = serve([first, second])[1]
    (cold,) = serve([second])
    assert cold.slot_action == "new" and cold.tokens
    assert (warm.slot_action, warm.reused_tokens) == ("extend", len(first) + len(r1.tokens) - 1)
    assert warm.tokens == cold.tokens


def test_compiled_decode_over_sliding_rings_equals_eager(gemma, monkeypatch):
    """A StreamingLLM window of W without a sink makes every layer a full ring of W with one
    pointer: the decode step runs compiled (the model's sliding mask of W masks nothing for one
    query over such a ring), with the eager step's logits."""
    from tinygpt_mlx import generate as engine
    from tinygpt_mlx.cache import compiled

    m, cfg = gemma.model, CacheConfig(window=W)
    want, want_tokens = run(m, make_cache(m, cfg))      # the model called directly: eager
    keys, real = [], compiled._step_fn
    monkeypatch.setattr(compiled, "_step_fn", lambda model, steps, key: keys.append(key) or real(model, steps, key))
    cache = make_cache(m, cfg)
    logits, tokens = [], []
    for i in range(0, len(PROMPT), CHUNK):
        logits.append(engine.forward(m, mx.array([PROMPT[i:i + CHUNK]]), cache)[0, -1].astype(mx.float32))
    for _ in range(DECODE):
        tokens.append(int(mx.argmax(logits[-1]).item()))
        logits.append(engine.forward(m, mx.array([[tokens[-1]]]), cache)[0, -1].astype(mx.float32))
    assert len(keys) >= DECODE - 1 and all(k[3] == W for k in keys)    # compiled steps ran
    assert tokens == want_tokens and mx.abs(mx.stack(logits) - want).max().item() < 1e-4


def test_retrieval_scaling_bench_grows_only_the_global_layers(gemma):
    """The scaling bench's `grow_cold` and `summary_recall` on a model with sliding layers: only
    the global layers have cold stores (a sliding ring forgets what leaves its window), so only
    they grow; the sliding rings keep their window and decoding goes on (before: the sliding
    layers' `Forgets` was taken for a cold store, an AttributeError on Gemma 3)."""
    from tinygpt_mlx.evaluate.retrieval_bench import decode_scaling, grow_cold, summary_recall

    cfg = CacheConfig(sink=4, hot_budget=24, retrieve_tokens=8, page_size=4, top_pages=2)
    cache = make_cache(gemma.model, cfg)
    run(gemma.model, cache, decode=0)
    grow_cold(cache, 300, block=16)
    for c in cache.global_layers:
        assert c.current_length == 300 and len(c.cold) + c.stored_count == 300
    for c in cache.owned:
        if c.sliding:
            assert c.current_length == len(PROMPT) and c.stored_count == W
    out = gemma.model(mx.array([[5]]), cache=cache)[0, -1]
    assert bool(mx.isfinite(out).all())
    rows = decode_scaling(gemma.model, cfg, PROMPT, [len(PROMPT), 200], decode_steps=2, chunk=CHUNK)
    assert [r["context"] for r in rows] == [len(PROMPT) + 3, 200 + 3]
    recall = summary_recall(gemma.model, cfg, PROMPT * 2, decode_steps=2, k=2, chunk=CHUNK)
    # the prompt and the two decode steps fed, less the sink and the hot window
    assert recall["cold_tokens"] == 2 * len(PROMPT) + 2 - 4 - 24
    assert set(recall["recall"]) == {"minmax", "mean", "hybrid"}
    assert all(0 <= r <= 1 for r in recall["recall"].values())


@pytest.mark.parametrize("policy", ["full", "int4", "streaming", "retrieval"])
def test_direct_fill_measures_the_bytes_a_forward_pass_leaves(gemma, policy):
    """`benchmarks.gemma3_sliding --direct` (docs/gguf.md's bytes at 32K and 128K) fills each
    layer's cache without running the model: its bytes, split and breakdown equal those of
    `cache.report.fill_and_measure` (the model run) at each length, ours and every layer under
    the policy, past its evaluation period of 16 calls."""
    from benchmarks.gemma3_sliding import fill_direct
    from tinygpt_mlx.cache.report import fill_and_measure

    cfg = POLICIES[policy]
    for windowed in (True, False):
        model = fill_and_measure(gemma.model, cfg, [40, 700], 300, chunk=CHUNK, windowed=windowed)
        direct = fill_direct(gemma.model, cfg, [40, 700], chunk=CHUNK, windowed=windowed)
        for a, b in zip(model, direct):
            assert (a.tokens, a.stored, a.nbytes, a.split, a.breakdown) == \
                (b.tokens, b.stored, b.nbytes, b.split, b.breakdown)


def test_bench_mlx_row_is_mlx_lm_own_caches(gemma):
    """bench's `mlx` baseline on a model with sliding layers is what mlx-lm gives it (its
    `make_prompt_cache`: RotatingKVCache of the window on the sliding layers, KVCache on the
    global ones), not a KVCache on every layer; it runs and holds the window there."""
    from mlx_lm.models.cache import KVCache as MlxKVCache

    from tinygpt_mlx.evaluate import bench

    policy = bench.make_policy("mlx", gemma.model)
    caches = policy.make()
    kinds = [type(c) for c in caches]
    sliding = [i % PATTERN != PATTERN - 1 for i in range(len(gemma.model.layers))]
    assert kinds == [RotatingKVCache if s else MlxKVCache for s in sliding], kinds
    assert all(c.max_size == W for c, s in zip(caches, sliding) if s)
    assert policy.label == f"mlx-lm KVCache + RotatingKVCache({W}) on {sum(sliding)} layers", policy.label
    r = bench.bench(gemma.model, ["mlx"], [48], decode_steps=2)
    (row,) = [row for row in r["rows"] if row["policy"] == "mlx"]
    assert row["decode_tokens_per_s"] > 0 and "error" not in row, row


def test_serve_admission_counts_sliding_layers_at_their_window(gemma):
    """serve's memory admission (server/worker.Admission): a sliding layer's cache is counted at
    most its window, the global layers' at every token the policy holds (it counted every layer
    for every token: 5 of 6 layers' worth too much on Gemma 3 at long contexts)."""
    from tinygpt_mlx.server.worker import Admission, kv_bytes

    n = len(gemma.model.layers)
    per_layer = 2 * 2 * 32 * 4            # K and V, 2 KV heads x head dim 32, fp32
    glob, sliding = kv_bytes(gemma)
    n_sliding = sum(i % PATTERN != PATTERN - 1 for i in range(n))
    assert glob == (n - n_sliding) * per_layer and sliding == [(W, per_layer)] * n_sliding
    a = Admission(gemma, CacheConfig())
    assert a.nbytes(10) == n * 10 * per_layer
    assert a.nbytes(1000) == (n - n_sliding) * 1000 * per_layer + n_sliding * W * per_layer


@pytest.mark.parametrize("rope_mode", ["absolute", "shifted"])
def test_compiled_retrieval_steps_sliding_rings_beside_global_layers(gemma, rope_mode):
    """Retrieval on the global layers beside sliding-window rings (Gemma 3's layout): the compiled
    retrieval step traces the rings too, each at its own position and pointer
    (compiled_retrieval.py `_rings_ready`), at original positions (the default inside a model's
    context) and shifted. Over 40 decode steps after a 240-token prompt of distinct tokens (hot
    window 16: a page completed every 4 steps, evicted eagerly ahead; the index engaged; sticky
    pages), every KV head of every global layer fetches the same cold tokens as the eager step
    and the host store (cold.py, the reference), the logits agree (1e-5 with the eager step, 1e-4
    with the host store) and most steps ran compiled."""
    import dataclasses

    from test_retrieval_device import _stepped
    from tinygpt_mlx.cache import compiled

    m = gemma.model
    cfg = CacheConfig(sink=4, hot_budget=16, page_size=4, top_pages=2, retrieve_tokens=8, index_block=2,
                      index_expand=1, rope_mode=rope_mode)
    prompt = [int(x) for x in np.random.RandomState(7).permutation(np.arange(1, 241))]
    ran, real = [], compiled._retrieval_decode
    compiled._retrieval_decode = lambda *a: ran.append(real(*a)) or ran[-1]
    try:
        fast = make_cache(m, cfg)
        assert fast.compiled_step == "retrieval" and fast.kinds() == [f"sliding {W}", f"sliding {W}", "global"] * 2
        got, got_picks = _stepped(m, fast, prompt, 40)
    finally:
        compiled._retrieval_decode = real
    assert sum(r is not None for r in ran) >= 30 and not compiled.trace_failures
    assert fast.global_layers[0].cold.index.uses_index()
    eager = make_cache(m, cfg)
    eager.compile_decode = False
    want, want_picks = _stepped(m, eager, prompt, 40)
    host, host_picks = _stepped(m, make_cache(m, dataclasses.replace(cfg, cold_store="disk")), prompt, 40)
    assert len(got_picks) == 40 * (1 + 2)       # a pick per step and global layer
    assert got_picks == want_picks == host_picks
    for a, b, c in zip(got, want, host):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-4)


def test_compiled_retrieval_steps_each_ring_at_its_own_position(gemma):
    """The sliding rings beside retrieval's global layers step at their own RoPE position in the
    compiled retrieval step, not the global layers' (compiled_retrieval.py `_rings_ready`): at
    original positions the rings re-base (frame positions) and the global layers do not, so after
    a re-base (every layer's `rebase_every` made 100 here) the two positions differ. Over 40
    decode steps after a 240-token prompt, across re-bases, the compiled step fetches what the
    eager step fetches and gives its logits (1e-5), most steps compiled. Fails with the rings
    stepped at the global layers' position (the test above cannot tell: no re-base in it)."""
    from test_retrieval_device import _stepped
    from tinygpt_mlx.cache import compiled

    m = gemma.model
    cfg = CacheConfig(sink=4, hot_budget=16, page_size=4, top_pages=2, retrieve_tokens=8, index_block=2,
                      index_expand=1, rope_mode="absolute")
    prompt = [int(x) for x in np.random.RandomState(7).permutation(np.arange(1, 241))]

    def made():
        cache = make_cache(m, cfg)
        for c in cache.owned:
            c.positions.rebase_every = 100
        return cache
    ran, real = [], compiled._retrieval_decode
    compiled._retrieval_decode = lambda *a: ran.append(real(*a)) or ran[-1]
    try:
        fast = made()
        assert fast.compiled_step == "retrieval"
        got, got_picks = _stepped(m, fast, prompt, 40)
    finally:
        compiled._retrieval_decode = real
    rings = [c for c in fast.owned if c.sliding is not None]
    assert {c.positions.base for c in rings} == {200} and fast.global_layers[0].positions.base == 0   # re-based apart
    assert sum(r is not None for r in ran) >= 30 and not compiled.trace_failures
    eager = made()
    eager.compile_decode = False
    want, want_picks = _stepped(m, eager, prompt, 40)
    assert len(got_picks) == 40 * (1 + 2) and got_picks == want_picks
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_rings_verdict_is_checked_again_when_a_ring_changes(gemma):
    """What compiled_retrieval.py `rings_ready` decides of the sliding rings as one (each ready,
    at one position, base and pointer) is decided once per change of the rings' layout
    (`RingStore.changes`, one count the cache's rings share: `KVCache.rings_checked`), not per
    step; per step only the re-base due, the first ring's fullness, its write slot and position.
    The rings' indices are decided when the cache is made (`KVCache.ring_layout`). After compiled
    steps, one ring re-based apart from the others (its base 8 on: no longer at the rings'
    position) makes the verdict stale: the next steps must run eager, each ring at its own
    position, equal (1e-5) to the same cache stepped eager. Fails with the verdict kept past the
    change (the re-based ring would be stepped at the first ring's position)."""
    from tinygpt_mlx.cache import compiled
    from tinygpt_mlx.generate import forward

    m = gemma.model
    cfg = CacheConfig(sink=4, hot_budget=16, page_size=4, top_pages=2, retrieve_tokens=8, rope_mode="absolute")
    prompt = [int(x) for x in np.random.RandomState(7).permutation(np.arange(1, 241))]
    fast, eager = make_cache(m, cfg), make_cache(m, cfg)
    eager.compile_decode = False
    ring_index, kept = fast.ring_layout
    assert [fast.owned[i].sliding for i in ring_index] == [W] * 4 and len(kept) == 2
    ran, real = [], compiled._retrieval_decode
    compiled._retrieval_decode = lambda *a: ran.append(real(*a)) or ran[-1]
    try:
        for cache in (fast, eager):
            mx.eval(forward(m, mx.array([prompt]), cache))
        step = 0

        def both(n):
            nonlocal step
            for _ in range(n):
                ids = mx.array([[3 + (7 * step) % 250]])
                got, want = forward(m, ids, fast)[0, -1], forward(m, ids, eager)[0, -1]
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
                step += 1
        both(12)
        assert sum(r is not None for r in ran) >= 10 and fast.rings_checked[1]
        checked, done = fast.rings_checked, len(ran)
        both(4)
        assert fast.rings_checked is checked       # decided once: steps do not check again
        for cache in (fast, eager):                # one ring re-based apart from the others
            ring = cache.owned[ring_index[1]]
            ring.body.rebase(8)
            ring.positions.base += 8
            ring._planned = None
        both(6)
        assert all(r is None for r in ran[done + 4:]), ran[done:]     # eager: the rings are not at one position
        assert fast.rings_checked[0] != checked[0] and not fast.rings_checked[1]
    finally:
        compiled._retrieval_decode = real
    assert not compiled.trace_failures
