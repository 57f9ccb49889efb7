"""Wire encoding, channels and deterministic fault injection."""
from __future__ import annotations

import json

import pytest

from kvrelay.core.clock import SimClock
from kvrelay.disagg import wire
from kvrelay.disagg.channel import InProcNetwork, ZmqChannel
from kvrelay.disagg.faults import Faults, FaultSpec, FaultyChannel
from disagg_helpers import LAYOUT

MESSAGES = [
    wire.BootstrapQuery("d", "i", LAYOUT.to_dict(), "fake", {"pool": "x"}),
    wire.BootstrapInfo("p", "j", LAYOUT.to_dict(), "fake"),
    wire.Destination(2**62 + 3, 4, (1, 2, 3), "d", "i", 9),
    wire.Heartbeat("w", "i", 7, {2**62 + 3: "queued", 5: "waiting"}),
    wire.Notice(1, 2, "aborted", "aborted"),
    wire.Aux(1, 2, 42, -0.5, ((3, -1.0), (4, -2.0)), 17),
    wire.Ack(1, 2),
    wire.Stopped(1, 2),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.KIND)
def test_every_message_round_trips(msg):
    src, back = wire.decode(wire.encode(msg, "tcp://a:1"))
    assert src == "tcp://a:1" and back == msg
    if isinstance(msg, wire._Identity):
        assert back.kv_layout == LAYOUT


def test_foreign_frames_are_wire_errors():
    with pytest.raises(wire.WireError):
        wire.decode(json.dumps({"v": 99, "kind": "Ack", "src": "x", "body": {}}).encode())
    with pytest.raises(wire.WireError):
        wire.decode(b"not json")
    with pytest.raises(wire.WireError):
        wire.decode(json.dumps({"v": wire.WIRE_VERSION, "kind": "Nope", "src": "x", "body": {}}).encode())


def test_spec_parsing():
    s = FaultSpec.parse("drop_ack=1.0; delay_ctrl=0.2;drop:Aux=0.5;seed=3")
    assert (s.drop_ack, s.delay_ctrl, s.drop_kinds, s.seed) == (1.0, 0.2, {"Aux": 0.5}, 3)
    assert FaultSpec.parse(None) == FaultSpec() and not FaultSpec().any
    with pytest.raises(ValueError):
        FaultSpec.parse("drop_akc=1")


def _pair(spec: str, clock=None):
    net = InProcNetwork()
    a, b = net.channel(), net.channel()
    return FaultyChannel(a, Faults(FaultSpec.parse(spec)), clock or SimClock()), b


def test_drop_dup_and_kind_filters():
    fa, b = _pair("drop_ack=1;dup_ctrl=1")
    fa.send(b.address, wire.Ack(1, 1))
    fa.send(b.address, wire.Stopped(1, 1))
    assert [r.msg for r in b.recv()] == [wire.Stopped(1, 1)] * 2
    fa.send(b.address, wire.Ack(1, 1), [b"data"])     # data frames are never touched
    assert [r.frames for r in b.recv()] == [(b"data",)]


def test_delay_and_reorder():
    clock = SimClock()
    fa, b = _pair("delay_ctrl=0.5", clock)
    fa.send(b.address, wire.Ack(1, 1))
    assert b.recv() == []
    clock.advance(0.5)
    fa.recv()
    assert [r.msg for r in b.recv()] == [wire.Ack(1, 1)]
    fa, b = _pair("reorder_ctrl=1")
    fa.send(b.address, wire.Ack(1, 1))
    fa.send(b.address, wire.Ack(2, 2))
    fa.recv()
    assert [r.msg.room for r in b.recv()] == [2, 1]


def test_seeded_faults_are_deterministic():
    runs = []
    for _ in range(2):
        f = Faults(FaultSpec.parse("drop_ctrl=0.5;hang_transfer=0.3;seed=11"))
        runs.append([f.drops(wire.Ack(1, 1)) for _ in range(50)] + [f.transfer_fault() for _ in range(20)])
    assert runs[0] == runs[1] and any(runs[0][:50]) and not all(runs[0][:50])


def test_zmq_channel_carries_control_and_data():
    a, b = ZmqChannel(), ZmqChannel()
    try:
        big = bytes(range(256)) * 1024
        assert a.send(b.address, wire.Ack(1, 2), [big])
        got = []
        for _ in range(2000):
            got += b.recv()
            if got:
                break
            import time
            time.sleep(0.001)
        assert got[0].src == a.address and got[0].msg == wire.Ack(1, 2) and bytes(got[0].frames[0]) == big
    finally:
        a.close()
        b.close()
