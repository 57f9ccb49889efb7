"""vLLM's utility routes beside the OpenAI API, with vLLM's request and response shapes:

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                      or {model?, messages, add_generation_prompt, continue_final_message,
                      chat_template_kwargs, tools, add_special_tokens, return_token_strs} (the
                      prompt a chat completion of those messages and tools would get)
                      -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {model?, tokens} -> {prompt}
    GET  /version     -> {version}

Unknown fields are 400s naming them, like the OpenAI routes. They work in colocated and
disaggregated mode alike (the router holds the tokenizer).
"""
from __future__ import annotations

import json
from importlib import metadata
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrelay.server.errors import invalid, model_not_found
from kvrelay.server.protocol import TOKEN_ID_LIMIT, ChatPromptFields, Text
from kvrelay.server.structured import MAX_TOOLS, Tool

if TYPE_CHECKING:
    from kvrelay.server.openai_api import OpenAIServing

MAX_DETOKENIZE_IDS = 1 << 20
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPromptFields):
    model: Text | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)   # rendered into the prompt as for chat
    # None: as a chat completion does (the tokenizer's own only when the template added no BOS)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_IDS)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


def kvrelay_version() -> str:
    try:
        return metadata.version("kvrelay")
    except metadata.PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown"


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise invalid(f"We could not parse the JSON body of your request: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body is missing or is not a JSON object.", None, "invalid_body")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:   # the same 400 naming the field as a route's own body model
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def utility_router(serving: OpenAIServing) -> APIRouter:
    r = APIRouter()
    tok, client = serving.tok, serving.client

    def check_model(model: str | None) -> None:
        if model is not None and model != client.model_name:
            raise model_not_found(model)

    @r.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await _json_object(request)
        body = _parse(TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest, raw)
        check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = await serving.chat_prompt_ids(body, body.add_special_tokens)
        else:
            ids = await serving.tokenizing.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        strs = await serving.tokenizing.pieces(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(mode="json")

    @r.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body = _parse(DetokenizeRequest, await _json_object(request))
        check_model(body.model)
        vocab = len(tok)
        outside = next((t for t in body.tokens if t >= vocab), None)
        if outside is not None:
            raise invalid(f"token id {outside} is outside the vocabulary (size {vocab})", "tokens")
        return {"prompt": await serving.tokenizing.decode(body.tokens)}

    @r.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvrelay_version()}

    return r
