"""Grammars never stall an engine thread or an event loop, and a grammar the backend
refuses is the request's fault, never a 500 (issue #53, finding 6).

- The llguidance tokenizer is built with the engine, not inside the first grammar request.
- A grammar is compiled (matcher + its first mask) in the compiler's own threads, never on
  the event loop or the engine thread: the lexer-limit regex `(a{1000}){1000}b` is a 400
  naming `grammar` while the engine's other requests run on and end normally.
- A grammar that reaches a limit only after generation started (LATE: a Lark grammar whose
  pathological terminal comes after a preamble) ends with `invalid_request`: a 400 when
  non-streamed, an error event when streamed, never retried by the router.
- A compile that overruns its budget is a 400; its result is kept, so a spec compiles once.
- The HTTP layer checks on its event loop only grammars short enough to check in ~2 ms.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
import re
import threading
import time
import types

import httpx
import jsonschema
import pytest

from api_helpers import api, assert_400, events
from kvrelay.core.config import KVCacheConfig, LifecycleConfig, RouterConfig, SchedulerConfig, TransferConfig
from kvrelay.engine import grammar
from kvrelay.engine.core import EngineCore
from kvrelay.engine.engine import AsyncEngine, build_engine
from kvrelay.engine.grammar_spec import INLINE_CHECK_CHARS, MAX_GRAMMAR_CHARS
from kvrelay.engine.types import FinishReason, GenerateRequest, GrammarSpec, RequestRejected, SamplingParams
from kvrelay.server import structured
from kvrelay.server.errors import OpenAIError
from kvrelay.server.worker_protocol import output_to_json

pytestmark = pytest.mark.anyio

LEXER_LIMIT = "(a{1000}){1000}b"   # its first mask reaches llguidance's lexer limit
# The pathological terminal only after a preamble (and behind a choice, so that llguidance
# does not fold it into the preamble's lexeme): the first masks are cheap, the one after
# "x" or "y" reaches the lexer limit.
LATE = 'start: "Here is the answer: " tail\ntail: "x" BAD | "y" BAD\nBAD: /(a{1000}){1000}b/'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
KV = KVCacheConfig(page_size=16, max_kv_tokens=2048)
_FRESH = itertools.count()
SCHED = SchedulerConfig(max_running_requests=16, max_prefill_tokens=512)


def greedy(rid: str, n: int, grammar_spec: GrammarSpec | None = None, prompt=range(10, 26)) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                              grammar=grammar_spec))


def fresh_regex(tag: str) -> str:
    """A regex no test compiled before (the compiler caches by spec)."""
    return f"{tag}-[0-9]{{3}}-{next(_FRESH)}"


class Recorder:
    """Stands for llguidance in engine/grammar.py: records where each matcher is built,
    optionally after a delay."""

    def __init__(self, delay: float = 0.0) -> None:
        self.threads: list[threading.Thread] = []
        self.delay = delay
        self.real = grammar.llguidance.LLMatcher

    def LLMatcher(self, *args, **kwargs):   # noqa: N802 - llguidance's name
        self.threads.append(threading.current_thread())
        time.sleep(self.delay)
        return self.real(*args, **kwargs)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(grammar, "llguidance", types.SimpleNamespace(LLMatcher=rec.LLMatcher))
    return rec


# -- the tokenizer, with the engine -------------------------------------------------------------

def test_the_llguidance_tokenizer_is_built_with_the_engine(tiny_loaded):
    """A tokenizer object no engine has seen: right after the engine is built, before any
    grammar request, its llguidance tokenizer exists (built on the engine thread)."""
    loaded = dataclasses.replace(tiny_loaded, tokenizer=copy.deepcopy(tiny_loaded.tokenizer))
    assert loaded.tokenizer not in grammar._LLTOKENIZERS
    engine = build_engine(loaded, KV, SCHED)
    try:
        compiler = engine.core.grammars
        assert compiler.tokenizer is not None and not compiler.unavailable
        assert compiler.words == (len(loaded.tokenizer) + 31) // 32
        assert loaded.tokenizer in grammar._LLTOKENIZERS
        assert not compiler._cache   # nothing compiled yet
        # a second engine on the same tokenizer shares it
        assert EngineCore(loaded, KV, SCHED).grammars.tokenizer is compiler.tokenizer
    finally:
        engine.shutdown()


def test_a_model_without_a_fast_tokenizer_refuses_grammars_at_request_time():
    """The simulation's stand-in tokenizer cannot be wrapped: the engine still builds, and a
    grammar request is a 400 naming `grammar` (as before: structured output unavailable)."""
    from kvrelay.sim.model import sim_loaded

    core = EngineCore(sim_loaded(), KV, SCHED)
    assert core.grammars.tokenizer is None and "not available" in core.grammars.unavailable
    with pytest.raises(RequestRejected) as err:
        core.validate(greedy("g", 4, GrammarSpec("regex", "[0-9]+"), prompt=range(1, 5)))
    assert err.value.param == "grammar" and "structured output is not available" in str(err.value)
    core.validate(greedy("plain", 4, prompt=range(1, 5)))


# -- colocated ---------------------------------------------------------------------------------

async def stream_tokens(engine: AsyncEngine, greq: GenerateRequest, started: asyncio.Event, got: list) -> None:
    async for out in engine.generate(greq):
        got.append(out)
        started.set()


async def test_the_lexer_limit_grammar_is_a_400_while_four_streams_end_normally(app, tiny_engine):
    """Four streams run; the lexer-limit grammar (whole and streamed) gets a 400 naming
    the request field it came in, never a 500, while the engine keeps sampling for the streams; a JSON schema
    request beside them still validates; every stream ends with all its tokens."""
    got: list[list] = [[] for _ in range(4)]
    started = [asyncio.Event() for _ in range(4)]
    streams = [asyncio.create_task(stream_tokens(tiny_engine, greedy(f"s{i}", 150, prompt=range(20 + i, 40 + i)),
                                                 started[i], got[i])) for i in range(4)]
    try:
        for e in started:   # every stream is running
            await asyncio.wait_for(e.wait(), 60)
        sampled = await tiny_engine.acall(lambda c: c.tokens_sampled)
        async with api(app) as c:
            for stream in (False, True):
                r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stream": stream,
                                                          "guided_regex": LEXER_LIMIT})
                message = assert_400(r, "guided_regex")
                assert r.json()["error"]["code"] == "invalid_request"
                assert "structured-output limits" in message and "lexer" in message, message
            sampled_meanwhile = await tiny_engine.acall(lambda c: c.tokens_sampled) - sampled
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "who?"}], "max_tokens": 60, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)
        await asyncio.wait_for(asyncio.gather(*streams), 120)
    finally:
        for t in streams:
            t.cancel()
    assert sampled_meanwhile > 0   # the engine thread sampled for the streams while the grammar compiled
    for outs in got:
        assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].error is None
        assert sum(len(o.token_ids) for o in outs) == 150
    tiny_engine.check_idle()


async def test_a_limit_reached_mid_output_ends_with_invalid_request(app, tiny_engine):
    """LATE passes its compile (first mask and a probe token), then reaches the lexer limit
    after the preamble: whole, a 400 with code invalid_request; streamed, the preamble's
    text and then an error event with that code, and [DONE]."""
    body = {"prompt": "x", "max_tokens": 64, "temperature": 0, "guided_grammar": LATE}
    async with api(app) as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error"
        assert "structured-output limits" in err["message"] and "lexer" in err["message"], err
        r = await c.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200
    evs = events(r.text)
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == "invalid_request", evs[-2:]
    text = "".join(e["choices"][0]["text"] for e in evs[:-2] if e.get("choices"))
    assert re.fullmatch(r"Here is the answer: [xy]a*", text), text   # a fresh compilation: the first one was spent
    assert not (await tiny_engine.core.grammars.prepare(GrammarSpec("lark", LATE))).spent
    tiny_engine.check_idle()


async def test_compile_runs_off_the_event_loop_and_off_the_engine_thread(app, tiny_engine, recorder):
    regex = fresh_regex("thread")
    async with api(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "guided_regex": regex})
    assert r.status_code == 200, r.text
    assert re.fullmatch(regex, r.json()["choices"][0]["text"])
    assert len(recorder.threads) == 1   # compiled once; the engine thread copied it
    where = recorder.threads[0]
    assert where.name.startswith("kvrelay-grammar")
    assert where is not threading.current_thread()   # this loop's (the app's) thread
    assert where is not tiny_engine._thread
    tiny_engine.check_idle()


async def test_a_compile_over_budget_is_a_400_and_its_result_is_kept(tiny_engine, monkeypatch):
    """A compile slower than the budget refuses the request (param grammar) without waiting
    for it; it runs on and is cached, so the next request finds it compiled: two requests,
    one compilation. A refused grammar is cached too."""
    rec = Recorder(delay=0.5)
    monkeypatch.setattr(grammar, "llguidance", types.SimpleNamespace(LLMatcher=rec.LLMatcher))
    compiler = tiny_engine.core.grammars
    spec = GrammarSpec("regex", fresh_regex("budget"))
    with pytest.raises(RequestRejected) as err:
        await compiler.prepare(spec, budget=0.05)
    assert err.value.param == "grammar" and "did not compile within 0.05 s" in str(err.value)
    first = await compiler.prepare(spec)   # waits for the same compilation
    assert (await compiler.prepare(spec)) is first and len(rec.threads) == 1
    bad = GrammarSpec("regex", LEXER_LIMIT + fresh_regex(""))
    for _ in range(2):
        with pytest.raises(RequestRejected, match="structured-output limits"):
            await compiler.prepare(bad)
    assert len(rec.threads) == 2


async def test_the_loop_checks_only_short_grammars_and_aplan_checks_the_rest(app, tiny_engine, monkeypatch):
    """`plan` runs llguidance's check on the event loop only up to INLINE_CHECK_CHARS; a
    longer schema is checked in a thread by `aplan` (a 400 naming its field), and one that
    only `plan` saw is refused by the engine's compile (a 400 naming `grammar`, not a 500)."""
    props = {f"field_{i}": {"type": "string", "format": "date-time"} for i in range(60)}
    good = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    bad = {**good, "properties": {**props, "tags": {"type": "array", "uniqueItems": True}}}
    assert INLINE_CHECK_CHARS < len(json.dumps(bad)) < MAX_GRAMMAR_CHARS
    checked: list[GrammarSpec] = []
    real = structured.check_spec
    monkeypatch.setattr(structured, "check_spec", lambda spec: checked.append(spec) or real(spec))

    def fields(schema) -> structured.GrammarFields:
        return structured.GrammarFields.model_validate(
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})

    plan = structured.plan(fields(bad))
    assert not plan.checked and plan.param == "response_format" and not checked
    with pytest.raises(OpenAIError) as err:
        await structured.aplan(fields(bad))
    assert err.value.status == 400 and err.value.param == "response_format" and "uniqueItems" in err.value.message
    assert (await structured.aplan(fields(good))).checked
    assert structured.plan(structured.GrammarFields.model_validate({"guided_regex": "[a-z]+"})).checked
    assert [s.value for s in checked] == ["[a-z]+"]   # the short one, on the loop
    async with api(app) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}})
    assert "uniqueItems" in assert_400(r, "response_format")
    tiny_engine.check_idle()


# -- disaggregated -------------------------------------------------------------------------------

LIFE = LifecycleConfig(heartbeat_interval=0.2, heartbeat_misses=8, bootstrap_timeout=5, queue_timeout=5,
                       waiting_timeout=5, transfer_timeout=5, quarantine_grace=0.5)


@pytest.fixture(scope="module")
def workers(tiny_loaded):
    """A prefill and a decode worker core (shm transfer) on the tiny model, each behind its
    AsyncEngine, in this process."""
    from kvrelay.disagg.decode_worker import DecodeCore
    from kvrelay.disagg.prefill_worker import PrefillCore

    tc = TransferConfig(transfer_backend="shm")
    P = AsyncEngine(lambda: PrefillCore(tiny_loaded, KV, SCHED, LIFE, tc))
    D = AsyncEngine(lambda: DecodeCore(tiny_loaded, KV, SCHED, LIFE, tc))
    yield P, D
    for e in (P, D):
        e.shutdown()
        e.core.close()


async def both_legs(P: AsyncEngine, D: AsyncEngine, greq: GenerateRequest, room: int):
    async def leg(engine, **kw):
        return [o async for o in engine.generate(greq, room=room, **kw)]

    return await asyncio.gather(leg(P), leg(D, prefill_address=P.core.manager.address))


@pytest.fixture(scope="module")
def late_legs(workers):
    """The outputs of both legs of a LATE request, as the workers' engines produce them."""
    P, D = workers
    return asyncio.run(both_legs(P, D, greedy("late", 64, GrammarSpec("lark", LATE)), room=7001))


def test_a_decode_worker_ends_a_limit_reached_mid_output_with_invalid_request(workers, late_legs):
    pouts, douts = late_legs
    assert [o.finish_reason for o in pouts] == [FinishReason.LENGTH]   # P's first token was fine
    last = douts[-1]
    assert last.finish_reason is FinishReason.ERROR and last.error.startswith("invalid_request: "), last.error
    assert "structured-output limits" in last.error
    assert "".join(o.text for o in douts).startswith("Here")
    for e in workers:
        e.check_idle(timeout=15)


async def test_a_worker_answers_the_lexer_limit_grammar_with_a_400_before_streaming(workers, recorder):
    from kvrelay.obs.metrics import ServingMetrics
    from kvrelay.server.worker_app import worker_app

    P, D = workers
    app = worker_app(P, ServingMetrics("prefill", ("queued",), lambda: None))
    spec = {"kind": "regex", "value": LEXER_LIMIT + fresh_regex("")}
    leg = {"rid": "lim", "room": 7002, "prompt_ids": list(range(10, 20)),
           "sampling": {"max_tokens": 8, "temperature": 0.0, "grammar": spec}}
    async with api(app) as c:
        r = await c.post("/generate", json=leg)
    assert "structured-output limits" in assert_400(r, "grammar")
    assert [t.name.split("_")[0] for t in recorder.threads] == ["kvrelay-grammar"]   # not this loop's thread
    P.check_idle(timeout=15)


# -- the router: a grammar limit is the request's fault, never retried ----------------------------

def fake_workers(late_legs, calls: list[str]):
    """Two prefill and two decode workers whose every leg replays the real LATE legs."""
    from kvrelay.server.worker_protocol import WorkerHealth

    pouts, douts = late_legs
    lines = {"prefill": "".join(output_to_json(o) for o in pouts), "decode": "".join(output_to_json(o) for o in douts)}

    def handle(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        role = "prefill" if request.url.host.startswith("p") else "decode"
        if request.url.path == "/health":
            return httpx.Response(200, json=WorkerHealth(
                role=role, worker_id=url, incarnation="1", model="m", max_model_len=256, transfer_backend="shm",
                transfer_address=f"tcp://127.0.0.1:{request.url.port}", live_requests=0, queued_requests=0,
                free_pages=64, total_pages=64).model_dump())
        if request.url.path == "/generate":
            calls.append(url)
            return httpx.Response(200, content=lines[role].encode(), headers={"content-type": "application/x-ndjson"})
        return httpx.Response(200, json={"aborted": False})

    return handle


async def test_the_router_never_retries_a_grammar_limit_and_answers_400(late_legs, tiny_loaded):
    from kvrelay.core.clock import MonotonicClock
    from kvrelay.server.openai_api import build_openai_app
    from kvrelay.server.pairing import WorkerTable
    from kvrelay.server.router import RouterClient
    from kvrelay.server.worker_client import WorkerAPI, WorkerMonitor

    calls: list[str] = []
    cfg = RouterConfig(prefill=("http://p1:1", "http://p2:2"), decode=("http://d1:3", "http://d2:4"),
                       health_timeout=2.0)
    wapi = WorkerAPI(cfg, httpx.MockTransport(fake_workers(late_legs, calls)))
    table = WorkerTable(cfg.prefill, cfg.decode, MonotonicClock())
    monitor = WorkerMonitor(table, wapi, cfg)
    await monitor.check_all()
    router = RouterClient(cfg, table, wapi, monitor, tiny_loaded.tokenizer, "m", 256, table.clock)
    body = {"prompt": list(range(10, 26)), "max_tokens": 64, "temperature": 0, "guided_grammar": LATE}
    try:
        async with api(build_openai_app(router)) as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request"
            assert len(calls) == 2 and {u[7] for u in calls} == {"p", "d"}   # one try: one pair, no retry
            r = await c.post("/v1/completions", json={**body, "stream": True})
        evs = events(r.text)
        assert r.status_code == 200 and evs[-2]["error"]["code"] == "invalid_request" and len(calls) == 4
    finally:
        await router.close()
        await wapi.close()
    labels = {"role": "router", "model_name": "m", "outcome": "failed", "reason": "invalid_request"}
    assert router.metrics.registry.get_sample_value("kvrelay_requests_finished_total", labels) == 2
