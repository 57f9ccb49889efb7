"""Structured outputs and tool calls on the HTTP side: the request fields, the grammar they
ask for (`engine.types.GrammarSpec`, enforced by `engine/grammar.py`) and the tools in the
prompt; `tool_calls.py` turns the model's output back into OpenAI `tool_calls`.

At most one field constrains the output: `response_format` (json_object, json_schema),
vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or a
`tool_choice` of "required" or a named function; two are a 400 naming the second.

A constraint llguidance refuses is a 400 naming its field. `plan` checks it on the event
loop only while that is cheap (`grammar_spec.INLINE_CHECK_CHARS`); `aplan` checks a longer
one in a thread. A longer one that only `plan` saw is refused by the engine's compilation
(off the loop too), with a 400 naming `grammar`.

Tool calls (docs/structured-outputs.md):
- required: the output is constrained to `[{"name": ..., "arguments": {...}}, ...]`
  (one item without `parallel_tool_calls`), each item a call of one tool with arguments
  of its parameter schema. The layout is compact and fixed by the grammar, which is what
  lets `tool_calls.CallArray` cut it into calls while it streams.
- named function: the output is constrained to that function's arguments object.
- auto: the model decides; Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  blocks in its text become calls (the format of Qwen2.5, Hermes and the block we put in
  the system prompt when the chat template takes no `tools`).
- none: tools are not shown to the model; the answer is text.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from kvrelay.engine.grammar_spec import INLINE_CHECK_CHARS, MAX_GRAMMAR_CHARS, check_spec, check_spec_async
from kvrelay.engine.types import GrammarSpec
from kvrelay.server.errors import invalid, is_text
from kvrelay.server.tool_calls import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, CallArray, HermesCalls, NamedCall,
                                       ToolCallParser, dumps, loads)

MAX_TOOLS = 128
MAX_CHOICES = 1024              # guided_choice entries
MAX_JSON_DEPTH = 64
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"   # OpenAI's function names
HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


# -- request fields --------------------------------------------------------------------------

def _check_json(v: Any, depth: int = 0) -> Any:
    """A JSON value nested at most MAX_JSON_DEPTH deep whose every string is valid Unicode."""
    if depth > MAX_JSON_DEPTH:
        raise PydanticCustomError("too_deep", f"is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(v, str) and not is_text(v):
        raise PydanticCustomError("invalid_text", "must be valid Unicode text (it holds a lone UTF-16 surrogate)")
    if isinstance(v, dict):
        for k, item in v.items():
            _check_json(k, depth + 1)
            _check_json(item, depth + 1)
    elif isinstance(v, list):
        for item in v:
            _check_json(item, depth + 1)
    return v


JsonObject = Annotated[dict[str, Any], AfterValidator(_check_json)]
Text = Annotated[str, AfterValidator(_check_json), Field(max_length=MAX_GRAMMAR_CHARS)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: Name = "response"
    description: Text | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None   # the output always follows the schema; a keyword that cannot be enforced is a 400


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Strict):
    name: Name
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None   # as for response_format: constrained calls always follow the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: Name


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class GrammarFields(BaseModel):
    """The output constraints both endpoints take (mixed into the request models)."""
    response_format: ResponseFormat | None = None
    guided_json: JsonObject | Text | None = Field(None, description="vLLM: a JSON schema (object or JSON text)")
    guided_regex: Text | None = Field(None, description="vLLM: the output matches this regular expression")
    guided_choice: list[Text] | None = Field(None, max_length=MAX_CHOICES, description="vLLM: one of these strings")
    guided_grammar: Text | None = Field(None, description="vLLM: a Lark (or GBNF) grammar")


class ToolFields(BaseModel):
    """Tool calling (chat only)."""
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _distinct(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("duplicate_tool", "tool function names must be distinct")
        return v


# -- the plan: what constrains the output, which tools the model sees --------------------------

@dataclass(frozen=True)
class ToolPlan:
    choice: Literal["none", "auto", "required", "named"]
    tools: tuple[dict, ...] = ()      # OpenAI tool objects, as the chat template takes them
    name: str | None = None           # the named function
    parallel: bool = True

    @property
    def offered(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def parser(self) -> ToolCallParser | None:
        if self.choice == "named":
            return NamedCall(self.name or "")
        if self.choice == "required":
            return CallArray()
        if self.choice == "auto" and self.tools:
            return HermesCalls({t["function"]["name"] for t in self.tools}, self.parallel)
        return None


@dataclass(frozen=True)
class Structured:
    grammar: GrammarSpec | None = None
    tools: ToolPlan = field(default_factory=lambda: ToolPlan("none"))
    param: str | None = None      # the request field `grammar` came from
    checked: bool = True          # llguidance has accepted `grammar` (see `aplan`)


def plan(body: BaseModel) -> Structured:
    """The grammar and tool plan of a request. Raises a 400 naming the parameter at fault
    (two constraints, a bad schema, a tool_choice naming no tool, ...)."""
    tools = tool_plan(body)
    sources = _grammar_sources(body)
    if tools.choice == "required":
        sources.append(("tool_choice", GrammarSpec("json_schema", dumps(_required_schema(tools)))))
    elif tools.choice == "named":
        params = next(t["function"] for t in tools.tools if t["function"]["name"] == tools.name)
        sources.append(("tool_choice", GrammarSpec("json_schema", dumps(_parameters(params)))))
    if len(sources) > 1:
        raise invalid(f"{sources[0][0]} and {sources[1][0]} both constrain the output; send at most one",
                      sources[1][0])
    if not sources:
        return Structured(None, tools)
    param, spec = sources[0]
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise invalid(f"{param}: the grammar is {len(spec.value)} characters long; at most "
                      f"{MAX_GRAMMAR_CHARS} are allowed", param)
    inline = len(spec.value) <= INLINE_CHECK_CHARS   # ~2 ms at most on the loop
    if inline:
        _refuse(param, check_spec(spec))
    return Structured(spec, tools, param, checked=inline)


async def aplan(body: BaseModel) -> Structured:
    """`plan`, with a grammar too long to check on the event loop checked in a thread:
    every grammar llguidance refuses is a 400 naming its field."""
    structured = plan(body)
    if structured.checked:
        return structured
    _refuse(structured.param or "grammar", await check_spec_async(structured.grammar))
    return replace(structured, checked=True)


def _refuse(param: str, error: str) -> None:
    if error:
        what = "tools: a tool's parameters" if param == "tool_choice" else param
        raise invalid(f"{what}: cannot be enforced: {error}", "tools" if param == "tool_choice" else param)


def _grammar_sources(body: BaseModel) -> list[tuple[str, GrammarSpec]]:
    out: list[tuple[str, GrammarSpec]] = []
    rf: ResponseFormat | None = getattr(body, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            out.append(("response_format", GrammarSpec("json_object")))
        elif rf.json_schema is None:
            raise invalid("response_format: type json_schema needs json_schema.schema", "response_format")
        else:
            out.append(("response_format", GrammarSpec("json_schema", dumps(rf.json_schema.schema_))))
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise invalid("response_format: json_schema is only allowed with type json_schema", "response_format")
    gj = getattr(body, "guided_json", None)
    if gj is not None:
        out.append(("guided_json", GrammarSpec("json_schema", _schema_text(gj))))
    if getattr(body, "guided_regex", None) is not None:
        out.append(("guided_regex", GrammarSpec("regex", body.guided_regex)))
    if getattr(body, "guided_choice", None) is not None:
        if not body.guided_choice or not all(body.guided_choice):
            raise invalid("guided_choice: must be a non-empty list of non-empty strings", "guided_choice")
        out.append(("guided_choice", GrammarSpec("choice", dumps(body.guided_choice))))
    if getattr(body, "guided_grammar", None) is not None:
        out.append(("guided_grammar", GrammarSpec("lark", body.guided_grammar)))
    return out


def _schema_text(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"guided_json: not valid JSON: {exc}", "guided_json") from None
        if not isinstance(parsed, (dict, bool)):
            raise invalid("guided_json: a JSON schema must be an object", "guided_json")
        return schema
    return dumps(schema)


def tool_plan(body: BaseModel) -> ToolPlan:
    tools: list[Tool] = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    parallel = getattr(body, "parallel_tool_calls", True)
    dicts = tuple(t.model_dump(exclude_none=True, by_alias=True) for t in tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise invalid(f"tool_choice: names function {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", dicts, name, parallel)
    if choice == "required" and not tools:
        raise invalid("tool_choice: required needs at least one tool in tools", "tool_choice")
    for t in tools:
        ptype = (t.function.parameters or {}).get("type", "object")
        if ptype != "object":
            raise invalid(f"tools: the parameters of {t.function.name!r} must describe an object; "
                          f"got type {ptype!r}", "tools")
    return ToolPlan(choice, dicts, None, parallel)


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _required_schema(tools: ToolPlan) -> dict:
    """An array of calls `{"name": <one tool>, "arguments": <its parameters>}`. Each tool's
    parameters move to `$defs/tool<i>` and their local `$ref`s are rewritten to point there,
    so a schema with its own `$defs` (pydantic's) still resolves."""
    defs, calls = {}, []
    for i, t in enumerate(tools.tools):
        fn = t["function"]
        defs[f"tool{i}"] = _rebase(copy.deepcopy(_parameters(fn)), f"#/$defs/tool{i}")
        calls.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                       "arguments": {"$ref": f"#/$defs/tool{i}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not tools.parallel:
        array["maxItems"] = 1
    return {**array, "$defs": defs}


def _rebase(schema: Any, base: str) -> Any:
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                schema[k] = base + v[1:]
            else:
                _rebase(v, base)
    elif isinstance(schema, list):
        for v in schema:
            _rebase(v, base)
    return schema


# -- the prompt ---------------------------------------------------------------------------------

def template_takes_tools(template: Any) -> bool:
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def prompt_inputs(body: BaseModel, messages: list[dict], template: Any) -> tuple[list[dict], dict[str, Any]]:
    """(messages, extra `apply_chat_template` arguments) for `body`'s tools. A template that
    takes `tools` gets them (and tool-call arguments as objects, as vLLM hands them over);
    any other gets the Hermes block in its system message, past calls as `<tool_call>`
    text and tool results as `<tool_response>` user turns."""
    tools = tool_plan(body)
    if template_takes_tools(template):
        messages = [_arguments_as_objects(m) for m in messages]
        return messages, ({"tools": list(tools.tools)} if tools.offered else {})
    messages = [_hermes_turn(m) for m in messages]
    if tools.offered:
        block = HERMES_SYSTEM.format(tools="\n".join(dumps(t) for t in tools.tools))
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, {}


def _arguments_as_objects(m: dict) -> dict:
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        return m
    fixed = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and "arguments" in fn:
            c = {**c, "function": {**fn, "arguments": loads(fn["arguments"])}}
        fixed.append(c)
    return {**m, "tool_calls": fixed}


def _hermes_turn(m: dict) -> dict:
    if m.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or not isinstance(calls, list):
        return m
    blocks = []
    for c in calls:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        blocks.append(f"{TOOL_CALL_OPEN}\n{dumps({'name': fn.get('name'), 'arguments': loads(fn.get('arguments'))})}"
                      f"\n{TOOL_CALL_CLOSE}")
    text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
