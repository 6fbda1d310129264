"""Memory of loading and running a GGUF, stage by stage (docs/gguf.md, "Memory").

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m benchmarks.gguf_memory_stages MODEL.gguf [MODEL.gguf ...] --json OUT.json

For each MODEL, three fresh processes (each figure is its process's own):
- stages: the project's loader (`tinygpt_mlx.loading.load`, as `sample` loads) with a mark at
  each of its stages: start, imports (MLX, mlx-lm, transformers, the loader), metadata read (inside
  the loader: after ggml's reader has parsed the file and been dropped, or after MLX's reader read
  it whole), tokenizer built, weights loaded, then `--tokens` greedy tokens of `--prompt` (full
  cache). At each: RSS, its high-water mark (VmHWM), anonymous/file RSS (/proc/self/status), MLX's
  active and peak memory, glibc's heap (`tinygpt_mlx.heap.usage`); and the parameters' bytes.
- parse: ggml's `GGUFReader` on the file alone (no tensor made): RSS before and after, what the
  loader's parse costs before it drops the reader (tinygpt_mlx/ggml/tensors.py).
- sample: `posttrainllm sample MODEL --prompt P --tokens N --temperature 0`, its peak RSS
  (the kernel's ru_maxrss for that process, what `/usr/bin/time -v` prints as "Maximum resident
  set size").
Memory does not depend on the machine's load (run it at nice 19); the load is recorded all the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._args import gguf_files

PARTS = ("stages", "parse", "sample")
ROOT = Path(__file__).resolve().parent.parent


def _status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def _mark(stages: list, name: str) -> None:
    import mlx.core as mx

    from tinygpt_mlx import heap

    stages.append({"stage": name, **_status(), "mlx_active_mib": round(mx.get_active_memory() / 2 ** 20, 1),
                   "mlx_peak_mib": round(mx.get_peak_memory() / 2 ** 20, 1), "heap_mib": heap.usage()})


def child_stages(model: str, prompt: str, tokens: int) -> dict:
    from tinygpt_mlx import heap

    heap.keep_large_blocks()        # as `posttrainllm` does at start (cli/main.py)
    stages: list = []
    _mark(stages, "start")
    import mlx_lm  # noqa: F401  (imported by the loader: counted here, not in the first load stage)
    import transformers  # noqa: F401

    from mlx.utils import tree_flatten

    from tinygpt_mlx import api, loading
    from tinygpt_mlx.ggml import load as gguf_load
    _mark(stages, "imports")
    read = gguf_load.read

    def marked_read(path, before_tensors=None):
        def before(md):
            _mark(stages, "metadata read")
            if before_tensors is not None:
                before_tensors(md)
            _mark(stages, "tokenizer built")
        return read(path, before)

    gguf_load.read = marked_read        # this process only: the loader's own stages, marked
    try:
        loaded = loading.load(model)
    finally:
        gguf_load.read = read
    _mark(stages, "weights loaded")
    params = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    text = api.generate_text(loaded, prompt, max_tokens=tokens, temperature=0.0)
    _mark(stages, f"generated {tokens} tokens")
    return {"stages": stages, "parameter_bytes": params, "reader": loaded.info.get("reader"),
            "weights": loaded.info.get("weights"), "text": text}


def child_parse(model: str) -> dict:
    before = _status()
    import gguf
    imported = _status()
    reader = gguf.GGUFReader(model)
    after = _status()
    n = len(reader.tensors)
    del reader
    return {"start": before, "gguf imported": imported, "GGUFReader": after, "tensors": n,
            "parse_rss_mib": round(after["VmRSS"] - imported["VmRSS"], 1)}


def run_sample(model: str, prompt: str, tokens: int) -> dict:
    """`posttrainllm sample` on MODEL: its peak RSS (ru_maxrss of that one process, `wait4`)."""
    exe = Path(sys.executable).parent / "posttrainllm"
    cmd = [str(exe), "sample", model, "--prompt", prompt, "--tokens", str(tokens), "--temperature", "0"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)     # reaped here: Popen must not wait again
        out.seek(0), err.seek(0)
        text, tail = out.read(), err.read().splitlines()[-2:]
    if p.returncode != 0:
        raise SystemExit(f"{model}: posttrainllm sample failed: {tail}")
    return {"command": "posttrainllm " + " ".join(cmd[1:]), "peak_rss_kb": usage.ru_maxrss,
            "exit": p.returncode, "text": text, "stderr_tail": tail}


def run_child(part: str, model: str, prompt: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gguf_memory_stages", "--child", part, model,
           "--prompt", prompt, "--tokens", str(tokens)]
    # no time limit: a nice 19 run may be paused for minutes (memory does not depend on time)
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"{model}: the {part} process failed: {got.stderr.strip().splitlines()[-3:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", metavar="MODEL", help="GGUF files")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens after loading (default 32)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)} (default all)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", choices=PARTS[:2], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts {args.parts!r}: expected some of {','.join(PARTS)}")
    args.parts = parts
    args.models = gguf_files(ap, args.models)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        got = (child_stages(args.models[0], args.prompt, args.tokens) if args.child == "stages"
               else child_parse(args.models[0]))
        print(json.dumps(got))
        return
    result = {"command": "python -m benchmarks.gguf_memory_stages " + " ".join(sys.argv[1:]),
              "ld_preload": os.environ.get("LD_PRELOAD", ""), "machine": platform.machine(),
              "load_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "models": {}}
    for model in args.models:
        one: dict = {}
        for part in args.parts:
            one[part] = (run_sample(model, args.prompt, args.tokens) if part == "sample"
                         else run_child(part, model, args.prompt, args.tokens))
        result["models"][Path(model).name] = one
        _print(Path(model).name, one)
    result["load_at_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def _print(name: str, one: dict) -> None:
    print(name)
    for s in one.get("stages", {}).get("stages", []):
        print(f"  {s['stage']:22} RSS {s['VmRSS']:7.1f} MiB  HWM {s['VmHWM']:7.1f}  anon {s['RssAnon']:7.1f}  "
              f"file {s['RssFile']:6.1f}  MLX active {s['mlx_active_mib']:7.1f} peak {s['mlx_peak_mib']:7.1f}")
    if "stages" in one:
        print(f"  parameters {one['stages']['parameter_bytes'] / 2 ** 20:.1f} MiB, reader {one['stages']['reader']}")
    if "parse" in one:
        print(f"  GGUFReader alone: RSS +{one['parse']['parse_rss_mib']} MiB")
    if "sample" in one:
        s = one["sample"]
        print(f"  {s['command']}: peak RSS {s['peak_rss_kb']:,} kB ({s['peak_rss_kb'] / 2 ** 20:.2f} GiB), exit {s['exit']}")


if __name__ == "__main__":
    main()
