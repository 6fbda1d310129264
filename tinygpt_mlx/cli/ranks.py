"""Ranks under `mlx.launch`: who writes, the shared seed, the bounded waits and the per-rank
report of a tensor-parallel `posttrainllm sample` (the distributed work is tinygpt_mlx/distributed.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Optional

import typer

from tinygpt_mlx import distributed
from tinygpt_mlx.config import SampleConfig
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

arrays = lazy("tinygpt_mlx.cache.arrays")

# How long a rank other than 0 waits, after a refusal every rank finds, for rank 0 to say it:
# mlx.launch ends every rank (SIGTERM) once one exits, so a rank that exited first would end
# rank 0 before its line is written. Rank 0's exit ends the wait; the bound only matters when
# rank 0 does not exit (then this rank exits 1 itself, silently).
EVERYWHERE_WAIT = 60.0


def print_ranks(r: dict) -> None:
    """Under several ranks: the world size and the cache each rank holds (1/N of the K/V)."""
    per = ", ".join(c.fmt_bytes(b) for b in r["rank_cache_bytes"])
    disk = sum(r["rank_cache_disk_bytes"])
    err.print(f"ranks: {r['world_size']} (tensor parallel, KV heads split {r['world_size']} ways); cache per rank "
              f"{per}; total {c.fmt_bytes(r['cache_bytes_total'])}"
              f"{f' (of which {c.fmt_bytes(disk)} memory-mapped on disk)' if disk else ''}")


class Ranks:
    """This process's place among the ranks of `mlx.launch` (`group` None: a single process).

    Only rank 0 writes the banner, the text, the notes and the report; every rank writes its
    own error line (`ranks()`). The bounded waits are `distributed.Guard`'s."""

    def __init__(self, group=None, guards: Optional[contextlib.ExitStack] = None):
        self.group, self.guard, self._guards = group, None, guards
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1

    def beat(self) -> None:
        if self.guard is not None:
            self.guard.beat()

    def write_stdout(self, text: str) -> None:
        if self.rank == 0:
            c.write_stdout(text)

    def shard(self, loaded) -> None:
        """Refuse a model the ranks cannot split (every rank finds the same, rank 0 says it),
        shard it, then start the bounded waits (`distributed.Guard`): before that, a rank
        that mlx.launch stops ends silently, after it with one line."""
        distributed.shard(loaded, self.group)
        # a rank that ends at once (a lost or hung peer, SIGTERM) still removes its disk stores
        self.guard = self._guards.enter_context(distributed.Guard(self.rank, cleanup=arrays.remove_private_dirs))

    def shared_seed(self, sample_config: SampleConfig) -> SampleConfig:
        """Same seed on every rank: the given one, or rank 0's random one."""
        return dataclasses.replace(sample_config, seed=distributed.agree_seed(sample_config.seed, self.group))

    def report(self, report: dict, text: str) -> dict:
        """The world size and every rank's cache bytes; refuses ranks whose texts differ."""
        per_rank = distributed.gather_ints(report["cache_bytes"], self.group)
        disk = distributed.gather_ints(report["cache_disk_bytes"], self.group)
        prints = distributed.gather_ints(distributed.fingerprint(list(text.encode())), self.group)
        if len(set(prints)) > 1:
            raise distributed.DistributedError(
                f"rank {self.rank}: the ranks generated different text (fingerprints {prints}): their logits "
                "disagree, so the run is not one generation", everywhere=True)
        return {"world_size": self.size, "rank_cache_bytes": per_rank, "rank_cache_disk_bytes": disk,
                "cache_bytes_total": sum(per_rank)}


@contextlib.contextmanager
def ranks():
    """The ranks of this run (`Ranks`), joined when `mlx.launch` started the process: ranks
    other than 0 write nothing but their own error line; a lost peer, a hung one (the
    watchdog) or mlx.launch's SIGTERM ends the rank with one line (`distributed.Guard`)."""
    if not distributed.launched():
        yield Ranks()
        return
    group = distributed.init()
    if group is None:
        yield Ranks()
        return
    rank = group.rank()
    quiet = err.quiet
    err.quiet = rank != 0
    try:
        with contextlib.ExitStack() as guards:
            yield Ranks(group, guards)
    except RuntimeError as e:
        err.quiet = quiet
        if distributed.peer_lost(e):
            raise distributed.DistributedError(distributed.lost_message(rank, e)) from None
        raise
    except (ValueError, c.PosttrainError) as e:
        err.quiet = quiet
        if getattr(e, "everywhere", False) and rank != 0:
            time.sleep(EVERYWHERE_WAIT)  # rank 0 says it; its exit ends this rank (SIGTERM)
            raise typer.Exit(1) from None
        if str(e).startswith("rank ") or getattr(e, "everywhere", False):
            raise
        raise distributed.DistributedError(f"rank {rank}: {e}") from None
    finally:
        err.quiet = quiet
