"""A transfer that makes progress is never failed; one that stalls fails within the lease.

D's heartbeats report how many of P's KV bytes have landed, in all and per waiting room
(two-sided backends). P fails an unacknowledged room only after `heartbeat_misses`
heartbeats in a row showing it waiting with no new byte landed. Under the simulated
clock, a `SlowLink` in front of D's data hook delivers the KV one page (or one span of a
page) at a time, at a set rate, as a throttled link would.
A write still pending (aux not out) is judged the same way, its own bytes handed off
counting as progress too, except on a backend whose pending writes are opaque (nixl)."""
from __future__ import annotations

import json
import time

import pytest

from disagg_helpers import BACKENDS, CFG, DT, LAYOUT, Harness, pattern, with_cfg
from kvrelay.disagg import wire
from kvrelay.disagg.channel import Received
from kvrelay.disagg.layerwise import LayerCursor
from kvrelay.disagg.transfer import TRANSFER_BACKENDS, tcp
from kvrelay.disagg.transfer.tcp import TcpKV

LEASE = CFG.heartbeat_interval * CFG.heartbeat_misses
# Backstops far away, so that only the lease rule can end a room here.
SLOW_CFG = with_cfg(transfer_timeout=60.0, waiting_timeout=60.0)
TWO_SIDED = [b for b in ("tcp", "fake-twosided") if b in BACKENDS]


@pytest.fixture(params=TWO_SIDED)
def backend(request):
    return request.param


class SlowLink:
    """Holds the KV data messages D receives and hands them to the backend one page per
    `seconds_per_page` of simulated time; `stall()` stops the flow (bytes stuck in the
    network), `resume()` restarts it. An Aux that arrives while data is held waits behind
    it, as on one byte stream (tcp sends the aux after the data on the same socket)."""

    def __init__(self, H: Harness, seconds_per_page: float) -> None:
        self.H, self.rate = H, seconds_per_page
        self.inner, self.inner_room = H.dm.on_data, H.dm._dispatch_room
        self.queue: list[tuple[object, Received]] = []   # (handler, message): data, or an aux behind it
        self.stalled = False
        self.next_at = 0.0
        self.last_landed_at: float | None = None
        self.delivered = 0
        H.dm.on_data, H.dm._dispatch_room = self.hold, self.hold_room

    def hold_room(self, received: Received) -> None:
        if isinstance(received.msg, wire.Aux) and self.queue:
            self.queue.append((self.inner_room, received))
        else:
            self.inner_room(received)

    def hold(self, received: Received) -> None:
        msg = received.msg
        data = memoryview(received.frames[0])
        first = getattr(msg, "first_page", None)
        span = (getattr(msg, "span_offset", 0), getattr(msg, "span_length", 0))   # tcp: a span of each page
        n = span[1] or LAYOUT.page_bytes
        pages = range(first, first + msg.num_pages) if first is not None else msg.dst_pages
        for i, p in enumerate(pages):  # one message per page (or span), as a byte stream would arrive
            piece = (type(msg)(msg.room, msg.epoch, p, 1, *span) if first is not None
                     else type(msg)(msg.room, msg.epoch, (p,)))
            self.queue.append((self.inner, Received(received.src, piece, (bytes(data[i * n:(i + 1) * n]),))))
        self.next_at = max(self.next_at, self.H.clock.now())

    def pump(self) -> None:
        now = self.H.clock.now()
        while self.queue and not self.stalled:
            handler, received = self.queue[0]
            if handler is self.inner and now < self.next_at:
                break                   # an aux takes no time of its own
            self.queue.pop(0)
            handler(received)
            if handler is self.inner:
                self.delivered += 1
                self.last_landed_at, self.next_at = now, self.next_at + self.rate

    def stall(self) -> None:
        self.stalled = True

    def resume(self) -> None:
        self.stalled, self.next_at = False, self.H.clock.now()


class ProgressHarness(Harness):
    """A Harness whose D receives KV through a SlowLink, and which counts the Aux
    messages P sends."""

    def __init__(self, backend: str, seconds_per_page: float, **kw) -> None:
        super().__init__(backend, SLOW_CFG, **kw)
        self.link = SlowLink(self, seconds_per_page)
        self.aux_sent = 0
        send = self.pm.channel.send

        def counting_send(dst, msg, frames=()):
            self.aux_sent += isinstance(msg, wire.Aux)
            return send(dst, msg, frames)
        self.pm.channel.send = counting_send

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            super().step()
            self.link.pump()


def ready(H: Harness, room: int) -> bool:
    return room in [r for r, _ in H.D.take_ready()] or H.phase("D", room) == "decode"


def ends_done(H: Harness, room: int = 1) -> None:
    """D finishes `room`: both sides end it `done` (no failure on the way), nothing leaked."""
    H.D.finish(room)
    H.settle()
    assert {(ev.side, ev.phase) for _, ev in H.events} == {("prefill", "done"), ("decode", "done")}
    H.assert_no_leak()


def prefill_layer_wise(H: Harness, room: int, n: int) -> None:
    """P computes `room` (n pages) and writes layer 0 of every page ahead, then the rest."""
    H.to_phase(room, "P", "queued")
    H.P.take_queued(1_000)
    pages, pb = H.palloc.allocate(n, room), LAYOUT.page_bytes
    for i, p in enumerate(pages):
        H.ppool[p * pb:(p + 1) * pb] = pattern(room, n * pb)[i * pb:(i + 1) * pb]
    tokens, cursor = n * LAYOUT.page_size, LayerCursor(LAYOUT)
    H.P.send_ahead(room, pages, cursor.advance(0, tokens, 1))
    H.P.prefill_done(room, pages, wire.Aux(0, 0, first_token=7, prompt_tokens=tokens),
                     cursor.finish(tokens, LAYOUT.num_layers))


def test_heartbeat_progress_round_trips_and_is_optional():
    hb = wire.Heartbeat("d", "i", 3, {7: "waiting", 8: "decode"}, {7: 5}, 42)
    src, back = wire.decode(wire.encode(hb, "tcp://a:1"))
    assert back == hb and back.progress == {7: 5} and back.landed == 42
    old = json.dumps({"v": wire.WIRE_VERSION, "kind": "Heartbeat", "src": "x",
                      "body": {"worker_id": "d", "incarnation": "i", "seq": 1, "rooms": [[7, "waiting"]]}})
    back = wire.decode(old.encode())[1]
    assert (back.progress, back.landed) == ({}, 0)       # a sender without the fields: no progress info
    bad_bodies = [{"progress": bad} for bad in ([[7, -1]], [[7, "5"]], [[7, 1.5]], [[7, True]], [7])]
    bad_bodies += [{"landed": bad} for bad in (-1, "3", 2.5, None)]
    for extra in bad_bodies:
        body = {"worker_id": "d", "incarnation": "i", "seq": 1, "rooms": [], **extra}
        with pytest.raises(wire.WireError):
            wire.decode(json.dumps({"v": wire.WIRE_VERSION, "kind": "Heartbeat", "src": "x", "body": body}).encode())


def test_a_transfer_that_keeps_landing_pages_survives_many_heartbeats(backend):
    """12 pages at one page per 0.8 s: the KV takes ~9 s to land, three times the lease,
    with aux out from the start. P never fails it; the bytes arrive exactly, and the aux
    is not resent while pages keep landing."""
    H = ProgressHarness(backend, seconds_per_page=0.8, num_pages=16)
    try:
        H.request(1, n_pages=12)
        H.to_phase(1, "P", "queued")
        dst = list(H.D.lc.rooms[1].data.pages)
        H.prefill(1)
        t0 = H.clock.now()
        assert H.run_until(lambda: ready(H, 1), 30), (H.P.live(), H.D.live(), H.events)
        took = H.clock.now() - t0
        assert took > 2.5 * LEASE and all(ev.phase == "done" for _, ev in H.events)   # no failure
        assert H.d_pages(dst) == pattern(1, 12 * LAYOUT.page_bytes)
        assert H.aux_sent == 1                                # moving: no resend was needed
        ends_done(H)
    finally:
        H.close()


def test_a_room_queued_behind_another_on_the_link_survives(backend):
    """Two rooms of 8 pages share the link, FIFO, one page per 0.8 s: room 2's first page
    lands only after room 1's last, 6.4 s (two leases) after its aux went out. The link
    moved all along, so neither fails."""
    H = ProgressHarness(backend, seconds_per_page=0.8, num_pages=16)
    try:
        for room in (1, 2):
            H.request(room, n_pages=8)
        H.to_phase(1, "P", "queued")
        H.to_phase(2, "P", "queued")
        H.prefill(1)
        H.prefill(2)
        done = set()
        assert H.run_until(lambda: bool(done.update(r for r, _ in H.D.take_ready())) or done == {1, 2}, 30), H.events
        assert all(ev.phase == "done" for _, ev in H.events), H.events
        for room in (1, 2):
            H.D.finish(room)
        H.assert_no_leak()
    finally:
        H.close()


@pytest.mark.skipif("tcp" not in BACKENDS, reason="tcp backend not under test")
def test_layer_wise_spans_landing_after_every_page_has_some_bytes_are_progress():
    """Layer-wise over a slow link, one span per 0.5 s: layer 0 of all 8 pages goes
    ahead and lands first, so every page has some bytes in after 4 s; layer 1's spans
    then take another 4 s, over a lease, with the aux out. Each span is progress, so P
    never fails the room; every byte arrives and the aux goes out once. (Counting pages
    with some bytes in, P saw no progress once the last page's first span was in.)"""
    H = ProgressHarness("tcp", seconds_per_page=0.5, num_pages=16)
    try:
        H.request(1, n_pages=8)
        H.to_phase(1, "P", "queued")
        dst = list(H.D.lc.rooms[1].data.pages)
        prefill_layer_wise(H, 1, 8)
        every_page_touched = lambda: len(H.D._receivers[1].spans) == 8   # noqa: E731
        assert H.run_until(every_page_touched, 30)
        touched_at = H.clock.now()
        assert H.run_until(lambda: ready(H, 1), 30), (H.P.live(), H.D.live(), H.events)
        assert H.clock.now() - touched_at > LEASE + CFG.heartbeat_interval   # long enough to have failed
        assert all(ev.phase == "done" for _, ev in H.events) and H.aux_sent == 1, H.events
        assert H.d_pages(dst) == pattern(1, 8 * LAYOUT.page_bytes)
        ends_done(H)
    finally:
        H.close()


def test_a_transfer_with_no_progress_for_the_lease_fails(backend):
    """The link stalls after 4 of 12 pages: P resends the aux on each heartbeat that shows
    no progress and fails the room with transfer_error after `heartbeat_misses` of them,
    long before --transfer-timeout. D's room fails with the same reason; nothing leaks."""
    H = ProgressHarness(backend, seconds_per_page=0.3, num_pages=16)
    try:
        H.request(1, n_pages=12)
        H.to_phase(1, "P", "queued")
        H.prefill(1)
        assert H.run_until(lambda: H.D._receivers[1].progress() >= 4 * LAYOUT.page_bytes, 10)
        H.link.stall()
        stalled_at = H.link.last_landed_at
        assert H.run_until(lambda: H.event("P", 1) is not None, 30)
        t, ev = H.event("P", 1)
        assert (ev.phase, ev.reason) == ("failed", "transfer_error") and "no KV progress" in ev.detail
        # The first D heartbeat after the stall may still show the last page as new; then
        # `misses` heartbeats without progress (each resends the aux) and the failure on
        # the next one; + a few iterations for the heartbeat to travel.
        assert LEASE <= t - stalled_at <= LEASE + 2 * CFG.heartbeat_interval + 10 * DT
        assert t - stalled_at < SLOW_CFG.transfer_timeout
        # One resend per heartbeat without progress; on real sockets (tcp) a heartbeat that
        # overtakes the first data can count one more before the stall.
        assert 1 + CFG.heartbeat_misses <= H.aux_sent <= 2 + CFG.heartbeat_misses
        assert H.run_until(lambda: H.event("D", 1) is not None, 5)
        assert H.event("D", 1)[1].reason == "transfer_error"
        H.assert_no_leak()
    finally:
        H.close()


def test_heartbeats_that_waited_through_a_long_prefill_step_count_for_nothing(backend):
    """A prefill step of two leases: P heartbeats and pumps its backend between the layers
    (`mid_step`) but reads no heartbeat, so D's, each showing the room waiting with no
    page landed, queue up. D sent them before P computed the room: the pass that reads
    them right after the send counts none as a stall, and the room completes."""
    H = ProgressHarness(backend, seconds_per_page=0.0)
    try:
        H.request(1, n_pages=3)
        H.to_phase(1, "P", "queued")
        H.P.take_queued(1_000)                      # the step that computes the room starts
        for _ in range(int(2 * LEASE / DT)):
            H.clock.advance(DT)
            H.P.mid_step()
            H.D.step()
            if H.real:
                time.sleep(0.001)
        assert H.phase("D", 1) == "waiting" and H.phase("P", 1) == "prefill"   # the lease held
        H.prefill(1)                                # the step ends: the KV goes out
        assert H.run_until(lambda: ready(H, 1), 10), H.events
        assert all(ev.phase == "done" for _, ev in H.events), H.events
        H.D.finish(1)
        H.settle()
        H.assert_no_leak()
    finally:
        H.close()


def test_progress_resets_the_count_and_a_resumed_link_completes(backend):
    """Stall for less than the lease, resume, stall again for less than the lease: each
    stall starts its count from zero, so the room completes. The resends during the
    stalls are harmless duplicates."""
    H = ProgressHarness(backend, seconds_per_page=0.2, num_pages=16)
    try:
        H.request(1, n_pages=12)
        H.to_phase(1, "P", "queued")
        H.prefill(1)
        for landed in (3, 7):
            assert H.run_until(lambda: H.D._receivers[1].progress() >= landed * LAYOUT.page_bytes, 10)
            H.link.stall()
            H.step(int((LEASE - CFG.heartbeat_interval) / DT))
            H.link.resume()
        assert H.run_until(lambda: ready(H, 1), 20), H.events
        assert all(ev.phase == "done" for _, ev in H.events) and H.aux_sent > 1
        H.D.finish(1)
        H.assert_no_leak()
    finally:
        H.close()


def test_an_aux_behind_another_rooms_bytes_is_waited_for(backend):
    """Room 1's pages have all landed, but its aux follows room 2's pages on the link (the
    two writes interleaved), and those take longer than the lease to drain. While they
    land, room 1 is on its way: it is not failed (on a 2 Mbit/s link it was, in CI)."""
    H = ProgressHarness(backend, seconds_per_page=0.5, num_pages=24)
    try:
        H.link.stall()
        for rid, n in ((1, 2), (2, 12)):
            H.request(rid, n_pages=n)
            H.to_phase(rid, "P", "queued")
            H.prefill(rid)
        q = H.link.queue
        assert H.run_until(lambda: sum(isinstance(x[1].msg, wire.Aux) for x in q) == 2, 10)
        aux1 = [x for x in q if isinstance(x[1].msg, wire.Aux) and x[1].msg.room == 1]
        assert len(aux1) == 1
        q.remove(aux1[0])
        q.append(aux1[0])                     # behind room 2's 12 pages: 6 s at 0.5 s a page
        assert 12 * 0.5 > LEASE
        H.link.resume()
        assert H.run_until(lambda: ready(H, 1) and ready(H, 2), 30), H.events
        assert all(ev.phase == "done" for _, ev in H.events)
        H.D.finish(1)
        H.D.finish(2)
        H.assert_no_leak()
    finally:
        H.close()


def test_every_page_in_but_no_aux_still_fails_within_the_lease(backend):
    """Once every page has landed and nothing more of this worker's lands, only the aux or
    the ack is missing, so D ignoring the aux (the stuck-inflight scenario) fails after
    the same `heartbeat_misses` heartbeats as before progress was reported; the aux went
    again at each heartbeat since its pages were in."""
    H = ProgressHarness(backend, seconds_per_page=0.0, d_faults="ignore_aux=1")
    try:
        H.request(1, n_pages=3)
        H.to_phase(1, "P", "queued")
        H.prefill(1)
        t0 = H.clock.now()
        assert H.run_until(lambda: H.event("P", 1) is not None, 30)
        t, ev = H.event("P", 1)
        assert (ev.phase, ev.reason) == ("failed", "transfer_error")
        assert t - t0 <= LEASE + 2 * CFG.heartbeat_interval + 10 * DT
        assert 1 + CFG.heartbeat_misses <= H.aux_sent <= 2 + CFG.heartbeat_misses
        H.assert_no_leak()
    finally:
        H.close()


def test_decode_reports_progress_only_for_waiting_rooms(backend):
    H = ProgressHarness(backend, seconds_per_page=0.5)
    try:
        H.request(1, n_pages=4)
        H.request(2, n_pages=2, on_p=False)                    # stays in bootstrap on D
        H.to_phase(1, "P", "queued")
        assert H.D._heartbeat_progress() == {}                # nothing landed yet
        H.prefill(1)
        two = 2 * LAYOUT.page_bytes
        assert H.run_until(lambda: H.D._receivers[1].progress() >= two, 10)
        assert set(H.D._heartbeat_progress()) == {1} and H.D._heartbeat_progress()[1] >= two
        lease = H.P.leases.peers[H.dm.address]
        assert H.run_until(lambda: lease.progress.get(1, 0) >= two and lease.landed >= two, 5)   # P sees it
        assert H.run_until(lambda: ready(H, 1), 10)
        assert H.D._heartbeat_progress() == {}                # decoding: no longer reported
        H.D.finish(1)
        H.D.abort(2)
        H.assert_no_leak()
    finally:
        H.close()


# ---- a write that is still pending (aux not out yet) is judged by progress too ------------
def opaque(backend: str) -> bool:
    return TRANSFER_BACKENDS.get(backend).opaque_writes


def hung_write_ends(H: Harness) -> tuple[float, object]:
    """Start one 3-page room whose write hangs; -> (seconds until P ended it, P's event)."""
    H.request(1, n_pages=3)
    H.to_phase(1, "P", "queued")
    H.prefill(1)
    t0 = H.clock.now()
    assert H.run_until(lambda: H.event("P", 1) is not None, 30), (H.P.live(), H.D.live())
    t, ev = H.event("P", 1)
    return t - t0, ev


@pytest.mark.parametrize("backend", [b for b in BACKENDS if not opaque(b)])
def test_a_write_that_never_starts_fails_within_the_lease(backend):
    """`hang_transfer=1` on P: the write never starts, so the aux never goes out and D
    lists the room as waiting in every heartbeat. With no byte handed off and none landed,
    P fails it (transfer_error) within the lease plus two heartbeat intervals, long before
    --transfer-timeout. The hung write never confirms it stopped, so a one-sided D keeps
    the pages quarantined until its backstop; then everything is released once."""
    H = Harness(backend, SLOW_CFG, p_faults="hang_transfer=1")
    try:
        took, ev = hung_write_ends(H)
        assert (ev.phase, ev.reason) == ("failed", "transfer_error") and "write made no progress" in ev.detail
        assert LEASE <= took <= LEASE + 2 * CFG.heartbeat_interval + 10 * DT
        assert H.run_until(lambda: H.event("D", 1) is not None, 5)
        assert H.event("D", 1)[1].reason == "transfer_error"
        H.step(5)
        assert (1 in H.D.quarantine) == H.dm.one_sided       # a hung write never says it stopped
        H.assert_no_leak()
    finally:
        H.close()


class FullSocket:
    """P's tcp socket at its high-water mark: it takes a KV chunk only while fewer than
    `window` pages are between P and D's pool, so the write stays pending and drains as
    fast as the SlowLink lands pages."""

    def __init__(self, H: ProgressHarness, window: int) -> None:
        self.H, self.window = H, window
        self.sent = self.refused = 0
        self.inner = H.pm.channel.send
        H.pm.channel.send = self.send

    def send(self, dst, msg, frames=()):
        if isinstance(msg, TcpKV):
            if self.sent - self.H.link.delivered >= self.window:
                self.refused += 1
                return False
            self.sent += msg.num_pages
        return self.inner(dst, msg, frames)


@pytest.mark.skipif("tcp" not in BACKENDS, reason="tcp backend not under test")
def test_a_full_socket_that_drains_slowly_is_never_failed(monkeypatch):
    """tcp, one page per chunk, a socket that holds two pages, a link that lands one page
    per 0.8 s: the write of 16 pages stays pending (aux not out) for ~11 s, over three
    leases, while D reports pages landing. P never fails it; the bytes arrive exactly."""
    monkeypatch.setattr(tcp, "CHUNK_BYTES", LAYOUT.page_bytes)
    H = ProgressHarness("tcp", seconds_per_page=0.8, num_pages=20)
    try:
        sock = FullSocket(H, window=2)
        H.request(1, n_pages=16)
        H.to_phase(1, "P", "queued")
        dst = list(H.D.lc.rooms[1].data.pages)
        H.prefill(1)
        t0 = H.clock.now()
        H.step(int(3 * LEASE / DT))
        assert not H.P._senders[1].aux_sent and H.phase("P", 1) == "transfer"   # still pending
        assert H.run_until(lambda: ready(H, 1), 30), (H.P.live(), H.D.live(), H.events)
        assert H.clock.now() - t0 > 3 * LEASE and sock.refused > 0
        assert all(ev.phase == "done" for _, ev in H.events), H.events
        assert H.d_pages(dst) == pattern(1, 16 * LAYOUT.page_bytes)
        H.D.finish(1)
        H.assert_no_leak()
    finally:
        H.close()


def test_a_slow_opaque_write_is_never_failed_for_its_length():
    """A backend that declares `opaque_writes` (nixl: UCX reports a WRITE in flight only
    as in progress) shows nothing while its write is pending, so a write that takes three
    leases (here the one-sided fake, landing after 160 iterations) must not be failed by
    the pending-write rule. The same write on a backend that reports progress is."""
    for is_opaque in (True, False):
        H = Harness("fake", SLOW_CFG)
        H.pm.opaque_writes, H.pm.write_iters = is_opaque, int(3 * LEASE / DT)
        try:
            H.request(1, n_pages=3)
            H.to_phase(1, "P", "queued")
            H.prefill(1)
            assert H.run_until(lambda: ready(H, 1) or H.event("P", 1) is not None, 30), H.P.live()
            if is_opaque:
                assert ready(H, 1) and H.events == []
                H.D.finish(1)
            else:
                assert H.event("P", 1)[1].reason == "transfer_error"
            H.assert_no_leak()
        finally:
            H.close()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if opaque(b)] + ["fake"])
def test_a_hung_opaque_write_is_bounded_by_the_transfer_timeout(backend):
    """nixl (and the fake declared opaque): a write that never completes is left to
    --transfer-timeout (timeout:transfer), not failed by the lease; nothing leaks."""
    H = Harness(backend, with_cfg(transfer_timeout=12.0, waiting_timeout=60.0), p_faults="hang_transfer=1")
    H.pm.opaque_writes = True
    try:
        took, ev = hung_write_ends(H)
        assert (ev.phase, ev.reason) == ("failed", "timeout:transfer")
        assert 12.0 - DT <= took <= 12.0 + 2 * DT
        H.assert_no_leak()
    finally:
        H.close()


# ---- spans: a page is complete only with every byte; dropped bytes still move the link ----------
@pytest.mark.parametrize("backend", TWO_SIDED)
def test_a_lost_span_never_completes_its_page(backend):
    """Layer 0 of every page goes ahead and is lost on the way (the channel may lose a
    message); layer 1 and the aux arrive. Every page has some bytes in, but not all: D
    must not take the room (its KV would be wrong), and P fails it within the lease."""
    H = Harness(backend, SLOW_CFG)
    inner = H.dm.on_data
    H.dm.on_data = lambda rcv: None if rcv.msg.span_offset == 0 and rcv.msg.span_length else inner(rcv)
    try:
        H.request(1, n_pages=3)
        prefill_layer_wise(H, 1, 3)
        assert H.run_until(lambda: H.event("P", 1) is not None, 30), (H.P.live(), H.D.live())
        assert H.event("P", 1)[1].reason == "transfer_error"
        assert H.phase("D", 1) != "decode"
        assert H.run_until(lambda: H.event("D", 1) is not None, 5)
        assert not [r for r, _ in H.D.take_ready()]
        H.assert_no_leak()
    finally:
        H.close()


@pytest.mark.parametrize("backend", TWO_SIDED)
def test_late_bytes_of_an_ended_room_count_as_link_movement_only(backend):
    """A data frame for a room that has ended fails D's owner check and lands nowhere,
    but it crossed the link: D's count of bytes arrived from P (Heartbeat.landed) grows,
    so a room queued behind it on the link is not judged stalled; no room's progress moves."""
    H = Harness(backend)
    frames = []
    inner = H.dm.on_data
    H.dm.on_data = lambda rcv: (frames.append(rcv), inner(rcv))[1]
    try:
        H.request(1, n_pages=2)
        H.complete(1, n_pages=2)
        H.settle()
        before = H.dm._landed_from.get(H.pm.address, 0)
        assert frames and before >= 2 * LAYOUT.page_bytes
        late = frames[0]
        inner(late)                                   # the same bytes again, after the room ended
        grew = H.dm._landed_from[H.pm.address] - before
        assert grew == sum(len(memoryview(f)) for f in late.frames) > 0
        H.assert_no_leak()
    finally:
        H.close()
