"""Which part of int4 KIVI error flips greedy tokens, and would another 4-bit scheme fix it?
(a measurement, not a policy)

Runs greedy decoding through the real cache with the frozen blocks *fake-quantised*: each block
is quantised and dequantised in fp32 when it freezes and then stored dense, so any grouping can be
tried (MLX's kernels only take G = 32/64/128 along the packed axis). `k4v4` reproduces the packed
int4 cache's tokens (dequantised vs packed attention agree to < 1e-4). Prints the mean greedy
prefix match against the fp32 cache per variant:

    kKvV            keys K bits per channel over G=32 tokens, values V bits per token (KIVI)
    k4g16, k4g8     finer key groups (16 or 8 tokens)
    v4g16, v4g8     finer value groups (16 or 8 channels); v4g64had: a group suffix before the others
    k4pre           keys quantised before RoPE (KVQuant)
    k4had, v4had    a Hadamard rotation of the head dimension before quantising (QuaRot)
    k4out2          the 2 largest-norm tokens of each key block kept exact (dense-and-sparse)
    k4L3, v4L0 ...  only layer i quantised (the others exact)
    clip            each group's range shrunk about its middle to the least-MSE of 7 ratios
    sink4           the first 4 tokens of the sequence kept exact (left out of their block's ranges)
    exact0.29       layers 0 and 29 kept exact (the others quantised as the spec says)
    +topN           exact top-N refinement (what `--kv-exact-topk N` does)

    python -m benchmarks.kivi_variants_probe models/tinygpt-base.tinygpt \\
        --prompts docs/results/kivi_long_prompts_48.txt --variants k4v4,k4,v4,k4g8,v4g8,k4L3
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re

import mlx.core as mx
import numpy as np

from tinygpt_mlx.cache import kivi, make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.compare import greedy_tokens, prefix_match, read_prompts
from tinygpt_mlx.evaluate.bench import make_policy
from tinygpt_mlx.generate import forward
from tinygpt_mlx.loading import load


def fake_quant(x: mx.array, bits: int, group: int, axis: int) -> mx.array:
    """Affine min/max quantise-dequantise of x [B, H, T, D] in groups along axis -2 (tokens) or -1."""
    x = x.astype(mx.float32)
    if axis == -2:
        x = mx.swapaxes(x, -1, -2)
    *lead, n = x.shape
    g = x.reshape(*lead, n // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)

    def qdq(lo, hi):
        step = mx.maximum((hi - lo) / (2 ** bits - 1), 1e-8)
        return mx.clip(mx.round((g - lo) / step), 0, 2 ** bits - 1) * step + lo

    out = qdq(lo, hi)
    if ACTIVE.get("clip"):      # per group, the range shrunk about its middle that gives the least MSE
        best = ((out - g) ** 2).sum(-1, keepdims=True)
        mid = (lo + hi) / 2
        for r in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
            cand = qdq(mid - (mid - lo) * r, mid + (hi - mid) * r)
            err = ((cand - g) ** 2).sum(-1, keepdims=True)
            out = mx.where(err < best, cand, out)
            best = mx.minimum(err, best)
    out = out.reshape(*lead, n)
    return mx.swapaxes(out, -1, -2) if axis == -2 else out


def hadamard(n: int) -> mx.array:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / math.sqrt(n), dtype=mx.float32)


def key_quantiser(bits: int, group: int, how: str):
    def f(k: mx.array, store) -> mx.array:
        if how == "had":
            H = hadamard(k.shape[-1])
            return fake_quant(k @ H, bits, group, -2) @ H.T
        if how == "pre":    # undo RoPE at the tokens' positions, quantise, rotate back
            pre = store.positions.rotate_rows(k, -store.frozen, -1)
            return store.positions.rotate_rows(fake_quant(pre, bits, group, -2), store.frozen, 1)
        if how.startswith("out"):   # largest-norm tokens exact, left out of the ranges
            m = int(how[3:])
            norm = (k * k).sum(-1)
            exact = (norm >= mx.sort(norm, axis=-1)[..., -m][..., None])[..., None]
            keep = ~exact
            mean = (k * keep).sum(-2, keepdims=True) / mx.maximum(keep.sum(-2, keepdims=True), 1)
            return mx.where(exact, k, fake_quant(mx.where(exact, mean, k), bits, group, -2))
        return fake_quant(k, bits, group, -2)
    return f


def value_quantiser(bits: int, group: int, how: str):
    def f(v: mx.array, store) -> mx.array:
        if how == "had":
            H = hadamard(v.shape[-1])
            return fake_quant(v @ H, bits, group, -1) @ H.T
        return fake_quant(v, bits, group, -1)
    return f


_PART = re.compile(r"(k|v)(\d)(g\d+)?(pre|had|out\d+)?(L\d+)?")


def parse(spec: str) -> dict:
    """'k4v4+top16' -> {"k": ..., "v": ..., "topk": 16}; kN/vN parts may carry a suffix."""
    out: dict = {"layers": {}}
    for part in spec.split("+"):
        if part.startswith("top"):
            out["topk"] = int(part[3:])
            continue
        if part == "clip":
            out["clip"] = True
            continue
        if part.startswith("sink"):
            out["sink"] = int(part[4:])
            continue
        if part.startswith("tier"):     # tierN or tierN.B: the newest N frozen tokens at B bits (8); tierk: keys only
            keys_only = part.startswith("tierk")
            n, _, b = part[5 if keys_only else 4:].partition(".")
            out["tier"], out["tier_bits"], out["tier_keys_only"] = int(n), int(b or 8), keys_only
            continue
        if part.startswith("exact"):
            out["exact"] = {int(i) for i in part[5:].split(".")}
            continue
        for m in re.finditer(r"[kv]\d(?:g\d+)?(?:pre|had|out\d+)?(?:L\d+)?", part):
            side, bits, g, how, layer = _PART.fullmatch(m[0]).groups()
            how = how or ""
            group = int(g[1:]) if g else 32
            make = key_quantiser if side == "k" else value_quantiser
            out[side] = make(int(bits), group, how)
            if layer:
                out["layers"][side] = int(layer[1:])
    return out


ACTIVE: dict = {}


def _quantise_block(self, k: mx.array, v: mx.array) -> tuple:
    for side in ("k", "v"):
        layer = ACTIVE["layers"].get(side)
        if self.layer_index in ACTIVE.get("exact", ()):
            continue
        if side in ACTIVE and (layer is None or layer == self.layer_index):
            if side == "k":
                k = ACTIVE["k"](k, self)
            else:
                v = ACTIVE["v"](v, self)
    return k, v


def _freeze(self, n: int) -> None:
    """KiviStore._freeze, storing fake-quantised dense blocks (and the exact shadow if asked)."""
    k, v = self.residual.drop_front(n)
    k, v = k.astype(mx.float32), v.astype(mx.float32)
    if self.shadow is not None:
        self.shadow.append(k, v)
    sink = max(0, min(ACTIVE.get("sink", 0) - self.frozen, n))
    exact_k, exact_v = k[:, :, :sink], v[:, :, :sink]
    if sink:    # left out of the block's ranges: stand in the block's mean there
        k = mx.concatenate([mx.broadcast_to(k[:, :, sink:].mean(2, keepdims=True), exact_k.shape), k[:, :, sink:]], 2)
    raw_k, raw_v = k, v
    k, v = _quantise_block(self, k, v)
    if sink:
        k = mx.concatenate([exact_k, k[:, :, sink:]], 2)
        v = mx.concatenate([exact_v, v[:, :, sink:]], 2)
    if ACTIVE.get("tier"):      # the newest blocks at more bits: re-quantise the block leaving the tier
        blocks = self.__dict__.setdefault("_tier_blocks", [])
        blocks.append((raw_k, raw_v, sink, exact_k, exact_v))
        edge = len(blocks) - max(1, ACTIVE["tier"] // n)
        parts = []
        for i, (bk, bv, s_, ek, ev) in enumerate(blocks):
            if i < edge:
                qk, qv = _quantise_block(self, bk, bv)
            else:
                qk, qv = _quantise_block(self, bk, bv)
                qk = fake_quant(bk, ACTIVE["tier_bits"], 32, -2)
                if not ACTIVE["tier_keys_only"]:
                    qv = fake_quant(bv, ACTIVE["tier_bits"], 32, -1)
            if s_:
                qk, qv = mx.concatenate([ek, qk[:, :, s_:]], 2), mx.concatenate([ev, qv[:, :, s_:]], 2)
            parts.append((qk, qv))
        self.tiers.packed.keys = (mx.concatenate([p[0] for p in parts], 2),)
        self.tiers.packed.values = (mx.concatenate([p[1] for p in parts], 2),)
    else:
        run = self.tiers.packed
        run.keys = (k,) if run.keys is None else (mx.concatenate([run.keys[0], k], 2),)
        run.values = (v,) if run.values is None else (mx.concatenate([run.values[0], v], 2),)
    self.tiers.packed.n += n
    self.frozen += n


def teacher_forced(model, ids: list[int], config: CacheConfig, chunk: int, skip: int = 256) -> mx.array:
    """Log-probabilities [T - skip, V] of every position after the first `skip`, the prompt fed
    through a cache under `config` in chunks of `chunk` tokens."""
    out = []
    cache = make_policy(config, model).make() if isinstance(config, str) else make_cache(model, config)
    with contextlib.nullcontext(cache) if isinstance(config, str) else cache:
        for i in range(0, len(ids), chunk):
            logits = forward(model, mx.array(ids[i:i + chunk])[None], cache)[0].astype(mx.float32)
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            lo = max(0, skip - i)
            if lo < logits.shape[0]:
                out.append(logits[lo:])
                mx.eval(out[-1])
    return mx.concatenate(out)


def print_kl(spec: str, model, config, refs: list, prompts: list, chunk: int, before=lambda: None) -> None:
    """One line: mean KL(fp32 || variant) and top-1 agreement over every prompt's positions
    (`before` runs ahead of each prompt's cache)."""
    kl = agree = n = 0.0
    for ref, ids in zip(refs, prompts):
        before()
        got = teacher_forced(model, ids, config, chunk)
        kl += (mx.exp(ref) * (ref - got)).sum().item()
        agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        n += ref.shape[0]
    kl_text = f"{kl / n:.5f}" if kl / n >= 1e-3 else f"{kl / n:.2e}"
    print(f"{spec:14s} KL {kl_text}  top-1 agreement {agree / n:.4f}  ({int(n)} positions)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", required=True, help="one prompt per line")
    ap.add_argument("--variants", default="k4v4,k4,v4,k4g16,k4g8,v4g16,v4g8,k4pre,k4had,v4had,k4out2,"
                                          "k4L0,k4L1,k4L2,k4L3,v4L0,v4L1,v4L2,v4L3,k4v4+top16,k4v4+top64")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--every", type=int, default=1, help="use every n-th prompt (a quick screen)")
    ap.add_argument("--kl", type=int, default=0, metavar="CHUNK",
                    help="instead of greedy decoding, feed each prompt in chunks of CHUNK tokens and "
                         "report KL(fp32 || variant) and top-1 agreement over its positions after the "
                         "first 256 (smoother than a greedy prefix; CHUNK 32 = the residual's size)")
    ap.add_argument("--real", action="store_true",
                    help="with --kl: variants are policy specs run through the real caches "
                         "(int4+rot+esink4, mlx-q4, ...), not fake-quantised blocks")
    ap.add_argument("--max-len", type=int, default=0, help="cut prompts to this many tokens (0: as given)")
    a = ap.parse_args()
    loaded = load(a.model)
    n_layers = len(loaded.model.layers)
    prompts = [loaded.tokenizer.encode(p) for p in read_prompts(a.prompts)[::a.every]]
    if a.max_len:
        prompts = [ids[:a.max_len] for ids in prompts]
    if a.kl and min(map(len, prompts)) <= 256:
        raise SystemExit(f"kivi_variants_probe: --kl scores positions after the first 256 tokens; "
                         f"{a.prompts} has a prompt of {min(map(len, prompts))} tokens")
    if a.kl:
        refs = [teacher_forced(loaded.model, ids, CacheConfig(), a.kl) for ids in prompts]
    else:
        refs = [greedy_tokens(loaded.model, ids, CacheConfig(), a.tokens) for ids in prompts]

    if a.real:      # the caches as they are: each variant a policy spec (ours or mlx-lm's)
        for spec in a.variants.split(","):
            cfg = spec if spec.startswith("mlx-") else CacheConfig.from_spec(spec)
            print_kl(spec, loaded.model, cfg, refs, prompts, a.kl)
        return
    count = [0]
    init = kivi.KiviStore.__init__

    def tagged_init(self, *args, **kw):   # caches are built layer by layer, in order
        init(self, *args, **kw)
        self.layer_index = count[0] % n_layers
        count[0] += 1
        self.key_bits = self.value_bits = None   # blocks are stored dense (fake-quantised)
        self.tiers.packed.key_bits = self.tiers.packed.value_bits = None

    kivi.KiviStore.__init__ = tagged_init
    kivi.KiviStore._freeze = _freeze
    for spec in a.variants.split(","):
        ACTIVE.clear()
        ACTIVE.update(parse(spec))
        topk = ACTIVE.get("topk", 0)
        cfg = CacheConfig(key_bits=4, value_bits=4, exact_topk=topk, shadow_store="ram" if topk else "disk")
        if a.kl:
            print_kl(spec, loaded.model, cfg, refs, prompts, a.kl, before=lambda: count.__setitem__(0, 0))
            continue
        matched = []
        for ref, ids in zip(refs, prompts):
            count[0] = 0
            matched.append(prefix_match(ref, greedy_tokens(loaded.model, ids, cfg, a.tokens))[0])
        print(f"{spec:14s} mean prefix match {sum(matched) / a.tokens / len(matched):.3f}  "
              f"prompts reproduced {sum(m == a.tokens for m in matched)}/{len(matched)}", flush=True)


if __name__ == "__main__":
    main()
