"""A stopped worker leaves no MLX state on its thread to be destroyed after it (server/worker.py):
its MLX compile cache (thread-local) is destroyed at the thread's end, taking the GIL for each
entry; an interpreter finalizing meanwhile ended the thread inside that destructor and the process
aborted ("terminate called without an active exception", status 134: every bench_server_parallel
run after writing its JSON). The worker's thread now empties its compile cache, random key and
streams itself as its last act (`release_thread_state`, any OS); on Linux `Worker.stop` also waits
until the OS thread has ended (`wait_os_thread`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import mlx.core as mx
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.server import worker as worker_module
from tinygpt_mlx.server.slots import SlotPool
from tinygpt_mlx.server.worker import Worker, release_thread_state


#: a constant the traced function closes over (16 MB): once the caller drops it, only the trace
#: in the compile cache of the thread that traced it holds it
MB16 = 4_000_000


def _traced_function():
    """A compiled function closing over a 16 MB constant (`holder[0]`); once the holder lets it go,
    only the compile cache of the thread that traced the function holds it (MLX's active memory
    shows whether that cache was emptied while the thread runs)."""
    holder = [mx.ones((MB16,))]
    mx.eval(holder[0])
    fn = mx.compile(lambda x: x + holder[0])
    return (lambda: mx.eval(fn(mx.ones((MB16,))))), holder


def _freed_by(release) -> float:
    """MiB of MLX's active memory that `release()` freed, run on the calling thread."""
    before = mx.get_active_memory()
    release()
    return (before - mx.get_active_memory()) / 2 ** 20


def test_release_empties_the_calling_threads_compile_cache():
    """On a thread of its own: a compiled function traced over a 16 MB constant, the constant then
    dropped by its holder; `release_thread_state` frees it (the trace held it) on that thread while
    it runs, not at its end. On any OS (nothing read from /proc). Fails with `release_thread_state`
    doing nothing (0 MiB freed)."""
    call, holder = _traced_function()
    freed = []

    def body():
        with mx.stream(mx.new_stream(mx.default_device())):
            call()
        holder[0] = None
        freed.append(_freed_by(release_thread_state))
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert freed[0] >= 15, freed


def test_the_worker_releases_its_mlx_state_on_its_own_thread_as_it_ends(native, monkeypatch):
    """The worker traces a compiled function over a 16 MB constant on its thread (`Worker.call`),
    the constant then dropped by its holder; when the worker stops, as its last act and on its own
    thread (the worker thread's id), it empties that thread's compile cache: the 16 MB freed
    there. On any OS. Fails with `Worker._run` not calling `release_thread_state` (never called),
    or with it doing nothing (0 MiB freed)."""
    call, holder = _traced_function()
    released = []
    real = worker_module.release_thread_state
    monkeypatch.setattr(worker_module, "release_thread_state",
                        lambda: released.append((threading.get_ident(), _freed_by(real))))
    w = Worker(native, SlotPool(native.model, CacheConfig(), max_slots=1), 16)
    w.call(call)
    holder[0] = None
    w.stop()
    assert not w._thread.is_alive()
    assert len(released) == 1 and released[0][0] == w._thread.ident, released
    assert released[0][1] >= 15, released


#: a process whose worker traced 1,000 compiled functions of lists and dicts, stopped, then exited at
#: once; the OS-thread wait is turned off (Linux only): what is left is `release_thread_state`
EXITING = """
import sys
import mlx.core as mx
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load
from tinygpt_mlx.server import worker as wm
from tinygpt_mlx.server.slots import SlotPool

wm.wait_os_thread = lambda tid, timeout: False
loaded = load(sys.argv[1])
w = wm.Worker(loaded, SlotPool(loaded.model, CacheConfig(), max_slots=1), 16)
fns = [mx.compile(lambda xs, d: [xs[0] * 2 + d["a"], {"b": xs[1] + 1}]) for _ in range(1000)]
w.call(lambda: [mx.eval(f([mx.ones((3,)), mx.ones((2,))], {"a": mx.ones((3,))})) for f in fns])
w.stop()
"""


@pytest.mark.slow
def test_a_process_exits_cleanly_after_its_worker_traced_a_thousand_functions(native_path):
    """The abort itself, on any OS: a process whose worker traced 1,000 compiled functions on its
    thread stops the worker and exits at once, with the OS-thread wait off: it exits 0, not killed by
    SIGABRT (-6 to subprocess, 134 in a shell).
    Fails with `release_thread_state` doing nothing: it aborted in 6 of 6 runs here (and 0 of 6
    with it, both on the shipped model, 2026-12-06)."""
    run = subprocess.run([sys.executable, "-c", EXITING, str(native_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "terminate called" not in run.stderr


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
