"""The device cold store (cache/cold_device.py) against the host store (cache/cold.py), its
reference: the same cold tokens for every query of a pass, prefill chunks and decode steps, under
every selection rule; and a decode step's graph is built without one read back to the host."""

import contextlib
import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from prerope import make_cache
from tinygpt_mlx.cache import KVCache
from tinygpt_mlx.cache.cold import ColdStore
from tinygpt_mlx.cache.cold_device import DeviceColdStore
from tinygpt_mlx.cache.positions import Positions
from tinygpt_mlx.cache.segments import PickedSegment, PoolSegment, Reading, attend
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward, prefill


def _stores(seed, n, G=2, D=16, **kw):
    """A host store and a device store holding the same `n` random keys over G KV heads (a
    strong key planted for head 0 near the end), appended in uneven pieces as evictions come."""
    cfg = CacheConfig(**{**dict(hot_budget=8, rope_mode="absolute", page_size=8, top_pages=4, retrieve_tokens=16,
                                retrieve_unit="tokens"), **kw})
    rng = np.random.RandomState(seed)
    keys = rng.randn(1, G, n, D).astype(np.float32)
    values = rng.randn(1, G, n, D).astype(np.float32)
    keys[0, 0, n - 2] = 3 * rng.randn(D)
    stores = (ColdStore(cfg, KVCache), DeviceColdStore(cfg, KVCache))
    cuts = [0] + sorted(rng.choice(np.arange(1, n), size=min(6, n - 1), replace=False).tolist()) + [n]
    for a, b in zip(cuts, cuts[1:]):
        for store in stores:
            store.append(mx.array(keys[:, :, a:b]), mx.array(values[:, :, a:b]), a)
    return cfg, stores, rng


def _attended(store, reading):
    """Per KV head and query, the sorted cold indices the query attends to, and the output."""
    segments, selection = store.retrieve(reading)
    out = attend(segments, 1, reading.queries, reading.scale, None)
    mx.eval(out)
    (seg,) = segments
    if isinstance(seg, PickedSegment):       # a decode step's pick, made before attention
        rows, valid = np.asarray(seg.rows), np.asarray(seg.valid).reshape(len(np.asarray(seg.rows)), -1)
        return [[sorted(row[ok].tolist())] for row, ok in zip(rows, valid)], np.asarray(out)
    if not isinstance(seg, PoolSegment):     # the slots rule: each query's own keys, in slot order
        return np.asarray(seg.keys), np.asarray(out)
    rows, valid = np.asarray(seg.rows), np.asarray(seg.valid).reshape(len(np.asarray(seg.rows)), -1)
    picked = np.asarray(seg.picked).reshape(rows.shape[0], -1, np.asarray(seg.picked).shape[-1])
    got = [[sorted(rows[g][p][valid[g][p]].tolist()) for p in picked[g]] for g in range(rows.shape[0])]
    return got, np.asarray(out)


CASES = {
    "tokens": {},
    "spans": dict(retrieve_unit="spans"),
    "spans-mean": dict(retrieve_unit="spans", span_score="mean"),
    "mean-summary": dict(summary="mean"),
    "hybrid": dict(summary="hybrid"),
    "no-index": dict(index_block=0),
    "not-sticky": dict(sticky=False),
    "cold-int8": dict(cold_bits=8),
    "cold-int4-spans": dict(cold_bits=4, retrieve_unit="spans"),
    "fixed": dict(rope_mode="shifted", retrieved_position="fixed", retrieve_unit="spans"),
    "page": dict(rope_mode="shifted", retrieved_position="page", retrieve_unit="spans"),
    "slots": dict(rope_mode="shifted", retrieved_position="slots"),
    "every-page": dict(top_pages=300, retrieve_unit="spans"),
    # blocks of 3 pages: the summaries' capacity (512) is not a multiple of the block, so the
    # index's candidates are gathered page by page (device_select._bound_at), not block by block
    "index-block-3": dict(index_block=3),
}


@pytest.mark.parametrize("n", [301, 2101])
@pytest.mark.parametrize("case", list(CASES))
def test_device_store_attends_to_what_the_host_store_does(case, n):
    """Three passes (a chunk of 6 queries, two decode steps: the sticky pages of each joining
    the next) over a store of 301 tokens (flat scan, an unfinished page) and 2,101 (the
    two-level index): every query attends to the same cold tokens on the device as on the host,
    and attention's output agrees."""
    kw = CASES[case]
    D = 32 if "cold_bits" in kw else 16
    cfg, (host, dev), rng = _stores(n, n, D=D, **kw)
    assert host.index.uses_index() == dev.index.uses_index() == (n > 2048 and case not in ("no-index", "every-page"))
    pos = Positions(cfg, nn.RoPE(D))
    for L in (6, 1, 1):
        q = mx.array(rng.randn(1, 4, L, D).astype(np.float32))
        reading = Reading(mx.float32, pos, 40 if pos.shifted else 0, q, 0.25)
        want, out_host = _attended(host, reading)
        got, out_dev = _attended(dev, reading)
        if isinstance(want, list):
            assert got == want
        else:
            np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(out_dev, out_host, atol=2e-5)


def test_device_store_sticky_pages_are_the_host_stores():
    """After a pass the device store's sticky pages are the host store's, page for page."""
    cfg, (host, dev), rng = _stores(0, 2101, retrieve_unit="tokens")
    q = mx.array(rng.randn(1, 4, 1, 16).astype(np.float32))
    reading = Reading(mx.float32, Positions(cfg, None), 0, q, 1.0)
    for store in (host, dev):
        _attended(store, reading)
    want = host._recent()
    got = np.asarray(dev._recent)
    for g in range(2):
        assert sorted(set(got[g][got[g] >= 0].tolist())) == want[g].tolist()


def test_device_store_pins_the_oracles_pages():
    """The needle oracle (`KVCache.pin`) puts the pages holding given positions into every pool."""
    cfg, (host, dev), rng = _stores(1, 2101, top_pages=1, retrieve_tokens=8)
    for store in (host, dev):
        store.pinned = np.array([17, 18])
    q = mx.array(rng.randn(1, 4, 1, 16).astype(np.float32))
    reading = Reading(mx.float32, Positions(cfg, None), 0, q, 1.0)
    pool_host, _ = host.pool(np.asarray(q).reshape(2, 2, 1, 16))
    pool_dev, _ = dev.pool(q.reshape(2, 2, 1, 16))
    for g in range(2):
        assert 2 in pool_host[g] and 2 in np.asarray(pool_dev)[g]
    assert _attended(host, reading)[0] == _attended(dev, reading)[0]


def test_device_store_grows_by_doubling_and_rewinds():
    """Rows and summaries grow by doubling (a few growths for thousands of tokens); a mark and
    a rewind cut the store back and the tokens appended after it are those the store then holds."""
    cfg, (host, dev), rng = _stores(2, 300)
    mark = dev.mark()
    extra = rng.randn(1, 2, 1900, 16).astype(np.float32)
    dev.append(mx.array(extra), mx.array(extra), 300)
    assert dev.keys.growths == 2 and dev.keys.capacity == 4096 and dev.index.n_pages == 2200 // 8
    dev.rewind(mark)
    host_mark = host.mark()
    for store in (host, dev):
        store.append(mx.array(extra[:, :, :37]), mx.array(extra[:, :, :37]), 300)
    q = mx.array(rng.randn(1, 4, 1, 16).astype(np.float32))
    reading = Reading(mx.float32, Positions(cfg, None), 0, q, 1.0)
    assert _attended(host, reading)[0] == _attended(dev, reading)[0]
    for name in ("smax", "smin", "bmax", "bmin"):    # the blocks from the pages' tail after the rewind
        np.testing.assert_array_equal(np.asarray(dev.index.rows[name].view()),
                                      getattr(host.index, name).view().transpose(1, 0, 2))
    assert dev.index.n_blocks == 5
    host.rewind(host_mark)


# ----- no host sync while a decode step is built ---------------------------------------------

@contextlib.contextmanager
def counting_syncs():
    """Counts every read of an MLX array back to the host (np.asarray / np.array of an MLX array,
    `.item()`, `.tolist()`, int/float/bool of one) and every `mx.eval`."""
    count = {"n": 0, "where": []}
    saved = {}

    def hit(name):
        import traceback
        count["n"] += 1
        count["where"].append((name, traceback.format_stack(limit=4)[0]))

    def wrap_np(fn, name):
        def wrapped(a, *args, **kw):
            if isinstance(a, mx.array):
                hit(name)
            return fn(a, *args, **kw)
        return wrapped

    def wrap_method(fn, name):
        def wrapped(self, *args, **kw):
            hit(name)
            return fn(self, *args, **kw)
        return wrapped

    saved[(np, "asarray")], saved[(np, "array")] = np.asarray, np.array
    np.asarray, np.array = wrap_np(np.asarray, "np.asarray"), wrap_np(np.array, "np.array")
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__"):
        saved[(mx.array, name)] = getattr(mx.array, name)
        setattr(mx.array, name, wrap_method(getattr(mx.array, name), name))
    saved[(mx, "eval")] = mx.eval
    mx.eval = wrap_method(mx.eval, "mx.eval")
    try:
        yield count
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


SYNC_CASES = {**{k: v for k, v in CASES.items() if k not in ("cold-int4-spans",)},
              "default": {}, "int4": dict(key_bits=4, value_bits=4), "sink": dict(sink=4)}


@pytest.mark.parametrize("case", list(SYNC_CASES))
def test_a_retrieval_decode_step_reads_nothing_back(native, case):
    """Building a decode step's graph (the model call; its logits are evaluated after) through
    every retrieval configuration reads nothing back from the device: the index (1,100 tokens
    through a hot window of 32: 134 pages, past the index's threshold), sticky pages, eviction
    into the cold store, every position rule."""
    kw = {**dict(hot_budget=32, page_size=8, top_pages=2, retrieve_tokens=16, index_block=4, index_expand=2), **SYNC_CASES[case]}
    if kw.get("retrieve_unit") is None and kw.get("retrieved_position") != "slots":
        kw.setdefault("retrieve_unit", "tokens")
    if "cold_bits" in kw or "key_bits" in kw:
        pytest.skip("packed cold rows and KIVI need a head dimension of 32: test_..._native32")
    _no_syncs(native.model, CacheConfig(**kw), indexed=case not in ("no-index", "every-page"))


@pytest.mark.parametrize("kw", [dict(cold_bits=8), dict(key_bits=4, value_bits=4, sink=4),
                                dict(key_bits=8, value_bits=8, retrieved_position="slots")],
                         ids=["cold-int8", "int4", "int8-slots"])
def test_a_retrieval_decode_step_reads_nothing_back_native32(native32, kw):
    _no_syncs(native32.model, CacheConfig(**{**dict(hot_budget=64, page_size=8, top_pages=2, retrieve_tokens=16,
                                                   index_block=4, index_expand=2), **kw}))


def _no_syncs(model, cfg, indexed=True):
    tokens = [int(x) for x in np.random.RandomState(0).randint(1, 300, size=1100)]
    cache = make_cache(model, cfg)
    logits = prefill(model, tokens, cache, 256)
    mx.eval(logits)
    assert cache[0].cold.index.uses_index() == indexed
    for t in range(3):
        with counting_syncs() as count:
            logits = model(mx.array([[5 + t]]), cache=cache)
        assert count["n"] == 0, count["where"]
        mx.eval(logits)


def test_the_sync_counter_counts(native):
    """The counter is not vacuous: it counts each kind of read, and the host store (on disk),
    which reads the query back in every layer, fails the test above."""
    with counting_syncs() as count:
        np.asarray(mx.array([1.0]))
        mx.array([2]).item()
        mx.eval(mx.array([3]))
        int(mx.array(4))
    assert count["n"] == 4
    with pytest.raises(AssertionError, match="np.asarray"):
        _no_syncs(native.model, CacheConfig(hot_budget=32, page_size=8, top_pages=2, retrieve_tokens=16,
                                            index_block=4, index_expand=2, cold_store="disk"))


# ----- edges a review found -------------------------------------------------------------------

def test_a_store_at_its_capacity_reads_no_row_past_it():
    """256 tokens (the rows' first capacity, whole pages: no unfinished page) and more tokens
    wanted than there are: the always-offered unfinished page holds none, and its padding must
    read a real row, not row n (past the array: garbage, NaN through p = 0)."""
    cfg, (host, dev), rng = _stores(4, 256, top_pages=64, retrieve_tokens=600)
    assert dev.keys.capacity == dev.n == 256
    q = mx.array(rng.randn(1, 4, 1, 16).astype(np.float32))
    reading = Reading(mx.float32, Positions(cfg, None), 0, q, 1.0)
    [seg], _ = dev.retrieve(reading)
    assert int(mx.max(seg.rows)) < 256
    assert _attended(host, reading)[0] == _attended(dev, reading)[0]


@pytest.mark.parametrize("unit", ["tokens", "spans"])
def test_the_index_at_its_capacity_scores_no_page_past_it(unit):
    """4,096 tokens: 512 pages, the summaries' capacity, 64 whole blocks and no unfinished one:
    the unfinished block the index always offers (block 64) lies past the arrays, its block
    gather reads the last one instead (device_select._bound_blocks) and its pages are masked;
    every query still attends to what the host store's does."""
    cfg, (host, dev), rng = _stores(9, 4096, retrieve_unit=unit)
    assert dev.index.uses_index() and dev.index.rows["smin"].capacity == dev.index.n_pages == 512
    for _ in range(3):
        q = mx.array(rng.randn(1, 4, 1, 16).astype(np.float32))
        reading = Reading(mx.float32, Positions(cfg, None), 0, q, 0.25)
        assert _attended(host, reading)[0] == _attended(dev, reading)[0]


def test_bf16_rows_are_written_as_the_host_store_writes_them():
    """A bf16 cache's device rows go to files as fp32 (the host store's layout; numpy has no bf16)
    and load back into either store."""
    cfg = CacheConfig(hot_budget=8, storage="bf16", rope_mode="absolute", page_size=8, top_pages=4)
    dev = DeviceColdStore(cfg, KVCache)
    keys = mx.random.normal((1, 2, 50, 16), key=mx.random.key(0))
    dev.append(keys, keys, 0)
    arrays, meta = dev.state()
    assert arrays["keys"].dtype == np.float32 and arrays["keys"].shape == (50, 2, 16)
    np.testing.assert_array_equal(arrays["keys"], np.asarray(keys.astype(mx.bfloat16).astype(mx.float32)[0].swapaxes(0, 1)))


@pytest.mark.parametrize("first", [10000.0, 3.0])
def test_compiled_selections_keep_their_own_rope(first):
    """Under the `page` rule the compiled pick turns keys by the layer's RoPE: two models with
    other RoPE bases in one process each pick what their host store picks."""
    for base in (first, 13000.0 - first):
        cfg, (host, dev), rng = _stores(6, 301, rope_mode="shifted", retrieved_position="page", retrieve_unit="spans")
        pos = Positions(cfg, nn.RoPE(16, base=base))
        q = mx.array(rng.randn(1, 4, 1, 16).astype(np.float32))
        reading = Reading(mx.float32, pos, 40, q, 0.25)
        assert _attended(host, reading)[0] == _attended(dev, reading)[0], base


def test_telemetry_keeps_the_newest_records_only(monkeypatch):
    from tinygpt_mlx.cache.telemetry import RetrievalTelemetry, Selection
    monkeypatch.setattr(RetrievalTelemetry, "KEEP", 4)
    t = RetrievalTelemetry()
    sel = Selection(layer=0, queries=1, cold_tokens=8, cold_pages=1, page_size=8, tokens_scored=8, indexed=False,
                    pages=np.zeros((1, 1)), positions=np.arange(8), tokens_retrieved=8, fetched=lambda: [])
    for _ in range(20):
        t.record(sel)
    assert 4 <= len(t.records) <= 8 and t.records[-1]["step"] == 19 and t.steps == 20


# ----- the RAM budget: the oldest rows spilled to disk (config.cold_ram) ----------------------

SPILL_CASES = {"fp32": {}, "bf16": dict(storage="bf16"), "mean-page": dict(summary="mean", retrieved_position="page"),
               "slots": dict(retrieved_position="slots"), "tokens": dict(retrieve_unit="tokens")}


def _spilling(model, cfg, share: int = 10 ** 6):
    """A cache whose ram stores spill past the least budget they take (one block of pages per
    layer): `cold_ram`'s 1 MiB shared by `share` layers, where a test model has 2."""
    cache = make_cache(model, cfg)
    for layer in cache.distinct():
        layer.cold.ram_layers = share
    return cache


def _run(model, cache, tokens, steps=24, chunk=64):
    """Every prefill chunk's logits, then greedy decode steps' (each evaluated: a spill reads back)."""
    out = []
    for i in range(0, len(tokens), chunk):
        out.append(prefill(model, tokens[i:i + chunk], cache, chunk))
        mx.eval(out[-1])
    for _ in range(steps):
        out.append(forward(model, mx.array([[int(mx.argmax(out[-1]).item())]]), cache)[0, -1])
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("case", list(SPILL_CASES))
def test_a_spilled_store_attends_to_what_it_would_in_ram(native, case):
    """Past its RAM budget the ram store moves its oldest rows to disk, a quarter of the budget
    at a time, and keeps at most the budget in RAM; every prefill chunk and decode step gives
    the logits it gives with everything in RAM (the search is the same: summaries stay in RAM;
    a picked spilled row is read back from its file; a decode step takes the selection op by
    op, not the compiled one, whose sums may differ in the last bit). The bytes in all are the
    same; `disk_nbytes` says how many are on disk."""
    cfg = CacheConfig(hot_budget=32, page_size=8, top_pages=4, retrieve_tokens=16, index_block=4, index_expand=2,
                      **SPILL_CASES[case])
    tokens = [int(x) for x in np.random.RandomState(3).randint(1, 300, size=900)]
    want = _run(native.model, make_cache(native.model, cfg), tokens)
    cache = _spilling(native.model, dataclasses.replace(cfg, cold_ram=1))
    got = _run(native.model, cache, tokens)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    store = cache[0].cold
    budget = store.budget_tokens()
    assert budget == 32 and store.spilled >= store.n - budget and store.n - store.spilled <= budget
    assert cache.disk_nbytes > 0 and cache.nbytes == make_cache_bytes(native.model, cfg, tokens)


def make_cache_bytes(model, cfg, tokens):
    cache = make_cache(model, cfg)
    _run(model, cache, tokens)
    return cache.nbytes


def test_a_spilled_store_reads_only_picked_rows_and_packed_rows_too(native32):
    """Packed cold rows (8 bits: codes, scale and zero, each spilled) attend as in RAM; a spill
    cuts back into the file on a rewind (a checkpoint older than the spill) and continues as the
    store in RAM does after the same rewind."""
    cfg = CacheConfig(hot_budget=64, page_size=8, top_pages=4, retrieve_tokens=16, index_block=4, cold_bits=8)
    tokens = [int(x) for x in np.random.RandomState(4).randint(1, 300, size=700)]
    ram, spilled = make_cache(native32.model, cfg), _spilling(native32.model, dataclasses.replace(cfg, cold_ram=1))
    marks = []
    for cache in (ram, spilled):
        _run(native32.model, cache, tokens[:200], steps=0)
        marks.append(cache.checkpoint())
        _run(native32.model, cache, tokens[200:], steps=0)
    assert spilled[0].cold.spilled > 200 - 64
    for cache, mark in zip((ram, spilled), marks):
        cache.restore(mark)
    assert spilled[0].cold.spilled <= 200
    a, b = (_run(native32.model, cache, tokens[300:], steps=8) for cache in (ram, spilled))
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


def test_a_spilled_cache_saves_the_file_a_ram_one_does(native, tmp_path):
    """A prompt-cache file of a spilled cache holds every row (the spilled ones read from their
    file): it loads into a cache without a budget, and one with it, and both continue as the
    cache that saved it would. The budget is placement, not policy: the files differ only in it."""
    from tinygpt_mlx.cache.persist import load_prompt_cache, save_prompt_cache

    cfg = CacheConfig(hot_budget=32, page_size=8, top_pages=4, retrieve_tokens=16, index_block=4)
    tokens = [int(x) for x in np.random.RandomState(5).randint(1, 300, size=600)]
    cache = _spilling(native.model, dataclasses.replace(cfg, cold_ram=1))
    logits = _run(native.model, cache, tokens, steps=0)[-1]
    assert cache[0].cold.spilled
    save_prompt_cache(tmp_path / "s.ptc", cache, native, tokens, logits)
    plain = make_cache(native.model, cfg)
    _run(native.model, plain, tokens, steps=0)
    save_prompt_cache(tmp_path / "r.ptc", plain, native, tokens, logits)
    want = _run(native.model, plain, [7, 8, 9], steps=6)
    for budget in (None, 1):
        restored, _ = load_prompt_cache(tmp_path / "s.ptc", native, config=dataclasses.replace(cfg, cold_ram=budget))
        for layer in restored.distinct():
            layer.cold.ram_layers = 10 ** 6
        got = _run(native.model, restored, [7, 8, 9], steps=6)
        assert bool(restored[0].cold.spilled) == (budget is not None)
        for x, y in zip(want, got):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
    from tinygpt_mlx.cache.persist import read_prompt_cache_info
    a, b = read_prompt_cache_info(tmp_path / "s.ptc"), read_prompt_cache_info(tmp_path / "r.ptc")
    assert a.config.cold_ram == 1 and b.config.cold_ram is None and a.tokens == b.tokens


def test_a_store_loaded_past_its_budget_spills_at_once():
    """A store loaded (a prompt-cache file, a checkpoint) past its budget spills as it loads, and
    its passes attend to what the store it was saved from attends to, chunk and decode."""
    from tinygpt_mlx.cache.checkpoint import Held

    cfg, (_, dev), rng = _stores(6, 2101)
    arrays, meta = dev.state()
    spilled = DeviceColdStore(dataclasses.replace(cfg, cold_ram=1), KVCache)
    spilled.ram_layers = 10 ** 6
    spilled.load_state(Held.of(arrays), meta)
    assert spilled.n == 2101 and spilled.spilled >= 2101 - spilled.budget_tokens() > 0
    for L in (6, 1):
        q = mx.array(rng.randn(1, 4, L, 16).astype(np.float32))
        reading = Reading(mx.float32, Positions(cfg, None), 0, q, 0.25)
        (want, out), (got, out_spilled) = _attended(dev, reading), _attended(spilled, reading)
        assert got == want
        np.testing.assert_allclose(out_spilled, out, atol=2e-5)
    assert spilled.nbytes_breakdown()["cold_disk"] > 0


# ----- a compiled decode step of the whole model (cache/compiled.py, "retrieval") ------------

STEP_CASES = {"default": {}, "tokens": dict(retrieve_unit="tokens"), "mean": dict(summary="mean"),
              "hybrid": dict(summary="hybrid"), "no-index": dict(index_block=0), "not-sticky": dict(sticky=False),
              "page": dict(retrieved_position="page"), "no-sink": dict(sink=0), "bf16": dict(storage="bf16"),
              # original positions (the default inside a model's context): keys as the model rotated them
              "absolute": dict(rope_mode="absolute"),
              "absolute-tokens": dict(rope_mode="absolute", retrieve_unit="tokens"),
              "absolute-mean": dict(rope_mode="absolute", summary="mean"),
              "absolute-no-index": dict(rope_mode="absolute", index_block=0),
              "absolute-not-sticky": dict(rope_mode="absolute", sticky=False),
              "absolute-no-sink": dict(rope_mode="absolute", sink=0),
              "absolute-bf16": dict(rope_mode="absolute", storage="bf16")}


def _stepped(model, cache, prompt, steps, record=True):
    """Prefill `prompt`, then decode `steps` given tokens (the same for every cache: the runs stay
    in step); per step the logits, and per step and layer the sorted cold indices each KV head
    fetched (the telemetry's `Selection`, recorded after attention; `record`: the cache asked to
    record, `KVCache.record_retrievals`, else nothing is recorded and the picks are the step marks)."""
    from tinygpt_mlx.cache.telemetry import RetrievalTelemetry

    picks = []
    record_fn = RetrievalTelemetry.record

    def keep(self, s):
        picks.append((s.layer, [sorted(np.asarray(r).tolist()) for r in s.fetched()]))
        record_fn(self, s)
    if record:
        cache.record_retrievals()
    mx.eval(prefill(model, prompt, cache, 256))
    out = []
    RetrievalTelemetry.record = keep
    try:
        for t in range(steps):
            picks.append("step")
            out.append(forward(model, mx.array([[3 + (7 * t) % 250]]), cache)[0, -1])
            mx.eval(out[-1])
    finally:
        RetrievalTelemetry.record = record_fn
    return out, picks


def _records(cache):
    """Every layer's telemetry records (the device store's tokens scored, a lazy scalar, read)."""
    return [[{k: int(v) if k == "tokens_scored" else v for k, v in r.items()} for r in c.telemetry.records]
            for c in cache.owned]


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_a_compiled_retrieval_step_attends_to_what_the_host_store_does(native, case):
    """Decode steps through the compiled step of the whole model (a hot window of 32 over 320
    tokens: the index engaged, sticky pages, a page completed every 8 steps, which evicts eagerly
    first, `LayerCache.evict_ahead`): every KV head of every layer fetches the same cold tokens
    as the device store's eager step and as the host store (cold.py, the reference), and the
    logits agree; most steps ran compiled. The prompt's tokens are distinct: the first layer's
    keys repeat with its tokens, and the host store breaks exact ties between pages otherwise
    (docs/retrieval.md), after which the runs part."""
    from tinygpt_mlx.cache import compiled

    cfg = CacheConfig(**{**dict(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=16, index_block=4,
                                index_expand=2), **STEP_CASES[case]})
    prompt = [int(x) for x in np.random.RandomState(7).permutation(np.arange(1, 321))]
    ran = {"compiled": 0}
    real = compiled._retrieval_decode

    def counted(*a):
        out = real(*a)
        ran["compiled"] += out is not None
        return out
    compiled._retrieval_decode = counted
    try:
        fast = make_cache(native.model, cfg)
        assert fast.compiled_step == "retrieval"
        got, got_picks = _stepped(native.model, fast, prompt, 24)
    finally:
        compiled._retrieval_decode = real
    assert ran["compiled"] >= 20 and not compiled.trace_failures
    eager = make_cache(native.model, cfg)
    eager.compile_decode = False
    want, want_picks = _stepped(native.model, eager, prompt, 24)
    host, host_picks = _stepped(native.model, make_cache(native.model, dataclasses.replace(cfg, cold_store="disk")),
                                prompt, 24)
    assert len(got_picks) == 24 * (1 + len(fast.owned))       # a pick per step and layer, read through the records
    assert got_picks == want_picks == host_picks
    assert _records(fast) == _records(eager)                   # the same records, compiled or eager
    # (the host store holds bf16 rows as fp32: numpy has no bf16)
    host_atol = 2e-3 if cfg.storage == "bf16" else 1e-4
    for a, b, c in zip(got, want, host):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=host_atol)


def test_union_holds_each_page_once_in_order():
    """`device_pages.union`: every page of the parts once, ascending; repeats and nones (-1, NONE)
    are -1 holes; the size is the parts' sum."""
    from tinygpt_mlx.cache.device_pages import NONE, union

    got = np.asarray(union([mx.array([[5, 3, -1, 3], [0, 0, 0, 0]], mx.int32),
                            mx.array([[NONE, 5, 9], [NONE, -1, 2]], mx.int32)]))
    assert got.shape == (2, 7)
    assert got[0][got[0] >= 0].tolist() == [3, 5, 9] and got[1][got[1] >= 0].tolist() == [0, 2]
    assert (got[got < 0] == -1).all() and (got < 0).sum() == 4 + 5


def _union_before(parts):
    """`union` as it was before 2026-12-06 (the reference): each sorted id compared with the next
    through two slices, a column of falses joined in front."""
    from tinygpt_mlx.cache.device_pages import NONE

    s = mx.sort(mx.concatenate(parts, axis=-1).astype(mx.int32), axis=-1)
    repeat = mx.concatenate([mx.zeros(s.shape[:-1] + (1,), dtype=mx.bool_), s[..., 1:] == s[..., :-1]], axis=-1)
    return mx.where(repeat | (s < 0) | (s == NONE), -1, s)


def _bound_before(q, summary, summaries, level):
    """`device_select._bound` as it was before 2026-12-06 (the reference): the rows turned for
    each summary's product."""
    from tinygpt_mlx.cache.device_pages import bound

    return bound(q, summary, lambda x, name: summaries[level + name] @ x.swapaxes(1, 2)).max(axis=2)


def test_the_selections_fewer_nodes_give_the_same_bits():
    """The forms that cut graph nodes from every layer's selection (issue 53: the build follows
    the nodes) against the ones they replaced, kept above: `union` (each id against the one
    before it, -2 in front) on random page lists with repeats, nones (-1, NONE) and page 0, and
    `_bound` (the rows turned once) on random rows and summaries, both equal bit for bit, built
    op by op and compiled; the sticky pages of `pick_spans` (a page's first token real, from the
    page ids) equal `pool_tokens`' validity of each page's first token."""
    from tinygpt_mlx.cache import device_select as ds
    from tinygpt_mlx.cache.device_pages import NONE, pool_tokens, union

    rng = np.random.RandomState(0)
    for trial in range(20):
        G = 1 + trial % 4
        parts = [mx.array(rng.randint(-1, 12, size=(G, k)).astype(np.int32)) for k in (5, 1, 3)]
        parts.append(mx.array(np.where(rng.rand(G, 2) < 0.5, NONE, rng.randint(0, 12, size=(G, 2))).astype(np.int32)))
        assert np.array_equal(np.asarray(union(parts)), np.asarray(_union_before(parts)))
        assert np.array_equal(np.asarray(mx.compile(union)(parts)), np.asarray(_union_before(parts)))
        rep, D, cap = 1 + trial % 3, 16 * (1 + trial % 4), 16 << (trial % 5)
        q = mx.array(rng.randn(G, rep, D).astype(np.float32))
        summaries = {"smin": mx.array(rng.randn(G, cap, D).astype(np.float32)),
                     "smax": mx.array(rng.randn(G, cap, D).astype(np.float32))}
        want = np.asarray(_bound_before(q, "minmax", summaries, "s"))
        assert np.array_equal(np.asarray(ds._bound(q, "minmax", summaries, "s")), want)
        traced = mx.compile(lambda q, a, b: ds._bound(q, "minmax", {"smin": a, "smax": b}, "s"))
        assert np.array_equal(np.asarray(traced(q, summaries["smin"], summaries["smax"])), want)
        # pick_spans' sticky pages: page ids (-1: none) of a store of n tokens, pages of 8
        n = int(rng.randint(1, 90)) if trial % 2 else 8 * int(rng.randint(1, 12))
        pool = rng.randint(-1, 13, size=(G, 6)).astype(np.int32)
        pool[:, 0] = n // 8        # (a page that starts at n, where n is a page's end, holds no token)
        pool = mx.array(pool)
        idx, valid = pool_tokens(pool, mx.array([n], mx.int32), 8)
        keys = mx.array(rng.randn(G, 48, D).astype(np.float32))
        # (every page picked: the sticky pages are the pool's own, where its first token is real)
        _, _, recent = ds.pick_spans(q, pool, mx.array([n], mx.int32), idx, keys, valid, 6, 8, "max", 8)
        first = np.asarray(valid).reshape(G, 6, 8)[:, :, 0]
        assert np.array_equal(np.sort(np.asarray(recent), axis=1), np.sort(np.where(first, np.asarray(pool), -1), axis=1))


class _ScaledRope:
    """A RoPE that scales its input as some variants do (YaRN's mscale): not an `nn.RoPE`."""

    def __call__(self, x, offset=0):
        return mx.fast.rope(x * 1.25, x.shape[-1], traditional=True, base=500.0, scale=1.0, offset=offset)


@pytest.mark.parametrize("rope", [nn.RoPE(16), nn.RoPE(16, traditional=True, base=77.0), nn.RoPE(8, base=9.0),
                                  _ScaledRope()], ids=["rope", "traditional", "partial", "scaled"])
def test_rotations_are_the_ropes_turns(rope):
    """`Positions.rotations`: x times the matrix of each offset is the layer's (pure) RoPE of x
    at that offset (a partial RoPE leaves its other dims as they are; an input scale is divided
    out); `rotation_key` shares matrices only between equal `nn.RoPE`s."""
    pos = Positions(CacheConfig(hot_budget=8), rope)
    x = mx.array(np.random.RandomState(3).randn(6, 1, 16).astype(np.float32))
    offsets = [-37, 0, 5, 1000]
    mats = pos.rotations(mx.array(offsets, mx.int32), 16)
    for o, m in zip(offsets, mats):
        np.testing.assert_allclose(np.asarray(x[:, 0] @ m), np.asarray(pos.rope(x, offset=o)[:, 0]), atol=2e-6)
    same = Positions(CacheConfig(hot_budget=8), nn.RoPE(16))
    assert (same.rotation_key() == pos.rotation_key()) == (isinstance(rope, nn.RoPE) and rope.base == 10000
                                                          and rope.dims == 16 and not rope.traditional)
    assert Positions(CacheConfig(hot_budget=8), _ScaledRope()).rotation_key() != pos.rotation_key()


@pytest.mark.parametrize("rope", [nn.RoPE(16), nn.RoPE(16, traditional=True, base=77.0), nn.RoPE(8, base=9.0),
                                  nn.RoPE(16, scale=0.25)], ids=["rope", "traditional", "partial", "scale"])
def test_the_turns_and_the_products_are_one_rule(rope):
    """A compiled retrieval step's turns (`Positions.rotations`, offsets [k]) and its products with
    the model's RoPE (rope_products.py `rope_matrix`: one offset, or serve's B rows' offsets) are
    one rule, positions.py `identity_rope`: at each offset the same matrix, bit for bit, whichever
    form made it (the solo step and serve's batched step must turn alike: tests/test_server_parallel.py)."""
    from tinygpt_mlx.cache import rope_products

    pos = Positions(CacheConfig(hot_budget=8), rope)
    offsets = [-37, 0, 5, 1000, 70000]
    turns = np.asarray(pos.rotations(mx.array(offsets, mx.int32), 16))
    rows = np.asarray(rope_products.rope_matrix(rope, mx.array(offsets, mx.int32), 16))
    assert turns.shape == (5, 16, 16) and rows.shape == (5, 1, 16, 16)
    for i, o in enumerate(offsets):
        one = np.asarray(rope_products.rope_matrix(rope, mx.array(o, mx.int32), 16))
        assert np.array_equal(one, turns[i]) and np.array_equal(one, rows[i, 0]), o


def test_a_compiled_retrieval_step_turns_each_layer_by_its_own_rope(native_path):
    """A model whose layers hold other RoPE bases (Gemma 3's local and global layers): the
    compiled step, which turns the queries and leaving keys by matrices made once per step and
    RoPE (`Positions.rotations`), fetches what the eager device step and the host store fetch,
    layer by layer, and the logits agree."""
    from tinygpt_mlx.loading import load

    m = load(native_path)      # (its own model: a compiled step is kept on the model it traced)
    D = m.model.layers[0].attn.head_dim
    m.model.layers[1].attn.rope = nn.RoPE(D, base=31.0)
    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=16, index_block=4,
                      index_expand=2)
    prompt = [int(x) for x in np.random.RandomState(7).permutation(np.arange(1, 321))]
    got, got_picks = _stepped(m.model, make_cache(m.model, cfg), prompt, 16)
    eager = make_cache(m.model, cfg)
    eager.compile_decode = False
    want, want_picks = _stepped(m.model, eager, prompt, 16)
    host, host_picks = _stepped(m.model, make_cache(m.model, dataclasses.replace(cfg, cold_store="disk")), prompt, 16)
    assert got_picks == want_picks == host_picks
    for a, b, c in zip(got, want, host):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-4)


def test_retrievals_are_recorded_only_when_asked(native):
    """Retrieval telemetry is recorded only when asked (`KVCache.record_retrievals`): by default
    a prefill and decode steps through the compiled step, the eager device step and the host
    store make no record and no `Selection` of a compiled pick, and the report says that nothing
    was asked (an error, not zeros). Unrecorded, the compiled step decodes what a recorded one
    does (its trace then gives only the next sticky pages: the logits equal over 24 steps)."""
    from tinygpt_mlx.cache import compiled

    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=16, index_block=4,
                      index_expand=2)
    prompt = [int(x) for x in np.random.RandomState(7).permutation(np.arange(1, 321))]
    made, ran = [], []
    real, real_decode = DeviceColdStore.picked, compiled._retrieval_decode

    def picked(self, *a):
        made.append(1)
        return real(self, *a)

    def decode(*a):
        ran.append(real_decode(*a))
        return ran[-1]
    DeviceColdStore.picked, compiled._retrieval_decode = picked, decode
    try:
        quiet = make_cache(native.model, cfg)
        got, picks = _stepped(native.model, quiet, prompt, 24, record=False)
        eager = make_cache(native.model, cfg)
        eager.compile_decode = False
        host = make_cache(native.model, dataclasses.replace(cfg, cold_store="disk"))
        for cache in (eager, host):
            _stepped(native.model, cache, prompt, 8, record=False)
    finally:
        DeviceColdStore.picked = real
        compiled._retrieval_decode = real_decode
    assert sum(r is not None for r in ran) >= 20 and not made and picks == ["step"] * 24
    for cache in (quiet, eager, host):
        assert all(c.telemetry.records == [] and c.telemetry.steps == 0 for c in cache.owned)
        with pytest.raises(RuntimeError, match="record_retrievals"):
            cache.retrieval_report()
    recorded = make_cache(native.model, cfg)
    want, _ = _stepped(native.model, recorded, prompt, 24)
    assert recorded.retrieval_report()["retrievals"] > 24 * len(recorded.owned)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("rope_mode", ["shifted", "absolute"])
def test_a_compiled_retrieval_step_reads_nothing_back(native, rope_mode):
    """The compiled step (the product's `forward`) builds its graph without a read back either,
    on frame positions and at original positions."""
    from tinygpt_mlx.cache import compiled

    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=16, index_block=4, index_expand=2,
                      rope_mode=rope_mode)
    cache = make_cache(native.model, cfg)
    mx.eval(prefill(native.model, [int(x) for x in np.random.RandomState(0).randint(1, 300, size=1100)], cache, 256))
    real, ran = compiled._retrieval_decode, []
    compiled._retrieval_decode = lambda *a: ran.append(real(*a)) or ran[-1]
    try:
        for t in range(10):
            with counting_syncs() as count:
                logits = forward(native.model, mx.array([[5 + t]]), cache)
            assert count["n"] == 0, count["where"]
            mx.eval(logits)
    finally:
        compiled._retrieval_decode = real
    assert sum(r is not None for r in ran) >= 8


def test_attention_softmax_without_precise_gives_the_same_bits_on_fp32():
    """segments.attend's softmax runs without MLX's `precise` (about 2x slower on a CPU): on
    fp32 scores, which attention always computes, it gives the same bits, masked columns and
    large scores included."""
    for shape, scale in (((2, 4, 1, 1284), 1.0), ((1, 4, 2, 64, 300), 30.0), ((3, 7), 300.0)):
        x = mx.random.normal(shape, key=mx.random.key(1)) * scale
        x = mx.where(mx.random.uniform(shape=shape, key=mx.random.key(2)) < 0.3, -mx.inf, x)
        assert mx.array_equal(mx.softmax(x, axis=-1), mx.softmax(x, axis=-1, precise=True)).item()


@pytest.mark.parametrize("scale, picked_mask", [(0.25, 3), (0.3, 3), (0.25, 4)])
@pytest.mark.parametrize("n_turned", [0, 1, 2])
@pytest.mark.parametrize("parts", ["picked+sink+window", "picked+window", "window"])
def test_attend_one_query_form_equals_the_general_form(parts, n_turned, scale, picked_mask, monkeypatch):
    """`segments.attend` of one unmasked query over exact segments takes its one-query form
    (`_attend_one`: the query axis dropped; a decode step's picked cold tokens, sink and hot
    window, compiled or eager) and gives what its general form gives for the same call with a mask
    that hides nothing (which takes the general form): picked tokens not `valid` masked, the first
    `n_turned` segments scored with the turned queries, a KV head's query group of 2. The one-query
    form scales the joined scores (not the queries) and sums the values in one product over the
    segments' values joined: within rounding at a scale that is not a power of two (0.3). The
    picks' mask given [B, H, T] (the eager step's) or [B, H, 1, T] (the compiled step's:
    `picked_mask` 4) is the same mask."""
    from tinygpt_mlx.cache import segments as seg

    rng = np.random.RandomState(5)
    arr = lambda *shape: mx.array(rng.randn(*shape).astype(np.float32))
    valid = mx.array(rng.rand(2, 2, 7) < 0.6) | (mx.arange(7) == 0)
    valid = valid if picked_mask == 3 else valid.reshape(2, 2, 1, 7)
    made = {"picked": lambda: PickedSegment(arr(2, 2, 7, 16), arr(2, 2, 7, 16), valid),
            "sink": lambda: seg.DenseSegment(arr(2, 2, 4, 16), arr(2, 2, 4, 16)),
            "window": lambda: seg.DenseSegment(arr(2, 2, 9, 16), arr(2, 2, 9, 16))}
    segments = [made[p]() for p in parts.split("+")]
    n_turned = min(n_turned, len(segments) - 1)
    n_retrieved = 1 if parts.startswith("picked") else 0
    queries, turned = arr(2, 4, 1, 16), arr(2, 4, 1, 16)
    seen = sum(s.keys.shape[2] for s in segments[n_retrieved:])      # (a mask's columns: the stored tokens)
    ones, real = [], seg._attend_one
    monkeypatch.setattr(seg, "_attend_one", lambda *a: ones.append(1) or real(*a))
    got = seg.attend(segments, n_retrieved, queries, scale, None, turned, n_turned)
    want = seg.attend(segments, n_retrieved, queries, scale, mx.ones((1, seen), mx.bool_), turned,
                      n_turned)
    assert len(ones) == 1       # the first call alone took the one-query form
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    assert got.shape == want.shape == (2, 4, 1, 16)


class _TwoRopes(nn.Module):
    """A module holding RoPEs the way a model's attention does (`self.rope`), one nested."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope
        self.inner = nn.Module()
        self.inner.rope = nn.RoPE(16, base=77.0)


@pytest.mark.parametrize("rope", [nn.RoPE(16), nn.RoPE(16, traditional=True, base=77.0), nn.RoPE(8, base=9.0),
                                  nn.RoPE(16, scale=0.25)], ids=["rope", "traditional", "partial", "scale"])
def test_rope_products_turn_as_the_rope_does(rope):
    """`rope_products.products` (a compiled retrieval step's trace): one fp32 token at the shared
    offset is turned by a product with the RoPE's matrix at that offset (`rope_matrix`), equal to
    the RoPE within the last bit at every offset, the matrix made once per setting; another
    offset, several tokens or another dtype is the RoPE's own result, bit for bit; the modules
    are put back after the block, also after an error."""
    from tinygpt_mlx.cache import rope_products

    m = _TwoRopes(rope)
    x = mx.array(np.random.RandomState(3).randn(2, 3, 1, 16).astype(np.float32))
    for o in (0, 5, 1000, 70000):
        offset = mx.array(o, mx.int32)
        made = []
        real = rope_products.rope_matrix
        rope_products.rope_matrix = lambda *a: made.append(a) or real(*a)
        try:
            with rope_products.products(m, offset):
                assert type(m.rope) is not nn.RoPE and type(m.inner.rope) is not nn.RoPE
                got = [m.rope(x, offset=offset), m.rope(x[:, :2], offset=offset), m.inner.rope(x, offset=offset)]
                other = m.rope(x, offset=mx.array(o, mx.int32))               # not the shared offset
                long = m.rope(mx.concatenate([x, x], axis=2), offset=offset)   # two tokens
                half = m.rope(x.astype(mx.bfloat16), offset=offset)
        finally:
            rope_products.rope_matrix = real
        assert len(made) == 2       # one matrix per setting (the two heads' calls share one)
        assert m.rope is rope and type(m.inner.rope) is nn.RoPE
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(rope(x, offset=o)), rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(rope(x[:, :2], offset=o)), rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(got[2]), np.asarray(m.inner.rope(x, offset=o)), rtol=0, atol=2e-6)
        assert np.array_equal(np.asarray(other), np.asarray(rope(x, offset=o)))
        assert np.array_equal(np.asarray(long), np.asarray(rope(mx.concatenate([x, x], axis=2), offset=o)))
        assert np.array_equal(np.asarray(half.astype(mx.float32)),
                              np.asarray(rope(x.astype(mx.bfloat16), offset=o).astype(mx.float32)))
    with pytest.raises(RuntimeError):
        with rope_products.products(m, mx.array(0, mx.int32)):
            raise RuntimeError("in the trace")
    assert m.rope is rope and type(m.inner.rope) is nn.RoPE


def test_a_compiled_retrieval_step_turns_by_one_rope_matrix(native):
    """The compiled step's trace turns every layer's query and key by products with one RoPE
    matrix of the step (`rope_products`): its graph computes the angles' cosines twice per step
    (that matrix and the retrieved slot's turns, `Positions.rotations`), not once per layer and
    call, and its logits are the eager step's (within 1e-5; the picks: the tests above)."""
    from tinygpt_mlx.cache import compiled
    from tinygpt_mlx.evaluate.opcount import graph_ops

    cfg = CacheConfig(hot_budget=32, sink=4, page_size=8, top_pages=2, retrieve_tokens=16, index_block=4, index_expand=2)
    prompt = [int(x) for x in np.random.RandomState(0).randint(1, 300, size=400)]
    fast, eager = make_cache(native.model, cfg), make_cache(native.model, cfg)
    eager.compile_decode = False
    real, ran, steady = compiled._retrieval_decode, [], 0
    compiled._retrieval_decode = lambda *a: ran.append(real(*a)) or ran[-1]
    try:
        mx.eval(prefill(native.model, prompt, fast, 256), prefill(native.model, prompt, eager, 256))
        for t in range(10):
            ran.clear()
            # (a step that completes a page evicts eagerly first, turning keys back; so does the
            # first after the prompt, whose chunk left the window one token long)
            ahead = fast.owned[0].cold.completes_page(1) or t == 0
            got = forward(native.model, mx.array([[5 + t]]), fast)
            cos = graph_ops(got).get("Cos", 0)
            want = forward(native.model, mx.array([[5 + t]]), eager)
            mx.eval(got, want)
            steady += ran[0] is not None and not ahead
            if ran[0] is not None and not ahead:
                assert cos == 2, cos
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    finally:
        compiled._retrieval_decode = real
    assert steady >= 6
