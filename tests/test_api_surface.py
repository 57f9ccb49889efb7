"""The OpenAI surface beyond one prompt and one choice (issue #12): n choices and lists of
prompts rendered whole and streamed, echo, the chat-template fields, the developer role,
text-only content, the utility routes (/tokenize, /detokenize, /version,
/v1/models/{id}), X-Request-Id and CORS.

n > 1 is rendered from outputs tagged with their choice `index`; `api_helpers.Scripted`
is an EngineClient that answers with such outputs, so the rendering is tested on its own. The
rest runs on the real tiny engine, which is idle at the end of every test.
"""
from __future__ import annotations

import copy

import pytest

from api_helpers import Scripted, api, assert_400, events
from kvrelay.engine.types import FinishReason, StepOutput
from kvrelay.server.openai_api import build_openai_app

pytestmark = pytest.mark.anyio
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


# -- n choices, rendered from index-tagged outputs ------------------------------------------

@pytest.fixture(scope="module")
def scripted(tiny_engine):
    return Scripted(tiny_engine.tokenizer())


@pytest.fixture(scope="module")
def scripted_app(scripted):
    return build_openai_app(scripted)


def prompt_len(tok, prompt: str) -> int:
    return len(tok.encode(prompt))


async def test_n_choices_whole_and_streamed_completions(scripted_app, scripted):
    plen = prompt_len(scripted.tok, "Once upon")
    async with api(scripted_app) as c:
        whole = (await c.post(C, json={"prompt": "Once upon", "n": 3, "max_tokens": 5})).json()
        streamed = events((await c.post(C, json={"prompt": "Once upon", "n": 3, "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True}})).text)
    assert scripted.requests[-1].params.n == 3
    assert [ch["index"] for ch in whole["choices"]] == [0, 1, 2]
    for j, ch in enumerate(whole["choices"]):
        assert ch["text"] == Scripted.text(plen, j) and ch["finish_reason"] == Scripted.finish(j)
    assert whole["usage"] == {"prompt_tokens": plen, "completion_tokens": 1 + 2 + 3, "total_tokens": plen + 6}
    assert streamed[-1] == "[DONE]" and streamed[-2]["usage"] == whole["usage"]
    for j in range(3):
        mine = [ch for e in streamed[:-2] for ch in e["choices"] if ch["index"] == j]
        assert "".join(ch["text"] for ch in mine) == Scripted.text(plen, j)
        assert [ch["finish_reason"] for ch in mine][-1] == Scripted.finish(j)
        assert all(ch["finish_reason"] is None for ch in mine[:-1])


async def test_n_choices_whole_and_streamed_chat(scripted_app, scripted):
    async with api(scripted_app) as c:
        whole = (await c.post(CHAT, json={"messages": USER, "n": 2})).json()
        plen = scripted.requests[-1].prompt_ids.__len__()
        streamed = events((await c.post(CHAT, json={"messages": USER, "n": 2, "stream": True})).text)
    assert [(ch["index"], ch["message"]["content"], ch["finish_reason"]) for ch in whole["choices"]] == [
        (j, Scripted.text(plen, j), Scripted.finish(j)) for j in range(2)]
    assert whole["usage"]["prompt_tokens"] == plen and whole["usage"]["completion_tokens"] == 3
    heads = [e["choices"][0] for e in streamed[:2]]
    assert heads == [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in range(2)]
    for j in range(2):
        mine = [ch for e in streamed[2:-1] for ch in e["choices"] if ch["index"] == j]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == Scripted.text(plen, j)
        assert mine[-1]["finish_reason"] == Scripted.finish(j)


async def test_a_list_of_prompts_with_n_is_prompt_major(scripted_app, scripted):
    tok = scripted.tok
    ids = tok.encode("a much longer second prompt here")
    prompts = ["short", tok.decode(ids)]
    lens = [prompt_len(tok, p) for p in prompts]
    async with api(scripted_app) as c:
        before = len(scripted.requests)
        whole = (await c.post(C, json={"prompt": prompts, "n": 2, "max_tokens": 3})).json()
        streamed = events((await c.post(C, json={"prompt": [tok.encode("short"), ids], "n": 2, "max_tokens": 3,
                                                  "stream": True, "stream_options": {"include_usage": True}})).text)
    sent = scripted.requests[before:before + 2]
    assert [len(r.prompt_ids) for r in sent] == lens and all(r.params.n == 2 for r in sent)
    assert sent[0].rid != sent[1].rid and whole["id"] in sent[0].rid
    want = [(i * 2 + j, Scripted.text(lens[i], j), Scripted.finish(j)) for i in range(2) for j in range(2)]
    assert [(ch["index"], ch["text"], ch["finish_reason"]) for ch in whole["choices"]] == want
    assert whole["usage"]["prompt_tokens"] == sum(lens) and whole["usage"]["completion_tokens"] == 2 * 3
    got = {}
    for e in streamed[:-2]:
        for ch in e["choices"]:
            got[ch["index"]] = got.get(ch["index"], "") + ch["text"]
    assert got == {index: text for index, text, _ in want}
    assert streamed[-2]["usage"] == whole["usage"]


async def test_best_of_equal_to_n_is_served(scripted_app, scripted):
    async with api(scripted_app) as c:
        r = await c.post(C, json={"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert "best_of must equal n" in assert_400(await c.post(C, json={"prompt": "x", "n": 2, "best_of": 3}),
                                                    "best_of")


async def test_fewer_choices_than_n_is_an_error_not_a_short_answer(tiny_engine):
    """An engine that drops choices is a 500, never a 200 with fewer choices."""
    class OneChoice(Scripted):
        async def generate(self, request):
            yield StepOutput(request.rid, token_ids=[5], index=0, text="x", prompt_tokens=1, completion_tokens=1,
                             finish_reason=FinishReason.LENGTH)

    async with api(build_openai_app(OneChoice(tiny_engine.tokenizer()))) as c:
        r = await c.post(C, json={"prompt": "x", "n": 2, "max_tokens": 1})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


# -- X-Request-Id and CORS --------------------------------------------------------------------

async def test_x_request_id_is_taken_echoed_and_made_into_the_rid(scripted_app, scripted):
    async with api(scripted_app) as c:
        r = await c.post(C, json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "trace-42.a"})
        assert r.headers["x-request-id"] == "trace-42.a"
        assert scripted.requests[-1].rid.startswith("cmpl-trace-42.a-") and r.json()["id"] == scripted.requests[-1].rid
        again = await c.post(C, json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "trace-42.a"})
        assert again.json()["id"] != r.json()["id"]          # two requests, one client id: two rids
        made = await c.post(CHAT, json={"messages": USER})
        assert len(made.headers["x-request-id"]) == 32
        assert made.json()["id"] == f"chatcmpl-{made.headers['x-request-id']}"
        for bad in ["has space", "x" * 129, "semi;colon", "é"]:
            r = await c.post(C, json={"prompt": "x"}, headers={"X-Request-Id": bad.encode()})
            assert "X-Request-Id must be" in assert_400(r, "X-Request-Id")
            assert len(r.headers["x-request-id"]) == 32
        for r in [await c.get("/v1/nothing", headers={"X-Request-Id": "e1"}),
                  await c.post(C, json={"prompt": 5}, headers={"X-Request-Id": "e2"}),
                  await c.get("/health", headers={"X-Request-Id": "e3"})]:
            assert r.headers["x-request-id"] in ("e1", "e2", "e3")


async def test_cors_only_with_allowed_origins(scripted):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-request-id"}
    async with api(build_openai_app(scripted)) as c:
        r = await c.options(C, headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = await c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers
    async with api(build_openai_app(scripted, allowed_origins=("https://app.example",))) as c:
        r = await c.options(C, headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST", "OPTIONS"}
        assert "x-request-id" in r.headers["access-control-allow-headers"].lower()
        r = await c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-expose-headers"].lower() == "x-request-id"
        r = await c.options(C, headers={**preflight, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


# -- the real engine: echo, chat-template fields, utility routes -------------------------------

@pytest.fixture(scope="module")
def app(tiny_engine):
    return build_openai_app(tiny_engine)


async def test_echo_prepends_the_prompt(app, tiny_engine):
    tok = tiny_engine.tokenizer()
    req = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with api(app) as c:
        plain = (await c.post(C, json={**req, "prompt": "The sea"})).json()["choices"][0]["text"]
        echoed = (await c.post(C, json={**req, "prompt": "The sea", "echo": True})).json()
        by_ids = (await c.post(C, json={**req, "prompt": tok.encode("The sea"), "echo": True})).json()
        streamed = events((await c.post(C, json={**req, "prompt": "The sea", "echo": True, "stream": True})).text)
    assert echoed["choices"][0]["text"] == "The sea" + plain
    assert by_ids["choices"][0]["text"] == tok.decode(tok.encode("The sea")) + plain
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == "The sea" + plain
    assert echoed["usage"]["completion_tokens"] == 4
    tiny_engine.check_idle()


async def test_tokenize_and_detokenize(app, tiny_engine):
    tok = tiny_engine.tokenizer()
    async with api(app) as c:
        r = (await c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})).json()
        assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == tiny_engine.max_model_len and "".join(r["token_strs"]) == "Hello world"
        back = (await c.post("/detokenize", json={"tokens": r["tokens"], "model": tiny_engine.model_name})).json()
        assert back == {"prompt": "Hello world"}
        chat = (await c.post("/tokenize", json={"messages": USER})).json()
        served = (await c.post(CHAT, json={"messages": USER, "max_tokens": 1})).json()
        assert chat["count"] == served["usage"]["prompt_tokens"] and chat["token_strs"] is None
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        with_tools = (await c.post("/tokenize", json={"messages": USER, "tools": tools})).json()
        served = (await c.post(CHAT, json={"messages": USER, "tools": tools, "max_tokens": 1})).json()
        assert with_tools["count"] == served["usage"]["prompt_tokens"] > chat["count"]
        assert "Unrecognized" in assert_400(await c.post("/tokenize", json={"prompt": "x", "extra": 1}), "extra")
        assert_400(await c.post("/tokenize", json={"prompt": 5}), "prompt")
        assert "vocabulary" in assert_400(await c.post("/detokenize", json={"tokens": [10**8]}), "tokens")
        assert_400(await c.post("/detokenize", json={"tokens": [-1]}), "tokens[0]")
        assert (await c.post("/detokenize", json={"tokens": [1], "model": "other"})).status_code == 404
        assert (await c.post("/tokenize", content=b"{")).json()["error"]["code"] == "invalid_json"
    tiny_engine.check_idle()


async def test_version_and_one_model(app, tiny_engine):
    from importlib.metadata import version
    async with api(app) as c:
        assert (await c.get("/version")).json() == {"version": version("kvrelay")}
        card = (await c.get(f"/v1/models/{tiny_engine.model_name}")).json()
        assert card["id"] == tiny_engine.model_name and card["object"] == "model"
        r = await c.get("/v1/models/org/other-model")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and "org/other-model" in r.json()["error"]["message"]


async def tokens_of(c, **body) -> str:
    r = await c.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return (await c.post("/detokenize", json={"tokens": r.json()["tokens"]})).json()["prompt"]


async def test_developer_role_is_the_system_prompt(app):
    async with api(app) as c:
        dev = await tokens_of(c, messages=[{"role": "developer", "content": "Be brief."}, *USER])
        sys = await tokens_of(c, messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert dev == sys and "<|im_start|>system\nBe brief." in dev and "developer" not in dev


async def test_generation_prompt_and_continuing_the_last_message(app, tiny_engine):
    convo = [*USER, {"role": "assistant", "content": "Hello the"}]
    async with api(app) as c:
        default = await tokens_of(c, messages=USER)
        bare = await tokens_of(c, messages=USER, add_generation_prompt=False)
        cont = await tokens_of(c, messages=convo, continue_final_message=True)
        both = await c.post(CHAT, json={"messages": convo, "continue_final_message": True,
                                        "add_generation_prompt": True})
        served = (await c.post(CHAT, json={"messages": convo, "continue_final_message": True, "max_tokens": 1,
                                           "add_generation_prompt": False})).json()
    assert default == bare + "<|im_start|>assistant\n"
    assert cont.endswith("<|im_start|>assistant\nHello the")
    assert "cannot both be true" in assert_400(both, "continue_final_message")
    assert served["usage"]["prompt_tokens"] == len(tiny_engine.tokenizer().encode(cont, add_special_tokens=False))
    tiny_engine.check_idle()


async def test_chat_template_kwargs_reach_the_template(tiny_engine):
    tok = copy.deepcopy(tiny_engine.tokenizer())   # a template of its own; the engine's stays intact
    tok.chat_template = ("{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    client = Scripted(tok)
    async with api(build_openai_app(client)) as c:
        loud = await tokens_of(c, messages=USER, chat_template_kwargs={"shout": True})
        quiet = await tokens_of(c, messages=USER)
        r = await c.post(CHAT, json={"messages": USER, "chat_template_kwargs": {"shout": True}})
        assert r.status_code == 200
        msg = assert_400(await c.post(CHAT, json={"messages": USER, "chat_template_kwargs": {"tokenize": True}}),
                         "chat_template_kwargs")
    assert loud == "LOUD user: hi\nassistant:" and quiet == "user: hi\nassistant:"
    assert tok.decode(client.requests[-1].prompt_ids) == loud
    assert "tokenize cannot be set" in msg


async def test_non_text_content_is_a_400_that_says_text_only(app):
    async with api(app) as c:
        for kind in ["image_url", "input_audio", "file"]:
            part = {"type": kind, kind: {"url": "data:,"}}
            r = await c.post(CHAT, json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, part]}]})
            msg = assert_400(r, "messages[0].content")
            assert "text-only" in msg and kind in msg, msg


async def test_continuous_usage_stats_puts_the_usage_on_every_chunk(app, tiny_engine):
    body = {"prompt": "The sea", "max_tokens": 5, "ignore_eos": True, "stream": True}
    async with api(app) as c:
        chunks = events((await c.post(C, json={**body, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})).text)[:-1]
        refused = await c.post(C, json={**body, "stream_options": {"continuous_usage_stats": True}})
    counts = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert all(ch["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0 for ch in chunks)
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1]["choices"] == []
    assert "include_usage" in assert_400(refused, "stream_options.continuous_usage_stats")
    tiny_engine.check_idle()


async def test_one_bad_prompt_of_a_list_fails_the_request_and_leaves_nothing(app, tiny_engine):
    ok = tiny_engine.tokenizer().encode("The sea")
    async with api(app) as c:
        for stream in (False, True):
            r = await c.post(C, json={"prompt": [ok, [10**9]], "max_tokens": 4, "stream": stream})
            assert "vocabulary" in assert_400(r, "prompt")
        r = await c.post(C, json={"prompt": [ok, ok], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert [ch["text"] for ch in r.json()["choices"]][0] == r.json()["choices"][1]["text"]
    tiny_engine.check_idle()
