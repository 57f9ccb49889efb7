"""Pydantic models of the OpenAI-compatible API: requests (validated declaratively, so a
bad field becomes a 400 naming that field) and responses.

Extensions beyond OpenAI's API: `top_k`, `stop_token_ids`, `ignore_eos`, and vLLM's `min_p`,
`min_tokens`, `repetition_penalty`, `chat_template_kwargs`, `add_generation_prompt`,
`continue_final_message`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
(the output constraints and tools: `structured.py`).

Nothing is silently ignored: an unknown field is a 400 naming it (as OpenAI answers), and
every declared field is honoured or refused with a 400 naming it, except the few that
carry no meaning for generation (`INERT_FIELDS`). tests/test_api_fields.py holds the
classification of every field and fails on a field that has none.

Validation at the edge: every string the engine or the tokenizer will see must be valid
Unicode (a lone UTF-16 surrogate such as "\ud800" is a 400 naming its field), and every
list or number the engine sizes something by is bounded here (`MAX_STOPS`,
`MAX_STOP_CHARS`, `MAX_STOP_TOKEN_IDS`, `MAX_LOGIT_BIAS_TOKENS`, token ids below `TOKEN_ID_LIMIT`,
`SEED_LIMIT`).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Callable, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from kvrelay.engine.types import SamplingParams, TokenLogprob
from kvrelay.server.errors import invalid, is_text
from kvrelay.server.structured import GrammarFields, ToolFields
from kvrelay.server.tool_calls import ToolCall

MAX_LOGPROBS = 20               # OpenAI's top_logprobs range is 0-20
MAX_STOPS = 16                 # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 512           # characters per stop string
MAX_STOP_TOKEN_IDS = 256       # stop_token_ids per request
MAX_LOGIT_BIAS_TOKENS = 1024   # logit_bias entries per request
LOGIT_BIAS_LIMIT = 100.0       # |bias| (OpenAI's range)
TOKEN_ID_LIMIT = 2**31         # every token id is in [0, 2**31); the vocabulary check comes later
SEED_LIMIT = 2**64             # |seed| < 2**64
TOP_K_LIMIT = 2**31
MAX_N = 64                     # choices per prompt (`n`, `best_of`)
MAX_PROMPTS = 256              # prompts in one /v1/completions request
MAX_REQUEST_CHOICES = 256      # prompts x n in one request
MAX_METADATA = 16              # `metadata` pairs (OpenAI: 16, keys <= 64 and values <= 512 characters)
# Accepted and not acted on: they carry no meaning for generation. `user` and `metadata`
# label a request for its owner; `service_tier` picks among tiers of which kvrelay has one.
INERT_FIELDS = frozenset({"user", "metadata", "service_tier"})
# Content parts a text-only model cannot take: a 400 that says so, naming the message.
NON_TEXT_PARTS = frozenset({"image_url", "input_audio", "file", "image", "audio_url", "video_url", "input_image",
                            "input_file"})
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", message)


def _bad_text() -> PydanticCustomError:
    return PydanticCustomError("invalid_text", "must be valid Unicode text (it holds a lone UTF-16 surrogate)")


def _check_text(s: str) -> str:
    if not is_text(s):
        raise _bad_text()
    return s


def _check_nested_text(v: object, depth: int = 0) -> None:
    """Every string in a JSON value (dict keys included) is valid Unicode."""
    if depth > 32:
        raise PydanticCustomError("too_deep", "is nested too deeply")
    if isinstance(v, str):
        _check_text(v)
    elif isinstance(v, dict):
        for k, item in v.items():
            _check_nested_text(k, depth + 1)
            _check_nested_text(item, depth + 1)
    elif isinstance(v, list):
        for item in v:
            _check_nested_text(item, depth + 1)


Text = Annotated[str, AfterValidator(_check_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # vLLM's: the usage so far on every chunk as well (benchmark tools read it per chunk)
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _with_usage(cls, v: bool, info: ValidationInfo) -> bool:
        if v and not info.data.get("include_usage"):
            raise _unsupported("continuous_usage_stats needs include_usage to be true")
        return v


class _SamplingFields(GrammarFields):
    """Fields shared by both endpoints; `sampling_params` turns them into the engine's
    (the output constraints of `GrammarFields`: `structured.plan`)."""
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=TOP_K_LIMIT, description="extension; 0 or -1: no top-k cut")
    seed: int | None = Field(None, gt=-SEED_LIMIT, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = Field(None, description="OpenAI: {token id: bias in [-100, 100]}")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM: drop tokens below min_p x the best one's probability")
    min_tokens: int = Field(0, ge=0, lt=TOKEN_ID_LIMIT, description="vLLM: no EOS or stop token id before this many")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="vLLM/HF: over prompt and output tokens")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, max_length=512, description="inert: the end user, for the caller's records")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_bounds(cls, v: object) -> object:
        # Checked by hand so that every error names `stop` (not `stop[3]` or a union member).
        stops = [v] if isinstance(v, str) else v
        if isinstance(stops, list):
            if len(stops) > MAX_STOPS:
                raise PydanticCustomError("too_many", f"at most {MAX_STOPS} stop strings are allowed; got {len(stops)}")
            for s in stops:
                if isinstance(s, str):
                    if len(s) > MAX_STOP_CHARS:
                        raise PydanticCustomError("too_long", f"a stop string may be at most {MAX_STOP_CHARS} "
                                                  f"characters long; one has {len(s)}")
                    _check_text(s)
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_bounds(cls, v: object) -> object:
        # Checked by hand so that every error names `logit_bias` (not `logit_bias.50256`).
        if v is None:
            return v
        if not isinstance(v, dict):
            raise PydanticCustomError("logit_bias_type", "must be an object mapping token ids to biases")
        if len(v) > MAX_LOGIT_BIAS_TOKENS:
            raise PydanticCustomError("too_many", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased; got {len(v)}")
        ids: set[int] = set()
        for key, bias in v.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
                    and int(key) < TOKEN_ID_LIMIT):
                raise PydanticCustomError("token_id", f"keys must be token ids in [0, 2**31); got {str(key)[:40]!r}")
            if int(key) in ids:
                raise PydanticCustomError("token_id", f"token id {int(key)} is given twice")
            ids.add(int(key))
            if type(bias) not in (int, float) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise PydanticCustomError("bias_range", f"biases must be numbers in [-100, 100]; token {key} has {bias!r}")
        return v

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=self.stop_strings(), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=logprobs,
            logit_bias=tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items()),
            min_p=self.min_p, min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty, n=self.n)


class CompletionRequest(_SamplingFields):
    # A string or token ids, or a list of either: one request per prompt (`prompts`).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: object) -> object:
        # Checked by hand: a union's per-member errors would not say what is wrong.
        if isinstance(v, str):
            return _check_text(v)
        kinds = {type(item) for item in v} if isinstance(v, list) else {None}
        if not isinstance(v, list) or len(kinds) > 1 or not kinds <= {int, str, list}:
            raise PydanticCustomError("prompt_type", "prompt must be a string, a list of token ids, or a list of "
                                      "prompts (all strings or all lists of token ids)")
        if kinds != {int} and len(v) > MAX_PROMPTS:
            raise PydanticCustomError("too_many", f"at most {MAX_PROMPTS} prompts per request; got {len(v)}")
        for item in v:
            if type(item) is str:
                _check_text(item)
            for t in (item if type(item) is list else [item] if type(item) is int else ()):
                if type(t) is not int:
                    raise PydanticCustomError("prompt_type", "a list of token ids must hold integers only")
                if not 0 <= t < TOKEN_ID_LIMIT:
                    raise PydanticCustomError("token_id", f"token ids must be in [0, 2**31); got {t}")
        return v

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("logprobs") is not None:
            raise _unsupported("echo with logprobs is not supported: kvrelay does not compute the "
                               "prompt's logprobs (echo alone, or logprobs alone, works)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise _unsupported(f"best_of must equal n ({info.data.get('n', 1)}): kvrelay returns every "
                               "choice it samples and does not rank them")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("suffix is not supported: this model has no fill-in-the-middle")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request, in order; choice `i * n + j` is prompt i's j-th."""
        p = self.prompt
        many = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
        prompts = list(p) if many else [p]
        if not p or any(not q for q in prompts):
            raise invalid("the prompt is empty", "prompt")
        if len(prompts) * self.n > MAX_REQUEST_CHOICES:
            raise invalid(f"at most {MAX_REQUEST_CHOICES} choices per request; {len(prompts)} prompts x n={self.n} "
                          f"is {len(prompts) * self.n}", "n")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_calls, ...: handed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: object) -> object:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NON_TEXT_PARTS:
                raise PydanticCustomError("text_only", "the served model is text-only: a content part of type "
                                          "{kind} is not supported; send text parts only", {"kind": str(kind)})
        return v

    @model_validator(mode="after")
    def _extra_text(self) -> "ChatMessage":
        # The extra fields reach the chat template and the tokenizer: the same text rule.
        _check_nested_text(self.model_extra or {})
        return self

    def template_dict(self) -> dict:
        """The message as the chat template sees it: text content, and OpenAI's `developer`
        role as `system` (what it replaced; templates know only the older name)."""
        d = self.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            d["content"] = ""
        return d


# chat_template_kwargs may not set what the request's own fields or the server decide.
RESERVED_TEMPLATE_KWARGS = frozenset({"tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
                                      "conversation", "messages", "chat_template", "tokenizer_kwargs", "padding",
                                      "truncation", "max_length", "add_generation_prompt", "continue_final_message",
                                      "tools", "documents"})


class ChatPromptFields(BaseModel):
    """What turns messages into a prompt (vLLM's fields): shared by chat completions and
    POST /tokenize. `add_generation_prompt` (default: true unless continuing) and
    `continue_final_message` exclude each other."""
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _one_of_prompt_or_continue(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise _unsupported("continue_final_message and add_generation_prompt cannot both be true (set "
                               "add_generation_prompt to false to continue the last message)")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _check_nested_text(v)
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(v or ()))
        if taken:
            raise _unsupported(f"{taken[0]} cannot be set through chat_template_kwargs" +
                               (" (use the request field)" if taken[0] in ChatPromptFields.model_fields else ""))
        return v

    def template_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `apply_chat_template` besides the messages."""
        adds = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": adds,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(ToolFields, _SamplingFields, ChatPromptFields):
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    metadata: dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        None, max_length=MAX_METADATA, description="inert: the caller's labels")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="inert: kvrelay has one tier")
    store: bool | None = None

    @field_validator("store")
    @classmethod
    def _no_store(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("store is not supported: kvrelay keeps no completions after answering")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ---------------------------------------------------------------------------

def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with `usage` None) one streamed chunk of it."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None            # None when the answer is tool calls
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]        # {"role": "assistant"} first, then {"content": ...} / {"tool_calls": [...]}, {} last
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvrelay"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- logprobs: engine TokenLogprob -> wire format ------------------------------------------

LOGPROB_FLOOR = -9999.0   # JSON has no -inf


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def completion_logprobs(lps: list[TokenLogprob], piece: Callable[[int], str], offset: int) -> CompletionLogprobs:
    """Completions style. `offset` is where the first token's text starts in the completion.
    As in OpenAI's API, each top_logprobs entry also holds the sampled token, so it may have
    logprobs + 1 entries."""
    out = CompletionLogprobs()
    for lp in lps:
        text = piece(lp.token_id)
        top = {piece(t): _lp(v) for t, v in lp.top}
        top.setdefault(text, _lp(lp.logprob))
        out.tokens.append(text)
        out.token_logprobs.append(_lp(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _top(token_id: int, logprob: float, piece: Callable[[int], str]) -> TopLogprob:
    text = piece(token_id)
    return TopLogprob(token=text, logprob=_lp(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(lps: list[TokenLogprob], piece: Callable[[int], str]) -> ChatLogprobs:
    """Chat style: each token with exactly `top_logprobs` alternatives, best first."""
    content = []
    for lp in lps:
        head = _top(lp.token_id, lp.logprob, piece)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[_top(t, v, piece) for t, v in lp.top]))
    return ChatLogprobs(content=content)
