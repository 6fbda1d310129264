"""Decode speed of KIVI caches against full-precision caches, interleaved step by step.

Each policy's cache is prefilled with the same random tokens; then decode steps run in turn
(fp32 step, fp16 step, int8 step, ...) so that load from other processes hits every policy
alike. Prints a markdown table of ms/token (min and median) and tokens/s from the median.
`--fill random` fills every layer's cache with random K/V through `update_and_fetch` instead
of running the model over the prompt (the cost of a decode step depends on what is stored,
not on where it came from; a 32K prefill of the 512-context model on this CPU takes ~10 min
per policy). Not a test.  Usage:
    python -m benchmarks.bench_kivi_decode MODEL --lengths 1024 8192 --policies fp32,fp16,int8,int4
    python -m benchmarks.bench_kivi_decode MODEL --lengths 1024 8192 32768 --fill random
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.generate import forward, prefill
from tinygpt_mlx.loading import load


def fill_random(model, cache, T: int, chunk: int) -> None:
    """Write T random tokens' K/V (N(0, 1), the model's KV shape) into every owned layer cache."""
    cfg = model.config if hasattr(model, "config") else model.args
    hkv = getattr(cfg, "n_kv_heads", None) or cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or cfg.d_model // cfg.n_heads
    key = mx.random.key(1)
    for layer in cache.owned:
        for s in range(0, T, chunk):
            n = min(chunk, T - s)
            key, k1, k2 = mx.random.split(key, 3)
            mx.eval(layer.update_and_fetch(mx.random.normal((1, hkv, n, dh), key=k1),
                                           mx.random.normal((1, hkv, n, dh), key=k2)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--policies", default="fp32,fp16,int8,int4,int2,k8v4", help="evaluate.modes specs")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                    help="prefill: run the model over random tokens; random: write random K/V directly")
    args = ap.parse_args()
    loaded = load(args.model)
    model, vocab = loaded.model, loaded.tokenizer.vocab_size
    names = [p.strip() for p in args.policies.split(",")]
    print(f"model {loaded.name}, device {mx.default_device()}, {args.steps} interleaved decode steps\n")
    print("| stored tokens | policy | cache MiB in RAM | on disk | ms/token min | ms/token median | tok/s (median) | vs fp32 |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for T in args.lengths:
        toks = mx.random.randint(0, vocab, (T,), key=mx.random.key(0)).tolist()
        caches = {n: make_cache(model, parse_policy(n)) for n in names}
        for c in caches.values():
            if args.fill == "prefill":
                mx.eval(prefill(model, toks, c, args.chunk))
            else:
                fill_random(model, c, T, args.chunk)
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.steps):
            token = mx.array([[toks[i]]])
            for n, c in caches.items():
                t0 = time.perf_counter()
                mx.eval(forward(model, token, c))
                times[n].append(time.perf_counter() - t0)
        base = sorted(times[names[0]])[args.steps // 2]
        for n in names:
            s = sorted(times[n])
            med = s[len(s) // 2]
            disk = caches[n].disk_nbytes
            print(f"| {T} | {n} | {(caches[n].nbytes - disk) / 2**20:.2f} | {disk / 2**20:.2f} | "
                  f"{s[0] * 1e3:.2f} | {med * 1e3:.2f} | "
                  f"{1 / med:.1f} | {base / med:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
