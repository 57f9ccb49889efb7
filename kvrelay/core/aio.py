"""The event loop of kvrelay's own asyncio processes (the router, `kvrelay bench`), and
the line reader of the streams they read.

uvicorn picks uvloop by itself where it starts the loop (`uvicorn.run`, the workers); a
process that starts its loop itself gets the pure-Python one unless it asks. The router
runs every streamed token of every request through its loop, on the cores the engines
compute on, so its CPU time is the engines' loss (and more: a parallel region waits for
the thread the router displaced).
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Coroutine, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (a pinned dependency), else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on `loop_factory()`'s loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """The lines of a byte stream (NDJSON, server-sent events), without their b"\\n" or
    b"\\r\\n", then its unterminated tail if any. Raises ValueError for a line longer than
    `limit` bytes: a peer that never ends its line never grows this buffer past that.
    One split per chunk, no text decoding: httpx's `aiter_lines` decodes and re-splits
    every chunk in two more generators, on the router's and the client's share of the
    cores, once per streamed token."""
    tail = b""
    async for chunk in chunks:
        *done, tail = (tail + chunk).split(b"\n")
        for line in done:
            if len(line) > limit:
                raise ValueError(f"a line longer than {limit} bytes")
            yield line[:-1] if line.endswith(b"\r") else line
        if len(tail) > limit:
            raise ValueError(f"a line longer than {limit} bytes")
    if tail:
        yield tail[:-1] if tail.endswith(b"\r") else tail
