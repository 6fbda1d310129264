"""Can the model answer keyed needle questions with the FULL cache? The baseline that the
multi-needle and dense-filler retrieval tables need (issue: KIV's limits).

For each keyed template of `corpus.TEMPLATES` ("The secret number of {name} is {v}.",
"{name}'s lucky number is {v}.", "{name} lives in room number {v}.") and 1 or 4 facts of that
template with different names in one ~480-token document of held-out filler, the greedy
answer to the question about one of them, with an exact full cache.

    python -m benchmarks.keyed_needle_probe [MODEL] [--docs 20] [--filler data/heldout.txt]
"""

from __future__ import annotations

import argparse
import random

from tinygpt_mlx import corpus, loading
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.corpus import make_needle_doc_tokens
from tinygpt_mlx.evaluate.needle import passed
from tinygpt_mlx.generate import greedy_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=480)
    ap.add_argument("--filler", default="data/heldout.txt")
    a = ap.parse_args()
    loaded = loading.load(a.model)
    tok = loaded.tokenizer
    filler = open(a.filler, encoding="utf-8").read()
    for template in (3, 4, 7):
        for facts in (1, 4):
            ok = 0
            for seed in range(a.docs):
                rng = random.Random(f"k-{seed}")
                prompt, answer = make_needle_doc_tokens(rng, filler, tok.encode, a.tokens, rng.random(),
                                                        template=template, distractors=facts - 1)
                with make_cache(loaded.model, CacheConfig()) as cache:
                    # the answer's tokens and one more (a longer number must not pass); until
                    # 2026-12-01 this decoded 4 tokens, which only a 3-digit answer fits
                    n_new = len(tok.encode(" " + answer)) + 1
                    out = tok.decode(greedy_tokens(loaded.model, tok.encode(prompt), cache, n_new, 128))
                ok += passed(out, answer)
            print(f"template {template} ({corpus.TEMPLATES[template][1]}), {facts} fact(s): {ok}/{a.docs}",
                  flush=True)


if __name__ == "__main__":
    main()
