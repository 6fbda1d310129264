"""Mutation check of the layer plan (tinygpt_mlx/cache/plan.py): break one field of every plan
by one and show that the cache tests catch it.

For each field of `Plan` (and the frame-mode slot of the sink, `LayerCache.sink_slot_during`),
this runs the cache tests with that field off by one in every plan a layer makes, and records
the first test that fails (pytest -x). A mutation no test catches is a hole in the tests: the
script exits 1 and says which.

    python -m benchmarks.plan_mutations [--json docs/results/plan_mutations.json] [--tests ...]

The same module is the pytest plugin that applies a mutation (`-p benchmarks.plan_mutations`, with
the field named in POSTTRAINLLM_PLAN_MUTATION); run from the checkout's root, as the tests are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ENV = "POSTTRAINLLM_PLAN_MUTATION"
#: the fields broken by one, and what each stands for in the issue's list
MUTATIONS = {
    "drop": "eviction count (one more body token evicted)",
    "first": "mask width (the oldest kept position one later: the mask's columns)",
    "offset": "position (the new tokens' RoPE position one on)",
    "rebase": "re-base (one position more, where a re-base is due)",
    "stored": "slot (shifted mode: the tokens held once evicted, which place the query)",
    "sink_slot": "slot (frame mode: where the sink sits in the query's frame)",
}
TESTS = ["tests/test_policies.py", "tests/test_ring.py", "tests/test_kivi.py", "tests/test_compiled.py",
         "tests/test_retrieval.py", "tests/test_cache.py", "tests/test_design_card.py", "tests/test_checkpoint.py"]


def pytest_configure(config) -> None:
    """Pytest plugin: break the field named in the environment, for the whole session."""
    field = os.environ.get(ENV)
    if not field:
        return
    from tinygpt_mlx.cache.layer import LayerCache   # noqa: PLC0415  (plugin: only when mutating)

    if field == "sink_slot":
        original = LayerCache.sink_slot_during
        LayerCache.sink_slot_during = lambda self, plan, L=1: original(self, plan, L) + 1
        return
    plan = LayerCache.plan

    def broken(self):
        p = plan(self)
        value = getattr(p, field)
        if field == "rebase" and not value:
            return p                      # only a re-base that is due is broken
        return dataclasses.replace(p, **{field: value + 1})
    LayerCache.plan = broken


def run(field: str, tests: list[str]) -> dict:
    env = dict(os.environ, **{ENV: field})
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "benchmarks.plan_mutations", "-p", "no:cacheprovider",
                        *tests], env=env, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", r.stdout, re.M)
    return {"field": field, "stands_for": MUTATIONS[field], "caught": r.returncode != 0 and bool(failed),
            "first_failure": failed[0] if failed else None, "seconds": round(time.perf_counter() - t0, 1),
            "returncode": r.returncode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the table here")
    ap.add_argument("--tests", nargs="*", default=TESTS, help="test files to run per mutation")
    ap.add_argument("--fields", nargs="*", default=list(MUTATIONS), choices=list(MUTATIONS))
    args = ap.parse_args()
    rows = []
    for field in args.fields:
        row = run(field, args.tests)
        rows.append(row)
        print(f"{field:10s} {'caught' if row['caught'] else 'SURVIVED':8s} {row['seconds']:7.1f}s  "
              f"{row['first_failure'] or ''}", flush=True)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"command": "python -m benchmarks.plan_mutations --json " + str(args.json),
                                   "tests": args.tests, "mutations": rows}, indent=1) + "\n")
        tmp.replace(args.json)
    survived = [r["field"] for r in rows if not r["caught"]]
    if survived:
        print(f"mutations no test caught: {', '.join(survived)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
