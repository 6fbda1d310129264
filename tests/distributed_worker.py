"""One rank of the distributed tests (tests/test_distributed.py), started by `mlx.launch`:

    mlx.launch -n 2 --backend ring -p PORT -- python tests/distributed_worker.py MODEL OUT PROMPT_FILE SPEC...

Rank 0 first runs every policy on the whole model (the 1-rank run: no collective is involved,
the model is not sharded yet); then every rank shards the model by KV head and runs every
policy again, greedily. Each rank writes OUT.rank<r>.json: per policy the tokens and the cache
bytes (RAM, disk) of the 1-rank run (rank 0 only) and of its own shard, the 1-rank run's
smallest top-1/top-2 logit margin over the generated steps, and the largest logit difference
between the 1-rank and the sharded run (rank 0 only). One launch covers every policy, so the
test starts Python + MLX once per rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from tinygpt_mlx import distributed
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.generate import steps
from tinygpt_mlx.loading import load
from tinygpt_mlx.sampling import make_sampler

NEW_TOKENS = 12
PREFILL_CHUNK = 64


def policy(spec: str, tmp: str) -> CacheConfig:
    """A spec of `CacheConfig.from_spec`, or "retrieval-disk" (hot 64, sink 4, pages of 8,
    disk cold store: what the body evicts is memory-mapped)."""
    if spec == "retrieval-disk":
        return CacheConfig(sink=4, hot_budget=64, page_size=8, top_pages=4, retrieve_tokens=32,
                           cold_store="disk", cold_path=tmp)
    return CacheConfig.from_spec(spec)


def run(model, ids: list[int], config: CacheConfig) -> dict:
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
    assert group is not None and group.size() > 1, "start this under mlx.launch with several ranks"
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
    with distributed.Guard(rank, timeout=120):
        distributed.shard(loaded, group)
        for spec in specs:
            r, logits = run(loaded.model, ids, policy(spec, tmp))
            entry = result["policies"].setdefault(spec, {})
            entry["sharded"] = r
            if rank == 0:
                n = min(len(logits), len(reference[spec]))
                entry["max_logit_diff"] = max(
                    (float(mx.abs(a - b).max()) for a, b in zip(logits[:n], reference[spec][:n])), default=0.0)
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
