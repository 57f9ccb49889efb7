"""Nothing silently ignored (issue #12): every field of every request model is in exactly
one of

- HONOURED: it acts; the entry names the test that proves it does;
- REFUSED: a non-default value is a 400 naming the field (sent here, whole and streamed);
- INERT: it carries no meaning for generation (`protocol.INERT_FIELDS`); accepted, and
  the output is the same as without it (checked here).

A field added to a request model and put in none of them fails
`test_every_field_is_classified_exactly_once`. An unknown field is a 400 naming it
(`test_an_unknown_field_is_a_400_naming_it`). The sampling fields are also checked to
reach the engine's SamplingParams unchanged (`test_a_sampling_field_reaches_the_engine`).
"""
from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from api_helpers import Scripted, api, assert_400
from kvrelay.server import protocol
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.utility_api import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

pytestmark = pytest.mark.anyio
TESTS = Path(__file__).parent
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BASE = {C: {"prompt": "The river", "max_tokens": 4}, CHAT: {"messages": USER, "max_tokens": 4}}

# The request bodies; the models nested in their fields (messages, stream_options, tools,
# response_format, ...) are walked too (`request_models`).
REQUEST_MODELS = [protocol.CompletionRequest, protocol.ChatCompletionRequest, TokenizeCompletionRequest,
                  TokenizeChatRequest, DetokenizeRequest]

SURFACE = "test_api_surface.py"
HONOURED = {
    # the OpenAI fields
    "model": "test_api.py::test_unknown_model_is_404",
    "prompt": "test_api.py::test_completion_forms_of_prompt_agree",
    "messages": "test_api.py::test_chat_whole",
    "role": f"{SURFACE}::test_developer_role_is_the_system_prompt",
    "content": f"{SURFACE}::test_non_text_content_is_a_400_that_says_text_only",
    "type": f"{SURFACE}::test_non_text_content_is_a_400_that_says_text_only",
    "text": "test_api.py::test_chat_whole",
    "max_tokens": "test_engine.py::test_stop_string_and_stop_token_and_max_tokens",
    "max_completion_tokens": "test_api.py::test_chat_whole",
    "temperature": "test_sampling.py::test_temperature_sharpens_distribution",
    "top_p": "test_sampling.py::test_truncation_support_and_renormalisation",
    "seed": "test_engine.py::test_same_seed_same_sampled_output",
    "stop": "test_api.py::test_stop_string_is_cut_from_text",
    "presence_penalty": "test_sampling_knobs.py::test_presence_and_frequency_penalties_break_a_models_repetition",
    "frequency_penalty": "test_sampling_knobs.py::test_presence_and_frequency_penalties_break_a_models_repetition",
    "logit_bias": "test_sampling_knobs.py::test_logit_bias_shifts_the_sampled_distribution",
    "n": f"{SURFACE}::test_n_choices_whole_and_streamed_completions",
    "stream": "test_api.py::test_completion_stream_matches_whole",
    "stream_options": "test_api.py::test_stream_without_include_usage_has_no_usage_chunk",
    "include_usage": "test_api.py::test_completion_stream_matches_whole",
    "continuous_usage_stats": f"{SURFACE}::test_continuous_usage_stats_puts_the_usage_on_every_chunk",
    "logprobs": "test_api.py::test_completion_logprobs_shape",
    "top_logprobs": "test_api.py::test_chat_logprobs_shape",
    "echo": f"{SURFACE}::test_echo_prepends_the_prompt",
    # extensions (vLLM's)
    "top_k": "test_sampling.py::test_truncation_support_and_renormalisation",
    "stop_token_ids": "test_engine.py::test_stop_string_and_stop_token_and_max_tokens",
    "ignore_eos": "test_api_fields.py::test_ignore_eos_runs_past_eos",
    "min_p": "test_sampling_knobs.py::test_min_p_drops_tokens_below_min_p_times_the_best",
    "min_tokens": "test_sampling_knobs.py::test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached",
    "repetition_penalty":
        "test_sampling_knobs.py::test_repetition_penalty_breaks_a_greedy_loop_and_resumes_across_workers",
    "chat_template_kwargs": f"{SURFACE}::test_chat_template_kwargs_reach_the_template",
    "add_generation_prompt": f"{SURFACE}::test_generation_prompt_and_continuing_the_last_message",
    "continue_final_message": f"{SURFACE}::test_generation_prompt_and_continuing_the_last_message",
    # structured outputs and tools (kvrelay/server/structured.py)
    "response_format": "test_structured.py::test_json_schema_over_20_prompts_always_validates",
    "json_schema": "test_structured.py::test_json_schema_over_20_prompts_always_validates",
    "schema_": "test_structured.py::test_json_schema_over_20_prompts_always_validates",
    "strict": "test_structured.py::test_json_schema_over_20_prompts_always_validates",
    "guided_json": "test_conformance.py::guided_json_choice_and_regex",
    "guided_regex": "test_structured.py::test_guided_choice_regex_and_json_object",
    "guided_choice": "test_structured.py::test_guided_choice_regex_and_json_object",
    "guided_grammar": "test_structured.py::test_guided_choice_regex_and_json_object",
    "tools": "test_structured.py::test_tool_choice_required_is_always_a_valid_call",
    "parameters": "test_structured.py::test_tool_choice_required_is_always_a_valid_call",
    "tool_choice": "test_structured.py::test_named_tool_choice_calls_that_tool",
    "function": "test_structured.py::test_named_tool_choice_calls_that_tool",
    "name": "test_structured.py::test_named_tool_choice_calls_that_tool",
    "description": "test_structured.py::test_hermes_history_and_template_tools",
    "parallel_tool_calls": "test_structured.py::test_required_grammar_takes_parallel_calls_and_rebased_refs",
    # /tokenize, /detokenize
    "add_special_tokens": "test_api_fields.py::test_add_special_tokens_on_tokenize",
    "return_token_strs": f"{SURFACE}::test_tokenize_and_detokenize",
    "tokens": f"{SURFACE}::test_tokenize_and_detokenize",
}
# field -> (route, the refused value); `best_of` equal to `n` is served
# (test_api_surface.py::test_best_of_equal_to_n_is_served).
REFUSED = {
    "suffix": (C, {"suffix": "    return x"}),
    "best_of": (C, {"best_of": 2}),
    "store": (CHAT, {"store": True}),
}
INERT = {
    "user": {"user": "user-1234"},
    "metadata": {"metadata": {"team": "search", "ticket": "T-1"}},
    "service_tier": {"service_tier": "flex"},
}


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def request_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo = list(REQUEST_MODELS)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.append(m)
            todo += [n for f in m.model_fields.values() for n in _models_in(f.annotation)]
    return seen


def all_fields() -> set[str]:
    return {name for m in request_models() for name in m.model_fields}


def test_every_field_is_classified_exactly_once():
    groups = {"HONOURED": set(HONOURED), "REFUSED": set(REFUSED), "INERT": set(INERT)}
    fields = all_fields()
    unclassified = fields - set().union(*groups.values())
    assert not unclassified, f"classify these request fields in tests/test_api_fields.py: {sorted(unclassified)}"
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not groups[a] & groups[b], f"in both {a} and {b}: {groups[a] & groups[b]}"
    assert not set().union(*groups.values()) - fields, "classified fields that no model declares"
    assert set(INERT) == protocol.INERT_FIELDS


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_an_honoured_field_names_a_test_that_exists(field):
    path, name = HONOURED[field].split("::")
    source = (TESTS / path).read_text()
    assert re.search(rf"^(async )?def {re.escape(name)}\(", source, re.M), HONOURED[field]


@pytest.mark.parametrize("field", sorted(REFUSED))
async def test_a_refused_field_is_a_400_naming_it(app, tiny_engine, field):
    route, value = REFUSED[field]
    async with api(app) as c:
        assert_400(await c.post(route, json={**BASE[route], **value}), field)
        assert_400(await c.post(route, json={**BASE[route], **value, "stream": True}), field)
    tiny_engine.check_idle()


@pytest.mark.parametrize("field", sorted(INERT))
async def test_an_inert_field_is_accepted_and_changes_nothing(app, tiny_engine, field):
    greedy = {"temperature": 0, "ignore_eos": True}
    async with api(app) as c:
        without = await c.post(CHAT, json={**BASE[CHAT], **greedy})
        with_it = await c.post(CHAT, json={**BASE[CHAT], **greedy, **INERT[field]})
        if field == "user":
            completion = await c.post(C, json={**BASE[C], **greedy, **INERT[field]})
            assert completion.status_code == 200, completion.text
    assert with_it.status_code == 200, with_it.text
    assert with_it.json()["choices"] == without.json()["choices"]
    tiny_engine.check_idle()


@pytest.mark.parametrize("route,field", [(C, "frobnicate"), (CHAT, "functions"), (CHAT, "reasoning_effort"),
                                         ("/tokenize", "messages_"), ("/detokenize", "prompt")])
async def test_an_unknown_field_is_a_400_naming_it(app, tiny_engine, route, field):
    body = {**BASE.get(route, {"prompt": "x"} if route == "/tokenize" else {"tokens": [1]}), field: 1}
    async with api(app) as c:
        msg = assert_400(await c.post(route, json=body), field)
    assert msg == f"Unrecognized request argument supplied: {field}"
    tiny_engine.check_idle()


# field -> (route, value sent, SamplingParams attribute, the value the engine must get)
PLUMBING = [
    (C, {"temperature": 0.5}, "temperature", 0.5), (C, {"top_p": 0.5}, "top_p", 0.5),
    (C, {"top_k": 7}, "top_k", 7), (C, {"top_k": -1}, "top_k", 0), (C, {"seed": 99}, "seed", 99),
    (C, {"stop": "END"}, "stop", ("END",)), (C, {"stop": ["a", "b"]}, "stop", ("a", "b")),
    (C, {"stop_token_ids": [5, 6]}, "stop_token_ids", (5, 6)), (C, {"ignore_eos": True}, "ignore_eos", True),
    (C, {"presence_penalty": 0.5}, "presence_penalty", 0.5),
    (C, {"frequency_penalty": -0.5}, "frequency_penalty", -0.5),
    (C, {"logit_bias": {"5": 3.0}}, "logit_bias", ((5, 3.0),)), (C, {"min_p": 0.2}, "min_p", 0.2),
    (C, {"min_tokens": 2}, "min_tokens", 2), (C, {"repetition_penalty": 1.3}, "repetition_penalty", 1.3),
    (C, {"n": 3}, "n", 3), (C, {"max_tokens": 3}, "max_tokens", 3), (C, {"logprobs": 4}, "logprobs", 4),
    (CHAT, {"max_completion_tokens": 3, "max_tokens": 9}, "max_tokens", 3),
    (CHAT, {"logprobs": True}, "logprobs", 0), (CHAT, {"logprobs": True, "top_logprobs": 20}, "logprobs", 20),
    (CHAT, {"n": 2, "temperature": 0.3}, "n", 2),
]


@pytest.mark.parametrize("route,value,attr,want", PLUMBING)
async def test_a_sampling_field_reaches_the_engine(tiny_engine, route, value, attr, want):
    client = Scripted(tiny_engine.tokenizer())
    async with api(build_openai_app(client)) as c:
        r = await c.post(route, json={**BASE[route], **value})
    assert r.status_code == 200, r.text
    assert getattr(client.requests[-1].params, attr) == want


async def test_ignore_eos_runs_past_eos(app, tiny_engine):
    eos = tiny_engine.tokenizer().eos_token_id
    body = {"prompt": "The river", "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    async with api(app) as c:
        stops = (await c.post(C, json=body)).json()
        runs = (await c.post(C, json={**body, "ignore_eos": True})).json()
    assert stops["choices"][0]["finish_reason"] == "stop" and stops["usage"]["completion_tokens"] == 1
    assert runs["choices"][0]["finish_reason"] == "length" and runs["usage"]["completion_tokens"] == 6
    tiny_engine.check_idle()


async def test_add_special_tokens_on_tokenize(tiny_engine):
    import copy
    tok = copy.deepcopy(tiny_engine.tokenizer())
    tok.add_bos_token = True          # a tokenizer that adds BOS, as Llama's does
    tok.update_post_processor()
    bos = tok.bos_token_id
    async with api(build_openai_app(Scripted(tok))) as c:
        plain = (await c.post("/tokenize", json={"prompt": "Hello"})).json()["tokens"]
        bare = (await c.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False})).json()["tokens"]
        chat = (await c.post("/tokenize", json={"messages": USER, "add_special_tokens": True})).json()["tokens"]
        chat_bare = (await c.post("/tokenize", json={"messages": USER, "add_special_tokens": False})).json()["tokens"]
    assert plain == [bos, *bare] and bos not in bare
    assert chat == [bos, *chat_bare]
