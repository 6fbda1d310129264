"""Long prompts (300 tokens each, by MODEL's tokenizer) from data/heldout.txt, one per line, for
`posttrainllm compare --prompts`: short prompts + 60 tokens barely reach KIVI's first frozen block.

Prompt i starts at line 400*(i mod 16) + (0, 130, 260)[i // 16] and joins 60 lines, so the first 16
(`--count 16`, docs/results/kivi_long_prompts.txt) are the set of the first measurements and
`--count 48` (docs/results/kivi_long_prompts_48.txt) adds 32 from the lines between them.
Usage: python scripts/long_prompts.py MODEL OUT [--count 48]
"""
import argparse

from tinygpt_mlx.loading import load

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("out")
ap.add_argument("--count", type=int, default=16, choices=(16, 32, 48))
a = ap.parse_args()
tok = load(a.model).tokenizer
lines = open("data/heldout.txt", encoding="utf-8").read().splitlines()
out = []
for i in range(a.count):
    start = 400 * (i % 16) + (0, 130, 260)[i // 16]
    ids = tok.encode(" ".join(lines[start:start + 60]))[:300]
    out.append(tok.decode(ids).replace("\n", " ").strip())
open(a.out, "w", encoding="utf-8").write("\n".join(out) + "\n")
