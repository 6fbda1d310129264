"""KIVI (keys per channel + exact residual) against mlx-lm's QuantizedKVCache (keys and values
per token, everything quantised) at the same bits, on the same model and text.

Teacher-forced like `posttrainllm perplexity`: the first `--prefill` tokens in one chunk, the
rest one by one; every policy runs side by side with the fp32 full cache and reports
perplexity, mean KL(fp32 || policy) and top-1 agreement. Policies are `posttrainllm bench`
specs: ours (int4, int4+r0, k8v4, ...) and mlx-lm's (mlx-q8, mlx-q4, mlx-q2).
Not a test.  Usage:
    python -m benchmarks.kivi_vs_mlx_quant MODEL --text data/heldout.txt --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import math
import os

import mlx.core as mx

from tinygpt_mlx.evaluate.bench import make_policy
from tinygpt_mlx.generate import forward
from tinygpt_mlx.loading import load


def log_softmax(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--policies", default="int8,mlx-q8,int4,int4+r0,mlx-q4,int2,int2+r0,mlx-q2,k8v4")
    ap.add_argument("--json", default=None, help="also write the table here (atomically)")
    args = ap.parse_args()
    loaded = load(args.model)
    model = loaded.model
    with open(args.text, encoding="utf-8") as f:
        tokens = loaded.tokenizer.encode(f.read())[: args.tokens + 1]
    specs = [s.strip() for s in args.policies.split(",")]
    caches = {s: make_policy(s, model) for s in ["fp32"] + specs}
    labels = {s: p.label for s, p in caches.items()}
    caches = {s: p.make() for s, p in caches.items()}
    zero = mx.array(0.0)
    acc = {s: {"nll": zero, "kl": zero, "agree": zero} for s in caches}
    n = len(tokens) - 1
    steps = [(0, min(args.prefill, n))] + [(i, i + 1) for i in range(min(args.prefill, n), n)]
    for a, b in steps:
        x, y = mx.array(tokens[a:b])[None], mx.array(tokens[a + 1:b + 1])
        base = None
        for s, cache in caches.items():
            logp = log_softmax(forward(model, x, cache)[0])
            if base is None:
                base = logp
            acc[s]["nll"] = acc[s]["nll"] - mx.take_along_axis(logp, y[:, None], axis=-1).sum()
            acc[s]["kl"] = acc[s]["kl"] + (mx.exp(base) * (base - logp)).sum()
            acc[s]["agree"] = acc[s]["agree"] + (logp.argmax(-1) == base.argmax(-1)).sum()
        mx.eval(acc)
    print(f"model {loaded.name}, {n} scored tokens of {args.text} ({args.prefill}-token prefill, "
          "then one by one)\n")
    print("| policy | cache | cache MiB (RAM) | perplexity | KL(fp32 ‖ policy) | top-1 agreement |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for s, cache in caches.items():
        r = acc[s]
        disk = getattr(cache, "disk_nbytes", 0)
        ram = f"{(cache.nbytes - disk) / 2**20:.2f}" + (f" (+{disk / 2**20:.2f} on disk)" if disk else "")
        print(f"| {s} | {labels[s]} | {ram} | {math.exp(r['nll'].item() / n):.3f} | "
              f"{max(0.0, r['kl'].item() / n):.5f} | {r['agree'].item() / n:.4f} |")
        rows.append({"policy": s, "cache": labels[s], "ram_bytes": int(cache.nbytes - disk),
                     "disk_bytes": int(disk), "perplexity": math.exp(r["nll"].item() / n),
                     "kl": max(0.0, r["kl"].item() / n), "top1_agreement": r["agree"].item() / n})
    if args.json:
        out = {"model": loaded.name, "model_path": args.model, "text": args.text, "scored_tokens": n,
               "prefill": args.prefill, "policies": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
