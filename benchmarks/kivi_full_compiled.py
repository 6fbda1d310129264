"""Mean and median decode step of a full KIVI cache with its quiet steps compiled (issue #54),
against the same cache stepped eagerly (`int4@eager`) and mlx-lm's QuantizedKVCache(4), after one
prefill and `--warmup` untimed steps, the caches stepped in an order shuffled every round: the
mean carries what the medians of `bench` leave out, the trace of a new shape once a block
freezes (every G = 32 steps) and the eager freeze steps themselves. The warm-up keeps out a
one-time cost of the process: the first traces compile MLX's fused CPU kernels (seconds in all,
once; its seconds per policy are printed beside). Not a test.

    python -m benchmarks.kivi_full_compiled [--model M] [--context 1024] [--steps 256] [--warmup 64]
        [--policies int4,int4@eager,mlx-q4] [--json FILE]

Prints one line per policy (mean, median, 95th percentile and slowest of the whole step in ms, and the mean
and median as ratios against the last policy) to stdout; --json writes them too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx.evaluate.bench import make_policy
from tinygpt_mlx.generate import forward
from tinygpt_mlx.loading import load


def step_times(model, specs: list[str], context: int, steps: int, warmup: int, chunk: int = 512,
               seed: int = 0) -> tuple[dict, dict]:
    """Seconds of each of `steps` decode steps (model call and evaluation) per spec, after the same
    `context` random tokens prefilled in chunks and `warmup` untimed steps (their seconds returned
    apart); the caches stepped in a shuffled order every round."""
    caches = [make_policy(s, model).make() for s in specs]
    vocab = model(mx.array([[0]])).shape[-1]
    ids = mx.random.randint(0, vocab, (context,), key=mx.random.key(seed)).tolist()
    for cache in caches:
        for i in range(0, context, chunk):
            mx.eval(forward(model, mx.array([ids[i:i + chunk]]), cache))
    rng = random.Random(seed)
    order = list(range(len(specs)))
    times: list[list[float]] = [[] for _ in specs]
    warm = [0.0 for _ in specs]
    for step in range(warmup + steps):
        rng.shuffle(order)
        for i in order:
            t0 = time.perf_counter()
            mx.eval(forward(model, mx.array([[7 + step % 50]]), caches[i]))
            dt = time.perf_counter() - t0
            if step < warmup:
                warm[i] += dt
            else:
                times[i].append(dt)
    return dict(zip(specs, times)), dict(zip(specs, warm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the shipped one)")
    ap.add_argument("--policies", default="int4,int4@eager,mlx-q4",
                    help="bench's policy names, comma-separated; ratios are against the last")
    ap.add_argument("--context", type=int, default=1024, help="tokens prefilled before the timed steps")
    ap.add_argument("--steps", type=int, default=256, help="timed decode steps per policy")
    ap.add_argument("--warmup", type=int, default=64, help="untimed decode steps per policy before them")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    a = ap.parse_args()
    if a.context < 1 or a.steps < 1 or a.warmup < 0:
        sys.exit(f"kivi_full_compiled: --context and --steps must be positive and --warmup not negative, "
                 f"got {a.context}, {a.steps} and {a.warmup}")
    specs = [s for s in a.policies.split(",") if s]
    try:
        model = load(a.model).model
        times, warm = step_times(model, specs, a.context, a.steps, a.warmup)
    except (ValueError, OSError) as e:
        sys.exit(f"kivi_full_compiled: {e}")
    rows = {}
    base = times[specs[-1]]
    for s, t in times.items():
        ms = sorted(1000 * x for x in t)
        rows[s] = {"mean_ms": statistics.fmean(ms), "median_ms": statistics.median(ms),
                   "p95_ms": ms[int(0.95 * (len(ms) - 1))], "max_ms": ms[-1],
                   "slowest_share": sum(ms[-len(ms) // 50:]) / sum(ms),     # of the time: the slowest 2% of steps
                   "mean_ratio": statistics.fmean(t) / statistics.fmean(base),
                   "median_ratio": statistics.median(t) / statistics.median(base), "warmup_s": warm[s]}
        r = rows[s]
        print(f"{s:>12s}  mean {r['mean_ms']:.3f} ms  median {r['median_ms']:.3f} ms  p95 {r['p95_ms']:.3f} ms  max {r['max_ms']:.1f} ms  "
              f"mean x{r['mean_ratio']:.3f}  median x{r['median_ratio']:.3f} (of {specs[-1]})  "
              f"warm-up {a.warmup} steps {r['warmup_s']:.2f} s", flush=True)
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"context": a.context, "steps": a.steps, "warmup": a.warmup, "policies": rows},
                                  indent=1))
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
