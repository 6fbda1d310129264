"""Greedy decoding pipelined (`steps(pipeline=True)`: each token fed before the host reads it,
mx.async_eval) against the stepwise loop, on one model and a few policies (a measurement).

Each round runs both loops once per policy, alternating which goes first, and the table gives the
median decode tokens/s of each and their ratio (machines here are shared and noisy: the ratio is
what counts). The tokens of the two loops are compared too (they must be equal).

    python -m benchmarks.pipeline models/tinygpt-base.tinygpt --policies fp32,int4,sink4/window256
"""

from __future__ import annotations

import argparse
import statistics

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.evaluate.modes import parse_policies
from tinygpt_mlx.generate import GenerationStats, generate_step
from tinygpt_mlx.loading import load
from tinygpt_mlx.sampling import make_sampler


def run(model, prompt: list[int], config, tokens: int, chunk: int, pipeline: bool) -> tuple[list[int], float]:
    """The greedy tokens and the decode tokens/s of one generation."""
    stats = GenerationStats()
    with make_cache(model, config) as cache:
        out = list(generate_step(model, prompt, cache, make_sampler(0.0), tokens, chunk, stats, pipeline=pipeline))
    return out, stats.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--policies", default="fp32,int4,sink4/window256")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per generation")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    for name, value, least in (("--prompt-tokens", args.prompt_tokens, 1), ("--tokens", args.tokens, 2),
                               ("--rounds", args.rounds, 1), ("--chunk", args.chunk, 1)):
        if value < least:
            ap.error(f"{name} must be at least {least}, got {value}")
    try:
        policies = parse_policies(args.policies)
    except ValueError as e:
        ap.error(f"--policies: {e}")
    loaded = load(args.model)
    vocab = loaded.tokenizer.vocab_size
    prompt = [(7 + 31 * i) % (vocab - 10) + 5 for i in range(args.prompt_tokens)]
    print(f"model {loaded.name}, prompt {len(prompt)} tokens, {args.tokens} greedy tokens, {args.rounds} rounds")
    print(f"{'policy':<44} {'stepwise tok/s':>15} {'pipelined tok/s':>16} {'ratio':>7}  same tokens")
    for label, config in policies.items():
        rates = {False: [], True: []}
        same = True
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            outs = {}
            for pipeline in order:
                outs[pipeline], rate = run(loaded.model, prompt, config, args.tokens, args.chunk, pipeline)
                rates[pipeline].append(rate)
            same &= outs[False] == outs[True]
        a, b = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"{label:<44} {a:>15.1f} {b:>16.1f} {b / a:>7.3f}  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
