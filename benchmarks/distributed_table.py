"""The 2-rank table of docs/distributed.md: the two-rank comparison of tinygpt_mlx/evaluate/sharded.py
(two ranks over loopback, as `mlx.launch -n 2 --backend ring` does, plus the same code unsharded;
tests/test_distributed.py checks the same runs) on the shipped model, printing one markdown row per
policy: tokens equal, 1-rank cache bytes, per-rank bytes, the 1-rank run's smallest top-2 margin
and the largest logit difference.

    python -m benchmarks.distributed_table [--model models/tinygpt-base.tinygpt]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tinygpt_mlx.evaluate import sharded

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tinygpt-base.tinygpt"


def kib(b: int) -> str:
    return f"{b / 1024:.1f} KiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SHIPPED, help="model file or folder (default: the shipped model)")
    args = ap.parse_args()
    if not args.model.exists():
        ap.error(f"--model {args.model}: no such file or directory")
    try:
        r0, r1 = sharded.run_ranks(args.model, Path(tempfile.mkdtemp()), sharded.PROMPT, sharded.POLICIES)
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        print("distributed_table: the two ranks wrote no results (their last output above)", file=sys.stderr)
        return 1
    for spec in sharded.POLICIES:
        p = r0["policies"][spec]
        single, s0, s1 = p["single"], p["sharded"], r1["policies"][spec]["sharded"]
        equal = "yes" if single["tokens"] == s0["tokens"] == s1["tokens"] else "NO"
        on_disk = [f" ({kib(x['disk_bytes'])} on disk)" if x.get("disk_bytes") else "" for x in (single, s0)]
        print(f"| {spec} | {equal} | {kib(single['cache_bytes'])}{on_disk[0]} | {kib(s0['cache_bytes'])}{on_disk[1]} | "
              f"{single['margin']:.3f} | {p['max_logit_diff']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
