"""kvrelay.core.aio: the line reader of the router's and the bench client's streams, and
the event loop they run on."""
from __future__ import annotations

import asyncio
import random

import pytest

from kvrelay.core import aio


async def _chunks(parts: list[bytes]):
    for p in parts:
        await asyncio.sleep(0)
        yield p


def _read(parts: list[bytes], limit: int = 1 << 20) -> list[bytes]:
    async def main():
        return [line async for line in aio.lines(_chunks(parts), limit)]
    return asyncio.run(main())


def test_lines_are_the_same_however_the_stream_is_cut():
    text = b'{"a": 1}\n\ndata: {"text": "caf\xc3\xa9"}\r\n\r\ndata: [DONE]\n' + b"x" * 5000 + b"\nno newline at the end"
    want = [b'{"a": 1}', b"", b'data: {"text": "caf\xc3\xa9"}', b"", b"data: [DONE]", b"x" * 5000,
            b"no newline at the end"]
    assert _read([text]) == want
    rng = random.Random(3)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _read(parts) == want
    assert _read([b"one\n", b"", b"two\n"]) == [b"one", b"two"]
    assert _read([]) == []


def test_a_line_longer_than_the_limit_is_refused_before_it_is_buffered_whole():
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        _read([b"x" * 60] * 1000, limit=100)            # never a newline: stops at the second chunk
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        _read([b"ok\n" + b"y" * 101 + b"\nok\n"], limit=100)
    assert _read([b"z" * 100 + b"\n"], limit=100) == [b"z" * 100]


def test_the_loop_runs_a_coroutine_to_its_result():
    async def main():
        await asyncio.sleep(0.01)
        return asyncio.get_running_loop()
    loop = aio.run(main())
    assert loop.is_closed()
    factory = aio.loop_factory()
    assert factory is not None
    made = factory()
    assert "uvloop" in type(made).__module__   # a pinned dependency
    made.close()
