"""Each of the first decode steps after a prefill, one by one, for KIVI under StreamingLLM against
mlx-lm's RotatingKVCache (issue #54): bench's decode speed is the median of its 32 steps right
after the prefill, so a step that is slow there for a reason of its own (the prompt's blocks
frozen, the window's overflow evicted, a quiet step's shape traced for the first time) moves
it. `--repeats` fresh prefills of the same tokens, each followed by `--steps` steps fed and timed
as bench times them (`generate.steps`, one `next()` a step, the two caches in turn); the median
time of each step index over the repeats, and what our step was: `c` compiled (a trace
replayed), `T` compiled with a new trace, `e` eager (its reason: `f` a block frozen, `d` a
block evicted, `g` the residual's buffers moved, `-` else). Not a test.

    python -m benchmarks.window_first_steps [--model M] [--context 1024] [--steps 32] [--repeats 5]
        [--policy int4+sink4/window252] [--peer mlx-rotating256] [--keep-traces] [--json FILE]

Prints one line per step (index, kind, ours ms, peer ms) and the decode ratio bench would give
(the peer's median step over ours: above 1, ours faster) over all steps and over the steps
after the first `--settle`; --json writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx.cache import compiled
from tinygpt_mlx.evaluate.bench import make_policy
from tinygpt_mlx.generate import make_sampler, steps
from tinygpt_mlx.loading import load


class Traces:
    """Counts the traces of KIVI's compiled quiet step: its traced layer caches are made only
    while MLX traces the step's function (compiled.py), never when a trace is replayed."""

    def __init__(self):
        self.n = 0
        self._init = compiled._TracedKivi.__init__

    def __enter__(self) -> "Traces":
        outer = self

        def counting(layer, *a, **k):
            outer.n += 1
            outer._init(layer, *a, **k)
        compiled._TracedKivi.__init__ = counting
        return self

    def __exit__(self, *exc) -> None:
        compiled._TracedKivi.__init__ = self._init


def eager_reason(cache) -> str:
    """Why the next step of our cache will not run compiled, from its first layer ('' if it will)."""
    layer = cache.owned[0]
    plan = layer.plan()
    if compiled._kivi_ready(layer, plan):
        return ""
    body, res = layer.body, layer.body.residual
    if plan.drop:
        return "d"
    if res.keys is not None and len(res) + 1 >= max(body.keep, 1) + body.group:
        return "f"
    if res.keys is not None and res.head + res.n + 1 > res.keys.shape[2]:
        return "g"
    return "-"


def run(model, specs: list[str], tokens: list[int], n: int, chunk: int = 512) -> tuple[list, list[str]]:
    """Seconds of each of `n` decode steps per spec after one prefill of `tokens` (caches in turn,
    as bench's `measure`), and our steps' kinds."""
    caches = [make_policy(s, model).make() for s in specs]
    runs = [steps(model, tokens, c, make_sampler(0.0), n + 1, chunk) for c in caches]
    for k in range(-(-len(tokens) // chunk)):
        for i in range(len(specs)):
            next(runs[(i + k) % len(specs)])
    times: list[list[float]] = [[] for _ in specs]
    kinds = []
    with Traces() as traces:
        for k in range(n):
            for i in [(j + k) % len(specs) for j in range(len(specs))]:
                reason = eager_reason(caches[0]) if i == 0 else ""
                before = traces.n
                t0 = time.perf_counter()
                next(runs[i])
                times[i].append(time.perf_counter() - t0)
                if i == 0:
                    kinds.append("e" + reason if reason else ("T" if traces.n > before else "c"))
    for r in runs:
        r.close()
    return times, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the shipped one)")
    ap.add_argument("--policy", default="int4+sink4/window252", help="ours: a KIVI policy under StreamingLLM")
    ap.add_argument("--peer", default="mlx-rotating256", help="bench's name of the cache to compare with")
    ap.add_argument("--context", type=int, default=1024, help="tokens prefilled before the steps")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed after each prefill (bench: 32)")
    ap.add_argument("--repeats", type=int, default=5, help="fresh prefills, each followed by the steps")
    ap.add_argument("--settle", type=int, default=6, help="steps left out of the second ratio")
    ap.add_argument("--keep-traces", action="store_true",
                    help="keep the compiled steps' traces from one prefill to the next (as bench's second "
                         "context finds its first's); by default each repeat traces anew, as a fresh process")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    a = ap.parse_args()
    for flag, v in (("--context", a.context), ("--steps", a.steps), ("--repeats", a.repeats)):
        if v < 1:
            ap.error(f"{flag} must be at least 1, got {v}")
    if not 0 <= a.settle < a.steps:
        ap.error(f"--settle must be at least 0 and below --steps ({a.steps}), got {a.settle}")
    specs = [a.policy, a.peer]
    try:
        model = load(a.model).model
        for s in specs:
            make_policy(s, model)
        vocab = model(mx.array([[0]])).shape[-1]
        tokens = mx.random.randint(0, vocab, (a.context,), key=mx.random.key(0)).tolist()
        run(model, specs, tokens[:600], 8)      # warm-up: MLX's first kernels, the first traces' fused kernels
        per: list[list[list[float]]] = [[[] for _ in range(a.steps)] for _ in specs]
        kinds: list[set] = [set() for _ in range(a.steps)]
        for _ in range(a.repeats):
            if not a.keep_traces:
                compiled.forget(model)
            times, ks = run(model, specs, tokens, a.steps)
            for i in range(len(specs)):
                for k, t in enumerate(times[i]):
                    per[i][k].append(t)
            for k, kind in enumerate(ks):
                kinds[k].add(kind)
    except (ValueError, OSError) as e:
        sys.exit(f"window_first_steps: {e}")
    med = [[statistics.median(x) * 1e3 for x in p] for p in per]
    rows = []
    for k in range(a.steps):
        kind = "/".join(sorted(kinds[k]))
        rows.append({"step": k, "kind": kind, "ours_ms": med[0][k], "peer_ms": med[1][k]})
        print(f"{k:3d} {kind:6s} ours {med[0][k]:8.2f} ms  peer {med[1][k]:8.2f} ms", flush=True)
    def ratio(lo: int) -> float:
        """bench's decode ratio within each repeat (the peer's median step over ours, steps from
        `lo` on), the median over the repeats."""
        return statistics.median(statistics.median(per[1][k][r] for k in range(lo, a.steps)) /
                                 statistics.median(per[0][k][r] for k in range(lo, a.steps))
                                 for r in range(a.repeats))
    all_steps, settled = ratio(0), ratio(a.settle)
    print(f"decode ratio (peer's median step / ours, per repeat, median over {a.repeats}): "
          f"all {a.steps} steps {all_steps:.3f}; after the first {a.settle} {settled:.3f}")
    if a.json is not None:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps({"context": a.context, "policy": a.policy, "peer": a.peer, "repeats": a.repeats,
                                   "settle": a.settle, "steps": rows, "ratio_all": all_steps,
                                   "ratio_after_settle": settled}, indent=1))
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
