"""How well a decode step's spilled pages can be guessed ahead (issue 53, cache/spill_stage.py).

A staged step reads the spilled pages its layers' pools will hold before the step, guessed from
earlier steps, and is computed again when any layer's pool holds a spilled page not staged. This
probe prefills a prompt into a retrieval cache with a RAM budget, runs greedy decode steps on the
per-layer path (every pool exact, recorded after each step: `spill_stage._recorded`), and replays
the guess offline: for a guess made of the pools of the last K steps, the share of steps whose
every layer and KV head would have hit, the share of (layer, head) pools covered, and the pages
staged per step. Nothing is timed.

    python -m benchmarks.spill_guess models/tinygpt-base.tinygpt --context 16384 --policy sink4/hot1024+spill32 \
        --steps 48 [--text tinygpt_mlx/data/heldout_kjv.txt] --json docs/results/spill_guess_16k.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np

from tinygpt_mlx.cache import spill_stage
from tinygpt_mlx.evaluate.bench import make_policy, parse_spec
from tinygpt_mlx.evaluate.inputs import read_text
from tinygpt_mlx.generate import prefill
from tinygpt_mlx.loading import load

HISTORY = (1, 2, 4, 8, 16)


def pools(model, cache, tokens: list[int], steps: int) -> tuple[list, list]:
    """Prefill `tokens`, then `steps` greedy decode steps on the per-layer path: per step, per
    layer, the spilled pages [G, K] (-1: none or resident) its pool held; and each layer's
    spilled page count per step."""
    logits = prefill(model, tokens, cache, 512)
    out, spilled = [], []
    for _ in range(steps):
        token = mx.array([[int(mx.argmax(logits).item())]])
        stores = [layer.cold for layer in cache.owned]
        logits = spill_stage._recorded(model, token, cache, stores)[0, -1]
        mx.eval(logits)
        sp = [s.spilled // s.page_size for s in stores]
        out.append([np.where((s.guess >= 0) & (s.guess < n), s.guess, -1) for s, n in zip(stores, sp)])
        spilled.append(sp)
    return out, spilled


def replay(steps: list, history: int) -> dict:
    """The guess of the last `history` steps' pools (page 0 always), replayed over `steps`."""
    hits = covered = heads = staged = 0
    for t in range(history, len(steps)):
        all_hit = True
        for layer, pool in enumerate(steps[t]):
            for g in range(pool.shape[0]):
                want = set(pool[g][pool[g] >= 0].tolist())
                guess = {0}
                for k in range(1, history + 1):
                    row = steps[t - k][layer][g]
                    guess |= set(row[row >= 0].tolist())
                staged += len(guess)
                heads += 1
                if want <= guess:
                    covered += 1
                else:
                    all_hit = False
        hits += all_hit
    n = len(steps) - history
    return {"history": history, "steps": n, "step_hit_rate": hits / n if n else None,
            "head_pools_covered": covered / heads if heads else None,
            "pages_staged_per_step": staged / n if n else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--policy", default="sink4/hot1024+spill32")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--text", help="prompt from this text file, repeated to the context (default: random "
                    "tokens, as bench's prompt: mx.random.randint, key 0)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.context < 1:
        ap.error(f"--context must be a positive integer, got {args.context}")
    if args.steps < 2:
        ap.error(f"--steps must be at least 2, got {args.steps}")
    if args.text and not os.path.isfile(args.text):
        ap.error(f"--text {args.text}: no such file")
    if not os.path.exists(args.model):
        ap.error(f"model {args.model}: no such file or directory")
    try:
        spec = parse_spec(args.policy)
    except ValueError as e:
        ap.error(f"--policy {args.policy!r}: {e}")
    if spec is None or isinstance(spec, str) or getattr(spec, "cold_ram", None) is None:
        ap.error(f"--policy {args.policy!r}: no RAM budget (spillN), nothing would spill")
    loaded = load(args.model)
    model = loaded.model if hasattr(loaded, "model") else loaded[0]
    policy = make_policy(args.policy, model)
    cache = policy.make()
    if args.text:
        ids = loaded.tokenizer.encode(read_text(args.text))
        tokens = (ids * (args.context // len(ids) + 1))[: args.context]
    else:
        vocab = model(mx.array([[0]])).shape[-1]
        tokens = mx.random.randint(0, vocab, (args.context,), key=mx.random.key(0)).tolist()
    t0 = time.time()
    steps, spilled = pools(model, cache, tokens, args.steps)
    G = steps[0][0].shape[0]
    pool_pages = float(np.mean([[(p >= 0).sum() / G for p in step] for step in steps]))
    result = {"model": os.path.basename(args.model), "context": args.context, "policy": args.policy,
              "prompt": args.text or "random tokens (bench's)",
              "decode_steps": args.steps, "layers": len(steps[0]), "kv_rows": G,
              "spilled_pages_per_layer": spilled[-1], "spilled_pool_pages_per_head": pool_pages,
              "guess": [replay(steps, k) for k in HISTORY if k < len(steps)],
              "seconds": round(time.time() - t0, 1)}
    cache.close()
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
