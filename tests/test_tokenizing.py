"""The front door's tokenizer work (`server.tokenizing`): text too long to fit is refused
before any tokenizer sees it, and tokenizing runs off the event loop, so one huge prompt
never stalls other clients (issue #53, finding 1; the real-process check is in
tests/test_hostile.py)."""
from __future__ import annotations

import asyncio
import copy
import threading

import pytest

from api_helpers import Scripted, api, assert_400
from kvrelay.server.openai_api import build_openai_app
from kvrelay.server.tokenizing import Tokenizing, longest_token

pytestmark = pytest.mark.anyio
MARK = "hold-this-one"


class Watched:
    """A tokenizer whose encode calls are logged (thread, length) and, for text holding
    MARK, wait until `release` is set; its copies share the log."""

    def __init__(self, tok, log: list, release: threading.Event, started: threading.Event) -> None:
        self._tok, self.log, self.release, self.started = tok, log, release, started

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)

    def __deepcopy__(self, memo) -> "Watched":
        return Watched(copy.deepcopy(self._tok, memo), self.log, self.release, self.started)

    def encode(self, text, **kwargs):
        self.log.append((threading.current_thread().name, len(text)))
        if MARK in text:
            self.started.set()
            self.release.wait(10)
        return self._tok.encode(text, **kwargs)


@pytest.fixture
def watched(tiny_loaded):
    return Watched(tiny_loaded.tokenizer, [], threading.Event(), threading.Event())


@pytest.fixture
def client(watched):
    c = Scripted(watched)
    c.max_model_len = 64
    return c


def test_the_bound_is_the_context_times_the_longest_token(tiny_loaded):
    tok = tiny_loaded.tokenizer
    longest = max(len(p) for p in tok.get_vocab())
    assert longest_token(tok) >= longest
    t = Tokenizing(tok, 100)
    assert t.max_chars == 100 * longest_token(tok)
    t.close()


async def test_text_too_long_to_fit_is_refused_before_the_tokenizer(client, watched):
    too_long = "a" * (64 * longest_token(watched) + 1)
    async with api(build_openai_app(client)) as c:
        r = await c.post("/v1/completions", json={"model": "scripted", "prompt": too_long})
        assert "maximum context length is 64 tokens" in assert_400(r, "prompt")
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/chat/completions", json={"model": "scripted",
                                                       "messages": [{"role": "user", "content": too_long}]})
        assert_400(r, "messages")
        r = await c.post("/tokenize", json={"prompt": too_long})
        assert_400(r, "prompt")
        assert watched.log == []          # no tokenizer saw any of them
        assert client.requests == []
        r = await c.post("/tokenize", json={"prompt": "a short one"})
        assert r.status_code == 200 and r.json()["count"] > 0


async def test_tokenizing_runs_in_the_pool_not_on_the_event_loop(client, watched):
    async with api(build_openai_app(client)) as c:
        r = await c.post("/v1/chat/completions", json={"model": "scripted", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json={"model": "scripted", "prompt": "hi there", "max_tokens": 2})
        assert r.status_code == 200, r.text
    names = {name for name, _ in watched.log}
    assert len(watched.log) == 2 and all(n.startswith("kvrelay-tokenizer") for n in names), watched.log
    assert threading.current_thread().name not in names


async def test_a_slow_tokenization_holds_no_other_client(client, watched):
    """While one prompt is being tokenized (held here), the loop answers another client."""
    async with api(build_openai_app(client)) as c:
        slow = asyncio.create_task(c.post("/tokenize", json={"prompt": f"{MARK} and more words"}))
        assert await asyncio.to_thread(watched.started.wait, 10)
        r = await c.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted"
        assert not slow.done()
        watched.release.set()
        r = await slow
        assert r.status_code == 200 and r.json()["count"] > 0
