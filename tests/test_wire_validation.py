"""Hostile input on a worker's control and transfer port (issue #10, findings 1, 2, 3 and
the transfer-port part of 8): a malformed, foreign or oversize frame is dropped at the
edge and counted; it never reaches the scheduler loop, never fails another request, and
never makes the worker open a socket. The attacker is a real zmq PUSH socket (or a raw
TCP connection speaking ZMTP) against live prefill/decode worker cores on a tiny model."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time

import pytest
import zmq

from test_worker_cores import Pair, colocated, greedy, tokens
from kvrelay.disagg import wire

SRC = "tcp://127.0.0.1:1"


def frame(kind: str, body: dict, src: str = SRC) -> bytes:
    return json.dumps({"v": wire.WIRE_VERSION, "kind": kind, "src": src, "body": body}).encode()


LAYOUT = {"model_id": "m", "dtype": "float32", "page_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
HB = {"worker_id": "w", "incarnation": "i", "seq": 1, "rooms": [[5, "waiting"]]}


def rejected(surface: str = "control", reason: str | None = None) -> float:
    from kvrelay.obs.metrics import rejected_count
    return rejected_count(surface, reason)


def push(address: str, frames: list[bytes]) -> None:
    """Send each frame from a fresh PUSH socket and wait until it has left."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    for f in frames:
        sock.send(f)
    sock.close(linger=2000)


def sockets_of(engine) -> list[str]:
    return engine.call(lambda c: list(c.manager.channel.inner._push), timeout=10)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def serve_while(pair: Pair, reqs, attack, seconds: float = 0.0):
    """Run `reqs` (each after the previous one while `seconds` lasts) with `attack()`
    called repeatedly alongside; -> [(prefill outs, decode outs)] per request."""
    stop = asyncio.Event()

    async def attacker():
        while not stop.is_set():
            await asyncio.to_thread(attack)
            await asyncio.sleep(0.05)

    task = asyncio.create_task(attacker())
    deadline = time.monotonic() + seconds
    try:
        results = list(await asyncio.gather(*(pair.run(g) for g in reqs)))
        while time.monotonic() < deadline:  # keep serving over several heartbeat intervals
            results.append(await pair.run(reqs[len(results) % len(reqs)]))
    finally:
        stop.set()
        await task
    return results


def assert_served(results, reqs, expected: dict[str, list[int]]) -> None:
    for p_outs, d_outs in results:
        assert all(o.error is None for o in p_outs + d_outs), [o.error for o in p_outs + d_outs if o.error]
        rid = d_outs[-1].rid
        assert tokens(d_outs) == expected[rid], rid


def baseline(tiny_engine, reqs) -> dict[str, list[int]]:
    async def main():
        return {g.rid: tokens(await colocated(tiny_engine, g)) for g in reqs}
    return asyncio.run(main())


@pytest.fixture
def tcp_pair(tiny_loaded):
    p = Pair(tiny_loaded, "tcp")
    yield p
    p.close()


REQS = [greedy(f"r{i}", range(3 + i, 40 + 5 * i), n=16) for i in range(4)]


# ---- finding 1: a well-formed frame with a wrong field type --------------------------

@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_malformed_frames_fail_no_request(tiny_loaded, tiny_engine, backend):
    pair = Pair(tiny_loaded, backend)
    try:
        expected = baseline(tiny_engine, REQS)
        bad = [frame("Notice", {"room": {"a": 1}, "epoch": 0, "kind": "failed", "reason": "x"}),
               frame("BootstrapQuery", {"worker_id": "d", "incarnation": "i", "layout": {}, "backend": backend}),
               frame("Aux", {"room": 5, "epoch": True, "first_token": 1}),
               frame("Heartbeat", {**HB, "rooms": {"5": "waiting"}})]
        before = rejected("control", "bad_field")

        def attack():
            for address in (pair.paddr, pair.D.core.manager.address):
                push(address, bad)

        results = asyncio.run(serve_while(pair, REQS, attack))
        assert_served(results, REQS, expected)
        pair.assert_idle()
        assert rejected("control", "bad_field") >= before + 8
    finally:
        pair.close()


# ---- finding 2: a src that is not an endpoint --------------------------------------------

def test_bad_src_creates_no_socket_and_keeps_serving(tcp_pair, tiny_engine):
    expected = baseline(tiny_engine, REQS)
    bad_srcs = ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:port", "tcp://", "garbage", "tcp://a b:1", "x" * 5000]
    before = rejected("control", "bad_src")
    frames = [frame(kind, body, src) for src in bad_srcs
              for kind, body in (("Heartbeat", HB), ("Destination", {"room": 5, "epoch": 1, "dst_pages": [0],
                                                                     "decode_id": "d", "incarnation": "i"}))]

    def attack():
        for address in (tcp_pair.paddr, tcp_pair.D.core.manager.address):
            push(address, frames)

    results = asyncio.run(serve_while(tcp_pair, REQS, attack, seconds=6 * 0.2))  # six heartbeat intervals
    assert_served(results, REQS, expected)
    for engine in (tcp_pair.P, tcp_pair.D):
        assert not set(sockets_of(engine)) & set(bad_srcs)
    tcp_pair.assert_idle()
    assert rejected("control", "bad_src") >= before + len(frames)


# ---- finding 3: a flood of fake senders ------------------------------------------------

def test_heartbeats_from_1100_fake_senders_open_no_socket(tcp_pair, tiny_engine):
    expected = baseline(tiny_engine, REQS)
    fds = open_fds()
    before = rejected("control", "unknown_peer")
    sent = []

    def attack():
        if len(sent) < 1100 * 2:
            batch = [frame("Heartbeat", HB, f"tcp://127.0.0.1:{20000 + len(sent) // 2 + i}") for i in range(275)]
            for address in (tcp_pair.paddr, tcp_pair.D.core.manager.address):
                push(address, batch)
                sent.extend(batch)

    results = asyncio.run(serve_while(tcp_pair, REQS, attack, seconds=1.0))
    while len(sent) < 1100 * 2:
        attack()
    assert_served(results, REQS, expected)
    for engine in (tcp_pair.P, tcp_pair.D):
        assert len(sockets_of(engine)) <= 1, sockets_of(engine)   # only the real peer
    assert open_fds() < fds + 50
    tcp_pair.assert_idle()
    deadline = time.monotonic() + 10
    while rejected("control", "unknown_peer") < before + 2200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rejected("control", "unknown_peer") >= before + 2200


# ---- finding 8: an oversize (half-sent) frame on the transfer port ---------------------

def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def zmtp_push(address: str) -> socket.socket:
    """A raw TCP connection that has done the ZMTP 3.0 NULL handshake as a PUSH socket."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    _recv_exact(s, 64)
    name, value = b"Socket-Type", b"PUSH"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    s.sendall(bytes([0x04, len(body)]) + body)
    flags = _recv_exact(s, 1)[0]
    size = struct.unpack(">Q", _recv_exact(s, 8))[0] if flags & 0x02 else _recv_exact(s, 1)[0]
    _recv_exact(s, size)
    return s


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_oversize_frame_is_refused_before_it_is_buffered(tcp_pair, tiny_engine):
    expected = baseline(tiny_engine, REQS[:1])
    d_address = tcp_pair.D.core.manager.address
    start = rss()
    s = zmtp_push(d_address)
    chunk = memoryview(bytes(1 << 20))
    sent = 0
    try:
        s.sendall(bytes([0x02]) + struct.pack(">Q", 512 << 20))  # one frame of 512 MiB, half-sent
        for _ in range(96):
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass  # the worker dropped the connection: what should happen
    time.sleep(0.5)
    grown = rss() - start
    s.close()
    assert grown < 32 << 20, f"RSS grew by {grown >> 20} MiB after {sent >> 20} MiB of a 512 MiB frame"
    results = asyncio.run(serve_while(tcp_pair, REQS[:1], lambda: None))
    assert_served(results, REQS[:1], expected)
    tcp_pair.assert_idle()


# ---- the decoder itself -----------------------------------------------------------------

DEST = {"room": 5, "epoch": 1, "dst_pages": [0, 1], "decode_id": "d", "incarnation": "i"}


@pytest.mark.parametrize("data,reason", [
    (None, "too_large"),  # MAX_FRAME_BYTES + 1 bytes
    (b"\xff\xfe", "bad_json"),
    (b"[1, 2]", "bad_json"),
    (json.dumps({"v": True, "kind": "Ack", "src": SRC, "body": {}}).encode(), "bad_version"),
    (frame("Nope", {}), "unknown_kind"),
    (frame("Ack", {"room": 1, "epoch": 1}, src="tcp://host:0"), "bad_src"),
    (frame("Ack", {"room": 0, "epoch": 1}), "bad_field"),
    (frame("Ack", {"room": 2**63, "epoch": 1}), "bad_field"),
    (frame("Ack", {"room": 1.0, "epoch": 1}), "bad_field"),
    (frame("Ack", {"room": "1", "epoch": 1}), "bad_field"),
    (frame("Ack", {"room": 1, "epoch": -1}), "bad_field"),
    (frame("Ack", {"room": 1}), "bad_field"),
    (frame("Notice", {"room": 1, "epoch": 1, "kind": "exploded", "reason": "x"}), "bad_field"),
    (frame("Notice", {"room": 1, "epoch": 1, "kind": "failed", "reason": "x" * 1000}), "bad_field"),
    (frame("Destination", {**DEST, "dst_pages": [0, -1]}), "bad_field"),
    (frame("Destination", {**DEST, "dst_pages": [0, 2**40]}), "bad_field"),
    (frame("Destination", {**DEST, "dst_pages": "01"}), "bad_field"),
    (frame("BootstrapQuery", {"worker_id": "d", "incarnation": "i", "layout": {**LAYOUT, "dtype": "int4"},
                              "backend": "tcp"}), "bad_field"),
    (frame("BootstrapQuery", {"worker_id": "d", "incarnation": "i", "layout": LAYOUT, "backend": "tcp",
                              "endpoint": {"bytes": [1]}}), "bad_field"),
    (frame("Heartbeat", {**HB, "rooms": [[5, "waiting", 1]]}), "bad_field"),
    (frame("Aux", {"room": 1, "epoch": 1, "first_token": 1, "logprob": "nan"}), "bad_field"),
    (frame("Aux", {"room": 1, "epoch": 1, "first_token": 1, "top_logprobs": [[1, -1.0, 3]]}), "bad_field"),
    (frame("Aux", {"room": 1, "epoch": 1, "first_token": 1, "kv_crc": 2**32}), "bad_field"),
    (frame("Aux", {"room": 1, "epoch": 1, "first_token": 1, "kv_crc": -1}), "bad_field"),
    (frame("Aux", {"room": 1, "epoch": 1, "first_token": 1, "kv_crc": "12ab"}), "bad_field"),
    (frame("TcpKV", {"room": 1, "epoch": 1, "first_page": 0, "num_pages": 0}), "bad_field"),
    (frame("TcpKV", {"room": 1, "epoch": 1, "first_page": 0, "num_pages": 1, "span_offset": 64}), "bad_field"),
    (frame("TcpKV", {"room": 1, "epoch": 1, "first_page": 0, "num_pages": 1, "span_length": -1}), "bad_field"),
    (b"[" * 100_000, "bad_json"),
])
def test_decode_rejects_with_a_reason(data, reason):
    import kvrelay.disagg.transfer.tcp  # noqa: F401 - registers TcpKV
    data = b"x" * (wire.MAX_FRAME_BYTES + 1) if data is None else data
    with pytest.raises(wire.WireError) as e:
        wire.decode(data, schemes=("tcp",))
    assert e.value.reason == reason


@pytest.mark.parametrize("address,ok", [
    ("tcp://127.0.0.1:5555", True), ("tcp://worker-3.example:80", True), ("tcp://[::1]:9", True),
    ("tcp://127.0.0.1:0", False), ("tcp://127.0.0.1:65536", False), ("tcp://300.1.1.1:5", False),
    ("tcp://*:5", False), ("tcp://-a:5", False), ("tcp://[zz]:5", False), ("ipc:///tmp/x", False),
    ("tcp://a:5 ", False), (5, False),
])
def test_valid_endpoint(address, ok):
    assert wire.valid_endpoint(address, ("tcp",)) is ok
