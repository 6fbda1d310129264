"""16 long prompts (300 tokens each, by MODEL's tokenizer) from data/heldout.txt, one per line, for
`posttrainllm compare --prompts`: short prompts + 60 tokens barely reach KIVI's first frozen block.
Usage: python scripts/long_prompts.py MODEL OUT
"""
import sys
from tinygpt_mlx.loading import load
tok = load(sys.argv[1]).tokenizer
lines = open("data/heldout.txt", encoding="utf-8").read().splitlines()
out = []
for i in range(0, 16 * 400, 400):
    ids = tok.encode(" ".join(lines[i:i + 60]))[:300]
    out.append(tok.decode(ids).replace("\n", " ").strip())
open(sys.argv[2], "w", encoding="utf-8").write("\n".join(out) + "\n")
