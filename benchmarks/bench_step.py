"""Median time of one decode step (the model call, eviction and evaluation) per cache policy, on
the shipped model after a prefill: the per-token cost of the hot path with nothing else timed.

    python -m benchmarks.bench_step [--context 1024] [--steps 150] [--policies fp32,int4,sink4/window252]

To compare two checkouts (e.g. before and after a redesign), run it from each checkout's root in
turn several times (`python -m` puts the directory it runs in first on the path, so each run
imports that checkout's tinygpt_mlx) and compare the smallest medians: docs/results.md has an
example.
Prints one line: the label and each policy's median ms per step; --json writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load


def parse(spec: str) -> CacheConfig:
    # the spec grammar of the checkout under test (older checkouts: evaluate.modes.parse_policy)
    try:
        return CacheConfig.from_spec(spec)
    except AttributeError:
        from tinygpt_mlx.evaluate.modes import parse_policy
        return parse_policy(spec)


def median_step_ms(model, config: CacheConfig, context: int, steps: int, chunk: int = 512) -> float:
    cache = make_cache(model, config)
    ids = [1 + i % 4000 for i in range(context)]
    for i in range(0, context, chunk):
        mx.eval(model(mx.array([ids[i:i + chunk]]), cache=cache))
    token = mx.array([[5]])

    def step():
        out = model(token, cache=cache)
        mx.eval(out)
    for _ in range(10):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the shipped one)")
    ap.add_argument("--policies", default="fp32,int4,sink4/window252")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    model = load(a.model).model
    res = {s: median_step_ms(model, parse(s), a.context, a.steps) for s in a.policies.split(",")}
    print(a.label, " ".join(f"{k} {v:.3f} ms" for k, v in res.items()), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps({"label": a.label, "context": a.context, "ms_per_step": res}, indent=1))


if __name__ == "__main__":
    main()
