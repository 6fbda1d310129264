"""A stopped worker's OS thread has ended when `Worker.stop` returns (server/worker.py
`wait_os_thread`): its MLX compile cache (thread-local) is destroyed at the thread's end, taking
the GIL for each entry; an interpreter finalizing meanwhile ended the thread inside that
destructor and the process aborted ("terminate called without an active exception", status 134:
every bench_server_parallel run after writing its JSON)."""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.worker import Worker


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task: Linux")
def test_a_stopped_workers_os_thread_has_ended_with_its_compile_cache(native):
    """The worker traces 1,000 compiled functions of lists and dicts on its thread (entries of its
    compile cache holding Python objects), then stops: when `stop` returns, its OS thread is gone
    from /proc/self/task (its thread-local destructors done). Fails with `stop` returning after
    the join alone (the thread still there, its cache still being destroyed)."""
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=1), 16)
    fns = [mx.compile(lambda xs, d: [xs[0] * 2 + d["a"], {"b": xs[1] + 1}]) for _ in range(1000)]
    w.call(lambda: [mx.eval(f([mx.ones((3,)), mx.ones((2,))], {"a": mx.ones((3,))})) for f in fns])
    tid = w._thread.native_id
    assert os.path.exists(f"/proc/self/task/{tid}")
    w.stop()
    assert not w._thread.is_alive()
    assert not os.path.exists(f"/proc/self/task/{tid}")
