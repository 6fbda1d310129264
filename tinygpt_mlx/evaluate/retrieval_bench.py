"""Retrieval at scale: decode time and hot/cold bytes against context, and summary recall.

`decode_scaling`: prefill a real prompt through the retrieval policy, then grow every
layer's cold store to the target context by appending copies of its own real pages (the
model is not run over the filler, so contexts of 256K+ tokens are measured in seconds on a
CPU; decode cost depends only on how much is cold, not on where it came from), and time
greedy decode steps. Hot bytes (sink + hot window) stay constant; cold bytes grow linearly.

`summary_recall`: for real queries of the last decode steps, the exact top-k cold tokens
(exhaustive q.k, max over each GQA group) are the ground truth; recall is the fraction of
them that lie in the `top_pages` pages a summary selects. Quest's min/max bound vs KIV's
mean key (and the hybrid of both), on the same keys and queries.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from ..cache import KVCache, make_cache
from ..cache.cold import ColdStore
from ..config import CacheConfig
from ..generate import Step, steps
from ..sampling import make_sampler


def grow_cold(cache, target_tokens: int, block: int = 4096) -> None:
    """Append copies of each cold store's own pages until `target_tokens` tokens are cold in
    total (hot tokens included). Positions continue from the last cold position. Only the global
    layers have cold stores (a sliding-window layer's ring keeps its own window: factory.sliding_layer;
    `grow_rings` moves it on)."""
    for lc in cache.global_layers:
        store = lc.cold
        base = store.n
        if base == 0:
            raise ValueError("nothing is cold yet: prefill more than the hot budget first")
        if store.cold_bits is not None:
            raise ValueError("grow_cold copies exact pages; use an exact cold store for scaling runs")
        B, H = store.B, store.G // store.B
        src_k, src_v = (_token_major(rows) for rows in (store.keys.view(), store.values.view()))
        want = target_tokens - lc.stored_count
        i = 0
        while store.n < want:
            n = min(block, want - store.n, base - i % base)
            j = i % base
            k = src_k[j:j + n].reshape(n, B, H, -1).transpose(1, 2, 0, 3)
            v = src_v[j:j + n].reshape(n, B, H, -1).transpose(1, 2, 0, 3)
            lc.extend_cold(k, v)
            getattr(store, "settle", lambda: None)()   # the device store: evaluate each block's appends
            i += n


def _token_major(rows: Any) -> mx.array:
    """A cold store's rows [n, G, D]: the host store keeps them so (numpy), the device store as
    MLX arrays [G, n, D]."""
    return rows.swapaxes(0, 1) if isinstance(rows, mx.array) else mx.array(rows)


def grow_full(cache, target_tokens: int) -> None:
    """A full cache's layers grown to `target_tokens` tokens by appending copies of their own
    rows (as stored: the keys keep the positions the model gave them), as `grow_cold` grows a
    retrieval cache's cold stores: a full cache's decode step reads every stored row, whatever it
    holds, so its cost at a context is measured without prefilling the model over it. One append
    per layer (its buffer grown once, not once per block). Only the global layers grow, as in
    `grow_cold` (a sliding-window layer's ring keeps its own window, Gemma 3's local layers:
    `grow_rings` moves it on)."""
    for lc in cache.global_layers:
        body = lc.body
        base = len(body)
        if base == 0:
            raise ValueError("the full cache holds nothing yet: prefill a prompt first")
        n = target_tokens - lc.seen
        if n <= 0:
            continue
        src_k, src_v = body.fetch()
        tiled = mx.array(np.arange(n, dtype=np.int32) % base)
        body.append(mx.take(src_k, tiled, axis=2), mx.take(src_v, tiled, axis=2))
        lc.seen += n
        mx.eval(body.keys, body.values)


def grow_rings(cache, target_tokens: int) -> None:
    """Each sliding-window layer's ring (Gemma 3's local layers) fed copies of its own newest rows
    until it has seen `target_tokens`, through its own commit and eviction (one window's worth a
    call, then trimmed to its window as `generate.forward` trims after a prompt chunk): it then
    holds its window as one prefilled over as many tokens does, at the same counts (seen, start,
    the frame's base: so its queries' positions and re-bases come at the same steps)."""
    for lc in cache.owned:
        if lc.sliding is None:
            continue
        while lc.seen < target_tokens:
            if not lc.stored_count:
                raise ValueError("the sliding-window ring holds nothing yet: prefill a prompt first")
            k, v = lc.fetch()
            n = min(lc.sliding, target_tokens - lc.seen, k.shape[2])
            lc.update_and_fetch(k[..., -n:, :], v[..., -n:, :])
            lc.evict_middle_if_needed()
            mx.eval(*lc.body.buffers())


def grow(cache, target_tokens: int) -> None:
    """Fill `cache` to `target_tokens` tokens without running the model over them: a retrieval
    cache's cold stores by copies of their own pages (`grow_cold`), a full cache's layers by
    copies of their own rows (`grow_full`), and the sliding-window rings beside them by their
    own rows fed through them (`grow_rings`). What a decode step then builds depends on the
    counts and the shapes this leaves, which are those of a cache prefilled over as many tokens
    (tests/test_bench_grow.py), not on the values it holds (`bench --grow-from`)."""
    (grow_cold if cache.config.retrieval else grow_full)(cache, target_tokens)
    grow_rings(cache, target_tokens)


def decode_scaling(model: Any, config: CacheConfig, prompt: list[int], contexts: list[int],
                   decode_steps: int = 16, chunk: int = 128,
                   progress: Optional[Callable[[dict], None]] = None, full: bool = False,
                   record: bool = True) -> list[dict]:
    """One row per context: decode ms/token (wall and this process's CPU time) and the cache's
    hot/cold bytes.

    Every context's cache is built first (the prompt prefilled once, then copied cold pages);
    then decode steps run interleaved, one step per context in turn, so that load from other
    processes hits every context alike and the ratios against the smallest stay meaningful.
    Each is a greedy generation (`generate.steps`): one untimed warm-up step, then the timed ones.
    `full`: each context also gets a full cache (`CacheConfig(storage=config.storage)`, no
    eviction) grown to it by copies of its prompt's rows (`grow_full`), its row after the
    retrieval cache's, stepped in the same rounds. `record` False: the retrieval caches keep no
    telemetry (a decode step as it runs by default; rows without "telemetry")."""
    kinds = [(context, kind) for context in contexts for kind in (("retrieval", "full") if full else ("retrieval",))]
    caches, runs, prefill_s = [], [], []
    try:
        for context, kind in kinds:
            caches.append(make_cache(model, config if kind == "retrieval" else CacheConfig(storage=config.storage)))
            if record and kind == "retrieval":
                caches[-1].record_retrievals()      # (each row's telemetry: `_row`)
            runs.append(steps(model, prompt, caches[-1], make_sampler(0.0), decode_steps + 2, chunk))
            t0 = time.perf_counter()
            _prefill(runs[-1])
            prefill_s.append(time.perf_counter() - t0)
            if context > len(prompt):
                grow(caches[-1], context)
            next(runs[-1])  # warm-up step
        times: list[list[float]] = [[] for _ in kinds]
        cpu: list[list[float]] = [[] for _ in kinds]
        for _ in range(decode_steps):
            for i, run in enumerate(runs):
                t0, c0 = time.perf_counter(), time.process_time()
                next(run)
                times[i].append(time.perf_counter() - t0)
                cpu[i].append(time.process_time() - c0)
        return [_row(cache, len(prompt), prefill_s[i], times[i], decode_steps, progress, cpu[i],
                     kinds[i][1], record and kinds[i][1] == "retrieval")
                for i, cache in enumerate(caches)]
    finally:
        for run, cache in zip(runs, caches):
            run.close()
            cache.close()


def _prefill(run: Iterator[Step]) -> None:
    """Advance a generation to the end of its prompt (its first token sampled, not yet fed)."""
    for step in run:
        if step.token is not None:
            return


def _row(cache: KVCache, prompt_tokens: int, prefill_s: float, times: list[float], decode_steps: int,
         progress: Optional[Callable[[dict], None]], cpu: Optional[list[float]] = None,
         kind: str = "retrieval", telemetry: bool = True) -> dict:
    parts = cache.nbytes_breakdown()
    hot = parts.get("sink", 0) + parts.get("body", 0)
    cold = sum(v for k, v in parts.items() if k.startswith("cold") and not k.startswith(("cold_summary", "cold_positions")))
    row = {"context": cache.current_length, "cache": kind, "prompt_tokens": prompt_tokens,
           "prefill_s": round(prefill_s, 2),
           "decode_ms_per_token": round(1000 * float(np.median(times)), 2),
           "decode_ms_min": round(1000 * float(np.min(times)), 2),
           **({"decode_cpu_ms_per_token": round(1000 * float(np.median(cpu)), 2)} if cpu else {}),
           "hot_bytes": hot, "cold_bytes": cold,
           "summary_bytes": parts.get("cold_summary", 0) + parts.get("cold_summary_disk", 0),
           "bytes": parts}
    if telemetry:
        row["telemetry"] = cache.retrieval_report(last_steps=decode_steps)
    if progress is not None:
        progress(row)
    return row


def _store_like(store: ColdStore, config: CacheConfig) -> ColdStore:
    """A RAM cold store under `config` holding the same exact keys as `store` (values unused)."""
    out = ColdStore(config, KVCache, store.layer_index)
    keys = _token_major(store.keys.view()).astype(mx.float32).transpose(1, 0, 2)[None]  # [1, G, n, D]
    out.append(keys, keys, 0)
    return out


def summary_recall(model: Any, config: CacheConfig, tokens: list[int], decode_steps: int = 8,
                   k: int = 16, chunk: int = 128, variants: Optional[list[tuple[str, int]]] = None) -> dict:
    """Recall of the exact top-k cold tokens inside the pages each (summary, index_block)
    variant selects, on the same keys and the same recorded decode queries. The selection is
    the cold store's own (`PageIndex.top_pages_of`): flat scans (index_block 0) and the
    two-level index, minmax vs mean vs hybrid."""
    variants = variants or [(s, 0) for s in ("minmax", "mean", "hybrid")]
    # the host store (on disk): its coarse pass is a method the spy below can wrap (the device
    # store's decode steps run theirs inside one compiled function); both rank pages alike
    cache = make_cache(model, dataclasses.replace(config, cold_store="disk"))
    run = steps(model, tokens, cache, make_sampler(0.0), decode_steps + 1, chunk)
    _prefill(run)
    stores = [c.cold for c in cache.global_layers]   # (sliding-window rings have none)
    queries: dict[int, list] = {id(s): [] for s in stores}
    for s in stores:  # record the (positioned) query rows each store's coarse pass is asked
        orig = s.coarse

        def spy(q, _orig=orig, _s=s):
            queries[id(_s)].append(np.array(q))  # [G, rep, R, D] (a copy; the device store's as numpy)
            return _orig(q)
        s.coarse = spy
    for _ in run:  # the decode steps
        pass
    ps, tp = config.page_size, config.top_pages
    scored = [s for s in stores if s.cold_bits is None and s.n_pages > tp]
    # ground truth, once for all variants: the pages holding each query's exact top-k tokens
    truth = {}
    for s in scored:
        keys = np.asarray(_token_major(s.keys.view())[:s.n_pages * ps].astype(mx.float32))
        truth[id(s)] = []
        for q in queries[id(s)][-decode_steps:]:
            qj = q.reshape(q.shape[0], -1, q.shape[-1])                     # [G, J, D]
            exact = np.einsum("gjd,ngd->gjn", qj, keys).max(axis=1)         # [G, n]
            truth[id(s)].append(np.argpartition(-exact, k - 1, axis=1)[:, :k] // ps)
    out = {}
    for summary, block in variants:
        hits, total, indexed = 0, 0, False
        for s in scored:
            v = _store_like(s, dataclasses.replace(config, summary=summary, index_block=block))
            indexed |= v.index.uses_index()
            for q, top in zip(queries[id(s)][-decode_steps:], truth[id(s)]):
                chosen = v.index.top_pages_of(q)[:, -1]                           # [G, top_pages]
                for g in range(q.shape[0]):
                    hits += int(np.isin(top[g], chosen[g]).sum())
                    total += k
            v.close()
        name = summary if not block else f"{summary}/index{block}"
        out[name] = hits / total if total else None
        if block and not indexed:
            out[name + " (index not engaged: store too short)"] = out.pop(name)
    cold_tokens = max((s.n for s in stores), default=0)
    cache.close()
    return {"top_k": k, "top_pages": tp, "page_size": ps, "cold_tokens": cold_tokens, "recall": out}
