"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the API returns has the body `{"error": {"message", "type", "param", "code"}}`,
whatever raised it: request validation (FastAPI's 422 becomes 400), our own checks,
`RequestRejected` from the engine, unknown routes, a body over `MAX_BODY_BYTES` (413) or
one that arrives too slowly (408), a missing or wrong credential (401) or too many
requests in flight for one (429; both from `server.security`), or a bug (500; the server
keeps serving).

Every JSON body goes out through `SafeJSONResponse`: text that cannot be encoded as UTF-8
(a lone UTF-16 surrogate) is replaced, never raised.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.engine.types import ErrorCode as E
from kvrelay.engine.types import RequestRejected, StepOutput

from kvrelay.obs.metrics import reject_input

log = logging.getLogger("kvrelay.server")

# A request body larger than this is refused with 413 before it is parsed; one that has
# not fully arrived within BODY_TIMEOUT_S is refused with 408. 4 MiB holds the longest
# legal prompt as token ids (~7 bytes each) for a 500k-token context.
MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT_S = 30.0

# HTTP status -> OpenAI error type (OpenAI's own 401 for a bad API key is an invalid_request_error).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "overloaded_error"}

# A request that failed for a reason in the serving system (a worker died, a transfer
# failed, a phase deadline passed before any token, no capacity) is worth retrying:
# 503 + Retry-After. An invalid request is a 400. A deadline that covers the whole
# request is a 504. Only a bug in kvrelay (`internal_error`, or a code this table does
# not know) is a 500. docs/operations.md documents the same table.
RETRY_AFTER_S = 1
# Where `http_headers.RequestId` keeps the request's id in the ASGI scope (echoed on a 500 too).
REQUEST_ID_SCOPE = "kvrelay.request_id"
_REASON_STATUS = {E.INVALID_REQUEST: 400, E.CONTEXT_LENGTH_EXCEEDED: 400,
                  E.OVERLOADED: 503, E.NO_HEALTHY_WORKER: 503, E.PEER_FAILED: 503, E.TRANSFER_ERROR: 503,
                  E.ABORTED: 503, E.TIMEOUT_REQUEST: 504, E.TIMEOUT_DECODE: 504, E.INTERNAL_ERROR: 500}


def reason_status(code: str) -> int:
    """The HTTP status of a request that ended with reason `code` (an ErrorCode or its value)."""
    if code in _REASON_STATUS:
        return _REASON_STATUS[code]   # type: ignore[index]
    return 503 if code.startswith("timeout:") else 500   # a worker phase's backstop (before decode)


def retry_headers(status: int) -> dict[str, str] | None:
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


class OpenAIError(Exception):
    """An error meant for the client, raised anywhere in a request's handling. `headers`
    go out with the error response (e.g. `Retry-After` on a 503)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


class StartupError(Exception):
    """A serving command cannot start; the CLI prints the message as one line and exits 1."""


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def is_text(s: str) -> bool:
    """False for a string that cannot be encoded as UTF-8 (it holds a lone surrogate)."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def scrub(text: str) -> str:
    """`text` made encodable as UTF-8: surrogate pairs are joined, lone surrogates become
    U+FFFD. The common case (nothing to fix) costs one encode."""
    return text if is_text(text) else text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def json_text(payload: Any) -> str:
    """Compact JSON whose text always encodes as UTF-8 (surrogates only occur inside JSON
    strings, so scrubbing the whole text keeps it valid JSON)."""
    return scrub(json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")))


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that never fails on text that cannot be encoded (see `scrub`)."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("utf-8")


def error_response(err: OpenAIError) -> JSONResponse:
    if err.status in (400, 408, 413):   # kvrelay_rejected_input_total{surface="http",reason}
        reject_input("http", _REJECT_REASONS.get(err.code or "", "bad_field"), err.message)
    return SafeJSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                            headers=err.headers)


# Reasons of kvrelay_rejected_input_total{surface="http"}: a closed set of short codes
# (every other 400 is a field out of its type or range: bad_field).
_REJECT_REASONS = {"invalid_json": "bad_json", "invalid_body": "bad_body", "body_too_large": "too_large",
                   "body_timeout": "slow_body", "context_length_exceeded": "too_long", "invalid_text": "bad_text",
                   "invalid_address": "bad_address", "too_many": "too_many"}


def from_failed_output(out: StepOutput) -> OpenAIError:
    """The error for a request the engine ended with FinishReason.ERROR: its text
    ("<code>: <message>", e.g. "timeout:queued: ...") and its code."""
    code = out.error_code or E.INTERNAL_ERROR
    status = reason_status(code)
    return OpenAIError(status, out.error or "internal_error: the request failed", None, code.value,
                       retry_headers(status))


def from_rejected(exc: RequestRejected) -> OpenAIError:
    return OpenAIError(400, str(exc), exc.param, exc.code)


def _param_of(loc: tuple) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _is_type_tag(p):
            out += f".{p}" if out else str(p)
    return out or None


def _depth(loc: tuple) -> int:
    return sum(1 for p in loc if p != "body" and (isinstance(p, int) or not _is_type_tag(p)))


def _is_type_tag(part: str) -> bool:
    # Union members show up in the location as type names ("str", "list[int]", "function-after[...]").
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"}


def from_validation(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    # A union field fails once per member: name the deepest field (the member that got
    # furthest, e.g. messages[0].content[0].text rather than messages[0].content).
    first = max(errors, key=lambda e: _depth(tuple(e.get("loc", ()))), default={})
    if first.get("type") == "json_invalid":
        return invalid("We could not parse the JSON body of your request: "
                       f"{first.get('ctx', {}).get('error', 'invalid JSON')}", None, "invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _param_of(loc)
    if first.get("type") == "extra_forbidden":   # OpenAI's words for a field it does not know
        return invalid(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if param is None and first.get("type") in ("missing", "model_attributes_type"):
        return invalid("The request body is missing or is not a JSON object.", None, "invalid_body")
    # A union field fails once per member; say all of them, once each.
    msgs = dict.fromkeys(e.get("msg", "invalid value") for e in errors if _param_of(tuple(e.get("loc", ()))) == param)
    message = " or ".join(msgs) or "invalid request"
    return invalid(f"{param}: {message}" if param else message, param, first.get("type"))


class BodyLimit:
    """ASGI middleware: read the whole request body before the app sees it, answering 413
    (declared or actual size over `max_bytes`) or 408 (not complete within `timeout_s`)
    without calling the app; then replay it, and pass every later message (the
    `http.disconnect` a streaming route waits for) straight through."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = OpenAIError(413, f"the request body is larger than {self.max_bytes} bytes", None, "body_too_large")
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._refuse(too_large, scope, receive, send)
            return
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return   # the client left before its request was complete: nothing to answer
                    body = message.get("body", b"")
                    size += len(body)
                    if size > self.max_bytes:
                        await self._refuse(too_large, scope, receive, send)
                        return
                    chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._refuse(OpenAIError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                           None, "body_timeout"), scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(err: OpenAIError, scope, receive, send) -> None:
        response = error_response(err)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def install_handlers(app: FastAPI, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestRejected)
    async def _rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        return error_response(from_rejected(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs and re-raises after this response is sent; the server goes on. This
        # response leaves outside every middleware, so it echoes the request id itself.
        rid = request.scope.get(REQUEST_ID_SCOPE)
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                          None, "internal_error", {"X-Request-Id": rid} if rid else None))
