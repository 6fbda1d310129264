"""Does a late question in a chat reach an early turn through retrieval? A ChatSession (the code
`posttrainllm chat` runs) with retrieval: turn 1 states a pass key, then filler turns push it
into the cold store, then a question. The retrieval telemetry, told where the pass key's tokens
are (`KVCache.set_truth`), reports how often the question's retrievals fetched them back
(`token_any`: some of its tokens, per layer, KV head and step; `token_recall`: the share of
them), for the pass-key question and for an unrelated question (the control), and what the
model answered. For docs/chat.md:

    python -m benchmarks.chat_retrieval_reach [--model M] [--rounds 8] [--hot 64] [--json FILE]

`--question` replaces the pass-key question (a model trained on conversations is asked "What is
the pass key?" and answers in its reply), `--reply-tokens` the reply's length, and `--compare`
adds the pass-key question under the full cache and under StreamingLLM (sink 4, window = the
hot budget) on the same conversation.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tinygpt_mlx.chat import ChatSession
from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.errors import ContextLengthError
from tinygpt_mlx.loading import load

FACT, KEY = "The pass key is 48213. Remember it.", " 48213"
FILLER = ["Tell me about the weather in the valley today.", "And the king went up to the city with all his men.",
          "What do the fishermen bring home in the evening?", "The wind came down from the hills and the river rose.",
          "Who keeps the gate of the old town at night?"]
QUESTIONS = {"pass key": "What is the pass key? The pass key is", "control": "Where does the river go in the spring?"}


def run(loaded, config: CacheConfig, rounds: int, question: str, reply_tokens: int = 4) -> dict:
    s = ChatSession(loaded, config, SampleConfig(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True))
    "".join(s.say(FACT))
    ids, key = s.conversation.transcript_ids(), loaded.tokenizer.encode(KEY)
    at = next(i for i in range(len(ids)) if ids[i:i + len(key)] == key)
    for text in FILLER * rounds:
        "".join(s.say(text))
    s.flush()
    if config.retrieval:
        s.cache.record_retrievals()
        s.cache.set_truth(list(range(at, at + len(key))))
        s.cache.reset_telemetry()
    reply = "".join(s.say(question))
    out = {"current_length": s.cache.current_length, "key_positions": [at, at + len(key)], "reply": reply,
           "answered": KEY.strip() in reply, **(s.cache.retrieval_report() if config.retrieval else {})}
    s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=8, help="times the 5 filler turns are said")
    ap.add_argument("--hot", type=int, default=64, help="--kiv-hot-budget")
    ap.add_argument("--unit", choices=("tokens", "spans"), default=None,
                    help="--kiv-unit (default: the policy default, spans)")
    ap.add_argument("--question", default=QUESTIONS["pass key"], help="the pass-key question")
    ap.add_argument("--reply-tokens", type=int, default=4, help="tokens of each reply")
    ap.add_argument("--compare", action="store_true", help="also the full cache and StreamingLLM")
    ap.add_argument("--rope", choices=("shifted", "absolute"), default=None,
                    help="--streaming-llm-rope (default: the policy default, shifted; the runs before "
                         "2026-12-01 used absolute)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    loaded = load(a.model)
    config = CacheConfig(sink=4, hot_budget=a.hot, rope_mode=a.rope, retrieve_unit=a.unit)
    questions = {**QUESTIONS, "pass key": a.question}
    rows = {name: run(loaded, config, a.rounds, q, a.reply_tokens) for name, q in questions.items()}
    if a.compare:
        for name, cfg in (("full cache", CacheConfig()),
                          ("streaming", CacheConfig(sink=4, window=a.hot, rope_mode=a.rope))):
            try:
                rows[name] = run(loaded, cfg, a.rounds, questions["pass key"], a.reply_tokens)
            except ContextLengthError as e:      # the full cache of a long chat outgrows the model
                print(f"{name:10s} does not fit: {e}")
    for name, r in rows.items():
        fetched = (f"cold {r['cold_tokens']}: pass-key tokens fetched in {r.get('token_any', 0):.3f} of layer-head "
                   f"steps (recall {r.get('token_recall', 0):.3f}); " if "cold_tokens" in r else "")
        print(f"{name:10s} currentLength {r['current_length']}, {fetched}answer {r['reply']!r}"
              f"{' (right)' if r['answered'] else ''}")
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"config": config.label(), "rope": config.rope_mode, "rounds": a.rounds, "model": loaded.name,
                                   "questions": questions, "rows": rows}, indent=1))
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
