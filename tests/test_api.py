"""The OpenAI-compatible HTTP layer, end to end on the real AsyncEngine (tiny random Llama).

Every test ends with `tiny_engine.check_idle()`: no request, no page left behind.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvrelay.engine.types import FinishReason, StepOutput
from kvrelay.server.openai_api import build_openai_app
from api_helpers import api, events
from serving_helpers import call_asgi

pytestmark = pytest.mark.anyio
ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(r: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    if param != "unset":
        assert err["param"] == param, err
    return err


GREEDY = {"temperature": 0}


# -- basic endpoints ----------------------------------------------------------------------

async def test_health_and_models(app, tiny_engine):
    async with api(app) as c:
        assert (await c.get("/health")).json() == {"status": "ok"}
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [tiny_engine.model_name]
        assert_error(await c.get("/v1/nothing"), 404)
    tiny_engine.check_idle()


# -- completions --------------------------------------------------------------------------

async def test_completion_forms_of_prompt_agree(app, tiny_engine):
    ids = tiny_engine.tokenizer().encode("The quick brown fox")
    async with api(app) as c:
        texts = []
        for prompt in ("The quick brown fox", ["The quick brown fox"], ids, [ids]):
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, **GREEDY})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
            assert body["model"] == tiny_engine.model_name
            (choice,) = body["choices"]
            assert choice["finish_reason"] == "length" and choice["logprobs"] is None
            assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
            texts.append(choice["text"])
        assert len(set(texts)) == 1
    tiny_engine.check_idle()


async def test_completion_default_max_tokens_is_16(app, tiny_engine):
    async with api(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "Once upon", "ignore_eos": True, **GREEDY})
        assert r.json()["usage"]["completion_tokens"] == 16
    tiny_engine.check_idle()


async def test_completion_logprobs_shape(app, tiny_engine):
    async with api(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "logprobs": 3,
                                                   "ignore_eos": True, **GREEDY})
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        for tok, tok_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert tok_lp <= 0 and 3 <= len(top) <= 4 and tok in top
            assert top[tok] == pytest.approx(tok_lp) and max(top.values()) == pytest.approx(tok_lp)  # greedy
    tiny_engine.check_idle()


async def test_completion_stream_matches_whole(app, tiny_engine):
    req = {"prompt": "A long time ago", "max_tokens": 8, "ignore_eos": True, **GREEDY}
    async with api(app) as c:
        whole = (await c.post("/v1/completions", json=req)).json()
        r = await c.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        evs = events(r.text)
    assert evs[-1] == "[DONE]"
    usage_chunk, chunks = evs[-2], evs[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["choices"][0]["text"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    assert {ch["id"] for ch in chunks} == {usage_chunk["id"]} and usage_chunk["id"].startswith("cmpl-")
    tiny_engine.check_idle()


async def test_stream_without_include_usage_has_no_usage_chunk(app, tiny_engine):
    async with api(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True, **GREEDY})
        evs = events(r.text)
    assert evs[-1] == "[DONE]"
    assert all(ev["choices"] and ev["usage"] is None for ev in evs[:-1])
    tiny_engine.check_idle()


async def test_stop_string_is_cut_from_text(app, tiny_engine):
    req = {"prompt": "The weather today", "max_tokens": 12, "ignore_eos": True, **GREEDY}
    async with api(app) as c:
        full = (await c.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        stop = full[len(full) // 2: len(full) // 2 + 3]
        assert len(stop) == 3
        expected = full[:full.index(stop)]
        whole = (await c.post("/v1/completions", json={**req, "stop": [stop, "\x00never"]})).json()
        streamed = events((await c.post("/v1/completions", json={**req, "stop": stop, "stream": True})).text)
    choice = whole["choices"][0]
    assert choice["text"] == expected and stop not in choice["text"] and choice["finish_reason"] == "stop"
    chunks = streamed[:-1]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    tiny_engine.check_idle()


# -- chat ---------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


async def test_chat_whole(app, tiny_engine):
    tok = tiny_engine.tokenizer()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_len = len(tok.encode(text, add_special_tokens=False))
    async with api(app) as c:
        r = await c.post("/v1/chat/completions", json={"model": tiny_engine.model_name, "messages": MESSAGES,
                                                        "max_completion_tokens": 4, "ignore_eos": True, **GREEDY})
        body = r.json()
        assert r.status_code == 200, r.text
        parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                 MESSAGES[1]]
        same = (await c.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 4,
                                                           "ignore_eos": True, **GREEDY})).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4}
    assert same["choices"][0]["message"]["content"] == choice["message"]["content"]
    tiny_engine.check_idle()


async def test_chat_default_max_tokens_is_remaining_context(app, tiny_engine):
    async with api(app) as c:
        r = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True, **GREEDY})
        usage = r.json()["usage"]
    assert usage["total_tokens"] == tiny_engine.max_model_len
    assert r.json()["choices"][0]["finish_reason"] == "length"
    tiny_engine.check_idle()


async def test_chat_stream(app, tiny_engine):
    req = {"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, **GREEDY}
    async with api(app) as c:
        whole = (await c.post("/v1/chat/completions", json=req)).json()
        r = await c.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
        evs = events(r.text)
    assert evs[-1] == "[DONE]" and evs[-2]["choices"] == [] and evs[-2]["usage"] == whole["usage"]
    chunks = evs[:-2]
    assert all(ch["object"] == "chat.completion.chunk" and ch["id"].startswith("chatcmpl-") for ch in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "length"
    tiny_engine.check_idle()


async def test_chat_logprobs_shape(app, tiny_engine):
    req = {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 2, **GREEDY}
    async with api(app) as c:
        whole = (await c.post("/v1/chat/completions", json=req)).json()
        streamed = events((await c.post("/v1/chat/completions", json={**req, "stream": True})).text)
        plain = (await c.post("/v1/chat/completions", json={**req, "top_logprobs": None})).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])   # greedy: the best one
        assert e["bytes"] == list(e["token"].encode())
    streamed_lp = [e for ch in streamed[:-1] if ch["choices"][0]["logprobs"]
                   for e in ch["choices"][0]["logprobs"]["content"]]
    assert streamed_lp == content
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    tiny_engine.check_idle()


# -- bad input ----------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"prompt": "hi", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD = [  # (path, body, status, param)
    (C, {**OK_C, "temperature": 2.5}, 400, "temperature"),
    (C, {**OK_C, "temperature": -0.1}, 400, "temperature"),
    (C, {**OK_C, "top_p": 0}, 400, "top_p"),
    (C, {**OK_C, "top_p": 1.5}, 400, "top_p"),
    (C, {**OK_C, "top_k": -2}, 400, "top_k"),
    (C, {**OK_C, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**OK_C, "max_tokens": "many"}, 400, "max_tokens"),
    (C, {**OK_C, "logprobs": 21}, 400, "logprobs"),
    (C, {**OK_C, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {**OK_C, "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {**OK_C, "n": 65}, 400, "n"),
    (C, {**OK_C, "echo": True, "logprobs": 1}, 400, "echo"),
    (C, {**OK_C, "best_of": 2}, 400, "best_of"),
    (C, {**OK_C, "suffix": "x"}, 400, "suffix"),
    (C, {**OK_C, "frobnicate": 1}, 400, "frobnicate"),
    (C, {**OK_C, "stream": "yes please"}, 400, "stream"),
    (C, {**OK_C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"max_tokens": 2}, 400, "prompt"),
    (C, {**OK_C, "prompt": 42}, 400, "prompt"),
    (C, {**OK_C, "prompt": ["one", [1]]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [[1, 2], []]}, 400, "prompt"),
    (C, {**OK_C, "prompt": []}, 400, "prompt"),
    (C, {**OK_C, "prompt": [1, -5]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [1, 2.5]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [True]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [10**9]}, 400, "prompt"),            # outside the vocabulary: RequestRejected
    (C, {**OK_C, "max_tokens": 5000}, 400, "max_tokens"),       # longer than max_model_len
    (C, {**OK_C, "prompt": [1] * 1024}, 400, "prompt"),         # no room left for a completion
    (C, {**OK_C, "stop_token_ids": ["x"]}, 400, "stop_token_ids[0]"),
    (CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    (CHAT, {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    (CHAT, {**OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {**OK_CHAT, "n": 0}, 400, "n"),
    (CHAT, {**OK_CHAT, "functions": []}, 400, "functions"),
    (CHAT, {**OK_CHAT, "store": True}, 400, "store"),
    (CHAT, {**OK_CHAT, "add_generation_prompt": True, "continue_final_message": True}, 400, "continue_final_message"),
    (CHAT, {**OK_CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    (CHAT, {**OK_CHAT, "max_tokens": 4000}, 400, "max_tokens"),
    (CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
async def test_bad_request_is_openai_400_and_server_serves_on(app, tiny_engine, path, body, status, param):
    async with api(app) as c:
        err = assert_error(await c.post(path, json=body), status)
        if param is not None:
            assert err["param"] == param, err
        assert err["type"] == "invalid_request_error"
        streamed = await c.post(path, json={**body, "stream": True})
        if body.get("stream") is None and "stream_options" not in body:
            assert_error(streamed, status)      # a streaming request fails before its 200, too
        ok = await c.post(path, json=OK_C if path == C else OK_CHAT)
        assert ok.status_code == 200, ok.text
    tiny_engine.check_idle()


async def test_specific_messages(app, tiny_engine):
    async with api(app) as c:
        fim = assert_error(await c.post(C, json={**OK_C, "suffix": "x"}), 400, "suffix")
        extra = assert_error(await c.post(C, json={**OK_C, "frobnicate": 1}), 400, "frobnicate")
        image = assert_error(await c.post(CHAT, json={**OK_CHAT, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]}), 400)
        long = assert_error(await c.post(C, json={**OK_C, "max_tokens": 5000}), 400, "max_tokens")
        vocab = assert_error(await c.post(C, json={**OK_C, "prompt": [10**9]}), 400, "prompt")
    assert "fill-in-the-middle" in fim["message"]
    assert extra["message"] == "Unrecognized request argument supplied: frobnicate"
    assert "text-only" in image["message"] and "image_url" in image["message"], image
    assert long["code"] == "context_length_exceeded" and str(tiny_engine.max_model_len) in long["message"]
    assert "vocabulary" in vocab["message"]
    tiny_engine.check_idle()


async def test_malformed_json_and_non_object_body(app, tiny_engine):
    async with api(app) as c:
        for content in (b"{not json", b'"a string"', b"[1, 2]", b""):
            r = await c.post(C, content=content, headers={"content-type": "application/json"})
            assert_error(r, 400, None)
        assert (await c.post(C, json=OK_C)).status_code == 200
    tiny_engine.check_idle()


async def test_unknown_model_is_404(app, tiny_engine):
    async with api(app) as c:
        for path, ok in ((C, OK_C), (CHAT, OK_CHAT)):
            err = assert_error(await c.post(path, json={**ok, "model": "gpt-17"}), 404, "model")
            assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
            assert (await c.post(path, json={**ok, "model": tiny_engine.model_name})).status_code == 200
    tiny_engine.check_idle()


# -- failures inside the engine or the server ---------------------------------------------

async def test_internal_error_is_500_and_server_serves_on(app, tiny_engine, monkeypatch):
    def broken(request):
        raise RuntimeError("boom")

    async with api(app) as c:
        monkeypatch.setattr(tiny_engine, "generate", broken)
        for stream in (False, True):
            err = assert_error(await c.post(C, json={**OK_C, "stream": stream}), 500, None)
            assert err["type"] == "server_error" and "boom" in err["message"]
        monkeypatch.undo()
        assert (await c.post(C, json=OK_C)).status_code == 200
    tiny_engine.check_idle()


def fail_after(engine, n_outputs: int, error: str):
    """A `generate` that passes on the real engine's first outputs, then ends the request
    with FinishReason.ERROR (as a transfer timeout would). The real request is aborted."""
    real = engine.generate

    async def generate(request):
        it = real(request)
        try:
            for _ in range(n_outputs):
                yield await it.__anext__()
        finally:
            await it.aclose()
        yield StepOutput(request.rid, finish_reason=FinishReason.ERROR, error=error)

    return generate


async def test_failure_mid_stream_sends_error_event_then_done(app, tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "generate", fail_after(tiny_engine, 2, "timeout:transfer: no ack in 60 s"))
    async with api(app) as c:
        for path, ok in ((C, OK_C), (CHAT, OK_CHAT)):
            # greedy: a sampled token that decodes to no text yet sends no chunk (flaky count)
            r = await c.post(path, json={**ok, "max_tokens": 10, "ignore_eos": True, "stream": True,
                                          "temperature": 0, "stream_options": {"include_usage": True}})
            assert r.status_code == 200
            evs = events(r.text)
            assert evs[-1] == "[DONE]"
            err = evs[-2]["error"]
            assert set(err) == ERROR_KEYS and err["code"] == "timeout:transfer" and "no ack" in err["message"]
            assert all("choices" in ev for ev in evs[:-2]) and len(evs) >= 4
            whole = await c.post(path, json={**ok, "max_tokens": 10, "ignore_eos": True})
            # A worker phase's deadline is no bug: retryable, and the client is told when.
            assert assert_error(whole, 503, None)["code"] == "timeout:transfer"
            assert whole.headers["retry-after"] == "1"
    tiny_engine.check_idle()


async def test_failure_before_first_token_keeps_its_status(app, tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "generate", fail_after(tiny_engine, 0, "overloaded: queue is full"))
    async with api(app) as c:
        for stream in (False, True):
            err = assert_error(await c.post(C, json={**OK_C, "stream": stream}), 503, None)
            assert err["code"] == "overloaded"
    tiny_engine.check_idle()


# -- client disconnect --------------------------------------------------------------------



@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_disconnect_mid_stream_aborts_request(app, tiny_engine, spec):
    body = {"prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True, "stream": True}
    sent = await call_asgi(app, C, body, disconnect_after_chunks=2, spec=spec)
    assert sent[0]["status"] == 200
    chunks = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    if spec == "2.4":   # nothing cancels the stream: it ends on its own, as aborted
        assert '"finish_reason":"abort"' in chunks and chunks.endswith("data: [DONE]\n\n")
    else:
        assert "[DONE]" not in chunks or '"finish_reason":"abort"' in chunks
    assert chunks.count("data: ") < 900
    tiny_engine.check_idle()


async def test_disconnect_while_waiting_aborts_request(app, tiny_engine):
    for path, ok in ((C, OK_C), (CHAT, OK_CHAT)):
        body = {**ok, "max_tokens": 900, "ignore_eos": True}
        sent = await call_asgi(app, path, body, disconnect_after_chunks=0)
        answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
        assert answer["choices"][0]["finish_reason"] == "abort"
        assert answer["usage"]["completion_tokens"] < 900
    tiny_engine.check_idle()


# -- concurrency and composition ----------------------------------------------------------

async def test_concurrent_requests_all_answered(app, tiny_engine):
    async def one(c, i):
        path, ok = (C, OK_C) if i % 2 else (CHAT, OK_CHAT)
        r = await c.post(path, json={**ok, "max_tokens": 3 + i, "ignore_eos": True, "stream": i % 3 == 0})
        assert r.status_code == 200, r.text
        return r

    async with api(app) as c:
        rs = await asyncio.gather(*(one(c, i) for i in range(12)))
    assert len({r.text for r in rs}) == 12
    tiny_engine.check_idle()


async def test_extra_routes_are_mounted(tiny_engine):
    from fastapi import APIRouter
    from starlette.routing import Route
    from starlette.responses import PlainTextResponse

    router = APIRouter()
    router.add_api_route("/debug/requests", lambda: {"requests": []}, methods=["GET"])
    route = Route("/metrics", lambda request: PlainTextResponse("kvrelay_up 1\n"))
    app = build_openai_app(tiny_engine, extra_routes=[router, route])
    async with api(app) as c:
        assert (await c.get("/debug/requests")).json() == {"requests": []}
        assert (await c.get("/metrics")).text == "kvrelay_up 1\n"
        assert (await c.post(C, json=OK_C)).status_code == 200
    tiny_engine.check_idle()


@pytest.mark.parametrize("code,status", [
    ("invalid_request", 400), ("peer_failed", 503), ("transfer_error", 503), ("overloaded", 503),
    ("no_healthy_worker", 503), ("aborted", 503), ("timeout:bootstrap", 503), ("timeout:queued", 503),
    ("timeout:waiting", 503), ("timeout:transfer", 503), ("timeout:request", 504), ("timeout:decode", 504),
    ("internal_error", 500), ("something_unknown", 500)])
async def test_a_failed_request_gets_the_status_of_its_reason(app, tiny_engine, monkeypatch, code, status):
    """Retryable failures (a worker died, a transfer failed, a phase deadline before any
    token) are 503 with Retry-After; an invalid request is a 400; a deadline over the
    whole request is a 504; only a bug is a 500. The code is in the error body, one of
    ErrorCode's: a code kvrelay does not know is an internal error (its text stays in the message)."""
    monkeypatch.setattr(tiny_engine, "generate", fail_after(tiny_engine, 0, f"{code}: what happened"))
    async with api(app) as c:
        for stream in (False, True):
            r = await c.post(C, json={**OK_C, "stream": stream})
            err = assert_error(r, status, None)
            known = code != "something_unknown"
            assert err["code"] == (code if known else "internal_error") and err["message"] == f"{code}: what happened"
            assert r.headers.get("retry-after") == ("1" if status == 503 else None)
    tiny_engine.check_idle()
