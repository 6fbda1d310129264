"""A prompt's prefill with the output head at each pass's last position only (`model.last_logits`,
the engine's path) against the head over every position of the pass (the whole model call, sliced
afterwards: the engine before it), in one process.

Each round prefills the same prompt into a fresh cache of each policy both ways, in the order
A B B A (then B A A B the next round), through `generate.prefill`, the loop `sample`, `needle`
and the server run; the pass size is `--chunk`. Per policy: the median prefill seconds each way,
the paired ratio of each round (last-position / whole), its median, and whether the logits after
the prompt were the same both ways (the largest difference). The JSON also holds the command,
the LD_PRELOAD it ran under and the load average at its start and end.

    python -m benchmarks.prefill_head_ab [--model PATH] [--tokens 4096] [--chunk 512] \\
        [--policies fp32,sink4/window1020,sink4/hot1024] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks._args import at_least, model_or_exit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default: the shipped model)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (random tokens)")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per prefill pass (sample's --prefill-chunk)")
    ap.add_argument("--policies", default="fp32,sink4/window1020,sink4/hot1024",
                    help="comma list of bench policy specs (posttrainllm bench --help)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of A B B A (each prefills twice each way)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (atomically)")
    a = ap.parse_args(argv)
    at_least(ap, ("--tokens", a.tokens, 2), ("--chunk", a.chunk, 2), ("--rounds", a.rounds, 1))

    from tinygpt_mlx import generate
    from tinygpt_mlx.cli.common import write_atomic
    from tinygpt_mlx.evaluate.bench import make_policy

    model = model_or_exit(ap, a.model)
    policies = []
    for spec in a.policies.split(","):
        try:
            policies.append(make_policy(spec, model))
        except ValueError as e:
            ap.error(f"--policies {spec!r}: {e}")
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or model.config.vocab_size
    prompt = mx.random.randint(0, vocab, (a.tokens,), key=mx.random.key(0)).tolist()
    last = generate.last_logits

    def whole(m, tokens, cache):           # the engine before `last_logits`: every position's head
        return m(tokens, cache=cache)[:, -1:]

    def run(policy, way) -> tuple[float, mx.array]:
        generate.last_logits = last if way == "last" else whole
        try:
            cache = policy.make()
            t0 = time.perf_counter()
            logits = generate.prefill(model, prompt, cache, a.chunk)
            return time.perf_counter() - t0, logits
        finally:
            generate.last_logits = last

    load_at_start = list(os.getloadavg())
    run(policies[0], "last")                # warm-up: first-call costs fall on neither side
    rows = []
    for policy in policies:
        seconds = {"last": [], "whole": []}
        diff = 0.0
        for r in range(a.rounds):
            order = ["last", "whole", "whole", "last"] if r % 2 == 0 else ["whole", "last", "last", "whole"]
            got = {}
            for way in order:
                s, logits = run(policy, way)
                seconds[way].append(s)
                got.setdefault(way, logits)
            diff = max(diff, mx.abs(got["last"] - got["whole"]).max().item())
            print(f"{policy.name} round {r + 1}/{a.rounds}: last {min(seconds['last'][-2:]):.2f} s, "
                  f"whole {min(seconds['whole'][-2:]):.2f} s", file=sys.stderr, flush=True)
        pairs = [l / w for l, w in zip(seconds["last"], seconds["whole"])]
        rows.append({"policy": policy.name, "label": policy.label,
                     "seconds_last": seconds["last"], "seconds_whole": seconds["whole"],
                     "median_last_s": statistics.median(seconds["last"]),
                     "median_whole_s": statistics.median(seconds["whole"]),
                     "paired_ratios": pairs, "median_ratio": statistics.median(pairs),
                     "tokens_per_s_last": a.tokens / statistics.median(seconds["last"]),
                     "tokens_per_s_whole": a.tokens / statistics.median(seconds["whole"]),
                     "max_logit_difference": diff})
    out = {"command": "python -m benchmarks.prefill_head_ab " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": a.model or "(shipped model)", "tokens": a.tokens, "chunk": a.chunk, "rounds": a.rounds,
           "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""), "load_average_at_start": load_at_start,
           "load_average_at_end": list(os.getloadavg()), "rows": rows}
    print(f"{'policy':<24} {'last s':>9} {'whole s':>9} {'ratio':>7} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['policy']:<24} {r['median_last_s']:>9.2f} {r['median_whole_s']:>9.2f} "
              f"{r['median_ratio']:>7.3f} {r['max_logit_difference']:>11.2e}")
    if a.json:
        write_atomic(a.json, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
