"""Owning one engine request on the HTTP side: collecting it, streaming it as server-sent
events, and aborting it when the client goes away.

Invariant: every `RequestStream` (or `StreamGroup` of them) is closed exactly where it is
created or handed over (a `finally`), and `close()` aborts each engine request unless it
finished. So a request leaves the engine whether the client reads to the end, disconnects,
or the handler fails.

Choices: an engine request with `n` choices yields outputs tagged `index` 0..n-1, each
choice ending with its own final output; the request is done when all n have ended (or
one output fails it). A /v1/completions request with several prompts is one engine
request per prompt, read together by `StreamGroup`: prompt i's choice j is choice i*n + j.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Union

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
    """The StepOutputs of one engine request (all its `n` choices), with its usage so far."""

    def __init__(self, client: EngineClient, request: GenerateRequest) -> None:
        self.client = client
        self.rid = request.rid
        self.n = request.params.n
        self.finished = False
        self.prompt_tokens = len(request.prompt_ids)
        self._completion: dict[int, int] = {}   # choice index -> its completion tokens
        self._ended: set[int] = set()            # choices whose final output came
        self._first: StepOutput | None = None
        self._it = client.generate(request)

    @property
    def completion_tokens(self) -> int:
        return sum(self._completion.values())

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
        if out.finished:
            self._ended.add(out.index)
        self.finished = len(self._ended) >= self.n or out.finish_reason is FinishReason.ERROR
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        held = self._completion.get(out.index, 0)
        self._completion[out.index] = max(held + len(out.token_ids), out.completion_tokens)
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

    async def abort(self) -> None:
        if not self.finished:
            await self.client.abort(self.rid)


class StreamGroup:
    """Several engine requests (the prompts of one /v1/completions request) read as one
    stream of outputs, in arrival order, re-indexed so that prompt i's choice j is choice
    i*n + j. Usage counts each prompt once and every choice's completion."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self.rid = streams[0].rid
        # (member, its next output | None once it has ended | the exception that ended it)
        self._queue: asyncio.Queue[tuple[int, StepOutput | Exception | None]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = len(streams)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def _indexed(self, i: int, out: StepOutput) -> StepOutput:
        return dataclasses.replace(out, index=i * self.streams[i].n + out.index)

    async def first(self) -> StepOutput:
        """Every member's first output (so each can still raise `RequestRejected` before a
        response starts); a failed one if any failed, else prompt 0's."""
        tasks = [asyncio.ensure_future(s.first()) for s in self.streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed
        outs = [self._indexed(i, t.result()) for i, t in enumerate(tasks)]
        return next((o for o in outs if o.finish_reason is FinishReason.ERROR), outs[0])

    def __aiter__(self) -> StreamGroup:
        return self

    async def __anext__(self) -> StepOutput:
        if not self._pumps:
            self._pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)]
        while self._open:
            i, out = await self._queue.get()
            if out is None:
                self._open -= 1
                continue
            if isinstance(out, Exception):   # a member rejected (RequestRejected) or broke: so does the group
                raise out
            return self._indexed(i, out)
        raise StopAsyncIteration

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
        except Exception as exc:
            self._queue.put_nowait((i, exc))
        finally:
            self._queue.put_nowait((i, None))

    def usage(self) -> Usage:
        prompt = sum(s.prompt_tokens for s in self.streams)
        completion = sum(s.completion_tokens for s in self.streams)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def close(self) -> None:
        """Idempotent; stops the readers first, so that no member is being read while it closes."""
        with anyio.CancelScope(shield=True):
            for t in self._pumps:
                t.cancel()
            await asyncio.gather(*self._pumps, return_exceptions=True)
            for s in self.streams:
                await s.close()

    async def abort(self) -> None:
        for s in self.streams:
            await s.abort()


Outputs = Union[RequestStream, StreamGroup]


@asynccontextmanager
async def abort_on_disconnect(request: Request, stream: Outputs) -> AsyncIterator[None]:
    """While the body runs, a client disconnect aborts the request; the engine then ends it
    with FinishReason.ABORT. The request body has been read, so the next ASGI message is
    `http.disconnect` (sent when the client leaves, or once the response is complete)."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client of request %s disconnected; aborting it", stream.rid)
        await stream.abort()

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


@dataclass
class Collected:
    """One whole choice of a non-streamed request."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


async def collect(stream: Outputs) -> dict[int, Collected]:
    """Read the stream to its end: each choice by its index. Raises the OpenAIError of a
    request that failed."""
    got: dict[int, Collected] = {}
    pieces: dict[int, list[str]] = {}
    async for out in stream:
        if out.finish_reason is FinishReason.ERROR:
            raise from_failed_output(out)
        choice = got.setdefault(out.index, Collected())
        pieces.setdefault(out.index, []).append(out.text)
        choice.token_ids += out.token_ids
        choice.logprobs += out.logprobs
        choice.finish_reason = out.finish_reason
    for index, choice in got.items():
        choice.text = "".join(pieces[index])
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
    def response(self, got: dict[int, Collected], usage: Usage) -> dict[str, Any]:
        """The whole non-streaming response (`got`: each choice by its index)."""


async def sse_events(stream: Outputs, render: Renderer, request: Request,
                     include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """The body of a streaming response. It always ends with `[DONE]`, preceded by an error
    event if the request failed: a client never meets silence. `continuous_usage`: every
    chunk also carries the usage so far."""
    def event(chunk: dict[str, Any]) -> str:
        if continuous_usage:
            chunk["usage"] = stream.usage().model_dump()
        return sse(chunk)

    try:
        try:
            async with abort_on_disconnect(request, stream):
                for chunk in render.head():
                    yield event(chunk)
                async for out in stream:
                    if out.finish_reason is FinishReason.ERROR:
                        err = from_failed_output(out)
                        yield sse(error_body(err.status, err.message, err.param, err.code))
                        break
                    chunk = render.chunk(out)
                    if chunk is not None:
                        yield event(chunk)
                else:
                    if include_usage:
                        yield sse(render.usage_chunk(stream.usage()))
        except Exception as exc:  # a bug ends this stream with an error event, never the server
            log.exception("streaming request %s failed", stream.rid)
            yield sse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error"))
        yield DONE
    finally:
        await stream.close()
