"""Retrieval at scale on one model: decode ms/token and hot/cold bytes per context, and the
summary recall of Quest's min/max bound vs KIV's mean key (tinygpt_mlx/evaluate/retrieval_bench.py).

    python -m benchmarks.retrieval_bench MODEL --contexts 4096,16384,65536,262144 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
from pathlib import Path

from tinygpt_mlx.config import CacheConfig, ConfigError, field_default
from tinygpt_mlx.corpus import make_needle_doc_tokens
from tinygpt_mlx.evaluate import retrieval_bench as rb
from tinygpt_mlx.evaluate.inputs import CORPUS_HELDOUT, read_text
from tinygpt_mlx.loading import load


#: the cache's fields as this bench's flags (a bad value is refused naming the flag)
_FLAGS = {"storage": "--storage", "hot_budget": "--hot", "sink": "--sink", "retrieve_tokens": "--top-p",
          "page_size": "--page-size", "top_pages": "--top-pages", "cold_store": "--cold-store", "summary": "--summary",
          "index_block": "--index-block", "retrieve_unit": "--unit", "index_expand": "--index-expand"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="4096,16384,65536,262144")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="real tokens prefilled before growing")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--hot", type=int, default=256)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--top-p", type=int, default=field_default(CacheConfig, "retrieve_tokens"))
    ap.add_argument("--page-size", type=int, default=field_default(CacheConfig, "page_size"))
    ap.add_argument("--top-pages", type=int, default=field_default(CacheConfig, "top_pages"))
    ap.add_argument("--summary", default=field_default(CacheConfig, "summary"))
    ap.add_argument("--index-block", type=int, default=field_default(CacheConfig, "index_block"),
                    help="pages per block of the two-level index (0 = flat scan)")
    ap.add_argument("--index-expand", type=int, default=field_default(CacheConfig, "index_expand"),
                    help="a decode step's index expands this many x top-pages blocks")
    ap.add_argument("--recall-variants", default="minmax:0,mean:0,hybrid:0",
                    help="summary:index_block pairs compared on the same keys and queries")
    ap.add_argument("--unit", choices=("tokens", "spans"), default=None,
                    help="what a query fetches (default: the policy default, spans)")
    ap.add_argument("--cold-store", default="ram")
    ap.add_argument("--storage", default="fp32")
    ap.add_argument("--recall-tokens", type=int, default=2048, help="0 = skip the summary recall run")
    ap.add_argument("--filler", help="haystack text (default data/heldout.txt, which the docs' numbers "
                    "used: scripts/fetch_corpus.sh; the package ships tinygpt_mlx/data/heldout_kjv.txt)")
    ap.add_argument("--full", action="store_true",
                    help="also time a full cache at each context (same storage), grown by copies of the "
                         "prompt's rows (grow_full), in the same interleaved rounds")
    ap.add_argument("--no-telemetry", action="store_true",
                    help="decode without recording retrievals (the default decode path; rows without telemetry)")
    ap.add_argument("--json")
    a = ap.parse_args()
    try:    # (every bad value of the cache's flags: one line naming it, before the model loads)
        cfg = CacheConfig(storage=a.storage, hot_budget=a.hot, sink=a.sink, retrieve_tokens=a.top_p,
                          page_size=a.page_size, top_pages=a.top_pages, cold_store=a.cold_store,
                          summary=a.summary, index_block=a.index_block, retrieve_unit=a.unit,
                          index_expand=a.index_expand)
    except ConfigError as e:
        flag = lambda field: _FLAGS.get(field, field)
        ap.error(f"{flag(e.field)} {getattr(a, _FLAGS.get(e.field, '--' + e.field)[2:].replace('-', '_'), '')!r}: "
                 f"{e.describe(flag)}")
    try:
        filler = read_text(a.filler or Path(__file__).resolve().parents[1] / CORPUS_HELDOUT)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    loaded = load(a.model)
    prompt, _ = make_needle_doc_tokens(random.Random(0), filler, loaded.tokenizer.encode, a.prompt_tokens, 0.5)
    ids = loaded.tokenizer.encode(prompt)
    out = {"model": loaded.name, "policy": cfg.describe()}
    if a.recall_tokens:
        p2, _ = make_needle_doc_tokens(random.Random(1), filler, loaded.tokenizer.encode, a.recall_tokens, 0.5)
        variants = [(v.split(":")[0], int(v.split(":")[1])) for v in a.recall_variants.split(",")]
        out["summary_recall"] = rb.summary_recall(loaded.model, cfg, loaded.tokenizer.encode(p2),
                                                  variants=variants)
        print("summary recall", out["summary_recall"], flush=True)
    ctx = [int(x) for x in a.contexts.split(",") if x]
    if not ctx:
        print(json.dumps(out.get("summary_recall"), indent=1))
        save(a.json, out)
        return
    print(f"{'context':>9} {'cache':>9} {'decode ms/tok':>13} {'cpu ms/tok':>10} {'hot MiB':>8} {'cold MiB':>9} "
          f"{'summary MiB':>11}", flush=True)

    def show(r: dict) -> None:
        print(f"{r['context']:>9} {r['cache']:>9} {r['decode_ms_per_token']:>13.1f} {r['decode_cpu_ms_per_token']:>10.1f} "
              f"{r['hot_bytes'] / 2**20:>8.2f} {r['cold_bytes'] / 2**20:>9.1f} {r['summary_bytes'] / 2**20:>11.2f}",
              flush=True)
    out["no_telemetry"] = a.no_telemetry
    out["rows"] = rb.decode_scaling(loaded.model, cfg, ids, ctx, a.decode_steps, progress=show, full=a.full,
                                    record=not a.no_telemetry)
    retrieval = [r for r in out["rows"] if r["cache"] == "retrieval"]
    for key in ("decode_ms_per_token", "decode_cpu_ms_per_token"):
        print(f"retrieval's {key} largest/smallest context:",
              round(retrieval[-1][key] / retrieval[0][key], 2))
    save(a.json, out)


def save(path: str | None, out: dict) -> None:
    """The run's JSON, written atomically, with the command that made it and the load average
    at its end (the 1, 5 and 15 minute ones: the machine's business beside the run)."""
    if not path:
        return
    from tinygpt_mlx.cli.common import write_atomic
    out = {"command": " ".join(["python -m benchmarks.retrieval_bench", *map(shlex.quote, sys.argv[1:])]),
           "load_average": [round(x, 2) for x in os.getloadavg()], **out}
    write_atomic(Path(path), json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
