"""The server's worker thread alone carries its OS-level name (server/worker.py `Worker._run`,
`name_os_thread`): bench_server_parallel's per-thread CPU (`thread_cpu`) counts the threads named
so as "worker" and the rest as "other", and the threads MLX starts for the worker's streams take
the OS name of the thread that starts them."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.worker import Job, Worker


def _names() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            continue                  # (a thread that ended)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux")
def test_only_the_worker_thread_carries_its_name_not_the_threads_mlx_starts_for_it(native):
    """Of the threads that appear while a worker starts and runs a job (the worker's own, MLX's
    stream threads it starts: the CPU kernels run there), only the worker's carries the name
    "posttrainllm-ge" (15 bytes of "posttrainllm-generate"). Fails with the name set before the
    worker's streams have run anything (the stream threads then carry it too: the bench counted
    MLX's kernels as the worker's CPU)."""
    before = set(_names())
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=1), 16)
    try:
        got = []
        job = Job(native.tokenizer.encode("Once upon a time"), 4, temperature=0)
        job.emit = lambda kind, payload: got.append(kind)
        w.submit(job)
        deadline = time.time() + 120
        while not got or got[-1] not in ("done", "error"):
            assert time.time() < deadline, "the worker stopped answering"
            time.sleep(0.01)
        assert got[-1] == "done", got
        new = {tid: name for tid, name in _names().items() if tid not in before}
    finally:
        w.stop()
    assert w._thread.native_id in new, new
    named = {tid for tid, name in new.items() if name == "posttrainllm-generate"[:15]}
    assert named == {w._thread.native_id}, new
    assert len(new) > 1, new          # (MLX's stream threads were started by the worker: checked)
