"""`bench --grow-from`: caches filled to a context by copies of their own rows
(`retrieval_bench.grow`) build the decode step of a cache prefilled over as many tokens, and
`bench --abba`'s order of the parts' rounds."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from conftest import recorded_bench_caches
from typer.testing import CliRunner

from tinygpt_mlx.evaluate import bench
from tinygpt_mlx.evaluate import retrieval_bench as rb
from tinygpt_mlx.evaluate.opcount import graph_ops
from tinygpt_mlx.generate import forward, prefill

#: N tokens prefilled for real, against P prefilled and the rest filled by `grow`: P past the
#: hot window's first move in its buffers (256 tokens, `DenseStore.step`), N where the
#: two-level index is engaged at `pages2` (more than 2 x 4 x 2 x 8 pages of 8 tokens)
N, P = 1300, 300
SPECS = ["fp32", "bf16", "sink2/hot16+pages2", "sink2/hot16+pages2+colddisk"]


def _arrays(obj, path: str, out: list, seen: set, depth: int = 0) -> None:
    """(path, shape, dtype) of every MLX array a cache layer holds, through its stores' attributes,
    lists and dicts (the config, codec and stage timers left out)."""
    if depth > 7 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        out.append((path, tuple(obj.shape), obj.dtype))
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _arrays(x, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            _arrays(x, f"{path}.{k}", out, seen, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("tinygpt_mlx.cache"):
        for k, x in vars(obj).items():
            if k not in ("config", "codec", "stages"):
                _arrays(x, f"{path}.{k}", out, seen, depth + 1)


def _layout(cache) -> tuple:
    """What a decode step's graph is built from: the tokens held in each part of every layer
    (seen, the window's start, stored, cold, pages, index blocks) and the shapes and dtypes of
    every array the layers hold; of a sliding-window layer's ring (Gemma 3) also its frame's base
    and write pointer. Left out: the values (a global layer's frame base, the body's head:
    numbers the step reads as an input array)."""
    counts, shapes = [cache.current_length], []
    for i, lc in enumerate(cache.owned):
        counts.append((lc.seen, lc.start, lc.stored_count, len(lc.body)))
        if lc.sliding is not None:
            counts.append((lc.sliding, lc.positions.base, lc.body.ptr, lc.body.ring))
        if lc.config.retrieval:
            counts.append((len(lc.cold), lc.cold.n_pages, lc.cold.index.n_blocks))
        _arrays(lc, f"layer{i}", shapes, set())
    return counts, shapes


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer_json):
    """test_sliding.py's tiny mlx-lm gemma3_text (sliding window 16, every third layer global)."""
    from test_sliding import build_gemma3_dir
    from tinygpt_mlx.loading import load
    return load(build_gemma3_dir(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", tokenizer_json))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("which", ["wide", "llama", "gemma"])
def test_a_filled_cache_builds_the_decode_step_of_a_prefilled_one(which, spec, request):
    """A cache prefilled over P tokens and filled to N by `retrieval_bench.grow` (a full cache's
    rows tiled, a retrieval cache's cold pages copied, a sliding-window ring fed its own rows)
    holds what one prefilled over N tokens holds, in counts and in array shapes, and its decode
    steps build the same graph (the nodes by primitive, every step of 12, a page completing and
    its eager eviction among them), on a native model, an mlx-lm Llama (SmolLM2's code) and an
    mlx-lm Gemma 3 (sliding-window rings beside the global layers: their seen tokens, and so
    their queries' positions, are the prefilled ring's). The values differ (copies, not the
    model's keys over those tokens): the build does not read them. The first decode step after a
    prefill reads the sticky pages of the prefill's last chunk, whose width follows how many
    queries that chunk had (N and P differ there), so both caches take one first."""
    model = request.getfixturevalue(which).model
    tokens = mx.random.randint(0, 250, (N,), key=mx.random.key(3)).tolist()
    real, grown = (bench.make_policy(spec, model).make() for _ in range(2))
    try:
        mx.eval(prefill(model, tokens, real, 64))
        mx.eval(prefill(model, tokens[:P], grown, 64))
        rb.grow(grown, N)
        assert real.current_length == grown.current_length == N
        for cache in (real, grown):
            mx.eval(forward(model, mx.array([[5]]), cache))
        assert _layout(grown) == _layout(real)
        for step in range(12):
            out = [forward(model, mx.array([[7 + step]]), c) for c in (real, grown)]
            graphs = [graph_ops(o) for o in out]
            mx.eval(out)
            assert graphs[0] == graphs[1], step
            assert out[0].shape == out[1].shape
        assert _layout(grown) == _layout(real)
    finally:
        real.close()
        grown.close()


def test_bench_grow_from_fills_each_context_and_builds_its_graph(wide):
    """`bench(grow_from=P)`: rows at each context, prefill over P tokens, `grown_from` said; the
    filled caches' decode steps count the nodes a really prefilled run's do (`decode_ops`) and
    hold its bytes."""
    kw = dict(decode_steps=2, prefill_chunk=64, parts_own=True)
    grown = bench.bench(wide.model, ["sink2/hot16+pages2"], [600, 1300], grow_from=P, **kw)
    real = bench.bench(wide.model, ["sink2/hot16+pages2"], [600, 1300], **kw)
    assert grown["grown_from"] == P and "grown_from" not in real
    assert [(r["policy"], r["context"], r["grown_from"]) for r in grown["rows"]] == [
        ("fp32", 600, P), ("sink2/hot16+pages2", 600, P), ("fp32", 1300, P), ("sink2/hot16+pages2", 1300, P)]
    for g, r in zip(grown["rows"], real["rows"]):
        assert (g["policy"], g["context"]) == (r["policy"], r["context"])
        assert g["decode_ops_by_primitive"] == r["decode_ops_by_primitive"], g["policy"]
        assert g["cache_bytes"] == r["cache_bytes"], g["policy"]
        assert "decode_step_us" in g


def test_step_parts_abba_alternates_the_order_and_its_reverse(wide, monkeypatch):
    """`step_parts(abba=True)` (`bench --abba`): even rounds step the caches in their given order,
    odd rounds in its reverse (with `after_own` each cache's untimed step right before its timed
    one); `bench` says so in `parts_rounds`."""
    real = bench.forward
    calls, caches = recorded_bench_caches(wide, monkeypatch)
    ids = [id(c) for c in caches]
    bench.step_parts(wide.model, caches, steps=4, warmup=2, abba=True)
    assert calls == (ids + ids[::-1]) * 3
    calls.clear()
    bench.step_parts(wide.model, caches, steps=2, warmup=0, abba=True, after_own=True)
    assert calls == [i for i in ids for _ in range(2)] + [i for i in ids[::-1] for _ in range(2)]
    monkeypatch.setattr(bench, "forward", real)
    r = bench.bench(wide.model, ["int8"], [24], decode_steps=2, prefill_chunk=16, abba=True)
    assert r["parts"] and r["parts_rounds"] == "abba" and all("decode_step_us" in x for x in r["rows"])
    assert bench.bench(wide.model, ["int8"], [24], decode_steps=2, prefill_chunk=16, parts=True)["parts_rounds"] == "shuffled"


def _run(*args):
    from tinygpt_mlx.cli.main import app
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_bench_grow_from_and_abba(wide_path, tmp_path):
    out = tmp_path / "b.json"
    r = _run("bench", wide_path, "--contexts", "400", "--policies", "sink2/hot16", "--decode-steps", 2,
             "--grow-from", 100, "--parts-own", "--abba", "--json", out)
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "of 100 tokens, each cache then filled to the context" in flat and "rounds in ABBA order" in flat
    d = json.loads(out.read_text())
    assert d["grown_from"] == 100 and d["parts_rounds"] == "abba" and d["parts_order"] == "own"
    assert [(x["context"], x["grown_from"]) for x in d["rows"]] == [(400, 100), (400, 100)]


@pytest.mark.parametrize("args, says", [
    (["--grow-from", "0"], "--grow-from 0: give a positive number"),
    (["--grow-from", "400"], "--grow-from 400: every --contexts value must be more than it (got 400)"),
    (["--grow-from", "100", "--policies", "mlx"], "--grow-from: policy 'mlx' is one of mlx-lm's caches"),
    (["--grow-from", "100", "--policies", "int4"], "--grow-from: policy 'int4' evicts or quantises"),
    (["--grow-from", "100", "--policies", "sink4/window64"], "policy 'sink4/window64' evicts or quantises"),
    (["--grow-from", "100", "--policies", "sink4/hot96"], "--grow-from 100: policy 'sink4/hot96' keeps 100 tokens hot"),
    (["--grow-from", "100", "--policies", "sink2/hot16+spill8"], "policy 'sink2/hot16+spill8' spills its cold rows"),
    (["--grow-from", "100", "--reference", "mlx", "--policies", "fp32"], "policy 'mlx' is one of mlx-lm's caches"),
])
def test_cli_bench_grow_from_refuses_what_it_cannot_fill(wide_path, tmp_path, args, says):
    """A bad --grow-from, or a policy it cannot fill: one line naming what was given, exit 2 (a
    usage error since session 44; it was 1), before the model loads (nothing on stdout, no JSON
    written)."""
    out = tmp_path / "b.json"
    r = _run("bench", wide_path, "--contexts", "400", "--decode-steps", 2,
             *(["--policies", "fp32"] if "--policies" not in args else []), *args, "--json", out)
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr
    assert says in r.stderr, r.stderr
    assert not r.stdout.strip() and not out.exists()
