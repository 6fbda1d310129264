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

`--fetched` prints, at every answer step, which of the needle's tokens each retrieval layer's
fine pass fetched for each KV head (of those that are cold): the step that reads the first
digit is the one fed the space before it. `--decode-fetch N,M,..` prefills once and feeds the
answer once per fine-pass budget (tokens per query at the decode steps only; the prompt's chunks
keep the policy's own; `all`: every cold token, the coarse pass keeping every page), the cache
put back to its state after prefill (`KVCache.checkpoint`) before each: whether a larger fine
pass at the answer's steps would read what the policy's does not, and (`all`, at original
positions: the full cache's attention at those steps over the prompt as retrieval prefilled it)
whether the answer's steps or the prefill lose it. `--json` writes every number printed, with the command and the load average.

    python -m benchmarks.needle_step_probe MODEL --context 16384 --depth 0.5 --seed 2 \
        --policies sink4/hot256+hybrid+nosticky,oracle:sink4/hot256+hybrid+nosticky,sink4/hot256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from tinygpt_mlx import loading
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.cold import ColdStore
from tinygpt_mlx.chat_template import encode_fragment
from tinygpt_mlx.cache.telemetry import cold_indices, pages_holding
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


class NeedleFetch:
    """What each retrieval layer's fine pass fetched of the needle, per forward pass (`step`):
    {layer: [(fetched needle positions, cold needle positions) per KV head]}, read from the
    `Selection` every retrieval hands its telemetry (recording is turned on here)."""

    def __init__(self, cache: Any, truth: Any):
        self.truth = np.asarray(truth, dtype=np.int64)
        self.current: dict = {}
        cache.record_retrievals(True)
        cache.set_truth(self.truth)     # (the telemetry's own recall beside: the test compares them)
        for c in cache.owned:
            if c.telemetry is not None:
                c.telemetry.record = self._wrap(c.telemetry.record)

    def _wrap(self, plain):
        def record(s):
            plain(s)
            cold = cold_indices(s.positions, s.cold_tokens, self.truth)
            self.current[s.layer] = [(s.positions[np.intersect1d(row, cold)], s.positions[cold])
                                     for row in s.fetched()]
        return record

    def step(self) -> dict:
        """The fetches recorded since the last call (one forward pass's, one per retrieval layer)."""
        out, self.current = self.current, {}
        return out


#: `--decode-fetch all`: every cold token (every page in the coarse pass's pool, all picked)
ALL = "all"


def set_fetch(cache: Any, tokens: Any) -> None:
    """Every cold store's fine-pass budget from now on: `tokens` per query (spans: whole pages,
    tokens // page_size of them), as `fetchN` sets it for the whole run; `ALL`: every cold page
    in the pool (the coarse pass keeps them all, as `pagesN` would) and every one of them picked."""
    for c in cache.owned:
        if c.config.retrieval:
            every = tokens == ALL
            c.cold.retrieve_tokens = 1 << 40 if every else tokens
            c.cold.top_pages = 1 << 40 if every else c.config.top_pages


def answer(model: Any, cache: Any, logits: mx.array, target: list, fetch: Optional[NeedleFetch] = None) -> list:
    """Feed `target` token by token after `logits` (teacher forcing): per answer token (token,
    p, rank, the model's top token, ms of the forward pass that made these logits, the needle
    fetched by that pass: {} where not recorded or for the prefill's logits)."""
    rows, fetched, ms = [], {}, None
    for i, t in enumerate(target):
        p = mx.softmax(logits.astype(mx.float32))
        rows.append((t, float(p[t]), int((p > p[t]).sum()), int(mx.argmax(p)), ms, fetched))
        if i + 1 == len(target):
            break
        t0 = time.perf_counter()
        logits = forward(model, mx.array([[t]]), cache)[0, -1]
        mx.eval(logits)
        ms = (time.perf_counter() - t0) * 1e3
        fetched = fetch.step() if fetch is not None else {}
    return rows


def probe_policy(model: Any, ids: list, target: list, truth: Any, config: CacheConfig, chunk: int,
                 oracle: bool = False, fetches: Sequence[Any] = (None,), fetched: bool = False,
                 on_prefill: Optional[Callable[[Any], None]] = None) -> dict:
    """One policy: prefill `ids` once, then per budget in `fetches` (None: the policy's own; `ALL`:
    every cold token) the answer fed token by token (`answer`), the cache restored to its state after prefill before
    each. Returns {budget: answer rows}."""
    if any(f is not None for f in fetches) and (not config.retrieval or config.retrieves_per_query):
        raise ValueError("a fine-pass budget needs a retrieval policy whose slots do not depend on it (not 'slots')")
    with make_cache(model, config) as cache:
        if oracle:
            cache.pin(truth)
        logits = prefill(model, ids, cache, chunk)
        if on_prefill is not None:
            on_prefill(cache)
        mx.eval(logits)
        held = cache.checkpoint() if len(fetches) > 1 else None
        rec = NeedleFetch(cache, truth) if fetched and config.retrieval else None
        own = config.retrieve_tokens
        out = {}
        for n in fetches:
            if held is not None and out:
                cache.restore(held)
            if config.retrieval:
                set_fetch(cache, own if n is None else n)
            out[n] = answer(model, cache, logits, target, rec)
        return out


def print_rows(tok: Any, label: str, rows: list, fetched: bool) -> None:
    print(f"{label}: " + " | ".join(f"{tok.decode([t])!r} p={p:.2f} rank {r} top {tok.decode([top])!r}"
                                   for t, p, r, top, _, _ in rows), flush=True)
    steps = [ms for *_, ms, _ in rows if ms is not None]
    if steps:
        print(f"  decode step ms (median of {len(steps)}): {float(np.median(steps)):.0f}", flush=True)
    if fetched and any(got for *_, got in rows):     # (a policy without retrieval records nothing)
        for t, *_, got in rows[1:]:
            print(f"  needle fetched by the step that reads {tok.decode([t])!r}: " + "; ".join(
                f"layer {layer} " + ", ".join(f"{len(f)}/{len(c)}" + (f" (missing {_spans(np.setdiff1d(c, f))})"
                                                                     if len(f) < len(c) else "")
                                              for f, c in heads)
                for layer, heads in sorted(got.items())), flush=True)


def _spans(pos: np.ndarray) -> str:
    """Positions as runs: 9800-9803, 9806."""
    runs, start = [], None
    for i, p in enumerate(pos):
        if start is None:
            start = p
        if i + 1 == len(pos) or pos[i + 1] != p + 1:
            runs.append(f"{start}" if start == p else f"{start}-{p}")
            start = None
    return ", ".join(runs)


def _as_json(tok: Any, rows: list) -> list:
    return [dict(token=tok.decode([t]), p=p, rank=r, top=tok.decode([top]), step_ms=ms,
                 fetched={str(layer): [dict(fetched=f.tolist(), cold=c.tolist()) for f, c in heads]
                          for layer, heads in got.items()})
            for t, p, r, top, ms, got in rows]


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
    ap.add_argument("--fetched", action="store_true",
                    help="print which needle tokens each retrieval layer fetched at each answer step (above)")
    ap.add_argument("--decode-fetch", default="",
                    help="fine-pass budgets (tokens per query) to feed the answer with after one prefill, "
                         "comma-separated; 'own' is the policy's, 'all' every cold token (above)")
    ap.add_argument("--json", default=None, help="write the results here, with the command and the load average")
    a = ap.parse_args()
    try:
        configs = [(spec, CacheConfig.from_spec(spec.removeprefix("oracle:"))) for spec in a.policies.split(",")]
    except ValueError as e:
        ap.error(f"--policies: {e}")
    try:
        fetches = ([None if f.strip() == "own" else ALL if f.strip() == ALL else int(f) for f in a.decode_fetch.split(",")]
                   if a.decode_fetch else [None])
    except ValueError:
        ap.error(f"--decode-fetch {a.decode_fetch!r}: give token counts (or 'own', 'all'), comma-separated")
    if any(isinstance(f, int) and f < 1 for f in fetches):
        ap.error(f"--decode-fetch {a.decode_fetch!r}: each budget must be at least 1 token")
    rankers = tuple(filter(None, a.rankers.split(",")))
    bad = [r for r in rankers if not re.fullmatch(r"mean|lowrank\d+|int\d+", r)]
    if bad:
        ap.error(f"--rankers: unknown ranker {bad[0]!r} (mean, lowrankR, intB)")
    loaded = loading.load(a.model)
    tok = loaded.tokenizer
    filler = open(a.filler, encoding="utf-8").read()
    prompt, answer_text = cell_document(tok, filler, a.context, a.depth, a.seed)
    prompt = as_chat(tok, prompt, a.lead_in) if a.chat else with_lead_in(prompt, a.lead_in)
    ids = list(tok.encode(prompt))
    truth = np.asarray(needle_positions(tok.encode, prompt, answer_text))
    target = encode_fragment(tok, " " + answer_text + ".")   # no BOS: the answer continues the prompt
    print(f"cell: context {a.context}, depth {a.depth}, seed {a.seed}: {len(ids)} tokens, answer {answer_text!r}, "
          f"needle at positions {truth.min()}-{truth.max()}", flush=True)
    plain = ColdStore.pool
    results = {}
    load_start = os.getloadavg()
    for spec, config in configs:
        last: dict = {}
        oracle = spec.startswith("oracle:")
        ColdStore.pool = recording_pool(last) if a.ranks and not oracle else plain

        def after_prefill(cache):
            if last:
                ColdStore.pool = plain      # the answer's steps are not recorded
                print_ranks(last, truth, rankers, a.fit)
        try:
            runs = probe_policy(loaded.model, ids, target, truth, config, a.chunk, oracle,
                                fetches if config.retrieval else [None], a.fetched, after_prefill)
        finally:
            ColdStore.pool = plain
        for n, rows in runs.items():
            label = (spec if n is None else f"{spec} (every cold token at the answer's steps)" if n == ALL
                     else f"{spec} (fine pass {n} tokens at the answer's steps)")
            print_rows(tok, label, rows, a.fetched)
            results[label] = _as_json(tok, rows)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(dict(command="python -m benchmarks.needle_step_probe " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                           LD_PRELOAD=os.environ.get("LD_PRELOAD", ""), load_average_at_start=list(load_start),
                           load_average_at_end=list(os.getloadavg()), context=a.context, depth=a.depth, seed=a.seed,
                           prompt_tokens=len(ids), answer=answer_text, needle_positions=truth.tolist(),
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
