"""Every message that crosses a process boundary between a prefill (P) and a decode (D)
worker. Nothing else is sent.

Control messages are versioned frozen dataclasses, encoded as one JSON frame:
    {"v": WIRE_VERSION, "kind": <class KIND>, "src": <sender's control address>, "body": {...}}
`src` is the address replies go to. Bulk data (KV bytes of a two-sided backend) travels as
extra raw frames after a header message; those frames are never JSON.

A backend adds its own data message with `@message("Name")` on a frozen dataclass here or
in its own module (e.g. the tcp backend's KV-frame header).

Validation at the edge: `decode()` accepts a frame only if it is a message of this
version, of bounded size, from a syntactically valid `src`, and every body field has the
type its dataclass annotation declares (bools are not ints, floats are not ints) and lies
in the range or size its `Annotated` constraint names (`Room`, `PageIds`, `Name`...). One
pydantic TypeAdapter, built once per message class from those annotations, serves every kind,
backends' data headers included; `Message.check()` adds a message's cross-field rules.
Anything else raises `WireError` whose `reason` is a short code for
`kvrelay_rejected_input_total{surface,reason}`:
    too_large     the frame exceeds MAX_FRAME_BYTES (checked before parsing)
    bad_json      not UTF-8 JSON, or not an object with v, kind, src, body
    bad_version   v is not WIRE_VERSION
    unknown_kind  kind is not a registered message
    bad_src       src is not an address (a network channel: not tcp://host:port)
    bad_field     a body field is missing, of the wrong type, or out of range
A decoded message is structurally safe; what only state can tell (a layout that differs
from ours, pages outside the pool, an unknown peer) is the transfer manager's to reject,
for that peer or room only. Unknown body keys are ignored (a newer sender's fields).
"""
from __future__ import annotations

import functools
import ipaddress
import json
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, PlainSerializer, TypeAdapter,
                      ValidationError, with_config)
from typing_extensions import NotRequired, TypedDict  # pydantic needs it (not typing's) before Python 3.12

from kvrelay.core.kvlayout import DTYPE_BYTES, KV_DTYPE_BYTES, KVLayout

WIRE_VERSION = 1

_KINDS: dict[str, type] = {}

I63 = 2**63 - 1
MAX_FRAME_BYTES = 8 << 20       # one JSON header frame; bulk data travels in raw frames
MAX_PAGE_ID = 2**31 - 1
MAX_PAGES_PER_MSG = 1 << 20
MAX_ROOMS_PER_MSG = 1 << 16     # rooms (or progress entries) in one heartbeat
MAX_NAME = 256                  # ids, incarnations, reasons, phases
MAX_ENDPOINT_VALUE = 1 << 20    # one value of a backend's endpoint (nixl agent metadata, base64)
MAX_ADDRESS = 270
MAX_CHOICES = 64                # first tokens in one Aux (engine.types.MAX_N)
MAX_TOP_LOGPROBS = 1024


class WireError(ValueError):
    """A frame that is not a message of this wire version. `reason` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def message(kind: str):
    """Register a frozen dataclass as a wire message named `kind` (unique)."""
    def deco(cls):
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise ValueError(f"wire message kind {kind!r} registered twice")
        cls.KIND = kind
        _KINDS[kind] = cls
        return cls
    return deco


def kinds() -> dict[str, type]:
    """Every registered message class by kind (the fuzzer walks them)."""
    return dict(_KINDS)


# ---- field types: strict pydantic types, named for what they carry ----------------------
# A body is validated in pydantic's lax mode (a JSON object becomes the dataclass, a JSON
# array a tuple), so every scalar says `strict=True`: a wire message's fields use these
# aliases (or `Annotated[..., Field(strict=True, ...)]`), never a bare int, str or float.

def _utf8(s: str) -> str:
    s.encode()  # a lone surrogate ("\\ud800" in JSON) raises UnicodeEncodeError, a ValueError
    return s


def _not_nan(x: float) -> float:
    if math.isnan(x):
        raise ValueError("NaN is not a number")
    return x


def _pairs(v: Any) -> Any:
    """dict[int, V] travels as [[key, value], ...] (JSON object keys are strings)."""
    if type(v) is not list or not all(type(p) is list and len(p) == 2 and type(p[0]) is int for p in v):
        raise ValueError("expected a list of [integer key, value] pairs")
    return dict(v)


_FROM_PAIRS, _TO_PAIRS = BeforeValidator(_pairs), PlainSerializer(lambda d: [[k, x] for k, x in d.items()])
_UTF8 = AfterValidator(_utf8)

Room = Annotated[int, Field(strict=True, ge=1, le=I63)]
Epoch = Annotated[int, Field(strict=True, ge=0, le=I63)]
Count = Annotated[int, Field(strict=True, ge=0, le=I63)]
PageId = Annotated[int, Field(strict=True, ge=0, le=MAX_PAGE_ID)]
PageIds = Annotated[tuple[PageId, ...], Field(max_length=MAX_PAGES_PER_MSG)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)]
Name = Annotated[str, Field(strict=True, max_length=MAX_NAME), _UTF8]
Number = Annotated[float, Field(strict=True), AfterValidator(_not_nan)]  # an int becomes a float; inf passes
Dtype = Literal["float32", "bfloat16", "float16"]
assert set(get_args(Dtype)) == set(DTYPE_BYTES)
KVDtype = Literal["float32", "bfloat16", "float16", "int8", "fp8_e4m3"]
assert set(get_args(KVDtype)) == set(KV_DTYPE_BYTES)


@with_config(ConfigDict(extra="forbid"))
class Layout(TypedDict):
    """A JSON object with exactly KVLayout's keys (KVLayout.to_dict())."""
    model_id: Annotated[str, Field(strict=True, max_length=1024), _UTF8]
    dtype: Dtype
    page_size: Annotated[int, Field(strict=True, ge=1, le=1 << 20)]
    num_layers: Annotated[int, Field(strict=True, ge=1, le=1 << 12)]
    num_kv_heads: Annotated[int, Field(strict=True, ge=1, le=1 << 12)]
    head_dim: Annotated[int, Field(strict=True, ge=1, le=1 << 16)]
    kv_dtype: NotRequired[KVDtype]   # absent: the same as dtype


Endpoint = Annotated[dict[Annotated[str, Field(strict=True, max_length=64), _UTF8],
                          Union[Annotated[str, Field(strict=True, max_length=MAX_ENDPOINT_VALUE), _UTF8], Count]],
                     Field(max_length=16)]
MAX_PAGE_BYTES = 1 << 30        # a layout whose page is bigger is refused (bad_field)

_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?):([0-9]{1,5})")
_INPROC = re.compile(r"inproc://[A-Za-z0-9._-]{1,64}")


def valid_endpoint(address: Any, schemes: tuple[str, ...] = ("tcp", "inproc")) -> bool:
    """`tcp://host:port` (host a DNS name, an IPv4 address or a bracketed IPv6 address;
    port 1..65535), or `inproc://name` where allowed. Syntax only: nothing is resolved."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS:
        return False
    if "inproc" in schemes and _INPROC.fullmatch(address):
        return True
    m = _TCP.fullmatch(address) if "tcp" in schemes else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        return False
    host = m.group(1)
    try:
        if host.startswith("["):
            return ipaddress.ip_address(host[1:-1]).version == 6
        if host.replace(".", "").isdigit():
            return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False
    return all(0 < len(label) <= 63 and not label.startswith("-") and not label.endswith("-")
               for label in host.split("."))


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    """Built once per message class from its annotations."""
    return TypeAdapter(cls)


def _detail(e: ValidationError) -> str:
    err = e.errors(include_url=False, include_context=False, include_input=False)[0]
    path = "".join(f"[{p}]" if type(p) is int else p if p.startswith("[") else f".{p}"
                   for p in err["loc"] if type(p) is int or not p.endswith("]") or p.startswith("["))
    return f"{path.lstrip('.')}: {err['msg']}"[:160]


class Message:
    """Base of every wire message. Field types are the contract: `from_body` builds the
    message only from values that match them (see the module docstring); `check()` adds
    rules across fields."""
    KIND: ClassVar[str] = ""

    def to_body(self) -> dict:
        return _adapter(type(self)).dump_python(self, warnings=False)

    @classmethod
    def from_body(cls, body: Any) -> "Message":
        if type(body) is not dict:
            raise WireError("bad_json", "body is not an object")
        try:
            msg = _adapter(cls).validate_python(body)
        except ValidationError as e:
            raise WireError("bad_field", _detail(e)) from None
        msg.check()
        return msg

    def check(self) -> None:
        """Raise WireError("bad_field", ...) if the fields do not fit together."""


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def encode(msg: Message, src: str) -> bytes:
    return _ENCODE({"v": WIRE_VERSION, "kind": msg.KIND, "src": src, "body": msg.to_body()}).encode()


def decode(data: bytes | memoryview, schemes: tuple[str, ...] | None = None) -> tuple[str, Message]:
    """-> (src address, message). Raises WireError (with a `reason` code) on any frame that
    is not a well-formed message of this version; never anything else. `schemes`: the
    endpoint schemes `src` must be an address of (a network channel passes ("tcp",));
    None accepts any string of bounded length."""
    if len(data) > MAX_FRAME_BYTES:
        raise WireError("too_large", f"{len(data)} bytes > {MAX_FRAME_BYTES}")
    try:
        obj = json.loads(data if isinstance(data, bytes) else bytes(data))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WireError("bad_json", str(e)[:80]) from None
    if type(obj) is not dict or not {"v", "kind", "src", "body"} <= obj.keys():
        raise WireError("bad_json", "not an object with v, kind, src and body")
    if type(obj["v"]) is not int or obj["v"] != WIRE_VERSION:
        raise WireError("bad_version", f"wire version {str(obj['v'])[:20]!r}, expected {WIRE_VERSION}")
    cls = _KINDS.get(obj["kind"]) if type(obj["kind"]) is str else None
    if cls is None:
        raise WireError("unknown_kind", str(obj["kind"])[:40])
    src = obj["src"]
    if not (valid_endpoint(src, schemes) if schemes else type(src) is str and 0 < len(src) <= MAX_ADDRESS):
        raise WireError("bad_src", repr(obj["src"])[:80])
    return src, cls.from_body(obj["body"])


# ---- rendezvous ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Identity(Message):
    """Who a worker is and how its transfer endpoint is reached. `incarnation` is random
    per process start: a new one at the same address means the peer restarted."""
    worker_id: Name
    incarnation: Name
    layout: Layout
    backend: Name
    endpoint: Endpoint = field(default_factory=dict)

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.layout)

    def check(self) -> None:
        if self.kv_layout.page_bytes > MAX_PAGE_BYTES:
            raise WireError("bad_field", f"layout: pages of {self.kv_layout.page_bytes} bytes")


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
    room: Room
    epoch: Epoch
    dst_pages: PageIds
    decode_id: Name
    incarnation: Name
    hb_seq: Count = 0


# ---- liveness and outcomes -----------------------------------------------------------

@message("Heartbeat")
@dataclass(frozen=True)
class Heartbeat(Message):
    """Both ways, from the scheduler loop. `rooms` maps every room the sender holds (and
    recently finished ones) to its phase name. `seq` grows by one per heartbeat sent.
    D -> P, two-sided backends: `landed` counts the KV bytes from the recipient that have
    arrived at the sender since it started (it grows while the link moves, whichever room
    the bytes are for, late bytes of an ended room too), and `progress` maps a waiting
    room to how many of its own bytes have landed. A sender that predates these fields (or a one-sided backend) sends
    neither: no progress information."""
    worker_id: Name
    incarnation: Name
    seq: Count
    rooms: Annotated[dict[Room, Name], _FROM_PAIRS, Field(max_length=MAX_ROOMS_PER_MSG), _TO_PAIRS] = \
        field(default_factory=dict)
    progress: Annotated[dict[Room, Count], _FROM_PAIRS, Field(max_length=MAX_ROOMS_PER_MSG), _TO_PAIRS] = \
        field(default_factory=dict)
    landed: Count = 0


NOTICE_KINDS = ("aborted", "failed")


@message("Notice")
@dataclass(frozen=True)
class Notice(Message):
    """Both ways: the sender ended (room, epoch) early. `reason` is the sender's reason."""
    room: Room
    epoch: Epoch
    kind: Literal[NOTICE_KINDS]
    reason: Name


TopLogprobs = Annotated[tuple[tuple[TokenId, Number], ...], Field(max_length=MAX_TOP_LOGPROBS)]


@dataclass(frozen=True)
class FirstToken:
    """A choice's first token, sampled on P, with its logprob and top alternatives."""
    token: TokenId
    logprob: Number | None = None
    top_logprobs: TopLogprobs = ()


@message("Aux")
@dataclass(frozen=True)
class Aux(Message):
    """P -> D, sent LAST: its arrival means all of the room's KV has landed. The first
    token (logprob, top alternatives) is choice 0's; a request of n > 1 choices, prefilled
    and sent once, carries choices 1..n-1's first tokens in `more_choices`, in order.
    `kv_crc` (P's --verify-kv): the CRC-32 of the room's pages as P sent them, in order;
    D decodes only if its own pages agree."""
    room: Room
    epoch: Epoch
    first_token: TokenId
    logprob: Number | None = None
    top_logprobs: TopLogprobs = ()
    prompt_tokens: Count = 0
    more_choices: Annotated[tuple[FirstToken, ...], Field(max_length=MAX_CHOICES - 1)] = ()
    kv_crc: Annotated[int, Field(strict=True, ge=0, le=0xFFFFFFFF)] | None = None   # --verify-kv: CRC-32 of the pages

    def first_tokens(self) -> list[FirstToken]:
        """Every choice's first token, choice 0 first."""
        return [FirstToken(self.first_token, self.logprob, self.top_logprobs), *self.more_choices]


@message("Ack")
@dataclass(frozen=True)
class Ack(Message):
    """D -> P: KV and aux received; P may free its source pages."""
    room: Room
    epoch: Epoch


@message("Stopped")
@dataclass(frozen=True)
class Stopped(Message):
    """P -> D: P will write nothing more into (room, epoch); ends a one-sided quarantine."""
    room: Room
    epoch: Epoch
