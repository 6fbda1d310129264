"""The server's worker thread carries its OS-level name, and the threads MLX starts for it do not
(server/worker.py `Worker._run`, `name_os_thread`): bench_server_parallel's per-thread CPU
(`thread_cpu`) counts the threads named so as "worker" and the rest as "other", and a thread takes
the OS name of the thread that starts it."""

from __future__ import annotations

import os
import sys
import time

import mlx.core as mx
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.worker import Worker


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux")
def test_the_kernels_a_worker_runs_count_as_other_not_as_the_worker(native):
    """Matrix products the worker evaluates (on its own MLX stream, whose thread MLX starts from
    the worker's) use CPU in MLX's threads, which `thread_cpu` counts as "other": 0.1 s there
    within 30 s, more than the worker's own thread (waiting in `mx.eval`) gains; the worker's thread
    itself carries the name. Fails with the name set before the worker's stream has run anything
    (its thread then carries the name too: the bench counted MLX's kernels as the worker's CPU)."""
    from benchmarks.bench_server_parallel import thread_cpu

    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=1), 16)
    a = mx.random.normal((384, 384), key=mx.random.key(0))
    mx.eval(a)

    def burn():       # products until MLX's threads have used 0.1 s more, or 30 s have passed
        start, deadline = thread_cpu(os.getpid())["other"], time.time() + 30
        while thread_cpu(os.getpid())["other"] - start < 0.1 and time.time() < deadline:
            mx.eval(a @ a + 1)
    try:
        w.call(lambda: None)                  # (started: the stream and the name set)
        with open(f"/proc/self/task/{w._thread.native_id}/comm") as f:
            assert f.read().strip() == "posttrainllm-generate"[:15]
        before = thread_cpu(os.getpid())
        w.call(burn)
        after = thread_cpu(os.getpid())
    finally:
        w.stop()
    other, worker = after["other"] - before["other"], after["worker"] - before["worker"]
    assert other >= 0.1 and other > worker, (before, after)
