"""The host's graph build of retrieval's decode step (`sink4/hot1024`, the compiled step) against
the size of its cold store, and against what the CPU evaluated just before the build, beside the
full fp32 cache's build, in one interleaved run (issue 53: `bench --parts` measured retrieval's
32K build 1.47x its 4K one with the same trace).

Each retrieval cache prefills a prompt of `--prompt` random tokens, then its cold stores are
grown to the context with copies of their own pages (retrieval_bench.grow_cold; `--real`:
the whole context prefilled through the policy instead, minutes per 32K here). The full cache
prefills `--prompt` tokens (its decode step builds the same graph at any context), or each of
`--full-contexts` (prefilled for real: about 8 minutes for 32K on this loaded CPU), where its
own evaluation before a build is that context's. Each build is
timed under two conditions, the (cache, condition) pairs shuffled every round (one more
retrieval cache, at the first context, records its retrievals: `KVCache.record_retrievals`,
off by default since issue 53):

- `own`: after the cache's own previous step was evaluated (a decode loop's order);
- `after_32k_full`: after an evaluation like a 32K full cache's step (one query attending over
  32K fp32 keys and values in each of the shipped model's 4 layers: 128 MiB streamed, four times
  the CPU's last-level cache), the neighbour `bench --parts` puts before most of retrieval's
  builds at 32K.

    python -m benchmarks.retrieval_build [--contexts 4096,32768] [--full-contexts 4096,32768] [--steps 30]
        [--real] [--model PATH] [--ops N] [--json PATH]

`--ops N`: each cache's graph nodes and kernels per decode step (`bench`'s `decode_ops` /
`decode_kernels`, averaged over N steps) beside its build times.

`--model`: another model than the shipped one (SmolLM2's GGUF, say); the neighbour stays the
shipped model's 32K step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks._args import model_or_exit, token_counts

CONDITIONS = ("own", "after_32k_full")


def _stream_32k_full() -> callable:
    """An evaluation like a 32K full cache's decode step on the shipped model (4 layers, 4 heads of
    dim 32): one query's attention over 32,768 fp32 keys and values per layer."""
    kv = [mx.random.normal((2, 1, 4, 32768, 32), key=mx.random.key(i)) for i in range(4)]
    mx.eval(kv)

    def run() -> None:
        outs = []
        for i, layer in enumerate(kv):
            q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(100 + i))
            outs.append(mx.softmax((q @ layer[0].swapaxes(-1, -2)) * 0.17, axis=-1) @ layer[1])
        mx.eval(outs)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768", help="retrieval contexts, comma list of token counts")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens prefilled before the cold stores grow")
    ap.add_argument("--steps", type=int, default=30, help="timed rounds (each times every cache and condition)")
    ap.add_argument("--real", action="store_true", help="prefill each whole context through the policy")
    ap.add_argument("--full-contexts", default=None,
                    help="contexts of the full fp32 cache, prefilled for real (default: --prompt tokens)")
    ap.add_argument("--model", default=None, help="model name or path (default: the shipped model)")
    ap.add_argument("--ops", type=int, default=0,
                    help="also count each cache's graph nodes and kernels per decode step over this many steps")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    contexts = token_counts(ap, "--contexts", a.contexts)
    if a.prompt <= 1028:
        ap.error(f"--prompt {a.prompt}: more than the hot window and sink (1,028 tokens)")
    full = token_counts(ap, "--full-contexts", a.full_contexts) if a.full_contexts else [a.prompt]
    if not full or min(full) < 1:
        ap.error(f"--full-contexts {a.full_contexts!r}: give positive token counts")
    if not contexts or min(contexts) < a.prompt:
        ap.error(f"--contexts {a.contexts!r}: each at least --prompt ({a.prompt}) tokens")
    if a.steps < 1:
        ap.error(f"--steps {a.steps}: give at least 1")
    if a.ops < 0:
        ap.error(f"--ops {a.ops}: give 0 (not counted) or more steps")

    from tinygpt_mlx.cli.common import write_atomic
    from tinygpt_mlx.evaluate.bench import make_policy, step_ops
    from tinygpt_mlx.evaluate.retrieval_bench import grow_cold
    from tinygpt_mlx.generate import forward, prefill

    model = model_or_exit(ap, a.model)
    caches: dict = {}
    made = ([("fp32", "fp32", c) for c in full] + [("sink4/hot1024", "sink4/hot1024", c) for c in contexts]
            + [("sink4/hot1024 recording", "sink4/hot1024", contexts[0])])
    for name, spec, ctx in made:
        cache = make_policy(spec, model).make()
        if name.endswith("recording"):      # its telemetry on (KVCache.record_retrievals; off by default)
            cache.record_retrievals()
        n = ctx if spec == "fp32" or a.real else a.prompt
        mx.eval(prefill(model, mx.random.randint(0, 1000, (n,), key=mx.random.key(0)).tolist(), cache, 512))
        if spec != "fp32" and ctx > n:
            grow_cold(cache, ctx)
        for s in range(6):      # past the first traces
            mx.eval(forward(model, mx.array([[7 + s]]), cache))
        caches[(name, ctx)] = cache
        print(f"  {name} at {ctx:,} tokens ready", file=sys.stderr, flush=True)
    # graph nodes / kernels per decode step (load-independent), counted before the timed rounds
    ops = {key: step_ops(model, cache, a.ops) for key, cache in caches.items()} if a.ops else {}
    neighbour = _stream_32k_full()
    pairs = [(k, c) for k in caches for c in CONDITIONS]
    build: dict = {p: [] for p in pairs}
    rng = random.Random(0)
    for step in range(a.steps):
        rng.shuffle(pairs)
        for key, cond in pairs:
            if cond == "after_32k_full":
                neighbour()
            else:       # the cache's own step, evaluated, right before
                mx.eval(forward(model, mx.array([[5 + step % 50]]), caches[key]))
            t0 = time.perf_counter()
            logits = forward(model, mx.array([[7 + step % 50]]), caches[key])
            t1 = time.perf_counter()
            mx.eval(logits)
            build[(key, cond)].append(t1 - t0)
    rows = []
    for cond in CONDITIONS:
        for key in caches:
            # against the full cache at the same context where one ran, else at its first context
            ref_ctx = key[1] if ("fp32", key[1]) in caches else full[0]
            ref = statistics.median(build[(("fp32", ref_ctx), cond)]) * 1e6
            us = statistics.median(build[(key, cond)]) * 1e6
            rows.append({"policy": key[0], "context": key[1], "condition": cond, "build_us": round(us, 1),
                         "vs_fp32": round(us / ref, 3), "fp32_context": ref_ctx,
                         **({"decode_ops": ops[key]["ops"], "decode_kernels": ops[key]["kernels"],
                             "decode_ops_by_primitive": ops[key]["by_primitive"]} if ops else {})})
            print(f"{cond:>15}  {key[0]:>24} {key[1]:>7,}  build {us:7.0f} us  ({us / ref:.2f}x fp32 at {ref_ctx:,})",
                  flush=True)
    if a.json is not None:
        write_atomic(a.json, json.dumps({"steps": a.steps, "prompt": a.prompt, "real": a.real, "full_contexts": full, "model": a.model,
                                         "rows": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
