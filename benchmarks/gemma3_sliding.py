"""Gemma 3 270M's sliding-window layers as our exact rings of their window (issue 55).

Two checks on the real GGUF (`python scripts/fetch_gemma3.py`), fp32 on the CPU backend:

* greedy ids after each prompt of benchmarks.gemma3_hf_reference (four short ones inside the
  512-token window, two of ~700 and ~2,000 tokens past it) under our full policy (15 sliding
  layers as rings of 512, 3 global layers full), under mlx-lm's own caches (RotatingKVCache on
  the sliding layers), and with every layer held in full (`make_cache(..., windowed=False)`:
  the model's mask still limits the sliding layers, so the ids should be the same);
* cache bytes after random tokens at each `--length` (`cache.report.fill_and_measure`, the
  numbers `cache-report` shows), for each `--policies` spec: ours, split into global and
  sliding layers, against every layer under that policy (windowed=False), and mlx-lm's own
  caches (which preallocate in steps of 256 tokens) for the full policy.

`--direct` fills the caches without running the model (the long contexts: 32K and 128K tokens
take minutes instead of hours on 2 cores): each layer's cache takes random keys and values of the
model's geometry (its KV heads and head dimension) through its own update path in the chunks the
model would call it with, so every store, ring, KIVI block, cold page and summary is made by the
code a forward pass runs; only attention is not computed. Bytes depend on how many tokens each
layer keeps, not on their values; `--check-direct N` measures both ways at N tokens in the same
run and fails unless they are equal.

Usage (a few minutes at 4K on 2 cores):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.gemma3_sliding --length 4096 --json docs/results/gemma3_sliding.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def greedy_rows(loaded, texts: list[str], tokens: int) -> list[dict]:
    from mlx_lm.models.cache import make_prompt_cache

    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.generate import greedy_tokens

    rows = []
    for text in texts:
        ids = loaded.tokenizer.encode(text)
        ours = greedy_tokens(loaded.model, ids, make_cache(loaded.model, CacheConfig()), tokens, 512)
        mlx_lm = greedy_tokens(loaded.model, ids, make_prompt_cache(loaded.model), tokens, 512)
        every = greedy_tokens(loaded.model, ids, make_cache(loaded.model, CacheConfig(), windowed=False), tokens, 512)
        rows.append({"prompt": text if len(text) < 80 else f"held-out KJV, first {len(text)} characters",
                     "prompt_tokens": len(ids), "same_as_mlx_lm_caches": ours == mlx_lm,
                     "same_as_every_layer_full": ours == every, "text": loaded.tokenizer.decode(ours)})
        print(f"  {rows[-1]['prompt'][:40]!r:44} {len(ids):5d} tokens: same as mlx-lm's caches {ours == mlx_lm}, "
              f"as every layer full {ours == every}", file=sys.stderr)
    return rows


def mlx_lm_bytes(model, length: int, vocab: int, chunk: int = 512) -> int:
    """mlx-lm's own caches after `length` random tokens, filled as fill_and_measure fills ours."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.random.randint(0, vocab, (1, length), key=mx.random.key(0))
    cache, done = make_prompt_cache(model), 0
    while done < length - 1:
        step = min(chunk, length - 1 - done)
        mx.eval(model(tokens[:, done:done + step], cache=cache))
        done += step
    mx.eval(model(tokens[:, done:done + 1], cache=cache))
    return sum(c.nbytes for c in cache)


def fill_direct(model, config, lengths: list[int], chunk: int = 512, windowed: bool = True) -> list:
    """`fill_and_measure`'s rows (cache.report.CacheBytes) without running the model: each layer's
    cache is called as a forward pass calls it (`update_and_fetch` with keys and values
    [1, KV heads, L, head dim] in chunks of `chunk`, the last token alone), with random values;
    attention is not computed."""
    import mlx.core as mx

    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.cache.report import CacheBytes

    args = model.args
    shape = (1, args.num_key_value_heads, args.head_dim)
    cache = make_cache(model, config, windowed=windowed)
    out, done, key, calls = [], 0, mx.random.key(0), 0

    def call(n: int, settle: bool = False) -> None:
        nonlocal key, calls
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((shape[0], shape[1], n, shape[2]), key=k1)
        v = mx.random.normal((shape[0], shape[1], n, shape[2]), key=k2)
        for c in cache.distinct():
            c.update_and_fetch(k, v)
        calls += 1
        if not settle and calls % 16:
            return
        for c in cache.owned:   # evaluate what the calls stored (a cold store: its appends, if lazy)
            for name, store in c.stores().items():
                if name == "cold":
                    getattr(store, "settle", lambda: None)()
                elif hasattr(store, "state"):
                    mx.eval([a for a in store.state()[0].values() if isinstance(a, mx.array)])

    for n in sorted(lengths):
        while done < n - 1:
            step = min(chunk, n - 1 - done)
            call(step)
            done += step
        call(1, settle=True)
        done += 1
        out.append(CacheBytes(config.label(), n, cache.stored_count, cache.nbytes, cache.nbytes_breakdown(),
                              cache.nbytes_split()))
    cache.close()
    return out


def bytes_rows(loaded, lengths: list[int], specs: str, direct: bool = False, every: bool = True) -> list[dict]:
    from tinygpt_mlx.cache.report import fill_and_measure
    from tinygpt_mlx.evaluate.modes import parse_policies

    vocab = loaded.tokenizer.vocab_size or loaded.info.get("config", {}).get("vocab_size")
    rows = []
    for spec, cfg in parse_policies(specs).items():
        fill = fill_direct if direct else (lambda m, c, n, **kw: fill_and_measure(m, c, n, vocab, label=spec, **kw))
        ours = fill(loaded.model, cfg, lengths)
        reference = fill(loaded.model, cfg, lengths, windowed=False) if every else [None] * len(ours)
        for a, b in zip(ours, reference):
            row = {"policy": spec, "tokens": a.tokens, "bytes": a.nbytes, "global_bytes": a.split["global"],
                   "sliding_bytes": a.split["sliding"], "every_layer_bytes": b and b.nbytes,
                   "ratio_to_every_layer": b and round(a.nbytes / b.nbytes, 4),
                   "filled": "direct" if direct else "model"}
            if (not direct and not cfg.quantised and not cfg.streaming and not cfg.retrieval
                    and cfg.storage == "fp32"):
                row["mlx_lm_caches_bytes"] = mlx_lm_bytes(loaded.model, a.tokens, vocab)
            rows.append(row)
            vs = f" vs every layer {b.nbytes / 2**20:8.2f} MiB: {row['ratio_to_every_layer']:.3f}x" if b else ""
            print(f"  {spec:12} {a.tokens:6d} tokens: {a.nbytes / 2**20:8.2f} MiB (global {a.split['global'] / 2**20:.2f}"
                  f" + sliding {a.split['sliding'] / 2**20:.2f}){vs}", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the one scripts/fetch_gemma3.py fetched)")
    ap.add_argument("--tokens", type=int, default=20, help="greedy tokens per prompt (0: skip the greedy check)")
    ap.add_argument("--length", type=int, action="append", help="stored length for the bytes (repeatable; default 4096)")
    ap.add_argument("--policies", default="fp32,int4", help="policy specs for the bytes (comma list)")
    ap.add_argument("--direct", action="store_true",
                    help="fill the caches for the bytes without running the model (see the module's docstring)")
    ap.add_argument("--check-direct", type=int, default=0, metavar="N",
                    help="first measure every policy both ways at N tokens; exit 1 unless equal (0: skip)")
    ap.add_argument("--no-every-layer", action="store_true",
                    help="skip the reference of every layer under the policy (at 128K it is most of the run)")
    ap.add_argument("--json", default=None, help="also write the results here (atomically)")
    args = ap.parse_args()
    from tinygpt_mlx.cli.common import write_atomic
    from tinygpt_mlx.errors import PosttrainError
    from tinygpt_mlx.loading import load
    from tinygpt_mlx.realmodel import gemma3_path

    from .gemma3_hf_reference import prompts

    lengths = args.length or [4096]
    if args.tokens < 0 or args.check_direct < 0 or any(n < 1 for n in lengths):
        ap.error(f"--tokens and --check-direct must be >= 0 and --length >= 1, got {args.tokens}, "
                 f"{args.check_direct} and {lengths}")
    try:
        from tinygpt_mlx.evaluate.modes import parse_policies
        parse_policies(args.policies)
        path = Path(args.gguf) if args.gguf else gemma3_path(fetch=False)
    except (PosttrainError, ValueError) as e:
        ap.error(str(e))
    if not path.is_file():
        ap.error(f"--gguf {path}: no such file")
    t0 = time.perf_counter()
    with load(path) as loaded:
        greedy = greedy_rows(loaded, prompts(), args.tokens) if args.tokens else []
        t_greedy = time.perf_counter()
        check = []
        if args.check_direct:
            model_rows = bytes_rows(loaded, [args.check_direct], args.policies)
            direct_rows = bytes_rows(loaded, [args.check_direct], args.policies, direct=True)
            keys = ("bytes", "global_bytes", "sliding_bytes", "every_layer_bytes")
            check = [{"policy": a["policy"], "tokens": a["tokens"], **{k: [a[k], b[k]] for k in keys},
                      "equal": all(a[k] == b[k] for k in keys)} for a, b in zip(model_rows, direct_rows)]
            if not all(r["equal"] for r in check):
                print(f"direct fill differs from the model's: {[r for r in check if not r['equal']]}", file=sys.stderr)
                sys.exit(1)
        t1 = time.perf_counter()
        sizes = bytes_rows(loaded, lengths, args.policies, direct=args.direct, every=not args.no_every_layer)
    result = {"gguf": path.name, "tokens": args.tokens, "greedy": greedy, "direct_check": check, "bytes": sizes,
              "seconds": {"greedy": round(t_greedy - t0, 1), "direct_check": round(t1 - t_greedy, 1), "bytes": round(time.perf_counter() - t1, 1)}}
    text = json.dumps(result, indent=1) + "\n"
    if args.json:
        write_atomic(Path(args.json), text)
    else:
        print(text)


if __name__ == "__main__":
    main()
