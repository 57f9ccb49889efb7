"""The OpenAI-compatible HTTP API over any EngineClient (colocated or disaggregated).

A request goes: validate (pydantic, then the checks that need the tokenizer or the
context length) -> GenerateRequest -> RequestStream -> JSON or server-sent events.
"""
from __future__ import annotations

import functools
import uuid
from typing import Any, Callable, Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.routing import BaseRoute

from kvrelay.engine.types import EngineClient, FinishReason, GenerateRequest, StepOutput
from kvrelay.server.errors import (SafeJSONResponse, from_failed_output, install_handlers, invalid, is_text,
                                   model_not_found)
from kvrelay.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                                     CompletionRequest, CompletionResponse, ModelCard, ModelList, Usage,
                                     chat_logprobs, completion_logprobs, now)
from kvrelay.server.security import Gate, guard
from kvrelay.server.sse import Collected, Renderer, RequestStream, abort_on_disconnect, collect, sse_events

COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_openai_app(client: EngineClient, *, extra_routes: Iterable[APIRouter | BaseRoute] | None = None,
                     gate: Gate | None = None) -> FastAPI:
    """The API app. `extra_routes` (routers or single routes: /metrics, /debug/requests,
    /abort, ...) are mounted beside the OpenAI routes. `gate`: the API keys and per-key
    limit every route but /health and /metrics is behind (`security.api_gate`)."""
    app = FastAPI(title="kvrelay", summary="OpenAI-compatible API of a kvrelay server")
    install_handlers(app)
    guard(app, gate)
    app.include_router(OpenAIServing(client).router())
    for route in extra_routes or ():
        if isinstance(route, APIRouter):
            app.include_router(route)
        else:
            app.router.routes.append(route)
    return app


def _finish(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None


class OpenAIServing:
    """The routes. Tokenizing runs on the event loop: it is short next to a forward pass,
    and one Hugging Face tokenizer is not safe to share between threads."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.tok = client.tokenizer()
        self.piece: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return r

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.client.model_name, max_model_len=self.client.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json")

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_common(body)
        prompt = body.single_prompt()
        ids = self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        max_tokens = self._max_tokens(body.max_tokens, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        greq = GenerateRequest(f"cmpl-{uuid.uuid4().hex}", tuple(ids), body.sampling_params(max_tokens, body.logprobs),
                               whole=not body.stream)
        render = CompletionRenderer(greq.rid, self.client.model_name, self.piece, body.logprobs is not None)
        return await self._serve(greq, render, request, body.stream, body.include_usage)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_common(body)
        logprobs = body.engine_logprobs()
        ids = self._chat_prompt_ids(body)
        max_tokens = self._max_tokens(body.requested_max_tokens(), len(ids), None, "messages")
        greq = GenerateRequest(f"chatcmpl-{uuid.uuid4().hex}", tuple(ids), body.sampling_params(max_tokens, logprobs),
                               whole=not body.stream)
        render = ChatRenderer(greq.rid, self.client.model_name, self.piece, logprobs is not None)
        return await self._serve(greq, render, request, body.stream, body.include_usage)

    # -- checks that pydantic cannot make --------------------------------------------------
    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model is not None and body.model != self.client.model_name:
            raise model_not_found(body.model)
        body.check_stream_options()

    def _chat_prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in body.messages]
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template rejected the conversation (roles out of order, ...)
            raise invalid(f"the chat template cannot render these messages: {exc}", "messages") from None
        # The rendered template already holds the special tokens it wants (BOS included
        # when the model uses one), so the tokenizer adds its own only if BOS is missing.
        bos = getattr(self.tok, "bos_token", None)
        return self._encode(text, "messages", add_special_tokens=not (bos and text.startswith(bos)))

    def _encode(self, text: object, param: str, **kwargs) -> list[int]:
        """Token ids of `text`. The models in protocol.py already refuse text that is not
        valid Unicode; this is the last check before the tokenizer (a rendered chat
        template holds more than the fields: whatever it holds must be text, too)."""
        if not isinstance(text, str) or not is_text(text):
            raise invalid(f"{param}: must be valid Unicode text", param, "invalid_text")
        return self.tok.encode(text, **kwargs)

    def _max_tokens(self, requested: int | None, prompt_len: int, cap: int | None, prompt_param: str) -> int:
        limit = self.client.max_model_len
        if prompt_len == 0:
            raise invalid("the prompt is empty", prompt_param)
        room = limit - prompt_len
        if room < 1:
            raise invalid(f"This model's maximum context length is {limit} tokens, but the prompt has "
                          f"{prompt_len} tokens, which leaves no room for a completion.", prompt_param,
                          "context_length_exceeded")
        if requested is None:
            return min(room, cap) if cap is not None else room
        if requested > room:
            raise invalid(f"This model's maximum context length is {limit} tokens. The prompt has "
                          f"{prompt_len} tokens and max_tokens is {requested}, {prompt_len + requested} in all; "
                          "lower max_tokens or shorten the prompt.", "max_tokens", "context_length_exceeded")
        return requested

    # -- running the request --------------------------------------------------------------
    async def _serve(self, greq: GenerateRequest, render: Renderer, request: Request, stream: bool,
                     include_usage: bool):
        rs = RequestStream(self.client, greq)
        if not stream:
            try:
                async with abort_on_disconnect(request, rs):
                    got = await collect(rs)
            finally:
                await rs.close()
            return SafeJSONResponse(render.response(got, rs.usage()))
        handed_over = False
        try:
            # Wait for the first output before the 200 goes out, so that a rejected or
            # failed-at-once request still gets its proper HTTP status.
            async with abort_on_disconnect(request, rs):
                first = await rs.first()
            if first.finish_reason is FinishReason.ERROR:
                raise from_failed_output(first.error)
            body = sse_events(rs, render, request, include_usage)
            handed_over = True   # from here on, sse_events owns `rs` and closes it
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        finally:
            if not handed_over:
                await rs.close()


class CompletionRenderer(Renderer):
    def __init__(self, rid: str, model: str, piece: Callable[[int], str], logprobs: bool) -> None:
        self.rid, self.model, self.piece, self.logprobs = rid, model, piece, logprobs
        self.created = now()
        self.offset = 0   # where the next streamed chunk's text starts in the completion

    def _wrap(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict[str, Any]:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                  usage=usage).model_dump(mode="json")

    def head(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, out: StepOutput) -> dict[str, Any] | None:
        if not (out.text or out.finished or (self.logprobs and out.logprobs)):
            return None
        lps = completion_logprobs(out.logprobs, self.piece, self.offset) if self.logprobs else None
        self.offset += len(out.text)
        return self._wrap([CompletionChoice(text=out.text, logprobs=lps, finish_reason=_finish(out.finish_reason))])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._wrap([], usage)

    def response(self, got: Collected, usage: Usage) -> dict[str, Any]:
        lps = completion_logprobs(got.logprobs, self.piece, 0) if self.logprobs else None
        return self._wrap([CompletionChoice(text=got.text, logprobs=lps, finish_reason=_finish(got.finish_reason))],
                          usage)


class ChatRenderer(Renderer):
    def __init__(self, rid: str, model: str, piece: Callable[[int], str], logprobs: bool) -> None:
        self.rid, self.model, self.piece, self.logprobs = rid, model, piece, logprobs
        self.created = now()

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump(mode="json")

    def head(self) -> list[dict[str, Any]]:
        return [self._chunk([ChatChunkChoice(delta={"role": "assistant", "content": ""})])]

    def chunk(self, out: StepOutput) -> dict[str, Any] | None:
        if not (out.text or out.finished or (self.logprobs and out.logprobs)):
            return None
        lps = chat_logprobs(out.logprobs, self.piece) if self.logprobs else None
        delta = {"content": out.text} if out.text else {}
        return self._chunk([ChatChunkChoice(delta=delta, logprobs=lps, finish_reason=_finish(out.finish_reason))])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([], usage)

    def response(self, got: Collected, usage: Usage) -> dict[str, Any]:
        lps = chat_logprobs(got.logprobs, self.piece) if self.logprobs else None
        choice = ChatChoice(message=AssistantMessage(content=got.text), logprobs=lps,
                            finish_reason=_finish(got.finish_reason))
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[choice],
                                      usage=usage).model_dump(mode="json")
