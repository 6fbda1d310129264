"""A long generation through the loop `sample` runs (`generate.steps`), measured as it goes: every
`--every` tokens one line with the decode tokens/s over those tokens, the process's current and
peak RSS, the cache's bytes and its stored count against currentLength. For docs/streaming.md:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.long_generation --tokens 100000 --policy sink4/window252 --json docs/results/streaming_100k.json

Sampling is --temperature 0.8 with --seed 0 and EOS ignored (`sample --ignore-eos`); nothing is
detokenized. Lines go to stdout as they come, so it can run in the background (nohup ... &).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import peak_rss_bytes, steps
from tinygpt_mlx.loading import load
from tinygpt_mlx.sampling import make_sampler


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the shipped one)")
    ap.add_argument("--policy", default="sink4/window252", help="cache policy spec (CacheConfig.from_spec)")
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=1000, help="tokens per measured line")
    ap.add_argument("--prompt", default="And it came to pass")
    ap.add_argument("--json", type=Path, default=None, help="write every line as JSON here (atomically)")
    a = ap.parse_args()
    if a.tokens < 1 or a.every < 1:
        ap.error(f"--tokens and --every must be positive, got {a.tokens} and {a.every}")
    loaded = load(a.model)
    config = CacheConfig.from_spec(a.policy)
    cache = make_cache(loaded.model, config)
    prompt = loaded.tokenizer.encode(a.prompt)
    sampler = make_sampler(0.8, seed=0)
    rows = []
    t0 = time.perf_counter()
    generated = 0
    for step in steps(loaded.model, prompt, cache, sampler, a.tokens, 512):
        if step.token is None:
            continue
        generated += 1
        if generated % a.every == 0 or generated == a.tokens:
            now = time.perf_counter()
            row = {"generated": generated, "current_length": cache.current_length,
                   "stored_count": cache.stored_count, "cache_bytes": cache.nbytes,
                   "decode_tokens_per_s": (a.every if generated % a.every == 0 else generated % a.every) / (now - t0),
                   "rss_bytes": current_rss_bytes(), "peak_rss_bytes": peak_rss_bytes()}
            rows.append(row)
            print(json.dumps(row), flush=True)
            t0 = time.perf_counter()
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"policy": a.policy, "prompt": a.prompt, "tokens": a.tokens, "every": a.every,
                                   "rows": rows}, indent=1))
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
