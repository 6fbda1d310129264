"""The 2-rank table of docs/distributed.md: runs the worker of tests/test_distributed.py (two ranks
over loopback, as `mlx.launch -n 2 --backend ring` does, plus the same code unsharded) on the
shipped model and prints one markdown row per policy: tokens equal, 1-rank cache bytes, per-rank
bytes, the 1-rank run's smallest top-2 margin and the largest logit difference.

    python -m benchmarks.distributed_table      # from the checkout's root: it imports tests/
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests import test_distributed as td


def kib(b: int) -> str:
    return f"{b / 1024:.1f} KiB"


def main() -> None:
    r0, r1 = td.run_worker(td.SHIPPED, Path(tempfile.mkdtemp()), td.PROMPT)
    for spec in td.POLICIES:
        p = r0["policies"][spec]
        single, s0, s1 = p["single"], p["sharded"], r1["policies"][spec]["sharded"]
        equal = "yes" if single["tokens"] == s0["tokens"] == s1["tokens"] else "NO"
        on_disk = [f" ({kib(x['disk_bytes'])} on disk)" if x.get("disk_bytes") else "" for x in (single, s0)]
        print(f"| {spec} | {equal} | {kib(single['cache_bytes'])}{on_disk[0]} | {kib(s0['cache_bytes'])}{on_disk[1]} | "
              f"{single['margin']:.3f} | {p['max_logit_diff']:.1e} |")


if __name__ == "__main__":
    main()
