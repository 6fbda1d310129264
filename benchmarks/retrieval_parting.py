"""Where retrieval's compiled decode step and its eager step part, and why (issue 53's review).

Two caches of one retrieval policy decode in lockstep on the same tokens (the eager run's greedy
ones, from the eager prefill's last logits), one through the compiled step (cache/compiled_retrieval.py),
one eager. Per step: the largest logit difference, and per layer and KV-head row whether the two
fetched the same cold tokens (the telemetry's records). Where they did not, each run's own
selection is scored again from its inputs (its query rows, its store: device_select's chain,
flat coarse pass) and the gaps at the two cuts are written: the coarse pass's k-th best page bound
less the (k+1)-th, the fine pass's `units`-th best span score less the next, and how far the two
runs' scores of the same pages lie apart. `--rope` keeps the model's RoPE in the compiled trace
(no products, cache/rope_products.py), as before adfb436.

    python -m benchmarks.retrieval_parting [--model PATH] [--policy sink4/hot128] [--prompt 700]
        [--steps 200] [--rope] [--json PATH]

Instruments the step (wraps a few internals) for this measurement only; tests/test_retrieval_ties.py
checks the same rule on the shipped model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks._args import model_or_exit


def _instrument(cap: dict) -> None:
    """Wrap the eager selection (`DeviceColdStore._compiled_pick`) and the compiled step (its
    inputs, its query rows as an extra output, its commits) so that each step's selections land
    in cap["sel"] by layer, the fetched rows in cap["fetched"], whether the step ran compiled in cap["ran"]."""
    from tinygpt_mlx.cache import compiled, compiled_retrieval
    from tinygpt_mlx.cache.cold_device import DeviceColdStore
    from tinygpt_mlx.cache.telemetry import RetrievalTelemetry

    real_pick = DeviceColdStore._compiled_pick

    def pick(self, q, units, unit, pos):
        static, rope, buckets, summaries, keys, _, recent = self.select_inputs(units, unit, pos)
        cap["sel"][self.layer_index] = dict(q=q, static=static, rope=rope, keys=keys, recent=recent, codec=self.codec,
                                            summaries={k: a[:, :buckets[k]] for k, a in summaries.items()},
                                            counts=(self.n, self.n_pages, self.index.n_blocks))
        return real_pick(self, q, units, unit, pos)
    DeviceColdStore._compiled_pick = pick

    pending, commits, trace_q = [], [], []
    real_inputs = compiled_retrieval.step_inputs

    def step_inputs(layers, plans):
        got = real_inputs(layers, plans)
        pending[:] = [got]
        return got
    compiled_retrieval.step_inputs = step_inputs
    real_sit = compiled_retrieval.select_in_trace

    def sit(static, codec, rope, q_rows, *a):
        trace_q.append(q_rows)
        return real_sit(static, codec, rope, q_rows, *a)
    compiled_retrieval.select_in_trace = sit
    traced = compiled_retrieval._TracedRetrieval
    real_attend, real_outputs = traced.attend, traced.outputs

    def attend(self, queries, scale, mask):
        n0 = len(trace_q)
        out = real_attend(self, queries, scale, mask)
        self._q = trace_q[n0]
        return out

    def outputs(self):
        return {**real_outputs(self), "q": self._q}
    traced.attend, traced.outputs = attend, outputs
    real_commit = compiled_retrieval.commit

    def commit(layer, plan, out):
        commits.append((layer, out))
        real_commit(layer, plan, out)
    compiled_retrieval.commit = commit
    real_decode = compiled._retrieval_decode

    def decode(*a):
        commits.clear()
        trace_q.clear()
        out = real_decode(*a)
        cap["ran"].append(out is not None)
        if out is not None:
            row, at, inputs, _ = pending[0]
            static, buckets = row[4], dict(row[5])
            counts = tuple(int(x) for x in at[5:8])
            for (layer, o), inp in zip(commits, inputs):
                cap["sel"][layer.cold.layer_index] = dict(
                    q=o["q"], static=static, rope=layer.positions.rope if static.page_rule else None,
                    keys=(o["evicted"][0],) if "evicted" in o else inp["keys"], codec=layer.cold.codec,
                    recent=inp["recent"] if static.sticky else None, counts=counts,
                    summaries={k: v[:, :buckets[k]] for k, v in inp["summaries"].items()})
        return out
    compiled._retrieval_decode = decode
    real_record = RetrievalTelemetry.record

    def record(self, s):
        cap["fetched"][s.layer] = [sorted(np.asarray(r).tolist()) for r in s.fetched()]
        real_record(self, s)
    RetrievalTelemetry.record = record


def _scores(sel: dict) -> tuple:
    """(coarse page bounds [G, P'] or None, the pool [G, K], fine span scores [G, K]) of one layer's
    selection inputs, as device_select's chain makes them (flat coarse pass)."""
    from tinygpt_mlx.cache import device_select as ds
    from tinygpt_mlx.cache.device_pages import iota, pool_tokens, union

    st, q, (n, P, NB) = sel["static"], sel["q"], sel["counts"]
    G = q.shape[0]
    Pa = mx.array([P], mx.int32)
    if st.few or st.index:
        if st.index:
            raise SystemExit("retrieval_parting: the two-level index is engaged; give a shorter --prompt")
        cap = next(iter(sel["summaries"].values())).shape[1]
        coarse, last = None, mx.broadcast_to(mx.where(iota(cap) < P, iota(cap), -1), (G, cap))
    else:
        sc = ds._bound(q, st.summary, sel["summaries"], "s")
        coarse = np.asarray(mx.where(iota(sc.shape[-1]) < Pa, sc, -mx.inf))
        last = ds._ranked(st, q, st.summary, sel["summaries"], Pa, mx.array([NB], mx.int32))
    parts = [last, mx.broadcast_to(Pa, (G, 1))] + ([sel["recent"]] if st.sticky else [])
    pool = union(parts)
    idx, valid = pool_tokens(pool, mx.array([n], mx.int32), st.page_size)
    k = ds._gather(sel["codec"], st.packed, sel["keys"], idx)
    fine = np.asarray(ds._span_scores(q, idx, k, valid, st.unit, st.span_score, st.page_size, sel["rope"]))
    return coarse, np.asarray(pool), fine, np.asarray(last)


def _gap(s: np.ndarray, k: int):
    s = np.sort(s[np.isfinite(s)])[::-1]
    return float(s[k - 1] - s[k]) if len(s) > k else None


def _apart(a: np.ndarray, b: np.ndarray) -> float:
    both = np.isfinite(a) & np.isfinite(b)
    return float(np.abs(a[both] - b[both]).max()) if both.any() else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default: the shipped model)")
    ap.add_argument("--policy", default="sink4/hot128", help="a retrieval policy spec")
    ap.add_argument("--prompt", type=int, default=700, help="random prompt tokens (ids below 1,000)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rope", action="store_true", help="the compiled trace keeps the model's RoPE (no products)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.steps < 1:
        ap.error(f"--steps {a.steps}: give at least 1")

    from tinygpt_mlx.cache import compiled_retrieval
    from tinygpt_mlx.cli.common import write_atomic
    from tinygpt_mlx.evaluate.bench import make_policy
    from tinygpt_mlx.generate import forward, prefill

    m = model_or_exit(ap, a.model)
    try:
        policy = make_policy(a.policy, m)
        if not policy.make().config.retrieval:
            raise ValueError("not a retrieval policy")
    except (ValueError, AttributeError) as e:
        ap.error(f"--policy {a.policy!r}: {e}")
    if a.prompt <= policy.make().config.hot_budget + 8:
        ap.error(f"--prompt {a.prompt}: must be more than the hot window and a page")
    warnings.simplefilter("ignore")
    if a.rope:
        compiled_retrieval.rope_products = type("P", (), {"products": staticmethod(lambda model, offset: nullcontext())})
    cap: dict = {"sel": {}, "fetched": {}, "ran": []}
    _instrument(cap)
    load_start, t0 = list(os.getloadavg()), time.time()
    prompt = mx.random.randint(0, 1000, (a.prompt,), key=mx.random.key(1)).tolist()
    caches = {}
    for name in ("compiled", "eager"):
        cache = policy.make()
        cache.compile_decode = name == "compiled"
        cache.record_retrievals()
        caches[name] = cache
        last = prefill(m, prompt, cache, 256)
    tok = int(mx.argmax(last.reshape(-1, last.shape[-1])[-1]).item())
    steps = []
    for s in range(a.steps):
        got = {}
        for name, cache in caches.items():
            cap["sel"], cap["fetched"], cap["ran"] = {}, {}, []
            logits = forward(m, mx.array([[tok]]), cache)[0, -1]
            got[name] = (np.asarray(logits), cap["sel"], cap["fetched"], cap["ran"])
        (lc, sc, fc, ran), (le, se, fe, _) = got["compiled"], got["eager"]
        rec = {"step": s, "max_logit_diff": float(np.abs(lc - le).max()), "compiled": bool(ran and ran[0]),
               "argmax_same": int(lc.argmax()) == int(le.argmax()), "parted": []}
        for L in sorted(fe):
            rows = [g for g, (x, y) in enumerate(zip(fc[L], fe[L])) if x != y]
            if not rows:
                continue
            (cc, pc, nc, kc), (ce, pe, ne, ke) = _scores(sc[L]), _scores(se[L])
            st = se[L]["static"]
            for g in rows:
                same_pool = bool(np.array_equal(pc[g], pe[g]))
                rec["parted"].append({
                    "layer": L, "row": g, "same_coarse_pages": bool(np.array_equal(np.sort(kc[g]), np.sort(ke[g]))),
                    "same_pool": same_pool, "fine_gap_eager": _gap(ne[g], st.units),
                    "fine_gap_compiled": _gap(nc[g], st.units),
                    "fine_scores_apart": _apart(nc[g], ne[g]) if same_pool else None,
                    "coarse_gap_eager": None if ce is None else _gap(ce[g], st.top_pages),
                    "coarse_scores_apart": None if ce is None else _apart(cc[g], ce[g])})
        steps.append(rec)
        tok = int(le.argmax())
        print(f"step {s:3d}  logits apart {rec['max_logit_diff']:.2e}  rows parted {len(rec['parted'])}", flush=True)
    first = next((r["step"] for r in steps if r["parted"]), None)
    diffs = [r["max_logit_diff"] for r in steps]
    low = min((p["layer"] for p in steps[first]["parted"]), default=None) if first is not None else None
    out = {"command": " ".join(["python -m benchmarks.retrieval_parting", *sys.argv[1:]]),
           "LD_PRELOAD": os.environ.get("LD_PRELOAD"), "load_average_at_start": load_start,
           "load_average_at_end": list(os.getloadavg()), "seconds": round(time.time() - t0, 1),
           "model": a.model or "shipped", "policy": a.policy, "prompt": a.prompt, "products": not a.rope,
           "summary": {"first_parting_step": first,
                       "max_logit_diff_before_it": max(diffs[:first]) if first else (max(diffs) if first is None else None),
                       "lowest_layer_parted_then": low,
                       "its_rows": [p for p in steps[first]["parted"] if p["layer"] == low] if first is not None else [],
                       "max_logit_diff": max(diffs), "at_step": int(np.argmax(diffs)),
                       "steps_over_0.05": sum(d > 0.05 for d in diffs),
                       "steps_with_a_parting": sum(bool(r["parted"]) for r in steps),
                       "steps_compiled": sum(r["compiled"] for r in steps),
                       "greedy_tokens_differing": sum(not r["argmax_same"] for r in steps)},
           "steps": steps}
    print(json.dumps(out["summary"], indent=1))
    if a.json is not None:
        write_atomic(a.json, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
