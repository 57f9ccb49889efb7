"""What a `GrammarSpec` means to llguidance, without a tokenizer or torch: its grammar text
and whether it compiles. The HTTP layer (the router included, which has no model) checks a
request's constraint here and refuses a bad one with a 400 naming its own parameter;
`engine/grammar.py` compiles the same text against the model's tokenizer."""
from __future__ import annotations

import json
from functools import lru_cache

import llguidance

from kvrelay.engine.types import GrammarSpec

KINDS = ("json_object", "json_schema", "regex", "choice", "lark")
MAX_GRAMMAR_CHARS = 1 << 17     # 128 KiB of schema or grammar text per request
CACHE_SIZE = 64                 # compiled grammars kept per engine (and validations per process)
# Compact JSON with json.dumps' separators and no free whitespace: a model cannot wander
# off into endless spaces, and every output has one layout (tool-call streaming relies on it).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec`. Raises ValueError for a spec that is not even
    well-formed (unknown kind, a schema that is not JSON, an empty choice list)."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown grammar kind {spec.kind!r}")
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar is {len(spec.value)} characters long; at most {MAX_GRAMMAR_CHARS} are allowed")
    if spec.kind in ("json_object", "json_schema"):
        schema = spec.value if spec.kind == "json_schema" else ANY_OBJECT
        try:
            json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("the choices must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    return llguidance.grammar_from("grammar", spec.value)   # Lark, or GBNF converted to Lark


@lru_cache(maxsize=CACHE_SIZE)
def _spec_error(spec: GrammarSpec) -> str:
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(spec))
    except ValueError as exc:
        return str(exc)
    return "; ".join(messages) if is_error else ""


def check_spec(spec: GrammarSpec) -> str:
    """"" if `spec` compiles, else why not (no tokenizer needed; cached)."""
    return _spec_error(spec).strip()
