"""The host's graph build of retrieval's compiled decode step with the model's RoPE as products
(cache/rope_products.py, the default) and without (the RoPE itself in the trace), in one process:
two copies of the model, one whose traces keep its RoPE, each with a `sink4/hot1024` cache whose
cold store is grown to the context, beside the full fp32 cache's eager build; every round times
one build of each in a shuffled order, each right after the cache's own evaluated step (a
decode loop's order), so load moves the three alike. Medians, the paired ratio of each round,
and each trace's graph nodes / kernels per step; the JSON also holds the command, the
LD_PRELOAD it ran under and the load average at its start and end.

    python -m benchmarks.rope_products_ab [--model PATH] [--context 4096] [--rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx

from benchmarks._args import model_or_exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default: the shipped model)")
    ap.add_argument("--context", type=int, default=4096, help="retrieval's context (cold store grown to it)")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens prefilled before the cold stores grow")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.prompt <= 1028:
        ap.error(f"--prompt {a.prompt}: must be more than the hot window and sink (1,028 tokens)")
    if a.context < a.prompt:
        ap.error(f"--context {a.context}: must be at least --prompt ({a.prompt} tokens)")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: give at least 1")

    from tinygpt_mlx.cache import compiled_retrieval, rope_products
    from tinygpt_mlx.cli.common import write_atomic
    from tinygpt_mlx.evaluate.bench import make_policy, step_ops
    from tinygpt_mlx.evaluate.retrieval_bench import grow_cold
    from tinygpt_mlx.generate import forward, prefill

    models = {"products": model_or_exit(ap, a.model), "rope": model_or_exit(ap, a.model)}
    real = rope_products.products
    # the "rope" copy's traces keep the model's RoPE (what the trace held before rope_products)
    compiled_retrieval.rope_products = type("P", (), {"products": staticmethod(
        lambda model, offset: nullcontext() if model is models["rope"] else real(model, offset))})
    load_at_start = list(os.getloadavg())
    prompt = mx.random.randint(0, 1000, (a.prompt,), key=mx.random.key(0)).tolist()
    caches = {}
    for name, spec, model in (("fp32", "fp32", models["products"]), ("products", "sink4/hot1024", models["products"]),
                              ("rope", "sink4/hot1024", models["rope"])):
        cache = make_policy(spec, model).make()
        mx.eval(prefill(model, prompt, cache, 512))
        if spec != "fp32" and a.context > a.prompt:
            grow_cold(cache, a.context)
        for s in range(6):      # past the first traces
            mx.eval(forward(model, mx.array([[7 + s]]), cache))
        caches[name] = (model, cache)
        print(f"  {name} ready", file=sys.stderr, flush=True)
    ops = {name: step_ops(model, cache, 8) for name, (model, cache) in caches.items()}
    build: dict = {name: [] for name in caches}
    order = list(caches)
    rng = random.Random(0)
    for r in range(a.rounds):
        rng.shuffle(order)
        for name in order:
            model, cache = caches[name]
            mx.eval(forward(model, mx.array([[5 + r % 50]]), cache))
            t0 = time.perf_counter()
            logits = forward(model, mx.array([[7 + r % 50]]), cache)
            build[name].append(time.perf_counter() - t0)
            mx.eval(logits)
    med = {name: statistics.median(v) * 1e6 for name, v in build.items()}
    paired = {name: statistics.median(x / f for x, f in zip(build[name], build["fp32"])) for name in build}
    out = {"command": " ".join(["python -m benchmarks.rope_products_ab", *sys.argv[1:]]),
           "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
           "load_average_at_start": load_at_start, "load_average_at_end": list(os.getloadavg()),
           "model": a.model, "context": a.context, "prompt": a.prompt, "rounds": a.rounds,
           "rows": [{"cache": name, "build_us": round(med[name], 1), "vs_fp32": round(med[name] / med["fp32"], 3),
                     "vs_fp32_paired": round(paired[name], 3), "decode_ops": ops[name]["ops"],
                     "decode_kernels": ops[name]["kernels"]} for name in caches],
           "products_vs_rope_paired": round(statistics.median(x / y for x, y in zip(build["products"], build["rope"])), 3)}
    for row in out["rows"]:
        print(f"{row['cache']:>9}  build {row['build_us']:8.0f} us  {row['vs_fp32']:.2f}x fp32 (paired {row['vs_fp32_paired']:.2f}x)"
              f"  nodes {row['decode_ops']:.0f} kernels {row['decode_kernels']:.0f}")
    print(f"products / rope, paired: {out['products_vs_rope_paired']:.3f}"
          f"  (load average {load_at_start[0]:.1f} -> {out['load_average_at_end'][0]:.1f})")
    if a.json is not None:
        write_atomic(a.json, json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
