"""The compiled decode step over full StreamingLLM rings (cache/compiled.py) against the eager
step it replaces: the same logits at every step and the same cache afterwards, through wraps,
the shifted sink's block advances and refreshes, re-bases, storage precisions and YOCO; and
every case it must leave to the eager path."""

from dataclasses import replace

import mlx.core as mx
import pytest

from dense_reference import reference_path
from tinygpt_mlx.cache import compiled, make_cache
from tinygpt_mlx.cache import sink_block
from tinygpt_mlx.cache.persist import layer_state
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.bench import step_ops
from tinygpt_mlx.loading import load

TOKENS = [(i * 37 + 11) % 300 for i in range(330)]
SINK, WINDOW, PROMPT = 4, 16, 20
# max |logit| difference compiled vs eager on these runs: measured 0.0 (the trace is the eager
# model's own code; MLX fuses the element-wise work without changing its arithmetic here)
TOL = 1e-5


def _drive(model, config, use_compiled: bool, rebase_every=None, tokens=TOKENS, batch=1, every=1):
    """Logits after every token (a prompt chunk, then one token per step; `batch` rows, row b
    shifted by 5b) and the cache; with `use_compiled` every `every`-th decode step goes to
    `compiled.decode` first (the eager call where it declines, and for the others), counting
    how many it ran."""
    cache = make_cache(model, config)
    if rebase_every is not None:
        for c in cache.owned:
            c.positions.rebase_every = rebase_every
    rows = [[(t + 5 * b) % 300 for t in tokens] for b in range(batch)]
    outs = [model(mx.array([r[:PROMPT] for r in rows]), cache=cache)]
    ran = 0
    for j in range(PROMPT, len(tokens)):
        x = mx.array([[r[j]] for r in rows])
        logits = compiled.decode(model, x, cache) if use_compiled and j % every == 0 else None
        if logits is None:
            logits = model(x, cache=cache)
            cache.evict_middle_if_needed()
        else:
            ran += 1
        outs.append(logits)
        mx.eval(outs[-1])
    out = mx.concatenate(outs, axis=1)
    return (out[0] if batch == 1 else out), cache, ran


def _same_cache(a, b):
    for x, y in zip(a.owned, b.owned):
        assert (x.seen, x.start, x.body.ptr, x.body.n, x.body.n_sink, x.positions.base) == \
            (y.seen, y.start, y.body.ptr, y.body.n, y.body.n_sink, y.positions.base)
        (kx, vx), (ky, vy) = x.fetch(), y.fetch()
        assert mx.abs(kx - ky).max().item() <= TOL and mx.abs(vx - vy).max().item() <= TOL


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["shifted", "absolute"])
def test_compiled_step_equals_the_eager_step(native, mode, storage, monkeypatch):
    """310 decode steps over a 4 + 16 ring: 19 wraps, the shifted sink's block advanced 38 times
    and refreshed every 3 blocks (REFRESH_BLOCKS patched down), re-based every 53 tokens (shifted
    mode's frame; the step of a re-base runs eager, the rest compiled)."""
    monkeypatch.setattr(sink_block, "REFRESH_BLOCKS", 3)
    config = CacheConfig(sink=SINK, window=WINDOW, rope_mode=mode, storage=storage)
    fast, cache, ran = _drive(native.model, config, True, rebase_every=53)
    slow, ref, _ = _drive(native.model, config, False, rebase_every=53)
    steps = len(TOKENS) - PROMPT
    # eager: the first step (it makes the prefilled window a ring) and the one of each re-base
    rebases = cache.owned[0].positions.base // 53
    assert rebases == (6 if mode == "shifted" else 0) and ran == steps - 1 - rebases
    assert mx.abs(fast - slow).max().item() <= TOL
    assert mx.argmax(fast, axis=-1).tolist() == mx.argmax(slow, axis=-1).tolist()
    _same_cache(cache, ref)


def test_compiled_steps_between_eager_ones_and_a_batch_of_two(native):
    """Every third step eager (the trace and the eager path hand the ring back and forth), and
    two sequences at once (the buffers' batch axis is a shape of the trace)."""
    config = CacheConfig(sink=SINK, window=WINDOW)
    for kw in ({"every": 3}, {"batch": 2}):
        fast, cache, ran = _drive(native.model, config, True, tokens=TOKENS[:140], **kw)
        slow, ref, _ = _drive(native.model, config, False, tokens=TOKENS[:140], **kw)
        assert ran >= (140 - PROMPT) // 3 - 1
        assert mx.abs(fast - slow).max().item() <= TOL
        _same_cache(cache, ref)


def test_compiled_step_serves_a_yoco_model(tmp_path, tokenizer_json):
    """Layers above the middle attend to the middle layer's K/V: one traced ring serves them all."""
    from conftest import build_native
    yoco = load(build_native(tmp_path / "yoco.tinygpt", tokenizer_json, n_layers=4, yoco=True)).model
    config = CacheConfig(sink=SINK, window=WINDOW)
    fast, cache, ran = _drive(yoco, config, True, tokens=TOKENS[:120])
    slow, ref, _ = _drive(yoco, config, False, tokens=TOKENS[:120])
    assert ran > 80 and cache.layers_with_kv < len(yoco.layers)
    assert mx.abs(fast - slow).max().item() <= TOL
    _same_cache(cache, ref)


@pytest.mark.parametrize("mode", ["shifted", "absolute"])
def test_compiled_step_runs_an_mlx_lm_model(llama, mode):
    """mlx-lm's Llama code, unmodified, traced over the stand-in rings."""
    config = CacheConfig(sink=SINK, window=WINDOW, rope_mode=mode)
    fast, cache, ran = _drive(llama.model, config, True, tokens=TOKENS[:150])
    slow, ref, _ = _drive(llama.model, config, False, tokens=TOKENS[:150])
    assert ran == 150 - PROMPT - 1
    assert mx.abs(fast - slow).max().item() <= TOL
    _same_cache(cache, ref)


def test_a_model_whose_code_cannot_be_traced_runs_eager(tmp_path, tokenizer_json, monkeypatch, caplog):
    """Code that needs the position as a Python number fails in the trace, before the cache is
    touched: that step and every later one run eager, with the eager step's results."""
    import logging

    from mlx_lm.models import llama as llama_code

    from conftest import build_llama_dir
    model = load(build_llama_dir(tmp_path / "llama", tokenizer_json)).model    # its own compiled steps
    plain = llama_code.Attention.__call__

    def reads_an_int(self, x, mask=None, cache=None):
        int(cache.offset)
        return plain(self, x, mask, cache)
    monkeypatch.setattr(llama_code.Attention, "__call__", reads_an_int)
    cache = _full_ring(model)
    ref = _full_ring(model)
    before = len(compiled.trace_failures)
    with caplog.at_level(logging.WARNING, logger="posttrainllm.compiled"):
        assert compiled.decode(model, mx.array([[5]]), cache) is None
    # counted and logged, never silent; expected here, so the autouse check is told (conftest)
    assert len(compiled.trace_failures) == before + 1
    assert any("runs eager from now on" in r.getMessage() for r in caplog.records)
    del compiled.trace_failures[before:]
    _same_cache(cache, ref)
    for t in (5, 9, 13):    # remembered: declined again, and the eager steps are the eager steps
        assert compiled.decode(model, mx.array([[t]]), cache) is None
        assert mx.array_equal(model(mx.array([[t]]), cache=cache), model(mx.array([[t]]), cache=ref))
    _same_cache(cache, ref)


def test_generation_uses_it_and_keeps_its_tokens(native, monkeypatch):
    """`generate.forward` (every front end's decode step) runs it: greedy tokens as eager."""
    from tinygpt_mlx.generate import greedy_tokens
    out, ran = {}, []
    plain = compiled.decode

    def counted(*args):
        logits = plain(*args)
        ran.append(logits is not None)
        return logits
    monkeypatch.setattr(compiled, "decode", counted)
    for flag in (True, False):
        cache = make_cache(native.model, CacheConfig(sink=SINK, window=WINDOW))
        cache.compile_decode = flag
        out[flag] = greedy_tokens(native.model, TOKENS[:30], cache, 120, 16)
    assert out[True] == out[False]
    assert sum(ran[:len(ran) // 2]) >= 110 and not any(ran[len(ran) // 2:])   # compiled, then eager


def _full_ring(model, config=None):
    cache = make_cache(model, config or CacheConfig(sink=SINK, window=WINDOW))
    model(mx.array([TOKENS[:SINK + WINDOW + 4]]), cache=cache)
    cache.evict_middle_if_needed()
    model(mx.array([[1]]), cache=cache)     # a decode step makes it a ring again
    return cache


def test_it_declines_what_it_does_not_cover(native, monkeypatch):
    """None (the caller runs eager) for: a ring not yet full, a chunk, a re-base due, the
    reference path, other policies (full, retrieval with its cold store on disk, KIVI + window),
    `compile_decode` off, the environment. (Retrieval with the cold store in RAM, the default,
    runs compiled: tests/test_retrieval_device.py.)"""
    m, one = native.model, mx.array([[5]])
    assert compiled.decode(m, one, _full_ring(m)) is not None
    young = make_cache(m, CacheConfig(sink=SINK, window=WINDOW))
    m(mx.array([TOKENS[:10]]), cache=young)
    assert compiled.decode(m, one, young) is None
    assert compiled.decode(m, mx.array([[5, 6]]), _full_ring(m)) is None
    due = _full_ring(m)
    for c in due.owned:
        c.positions.rebase_every = c.seen - c.positions.base
    assert compiled.decode(m, one, due) is None
    with reference_path():
        assert compiled.decode(m, one, _full_ring(m)) is None
    for spec in (CacheConfig(), CacheConfig(sink=SINK, hot_budget=WINDOW, cold_store="disk"),
                 CacheConfig(sink=SINK, window=WINDOW, key_bits=4)):
        assert compiled.decode(m, one, _full_ring(m, spec)) is None
    assert compiled.decode(m, one, _full_ring(m, CacheConfig(sink=SINK, hot_budget=WINDOW))) is not None
    off = _full_ring(m)
    off.compile_decode = False
    assert compiled.decode(m, one, off) is None
    monkeypatch.setenv("POSTTRAINLLM_COMPILE", "0")
    assert compiled.decode(m, one, _full_ring(m)) is None


def test_it_runs_fewer_kernels(native):
    """The point of it: the step's element-wise work fused (on a GPU, kernel launches saved)."""
    counts = {}
    for flag in (True, False):
        cache = _full_ring(native.model)
        cache.compile_decode = flag
        counts[flag] = step_ops(native.model, cache)["kernels"]
    print(f"kernels per ring decode step: compiled {counts[True]}, eager {counts[False]}")
    assert counts[True] < 0.75 * counts[False]


def test_forget_drops_the_traced_weights(tmp_path, tokenizer_json):
    """The trace holds the weights it saw; after new weights `forget` makes the next step trace
    them (without it the step would still use the old ones)."""
    from mlx.utils import tree_map

    from conftest import build_native
    model = load(build_native(tmp_path / "w.tinygpt", tokenizer_json)).model
    one = mx.array([[5]])
    assert compiled.decode(model, one, _full_ring(model)) is not None      # traced
    model.update(tree_map(lambda a: a * 1.5, model.parameters()))
    stale, eager = compiled.decode(model, one, _full_ring(model)), model(one, cache=_full_ring(model))
    assert mx.abs(stale - eager).max().item() > 100 * TOL
    compiled.forget(model)
    fresh = compiled.decode(model, one, _full_ring(model))
    assert mx.abs(fresh - eager).max().item() <= TOL


# ----- KIVI under StreamingLLM (frame positions): the quiet steps compiled ----------------------

@pytest.mark.parametrize("spec", ["int4+sink4/window64", "int8+sink4/window64", "int2+sink4/window64+r0",
                                  "k8v4+sink4/window64"])
@pytest.mark.slow
def test_compiled_kivi_window_step_equals_the_eager_step(native32, spec):
    """400 steps of KIVI with a 64-token window (G = 32): blocks frozen and evicted every 32 steps,
    re-based every 150 tokens; the quiet steps between compiled (no freeze, eviction, residual
    growth or re-base: those run eager), the same logits and the same cache."""
    config = CacheConfig.from_spec(spec)
    toks = [(i * 37 + 11) % 300 for i in range(420)]
    fast, cache, ran = _drive(native32.model, config, True, rebase_every=150, tokens=toks)
    slow, ref, _ = _drive(native32.model, config, False, rebase_every=150, tokens=toks)
    assert 250 < ran < 400 - 32        # after the window fills, all but a few steps of every 32
    assert mx.abs(fast - slow).max().item() <= TOL
    assert mx.argmax(fast, axis=-1).tolist() == mx.argmax(slow, axis=-1).tolist()
    for x, y in zip(cache.owned, ref.owned):
        assert (x.seen, x.start, x.body.n_packed, len(x.body.residual), x.positions.base) == \
            (y.seen, y.start, y.body.n_packed, len(y.body.residual), y.positions.base)
        (kx, vx), (ky, vy) = x.fetch(), y.fetch()
        assert mx.abs(kx - ky).max().item() <= TOL and mx.abs(vx - vy).max().item() <= TOL


@pytest.mark.parametrize("spec", ["int4+near32+sink4/window96", "int4+sink4/window320", "int4+near64b6+sink4/window160"])
@pytest.mark.slow
def test_compiled_kivi_window_step_reads_the_near_tier(native32, spec):
    """Under a window whose near tier holds tokens (a fixed tier of 32, int4's own 1/8 in a
    window of 320, a 6-bit tier) the compiled quiet step reads the tier as one more packed
    segment, at its bits: the eager step's logits and cache, the tier held throughout."""
    config = CacheConfig.from_spec(spec)
    toks = [(i * 37 + 11) % 300 for i in range(420)]
    fast, cache, ran = _drive(native32.model, config, True, rebase_every=150, tokens=toks)
    slow, ref, _ = _drive(native32.model, config, False, rebase_every=150, tokens=toks)
    assert cache.owned[0].body.tiers.near.n > 0 and ran > 40, (spec, ran)   # quiet steps once the window is full
    assert mx.abs(fast - slow).max().item() <= TOL
    for x, y in zip(cache.owned, ref.owned):
        assert (x.body.tiers.near.n, x.body.n_packed, len(x.body.residual)) == \
            (y.body.tiers.near.n, y.body.n_packed, len(y.body.residual))


def test_compiled_kivi_window_step_reads_value_groups_of_their_own(tmp_path, tokenizer_json):
    """Values in groups of 64 channels (head dim 64; `PackedRun.of` hands the compiled step the
    value group): the compiled quiet steps give the eager steps' logits and cache."""
    from conftest import build_native
    model = load(build_native(tmp_path / "hd64.tinygpt", tokenizer_json, d_model=256, n_heads=4, n_kv_heads=2,
                              d_ff=256, context_length=512)).model
    config = CacheConfig.from_spec("k3v2+vg64+sink4/window64")
    toks = [(i * 37 + 11) % 300 for i in range(200)]
    fast, cache, ran = _drive(model, config, True, rebase_every=150, tokens=toks)
    slow, ref, _ = _drive(model, config, False, rebase_every=150, tokens=toks)
    assert ran > 50
    assert mx.abs(fast - slow).max().item() <= TOL
    for x, y in zip(cache.owned, ref.owned):
        (kx, vx), (ky, vy) = x.fetch(), y.fetch()
        assert mx.abs(kx - ky).max().item() <= TOL and mx.abs(vx - vy).max().item() <= TOL


def test_compiled_kivi_window_step_waits_for_the_full_window(native32):
    """Before its first block froze (60 tokens under a 64-token window, R = G = 32) a window's
    solo step runs eager, as a full cache's first steps do (a filling window's later quiet steps
    compile since session 46: tests/test_server_kivi_fill.py); and
    KIVI under a window with absolute positions, or with an exact top-k shadow (a window's or a
    full cache's: keys before RoPE), is not covered. (A full KIVI cache's quiet steps are:
    below.)"""
    toks = [(i * 37 + 11) % 300 for i in range(120)]
    _, _, ran = _drive(native32.model, CacheConfig.from_spec("int4+sink4/window64"), True, tokens=toks[:60])
    assert ran == 0
    for spec in ("int4+sink4/window64:absolute", "int4+top8+sink4/window64", "int4+top8"):
        _, _, ran = _drive(native32.model, CacheConfig.from_spec(spec), True, tokens=toks)
        assert ran == 0, spec


def test_compiled_kivi_window_step_replays_a_few_traces(native32, monkeypatch):
    """The quiet step's shapes are the residual's whole buffers and the packed run, not its live
    tokens (masked instead, `_quiet_mask`): over 300 steps of a 64-token window (G = 32: 31 quiet
    steps of as many residual lengths between two freezes) MLX traces it a few times (each
    packed length and buffer size once), not once per residual length (about 2G traces: each
    first-time shape cost a trace of a few ms, docs/kivi.md); the logits still the eager ones."""
    traced = []
    real = compiled._quiet_mask     # called once per trace (the step's Python runs only then)
    monkeypatch.setattr(compiled, "_quiet_mask", lambda *a: traced.append(a[3][0].shape) or real(*a))
    compiled.forget(native32.model)
    config = CacheConfig.from_spec("int4+sink4/window64")
    toks = [(i * 37 + 11) % 300 for i in range(320)]
    fast, _, ran = _drive(native32.model, config, True, tokens=toks)
    slow, _, _ = _drive(native32.model, config, False, tokens=toks)
    assert ran > 200 and 1 <= len(traced) <= 4, (ran, traced)
    assert mx.abs(fast - slow).max().item() <= TOL


@pytest.mark.parametrize("spec", ["int4+sink4/window64", "int4"])
def test_kivi_window_moves_its_residual_at_a_freeze_not_on_a_step_of_its_own(native32, monkeypatch, spec):
    """A KIVI window's residual drops its front at every freeze; its buffers are moved (made anew,
    the live tokens copied in) in that freeze's step, which is eager anyway, where the next G
    tokens would not fit, or where they are a prefill chunk's (larger than the size a move makes):
    no decode step runs eager only to move them (one in every 2G steps did, and the first after a
    prefill read the chunk's whole buffer). So do a full int4 cache's, whose buffers keep room
    for the led sink before the live tokens (one in every G steps was eager to make them). Nothing
    stored moves: the logits are those of the same run with the buffers moved only when full, bit
    for bit, compiled or eager."""
    from tinygpt_mlx.cache.kivi import Residual
    model = native32.model
    toks = [(i * 37 + 11) % 300 for i in range(400)] + [(i * 53 + 7) % 300 for i in range(260)]
    config = CacheConfig.from_spec(spec)

    def run(use_compiled, moved_at_freezes=True):
        cache = make_cache(model, config)
        outs = []
        for chunk in (toks[:200], toks[200:400]):     # a prompt in two chunks, as bench's
            outs.append(model(mx.array([chunk]), cache=cache))
            cache.evict_middle_if_needed()
        moves = []
        for j in range(400, len(toks)):
            layer = cache.owned[0]
            body, res = layer.body, layer.body.residual
            freezes = len(res) + 1 >= max(body.keep, 1) + body.group
            if not freezes and res.head + res.n + 1 > res.keys.shape[2]:
                moves.append(j)       # a step that is not quiet only to move the buffers
            logits = compiled.decode(model, mx.array([[toks[j]]]), cache) if use_compiled else None
            if logits is None:
                logits = model(mx.array([[toks[j]]]), cache=cache)
                cache.evict_middle_if_needed()
            outs.append(logits)
            mx.eval(logits)
            # from the first freeze after the prompt (this step's) on, buffers of the size a move makes
            assert res.keys.shape[2] - res.room <= 3 * body.group or not moved_at_freezes, (j, res.keys.shape)
        return mx.concatenate(outs, axis=1), moves

    fast, moves = run(True)
    slow, _ = run(False)
    assert moves == [], moves
    assert mx.array_equal(fast, slow).item() or mx.abs(fast - slow).max().item() <= TOL
    monkeypatch.setattr(Residual, "fit_ahead", lambda self, ahead: None)    # moved only when full
    late, late_moves = run(False, moved_at_freezes=False)
    assert late_moves and mx.array_equal(late, slow).item()


@pytest.mark.parametrize("spec", ["int4+sink4/window64", "int4"])
def test_kivi_quiet_steps_replay_traces_made_in_the_eager_steps_before_them(native32, monkeypatch, spec):
    """A quiet step of a new shape comes only after an eager step (a block frozen or evicted):
    `generate.forward` has that step trace it (`compiled.prepare`, with the next step's inputs), so
    no quiet step traces (each first-time shape made one slow: two of bench's 32 steps after a
    1K prefill, docs/results.md); the logits those of the eager steps, and of the same run
    without `prepare`. Fails with `prepare` a no-op (the quiet steps trace) or tracing nothing."""
    from tinygpt_mlx.generate import forward
    model = native32.model
    toks = [(i * 37 + 11) % 300 for i in range(400)] + [(i * 53 + 7) % 300 for i in range(200)]
    where = []      # "decode" / "prepare": where each trace happened (the step's Python runs only then)
    real_mask, real_decode, real_prepare = compiled._quiet_mask, compiled.decode, compiled.prepare
    now = ["eager"]

    def during(name, fn):
        def wrapped(*a, **k):
            now[0] = name
            try:
                return fn(*a, **k)
            finally:
                now[0] = "eager"
        return wrapped
    monkeypatch.setattr(compiled, "_quiet_mask", lambda *a: where.append(now[0]) or real_mask(*a))
    monkeypatch.setattr(compiled, "decode", during("decode", real_decode))

    def run(compile_decode, prepared=True):
        compiled.forget(model)
        cache = make_cache(model, CacheConfig.from_spec(spec))
        cache.compile_decode = compile_decode
        outs = [forward(model, mx.array([toks[:200]]), cache), forward(model, mx.array([toks[200:400]]), cache)]
        for t in toks[400:]:
            outs.append(forward(model, mx.array([[t]]), cache))
            mx.eval(outs[-1])
            if len(outs) == 3 and compile_decode and prepared and cache.config.streaming:
                # the prompt's blocks frozen by this first step, what the window does not hold is
                # evicted in it (the next step's plan would have, eagerly): the next is quiet
                layer = cache.owned[0]
                assert len(layer.body) < cache.config.window + layer.body.group and not layer.plan().drop
        return mx.concatenate(outs, axis=1)

    monkeypatch.setattr(compiled, "prepare", during("prepare", real_prepare))
    fast = run(True)
    assert where and set(where) == {"prepare"}, where
    slow = run(False)
    assert mx.abs(fast - slow).max().item() <= TOL
    where.clear()
    monkeypatch.setattr(compiled, "prepare", lambda *a: False)
    unprepared = run(True, prepared=False)
    assert "decode" in where        # (the check above can fail)
    assert mx.array_equal(unprepared, fast).item()


def test_a_kivi_window_holds_the_same_between_steps_compiled_or_not(native32):
    """Under StreamingLLM a KIVI cache evicts what its window no longer holds after an eager step
    (`compiled.prepare`), with its decode steps compiled or not: what it stores between steps (what
    a prompt-cache file or checkpoint saves) does not depend on POSTTRAINLLM_COMPILE. Fails with the
    eviction done only where the steps compile (the eager cache held a window's worth more)."""
    from tinygpt_mlx.generate import forward
    model = native32.model
    toks = [(i * 37 + 11) % 300 for i in range(300)] + [(i * 53 + 7) % 300 for i in range(80)]

    def held(compile_decode):
        compiled.forget(model)
        cache = make_cache(model, CacheConfig.from_spec("int4+sink4/window64"))
        cache.compile_decode = compile_decode
        forward(model, mx.array([toks[:300]]), cache)
        out = []
        for t in toks[300:]:
            mx.eval(forward(model, mx.array([[t]]), cache))
            out.append((cache.current_length, cache.stored_count, cache.nbytes))
        return out
    assert held(True) == held(False)


@pytest.mark.parametrize("spec", ["sink4/window16", "int4+sink4/window64"])
def test_a_compiled_step_leaves_nothing_unevaluated(native32, spec):
    """Everything the step stores is evaluated with its logits: the server steps on a worker
    thread and saves its slots on another (MLX cannot evaluate an array on a thread other than
    the one whose stream built it). The KIVI trace first stored the new token outside the
    logits' graph: the server's --slot-dir test failed with "There is no Stream(cpu, N)"."""
    import threading
    model = native32.model
    cache = make_cache(model, CacheConfig.from_spec(spec))
    ran = []

    def worker():
        model(mx.array([TOKENS[:90]]), cache=cache)
        cache.evict_middle_if_needed()
        for t in TOKENS[90:200]:
            logits = compiled.decode(model, mx.array([[t]]), cache)
            ran.append(logits is not None)
            if logits is None:
                logits = model(mx.array([[t]]), cache=cache)
            cache.evict_middle_if_needed()
            mx.eval(logits)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert sum(ran) > 60
    for layer in cache.owned:
        arrays, _ = layer_state(layer)
        mx.eval(list(arrays.values()))      # here, on another thread: raises if anything is pending



# ----- a full KIVI cache (no window): its quiet steps compiled -----------------------------------

@pytest.mark.parametrize("spec,sink", [("int4", 4), ("int4", 0), ("int2", 4), ("k8v4", 4), ("int4+near32", 4)])
def test_compiled_kivi_full_step_equals_the_eager_step(native32, spec, sink):
    """A full KIVI cache (G = 32) over 400 steps: a block frozen every 32 (int4's near tier
    taking its 1/8 and handing blocks on to the body; a fixed tier of 32), the quiet steps
    between compiled, its exact first tokens read from their copy in the residual's buffers
    (`KiviStore.segments_led`; none with `kivi_sink` 0): the eager steps' logits and cache."""
    config = replace(CacheConfig.from_spec(spec), kivi_sink=sink)
    toks = [(i * 37 + 11) % 300 for i in range(420)]
    fast, cache, ran = _drive(native32.model, config, True, tokens=toks)
    slow, ref, _ = _drive(native32.model, config, False, tokens=toks)
    assert 250 < ran < 400 - 10, ran      # all but the freezes' and the residual's new buffers' steps
    assert mx.abs(fast - slow).max().item() <= TOL
    assert mx.argmax(fast, axis=-1).tolist() == mx.argmax(slow, axis=-1).tolist()
    near = cache.owned[0].body.tiers.near
    assert near is None or near.n > 0
    for x, y in zip(cache.owned, ref.owned):
        assert (x.seen, x.body.n_packed, x.body.held, len(x.body.residual), len(x.sink_store)) == \
            (y.seen, y.body.n_packed, y.body.held, len(y.body.residual), len(y.sink_store))
        (kx, vx), (ky, vy) = x.fetch(), y.fetch()
        assert mx.abs(kx - ky).max().item() <= TOL and mx.abs(vx - vy).max().item() <= TOL


def test_compiled_kivi_full_step_keeps_one_function(native32, monkeypatch):
    """A full cache's packed run only grows, so each trace serves the quiet steps of one block
    and is dropped when the next freezes: about one trace per block frozen (and per new residual
    buffer), and the model holds one compiled KIVI function at the end, not one per block."""
    traced = []
    real = compiled._quiet_mask     # called once per trace (the step's Python runs only then)
    monkeypatch.setattr(compiled, "_quiet_mask", lambda *a: traced.append(a[1][1][0].shape) or real(*a))
    model = native32.model
    compiled.forget(model)
    toks = [(i * 37 + 11) % 300 for i in range(340)]
    fast, cache, ran = _drive(model, CacheConfig.from_spec("int4"), True, tokens=toks)
    slow, _, _ = _drive(model, CacheConfig.from_spec("int4"), False, tokens=toks)
    blocks = cache.owned[0].body.held // 32
    assert ran > 250 and blocks // 2 <= len(traced) <= 2 * blocks, (ran, blocks, traced)
    assert len([k for k in compiled._steps_of(model) if k[0] == "kivi"]) == 1
    assert mx.abs(fast - slow).max().item() <= TOL


def test_compiled_kivi_full_step_runs_fewer_kernels_than_quantized_kv_cache(native32):
    """What compiling int4's quiet steps is for (issue #54): the eager step launches more kernels
    than mlx-lm's QuantizedKVCache(4) (casts of the float16 scales, three segments, the
    rotation); the compiled one fewer (the model's element-wise work fused, as the ring's)."""
    from tinygpt_mlx.evaluate.bench import make_policy

    model = native32.model
    counts = {}
    for flag in (True, False):
        cache = make_cache(model, CacheConfig.from_spec("int4"))
        cache.compile_decode = flag
        mx.eval(model(mx.array([TOKENS[:100]]), cache=cache))
        for t in TOKENS[100:104]:      # past the first decode step's freeze of the prompt's blocks
            mx.eval(model(mx.array([[t]]), cache=cache))
        counts[flag] = step_ops(model, cache)["kernels"]
    peer = make_policy("mlx-q4", model).make()
    mx.eval(model(mx.array([TOKENS[:100]]), cache=peer))
    counts["peer"] = step_ops(model, peer)["kernels"]
    print(f"kernels per int4 decode step: compiled {counts[True]}, eager {counts[False]}, "
          f"QuantizedKVCache {counts['peer']}")
    assert counts[True] < counts["peer"] < counts[False]


def test_compiled_kivi_mask_compiles_no_kernel_per_frozen_length(tmp_path):
    """The quiet step's mask takes every number that moves between traces as an array: a Python
    number in it (the frozen tokens' count, before) is a constant of MLX's fused kernel, whose
    CPU build then compiled a new kernel library (g++, about a second) for every count, in a
    full cache at every block frozen, a step of a second or two every G steps. Traced at three
    frozen lengths no one has used (random), the mask's fused kernel is built at most once."""
    import os
    import random
    import tempfile

    jit = os.path.join(tempfile.gettempdir(), "mlx", mx.__version__, "cpu")

    def libs() -> set:
        return {f for f in os.listdir(jit) if f.endswith(".so") and "BitwiseAnd" in f} if os.path.isdir(jit) else set()
    buffers = (mx.zeros((1, 2, 64, 32)),)
    fn = mx.compile(lambda packed, first, last, cut: compiled._quiet_mask(4, packed, (), buffers, first, last, cut))
    lengths = random.Random().sample(range(40, 4000), 3)
    seen = []
    for n in lengths:
        packed = ((), (mx.zeros((1, 2, n, 4), mx.uint32),))       # `_tokens` reads the values' rows
        mask = fn(packed, mx.array(3, mx.int32), mx.array(20, mx.int32), mx.array(n // 2, mx.int32))
        mx.eval(mask)
        assert mask.shape == (1, 4 + n + 64) and mask.sum().item() == 4 + (n - n // 2) + 18
        seen.append(libs())
    assert seen[2] == seen[0], (lengths, sorted(seen[2] - seen[0]))
