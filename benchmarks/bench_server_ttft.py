"""Time to first token of the second turn of a long chat, with and without the warm slot.

Starts `posttrainllm serve`'s app in-process (uvicorn on a free 127.0.0.1 port) and talks to it
over HTTP with ollama's /api/chat, streamed, like Open WebUI does:

  turn 1: one long user message (~--context-tokens tokens of data/heldout.txt), short answer
  turn 2: the history + a short question           <- measured
  warm:   turn 2 right after turn 1 (the slot holds turn 1: only the tail is prefilled)
  cold:   the same turn 2 after the server's slots were cleared (what a server without warm
          slots does: the whole history is prefilled again)

TTFT is measured at the client: request sent -> first streamed NDJSON line. The server's own
prefill time (prompt_eval_duration) and prefilled-token count (prompt_eval_count) come from
the final chunk. Median of --repeats conversations, each on a different slice of the text.

  python -m benchmarks.bench_server_ttft --model models/tinygpt-base.tinygpt
  python -m benchmarks.bench_server_ttft --fixture            # the tests' tiny random model
  python -m benchmarks.bench_server_ttft --random-shape 2048  # untrained, d256 / 6 layers
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import mlx.core as mx

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load
from tinygpt_mlx.server.app import create_app, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent


#: the text the tests' tokenizer is trained on (tests/conftest.py's TEXT): the same tokenizer,
#: so `--fixture` is the tests' tiny model
TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word "
    "was with the keeper of numbers 0123456789. Café, naïve, 東京 and emoji 🙂 round-trip. "
) * 20


def train_tokenizer(vocab_size: int = 320):
    """The tests' byte-level BPE tokenizer (tests/conftest.py's `train_tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    return tok


def build_native(path: Path, tokenizer_json: str, seed: int = 0, **overrides) -> Path:
    """A random-weight native model written to `path` (tests/conftest.py's `build_native`: the
    tiny fixture's shape unless `overrides` say otherwise)."""
    from tinygpt_mlx import format as fmt  # noqa: PLC0415
    from tinygpt_mlx.config import ModelConfig  # noqa: PLC0415
    from tinygpt_mlx.model import Model  # noqa: PLC0415
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    cfg = dict(vocab_size=len(vocab) + 1, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
               context_length=256)
    cfg.update(overrides)
    mx.random.seed(seed)
    model = Model(ModelConfig(**cfg))
    mx.eval(model.parameters())
    return fmt.save(path, model, tokenizer_json)


def build_model(kind: str, context: int) -> Path:
    """A random-weight native model: the tests' tiny fixture, or the training default shape."""
    tok = train_tokenizer().to_str()
    path = Path(tempfile.mkdtemp()) / f"{kind}.tinygpt"
    if kind == "fixture":
        return build_native(path, tok)
    return build_native(path, tok, d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=768,
                        context_length=context)


def serve(loaded, cache_config, prefill_chunk):
    app = create_app(loaded, cache_config, max_slots=2, prefill_chunk=prefill_chunk)
    return (app, *serve_in_thread(app))


def chat(url: str, model: str, messages: list, num_predict: int) -> dict:
    body = {"model": model, "messages": messages, "stream": True,
            "options": {"temperature": 0, "num_predict": num_predict}}
    t0 = time.perf_counter()
    ttft, text, final = None, [], None
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None:
                ttft = time.perf_counter() - t0
            obj = json.loads(line)
            if obj["done"]:
                final = obj
            else:
                text.append(obj["message"]["content"])
    return {"ttft_s": ttft, "text": "".join(text), "prompt_eval_count": final["prompt_eval_count"],
            "prompt_eval_ms": final["prompt_eval_duration"] / 1e6, "total_prompt": final.get("prompt_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a .tinygpt file or mlx-lm directory")
    src.add_argument("--fixture", action="store_true", help="the tests' tiny random model (context 256)")
    src.add_argument("--random-shape", type=int, metavar="CONTEXT",
                     help="random weights, d256 / 6 layers (the training default), with this context")
    ap.add_argument("--context-tokens", type=int, default=None,
                    help="tokens in the first user message (default: 70%% of the model's context)")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--streaming-llm-sink", type=int, default=None)
    ap.add_argument("--streaming-llm-window", type=int, default=None,
                    help="serve with a StreamingLLM cache (cannot be trimmed: warm turns must extend)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    if args.fixture or args.random_shape:
        path = build_model("fixture" if args.fixture else "random-base-shape", args.random_shape or 256)
        label = ("tiny test fixture (random weights, d64, 2 layers, context 256)" if args.fixture else
                 f"UNTRAINED random weights, d256, 6 layers (the training default), context {args.random_shape}")
    else:
        path = args.model or ROOT / "models" / "tinygpt-base.tinygpt"
        label = str(path)
    loaded = load(path)
    tok = loaded.tokenizer
    ctx = loaded.context_length or 4096
    n_first = args.context_tokens or int(ctx * 0.7) - 2 * args.answer_tokens
    text = (ROOT / "data" / "heldout.txt").read_text(encoding="utf-8")
    ids = tok.encode(text[:200_000])
    cache_config = CacheConfig.from_flags(sink=args.streaming_llm_sink, window=args.streaming_llm_window)
    app, server, thread, url = serve(loaded, cache_config, args.prefill_chunk)
    model = loaded.name
    runs = {"warm": [], "cold": []}
    try:
        chat(url, model, [{"role": "user", "content": "warm-up"}], 2)
        for i in range(args.repeats):
            first = tok.decode(ids[i * n_first:(i + 1) * n_first])
            msgs = [{"role": "user", "content": first}]
            a = chat(url, model, msgs, args.answer_tokens)
            msgs += [{"role": "assistant", "content": a["text"]},
                     {"role": "user", "content": "Who is speaking here, and to whom?"}]
            runs["warm"].append(chat(url, model, msgs, args.answer_tokens))
            for slot in list(app.state.server.pool.slots):
                app.state.server.pool.invalidate(slot)
            runs["cold"].append(chat(url, model, msgs, args.answer_tokens))
    finally:
        server.should_exit = True     # shutdown stops the worker; join before the interpreter exits
        thread.join(timeout=30)
    out = {"model": label, "cache": cache_config.label(), "first_message_tokens": n_first, "repeats": args.repeats,
           "prefill_chunk": args.prefill_chunk}
    for k, rs in runs.items():
        out[k] = {"ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in rs), 1),
                  "prefill_ms": round(statistics.median(r["prompt_eval_ms"] for r in rs), 1),
                  "prompt_eval_count": statistics.median(r["prompt_eval_count"] for r in rs),
                  "turn2_prompt_tokens": statistics.median(r["total_prompt"] for r in rs)}
    out["speedup"] = round(out["cold"]["ttft_ms"] / out["warm"]["ttft_ms"], 1)
    print(json.dumps(out, indent=2))
    print(f"\n| model | cache | turn-2 prompt | warm: prefilled / TTFT | cold: prefilled / TTFT | speed-up |\n"
          f"|---|---|---|---|---|---|\n| {label} | {out['cache']} | {out['warm']['turn2_prompt_tokens']:.0f} tokens | "
          f"{out['warm']['prompt_eval_count']:.0f} tok / {out['warm']['ttft_ms']} ms | "
          f"{out['cold']['prompt_eval_count']:.0f} tok / {out['cold']['ttft_ms']} ms | {out['speedup']}x |")
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
