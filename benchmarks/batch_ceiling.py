"""The most batching can give a model call on this machine (issue #56): the bare model forward,
one call of --rows rows against --rows calls of one row, with as little cache work as can be
taken away, and the server's own work per token beside it.

The model calls, each pair timed in the same rounds (the order shuffled every round; --steps
decode steps a round; medians and quartiles over --rounds rounds of the per-round ratio),
on one OpenBLAS thread as `serve` runs its decode steps (blas.Threads):

  none            the model with no cache at all: one token attends to itself (the projections,
                  RoPE, MLP, head and the per-operation work; no K/V read or written)
  fixed           each layer attends over --context tokens of K/V made once and never written
                  (`FixedCache`: update_and_fetch hands back the same arrays; no write, no copy)
  fixed-compiled  the same call as one compiled MLX function (mx.compile): no Python per operation
  kvcache         mlx-lm's own KVCache (writes each token; trimmed back to --context after every
                  round, so every pair steps the same lengths)

Each one-row call is evaluated on its own, as a lone request's step is (`solo`); the JSON also
gives the one-row calls of a step built together and evaluated once (`solo_joint`: how
bench_server_parallel's `engine_peer_*` columns timed them, a faster baseline).

The server's work per token, in this process, on the tokens the model generates greedily:
detokenising (`TextStream.add`), sampling at temperature 0.8 (`make_sampler`, one `.item()`),
the worker's event (`Job.emit` into the outbox, `Worker._flush` once per step of --rows tokens,
delivered on a running asyncio loop) and the handler's NDJSON line (ollama's `generate_chunk`
dict, `json.dumps`). From these and the model calls, the server's ratio if it added only that
work: rows x (solo step + o) / (batched step + rows x o), o the greedy request's work per token.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python -m benchmarks.batch_ceiling \\
      models/tinygpt-base.tinygpt --json docs/results/batch_ceiling_tinygpt_base.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx import blas
from tinygpt_mlx.loading import load
from tinygpt_mlx.cli.common import write_atomic

VARIANTS = ("none", "fixed", "fixed-compiled", "kvcache")


class FixedCache:
    """A layer cache of K/V made once: `update_and_fetch` hands back the same arrays and writes
    nothing (the new token's own K/V are dropped), the offset never moves. The cost of a model
    call's attention over `keys.shape[2]` tokens with no cache work at all; its logits are not a
    model's (the timing only needs their shape)."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return None


def _kv_shape(model) -> tuple[int, int]:
    """(KV heads, head dim) of the model's attention layers."""
    for layer in model.layers:
        attn = getattr(layer, "attn", None) or getattr(layer, "self_attn", None)
        heads = getattr(attn, "n_kv_heads", None)
        if heads:
            dim = getattr(attn, "head_dim", None) or attn.k_proj.weight.shape[0] // heads
            return heads, dim
    raise ValueError("no attention layer with n_kv_heads found")


def calls(model, rows: int, context: int, seed: int = 0) -> dict:
    """Per variant: (one-row step functions, the batched step function, reset after a round).
    Each step function takes the tokens ([1, 1] or [rows, 1] int32) and returns the next ones
    (argmax of the last logits), not evaluated."""
    from mlx_lm.models import cache as mlx_cache
    heads, dim = _kv_shape(model)
    n = len(model.layers)
    mx.random.seed(seed)

    def kv(b):
        return [(mx.random.normal((b, heads, context, dim)), mx.random.normal((b, heads, context, dim)))
                for _ in range(n)]

    def pick(logits):
        return mx.argmax(logits[:, -1:], axis=-1)

    out = {}
    out["none"] = ([lambda t: pick(model(t))] * rows, lambda t: pick(model(t)), lambda: None)
    solo_kv, batch_kv = [kv(1) for _ in range(rows)], kv(rows)
    mx.eval(solo_kv, batch_kv)

    def fixed(kvs):
        caches = [FixedCache(k, v) for k, v in kvs]
        return lambda t: pick(model(t, cache=caches))

    out["fixed"] = ([fixed(s) for s in solo_kv], fixed(batch_kv), lambda: None)
    out["fixed-compiled"] = ([mx.compile(fixed(s)) for s in solo_kv], mx.compile(fixed(batch_kv)), lambda: None)
    # mlx-lm's KVCache: prefilled with `context` random tokens, trimmed back to them after each round
    prompt = mx.random.randint(0, model.embed.weight.shape[0] if hasattr(model, "embed") else 1000,
                               (rows, context)).astype(mx.int32)
    solo_c = [mlx_cache.make_prompt_cache(model) for _ in range(rows)]
    batch_c = mlx_cache.make_prompt_cache(model)
    for i, c in enumerate(solo_c):
        mx.eval(model(prompt[i:i + 1], cache=c))
    mx.eval(model(prompt, cache=batch_c))

    def reset():
        for c in [*solo_c, batch_c]:
            for layer in c:
                if layer.offset > context:
                    layer.trim(layer.offset - context)

    out["kvcache"] = ([lambda t, c=c: pick(model(t, cache=c)) for c in solo_c],
                      lambda t: pick(model(t, cache=batch_c)), reset)
    return out


def time_models(model, rows: int, context: int, steps: int, rounds: int, variants: list[str], seed: int = 0,
                server_s: float = 0.0) -> dict:
    """Per variant: each mode's median step (ms, wall and CPU), the per-round ratio of the one-row
    calls' time to the batched call's (median, quartiles), and that ratio with `server_s` seconds
    of the server's work added per token: (solo + rows x o) / (batched + rows x o), per round."""
    fns = calls(model, rows, context, seed)
    first = mx.array([[1]], dtype=mx.int32)
    # warm up every function (compiles its trace), then reset
    for v in variants:
        solo, batched, reset = fns[v]
        for f in solo:
            mx.eval(f(first))
        mx.eval(batched(mx.concatenate([first] * rows)))
        reset()
    kinds = [(v, mode) for v in variants for mode in ("solo", "solo_joint", "batched")]
    wall = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = kinds[:]
        rng.shuffle(order)
        for v, mode in order:
            solo, batched, reset = fns[v]
            toks = [first] * rows
            bt = mx.concatenate(toks)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                if mode == "solo":             # each lone request's step evaluated on its own
                    toks = [f(t) for f, t in zip(solo, toks)]
                    for t in toks:
                        mx.eval(t)
                        t.item()
                elif mode == "solo_joint":     # the rows' one-row graphs built, then one evaluation
                    toks = [f(t) for f, t in zip(solo, toks)]
                    mx.eval(toks)
                    [t.item() for t in toks]
                else:
                    bt = batched(bt)
                    mx.eval(bt)
                    bt.tolist()
            wall[(v, mode)].append((time.perf_counter() - t0) / steps)
            cpu[(v, mode)].append((time.process_time() - c0) / steps)
            reset()
    res = {}
    for v in variants:
        r = {}
        for mode in ("solo", "solo_joint", "batched"):
            r[f"{mode}_step_ms"] = round(1e3 * statistics.median(wall[(v, mode)]), 4)
            r[f"{mode}_step_cpu_ms"] = round(1e3 * statistics.median(cpu[(v, mode)]), 4)
        for base in ("solo", "solo_joint"):
            per = sorted(s / b for s, b in zip(wall[(v, base)], wall[(v, "batched")]))
            per_cpu = sorted(s / b for s, b in zip(cpu[(v, base)], cpu[(v, "batched")]))
            q = statistics.quantiles(per, n=4) if len(per) > 1 else [per[0]] * 3
            qc = statistics.quantiles(per_cpu, n=4) if len(per_cpu) > 1 else [per_cpu[0]] * 3
            key = "x" if base == "solo" else "x_vs_joint"
            r[key] = {"median": round(q[1], 3), "q1": round(q[0], 3), "q3": round(q[2], 3),
                      "min": round(per[0], 3), "max": round(per[-1], 3)}
            r[key + "_cpu"] = {"median": round(qc[1], 3), "q1": round(qc[0], 3), "q3": round(qc[2], 3)}
        o = rows * server_s
        per = sorted((s + o) / (b + o) for s, b in zip(wall[(v, "solo")], wall[(v, "batched")]))
        q = statistics.quantiles(per, n=4)
        r["x_with_server_work"] = {"median": round(q[1], 3), "q1": round(q[0], 3), "q3": round(q[2], 3)}
        res[v] = r
    return res


def per_token_server_work(loaded, tokens: list[int], rows: int, repeats: int) -> dict:
    """Microseconds per token of the server's own work around a greedy (and a sampled) token."""
    from tinygpt_mlx.sampling import make_sampler
    from tinygpt_mlx.server.ollama import generate_chunk
    from tinygpt_mlx.server.worker import Job, Worker
    from tinygpt_mlx.textstream import TextStream

    tok = loaded.tokenizer
    out = {}

    def best(fn, n):        # the median over `repeats` runs of fn(), per unit of n
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1e6 * statistics.median(times) / n, 2)

    def detok():
        s = TextStream(tok, ())
        for t in tokens:
            s.add(t)
        s.finish()

    out["detokenize_us"] = best(detok, len(tokens))
    pieces = []
    s = TextStream(tok, ())
    for t in tokens:
        pieces.append(s.add(t))
    vocab = loaded.model.embed.weight.shape[0] if hasattr(loaded.model, "embed") else 49152
    logits = mx.random.normal((vocab,))
    mx.eval(logits)
    sampler = make_sampler(0.8, 1.0, 0, 0)
    n = min(64, len(tokens))
    out["sample_temperature_us"] = best(lambda: [int(sampler(logits[None])[0].item()) for _ in range(n)], n)
    out["argmax_separate_us"] = best(lambda: [int(mx.argmax(logits).item()) for _ in range(n)], n)

    # the worker's event per token: emit into the outbox, one flush per step of `rows` tokens, on a
    # running loop (its thread delivers them into the jobs' queues)
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    jobs = []
    for _ in range(rows):
        job = Job(ids=[0], max_tokens=1, loop=loop, events=None)
        job.events = asyncio.run_coroutine_threadsafe(_make_queue(), loop).result()
        job.outbox = []
        jobs.append(job)
    shared: list = []
    for job in jobs:
        job.outbox = shared
    flusher = type("F", (), {"_outbox": shared})()

    def events():
        for p in pieces:
            for job in jobs:
                job.emit("text", p)
            Worker._flush(flusher)
        asyncio.run_coroutine_threadsafe(_drain([j.events for j in jobs]), loop).result()

    out["event_worker_us"] = best(events, len(pieces) * rows)
    loop.call_soon_threadsafe(loop.stop)
    th.join(timeout=5)

    def lines():
        for p in pieces:
            json.dumps(generate_chunk("tinygpt-base", p), ensure_ascii=False)

    out["ndjson_line_us"] = best(lines, len(pieces))
    out["greedy_total_us"] = round(out["detokenize_us"] + out["event_worker_us"] + out["ndjson_line_us"], 2)
    return out


async def _make_queue() -> asyncio.Queue:
    return asyncio.Queue()


async def _drain(queues) -> None:
    for q in queues:
        while not q.empty():
            q.get_nowait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--rows", type=int, default=4, help="rows of the batched call (and one-row calls)")
    ap.add_argument("--context", type=int, default=128, help="cached tokens each row attends over")
    ap.add_argument("--steps", type=int, default=16, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens the per-token part works on")
    ap.add_argument("--blas-threads", type=int, default=1,
                    help="OpenBLAS threads for the model calls (default 1, as serve's decode steps; 0: its own count)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for name, value, least in (("--rows", args.rows, 2), ("--context", args.context, 1), ("--steps", args.steps, 1),
                               ("--rounds", args.rounds, 2), ("--tokens", args.tokens, 8),
                               ("--blas-threads", args.blas_threads, 0)):
        if value < least:
            ap.error(f"{name} must be at least {least}, got {value}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    if not Path(args.model).expanduser().exists():
        ap.error(f"model {args.model}: no such file or directory")
    loaded = load(str(Path(args.model).expanduser()))
    model = loaded.model
    threads = blas.Threads(decode=args.blas_threads or 1 << 16)
    start_load = list(os.getloadavg())
    # the tokens the per-token part detokenises: a greedy reply of the model
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.generate import call, prefill
    ids = loaded.tokenizer.encode("The history of the city begins")
    with make_cache(model, CacheConfig()) as c:
        t = int(mx.argmax(prefill(model, ids, c, 512)).item())
        tokens = [t]
        for _ in range(args.tokens - 1):
            t = int(mx.argmax(call(model, [t], c)).item())
            tokens.append(t)
    work = per_token_server_work(loaded, tokens, args.rows, repeats=max(5, args.rounds // 4))
    threads.for_decode()
    try:
        models = time_models(model, args.rows, args.context, args.steps, args.rounds, variants,
                             server_s=work["greedy_total_us"] / 1e6)
    finally:
        threads.for_prefill()
    res = {"model": Path(args.model).stem, "command": " ".join(sys.argv), "rows": args.rows, "context": args.context,
           "steps": args.steps, "rounds": args.rounds,
           "openblas_threads": (args.blas_threads or threads.default) if threads.available else None,
           "load_average_at_start": start_load, "load_average_at_end": list(os.getloadavg()),
           "models": models, "per_token_server_work": work}
    for v, r in models.items():
        x = r["x"]
        print(f"{v:<15} one row {r['solo_step_ms']:.3f} ms x{args.rows}, {args.rows} rows {r['batched_step_ms']:.3f} ms: "
              f"x{x['median']:.2f} (quartiles {x['q1']:.2f}-{x['q3']:.2f}; per CPU-s x{r['x_cpu']['median']:.2f}; "
              f"vs one-row calls evaluated together x{r['x_vs_joint']['median']:.2f}); with the server's per-token "
              f"work x{r['x_with_server_work']['median']:.2f}", flush=True)
    print("server work per token (us): " + ", ".join(f"{k} {v}" for k, v in work.items()))
    print(f"load average {start_load[0]:.2f} -> {res['load_average_at_end'][0]:.2f}")
    if args.json:
        write_atomic(args.json, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
