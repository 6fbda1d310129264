"""Would quantising keys before RoPE help KIVI on this model? (a measurement, not a policy)

Prefills a prompt into an fp32 cache, takes every layer's keys (post-RoPE, as KIVI stores them
in absolute mode) and compares two int-N per-channel schemes over blocks of G tokens:
  post: quantise the post-RoPE keys (what KIVI does now);
  pre:  undo RoPE, quantise, dequantise, re-apply RoPE (KVQuant's pre-RoPE keys).
Reports the relative key error and the error of attention logits q.k (queries = the layer's
own keys of the last 64 positions, scaled like attention) against the exact keys.

    python -m benchmarks.kivi_prerope_probe models/tinygpt-base.tinygpt --prompts docs/results/kivi_long_prompts.txt
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from tinygpt_mlx import quant
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import prefill
from tinygpt_mlx.loading import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--prompts", required=True, help="one prompt per line")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    a = ap.parse_args()
    loaded = load(a.model)
    model = loaded.model
    prompts = [p for p in open(a.prompts, encoding="utf-8").read().split("\n") if p.strip()]
    sums = {"post": [0.0, 0.0], "pre": [0.0, 0.0]}
    for text in prompts:
        ids = loaded.tokenizer.encode(text)
        cache = make_cache(model, CacheConfig())
        mx.eval(prefill(model, ids, cache, 512))
        for layer in cache.owned:
            k, _ = layer.fetch()                                   # [B, H, T, D] post-RoPE
            T = (k.shape[2] // a.group) * a.group
            k = k[:, :, :T].astype(mx.float32)
            rope = layer.positions.rope
            B, H, _, D = k.shape
            flat = k.transpose(2, 0, 1, 3).reshape(T * B * H, 1, D)
            pos = mx.repeat(mx.arange(T), B * H)
            k_pre = rope(flat, offset=-pos)
            q = k[:, :, -64:] / (D ** 0.5)
            exact = q @ k.swapaxes(-1, -2)
            for name in sums:
                src = k if name == "post" else k_pre.reshape(T, B, H, D).transpose(1, 2, 0, 3)
                deq = quant.dequantise_k(*quant.quantise_k(src, a.bits, a.group), a.bits, a.group)
                if name == "pre":
                    f = deq.transpose(2, 0, 1, 3).reshape(T * B * H, 1, D)
                    deq = rope(f, offset=pos).reshape(T, B, H, D).transpose(1, 2, 0, 3)
                err = mx.sqrt(((deq - k) ** 2).sum() / (k ** 2).sum()).item()
                logit = mx.abs(q @ deq.swapaxes(-1, -2) - exact).mean().item()
                sums[name][0] += err
                sums[name][1] += logit
        n = len(prompts) * len(cache.owned)
    for name, (e, lg) in sums.items():
        print(f"int{a.bits} G{a.group} {name}-RoPE keys: relative key error {e / n:.4f}, "
              f"mean |logit error| {lg / n:.4f}")


if __name__ == "__main__":
    main()
