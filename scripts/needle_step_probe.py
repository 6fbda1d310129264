"""Which answer step of a needle cell goes wrong, and whether retrieval is the cause.

Rebuilds one cell of `posttrainllm needle` (the same document: seeded by seed, context and
depth), prefills it through retrieval, then feeds the right answer token by token (teacher
forcing) and prints, for every answer token, its probability, its rank and the model's top token.
Each policy is a `CacheConfig.from_spec` string; a policy prefixed `oracle:` also puts the
pages holding the needle into every head's pool at every pass (the model still picks from the
pool by its own scores): if the oracle answers where the policy does not, the needle's pages
were out of reach (the coarse pass), not beyond the model.

    python scripts/needle_step_probe.py MODEL --context 16384 --depth 0.5 --seed 2 \
        --policies sink4/hot256+hybrid+nosticky,oracle:sink4/hot256+hybrid+nosticky,sink4/hot256
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from tinygpt_mlx import loading
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.cold import ColdStore
from tinygpt_mlx.cache.telemetry import cold_indices
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.needle import cell_document, needle_positions
from tinygpt_mlx.generate import forward, prefill


def oracle_pool(truth: list[int]):
    """`ColdStore.pool` that adds the complete pages holding the `truth` positions to every row."""
    plain = ColdStore.pool

    def pool(self, rows):
        out, last = plain(self, rows)
        pages = np.unique(cold_indices(self.positions.view(), self.n, truth) // self.page_size)
        pages = pages[pages < self.n_pages]
        if pages.size:
            extra = np.broadcast_to(pages, (out.shape[0], pages.size))
            out = np.concatenate([out, extra], axis=1)
        return out, last
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--filler", default="data/heldout.txt")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--policies", default="sink4/hot256,oracle:sink4/hot256")
    a = ap.parse_args()
    try:
        configs = [(spec, CacheConfig.from_spec(spec.removeprefix("oracle:"))) for spec in a.policies.split(",")]
    except ValueError as e:
        ap.error(f"--policies: {e}")
    loaded = loading.load(a.model)
    tok = loaded.tokenizer
    filler = open(a.filler, encoding="utf-8").read()
    prompt, answer = cell_document(tok, filler, a.context, a.depth, a.seed)
    ids = list(tok.encode(prompt))
    truth = np.asarray(needle_positions(tok.encode, prompt, answer))
    target = list(tok.encode(" " + answer + "."))
    print(f"cell: context {a.context}, depth {a.depth}, seed {a.seed}: {len(ids)} tokens, answer {answer!r}, "
          f"needle at positions {truth.min()}-{truth.max()}", flush=True)
    plain = ColdStore.pool
    for spec, config in configs:
        ColdStore.pool = oracle_pool(truth) if spec.startswith("oracle:") else plain
        try:
            with make_cache(loaded.model, config) as cache:
                logits = prefill(loaded.model, ids, cache, a.chunk)
                steps = []
                for t in target:
                    p = mx.softmax(logits.astype(mx.float32))
                    rank, top = int((p > p[t]).sum()), int(mx.argmax(p))
                    steps.append(f"{tok.decode([t])!r} p={float(p[t]):.2f} rank {rank} top {tok.decode([top])!r}")
                    logits = forward(loaded.model, mx.array([[t]]), cache)[0, -1]
        finally:
            ColdStore.pool = plain
        print(f"{spec}: " + " | ".join(steps), flush=True)


if __name__ == "__main__":
    main()
