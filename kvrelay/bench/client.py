"""One streamed request against an OpenAI-compatible server, timed from the client's side.

Times are seconds on the monotonic clock: `start` relative to the run's start, the rest
relative to the request's own start. A token is counted when a chunk carrying text
arrives; the final usage, where the server sends it, gives the exact count.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from kvrelay.bench.workload import Turn
from kvrelay.core import aio

MAX_LINE_BYTES = 64 * 1024 * 1024   # one server-sent event: a whole answer's text at most


@dataclass
class Outcome:
    item: int
    turn: int
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk with text
    output_tokens: int = 0
    prompt_tokens: int = 0
    expected_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None below two tokens)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class Target:
    """Where and how to send: base URL, model, chat or not, and, for --text-prompts, the
    ids whose logits logit_bias pushes down (instead of ignore_eos)."""
    url: str
    model: str
    chat: bool = False
    eos_ids: tuple[int, ...] | None = None


def body(target: Target, turn: Turn, history: list[dict]) -> dict:
    out: dict = {"model": target.model, "max_tokens": turn.output_len, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
    if target.chat:
        out["messages"] = [*history, {"role": "user", "content": turn.prompt}]
    else:
        out["prompt"] = turn.prompt
    if target.eos_ids is None:
        out["ignore_eos"] = True
    else:
        out["logit_bias"] = {str(i): -100 for i in target.eos_ids}
    return out


async def send(client: httpx.AsyncClient, target: Target, turn: Turn, history: list[dict],
               item: int, index: int, t0: float) -> Outcome:
    res = Outcome(item, index, expected_tokens=turn.output_len, prompt_tokens=turn.prompt_len)
    path = "/v1/chat/completions" if target.chat else "/v1/completions"
    start = time.perf_counter()
    res.start = start - t0
    try:
        async with client.stream("POST", target.url + path, json=body(target, turn, history)) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {_message(await resp.aread())}"
                return res
            await _read(resp, res, start, target.chat)
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    res.e2e = time.perf_counter() - start
    if res.error is None and not res.chunk_times:
        res.error = "the stream ended without a token"
    return res


async def _read(resp: httpx.Response, res: Outcome, start: float, chat: bool) -> None:
    chunks, usage = 0, None
    async for line in aio.lines(resp.aiter_bytes(), MAX_LINE_BYTES):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            res.error = f"stream error: {_message(chunk)}"
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                now = time.perf_counter() - start
                if not res.chunk_times:
                    res.ttft = now
                res.chunk_times.append(now)
                res.text += text
                chunks += 1
    res.output_tokens = usage["completion_tokens"] if usage else chunks
    if usage and usage.get("prompt_tokens"):
        res.prompt_tokens = usage["prompt_tokens"]


def _message(raw: bytes | dict) -> str:
    try:
        data = json.loads(raw) if isinstance(raw, bytes) else raw
        return str(data["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw))[:300]


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model the server lists; ValueError saying what went wrong."""
    try:
        resp = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"{url}: cannot reach the server ({type(exc).__name__}); is it running?") from None
    if resp.status_code != 200:
        raise ValueError(f"{url}/v1/models answered HTTP {resp.status_code}: {_message(resp.content)}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{url}/v1/models lists no model") from None
