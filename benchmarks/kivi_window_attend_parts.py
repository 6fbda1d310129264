"""Where the int4 + StreamingLLM window's compiled decode step spends its attention evaluation,
against mlx-lm's RotatingKVCache(256) fused attention, on a real model's window state (issue 54).

A cache of the policy (default `int4+sink4/window252`) is filled as `bench` fills it (a prompt of
`--context` random tokens, prefilled in chunks of 512, then decode steps), and after `--after`
decode steps (default 8: the int4 near tier, which holds tokens in the first steps after a
prompt, has handed them on by then) taken at its next quiet step (the compiled step,
cache/compiled.py); its layers' inputs to that step (`compiled.kivi_inputs`: the placed sink,
the packed run, the residual's buffers, the step's mask) are then attended to by one random
query per layer, every layer in one compiled function, as the step's trace does. Timed, each
as its own compiled function over all layers, evaluated on inputs already evaluated (medians
over `--rounds` rounds, the order shuffled each round):

- `ours`: `_TracedKivi.attend`, the step's attention (the real code);
- its parts on their own, each from its inputs evaluated: the query scaled and turned into the
  keys' basis, the key `quantized_matmul`, the exact scores (sink, residual buffer), the join,
  mask and softmax, the exact outputs, the value `quantized_matmul` and the turn back;
- two candidates for a cheaper evaluation (issue 54), each checked against `ours` (its largest
  difference is printed and kept): the sink's and the residual's keys and values joined by two
  concatenations so that one product each way replaces two; and the packed runs dequantised in
  the step, then plain products (`quant.matmul_path`'s "dequantise", MLX's CUDA backend's);
  and a bound: the sink's rows already in the residual's buffers (joined before the timing,
  as a store that kept them there would hold them), one product each way and no join;
- three more candidates (session 39): the mask as an additive bias built once per step for all
  the layers (`softmax(scores + bias)` where each layer ran `where(mask, scores, -inf)`); the
  softmax written per part without the join (flash-style: each part's scores biased, their
  maxima combined, each part's exponentials summed and multiplied by its values, the sums
  divided once: no concatenation of scores); and the query left unscaled, the scale applied
  to the joined scores in the mask's select (one element-wise kernel fewer per layer under
  `mx.compile`), the outputs summed by `mx.addmm` (a product and its sum in one kernel); and
  that last one over the bound's held sink;
- `peer`: `mx.fast.scaled_dot_product_attention` over 256 exact keys, what mlx-lm's
  RotatingKVCache(256) hands the model (its parts: the scores, softmax, output products).

    python -m benchmarks.kivi_window_attend_parts MODEL [--context 1024] [--rounds 40] [--json out.json]

Not a test (speed only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tinygpt_mlx import quant
from tinygpt_mlx.cache import compiled, make_cache
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.cache.packed import PackedRun, rotation, rotation_back
from tinygpt_mlx.evaluate import opcount
from tinygpt_mlx.evaluate.modes import parse_policies
from tinygpt_mlx.generate import forward, prefill
from tinygpt_mlx.loading import load


def _geometry(model) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of `model`'s attention."""
    cfg = model.config if hasattr(model, "config") else model.args
    hq = getattr(cfg, "n_heads", None) or cfg.num_attention_heads
    hkv = getattr(cfg, "n_kv_heads", None) or cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return hq, hkv, d


def quiet_inputs(model, spec: str, context: int, after: int, chunk: int = 512) -> tuple:
    """The window's state for its first quiet decode step at least `after` steps after a prompt
    of `context` random tokens, prefilled and decoded as `bench` does (`generate.prefill`,
    `generate.forward`): (config, layers, `compiled.kivi_inputs`, the step's mask)."""
    cfg = parse_policies(spec)[spec]
    cache = make_cache(model, cfg)
    vocab = model.args.vocab_size if hasattr(model, "args") else model.config.vocab_size
    toks = mx.random.randint(0, vocab, (context + after + 4 * cfg.group_size,), key=mx.random.key(1)).tolist()
    mx.eval(prefill(model, toks[:context], cache, chunk))
    for i, t in enumerate(toks[context:]):
        mx.eval(forward(model, mx.array([[t]]), cache))
        if i + 1 < after:
            continue
        layers = cache.owned
        plans = [c.plan() for c in layers]
        layout = compiled.kivi_layout(layers)
        if layout and all(compiled._kivi_ready(c, p) for c, p in zip(layers, plans)):
            inputs = compiled.kivi_inputs(layers, plans, layout)
            _, sinks, packed, nears, buffers, first, slot, cut = inputs
            mask = compiled._quiet_mask(sinks[0][0].shape[2] if sinks[0] else 0, packed[0], nears[0], buffers[0],
                                        mx.array(first, mx.int32), mx.array(slot, mx.int32), mx.array(cut, mx.int32))
            return cfg, layers, inputs, mask
    raise SystemExit(f"{spec}: no quiet step within {after + 4 * cfg.group_size} tokens after {context}")


def median_us(fn, args, rounds_out: list) -> None:
    t = time.perf_counter()
    mx.eval(fn(*args))
    rounds_out.append((time.perf_counter() - t) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--policy", default="int4+sink4/window252")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--peer-window", type=int, default=256)
    ap.add_argument("--after", type=int, default=8, help="decode steps after the prompt before the state is taken")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.rounds < 3:
        ap.error(f"--rounds {a.rounds}: must be at least 3")
    if a.after < 0:
        ap.error(f"--after {a.after}: must be 0 or more")
    if a.peer_window < 1:
        ap.error(f"--peer-window {a.peer_window}: must be at least 1")
    if a.context < 2 * a.peer_window:
        ap.error(f"--context {a.context}: must be at least twice --peer-window ({2 * a.peer_window})")
    try:
        cfg = parse_policies(a.policy)[a.policy]
    except ValueError as e:
        ap.error(f"--policy: {e}")
    if not (cfg.quantised and cfg.streaming and cfg.rotate):
        ap.error(f"--policy {a.policy!r}: not a KIVI policy (rotated) under a StreamingLLM window")
    if not os.path.exists(os.path.expanduser(a.model)):
        ap.error(f"model {a.model}: no such file or directory")
    load_at_start = list(os.getloadavg())
    print(f"load at start {load_at_start[0]:.2f}", flush=True)
    model = load(os.path.expanduser(a.model)).model
    hq, hkv, d = _geometry(model)
    cfg, layers, inputs, mask = quiet_inputs(model, a.policy, a.context, a.after)
    _, sinks, packed, nears, buffers, first, slot, cut = inputs
    n_layers = len(layers)
    scale = d ** -0.5
    keys = mx.random.split(mx.random.key(2), 4 * n_layers)
    queries = [mx.random.normal((1, hq, 1, d), key=keys[i]) for i in range(n_layers)]
    peer_kv = [(mx.random.normal((1, hkv, a.peer_window, d), key=keys[n_layers + i]),
                mx.random.normal((1, hkv, a.peer_window, d), key=keys[2 * n_layers + i])) for i in range(n_layers)]
    mx.eval(queries, peer_kv, mask)

    def traced(i):
        return compiled._TracedKivi(sinks[i], packed[i], nears[i], buffers[i], None, mask, None, cfg,
                                    layers[i].body.storage, layers[i].dtype)

    def ours(qs):
        return [traced(i).attend(q, scale, mask) for i, q in enumerate(qs)]

    def peer(qs, kv):
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None) for q, (k, v) in zip(qs, kv)]

    runs = [[PackedRun.of(*packed[i], cfg)] + ([PackedRun.of(*nears[i], cfg, near=True)] if nears[i] else [])
            for i in range(n_layers)]
    R, Rb = rotation(d), rotation_back(d)

    def rows_of(q):
        return (q * scale).reshape(1, hkv, hq // hkv, d)

    def key_scores(i, turned_rows):
        return [quant.quantised_matmul(turned_rows, *r.keys, bits=r.key_bits, group=r.group, path=r.path)
                for r in runs[i]]

    def value_out(i, pieces):
        out = None
        for r, p in zip(runs[i], pieces):
            part = quant.quantised_matmul(p, *r.values, bits=r.value_bits, group=r.value_group, path=r.path)
            out = part if out is None else out + part
        return out @ Rb

    def joined(i, s_sink, s_runs, s_res):
        return mx.softmax(mx.where(mask, mx.concatenate([s_sink, *s_runs, s_res], axis=-1), -mx.inf), axis=-1)

    S = buffers[0][0].shape[2]
    perm = mx.concatenate([mask[..., :sinks[0][0].shape[2]], mask[..., -S:], mask[..., sinks[0][0].shape[2]:-S]], axis=-1)
    mx.eval(perm)

    def joined_variant(i, q):
        r = rows_of(q)
        t = r @ R
        k = mx.concatenate([sinks[i][0], buffers[i][0]], axis=2)
        v = mx.concatenate([sinks[i][1], buffers[i][1]], axis=2)
        sc = [r @ k.swapaxes(-1, -2)] + key_scores(i, t)
        probs = mx.softmax(mx.where(perm, mx.concatenate(sc, axis=-1), -mx.inf), axis=-1)
        ne = k.shape[2]
        out = probs[..., :ne] @ v
        pieces, start = [], ne
        for x in sc[1:]:
            pieces.append(probs[..., start:start + x.shape[-1]])
            start += x.shape[-1]
        return (out + value_out(i, pieces)).reshape(1, hq, 1, d)

    # the sink's rows written once into buffers of their own before the residual's slots, as a
    # store that kept them there would hold them (kivi.Residual's room, a full KIVI cache's
    # `led` sink): not built here per step, so this is a bound on what such a store could save
    held = [tuple(mx.concatenate([sinks[i][x], buffers[i][x]], axis=2) for x in (0, 1)) for i in range(n_layers)]
    mx.eval(held)

    def held_variant(i, q):
        r = rows_of(q)
        t = r @ R
        k, v = held[i]
        sc = [r @ k.swapaxes(-1, -2)] + key_scores(i, t)
        probs = mx.softmax(mx.where(perm, mx.concatenate(sc, axis=-1), -mx.inf), axis=-1)
        ne = k.shape[2]
        pieces, start = [], ne
        for x in sc[1:]:
            pieces.append(probs[..., start:start + x.shape[-1]])
            start += x.shape[-1]
        return (probs[..., :ne] @ v + value_out(i, pieces)).reshape(1, hq, 1, d)

    def bias_variant(qs):
        # the mask as an additive bias, made once for every layer of the step
        bias = mx.where(mask, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
        out = []
        for i, q in enumerate(qs):
            r = rows_of(q)
            sc = [r @ sinks[i][0].swapaxes(-1, -2)] + key_scores(i, r @ R) + [r @ buffers[i][0].swapaxes(-1, -2)]
            p = mx.softmax(mx.concatenate(sc, axis=-1) + bias, axis=-1)
            o = p[..., :ns] @ sinks[i][1] + p[..., -nr:] @ buffers[i][1]
            out.append((o + value_out(i, [p[..., bounds[j]:bounds[j + 1]] for j in range(len(sizes))])).reshape(1, hq, 1, d))
        return out

    def flash_variant(qs):
        # one softmax per part, combined (flash-style): no join of the scores
        bias = mx.where(mask, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
        cuts = [0, *bounds, bounds[-1] + nr]
        out = []
        for i, q in enumerate(qs):
            r = rows_of(q)
            sc = [r @ sinks[i][0].swapaxes(-1, -2)] + key_scores(i, r @ R) + [r @ buffers[i][0].swapaxes(-1, -2)]
            sc = [s + bias[..., cuts[j]:cuts[j + 1]] for j, s in enumerate(sc)]
            top = sc[0].max(axis=-1, keepdims=True)
            for s in sc[1:]:
                top = mx.maximum(top, s.max(axis=-1, keepdims=True))
            e = [mx.exp(s - top) for s in sc]
            den = e[0].sum(axis=-1, keepdims=True)
            for x in e[1:]:
                den = den + x.sum(axis=-1, keepdims=True)
            o = e[0] @ sinks[i][1] + e[-1] @ buffers[i][1] + value_out(i, e[1:-1])
            out.append((o / den).reshape(1, hq, 1, d))
        return out

    def late_scale_variant(qs, held_sink=False):
        # the query unscaled, the scale applied in the mask's select; outputs summed by addmm
        out = []
        for i, q in enumerate(qs):
            r = q.reshape(1, hkv, hq // hkv, d)
            if held_sink:
                k, v = held[i]
                sc = [r @ k.swapaxes(-1, -2)] + key_scores(i, r @ R)
                p = mx.softmax(mx.where(perm, mx.concatenate(sc, axis=-1) * scale, -mx.inf), axis=-1)
                ne = k.shape[2]
                exact, parts_ = p[..., :ne] @ v, []
                start = ne
                for x in sc[1:]:
                    parts_.append(p[..., start:start + x.shape[-1]])
                    start += x.shape[-1]
            else:
                sc = [r @ sinks[i][0].swapaxes(-1, -2)] + key_scores(i, r @ R) + [r @ buffers[i][0].swapaxes(-1, -2)]
                p = mx.softmax(mx.where(mask, mx.concatenate(sc, axis=-1) * scale, -mx.inf), axis=-1)
                exact = mx.addmm(p[..., :ns] @ sinks[i][1], p[..., -nr:], buffers[i][1])
                parts_ = [p[..., bounds[j]:bounds[j + 1]] for j in range(len(sizes))]
            in_basis = None
            for run, x in zip(runs[i], parts_):
                part = quant.quantised_matmul(x, *run.values, bits=run.value_bits, group=run.value_group, path=run.path)
                in_basis = part if in_basis is None else in_basis + part
            out.append(mx.addmm(exact, in_basis, Rb).reshape(1, hq, 1, d))
        return out

    def dequantised_variant(i, q):
        # the packed runs dequantised in the step (`quant.matmul_path` "dequantise"), then the products
        r = rows_of(q)
        t = r @ R
        sc = [r @ sinks[i][0].swapaxes(-1, -2)]
        sc += [t @ quant.dequantise(*run.keys, run.key_bits, run.group) for run in runs[i]]
        sc.append(r @ buffers[i][0].swapaxes(-1, -2))
        probs = mx.softmax(mx.where(mask, mx.concatenate(sc, axis=-1), -mx.inf), axis=-1)
        out = probs[..., :ns] @ sinks[i][1] + probs[..., -nr:] @ buffers[i][1]
        packed_out = None
        for j, run in enumerate(runs[i]):
            part = probs[..., bounds[j]:bounds[j + 1]] @ quant.dequantise(*run.values, run.value_bits, run.value_group)
            packed_out = part if packed_out is None else packed_out + part
        return (out + packed_out @ Rb).reshape(1, hq, 1, d)

    # the parts' inputs, evaluated
    rows = [rows_of(q) for q in queries]
    turned = [r @ R for r in rows]
    sk = [key_scores(i, t) for i, t in enumerate(turned)]
    ss = [r @ sinks[i][0].swapaxes(-1, -2) for i, r in enumerate(rows)]
    sr = [r @ buffers[i][0].swapaxes(-1, -2) for i, r in enumerate(rows)]
    probs = [joined(i, ss[i], sk[i], sr[i]) for i in range(n_layers)]
    ns, nr = ss[0].shape[-1], sr[0].shape[-1]
    sizes = [x.shape[-1] for x in sk[0]]
    bounds = [ns + sum(sizes[:j]) for j in range(len(sizes) + 1)]
    pk = [[mx.contiguous(p[..., bounds[j]:bounds[j + 1]]) for j in range(len(sizes))] for p in probs]
    mx.eval(rows, turned, sk, ss, sr, probs, pk)
    peer_scores = [(q * scale).reshape(1, hkv, hq // hkv, d) @ k.swapaxes(-1, -2) for q, (k, _) in zip(queries, peer_kv)]
    peer_probs = [mx.softmax(s, axis=-1) for s in peer_scores]
    mx.eval(peer_scores, peer_probs)

    cases = {
        "ours: the whole attention (_TracedKivi.attend)": (ours, (queries,)),
        f"peer: mx.fast.scaled_dot_product_attention over {a.peer_window}": (peer, (queries, peer_kv)),
        "ours: query scaled, turned into the keys' basis": (lambda qs: [rows_of(q) @ R for q in qs], (queries,)),
        "ours: key quantized_matmul (packed runs)": (lambda ts: [key_scores(i, t) for i, t in enumerate(ts)], (turned,)),
        "ours: exact scores (sink, residual buffer)": (
            lambda rs: [(r @ sinks[i][0].swapaxes(-1, -2), r @ buffers[i][0].swapaxes(-1, -2)) for i, r in enumerate(rs)],
            (rows,)),
        "ours: join, mask, softmax": (
            lambda a_, b_, c_: [joined(i, a_[i], b_[i], c_[i]) for i in range(n_layers)], (ss, sk, sr)),
        "ours: exact outputs (sink, residual) and their sum": (
            lambda ps: [p[..., :ns] @ sinks[i][1] + p[..., -nr:] @ buffers[i][1] for i, p in enumerate(ps)],
            (probs,)),
        "ours: value quantized_matmul (packed runs) and the turn back": (
            lambda ps: [value_out(i, p) for i, p in enumerate(ps)], (pk,)),
        "variant: sink and residual joined (2 concatenations for 2 products)": (
            lambda qs: [joined_variant(i, q) for i, q in enumerate(qs)], (queries,)),
        "bound: sink already held in the residual's buffers (one exact product each way)": (
            lambda qs: [held_variant(i, q) for i, q in enumerate(qs)], (queries,)),
        "variant: packed runs dequantised, then plain products": (
            lambda qs: [dequantised_variant(i, q) for i, q in enumerate(qs)], (queries,)),
        "variant: the mask as an additive bias made once per step": (bias_variant, (queries,)),
        "variant: one softmax per part, combined (flash-style, no join)": (flash_variant, (queries,)),
        "variant: scale in the mask's select, outputs summed by addmm": (late_scale_variant, (queries,)),
        "bound: the held sink, with the scale in the select and addmm": (
            lambda qs: late_scale_variant(qs, held_sink=True), (queries,)),
        f"peer: scores (q.k over {a.peer_window}, query group as rows)": (
            lambda qs, kv: [(q * scale).reshape(1, hkv, hq // hkv, d) @ k.swapaxes(-1, -2) for q, (k, _) in zip(qs, kv)],
            (queries, peer_kv)),
        "peer: softmax": (lambda ss_: [mx.softmax(s, axis=-1) for s in ss_], (peer_scores,)),
        "peer: output product": (lambda ps, kv: [p @ v for p, (_, v) in zip(ps, kv)], (peer_probs, peer_kv)),
    }
    fns = {name: (mx.compile(fn), args) for name, (fn, args) in cases.items()}
    # kernels per layer: the graph's nodes that are not views, as written and as compiled (where
    # mx.compile fuses element-wise chains into one kernel), `evaluate.opcount`'s count
    kernels = {name: {how: opcount.summary(opcount.graph_ops(*[x for _, x in tree_flatten(f(*args))]))["kernels"] / n_layers
                      for how, f in (("as written", cases[name][0]), ("compiled", fns[name][0]))}
               for name, (_, args) in cases.items()}
    reference = mx.stack(ours(queries))
    differences = {name: mx.abs(mx.stack(fn(*args)) - reference).max().item()
                   for name, (fn, args) in fns.items() if name.startswith(("variant", "bound"))}
    for fn, args in fns.values():       # traced and warmed
        for _ in range(3):
            mx.eval(fn(*args))
    times: dict = {name: [] for name in fns}
    rng = random.Random(a.seed)
    order = list(fns)
    for _ in range(a.rounds):
        rng.shuffle(order)
        for name in order:
            median_us(*fns[name], times[name])
    shapes = {"query heads": hq, "kv heads": hkv, "head dim": d, "layers": n_layers,
              "sink": sinks[0][0].shape[2] if sinks[0] else 0, "packed tokens": packed[0][1][0].shape[-2],
              "near tier tokens": nears[0][1][0].shape[-2] if nears[0] else 0,
              "residual buffer slots": buffers[0][0].shape[2], "residual slots read": slot - first + 1,
              "peer keys": a.peer_window}
    load_avg = list(os.getloadavg())
    print(f"{a.policy} at {a.context} tokens, {n_layers} layers: {shapes}; load {load_avg[0]:.2f}")
    print(f"{'part (all layers, one compiled call)':58s} {'median us':>10s} {'per layer':>10s} {'kernels/layer':>14s}")
    rows_out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows_out[name] = {"median_us": med, "per_layer_us": med / n_layers, "kernels_per_layer": kernels[name],
                          "rounds_us": ts}
        print(f"{name:58s} {med:10.1f} {med / n_layers:10.2f} {kernels[name]['as written']:6.1f} {kernels[name]['compiled']:6.1f}")
    whole = rows_out["ours: the whole attention (_TracedKivi.attend)"]["median_us"]
    fused = rows_out[f"peer: mx.fast.scaled_dot_product_attention over {a.peer_window}"]["median_us"]
    print(f"ours / peer: {whole / fused:.2f}; largest difference from ours: {differences}")
    if a.json:
        write_atomic(a.json, json.dumps({"command": " ".join(["python -m benchmarks.kivi_window_attend_parts", *sys.argv[1:]]),
                       "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
                       "load_average_at_start": load_at_start, "model": a.model, "policy": a.policy, "context": a.context, "after": a.after, "rounds": a.rounds,
                       "seed": a.seed, "shapes": shapes, "load_average_at_end": load_avg, "parts": rows_out,
                       "ours_over_peer": whole / fused,
                       "variant_max_abs_difference": differences}, indent=1) + "\n")


if __name__ == "__main__":
    main()
