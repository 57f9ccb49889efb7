"""Structured logs: one line per event, `key=value` fields after the message.

Per-request events pass their fields as `extra` (`log.info("request ended", extra={"rid":
..., "room": ..., "reason": ...})`), so every line about a request carries its id and
`grep rid=<id>` over all processes' logs tells its story.
"""
from __future__ import annotations

import logging
import sys

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _value(v: object) -> str:
    s = str(v)
    return f'"{s}"' if (not s or any(c in s for c in ' "=')) else s


class KeyValueFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        if fields:
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        return line


def setup_logging(level: str = "info") -> None:
    """kvrelay's loggers write key=value lines to stderr at `level` (idempotent)."""
    root = logging.getLogger("kvrelay")
    root.setLevel(level.upper())
    if not any(isinstance(h.formatter, KeyValueFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(KeyValueFormatter())
        root.addHandler(handler)
        root.propagate = False
