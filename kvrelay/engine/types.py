"""Request-level types the engine exposes to the server layer (no torch)."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator

MAX_N = 64   # most choices (`n`) one request may ask for


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text, compiled by `engine/grammar.py`.
    kind: "json_object" (any JSON object), "json_schema" (value: the schema as JSON text),
    "regex" (value: the pattern), "choice" (value: a JSON list of the allowed strings),
    "lark" (value: a Lark grammar)."""
    kind: str
    value: str = ""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 means no top-k cut
    seed: int | None = None           # per-request generator: same seed, same output
    stop: tuple[str, ...] = ()        # stop strings; never returned in the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None       # None: none; 0..20: chosen token plus that many top alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit), OpenAI's
    min_p: float = 0.0                # drop tokens below min_p x the best token's probability
    min_tokens: int = 0               # EOS and stop token ids are suppressed before this many tokens
    repetition_penalty: float = 1.0   # vLLM/HF: over prompt and output tokens, >1 discourages
    n: int = 1                        # choices per request; they share the prompt's KV pages
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # client disconnect or explicit abort
    ERROR = "error"        # the request failed; `StepOutput.error` says why


class ErrorCode(str, enum.Enum):
    """Why a request failed: the code an error text starts with ("<code>: <detail>"), the
    `code` of the client's error body, and what its HTTP status follows (server.errors)."""
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    OVERLOADED = "overloaded"                 # shed (--shed-ttft) or no capacity
    NO_HEALTHY_WORKER = "no_healthy_worker"
    ABORTED = "aborted"
    PEER_FAILED = "peer_failed"               # the other worker of the pair died, froze or gave up
    TRANSFER_ERROR = "transfer_error"
    INTERNAL_ERROR = "internal_error"         # a bug in kvrelay
    TIMEOUT_REQUEST = "timeout:request"       # the router's --request-timeout
    TIMEOUT_BOOTSTRAP = "timeout:bootstrap"   # a worker phase's deadline (disagg.lifecycle)
    TIMEOUT_QUEUED = "timeout:queued"
    TIMEOUT_PREFILL = "timeout:prefill"
    TIMEOUT_TRANSFER = "timeout:transfer"
    TIMEOUT_WAITING = "timeout:waiting"
    TIMEOUT_DECODE = "timeout:decode"         # also --max-request-time

    @classmethod
    def of(cls, text: str | None) -> "ErrorCode":
        """The code `text` ("<code>: <detail>", or a bare code) starts with; a text without
        a known one is an internal error. The one place an error text is parsed."""
        try:
            return cls((text or "").split(": ", 1)[0].strip())
        except ValueError:
            return cls.INTERNAL_ERROR


@dataclass(frozen=True)
class GenerateRequest:
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    # The consumer shows the client nothing before the final output (a non-streamed
    # response), so an EngineClient may restart the request from scratch after a failure.
    whole: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), best first


@dataclass
class StepOutput:
    """What one engine step produced for one choice of a request. `text` is the new
    detokenized text (stop strings already cut); the last output of each choice has
    `finish_reason` set. `prompt_tokens` is the request's prompt (count it once per
    request), `completion_tokens` this choice's tokens so far."""
    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None          # "<code>: <message>" when finish_reason is ERROR (or ABORT)
    index: int = 0                    # which of the request's `n` choices this output belongs to

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def error_code(self) -> ErrorCode | None:
        """The code of `error`, typed (read from the text: one source of truth)."""
        return None if self.error is None else ErrorCode.of(self.error)

    @property
    def error_detail(self) -> str:
        """`error` without its code."""
        code, sep, rest = (self.error or "").partition(": ")
        return rest if sep and code.strip() == self.error_code else (self.error or "")


class RequestRejected(Exception):
    """The request can never be served as asked (too long, too big for the KV pool, ...).
    The server turns it into an HTTP 400 with this message."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineClient(ABC):
    """What the HTTP layer needs from an engine, colocated or disaggregated.

    Contract:
    - `generate` yields StepOutputs for one request, each tagged with the `index` of the
      choice it belongs to (0..params.n-1; always 0 for n=1). Outputs of different
      choices interleave; each choice's own outputs come in order, and its last one has
      `finish_reason` set. Exactly one final output per choice: a choice that a failure
      or an abort ends gets one too (ERROR or ABORT, with `error`). After the n-th final
      output the generator stops. It raises `RequestRejected` before yielding anything if
      the request can never be served (n out of [1, MAX_N] or above the running batch,
      or n choices that cannot fit in the KV pool: param "n").
    - A request's n choices cost one prefill: they share the prompt's KV pages.
    - Cancelling the consumer of `generate` (client disconnect) aborts the request: all
      of its choices, whose pages are freed within one scheduler step.
    - `abort(rid)` ends every live choice of a request with FinishReason.ABORT; unknown
      rids are ignored.
    """

    model_name: str
    max_model_len: int

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]: ...

    @abstractmethod
    async def abort(self, rid: str) -> None: ...

    def check_capacity(self, units: int, param: str) -> None:
        """Before the requests of one API call start: raise (an HTTP error naming `param`
        when it can never fit) if `units` more completions (prompts x n) cannot be admitted
        now, so that a batch is admitted whole or not at all. Default: no limit of its own."""

    @abstractmethod
    def tokenizer(self):
        """The Hugging Face tokenizer (encode, decode, apply_chat_template)."""
