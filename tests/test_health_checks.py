"""How the router classes a health check that fails (`WorkerAPI.health`,
`WorkerMonitor.check`): lateness of any kind (connect, read, pool) leaves the worker up,
marked slow, for its lease to decide; a refused or broken connection takes it down at
once. Over an httpx transport that raises what a real one raises."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvrelay.core.clock import SimClock
from kvrelay.core.config import RouterConfig
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.worker_client import LegFailure, WorkerAPI, WorkerMonitor
from kvrelay.server.worker_protocol import WorkerHealth

P, D = "http://127.0.0.1:1", "http://127.0.0.1:2"


def answer(role: str) -> dict:
    return WorkerHealth(role=role, worker_id=role, incarnation="i1", model="m", max_model_len=64,
                        transfer_backend="fake", transfer_address="a", live_requests=0, queued_requests=0,
                        free_pages=8, total_pages=8).model_dump()


class Host:
    """Answers every worker's /health, except the one told to fail, which raises `error`."""

    def __init__(self) -> None:
        self.failing: str | None = None
        self.error: Exception | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url == self.failing:
            raise self.error
        return httpx.Response(200, json=answer("prefill" if url == P else "decode"))


@pytest.mark.parametrize("error,slow", [
    (httpx.ConnectTimeout("connect timed out"), True),
    (httpx.ReadTimeout("read timed out"), True),
    (httpx.PoolTimeout("no connection free"), True),
    (httpx.ConnectError("connection refused"), False),
    (httpx.RemoteProtocolError("server disconnected"), False),
])
def test_a_late_check_leaves_the_worker_up_and_a_refused_one_takes_it_down(error, slow):
    host = Host()
    cfg = RouterConfig(prefill=(P,), decode=(D,))
    table = WorkerTable([P], [D], SimClock())

    async def main():
        api = WorkerAPI(cfg, httpx.MockTransport(host))
        try:
            monitor = WorkerMonitor(table, api, cfg)
            await monitor.check_all()
            assert table.get(D).up and not table.get(D).slow
            host.failing, host.error = D, error
            if slow:
                with pytest.raises(TimeoutError):
                    await api.health(D)
            else:
                with pytest.raises(LegFailure) as raised:
                    await api.health(D)
                assert raised.value.broken
            await monitor.check(D)
        finally:
            await api.close()

    asyncio.run(main())
    w = table.get(D)
    assert (w.up, w.slow) == ((True, True) if slow else (False, False))
    assert w.failures == 1
    assert w.last_error.startswith("no answer to GET /health" if slow else type(error).__name__)
    assert table.get(P).up   # the other worker's checks are untouched
