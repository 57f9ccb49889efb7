"""HTTP connections, bounded and timed. Every server kvrelay runs (the router's front door,
each worker's HTTP port) accepts connections through a `BoundedHttp` subclass of its own
(`bounded_protocol`), which applies the ServerConfig limits:

- --header-timeout: from connecting, or from the first byte after a response, until a
  request's headers are complete; a slower connection is closed without an answer (a
  connection that never speaks included).
- --timeout-keep-alive: uvicorn's own timer, from a response's end to the next byte.
- --body-timeout: a request body that goes this long without a byte: 408, then closed.
- --max-connections, --max-connections-per-client: a new connection beyond either cap
  closes the longest-idle connection (of its client, of the server); when none is idle,
  it is answered 503 and closed.
- --limit-concurrency: requests in flight; a request beyond it is answered 503. Idle
  connections do not count.
- MAX_HEADER_BYTES (no flag): a request line and headers longer than it: 431, then closed.

Every answer is an OpenAI error body (`errors.error_response`). uvicorn's own
limit_concurrency must stay off: it counts idle connections and answers text/plain.

The protocol is uvicorn's httptools one (httptools is a kvrelay dependency, and uvicorn's
own pick when installed): its parser calls back at a request's first byte, at its headers'
end, per body chunk and at its end, the points these timers need; h11's sees whole events.
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvrelay.core.config import ServerConfig
from kvrelay.server.errors import OpenAIError, error_response, retry_headers

log = logging.getLogger("kvrelay.server")

LOG_EVERY_S = 10.0   # at most one line of limit events per server this often (a flood is not a log flood)
CLOCK_SLACK = 0.01   # a loop timer may fire up to a clock tick before its deadline
# A request line and headers longer than this: 431, then closed. httptools keeps them all in
# memory and has no cap of its own (h11's is 16 KiB; nginx's 32 KiB).
MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Admission:
    accepted: bool
    shed: tuple[int, ...] = ()   # connections to close so that this one fits


class ConnectionPolicy:
    """Which connection to shed or refuse: pure, over connection ids, client addresses and
    a clock. A connection is busy from its request's headers until its response's end,
    and idle otherwise (connecting, sending headers, between requests). Invariants
    (`check_integrity`): every open connection is idle or busy, never both; no address
    holds more than `max_per_client`, nor the server more than `max_total`, connections;
    a busy connection is never shed."""

    def __init__(self, max_total: int, max_per_client: int, max_in_flight: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_total, self.max_per_client, self.max_in_flight = max_total, max_per_client, max_in_flight
        self.clock = clock
        self._address: dict[int, str] = {}
        self._count: Counter[str] = Counter()
        self._idle: OrderedDict[int, float] = OrderedDict()   # id -> idle since; longest idle first
        self._idle_of: dict[str, OrderedDict[int, None]] = {}   # the same, per address
        self._busy: set[int] = set()

    @property
    def open(self) -> int:
        return len(self._address)

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    def count(self, address: str) -> int:
        return self._count[address]

    def is_busy(self, cid: int) -> bool:
        return cid in self._busy

    def idle_for(self, cid: int) -> float | None:
        since = self._idle.get(cid)
        return None if since is None else self.clock() - since

    def admit(self, cid: int, address: str) -> Admission:
        """Open `cid` (idle) unless both caps cannot be kept; the connections to close
        first, which are already forgotten here."""
        shed: list[int | None] = []
        if self._count[address] >= self.max_per_client:
            shed.append(_first(self._idle_of.get(address, ()), ()))
        if self.open - len(shed) >= self.max_total:
            shed.append(_first(self._idle, shed))
        if None in shed:
            return Admission(False)
        for victim in shed:
            self.close(victim)
        self._address[cid] = address
        self._count[address] += 1
        self._set_idle(cid)
        return Admission(True, tuple(shed))   # type: ignore[arg-type]

    def requests_full(self) -> bool:
        """A request starting now would be one more than --limit-concurrency."""
        return self.in_flight >= self.max_in_flight

    def busy(self, cid: int) -> None:
        if cid in self._address:
            self._unset_idle(cid)
            self._busy.add(cid)

    def idle(self, cid: int) -> None:
        if cid in self._busy:
            self._busy.discard(cid)
            self._set_idle(cid)

    def close(self, cid: int) -> None:
        """Forget `cid`; a second call is a no-op (shed connections are closed twice)."""
        if cid not in self._address:
            return
        self._busy.discard(cid)
        self._unset_idle(cid)
        address = self._address.pop(cid)
        self._count[address] -= 1
        if not self._count[address]:
            del self._count[address]

    def check_integrity(self) -> None:
        assert not (self._busy & self._idle.keys()), "a connection both busy and idle"
        assert set(self._address) == self._busy | self._idle.keys(), "an open connection neither busy nor idle"
        assert Counter(self._address.values()) == self._count, "per-address counts drifted"
        assert sum(len(ids) for ids in self._idle_of.values()) == len(self._idle), "per-address idle drifted"
        assert self.open <= self.max_total and all(n <= self.max_per_client for n in self._count.values())

    def _set_idle(self, cid: int) -> None:
        self._idle[cid] = self.clock()
        self._idle_of.setdefault(self._address[cid], OrderedDict())[cid] = None

    def _unset_idle(self, cid: int) -> None:
        if self._idle.pop(cid, None) is None:
            return
        ids = self._idle_of[self._address[cid]]
        del ids[cid]
        if not ids:
            del self._idle_of[self._address[cid]]


def _first(ordered, exclude) -> int | None:
    return next((cid for cid in ordered if cid not in exclude), None)


def client_address(client: tuple[str, int] | None) -> str:
    """The key a client's connections are counted under: its IPv4 address, or its IPv6 /64
    (one host's share of a network; one address each would let one host open 2^64 x the
    cap)."""
    if client is None:
        return ""   # a Unix socket: every peer is the same client
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return client[0]
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)


class LimitEvents:
    """Totals of each limit event on one server; a warning with the counts since the last
    one, at most every LOG_EVERY_S."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self._logged: Counter[str] = Counter()
        self._at = -math.inf

    def add(self, event: str, now: float) -> None:
        self.total[event] += 1
        if now - self._at >= LOG_EVERY_S:
            since = self.total - self._logged
            self._logged, self._at = self.total.copy(), now
            log.warning("HTTP connection limits hit (counts since the last such line)", extra=dict(since))


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol under a `ConnectionPolicy`, with the header and body
    timers. Invariants: the header timer runs only while the connection is idle; the body
    timer from a request's headers until its body's end; `live` holds exactly the
    policy's open ids. One subclass per server carries that server's state."""

    limits: ServerConfig
    policy: ConnectionPolicy
    live: dict[int, BoundedHttp]
    events: LimitEvents
    _ids = itertools.count(1)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cid = next(self._ids)
        self._busy = self._in_headers = False
        self._header_timer = self._body_timer = None
        self._body_seen = 0.0
        self._header_bytes = 0   # received since the last request's headers ended, bodies aside

    # -- connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        admission = self.policy.admit(self.cid, client_address(self.client))
        if not admission.accepted:
            self.events.add("refused_connections", self.loop.time())
            self._answer(OpenAIError(503, f"too many connections (--max-connections {self.policy.max_total}, "
                                          f"--max-connections-per-client {self.policy.max_per_client}) and none "
                                          "idle; retry later", None, "too_many_connections", retry_headers(503)))
            return
        for victim in admission.shed:
            self.live.pop(victim).transport.close()
            self.events.add("shed_idle", self.loop.time())
        self.live[self.cid] = self
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self.policy.close(self.cid)
        self.live.pop(self.cid, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self._arm_header_timer()   # uvicorn's keep-alive timer ends at this byte; ours takes over
        if self._body_timer is None:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._headers_too_large()

    # -- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._in_headers, self._header_bytes = False, 0
        starting = not self._busy   # a pipelined request waits for this one: not one more in flight
        refuse = starting and self.policy.requests_full()
        if starting:
            self._busy = True
            self.policy.busy(self.cid)
        app = self.app
        if refuse:
            self.app = self._too_many_requests   # super() reads self.app for this request only
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        self._body_seen = self.loop.time()
        self._cancel_body_timer()
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timeout)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_seen = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_body_timer()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined:
            self._busy = False
            self.policy.idle(self.cid)
            if self._in_headers:
                self._arm_header_timer()   # the next request's first bytes came during this one

    # -- timers
    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._busy and not self.transport.is_closing():
            self.events.add("header_timeouts", self.loop.time())
            self.transport.close()

    def _body_timeout(self) -> None:
        """No body byte for --body-timeout: 408 unless a response has started, then close.
        While reading is paused the app is the slow one, so the wait starts again."""
        now, timeout = self.loop.time(), self.limits.body_timeout
        if self.flow.read_paused:
            self._body_seen = now
        if self._body_seen + timeout - now > CLOCK_SLACK:
            self._body_timer = self.loop.call_at(self._body_seen + timeout, self._body_timeout)
            return
        self._body_timer = None
        self.events.add("body_timeouts", now)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._answer(OpenAIError(408, f"the request body sent no byte for {timeout:g} s (--body-timeout)",
                                     None, "body_timeout"))
        else:
            self.transport.close()
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True   # the app's receive() sees http.disconnect, its send() goes nowhere
            cycle.message_event.set()

    def _headers_too_large(self) -> None:
        self.events.add("headers_too_large", self.loop.time())
        if self._busy:
            self.transport.close()   # a pipelined request's: an answer now would cut into the response in flight
            return
        self._answer(OpenAIError(431, f"the request line and headers are longer than {MAX_HEADER_BYTES} bytes",
                                 None, "headers_too_large"))

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()

    # -- answers
    def _answer(self, err: OpenAIError) -> None:
        """Write `err` as a whole response straight to the transport, then close it."""
        response = error_response(err)
        headers = [*self.server_state.default_headers, *response.headers.raw, (b"connection", b"close")]
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(STATUS_LINE[err.status] + head + b"\r\n" + response.body)
        self.transport.close()

    async def _too_many_requests(self, scope, receive, send) -> None:
        self.events.add("refused_requests", self.loop.time())
        response = error_response(OpenAIError(503, f"more than {self.policy.max_in_flight} requests in flight "
                                                   "(--limit-concurrency); retry later", None, "overloaded",
                                              retry_headers(503)))
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def bounded_protocol(limits: ServerConfig) -> type[BoundedHttp]:
    """A `BoundedHttp` subclass for one server (uvicorn's `http=`): `limits`' timeouts and
    caps, and a policy and connection table of its own."""
    policy = ConnectionPolicy(limits.max_connections, limits.max_connections_per_client, limits.limit_concurrency)
    return type("BoundedHttp", (BoundedHttp,), dict(limits=limits, policy=policy, live={}, events=LimitEvents()))
