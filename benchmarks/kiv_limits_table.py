"""The markdown tables of docs/retrieval.md "Beyond KIV's limits", from the JSON that
benchmarks/kiv_limits.sh writes (passed cells, and values right where an answer has several).

    python -m benchmarks.kiv_limits_table [docs/results/kiv_limits]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TASKS = {"passkey": "pass key (1 fact)", "keyed": "4 keyed facts, ask one", "keyed-all": "4 keyed facts, ask all",
         "phonebook": "phone book, ask one"}


def cell(summary: dict) -> str:
    if not summary or not summary["cells"]:
        return "-"
    text = f"{summary['passed']}/{summary['cells']}"
    if summary["values"] > summary["cells"]:
        text += f" ({summary['values_right']}/{summary['values']} values)"
    return text


def _mean(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


def main() -> None:
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/kiv_limits")
    print("Full cache, 480-token documents (inside the trained context), 5 depths x 4 seeds:\n")
    print("| task | base model | keyed model |\n|---|---:|---:|")
    for task, name in TASKS.items():
        row = []
        for model in ("base", "keyed"):
            p = d / f"full480_{model}_{task}.json"
            row.append(cell(json.loads(p.read_text())["summary"]["full"]) if p.exists() else "-")
        print(f"| {name} | {' | '.join(row)} |")
    print("\nKeyed model, StreamingLLM vs retrieval (sink 4 + 256 hot tokens), 5 depths x 3 seeds:\n")
    contexts = None
    rows, telemetry = [], []
    for task, name in TASKS.items():
        p = d / f"long_{task}.json"
        if not p.exists():
            continue
        g = json.loads(p.read_text())
        contexts = g["contexts"]
        for policy in ("streaming", "retrieval"):
            out = []
            for ctx in contexts:
                mine = [c for c in g["cells"] if c["policy"] == policy and c["context"] == ctx]
                s = {"cells": len(mine), "passed": sum(c["passed"] for c in mine),
                     "values": sum(c["values"] for c in mine), "values_right": sum(c["values_right"] for c in mine)}
                out.append(cell(s))
            label = {"streaming": "StreamingLLM"}.get(policy, policy)
            rows.append(f"| {name} | {label} | {' | '.join(out)} |")
        tel = []
        for ctx in contexts:
            mine = [c["telemetry"] for c in g["cells"] if c["policy"] == "retrieval" and c["context"] == ctx
                    and "page_recall" in c.get("telemetry", {})]
            tel.append(f"{_mean(mine, 'token_any'):.2g} / {_mean(mine, 'page_recall'):.2g}" if mine else "-")
        telemetry.append(f"| {name} | {' | '.join(tel)} |")
    if contexts:
        print("| task | policy | " + " | ".join(f"{c:,}" for c in contexts) + " |")
        print("|---|---|" + "---:|" * len(contexts))
        print("\n".join(rows))
        print("\nRetrieval telemetry (cells whose asked tokens are cold): token_any / page_recall\n")
        print("| task | " + " | ".join(f"{c:,}" for c in contexts) + " |")
        print("|---|" + "---:|" * len(contexts))
        print("\n".join(telemetry))


if __name__ == "__main__":
    main()
