"""The OpenAI feature matrix (issue #12), walked with the official `openai` SDK against a
colocated server and a disaggregated cluster (router + one prefill + one decode worker,
`kvrelay serve`) on the tiny random model.

Every row is either "works" (`WORKS`: asserted on the output) or "clear 400" (`REFUSED`:
status 400 with the named `param`). There is no third kind: a parameter accepted and
ignored is what this matrix exists to rule out. Each mode ends with a no-leak check.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Literal

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from api_helpers import serving
from kvrelay.server.openai_api import build_openai_app
from serving_helpers import assert_no_leak, running_server

USER = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0}
ORIGIN = "https://app.example"
CLUSTER_ARGS = ("--dtype", "float32", "--max-kv-tokens", "16384", "--allowed-origins", ORIGIN)


@dataclass
class Ctx:
    mode: str
    url: str
    client: OpenAI
    model: str
    http: httpx.Client

    def complete(self, **kw):
        return self.client.completions.create(model=self.model, **{"prompt": "The river", "max_tokens": 4, **kw})

    def chat(self, **kw):
        return self.client.chat.completions.create(model=self.model, **{"messages": USER, "max_tokens": 4, **kw})


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def ctx(request, tiny_engine, tiny_llama_dir):
    if request.param == "colocated":
        server = serving(build_openai_app(tiny_engine, allowed_origins=(ORIGIN,)))
    else:
        server = running_server("--model", f"random:{tiny_llama_dir}", *CLUSTER_ARGS)
    with server as url, httpx.Client(base_url=url, timeout=120) as http:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield Ctx(request.param, url, client, client.models.list().data[0].id, http)
        if request.param == "colocated":
            tiny_engine.check_idle()
        else:
            assert_no_leak(url)


WORKS: dict[str, Callable[[Ctx], None]] = {}


def works(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    WORKS[fn.__name__] = fn
    return fn


# -- models and the utility routes ---------------------------------------------------------

@works
def models_list_and_retrieve(c: Ctx) -> None:
    assert c.client.models.retrieve(c.model).id == c.model
    with pytest.raises(openai.NotFoundError) as e:
        c.client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


@works
def tokenize_detokenize_version(c: Ctx) -> None:
    tok = c.http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert c.http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat = c.http.post("/tokenize", json={"model": c.model, "messages": USER}).json()
    assert chat["count"] == c.chat(max_tokens=1).usage.prompt_tokens
    assert c.http.get("/version").json()["version"]


@works
def cors_for_the_allowed_origin(c: Ctx) -> None:
    pre = c.http.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = c.http.get("/v1/models", headers={"Origin": "https://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


@works
def x_request_id(c: Ctx) -> None:
    raw = c.client.completions.with_raw_response.create(model=c.model, prompt="x", max_tokens=1,
                                                        extra_headers={"X-Request-Id": "conformance-1"})
    assert raw.headers["x-request-id"] == "conformance-1" and "conformance-1" in raw.parse().id


# -- completions ------------------------------------------------------------------------------

@works
def completion_whole_and_stream(c: Ctx) -> None:
    whole = c.complete(**GREEDY, max_tokens=6, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(c.complete(**GREEDY, max_tokens=6, extra_body={"ignore_eos": True}, stream=True,
                             stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


@works
def completion_token_id_prompt(c: Ctx) -> None:
    ids = c.http.post("/tokenize", json={"prompt": "The river"}).json()["tokens"]
    assert c.complete(prompt=ids, **GREEDY).choices[0].text == c.complete(**GREEDY).choices[0].text


@works
def completion_logprobs(c: Ctx) -> None:
    lp = c.complete(logprobs=3, max_tokens=3).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(3 <= len(t) <= 4 for t in lp.top_logprobs)


@works
def completion_echo(c: Ctx) -> None:
    plain = c.complete(**GREEDY).choices[0].text
    assert c.complete(**GREEDY, echo=True).choices[0].text == "The river" + plain


@works
def completion_n_and_prompt_list(c: Ctx) -> None:
    r = c.complete(prompt=["The river", "A mountain"], n=2, max_tokens=3, seed=5, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert all(ch.finish_reason == "length" for ch in r.choices) and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == sum(c.http.post("/tokenize", json={"prompt": p}).json()["count"]
                                        for p in ["The river", "A mountain"])
    first = c.complete(prompt="The river", **GREEDY, max_tokens=3).choices[0].text
    greedy = c.complete(prompt=["The river", "A mountain"], n=2, **GREEDY, max_tokens=3)
    assert greedy.choices[0].text == greedy.choices[1].text == first   # prompt-major


@works
def completion_best_of_equal_to_n(c: Ctx) -> None:
    assert len(c.complete(n=2, best_of=2).choices) == 2


@works
def stop_and_seed(c: Ctx) -> None:
    base = c.complete(**GREEDY, max_tokens=8, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 2]
    if stop.strip():
        cut = c.complete(**GREEDY, max_tokens=8, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
        assert cut.finish_reason == "stop" and stop not in cut.text and base.startswith(cut.text)
    once, again = (c.complete(temperature=1.0, seed=11, max_tokens=8).choices[0].text for _ in range(2))
    assert once == again


# -- chat -------------------------------------------------------------------------------------

@works
def chat_whole_and_stream(c: Ctx) -> None:
    whole = c.chat(**GREEDY, max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 5
    chunks = list(c.chat(**GREEDY, max_completion_tokens=5, extra_body={"ignore_eos": True}, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content


@works
def chat_n(c: Ctx) -> None:
    r = c.chat(n=3, max_tokens=3, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 9
    chunks = list(c.chat(n=2, max_tokens=3, extra_body={"ignore_eos": True}, stream=True))
    assert {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason} == {0, 1}


@works
def chat_logprobs_up_to_20(c: Ctx) -> None:
    lp = c.chat(max_tokens=2, logprobs=True, top_logprobs=20).choices[0].logprobs.content
    assert len(lp) == 2 and all(len(t.top_logprobs) == 20 for t in lp)


@works
def chat_developer_role(c: Ctx) -> None:
    dev = c.http.post("/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."}, *USER]}).json()
    sys = c.http.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}, *USER]}).json()
    assert dev["tokens"] == sys["tokens"]
    assert c.chat(messages=[{"role": "developer", "content": "Be brief."}, *USER]).choices[0].message.content


@works
def chat_template_fields(c: Ctx) -> None:
    convo = [*USER, {"role": "assistant", "content": "Well"}]
    full = c.chat(max_tokens=1).usage.prompt_tokens
    bare = c.chat(max_tokens=1, extra_body={"add_generation_prompt": False}).usage.prompt_tokens
    cont = c.chat(messages=convo, max_tokens=1, extra_body={"continue_final_message": True}).usage.prompt_tokens
    kw = c.chat(max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert bare < full and cont > bare and kw == full


@works
def inert_user_metadata_service_tier(c: Ctx) -> None:
    plain = c.chat(**GREEDY).choices[0].message.content
    assert c.chat(**GREEDY, user="u-1", metadata={"k": "v"}, service_tier="auto").choices[0].message.content == plain
    assert c.complete(**GREEDY, user="u-1").choices[0].text == c.complete(**GREEDY).choices[0].text


# -- sampling knobs ---------------------------------------------------------------------------

def _token_ids(c: Ctx, text: str) -> list[int]:
    return c.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


@works
def logit_bias(c: Ctx) -> None:
    favourite = _token_ids(c, " river")[0]
    r = c.complete(max_tokens=4, temperature=1.0, logit_bias={str(favourite): 100}, logprobs=0,
                   extra_body={"ignore_eos": True})
    piece = c.http.post("/detokenize", json={"tokens": [favourite]}).json()["prompt"]
    assert r.choices[0].logprobs.tokens == [piece] * 4


@works
def min_tokens_and_ignore_eos_and_stop_token_ids(c: Ctx) -> None:
    eos = {str(_eos(c)): 100}
    assert c.complete(max_tokens=8, logit_bias=eos).usage.completion_tokens == 1
    assert c.complete(max_tokens=8, logit_bias=eos, extra_body={"min_tokens": 4}).usage.completion_tokens == 5
    assert c.complete(max_tokens=8, logit_bias=eos, extra_body={"ignore_eos": True}).usage.completion_tokens == 8
    first = c.complete(**GREEDY, max_tokens=1, extra_body={"ignore_eos": True}, logprobs=0)
    tid = _token_ids(c, first.choices[0].logprobs.tokens[0])[0]
    stopped = c.complete(**GREEDY, max_tokens=8, extra_body={"ignore_eos": True, "stop_token_ids": [tid]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


def _eos(c: Ctx) -> int:
    return c.http.post("/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False}).json()["tokens"][0]


@works
def min_p_top_k_top_p(c: Ctx) -> None:
    """Each cut down to the single best token turns a seeded free draw into the greedy answer."""
    def text(**kw) -> str:
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        return c.complete(max_tokens=6, **kw, extra_body=extra).choices[0].text

    greedy, free = text(**GREEDY), text(temperature=1.0, seed=3)
    assert free != greedy
    for cut in ({"extra_body": {"min_p": 1.0}}, {"extra_body": {"top_k": 1}}, {"top_p": 1e-9}):
        assert text(temperature=1.0, seed=3, **cut) == greedy, cut


@works
def penalties_break_repetition(c: Ctx) -> None:
    def tokens(**kw) -> list[str]:
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        r = c.complete(prompt="Hello, my name is", max_tokens=24, logprobs=0, **GREEDY, **kw, extra_body=extra)
        return r.choices[0].logprobs.tokens

    plain = max(Counter(tokens()).values())
    assert plain >= 4   # the greedy loop the penalties must break
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.5}}):
        assert max(Counter(tokens(**kw)).values()) < plain, kw


# -- structured outputs and tools (the grammar engine) ----------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "colour": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["ok", "colour"], "additionalProperties": False}


class Answer(BaseModel):
    ok: bool
    colour: Literal["red", "green", "blue"]


@works
def response_format_json_object(c: Ctx) -> None:
    # The random model would write one endless key; a bias toward "{}" (which alone would
    # give "{}{}{}") lets the grammar end the object at once.
    r = c.chat(max_tokens=60, response_format={"type": "json_object"},
               logit_bias={str(t): 30 for t in _token_ids(c, "{}")})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@works
def response_format_json_schema(c: Ctx) -> None:
    r = c.chat(max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}})
    got = json.loads(r.choices[0].message.content)
    assert set(got) == {"ok", "colour"} and isinstance(got["ok"], bool) and got["colour"] in ("red", "green", "blue")
    parsed = c.client.chat.completions.parse(model=c.model, messages=USER, max_tokens=40, response_format=Answer)
    assert isinstance(parsed.choices[0].message.parsed, Answer)


@works
def guided_json_choice_and_regex(c: Ctx) -> None:
    got = json.loads(c.chat(max_tokens=40, extra_body={"guided_json": SCHEMA}).choices[0].message.content)
    assert set(got) == {"ok", "colour"} and isinstance(got["ok"], bool) and got["colour"] in ("red", "green", "blue")
    r = c.chat(max_tokens=5, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = c.complete(max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)


@works
def tools_required_named_none_and_stream(c: Ctx) -> None:
    # One call each (parallel_tool_calls=false): with parallel calls allowed, the random
    # model decides between "," and "]" by chance and may run out of max_tokens mid-array.
    # Parallel arrays are covered on a seeded engine in test_structured.py.
    r = c.chat(max_tokens=60, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"utc"}))
    named = c.chat(max_tokens=60, tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["utc"], bool)
    assert c.chat(max_tokens=4, tools=[WEATHER], tool_choice="none").choices[0].message.tool_calls in (None, [])
    chunks = list(c.chat(max_tokens=60, tools=[WEATHER], tool_choice="required", stream=True,
                         parallel_tool_calls=False))
    calls: dict[int, list] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            calls.setdefault(tc.index, []).append(tc)
    (deltas,) = calls.values()   # one call, streamed as its name then its arguments
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas))["city"] in ("Paris", "Rome")
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


# -- clear 400s -------------------------------------------------------------------------------

REFUSED: dict[str, tuple[Callable[[Ctx], Any], str]] = {
    "suffix": (lambda c: c.complete(suffix="    return x"), "suffix"),
    "best_of_above_n": (lambda c: c.complete(best_of=2), "best_of"),
    "echo_with_logprobs": (lambda c: c.complete(echo=True, logprobs=1), "echo"),
    "unknown_field": (lambda c: c.chat(extra_body={"frobnicate": 1}), "frobnicate"),
    "store": (lambda c: c.chat(store=True), "store"),
    "image_url": (lambda c: c.chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), "messages[0].content"),
    "input_audio": (lambda c: c.chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), "messages[0].content"),
    "continue_and_generation_prompt": (lambda c: c.chat(extra_body={"continue_final_message": True,
                                                                    "add_generation_prompt": True}),
                                       "continue_final_message"),
    "chat_template_kwargs_reserved": (lambda c: c.chat(extra_body={"chat_template_kwargs": {"tokenize": True}}),
                                      "chat_template_kwargs"),
    "min_p_out_of_range": (lambda c: c.complete(extra_body={"min_p": 5.0}), "min_p"),
    "top_logprobs_above_20": (lambda c: c.chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "logit_bias_out_of_range": (lambda c: c.complete(logit_bias={"5": 101}), "logit_bias"),
    "n_too_large": (lambda c: c.complete(n=1000), "n"),
}


@pytest.mark.parametrize("row", sorted(WORKS))
def test_works(ctx, row):
    WORKS[row](ctx)


@pytest.mark.parametrize("row", sorted(REFUSED))
def test_clear_400(ctx, row):
    call, param = REFUSED[row]
    with pytest.raises(openai.BadRequestError) as e:
        call(ctx)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
