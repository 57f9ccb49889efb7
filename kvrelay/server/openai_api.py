"""The OpenAI-compatible HTTP API over any EngineClient (colocated or disaggregated).

A request goes: validate (pydantic, then the checks that need the tokenizer or the
context length) -> GenerateRequest (one per prompt; each may ask for `n` choices) ->
RequestStream (or a StreamGroup of them) -> JSON or server-sent events with one choice
per (prompt, n) pair. The utility routes (/tokenize, /detokenize, /version) are in
`utility_api`; X-Request-Id and CORS in `http_headers`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Awaitable, Callable, Iterable, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.routing import BaseRoute

from kvrelay.engine.types import EngineClient, FinishReason, GenerateRequest, RequestRejected, StepOutput
from kvrelay.server import http_headers, structured
from kvrelay.server.errors import (SafeJSONResponse, from_failed_output, install_handlers, invalid,
                                   model_not_found)
from kvrelay.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatPromptFields,
                                     CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                                     Usage, chat_logprobs, completion_logprobs, now)
from kvrelay.server.security import Gate, charge, guard
from kvrelay.server.sse import (Collected, Renderer, RequestStream, StreamGroup, abort_on_disconnect, collect,
                                sse_events)
from kvrelay.server.tokenizing import Tokenizing
from kvrelay.server.utility_api import utility_router

COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


Health = Callable[[], Awaitable[tuple[int, dict[str, Any]]]]


def build_openai_app(client: EngineClient, *, extra_routes: Iterable[APIRouter | BaseRoute] | None = None,
                     gate: Gate | None = None, allowed_origins: Sequence[str] = (),
                     health_info: dict[str, str] | None = None, health: Health | None = None) -> FastAPI:
    """The API app. `extra_routes` (routers or single routes: /metrics, /debug/requests,
    /abort, ...) are mounted beside the OpenAI routes. `gate`: the API keys and per-key
    limit every route but /health and /metrics is behind (`security.api_gate`).
    `allowed_origins`: CORS (`--allowed-origins`; none: no CORS headers). `health_info`:
    what /health reports beside its status (a colocated server: what computes). `health`:
    (status code, body) of GET /health instead (the router: which workers are down)."""
    app = FastAPI(title="kvrelay", summary="OpenAI-compatible API of a kvrelay server")
    install_handlers(app)
    guard(app, gate)
    http_headers.install(app, allowed_origins)
    serving = OpenAIServing(client, health_info or {}, health)
    app.include_router(serving.router())
    app.include_router(utility_router(serving))
    for route in extra_routes or ():
        if isinstance(route, APIRouter):
            app.include_router(route)
        else:
            app.router.routes.append(route)
    return app


def _finish(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None


class OpenAIServing:
    """The routes. Every tokenizer call but the cached one-token `piece` runs off the event
    loop (`tokenizing.Tokenizing`), after the cheap checks that refuse text too long to fit."""

    def __init__(self, client: EngineClient, health_info: dict[str, str] | None = None,
                 health: Health | None = None) -> None:
        self.client = client
        self.health_info = health_info or {}
        self._health = health
        self.tok = client.tokenizer()
        self.tokenizing = Tokenizing(self.tok, client.max_model_len)
        self.piece: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return r

    async def health(self) -> JSONResponse:
        if self._health is None:
            return JSONResponse({"status": "ok", **self.health_info})
        code, body = await self._health()
        return JSONResponse(body, status_code=code)

    def _card(self) -> ModelCard:
        return ModelCard(id=self.client.model_name, max_model_len=self.client.max_model_len)

    async def models(self) -> dict[str, Any]:
        return ModelList(data=[self._card()]).model_dump(mode="json")

    async def model(self, model_id: str) -> dict[str, Any]:
        if model_id != self.client.model_name:
            raise model_not_found(model_id)
        return self._card().model_dump(mode="json")

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_common(body)
        rid = http_headers.request_rid("cmpl", request.scope)
        plan = await structured.aplan(body)
        grammar = plan.grammar
        prompts = body.prompts()
        greqs, echoes = [], []
        for i, prompt in enumerate(prompts):
            ids = await self.tokenizing.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
            max_tokens = self._max_tokens(body.max_tokens, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
            greqs.append(GenerateRequest(rid if len(prompts) == 1 else f"{rid}-{i}", tuple(ids),
                                         dataclasses.replace(body.sampling_params(max_tokens, body.logprobs),
                                                             grammar=grammar), whole=not body.stream))
            if body.echo:
                echoes += [prompt if isinstance(prompt, str) else await self.tokenizing.decode(ids)] * body.n
        render = CompletionRenderer(rid, self.client.model_name, self.piece, body.logprobs is not None,
                                    len(prompts) * body.n, echoes or None)
        return await self._serve(greqs, render, request, body.stream, body.include_usage, body.continuous_usage,
                                 plan.param)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_common(body)
        logprobs = body.engine_logprobs()
        plan = await structured.aplan(body)
        ids = await self.chat_prompt_ids(body)
        max_tokens = self._max_tokens(body.requested_max_tokens(), len(ids), None, "messages")
        greq = GenerateRequest(http_headers.request_rid("chatcmpl", request.scope), tuple(ids),
                               dataclasses.replace(body.sampling_params(max_tokens, logprobs), grammar=plan.grammar),
                               whole=not body.stream)
        render = ChatRenderer(greq.rid, self.client.model_name, self.piece, logprobs is not None, body.n, plan.tools)
        return await self._serve([greq], render, request, body.stream, body.include_usage, body.continuous_usage,
                                 plan.param)

    # -- checks that pydantic cannot make --------------------------------------------------
    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model is not None and body.model != self.client.model_name:
            raise model_not_found(body.model)
        body.check_stream_options()

    async def chat_prompt_ids(self, body: ChatPromptFields, add_special_tokens: bool | None = None) -> list[int]:
        """The prompt of a chat request (or of POST /tokenize with messages)."""
        messages = [m.template_dict() for m in body.messages]
        kwargs = body.template_kwargs()
        messages, tool_kwargs = structured.prompt_inputs(body, messages, kwargs.get("chat_template")
                                                         or getattr(self.tok, "chat_template", None))
        try:
            text = await self.tokenizing.render(messages, **{**kwargs, **tool_kwargs})
        except Exception as exc:  # the template rejected the conversation (roles out of order, ...)
            raise invalid(f"the chat template cannot render these messages: {exc}", "messages") from None
        # The rendered template already holds the special tokens it wants (BOS included
        # when the model uses one), so the tokenizer adds its own only if BOS is missing.
        if add_special_tokens is None:
            bos = getattr(self.tok, "bos_token", None)
            add_special_tokens = not (bos and text.startswith(bos))
        return await self.tokenizing.encode(text, "messages", add_special_tokens=add_special_tokens)

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
    async def _serve(self, greqs: list[GenerateRequest], render: Renderer, request: Request, stream: bool,
                     include_usage: bool, continuous_usage: bool = False, grammar_param: str | None = None):
        """`grammar_param`: the request field the grammar came from, which a refusal of
        the grammar by the engine or a worker names."""
        try:
            return await self._respond(greqs, render, request, stream, include_usage, continuous_usage)
        except RequestRejected as exc:
            if exc.param == "grammar" and grammar_param:
                raise RequestRejected(str(exc), grammar_param, exc.code) from None
            raise

    async def _respond(self, greqs: list[GenerateRequest], render: Renderer, request: Request, stream: bool,
                       include_usage: bool, continuous_usage: bool):
        units = sum(g.params.n for g in greqs)   # every limit counts each completion
        param = "prompt" if len(greqs) > 1 else "n"
        charge(request.scope, units, param)
        self.client.check_capacity(units, param)
        streams = [RequestStream(self.client, g) for g in greqs]
        rs = streams[0] if len(streams) == 1 else StreamGroup(streams)
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
                raise from_failed_output(first)
            body = sse_events(rs, render, request, include_usage, continuous_usage)
            handed_over = True   # from here on, sse_events owns `rs` and closes it
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        finally:
            if not handed_over:
                await rs.close()


class CompletionRenderer(Renderer):
    """`choices`: prompts x n. `echo`: each choice's prompt text, sent before its completion."""

    def __init__(self, rid: str, model: str, piece: Callable[[int], str], logprobs: bool, choices: int = 1,
                 echo: list[str] | None = None) -> None:
        self.rid, self.model, self.piece, self.logprobs = rid, model, piece, logprobs
        self.created = now()
        self.echo = echo or [""] * choices
        self.offset = [len(e) for e in self.echo]   # where each choice's next streamed text starts

    def _wrap(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict[str, Any]:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                  usage=usage).model_dump(mode="json")

    def head(self) -> list[dict[str, Any]]:
        return [self._wrap([CompletionChoice(index=i, text=e)]) for i, e in enumerate(self.echo) if e]

    def chunk(self, out: StepOutput) -> dict[str, Any] | None:
        if not (out.text or out.finished or (self.logprobs and out.logprobs)):
            return None
        lps = completion_logprobs(out.logprobs, self.piece, self.offset[out.index]) if self.logprobs else None
        self.offset[out.index] += len(out.text)
        return self._wrap([CompletionChoice(index=out.index, text=out.text, logprobs=lps,
                                            finish_reason=_finish(out.finish_reason))])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._wrap([], usage)

    def response(self, got: dict[int, Collected], usage: Usage) -> dict[str, Any]:
        choices = []
        for i, c in sorted(got.items()):
            lps = completion_logprobs(c.logprobs, self.piece, len(self.echo[i])) if self.logprobs else None
            choices.append(CompletionChoice(index=i, text=self.echo[i] + c.text, logprobs=lps,
                                            finish_reason=_finish(c.finish_reason)))
        return self._wrap(choices, usage)


class ChatRenderer(Renderer):
    """`tools`: the request's tool plan; its parser (one per choice) turns text into tool_calls."""

    def __init__(self, rid: str, model: str, piece: Callable[[int], str], logprobs: bool, choices: int = 1,
                 tools: structured.ToolPlan | None = None) -> None:
        self.rid, self.model, self.piece, self.logprobs = rid, model, piece, logprobs
        self.choices = choices
        self.created = now()
        self.tools = tools or structured.ToolPlan("none")
        self.parsers = [self.tools.parser() for _ in range(choices)]

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump(mode="json")

    def head(self) -> list[dict[str, Any]]:
        heads = [self._chunk([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
                 for i in range(self.choices)]
        return heads + [self._chunk([ChatChunkChoice(index=i, delta=d)])
                        for i, p in enumerate(self.parsers) if p is not None and (d := p.head())]

    def chunk(self, out: StepOutput) -> dict[str, Any] | None:
        parser, finish = self.parsers[out.index], _finish(out.finish_reason)
        if parser is None:
            delta = {"content": out.text} if out.text else {}
        else:
            delta, finish = parser.step(out.text, out.finished), parser.finish_reason(finish)
        if not (delta or out.finished or (self.logprobs and out.logprobs)):
            return None
        lps = chat_logprobs(out.logprobs, self.piece) if self.logprobs else None
        return self._chunk([ChatChunkChoice(index=out.index, delta=delta, logprobs=lps, finish_reason=finish)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._chunk([], usage)

    def response(self, got: dict[int, Collected], usage: Usage) -> dict[str, Any]:
        choices = []
        for i, c in sorted(got.items()):
            parser, finish = self.tools.parser(), _finish(c.finish_reason)
            content, calls = parser.message(c.text) if parser is not None else (c.text, None)
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls),
                                      logprobs=chat_logprobs(c.logprobs, self.piece) if self.logprobs else None,
                                      finish_reason=parser.finish_reason(finish) if parser is not None else finish))
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                      usage=usage).model_dump(mode="json")
