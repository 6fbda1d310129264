"""What joining the rows' arrays costs serve's four-row int4 step (issue #56): the ceiling of a
batch-owned buffer, measured before building one.

The compiled stacked KIVI step (server/batch.py `_kivi_step` with `_KiviStacked`) takes each
row's packed runs and residual buffers, writes each row's token into its own buffer, then joins
the rows along the batch axis in every layer (`_padded`, the buffers concatenated) before one
attention over them. A batch owning one [B, ...] array per layer for all its rows would read
them as they lie. This script captures one real four-row step's inputs (the shipped model's int4
cache, bench_server_parallel's prompts, --warm batched steps first) and replays at that fixed
state, interleaved A B B A per round:

- `today`: the step as it runs (`_kivi_step`'s compiled function, its inputs per row);
- `joined`: the same model, the same attention (`_TracedKivi.attend` over the stacked rows, the
  same mask `_stacked_mask`), fed the rows' packed runs and residual buffers already joined
  (built once, outside the timed loop), each row's token written into the joined buffer at its
  own slot (one `slice_update` per row, axes batch and token).

Both are replayed `--steps` times per turn; `--fed` feeds each replay's written buffers back as
the next one's inputs, no other reference held (so MLX may write them in place, as a batch-owned
buffer would be fed). The logits of the two agree (checked first). Per variant the median CPU ms
of this process per replay over the turns, and the saving as a share of `today`'s replay and of
the whole batched step (`batch.decode_step` of the four rows, timed in the same rounds on caches
of the same state, its freeze-ahead steps included).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python -m benchmarks.kivi_joins \\
      models/tinygpt-base.tinygpt --warm 100 --steps 100 --rounds 6 [--fed] --json OUT.json

It measures the step as it was up to 1dcb441: from session 44 the stacked step reads the batch's
joined buffers itself (server/batch.py `_joined_buffers`), and this script says so and stops; copy
it into a tree at 1dcb441 to run it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks._args import at_least
from benchmarks.batch_rows import setup
from benchmarks.bench_server_parallel import policies
from tinygpt_mlx import blas
from tinygpt_mlx.cache.compiled import _TracedKivi
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import batch


def capture(model, caches, tokens) -> tuple:
    """One batched step of `caches` run as the server runs it, its compiled KIVI step and that
    step's inputs kept: (the step, its inputs, its layout key, the step's greedy tokens)."""
    got = {}
    made = batch._kivi_step

    def keeping(m, key):
        step = made(m, key)

        def call(*args):
            got.update(step=step, args=args, key=key)
            return step(*args)
        call.holds = step.holds
        return call
    batch._kivi_step = keeping
    try:
        _, tokens = batch.decode_step(model, tokens, caches, argmax=True)
    finally:
        batch._kivi_step = made
    if "step" not in got or not got["key"][3]:
        raise SystemExit("the captured step is not a stacked compiled KIVI step: nothing to compare")
    if isinstance(got["args"][5][0][0], mx.array):
        raise SystemExit("this tree's stacked KIVI step reads the batch's joined buffers already (issue 56, "
                         "session 44): copy this file into a tree at 1dcb441 (`git worktree add DIR 1dcb441`) "
                         "and run it there")
    return got["step"], got["args"], got["key"], tokens


class _Joined(_TracedKivi):
    """A layer of the joined variant: the rows' arrays already [B, ...]; each row's token written
    into the joined buffers at its own slot."""

    def __init__(self, sink, packed, near, buffers, starts, mask, cfg):
        super().__init__(sink, packed, near, buffers, None, mask, None, cfg.config, cfg.storage, cfg.compute_dtype)
        self.starts = starts

    def update_and_fetch(self, keys, values):
        new = (keys.astype(self.storage), values.astype(self.storage))
        out = []
        for b, n in zip(self.buffers, new):
            for i in range(n.shape[0]):
                b = mx.slice_update(b, n[i:i + 1], self.starts[i], axes=(0, 2))
            out.append(b)
        self.buffers = tuple(out)
        return keys, values


def joined_step(model, key, like: _TracedKivi):
    """The compiled joined variant of `key`'s step (its owners), its config from `like`."""
    owners = key[1]

    def step(tokens, offsets, sinks, packed, nears, buffers, firsts, slots, cuts, counts):
        B = tokens.shape[0]
        n_sink = sinks[0][0].shape[2] if sinks[0] else 0
        shapes = (packed[0][1][0].shape[2] if packed[0] else 0, nears[0][1][0].shape[2] if nears[0] else 0,
                  buffers[0][0].shape[2])
        mask = batch._stacked_mask(n_sink, shapes, counts, firsts, slots, cuts)
        starts = [mx.concatenate([mx.array([i], mx.int32), slots[i:i + 1]]) for i in range(B)]
        layers = [_Joined(sinks[j], packed[j], nears[j], buffers[j], starts, mask, like) for j in range(len(buffers))]
        for layer in layers:
            layer.offset = offsets
        logits = model(tokens, cache=[layers[i] for i in owners])
        return logits, [layer.buffers for layer in layers]
    return mx.compile(step)


def join_inputs(args: tuple) -> tuple:
    """`today`'s inputs (per row, per layer) joined per layer along the rows, evaluated."""
    ids, offsets, sinks, packed, nears, buffers, firsts, slots, cuts, counts = args
    B, L = len(buffers), len(buffers[0])
    cat = (lambda xs: mx.concatenate(xs, axis=0))
    j_sinks = [tuple(cat([sinks[i][j][x] for i in range(B)]) for x in (0, 1)) if sinks[0][j] else () for j in range(L)]
    j_packed = [batch._padded([packed[i][j] for i in range(B)]) for j in range(L)]
    j_nears = [batch._padded([nears[i][j] for i in range(B)]) if any(nears[i][j] for i in range(B)) else ()
               for j in range(L)]
    size = [max(buffers[i][j][0].shape[2] for i in range(B)) for j in range(L)]
    j_bufs = [tuple(cat([batch._pad(buffers[i][j][x], 2, size[j] - buffers[i][j][x].shape[2]) for i in range(B)])
                    for x in (0, 1)) for j in range(L)]
    out = (ids, offsets, j_sinks, j_packed, j_nears, j_bufs, firsts, slots, cuts, counts)
    mx.eval(out)
    return out


def replays(fn, args: tuple, steps: int, fed: bool, joined: bool) -> float:
    """CPU seconds of `steps` replays of `fn` at `args` (`fed`: each replay's written buffers the
    next one's, nothing else holding them)."""
    args = list(args)
    c0 = time.process_time()
    for _ in range(steps):
        logits, new = fn(*args)
        if fed:
            args[5] = new if joined else [[new[j][i] for j in range(len(new))] for i in range(len(new[0]))]
            del new
        mx.eval(logits, args[5] if fed else new)
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .tinygpt, GGUF or model directory")
    ap.add_argument("--policy", default="int4", help="a KIVI policy of bench_server_parallel's (default int4)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--warm", type=int, default=100, help="batched steps of all rows before the captured one")
    ap.add_argument("--steps", type=int, default=100, help="replays per variant and turn")
    ap.add_argument("--whole", type=int, default=32, help="whole batched steps timed per round (0: none)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--fed", action="store_true", help="feed each replay's written buffers to the next")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    at_least(ap, ("--rows", args.rows, 2), ("--warm", args.warm, 0), ("--steps", args.steps, 1),
             ("--whole", args.whole, 0), ("--rounds", args.rounds, 1))
    table = policies(128)
    if args.policy not in table or table[args.policy].key_bits is None:
        ap.error(f"--policy: {args.policy!r} is not a KIVI policy of {', '.join(table)}")
    if not Path(args.model).expanduser().exists():
        ap.error(f"model {args.model}: no such file or directory")
    loaded = load(args.model)
    m, config = loaded.model, table[args.policy]
    threads = blas.Threads()
    threads.for_decode()
    caches, tokens = setup(loaded, config, args.rows, args.warm, 0)
    threads.for_decode()
    step, today, key, _ = capture(m, caches, tokens)
    like = caches[0].owned[0]
    like = _TracedKivi((), (), (), (), None, None, None, like.config, like.body.storage, like.dtype)
    fn = joined_step(m, key, like)
    joined = join_inputs(today)
    a, b = step(*today)[0], fn(*joined)[0]
    diff = float(mx.max(mx.abs(a - b)).item())
    same = bool(mx.all(mx.argmax(a[:, -1], axis=-1) == mx.argmax(b[:, -1], axis=-1)).item())
    print(f"logits: max |today - joined| {diff:.2e}, the same greedy tokens: {same}", flush=True)
    if not same or diff > 1e-3:
        raise SystemExit("the joined variant does not compute today's step")
    res = {"model": Path(args.model).stem, "command": " ".join(sys.argv), "policy": args.policy, "rows": args.rows,
           "warm": args.warm, "steps": args.steps, "rounds": args.rounds, "fed": args.fed, "whole": args.whole,
           "max_abs_logit_diff": diff, "load_average_at_start": list(os.getloadavg())}
    got = {"today": [], "joined": [], "whole": []}
    order = ["today", "joined", "joined", "today"]
    for r in range(args.rounds + 1):        # round 0: warm-up, not counted
        for v in order:
            t = replays(step, today, args.steps, args.fed, False) if v == "today" else \
                replays(fn, joined, args.steps, args.fed, True)
            if r:
                got[v].append(t / args.steps * 1e3)
        if args.whole:
            cs, ts = setup(loaded, config, args.rows, args.warm, 0)
            threads.for_decode()
            c0 = time.process_time()
            for _ in range(args.whole):
                _, ts = batch.decode_step(m, ts, cs, argmax=True)
            if r:
                got["whole"].append((time.process_time() - c0) / args.whole * 1e3)
        print(f"round {r}: " + ", ".join(f"{v} {x[-1]:.3f}" for v, x in got.items() if x and r)
              + f" ms CPU per step | load {os.getloadavg()[0]:.2f}", flush=True)
    med = {v: round(statistics.median(x), 3) for v, x in got.items() if x}
    res.update(cpu_ms_per_step=med, cpu_ms_per_step_samples={v: [round(t, 3) for t in x] for v, x in got.items()},
               load_average_at_end=list(os.getloadavg()))
    saved = med["today"] - med["joined"]
    res["saved_share_of_today_replay"] = round(saved / med["today"], 3)
    if "whole" in med:
        res["saved_share_of_whole_step"] = round(saved / med["whole"], 3)
    print(f"median CPU ms per four-row step: today {med['today']:.3f}, joined {med['joined']:.3f} "
          f"(saved {saved:.3f}: {100 * saved / med['today']:.1f}% of the replay"
          + (f", {100 * saved / med['whole']:.1f}% of the whole step {med['whole']:.3f})" if "whole" in med else ")"),
          flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
