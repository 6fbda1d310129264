"""The two-level index's block scan of a decode step against the context: the coarse pass's
matmul in the two layouts (the query rows times the summaries turned, `q @ s^T`, as before
issue 53's change, and the summaries times the rows, `s @ q^T`, as device_select._bound and
device_pages._scan do now), interleaved in one run, with the whole compiled selection
(device_select.select) beside them, per layer of the shipped model's shape (4 KV heads, 2
query rows each, head dim 32, pages of 8 tokens, blocks of 8 pages, the defaults for a hot
window of 256: 64 top pages, the index expanding 4 x 64 blocks). Random summaries: the time
of the ops, not of any model's keys. Both layouts give the same bits (checked and reported).
Where the index is engaged, its candidates' scores (the kept blocks' pages and the unfinished
block's, masked past the page count) gathered page by page (`take_along_axis`, before) and
block by block (`_bound_blocks`, now), same bits checked too.

    python -m benchmarks.coarse_scan [--contexts 4096,65536,262144,1048576] [--reps 20] [--top-pages 64]
        [--json PATH]

`--top-pages N`: the coarse pass's pages (64 at a hot window of 256; 256 at `sink4/hot1024`,
where the index keeps 4 x 256 blocks: 8,200 candidate pages, and a query picks N / 8 spans; the
default keeps its 4). Each piece's median is given in
wall time and in this process's CPU time (`cpu`: steadier on a shared machine). Beside the
scans: the block scan with its argpartition (the kept blocks) and the whole coarse pass
(`device_select._ranked`: blocks, candidates, their argpartition).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks._args import token_counts
from tinygpt_mlx.cache.device_pages import bound, iota
from tinygpt_mlx.cache.device_select import Static, _bound, _bound_at, _bound_blocks, _ranked, select
from tinygpt_mlx.cli.common import write_atomic

G, REP, D, PAGE, BLOCK, TOP, EXPAND, UNITS = 4, 2, 32, 8, 8, 64, 4, 4


def _bucket(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


def row(tokens: int, reps: int, rng: np.random.RandomState, top: int = TOP) -> dict:
    """Median ms per layer of each piece at a store of `tokens` cold tokens (interleaved calls),
    wall time and (`cpu`) this process's CPU time."""
    P = tokens // PAGE
    NB = P // BLOCK
    uses = P > 2 * EXPAND * top * BLOCK
    cap_p, cap_b = _bucket(P), _bucket(NB)
    f32 = np.float32
    keys = mx.array(rng.randn(G, cap_p * PAGE, D).astype(f32))
    values = mx.array(rng.randn(G, cap_p * PAGE, D).astype(f32))
    summaries = {n: mx.array(rng.randn(G, cap_p, D).astype(f32)) for n in ("smin", "smax")}
    summaries.update({n: mx.array(rng.randn(G, cap_b, D).astype(f32)) for n in ("bmin", "bmax")})
    mx.eval(keys, values, *summaries.values())
    units = UNITS if top == TOP else top // PAGE    # (sink4/hot1024: 256 tokens fetched, 32 spans)
    static = Static("minmax", top, False, uses, BLOCK, min(EXPAND * top, NB) if uses else 0, PAGE, units, PAGE,
                    "max", False, True, None)
    counts = mx.array([tokens, P, NB], mx.int32)
    recent = mx.array(rng.randint(0, P, size=(G, units)).astype(np.int32))
    level = "b" if uses else "s"
    lo, hi = summaries[level + "min"], summaries[level + "max"]
    before = mx.compile(lambda q: bound(q, "minmax", lambda x, n: x @ (lo if n == "min" else hi).swapaxes(1, 2)).max(axis=1))
    after = mx.compile(lambda q: bound(q, "minmax", lambda x, n: (lo if n == "min" else hi) @ x.swapaxes(1, 2)).max(axis=2))
    pieces = {"scan q @ s^T (before)": before, "scan s @ q^T (now)": after,
              "coarse pass (_ranked)": mx.compile(lambda q: _ranked(static, q, "minmax", summaries, counts[1:2],
                                                                     counts[2:3])),
              "whole selection (now)": lambda q: select(static, None, None, q, counts, summaries, (keys,), (values,),
                                                        recent)}
    if uses:    # the index's candidates (kept blocks + the unfinished one), scored (masked past P)
        kb = static.blocks_kept

        def kept(q):    # the block scan as `_ranked` runs it: the bound, masked past NB, its argpartition
            bs = _bound(q, "minmax", summaries, "b")
            bs = mx.where(iota(bs.shape[-1]) < counts[2:3], bs, -mx.inf)
            return mx.argpartition(-bs, kb - 1, axis=-1)[:, :kb]
        pieces["block scan + argpartition"] = mx.compile(kept)
        blocks = mx.array(np.concatenate([rng.choice(NB, size=(G, kb)), np.full((G, 1), NB)], axis=1).astype(np.int32))
        cand = (blocks[..., None] * BLOCK + iota(BLOCK)).reshape(G, -1)

        def masked(sc):
            return mx.where(cand < P, sc, -mx.inf)
        pieces["candidates by page (before)"] = mx.compile(
            lambda q: masked(_bound_at(q, "minmax", summaries, mx.minimum(cand, cap_p - 1))))
        pieces["candidates by block (now)"] = mx.compile(
            lambda q: masked(_bound_blocks(q, "minmax", summaries, blocks, BLOCK)))
    times: dict = {name: [] for name in pieces}
    cpu: dict = {name: [] for name in pieces}
    same = same_cand = True
    for i in range(reps + 2):
        q = mx.array(rng.randn(G, REP, D).astype(f32))
        mx.eval(q)
        if i == 0:
            same = bool(mx.array_equal(before(q), after(q)).item())
            if uses:
                same_cand = bool(mx.array_equal(pieces["candidates by page (before)"](q),
                                                pieces["candidates by block (now)"](q)).item())
        for name, fn in pieces.items():
            t0, c0 = time.perf_counter(), time.process_time()
            mx.eval(fn(q))
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    out = {"context": tokens, "pages": P, "blocks": NB, "index": uses,
           "scanned": NB if uses else P, "same_bits": same, "candidates_same_bits": same_cand}
    out.update({name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()})
    out["cpu"] = {name: round(statistics.median(t) * 1e3, 3) for name, t in cpu.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,65536,262144,1048576")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top-pages", type=int, default=TOP,
                    help="the coarse pass's pages (64: a hot window of 256; 256: sink4/hot1024)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    contexts = token_counts(ap, "--contexts", a.contexts)
    if not contexts or min(contexts) < PAGE * BLOCK:
        ap.error(f"--contexts {a.contexts!r}: each at least {PAGE * BLOCK} tokens")
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    if a.top_pages < UNITS * PAGE:   # fewer would pick top // PAGE = no span at all (or fewer than the default's 4)
        ap.error(f"--top-pages {a.top_pages}: give at least {UNITS * PAGE} ({UNITS} spans of {PAGE} pages, what a query picks)")
    rng = np.random.RandomState(0)
    rows = []
    for tokens in contexts:
        r = row(tokens, a.reps, rng, a.top_pages)
        rows.append(r)
        print(f"{tokens:>9,} tokens ({'blocks' if r['index'] else 'pages'} scanned {r['scanned']:>6,}): "
              f"scan q @ s^T {r['scan q @ s^T (before)']:7.3f} ms, s @ q^T {r['scan s @ q^T (now)']:7.3f} ms "
              f"(same bits: {r['same_bits']}); coarse pass {r['coarse pass (_ranked)']:7.3f} ms, "
              f"whole selection {r['whole selection (now)']:7.3f} ms per layer (cpu {r['cpu']['whole selection (now)']:7.3f})"
              + (f"; candidates by page {r['candidates by page (before)']:7.3f} ms, by block "
                 f"{r['candidates by block (now)']:7.3f} ms (same bits: {r['candidates_same_bits']})"
                 if r["index"] else ""), flush=True)
    if a.json is not None:
        write_atomic(a.json, json.dumps({"reps": a.reps, "shape": {"G": G, "rep": REP, "D": D},
                                         "top_pages": a.top_pages, "blocks_kept": EXPAND * a.top_pages,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
