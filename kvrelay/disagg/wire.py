"""Every message that crosses a process boundary between a prefill (P) and a decode (D)
worker. Nothing else is sent.

Control messages are versioned frozen dataclasses, encoded as one JSON frame:
    {"v": WIRE_VERSION, "kind": <class KIND>, "src": <sender's control address>, "body": {...}}
`src` is the address replies go to. Bulk data (KV bytes of a two-sided backend) travels as
extra raw frames after a header message; those frames are never JSON.

A backend adds its own data message with `@message("Name")` on a frozen dataclass here or
in its own module (e.g. the tcp backend's KV-frame header).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from kvrelay.core.kvlayout import KVLayout

WIRE_VERSION = 1

_KINDS: dict[str, type] = {}


class WireError(ValueError):
    """A frame that is not a message of this wire version."""


def message(kind: str):
    """Register a frozen dataclass as a wire message named `kind` (unique)."""
    def deco(cls):
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise ValueError(f"wire message kind {kind!r} registered twice")
        cls.KIND = kind
        _KINDS[kind] = cls
        return cls
    return deco


class Message:
    """Base of every wire message. Subclasses may override `to_body`/`from_body` when a
    field does not survive JSON as is (int dict keys, tuples)."""
    KIND: ClassVar[str] = ""

    def to_body(self) -> dict:
        # Shallow on purpose (asdict deep-copies); nested dataclasses override to_body.
        return {name: getattr(self, name) for name in _field_names(type(self))}

    @classmethod
    def from_body(cls, body: dict) -> "Message":
        known = _field_names(cls)
        return cls(**{k: _tuples(v) for k, v in body.items() if k in known})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """Cached: dataclasses.fields() costs microseconds, and this runs per message."""
    return tuple(f.name for f in fields(cls))


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def encode(msg: Message, src: str) -> bytes:
    return _ENCODE({"v": WIRE_VERSION, "kind": msg.KIND, "src": src, "body": msg.to_body()}).encode()


def decode(data: bytes | memoryview) -> tuple[str, Message]:
    """-> (src address, message). Raises WireError on any malformed or foreign frame."""
    try:
        obj = json.loads(data if isinstance(data, bytes) else bytes(data))
        if obj.get("v") != WIRE_VERSION:
            raise WireError(f"wire version {obj.get('v')!r}, expected {WIRE_VERSION}")
        cls = _KINDS[obj["kind"]]
        return obj["src"], cls.from_body(obj["body"])
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed frame is one WireError
        raise WireError(f"undecodable frame: {e!r}") from e


# ---- rendezvous ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Identity(Message):
    """Who a worker is and how its transfer endpoint is reached. `incarnation` is random
    per process start: a new one at the same address means the peer restarted."""
    worker_id: str
    incarnation: str
    layout: dict
    backend: str
    endpoint: dict = field(default_factory=dict)

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.layout)


@message("BootstrapQuery")
@dataclass(frozen=True)
class BootstrapQuery(_Identity):
    """D -> P: here is who I am (P needs D's endpoint to write into it); who are you?"""


@message("BootstrapInfo")
@dataclass(frozen=True)
class BootstrapInfo(_Identity):
    """P -> D: the answer to BootstrapQuery."""


# Phase name a decode worker lists in its heartbeat for a failed room whose pages are held
# in one-sided quarantine: P answers with Stopped once it has stopped writing.
QUARANTINE_PHASE = "quarantine"


@message("Destination")
@dataclass(frozen=True)
class Destination(Message):
    """D -> P: write room's KV into these pages of my pool, tagged with this epoch.
    `hb_seq` is D's last heartbeat seq when this was sent: any later D heartbeat that does
    not list the room means D forgot it."""
    room: int
    epoch: int
    dst_pages: tuple[int, ...]
    decode_id: str
    incarnation: str
    hb_seq: int = 0


# ---- liveness and outcomes -----------------------------------------------------------

@message("Heartbeat")
@dataclass(frozen=True)
class Heartbeat(Message):
    """Both ways, from the scheduler loop. `rooms` maps every room the sender holds (and
    recently finished ones) to its phase name. `seq` grows by one per heartbeat sent.
    D -> P, two-sided backends: `landed` counts the KV pages from the recipient that have
    landed at the sender since it started (it grows while the link moves, whichever room
    the bytes are for), and `progress` maps a waiting room to how many of its own pages
    have landed. A sender that predates these fields (or a one-sided backend) sends
    neither: no progress information."""
    worker_id: str
    incarnation: str
    seq: int
    rooms: dict = field(default_factory=dict)  # {room: phase}
    progress: dict = field(default_factory=dict)  # {room: pages landed}
    landed: int = 0

    def to_body(self) -> dict:
        body = super().to_body()
        body["rooms"] = [[r, p] for r, p in self.rooms.items()]
        body["progress"] = [[r, n] for r, n in self.progress.items()]
        return body

    @classmethod
    def from_body(cls, body: dict) -> "Heartbeat":
        rooms = {int(r): str(p) for r, p in body["rooms"]}
        progress = {int(r): _count(n) for r, n in body.get("progress", ())}
        return cls(body["worker_id"], body["incarnation"], int(body["seq"]), rooms, progress,
                   _count(body.get("landed", 0)))


def _count(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise WireError(f"progress count {n!r} is not a non-negative integer")
    return n


NOTICE_KINDS = ("aborted", "failed")


@message("Notice")
@dataclass(frozen=True)
class Notice(Message):
    """Both ways: the sender ended (room, epoch) early. `reason` is the sender's reason."""
    room: int
    epoch: int
    kind: str  # one of NOTICE_KINDS
    reason: str


@message("Aux")
@dataclass(frozen=True)
class Aux(Message):
    """P -> D, sent LAST: its arrival means all of the room's KV has landed."""
    room: int
    epoch: int
    first_token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_tokens: int = 0


@message("Ack")
@dataclass(frozen=True)
class Ack(Message):
    """D -> P: KV and aux received; P may free its source pages."""
    room: int
    epoch: int


@message("Stopped")
@dataclass(frozen=True)
class Stopped(Message):
    """P -> D: P will write nothing more into (room, epoch); ends a one-sided quarantine."""
    room: int
    epoch: int
