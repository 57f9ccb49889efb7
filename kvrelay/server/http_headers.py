"""Headers every front-door response carries: `X-Request-Id`, and CORS when asked for.

X-Request-Id: a client's id is taken from the request (1-128 characters of letters,
digits and `. _ : @ + = -`, so it can stand inside an engine rid; anything else is a 400
naming the header), or one is made (32 hex digits). Every response, errors included,
echoes it. The request's rid is `<kind>-<id>` for a made id and `<kind>-<id>-<12 hex>` for
a client's (two requests may send the same one), so every log line of the router and the
workers that names the rid names the client's id too. The response `id` is that rid.

CORS (`--allowed-origins`, none by default: no CORS header at all): starlette's
CORSMiddleware, outermost, so a preflight `OPTIONS` is answered before the API-key check
and an error response still carries the headers a browser needs to read it. Methods GET,
POST, OPTIONS; request headers Authorization, Content-Type, X-Request-Id; X-Request-Id is
exposed to scripts; no credentials (cookies) are allowed.
"""
from __future__ import annotations

import re
import uuid
from typing import Sequence

from starlette.middleware.cors import CORSMiddleware

from kvrelay.server.errors import REQUEST_ID_SCOPE, OpenAIError, error_response

HEADER = "X-Request-Id"
SCOPE_ID = REQUEST_ID_SCOPE                # the request's id, given or made
SCOPE_GIVEN = "kvrelay.request_id_given"   # whether the client sent it
MAX_ID_CHARS = 128
ID_RE = re.compile(rf"[A-Za-z0-9._:@+=-]{{1,{MAX_ID_CHARS}}}")
CORS_METHODS = ("GET", "POST", "OPTIONS")
CORS_HEADERS = ("Authorization", "Content-Type", HEADER)


class RequestId:
    """ASGI middleware: validate or make the request's id, put it in the scope, and add it
    to the response's headers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        text = given.decode("latin-1") if given is not None else None
        valid = text is not None and ID_RE.fullmatch(text) is not None
        rid = text if valid else uuid.uuid4().hex
        scope[SCOPE_ID], scope[SCOPE_GIVEN] = rid, valid
        echo = (b"x-request-id", rid.encode("ascii"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), echo]}
            await send(message)

        if given is not None and not valid:
            err = OpenAIError(400, f"{HEADER} must be 1-{MAX_ID_CHARS} characters of letters, digits and "
                              ". _ : @ + = -", HEADER, "invalid_request_id")
            await error_response(err)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def request_rid(kind: str, scope) -> str:
    """The engine rid of a request whose id `RequestId` put in `scope` (see the module doc)."""
    rid = scope.get(SCOPE_ID) or uuid.uuid4().hex
    return f"{kind}-{rid}-{uuid.uuid4().hex[:12]}" if scope.get(SCOPE_GIVEN) else f"{kind}-{rid}"


def install(app, allowed_origins: Sequence[str] = ()) -> None:
    """Call last: starlette runs the middleware added last first."""
    app.add_middleware(RequestId)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(CORS_METHODS),
                           allow_headers=list(CORS_HEADERS), expose_headers=[HEADER], allow_credentials=False)
