"""The cluster key on the P<->D channel (#10): every frame is sealed, and a process without
the key cannot bootstrap with a worker, send a heartbeat that is accepted, or write a byte
into any pool; captured frames cannot be replayed, nor sent to another worker.

ChannelAuth alone first (seal/verify/accept rules), then real channels and managers on
every backend, with the attacker using the real wire format (or a raw zmq socket)."""
from __future__ import annotations

import time

import pytest
import zmq

from disagg_helpers import CFG, DT, LAYOUT, Harness, checksum, pattern
from kvrelay.core.config import TransferConfig
from kvrelay.core.keys import ClusterKey
from kvrelay.disagg import wire
from kvrelay.disagg.auth import AUTH_BYTES, WINDOW, AuthError, ChannelAuth
from kvrelay.disagg.channel import InProcNetwork, ZmqChannel
from kvrelay.disagg.transfer import create_manager
from kvrelay.disagg.transfer.base import TransferStatus as S, host_pool
from kvrelay.obs.metrics import rejected_count
from test_backends import PB, REAL, Pair, drain

KEY = ClusterKey(b"the cluster's secret, 32 bytes..").control_key
OTHER = ClusterKey(b"somebody else's secret, 32 bytes").control_key
DST = "tcp://10.0.0.2:5000"


class Wall:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def sealed(auth: ChannelAuth, header: bytes = b'{"x":1}', frames=(), dst: str = DST):
    return auth.seal(dst, header, frames), header, frames


def reason(fn) -> str | None:
    try:
        fn()
    except AuthError as e:
        return e.reason
    return None


# ---- ChannelAuth ------------------------------------------------------------------------

def flip(auth: bytes, i: int) -> bytes:
    return auth[:i] + bytes([auth[i] ^ 1]) + auth[i + 1:]


def test_a_sealed_message_verifies_once_and_only_as_sent():
    wall = Wall()
    tx, rx = ChannelAuth(KEY, wall=wall), ChannelAuth(KEY, wall=wall)
    auth, header, frames = sealed(tx, frames=[b"a" * 100, b"b" * 7])
    assert len(auth) == AUTH_BYTES == 84 and auth[:4] == b"KVA2"
    # anything else than what was sealed is refused before the header is parsed
    assert reason(lambda: ChannelAuth(OTHER, wall=wall).verify(DST, auth, header, frames)) == "bad_auth"
    assert reason(lambda: rx.verify(DST, auth, b'{"x":2}', frames)) == "bad_auth"      # same length
    assert reason(lambda: rx.verify(DST, auth, b'{"x":22}', frames)) == "bad_auth"
    assert reason(lambda: rx.verify(DST, auth, header, [b"a" * 101, b"b" * 7])) == "bad_auth"
    assert reason(lambda: rx.verify(DST, auth, header, frames[:1])) == "bad_auth"
    assert reason(lambda: rx.verify("tcp://10.0.0.3:5000", auth, header, frames)) == "bad_auth"
    for i in (12, 36, 44, 52, 68, 83):   # counter, receiver boot and id, both macs
        assert reason(lambda: rx.verify(DST, flip(auth, i), header, frames)) == "bad_auth", i
    assert reason(lambda: rx.verify(DST, None, header, frames)) == "no_auth"
    assert reason(lambda: rx.verify(DST, auth[:-1], header, frames)) == "no_auth"
    assert reason(lambda: rx.verify(DST, b'{"v":1}', header, frames)) == "no_auth"
    assert reason(lambda: rx.verify(DST, b"KVA1" + auth[4:], header, frames)) == "no_auth"
    stamp = rx.verify(DST, auth, header, frames)
    assert rx.accept("tcp://p:1", stamp) is None
    assert rx.accept("tcp://p:1", stamp) == "replay"
    assert reason(lambda: rx.verify(DST, auth, header, frames)) == "replay"   # from the cleartext


def test_a_sender_names_the_receiver_incarnation_it_last_accepted():
    """Finding 10 at the unit level: a frame sealed for one incarnation of a receiver is
    refused by the next one at the same address, which learns who still believes in the old
    one; a first contact (no incarnation named) sealed before the receiver started is
    refused too."""
    wall = Wall()
    p, d = ChannelAuth(KEY, wall=wall), ChannelAuth(KEY, wall=wall)
    first = sealed(p, dst=DST)                      # P has heard nothing from D yet
    assert d.accept("P", d.verify(DST, *first)) is None
    assert p.accept(DST, p.verify("P", *sealed(d, dst="P"))) is None
    named = sealed(p, dst=DST)                      # names d's incarnation now
    assert named[0][36:52] == d.boot.to_bytes(8, "big") + d.sender
    assert d.accept("P", d.verify(DST, *named)) is None
    wall.t += 2.0
    d2 = ChannelAuth(KEY, wall=wall)                # D restarted at the same address
    assert d2.accept("P", d2.verify(DST, *named)) == "other_incarnation"
    assert d2.take_unaware() == {"P"} and d2.take_unaware() == set()
    assert reason(lambda: d2.verify(DST, *first)) == "before_boot"
    fresh = sealed(p, dst=DST)                      # P still names the old D: refused
    assert d2.accept("P", d2.verify(DST, *fresh)) == "other_incarnation"
    assert p.accept(DST, p.verify("P", *sealed(d2, dst="P"))) is None   # d2's first contact
    assert d2.accept("P", d2.verify(DST, *sealed(p, dst=DST))) is None


def test_messages_outside_the_replay_window_are_stale():
    tx_wall, rx_wall = Wall(), Wall()
    tx, rx = ChannelAuth(KEY, 60.0, wall=tx_wall), ChannelAuth(KEY, 60.0, wall=rx_wall)
    old = sealed(tx)
    rx_wall.t += 59.0
    assert reason(lambda: rx.verify(DST, *old)) is None
    rx_wall.t += 2.0
    assert reason(lambda: rx.verify(DST, *old)) == "stale"
    tx_wall.t = rx_wall.t + 61.0        # from the future (a clock far ahead) too
    assert reason(lambda: rx.verify(DST, *sealed(tx))) == "stale"


def test_counters_may_arrive_out_of_order_but_each_once_and_within_the_window():
    wall = Wall()
    tx, rx = ChannelAuth(KEY, wall=wall), ChannelAuth(KEY, wall=wall)
    msgs = [sealed(tx) for _ in range(WINDOW + 10)]
    stamps = [rx.verify(DST, *m) for m in msgs]
    assert rx.accept("src", stamps[5]) is None
    assert rx.accept("src", stamps[2]) is None      # late but new: accepted once
    assert rx.accept("src", stamps[2]) == "replay"
    assert rx.accept("src", stamps[WINDOW + 9]) is None
    assert rx.accept("src", stamps[8]) == "replay"  # now more than WINDOW behind the highest
    assert rx.accept("src", stamps[WINDOW + 5]) is None
    assert rx.accept("src", stamps[WINDOW + 5]) == "replay"
    assert rx.accept("other-src", stamps[3]) is None   # replay state is per sender address


def test_an_older_incarnation_of_a_sender_is_refused_until_the_new_one_goes_quiet():
    wall = Wall()
    old = ChannelAuth(KEY, 60.0, wall=wall)
    wall.t += 5.0
    new = ChannelAuth(KEY, 60.0, wall=wall)           # the same worker restarted: a later boot
    rx = ChannelAuth(KEY, 60.0, wall=wall)
    captured = sealed(old)
    assert rx.accept("P", rx.verify(DST, *sealed(old))) is None
    assert rx.accept("P", rx.verify(DST, *sealed(new))) is None
    assert rx.accept("P", rx.verify(DST, *captured)) == "old_incarnation"
    assert rx.accept("P", rx.verify(DST, *sealed(new))) is None
    wall.t += 50.0
    assert rx.accept("P", rx.verify(DST, *sealed(old))) == "old_incarnation"
    wall.t += 11.0                                     # the new one silent for a whole window
    assert rx.accept("P", rx.verify(DST, *sealed(old))) is None


def test_cluster_key_loading_and_derivation(tmp_path):
    f = tmp_path / "key"
    f.write_text("  0123456789abcdef0123456789abcdef\n")
    f.chmod(0o600)
    a = ClusterKey.load(str(f), environ={})
    b = ClusterKey.load(None, environ={"KVRELAY_CLUSTER_KEY": "0123456789abcdef0123456789abcdef"})
    assert a.control_key == b.control_key and a.http_token == b.http_token
    assert a.control_key != a.derive("worker-http") and len(a.http_token) == 64
    assert a.channel_password == b.channel_password == ChannelAuth(a.control_key).password
    assert len({a.channel_password, a.http_token, a.control_key.hex()}) == 3
    assert "0123" not in repr(a)
    assert ClusterKey.load(None, environ={}) is None
    assert a.check_http_token(a.http_token) and not a.check_http_token(b.http_token[:-1] + "0")
    assert not a.check_http_token(None)
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        ClusterKey.load(str(f), environ={})
    with pytest.raises(ValueError, match="cannot read --cluster-key-file"):
        ClusterKey.load(str(tmp_path / "missing"), environ={})
    g1, g2 = ClusterKey.generate(), ClusterKey.generate()
    assert g1.control_key != g2.control_key
    assert ClusterKey.load(None, environ={"KVRELAY_CLUSTER_KEY": g1.export()}).control_key == g1.control_key


# ---- channels ---------------------------------------------------------------------------

def _hb(seq: int = 1) -> wire.Heartbeat:
    return wire.Heartbeat("w", "inc", seq, {5: "waiting"})


def test_inproc_channels_accept_only_frames_sealed_with_their_key():
    net = InProcNetwork()
    a, b, stranger, unkeyed = (net.channel() for _ in range(4))
    a.auth, b.auth, stranger.auth = ChannelAuth(KEY), ChannelAuth(KEY), ChannelAuth(OTHER)
    before = {r: rejected_count("control", r) for r in ("no_auth", "bad_auth", "auth_not_configured")}
    assert a.send(b.address, _hb())
    assert [r.msg for r in b.recv()] == [_hb()]
    stranger.send(b.address, _hb(2))
    unkeyed.send(b.address, _hb(3))
    a.send(unkeyed.address, _hb(4))
    assert b.recv() == [] and unkeyed.recv() == []
    assert rejected_count("control", "bad_auth") == before["bad_auth"] + 1
    assert rejected_count("control", "no_auth") == before["no_auth"] + 1
    assert rejected_count("control", "auth_not_configured") == before["auth_not_configured"] + 1


def plain_push(password: str | None):
    """A raw PUSH socket; with `password`, it passes a keyed channel's handshake (an
    attacker who read the password on the wire), without, it speaks zmq's NULL."""
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    if password is not None:
        raw.plain_username, raw.plain_password = b"kvrelay", password.encode()
    return raw


def _recv_all(ch, expect: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        got += ch.recv()
        time.sleep(0.002)
    time.sleep(0.05)
    return got + ch.recv()


def test_zmq_frames_captured_on_the_wire_cannot_be_replayed_or_redirected():
    """An attacker on the path records the exact bytes P sent to D and sends them again
    from its own socket, to D and to another worker."""
    p, d, d2 = (ZmqChannel(auth=ChannelAuth(KEY)) for _ in range(3))
    raw = plain_push(ChannelAuth(KEY).password)   # the handshake's password travels in clear
    try:
        wire_parts = p._parts(d.address, _hb(1), ())   # exactly what p.send would put on the wire
        raw.connect(d.address)
        raw.send_multipart(wire_parts)
        assert [r.msg.seq for r in _recv_all(d, 1)] == [1]   # the first copy is P's own message
        replay = rejected_count("control", "replay")
        raw.send_multipart(wire_parts)
        assert _recv_all(d, 0) == []
        assert rejected_count("control", "replay") == replay + 1
        bad = rejected_count("control", "bad_auth")
        raw2 = plain_push(ChannelAuth(KEY).password)
        raw2.connect(d2.address)
        raw2.send_multipart(wire_parts)                    # sealed for d, not for d2
        assert _recv_all(d2, 0) == []
        assert rejected_count("control", "bad_auth") == bad + 1
        raw2.close()
        assert p.send(d.address, _hb(2))                   # P's channel itself still works
        assert [r.msg.seq for r in _recv_all(d, 1)] == [2]
    finally:
        raw.close()
        for ch in (p, d, d2):
            ch.close()


# ---- spoofing a worker: bootstrap, heartbeat, KV bytes -----------------------------------

class Eavesdropper(ChannelAuth):
    """Seals with a key of its own, but read the cluster's handshake password on the wire
    (PLAIN sends it in clear): its frames get past the handshake to the auth frame check."""

    @property
    def password(self) -> str:
        return ChannelAuth(KEY).password


@pytest.mark.parametrize("backend", REAL)
def test_without_the_key_no_bootstrap_no_heartbeat_no_byte_lands(backend):
    """D and P share the key; three managers without it play the attacker: one with another
    key (refused at the handshake, counted), one that also read the handshake password
    (its frames refused by their auth frame), one with no key at all (zmq's NULL mechanism:
    refused at the greeting). Each asks P to bootstrap, heartbeats D in P's name, and (tcp)
    sends KV frames for D's live room with the right room, epoch and pages."""
    pair = Pair(backend, key=KEY)
    other, unkeyed = Pair(backend, key=OTHER), Pair(backend)
    spy = create_manager(backend, LAYOUT, TransferConfig(transfer_backend=backend), auth=Eavesdropper(OTHER))
    host_pool(spy, 16)
    handshakes, rejected = rejected_count("control", "bad_handshake"), rejected_count("control")
    attackers = [  # the manager, and when all it sent has been judged
        (other.d, lambda: rejected_count("control", "bad_handshake") >= handshakes + 2),
        (spy, lambda: rejected_count("control") >= rejected + 4),
        (unkeyed.d, lambda: time.monotonic() > t0 + 0.5),   # nothing to count: wait a while
    ]
    try:
        snd, rcv = pair.rendezvous(1, [4, 5], epoch=7)
        pair.dpool[4 * PB:6 * PB] = pattern(99, 2 * PB)
        before = checksum(pair.d_bytes(range(16)))
        peers_p, peers_d = set(pair.p.peers()), set(pair.d.peers())
        for e, done in attackers:
            handshakes, rejected, t0 = rejected_count("control", "bad_handshake"), rejected_count("control"), \
                time.monotonic()
            e.channel.send(pair.p.address, e._identity(wire.BootstrapQuery))
            e.channel.send(pair.d.address, wire.Heartbeat(pair.p.worker_id, "forged-incarnation", 10**6, {}))
            e.channel.send(pair.d.address, wire.Notice(1, 7, "failed", "transfer_error"))
            if backend == "tcp":
                from kvrelay.disagg.transfer.tcp import TcpKV
                e.channel.send(pair.d.address, TcpKV(1, 7, 4, 2), [pattern(13, 2 * PB)])
            e.channel.send(pair.d.address, wire.Aux(1, 7, first_token=3))
            drain(pair)

            def judged() -> bool:
                # The attacker's frames come over connections of their own, unordered with
                # P's: wait until each is judged (refused), however loaded the machine is.
                e.progress()
                return done()
            assert pair.pump_until(judged), rejected_count("control") - rejected
            for _ in range(50):
                pair.p.progress()
                pair.d.progress()
                e.progress()
            assert set(pair.p.peers()) == peers_p and set(pair.d.peers()) == peers_d   # nobody learned
            assert e.peers() == {}                        # and P never answered the attacker
            assert pair.d.take_heartbeats() == []       # no forged heartbeat reached the lease
            assert checksum(pair.d_bytes(range(16))) == before
            assert rcv.poll() is S.TRANSFERRING and rcv.spans == {} and rcv.aux() is None
        # the real P still completes the room
        data = pair.fill([0, 1], seed=3)
        snd.send([0, 1], wire.Aux(0, 0, first_token=42))
        assert pair.pump_until(lambda: rcv.aux() is not None)
        assert pair.d_bytes([4, 5]) == data
        snd.close()
        rcv.close()
    finally:
        pair.close()
        other.close()
        unkeyed.close()
        spy.close()


# ---- finding 5: a forged heartbeat changes nothing ---------------------------------------

@pytest.mark.parametrize("backend", ["fake", "tcp"])
def test_forged_and_replayed_heartbeats_do_not_touch_the_lease(backend):
    """Finding 5: on the unkeyed code one forged Heartbeat made D ignore its real P's
    heartbeats (a room P aborted stayed pinned until --waiting-timeout), and a forged new
    incarnation failed every room D held with that P. With the key neither is accepted,
    (a replay of a captured heartbeat: test_zmq_frames_captured_on_the_wire_cannot_be_replayed...)."""
    h = Harness(backend, key=KEY)
    try:
        h.request(1)
        h.request(2)
        h.to_phase(1, "P", "queued")
        h.to_phase(2, "P", "queued")
        forger = ChannelAuth(OTHER)
        hb = wire.Heartbeat(h.pm.worker_id, "a-new-incarnation", 10**9, {})
        header = wire.encode(hb, h.pm.address)
        if backend == "fake":
            h.network.queues[h.dm.address].append([forger.seal(h.dm.address, header), header])
        else:
            raw = plain_push(ChannelAuth(KEY).password)   # past the handshake: the frames' auth decides
            raw.connect(h.dm.address)
            raw.send_multipart([forger.seal(h.dm.address, header), header])
            raw.send_multipart([header])   # and unsigned
        h.step(int(3 * CFG.heartbeat_interval / DT))
        assert h.phase("D", 1) == "waiting" and h.phase("D", 2) == "waiting"   # nothing failed
        h.set_faults("P", "drop:Notice=1")             # P ends room 1 and its Notice is lost:
        h.P.abort(1)                                    # D learns from P's heartbeats, within a lease
        t0 = h.clock.now()
        assert h.run_until(lambda: h.phase("D", 1) is None, 3 * CFG.heartbeat_interval)
        assert h.clock.now() - t0 <= CFG.heartbeat_interval * CFG.heartbeat_misses
        h.set_faults("P", "")
        h.prefill(2)
        assert h.run_until(lambda: 2 in [r for r, _ in h.D.take_ready()] or h.phase("D", 2) == "decode")
        h.D.finish(2)
        h.assert_no_leak()
    finally:
        h.close()
