"""Which answer step of a needle cell goes wrong, and whether retrieval is the cause.

Rebuilds one cell of `posttrainllm needle` (the same document: seeded by seed, context and
depth), prefills it through retrieval, then feeds the right answer token by token (teacher
forcing) and prints, for every answer token, its probability, its rank and the model's top token.
Each policy is a `CacheConfig.from_spec` string; a policy prefixed `oracle:` also puts the
pages holding the needle into every head's pool at every pass (`KVCache.pin`, as `posttrainllm
needle --probe` does; the model still picks from the pool by its own scores): if the oracle
answers where the policy does not, the needle's pages were out of reach (the coarse pass),
not beyond the model.

`--ranks` also prints, per layer, where the needle's best page ranks among all complete cold
pages for the prompt's last query (the one that answers) at the last prefill pass: by the
policy's page summary (the coarse pass) and by its exact score (max q.k over the page's keys,
max over the GQA group), as the median and best over KV heads. A needle that ranks high by its
exact score but low by its summary is lost by the summary; one that ranks low by both is not
what that layer's query looks for. `--rankers` adds columns for other page rankers computed from
the same keys (`alt_page_scores`): "mean" (KIV's mean key), "lowrankR" (every token scored in the
top-R principal directions of the layer's first `--fit` cold keys, Loki; the page takes its best
token), "intB" (every token scored against its key quantised to B bits per channel in groups of
32 tokens; the page takes its best token).

    python -m benchmarks.needle_step_probe MODEL --context 16384 --depth 0.5 --seed 2 \
        --policies sink4/hot256+hybrid+nosticky,oracle:sink4/hot256+hybrid+nosticky,sink4/hot256
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import mlx.core as mx
import numpy as np

from tinygpt_mlx import loading
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.cold import ColdStore
from tinygpt_mlx.chat_template import encode_fragment
from tinygpt_mlx.cache.telemetry import pages_holding
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.needle import DEFAULT_FILLER, as_chat, cell_document, needle_positions, with_lead_in
from tinygpt_mlx.generate import forward, prefill


def needle_pages(store: ColdStore, truth: Any, n_pages: int) -> np.ndarray:
    """The complete pages among the first `n_pages` of `store` that hold the `truth` positions."""
    pages = pages_holding(store.positions.view(), store.n, truth, store.page_size)
    return pages[pages < n_pages]


def recording_pool(last: dict):
    """`ColdStore.pool` that keeps, per layer, the store, its complete pages and the pass's last
    query (row 0) of the latest pass; the ranks are computed once, after prefill (`ranks`)."""
    plain = ColdStore.pool

    def pool(self, rows):
        last[self.layer_index] = (self, self.n_pages, rows[:, :, :1].copy())
        return plain(self, rows)
    return pool


def alt_page_scores(kind: str, q: np.ndarray, keys: np.ndarray, ps: int, fit: int) -> np.ndarray:
    """Page scores [G, P] by another ranker (module doc) for the query [G, rep, D] over the
    complete pages' exact keys [G, P * ps, D]."""
    G, N, D = keys.shape
    if kind == "mean":
        return np.matmul(q, keys.reshape(G, N // ps, ps, D).mean(axis=2).transpose(0, 2, 1)).max(axis=1)
    if kind.startswith("lowrank"):
        r = int(kind[7:])
        basis = np.stack([np.linalg.svd(keys[g, :fit], full_matrices=False)[2][:r].T for g in range(G)])
        tok = np.matmul(np.matmul(q, basis), np.matmul(keys, basis).transpose(0, 2, 1))
    elif kind.startswith("int"):
        bits, g32 = int(kind[3:]), keys[:, : N // 32 * 32].reshape(G, N // 32, 32, D)
        lo, hi = g32.min(axis=2, keepdims=True), g32.max(axis=2, keepdims=True)
        step = np.maximum(hi - lo, 1e-8) / (2 ** bits - 1)
        deq = (np.round((g32 - lo) / step) * step + lo).reshape(G, -1, D)
        tok = np.matmul(q, np.concatenate([deq, keys[:, deq.shape[1]:]], axis=1).transpose(0, 2, 1))
    else:
        raise ValueError(f"unknown ranker {kind!r}")
    return tok.max(axis=1).reshape(G, N // ps, ps).max(axis=-1)


def ranks(last: dict, truth: Any, rankers: tuple = (), fit: int = 2048) -> dict:
    """Per layer, for each KV head, the ranks of the needle's best complete page for the recorded
    query among the pages complete then (rows only grow): by the coarse summary and by the exact
    page score (max q.k over its keys, max over the GQA group)."""
    out = {}
    for layer, (store, P, q) in last.items():                              # q [G, rep, 1, D]
        pages = needle_pages(store, truth, P)
        if not pages.size or P < 2:
            continue
        ps = store.page_size
        coarse = store.index.page_scores(q)[:, 0, :P]                      # [G, P]
        keys = store._gather(store.keys, np.broadcast_to(np.arange(P * ps), (store.G, P * ps)))
        exact = np.matmul(q[:, :, 0], keys.transpose(0, 2, 1)).max(axis=1).reshape(store.G, P, ps).max(axis=-1)
        others = [alt_page_scores(kind, q[:, :, 0], keys, ps, min(fit, P * ps)) for kind in rankers]
        out[layer] = [tuple(int((s[g] > s[g, pages].max()).sum()) for s in (coarse, exact, *others))
                      for g in range(store.G)]
    return out


def print_ranks(last: dict, truth: Any, rankers: tuple = (), fit: int = 2048) -> None:
    store, n_pages, _ = last[max(last)]
    print(f"needle's best page among {n_pages} cold pages, last query (median / best over KV heads; "
          f"the coarse pass keeps the top {store.top_pages}):")
    names = ("summary", "exact", *rankers)
    print("layer | " + " | ".join(f"{n + ' rank':>13}" for n in names))
    within = np.zeros(len(names), dtype=int)
    fetched = np.zeros(len(names), dtype=int)
    spans = max(1, store.retrieve_tokens // store.page_size)
    for layer, per_head in sorted(ranks(last, truth, rankers, fit).items()):
        cols = [np.array([r[i] for r in per_head]) for i in range(len(names))]
        within += [int(np.median(c)) < store.top_pages for c in cols]
        fetched += [int(np.median(c)) < spans for c in cols]
        print(f"{layer:5d} | " + " | ".join(f"{int(np.median(c)):5d} / {c.min():5d}" for c in cols))
    print("layers within the top " + f"{store.top_pages} (median): " +
          ", ".join(f"{n} {w}" for n, w in zip(names, within)))
    print(f"layers within the top {spans} (median; the pages a step fetches whole): " +
          ", ".join(f"{n} {w}" for n, w in zip(names, fetched)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--filler", default=str(DEFAULT_FILLER))
    ap.add_argument("--chat", action="store_true", help="ask through the model's chat template (as needle --chat)")
    ap.add_argument("--lead-in", default=None, help="the answer's lead-in (as needle --lead-in)")
    ap.add_argument("--ranks", action="store_true", help="print the needle page's rank per layer (above)")
    ap.add_argument("--rankers", default="", help="other page rankers to rank the needle by (with --ranks): "
                    "comma-separated mean, lowrankR, intB (module doc)")
    ap.add_argument("--fit", type=int, default=2048, help="cold keys the lowrank basis is fitted on (the first)")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--policies", default="sink4/hot256,oracle:sink4/hot256")
    a = ap.parse_args()
    try:
        configs = [(spec, CacheConfig.from_spec(spec.removeprefix("oracle:"))) for spec in a.policies.split(",")]
    except ValueError as e:
        ap.error(f"--policies: {e}")
    rankers = tuple(filter(None, a.rankers.split(",")))
    bad = [r for r in rankers if not re.fullmatch(r"mean|lowrank\d+|int\d+", r)]
    if bad:
        ap.error(f"--rankers: unknown ranker {bad[0]!r} (mean, lowrankR, intB)")
    loaded = loading.load(a.model)
    tok = loaded.tokenizer
    filler = open(a.filler, encoding="utf-8").read()
    prompt, answer = cell_document(tok, filler, a.context, a.depth, a.seed)
    prompt = as_chat(tok, prompt, a.lead_in) if a.chat else with_lead_in(prompt, a.lead_in)
    ids = list(tok.encode(prompt))
    truth = np.asarray(needle_positions(tok.encode, prompt, answer))
    target = encode_fragment(tok, " " + answer + ".")   # no BOS: the answer continues the prompt
    print(f"cell: context {a.context}, depth {a.depth}, seed {a.seed}: {len(ids)} tokens, answer {answer!r}, "
          f"needle at positions {truth.min()}-{truth.max()}", flush=True)
    plain = ColdStore.pool
    for spec, config in configs:
        last: dict = {}
        oracle = spec.startswith("oracle:")
        ColdStore.pool = recording_pool(last) if a.ranks and not oracle else plain
        try:
            with make_cache(loaded.model, config) as cache:
                if oracle:
                    cache.pin(truth)
                logits = prefill(loaded.model, ids, cache, a.chunk)
                if last:
                    ColdStore.pool = plain      # the answer's steps are not recorded
                    print_ranks(last, truth, rankers, a.fit)
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
