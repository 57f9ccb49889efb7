"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the API returns has the body `{"error": {"message", "type", "param", "code"}}`,
whatever raised it: request validation (FastAPI's 422 becomes 400), our own checks,
`RequestRejected` from the engine, unknown routes, or a bug (500; the server keeps serving).
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.engine.types import RequestRejected

log = logging.getLogger("kvrelay.server")

# HTTP status -> OpenAI error type.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}

# A request that failed for a reason in the serving system (a worker died, a transfer
# failed, a phase deadline passed before any token, no capacity) is worth retrying:
# 503 + Retry-After. An invalid request is a 400. A deadline that covers the whole
# request is a 504. Only a bug in kvrelay (`internal_error`, or a code this table does
# not know) is a 500. docs/operations.md documents the same table.
RETRY_AFTER_S = 1
_REASON_STATUS = {"invalid_request": 400, "context_length_exceeded": 400,
                  "overloaded": 503, "no_healthy_worker": 503, "peer_failed": 503, "transfer_error": 503,
                  "aborted": 503, "timeout:request": 504, "timeout:decode": 504, "internal_error": 500}


def reason_status(code: str) -> int:
    """The HTTP status of a request that ended with reason `code`."""
    if code in _REASON_STATUS:
        return _REASON_STATUS[code]
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


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def from_failed_output(error: str | None) -> OpenAIError:
    """The error for a request the engine ended with FinishReason.ERROR. Its text is
    "<reason code>: <message>" (e.g. "timeout:queued: ..."), or a bare reason code."""
    text = error or "internal_error: the request failed"
    code = text.split(": ", 1)[0].strip() or "internal_error"
    status = reason_status(code)
    return OpenAIError(status, text, None, code, retry_headers(status))


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


def _is_type_tag(part: str) -> bool:
    # Union members show up in the location as type names ("str", "list[int]", "function-after[...]").
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"}


def from_validation(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return invalid("We could not parse the JSON body of your request: "
                       f"{first.get('ctx', {}).get('error', 'invalid JSON')}", None, "invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _param_of(loc)
    if param is None and first.get("type") in ("missing", "model_attributes_type"):
        return invalid("The request body is missing or is not a JSON object.", None, "invalid_body")
    # A union field fails once per member; say all of them, once each.
    msgs = dict.fromkeys(e.get("msg", "invalid value") for e in errors if _param_of(tuple(e.get("loc", ()))) == param)
    message = " or ".join(msgs) or "invalid request"
    return invalid(f"{param}: {message}" if param else message, param, first.get("type"))


def install_handlers(app: FastAPI) -> None:
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
        # Starlette logs and re-raises after this response is sent; the server goes on.
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                          None, "internal_error"))
