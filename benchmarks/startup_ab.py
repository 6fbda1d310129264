"""Start-up A/B: README's main command (`sample` on the shipped model) run from two checkouts of
the project, interleaved A B B A, each a fresh process: wall time per run, the peak RSS the
command's own report line prints, and whether the process imported mlx-lm / transformers / torch.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m benchmarks.startup_ab --tree-a /tmp/before --tree-b . --rounds 4 --json out.json

A tree is a directory holding a `tinygpt_mlx` package (`git archive COMMIT | tar -x -C DIR`);
each run imports the package from its tree (its directory first on sys.path) with this
interpreter's site-packages, so the two differ only in the project's code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMAND = ["sample", "--prompt", "And God said", "--tokens", "120", "--streaming-llm-sink", "4",
           "--streaming-llm-window", "256", "--kv-quantize", "int8", "--seed", "0"]
HIDE_TORCH = "sys.modules['torch'] = None\n"     # as on the base install, which has no torch
PROBE = ("import sys\n{hide}sys.argv = ['posttrainllm', *{args!r}]\nfrom tinygpt_mlx.cli.main import app\n"
         "try:\n    app()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
         "print('MODULES', *[m for m in ('mlx_lm', 'transformers', 'torch') if sys.modules.get(m) is not None],"
         " file=sys.stderr)\nsys.exit(code)")


def run_once(tree: Path, hide_torch: bool) -> dict:
    env = {**os.environ, "POSTTRAINLLM_NO_BLAS_PRELOAD": "1"}    # LD_PRELOAD as this process has it
    t0 = time.perf_counter()
    probe = PROBE.format(args=COMMAND, hide=HIDE_TORCH if hide_torch else "")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the command failed: {out.stderr.strip().splitlines()[-1:]}")
    rss = re.search(r"peak RSS ([\d.]+) MiB", out.stderr)
    mods = next((line.split()[1:] for line in out.stderr.splitlines() if line.startswith("MODULES")), [])
    return {"wall_s": round(wall, 3), "peak_rss_mib": float(rss.group(1)) if rss else None,
            "imported": mods, "text": out.stdout}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree-a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--tree-b", required=True, help="checkout B")
    ap.add_argument("--rounds", type=int, default=4, help="A B B A rounds (default 4: 8 runs a tree)")
    ap.add_argument("--hide-torch", action="store_true",
                    help="run as on the base install: torch unimportable (the [train]/[dev] extras bring it)")
    ap.add_argument("--json", help="write the runs and medians here")
    args = ap.parse_args()
    trees = {"a": Path(args.tree_a).resolve(), "b": Path(args.tree_b).resolve()}
    for name, tree in trees.items():
        if not (tree / "tinygpt_mlx" / "__init__.py").is_file():
            ap.error(f"--tree-{name} {str(tree)!r}: no tinygpt_mlx package there")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give at least 1")
    load_at_start = os.getloadavg()
    runs: dict = {"a": [], "b": []}
    for _ in range(args.rounds):
        for name in ("a", "b", "b", "a"):
            runs[name].append(run_once(trees[name], args.hide_torch))
    texts = {r["text"] for rs in runs.values() for r in rs}
    summary = {name: {"median_wall_s": statistics.median(r["wall_s"] for r in rs),
                      "median_peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                      "imported": sorted({m for r in rs for m in r["imported"]})} for name, rs in runs.items()}
    summary["b_over_a_wall"] = round(summary["b"]["median_wall_s"] / summary["a"]["median_wall_s"], 3)
    summary["same_text"] = len(texts) == 1
    summary["load_after"] = os.getloadavg()
    for name in ("a", "b"):
        s = summary[name]
        print(f"{name} {trees[name]}: median {s['median_wall_s']:.2f} s, peak RSS {s['median_peak_rss_mib']:.1f} MiB, "
              f"imported {', '.join(s['imported']) or 'none of mlx_lm/transformers/torch'}")
    print(f"b/a wall {summary['b_over_a_wall']}, same text {summary['same_text']}, load {summary['load_after']}")
    if args.json:
        out = {"command": ["posttrainllm", *COMMAND], "hide_torch": args.hide_torch,
               # how this run was made, as the other benchmarks' JSONs say it
               "benchmark_command": " ".join(["python -m benchmarks.startup_ab", *sys.argv[1:]]),
               "LD_PRELOAD": os.environ.get("LD_PRELOAD"), "load_average_at_start": list(load_at_start),
               "trees": {k: str(v) for k, v in trees.items()},
               "runs": {k: [{x: r[x] for x in ("wall_s", "peak_rss_mib", "imported")} for r in rs]
                        for k, rs in runs.items()}, "summary": summary}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
