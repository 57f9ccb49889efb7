"""The router against scripted workers (httpx.MockTransport): pairing, streaming, cancelling
the other leg, the one retry, client aborts, the deadline, admission, and the debug view."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvrelay.core.clock import MonotonicClock
from kvrelay.core.config import RouterConfig
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, SamplingParams, StepOutput
from kvrelay.server.errors import OpenAIError, StartupError
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.router import RouterClient, router_app
from kvrelay.server.worker_client import WorkerAPI, WorkerMonitor
from kvrelay.server.worker_protocol import LegRequest, WorkerHealth, output_to_json

P1, P2 = "http://p1:1", "http://p2:1"
D1, D2 = "http://d1:1", "http://d2:1"
LENGTH, ERROR = FinishReason.LENGTH, FinishReason.ERROR


class FakeWorkers:
    """Workers as an httpx handler. `behaviour[url](leg)` answers POST /generate."""

    def __init__(self, urls, model="m") -> None:
        self.model = model
        self.role = {url: "prefill" if "//p" in url else "decode" for url in urls}
        self.models = {url: model for url in urls}
        self.behaviour = {url: (prefill_ok if self.role[url] == "prefill" else decode_tokens(1, 2, 3))
                          for url in urls}
        self.legs: list[tuple[str, LegRequest]] = []
        self.aborts: list[tuple[str, str]] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        url, path = f"{request.url.scheme}://{request.url.host}:{request.url.port}", request.url.path
        if path == "/health":
            return httpx.Response(200, text=WorkerHealth(
                role=self.role[url], worker_id=url, incarnation="1", model=self.models[url], max_model_len=512,
                transfer_backend="fake", transfer_address=f"tcp://{request.url.host}:9", live_requests=0,
                queued_requests=0, free_pages=10, total_pages=10).model_dump_json())
        if path == "/abort":
            self.aborts.append((url, json.loads(request.content)["rid"]))
            return httpx.Response(200, json={"aborted": True})
        if path == "/debug/requests":
            return httpx.Response(200, json={"role": self.role[url], "count": 0, "requests": [], "phases": {}})
        leg = LegRequest.model_validate_json(request.content)
        self.legs.append((url, leg))
        return self.behaviour[url](leg)

    def rooms(self) -> set[int]:
        return {leg.room for _, leg in self.legs}


def stream(outs, delay: float = 0.0, hang: bool = False) -> httpx.Response:
    async def body():
        for out in outs:
            await asyncio.sleep(delay)
            yield output_to_json(out).encode()
        if hang:
            await asyncio.Event().wait()
    return httpx.Response(200, content=body())


def prefill_ok(leg):
    return stream([StepOutput(leg.rid, [1], finish_reason=LENGTH)])


def decode_tokens(*ids, end=LENGTH, error=None, delay=0.0, hang=False):
    def respond(leg):
        outs = [StepOutput(leg.rid, [i], text=f"<{i}>") for i in ids]
        if end is not None:
            outs.append(StepOutput(leg.rid, finish_reason=end, error=error))
        return stream(outs, delay, hang)
    return respond


def fails(error: str):
    return lambda leg: stream([StepOutput(leg.rid, finish_reason=ERROR, error=error)])


def hangs(leg):
    return stream([], hang=True)


def refused(leg):
    raise httpx.ConnectError("connection refused")


async def start_router(fake: FakeWorkers, prefill=(P1,), decode=(D1,), **cfg) -> RouterClient:
    config = RouterConfig(prefill=prefill, decode=decode, **cfg)
    api = WorkerAPI(config, transport=httpx.MockTransport(fake.handler))
    clock = MonotonicClock()
    table = WorkerTable(prefill, decode, clock)
    monitor = WorkerMonitor(table, api, config)
    model, max_len = await monitor.wait_ready(5, clock)
    return RouterClient(config, table, api, monitor, None, model, max_len, clock)


async def settle(router: RouterClient) -> None:
    """Let background aborts land and cancelled legs finish."""
    await asyncio.sleep(0.05)
    await router.close()
    await asyncio.sleep(0.01)


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(rid, (5, 6, 7), SamplingParams(max_tokens=8))


async def collect(router: RouterClient, rid: str = "r1") -> list[StepOutput]:
    return [out async for out in router.generate(request(rid))]


def finished(router: RouterClient) -> dict[tuple[str, str], float]:
    return {(s.labels["outcome"], s.labels["reason"]): s.value
            for m in router.metrics.registry.collect() if m.name == "kvrelay_requests_finished"
            for s in m.samples if s.name.endswith("_total")}


def outstanding(router: RouterClient) -> list[int]:
    return [router.table.get(url).outstanding for url in router.table.urls()]


def test_a_request_sends_both_legs_at_once_and_streams_the_decode_tokens():
    async def main():
        fake = FakeWorkers([P1, D1])
        router = await start_router(fake)
        outs = await collect(router)
        await settle(router)
        assert "".join(o.text for o in outs) == "<1><2><3>"
        assert outs[-1].finish_reason is LENGTH and all(o.rid == "r1" for o in outs)
        (p_url, p_leg), (d_url, d_leg) = sorted(fake.legs, key=lambda x: x[0] != P1)
        assert (p_url, d_url) == (P1, D1)
        assert p_leg.rid == d_leg.rid == "r1" and p_leg.room == d_leg.room >= 1
        assert p_leg.prompt_ids == d_leg.prompt_ids == [5, 6, 7] and d_leg.sampling.max_tokens == 8
        assert (p_leg.prefill_address, d_leg.prefill_address) == (None, "tcp://p1:9")
        assert fake.aborts == []
        assert outstanding(router) == [0, 0]
        assert finished(router) == {("success", "length"): 1.0}
        assert router.debug_rows() == []
    asyncio.run(main())


def test_a_prefill_failure_before_any_token_cancels_the_decode_leg_and_retries_on_another_pair():
    async def main():
        fake = FakeWorkers([P1, P2, D1, D2])
        fake.behaviour[P1] = fails("transfer_error: the backend lost the connection")
        fake.behaviour[D1] = decode_tokens(9, delay=0.2)
        router = await start_router(fake, prefill=(P1, P2), decode=(D1, D2))
        outs = await collect(router)
        await settle(router)
        assert "".join(o.text for o in outs) == "<1><2><3>"
        assert fake.aborts == [(D1, "r1")]
        second = [(url, leg.rid) for url, leg in fake.legs[2:]]
        assert sorted(second) == [(D2, "r1-try2"), (P2, "r1-try2")]
        assert len(fake.rooms()) == 2   # a new room for the new try
        assert outstanding(router) == [0, 0, 0, 0]
        assert finished(router) == {("success", "length"): 1.0}
    asyncio.run(main())


def test_a_failure_after_tokens_reached_the_client_ends_it_with_the_reason_and_no_retry():
    async def main():
        fake = FakeWorkers([P1, P2, D1, D2])
        fake.behaviour[D1] = decode_tokens(1, end=ERROR, error="peer_failed: prefill worker stopped heartbeating")
        router = await start_router(fake, prefill=(P1, P2), decode=(D1, D2))
        outs = await collect(router)
        await settle(router)
        assert [o.text for o in outs] == ["<1>", ""]
        assert outs[-1].finish_reason is ERROR
        assert outs[-1].error == "peer_failed: prefill worker stopped heartbeating"
        assert len(fake.legs) == 2
        assert finished(router) == {("failed", "peer_failed"): 1.0}
    asyncio.run(main())


def test_an_unreachable_worker_is_marked_down_its_peer_leg_aborted_and_the_request_retried():
    async def main():
        fake = FakeWorkers([P1, D1, D2])
        fake.behaviour[D1] = refused
        fake.behaviour[P1] = lambda leg: stream([StepOutput(leg.rid, [1], finish_reason=LENGTH)], delay=0.2)
        router = await start_router(fake, decode=(D1, D2))
        outs = await collect(router)
        await settle(router)
        assert outs[-1].finish_reason is LENGTH
        assert not router.table.get(D1).up and "connection refused" in router.table.get(D1).last_error
        assert (P1, "r1") in fake.aborts
        assert [url for url, _ in fake.legs[2:]].count(D2) == 1
    asyncio.run(main())


def test_when_the_retry_fails_too_the_client_gets_the_error_with_its_reason():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.behaviour[P1] = fails("timeout:transfer: D never acknowledged the KV")
        router = await start_router(fake)
        outs = await collect(router)
        await settle(router)
        assert len(outs) == 1 and outs[0].finish_reason is ERROR
        assert outs[0].error == "timeout:transfer: D never acknowledged the KV"
        assert len(fake.legs) == 4   # two tries, each with both legs; the only pair is reused
        assert finished(router) == {("failed", "timeout:transfer"): 1.0}
    asyncio.run(main())


def test_a_request_the_workers_reject_is_rejected_with_their_message():
    async def main():
        fake = FakeWorkers([P1, D1])
        body = {"error": {"message": "prompt too long for the KV pool", "type": "invalid_request_error",
                          "param": "messages", "code": "kv_capacity_exceeded"}}
        fake.behaviour[P1] = fake.behaviour[D1] = lambda leg: httpx.Response(400, json=body)
        router = await start_router(fake)
        with pytest.raises(RequestRejected) as err:
            await collect(router)
        await settle(router)
        assert (str(err.value), err.value.param, err.value.code) == (
            "prompt too long for the KV pool", "messages", "kv_capacity_exceeded")
        assert len(fake.legs) == 2
        assert finished(router) == {("failed", "invalid_request"): 1.0}
    asyncio.run(main())


def test_a_client_abort_ends_the_request_and_aborts_both_legs():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.behaviour[P1] = fake.behaviour[D1] = hangs
        router = await start_router(fake)
        task = asyncio.create_task(collect(router))
        await asyncio.sleep(0.05)
        assert [row["phase"] for row in router.debug_rows()] == ["dispatched"]
        await router.abort("r1")
        outs = await task
        await settle(router)
        assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
        assert sorted(fake.aborts) == [(D1, "r1"), (P1, "r1")]
        assert outstanding(router) == [0, 0]
        assert finished(router) == {("aborted", "aborted"): 1.0}
    asyncio.run(main())


def test_a_consumer_that_stops_reading_mid_stream_aborts_both_legs():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.behaviour[P1] = hangs
        fake.behaviour[D1] = decode_tokens(1, end=None, hang=True)
        router = await start_router(fake)
        gen = router.generate(request())
        first = await gen.__anext__()
        assert first.text == "<1>"
        assert [row["phase"] for row in router.debug_rows()] == ["streaming"]
        await gen.aclose()
        await settle(router)
        assert sorted(fake.aborts) == [(D1, "r1"), (P1, "r1")]
        assert outstanding(router) == [0, 0]
        assert finished(router) == {("aborted", "aborted"): 1.0}
    asyncio.run(main())


def test_the_end_to_end_deadline_aborts_both_legs_and_names_the_reason():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.behaviour[P1] = fake.behaviour[D1] = hangs
        router = await start_router(fake, request_timeout=0.2)
        outs = await collect(router)
        await settle(router)
        assert outs[-1].finish_reason is ERROR and outs[-1].error.startswith("timeout:request: ")
        assert sorted(fake.aborts) == [(D1, "r1"), (P1, "r1")]
        assert len(fake.legs) == 2   # a deadline is never retried
    asyncio.run(main())


def test_beyond_max_queued_requests_new_requests_get_503_with_retry_after():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.behaviour[P1] = fake.behaviour[D1] = hangs
        router = await start_router(fake, max_queued_requests=1)
        task = asyncio.create_task(collect(router, "r1"))
        await asyncio.sleep(0.05)
        with pytest.raises(OpenAIError) as err:
            await collect(router, "r2")
        assert (err.value.status, err.value.code, err.value.headers) == (503, "overloaded", {"Retry-After": "1"})
        await router.abort("r1")
        await task
        fake.behaviour[P1], fake.behaviour[D1] = prefill_ok, decode_tokens(1)
        outs = await asyncio.wait_for(collect(router, "r3"), 5)   # room again once r1 has ended
        await settle(router)
        assert outs[-1].finish_reason is LENGTH
        assert finished(router) == {("failed", "overloaded"): 1.0, ("aborted", "aborted"): 1.0,
                                    ("success", "length"): 1.0}
    asyncio.run(main())


def test_with_no_healthy_pair_the_client_gets_503():
    async def main():
        fake = FakeWorkers([P1, D1])
        router = await start_router(fake)
        fake.behaviour[D1] = refused
        router.monitor.failed(D1, "ConnectError: refused")
        with pytest.raises(OpenAIError) as err:
            await collect(router)
        assert (err.value.status, err.value.code) == (503, "no_healthy_worker")
        assert "no healthy decode worker" in err.value.message
    asyncio.run(main())


def test_health_checks_keep_out_workers_with_another_role_or_model_and_let_them_rejoin():
    async def main():
        fake = FakeWorkers([P1, D1, D2])
        router = await start_router(fake, decode=(D1, D2))
        fake.models[D2] = "other"
        fake.role[D1] = "prefill"
        await router.monitor.check_all()
        assert router.table.up("decode") == []
        assert "serves model other" in router.table.get(D2).last_error
        assert "reports role prefill" in router.table.get(D1).last_error
        fake.models[D2] = "m"
        await router.monitor.check_all()
        assert [w.url for w in router.table.up("decode")] == [D2]
    asyncio.run(main())


def test_startup_refuses_workers_that_disagree_on_the_model():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.models[D1] = "other"
        with pytest.raises(StartupError, match="different models"):
            await start_router(fake)
    asyncio.run(main())


def test_debug_requests_lists_the_routers_requests_and_every_workers_view():
    async def main():
        fake = FakeWorkers([P1, D1])
        fake.behaviour[P1] = fake.behaviour[D1] = hangs
        router = await start_router(fake)
        task = asyncio.create_task(collect(router))
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(router_app(router)), base_url="http://r") as c:
            debug = (await c.get("/debug/requests")).json()
            workers = (await c.get("/workers")).json()["workers"]
            metrics = (await c.get("/metrics")).text
        await router.abort("r1")
        await task
        await settle(router)
        assert debug["role"] == "router" and debug["count"] == 1
        row = debug["requests"][0]
        assert (row["id"], row["phase"], row["attempt"]) == ("r1", "dispatched", 1)
        assert (row["prefill"], row["decode"]) == (P1, D1)
        assert row["room"] in fake.rooms() and row["deadline_in"] > 0
        assert debug["workers"] == {P1: {"role": "prefill", "requests": [], "phases": {}},
                                    D1: {"role": "decode", "requests": [], "phases": {}}}
        assert [(w["url"], w["up"], w["outstanding"]) for w in workers] == [(P1, True, 1), (D1, True, 1)]
        assert 'kvrelay_requests{phase="dispatched",role="router"} 1.0' in metrics
    asyncio.run(main())
