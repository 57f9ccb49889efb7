"""The lifecycle promise (docs/lifecycle.md), proved on every backend:
abort everywhere, deadlines per phase, leases, lost/duplicated/late messages, no leak."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from disagg_helpers import BACKENDS, CFG, DELIVERY, DT, LAYOUT, Harness, pattern, with_cfg
from kvrelay.disagg import wire
from kvrelay.disagg.transfer.base import TransferStatus

LEASE = CFG.heartbeat_interval * CFG.heartbeat_misses


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def make(backend, **kw) -> Harness:
    return Harness(backend, **kw)


def test_happy_path_moves_exact_bytes(backend):
    H = make(backend)
    try:
        H.request(1, n_pages=3)
        H.to_phase(1, "P", "queued")
        dst = list(H.D.lc.rooms[1].data.pages)
        H.prefill(1)
        ready = []
        assert H.run_until(lambda: bool(ready.extend(H.D.take_ready()) or ready))
        room, aux = ready[0]
        assert room == 1 and aux.first_token == 7 and aux.prompt_tokens == 12 and aux.logprob == -0.25
        assert H.d_pages(dst) == pattern(1, 3 * LAYOUT.page_bytes)
        assert H.run_until(lambda: H.phase("P", 1) is None)
        assert H.event("P", 1)[1].phase == "done"
        H.D.finish(1)
        assert H.event("D", 1)[1].phase == "done"
        H.assert_no_leak()
    finally:
        H.close()


def queue_two(H: Harness) -> None:
    """Rooms 1 and 2 paired, both queued at P."""
    for room in (1, 2):
        H.request(room)
    for room in (1, 2):
        H.to_phase(room, "P", "queued")


def test_inside_a_pass_only_settled_transfers_end(backend):
    """Between a pass's layers (`mid_step`) P ends a room in transfer once D acks it, so
    its transfer phase measures the transfer, not the rest of the step. A room the pass
    may be computing into (prefill) stays, even with its sender failed: it ends at the
    step's end."""
    H = make(backend)
    try:
        queue_two(H)
        H.prefill(1)                          # the pass that computes room 2 runs from here
        assert H.phase("P", 1) == "transfer" and H.phase("P", 2) == "prefill"
        H.D.abort(2, "aborted", "client went away")   # D tells P room 2 ended
        ready: list = []
        for _ in range(int(2 / DT)):
            H.clock.advance(DT)
            H.P.mid_step()
            H.D.step()
            ready += H.D.take_ready()
            if H.real:
                time.sleep(0.001)
            if H.phase("P", 1) is None and H.P._senders[2].poll() is TransferStatus.FAILED:
                break
        assert [room for room, _ in ready] == [1]
        assert H.phase("P", 1) is None and H.event("P", 1)[1].phase == "done"
        assert H.p_released.get(1) == 1 and H.p_released.get(2) is None
        assert H.phase("P", 2) == "prefill"   # failed sender, but the pass may still write its pages
        H.P.step()                            # the step's end
        assert H.phase("P", 2) is None and H.event("P", 2)[1].phase == "aborted"
        H.D.finish(1)
        H.assert_no_leak()
    finally:
        H.close()


# ---- abort in every phase, on both sides --------------------------------------------------

def _reach(H: Harness, side: str, phase: str) -> None:
    """Put room 1 in `phase` on `side`."""
    if (side, phase) == ("P", "bootstrap"):
        return
    if (side, phase) == ("D", "bootstrap"):
        H.dalloc.allocate(H.num_pages, "hog")  # pool full: D stays in bootstrap
        H.step(3)
        return
    if (side, phase) in (("P", "queued"), ("D", "waiting")):
        H.to_phase(1, "P", "queued")
        return
    H.to_phase(1, "P", "queued")
    if (side, phase) == ("P", "prefill"):
        H.P.take_queued(1)
        return
    H.prefill(1)
    if (side, phase) == ("P", "transfer"):
        return
    assert H.run_until(lambda: H.D.take_ready() != [] or H.phase("D", 1) == "decode")  # D decode


PHASES = [("P", "bootstrap"), ("P", "queued"), ("P", "prefill"), ("P", "transfer"),
          ("D", "bootstrap"), ("D", "waiting"), ("D", "decode")]


@pytest.mark.parametrize("side,phase", PHASES)
def test_abort_in_every_phase(backend, side, phase):
    H = make(backend, p_faults="drop_ack=1" if phase == "transfer" else None)
    try:
        H.request(1)
        _reach(H, side, phase)
        assert H.phase(side, 1) == phase
        me = H.P if side == "P" else H.D
        endpoint = (H.P._senders if side == "P" else H.D._receivers).get(1)
        assert me.abort(1)
        if endpoint is not None:
            assert endpoint.poll() is TransferStatus.FAILED
            endpoint.abort("aborted")  # idempotent, still FAILED
            assert endpoint.poll() is TransferStatus.FAILED
        t0, ev = H.event(side, 1)
        assert (ev.phase, ev.reason, ev.from_phase) == ("aborted", "aborted", phase)
        other = "D" if side == "P" else "P"
        if (side, phase) != ("D", "decode"):
            assert H.run_until(lambda: H.event(other, 1) is not None, LEASE + 1)
            t1, oev = H.event(other, 1)
            assert oev.phase == "aborted" and oev.reason == "aborted", oev
            assert t1 - t0 <= CFG.heartbeat_interval + 2 * DT
        H.dalloc.free("hog")
        H.assert_no_leak()
    finally:
        H.close()


# ---- a deadline per phase ---------------------------------------------------------------------

TIMEOUTS = {
    ("P", "bootstrap"): dict(cfg=with_cfg(bootstrap_timeout=3.0)),
    ("P", "queued"): dict(cfg=with_cfg(queue_timeout=4.0, waiting_timeout=100.0)),
    ("P", "transfer"): dict(cfg=with_cfg(transfer_timeout=3.0, waiting_timeout=100.0), p_faults="hang_transfer=1"),
    ("D", "bootstrap"): dict(cfg=with_cfg(bootstrap_timeout=3.0)),
    ("D", "waiting"): dict(cfg=with_cfg(waiting_timeout=4.0, queue_timeout=100.0)),
    ("D", "decode"): dict(cfg=with_cfg(max_request_time=3.0)),
}


@pytest.mark.parametrize("side,phase", list(TIMEOUTS))
def test_timeout_in_every_phase(backend, side, phase):
    kw = TIMEOUTS[(side, phase)]
    H = make(backend, **kw)
    cfg = kw["cfg"]
    try:
        H.request(1, on_d=(side, phase) != ("P", "bootstrap"))
        _reach(H, side, phase)
        r = (H.P if side == "P" else H.D).lc.rooms[1]
        entered, deadline = r.entered, r.deadline
        assert H.run_until(lambda: H.event(side, 1) is not None, 200)
        t, ev = H.event(side, 1)
        assert (ev.phase, ev.reason) == ("failed", f"timeout:{phase}"), ev
        assert deadline - entered > 0 and t <= deadline + DT + 1e-9
        other = "D" if side == "P" else "P"
        if (side, phase) not in (("P", "bootstrap"), ("D", "decode")):
            assert H.run_until(lambda: H.event(other, 1) is not None, LEASE + 1)
            oev = H.event(other, 1)[1]
            # both bootstrap backstops are equal, so P may time out in the same iteration
            assert oev.reason == "peer_failed" or oev.reason == "timeout:bootstrap" == ev.reason, oev
        H.dalloc.free("hog")
        H.assert_no_leak()
        assert cfg is H.cfg
    finally:
        H.close()


# ---- leases -----------------------------------------------------------------------------------

@pytest.mark.parametrize("silent", ["P", "D"])
@pytest.mark.parametrize("phase", ["queued", "transfer"])
def test_peer_that_stops_heartbeating_fails_its_rooms(backend, silent, phase):
    H = make(backend, cfg=with_cfg(queue_timeout=100, waiting_timeout=100, transfer_timeout=100),
             p_faults="hang_transfer=1")
    try:
        H.request(1)
        H.to_phase(1, "P", "queued")
        if phase == "transfer":
            H.prefill(1)
        H.set_faults(silent, "drop_heartbeat=1;" + ("hang_transfer=1" if silent == "P" else ""))
        t_stop = H.clock.now()
        watcher = "D" if silent == "P" else "P"
        assert H.run_until(lambda: H.event(watcher, 1) is not None, 2 * LEASE)
        t, ev = H.event(watcher, 1)
        assert (ev.phase, ev.reason) == ("failed", "peer_failed") and "heartbeats" in ev.detail, ev
        assert t <= t_stop + LEASE + DT + 1e-9
        H.set_faults(silent, "")
        H.assert_no_leak()
    finally:
        H.close()


@pytest.mark.parametrize("forgetter", ["P", "D"])
def test_peer_that_forgets_a_room(backend, forgetter):
    H = make(backend, cfg=with_cfg(queue_timeout=100, waiting_timeout=100))
    try:
        H.request(1)
        H.to_phase(1, "P", "queued")
        H.step(int(2 * CFG.heartbeat_interval / DT))  # both sides have listed the room
        t_forget = H.clock.now()
        if forgetter == "P":
            H.P.lc.rooms.pop(1)
            H.P._senders.pop(1).close()
            H.palloc.free(1)
        else:
            r = H.D.lc.rooms.pop(1)
            H.D._receivers.pop(1).close()
            H.dalloc.free(1)
            r.data.pages = None   # its pages went back to the pool above
        watcher = "D" if forgetter == "P" else "P"
        assert H.run_until(lambda: H.event(watcher, 1) is not None, 2 * LEASE)
        t, ev = H.event(watcher, 1)
        assert (ev.phase, ev.reason) == ("failed", "peer_failed") and "no longer holds" in ev.detail, ev
        # within one heartbeat (plus, over real sockets, the delivery: the SimClock runs on while a
        # frame is in flight), well inside the lease that would otherwise end it
        assert t <= t_forget + CFG.heartbeat_interval + 2 * DT + (DELIVERY if H.real else 0) + 1e-9
        H.assert_no_leak()
    finally:
        H.close()


@pytest.mark.parametrize("phase", ["waiting", "bootstrap"])
def test_prefill_restart_fails_decode_rooms(backend, phase):
    H = make(backend, cfg=with_cfg(queue_timeout=100, waiting_timeout=100, bootstrap_timeout=100))
    try:
        H.request(1)
        if phase == "bootstrap":
            H.dalloc.allocate(H.num_pages, "hog")
        H.to_phase(1, "D", phase)
        H.step(int(2 * CFG.heartbeat_interval / DT))
        t_restart = H.clock.now()
        H.restart_p()
        H.request(2, on_d=True)  # new traffic lets D meet the new incarnation
        assert H.run_until(lambda: H.event("D", 1) is not None, 2 * LEASE)
        t, ev = H.event("D", 1)
        assert (ev.phase, ev.reason) == ("failed", "peer_failed"), ev
        assert t <= t_restart + LEASE + DT + 1e-9
        H.dalloc.free("hog")
        H.complete(2)
        H.assert_no_leak()
    finally:
        H.close()


@pytest.mark.parametrize("phase", ["queued", "transfer"])
def test_decode_restart_fails_prefill_rooms(backend, phase):
    H = make(backend, cfg=with_cfg(queue_timeout=100, transfer_timeout=100, waiting_timeout=100),
             d_faults="drop_ack=1")  # keeps P in transfer; the restarted D has no faults
    try:
        H.request(1)
        H.to_phase(1, "P", "queued")
        if phase == "transfer":
            H.prefill(1)
        assert H.phase("P", 1) == phase
        H.step(int(2 * CFG.heartbeat_interval / DT))
        t_restart = H.clock.now()
        H.restart_d()
        assert H.run_until(lambda: H.event("P", 1) is not None, 2 * LEASE)
        t, ev = H.event("P", 1)
        assert (ev.phase, ev.reason) == ("failed", "peer_failed"), ev
        # The old incarnation's last heartbeat may still be on a real socket at the restart
        # and be heard one step later; its lease then ends one step later too.
        assert t <= t_restart + LEASE + 2 * DT + 1e-9
        H.request(2)  # the new incarnation serves new traffic
        H.complete(2)
        H.assert_no_leak()
    finally:
        H.close()


@pytest.mark.parametrize("phase", ["queued", "waiting"])
def test_slow_request_kept_alive_by_heartbeats(backend, phase):
    H = make(backend, cfg=with_cfg(queue_timeout=1000, waiting_timeout=1000))
    try:
        H.request(1)
        H.to_phase(1, "P", "queued")
        H.step(int(10 * LEASE / DT))
        assert H.phase("P", 1) == "queued" and H.phase("D", 1) == "waiting"
        assert H.events == []
        H.complete(1)
        H.assert_no_leak()
    finally:
        H.close()


# ---- lost, duplicated, late messages ----------------------------------------------------------

RECOVERABLE = {
    "dup": dict(p_faults="dup_ctrl=1", d_faults="dup_ctrl=1"),
    "delay": dict(p_faults="delay_ctrl=0.3", d_faults="delay_ctrl=0.3"),
    "reorder": dict(p_faults="reorder_ctrl=0.5;seed=3", d_faults="reorder_ctrl=0.5;seed=4"),
    "lost_ack": dict(d_faults="drop_ack=1"),
    "lost_destination": dict(d_faults="drop:Destination=1"),   # switched off after 1 s
    "lost_aux": dict(p_faults="drop:Aux=1"),                   # switched off after 1 s
}


@pytest.mark.parametrize("fault", list(RECOVERABLE))
def test_recoverable_message_faults_complete(backend, fault):
    H = make(backend, **RECOVERABLE[fault])
    try:
        for room in (1, 2, 3):
            H.request(room)
        if fault == "lost_destination":
            H.step(int(1.0 / DT))
            assert H.phase("P", 1) == "bootstrap"
            H.set_faults("D", "")
        for room in (1, 2, 3):
            H.prefill(room)
        if fault == "lost_aux":
            H.step(int(1.0 / DT))
            assert H.phase("D", 1) == "waiting"
            H.set_faults("P", "")
        ready = set()
        assert H.run_until(lambda: bool(ready.update(r for r, _ in H.D.take_ready())) or ready == {1, 2, 3}, 20)
        for room in (1, 2, 3):
            H.D.finish(room)
        H.settle()
        assert {(ev.side, ev.phase) for _, ev in H.events} == {("prefill", "done"), ("decode", "done")}
        H.assert_no_leak()
    finally:
        H.close()


def test_random_loss_always_terminates(backend):
    H = make(backend, p_faults="drop_ctrl=0.2;dup_ctrl=0.1;seed=5", d_faults="drop_ctrl=0.2;reorder_ctrl=0.2;seed=6")
    try:
        rooms = list(range(1, 7))
        for room in rooms:
            H.request(room)
        for _ in range(int(30 / DT)):
            for room in H.P.take_queued(10):
                n = len(H.P._senders[room].dest.dst_pages)
                H.P.prefill_done(room, H.palloc.allocate(n, room), wire.Aux(0, 0, first_token=1))
            for room, _ in H.D.take_ready():
                H.D.finish(room)
            H.step()
            if H.P.idle() and H.D.idle():
                break
        bound = CFG.bootstrap_timeout + CFG.queue_timeout + CFG.transfer_timeout + CFG.waiting_timeout
        for side in ("P", "D"):
            for room in rooms:
                t, ev = H.event(side, room)
                assert ev.age <= bound + 2 * DT
                assert ev.phase == "done" or ev.reason in ("peer_failed", "aborted") or ev.reason.startswith("timeout:")
        H.assert_no_leak()
    finally:
        H.close()


def test_layout_mismatch_names_the_fields(backend):
    H = make(backend)
    try:
        other = replace(LAYOUT, head_dim=8, dtype="bfloat16")
        H.pm.layout = other  # P now advertises a different layout
        H.request(1)
        assert H.run_until(lambda: H.event("D", 1) is not None, 5)
        ev = H.event("D", 1)[1]
        assert ev.reason == "invalid_request" and "head_dim" in ev.detail and "dtype" in ev.detail
        H.pm.layout = LAYOUT
        H.assert_no_leak()
    finally:
        H.close()


def test_debug_rows_and_gauges_agree(backend):
    H = make(backend)
    try:
        queue_two(H)
        H.P.take_queued(1)
        rows = H.P.live()
        assert {r["phase"] for r in rows} == {"prefill", "queued"}
        counts = H.P.phase_counts()
        assert counts["prefill"] == 1 and counts["queued"] == 1 and sum(counts.values()) == len(rows)
        for row in rows:
            assert row["peer"] == H.dm.address and row["age"] > 0
            assert row["phase"] == "prefill" or 0 < row["deadline_in"] <= CFG.queue_timeout
        assert [r["phase"] for r in H.D.live()] == ["waiting", "waiting"]
        assert H.D.oldest_age() > 0
        for room in (1, 2):
            H.P.abort(room)
        H.assert_no_leak()
    finally:
        H.close()
