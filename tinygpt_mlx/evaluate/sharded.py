"""Two ranks against one: each policy's greedy run on the whole model and on its tensor-parallel
shards, the comparison behind docs/distributed.md's table (tests/test_distributed.py checks it,
benchmarks/distributed_table.py prints it).

`run_ranks(model, tmp, prompt, specs)` starts `mlx.launch -n 2 --backend ring` on 127.0.0.1 with
this module as each rank's worker:

    mlx.launch -n 2 --backend ring -p PORT -- python -m tinygpt_mlx.evaluate.sharded MODEL OUT PROMPT_FILE SPEC...

Rank 0 first runs every policy on the whole model (the 1-rank run: no collective is involved,
the model is not sharded yet); then every rank shards the model by KV head and runs every
policy again, greedily (the ranks meet before that, outside the watchdog, which then bounds each
policy's run). Each rank writes OUT.rank<r>.json: per policy the tokens and the cache
bytes (RAM, disk) of the 1-rank run (rank 0 only) and of its own shard, the 1-rank run's
smallest top-1/top-2 logit margin over the generated steps, and the largest logit difference
between the 1-rank and the sharded run (rank 0 only). One launch covers every policy, so Python
and MLX start once per rank.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx

from .. import distributed, switches
from ..cache import make_cache
from ..config import CacheConfig
from ..generate import steps
from ..loading import load
from ..sampling import make_sampler

# docs/distributed.md's table: these policies after this 184-token prompt on the shipped model
POLICIES = ("full", "int4", "sink4/window64:shifted", "retrieval-disk", "int4+sink4/window64", "int4+top8")
PROMPT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
    "And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
    "God divided the light from the darkness. And God called the light Day, and the darkness he called "
    "Night. And the evening and the morning were the first day. And God said, Let there be a firmament in "
    "the midst of the waters, and let it divide the waters from the waters. And God made the firmament, and "
    "divided the waters which were under the firmament from the waters which were above the firmament: and "
    "it was so. And God called the firmament Heaven.\n")
NEW_TOKENS = 12
PREFILL_CHUNK = 64
LAUNCH_TIMEOUT = 240   # seconds: a launch that passes it is a hang


def mlx_launch() -> list[str]:
    """The `mlx.launch` beside this Python, or MLX's launcher module run by it."""
    exe = Path(sys.executable).parent / "mlx.launch"
    return [str(exe)] if exe.exists() else [sys.executable, "-c",
                                           "from mlx._distributed_utils.launch import main; main()"]


def free_port(n: int = 2) -> int:
    """A port p with p .. p+n-1 free on 127.0.0.1 (the ring listens on one per rank), below the
    kernel's ephemeral range (32768 on), where outgoing connections take ports between our check
    and the ring's bind."""
    for _ in range(50):
        p = random.randrange(20000, 32000 - n)
        try:
            socks = []
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free ports")


def launch_env() -> dict:
    """This process's environment without MLX_RANK (a launched rank would pass its own on)."""
    e = dict(os.environ)
    e.pop("MLX_RANK", None)
    return e


def launch_cmd(n: int, command: list[str]) -> list[str]:
    return [*mlx_launch(), "-n", str(n), "--backend", "ring", "-p", str(free_port(n)), "--", *command]


def launch(n: int, command: list[str], timeout: float = LAUNCH_TIMEOUT, env: Optional[dict] = None,
           **extra) -> subprocess.CompletedProcess:
    """Run `command` as n ranks on loopback; again on other ports (up to 3 tries) where a rank could
    not bind its port (taken between `free_port`'s check and the ring's bind: another process's)."""
    for _ in range(3):
        p = run_group(launch_cmd(n, command), timeout, env=launch_env() if env is None else env, **extra)
        if "Couldn't bind socket" not in p.stdout + p.stderr:
            return p
    return p


def run_group(cmd: list[str], timeout: float, **extra) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`, but a timeout ends
    the launcher's whole process group, its ranks too: subprocess.run kills the launcher alone, and
    ranks left behind spin on a core each for the rest of the machine's work."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **extra) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_ranks(model: Path, tmp: Path, prompt: str, specs, env: Optional[dict] = None,
              **extra) -> tuple[dict, dict]:
    """Both ranks' JSON (module docstring) for `prompt` under each policy spec; files under `tmp`.
    Raises RuntimeError with the launch's output where a rank wrote none."""
    (tmp / "prompt.txt").write_text(prompt)
    out = tmp / "out"
    p = launch(2, [sys.executable, "-m", __name__, str(model), str(out), str(tmp / "prompt.txt"), *specs],
               env=env, **extra)
    files = [Path(f"{out}.rank{r}.json") for r in (0, 1)]
    if not all(f.exists() for f in files):
        raise RuntimeError(f"worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return tuple(json.loads(f.read_text()) for f in files)


def policy(spec: str, tmp: str) -> CacheConfig:
    """A spec of `CacheConfig.from_spec`, or "retrieval-disk" (hot 64, sink 4, pages of 8,
    disk cold store: what the body evicts is memory-mapped)."""
    if spec == "retrieval-disk":
        return CacheConfig(sink=4, hot_budget=64, page_size=8, top_pages=4, retrieve_tokens=32,
                           cold_store="disk", cold_path=tmp)
    return CacheConfig.from_spec(spec)


def run(model: Any, ids: list[int], config: CacheConfig) -> tuple[dict, list]:
    """One greedy run of NEW_TOKENS tokens: its record and the logits of each sampled step."""
    cache = make_cache(model, config)
    tokens, logits, t0 = [], [], time.perf_counter()
    for step in steps(model, ids, cache, make_sampler(0.0), NEW_TOKENS, PREFILL_CHUNK):
        if step.token is not None:
            tokens.append(step.token)
            logits.append(step.logits)
    seconds = time.perf_counter() - t0
    top2 = [mx.sort(lg)[-2:] for lg in logits]
    parts = cache.nbytes_breakdown()
    out = {"tokens": tokens, "cache_bytes": cache.nbytes, "disk_bytes": cache.disk_nbytes,
           # a cold store's token positions: one per token, held whole by every rank
           "replicated": {"cache_bytes": sum(v for k, v in parts.items() if k.startswith("cold_positions")),
                          "disk_bytes": parts.get("cold_positions_disk", 0)},
           "stored": cache.stored_count, "seconds": seconds,
           "margin": min(float(t[1] - t[0]) for t in top2)}
    cache.close()
    return out, logits


def main() -> None:
    model_path, out, prompt_file, *specs = sys.argv[1:]
    group = distributed.init()
    if group is None or group.size() < 2:
        raise SystemExit("sharded.py: start this under mlx.launch with several ranks (run_ranks does)")
    rank = group.rank()
    loaded = load(model_path)
    ids = loaded.tokenizer.encode(Path(prompt_file).read_text())
    tmp = str(Path(out).parent)
    result: dict = {"rank": rank, "world_size": group.size(), "prompt_tokens": len(ids), "policies": {}}
    reference: dict = {}
    if rank == 0:
        for spec in specs:
            r, logits = run(loaded.model, ids, policy(spec, tmp))
            result["policies"][spec] = {"single": r}
            reference[spec] = logits
    # The other ranks wait here while rank 0 runs the whole model: a wait as long as that run, which
    # the watchdog below would count as a hung peer (with the machine shared, 120 s was passed and
    # rank 1 ended with 124). A rank that dies closes its socket and ends the wait; a hung one is
    # left to the launch's own timeout.
    distributed.gather_ints(rank, group)
    with distributed.Guard(rank, timeout=switches.rank_timeout(default=120.0)) as guard:   # (the message's variable works)
        distributed.shard(loaded, group)
        for spec in specs:
            guard.beat()   # the timeout bounds one policy's run, not all of them together
            r, logits = run(loaded.model, ids, policy(spec, tmp))
            entry = result["policies"].setdefault(spec, {})
            entry["sharded"] = r
            if rank == 0:
                n = min(len(logits), len(reference[spec]))
                entry["max_logit_diff"] = max(
                    (float(mx.abs(a - b).max()) for a, b in zip(logits[:n], reference[spec][:n])), default=0.0)
    path = Path(f"{out}.rank{rank}.json")
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_text(json.dumps(result, indent=1))
    tmp_path.replace(path)


if __name__ == "__main__":
    main()
