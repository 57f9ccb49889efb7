"""Shared by the HTTP API tests: an in-process client, SSE parsing, the OpenAI 400 check,
`Scripted`, an EngineClient that answers with n index-tagged choices, and `serving`, an app
on a real socket."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from contextlib import asynccontextmanager

import httpx
import uvicorn

from kvrelay.core.config import SecurityConfig, ServerConfig
from kvrelay.engine.types import EngineClient, FinishReason, GenerateRequest, StepOutput
from kvrelay.server.startup import serving_url, uvicorn_options
from serving_helpers import free_port


@asynccontextmanager
async def api(app):
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay", timeout=60) as c:
        yield c


def events(text: str) -> list:
    """The data payloads of an SSE body, `[DONE]` kept as the string."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_400(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


class Scripted(EngineClient):
    """Choice j of a request has j + 1 tokens; the choices' outputs interleave, and choice j
    ends with "length" if j is even, else "stop". The text says the prompt length, choice
    and step, so every piece shows where it belongs."""
    model_name = "scripted"
    max_model_len = 4096

    def __init__(self, tok) -> None:
        self.tok = tok
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []

    def tokenizer(self):
        return self.tok

    @staticmethod
    def text(prompt_len: int, j: int) -> str:
        return "".join(f"p{prompt_len}c{j}t{s} " for s in range(j + 1))

    @staticmethod
    def finish(j: int) -> str:
        return "length" if j % 2 == 0 else "stop"

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        n, plen = request.params.n, len(request.prompt_ids)
        for s in range(n):
            for j in range(s, n):
                done = (FinishReason.LENGTH if j % 2 == 0 else FinishReason.STOP) if s == j else None
                yield StepOutput(request.rid, token_ids=[100 + s], index=j, text=f"p{plen}c{j}t{s} ",
                                 prompt_tokens=plen, completion_tokens=s + 1, finish_reason=done)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


@contextlib.contextmanager
def serving(app, sec: SecurityConfig | None = None):
    """`app` on uvicorn in a thread, with the options every serving command uses; yields
    its URL. For clients that need a real socket, without a process to start."""
    sec = sec or SecurityConfig()
    srv = ServerConfig(port=free_port(), log_level="warning")
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(srv, sec)))
    thread = threading.Thread(target=server.run, name="uvicorn-api", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield serving_url(srv, sec)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
