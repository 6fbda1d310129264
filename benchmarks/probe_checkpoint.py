"""Probe training checkpoints for the skills behind retrieval (the stage-2 table of docs/model.md).

For each `checkpoint.pt`: copy accuracy on rows that repeat a span of random tokens (the
induction-head test: after the first copy every token is predictable only by looking back one
span), at span lengths 30 and 200, the loss on the first copy vs the repeats, and
teacher-forced pass-key accuracy (all answer tokens argmax-correct) on held-out documents.

    python -m benchmarks.probe_checkpoint runs/s4/checkpoint.pt --tokenizer runs/s4/tokenizer.json
"""

from __future__ import annotations

import argparse
import random


def main() -> None:
    import torch
    from tokenizers import Tokenizer

    from tinygpt_mlx.config import ModelConfig
    from tinygpt_mlx.train import data as D
    from tinygpt_mlx.train.loop import needle_accuracy
    from tinygpt_mlx.train.torch_model import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--tokenizer", required=True, help="the run's tokenizer.json")
    ap.add_argument("--heldout", default="data/heldout.txt")
    ap.add_argument("--docs", type=int, default=24)
    a = ap.parse_args()
    torch.set_num_threads(1)
    F = torch.nn.functional
    tok = Tokenizer.from_file(a.tokenizer)
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    rows, spans = D.needle_eval_rows(open(a.heldout, encoding="utf-8").read(), enc, 512, a.docs, seed=99)
    for path in a.checkpoints:
        c = torch.load(path, map_location="cpu", weights_only=False)
        cfg = ModelConfig(**c["config"])
        m = build_model(cfg)
        m.load_state_dict(c["model"])
        m.eval()
        out = []
        for n in (30, 200):
            rng = random.Random(0)
            x = torch.tensor([([rng.randrange(1, cfg.vocab_size) for _ in range(n)] * (1 + 512 // n))[:513]
                              for _ in range(8)])
            with torch.no_grad():
                lg = m(x[:, :-1])
            first = F.cross_entropy(lg[:, :n - 1].reshape(-1, lg.shape[-1]), x[:, 1:n].reshape(-1)).item()
            rep = F.cross_entropy(lg[:, n:].reshape(-1, lg.shape[-1]), x[:, n + 1:].reshape(-1)).item()
            acc = (lg[:, n:].argmax(-1) == x[:, n + 1:]).float().mean().item()
            out.append(f"copy@{n}: acc {acc:.2f} (loss first {first:.2f}, repeats {rep:.2f})")
        acc = needle_accuracy(m, torch, rows, spans)
        out.append(f"pass key (teacher-forced) {acc:.2f}")
        print(f"{path} step {c['step']}: " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
