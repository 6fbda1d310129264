"""A spilled cold store's decode step staged ahead (cache/spill_stage.py) against the per-layer
path it replaces (`DeviceRows.gather` reading the picked indices back in every layer, kept:
`stage_spills` off) and the store in RAM: the same logits bit for bit over decode steps that hit,
steps forced to miss, a query that jumps, a rewind into the spilled part, fp32 / bf16 / packed
rows and every position rule; one wait per staged step, and the spilled rows read before the
step (one bulk read per rows array, one upload), none inside the layer loop."""

import contextlib
import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from prerope import make_cache
from test_retrieval_device import SPILL_CASES, _spilling, counting_syncs
from tinygpt_mlx.cache import spill_stage
from tinygpt_mlx.cache.device_pages import DeviceRows
from tinygpt_mlx.cache.kv_cache import KVCache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import forward, prefill

BASE = dict(hot_budget=32, page_size=8, top_pages=4, retrieve_tokens=16, index_block=4, index_expand=2)


def _cache(model, cfg, staged: bool, ring: bool = False):
    cache = _spilling(model, dataclasses.replace(cfg, cold_ram=1)) if not ring else make_cache(
        model, dataclasses.replace(cfg, cold_ram=1), ring=True)
    for layer in cache.distinct():
        layer.cold.ram_layers = 10 ** 6
    cache.stage_spills = staged
    return cache


def _steps(model, cache, tokens, steps, jump_at=(), chunk=64):
    """Prefill `tokens`, then greedy decode steps (a step in `jump_at` feeds token 299 instead:
    a query that jumps); every step's logits, evaluated."""
    logits = prefill(model, tokens, cache, chunk)
    out = []
    for t in range(steps):
        nxt = 299 if t in jump_at else int(mx.argmax(logits).item())
        logits = forward(model, mx.array([[nxt]]), cache)[0, -1]
        mx.eval(logits)
        out.append(np.asarray(logits))
    return out


def _tokens(seed, n=900):
    return [int(x) for x in np.random.RandomState(seed).randint(1, 300, size=n)]


@pytest.mark.parametrize("case", list(SPILL_CASES))
def test_staged_steps_give_the_per_layer_paths_logits(native, case):
    """Every decode step staged ahead gives the per-layer path's logits exactly (the same rows
    gathered, the same graph after them) and the store in RAM's within float noise; steps hit
    and miss (the tiny random model's queries move a lot; a query that jumps), and the counters say so."""
    cfg = CacheConfig(**BASE, **SPILL_CASES[case])
    tokens = _tokens(3)
    want = _steps(native.model, _cache(native.model, cfg, staged=False), tokens, 24, jump_at=(8, 16))
    cache = _cache(native.model, cfg, staged=True)
    got = _steps(native.model, cache, tokens, 24, jump_at=(8, 16))
    ram = make_cache(native.model, cfg)
    ram.compile_decode = False
    ram = _steps(native.model, ram, tokens, 24, jump_at=(8, 16))
    for a, b, c in zip(want, got, ram):
        np.testing.assert_array_equal(b, a)
        np.testing.assert_allclose(b, c, atol=1e-4)     # (its selection is compiled: sums part in the last bits)
    stats = cache.spill_stats
    assert cache[0].cold.spilled and stats["recorded"] >= 1 and stats["hits"] >= 1 and stats["misses"] >= 1, stats
    assert stats["staged"] == stats["hits"] + stats["misses"] and stats["staged"] + stats["recorded"] - stats["misses"] == 24


def test_packed_rows_staged(native32):
    """Packed cold rows (codes, scale and zero: each spilled, staged and gathered) as above."""
    cfg = CacheConfig(**{**BASE, "hot_budget": 64}, cold_bits=8)
    tokens = _tokens(4, 700)
    want = _steps(native32.model, _cache(native32.model, cfg, staged=False), tokens, 16, jump_at=(5,))
    cache = _cache(native32.model, cfg, staged=True)
    got = _steps(native32.model, cache, tokens, 16, jump_at=(5,))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
    assert cache.spill_stats["hits"] >= 4, cache.spill_stats


def test_frame_positions_staged(native):
    """The product's caches (frame positions: a re-base every so many steps is not staged, the
    per-layer path runs it) give the per-layer path's logits."""
    cfg = CacheConfig(**BASE, sink=4)
    tokens = _tokens(7)
    want = _steps(native.model, _cache(native.model, cfg, staged=False, ring=True), tokens, 40)
    cache = _cache(native.model, cfg, staged=True, ring=True)
    got = _steps(native.model, cache, tokens, 40)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
    assert cache.spill_stats["hits"] >= 5, cache.spill_stats


def test_a_forced_miss_is_computed_again(native):
    """A step whose guess leaves out the pages its pools pick (the guess cut to page 0 before
    every step) misses in some layer, is taken back (the hot window, the cold rows, the
    sticky pages, the counters) and computed again: the per-layer path's logits, step after step."""
    cfg = CacheConfig(**BASE)
    tokens = _tokens(5)
    want = _steps(native.model, _cache(native.model, cfg, staged=False), tokens, 12)
    cache = _cache(native.model, cfg, staged=True)
    logits = prefill(native.model, tokens, cache, 64)
    got = []
    for _ in range(12):
        for layer in cache.owned:
            if layer.cold.guess is not None:
                layer.cold.guess = np.zeros_like(layer.cold.guess)
        logits = forward(native.model, mx.array([[int(mx.argmax(logits).item())]]), cache)[0, -1]
        mx.eval(logits)
        got.append(np.asarray(logits))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
    assert cache.spill_stats["misses"] == 11 and cache.spill_stats["hits"] == 0, cache.spill_stats
    assert len(cache[0].cold) == len(_cache_after(native.model, cfg, tokens, 12)[0].cold)


def _cache_after(model, cfg, tokens, steps):
    cache = _cache(model, cfg, staged=False)
    _steps(model, cache, tokens, steps)
    return cache


def test_a_rewind_into_the_spilled_part(native):
    """A checkpoint taken before most rows spilled, restored (the files cut back), then staged
    decode steps: the per-layer path's logits after the same rewind."""
    cfg = CacheConfig(**BASE)
    tokens = _tokens(6)
    outs = []
    for staged in (False, True):
        cache = _cache(native.model, cfg, staged=staged)
        _steps(native.model, cache, tokens[:300], 4)
        mark = cache.checkpoint()
        _steps(native.model, cache, tokens[300:], 6)
        spilled = cache[0].cold.spilled
        cache.restore(mark)
        assert cache[0].cold.spilled < spilled
        outs.append((_steps(native.model, cache, tokens[500:700], 16), cache.spill_stats))
    (want, _), (got, stats) = outs
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
    assert stats["hits"] >= 8, stats


@contextlib.contextmanager
def _disk_reads():
    """Counts `DeviceRows.read_disk` calls (the memory-mapped files' reads), inside `stage`
    (before the step) and elsewhere (inside the layer loop), and the bulk uploads (`stage` calls)."""
    count = {"staging": 0, "loop": 0, "stages": 0}
    read, stage = DeviceRows.read_disk, spill_stage.stage
    inside = [False]

    def spy_read(self, *a, **kw):
        count["staging" if inside[0] else "loop"] += 1
        return read(self, *a, **kw)

    def spy_stage(stores):
        inside[0] = True
        count["stages"] += 1
        try:
            return stage(stores)
        finally:
            inside[0] = False

    DeviceRows.read_disk, spill_stage.stage = spy_read, spy_stage
    try:
        yield count
    finally:
        DeviceRows.read_disk, spill_stage.stage = read, stage


@pytest.mark.parametrize("case", ["fp32", "tokens"])
def test_one_wait_and_one_bulk_read_per_staged_step(native, case):
    """A staged step that hits reads back once (its checks and pools, after the step's graph is
    built) and reads the files only while staging, one read per spilled rows array; the
    per-layer path reads back in every layer and reads the files there."""
    cfg = CacheConfig(**BASE, **SPILL_CASES[case])
    tokens = _tokens(3)
    per_step = {}
    for staged in (True, False):
        cache = _cache(native.model, cfg, staged=staged)
        logits = prefill(native.model, tokens, cache, 64)
        waits, reads = [], []
        for t in range(20):
            token = mx.array([[int(mx.argmax(logits).item())]])
            hits = cache.spill_stats["hits"]
            with counting_syncs() as count, _disk_reads() as disk:
                logits = forward(native.model, token, cache)[0, -1]
            mx.eval(logits)
            if not staged or cache.spill_stats["hits"] > hits:
                waits.append(count["n"])
                reads.append(dict(disk))
        per_step[staged] = (waits, reads)
    layers = len(cache.owned)
    spilled_arrays = sum(2 for layer in cache.owned if layer.cold.spilled)
    waits, reads = per_step[True]
    assert len(waits) >= 3 and set(waits) == {1}, waits
    assert all(r == {"staging": spilled_arrays, "loop": 0, "stages": 1} for r in reads), reads
    waits, reads = per_step[False]
    assert min(waits) >= 2 * layers, waits
    assert all(r["loop"] >= layers and r["staging"] == 0 for r in reads), reads


def test_off_where_a_step_cannot_be_taken_back(native):
    """Telemetry recording (or no spilled rows yet, or no budget) runs the per-layer path."""
    cfg = CacheConfig(**BASE)
    tokens = _tokens(3)
    cache = _cache(native.model, cfg, staged=True)
    cache.record_retrievals(True)
    _steps(native.model, cache, tokens, 6)
    assert cache.spill_stats == spill_stage.new_stats()
    small = _cache(native.model, cfg, staged=True)
    _steps(native.model, small, tokens[:40], 4)
    assert not small[0].cold.spilled and small.spill_stats == spill_stage.new_stats()


def test_the_switch_is_read_once_a_model_call(native):
    """`stage_spills` is read once per model call of a non-compiled cache (`compiled.decode`, which
    calls spill_stage.decode only when it is on), staged steps hitting and missing among them;
    twice before session 43 (`spill_stage.stores_of` read it again)."""
    class Counted(KVCache):
        reads = 0

        @property
        def stage_spills(self):
            Counted.reads += 1
            return self.__dict__["stage_spills"]

        @stage_spills.setter
        def stage_spills(self, on):
            self.__dict__["stage_spills"] = on

    cfg = CacheConfig(**BASE, **SPILL_CASES[next(iter(SPILL_CASES))])
    cache = _cache(native.model, cfg, staged=True)
    cache.__class__ = Counted
    tokens = _tokens(3, 300)
    _steps(native.model, cache, tokens, 12, jump_at=(6,))
    calls = -(-len(tokens) // 64) + 12
    assert cache.spill_stats["staged"] >= 1, cache.spill_stats
    assert Counted.reads == calls, (Counted.reads, calls)


def test_off_by_default(native, monkeypatch):
    """A new cache runs the per-layer path unless POSTTRAINLLM_STAGE_SPILLS=1 (the guess misses:
    spill_stage.py); with it, staged steps run."""
    cfg = dataclasses.replace(CacheConfig(**BASE), cold_ram=1)
    assert make_cache(native.model, cfg).stage_spills is False
    monkeypatch.setenv("POSTTRAINLLM_STAGE_SPILLS", "1")
    cache = _spilling(native.model, cfg)
    assert cache.stage_spills is True
    _steps(native.model, cache, _tokens(3), 6)
    assert cache.spill_stats["staged"] >= 1, cache.spill_stats


# ----- benchmarks/spill_guess.py: the guess replayed offline ---------------------------------

def test_the_guess_replay_counts_what_a_staged_run_hits(native):
    """The probe's replay of the last step's pool (history 1) hits in exactly the steps a staged
    run hits (the pools are exact in both: a miss's redo is the per-layer path), on the same
    prompt; and the replay's counts on a hand-made sequence."""
    from benchmarks.spill_guess import pools, replay

    cfg = CacheConfig(**BASE)
    tokens = _tokens(3)
    steps, spilled = pools(native.model, _cache(native.model, cfg, staged=False), tokens, 12)
    cache = _cache(native.model, cfg, staged=True)
    _steps(native.model, cache, tokens, 12, chunk=512)
    got = replay(steps, 1)
    assert got["steps"] == 11 == cache.spill_stats["staged"]
    assert round(got["step_hit_rate"] * 11) == cache.spill_stats["hits"], (got, cache.spill_stats)
    assert spilled[-1][0] == cache[0].cold.spilled // cfg.page_size
    a = np.array([[3, 5, -1]])
    b = np.array([[3, -1, -1]])
    c = np.array([[7, 3, -1]])
    seq = [[a], [b], [c], [a]]      # one layer, one KV head
    one, two = replay(seq, 1), replay(seq, 2)
    assert (one["step_hit_rate"], one["head_pools_covered"]) == (1 / 3, 1 / 3)   # b within a; c, a miss
    assert (two["step_hit_rate"], two["pages_staged_per_step"]) == (0.0, 3.0)    # c misses 7, a 5: {0,3,5}, {0,3,7}
    assert replay(seq, 3)["step_hit_rate"] == 1.0                               # a within a, b, c


@pytest.mark.parametrize("args, says", [
    (["--steps", "1"], "--steps must be at least 2, got 1"),
    (["--context", "0"], "--context must be a positive integer, got 0"),
    (["--policy", "sink4/hot1024"], "--policy 'sink4/hot1024': no RAM budget (spillN), nothing would spill"),
    (["--text", "/no/such.txt"], "--text /no/such.txt: no such file"),
])
def test_spill_guess_refuses_bad_arguments(args, says, capfd, monkeypatch):
    """`python -m benchmarks.spill_guess` run in pytest's process (test_scripts' `run_as_main`: a
    subprocess spent seconds importing before a refusal of milliseconds; any exception but the
    exit fails the test, as the process's traceback would)."""
    from test_scripts import run_as_main

    returncode, _, stderr = run_as_main("spill_guess", ["models/tinygpt-base.tinygpt", *args], capfd, monkeypatch)
    assert returncode == 2 and stderr.strip().splitlines()[-1].endswith(says), stderr
