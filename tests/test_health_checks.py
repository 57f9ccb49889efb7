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


class Slow:
    """Answers every /health `delay` seconds late (a link busy with KV bytes), with `loop_age`."""

    def __init__(self, delay: float, loop_age: float = 0.0) -> None:
        self.delay, self.loop_age, self.calls = delay, loop_age, 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        await asyncio.sleep(self.delay)
        role = "prefill" if request.url.port == 1 else "decode"
        return httpx.Response(200, json={**answer(role), "loop_age": self.loop_age})


def watch(handler: Slow, seconds: float, **cfg) -> tuple[WorkerTable, WorkerMonitor, list[bool]]:
    """The check loops and reaper over `handler` for `seconds` (real time); the D worker's
    slow flag as seen every 50 ms."""
    from kvrelay.core.clock import MonotonicClock

    config = RouterConfig(prefill=(P,), decode=(D,), **cfg)
    table = WorkerTable([P], [D], MonotonicClock())
    seen: list[bool] = []

    async def main():
        api = WorkerAPI(config, httpx.MockTransport(handler.handle))
        monitor = WorkerMonitor(table, api, config)
        try:
            table.mark_ok(D, WorkerHealth(**answer("decode")))
            table.mark_ok(P, WorkerHealth(**answer("prefill")))
            run = asyncio.create_task(monitor.run())
            for _ in range(int(seconds / 0.05)):
                await asyncio.sleep(0.05)
                seen.append(table.get(D).slow)
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        finally:
            await api.close()
        return monitor

    return table, asyncio.run(main()), seen


def test_answers_later_than_the_timeout_make_a_worker_slow_never_dead():
    """Finding 8: checks slowed by a busy link (each answer 0.5 s late, past the 0.2 s
    --health-timeout, within the 1 s lease) keep the worker alive: slow, not down."""
    handler = Slow(0.5)
    table, monitor, seen = watch(handler, 3.0, health_interval=0.25, health_timeout=0.2, health_misses=4)
    assert any(seen)                              # marked slow while its checks were late
    assert monitor.expired == 0 and table.get(D).up and not table.get(D).dead
    assert handler.calls >= 8                     # checks kept starting while earlier ones were late


def test_a_worker_whose_own_loop_stopped_is_not_renewed():
    """An answer that says the worker's scheduler loop last ran 5 s ago is no good check:
    its lease ends although /health answers at once."""
    table, monitor, seen = watch(Slow(0.0, loop_age=5.0), 2.0, health_interval=0.25, health_timeout=0.2,
                                 health_misses=2)
    assert monitor.expired == 2 and table.get(D).dead and not table.get(D).up
    assert table.get(D).last_error == "its scheduler loop last ran 5.0 s ago"   # what each check says since
