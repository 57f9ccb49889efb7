"""Hostile input on the HTTP surfaces (issue #10, findings 6, 7 and the HTTP part of 8):
the OpenAI front door, a worker's `POST /generate`, and the worker->router NDJSON lines.
Each input is refused at the edge with an OpenAI-style 4xx naming its field, and the
server serves on with nothing left behind."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import pytest

from kvrelay.core.config import KVCacheConfig, LifecycleConfig, SchedulerConfig, ServerConfig, TransferConfig
from kvrelay.engine.types import FinishReason, StepOutput, TokenLogprob
from kvrelay.obs.metrics import ServingMetrics, rejected_count
from kvrelay.server.errors import MAX_BODY_BYTES
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.protocol import MAX_STOPS
from kvrelay.server.startup import uvicorn_options
from kvrelay.server.worker_protocol import output_from_json, output_to_json

pytestmark = pytest.mark.anyio
ERROR_KEYS = {"message", "type", "param", "code"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"prompt": "hi", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONE = "\ud800"   # a lone UTF-16 surrogate: valid JSON ("\ud800"), not valid Unicode text


@asynccontextmanager
async def client(app):
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay", timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"], err
    if param != "unset":
        assert err["param"] == param, err
    return err


def raw_json(body: dict) -> bytes:
    """`body` as JSON with lone surrogates escaped (httpx's json= would refuse them)."""
    return json.dumps(body, ensure_ascii=True).encode()


@pytest.fixture(scope="module")
def app(tiny_engine):
    return build_openai_app(tiny_engine)


# -- finding 7: lone surrogates ------------------------------------------------------------

SURROGATES = [  # (path, body, param)
    (C, {**OK_C, "prompt": f"hello {LONE} world"}, "prompt"),
    (C, {**OK_C, "prompt": [f"x{LONE}"]}, "prompt"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": f"hi {LONE}"}]}, "messages[0].content"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages[0]"),
    (C, {**OK_C, "stop": [LONE]}, "stop"),
    (C, {**OK_C, "model": LONE}, "model"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES)
async def test_a_lone_surrogate_is_a_400_naming_the_parameter(app, tiny_engine, path, body, param):
    before = rejected_count("http")
    async with client(app) as c:
        for stream in (False, True):
            r = await c.post(path, content=raw_json({**body, "stream": stream}),
                             headers={"content-type": "application/json"})
            err = assert_error(r, 400, param)
            assert err["type"] == "invalid_request_error"
        assert (await c.post(path, json=OK_C if path == C else OK_CHAT)).status_code == 200
    assert rejected_count("http") >= before + 2
    tiny_engine.check_idle()


def surrogate_output(engine):
    """A `generate` whose outputs carry text that cannot be encoded as UTF-8 (as an odd
    tokenizer's decode could), over the real engine's tokens."""
    real = engine.generate

    async def generate(request):
        async for out in real(request):
            yield StepOutput(out.rid, out.token_ids, out.text + LONE, out.logprobs, out.prompt_tokens,
                             out.completion_tokens, out.finish_reason, out.error)
    return generate


async def test_output_text_that_cannot_be_encoded_still_completes(app, tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "generate", surrogate_output(tiny_engine))
    async with client(app) as c:
        r = await c.post(C, json={**OK_C, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert "\ufffd" in r.json()["choices"][0]["text"]
        r = await c.post(C, json={**OK_C, "max_tokens": 4, "ignore_eos": True, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert '"finish_reason":"length"' in r.text and "\ufffd" in r.text and "internal" not in r.text
    tiny_engine.check_idle()


def test_ndjson_line_of_text_that_cannot_be_encoded_is_valid_and_reads_back():
    out = StepOutput("cmpl-1", [5, 6], f"a{LONE}b\ud83d\ude00", [TokenLogprob(5, float("-inf"), ((6, -0.5),))],
                     3, 2, FinishReason.LENGTH, None)
    line = output_to_json(out)
    line.encode("utf-8")                        # what the worker's StreamingResponse does
    assert line.endswith("\n") and "\n" not in line[:-1]
    back = output_from_json(line.encode("utf-8"))
    assert back.text == "a\ufffdb\U0001F600" and back.token_ids == [5, 6]
    assert back.logprobs == [TokenLogprob(5, float("-inf"), ((6, -0.5),))]
    assert back.finish_reason is FinishReason.LENGTH and back.completion_tokens == 2


GOOD_LINE = {"rid": "r", "token_ids": [1], "text": "x", "logprobs": [], "prompt_tokens": 1,
             "completion_tokens": 1, "finish_reason": None, "error": None}
MALFORMED_LINES = [
    b"not json", b"[1, 2]", b"null", b'"text"', b"42", b"{}", b"[" * 100_000, b"\xff\xfe",
    json.dumps({**GOOD_LINE, "rid": 5}), json.dumps({**GOOD_LINE, "token_ids": "abc"}),
    json.dumps({**GOOD_LINE, "token_ids": [-1]}), json.dumps({**GOOD_LINE, "token_ids": [2**40]}),
    json.dumps({**GOOD_LINE, "text": ["x"]}), json.dumps({**GOOD_LINE, "logprobs": [[1, 2]]}),
    json.dumps({**GOOD_LINE, "logprobs": 7}), json.dumps({**GOOD_LINE, "logprobs": [[1, -1.0, [[1, "a"]]]]}),
    json.dumps({**GOOD_LINE, "finish_reason": "exploded"}), json.dumps({**GOOD_LINE, "finish_reason": 1}),
    json.dumps({**GOOD_LINE, "prompt_tokens": "1"}), json.dumps({**GOOD_LINE, "error": {"a": 1}}),
    json.dumps({k: v for k, v in GOOD_LINE.items() if k != "text"}),
]


@pytest.mark.parametrize("line", MALFORMED_LINES, ids=range(len(MALFORMED_LINES)))
def test_a_malformed_ndjson_line_is_a_value_error(line):
    """`WorkerAPI.generate` maps a ValueError to that leg's LegFailure: nothing else may escape."""
    with pytest.raises(ValueError):
        output_from_json(line)
    assert output_from_json(json.dumps(GOOD_LINE)).token_ids == [1]


# -- finding 8 (HTTP) and item 2: limits ----------------------------------------------------

async def test_a_body_over_the_limit_is_413(app, tiny_engine):
    big = json.dumps({**OK_C, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    async with client(app) as c:
        err = assert_error(await c.post(C, content=big, headers={"content-type": "application/json"}), 413, None)
        assert err["code"] == "body_too_large"

        async def chunked():   # no content-length: counted as it arrives
            for _ in range(MAX_BODY_BYTES // 65536 + 2):
                yield b"x" * 65536
        err = assert_error(await c.post(C, content=chunked(), headers={"content-type": "application/json"}), 413)
        assert err["code"] == "body_too_large"
        assert (await c.post(C, json=OK_C)).status_code == 200
    tiny_engine.check_idle()


LIMITS = [  # (path, body, param)
    (C, {**OK_C, "stop": [f"s{i}" for i in range(MAX_STOPS + 1)]}, "stop"),
    (C, {**OK_C, "stop": "x" * 10_000}, "stop"),
    (CHAT, {**OK_CHAT, "stop": [f"s{i}" for i in range(100)]}, "stop"),
    (C, {**OK_C, "stop_token_ids": list(range(1000))}, "stop_token_ids"),
    (C, {**OK_C, "stop_token_ids": [2**40]}, "stop_token_ids[0]"),
    (C, {**OK_C, "prompt": [1, 2**40]}, "prompt"),
    (C, {**OK_C, "seed": 10**30}, "seed"),
    (C, {**OK_C, "top_k": 10**30}, "top_k"),
    (C, {**OK_C, "logprobs": -1}, "logprobs"),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 100}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", LIMITS)
async def test_limits_are_400s_naming_the_field(app, tiny_engine, path, body, param):
    async with client(app) as c:
        assert_error(await c.post(path, json=body), 400, param)
        ok = {**OK_C, "stop": [f"s{i}" for i in range(MAX_STOPS)]} if path == C else OK_CHAT
        assert (await c.post(path, json=ok)).status_code == 200
    tiny_engine.check_idle()


def test_uvicorn_gets_the_connection_limits():
    # --limit-concurrency is kvrelay's protocol's (requests in flight, a JSON 503), never
    # uvicorn's own (which counts idle connections and answers text/plain).
    opts = uvicorn_options(ServerConfig())
    assert opts["timeout_keep_alive"] == 5.0 and opts["limit_concurrency"] is None
    assert opts["http"].policy.max_in_flight == 2048 and opts["http"].limits.header_timeout == 10.0
    opts = uvicorn_options(ServerConfig(timeout_keep_alive=1.5, limit_concurrency=10, body_timeout=3.0))
    assert opts["timeout_keep_alive"] == 1.5 and opts["limit_concurrency"] is None
    assert opts["http"].policy.max_in_flight == 10 and opts["http"].limits.body_timeout == 3.0
    with pytest.raises(ValueError):
        ServerConfig(limit_concurrency=0)


# -- finding 6: a worker's POST /generate ---------------------------------------------------

KV = KVCacheConfig(page_size=16, max_kv_tokens=2048)
SCHED = SchedulerConfig(max_running_requests=16, max_prefill_tokens=512)
LIFE = LifecycleConfig(heartbeat_interval=0.2, heartbeat_misses=3, bootstrap_timeout=5, queue_timeout=5,
                       waiting_timeout=5, transfer_timeout=5, quarantine_grace=0.5)


@pytest.fixture(scope="module")
def workers(tiny_loaded):
    """A prefill and a decode worker app (real cores, shm) in this process."""
    from kvrelay.disagg.decode_worker import DecodeCore
    from kvrelay.disagg.prefill_worker import PrefillCore
    from kvrelay.engine.engine import AsyncEngine
    from kvrelay.server.worker_app import worker_app

    tc = TransferConfig(transfer_backend="shm")
    engines = {"prefill": AsyncEngine(lambda: PrefillCore(tiny_loaded, KV, SCHED, LIFE, tc)),
               "decode": AsyncEngine(lambda: DecodeCore(tiny_loaded, KV, SCHED, LIFE, tc))}
    apps = {}
    for role, engine in engines.items():
        metrics = ServingMetrics(role, type(engine.core).PHASES, lambda e=engine: e.call(lambda c: c.snapshot()))
        apps[role] = worker_app(engine, metrics)
    yield apps, engines
    for engine in engines.values():
        engine.shutdown()
        engine.core.close()


def leg(rid: str, room: int, **extra) -> dict:
    return {"rid": rid, "room": room, "prompt_ids": list(range(3, 30)),
            "sampling": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}, **extra}


def lines(r: httpx.Response) -> list[StepOutput]:
    return [output_from_json(line) for line in r.text.splitlines() if line.strip()]


BAD_LEGS = [  # (changes to a decode leg, param)
    ({"prefill_address": "not an address"}, "prefill_address"),
    ({"prefill_address": "tcp://127.0.0.1:99999"}, "prefill_address"),
    ({"prefill_address": "tcp://127.0.0.1"}, "prefill_address"),
    ({"prefill_address": "tcp://" + "a" * 400 + ":5"}, "prefill_address"),
    ({"prefill_address": {"host": "x"}}, "prefill_address"),
    ({"rid": "has spaces and / slashes"}, "rid"),
    ({"rid": "r" * 500}, "rid"),
    ({"room": 0}, "room"),
    ({"room": "7"}, "room"),
    ({"prompt_ids": [1, 2**31]}, "prompt_ids[1]"),
    ({"prompt_ids": [1, -3]}, "prompt_ids[1]"),
    ({"prompt_ids": "1 2 3"}, "prompt_ids"),
    ({"sampling": {"max_tokens": 5, "stop": ["s"] * 1000}}, "sampling.stop"),
    ({"sampling": {"max_tokens": 5, "stop": ["s" * 5000]}}, "sampling.stop[0]"),
    ({"sampling": {"max_tokens": 5, "logprobs": 50}}, "sampling.logprobs"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
    ({"sampling": {"max_tokens": 5, "temperature": -1.0}}, "sampling.temperature"),
    ({"sampling": {"max_tokens": 5, "top_p": 0.0}}, "sampling.top_p"),
    ({"sampling": {"max_tokens": 5, "stop_token_ids": [2**40]}}, "sampling.stop_token_ids[0]"),
    ({"sampling": {"max_tokens": 5, "seed": 10**40}}, "sampling.seed"),
    ({"sampling": {"max_tokens": 5, "ignore_eos": "yes"}}, "sampling.ignore_eos"),
]


@pytest.mark.parametrize("change,param", BAD_LEGS, ids=[p for _, p in BAD_LEGS])
async def test_a_bad_decode_leg_is_a_400_before_any_line_and_the_worker_serves_on(workers, change, param):
    apps, engines = workers
    paddr = engines["prefill"].core.manager.address
    room = 1000 + BAD_LEGS.index((change, param)) * 2
    async with client(apps["prefill"]) as p, client(apps["decode"]) as d:
        err = assert_error(await d.post("/generate", json={**leg("bad", room), "prefill_address": paddr, **change}),
                           400, param)
        assert err["type"] == "invalid_request_error"
        # A good request on the same worker runs to its end.
        ok = leg("good", room + 1)
        rp, rd = await asyncio.gather(p.post("/generate", json=ok), d.post("/generate", json={**ok, "prefill_address": paddr}))
        assert rp.status_code == rd.status_code == 200, (rp.text, rd.text)
        outs = lines(rd)
        assert outs[-1].finish_reason is FinishReason.LENGTH, outs[-1]
        assert sum(len(o.token_ids) for o in outs) == 5
    for engine in engines.values():
        engine.check_idle(timeout=15)


async def test_a_leg_naming_the_wrong_prefill_source_is_a_400_and_one_prefilled_on_decode_runs(workers):
    """A decode leg has exactly one of prefill_address and prefill_here; a prefill leg has
    neither. A decode leg with prefill_here is prefilled by the decode worker alone."""
    apps, engines = workers
    paddr = engines["prefill"].core.manager.address
    async with client(apps["prefill"]) as p, client(apps["decode"]) as d:
        for worker, extra, param in ((d, {}, "prefill_address"),
                                     (d, {"prefill_address": paddr, "prefill_here": True}, "prefill_address"),
                                     (p, {"prefill_here": True}, "prefill_here"),
                                     (p, {"prefill_address": paddr}, "prefill_address")):
            assert_error(await worker.post("/generate", json={**leg("wrong", 3000), **extra}), 400, param)
        outs = lines(await d.post("/generate", json={**leg("here", 3001), "prefill_here": True}))
        assert outs[-1].finish_reason is FinishReason.LENGTH, outs[-1]
        assert sum(len(o.token_ids) for o in outs) == 5
    for engine in engines.values():
        engine.check_idle(timeout=15)


async def test_a_worker_body_over_the_limit_is_413(workers):
    apps, _ = workers
    async with client(apps["decode"]) as d:
        big = json.dumps(leg("big", 5, prompt_ids=[1] * (MAX_BODY_BYTES // 2))).encode()
        assert_error(await d.post("/generate", content=big, headers={"content-type": "application/json"}), 413)


async def test_fault_injection_exists_only_on_purpose(workers):
    """Without --enable-fault-injection a worker has no POST /debug/faults (#10 finding 9:
    it was open to anyone who reached the port)."""
    apps, engines = workers
    for role, app in apps.items():
        async with client(app) as w:
            r = await w.post("/debug/faults", json={"spec": "drop_ack=1"})
            assert r.status_code == 404, (role, r.text)
            assert r.json()["error"]["type"] == "not_found_error"
        assert not engines[role].core.manager.faults.spec.any


# -- item 6: /debug/requests shows no text --------------------------------------------------

async def test_debug_requests_shows_no_prompt_or_output_text(tiny_engine):
    import asyncio as aio

    from kvrelay.server.observe import observability_router

    async def rows():
        return await aio.to_thread(tiny_engine.call, lambda core: core.debug_rows())

    metrics = ServingMetrics("colocated", ("waiting", "running"), lambda: None)
    app = build_openai_app(tiny_engine, extra_routes=[observability_router(metrics, rows)])
    secret = "zebra-xylophone-secret"
    async with client(app) as c:
        task = aio.create_task(c.post(C, json={"prompt": secret, "max_tokens": 200, "ignore_eos": True,
                                               "stop": [secret]}))
        for _ in range(200):
            view = (await c.get("/debug/requests")).json()
            if view["count"]:
                break
            await aio.sleep(0.01)
        assert view["count"] == 1, view
        assert secret not in json.dumps(view) and "zebra" not in json.dumps(view)
        assert (await task).status_code == 200
    tiny_engine.check_idle()
