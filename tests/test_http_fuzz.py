"""Fuzz of the OpenAI endpoints (issue #10, item 7): hypothesis builds request bodies from
the API's fields with mutated types and values, odd strings (lone surrogates, NULs, very
long), broken JSON and wrong content types, and sends them in-process to the app over a
real tiny engine. Every answer is a 200 with a valid body or an OpenAI-style 4xx, never a
5xx and never a hang, and the engine is idle afterwards. Derandomized and bounded: a few
seconds in `make test`. `tests/fuzz_http.py` runs the same bodies against a live server.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.server.openai_api import build_openai_app

ERROR_KEYS = {"message", "type", "param", "code"}
C, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
REQUEST_TIMEOUT = 30.0

# -- the strategies (shared with tests/fuzz_http.py) -----------------------------------------

odd_text = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=20),   # surrogates included
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "nul\x00in", "\ufffe", "\U0010ffff", "", " ", "<|endoftext|>",
                     "{{ raise }}", "{% for %}", "\\u0000"]),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "\x00", "\ud800", "é", " "]),
              st.sampled_from([1_000, 100_000])),
)
odd_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([0.5, -0.0, 1e308, 5e-324]),
)
odd_value = st.recursive(
    st.one_of(st.none(), st.booleans(), odd_number, odd_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(odd_text, inner, max_size=3)),
    max_leaves=8,
)
small_tokens = st.integers(min_value=1, max_value=4)
valid_ids = st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=12)
plain_text = st.text(st.characters(codec="utf-8"), max_size=30)

# Valid values of each field; a fuzzed body starts valid and then has a few fields replaced
# by odd values (or removed), so that both the 200 path and every 400 path are covered.
SAMPLING = {
    "model": st.just("tiny-llama"),
    "temperature": st.sampled_from([0, 0.0, 0.7, 2.0]),
    "top_p": st.sampled_from([1.0, 0.5]),
    "top_k": st.sampled_from([0, -1, 5]),
    "seed": st.integers(0, 2**63),
    "stop": st.one_of(plain_text, st.lists(plain_text, max_size=4), odd_text),
    "stop_token_ids": valid_ids,
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "n": st.just(1),
    "stream": st.booleans(),
}
message = st.fixed_dictionaries(
    {"role": st.just("user"),
     "content": st.one_of(plain_text, odd_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}),
                                               min_size=1, max_size=3))},
    optional={"name": st.text(st.characters(codec="utf-8", categories=["L"]), min_size=1, max_size=8)})
COMPLETION = {**SAMPLING,
              "prompt": st.one_of(plain_text.filter(str.strip), odd_text, valid_ids, st.lists(valid_ids, min_size=1, max_size=1)),
              "max_tokens": small_tokens, "logprobs": st.integers(0, 5), "echo": st.just(False),
              "best_of": st.just(1)}
CHATS = {**SAMPLING,
         "messages": st.lists(message, min_size=1, max_size=3),
         "max_tokens": small_tokens, "max_completion_tokens": small_tokens,
         "logprobs": st.booleans()}
EXTRA_KEYS = ["suffix", "user", "tools", "response_format", "stream_options", "top_logprobs", "messages", "prompt",
              "max_tokens", "\ud800", "\x00", ""]


@st.composite
def body_of(draw, fields: dict, required: tuple[str, ...]) -> dict:
    """A valid body (the required fields and max_tokens, any others), then 0-3 fields
    replaced by odd values, added, or removed."""
    keep = ("max_tokens",) + required
    optional = {k: v for k, v in fields.items() if k not in keep}
    body = draw(st.fixed_dictionaries({k: fields[k] for k in keep}, optional=optional))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if body.get("logprobs") is True and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(0, 5))
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3]))):
        key = draw(st.sampled_from(sorted(fields) + EXTRA_KEYS))
        if draw(st.integers(0, 4)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(odd_value)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4   # a chat request without it may decode to the end of the context
    return body


def encode(obj) -> bytes:
    # ensure_ascii: lone surrogates travel as valid JSON escapes ("\ud800")
    return json.dumps(obj, ensure_ascii=True).encode()


raw_body = st.one_of(
    st.binary(max_size=64), st.sampled_from([b"", b"{", b"[]", b"null", b"1e999", b'{"prompt": NaN}',
                                            b'{"prompt": "x", "max_tokens": Infinity}', b"\xff\xfe{}",
                                            b'{"messages": [' * 50, b"[" * 5000 + b"]" * 5000]),
)
content_type = st.sampled_from(["application/json", "application/json", "application/json", "text/plain",
                                "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                                "application/json; charset=latin-1"])


@st.composite
def fuzzed_request(draw) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers)."""
    kind = draw(st.sampled_from(["completion", "completion", "chat", "chat", "raw", "models", "method"]))
    if kind == "models":
        return "GET", MODELS + draw(st.sampled_from(["", "?x=1", "/tiny-llama", "?" + "a" * 3000])), b"", {}
    if kind == "method":
        return draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])), draw(st.sampled_from([C, CHAT, MODELS])), b"", {}
    path = draw(st.sampled_from([C, CHAT]))
    if kind == "raw":
        body = draw(raw_body)
    else:
        path = C if kind == "completion" else CHAT
        obj = draw(body_of(COMPLETION, ("prompt",)) if path == C else body_of(CHATS, ("messages",)))
        body = encode(draw(st.one_of(st.just(obj), st.just(obj), st.just(obj), odd_value)))
        if draw(st.integers(0, 9)) == 0:
            body = body[:draw(st.integers(0, max(0, len(body) - 1)))]       # truncated JSON
    ctype = draw(content_type)
    return "POST", path, body, ({"content-type": ctype} if ctype else {})


def check_answer(r: httpx.Response) -> str:
    """Raise AssertionError unless `r` is a valid 200 or an OpenAI-style 4xx; returns a short
    label of the answer for statistics."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, r.status_code
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
        return str(r.status_code)
    if r.headers["content-type"].startswith("text/event-stream"):
        blocks = [b for b in r.text.split("\n\n") if b.strip()]
        assert blocks and blocks[-1] == "data: [DONE]", r.text[-300:]
        for b in blocks[:-1]:
            payload = json.loads(b[len("data: "):])
            assert "error" not in payload or payload["error"]["code"] not in (None, "internal_error"), payload
        return "200-stream"
    body = r.json()
    assert body.get("object") in ("text_completion", "chat.completion", "list", "model"), body
    return "200"


# -- the in-process test -------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tiny_engine):
    return build_openai_app(tiny_engine)


async def send(app, method: str, path: str, body: bytes, headers: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay") as c:
        return await asyncio.wait_for(c.request(method, path, content=body or None, headers=headers),
                                      REQUEST_TIMEOUT)


def test_fuzzed_openai_requests_get_a_200_or_an_openai_4xx_and_leave_nothing_behind(app, tiny_engine):
    seen: dict[str, int] = {}

    @settings(max_examples=400, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzzed_request())
    def one(req):
        label = check_answer(asyncio.run(send(app, *req)))
        seen[label] = seen.get(label, 0) + 1

    one()
    print("fuzzed answers:", seen)
    tiny_engine.check_idle()
    assert sum(seen.values()) >= 400 and seen.get("200", 0) + seen.get("200-stream", 0) > 10, seen
    assert seen.get("400", 0) > 50, seen
