"""Time to first token of regenerate / edited reply / follow-up after a long document, per policy.

Issue #32. Starts `posttrainllm serve`'s app in-process for each cache policy and talks to it over
HTTP with ollama's /api/chat, streamed (Open WebUI's requests):

  cold:  the document (--doc-tokens of the shipped KJV held-out text) as the first message
  (a)    the same request again ("regenerate")
  (b)    the reply edited in its last words + a new question
  (c)    a follow-up to (b)

TTFT is measured at the client (request sent -> first streamed text; the empty keep-alive
chunks a long prefill sends are not text). The final line gives the
tokens prefilled (prompt_eval_count) and restored from a checkpoint; /api/ps the bytes the slot's
checkpoints hold. One JSON line per policy on stdout; a table on stderr.

  python -m benchmarks.bench_slot_restore ~/.cache/posttrainllm/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --doc-tokens 7000 --json docs/results/smollm2_slot_restore.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from tinygpt_mlx.evaluate.modes import parse_policy
from tinygpt_mlx.loading import load
from tinygpt_mlx.server.app import create_app, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent

POLICIES = ["full", "int4", "sink4/window1024", "int4+sink4/window1024", "sink4/hot1024", "int4+sink4/hot1024:absolute"]


def chat(url: str, model: str, messages: list, num_predict: int) -> dict:
    body = {"model": model, "messages": messages, "stream": True,
            "options": {"temperature": 0, "num_predict": num_predict}}
    t0 = time.perf_counter()
    ttft, text, final = None, [], {}
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise SystemExit(f"bench_slot_restore: /api/chat answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line:
                continue
            d = json.loads(line)
            # the first text (or the end): not a keep-alive chunk (empty text, sent every 10 s)
            if ttft is None and (d.get("done") or d.get("message", {}).get("content")):
                ttft = time.perf_counter() - t0
            if d.get("done"):
                final = d
            else:
                text.append(d["message"]["content"])
    return {"ttft_s": round(ttft, 3), "text": "".join(text), "prefilled": final.get("prompt_eval_count"),
            "prompt_tokens": final.get("prompt_tokens"), "restored": final.get("prompt_restored_tokens"),
            "cached": final.get("prompt_cached_tokens")}


def document(loaded, n_tokens: int) -> str:
    text = (ROOT / "tinygpt_mlx" / "data" / "heldout_kjv.txt").read_text()
    ids = loaded.tokenizer.encode(text)[:n_tokens]
    return loaded.tokenizer.decode(ids)


def run(loaded, policy: str, doc: str, num_predict: int, chunk: int) -> dict:
    cfg = parse_policy(policy)
    app = create_app(loaded, cfg, max_slots=2, prefill_chunk=chunk)
    srv, thread, url = serve_in_thread(app, timeout=60)
    name = app.state.server.names[1]
    out: dict = {"policy": policy, "label": cfg.label()}
    try:
        first = [{"role": "user", "content": doc + "\n\nSummarise the text above in one sentence."}]
        out["cold"] = cold = chat(url, name, first, num_predict)
        out["regenerate"] = chat(url, name, first, num_predict)
        reply = cold["text"]
        edited = reply[: max(1, len(reply) // 2)] + " and so on."
        second = first + [{"role": "assistant", "content": edited},
                          {"role": "user", "content": "Who is speaking in it?"}]
        out["edited"] = two = chat(url, name, second, num_predict)
        third = second + [{"role": "assistant", "content": two["text"]},
                          {"role": "user", "content": "And to whom?"}]
        out["follow_up"] = chat(url, name, third, num_predict)
        mem = httpx.get(url + "/api/ps").json()["models"][0]["posttrainllm"]
        out["cache_bytes"], out["checkpoint_bytes"] = mem["cache_bytes"], mem["checkpoint_bytes"]
        slots = httpx.get(url + "/api/slots").json()["slots"]
        out["checkpoints"] = [s.get("checkpoints", []) for s in slots]
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        app.state.server.pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="MODEL as `serve` takes it (the SmolLM2 GGUF for the docs' table)")
    ap.add_argument("--doc-tokens", type=int, default=7000)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy specs")
    ap.add_argument("--num-predict", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--json", type=Path, help="also write the results here (one JSON list)")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        parse_policy(p)          # a bad spec fails before the model loads
    loaded = load(args.model)
    doc = document(loaded, args.doc_tokens)
    results = []
    print(f"{'policy':28} {'cold':>8} {'regen':>8} {'edited':>8} {'follow':>8}  prefilled (cold/a/b/c)   checkpoints",
          file=sys.stderr)
    for p in policies:
        r = run(loaded, p, doc, args.num_predict, args.prefill_chunk)
        results.append(r)
        print(json.dumps(r), flush=True)
        parts = [r[k] for k in ("cold", "regenerate", "edited", "follow_up")]
        print(f"{p:28} " + " ".join(f"{x['ttft_s']:7.2f}s" for x in parts)
              + "  " + "/".join(str(x["prefilled"]) for x in parts)
              + f"   {r['checkpoint_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
