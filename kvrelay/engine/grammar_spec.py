"""What a `GrammarSpec` means to llguidance, without a tokenizer or torch: its grammar text,
the limits it is compiled under, and whether it compiles. The HTTP layer (the router
included, which has no model) checks a request's constraint here and refuses a bad one
with a 400 naming its own parameter; `engine/grammar.py` compiles the same text, under the
same limits, against the model's tokenizer."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
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
# llguidance's resource limits (`LLParserLimits`), the same for a check and a compile, so the
# router and the workers agree on what fits. Only the lexer fuel of one token mask is below
# llguidance's default (200_000): it bounds the mask the engine thread computes at each step
# (a grammar that reaches the lexer limit mid-output cost 200-260 ms a mask at the default,
# 5-9 ms at this value), and the ordinary grammars measured need a quarter of it. The initial
# fuel (building the lexer, and the first mask, which the compile warms) keeps its default
# of 1_000_000: a format-heavy 128 KiB JSON schema needs ~520_000. Terse errors: they reach
# the client, and the verbose ones dump the parser state and the whole grammar.
LIMITS = {"step_lexer_fuel": 20_000, "verbose_errors": False}
TERSE = "\n<non-verbose/>"      # what llguidance appends to an error without verbose_errors
# A check costs up to ~2.5 us per character of text (llguidance builds the lexer of every
# regex and format: 2.4 ms for 1 KiB of date-time fields, 0.3-0.6 s for a 128 KiB schema),
# so the HTTP layer checks on its event loop only a spec this short; a longer one is checked
# in CHECK_THREADS threads (`check_spec_async`), or by the engine's compile, off the loop too.
INLINE_CHECK_CHARS = 1024
CHECK_THREADS = 2
_CHECKS = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kvrelay-grammar-check")   # threads start on first use


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def terse(error: str) -> str:
    """An llguidance error without its trailer."""
    return error.removesuffix(TERSE).strip()


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
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(spec),
                                                                                limits=parser_limits())
    except ValueError as exc:
        return str(exc)
    return terse("; ".join(messages)) if is_error else ""


def check_spec(spec: GrammarSpec) -> str:
    """"" if `spec` compiles, else why not (no tokenizer needed; cached; any thread, but
    on an event loop only for a spec of at most INLINE_CHECK_CHARS)."""
    return _spec_error(spec).strip()


async def check_spec_async(spec: GrammarSpec) -> str:
    """`check_spec` in one of CHECK_THREADS threads, the caller's event loop free meanwhile
    (llguidance releases the GIL while it validates)."""
    return await asyncio.wrap_future(_CHECKS.submit(check_spec, spec))
