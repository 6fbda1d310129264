"""Measure a trained .tinygpt with the MLX model itself (the numbers in docs/model.md).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.model_report models/tinygpt-base.tinygpt --heldout data/heldout.txt \\
        --data data/corpus --trials 50 --json runs/report.json

Held-out loss/perplexity over non-overlapping context-length windows of the held-out split,
the add-one unigram baseline fitted on the training corpus with the same tokenizer, pass-key
accuracy (greedy, full forward = full cache) at the trained context over --trials random
trials on held-out filler, and greedy samples.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from tinygpt_mlx import corpus, make_cache
from tinygpt_mlx.evaluate.passkey import passkey_accuracy
from tinygpt_mlx.generate import greedy_tokens
from tinygpt_mlx.format import load

PROMPTS = ("In the beginning", "A wise man once said", "Abandon, v. t.")


def encode_chunks(tok, text: str) -> list[int]:
    chunks = [c + "\n\n" for c in text.split("\n\n")]
    return [i for e in tok.encode_batch(chunks, add_special_tokens=False) for i in e.ids]


def heldout_loss(model, ids: np.ndarray, ctx: int, batch: int = 8) -> tuple[float, int]:
    n = (len(ids) - 1) // ctx
    wins = np.stack([ids[i * ctx:i * ctx + ctx + 1] for i in range(n)]).astype(np.int32)
    total = 0.0
    for i in range(0, n, batch):
        x = mx.array(wins[i:i + batch])
        logits = model(x[:, :-1]).astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        tgt = mx.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0]
        total += float((lse - tgt).sum())
    return total / (n * ctx), n * ctx


def greedy(model, tok, prompt: str, n: int = 60) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    with make_cache(model) as cache:        # the prompt in one chunk, then n greedy tokens
        out = greedy_tokens(model, ids, cache, n, len(ids))
    return prompt + tok.decode(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--heldout", default="data/heldout.txt")
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--n-tokens", type=int, default=None, help="pass-key prompt length (default: context)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=60, help="tokens per greedy sample")
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-windows", type=int, default=64, help="held-out windows (context tokens each)")
    ap.add_argument("--train-tokens", default=None,
                    help="cached training token ids (runs/NAME/train_tokens.npy) for the unigram baseline")
    a = ap.parse_args()

    model, tok_json, extra = load(a.model)
    tok = Tokenizer.from_str(tok_json)
    cfg = model.config
    ctx = cfg.context_length
    heldout_text = corpus.load_text(a.heldout)
    report: dict = {"model": a.model, "config": cfg.to_dict(), "parameters": model.num_parameters(),
                    "training": extra}
    t0 = time.time()
    ho = np.asarray(encode_chunks(tok, heldout_text))
    loss, n_tok = heldout_loss(model, ho[:a.max_windows * ctx + 1], ctx)
    if a.train_tokens:
        train_ids = np.load(a.train_tokens).astype(np.int64)
    else:
        train_ids = np.concatenate([np.asarray(encode_chunks(tok, d)) for d in corpus.load_documents(a.data)])
    counts = np.bincount(train_ids, minlength=tok.get_vocab_size()).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    uni = float(-logp[ho[1:n_tok + 1]].mean())
    report.update(heldout_tokens=n_tok, heldout_loss=loss, heldout_ppl=math.exp(loss),
                  unigram_loss=uni, unigram_ppl=math.exp(uni),
                  heldout_bits_per_char=loss * n_tok / math.log(2) / len(tok.decode(ho[1:n_tok + 1].tolist())))
    print(f"held-out: loss {loss:.4f} ppl {math.exp(loss):.2f} over {n_tok:,} tokens; "
          f"unigram loss {uni:.4f} ppl {math.exp(uni):.2f} ({time.time() - t0:.0f}s)", flush=True)

    class Tok:
        encode = staticmethod(lambda s: tok.encode(s, add_special_tokens=False).ids)
        decode = staticmethod(lambda ids: tok.decode(list(ids)))

    t0 = time.time()
    pk = passkey_accuracy(model, Tok, heldout_text, a.n_tokens or ctx, trials=a.trials, seed=a.seed)
    report["passkey"] = pk
    print(f"pass key at {pk['n_tokens']} tokens, full cache: {pk['accuracy']:.0%} of {pk['trials']} "
          f"({time.time() - t0:.0f}s)", flush=True)
    for d, ans, out in pk["results"]:
        if not out.strip().startswith(ans):
            print(f"  miss at depth {d}: expected {ans}, got {out!r}")
    report["samples"] = [greedy(model, tok, p, a.samples) for p in PROMPTS]
    for s in report["samples"]:
        print("---\n" + s)
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
