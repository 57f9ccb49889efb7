"""The transfer/control port cannot be used to stall or bloat a worker (#53, findings 2, 4
and 10), with real zmq sockets, raw TCP connections and a worker-like process:

- junk floods (zmq NULL-mechanism senders, raw ZMTP connections) never reach a keyed
  channel's checks, and no recv() call does more than its budget, keyed or not;
- a forged auth frame costs a fixed-size hash, whatever the header behind it;
- endless unauthenticated multipart messages do not grow a keyed worker's memory;
- frames captured before a worker restarts are refused after it, and the restarted
  worker makes the peer that still names its old incarnation bootstrap again."""
from __future__ import annotations

import hmac
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import zmq

from disagg_helpers import LAYOUT, checksum, pattern
from kvrelay.core.config import TransferConfig
from kvrelay.core.keys import ClusterKey
from kvrelay.disagg import auth as auth_mod, wire
from kvrelay.disagg.auth import ChannelAuth
from kvrelay.disagg.channel import RECV_FRAMES, ZmqChannel
from kvrelay.disagg.transfer import create_manager
from kvrelay.disagg.transfer.base import TransferStatus as S, host_pool
from kvrelay.obs.metrics import rejected_count
from test_auth import Wall, plain_push, reason
from test_backends import PB, Pair, assert_idle

KEY = ClusterKey(b"the cluster's secret, 32 bytes..").control_key
PASSWORD = ChannelAuth(KEY).password


def _hb(seq: int) -> wire.Heartbeat:
    return wire.Heartbeat("w", "inc", seq, {})


# ---- junk senders ------------------------------------------------------------------------

def zmtp_hello(mechanism: bytes, password: bytes = b"") -> bytes:
    """What a raw ZMTP 3.0 client sends before its first frame: a greeting for `mechanism`,
    then READY (NULL) or HELLO (PLAIN)."""
    greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + bytes(31)
    if mechanism == b"PLAIN":
        body = b"\x05HELLO" + b"\x07kvrelay" + bytes([len(password)]) + password
    else:
        body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack("!I", 4) + b"PUSH"
    return greeting + bytes([0x04, len(body)]) + body


def more_frame(size: int) -> bytes:
    """The header of a ZMTP 3.0 data frame of `size` bytes with the MORE flag."""
    return b"\x03" + struct.pack("!Q", size)


class Flood:
    """Threads that hammer an address until stopped (or until `cap` bytes each)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.sent: list[int] = []

    def start(self, fn, *args) -> None:
        i = len(self.sent)
        self.sent.append(0)
        t = threading.Thread(target=fn, args=(i, *args), daemon=True)
        self.threads.append(t)
        t.start()

    def null_push(self, i: int, address: str) -> None:
        """A zmq PUSH without credentials sending one-byte frames as fast as it can."""
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while not self.stop.is_set():
                try:
                    sock.send(b"x", zmq.NOBLOCK)
                    self.sent[i] += 1
                except zmq.Again:
                    time.sleep(0.0005)
        finally:
            sock.close()

    def raw_zmtp(self, i: int, address: str, mechanism: bytes, frame: int, cap: int,
                 password: bytes = b"") -> None:
        """A raw TCP client: a ZMTP greeting, then one message of `frame`-byte frames that
        never ends (after `cap` bytes it holds the connection open, sending nothing); it
        reconnects whenever the server drops it, until stopped."""
        host, port = address[len("tcp://"):].rsplit(":", 1)
        payload = more_frame(frame) + bytes(frame)
        while not self.stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=1.0) as s:
                    s.sendall(zmtp_hello(mechanism, password))
                    while not self.stop.is_set():
                        if self.sent[i] < cap:
                            s.sendall(payload)
                            self.sent[i] += frame
                        else:
                            self.stop.wait(0.05)
            except OSError:
                time.sleep(0.01)

    def under_way(self, nbytes: int = 1000, limit: float = 30.0) -> bool:
        """Wait until every sender has sent something, `nbytes` in all."""
        deadline = time.monotonic() + limit
        while not (min(self.sent) > 0 and sum(self.sent) > nbytes) and time.monotonic() < deadline:
            time.sleep(0.01)
        return time.monotonic() < deadline

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def counting_opens(ch: ZmqChannel) -> list[int]:
    """Hook: how many messages each recv() call of `ch` judged (accepted or not)."""
    calls: list[int] = [0]
    real_open, real_recv = ch._open, ch.recv

    def _open(parts, schemes):
        calls[-1] += 1
        return real_open(parts, schemes)

    def recv(max_n: int = 10_000):
        calls.append(0)
        return real_recv(max_n)
    ch._open, ch.recv = _open, recv   # type: ignore[method-assign]
    return calls


def receive(ch: ZmqChannel, until, limit: float = 30.0) -> list:
    got, deadline = [], time.monotonic() + limit
    while not until(got) and time.monotonic() < deadline:
        got += ch.recv()
        time.sleep(0.001)
    return got


# ---- finding 2: floods ---------------------------------------------------------------------

def test_junk_on_a_keyed_port_never_reaches_its_checks():
    """Two zmq senders without credentials and a raw ZMTP client flood a keyed channel with
    one-byte frames while a member sends it 300 messages: each arrives, in order, and not
    one junk frame is pulled off the socket (the handshake refused every junk connection)."""
    rx, tx = ZmqChannel(auth=ChannelAuth(KEY)), ZmqChannel(auth=ChannelAuth(KEY))
    calls = counting_opens(rx)
    flood = Flood()
    try:
        for _ in range(2):
            flood.start(flood.null_push, rx.address)
        flood.start(flood.raw_zmtp, rx.address, b"NULL", 1, 1 << 30)
        assert flood.under_way()
        got = []
        for seq in range(1, 301):
            assert tx.send(rx.address, _hb(seq))
            if seq % 30 == 0:
                got += receive(rx, lambda g: len(got) + len(g) >= seq)
        assert [r.msg.seq for r in got] == list(range(1, 301))
    finally:
        flood.close()
        rx.close()
        tx.close()
    assert sum(calls) == 300                   # nothing but the member's messages was opened
    assert max(calls) <= RECV_FRAMES


def test_an_unkeyed_port_judges_at_most_its_budget_per_call():
    """Without a key (loopback only) junk is let in, and rejected: one recv() call still
    judges at most RECV_FRAMES messages however many wait, and each is counted."""
    rx, tx = ZmqChannel(), ZmqChannel()
    calls = counting_opens(rx)
    flood = Flood()
    before = rejected_count("control", "bad_json")
    try:
        for _ in range(2):
            flood.start(flood.null_push, rx.address)
        assert flood.under_way(3 * RECV_FRAMES)   # a backlog bigger than one call's budget
        got = []
        for seq in range(1, 51):
            assert tx.send(rx.address, _hb(seq))
            got += rx.recv()
        got += receive(rx, lambda g: len(got) + len(g) >= 50)
        flood.stop.set()
        assert [r.msg.seq for r in got] == list(range(1, 51))
        assert max(calls) == RECV_FRAMES           # the budget, not the backlog, ended a call
        rx_rejected = rejected_count("control", "bad_json") - before
        assert rx_rejected == sum(calls) - 50      # every junk frame judged was counted
    finally:
        flood.close()
        rx.close()
        tx.close()


def test_a_message_of_too_many_frames_is_skipped_across_calls_within_the_budget(monkeypatch):
    """A message of more frames than any member sends is dropped whole ("too_many_frames"),
    and skipping its rest is charged to the budget of the calls it spans, which are small
    here: the message after it still arrives."""
    from kvrelay.disagg import channel
    monkeypatch.setattr(channel, "RECV_FRAMES", 4)
    rx, tx = ZmqChannel(), ZmqChannel()
    calls = counting_opens(rx)
    raw = plain_push(None)
    try:
        raw.connect(rx.address)
        before = rejected_count("control", "too_many_frames")
        raw.send_multipart([b"x"] * (channel.MAX_PARTS + 10))
        assert receive(rx, lambda g: rejected_count("control", "too_many_frames") > before) == []
        assert rx._skipping                      # 10 frames left, 4 a call
        assert tx.send(rx.address, _hb(1))
        assert [r.msg.seq for r in receive(rx, lambda g: g)] == [1]
        assert rejected_count("control", "too_many_frames") == before + 1
        assert sum(calls) == 1 and len(calls) >= 5   # only hb 1 was opened; skipping took calls
    finally:
        raw.close()
        rx.close()
        tx.close()


def test_junk_floods_on_both_ports_leave_a_transfer_whole():
    """Keyed P and D (tcp backend) move a room's KV while both transfer ports are flooded
    with one-byte frames (zmq senders and raw ZMTP connections): the room completes with
    exactly its bytes."""
    pair = Pair("tcp", num_pages=64, key=KEY)
    flood = Flood()
    try:
        for address in (pair.p.address, pair.d.address):
            flood.start(flood.null_push, address)
            flood.start(flood.raw_zmtp, address, b"NULL", 1, 1 << 30)
        assert flood.under_way()
        src, dst = list(range(32)), list(range(32, 64))
        for room in range(1, 6):
            data = pair.fill(src, seed=room)
            snd, rcv = pair.rendezvous(room, dst, epoch=room)
            snd.send(src, wire.Aux(0, 0, first_token=room))
            assert pair.pump_until(lambda: snd.poll() is S.SUCCESS and rcv.poll() is S.SUCCESS)
            assert checksum(pair.d_bytes(dst)) == checksum(data) and rcv.aux().first_token == room
            snd.close()
            rcv.close()
        assert_idle(pair)
    finally:
        flood.close()
        pair.close()


# ---- finding 2: no hash that grows with a forged frame -------------------------------------

class HashMeter:
    """Replaces disagg.auth's hmac: counts every byte any HMAC there digests."""

    def __init__(self, monkeypatch) -> None:
        self.nbytes = 0
        real = hmac.new
        meter = self

        class Metered:
            def __init__(self, key, msg=b"", digestmod=None) -> None:
                self._h = real(key, b"", digestmod)
                self.update(msg)

            def update(self, data) -> None:
                meter.nbytes += memoryview(data).nbytes
                self._h.update(data)

            def digest(self) -> bytes:
                return self._h.digest()
        monkeypatch.setattr(auth_mod, "hmac", types.SimpleNamespace(new=Metered, compare_digest=hmac.compare_digest))


def forged(wall: float, header_len: int) -> bytes:
    """An auth frame of the right shape, fresh, for a first contact, with made-up macs."""
    prefix = auth_mod._PREFIX.pack(auth_mod.MAGIC, 1, 1, int(wall * 1000), b"8 bytes!", 0, bytes(8))
    return prefix + os.urandom(2 * auth_mod.MAC_BYTES)


def test_a_forged_auth_frame_costs_a_fixed_hash_whatever_the_header(monkeypatch):
    """Finding 2's 40 headers of 8 MiB behind a fake auth frame: each is refused after
    hashing a few hundred bytes, over a real socket too; a header over the frame limit
    is refused before any hash. A genuine header is still hashed whole."""
    meter = HashMeter(monkeypatch)
    big = b"{" + bytes(wire.MAX_FRAME_BYTES - 1)
    rx = ChannelAuth(KEY)
    for _ in range(40):
        assert reason(lambda: rx.verify("tcp://d:1", forged(time.time(), len(big)), big)) == "bad_auth"
    assert meter.nbytes <= 40 * 256, meter.nbytes
    meter.nbytes = 0
    assert reason(lambda: rx.verify("tcp://d:1", forged(time.time(), 0), big + b"}")) == "too_large"
    assert meter.nbytes == 0
    tx = ChannelAuth(KEY)
    rx.verify("tcp://d:1", tx.seal("tcp://d:1", big), big)
    assert meter.nbytes >= len(big)

    d = ZmqChannel(auth=ChannelAuth(KEY), max_msg_size=wire.MAX_FRAME_BYTES)
    raw = plain_push(PASSWORD)   # an attacker who read the handshake password on the wire
    try:
        raw.connect(d.address)
        bad = rejected_count("control", "bad_auth")
        meter.nbytes = 0
        for _ in range(40):
            raw.send_multipart([forged(time.time(), len(big)), big])
        receive(d, lambda g: rejected_count("control", "bad_auth") >= bad + 40)
        assert rejected_count("control", "bad_auth") == bad + 40
        assert meter.nbytes <= 40 * 256, meter.nbytes
    finally:
        raw.close()
        d.close()


# ---- finding 4: memory before authentication ------------------------------------------------

WORKER = """
import sys, time
from kvrelay.disagg import wire
from kvrelay.disagg.auth import ChannelAuth
from kvrelay.disagg.channel import ZmqChannel
auth = ChannelAuth(bytes.fromhex(sys.argv[1])) if sys.argv[1] else None
ch = ZmqChannel(max_msg_size=wire.MAX_FRAME_BYTES, auth=auth)
print(ch.address, flush=True)
while True:
    for r in ch.recv():
        print("got", r.msg.seq, flush=True)
    time.sleep(0.002)
"""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def flood_worker_memory(key: bytes | None, cap: int, seconds: float = 3.0) -> tuple[float, list[int], list[str]]:
    """Start a worker-like process (a ZmqChannel and its recv loop), send it one message,
    flood it from 3 raw connections with never-ending messages of 1 MiB frames (at most
    `cap` bytes each, the connections held open), then send another. -> (the most its RSS
    grew, in MB, while the flood's connections were open; bytes each sent; its lines)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", WORKER, key.hex() if key else ""],
                             stdout=subprocess.PIPE, text=True, cwd=root, env=dict(os.environ, PYTHONPATH=root))
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(line.strip()) for line in child.stdout], daemon=True).start()
    tx = ZmqChannel(auth=ChannelAuth(key) if key else None)
    flood = Flood()
    try:
        address = out.get(timeout=30)
        tx.send(address, _hb(1))
        lines = [out.get(timeout=30)]
        base = rss_mb(child.pid)
        flood.start(flood.raw_zmtp, address, b"NULL", 1 << 20, cap)
        flood.start(flood.raw_zmtp, address, b"NULL", 1 << 20, cap)
        flood.start(flood.raw_zmtp, address, b"PLAIN", 1 << 20, cap, b"a guessed password")
        grown, end = 0.0, time.monotonic() + seconds
        while time.monotonic() < end:
            grown = max(grown, rss_mb(child.pid) - base)
            time.sleep(0.05)
        flood.close()
        tx.send(address, _hb(2))
        lines.append(out.get(timeout=30))
        return grown, flood.sent, lines
    finally:
        flood.close()
        tx.close()
        child.kill()
        child.wait()


def test_endless_unauthenticated_messages_do_not_grow_a_keyed_worker():
    """Finding 4: three connections that each send a never-ending message of 1 MiB frames
    (two as zmq NULL peers, one presenting a wrong PLAIN password) add less than 50 MB to
    a keyed worker's memory, and the worker still hears its members."""
    grown, sent, lines = flood_worker_memory(KEY, cap=128 << 20)
    assert lines == ["got 1", "got 2"]
    assert grown < 50, (grown, sent)


# ---- finding 10: replay across a restart -------------------------------------------------

def test_frames_captured_before_a_restart_are_refused_after_it():
    """Frames P sealed for D, captured on the wire, are replayed to a new D bound at the
    same address: the one naming the old D is refused as other_incarnation (and its sender
    noted), a first contact sealed before the new D started as before_boot. Then P and the
    new D talk: D's first contact, after which P names D's new incarnation."""
    wall = Wall(time.time())
    p, d = ZmqChannel(auth=ChannelAuth(KEY, wall=wall)), ZmqChannel(auth=ChannelAuth(KEY, wall=wall))
    raw = plain_push(PASSWORD)   # the attacker on the path read the handshake password
    d2 = None
    try:
        raw.connect(d.address)
        first = p._parts(d.address, _hb(1), ())      # exactly what p.send would put on the wire
        raw.send_multipart(first)
        assert [r.msg.seq for r in receive(d, lambda g: g)] == [1]
        d.send(p.address, _hb(100))
        assert [r.msg.seq for r in receive(p, lambda g: g)] == [100]
        named = p._parts(d.address, _hb(2), ())
        assert named[0][36:52] == d.auth.boot.to_bytes(8, "big") + d.auth.sender
        raw.send_multipart(named)
        assert [r.msg.seq for r in receive(d, lambda g: g)] == [2]
        address = d.address
        d.close()
        wall.t += 2.0
        d2 = ZmqChannel(port=int(address.rsplit(":", 1)[1]), auth=ChannelAuth(KEY, wall=wall))
        raw.close()   # new connections: what was queued on one to the old D may die with it
        p.forget(address)
        raw = plain_push(PASSWORD)
        raw.connect(address)
        other, boot = rejected_count("control", "other_incarnation"), rejected_count("control", "before_boot")
        raw.send_multipart(named)
        raw.send_multipart(first)
        receive(d2, lambda g: rejected_count("control", "before_boot") > boot)
        assert rejected_count("control", "other_incarnation") == other + 1
        assert rejected_count("control", "before_boot") == boot + 1
        assert d2.auth.take_unaware() == {p.address}
        assert p.send(d2.address, _hb(3))             # P still names the old D: refused too
        receive(d2, lambda g: rejected_count("control", "other_incarnation") > other + 1)
        assert d2.send(p.address, _hb(200))           # the new D's first contact
        assert [r.msg.seq for r in receive(p, lambda g: g)] == [200]
        assert p.auth._seen[d2.address].boot == d2.auth.boot
        assert p.send(d2.address, _hb(4))
        assert [r.msg.seq for r in receive(d2, lambda g: g)] == [4]
    finally:
        raw.close()
        for ch in (p, d2):
            if ch is not None:
                ch.close()


def test_a_peer_naming_the_old_incarnation_is_asked_to_bootstrap():
    """D still heartbeats P's previous incarnation after P restarted at the same address:
    the new P refuses those frames and asks D for bootstrap, so D learns P restarted."""
    pair = Pair("tcp", key=KEY)
    try:
        pair.rendezvous(1, [4, 5], epoch=7)
        address, old = pair.p.address, pair.p.incarnation
        assert pair.d.peers()[address].incarnation == old
        pair.p.close()
        pair.p = create_manager("tcp", LAYOUT, TransferConfig(transfer_backend="tcp",
                                transfer_port=int(address.rsplit(":", 1)[1])), auth=ChannelAuth(KEY))
        host_pool(pair.p, 16)
        assert pair.p.address == address
        refused = rejected_count("control", "other_incarnation")
        sent = [0.0]

        def learned() -> bool:
            if time.monotonic() - sent[0] > 0.05:   # D heartbeats on, as its loop does (the
                sent[0] = time.monotonic()          # first ones may die with the old connection)
                pair.d.heartbeat(address, {1: "waiting"})
            return pair.d.peers()[address].incarnation == pair.p.incarnation \
                and pair.d.address in pair.p.peers()   # and P learned D from its answer
        assert pair.pump_until(learned)
        assert rejected_count("control", "other_incarnation") > refused
    finally:
        pair.close()
