"""Milliseconds per call of an MLX computation, shared by the benchmarks in this package."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx


def ms_per_call(fn: Callable[[], mx.array], reps: int, warmup: int = 1, median: bool = False) -> float:
    """Mean (or, with `median`, median) wall milliseconds of `mx.eval(fn())` over `reps` calls,
    after `warmup` untimed ones."""
    for _ in range(warmup):
        mx.eval(fn())
    if median:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t0) / reps * 1e3
