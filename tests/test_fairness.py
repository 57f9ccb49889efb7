"""Every limit counts completions, not API calls (issue #53, finding 5): a request of k
prompts and n choices each holds k x n of its key's --max-streams-per-key bucket and of the
router's --max-queued-requests, is admitted whole or not at all, and one that could never
fit is a 400 naming the field. The real-process check is in tests/test_hostile.py."""
from __future__ import annotations

import asyncio

import pytest

from api_helpers import Scripted, api
from kvrelay.core.clock import SimClock
from kvrelay.core.config import RouterConfig
from kvrelay.engine.types import GenerateRequest, SamplingParams
from kvrelay.server.errors import OpenAIError
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.router import RouterClient
from kvrelay.server.security import Gate
from kvrelay.server.worker_client import WorkerAPI, WorkerMonitor

pytestmark = pytest.mark.anyio
C = "/v1/completions"


class Held(Scripted):
    """Scripted, but every request waits for `release` before its outputs."""

    def __init__(self, tok) -> None:
        super().__init__(tok)
        self.release = asyncio.Event()

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        await self.release.wait()
        async for out in super().generate(request):
            yield out


def assert_refused(r, status: int, code: str, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    return err["message"]


async def until(check, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def test_a_batch_holds_one_slot_per_completion_of_its_keys_bucket(tiny_loaded):
    client = Held(tiny_loaded.tokenizer)
    gate = Gate((), max_streams=4)
    async with api(build_openai_app(client, gate=gate)) as c:
        r = await c.post(C, json={"model": "scripted", "prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2})
        assert "5 completions" in assert_refused(r, 400, "too_many_completions", "prompt")
        r = await c.post(C, json={"model": "scripted", "prompt": "a", "n": 5, "max_tokens": 2})
        assert_refused(r, 400, "too_many_completions", "n")
        assert client.requests == []          # refused whole: nothing started
        batch = asyncio.create_task(c.post(C, json={"model": "scripted", "prompt": ["a", "b"], "n": 2,
                                                    "max_tokens": 2}))
        await until(lambda: len(client.requests) == 2)
        r = await c.post(C, json={"model": "scripted", "prompt": "another client", "max_tokens": 2})
        assert "--max-streams-per-key 4" in assert_refused(r, 429, "rate_limit_exceeded", None)
        assert r.headers["retry-after"] == "1"
        client.release.set()
        r = await batch
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        r = await c.post(C, json={"model": "scripted", "prompt": ["x"] * 4, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4   # the four slots came back


def router(max_queued: int) -> RouterClient:
    cfg = RouterConfig(prefill=("http://p:1",), decode=("http://d:1",), max_queued_requests=max_queued)
    clock = SimClock()
    table = WorkerTable(cfg.prefill, cfg.decode, clock)
    api_ = WorkerAPI(cfg)
    return RouterClient(cfg, table, api_, WorkerMonitor(table, api_, cfg), None, "m", 100, clock)


def test_the_router_counts_every_completion_and_admits_a_batch_whole():
    r = router(8)
    with pytest.raises(OpenAIError) as e:
        r.check_capacity(9, "prompt")
    assert (e.value.status, e.value.param) == (400, "prompt")
    held = [r._admit(GenerateRequest(f"r{i}", (1, 2), SamplingParams(n=3))) for i in range(2)]
    assert r._units == 6
    with pytest.raises(OpenAIError) as e:
        r.check_capacity(3, "prompt")          # 6 + 3 > 8: the whole batch waits
    assert e.value.status == 503 and e.value.code == "overloaded" and "Retry-After" in e.value.headers
    r.check_capacity(2, "n")                   # another client's two still fit
    with pytest.raises(OpenAIError):
        r._admit(GenerateRequest("big", (1,), SamplingParams(n=3)))
    assert r._units == 6 and len(r._live) == 2
    for routed in held:
        routed.outcome = ("success", "stop")
        r._finish(routed)
    assert r._units == 0 and not r._live
    r.check_capacity(8, "prompt")
