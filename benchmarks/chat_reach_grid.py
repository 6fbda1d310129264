"""How often does a late chat question get an early turn's fact back? For docs/chat.md.

A `ChatSession` (the code `posttrainllm chat` runs): turn 1 states a pass key ("The pass key is
N. Remember it."), then `rounds` x 5 filler turns (benchmarks/chat_retrieval_reach.py's), then
"What is the pass key?". For each of `--keys` random 5-digit keys and each rounds count, the
greedy reply (12 tokens) under the full cache (only where the conversation fits the model's
context), StreamingLLM (sink 4 + window = the hot budget) and retrieval (sink 4 + hot budget,
the rest in the cold store); a reply counts when it contains the key.

    python -m benchmarks.chat_reach_grid [--model M] [--rounds 2,4,8] [--keys 5] [--hot 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from tinygpt_mlx.chat import ChatSession
from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.errors import ContextLengthError
from tinygpt_mlx.loading import load

FILLER = ["Tell me about the weather in the valley today.", "And the king went up to the city with all his men.",
          "What do the fishermen bring home in the evening?", "The wind came down from the hills and the river rose.",
          "Who keeps the gate of the old town at night?"]


def ask(loaded, config: CacheConfig, key: str, rounds: int) -> dict:
    s = ChatSession(loaded, config, SampleConfig(temperature=0.0, max_tokens=12, ignore_eos=True))
    try:
        "".join(s.say(f"The pass key is {key}. Remember it."))
        for text in FILLER * rounds:
            "".join(s.say(text))
        reply = "".join(s.say("What is the pass key?"))
        return {"reply": reply, "right": key in reply, "current_length": s.cache.current_length}
    finally:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", default="2,4,8", help="comma list: times the 5 filler turns are said")
    ap.add_argument("--keys", type=int, default=5)
    ap.add_argument("--hot", type=int, default=64, help="--kiv-hot-budget (and the StreamingLLM window)")
    ap.add_argument("--retrieval", default="", help="extra policy spec parts for retrieval, e.g. "
                    "hybrid+nosticky+expand1 (the retrieval defaults before 2026-12-02)")
    ap.add_argument("--policies", default="full cache,streaming,retrieval", help="comma list of the three")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    loaded = load(a.model)
    rng = random.Random(0)
    keys = [str(rng.randint(10000, 99999)) for _ in range(a.keys)]
    policies = {"full cache": CacheConfig(), "streaming": CacheConfig(sink=4, window=a.hot),
                "retrieval": CacheConfig.from_spec(f"sink4/hot{a.hot}" + (f"+{a.retrieval}" if a.retrieval else ""))}
    unknown = [n for n in a.policies.split(",") if n not in policies]
    if unknown:
        ap.error(f"--policies {a.policies!r}: unknown {', '.join(unknown)} (choose from {', '.join(policies)})")
    policies = {name: policies[name] for name in a.policies.split(",")}
    rows = []
    for rounds in [int(r) for r in a.rounds.split(",")]:
        for name, cfg in policies.items():
            cells = []
            for key in keys:
                try:
                    cells.append({"key": key, **ask(loaded, cfg, key, rounds)})
                except ContextLengthError:       # the full cache of a long chat outgrows the model
                    break
            if not cells:
                print(f"rounds {rounds:2d} {name:10s} does not fit the model's context", flush=True)
                continue
            rows.append({"rounds": rounds, "policy": name, "right": sum(c["right"] for c in cells),
                         "n": len(cells), "current_length": cells[0]["current_length"], "cells": cells})
            print(f"rounds {rounds:2d} {name:10s} {rows[-1]['right']}/{len(cells)} right "
                  f"(conversation {cells[0]['current_length']} tokens): "
                  + ", ".join(repr(c["reply"].strip()[:24]) for c in cells), flush=True)
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"model": loaded.name, "hot": a.hot, "keys": keys, "rows": rows}, indent=1))
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
