"""Wire fuzzer (issue #10, Build item 7): hypothesis mutates every wire message kind
(each field's type and value, the envelope, the encoded bytes) and sends each result with
a real zmq PUSH socket to a live prefill and decode manager (tcp backend), which take it
through the path every received frame takes (ZmqChannel.recv -> wire.decode -> the
manager's admission and dispatch), stepped on a simulated clock. No exception escapes a
step, the room live beside the fuzz is never failed and later lands byte-exact, and
nothing leaks or grows past its cap. Derandomized and bounded so it runs in `make test`;
tests/fuzz_wire.py is the 10,000-frame version against worker cores under load."""
from __future__ import annotations

import time

import zmq
from hypothesis import HealthCheck, given, settings

from disagg_helpers import LAYOUT, Harness, pattern, with_cfg
from wire_fuzz_strategies import frames
from kvrelay.disagg.channel import MAX_SOCKETS
from kvrelay.disagg.transfer.common import MAX_EARLY_ROOMS, MAX_PEERS
from kvrelay.obs.metrics import rejected_count

LIVE = 0x5EED_1234_5678_9ABC   # a room id no strategy draws
EXAMPLES = 1000


def test_fuzzed_frames_affect_no_live_room():
    H = Harness("tcp", with_cfg(bootstrap_timeout=1e6, queue_timeout=1e6, waiting_timeout=1e6,
                                transfer_timeout=1e6))
    ctx = zmq.Context.instance()
    attackers = []
    try:
        H.request(LIVE, n_pages=3)
        H.to_phase(LIVE, "D", "waiting")
        H.to_phase(LIVE, "P", "queued")
        for address in (H.pm.address, H.dm.address):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            attackers.append(sock)
        before = rejected_count("control")
        sent = []

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(frames(LAYOUT))
        def feed(parts):
            for sock in attackers:
                sock.send_multipart(parts)
            sent.append(parts)
            H.step(1)  # an exception here escapes to hypothesis: a failure
            assert H.event("P", LIVE) is None and H.event("D", LIVE) is None, H.events

        feed()
        time.sleep(0.2)
        H.step(10)
        assert len(sent) >= EXAMPLES // 2
        assert rejected_count("control") > before
        for m in (H.pm, H.dm):
            assert len(m.peers()) <= MAX_PEERS and len(m._early) <= MAX_EARLY_ROOMS
            assert len(m.channel.inner.sockets()) <= MAX_SOCKETS
        pages = H.prefill(LIVE)
        assert H.run_until(lambda: LIVE in [r for r, _ in H.D.take_ready()] or H.phase("D", LIVE) == "decode")
        d_pages = H.D.lc.rooms[LIVE].data.pages
        assert H.d_pages(d_pages) == pattern(LIVE, len(pages) * LAYOUT.page_bytes)
        H.D.finish(LIVE)
        H.assert_no_leak()
    finally:
        for sock in attackers:
            sock.close(linger=0)
        H.close()
