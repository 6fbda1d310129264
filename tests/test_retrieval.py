"""Tiered retrieval: equivalence with the full cache, summary recall, O(page) appends, disk
store == RAM store, bounded positions, retrieval during prefill, and the needle CLI."""

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from typer.testing import CliRunner

from tinygpt_mlx.cli.main import app
from prerope import make_cache
from retrieval_reference import select
from tinygpt_mlx.cache import KVCache
from tinygpt_mlx.cache.arrays import GrowingArray
from tinygpt_mlx.cache.cold import ColdStore
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward, prefill

TOKENS = [int(x) for x in np.random.RandomState(0).randint(1, 300, size=150)]


def run(model, config, tokens=TOKENS, chunk=16, steps=4, ring=True, rebase_every=None, record=False):
    """Logits after a chunked prefill and after each of `steps` decode tokens, and the cache
    (`ring=False`: the shifted hot window before RoPE, the path frame positions replaced;
    `record`: its retrievals recorded, `KVCache.record_retrievals`)."""
    cache = make_cache(model, config, ring=ring)
    if record:
        cache.record_retrievals()
    if rebase_every is not None:
        for c in cache.owned:
            c.positions.rebase_every = rebase_every
    out = [prefill(model, tokens, cache, chunk)]
    for t in range(5, 5 + steps):
        out.append(forward(model, mx.array([[t]]), cache)[0, -1].astype(mx.float32))
    return mx.stack(out), cache


def covering(**kw):
    """A retrieval policy whose top pages and top-P cover the whole cold store."""
    return CacheConfig(hot_budget=40, page_size=16, top_pages=64, retrieve_tokens=512, **kw)


@pytest.mark.parametrize("kw", [dict(rope_mode="absolute"), dict(retrieved_position="slots"),
                                dict(rope_mode="absolute", retrieve_unit="spans"),
                                dict(rope_mode="absolute", retrieve_unit="spans", sticky=True)],
                         ids=["absolute", "shifted-slots", "absolute-spans", "absolute-spans-sticky"])
def test_retrieving_everything_equals_full_cache(native, kw):
    ref, _ = run(native.model, CacheConfig())
    out, cache = run(native.model, covering(**kw))
    assert len(cache[0].cold) > 0 and cache[0].stored_count == 40
    assert float(mx.abs(out - ref).max()) < 1e-4


def _pool_case(seed, n=301, L=1, G=2, rep=2, D=16, **kw):
    """A store of `n` random keys over G KV heads (the last page unfinished, a strong key planted
    in it for head 0), queries [1, G * rep, L, D], and the reading that retrieves for them."""
    from tinygpt_mlx.cache.positions import Positions
    from tinygpt_mlx.cache.segments import Reading
    rng = np.random.RandomState(seed)
    cfg = CacheConfig(**{**dict(hot_budget=8, rope_mode="absolute", page_size=8, top_pages=4, retrieve_tokens=8,
                                retrieve_unit="tokens"), **kw})
    store = ColdStore(cfg, KVCache)
    keys = rng.randn(1, G, n, D).astype(np.float32)
    q = rng.randn(1, G * rep, L, D).astype(np.float32)
    keys[0, 0, n - 2] = 3 * q[0, 0, -1]
    store.append(mx.array(keys), mx.array(rng.randn(1, G, n, D).astype(np.float32)), 0)
    return store, q, Reading(mx.float32, Positions(cfg, nn.RoPE(D)), 0, mx.array(q), 1.0)


def _picked(store, reading):
    """Cold indices each KV head's last query attends to through the pool path."""
    from tinygpt_mlx.cache.segments import attend
    segments, selection = store.retrieve(reading)
    mx.eval(attend(segments, 1, reading.queries, 1.0, None))
    return [np.sort(row) for row in selection.fetched()]


def _exact(store, q, idx, g, rep=2):
    """Exact scores (max over the KV head's query group) of the last query against cold `idx`."""
    k = store.keys.view()[idx, g]
    return np.sort((q[0, g * rep:(g + 1) * rep, -1] @ k.T).max(axis=0))[::-1]


@pytest.mark.parametrize("seed", range(5))
def test_pool_decode_fetches_what_the_per_query_search_fetches(seed):
    """A decode step's pool is its query's pages plus the unfinished page: it attends to exactly
    the tokens the per-query search (`select`, the reference) picks, the planted tail key among them."""
    store, q, reading = _pool_case(seed)
    ref = select(store, q.reshape(2, 2, 1, -1))[0][:, -1]
    got = _picked(store, reading)
    for g in range(2):
        assert got[g].tolist() == sorted(ref[g].tolist())
    assert 299 in got[0]


@pytest.mark.parametrize("seed", range(5))
def test_pool_chunk_serves_its_last_query_at_least_as_well(seed):
    """A chunk's pool holds its last query's own pages, so that query's picks score at least as
    high, rank by rank, as what the per-query search gives it."""
    store, q, reading = _pool_case(seed, L=6)
    ref = select(store, q.reshape(1, 2, 2, 6, -1).transpose(1, 2, 0, 3, 4).reshape(2, 2, 6, -1))[0][:, -1]
    got = _picked(store, reading)
    for g in range(2):
        mine, theirs = _exact(store, q, got[g], g), _exact(store, q, ref[g], g)
        assert len(mine) == len(theirs) == 8
        assert np.all(mine >= theirs - 1e-5)


@pytest.mark.parametrize("seed, n, L", [(0, 301, 6), (1, 301, 1), (2, 2101, 6), (3, 2101, 1), (4, 296, 6)])
def test_slots_pools_pick_what_the_per_query_search_picks(seed, n, L):
    """Under the `slots` rule every query of a pass gets a pool of its own: the keys it attends
    to (which tokens, in which order, at which slots) are exactly the per-query reference
    search's, the unfinished page's tokens among the candidates (n 301, 2101), none (n 296), and
    through the two-level page index (n 2101)."""
    store, q, reading = _pool_case(seed, n=n, L=L, rope_mode="shifted", retrieved_position="slots")
    pos = reading.positions
    [segment], selection = store.retrieve(dataclasses.replace(reading, first_slot=40))
    idx, _, m = select(store, np.asarray(pos.rotate_to(mx.array(q), -40)).reshape(2, 2, L, -1))
    T = idx.shape[-1]
    want = pos.place(mx.array(store.keys.view()[idx, np.arange(2).reshape(2, 1, 1)].reshape(1, 2, L, T, -1)), 40 - T + 1)
    assert T == 8 < m == selection.tokens_scored
    assert store.index.uses_index() == (n > 2048)
    np.testing.assert_array_equal(np.asarray(segment.keys), np.asarray(want))


@pytest.mark.parametrize("unit, span_score", [("tokens", "max"), ("spans", "max"), ("spans", "mean")])
def test_decode_host_pick_equals_the_pool_segment_pick(unit, span_score):
    """A decode step picks on the host (`_pick`) what `PoolSegment` picks on device for a chunk,
    from the same pool: the two implementations of one rule agree (pages by their best token
    or by their tokens' mean score); 3 query heads per KV head."""
    from tinygpt_mlx.cache.segments import PoolSegment
    for seed in range(5):
        store, q, _ = _pool_case(seed, rep=3, retrieve_unit=unit, retrieve_tokens=16, span_score=span_score)
        pool, _ = store.pool(q.reshape(2, 3, 1, -1))
        idx, valid = store.pool_tokens(pool)
        units, u = (2, 8) if unit == "spans" else (16, 1)
        pool_keys = store.keys.view()[idx, np.arange(2)[:, None]]
        pick, ok = store._pick(q[0].reshape(2, 3, -1), pool_keys, valid, units, u)
        host, ok = np.take_along_axis(idx, pick, axis=-1), ok & np.take_along_axis(valid, pick, axis=-1)
        keys = mx.array(pool_keys[None])
        seg = PoolSegment(keys, keys, mx.array(valid[None]), units, u, span_score)
        mx.eval(seg.scores(mx.array(q.reshape(1, 2, 3, 1, -1))))
        dev = np.asarray(seg.last_picked())[0]
        for g in range(2):
            assert sorted(host[g][ok[g]].tolist()) == sorted(idx[g][dev[g]][valid[g][dev[g]]].tolist())


@pytest.mark.parametrize("unit", ["tokens", "spans"])
def test_sticky_remembers_the_pages_the_last_query_picked(unit):
    """After a pass, a sticky store holds the pages of the tokens its last query attended to
    (decode: the host pick; a chunk: `PoolSegment`'s pick, read after attention)."""
    for L in (1, 5):
        store, q, reading = _pool_case(3, L=L, retrieve_unit=unit, retrieve_tokens=16, sticky=True)
        fetched = _picked(store, reading)
        recent = store._recent()
        for g in range(2):
            assert recent[g].tolist() == np.unique(fetched[g] // 8).tolist()


@pytest.mark.parametrize("unit", ["tokens", "spans"])
def test_sticky_pages_join_the_next_pool(unit):
    """A page the previous step picked is scored again even where the coarse pass now ranks
    another page first: page 30 holds the key that best matches the query, but page 5's
    per-channel bound is higher (each of its keys is large in a different pair of channels, none
    along the query), so with one top page only a sticky pool reaches page 30."""
    from tinygpt_mlx.cache.positions import Positions
    from tinygpt_mlx.cache.segments import Reading
    D, n = 16, 301
    rng = np.random.RandomState(0)
    keys = 0.1 * rng.randn(1, 2, n, D).astype(np.float32)
    for j in range(8):
        keys[0, :, 40 + j] = 0
        keys[0, :, 40 + j, 2 * j:2 * j + 2] = 10.0          # page 5: bound 160, every key scores 20
    keys[0, :, 243] = 3.0                                   # page 30: the best key, scores 48
    q = np.ones((1, 4, 1, D), np.float32)
    for sticky in (False, True):
        cfg = CacheConfig(hot_budget=8, rope_mode="absolute", page_size=8, top_pages=1, retrieve_tokens=8,
                          retrieve_unit=unit, summary="minmax", sticky=sticky)
        store = ColdStore(cfg, KVCache)
        store.append(mx.array(keys), mx.array(rng.randn(1, 2, n, D).astype(np.float32)), 0)
        assert store.index.top_pages_of(q.reshape(2, 2, 1, D))[:, 0, 0].tolist() == [5, 5]
        store._recent = lambda: [np.array([30]), np.array([30])]
        fetched = _picked(store, Reading(mx.float32, Positions(cfg, None), 0, mx.array(q), 1.0))
        assert all((243 in row) == sticky for row in fetched)


def test_union_of_pools_keeps_each_page_once():
    from tinygpt_mlx.cache.cold import _union
    pool = np.array([[2, 5, 9, -1], [1, 3, -1, -1]])
    got = _union(pool, [np.array([5, 7]), np.array([0, 3, 4, 8])])
    assert got.tolist() == [[2, 5, 7, 9, -1], [0, 1, 3, 4, 8]]


def test_page_rule_places_token_j_of_a_page_at_slot_plus_j(native):
    cfg = CacheConfig(hot_budget=8, retrieved_position="page", page_size=8)
    pos = make_cache(native.model, cfg)[0].positions      # the model's RoPE
    store = ColdStore(cfg, KVCache)
    k = mx.array(np.random.RandomState(0).randn(1, 2, 5, 16).astype(np.float32))
    idx = np.array([[3, 8, 9, 21, 30], [0, 7, 15, 16, 40]])
    got = store._place(k, idx, 6, pos)
    for g in range(2):
        for t in range(5):
            want = pos.rotate_to(k[:, g:g + 1, t:t + 1], 6 + int(idx[g, t]) % 8)
            assert float(mx.abs(got[:, g:g + 1, t:t + 1] - want).max()) < 1e-6


def test_spans_fetch_whole_pages():
    store, q, reading = _pool_case(0, retrieve_unit="spans", retrieve_tokens=16)
    for row in _picked(store, reading):
        pages = np.unique(row // 8)
        assert len(pages) == 2
        assert sorted(row.tolist()) == [i for p in pages for i in range(8 * p, min(8 * p + 8, 301))]


def test_retrieving_everything_equals_full_cache_mlx_lm(llama):
    ref, _ = run(llama.model, CacheConfig())
    out, cache = run(llama.model, covering(rope_mode="absolute"))
    assert len(cache[0].cold) > 0
    assert float(mx.abs(out - ref).max()) < 1e-4


def _micro_store(summary, page_size=8, top_pages=1, retrieve_tokens=4, index_block=32):
    cfg = CacheConfig(hot_budget=8, rope_mode="absolute", page_size=page_size, top_pages=top_pages,
                      retrieve_tokens=retrieve_tokens, summary=summary, index_block=index_block)
    return ColdStore(cfg, KVCache)


def test_planted_key_always_retrieved_by_minmax_and_missed_by_mean():
    """A planted key along the query (q.k = 2|q|^2, above any other page's min/max bound) is
    always found with top_pages=1: the page holding it has the highest bound. The mean key
    dilutes it 8-fold, so a page of keys that all lean towards q outranks it."""
    D, ps = 16, 8
    misses = {"minmax": 0, "mean": 0}
    for seed in range(10):
        rng = np.random.RandomState(seed)
        q = rng.randn(1, 1, 1, D).astype(np.float32)
        keys = rng.randn(20 * ps, D).astype(np.float32)
        # a decoy page whose keys all lean towards q: its MEAN beats a page with one exact match
        decoy = rng.randint(20)
        keys[decoy * ps:(decoy + 1) * ps] = 0.4 * q[0, 0, 0] + 0.1 * rng.randn(ps, D)
        needle = rng.randint(20 * ps)
        while needle // ps == decoy:
            needle = rng.randint(20 * ps)
        keys[needle] = 2 * q[0, 0, 0]
        for summary in misses:
            store = _micro_store(summary)
            k = mx.array(keys[None, None])
            store.append(k, k, start_position=100)
            idx, pages, _ = select(store, q)
            misses[summary] += needle not in idx[0, 0]
    assert misses["minmax"] == 0
    assert misses["mean"] > 0


def test_hybrid_keeps_the_best_page_of_each_summary():
    rng = np.random.RandomState(0)
    D, ps = 16, 8
    q = rng.randn(1, 1, 1, D).astype(np.float32)
    keys = rng.randn(20 * ps, D).astype(np.float32)
    keys[3 * ps:4 * ps] = 0.4 * q[0, 0, 0] + 0.1 * rng.randn(ps, D)   # best mean
    keys[11 * ps + 2] = 2 * q[0, 0, 0]                                 # best bound
    store = _micro_store("hybrid", top_pages=2)
    k = mx.array(keys[None, None])
    store.append(k, k, start_position=0)
    assert sorted(store.index.top_pages_of(q)[0, 0].tolist()) == [3, 11]


def test_pages_append_without_copying_the_store():
    store = _micro_store("minmax", page_size=4)
    k = mx.zeros((1, 2, 4, 8))
    store.append(k, k, 0)
    arrays = [store.keys.array]
    for i in range(1, 600):
        store.append(k + i, k, 4 * i)
        if store.keys.array is not arrays[-1]:
            arrays.append(store.keys.array)
    assert len(store) == 2400 and store.n_pages == 600
    # capacity doubles: log2(2400 / 256) + 1 reallocations, each page otherwise written in place
    assert store.keys.growths == len(arrays) - 1 <= 4
    assert store.keys.capacity < 2 * 2400
    assert float(store.index.smax.view()[599].max()) == 599.0 and float(store.index.smin.view()[0].min()) == 0.0


def test_growing_array_disk_grows_in_place(tmp_path):
    a = GrowingArray((3,), np.float32, str(tmp_path / "g.bin"), initial=4)
    for i in range(20):
        a.append(np.full((1, 3), i, np.float32))
    assert a.capacity == 32 and a.growths == 3 and isinstance(a.array, np.memmap)
    assert (tmp_path / "g.bin").stat().st_size == 32 * 3 * 4
    assert a.view()[:, 0].tolist() == list(range(20))


def test_disk_store_equals_ram_store_over_a_long_prefill(native, tmp_path):
    """Thousands of tokens through the disk store (pages, the index and spans in play, its search
    on the host) give the RAM store's logits (its search on the device: the same tokens, summed
    in another order; tests/test_retrieval_device.py checks the tokens)."""
    tokens = [int(x) for x in np.random.RandomState(1).randint(1, 300, size=3000)]
    kw = dict(hot_budget=32, sink=4, page_size=8, top_pages=4, index_block=4, retrieve_unit="spans")
    ram, cache = run(native.model, CacheConfig(cold_store="ram", **kw), tokens, chunk=128, steps=2)
    assert cache[0].cold.index.uses_index()
    disk, cache = run(native.model, CacheConfig(cold_store="disk", cold_path=str(tmp_path), **kw), tokens,
                      chunk=128, steps=2)
    assert cache.nbytes_breakdown()["cold_disk"] > 0
    assert float(mx.abs(ram - disk).max()) < 1e-4


def test_disk_cold_store_keeps_ram_bounded(native):
    """The disk cold store (`--kiv-cold-store disk`) maps everything, its summaries and positions included: the bytes
    held in RAM are the hot window's (and the open page's), the same after 400 tokens as after
    1,200, while the mapped bytes grow with the document."""
    rng = np.random.RandomState(2)
    held = []
    for n in (400, 1200):
        tokens = [int(x) for x in rng.randint(1, 300, size=n)]
        _, cache = run(native.model, CacheConfig(hot_budget=32, sink=4, page_size=8, cold_store="disk"), tokens,
                       chunk=64, steps=1)
        parts = cache.nbytes_breakdown()
        assert not any(k.startswith("cold") and not k.endswith("_disk") for k in parts), parts
        held.append((cache.nbytes - cache.disk_nbytes, cache.disk_nbytes))
        cache.close()
    assert held[0][0] == held[1][0] and held[1][1] > 2.5 * held[0][1], held


def test_disk_store_equals_ram_store(native, tmp_path):
    kw = dict(hot_budget=32, page_size=8, top_pages=2, retrieve_tokens=12)
    ram, _ = run(native.model, CacheConfig(cold_store="ram", **kw))
    disk, cache = run(native.model, CacheConfig(cold_store="disk", cold_path=str(tmp_path), **kw))
    assert float(mx.abs(ram - disk).max()) < 1e-4
    assert "cold_disk" in cache.nbytes_breakdown() and any(tmp_path.rglob("*.bin"))
    cache.close()
    assert not any(tmp_path.rglob("*.bin"))


@pytest.mark.parametrize("ring", [True, False], ids=["frame", "pre-rope"])
def test_positions_stay_bounded_and_prefill_chunks_retrieve(native, ring):
    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=12, retrieve_unit="tokens")
    tokens = TOKENS * 3   # 450 tokens, longer than the tiny model's context of 256
    _, cache = run(native.model, cfg, tokens=tokens, chunk=16, steps=2, ring=ring, record=True)
    c = cache[0]
    assert c.current_length == 452 and c.stored_count == 4 + 32
    # the query's distance to slot 0 (the sink's first key): on frame positions the query sits
    # at its position and slot 0 just before the retrieval slots and the hot window
    assert c.positions.frame == ring
    assert c.offset - c.slot0() <= 4 + c.positions.reserved + 32
    if not ring:
        assert c.offset <= 4 + c.positions.reserved + 32
    rep = cache.retrieval_report()
    # every prefill chunk after the first evictions retrieved, not only the decode steps
    assert rep["retrievals"] > 2 * 2 * 2 and rep["tokens_retrieved"] == 12


def test_quantised_cold_store_is_close(tokenizer_json, tmp_path):
    from conftest import build_native
    from tinygpt_mlx.loading import load
    model = load(build_native(tmp_path / "hd32.tinygpt", tokenizer_json, n_heads=2, n_kv_heads=1)).model
    ref, _ = run(model, covering(rope_mode="absolute"))
    q8, cache = run(model, covering(rope_mode="absolute", cold_bits=8))
    exact_bytes = run(model, covering(rope_mode="absolute"))[1].nbytes_breakdown()["cold"]
    assert cache.nbytes_breakdown()["cold"] < 0.4 * exact_bytes
    assert float(mx.abs(q8 - ref).max()) < 0.018   # measured 0.0086 (6-bit codes: 0.021)


def test_needle_cli_writes_json(native_path, tmp_path):
    filler = tmp_path / "filler.txt"
    filler.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "n.json"
    r = CliRunner().invoke(app, [
        "needle", str(native_path), "--contexts", "80,160", "--depths", "0.5", "--seeds", "1",
        "--kiv-hot-budget", "24", "--kiv-page-size", "8", "--kiv-top-p", "8", "--kiv-top-pages", "2",
        "--prefill-chunk", "16", "--filler", str(filler), "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert {(c["policy"], c["context"]) for c in data["cells"]} == {
        (p, n) for p in ("full", "streaming", "retrieval") for n in (80, 160)}
    from tinygpt_mlx.evaluate.needle import passed
    for cell in data["cells"]:
        assert {"policy", "context", "depth", "seed", "passed"} <= set(cell)
        # the verdict is the scorer's on the decoded output (tests/test_needle.py pins the scorer)
        assert cell["passed"] is passed(cell["output"], cell["answer"]), cell
        assert len(cell["answer"]) == 5 and cell["answer"].isdigit()
    for policy, s in data["summary"].items():
        mine = [c["passed"] for c in data["cells"] if c["policy"] == policy]
        assert (s["cells"], s["passed"]) == (len(mine), sum(mine))
    assert "retrievals" in [c for c in data["cells"] if c["policy"] == "retrieval"][-1]["telemetry"]
    assert all(c["rss_anon_peak_bytes"] > 0 for c in data["cells"])


def test_needle_prefill_report_lines(capsys):
    """Long prefills report tokens, rate, ETA, memory and the cache's bytes (the part on disk
    where some are); a new cell starts a new rate."""
    import time

    from tinygpt_mlx.cli.needle import PrefillReport

    class Cache:
        nbytes, disk_nbytes = 5 * 2**20, 3 * 2**20

    class InRam:
        nbytes, disk_nbytes = 5 * 2**20, 0
    report = PrefillReport(every=0.0)
    for done in (128, 256, 384):                  # the first chunk only starts the clock
        time.sleep(0.01)
        report(done, 1024, Cache())
    report(1024, 1024, Cache())                   # the end of a prefill says nothing
    report(128, 512, Cache())                     # a new cell
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "prefill" in ln]
    assert len(lines) == 2
    assert "256/1,024 tokens" in lines[0] and "384/1,024 tokens" in lines[1]
    assert "cache 5.00 MiB (3.00 MiB of it on disk)" in lines[1] and "ETA" in lines[1] and "RSS" in lines[1]
    report(256, 512, InRam())
    assert "cache 5.00 MiB in RAM" in capsys.readouterr().err


def test_two_level_index_bounds_its_pages_and_finds_a_planted_key():
    """Block summaries are the min of their pages' mins and the max of their maxes (so they
    bound every key of the block); with the index in use a planted key along the query is still
    retrieved. (A block bound is looser than a page bound, so the planted key is 3|q|^2 here,
    not the 2|q|^2 that the flat scan always finds: the index trades recall for speed.)"""
    D, ps, Bp = 16, 8, 4
    for seed in range(5):
        rng = np.random.RandomState(seed)
        q = rng.randn(1, 1, 1, D).astype(np.float32)
        n_pages = 200                                     # > 2 * top_pages * Bp: the index is on
        keys = rng.randn(n_pages * ps + 5, D).astype(np.float32)
        needle = rng.randint(len(keys) - 5)
        keys[needle] = 3 * q[0, 0, 0]
        store = _micro_store("minmax", top_pages=2, index_block=Bp)
        for s in range(0, len(keys), 37):                 # appends that straddle pages and blocks
            k = mx.array(keys[None, None, s:s + 37])
            store.append(k, k, start_position=s)
        assert store.index.uses_index() and store.index.n_blocks == n_pages // Bp
        smin, smax = store.index.smin.view(), store.index.smax.view()
        np.testing.assert_array_equal(store.index.bmin.view(), smin.reshape(-1, Bp, *smin.shape[1:]).min(axis=1))
        np.testing.assert_array_equal(store.index.bmax.view(), smax.reshape(-1, Bp, *smax.shape[1:]).max(axis=1))
        idx, pages, _ = select(store, q)
        assert needle in idx[0, 0]
        assert pages[0, 0, 0] == needle // ps


def test_two_level_index_matches_the_flat_scan_on_its_candidates():
    """Index off (index_block 0) and on agree on the best page when the best page's block is
    among the expanded ones; hybrid works through the index."""
    D, ps = 16, 8
    rng = np.random.RandomState(3)
    q = rng.randn(1, 2, 1, D).astype(np.float32)
    keys = rng.randn(300 * ps, D).astype(np.float32)
    keys[1234] = 3 * q[0, 0, 0]
    out = {}
    for block in (0, 4):
        store = _micro_store("hybrid", top_pages=4, index_block=block)
        k = mx.array(keys[None, None])
        store.append(k, k, start_position=0)
        out[block] = store.index.top_pages_of(q)[0, 0]
        assert store.index.uses_index() == bool(block)
    assert out[0][0] == out[4][0] == 1234 // ps


def test_index_expand_ranks_the_pages_of_that_many_best_blocks():
    """A decode step's query expands `index_expand` x top_pages blocks: the index returns the
    best pages (by the flat scan's page scores) among the pages of exactly that many best blocks;
    widening it recovers more of the flat scan's top pages (one expansion loses some on this
    store). A prefill chunk's rows expand top_pages blocks."""
    D, ps, Bp, top = 16, 8, 4, 4
    rng = np.random.RandomState(0)
    q = rng.randn(1, 2, 1, D).astype(np.float32).reshape(1, 2, 1, D)
    keys = mx.array(rng.randn(1, 1, 400 * ps, D).astype(np.float32))
    found = []
    for expand in (1, 3, 12):                        # 12 x 4 = 48 of 100 blocks: the index is still on
        cfg = CacheConfig(hot_budget=8, rope_mode="absolute", page_size=ps, top_pages=top, retrieve_tokens=4,
                          summary="minmax", index_block=Bp, index_expand=expand)
        store = ColdStore(cfg, KVCache)
        store.append(keys, keys, 0)
        assert store.index.uses_index()
        pages = store.index.scan(q, "minmax", store.index.smin, store.index.smax, None)[0, 0]
        blocks = store.index.scan(q, "minmax", store.index.bmin, store.index.bmax, None)[0, 0]
        cand = [p for b in np.argsort(-blocks)[:expand * top] for p in range(b * Bp, (b + 1) * Bp)]
        want = sorted(cand, key=lambda p: -pages[p])[:top]
        got = store.index.ranked_pages(q, "minmax")[0, 0]
        assert got.tolist() == want
        found.append(len(set(got.tolist()) & set(np.argsort(-pages)[:top].tolist())))
        # a prefill chunk's rows (two query rows) expand top_pages blocks whatever index_expand
        rows = np.concatenate([q, -q], axis=2)
        cand1 = [p for b in np.argsort(-blocks)[:top] for p in range(b * Bp, (b + 1) * Bp)]
        assert store.index.ranked_pages(rows, "minmax")[0, 0].tolist() == sorted(cand1, key=lambda p: -pages[p])[:top]
    assert found[0] < top and found == sorted(found) and found[-1] > found[0]


def test_decode_scaling_grows_the_cold_store_and_engages_the_index(native):
    """The scaling bench (interleaved decode over several contexts): hot bytes stay fixed,
    cold bytes grow with the context, and the long context uses the two-level index."""
    from tinygpt_mlx.evaluate.retrieval_bench import decode_scaling

    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=8, index_block=4)
    rows = decode_scaling(native.model, cfg, TOKENS, [150, 2048], decode_steps=2, chunk=32)
    assert [r["context"] for r in rows] == [150 + 3, 2048 + 3]   # + warm-up and 2 steps
    assert rows[0]["hot_bytes"] == rows[1]["hot_bytes"]
    assert rows[1]["cold_bytes"] > 10 * rows[0]["cold_bytes"]
    assert rows[1]["decode_ms_per_token"] > 0
    assert rows[0]["telemetry"]["indexed"] == 0 and rows[1]["telemetry"]["indexed"] == 1


def test_grow_full_tiles_the_prompts_rows_and_the_bench_steps_the_full_cache_beside(native, monkeypatch):
    """`grow_full` (the scaling bench's full cache at a long context, `--full`): every layer
    holds the prompt's rows tiled to the target, counts them as seen (the next token's position
    follows them) and decodes; `decode_scaling(full=True)` gives each context a full-cache row
    after the retrieval one, stepped in the same rounds, and `record=False` keeps no telemetry."""
    from tinygpt_mlx.cache import make_cache as plain_cache
    from tinygpt_mlx.evaluate.retrieval_bench import decode_scaling, grow_full

    cache = plain_cache(native.model, CacheConfig())
    prefill(native.model, TOKENS[:100], cache, 32)
    first = [tuple(np.array(x) for x in layer.body.fetch()) for layer in cache.owned]
    grow_full(cache, 250)
    tiled = np.arange(250) % 100
    for layer, (k0, v0) in zip(cache.owned, first):
        k, v = (np.array(x) for x in layer.body.fetch())
        assert layer.current_length == layer.offset == 250
        assert (k == k0[..., tiled, :]).all() and (v == v0[..., tiled, :]).all()
    logits = forward(native.model, mx.array([[TOKENS[100]]]), cache)
    assert cache.owned[0].current_length == 251 and bool(mx.isfinite(logits).all())

    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=8, index_block=4)
    asked = []
    monkeypatch.setattr(KVCache, "record_retrievals", lambda self: asked.append(self))
    rows = decode_scaling(native.model, cfg, TOKENS, [150, 600], decode_steps=2, chunk=32, full=True, record=False)
    assert not asked
    assert [(r["context"], r["cache"]) for r in rows] == [(153, "retrieval"), (153, "full"),
                                                          (603, "retrieval"), (603, "full")]
    assert rows[3]["hot_bytes"] > 3 * rows[1]["hot_bytes"] and rows[3]["cold_bytes"] == 0
    assert rows[0]["hot_bytes"] == rows[2]["hot_bytes"] and rows[2]["cold_bytes"] > rows[0]["cold_bytes"]
    assert all("telemetry" not in r and r["decode_cpu_ms_per_token"] > 0 for r in rows)


def test_summary_recall_reads_the_decode_steps_coarse_passes(native):
    """The recall bench records the query rows of every decode step's coarse pass (the pool's
    ranking) and scores each summary on them: until the pools it spied on the per-query search,
    which decode no longer runs, and found nothing to score."""
    from tinygpt_mlx.evaluate.retrieval_bench import summary_recall

    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=8)
    out = summary_recall(native.model, cfg, TOKENS[:400], decode_steps=3, k=4, chunk=64,
                         variants=[("minmax", 0), ("mean", 0)])
    assert out["cold_tokens"] > 8 * 2
    assert all(r is not None and 0 < r <= 1 for r in out["recall"].values()), out


@pytest.mark.parametrize("unit, units, span_score", [(1, 24, "max"), (8, 3, "max"), (8, 3, "mean")])
def test_pool_segment_fast_path_equals_the_gather_reference(unit, units, span_score):
    """PoolSegment scores whole pages by a page gather and forms its output by scattering the
    probabilities into the pool and one matmul (tokens) or weighting each query's picked pages
    gathered as pages (spans); the simple path (gather each query's picked keys and values,
    score and weight them) gives the same picks, scores and output. Two batch rows: a page
    gather offset by the wrong row fails."""
    import mlx.core as mx

    from tinygpt_mlx.cache.segments import PoolSegment
    B, H, rep, L, U, D = 2, 2, 3, 5, 64, 8
    keys, values = mx.random.normal((B, H, U, D), key=mx.random.key(1)), mx.random.normal((B, H, U, D), key=mx.random.key(2))
    if unit == 1:
        valid = mx.random.uniform(shape=(B, H, U), key=mx.random.key(3)) > 0.2
    else:   # as the cold store gathers pages: real tokens a prefix of each page, padding a copy
        # of the page's first row (ColdStore.pool_tokens); page 0 is all padding
        # with keys that would outscore every real page if pages were not masked
        n_real = mx.random.randint(1, unit + 1, (B, H, U // unit, 1), key=mx.random.key(3))
        n_real = mx.where(mx.arange(U // unit)[:, None] == 0, 0, n_real)
        valid = (mx.arange(unit) < n_real).reshape(B, H, U)
        keys = mx.where((mx.arange(U) < unit)[:, None], 100 * keys, keys)
        first = mx.repeat(keys.reshape(B, H, U // unit, unit, D)[:, :, :, :1], unit, axis=3).reshape(B, H, U, D)
        keys = mx.where(valid[..., None], keys, first)
    q = mx.random.normal((B, H, rep, L, D), key=mx.random.key(4))
    seg = PoolSegment(keys, values, valid, units, unit, span_score)
    scores = seg.scores(q)
    p = mx.softmax(scores, axis=-1)
    out = seg.output(p)
    idx = seg.picked                                                        # [B, H, L, T]
    # the reference: every query's own picked keys and values, gathered
    k_sel = mx.take_along_axis(keys[:, :, None], idx[..., None], axis=3)   # [B, H, L, T, D]
    v_sel = mx.take_along_axis(values[:, :, None], idx[..., None], axis=3)
    ok = mx.take_along_axis(mx.broadcast_to(valid[:, :, None], (B, H, L, U)), idx, axis=-1)
    ref = mx.where(ok[:, :, None], mx.einsum("bhrld,bhltd->bhrlt", q, k_sel), -mx.inf)
    assert mx.array_equal(mx.isinf(scores), mx.isinf(ref)).item()
    assert mx.abs(mx.where(mx.isinf(ref), 0, scores - ref)).max().item() < 1e-5
    assert mx.abs(out - mx.einsum("bhrlt,bhltd->bhrld", p, v_sel)).max().item() < 1e-5
    # the picks are the best: no unpicked valid unit scores above a picked one (group max), a
    # page scored by its best real token, or (mean) each head's query against its real keys' mean
    if span_score == "mean":
        real = valid.reshape(B, H, U // unit, unit, 1)
        mean_key = (keys.reshape(B, H, U // unit, unit, D) * real).sum(axis=3) / mx.maximum(real.sum(axis=3), 1)
        per_unit = mx.where(real.any(axis=(3, 4))[:, :, None], mx.einsum("bhrld,bhpd->bhrlp", q, mean_key).max(axis=2), -mx.inf)
    else:
        best = mx.where(valid[:, :, None], (mx.einsum("bhrld,bhud->bhrlu", q, keys)).max(axis=2), -mx.inf)
        per_unit = best.reshape(B, H, L, U // unit, unit).max(axis=-1)
    picked_units = mx.take_along_axis(per_unit, idx[..., ::unit] // unit, axis=-1)
    assert (picked_units.min(axis=-1) >= mx.sort(per_unit, axis=-1)[..., -units]).all().item()


# max |logit| difference, frame hot window vs the pre-RoPE path (and re-based vs not) on these
# runs: measured 2.2e-6 .. 2.7e-6 (fp32 RoPE applied in another order)
FRAME_TOL = 6e-6
# 300 distinct tokens: a repeated token has the same key in the first layer wherever it stands,
# so two pages can tie exactly on their best key, and rounding (the query turned by other
# angles) may then pick either, as two correct implementations may
DISTINCT = [int(x) for x in np.random.RandomState(0).permutation(300) + 1]
FRAME_CASES = {"fixed-spans": dict(), "fixed-tokens": dict(retrieve_unit="tokens"),
               "page": dict(retrieved_position="page", retrieve_unit="tokens"),
               "slots": dict(retrieved_position="slots"), "no-sink": dict(sink=0)}


def _frame_config(**kw):
    return CacheConfig(**{**dict(hot_budget=24, sink=4, page_size=8, top_pages=2, retrieve_tokens=16), **kw})


@pytest.mark.parametrize("case", list(FRAME_CASES))
def test_frame_hot_window_equals_the_pre_rope_path(native, case):
    """The shifted hot window on frame positions (keys kept as the model rotated them, the sink
    and the retrieved keys placed relative to it, a key un-rotated once as it goes cold) puts
    every key at the distance the pre-RoPE path (`ring=False`: the window before RoPE, placed
    on every read) puts it, across prefill chunks, evictions into the cold store, retrieval and
    decode: the same logits to rounding, the same tokens, the same cold store."""
    tokens = DISTINCT
    frame, cache = run(native.model, _frame_config(**FRAME_CASES[case]), tokens, chunk=16, steps=24, record=True)
    simple, ref = run(native.model, _frame_config(**FRAME_CASES[case]), tokens, chunk=16, steps=24, ring=False,
                      record=True)
    layer = cache[0]
    assert layer.positions.frame and layer.body.frame is not None and not ref[0].positions.frame
    assert len(layer.cold) == len(ref[0].cold) > 200
    err = float(mx.abs(frame - simple).max())
    print(f"{case}: frame vs pre-RoPE hot window {err:.2e}")
    assert err < FRAME_TOL
    assert mx.argmax(frame, axis=-1).tolist() == mx.argmax(simple, axis=-1).tolist()
    # the cold store received the same (pre-RoPE) keys
    np.testing.assert_allclose(layer.cold.keys.view(), ref[0].cold.keys.view(), atol=2e-5)
    assert cache.retrieval_report()["retrievals"] == ref.retrieval_report()["retrievals"] > 0


def test_frame_hot_window_rebase_is_exact(native):
    """Re-basing every 23 tokens (13 times over 300 tokens: inside prefill chunks and decode)
    turns the hot window back and moves the frame: the un-rebased logits, and the query's RoPE
    position stays below the interval."""
    tokens = DISTINCT
    plain, _ = run(native.model, _frame_config(), tokens, chunk=16, steps=24)
    rebased, cache = run(native.model, _frame_config(), tokens, chunk=16, steps=24, rebase_every=23)
    layer = cache[0]
    assert layer.positions.base >= 23 * 12 and 0 <= layer.offset < 23
    err = float(mx.abs(rebased - plain).max())
    print(f"re-based every 23 tokens vs not: {err:.2e}")
    assert err < FRAME_TOL
    assert mx.argmax(rebased, axis=-1).tolist() == mx.argmax(plain, axis=-1).tolist()


def test_frame_hot_window_is_not_rotated_per_step(native):
    """What a decode step rotates by RoPE, in rows (tokens x heads) per layer: on frame positions
    the query (turned once to the retrieved slot: the coarse pass, the retrieved keys and the
    sink are scored against it) and the key going cold, nothing else; the pre-RoPE path also
    places its whole hot window and the retrieved keys, every step."""
    hot = 48
    rows = {}
    for ring in (True, False):
        cfg = _frame_config(hot_budget=hot)
        cache = make_cache(native.model, cfg, ring=ring)
        cache.compile_decode = False    # counted op by op (a compiled step traces the same calls once)
        prefill(native.model, TOKENS, cache, 16)
        layer = cache[0]
        seen = []
        rope = layer.positions.rope

        def counting(x, offset=0, rope=rope, seen=seen):
            seen.append(x.size // x.shape[-1])
            return rope(x, offset=offset)
        layer.positions.rope = counting
        for t in range(5, 9):
            mx.eval(forward(native.model, mx.array([[t]]), cache))
        rows[ring] = sum(seen) / 4
        layer.positions.rope = rope
    hkv = cache[0].body.keys.shape[1]
    print(f"RoPE rows per decode step in one layer: frame {rows[True]}, pre-RoPE {rows[False]}")
    assert rows[True] == native.model.layers[0].attn.n_heads + hkv
    assert hot * hkv <= rows[False]


def test_extended_cold_store_keeps_the_window_in_place(native):
    """`extend_cold` (the scaling bench's way to long contexts) moves the hot window on by what
    it adds: on frame positions the base moves with it (the window's keys are never turned, so
    no rounding builds up over many calls), so decoding afterwards equals the pre-RoPE path
    (which places by slots), and positions stay consecutive and increasing."""
    from tinygpt_mlx.evaluate.retrieval_bench import grow_cold
    out = {}
    for ring in (True, False):
        cache = make_cache(native.model, _frame_config(), ring=ring)
        prefill(native.model, DISTINCT[:120], cache, 16)
        grow_cold(cache, 700, block=16)     # 36 calls
        out[ring] = mx.stack([forward(native.model, mx.array([[t]]), cache)[0, -1] for t in DISTINCT[120:136]])
        layer = cache[0]
        cold = layer.cold.positions.view()
        assert layer.current_length == 700 + 16 and len(layer.cold) + layer.stored_count == layer.current_length
        assert (np.diff(cold) == 1).all() and cold[-1] + 1 == layer.start
        assert layer.key_positions().tolist()[-1] == layer.current_length - 1
    err = float(mx.abs(out[True] - out[False]).max())
    print(f"after extend_cold, frame vs pre-RoPE: {err:.2e}")
    assert err < FRAME_TOL


@pytest.mark.parametrize("bits, rebase_every", [(dict(key_bits=None, value_bits=8), None),
                                                 (dict(key_bits=None, value_bits=8), 23),
                                                 (dict(key_bits=4, value_bits=4), None),
                                                 (dict(key_bits=4, value_bits=4, rotate=True), None),
                                                 (dict(key_bits=None, value_bits=8, rotate=True), 23)],
                         ids=["k-exact-v8", "k-exact-v8-rebased", "int4", "int4-rotated", "k-exact-v8-rotated-rebased"])
def test_kivi_with_shifted_retrieval_equals_the_full_kivi_cache_when_everything_comes_back(native32, bits,
                                                                                            rebase_every):
    """KIVI under shifted retrieval (frame positions: the body's keys quantised as the model
    rotated them, as in the full KIVI cache; evicted blocks go cold dequantised and un-rotated)
    retrieving everything at consecutive slots gives the full KIVI cache's logits: the same
    quantised tokens at the same distances (measured 1.8e-6 .. 2.6e-6), re-basing every 23
    tokens included (exact keys: the re-base turns them exactly)."""
    full, _ = run(native32.model, CacheConfig(kivi_sink=0, **bits))   # as retrieval's sink: none
    out, cache = run(native32.model, covering(retrieved_position="slots", **bits), rebase_every=rebase_every)
    layer = cache[0]
    assert layer.positions.frame and len(layer.cold) > 0 and len(layer.cold) % 32 == 0   # frozen blocks went cold
    if rebase_every:
        assert layer.positions.base >= 5 * rebase_every
    err = float(mx.abs(out - full).max())
    print(f"{bits}, re-base every {rebase_every}: shifted KIVI retrieval vs the full KIVI cache {err:.2e}")
    assert err < 6e-6
    with pytest.raises(ValueError, match="frame positions only"):
        make_cache(native32.model, covering(retrieved_position="slots", **bits), ring=False)
