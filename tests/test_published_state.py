"""/health and /metrics never touch the engine thread (issue #53, finding 7): the engine
thread publishes its core's health view and metrics snapshot (`AsyncEngine.published`),
the routes read that, and a flood of scrapes costs one render, and one fan-out to the
workers, per RENDER_SPACING_S, while no scrape gets state older than itself. A wedged loop still answers /health, with a growing
`loop_age`."""
from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.core.clock import SimClock
from kvrelay.core.config import KVCacheConfig, LifecycleConfig, SchedulerConfig, TransferConfig
from kvrelay.disagg.decode_worker import DecodeCore
from kvrelay.disagg.prefill_worker import PrefillCore
from kvrelay.engine.engine import AsyncEngine
from kvrelay.engine.types import GenerateRequest, SamplingParams
from kvrelay.obs import metrics as obs_metrics
from kvrelay.obs.metrics import RENDER_SPACING_S, ServingMetrics, Snapshot
from kvrelay.server.observe import Coalesced, observability_router, scrape_workers
from kvrelay.server.worker_app import LOOP_STALLED_S, health_body, worker_app

KV = KVCacheConfig(page_size=16, max_kv_tokens=1024)
SCHED = SchedulerConfig(max_running_requests=8, max_prefill_tokens=256)
LIFE = LifecycleConfig(heartbeat_interval=0.2, heartbeat_misses=8, bootstrap_timeout=30, queue_timeout=30,
                       waiting_timeout=30, transfer_timeout=30, quarantine_grace=0.5)
SHM = TransferConfig(transfer_backend="shm")


class CountingInbox(queue.SimpleQueue):
    """The engine's inbox, counting every command put on it."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put(self, item, block=True, timeout=None) -> None:
        self.puts += 1
        super().put(item)


def worker_metrics(engine: AsyncEngine) -> ServingMetrics:
    """As `serve_worker` wires them: the snapshot the engine published."""
    return ServingMetrics(engine.core.role, type(engine.core).PHASES, lambda: engine.published.snapshot)


def gauges(text: str, name: str) -> dict[str, float]:
    return {s.labels.get("phase", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def get_all(app, paths: list[str], timeout: float = 5.0) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=timeout) as c:
            return [await c.get(p) for p in paths]
    return asyncio.run(run())


def test_health_and_metrics_read_the_published_state_and_put_nothing_on_the_inbox(tiny_loaded):
    """Nobody iterates this engine (threaded=False) unless the test does, so a route that
    waited on the loop would time out. Both answer from what the last iteration published,
    a new leg shows after the next iteration, and an engine that stops iterating answers
    with a `loop_age` that grows with its clock (what the simulation's router reads)."""
    clock = SimClock()
    engine = AsyncEngine(lambda: PrefillCore(tiny_loaded, KV, SCHED, LIFE, SHM, clock=clock), threaded=False)
    try:
        inbox = engine._inbox = CountingInbox()
        metrics = worker_metrics(engine)
        app = worker_app(engine, metrics)
        health, text = get_all(app, ["/health", "/metrics"])
        assert health.status_code == text.status_code == 200
        assert (health.json()["live_requests"], health.json()["iterations"], health.json()["loop_age"]) == (0, 0, 0.0)
        assert gauges(text.text, "kvrelay_requests")["bootstrap"] == 0

        engine.core.add(GenerateRequest("leg-1", (3, 4, 5, 6), SamplingParams(max_tokens=4)), [].append, room=7)
        clock.advance(0.05)
        assert engine.iterate()
        health, text = get_all(app, ["/health", "/metrics"])
        body = health.json()
        assert (body["live_requests"], body["queued_requests"], body["iterations"], body["loop_age"]) == (1, 1, 1, 0.0)
        assert gauges(text.text, "kvrelay_requests")["bootstrap"] == 1   # P waits for D's destination

        clock.advance(0.75)   # the loop stops: its view grows old, and says so
        assert get_all(app, ["/health"])[0].json()["loop_age"] == pytest.approx(0.75)
        assert health_body(engine).loop_age == pytest.approx(0.75)
        clock.advance(LOOP_STALLED_S)   # long enough for a probe that reads only the status
        stalled = get_all(app, ["/health"])[0]
        assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
        assert inbox.puts == 0

        engine.core.abort("leg-1")
        clock.advance(0.05)
        engine.iterate()
        answer = get_all(app, ["/health"])[0]
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "ok"
        assert (body["live_requests"], body["iterations"], body["loop_age"]) == (0, 2, 0.0)
        engine.core.check_idle()
    finally:
        engine.core.close()


def test_every_iteration_publishes_the_health_view_and_the_snapshot(tiny_loaded):
    clock = SimClock()
    engine = AsyncEngine(lambda: PrefillCore(tiny_loaded, KV, SCHED, LIFE, SHM, clock=clock), threaded=False)
    try:
        first = engine.published
        engine.core.add(GenerateRequest("leg-2", (3, 4, 5), SamplingParams(max_tokens=2)), [].append, room=8)
        clock.advance(0.01)
        engine.iterate()
        after = engine.published
        assert after is not first and after.health["live_requests"] == 1
        assert len(after.snapshot.phases["bootstrap"]) == 1 and after.iterations == 1
        assert after.at == clock.now()
        engine.core.abort("leg-2")
        engine.iterate()
        assert engine.published.health["live_requests"] == 0 and not engine.published.snapshot.phases["bootstrap"]
        engine.core.check_idle()
    finally:
        engine.core.close()


def test_a_view_that_raises_publishes_nothing_and_never_stops_the_loop(tiny_loaded):
    clock = SimClock()
    engine = AsyncEngine(lambda: PrefillCore(tiny_loaded, KV, SCHED, LIFE, SHM, clock=clock), threaded=False)
    try:
        engine.core.health = lambda: 1 / 0
        clock.advance(1.0)
        assert engine.iterate()   # the iteration itself succeeded
        assert engine.iterations == 1 and engine.published.iterations == 0 and engine.loop_age() == 1.0
        del engine.core.health
        engine.iterate()
        assert engine.published.iterations == 2 and engine.loop_age() == 0.0
        engine.core.check_idle()
    finally:
        engine.core.close()


def test_a_wedged_engine_thread_still_answers_health_and_metrics(tiny_loaded):
    """The engine thread blocks inside a call: /health answers at once, its loop_age
    growing and its iteration count standing still, and /metrics answers; once the thread
    goes on, both move again. (On the old code both waited 10 s for the loop, then 500.)"""
    engine = AsyncEngine(lambda: DecodeCore(tiny_loaded, KV, SCHED, LIFE, SHM))
    blocked, release = threading.Event(), threading.Event()
    try:
        app = worker_app(engine, worker_metrics(engine))
        with ThreadPoolExecutor(1) as pool:
            wedge = pool.submit(engine.call, lambda c: (blocked.set(), release.wait(60)), 90)
            assert blocked.wait(30)
            first, text = get_all(app, ["/health", "/metrics"], timeout=2.0)
            time.sleep(0.3)
            second = get_all(app, ["/health"], timeout=2.0)[0]
            assert first.status_code == second.status_code == text.status_code == 200
            assert second.json()["loop_age"] >= first.json()["loop_age"] + 0.3
            assert second.json()["iterations"] == first.json()["iterations"]
            assert "kvrelay_requests" in text.text
            release.set()
            wedge.result(timeout=30)
        deadline = time.monotonic() + 30
        while (body := get_all(app, ["/health"])[0].json())["iterations"] <= first.json()["iterations"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert body["loop_age"] < second.json()["loop_age"]
        engine.check_idle()
    finally:
        release.set()
        engine.shutdown()
        engine.core.close()


# ---------------------------------------------------------------- floods of scrapes

@pytest.fixture
def renders(monkeypatch) -> list[float]:
    """The monotonic time of every exposition ServingMetrics renders."""
    seen: list[float] = []
    real = obs_metrics.generate_latest

    def counted(registry):
        seen.append(time.monotonic())
        return real(registry)
    monkeypatch.setattr(obs_metrics, "generate_latest", counted)
    return seen


def metrics_app(snapshot) -> tuple[FastAPI, ServingMetrics]:
    metrics = ServingMetrics("colocated", ("waiting", "running"), snapshot)

    async def rows() -> list[dict]:
        return []
    app = FastAPI()
    app.include_router(observability_router(metrics, rows))
    return app, metrics


def test_a_flood_of_scrapes_renders_once_per_interval(renders):
    """20 scrapes one after another, then 300 at once: at most one render (and one call of
    the snapshot function) per RENDER_SPACING_S; every scrape gets the exposition."""
    snapshots = []

    def snapshot() -> Snapshot:
        snapshots.append(1)
        return Snapshot(phases={"waiting": [], "running": [0.5]})
    app, _ = metrics_app(snapshot)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://m") as c:
            got = [await c.get("/metrics") for _ in range(20)]
            return got + list(await asyncio.gather(*(c.get("/metrics") for _ in range(300))))

    started = time.monotonic()
    got = asyncio.run(run())
    elapsed = time.monotonic() - started
    assert {r.status_code for r in got} == {200} and all("kvrelay_requests" in r.text for r in got)
    assert 1 <= len(renders) <= math.ceil(elapsed / RENDER_SPACING_S) + 1, (len(renders), elapsed)
    assert len(snapshots) == len(renders)


def test_a_scrape_never_reads_state_older_than_itself(renders):
    """A scrape right after another still sees what changed between them: it waits (at
    most the spacing) for a render begun after it arrived."""
    live = [0.0]
    app, _ = metrics_app(lambda: Snapshot(phases={"running": list(live)}))

    async def run() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://m") as c:
            first = (await c.get("/metrics")).text
            live.append(1.0)
            return [first, (await c.get("/metrics")).text]

    first, second = asyncio.run(run())
    assert gauges(first, "kvrelay_requests")["running"] == 1
    assert gauges(second, "kvrelay_requests")["running"] == 2 and len(renders) == 2
    assert renders[1] - renders[0] >= RENDER_SPACING_S - 0.01


def test_the_reexport_fetches_each_worker_once_per_interval_under_concurrent_scrapes():
    """Rounds of 50 concurrent scrapes of the router's /metrics/workers: one fan-out to the
    workers serves a whole round, and each worker is fetched at most once per interval."""
    fetched: dict[str, int] = {}

    async def worker(request: httpx.Request) -> httpx.Response:
        fetched[request.url.host] = fetched.get(request.url.host, 0) + 1
        await asyncio.sleep(0.05)   # scrapes pile up while it is in flight
        return httpx.Response(200, text="# TYPE kvrelay_up gauge\nkvrelay_up 1.0\n")

    targets = [("http://p:1", "prefill"), ("http://d:2", "decode")]

    async def run() -> list[list[httpx.Response]]:
        workers = httpx.AsyncClient(transport=httpx.MockTransport(worker))
        metrics = ServingMetrics("router", ("dispatched",), Snapshot)

        async def rows() -> list[dict]:
            return []
        app = FastAPI()
        app.include_router(observability_router(metrics, rows, lambda: scrape_workers(workers, targets, 2.0)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://r") as c:
            rounds = []
            for _ in range(3):
                rounds.append(await asyncio.gather(*(c.get("/metrics/workers") for _ in range(50))))
                if len(rounds) == 1:
                    assert fetched == {"p": 1, "d": 1}   # one fan-out for the whole round
                await asyncio.sleep(RENDER_SPACING_S / 2)
        await workers.aclose()
        return rounds

    started = time.monotonic()
    rounds = asyncio.run(run())
    elapsed = time.monotonic() - started
    for responses in rounds:
        assert {r.status_code for r in responses} == {200} and len({r.text for r in responses}) == 1
        ok = {s.labels["worker"]: s.value for f in text_string_to_metric_families(responses[0].text)
              for s in f.samples if s.name == "kvrelay_worker_scrape_ok"}
        assert ok == {"http://p:1": 1.0, "http://d:2": 1.0}
    assert set(fetched) == {"p", "d"}
    assert max(fetched.values()) <= math.ceil(elapsed / RENDER_SPACING_S) + 1, (fetched, elapsed)


def test_a_waiter_that_leaves_does_not_cancel_the_shared_fetch():
    calls = []

    async def fetch() -> bytes:
        calls.append(1)
        await asyncio.sleep(0.05)
        return b"x"

    async def run() -> bytes:
        shared = Coalesced(fetch)
        first = asyncio.ensure_future(shared.get())
        second = asyncio.ensure_future(shared.get())
        await asyncio.sleep(0.01)
        first.cancel()
        got = await second
        assert first.cancelled() and calls == [1]
        assert await shared.get() == b"x" and calls == [1, 1]   # asked after it began: a new one
        return got

    assert asyncio.run(run()) == b"x"
