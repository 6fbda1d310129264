"""Prompt-cache files per policy: file size, save time, load time vs re-prefill time
(docs/prompt-cache.md). Each policy prefills a document of N tokens, saves it, loads it back
(fingerprint + checksum checked, disk rows copied into a private dir) and checks that one more
token gives bit-identical logits in both caches. Numbers from one process, same run.

    python -m benchmarks.bench_prompt_cache [--model M] [--tokens 4096,32768] [--policies int4,hot256,...]
                                         [--json out.json]

Policy specs as in `--policies` (evaluate/modes.py) plus ":disk" (cold store on disk) and
":ram" / ":disk" for the shadow via shadowram/shadowdisk. The full-cache policies run past
the shipped model's 512-token context here: timing only (the library does not refuse it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.persist import load_prompt_cache, save_prompt_cache
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.generate import forward, prefill
from tinygpt_mlx.loading import load


def policy(spec: str):
    disk = spec.endswith(":disk")
    cfg = parse_policy(spec[:-5] if disk else spec)
    return dataclasses.replace(cfg, cold_store="disk") if disk else cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--policies", default="full,bf16,int8,int4,int2,k8v4,int4+top16+shadowdisk,"
                    "sink4/window256,sink4/window256:absolute,hot256,hot256:disk,int4+sink4/window256")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loaded = load(args.model)
    vocab = loaded.tokenizer.vocab_size if hasattr(loaded.tokenizer, "vocab_size") else 4000
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-pcache-"))
    for n in (int(t) for t in args.tokens.split(",")):
        doc = np.random.RandomState(n).randint(1, min(vocab, 4000), n).tolist()
        for spec in args.policies.split(","):
            cfg = policy(spec)
            path = tmp / "doc.ptc"
            with make_cache(loaded.model, cfg) as cache:
                t0 = time.perf_counter()
                logits = prefill(loaded.model, doc, cache, args.chunk)
                t_prefill = time.perf_counter() - t0
                t0 = time.perf_counter()
                save_prompt_cache(path, cache, loaded, doc, logits)
                t_save = time.perf_counter() - t0
                nbytes, disk = cache.nbytes, cache.disk_nbytes
                t0 = time.perf_counter()
                loaded_cache, info = load_prompt_cache(path, loaded)
                t_load = time.perf_counter() - t0
                with loaded_cache:
                    a = forward(loaded.model, mx.array([[7]]), cache)[0, -1]
                    b = forward(loaded.model, mx.array([[7]]), loaded_cache)[0, -1]
                    same = bool(mx.array_equal(a, b))
            row = {"policy": spec, "tokens": n, "file_bytes": path.stat().st_size, "cache_bytes": nbytes,
                   "disk_bytes": disk, "prefill_s": t_prefill, "save_s": t_save, "load_s": t_load,
                   "speedup": t_prefill / t_load, "identical_next_logits": same}
            rows.append(row)
            print(f"{n:>6} {spec:<28} file {row['file_bytes'] / 2**20:8.2f} MiB  prefill {t_prefill:8.2f} s  "
                  f"save {t_save:6.3f} s  load {t_load:6.3f} s  x{row['speedup']:7.1f}  identical={same}",
                  flush=True)
            path.unlink()
            if args.json:
                Path(args.json).write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()}",
                                                       "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
