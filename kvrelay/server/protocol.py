"""Pydantic models of the OpenAI-compatible API: requests (validated declaratively, so a
bad field becomes a 400 naming that field) and responses.

Extensions beyond OpenAI's API: `top_k`, `stop_token_ids`, `ignore_eos`. Unknown fields
are ignored, as most OpenAI-compatible servers do.

Validation at the edge: every string the engine or the tokenizer will see must be valid
Unicode (a lone UTF-16 surrogate such as "\ud800" is a 400 naming its field), and every
list or number the engine sizes something by is bounded here (`MAX_STOPS`,
`MAX_STOP_CHARS`, `MAX_STOP_TOKEN_IDS`, token ids below `TOKEN_ID_LIMIT`, `SEED_LIMIT`).
"""
from __future__ import annotations

import time
from typing import Annotated, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvrelay.engine.types import SamplingParams, TokenLogprob
from kvrelay.server.errors import invalid, is_text

MAX_LOGPROBS = 5
MAX_STOPS = 16                 # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 512           # characters per stop string
MAX_STOP_TOKEN_IDS = 256       # stop_token_ids per request
TOKEN_ID_LIMIT = 2**31         # every token id is in [0, 2**31); the vocabulary check comes later
SEED_LIMIT = 2**64             # |seed| < 2**64
TOP_K_LIMIT = 2**31
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
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; `sampling_params` turns them into the engine's."""
    model_config = ConfigDict(extra="ignore")

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
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None

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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v > 1:
            raise _unsupported("n > 1 is not supported")
        return v

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=self.stop_strings(), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=logprobs)


class CompletionRequest(_SamplingFields):
    # One prompt: a string or token ids, alone or as a one-element list (see `_prompt_shape`).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: object) -> object:
        # Checked by hand: a union's per-member errors would not say what is wrong.
        if isinstance(v, str):
            return _check_text(v)
        if not isinstance(v, list):
            raise PydanticCustomError("prompt_type", "prompt must be a string or a list of token ids")
        for item in (v[0] if len(v) == 1 and isinstance(v[0], list) else v):
            if type(item) is int and not 0 <= item < TOKEN_ID_LIMIT:
                raise PydanticCustomError("token_id", f"token ids must be in [0, 2**31); got {item}")
            if type(item) is str:
                _check_text(item)
            elif type(item) is not int and not isinstance(item, list):
                raise PydanticCustomError("prompt_type", "prompt must be a string or a list of token ids")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise _unsupported("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise _unsupported("best_of > 1 is not supported")
        return v

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            if isinstance(p, list) and not p:
                raise invalid("the prompt is empty", "prompt")
            return p
        if len(p) != 1:
            raise invalid(f"only one prompt per request is supported; got {len(p)}", "prompt")
        return p[0]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_calls, ...: handed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @model_validator(mode="after")
    def _extra_text(self) -> "ChatMessage":
        # The extra fields reach the chat template and the tokenizer: the same text rule.
        _check_nested_text(self.model_extra or {})
        return self

    def template_dict(self) -> dict:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            d["content"] = ""
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

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
    content: str


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
    delta: dict[str, str]        # {"role": "assistant"} first, then {"content": ...}, {} last
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
