"""The full exact cache's host work per decode step against mlx-lm's `KVCache` (issue #54), and its
whole step, in four measures that a loaded machine moves less than bench's one median:

1. `layer` (measured last, on the caches the rounds below have stepped: `--context` tokens and
   every step since, the same on both): the calls an attention layer of an mlx-lm model makes
   on its cache per decode step (`cache.offset` twice, `update_and_fetch` of one token), timed
   alone on one layer of each cache, in blocks of `--calls` calls, the two alternating block by
   block (nothing evaluated inside a block);
2. `build`: the model's whole decode step built (`generate.forward` before evaluation, what
   `bench --parts` calls the build), the two caches stepped in an order shuffled every step
   after the same prefill, in `--rounds` rounds of `--steps` steps each; the ratio of the two
   medians per round, and the median of those ratios (a load that rises for a round moves
   both caches' steps of that round);
0. `graph`: the first two decode steps' MLX graphs on each cache after the same prefill
   (opcount's nodes by primitive, views included), and whether the two caches' graphs are the
   same (`mx.export_to_dot`'s text, its node ids renamed in order of appearance);
3. `step`: in the same steps, the whole decode step (the build and its evaluation, what bench's
   decode tok/s is one over), its per-round medians and their ratios as for the build.

    python -m benchmarks.full_build_pair [--model M] [--context 1024] [--rounds 30] [--steps 10]
        [--calls 200] [--json FILE]

Prints one line per measure to stdout (ours, mlx-lm's, ratio ours / mlx-lm's: below 1, ours
does less); --json writes them too, with every round's ratio. Not a test.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx.evaluate.bench import make_policy
from tinygpt_mlx.evaluate.opcount import graph_ops
from tinygpt_mlx.generate import forward
from tinygpt_mlx.loading import load

SPECS = ("fp32", "mlx")     # our full exact cache, mlx-lm's KVCache (bench's names)


def prefilled(model, context: int, chunk: int = 512, seed: int = 0) -> dict:
    """Each of SPECS' caches after the same `context` random tokens."""
    vocab = model(mx.array([[0]])).shape[-1]
    ids = mx.random.randint(0, vocab, (context,), key=mx.random.key(seed)).tolist()
    caches = {}
    for spec in SPECS:
        cache = make_policy(spec, model).make()
        for i in range(0, context, chunk):
            mx.eval(forward(model, mx.array([ids[i:i + chunk]]), cache))
        caches[spec] = cache
    return caches


def layer_calls(caches: dict, blocks: int, calls: int) -> dict:
    """Median microseconds of one layer's per-step cache calls (`offset` twice, `update_and_fetch`
    of one token) on layer 0 of each cache, over `blocks` blocks of `calls` calls, alternating."""
    layers = {s: c[0] for s, c in caches.items()}
    k0 = layers["mlx"].keys
    B, H, _, D = k0.shape
    token = mx.random.normal((B, H, 1, D)).astype(k0.dtype)
    mx.eval(token)
    per: dict[str, list[float]] = {s: [] for s in layers}
    for b in range(blocks):
        for s in (SPECS if b % 2 else SPECS[::-1]):
            layer = layers[s]
            t0 = time.perf_counter()
            for _ in range(calls):
                layer.offset
                layer.offset
                kv = layer.update_and_fetch(token, token)
            per[s].append((time.perf_counter() - t0) / calls * 1e6)
            mx.eval(kv)
    return {s: statistics.median(v) for s, v in per.items()}


def graphs(model, caches: dict, steps: int = 2) -> list[dict]:
    """The graphs of the first `steps` decode steps on each cache: each step's nodes by
    primitive, and whether the two caches' graphs are the same (the dot text with every node id
    renamed by first appearance). After a prefill that fills the buffers (a multiple of 256
    tokens) the first step grows them: mlx-lm's KVCache concatenates, ours copies into a new
    buffer (`DenseStore.append`), so that step differs; the next ones do not."""
    out = []
    for step in range(steps):
        ops, dots = {}, {}
        for s in SPECS:
            logits = forward(model, mx.array([[5 + step]]), caches[s])
            ops[s] = graph_ops(logits)
            buf = io.StringIO()
            mx.export_to_dot(buf, logits)
            ids: dict[str, str] = {}
            dots[s] = re.sub(r"\b\d{6,}\b", lambda m: ids.setdefault(m.group(0), f"n{len(ids)}"), buf.getvalue())
            mx.eval(logits)
        out.append({"nodes": {s: sum(o.values()) for s, o in ops.items()},
                    "by_primitive": {s: dict(sorted(o.items())) for s, o in ops.items()},
                    "same_graph": dots["fp32"] == dots["mlx"]})
    return out


def builds(model, caches: dict, rounds: int, steps: int, warmup: int = 5, seed: int = 0) -> dict:
    """Each round's median build and whole step (us) per cache and the per-round ratios ours /
    mlx-lm's (`rounds_us`/`ratios` the build's, `whole_rounds_us`/`whole_ratios` the step's)."""
    rng = random.Random(seed)
    order = list(SPECS)
    out: dict[str, list] = {s: [] for s in SPECS}
    whole_out: dict[str, list] = {s: [] for s in SPECS}
    ratios, whole_ratios = [], []
    for r in range(rounds + 1):
        b: dict[str, list[float]] = {s: [] for s in SPECS}
        w: dict[str, list[float]] = {s: [] for s in SPECS}
        for step in range(warmup if r == 0 else steps):
            rng.shuffle(order)
            for s in order:
                t0 = time.perf_counter()
                logits = forward(model, mx.array([[7 + step % 50]]), caches[s])
                t1 = time.perf_counter()
                mx.eval(logits)
                t2 = time.perf_counter()
                b[s].append(t1 - t0)
                w[s].append(t2 - t0)
        if r == 0:
            continue    # warm-up round
        for s in SPECS:
            out[s].append(statistics.median(b[s]) * 1e6)
            whole_out[s].append(statistics.median(w[s]) * 1e6)
        ratios.append(out["fp32"][-1] / out["mlx"][-1])
        whole_ratios.append(whole_out["fp32"][-1] / whole_out["mlx"][-1])
    return {"rounds_us": out, "ratios": ratios, "whole_rounds_us": whole_out, "whole_ratios": whole_ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the shipped one)")
    ap.add_argument("--context", type=int, default=1024, help="tokens prefilled before the timed steps")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of the build measure")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per cache per round")
    ap.add_argument("--calls", type=int, default=200, help="calls per block of the layer measure (40 blocks)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    a = ap.parse_args()
    for flag, v in (("--context", a.context), ("--rounds", a.rounds), ("--steps", a.steps), ("--calls", a.calls)):
        if v < 1:
            ap.error(f"{flag} must be at least 1, got {v}")
    try:
        model = load(a.model).model
        caches = prefilled(model, a.context)    # one prefill each serves the three measures
        graph = graphs(model, caches)
        built = builds(model, caches, a.rounds, a.steps)
        layer = layer_calls(caches, 40, a.calls)     # last: it appends to layer 0 alone
    except (ValueError, OSError) as e:
        sys.exit(f"full_build_pair: {e}")
    layer_ratio = layer["fp32"] / layer["mlx"]
    medians = {s: statistics.median(v) for s, v in built["rounds_us"].items()}
    ratio = statistics.median(built["ratios"])
    for i, g in enumerate(graph):
        print(f"step {i}'s graph: fp32 {g['nodes']['fp32']} nodes  mlx {g['nodes']['mlx']} nodes  "
              f"{'the same graph' if g['same_graph'] else 'different graphs'}")
    print(f"layer calls per step: fp32 {layer['fp32']:.2f} us  mlx {layer['mlx']:.2f} us  ratio {layer_ratio:.3f}")
    whole = {s: statistics.median(v) for s, v in built["whole_rounds_us"].items()}
    whole_ratio = statistics.median(built["whole_ratios"])
    for what, med, rat, rs in (("build", medians, ratio, built["ratios"]),
                               ("whole step", whole, whole_ratio, built["whole_ratios"])):
        print(f"{what} per step: fp32 {med['fp32']:.0f} us  mlx {med['mlx']:.0f} us  "
              f"median of {a.rounds} round ratios {rat:.3f} (rounds {min(rs):.3f}-{max(rs):.3f})", flush=True)
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"context": a.context, "rounds": a.rounds, "steps": a.steps, "calls": a.calls,
                                   "layer_us": layer, "layer_ratio": layer_ratio, "build_median_us": medians,
                                   "build_ratio_median": ratio, "whole_median_us": whole,
                                   "whole_ratio_median": whole_ratio, "graph": graph, **built}, indent=1))
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
