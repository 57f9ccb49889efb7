"""Structured outputs and tool calls (issue #12): a tiny random-weight model, which on its
own writes noise, must still produce output of the requested shape when constrained --
JSON that validates against a nested schema, a call of one of the given tools, one of
the choices, a regex match -- colocated and disaggregated. Bad grammars are 400s naming
their parameter. Every test that runs the engine ends with nothing leaked."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError

from api_helpers import api, assert_400
from kvrelay.engine.grammar import GrammarCompiler, apply_masks
from kvrelay.engine.grammar_spec import MAX_GRAMMAR_CHARS
from kvrelay.engine.types import EngineClient, FinishReason, GrammarSpec, StepOutput
from kvrelay.server import structured
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.worker_protocol import WireSampling
from serving_helpers import assert_no_leak, running_server

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"

# Nested and bounded: a random model may wander anywhere the grammar lets it, so every
# string, number and array has a limit and no object takes extra keys; it must terminate.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                                    "unit": {"enum": ["C", "F"]}},
                                                     "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object",
                                                     "properties": {"a": {"type": "integer", "minimum": -999,
                                                                          "maximum": 999},
                                                                    "b": {"type": "integer", "minimum": -999,
                                                                          "maximum": 999}},
                                                     "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [f"Describe person number {i} as JSON." for i in range(20)]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def openai_client(app) -> AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://kvrelay/v1", timeout=120)
    return AsyncOpenAI(base_url="http://kvrelay/v1", api_key="unused", http_client=http)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def json_answers(client: AsyncOpenAI, model: str) -> list:
    """The 20 prompts, concurrently (a batch of constrained rows), half of them sampled."""
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=model, messages=user(p), response_format=JSON_FORMAT, max_tokens=160,
                                       temperature=1.0 if i % 2 else 0.0, seed=i)
        for i, p in enumerate(PROMPTS)))
    return [r.choices[0] for r in replies]


def assert_valid_people(choices) -> None:
    assert len(choices) == len(PROMPTS)
    for c in choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)


def assert_valid_call(call, names=tuple(SCHEMAS)) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- colocated ---------------------------------------------------------------------------------

async def test_json_schema_over_20_prompts_always_validates(app, tiny_engine):
    choices = await json_answers(openai_client(app), tiny_engine.model_name)
    assert_valid_people(choices)
    assert len({c.message.content for c in choices}) > 10   # the model's own values, not one canned answer
    tiny_engine.check_idle()


async def test_tool_choice_required_is_always_a_valid_call(app, tiny_engine):
    client = openai_client(app)
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=tiny_engine.model_name, messages=user(f"Task {i}"), tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                       temperature=1.0, seed=i)
        for i in range(12)))
    for r in replies:
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        assert_valid_call(c.message.tool_calls[0])
    tiny_engine.check_idle()


async def test_named_tool_choice_calls_that_tool(app, tiny_engine):
    client = openai_client(app)
    for seed in range(3):
        r = await client.chat.completions.create(
            model=tiny_engine.model_name, messages=user("add"), tools=TOOLS, max_tokens=60, seed=seed,
            tool_choice={"type": "function", "function": {"name": "add"}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["add"]
        assert_valid_call(c.message.tool_calls[0], ("add",))
    tiny_engine.check_idle()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_streamed_tool_calls_open_with_id_and_name_then_add_arguments(app, tiny_engine, tool_choice):
    client = openai_client(app)
    stream = await client.chat.completions.create(
        model=tiny_engine.model_name, messages=user("weather"), tools=TOOLS, tool_choice=tool_choice,
        max_tokens=120, stream=True, seed=5)
    calls: dict[int, dict] = {}
    finishes = []
    async for chunk in stream:
        choice = chunk.choices[0]
        finishes.append(choice.finish_reason)
        assert not choice.delta.content
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:   # the first delta of a call opens it
                assert d.id.startswith("call_") and d.type == "function" and d.function.name in SCHEMAS
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert calls and len(calls) == 1
    for call in calls.values():
        assert tool_choice == "required" or call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    tiny_engine.check_idle()


async def test_guided_choice_regex_and_json_object(app, tiny_engine):
    client = openai_client(app)
    model = tiny_engine.model_name
    for seed in range(4):
        r = await client.chat.completions.create(model=model, messages=user("?"), max_tokens=10, seed=seed,
                                                 extra_body={"guided_choice": ["yes", "no", "maybe not"]})
        assert r.choices[0].message.content in ("yes", "no", "maybe not") and r.choices[0].finish_reason == "stop"
        r = await client.completions.create(model=model, prompt="Code:", max_tokens=12, seed=seed,
                                            extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = await client.chat.completions.create(model=model, messages=user("{}"), max_tokens=200, seed=seed,
                                                 response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":   # any object: it may also run to max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        r = await client.completions.create(model=model, prompt="x", max_tokens=12, seed=seed,
                                            extra_body={"guided_grammar": 'start: "a" b\nb: "1" | "22"'})
        assert r.choices[0].text in ("a1", "a22")
        r = await client.completions.create(model=model, prompt="x", max_tokens=40, seed=seed,
                                            extra_body={"guided_json": SCHEMAS["add"]})
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["add"])
    tiny_engine.check_idle()


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                          "uniqueItems": True}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
])
async def test_a_bad_constraint_is_a_400_naming_its_parameter(app, tiny_engine, body, param):
    async with api(app) as c:
        for stream in (False, True):
            assert_400(await c.post(CHAT, json={"messages": user("x"), "max_tokens": 4, "stream": stream, **body}),
                       param)
    tiny_engine.check_idle()


async def test_the_sdk_sees_a_bad_schema_as_a_bad_request(app, tiny_engine):
    with pytest.raises(BadRequestError) as err:
        await openai_client(app).chat.completions.create(
            model=tiny_engine.model_name, messages=user("x"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                             "if": {}}}})
    assert err.value.body["param"] == "response_format" and "if" in err.value.body["message"]


# -- tool_choice auto: the Hermes format, on a scripted engine ------------------------------------

class Canned(EngineClient):
    """Answers every request with `pieces`, one output each, the last with `finish`."""
    model_name = "canned"
    max_model_len = 4096

    def __init__(self, tok, pieces: list[str], finish: FinishReason = FinishReason.STOP) -> None:
        self.tok, self.pieces, self.finish = tok, pieces, finish
        self.prompts: list[str] = []

    def tokenizer(self):
        return self.tok

    async def generate(self, request):
        self.prompts.append(self.tok.decode(list(request.prompt_ids)))
        for i, p in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield StepOutput(request.rid, token_ids=[7], text=p, prompt_tokens=len(request.prompt_ids),
                             completion_tokens=i + 1, finish_reason=self.finish if last else None)

    async def abort(self, rid: str) -> None:
        pass


HERMES_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


async def test_auto_parses_hermes_tool_calls_whole_and_streamed(tiny_engine):
    pieces = [HERMES_OUTPUT[i:i + 7] for i in range(0, len(HERMES_OUTPUT), 7)]   # tags split across outputs
    canned = Canned(tiny_engine.tokenizer(), pieces)
    client = openai_client(build_openai_app(canned))
    r = await client.chat.completions.create(model="canned", messages=user("weather and a sum"), tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather", "add"]
    assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == [{"city": "Paris", "unit": "C"},
                                                                              {"a": 1, "b": 2}]
    # the template of the default model takes no `tools`: the Hermes block names them in the system turn
    assert "<tools>" in canned.prompts[-1] and '"name": "get_weather"' in canned.prompts[-1]

    stream = await client.chat.completions.create(model="canned", messages=user("x"), tools=TOOLS, stream=True)
    content, names, args, finish = "", [], {}, None
    async for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or ():
            if t.id:
                names.append(t.function.name)
            args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Let me check." and "<tool" not in content
    assert names == ["get_weather", "add"] and json.loads(args[1]) == {"a": 1, "b": 2}
    assert finish == "tool_calls"

    r = await client.chat.completions.create(model="canned", messages=user("x"), tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == HERMES_OUTPUT
    assert "<tools>" not in canned.prompts[-1]   # tool_choice none: the model is not shown the tools
    r = await client.chat.completions.create(model="canned", messages=user("x"), tools=TOOLS,
                                             parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]


def test_hermes_history_and_template_tools():
    tools = {"tools": TOOLS, "tool_choice": "auto"}
    body = structured.ToolFields.model_validate(tools)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sum?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    msgs, kwargs = structured.prompt_inputs(body, history, "{{ messages }}")   # a template without tools
    assert kwargs == {} and msgs[0]["content"].startswith("Be brief.\n\n# Tools") and "<tools>" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    msgs, kwargs = structured.prompt_inputs(body, history, "{% if tools %}{{ tools }}{% endif %}")
    assert kwargs == {"tools": TOOLS} and msgs[0] == history[0]
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}   # as vLLM hands it over


def test_required_grammar_takes_parallel_calls_and_rebased_refs(tiny_engine):
    """Without parallel_tool_calls=false the array holds any number of calls; a tool's own
    `$defs` still resolve once its schema moved under the array's `$defs`."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"t": {"$ref": "#/$defs/T"}}, "required": ["t"],
        "additionalProperties": False, "$defs": {"T": {"enum": ["x", "y"]}}}}}]
    plan = structured.plan(structured.ToolFields.model_validate({"tools": tools, "tool_choice": "required"}))
    compiler = GrammarCompiler(tiny_engine.tokenizer(), len(tiny_engine.tokenizer()), [2])
    text = '[{"name": "add", "arguments": {"a": 1, "b": -2}}, {"name": "tag", "arguments": {"t": "y"}}]'
    m = compiler.matcher(plan.grammar)
    for t in tiny_engine.tokenizer().encode(text):
        m.accept(t)
    assert m.stopped and not m.error
    content, calls = plan.tools.parser().message(text)
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("add", {"a": 1, "b": -2}), ("tag", {"t": "y"})]
    m = compiler.matcher(plan.grammar)
    for t in tiny_engine.tokenizer().encode('[{"name": "tag", "arguments": {"t": "z"'):
        m.accept(t)
    assert m.error   # "z" is not in the referenced enum


def test_mask_allows_eos_only_where_the_grammar_accepts(tiny_engine):
    import torch

    tok = tiny_engine.tokenizer()
    eos = tok.eos_token_id
    compiler = GrammarCompiler(tok, len(tok), [eos])
    m = compiler.matcher(GrammarSpec("regex", "[0-9]{2,3}"))
    vocab = len(tok)

    def allowed() -> torch.Tensor:
        return torch.isfinite(apply_masks(torch.zeros(2, vocab), [None, m]))

    a = allowed()
    assert a[0].all()                          # the unconstrained row is untouched
    assert not a[1, eos] and a[1, tok.convert_tokens_to_ids("7")]
    for t in tok.encode("12"):
        m.accept(t)
    assert allowed()[1, eos] and not m.stopped  # accepting, may go on: EOS is one option
    for t in tok.encode("3"):
        m.accept(t)
    assert m.stopped and not m.error


@pytest.mark.parametrize("first,finish", [("{", FinishReason.LENGTH), ("x", FinishReason.ERROR)])
def test_decode_side_carries_the_grammar_on_from_the_first_token(tiny_loaded, first, finish):
    """D's matcher starts from the spec and consumes P's first token: a token the grammar
    allows goes on under the grammar; one it refuses (P and D disagreeing) fails the request
    at once, and its pages are freed either way."""
    from kvrelay.core.config import KVCacheConfig, SchedulerConfig
    from kvrelay.engine.core import EngineCore
    from kvrelay.engine.sampling import SampleResult
    from kvrelay.engine.types import GenerateRequest, SamplingParams

    core = EngineCore(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=1024), SchedulerConfig())
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["add"]))
    greq = GenerateRequest("d1", tuple(range(10, 30)), SamplingParams(max_tokens=6, temperature=0, grammar=spec))
    outs: list[StepOutput] = []
    core.add_prefilled(greq, outs.append, core.allocator.allocate(2, "d1"),
                       [SampleResult(tiny_loaded.tokenizer.convert_tokens_to_ids(first))])
    while core.has_work:
        core.step()
    assert outs[-1].finish_reason is finish
    if finish is FinishReason.LENGTH:
        text = "".join(o.text for o in outs)
        assert text.startswith('{"a": ') and len(outs) == 6   # six tokens, every one inside the grammar
    else:
        # sampled outside the grammar (P and D disagreeing): a bug, not the request's fault
        assert len(outs) == 1 and outs[-1].error.startswith("internal_error: the grammar refused")
    core.check_idle()


def test_wire_carries_a_bounded_grammar():
    from pydantic import ValidationError
    from kvrelay.engine.types import SamplingParams

    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    wire = WireSampling.of(SamplingParams(max_tokens=8, grammar=spec))
    assert WireSampling.model_validate_json(wire.model_dump_json()).params().grammar == spec
    body = json.loads(wire.model_dump_json())
    too_big = {**body, "grammar": {"kind": "regex", "value": "a" * (MAX_GRAMMAR_CHARS + 1)}}
    with pytest.raises(ValidationError):
        WireSampling.model_validate(too_big)
    with pytest.raises(ValidationError):
        WireSampling.model_validate({**body, "grammar": {"kind": "python", "value": "1"}})


# -- disaggregated: P samples the first token under the grammar, D carries the state on ---------

def test_json_schema_and_required_tools_disaggregated(tiny_llama_dir):
    with running_server("--model", f"random:{tiny_llama_dir}", "--dtype", "float32", "--max-kv-tokens", "16384",
                        "--served-model-name", "tiny") as url:
        async def run():
            # Closed here, on this loop: left open, its sockets were closed by the garbage
            # collector inside a later test's loop ("Event loop is closed" in that test).
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120) as client:
                people = await json_answers(client, "tiny")
                calls = await asyncio.gather(*(
                    client.chat.completions.create(model="tiny", messages=user(f"Task {i}"), tools=TOOLS, seed=i,
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=120)
                    for i in range(2)))
            return people, calls

        people, calls = asyncio.run(run())
        assert_no_leak(url)
    assert_valid_people(people)
    for r in calls:
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid_call(r.choices[0].message.tool_calls[0])
