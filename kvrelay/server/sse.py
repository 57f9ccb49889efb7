"""Owning one engine request on the HTTP side: collecting it, streaming it as server-sent
events, and aborting it when the client goes away.

Invariant: every `RequestStream` is closed exactly where it is created or handed over (a
`finally`), and `close()` aborts the engine request unless it finished. So a request
leaves the engine whether the client reads to the end, disconnects, or the handler fails.
"""
from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request

from kvrelay.engine.types import EngineClient, FinishReason, GenerateRequest, StepOutput, TokenLogprob
from kvrelay.server.errors import error_body, from_failed_output, json_text
from kvrelay.server.protocol import Usage

log = logging.getLogger("kvrelay.server")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One event. Text that cannot be encoded as UTF-8 is replaced (`errors.scrub`): an
    odd output never breaks the stream."""
    return f"data: {json_text(payload)}\n\n"


class RequestStream:
    """The StepOutputs of one engine request, with its usage so far."""

    def __init__(self, client: EngineClient, request: GenerateRequest) -> None:
        self.client = client
        self.rid = request.rid
        self.finished = False
        self.prompt_tokens = len(request.prompt_ids)
        self.completion_tokens = 0
        self._first: StepOutput | None = None
        self._it = client.generate(request)

    async def first(self) -> StepOutput:
        """Wait for the first output and keep it for iteration. Raises `RequestRejected`
        while the response has not started, so it can still become an HTTP 400."""
        if self._first is None:
            self._first = await self._next()
        return self._first

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self._first is not None:
            out, self._first = self._first, None
            return out
        if self.finished:
            raise StopAsyncIteration
        return await self._next()

    async def _next(self) -> StepOutput:
        try:
            out = await self._it.__anext__()
        except StopAsyncIteration:  # the contract promises a final output; never hang on its absence
            out = StepOutput(self.rid, finish_reason=FinishReason.ERROR,
                             error="internal_error: the engine ended the request without a final output")
        self.finished = out.finished
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens + len(out.token_ids), out.completion_tokens)
        return out

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    async def close(self) -> None:
        """Idempotent; completes even while the calling task is being cancelled."""
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                await aclose()
            if not self.finished:
                self.finished = True
                await self.client.abort(self.rid)


@asynccontextmanager
async def abort_on_disconnect(request: Request, stream: RequestStream) -> AsyncIterator[None]:
    """While the body runs, a client disconnect aborts the request; the engine then ends it
    with FinishReason.ABORT. The request body has been read, so the next ASGI message is
    `http.disconnect` (sent when the client leaves, or once the response is complete)."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client of request %s disconnected; aborting it", stream.rid)
        await stream.client.abort(stream.rid)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


@dataclass
class Collected:
    """A whole non-streamed request."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


async def collect(stream: RequestStream) -> Collected:
    """Read the stream to its end. Raises the OpenAIError of a request that failed."""
    got = Collected()
    pieces = []
    async for out in stream:
        if out.finish_reason is FinishReason.ERROR:
            raise from_failed_output(out.error)
        pieces.append(out.text)
        got.token_ids += out.token_ids
        got.logprobs += out.logprobs
        got.finish_reason = out.finish_reason
    got.text = "".join(pieces)
    return got


class Renderer(ABC):
    """Turns one request's outputs into OpenAI JSON. It may keep per-request state (a
    streamed completion's text offset), so each request gets its own."""

    @abstractmethod
    def head(self) -> list[dict[str, Any]]:
        """Chunks sent before the first output (chat: the assistant role)."""

    @abstractmethod
    def chunk(self, out: StepOutput) -> dict[str, Any] | None:
        """The chunk for one output, or None when it carries nothing to send."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk before [DONE] when the client asked for usage (choices: [])."""

    @abstractmethod
    def response(self, got: Collected, usage: Usage) -> dict[str, Any]:
        """The whole non-streaming response."""


async def sse_events(stream: RequestStream, render: Renderer, request: Request,
                     include_usage: bool) -> AsyncIterator[str]:
    """The body of a streaming response. It always ends with `[DONE]`, preceded by an error
    event if the request failed: a client never meets silence."""
    try:
        try:
            async with abort_on_disconnect(request, stream):
                for chunk in render.head():
                    yield sse(chunk)
                async for out in stream:
                    if out.finish_reason is FinishReason.ERROR:
                        err = from_failed_output(out.error)
                        yield sse(error_body(err.status, err.message, err.param, err.code))
                        break
                    chunk = render.chunk(out)
                    if chunk is not None:
                        yield sse(chunk)
                else:
                    if include_usage:
                        yield sse(render.usage_chunk(stream.usage()))
        except Exception as exc:  # a bug ends this stream with an error event, never the server
            log.exception("streaming request %s failed", stream.rid)
            yield sse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error"))
        yield DONE
    finally:
        await stream.close()
