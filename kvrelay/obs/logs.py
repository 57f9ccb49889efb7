"""Structured logs: one line per event, for kvrelay's loggers and uvicorn's alike.

Two formats (`--log-format`):
- `text`: `2025-01-01 12:00:00,123 INFO kvrelay.worker message key=value ...`;
- `json`: one JSON object per line: `ts` (ISO 8601, UTC), `level`, `logger`, `msg`, then
  the record's own fields.

Per-request events pass their fields as `extra` (`log.info("request ended", extra={"rid":
..., "room": ..., "reason": ...})`), so every line about a request carries its id and
`grep rid=<id>` over all processes' logs tells its story. `AccessLog` adds one line per
HTTP request (method, path, status, duration, client, rid).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone

FORMATS = ("text", "json")
# Loggers that write through kvrelay's handler: its own, uvicorn's (whose records
# propagate up to "uvicorn"; uvicorn is told not to install handlers of its own), and
# Python's warnings (a library's warning is a log line in the same format, not a raw one).
LOGGERS = ("kvrelay", "uvicorn", "py.warnings")
ACCESS_LOGGER = "kvrelay.access"
# Polled routes: their access lines are debug-level, or a worker's log would be health checks.
QUIET_PATHS = frozenset({"/health", "/metrics"})

# Attributes every LogRecord has, and uvicorn's ANSI-coloured copy of its message.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName",
                                                                        "color_message"}


def record_fields(record: logging.LogRecord) -> dict:
    """The fields a call passed as `extra`."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _value(v: object) -> str:
    s = str(v)
    return f'"{s}"' if (not s or any(c in s for c in ' "=')) else s


class KeyValueFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a field that JSON cannot hold is written as its str()."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        for k, v in record_fields(record).items():
            obj.setdefault(k, v)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def json_line(msg: str, logger: str, level: str = "info", **fields) -> str:
    """A line in the json format for text that did not come from a log record (a child
    process's plain output that `kvrelay serve` forwards)."""
    obj = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "level": level,
           "logger": logger, "msg": msg, **fields}
    return json.dumps(obj, default=str, ensure_ascii=False)


_FORMATTERS = {"text": KeyValueFormatter, "json": JsonFormatter}
_handler: logging.Handler | None = None


def setup_logging(level: str = "info", fmt: str | None = None) -> None:
    """kvrelay's and uvicorn's loggers write to stderr at `level`, in format `fmt` (text or
    json). Idempotent; `fmt=None` keeps the format already set (text at first)."""
    global _handler
    if fmt is not None and fmt not in _FORMATTERS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(_FORMATTERS[fmt or "text"]())
    elif fmt is not None and not isinstance(_handler.formatter, _FORMATTERS[fmt]):
        _handler.setFormatter(_FORMATTERS[fmt]())
    logging.captureWarnings(True)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        if _handler not in logger.handlers:
            logger.addHandler(_handler)
        logger.propagate = False


def log_format() -> str:
    """The format setup_logging installed ("text" before it ran)."""
    return "json" if _handler is not None and isinstance(_handler.formatter, JsonFormatter) else "text"


class AccessLog:
    """ASGI middleware: one `kvrelay.access` line per HTTP request once its response has
    ended (for a stream, its last byte): method, path, status, duration_ms, client, and rid,
    the response's X-Request-Id header ('-' when it has none). A request whose app raised
    before answering is logged with status 500 (what uvicorn sends)."""

    def __init__(self, app, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.log = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        seen = {"status": 500, "rid": "-"}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == b"x-request-id":
                        seen["rid"] = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self._line(scope, seen["status"], seen["rid"], time.perf_counter() - start)

    def _line(self, scope, status: int, rid: str, seconds: float) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not self.log.isEnabledFor(level):
            return
        client = scope.get("client")
        self.log.log(level, "request", extra={
            "method": scope.get("method", ""), "path": path, "status": status,
            "duration_ms": round(seconds * 1000, 1), "client": f"{client[0]}:{client[1]}" if client else "-",
            "rid": rid})
