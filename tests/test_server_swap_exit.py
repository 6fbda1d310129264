"""A model swap leaves no MLX state on the thread that ran it (server/models.py, `run_released`).

The swap (`serve A B`, a request for B) loads B and probes it on a thread other than the worker's;
the probe's model call traces `nn.silu`'s compiled function there, into that thread's MLX compile
cache (thread-local, each entry taking the GIL to drop its Python objects). The swap ran on
asyncio's default executor (`asyncio.to_thread`), whose thread kept that cache until `asyncio.run`
shut the executor down as the server stopped: destroyed while the interpreter finalized, the
process aborted ("terminate called without an active exception", SIGABRT; seen once at a
`serve`'s Ctrl-C after a swap). The swap's thread is now one of its own that drops its MLX state as
its last act, and the shutdown waits for a swap still running."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import mlx.core as mx
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load
from tinygpt_mlx.resolve import resolve
from tinygpt_mlx.server.app import create_app

#: a constant a traced function closes over (16 MB)
MB16 = 4_000_000


def hold_loads(models) -> tuple[threading.Event, threading.Event]:
    """(loading, go): the swap's model loads wait, `loading` set, until `go` is set."""
    make, loading, go = models._make, threading.Event(), threading.Event()

    def held(resolved):
        if not go.is_set():
            loading.set()
            go.wait(30)
        return make(resolved)

    models._make = held
    return loading, go


def _app(native_path, wide_path):
    return create_app(load(resolve(str(native_path))), CacheConfig(), max_slots=1,
                      others=[resolve(str(wide_path))])


def test_the_swaps_thread_drops_its_compile_cache_before_the_swap_returns(native_path, wide_path):
    """The thread that makes the swapped-in server traces a compiled function (kept alive) over a
    16 MB constant, whose holder then lets it go (only that thread's compile cache holds it): when the
    swap returns, the 16 MB are freed, on a thread that has ended. On any OS. Fails with the swap run
    by `asyncio.to_thread` (the executor's thread keeps its cache: nothing freed, the thread alive)."""
    app = _app(native_path, wide_path)
    models = app.state.models
    make, seen = models._make, {}
    holder = [mx.ones((MB16,))]
    mx.eval(holder[0])

    def traced_make(resolved):
        # (the function kept alive, as `nn.silu` is: its compile-cache entries go with it)
        fn = seen["fn"] = mx.compile(lambda x: x + holder[0])
        mx.eval(fn(mx.ones((MB16,))))
        holder[0] = None
        srv = make(resolved)
        seen.update(thread=threading.current_thread(), before=mx.get_active_memory())
        return srv

    models._make = traced_make

    async def main():
        async with app.router.lifespan_context(app):
            srv = await models.server({"model": models.entries[1].names[0]})
            return srv, (seen["before"] - mx.get_active_memory()) / 2**20

    srv, freed = asyncio.run(main())
    assert srv is models.resident and models.swaps == 1 and srv.names != app.state.server.names
    assert freed >= 15, freed
    assert seen["thread"] is not threading.main_thread() and not seen["thread"].is_alive()


def test_the_shutdown_waits_for_a_swap_whose_request_is_gone(native_path, wide_path):
    """A swap whose request was cancelled while the model loads (its client gone as the server
    stops) still finishes before the shutdown stops the resident server, and that server is the
    swapped-in one: its worker stopped, its thread ended (not left inside MLX at exit). Fails with
    the shutdown not waiting (`Models.settle`): the old server stopped twice, the new one's worker
    left running."""
    app = _app(native_path, wide_path)
    models = app.state.models
    loading, go = hold_loads(models)

    async def main():
        async with app.router.lifespan_context(app):
            task = asyncio.create_task(models.server({"model": models.entries[1].names[0]}))
            while not loading.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            threading.Timer(0.3, go.set).start()    # the load goes on after the request is gone
        return task

    task = asyncio.run(main())
    assert task.cancelled()
    new = models.resident
    assert models.swaps == 1 and new is not app.state.server and new.names != app.state.server.names
    assert not new.worker._thread.is_alive()
    assert not models._swapping[1].is_alive()


#: a process that swaps to its second model, the swap's thread having traced 1,000 compiled
#: functions of lists and dicts (a slow destructor for its compile cache, which widens the race
#: a real swap's few traces lose now and then), and exits as `serve` does once uvicorn returns
EXITING = """
import asyncio, sys
import mlx.core as mx
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load
from tinygpt_mlx.resolve import resolve
from tinygpt_mlx.server.app import create_app

app = create_app(load(resolve(sys.argv[1])), CacheConfig(), max_slots=1, others=[resolve(sys.argv[2])])
models = app.state.models
make = models._make

def traced_make(resolved):
    fns = [mx.compile(lambda xs, d: [xs[0] * 2 + d["a"], {"b": xs[1] + 1}]) for _ in range(1000)]
    [mx.eval(f([mx.ones((3,)), mx.ones((2,))], {"a": mx.ones((3,))})) for f in fns]
    return make(resolved)

models._make = traced_make

async def main():
    async with app.router.lifespan_context(app):
        await models.server({"model": models.entries[1].names[0]})
    assert models.swaps == 1

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_process_exits_cleanly_after_a_swap(native_path, wide_path):
    """The abort itself: a process swaps to its second model (the swap's thread traced 1,000
    compiled functions), runs the app's shutdown and exits as `serve` does after uvicorn (whose
    `asyncio.run` shut its default executor down): exit status 0, not SIGABRT (-6). Fails with the
    swap run by `asyncio.to_thread`: 4 of 6 runs aborted here (0 of 6 with `run_released`), so
    three runs miss it about once in 27."""
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", EXITING, str(native_path), str(wide_path)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        assert "terminate called" not in run.stderr
