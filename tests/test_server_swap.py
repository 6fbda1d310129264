"""`serve A B`'s model swap under requests that arrive during it, and a swap whose load fails
(server/models.py): a request is never handed to the server being closed, and a failed load
leaves the old model serving."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_server_swap_exit import _app, hold_loads


def _alive(srv) -> bool:
    return srv.worker._thread is not None and srv.worker._thread.is_alive()


def test_a_request_for_the_old_model_during_a_swap_waits_and_gets_a_live_server(native_path, wide_path):
    """While B loads, a request for A (the resident model, being closed) waits behind the swap and
    then gets A loaded again, on a running worker. Fails with the resident returned at once: the
    closed server (its worker stopped, the request never answered)."""
    app = _app(native_path, wide_path)
    models = app.state.models
    a, b = app.state.server.names[0], models.entries[1].names[0]
    loading, go = hold_loads(models)

    async def main():
        async with app.router.lifespan_context(app):
            to_b = asyncio.create_task(models.server({"model": b}))
            while not loading.is_set():
                await asyncio.sleep(0.01)
            to_a = asyncio.create_task(models.server({"model": a}))
            await asyncio.sleep(0.2)
            early = to_a.done()
            go.set()
            srv_b, srv_a = await to_b, await to_a
            return early, srv_b, srv_a, _alive(srv_a)

    early, srv_b, srv_a, alive = asyncio.run(main())
    assert not early                       # it waited for the swap
    assert b in srv_b.names and a in srv_a.names and srv_a is not app.state.server
    assert alive and models.swaps == 2


def test_a_swap_whose_load_fails_leaves_the_old_model_serving(native_path, wide_path):
    """B's load raises: its request gets the error, and A is loaded again and resident with a
    running worker. Fails with the closed A left resident."""
    app = _app(native_path, wide_path)
    models = app.state.models
    a, b = app.state.server.names[0], models.entries[1].names[0]
    make = models._make

    def failing_make(resolved):
        if resolved == models.entries[1].resolved:
            raise ValueError("B does not load")
        return make(resolved)

    models._make = failing_make

    async def main():
        async with app.router.lifespan_context(app):
            with pytest.raises(ValueError, match="B does not load"):
                await models.server({"model": b})
            srv = await models.server({"model": a})
            return srv, _alive(srv)

    srv, alive = asyncio.run(main())
    assert a in srv.names and srv is models.resident and srv is not app.state.server and alive
