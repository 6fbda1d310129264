"""Prefill tokens/s with glibc's mmap threshold at its own ceiling and at tinygpt_mlx/heap.py's,
interleaved in one process: each (policy, threshold) pair has its own cache, and the thresholds
are set (`mallopt`) before each timed chunk, the order rotating chunk by chunk.

glibc's own threshold is dynamic: it starts at 128 KiB and rises to the size of a freed mmapped
block up to 32 MiB, so "glibc" here fixes it at that ceiling (trim threshold 64 MiB, twice it,
as glibc sets it), the most a process that is not tuned gets; "kept" is `heap.keep_large_blocks`'s
(256 MiB, trim 512 MiB). Ratios are against the first policy at the same threshold.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.heap_prefill --context 16384 --policies sink4/window1020,sink4/hot1024 [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx import heap

MODES = {"glibc": (32 << 20, 64 << 20), "kept": (heap.MMAP_THRESHOLD, heap.TRIM_THRESHOLD)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens prefilled per cache")
    ap.add_argument("--policies", default="sink4/window1020,sink4/hot1024", help="bench policy specs, comma list")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.context < 1 or a.chunk < 1:
        ap.error(f"--context {a.context} / --chunk {a.chunk}: give positive token counts")
    if not sys.platform.startswith("linux") or heap._libc() is None:
        ap.error("glibc's mallopt is needed (Linux)")
    specs = [s.strip() for s in a.policies.split(",") if s.strip()]
    if not specs:
        ap.error(f"--policies {a.policies!r}: give at least one policy spec")

    from tinygpt_mlx.cli.common import load_model, write_atomic
    from tinygpt_mlx.evaluate.bench import make_policy, parse_spec

    for spec in specs:
        try:
            parse_spec(spec)
        except ValueError as e:
            ap.error(f"--policies {a.policies!r}: {e}")
    libc = heap._libc()
    model = load_model(None).model
    vocab = model(mx.array([[0]])).shape[-1]
    tokens = mx.random.randint(0, vocab, (a.context,), key=mx.random.key(0))
    runs = [(s, m) for m in MODES for s in specs]
    caches = [make_policy(s, model).make() for s, _ in runs]
    mx.eval(model(mx.zeros((1, min(a.chunk, a.context)), dtype=mx.int32)))
    seconds = [0.0] * len(runs)
    for k in range(-(-a.context // a.chunk)):
        chunk = tokens[None, k * a.chunk:(k + 1) * a.chunk]
        for i in range(len(runs)):
            j = (i + k) % len(runs)
            mmap, trim = MODES[runs[j][1]]
            libc.mallopt(-3, mmap)      # M_MMAP_THRESHOLD
            libc.mallopt(-1, trim)      # M_TRIM_THRESHOLD
            t0 = time.perf_counter()
            mx.eval(model(chunk, cache=caches[j]))
            seconds[j] += time.perf_counter() - t0
    rows = []
    for (spec, mode), s in zip(runs, seconds):
        ref = seconds[runs.index((specs[0], mode))]
        rows.append({"policy": spec, "threshold": mode, "prefill_tokens_per_s": round(a.context / s, 1),
                     "vs_first_policy": round(ref / s, 3)})
        print(f"{spec:>24} {mode:>6}  {a.context / s:8.1f} tok/s  x{ref / s:.2f} of {specs[0]}", flush=True)
    for spec in specs:
        glibc, kept = (seconds[runs.index((spec, m))] for m in MODES)
        print(f"{spec:>24} kept / glibc: {glibc / kept:.2f}x tok/s", flush=True)
    if a.json is not None:
        write_atomic(a.json, json.dumps({"context": a.context, "chunk": a.chunk, "modes": MODES,
                                         "load": os.getloadavg(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
