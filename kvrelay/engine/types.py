"""Request-level types the engine exposes to the server layer (no torch)."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator


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
    logprobs: int | None = None       # None: none; 0..5: chosen token plus that many top alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # client disconnect or explicit abort
    ERROR = "error"        # the request failed; `StepOutput.error` says why


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
    """What one engine step produced for one request. `text` is the new detokenized text
    (stop strings already cut); the last output of a request has `finish_reason` set."""
    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None          # reason code + message when finish_reason is ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    - `generate` yields StepOutputs for one request, the last with `finish_reason` set,
      and then stops. It raises `RequestRejected` before yielding anything if the
      request can never be served.
    - Cancelling the consumer of `generate` (client disconnect) aborts the request; its
      pages are freed within one scheduler step.
    - `abort(rid)` ends a live request with FinishReason.ABORT; unknown rids are ignored.
    """

    model_name: str
    max_model_len: int

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]: ...

    @abstractmethod
    async def abort(self, rid: str) -> None: ...

    @abstractmethod
    def tokenizer(self):
        """The Hugging Face tokenizer (encode, decode, apply_chat_template)."""
