"""Tool calls in a model's output, turned into OpenAI `tool_calls`, whole or streamed: the
parsers behind `structured.ToolPlan.parser` (docs/structured-outputs.md).

- `NamedCall`: tool_choice naming a function; the whole output is its arguments.
- `CallArray`: tool_choice "required"; the grammar's `[{"name": ..., "arguments": ...}]`.
- `HermesCalls`: tool_choice "auto"; `<tool_call>` blocks in free text.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, Literal

from pydantic import BaseModel

from kvrelay.core import ids

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def loads(text: Any) -> Any:
    """`text` parsed as JSON, or `text` itself when it is not JSON text."""
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


class ToolCallFunction(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def call_id() -> str:
    return f"call_{ids.token_hex(12)}"


class ToolCallParser(ABC):
    """Turns one choice's text into content and tool calls, streamed or whole. Streaming:
    `head()` once, `feed(text)` per output, `end()` after the last; each returns a delta
    (possibly empty) whose `tool_calls` entries follow OpenAI's stream: an entry with
    id, type and name opens a call, later entries with its index add to its arguments."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def head(self) -> dict:
        return {}

    @abstractmethod
    def feed(self, text: str) -> dict: ...

    def end(self) -> dict:
        return {}

    def step(self, text: str, last: bool) -> dict:
        """The delta of one streamed output (`last`: the request's final one)."""
        d = self.feed(text)
        if not last:
            return d
        e = self.end()
        return _delta(d.get("tool_calls", []) + e.get("tool_calls", []), d.get("content", "") + e.get("content", ""))

    @abstractmethod
    def complete(self) -> bool:
        """The calls were read to their end (the whole output was understood)."""

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls and self.complete() else reason

    def message(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """(content, tool_calls) of a whole output: the text as content when it holds no
        complete call (e.g. cut off by max_tokens)."""
        self.feed(text)
        self.end()
        return (None, self.calls) if self.calls and self.complete() else (text, None)

    def _open(self, name: str, arguments: str = "") -> dict:
        call = ToolCall(id=call_id(), function=ToolCallFunction(name=name, arguments=arguments))
        self.calls.append(call)
        return {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _add(self, index: int, piece: str) -> dict:
        self.calls[index].function.arguments += piece
        return {"index": index, "function": {"arguments": piece}}


def _delta(entries: list[dict], content: str = "") -> dict:
    """One delta; entries of the same call index merged (one entry per call per chunk)."""
    merged: dict[int, dict] = {}
    for e in entries:
        m = merged.get(e["index"])
        if m is None:
            merged[e["index"]] = {**e, "function": dict(e["function"])}
        else:
            m["function"]["arguments"] += e["function"].get("arguments", "")
    out: dict[str, Any] = {"content": content} if content else {}
    if merged:
        out["tool_calls"] = list(merged.values())
    return out


class NamedCall(ToolCallParser):
    """tool_choice naming a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.text = ""

    def head(self) -> dict:
        return _delta([self._open(self.name)])

    def feed(self, text: str) -> dict:
        self.text += text
        if not self.calls:
            self._open(self.name)
        return _delta([self._add(0, text)]) if text else {}

    def complete(self) -> bool:
        try:
            return isinstance(json.loads(self.text), dict)
        except ValueError:
            return False


class CallArray(ToolCallParser):
    """tool_choice "required": `[{"name": "f", "arguments": ARGS}, ...]` in the grammar's
    compact layout, cut into calls as the text arrives. ARGS is streamed as it comes; its
    end is found by tracking JSON strings and nesting."""

    HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
    HEAD_START, HEAD_END = '{"name": "', '", "arguments": '

    def __init__(self) -> None:
        super().__init__()
        self.buf, self.pos, self.state = "", 0, "open"
        self.depth, self.in_str, self.esc, self.scalar = 0, False, False, False

    def complete(self) -> bool:
        return self.state == "end"

    def feed(self, text: str) -> dict:
        self.buf += text
        entries: list[dict] = []
        try:
            while self.pos < len(self.buf) and self._step(entries):
                pass
        except ValueError:
            self.state = "broken"   # not the grammar's layout (cannot happen while constrained)
        return _delta(entries)

    def _step(self, entries: list[dict]) -> bool:
        """Advance one state; False: wait for more text."""
        rest = self.buf[self.pos:]
        if self.state == "open":
            self._expect(rest.startswith("["))
            self.pos += 1
            self.state = "item"
        elif self.state == "item":
            m = self.HEAD.match(self.buf, self.pos)
            if m is None:
                self._expect(self._head_prefix(rest))
                return False
            entries.append(self._open(m.group(1)))
            self.pos, self.state = m.end(), "args"
            self.depth, self.in_str, self.esc, self.scalar = 0, False, False, False
        elif self.state == "args":
            start = self.pos
            done = self._scan_value()
            if self.pos > start:
                entries.append(self._add(len(self.calls) - 1, self.buf[start:self.pos]))
            if not done:
                return False
            self.state = "close"
        elif self.state == "close":
            for sep, nxt in (("}, ", "item"), ("}]", "end")):
                if rest.startswith(sep):
                    self.pos += len(sep)
                    self.state = nxt
                    return True
            self._expect("}, ".startswith(rest) or "}]".startswith(rest))
            return False
        else:   # end or broken: nothing more is read
            self._expect(self.state == "end" and not rest.strip())
            return False
        return True

    @staticmethod
    def _expect(ok: bool) -> None:
        if not ok:
            raise ValueError("unexpected text in a tool call array")

    def _head_prefix(self, rest: str) -> bool:
        start = self.HEAD_START
        if len(rest) <= len(start):
            return start.startswith(rest)
        if not rest.startswith(start):
            return False
        tail = rest[len(start) + re.match(r"[A-Za-z0-9_-]*", rest[len(start):]).end():]
        return self.HEAD_END.startswith(tail)

    def _scan_value(self) -> bool:
        """Consume the arguments value from `pos`; True once it is complete."""
        buf = self.buf
        while self.pos < len(buf):
            ch = buf[self.pos]
            if self.in_str:
                self.pos += 1
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return True
                continue
            if self.depth == 0 and self.scalar and ch in "},]":
                return True   # a number, true, false or null ended (the wrapper's "}" is not ours)
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.pos += 1
                if self.depth == 0:
                    return True
                continue
            elif self.depth == 0:
                self.scalar = True
            self.pos += 1
        return False


class HermesCalls(ToolCallParser):
    """tool_choice "auto": `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in
    free text become calls; a block that does not parse, or names no offered tool, stays
    text. Content is streamed as it comes, except a tail that may open a block."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        super().__init__()
        self.names, self.parallel = names, parallel
        self.pending, self.in_call = "", False
        self.content = ""

    def complete(self) -> bool:
        return not self.in_call

    def feed(self, text: str) -> dict:
        self.pending += text
        entries: list[dict] = []
        out = ""
        while True:
            if not self.in_call:
                at = self.pending.find(TOOL_CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.pending, TOOL_CALL_OPEN)
                    out += self._text(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                out += self._text(self.pending[:at])
                self.pending, self.in_call = self.pending[at + len(TOOL_CALL_OPEN):], True
            else:
                at = self.pending.find(TOOL_CALL_CLOSE)
                if at < 0:
                    break
                block, self.pending = self.pending[:at], self.pending[at + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                out += self._block(block, entries, closed=True)
        return _delta(entries, out)

    def end(self) -> dict:
        entries: list[dict] = []
        if self.in_call:   # the output ended inside a block: a call if it parses
            out = self._block(self.pending, entries, closed=False)
            self.in_call = False
        else:
            out = self._text(self.pending)
        self.pending = ""
        return _delta(entries, out)

    def _text(self, text: str) -> str:
        if not self.content:   # no whitespace ahead of the first real content
            text = text.lstrip()
        self.content += text
        return text

    def _block(self, block: str, entries: list[dict], closed: bool) -> str:
        call = loads(block.strip())
        if isinstance(call, dict) and call.get("name") in self.names:
            args = call.get("arguments", call.get("parameters", {}))
            args = loads(args)
            if isinstance(args, dict):
                if self.parallel or not self.calls:
                    entries.append(self._open(call["name"], dumps(args)))
                return ""
        raw = TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
        return self._text(raw)

    def message(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        self.feed(text)
        self.end()
        return self.content.strip() or None, self.calls or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
