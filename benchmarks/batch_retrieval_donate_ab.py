"""In-process A/B of the compiled retrieval step's body writes in place (compiled_retrieval.DONATED_BODY, issue
#56): the shipped model loaded twice, one copy's traces made with the flag on, the other's with it off (each model
holds its own traces); per copy four caches (retrieval sink4/hot128, bench_server_parallel's prompts) warmed by
WARM batched steps, and four more stepped alone. Then BLOCKS blocks, in each (order shuffled per block) STEPS
batched steps of each copy's four rows and STEPS lone steps of each of its other four caches, the flag set to the
copy's before each. Per case: process CPU and calling-thread CPU per token (medians over blocks), MLX's peak
memory above the active memory per step (median), and how many of the first row's body and cold buffers were not
written in place in the block's steps (their addresses moved); ratio = lone / batched CPU per token, per copy.
--hot N: retrieval sink4/hotN; --prefill N: N tokens of the prompts' text prefilled after each prompt (a longer
context: --model a GGUF, e.g. SmolLM2 with --hot 1024 --prefill 2000).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m benchmarks.batch_retrieval_donate_ab --blocks 20 --json OUT.json

(session 43, docs/server.md "Retrieval's four-row step: where a row's cost goes; the hot window written in place")."""
import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.batch_rows import setup
from benchmarks.bench_server_parallel import PROMPTS, policies
from tinygpt_mlx import blas
from tinygpt_mlx.cache import compiled_retrieval
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.generate import call, prefill
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch


def addresses(cache) -> list:
    """The data addresses of a cache's hot-window and cold-row buffers, each layer's keys and values (a
    zero-copy view of each; tests/test_retrieval_in_place.py reads them too)."""
    out = []
    for layer in cache.owned:
        for a in (layer.body.keys, layer.body.values, layer.cold.keys.array, layer.cold.values.array):
            view = np.asarray(memoryview(a))
            out.append(view.__array_interface__["data"][0])
            del view
    return out


def long_setup(loaded, config, rows: int, filler: int, warm: int) -> tuple[list, list[int]]:
    """`rows` caches of `config`, each a prompt followed by `filler` tokens of the prompts' text prefilled,
    then `warm` batched steps; (the caches, their next tokens)."""
    m, tok = loaded.model, loaded.tokenizer
    text = tok.encode(" ".join(PROMPTS) * (filler // 8 + 1))[:filler]
    caches, tokens = [], []
    for p in PROMPTS[:rows]:
        c = make_cache(m, config)
        tokens.append(int(mx.argmax(prefill(m, tok.encode(p) + text, c, 512)).item()))
        caches.append(c)
    for _ in range(warm):
        _, tokens = batch.decode_step(m, tokens, caches, argmax=True)
    return caches, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tinygpt-base.tinygpt")
    ap.add_argument("--warm", type=int, default=180, help="batched steps before the timed blocks")
    ap.add_argument("--steps", type=int, default=16, help="steps per case and block")
    ap.add_argument("--blocks", type=int, default=20, help="blocks, each case once per block in shuffled order")
    ap.add_argument("--hot", type=int, default=128, help="the hot window (retrieval sink4/hotN)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="tokens of text prefilled after each prompt (0: the prompt alone, batch_rows' setup)")
    ap.add_argument("--json", required=True, help="where to write the result")
    a = ap.parse_args()
    if min(a.warm, a.steps, a.blocks, a.hot) < 1 or a.prefill < 0:
        ap.error(f"--warm, --steps, --blocks and --hot must be positive and --prefill at least 0 "
                 f"(got {a.warm}, {a.steps}, {a.blocks}, {a.hot}, {a.prefill})")
    if not Path(a.model).expanduser().exists():
        ap.error(f"--model {a.model}: no such file or directory")
    cfg = policies(a.hot)[f"retrieval sink4/hot{a.hot}"]
    th = blas.Threads()
    copies = {}
    for flag in (True, False):
        compiled_retrieval.DONATED_BODY = flag
        loaded = load(a.model)
        made = (lambda: setup(loaded, cfg, 4, a.warm, 0)) if not a.prefill else (
            lambda: long_setup(loaded, cfg, 4, a.prefill, a.warm))
        copies[flag] = {"model": loaded.model, "batched": list(made()), "lone": list(made())}
    cases = [(flag, kind) for flag in (True, False) for kind in ("batched", "lone")]
    got = {c: [] for c in cases}
    calling = {c: [] for c in cases}
    peak = {c: [] for c in cases}
    moved = {c: 0 for c in cases}
    rng = random.Random(0)
    load0 = os.getloadavg()
    for _ in range(a.blocks):
        order = cases[:]
        rng.shuffle(order)
        for flag, kind in order:
            compiled_retrieval.DONATED_BODY = flag
            m = copies[flag]["model"]
            caches, tokens = copies[flag][kind]
            th.for_decode()
            cpu = thread = 0.0
            peaks = []
            for _ in range(a.steps):
                before = addresses(caches[0])
                mx.synchronize()
                active = mx.get_active_memory()
                mx.reset_peak_memory()
                c0, t0 = time.process_time(), time.thread_time()
                if kind == "lone":
                    for i, c in enumerate(caches):
                        lg = call(m, [tokens[i]], c, wait=False)
                        p = mx.argmax(lg)
                        mx.eval(lg, p)
                        tokens[i] = p.item()
                else:
                    _, tokens = batch.decode_step(m, tokens, caches, argmax=True)
                cpu += time.process_time() - c0
                thread += time.thread_time() - t0
                peaks.append(mx.get_peak_memory() - active)
                moved[(flag, kind)] += sum(x != y for x, y in zip(before, addresses(caches[0])))
            copies[flag][kind][1] = tokens
            got[(flag, kind)].append(cpu / (4 * a.steps) * 1e3)
            calling[(flag, kind)].append(thread / (4 * a.steps) * 1e3)
            peak[(flag, kind)].append(statistics.median(peaks))
            th.for_prefill()
    name = {True: "in_place", False: "before"}
    med = {f"{name[f]}_{k}": statistics.median(v) for (f, k), v in got.items()}
    out = {"command": "python -m benchmarks.batch_retrieval_donate_ab " + " ".join(
               f"--{k} {v}" for k, v in vars(a).items() if k != "json"),
           "model": Path(a.model).name, "hot": a.hot, "prefill": a.prefill, "warm": a.warm, "steps": a.steps, "blocks": a.blocks, "load_start": load0, "load_end": os.getloadavg(),
           "cpu_ms_per_token_median": med,
           "calling_thread_ms_per_token_median": {f"{name[f]}_{k}": statistics.median(v) for (f, k), v in calling.items()},
           "peak_bytes_over_active_per_step_median": {f"{name[f]}_{k}": statistics.median(v) for (f, k), v in peak.items()},
           "buffers_moved_first_row": {f"{name[f]}_{k}": v for (f, k), v in moved.items()},
           "buffers_checked_first_row": a.blocks * a.steps * 4 * len(copies[True]["batched"][0][0].owned),
           "ratio_cpu_in_place": med["in_place_lone"] / med["in_place_batched"],
           "ratio_cpu_before": med["before_lone"] / med["before_batched"],
           "same_tokens_batched": copies[True]["batched"][1] == copies[False]["batched"][1],
           "same_tokens_lone": copies[True]["lone"][1] == copies[False]["lone"][1],
           "cpu_ms_per_token": {f"{name[f]}_{k}": v for (f, k), v in got.items()}}
    compiled_retrieval.DONATED_BODY = True
    print(json.dumps({k: v for k, v in out.items() if k != "cpu_ms_per_token"}, indent=1))
    write_atomic(Path(a.json), json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
