"""Where one layer's attention of a retrieval prefill chunk goes, piece by piece, beside
StreamingLLM's whole attention at the same hot window (issue 53's prefill target), at the shipped
model's sizes under `sink4/hot1024`: 512 queries (8 heads over 4 KV heads of dim 32), a pool of
545 pages of 8 tokens (2 x 256 top pages, the unfinished page, 32 sticky pages: 4,360 tokens),
32 pages picked per query, the sink's 4 tokens and the hot window's 1,024 + the chunk's 511.
`--geometry smollm2` takes SmolLM2-135M's heads (9 over 3 KV heads of dim 64), `--chunk` another
chunk length (the pool stays 545 pages: two query rows' top pages whatever the chunk).
Random keys and queries; each piece is evaluated alone on inputs evaluated before it, the pieces
interleaved round by round; the median of `--reps` rounds. glibc's thresholds are set as
`posttrainllm` sets them (tinygpt_mlx/heap.py); `--glibc-heap` leaves glibc's own.

Besides the pieces: StreamingLLM's attention split as MLX's CPU fallback runs it (the fused call
is that composition on a CPU), and candidate compositions of retrieval's attention that attend to
the same tokens (each one's largest difference from `segments.attend` is recorded; the
candidates' softmax is `mx.softmax`):
the causal mask as an additive bias of the window's scores (`addmm`), the queries in causal
blocks (a block scores only the chunk's keys its queries can see), and one masked
`mx.fast.scaled_dot_product_attention` over the whole pool + sink + window. `floor_ms` in the
JSON sums the pieces any composition does (the pool's q.k, the group and page maxima, the
pages' argpartition, the sink and window scores, the softmax over picked + sink + window, the
two outputs): a lower bound on retrieval's attention as MLX's CPU kernels run them, and
`floor_ms_cpu_softmax` the same with the softmax of cache/cpu_softmax.py, which `segments.attend`
takes for a retrieval chunk on an x86 CPU (the whole attention is timed with it and, as before
it, with `mx.softmax`).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.pool_attention_parts [--reps 7] [--glibc-heap] [--geometry shipped|smollm2]
        [--chunk 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx import heap
from tinygpt_mlx.cache import cpu_softmax
from tinygpt_mlx.cache.segments import DenseSegment, PoolSegment, attend, mask_array

GEOMETRIES = {"shipped": (8, 4, 32), "smollm2": (9, 3, 64)}     # query heads, KV heads, head dim
B = 1
UNIT, UNITS, POOL_PAGES = 8, 32, 545
U = POOL_PAGES * UNIT
WINDOW = 1024

#: the pieces any composition of retrieval's attention does, each once (`floor_ms`)
FLOOR = ("  pool: q.k matmul", "  pool: max over the query group", "  pool: max per page",
         "  pool: argpartition of the pages", "sink and window scores", "softmax (picked + sink + window)",
         "pool output (PoolSegment.output)", "window output")


def plain_softmax(fn):
    """fn() with `segments.attend` on `mx.softmax` (cpu_softmax off), evaluated."""
    held, cpu_softmax.ENABLED = cpu_softmax.ENABLED, False
    try:
        out = fn()
        mx.eval(out)
        return out
    finally:
        cpu_softmax.ENABLED = held


def group_max(raw: mx.array) -> mx.array:
    """The max over a KV head's query group (axis 2), as `PoolSegment.scores` takes it."""
    best = raw[:, :, 0]
    for r in range(1, raw.shape[2]):
        best = mx.maximum(best, raw[:, :, r])
    return best


def pool_pages_output(pool: PoolSegment, p: mx.array, top: mx.array) -> mx.array:
    """`PoolSegment.output` (spans) for the queries whose picked pages are `top` [B, H, l, k]."""
    B_, H, rep, L, T = p.shape
    u, D = pool.unit, pool.values.shape[-1]
    P = pool.values.shape[2] // u
    rows = (top + (mx.arange(B_ * H, dtype=top.dtype) * P).reshape(B_, H, 1, 1)).reshape(-1)
    picked = mx.take(pool.values.reshape(B_ * H * P, u * D), rows, axis=0).reshape(B_, H, L, T, D)
    return (p.transpose(0, 1, 3, 2, 4) @ picked).transpose(0, 1, 3, 2, 4)


def attend_bias(kp, vp, valid, sink, body, q):
    """Retrieval's attention with the causal mask as an additive bias on the window's scores
    (`addmm`: no `where` over the joined scores)."""
    B_, Hq, L, D = q.shape
    hkv = body.n_heads
    rep = Hq // hkv
    qq = q.reshape(B_, hkv, rep, L, D)
    pool = PoolSegment(kp, vp, valid, UNITS, UNIT)
    T = body.keys.shape[2]
    causal = mask_array("causal", L, T, 0)
    bias = mx.broadcast_to(mx.where(causal, 0.0, -mx.inf)[None], (rep, L, T)).reshape(rep * L, T)
    sw = mx.addmm(bias, qq.reshape(B_, hkv, rep * L, D), body.keys.swapaxes(-1, -2)).reshape(B_, hkv, rep, L, T)
    parts = [pool.scores(qq), sink.scores(qq), sw]
    sizes = [x.shape[-1] for x in parts]
    probs = mx.softmax(mx.concatenate(parts, axis=-1), axis=-1)
    a, b = sizes[0], sizes[0] + sizes[1]
    out = pool.output(probs[..., :a]) + sink.output(probs[..., a:b]) + body.output(probs[..., b:])
    return out.reshape(B_, Hq, L, -1)


def attend_blocks(kp, vp, valid, sink, body, q, n: int):
    """Retrieval's attention with the chunk's queries in `n` causal blocks: the pool scored and
    picked once for all of them; block j scores the window's keys up to its last query's."""
    B_, Hq, L, D = q.shape
    hkv = body.n_heads
    rep = Hq // hkv
    qq = q.reshape(B_, hkv, rep, L, D)
    pool = PoolSegment(kp, vp, valid, UNITS, UNIT)
    sel = pool.scores(qq)
    ssc = sink.scores(qq)
    T = body.keys.shape[2]
    step = -(-L // n)
    outs = []
    for a in range(0, L, step):
        b = min(L, a + step)
        qb = qq[:, :, :, a:b]
        n_keys = T - L + b
        kb, vb = body.keys[:, :, :n_keys], body.values[:, :, :n_keys]
        sw = (qb.reshape(B_, hkv, rep * (b - a), D) @ kb.swapaxes(-1, -2)).reshape(B_, hkv, rep, b - a, n_keys)
        seen = mx.arange(n_keys)[None] <= (mx.arange(T - L + a, T - L + b)[:, None])
        sw = mx.where(seen, sw, -mx.inf)
        k1 = sel.shape[-1]
        probs = mx.softmax(mx.concatenate([sel[:, :, :, a:b], ssc[:, :, :, a:b], sw], axis=-1), axis=-1)
        o = (pool_pages_output(pool, probs[..., :k1], pool.top[:, :, a:b])
             + (probs[..., k1:k1 + ssc.shape[-1]].reshape(B_, hkv, rep * (b - a), -1) @ sink.values).reshape(
                 B_, hkv, rep, b - a, -1)
             + (probs[..., k1 + ssc.shape[-1]:].reshape(B_, hkv, rep * (b - a), -1) @ vb).reshape(
                 B_, hkv, rep, b - a, -1))
        outs.append(o)
    return mx.concatenate(outs, axis=3).reshape(B_, Hq, L, -1)


def attend_sdpa_masked(kp, vp, valid, sink, body, q):
    """Retrieval's attention as one `mx.fast.scaled_dot_product_attention` over every pool token
    + sink + window, each query's unpicked pages and the causal future masked."""
    B_, Hq, L, D = q.shape
    hkv = body.n_heads
    rep = Hq // hkv
    qq = q.reshape(B_, hkv, rep, L, D)
    pool = PoolSegment(kp, vp, valid, UNITS, UNIT)
    sel = pool.scores(qq)   # (the pick; its scores are recomputed by the fused call)
    P = kp.shape[2] // UNIT
    picked = mx.put_along_axis(mx.zeros((B_, hkv, L, P), dtype=mx.bool_), pool.top,
                               mx.array(True), axis=-1)
    tokens = mx.broadcast_to(picked[..., None], (B_, hkv, L, P, UNIT)).reshape(B_, hkv, L, P * UNIT) & valid[:, :, None]
    T = sink.keys.shape[2] + body.keys.shape[2]
    causal = mx.broadcast_to(mask_array("causal", L, T, 0), (B_, hkv, L, T))
    mask = mx.concatenate([tokens, causal], axis=-1)
    mask = mx.broadcast_to(mask[:, :, None], (B_, hkv, rep, L, mask.shape[-1])).reshape(B_, Hq, L, -1)
    k = mx.concatenate([kp, sink.keys, body.keys], axis=2)
    v = mx.concatenate([vp, sink.values, body.values], axis=2)
    del sel
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)


def pieces(hq: int, hkv: int, d: int, L: int) -> tuple[dict, dict]:
    """Named () -> array functions, every input evaluated beforehand; and each candidate's largest
    difference from `segments.attend`."""
    rep = hq // hkv
    key = mx.random.key
    q = mx.random.normal((B, hq, L, d), key=key(0)) * d ** -0.5
    kw, vw = (mx.random.normal((B, hkv, WINDOW + L, d), key=key(i)) for i in (1, 2))
    kp, vp = (mx.random.normal((B, hkv, U, d), key=key(i)) for i in (3, 4))
    valid = mx.ones((B, hkv, U), dtype=mx.bool_)
    sink, body = DenseSegment(kw[:, :, :4], vw[:, :, :4]), DenseSegment(kw[:, :, 4:], vw[:, :, 4:])
    qq = q.reshape(B, hkv, rep, L, d)
    pool = PoolSegment(kp, vp, valid, UNITS, UNIT)
    scores = [pool.scores(qq), sink.scores(qq), body.scores(qq)]
    joined = mx.concatenate(scores, axis=-1)
    n_picked = scores[0].shape[-1]
    mask = mask_array("causal", L, joined.shape[-1], n_picked)
    masked = mx.where(mask, joined, -mx.inf)
    probs = mx.softmax(masked, axis=-1)
    p_pool, p_body = probs[..., :n_picked], probs[..., n_picked + 4:]
    raw = (qq.reshape(B, hkv, rep * L, d) @ kp.swapaxes(-1, -2)).reshape(B, hkv, rep, L, U)
    best = group_max(raw)
    per_page = best.reshape(B, hkv, L, POOL_PAGES, UNIT).max(axis=-1)
    window_mask = mask_array("causal", L, WINDOW + L, 0)
    # StreamingLLM's fused call as MLX's CPU fallback composes it (mlx/fast.cpp)
    s_scores = qq @ mx.expand_dims(kw, 2).swapaxes(-1, -2)
    s_masked = mx.where(window_mask, s_scores, mx.finfo(mx.float32).min)
    s_probs = mx.softmax(s_masked, axis=-1, precise=True)
    reference = attend([PoolSegment(kp, vp, valid, UNITS, UNIT), sink, body], 1, q * d ** 0.5, d ** -0.5, "causal")
    mx.eval(q, kw, vw, kp, vp, valid, scores, joined, mask, masked, probs, p_pool, p_body, raw, best, per_page,
            window_mask, pool.picked, pool.top, s_scores, s_masked, s_probs, reference)
    candidates = {
        "candidate: the causal mask as an addmm bias": lambda: attend_bias(kp, vp, valid, sink, body, q),
        "candidate: queries in 2 causal blocks": lambda: attend_blocks(kp, vp, valid, sink, body, q, 2),
        "candidate: queries in 4 causal blocks": lambda: attend_blocks(kp, vp, valid, sink, body, q, 4),
        "candidate: one masked fused SDPA over pool + sink + window": lambda: attend_sdpa_masked(
            kp, vp, valid, sink, body, q),
    }
    agree = {name: float(mx.abs(f() - reference).max()) for name, f in candidates.items()}
    one_reduce = lambda: raw.reshape(B, hkv, rep, L, POOL_PAGES, UNIT).max(axis=(2, 5))    # noqa: E731
    agree["  pool: group and page max in one reduction"] = float(mx.abs(one_reduce() - per_page).max())
    fns = {
        "StreamingLLM: fused attention over sink + window + chunk": lambda: mx.fast.scaled_dot_product_attention(
            q, kw, vw, scale=1.0, mask=window_mask),
        "  StreamingLLM: q.k matmul": lambda: qq @ mx.expand_dims(kw, 2).swapaxes(-1, -2),
        "  StreamingLLM: mask (where)": lambda: mx.where(window_mask, s_scores, mx.finfo(mx.float32).min),
        "  StreamingLLM: softmax (precise)": lambda: mx.softmax(s_masked, axis=-1, precise=True),
        "  StreamingLLM: softmax, not precise": lambda: mx.softmax(s_masked, axis=-1),
        "  StreamingLLM: output matmul": lambda: s_probs @ mx.expand_dims(vw, 2),
        "retrieval: the whole attention": lambda: attend(
            [PoolSegment(kp, vp, valid, UNITS, UNIT), sink, body], 1, q * d ** 0.5, d ** -0.5, "causal"),
        "retrieval: the whole attention with mx.softmax (before cpu_softmax)": lambda: plain_softmax(
            lambda: attend([PoolSegment(kp, vp, valid, UNITS, UNIT), sink, body], 1, q * d ** 0.5, d ** -0.5,
                           "causal")),
        "pool: scores and pick (all of PoolSegment.scores)": lambda: PoolSegment(kp, vp, valid, UNITS, UNIT).scores(qq),
        "  pool: q.k matmul": lambda: qq.reshape(B, hkv, rep * L, d) @ kp.swapaxes(-1, -2),
        "  pool: max over the query group": lambda: group_max(raw),
        "  pool: max per page": lambda: best.reshape(B, hkv, L, POOL_PAGES, UNIT).max(axis=-1),
        "  pool: group and page max in one reduction": one_reduce,
        "  pool: argpartition of the pages": lambda: mx.argpartition(-per_page, UNITS - 1, axis=-1)[..., :UNITS],
        "sink and window scores": lambda: (sink.scores(qq), body.scores(qq)),
        "scores joined": lambda: mx.concatenate(scores, axis=-1),
        "mask applied": lambda: mx.where(mask, joined, -mx.inf),
        "softmax (picked + sink + window)": lambda: mx.softmax(masked, axis=-1),
        "  softmax (picked + sink + window), precise": lambda: mx.softmax(masked, axis=-1, precise=True),
        "  softmax (picked + sink + window), cpu_softmax.softmax_rows": lambda: cpu_softmax.softmax_rows(masked),
        "pool output (PoolSegment.output)": lambda: pool.output(p_pool),
        "window output": lambda: body.output(p_body),
        **candidates,
    }
    return fns, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="rounds (each times every piece once)")
    ap.add_argument("--glibc-heap", action="store_true", help="leave glibc's mmap and trim thresholds as they are")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="shipped",
                    help="heads and head dim: the shipped model's (8/4 x 32) or SmolLM2-135M's (9/3 x 64)")
    ap.add_argument("--chunk", type=int, default=512, help="queries per chunk (the prefill chunk)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: give at least 1")
    if a.chunk < 8:
        ap.error(f"--chunk {a.chunk}: give at least 8")
    kept = False if a.glibc_heap else heap.keep_large_blocks()
    from tinygpt_mlx.cli.common import write_atomic

    load_start = os.getloadavg()
    fns, agree = pieces(*GEOMETRIES[a.geometry], a.chunk)
    for f in fns.values():      # warm-up
        mx.eval(f())
    times: dict = {name: [] for name in fns}
    for _ in range(a.reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            mx.eval(f())
            times[name].append(time.perf_counter() - t0)
    rows = [{"piece": name, "ms": round(statistics.median(ts) * 1e3, 2),
             **({"max_abs_diff": agree[name]} if name in agree else {})} for name, ts in times.items()]
    ms = {r["piece"]: r["ms"] for r in rows}
    stream = ms["StreamingLLM: fused attention over sink + window + chunk"]
    floor = round(sum(ms[p] for p in FLOOR), 2)
    fast = "  softmax (picked + sink + window), cpu_softmax.softmax_rows"
    floor_fast = round(floor - ms["softmax (picked + sink + window)"] + ms[fast], 2)
    for r in rows:
        extra = f"  (x{r['ms'] / stream:.2f} of StreamingLLM's)" if not r["piece"].startswith(" ") else ""
        diff = f"  max |diff| {r['max_abs_diff']:.1e}" if "max_abs_diff" in r else ""
        print(f"{r['piece']:62s} {r['ms']:8.1f} ms{extra}{diff}", flush=True)
    print(f"{'floor (the pieces any composition does, summed)':62s} {floor:8.1f} ms  (x{floor / stream:.2f})")
    print(f"{'floor with cpu_softmax.softmax_rows':62s} {floor_fast:8.1f} ms  (x{floor_fast / stream:.2f})")
    if a.json is not None:
        write_atomic(a.json, json.dumps({"command": "python -m benchmarks.pool_attention_parts " + " ".join(sys.argv[1:]),
                                         "reps": a.reps, "load": load_start, "load_end": os.getloadavg(),
                                         "geometry": a.geometry, "chunk": a.chunk, "pool_tokens": U,
                                         "heap_kept": kept, "floor_pieces": list(FLOOR), "floor_ms": floor,
                                         "floor_over_streaming": round(floor / stream, 3),
                                         "floor_ms_cpu_softmax": floor_fast,
                                         "floor_cpu_softmax_over_streaming": round(floor_fast / stream, 3),
                                         "cpu_softmax": cpu_softmax.use_here(),
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
