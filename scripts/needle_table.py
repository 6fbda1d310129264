"""Gather every `needle` cell of one model from the JSONs under docs/results/ into one table:
per policy (as its JSON records it) and context, the cells passed of those run, by seed.

Issue 55's grid was run cell by cell over many sessions, into files named as each session chose;
this reads what each file's own record says (its `policies` config, `prefill_tail`, and each
cell's context, depth and seed), not its name. A cell run more than once (a rerun after a change)
counts once, from the file git added last (an untracked file counts as newest); where the runs
disagree the cell is listed under "reruns that disagree".

    python scripts/needle_table.py                          # Gemma 3's table (markdown)
    python scripts/needle_table.py --cells                  # and every cell, with its file
    python scripts/needle_table.py --missing                # the issue grid's cells not yet run
    python scripts/needle_table.py --commands               # a `needle` command for each group of them
    python scripts/needle_table.py --against full           # each column against the full cache, cell by cell
    python scripts/needle_table.py --model SmolLM2-135M-Instruct.Q4_1 --results DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"

#: the issue's grid (issue 55): the columns, contexts, depths and seeds it asks for
GRID_LABELS = ("full", "streaming", "retrieval", "int4", "int4+retrieval")
GRID_CONTEXTS = (8192, 16384, 32768, 65536, 131072)
GRID_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
GRID_SEEDS = (0, 1, 2)

#: the defaults the grid's cells run with (`needle ... --streaming-llm-sink 4 --kiv-hot-budget 1024`)
DEFAULT_HOT, DEFAULT_FETCH, DEFAULT_WINDOW = 1024, (256, 256), 1024


def label(policy: str, config: dict, tail: int | None, fits: bool = True) -> str:
    """The column a cell belongs to: the policy, its quantisation, and what differs from the
    grid's defaults (`hot2048`, `fetch1024/pages1024`, `window256`, `:absolute`, `tail64`).
    Retrieval's default positions are original ones where the cell `fits` the model's context
    and shifted past it (`rope_auto`); a run whose positions were fixed either way counts as the
    default where it used the ones the default would have."""
    kivi, ret, sl = config.get("kivi"), config.get("retrieval"), config.get("streaming_llm")
    parts = []
    if kivi:
        kb, vb = kivi.get("key_bits"), kivi.get("value_bits")
        q = f"int{kb}" if kb == vb else f"k{kb}v{vb}"
        if kivi.get("exact_topk"):
            q += f"+top{kivi['exact_topk']}"
        parts.append(q)
    if policy != "full" or not parts:
        parts.append(policy)
    name = "+".join(parts)
    extra = []
    if config.get("storage", "fp32") != "fp32":
        extra.append(config["storage"])
    if ret:
        if ret.get("hot_budget") != DEFAULT_HOT:
            extra.append(f"hot{ret['hot_budget']}")
        if (ret.get("retrieve_tokens"), ret.get("top_pages")) != DEFAULT_FETCH:
            extra.append(f"fetch{ret['retrieve_tokens']}/pages{ret['top_pages']}")
        if not ret.get("rope_auto"):        # positions fixed by the run (or run before `rope_auto`)
            mode = ret.get("rope_mode", "shifted")
            if mode != ("absolute" if fits else "shifted"):
                extra.append(f":{mode}")
    if sl and sl.get("window") != DEFAULT_WINDOW:
        extra.append(f"window{sl['window']}")
    if tail:
        extra.append(f"tail{tail}")
    return name + (" " + " ".join(extra) if extra else "")


def _git_added(results: Path) -> dict[str, int]:
    """When git last added each file under `results` (seconds since the epoch)."""
    try:
        out = subprocess.run(["git", "log", "--no-renames", "--diff-filter=A", "--format=%x00%ct", "--name-only", "--",
                              str(results)],
                             cwd=results, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=results, capture_output=True, text=True).stdout.strip()
    added: dict[str, int] = {}
    for block in out.split("\0")[1:]:
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        when = int(lines[0])
        for name in lines[1:]:
            path = os.path.realpath(os.path.join(top, name))
            added[path] = max(added.get(path, 0), when)
    return added


#: config fields that do not change what a cell computes (where the cold rows live) or that the
#: label already reads (the positions)
IGNORED = {"cold_store", "rope_auto", "rope_mode"}
#: a grid's own settings that change its prompts, with `needle`'s defaults: recorded since
#: 2026-12-07; a file from before records none of them and counts as the defaults (every Gemma 3
#: needle command in docs/gguf.md ran them), so that a grid resumed or rerun since is the same row
PROMPT_FIELDS = {"digits": 5, "chat": False, "lead_in": None}


def _leaves(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        elif k not in IGNORED:
            out[prefix + k] = v
    return out


def _fits(cell: dict, context_length) -> bool:
    """Whether `rope_auto` would have given the cell original positions: its prompt and answer
    (`run_cell`: the answer's tokens + 1; a digit a token, plus its leading space) inside the
    model's context."""
    if not context_length:
        return True
    tokens = int(cell.get("prompt_tokens", cell["context"])) + len(str(cell.get("answer", ""))) + 2
    return tokens <= int(context_length)


def gather(results: Path, model: str) -> tuple[dict, list, list]:
    """(cells, reruns that disagree, files read): cells maps (label, context, seed, depth) to the
    newest run's {passed, output, answer, file}. Cells whose configs differ in a field `label`
    does not name (e.g. SmolLM2's page summaries) are told apart: the config most cells of a
    label ran keeps the label, the others add what differs from it in brackets."""
    added = _git_added(results)
    entries = []        # (base label, signature, leaves, key rest, order, path, cell)
    files = []
    for path in sorted(glob.glob(str(results / "*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict) or d.get("model") != model or "cells" not in d or "policies" not in d:
            continue
        if d.get("task", "passkey") != "passkey":
            continue
        files.append(path)
        order = added.get(os.path.realpath(path), float("inf"))   # untracked: newest
        prompt = {f: d.get(f, default) for f, default in PROMPT_FIELDS.items()}
        for c in d["cells"]:
            config = d["policies"][c["policy"]]
            base = label(c["policy"], config, d.get("prefill_tail"), _fits(c, d.get("context_length")))
            leaves = {**_leaves(config), **prompt}
            entries.append((base, json.dumps(leaves, sort_keys=True), leaves,
                            (int(c["context"]), int(c["seed"]), round(float(c["depth"]), 3)), order, path, c))
    counts: dict[str, dict[str, int]] = {}
    for base, sig, *_ in entries:
        counts.setdefault(base, {}).setdefault(sig, 0)
        counts[base][sig] += 1
    main = {base: max(sigs, key=lambda g: (sigs[g], g)) for base, sigs in counts.items()}
    runs: dict[tuple, list] = {}
    for base, sig, leaves, rest, order, path, c in entries:
        lab = base
        if sig != main[base]:
            ref = json.loads(main[base])
            diff = [f"{k}={leaves.get(k, '-')}" for k in sorted(set(leaves) | set(ref)) if leaves.get(k) != ref.get(k)]
            lab = f"{base} [{', '.join(diff)}]"
        runs.setdefault((lab, *rest), []).append((order, path, c))
    cells, disagree = {}, []
    for key, rs in runs.items():
        rs.sort(key=lambda r: (r[0], r[1]))
        order, path, c = rs[-1]
        cells[key] = {"passed": bool(c["passed"]), "output": c.get("output"), "answer": c.get("answer"),
                      "file": os.path.basename(path), "runs": len(rs)}
        if len({bool(r[2]["passed"]) for r in rs}) > 1:
            disagree.append((key, [(os.path.basename(r[1]), bool(r[2]["passed"])) for r in rs]))
    return cells, disagree, files


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(cells: dict) -> list[str]:
    """Markdown: a row per label, a column per context: passed of run, and by seed."""
    labels = sorted({k[0] for k in cells}, key=lambda s: (GRID_LABELS.index(s) if s in GRID_LABELS else 99, s))
    contexts = sorted({k[1] for k in cells})
    lines = ["| policy | " + " | ".join(_ctx(n) for n in contexts) + " |",
             "|---|" + "---:|" * len(contexts)]
    for lab in labels:
        row = []
        for n in contexts:
            ks = [k for k in cells if k[0] == lab and k[1] == n]
            if not ks:
                row.append("")
                continue
            passed = sum(cells[k]["passed"] for k in ks)
            seeds = sorted({k[2] for k in ks})
            by_seed = ", ".join(f"s{s} {sum(cells[k]['passed'] for k in ks if k[2] == s)}/"
                                f"{sum(1 for k in ks if k[2] == s)}" for s in seeds)
            row.append(f"**{passed}/{len(ks)}** ({by_seed})")
        lines.append(f"| {lab} | " + " | ".join(row) + " |")
    return lines


def missing(cells: dict) -> list[tuple]:
    """The issue grid's cells (GRID_*) with no run."""
    return [(lab, n, s, d) for lab in GRID_LABELS for n in GRID_CONTEXTS for s in GRID_SEEDS for d in GRID_DEPTHS
            if (lab, n, s, d) not in cells]


def against(cells: dict, base: str = "full") -> list[str]:
    """Markdown: each policy row of `table` against `base` (issue 55: "inside 32K, retrieval and
    int4 find what the full cache finds, same cells or more") over the cells both ran, per
    context: both pass, only `base` passes (listed: what the policy misses), only the policy
    passes. The grid's columns first, then the variants (other fetches, the exact top-64, ...)."""
    lines = [f"| policy | context | cells both ran | both pass | only {base} passes | only the policy passes |",
             "|---|---:|---:|---:|---|---|"]
    labels = sorted({k[0] for k in cells}, key=lambda s: (GRID_LABELS.index(s) if s in GRID_LABELS else 99, s))
    for lab in labels:
        if lab == base:
            continue
        for n in sorted({k[1] for k in cells}):
            keys = sorted(k for k in cells if k[0] == lab and k[1] == n and (base, *k[1:]) in cells)
            if not keys:
                continue
            mine = {k: cells[k]["passed"] for k in keys}
            theirs = {k: cells[(base, *k[1:])]["passed"] for k in keys}

            def listed(which: list) -> str:
                return f"{len(which)}" + (f" ({', '.join(f's{k[2]} d{k[3]:g}' for k in which)})" if which else "")
            only_base = [k for k in keys if theirs[k] and not mine[k]]
            only_mine = [k for k in keys if mine[k] and not theirs[k]]
            lines.append(f"| {lab} | {_ctx(n)} | {len(keys)} | {sum(mine[k] and theirs[k] for k in keys)} | "
                         f"{listed(only_base)} | {listed(only_mine)} |")
    return lines


#: the flags of each of the issue grid's columns (`needle`), as its cells above were run
COLUMN_FLAGS = {"full": "--policies full", "streaming": "--policies streaming", "retrieval": "--policies retrieval",
                "int4": "--policies full --kv-quantize int4", "int4+retrieval": "--policies retrieval --kv-quantize int4"}
GRID_FLAGS = "--seeds 1 --streaming-llm-sink 4 --kiv-hot-budget 1024 --prefill-chunk 512"
TRAINED_CONTEXT = 32768


def commands(gaps: list[tuple], model_file: str) -> list[str]:
    """One `needle` command per (column, context, seed) with cells not run: its missing depths,
    into its own JSON under docs/results, `--resume` so that a stopped run goes on."""
    groups: dict[tuple, list] = {}
    for lab, n, s, d in gaps:
        groups.setdefault((lab, n, s), []).append(d)
    out = []
    for (lab, n, s), ds in groups.items():
        past = " --past-context" if lab in ("full", "int4") and n > TRAINED_CONTEXT else ""
        name = f"gemma3_needle_{_ctx(n).lower()}_{lab.replace('+', '_')}_seed{s}_d{''.join(f'{round(d * 10):d}' for d in ds)}"
        out.append(f"posttrainllm needle {model_file} --contexts {n} --depths {','.join(f'{d:g}' for d in ds)} "
                   f"--first-seed {s} {COLUMN_FLAGS[lab]}{past} {GRID_FLAGS} --json docs/results/{name}.json --resume")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder of needle JSONs (default docs/results)")
    ap.add_argument("--model", default="gemma-3-270m-q4_k_m", help="the model name the JSONs record")
    ap.add_argument("--cells", action="store_true", help="also list every cell, its answer and its file")
    ap.add_argument("--missing", action="store_true", help="list the issue grid's cells not yet run, by column and context")
    ap.add_argument("--commands", action="store_true",
                    help="print a `needle` command for each column, context and seed with cells not run")
    ap.add_argument("--model-file", default="~/.cache/posttrainllm/gemma-3-270m-q4_k_m.gguf",
                    help="the model the --commands name")
    ap.add_argument("--against", metavar="COLUMN", choices=GRID_LABELS,
                    help="compare every policy with this grid column (e.g. full) over the cells both ran")
    a = ap.parse_args(argv)
    if not a.results.is_dir():
        print(f"needle_table: --results {a.results}: not a folder", file=sys.stderr)
        return 2
    cells, disagree, files = gather(a.results, a.model)
    if not cells:
        print(f"needle_table: no needle cells of model {a.model!r} under {a.results}", file=sys.stderr)
        return 1
    print(f"{len(cells)} cells of {a.model} from {len(files)} files under {a.results}\n")
    print("\n".join(table(cells)))
    if disagree:
        print("\nreruns that disagree (the newest counts):")
        for key, rs in sorted(disagree):
            print(f"  {key[0]} {_ctx(key[1])} seed {key[2]} depth {key[3]}: "
                  + ", ".join(f"{f} {'pass' if p else 'fail'}" for f, p in rs))
    if a.cells:
        print()
        for key in sorted(cells):
            c = cells[key]
            print(f"  {key[0]:<28} {_ctx(key[1]):>5} seed {key[2]} depth {key[3]}: {'pass' if c['passed'] else 'FAIL'} "
                  f"{c['answer']!r} -> {c['output']!r}  {c['file']}" + (f" ({c['runs']} runs)" if c["runs"] > 1 else ""))
    if a.missing:
        gaps = missing(cells)
        print(f"\n{len(gaps)} of the issue grid's {len(GRID_LABELS) * len(GRID_CONTEXTS) * len(GRID_SEEDS) * len(GRID_DEPTHS)} "
              f"cells not run:")
        for lab in GRID_LABELS:
            for n in GRID_CONTEXTS:
                g = [(s, d) for (l2, n2, s, d) in gaps if l2 == lab and n2 == n]
                if g:
                    print(f"  {lab} {_ctx(n)}: " + ", ".join(f"s{s} d{d}" for s, d in g))
    if a.against:
        print()
        print("\n".join(against(cells, a.against)))
    if a.commands:
        print()
        print("\n".join(commands(missing(cells), a.model_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
