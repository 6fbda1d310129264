"""Gemma 3 270M from its GGUF: our loader's greedy tokens against transformers' own GGUF loader.

Both read the same file (`python scripts/fetch_gemma3.py`) and run in float32: ours through
mlx-lm's gemma3_text (CPU backend, weights dequantised), transformers through
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` (torch, CPU). For each
prompt: both tokenizers' ids, `--tokens` greedy ids (ours under the full policy, and under
mlx-lm's own caches, which rotate the sliding-window layers), and the largest difference of
the next-token logits after the prompt. The short prompts fit in the 512-token window; the
long ones (the start of the held-out KJV text) pass it, so the sliding layers' window matters.
Not a test (transformers' load alone takes a minute or two here). Usage:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m benchmarks.gemma3_hf_reference --json docs/results/gemma3_hf_greedy.json

Needs transformers, torch and accelerate (transformers asks for it to load a GGUF).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHORT = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are"]
LONG_CHARS = (2800, 8000)   # the held-out text's first characters: ~700 and ~2,000 tokens


def prompts() -> list[str]:
    from tinygpt_mlx.evaluate.inputs import HELDOUT_KJV

    text = HELDOUT_KJV.read_text(encoding="utf-8")
    return SHORT + [text[:n] for n in LONG_CHARS]


def ours(path: Path, texts: list[str], tokens: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.generate import greedy_tokens
    from tinygpt_mlx.loading import load

    out = []
    with load(path) as loaded:
        for text in texts:
            ids = loaded.tokenizer.encode(text)
            full = greedy_tokens(loaded.model, ids, make_cache(loaded.model, CacheConfig()), tokens, 512)
            own = greedy_tokens(loaded.model, ids, make_prompt_cache(loaded.model), tokens, 512)
            logits = loaded.model(mx.array([ids]))[0, -1].astype(mx.float32)
            out.append({"prompt_ids": ids, "ids": full, "ids_mlx_lm_cache": own,
                        "logits": logits.tolist(), "text": loaded.tokenizer.decode(full)})
    return out


def transformers_side(path: Path, texts: list[str], tokens: int) -> tuple[list[dict], dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    cfg = model.config
    config = {k: getattr(cfg, k, None) for k in ("sliding_window", "layer_types", "rope_theta",
                                                 "rope_local_base_freq", "query_pre_attn_scalar",
                                                 "tie_word_embeddings", "max_position_embeddings")}
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
            g = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        new = g[0, ids.shape[1]:].tolist()
        out.append({"prompt_ids": ids[0].tolist(), "ids": new, "logits": logits.tolist(), "text": tok.decode(new)})
    return out, config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the one scripts/fetch_gemma3.py fetched)")
    ap.add_argument("--tokens", type=int, default=20, help="greedy tokens per prompt")
    ap.add_argument("--json", default=None, help="also write the table here (atomically)")
    args = ap.parse_args()
    import numpy as np

    from tinygpt_mlx.cli.common import write_atomic
    from tinygpt_mlx.errors import PosttrainError
    from tinygpt_mlx.realmodel import gemma3_path

    if args.tokens < 1:
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    try:
        path = Path(args.gguf) if args.gguf else gemma3_path(fetch=False)
    except PosttrainError as e:
        ap.error(str(e))
    if not path.is_file():
        ap.error(f"--gguf {path}: no such file")
    texts = prompts()
    t0 = time.perf_counter()
    mine = ours(path, texts, args.tokens)
    t1 = time.perf_counter()
    theirs, hf_config = transformers_side(path, texts, args.tokens)
    t2 = time.perf_counter()
    rows = []
    for text, a, b in zip(texts, mine, theirs):
        la, lb = np.array(a.pop("logits")), np.array(b.pop("logits"))
        rows.append({"prompt": text if len(text) < 80 else f"held-out KJV, first {len(text)} characters",
                     "prompt_tokens": len(a["prompt_ids"]),
                     "same_prompt_ids": a["prompt_ids"] == b["prompt_ids"],
                     "same_greedy": a["ids"] == b["ids"],
                     "same_greedy_mlx_lm_cache": a["ids_mlx_lm_cache"] == b["ids"],
                     "max_abs_logit_diff": float(np.abs(la - lb).max()),
                     "logit_range": float(lb.max() - lb.min()),
                     "same_top1": int(la.argmax()) == int(lb.argmax()),
                     "ours": {"ids": a["ids"], "text": a["text"]},
                     "transformers": {"ids": b["ids"], "text": b["text"]},
                     **({} if a["ids_mlx_lm_cache"] == a["ids"] else {"mlx_lm_cache_ids": a["ids_mlx_lm_cache"]})})
        if len(text) < 80:
            rows[-1]["prompt_ids"] = b["prompt_ids"]
        else:
            rows[-1]["prompt_chars"] = len(text)
    result = {"gguf": path.name, "tokens": args.tokens, "transformers_config": hf_config,
              "seconds": {"ours": round(t1 - t0, 1), "transformers": round(t2 - t1, 1)}, "prompts": rows}
    for r in rows:
        print(f"{r['prompt'][:40]!r:44} {r['prompt_tokens']:5d} tokens  ids {r['same_prompt_ids']}  "
              f"greedy {r['same_greedy']} (mlx-lm cache {r['same_greedy_mlx_lm_cache']})  "
              f"max |dlogit| {r['max_abs_logit_diff']:.2e} of {r['logit_range']:.1f}", file=sys.stderr)
    text = json.dumps(result, indent=1) + "\n"
    if args.json:
        write_atomic(Path(args.json), text)
    else:
        print(text)


if __name__ == "__main__":
    main()
