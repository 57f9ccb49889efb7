"""Connections are bounded and timed (`server.connections`): the policy alone under a fake
clock, then a real uvicorn server with the options every serving command uses, driven over
raw sockets so that every byte, timeout and close is the test's own."""
from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import select
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn
from fastapi import FastAPI, Request

from kvrelay.core.config import ServerConfig
from kvrelay.server.connections import MAX_HEADER_BYTES, Admission, ConnectionPolicy, client_address
from kvrelay.server.startup import FD_RESERVE, uvicorn_options
from serving_helpers import free_port

GRACE = 5.0   # "closed within its timeout + GRACE": a bound for a loaded machine, not a timing claim


# -- the policy, pure ---------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def policy(total=10, per_client=3, in_flight=5) -> tuple[ConnectionPolicy, FakeClock]:
    clock = FakeClock()
    return ConnectionPolicy(total, per_client, in_flight, clock), clock


def test_policy_sheds_the_clients_longest_idle_connection_never_a_busy_one():
    p, clock = policy(per_client=3)
    for cid in (1, 2, 3):
        clock.t += 1
        assert p.admit(cid, "a") == Admission(True)
    p.busy(1)   # the oldest, but busy
    clock.t += 1
    assert p.admit(4, "a") == Admission(True, (2,))
    assert p.admit(5, "b") == Admission(True)   # another client's cap is its own
    assert (p.open, p.count("a"), p.count("b")) == (4, 3, 1)
    assert p.admit(6, "a") == Admission(True, (3,))
    assert p.admit(7, "a") == Admission(True, (4,))
    assert p.is_busy(1) and p.count("a") == 3
    p.check_integrity()


def test_policy_sheds_the_servers_longest_idle_connection_at_the_total_cap():
    p, clock = policy(total=3, per_client=3)
    for cid, address in ((1, "a"), (2, "b"), (3, "b")):
        clock.t += 1
        p.admit(cid, address)
    assert p.admit(4, "c") == Admission(True, (1,))   # "a"'s, the longest idle of all
    p.busy(2)
    assert p.admit(5, "c") == Admission(True, (3,))
    assert (p.count("a"), p.count("b"), p.count("c")) == (0, 1, 2)
    p.check_integrity()


def test_policy_refuses_when_nothing_is_idle_and_then_changes_nothing():
    p, _ = policy(total=4, per_client=2)
    for cid, address in ((1, "a"), (2, "a"), (3, "b"), (4, "b")):
        p.admit(cid, address)
    p.busy(1)
    p.busy(2)
    assert p.admit(5, "a") == Admission(False)   # "a" is full and busy, though "b" has idle ones
    p.busy(3)
    p.busy(4)
    assert p.admit(6, "c") == Admission(False)   # the server is full and busy
    assert (p.open, p.in_flight) == (4, 4)
    p.idle(3)
    assert p.admit(6, "c") == Admission(True, (3,))
    p.check_integrity()


def test_policy_a_connection_idle_again_goes_to_the_back_of_the_line():
    p, clock = policy(per_client=2)
    p.admit(1, "a")
    clock.t = 5
    p.admit(2, "a")
    assert p.idle_for(1) == 5 and p.idle_for(2) == 0
    p.busy(1)
    assert p.idle_for(1) is None
    clock.t = 7
    p.idle(1)   # its response ended: idle since 7, after 2's 5
    clock.t = 8
    assert p.idle_for(1) == 1 and p.idle_for(2) == 3
    assert p.admit(3, "a") == Admission(True, (2,))
    p.check_integrity()


def test_policy_counts_requests_in_flight_not_connections():
    p, _ = policy(total=100, per_client=100, in_flight=2)
    for cid in range(50):
        p.admit(cid, "a")
    assert p.in_flight == 0 and not p.requests_full()   # 50 idle connections are no requests
    p.busy(0)
    p.busy(1)
    assert p.in_flight == 2 and p.requests_full()
    p.close(1)
    assert p.in_flight == 1 and not p.requests_full()
    p.check_integrity()


def test_policy_close_is_idempotent_and_forgets_every_trace():
    p, _ = policy()
    p.admit(1, "a")
    p.busy(1)
    p.close(1)
    p.close(1)
    p.busy(1)   # a late callback of a closed connection changes nothing
    p.idle(1)
    assert (p.open, p.in_flight, p.count("a"), p.idle_for(1)) == (0, 0, 0, None)
    p.check_integrity()


def test_client_address_counts_ipv4_hosts_and_ipv6_slash_64s():
    assert client_address(("10.0.0.7", 5000)) == "10.0.0.7"
    assert client_address(("2001:db8::1", 1)) == client_address(("2001:db8::ffff:1", 2)) == "2001:db8::/64"
    assert client_address(("2001:db8:0:1::1", 1)) != client_address(("2001:db8::1", 1))
    assert client_address(None) == ""


# -- start-up options -----------------------------------------------------------------------

def test_the_open_file_limit_is_raised_and_max_connections_kept_below_it():
    opts = uvicorn_options(ServerConfig(max_connections=10 ** 9))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard
    assert opts["http"].policy.max_total == soft - min(FD_RESERVE, soft // 2) < soft
    default = uvicorn_options(ServerConfig())["http"].policy
    assert default.max_total == min(4096, soft - min(FD_RESERVE, soft // 2))
    assert (default.max_per_client, default.max_in_flight) == (2048, 2048)
    assert opts["limit_concurrency"] is None and opts["ws"] == "none"


# -- a real server ----------------------------------------------------------------------------

def make_app(release: threading.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/slow")
    async def slow() -> dict:
        while not release.is_set():   # a request in flight until the test lets it end
            await asyncio.sleep(0.02)
        return {"slow": "done"}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    return app


@dataclass
class Served:
    port: int
    http: type
    release: threading.Event

    @property
    def policy(self) -> ConnectionPolicy:
        return self.http.policy

    def events(self, name: str) -> int:
        return self.http.events.total[name]


@contextlib.contextmanager
def serving(**limits):
    """A tiny app on uvicorn in a thread, with `uvicorn_options` of ServerConfig(**limits)."""
    srv = ServerConfig(port=free_port(), log_level="warning", **limits)
    opts = uvicorn_options(srv)
    release = threading.Event()
    server = uvicorn.Server(uvicorn.Config(make_app(release), **opts))
    thread = threading.Thread(target=server.run, name="uvicorn-connections", daemon=True)
    thread.start()
    try:
        until(lambda: server.started or not thread.is_alive(), 30)
        assert server.started, "uvicorn did not start"
        yield Served(srv.port, opts["http"], release)
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class Client:
    """One raw HTTP/1.1 connection."""

    def __init__(self, port: int, source: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def get(self, path: str) -> None:
        self.send(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())

    def response(self, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        self.sock.settimeout(timeout)
        status = int(self.file.readline().split()[1])
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers, self.file.read(int(headers.get("content-length", 0)))

    def closed(self) -> bool:
        """The server closed this connection (nothing unread before its end)."""
        poll = select.poll()   # not select.select: it refuses descriptors past 1023
        poll.register(self.sock, select.POLLIN)
        if not poll.poll(0):
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except ConnectionResetError:
            return True

    def rest(self) -> bytes:
        """Whatever the server sends until it closes (b'': it closed without an answer)."""
        self.sock.settimeout(30)
        try:
            return self.file.read()
        except ConnectionResetError:
            return b""

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def json_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    """The OpenAI error of a response that must be `expected`, JSON, never text/plain."""
    assert status == expected, body
    assert headers["content-type"] == "application/json" and headers.get("connection") == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def health_ok(client: Client) -> None:
    client.get("/health")
    status, headers, body = client.response()
    assert (status, headers["content-type"], json.loads(body)) == (200, "application/json", {"status": "ok"})


@contextlib.contextmanager
def clients():
    opened: list[Client] = []
    try:
        yield opened
    finally:
        for c in opened:
            c.close()


def open_idle(served: Served, opened: list[Client], n: int) -> list[Client]:
    """`n` silent connections, one at a time: each is accounted for by the server (open,
    or having shed one, or refused) before the next connects, so the server sees them in
    this order."""
    def accounted() -> int:
        return served.policy.open + served.events("shed_idle") + served.events("refused_connections")

    flood, before = [], accounted()
    for i in range(n):
        flood.append(Client(served.port))
        opened.append(flood[-1])
        until(lambda: accounted() == before + i + 1)
    return flood


def test_a_flood_of_idle_connections_sheds_the_clients_longest_idle_and_new_clients_get_in():
    cap = 50
    with serving(max_connections=1000, max_connections_per_client=cap, header_timeout=120) as s, clients() as opened:
        flood = open_idle(s, opened, 3 * cap)
        until(lambda: all(c.closed() for c in flood[:2 * cap]))
        assert [c.closed() for c in flood] == [True] * (2 * cap) + [False] * cap
        assert all(c.rest() == b"" for c in flood[:5])   # shed without an answer
        other = Client(s.port, source="127.0.0.2")   # another client: the flood's cap is not its
        opened.append(other)
        health_ok(other)
        assert (s.policy.count("127.0.0.1"), s.policy.count("127.0.0.2")) == (cap, 1)
        same = Client(s.port)   # the flooding address again: its own longest idle makes room
        opened.append(same)
        health_ok(same)
        until(lambda: flood[2 * cap].closed())
        assert not any(c.closed() for c in flood[2 * cap + 1:])
        assert s.events("shed_idle") == 2 * cap + 1 and s.events("refused_connections") == 0
        s.policy.check_integrity()


def test_a_flood_beyond_max_connections_sheds_the_servers_longest_idle():
    cap = 50
    with serving(max_connections=cap, max_connections_per_client=1024, header_timeout=120) as s, \
            clients() as opened:
        flood = open_idle(s, opened, 3 * cap)
        until(lambda: all(c.closed() for c in flood[:2 * cap]))
        assert [c.closed() for c in flood] == [True] * (2 * cap) + [False] * cap
        other = Client(s.port, source="127.0.0.2")
        opened.append(other)
        health_ok(other)
        until(lambda: flood[2 * cap].closed())
        assert s.policy.open == cap and s.policy.count("127.0.0.2") == 1
        s.policy.check_integrity()


def test_a_connection_with_a_request_in_flight_is_never_shed_and_none_idle_means_503_json():
    cap = 5
    with serving(max_connections=1000, max_connections_per_client=cap, header_timeout=120) as s, \
            clients() as opened:
        busy = [Client(s.port) for _ in range(3)]
        opened.extend(busy)
        for c in busy:
            c.get("/slow")
        until(lambda: s.policy.in_flight == 3)
        flood = open_idle(s, opened, 12)
        assert not any(c.closed() for c in busy) and s.events("shed_idle") == 10
        for c in flood[-2:]:   # now every connection of the client is busy
            c.get("/slow")
        until(lambda: s.policy.in_flight == cap)
        refused = Client(s.port)
        opened.append(refused)
        error = json_error(*refused.response(), 503)
        assert error["code"] == "too_many_connections" and error["type"] == "overloaded_error"
        assert refused.rest() == b"" and s.events("refused_connections") == 1
        s.release.set()
        for c in busy + flood[-2:]:
            status, _, body = c.response()
            assert (status, json.loads(body)) == (200, {"slow": "done"})
        until(lambda: s.policy.in_flight == 0)
        assert s.events("shed_idle") == 10
        s.policy.check_integrity()


def test_slow_headers_and_silent_connections_are_closed_after_header_timeout():
    timeout = 1.0
    with serving(header_timeout=timeout, timeout_keep_alive=60) as s, clients() as opened:
        silent, trickler = Client(s.port), Client(s.port)
        opened += [silent, trickler]
        head = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"
        sent, start = 0, time.monotonic()
        while not trickler.closed() and time.monotonic() - start < timeout + GRACE:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                trickler.send(head[sent:sent + 1])
                sent += 1
            time.sleep(0.3)
        assert trickler.closed() and sent < len(head)   # closed while its headers were still coming
        assert trickler.rest() == b""
        until(silent.closed, timeout + GRACE)
        assert silent.rest() == b""
        # After a response the idle timer is --timeout-keep-alive (60 s here), but the first
        # byte of a next request starts the header timer again.
        kept = Client(s.port)
        opened.append(kept)
        health_ok(kept)
        health_ok(kept)
        kept.send(b"G")
        until(kept.closed, timeout + GRACE)
        assert s.events("header_timeouts") == 3 and s.policy.open == 0


def test_an_idle_keep_alive_connection_is_closed_after_timeout_keep_alive():
    with serving(timeout_keep_alive=1.0, header_timeout=60) as s, clients() as opened:
        c = Client(s.port)
        opened.append(c)
        health_ok(c)
        until(c.closed, 1.0 + GRACE)
        assert c.rest() == b"" and s.events("header_timeouts") == 0


def test_a_body_that_stops_gets_408_json_and_one_that_keeps_coming_is_served():
    timeout = 1.0
    with serving(body_timeout=timeout) as s, clients() as opened:
        stalled, trickling = Client(s.port), Client(s.port)
        opened += [stalled, trickling]
        post = b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Type: text/plain\r\nContent-Length: 10\r\n\r\n"
        stalled.send(post + b"abc")
        error = json_error(*stalled.response(timeout + GRACE), 408)
        assert error["code"] == "body_timeout" and error["type"] == "invalid_request_error"
        assert stalled.rest() == b""
        trickling.send(post)
        for byte in b"0123456789":   # a byte every 0.1 s: never 1 s without one
            time.sleep(0.1)
            trickling.send(bytes([byte]))
        status, _, body = trickling.response()
        assert (status, json.loads(body)) == (200, {"size": 10})
        assert s.events("body_timeouts") == 1


def test_requests_beyond_limit_concurrency_get_503_json_and_idle_connections_do_not_count():
    with serving(limit_concurrency=2, header_timeout=60) as s, clients() as opened:
        idle = [Client(s.port) for _ in range(20)]
        opened += idle
        until(lambda: s.policy.open == 20)
        first = Client(s.port)
        opened.append(first)
        health_ok(first)   # 20 idle connections are not 20 requests
        slow = [Client(s.port) for _ in range(2)]
        opened += slow
        for c in slow:
            c.get("/slow")
        until(lambda: s.policy.in_flight == 2)
        third = Client(s.port)
        opened.append(third)
        third.get("/health")
        status, headers, body = third.response()
        error = json_error(status, headers, body, 503)
        assert error["code"] == "overloaded" and error["type"] == "overloaded_error"
        assert headers["retry-after"] == "1" and "text/plain" not in headers["content-type"]
        assert third.rest() == b""
        s.release.set()
        for c in slow:
            assert c.response()[0] == 200
        until(lambda: s.policy.in_flight == 0)
        health_ok(first)
        assert s.events("refused_requests") == 1 and not any(c.closed() for c in idle)


def test_headers_longer_than_the_cap_get_431_json_and_a_long_but_legal_one_is_served():
    with serving() as s, clients() as opened:
        legal, endless = Client(s.port), Client(s.port)
        opened += [legal, endless]
        legal.send(b"GET /health HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + b"k" * 16000 + b"\r\n\r\n")
        assert legal.response()[0] == 200
        endless.send(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(4 * MAX_HEADER_BYTES // 1024):
                endless.send(b"X-Pad: " + b"a" * 1015 + b"\r\n")
        error = json_error(*endless.response(), 431)
        assert error["code"] == "headers_too_large"
        assert s.events("headers_too_large") == 1
