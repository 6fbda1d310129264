"""Prefill with OpenBLAS against MLX's reference BLAS, same run (docs/results.md, "BLAS on Linux").

    nice python -m benchmarks.blas_prefill MODEL [--context 2048] [--rounds 2] [--json out.json]

Each round runs `posttrainllm bench MODEL --contexts N --policies fp32 --decode-steps 8` twice,
as a user runs it: once as it is (the command preloads the system's OpenBLAS itself,
tinygpt_mlx/blas.py) and once with POSTTRAINLLM_NO_BLAS_PRELOAD=1 (MLX's own reference BLAS),
alternating which goes first, and a float32 matmul of SmolLM2's MLP shape ([N, 576] x [576,
1536]) under each library. Prints medians and the ratios; Linux only, and only with an OpenBLAS
installed (the point is the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tinygpt_mlx import blas

MATMUL = """
import sys, time, mlx.core as mx
n, d, f = (int(x) for x in sys.argv[1:4])
a, w = mx.random.normal((n, d)), mx.random.normal((d, f))
mx.eval(a, w, a @ w)
times = []
for _ in range(7):
    t = time.perf_counter(); mx.eval(a @ w); times.append(time.perf_counter() - t)
times.sort()
print(2 * n * d * f / times[3] / 1e9)
"""


def environ(openblas: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARK_VAR, blas.OFF_VAR)}
    return env if openblas else {**env, blas.OFF_VAR: "1"}


def prefill_tok_s(model: str, context: int, openblas: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        r = subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", "bench", model, "--contexts", str(context),
                            "--policies", "fp32", "--decode-steps", "8", "--json", str(out)],
                           env=environ(openblas), capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"bench failed: {r.stderr.strip().splitlines()[-1:]}")
        [row] = json.loads(out.read_text())["rows"]
        return row["prefill_tokens_per_s"]


def matmul_gflops(context: int, openblas: bool, library: str) -> float:
    env = environ(openblas)
    if openblas:   # a plain python process: preloaded here, as the command does for itself
        env = blas.preload_environ(env, library)
    r = subprocess.run([sys.executable, "-c", MATMUL, str(context), "576", "1536"], env=env,
                       capture_output=True, text=True, check=True)
    return float(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="the model to prefill (the docs use SmolLM2-135M-Instruct.Q4_1.gguf)")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both libraries, alternating (default 2)")
    ap.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = ap.parse_args()
    if args.context < 1 or args.rounds < 1:
        ap.error(f"--context and --rounds must be positive, got {args.context} and {args.rounds}")
    library = blas.find_openblas()
    if not sys.platform.startswith("linux") or library is None:
        sys.exit(f"error: needs Linux with an OpenBLAS installed ({blas.install_command(True)})")
    runs: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "matmul": []} for k in ("openblas", "reference")}
    for i in range(args.rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        for openblas in order:
            name = "openblas" if openblas else "reference"
            runs[name]["matmul"].append(matmul_gflops(args.context, openblas, library))
            runs[name]["prefill"].append(prefill_tok_s(args.model, args.context, openblas))
            print(f"round {i + 1} {name}: prefill {runs[name]['prefill'][-1]:.1f} tok/s, "
                  f"matmul {runs[name]['matmul'][-1]:.2f} GFLOP/s", file=sys.stderr, flush=True)
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in runs.items()}
    result = {"model": args.model, "context": args.context, "rounds": args.rounds, "openblas": library,
              "runs": runs, "median": med,
              "prefill_ratio": med["openblas"]["prefill"] / med["reference"]["prefill"],
              "matmul_ratio": med["openblas"]["matmul"] / med["reference"]["matmul"]}
    print(f"| BLAS | prefill tok/s at {args.context} | matmul [{args.context}, 576] x [576, 1536] GFLOP/s |")
    print("|---|---|---|")
    print(f"| MLX's reference BLAS | {med['reference']['prefill']:.1f} | {med['reference']['matmul']:.2f} |")
    print(f"| OpenBLAS ({library}) | {med['openblas']['prefill']:.1f} | {med['openblas']['matmul']:.2f} |")
    print(f"| ratio | {result['prefill_ratio']:.1f}x | {result['matmul_ratio']:.1f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
