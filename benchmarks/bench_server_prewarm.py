"""Time to first token of `serve --prompt-cache` vs a cold server (docs/prompt-cache.md).

Prefills a document of N tokens once under POLICY and saves it (as `cache-prompt` does), then
starts two live servers on loopback in this process, one pre-warmed from the file and one cold,
and asks each the same streamed greedy question (document + question) through /api/generate:
time to the first streamed piece, prefilled tokens, and the answers (they must be equal).

    python -m benchmarks.bench_server_prewarm [--model M] [--tokens 4096] [--policy int4+sink4/window256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache.persist import save_prompt_cache
from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.generate import prefill
from tinygpt_mlx.loading import load
from tinygpt_mlx.server.app import create_app, serve_in_thread

QUESTION = "\n\nQuestion: what is this text about?\nAnswer:"


def serve(loaded, cfg, chunk, files):
    return serve_in_thread(create_app(loaded, cfg, prefill_chunk=chunk, max_slots=2, prompt_caches=files))


def ask(url, name, prompt, n):
    t0 = time.perf_counter()
    first, text, final = None, [], None
    body = {"model": name, "prompt": prompt, "options": {"temperature": 0, "num_predict": n}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            d = json.loads(line)
            if d.get("response") and first is None:
                first = time.perf_counter() - t0
            text.append(d.get("response", ""))
            if d.get("done"):
                final = d
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "prompt_eval_count": final["prompt_eval_count"],
            "answer": "".join(text)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--policy", default="int4+sink4/window256")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loaded = load(args.model)
    cfg = parse_policy(args.policy)
    tok = loaded.tokenizer
    rng = np.random.RandomState(0)
    # The document is cut to a multiple of the prefill chunk (and re-encoded until stable) so the
    # cold server's chunks are the pre-warmed one's: doc chunks, then the question alone. KIVI
    # freezes and StreamingLLM evicts by chunk, so only then must the answers be bit-equal.
    ids = rng.randint(1, 4000, args.tokens).tolist()
    for _ in range(20):
        ids = ids[:len(ids) // args.chunk * args.chunk]
        doc = tok.decode(ids)
        ids = tok.encode(doc)
        if len(ids) % args.chunk == 0:
            break
    aligned = len(ids) % args.chunk == 0 and tok.encode(doc + QUESTION) == ids + tok.encode(QUESTION)
    path = Path(tempfile.mkdtemp(prefix="bench-prewarm-")) / "doc.ptc"
    with make_cache(loaded.model, cfg) as cache:
        t0 = time.perf_counter()
        logits = prefill(loaded.model, ids, cache, args.chunk)
        t_prefill = time.perf_counter() - t0
        save_prompt_cache(path, cache, loaded, ids, logits)
    t0 = time.perf_counter()
    warm_srv = serve(loaded, cfg, args.chunk, [path])
    t_start = time.perf_counter() - t0
    cold_srv = serve(loaded, cfg, args.chunk, [])
    try:
        warm = ask(warm_srv[2], loaded.name, doc + QUESTION, args.answer_tokens)
        cold = ask(cold_srv[2], loaded.name, doc + QUESTION, args.answer_tokens)
    finally:
        for srv, t, _ in (warm_srv, cold_srv):
            srv.should_exit = True
            t.join(timeout=30)
    out = {"machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()}", "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
           "model": loaded.name, "policy": args.policy, "doc_tokens": len(ids), "chunk_aligned": aligned, "file_bytes": path.stat().st_size,
           "cache_prompt_prefill_s": t_prefill, "warm_server_startup_s": t_start, "prewarmed": warm, "cold": cold,
           "ttft_ratio": cold["ttft_s"] / warm["ttft_s"], "same_answer": warm["answer"] == cold["answer"]}
    path.unlink()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
