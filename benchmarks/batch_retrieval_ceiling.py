"""The ceiling of a batch-owned retrieval step (issue #56, session 44): today's four-row retrieval
step against the same selection and attention run on inputs already held as [B, ...] arrays.

Today's batched step (server/batch.py `_compiled_retrieval`) keeps each row's own buffers: per
layer it joins the rows' live windows, gathered cold rows and summaries, and gathers per row.
A batch that owned one buffer per layer for all its rows (mlx-lm's `BatchKVCache` design) would
hold the hot windows as [B, H, cap, D] in one layout (every row writing its token at one slot),
the cold stores as [B H, cap, D], the summaries as [B H, pages, D]: one slice update, one
scatter of the leaving keys, one coarse pass, one top-k and one gather with batch indices per
layer. `IdealLayer` is that step's layer, built from the same code (`device_select._select` with
per-row counts, `cold_device.place`, `segments.attend`); `ideal_inputs` stacks the rows' arrays
of a captured step of today's (the live windows moved to one layout) once, outside the timed loop.

Four shipped-model caches (retrieval sink4/hot128, bench_server_parallel's prompts) are warmed
--warm batched steps (batch_rows' `setup`); four more are stepped alone. Each block first
captures one of today's four-row steps and one of today's one-row steps (their compiled calls'
arguments, untimed), checks the ideal step's logits against today's (the same state), then
times, in an order reversed every other block (A B ... B A): `lone` (each of the other four
caches one token alone, the worker's one-row path, as batch_rows), `today4` (today's four-row
step, `batch.decode_step`, as the worker runs it, the caches advancing), `call4`/`call1`
(today's compiled call alone, replayed at the captured state with its written buffers fed back:
no host work), `ideal4`/`ideal1` (the batch-owned step's compiled call at the captured state,
fed back the same way), `hot4`/`hot1` (the ideal step without the cold store: the sink and the
hot window attended alone, the floor any retrieval step of this model stands on). Per case the
median over blocks of process CPU and wall ms per step. From them: x = 4 lone / step for each
four-row form; today's host work per four-row step (today4 - call4), and the ideal with that
host work added; W and X of each form from its one- and four-row calls (X = (c4 - c1) / 3,
W = c1 - X) and 4(W+X)/(W+4X) (session 42's model of the step: the lone step as the form's
one-row step). --answer N instead: whole answers of N tokens from the prompts, batched and lone,
their steady and filling steps timed apart, and the steps that traced a retrieval step counted and
timed apart (`answer`). docs/server.md, "Retrieval's four-row step
with batch-owned buffers: its ceiling measured before building" (session 44).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m benchmarks.batch_retrieval_ceiling --warm 180 --blocks 24 --steps 16 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.batch_rows import setup
from benchmarks.bench_server_parallel import policies
from tinygpt_mlx import blas
from tinygpt_mlx.cache import rope_products
from tinygpt_mlx.cache.cold_device import place
from tinygpt_mlx.cache.compiled_retrieval import (AT_COUNTS, AT_FIRST, AT_LIVE, AT_ROW, AT_SRC, AT_TURN, AT_WRITE,
                                                  layer_specs)
from tinygpt_mlx.cache.device_select import _select
from tinygpt_mlx.cache.segments import DenseSegment, PickedSegment, attend
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.generate import call
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch


class IdealLayer:
    """One retrieval layer of B rows whose buffers the batch owns: hot windows [B, H, cap, D] in one
    layout (`at0`: the shared write, leaving and live slots), cold keys and values [B H, cap, D],
    summaries [B H, width, D], sticky pages [B H, S]; `at` [B, 10] each row's step numbers
    (compiled_retrieval's AT_*), `turns` [B, 2, D, D] each row's RoPE matrices. The same work as
    `_TracedRetrieval` + `attend_rows`, one op per step for all rows."""

    reads_own_segments = True

    def __init__(self, spec, at, at0, inputs, turns, offset, hot_only=False):
        self.spec, self.at, self.at0, self.turns, self.offset = spec, at, at0, turns, offset
        self.hot_only = hot_only    # (the floor: no cold store written or searched, sink and hot window only)
        self.body, self.sink = inputs["body"], inputs["sink"]
        self.keys, self.values = inputs["keys"], inputs["values"]
        self.summaries, self.recent = inputs["summaries"], inputs["recent"]
        self.leaving = None
        self.picked = None

    def make_mask(self, N, return_array=False, window_size=None):
        if window_size is not None:
            raise ValueError("a windowed mask is not traced")
        return None

    def update_and_fetch(self, keys, values):
        kb, vb = self.body
        B, H = kb.shape[:2]
        at0, dt = self.at0, kb.dtype
        self.body = tuple(mx.slice_update(b, x.astype(dt), at0[AT_WRITE:AT_WRITE + 1], axes=(2,))
                          for b, x in ((kb, keys), (vb, values)))
        if self.spec.evicts:
            self.leaving = tuple(mx.slice(b, at0[AT_SRC:AT_SRC + 1], (2,), (B, H, 1, b.shape[3])) for b in self.body)
        return keys, values

    def attend(self, queries, scale, mask):
        sp, at = self.spec, self.at
        kb = self.body[0]
        B, H = kb.shape[:2]
        Hq, D = queries.shape[1], queries.shape[3]
        frame = sp.positions.frame
        q = queries.astype(mx.float32)
        q_rows = ((q.reshape(B, -1, D) @ self.turns[:, 1]) if frame else q).reshape(B * H, Hq // H, D)
        ck, cv = self.keys, self.values
        if self.hot_only:
            segments = ([DenseSegment(*self.sink)] if self.sink else [])
            live = [mx.slice(b, self.at0[AT_LIVE:AT_LIVE + 1], (2,), (B, H, sp.live, b.shape[3])) for b in self.body]
            segments.append(DenseSegment(*live))
            return attend(segments, 0, queries, scale, mask, q_rows if frame else None,
                          len(segments) - 1 if frame else 0)
        if self.leaving is not None:     # each row's leaving token, turned back, scattered at its cold row
            k = self.leaving[0].astype(mx.float32).reshape(B, H, D)
            k = (k @ self.turns[:, 0]) if frame else k
            v = self.leaving[1].astype(mx.float32).reshape(B * H, 1, -1)
            row = mx.broadcast_to(at[:, AT_ROW][:, None, None, None], (B, H, 1, 1)).reshape(B * H, 1, 1)
            ck = mx.put_along_axis(ck, mx.broadcast_to(row, (B * H, 1, D)), k.reshape(B * H, 1, D).astype(ck.dtype),
                                   axis=1)
            cv = mx.put_along_axis(cv, mx.broadcast_to(row, (B * H, 1, v.shape[2])), v.astype(cv.dtype), axis=1)
            self.keys, self.values = ck, cv
        counts = mx.broadcast_to(at[:, AT_COUNTS:AT_COUNTS + 3][:, None, :, None], (B, H, 3, 1))
        counts = counts.reshape(B * H, 3, 1).swapaxes(0, 1)
        idx, k, v, valid, last, scored, recent = _select(
            sp.static, sp.codec, sp.rope, q_rows, counts, self.summaries, (ck,), (cv,),
            self.recent if sp.static.sticky else mx.zeros((1,), mx.int32), per_row=True)
        self.picked = recent
        T = idx.shape[1]
        k = place(k.reshape(B, H, T, D), idx, 0, sp.positions, sp.static.page_size)
        segments = [PickedSegment(k, v.reshape(B, H, T, -1), valid.reshape(B, H, 1, T))]
        if self.sink:
            segments.append(DenseSegment(*self.sink))
        live = [mx.slice(b, self.at0[AT_LIVE:AT_LIVE + 1], (2,), (B, H, sp.live, b.shape[3])) for b in self.body]
        if live[0].dtype != sp.compute:
            live = [b.astype(sp.compute) for b in live]
        segments.append(DenseSegment(*live))
        return attend(segments, 1, queries, scale, mask, q_rows if frame else None, len(segments) - 1 if frame else 0)

    def outputs(self):
        return {"body": self.body, "keys": self.keys, "values": self.values, "recent": self.picked}


def ideal_step(model, specs, hot_only=False):
    """The batch-owned step, compiled: (tokens [B, 1], offsets [B], at [B, 10], at0 [10], per layer
    the stacked inputs) -> (logits, per layer the written buffers and sticky pages). `hot_only`: the
    same step without the cold store (the sink and the hot window attended alone): the floor any
    retrieval step of this model stands on."""
    pos = specs[0].positions

    def step(tokens, offsets, at, at0, inputs):
        B, D = at.shape[0], inputs[0]["body"][0].shape[3]
        turns = (pos.rotations(at[:, AT_FIRST:AT_TURN + 1].reshape(-1), D).reshape(B, 2, D, D)
                 if pos.frame else None)
        layers = [IdealLayer(sp, at, at0, x, turns, offsets, hot_only) for sp, x in zip(specs, inputs)]
        with rope_products.products(model, offsets):
            logits = model(tokens, cache=layers)
        return logits, [layer.outputs() for layer in layers]
    return mx.compile(step)


def capture(model, tokens, caches):
    """One of today's batched steps of `caches` (decode_step, greedy), its compiled call's key,
    arguments and outputs kept (held: the step then copies its buffers instead of writing them
    in place, so the arguments keep the state before it); (the next tokens, the capture) or None
    where the step did not run the compiled retrieval call."""
    got = {}
    orig = batch._retrieval_step

    def spy(m, key, cs):
        made = orig(m, key, cs)
        if made is batch._FAILED:
            return made
        fn, n = made

        def run(*args):
            out = fn(*args)
            got.update(key=key, fn=fn, args=args, out=out, caches=list(cs))
            return out
        return run, n
    batch._retrieval_step = spy
    try:
        logits, nxt = batch.decode_step(model, tokens, caches, argmax=True)
    finally:
        batch._retrieval_step = orig
    return nxt, (got or None), logits


def aligned(captured: dict):
    """Whether the captured step's rows all evict in their trace (each its live window one past its
    leaving slot) and select as one group (`batch._group`: one `Static`, the same summary widths):
    the rows the ideal's one layout holds."""
    return (all(int(a[AT_LIVE]) == int(a[AT_SRC]) + 1 for a in (x.tolist() for x in captured["args"][2]))
            and len({batch._group(k) for k in captured["key"][2]}) == 1)


def _pad(a, axis, n):
    if a.shape[axis] == n:
        return a
    shape = list(a.shape)
    shape[axis] = n - a.shape[axis]
    return mx.concatenate([a, mx.zeros(shape, a.dtype)], axis=axis)


def ideal_inputs(captured: dict, rows: list):
    """The ideal step's arguments for captured rows `rows` (indices in the captured order), stacked
    once: (specs, tokens, offsets, at, at0, per layer inputs). The hot windows moved to one layout:
    each row's live window to slots 0..len-1 of a buffer of the rows' largest capacity, so the
    leaving token sits at slot 0, the new token at slot len, the live window after the step at 1."""
    key, args = captured["key"], captured["args"]
    ids, offsets, ats, inputs = args[0], args[1], args[2], args[3]
    row_keys = key[2]
    specs = layer_specs(captured["caches"][rows[0]].global_layers, row_keys[rows[0]])
    groups = {batch._group(row_keys[i]) for i in rows}
    assert len(groups) == 1, "rows of several groups: not one ideal layout"
    at = [ats[i].tolist() for i in rows]
    n_body = specs[0].live            # the live tokens before the step (it evicts one, adds one)
    stacked = []
    for j, sp in enumerate(specs):
        xs = [inputs[i][j] for i in rows]
        cap = max(x["body"][0].shape[2] for x in xs)
        body = []
        for s in (0, 1):
            parts = [_pad(mx.slice(x["body"][s], mx.array([a[AT_SRC]]), (2,),
                                   (1,) + x["body"][s].shape[1:2] + (n_body, x["body"][s].shape[3])), 2, cap)
                     for x, a in zip(xs, at)]
            body.append(mx.concatenate(parts, axis=0))
        ccap = max(x["keys"][0].shape[1] for x in xs)
        one = {"body": tuple(body),
               "sink": tuple(mx.concatenate([x["sink"][s] for x in xs], axis=0) for s in (0, 1)) if xs[0]["sink"] else (),
               "keys": mx.concatenate([_pad(x["keys"][0], 1, ccap) for x in xs], axis=0),
               "values": mx.concatenate([_pad(x["values"][0], 1, ccap) for x in xs], axis=0),
               "summaries": {name: mx.concatenate([x["summaries"][name][:, :sp.buckets[name]] for x in xs], axis=0)
                             for name in xs[0]["summaries"]},
               "recent": mx.concatenate([x["recent"] for x in xs], axis=0) if sp.static.sticky else mx.zeros((1,), mx.int32)}
        stacked.append(one)
    at0 = [0] * 10
    at0[AT_SRC], at0[AT_WRITE], at0[AT_LIVE] = 0, n_body, 1
    tok = ids[mx.array(rows)] if len(rows) < ids.shape[0] else ids
    off = offsets[mx.array(rows)] if len(rows) < offsets.shape[0] else offsets
    arrays = (tok, off, mx.array(at, mx.int32), mx.array(at0, mx.int32), stacked)
    mx.eval(arrays)
    return specs, arrays


def replay_today(captured: dict):
    """Today's compiled call at the captured state, its written buffers fed back (a closure taking
    nothing, one step per call)."""
    fn = captured["fn"]
    ids, offsets, ats, inputs, ring_at, ring_buffers = captured["args"]
    inputs = [[dict(x) for x in row] for row in inputs]
    state = {"ids": ids}

    def one():
        logits, outs, _ = fn(state["ids"], offsets, ats, inputs, ring_at, ring_buffers)
        best = mx.argmax(logits[:, -1].astype(mx.float32), axis=-1)
        # (the written buffers replace the inputs before the evaluation, as the worker's commit does:
        # the old ones then have the write as their one reader and MLX writes them in place)
        for j, layer in enumerate(outs):
            for i, o in enumerate(layer):
                inputs[i][j]["body"] = o["body"]
                if "evicted" in o:
                    inputs[i][j]["keys"], inputs[i][j]["values"] = (o["evicted"][0],), (o["evicted"][1],)
                inputs[i][j]["recent"] = o["picked"][-1]
        del outs
        state["ids"] = best[:, None].astype(mx.int32)
        mx.eval(logits, best)
    return one


def replay_ideal(fn, arrays):
    tok, off, at, at0, stacked = arrays
    state = {"tok": tok, "inputs": [dict(x) for x in stacked]}

    def one():
        logits, outs = fn(state["tok"], off, at, at0, state["inputs"])
        best = mx.argmax(logits[:, -1].astype(mx.float32), axis=-1)
        for x, o in zip(state["inputs"], outs):     # (before the evaluation: written in place, `replay_today`)
            x["body"], x["keys"], x["values"] = o["body"], o["keys"], o["values"]
            if o["recent"] is not None and x["recent"].ndim == 2:
                x["recent"] = o["recent"]
        del outs
        state["tok"] = best[:, None].astype(mx.int32)
        mx.eval(logits, best)
    return one


class _TraceSpy:
    """Counts the traced retrieval layers made (`_TracedRetrieval`: built only while MLX traces a
    retrieval step, the solo one's or the batched one's), so that `answer` can tell the steps that
    traced from those that replayed; installed by the benchmark only, nothing on the served path."""

    def __init__(self):
        from tinygpt_mlx.cache import compiled_retrieval
        self.made, cls = 0, compiled_retrieval._TracedRetrieval
        init = cls.__init__

        def counted(this, *args, **kwargs):
            self.made += 1
            init(this, *args, **kwargs)
        cls.__init__ = counted


def answer(loaded, cfg, tokens: int, rounds: int) -> dict:
    """`--answer`: whole answers as the HTTP run's throughput part has them, in process: the four
    prompts prefilled afresh, then `tokens` - 1 decode steps, batched (`batch.decode_step`, the
    four rows) or lone (each cache alone, as batch_rows' lone case), in the order B L L B per two
    rounds. Each step timed (process CPU, wall) and counted as steady where it ran the compiled
    steady retrieval step (batched: `batch.taken["compiled_retrieval"]` moved; lone: the cache's
    cold store held tokens before it: its hot window full) or filling (the rest: the hot window
    still filling, prompts of 5-11 tokens). Per case the medians over rounds of the totals.
    Beside them (session 44, h56t) the steps that traced a retrieval step (`_TraceSpy`: the solo
    step's or the batched one's), timed apart as "trace" (their time is also in their phase's):
    per round how many, at which steps, their CPU and wall ms, and for the batched ones whether
    the trace came with a new layout key (`batch._steps`, a new compiled function: the summaries'
    widths scanned, the sticky pages' width...) or only new input shapes under a held key (the
    cold stores' capacities); `growths`: the cold stores' capacity doublings (every layer's keys,
    values and summaries, all rows) in the answer. The process keeps its traces from round to
    round (as a server does from request to request), so round 0's case pays the first traces."""
    from tinygpt_mlx.cache.device_pages import DeviceRows
    m = loaded.model
    th = blas.Threads()
    spy = _TraceSpy()
    grown = [0]
    make_room = DeviceRows.make_room

    def counted_room(self, n):
        g = self.growths
        make_room(self, n)
        grown[0] += self.growths - g
    DeviceRows.make_room = counted_room
    got: dict = {"batched": [], "lone": []}
    for r in range(rounds):
        for case in (("batched", "lone") if r % 2 == 0 else ("lone", "batched")):
            caches, toks = setup(loaded, cfg, 4, 0, 0)
            parts = {"steady": [0.0, 0.0, 0], "filling": [0.0, 0.0, 0]}
            trace = {"steps": 0, "cpu_ms": 0.0, "wall_ms": 0.0, "at": [], "new_key": []}
            grown[0] = 0
            th.for_decode()

            def traced_step(made0, c, w, at, keys0=None):
                if spy.made == made0:
                    return
                trace["steps"] += 1
                trace["cpu_ms"] += c * 1e3
                trace["wall_ms"] += w * 1e3
                trace["at"].append(at)
                if keys0 is not None:
                    trace["new_key"].append(len(set(batch._steps(m)[0]) - keys0) > 0)
            if case == "batched":
                for s in range(tokens - 1):
                    before = batch.taken["compiled_retrieval"]
                    made0, keys0 = spy.made, set(batch._steps(m)[0])
                    c0, t0 = time.process_time(), time.perf_counter()
                    _, toks = batch.decode_step(m, toks, caches, argmax=True)
                    c, w = time.process_time() - c0, time.perf_counter() - t0
                    p = parts["steady" if batch.taken["compiled_retrieval"] > before else "filling"]
                    p[0], p[1], p[2] = p[0] + c, p[1] + w, p[2] + 1
                    traced_step(made0, c, w, s, keys0)
            else:
                for i, cache in enumerate(caches):
                    t = toks[i]
                    for s in range(tokens - 1):
                        steady = len(cache.owned[0].cold) > 0
                        made0 = spy.made
                        c0, t0 = time.process_time(), time.perf_counter()
                        lg = call(m, [t], cache, wait=False)
                        pick = mx.argmax(lg)
                        mx.eval(lg, pick)
                        t = pick.item()
                        c, w = time.process_time() - c0, time.perf_counter() - t0
                        p = parts["steady" if steady else "filling"]
                        p[0], p[1], p[2] = p[0] + c, p[1] + w, p[2] + 1
                        traced_step(made0, c, w, (i, s))
            th.for_prefill()
            trace["cpu_ms"], trace["wall_ms"] = round(trace["cpu_ms"], 1), round(trace["wall_ms"], 1)
            parts["trace"] = trace
            parts["growths"] = grown[0]
            got[case].append(parts)
            print(f"round {r} {case}: " + ", ".join(f"{k} {parts[k][2]} steps {parts[k][0] * 1e3:.0f} ms CPU "
                                                    f"{parts[k][1] * 1e3:.0f} ms wall" for k in ("steady", "filling"))
                  + f"; traced {trace['steps']} steps {trace['cpu_ms']:.0f} ms CPU {trace['wall_ms']:.0f} ms wall"
                  + f" at {trace['at']} new key {trace['new_key']}; growths {grown[0]}"
                  + f" | load {os.getloadavg()[0]:.2f}", flush=True)
    DeviceRows.make_room = make_room
    med = {case: {ph: {"steps": rs[0][ph][2],
                       "cpu_ms": round(statistics.median(x[ph][0] for x in rs) * 1e3, 1),
                       "wall_ms": round(statistics.median(x[ph][1] for x in rs) * 1e3, 1)} for ph in ("steady", "filling")}
           for case, rs in got.items()}
    for case, rs in got.items():
        med[case]["trace"] = {"steps": [x["trace"]["steps"] for x in rs],
                              "cpu_ms": [x["trace"]["cpu_ms"] for x in rs],
                              "wall_ms": [x["trace"]["wall_ms"] for x in rs]}
    out = {"medians": med, "rounds": got}

    def ratio(x: float, y: float):
        return round(x / y, 3) if y else None    # (an answer too short to reach a phase: none)
    for k, unit in enumerate(("cpu_ms", "wall_ms")):
        lone = med["lone"]["steady"][unit] + med["lone"]["filling"][unit]
        bat = med["batched"]["steady"][unit] + med["batched"]["filling"][unit]
        out[f"x_whole_{unit[:-3]}"] = ratio(lone, bat)
        out[f"x_steady_{unit[:-3]}"] = ratio(med["lone"]["steady"][unit], med["batched"]["steady"][unit])
        out[f"x_filling_{unit[:-3]}"] = ratio(med["lone"]["filling"][unit], med["batched"]["filling"][unit])
        out[f"batched_steady_share_{unit[:-3]}"] = ratio(med["batched"]["steady"][unit], bat)
        # per round: the share of each answer's time its traced steps took
        for case in ("batched", "lone"):
            out[f"{case}_trace_share_{unit[:-3]}"] = [
                ratio(x["trace"][unit], (x["steady"][k] + x["filling"][k]) * 1e3) for x in got[case]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tinygpt-base.tinygpt")
    ap.add_argument("--warm", type=int, default=180, help="batched steps before the timed blocks")
    ap.add_argument("--steps", type=int, default=16, help="steps per case and block")
    ap.add_argument("--blocks", type=int, default=24, help="blocks; the cases' order reversed every other one")
    ap.add_argument("--answer", type=int, default=0,
                    help="instead of the blocks: whole answers of this many tokens from the prompts, batched and "
                         "lone, the steady and filling steps timed apart (`answer`)")
    ap.add_argument("--rounds", type=int, default=4, help="--answer's rounds (B L L B per two)")
    ap.add_argument("--json", type=Path, required=True, help="where to write the result")
    a = ap.parse_args()
    if min(a.warm, a.steps, a.blocks) < 1:
        ap.error(f"--warm, --steps and --blocks must be positive (got {a.warm}, {a.steps}, {a.blocks})")
    if not Path(a.model).expanduser().exists():
        ap.error(f"--model {a.model}: no such file or directory")
    if a.answer and (a.answer < 2 or a.rounds < 1):
        ap.error(f"--answer must be at least 2 and --rounds at least 1 (got {a.answer}, {a.rounds})")
    cfg = policies(128)["retrieval sink4/hot128"]
    loaded = load(a.model)
    m = loaded.model
    if a.answer:
        load0 = os.getloadavg()
        res = {"command": "python -m benchmarks.batch_retrieval_ceiling " + " ".join(sys.argv[1:]),
               "model": Path(a.model).name, "policy": "retrieval sink4/hot128", "tokens": a.answer,
               "load_start": load0, **answer(loaded, cfg, a.answer, a.rounds), "load_end": os.getloadavg()}
        print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))
        write_atomic(a.json, json.dumps(res, indent=1) + "\n")
        return
    caches, tokens = setup(loaded, cfg, 4, a.warm, 0)
    lone, lone_tokens = setup(loaded, cfg, 4, a.warm, 0)
    th = blas.Threads()
    fns = {}
    cases = ["lone", "today4", "call4", "call1", "ideal4", "ideal1", "hot4", "hot1"]
    cpu = {c: [] for c in cases}
    wall = {c: [] for c in cases}
    checks = []
    captures = []       # four-row steps captured per block until one held one layout
    # today's timed four-row steps: how many ran the compiled batched call, in how many groups
    seen = {"compiled_retrieval": 0, "retrieval_groups": 0}
    load0 = os.getloadavg()
    for blk in range(a.blocks):
        th.for_decode()
        cap4 = None
        for tries in range(1, 65):     # a captured four-row step whose rows all evict in the trace (one layout)
            tokens, cap4, _ = capture(m, tokens, caches)
            if cap4 is not None and aligned(cap4):
                break
        captures.append(tries)
        assert cap4 is not None and aligned(cap4), "no four-row step with every row evicting in its trace"
        cap1 = None
        for _ in range(32):
            nxt, cap1, _ = capture(m, tokens[:1], caches[:1])
            tokens[0] = nxt[0]
            if cap1 is not None and aligned(cap1):
                break
        assert cap1 is not None and aligned(cap1)
        run = {"call4": replay_today(cap4), "call1": replay_today(cap1)}
        for name, c, rows in (("ideal4", cap4, [0, 1, 2, 3]), ("ideal1", cap1, [0])):
            specs, arrays = ideal_inputs(c, rows)
            # (one compiled function per layout: the specs' `Static` and widths change as the stores grow)
            layout = (specs[0].static, tuple(sorted(specs[0].buckets.items())), specs[0].live, specs[0].evicts)
            if (name, layout) not in fns:
                fns[(name, layout)] = ideal_step(m, specs)
                fns[("hot" + name[-1], layout)] = ideal_step(m, specs, hot_only=True)
            fn = fns[(name, layout)]
            if name == "ideal4":        # the same state: the ideal's logits against today's (captured order)
                logits, _ = fn(*arrays)
                ref = c["out"][0]
                rows_diff = mx.abs(logits[:, -1].astype(mx.float32) - ref[:, -1].astype(mx.float32)).max(axis=-1)
                same = (mx.argmax(logits[:, -1], axis=-1) == mx.argmax(ref[:, -1], axis=-1)).all().item()
                st = specs[0].static
                checks.append({"block": blk, "max_abs_logit_diff": max(rows_diff.tolist()), "same_argmax": bool(same),
                               "rows_diff": rows_diff.tolist(), "few": st.few, "index": st.index,
                               "at": [x.tolist() for x in c["args"][2]],
                               "cold_capacity": [x[0]["keys"][0].shape[1] for x in c["args"][3]],
                               "body_capacity": [x[0]["body"][0].shape[2] for x in c["args"][3]]})
            run[name] = replay_ideal(fn, arrays)
            hot = "hot" + name[-1]
            run[hot] = replay_ideal(fns[(hot, layout)], arrays)
        del cap4, cap1

        def today4():
            nonlocal tokens
            _, tokens = batch.decode_step(m, tokens, caches, argmax=True)

        def lone_all():
            for i, c in enumerate(lone):
                lg = call(m, [lone_tokens[i]], c, wait=False)
                p = mx.argmax(lg)
                mx.eval(lg, p)
                lone_tokens[i] = p.item()
        run["today4"], run["lone"] = today4, lone_all
        for f in run.values():      # (each traced once before its timing)
            f()
        order = cases if blk % 2 == 0 else cases[::-1]
        before = batch.taken.copy()
        for case in order:
            per = 4 if case == "lone" else 1
            mx.synchronize()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(a.steps):
                run[case]()
            cpu[case].append((time.process_time() - c0) / (a.steps * per) * 1e3)
            wall[case].append((time.perf_counter() - t0) / (a.steps * per) * 1e3)
        th.for_prefill()
        for name in seen:
            seen[name] += batch.taken[name] - before[name]
        print(f"block {blk}: " + ", ".join(f"{c} {cpu[c][-1]:.2f}" for c in cases)
              + f" ms CPU | load {os.getloadavg()[0]:.2f}", flush=True)
    med = {c: round(statistics.median(v), 3) for c, v in cpu.items()}
    medw = {c: round(statistics.median(v), 3) for c, v in wall.items()}

    def derived(t: dict) -> dict:
        host = t["today4"] - t["call4"]
        out = {"x_today": 4 * t["lone"] / t["today4"], "x_call4_no_host": 4 * t["lone"] / t["call4"],
               "x_ideal4_no_host": 4 * t["lone"] / t["ideal4"],
               "host_ms_today4": host, "x_ideal4_with_todays_host": 4 * t["lone"] / (t["ideal4"] + host)}
        out["x_hot4_no_host"] = 4 * t["lone"] / t["hot4"]
        for form in ("call", "ideal", "hot"):
            X = (t[form + "4"] - t[form + "1"]) / 3
            W = t[form + "1"] - X
            out[f"{form}_W_ms"], out[f"{form}_X_ms"] = W, X
            out[f"{form}_formula_4(W+X)/(W+4X)"] = 4 * (W + X) / (W + 4 * X)
        return {k: round(v, 3) for k, v in out.items()}
    res = {"command": "python -m benchmarks.batch_retrieval_ceiling " + " ".join(sys.argv[1:]),
           "model": Path(a.model).name, "policy": "retrieval sink4/hot128", "warm": a.warm, "steps": a.steps,
           "blocks": a.blocks, "load_start": load0, "load_end": os.getloadavg(),
           "cpu_ms_per_step_median": med, "wall_ms_per_step_median": medw,
           "derived_cpu": derived(med), "derived_wall": derived(medw),
           "ideal_vs_today_same_state": checks, "four_row_captures_per_block": captures,
           "today4_compiled_steps_and_groups": seen,
           "cpu_ms_per_step": {c: [round(x, 3) for x in v] for c, v in cpu.items()},
           "wall_ms_per_step": {c: [round(x, 3) for x in v] for c, v in wall.items()},
           "note": "lone: per token; the others per step (four rows or one); call*/ideal*: compiled call only"}
    print(json.dumps({k: res[k] for k in ("cpu_ms_per_step_median", "wall_ms_per_step_median", "derived_cpu",
                                          "derived_wall")}, indent=1))
    write_atomic(a.json, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
