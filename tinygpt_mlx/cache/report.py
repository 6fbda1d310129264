"""Measured cache sizes: fill real caches through the model and read back what they hold.

`cache-report` and docs/kivi.md show these numbers; none is computed from a formula, so a
mistake in packing, scales or residual bookkeeping shows up here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx

from ..config import CacheConfig
from ..model import last_logits
from .factory import make_cache

#: The policies of the bytes table, by label.
REPORT_POLICIES: dict[str, dict] = {
    "fp32": dict(kv_quantize="fp32"),
    "bf16": dict(kv_quantize="bf16"),
    "int8": dict(kv_quantize="int8"),
    "int4": dict(kv_quantize="int4"),
    "int2": dict(kv_quantize="int2"),
    "K int8 / V int4": dict(kv_quantize_keys="int8", kv_quantize_values="int4"),
}


@dataclass
class CacheBytes:
    """What one cache held at one stored length."""
    policy: str
    tokens: int
    stored: int
    nbytes: int
    breakdown: dict = field(default_factory=dict)
    #: the global layers' bytes (the policy's) and the sliding-window layers' (`KVCache.nbytes_split`)
    split: dict = field(default_factory=dict)


def fill_and_measure(model: Any, config: CacheConfig, lengths: Iterable[int], vocab_size: int,
                     chunk: int = 512, seed: int = 0, label: Optional[str] = None,
                     progress: Optional[Callable[[str, int], None]] = None, windowed: bool = True
                     ) -> list[CacheBytes]:
    """Prefill random tokens into a fresh cache and record its bytes at each length.

    The last token before each measurement goes in alone, as a decode step does, so the cache
    is in its decode-time state (KIVI: residual back to between R and R + G - 1 tokens).
    `windowed` False: sliding-window layers under the policy too (`make_cache`'s reference).
    """
    lengths = sorted(set(int(n) for n in lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths must be positive, got {lengths}")
    tokens = mx.random.randint(0, vocab_size, (1, lengths[-1]), key=mx.random.key(seed))
    cache = make_cache(model, config, windowed=windowed)
    out, done = [], 0
    for n in lengths:
        while done < n - 1:
            step = min(chunk, n - 1 - done)
            mx.eval(last_logits(model, tokens[:, done:done + step], cache))   # the cache's fill; one position's head
            done += step
        mx.eval(model(tokens[:, done:done + 1], cache=cache))
        done += 1
        out.append(CacheBytes(label or config.label(), n, cache.stored_count, cache.nbytes,
                              cache.nbytes_breakdown(), cache.nbytes_split()))
        if progress is not None:
            progress(label or config.label(), n)
    return out


def bytes_table(model: Any, vocab_size: int, lengths: Iterable[int],
                policies: Optional[dict[str, dict]] = None, chunk: int = 512,
                progress: Optional[Callable[[str, int], None]] = None, **flags: Any
                ) -> list[list[CacheBytes]]:
    """One row per policy (flags as for `CacheConfig.from_flags`, or a `CacheConfig`; `flags`
    such as group_size apply to each), one `CacheBytes` per length."""
    rows = []
    for label, pflags in (policies or REPORT_POLICIES).items():
        rows.append(fill_and_measure(model, row_config(pflags, **flags), lengths, vocab_size, chunk, label=label,
                                     progress=progress))
    return rows


def row_config(policy: Any, **flags: Any) -> CacheConfig:
    """One row's policy (flags as for `CacheConfig.from_flags`, or a `CacheConfig`) with `flags`
    applied (None: not given); raises as the config does (`cache-report` checks every row with it
    before the model loads)."""
    if isinstance(policy, CacheConfig):
        return dataclasses.replace(policy, **{k: v for k, v in flags.items() if v is not None})
    return CacheConfig.from_flags(**policy, **flags)
