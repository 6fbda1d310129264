"""Time to the first token of `posttrainllm sample GGUF`, split (docs/gguf.md, "Start-up: the
tokenizer converted once").

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m benchmarks.startup_split MODEL.gguf [MODEL.gguf ...] --json OUT.json

For each MODEL, runs in the order --order (default cold,warm,warm,cold), each a fresh process that
runs `posttrainllm sample MODEL --prompt P --tokens 1 --temperature 0` in-process (the CLI's own
`app`, after `heap.keep_large_blocks` as the command does; OpenBLAS preloaded where `posttrainllm`
would preload it), timed around the loader's calls, from the process's first line:
- imports: the CLI, the loader and `generate` imported (MLX; mlx-lm's tokenizer module is imported
  by the tokenizer build, so it falls in the next);
- tokenizer: `tokenizer_from_metadata` (the tokenizer cache read, or transformers' converter run
  and the entry written; mlx-lm's `TokenizerWrapper`);
- weights: `load_gguf_model` less the tokenizer (the reader's parse, the tensors dequantised);
- first forward: the first `generate.call` (the prompt's prefill);
- to the first token: from the process's first line to the end of that call;
and, from this process, the child's wall time, CPU user time and peak RSS (`wait4`'s ru_maxrss).
A cold run reads an empty tokenizer cache ($POSTTRAINLLM_CACHE a fresh directory: the converter
runs and writes the entry); a warm run reads the entry the first cold run wrote (so --order starts
cold). Times depend on the load: it is recorded at the start and end of every run.
"""

import time

T0 = time.perf_counter()        # (the child's start: before any import below)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks._args import gguf_files  # noqa: E402

KINDS = ("cold", "warm")
PARTS = ("imports_s", "tokenizer_s", "weights_s", "first_forward_s", "to_first_token_s", "wall_s", "cpu_user_s")
ROOT = Path(__file__).resolve().parent.parent


def child(model: str, prompt: str, out: str) -> None:
    """In the fresh process: `sample` run in-process with the timers; the marks written to `out`."""
    from tinygpt_mlx import heap

    heap.keep_large_blocks()        # as `posttrainllm` does at start (cli/main.py)
    import tinygpt_mlx.generate as generate
    import tinygpt_mlx.loading as loading
    from tinygpt_mlx import blas
    from tinygpt_mlx.cli.main import app

    marks = {"imports_s": time.perf_counter() - T0, "tokenizer_s": 0.0}
    build, load, call = loading.tokenizer_from_metadata, loading.load_gguf_model, generate.call

    def timed_build(*a, **k):
        t = time.perf_counter()
        try:
            return build(*a, **k)
        finally:
            marks["tokenizer_s"] += time.perf_counter() - t

    def timed_load(*a, **k):
        t = time.perf_counter()
        try:
            return load(*a, **k)
        finally:
            marks["load_s"] = time.perf_counter() - t

    def timed_call(*a, **k):
        if "first_forward_s" in marks:
            return call(*a, **k)
        t = time.perf_counter()
        try:
            return call(*a, **k)
        finally:
            now = time.perf_counter()
            marks["first_forward_s"], marks["to_first_token_s"] = now - t, now - T0

    loading.tokenizer_from_metadata, loading.load_gguf_model, generate.call = timed_build, timed_load, timed_call
    app(["sample", model, "--prompt", prompt, "--tokens", "1", "--temperature", "0"], standalone_mode=False)
    marks["weights_s"] = marks.pop("load_s") - marks["tokenizer_s"]
    marks["openblas"] = blas.loaded_openblas()
    Path(out).write_text(json.dumps(marks))


def child_env(cache: Path) -> dict:
    """This environment with the tokenizer cache at `cache` and OpenBLAS preloaded where
    `posttrainllm sample` would preload it (its own re-execution, tinygpt_mlx/blas.py)."""
    from tinygpt_mlx import blas

    env = {**os.environ, "POSTTRAINLLM_CACHE": str(cache)}
    library = blas.plan(["sample"], env, sys.platform).library
    return blas.preload_environ(env, library) if library else env


def run_once(model: str, prompt: str, kind: str, cache: Path) -> dict:
    """One fresh process (`child`): its marks, wall and CPU user time, peak RSS, stdout (the text)."""
    with tempfile.TemporaryDirectory() as tmp:
        marks, stdout, stderr = Path(tmp) / "marks.json", Path(tmp) / "out", Path(tmp) / "err"
        cmd = [sys.executable, "-m", "benchmarks.startup_split", "--child", str(marks), model, "--prompt", prompt]
        load0 = list(os.getloadavg())
        with stdout.open("w") as out, stderr.open("w") as err:
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, cwd=ROOT, env=child_env(cache), stdout=out, stderr=err)
            _, status, usage = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)     # reaped here: Popen must not wait again
        if p.returncode != 0 or not marks.exists():
            raise SystemExit(f"{model}: the {kind} run failed (exit {p.returncode}): "
                             f"{stderr.read_text().strip().splitlines()[-3:]}")
        got = json.loads(marks.read_text())
        return {"kind": kind, **{k: round(v, 3) for k, v in got.items() if k.endswith("_s")},
                "wall_s": round(wall, 3), "cpu_user_s": round(usage.ru_utime, 3), "peak_rss_kb": usage.ru_maxrss,
                "openblas": got["openblas"], "text": stdout.read_text(), "load_average_at_start": load0,
                "load_average_at_end": list(os.getloadavg())}


def measure(model: str, prompt: str, order: list[str]) -> dict:
    """The runs of `order` on `model`, and each kind's means."""
    runs = []
    with tempfile.TemporaryDirectory() as warm:
        seeded = "warm" not in order
        for kind in order:
            if kind == "warm":
                runs.append(run_once(model, prompt, kind, Path(warm)))
                continue
            with tempfile.TemporaryDirectory() as cold:
                runs.append(run_once(model, prompt, kind, Path(cold)))
                if not seeded:      # the first cold run's entry: what the warm runs read
                    entry = Path(cold) / "tokenizers"
                    if not entry.is_dir() or not any(entry.iterdir()):
                        raise SystemExit(f"{model}: the cold run wrote no tokenizer cache entry (a vocabulary "
                                         f"under the cache's MIN_TOKENS?): its warm runs would be cold ones")
                    shutil.copytree(entry, Path(warm) / "tokenizers")
                    seeded = True
    means = {kind: {part: round(statistics.fmean(r[part] for r in runs if r["kind"] == kind), 3) for part in PARTS}
             for kind in KINDS if kind in order}
    return {"runs": runs, "means": means}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", metavar="MODEL", help="GGUF files")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--order", default="cold,warm,warm,cold",
                    help="the runs, each cold or warm, comma-separated; the first cold (default cold,warm,warm,cold)")
    ap.add_argument("--json", help="write the runs and the means here")
    ap.add_argument("--child", metavar="MARKS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    order = args.order.split(",")
    if not args.order or any(k not in KINDS for k in order):
        ap.error(f"--order {args.order!r}: expected cold or warm, comma-separated")
    if order[0] != "cold":
        ap.error(f"--order {args.order!r}: the first run must be cold (the warm runs read the entry it writes)")
    args.order = order
    if not args.prompt:
        ap.error("--prompt: empty")
    if args.json:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            ap.error(f"--json {args.json}: no such directory {parent}")
    args.models = gguf_files(ap, args.models)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args.models[0], args.prompt, args.child)
        return
    result = {"command": "python -m benchmarks.startup_split " + " ".join(sys.argv[1:] if argv is None else argv),
              "ld_preload": os.environ.get("LD_PRELOAD", ""), "load_average_at_start": list(os.getloadavg()),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": {}}
    for model in args.models:
        got = result["models"][Path(model).name] = measure(model, args.prompt, args.order)
        print(Path(model).name)
        for r in got["runs"]:
            print(f"  {r['kind']:5} tokenizer {r['tokenizer_s']:6.2f} s  weights {r['weights_s']:6.2f} s  first forward "
                  f"{r['first_forward_s']:5.2f} s  to the first token {r['to_first_token_s']:6.2f} s  wall {r['wall_s']:6.2f} s "
                  f"(CPU user {r['cpu_user_s']:.2f} s)  peak RSS {r['peak_rss_kb']:,} kB  load {r['load_average_at_start'][0]:.1f}")
    result["load_average_at_end"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
