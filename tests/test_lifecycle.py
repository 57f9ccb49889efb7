"""The pure state machines and leases under a SimClock (no transfer backend)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.core.clock import SimClock
from kvrelay.disagg import wire
from kvrelay.disagg.lease import Leases
from kvrelay.disagg.lifecycle import (D_TRANSITIONS, NO_PEER, P_TRANSITIONS, DPhase, Lifecycle, PPhase,
                                      TransitionError, d_deadlines, p_deadlines, timeout)
from disagg_helpers import CFG


def make_p(clock):
    return Lifecycle("prefill", PPhase, P_TRANSITIONS, p_deadlines(CFG), clock)


def test_terminal_phases_come_last_and_have_no_exits():
    for phases, table in ((PPhase, P_TRANSITIONS), (DPhase, D_TRANSITIONS)):
        live = [p for p in phases if p in table]
        terminal = [p for p in phases if p not in table]
        assert max(live) < min(terminal)
        assert {p.name for p in terminal} == {"DONE", "FAILED", "ABORTED"}
        for p in live:
            assert {phases.FAILED, phases.ABORTED} <= table[p]


def test_happy_path_and_illegal_moves():
    clock = SimClock()
    lc = make_p(clock)
    lc.add(1, "a")
    with pytest.raises(TransitionError):
        lc.move(1, PPhase.TRANSFER)
    for ph in (PPhase.QUEUED, PPhase.PREFILL, PPhase.TRANSFER):
        lc.move(1, ph)
    ev = lc.end(1, PPhase.DONE)
    assert (ev.phase, ev.from_phase, ev.reason) == ("done", "transfer", None)
    assert lc.rooms == {} and lc.phase_counts() == {"bootstrap": 0, "queued": 0, "prefill": 0, "transfer": 0}
    lc.add(2, "b")
    with pytest.raises(ValueError):
        lc.add(2, "b")


def test_only_a_room_without_a_peer_enters_past_the_first_phase():
    """A decode room its own engine prefills enters at decode, with decode's deadline; one
    with a peer must start at bootstrap, and no room enters at a terminal phase."""
    clock = SimClock()
    lc = Lifecycle("decode", DPhase, D_TRANSITIONS, d_deadlines(replace(CFG, max_request_time=30.0)), clock)
    with pytest.raises(TransitionError):
        lc.add(1, "a", peer="tcp://127.0.0.1:5000", phase=DPhase.DECODE)
    with pytest.raises(TransitionError):
        lc.add(1, "a", peer=NO_PEER, phase=DPhase.DONE)
    assert lc.rooms == {}
    r = lc.add(1, "a", peer=NO_PEER, phase=DPhase.DECODE)
    assert (r.phase, r.deadline) == (DPhase.DECODE, clock.now() + 30.0)
    assert lc.end(1, DPhase.DONE).from_phase == "decode"


def test_every_non_terminal_phase_has_its_deadline():
    clock = SimClock()
    lc = make_p(clock)
    lc.add(1, "a")
    lc.add(2, "b")
    lc.move(2, PPhase.QUEUED)
    clock.advance(CFG.bootstrap_timeout - 0.01)
    assert lc.expired() == []
    clock.advance(0.01)
    assert [r.room for r in lc.expired()] == [1]   # the watchdog sees every room, not one queue
    clock.advance(CFG.queue_timeout)
    assert sorted(r.room for r in lc.expired()) == [1, 2]
    lc.move(2, PPhase.PREFILL)
    assert lc.rooms[2].deadline is None             # bounded by compute
    assert timeout(PPhase.QUEUED) == "timeout:queued"
    d = d_deadlines(CFG)
    assert d[DPhase.BOOTSTRAP] and d[DPhase.WAITING] and DPhase.DECODE in d


def test_counts_ages_and_events():
    clock = SimClock()
    seen = []
    lc = Lifecycle("decode", DPhase, D_TRANSITIONS, d_deadlines(CFG), clock, on_terminal=seen.append)
    lc.add(1, "a", peer="tcp://p")
    clock.advance(2)
    lc.add(2, "b")
    assert lc.phase_counts()["bootstrap"] == 2 and lc.oldest_age() == 2
    ev = lc.end(1, DPhase.ABORTED, "aborted", "client left")
    assert seen == [ev] and lc.terminal_counts[("aborted", "aborted")] == 1
    row = lc.row(lc.rooms[2], "waiting")
    assert row["phase"] == "bootstrap" and row["deadline_in"] == CFG.bootstrap_timeout


def hb(seq, inc="i1", rooms=None):
    return wire.Heartbeat("w", inc, seq, rooms or {})


def test_leases_death_restart_and_stale():
    clock = SimClock()
    leases = Leases(CFG, clock)
    leases.expect("a")
    clock.advance(CFG.heartbeat_interval * CFG.heartbeat_misses - 0.01)
    assert leases.dead() == []
    assert leases.on_heartbeat("a", hb(5, rooms={1: "queued"})) == "ok"
    assert leases.on_heartbeat("a", hb(4)) == "stale"          # reordered: ignored
    assert leases.peers["a"].rooms == {1: "queued"}
    clock.advance(CFG.heartbeat_interval * CFG.heartbeat_misses)
    assert leases.dead() == ["a"]
    assert leases.on_heartbeat("a", hb(1, inc="i2")) == "restarted"
    assert leases.dead() == [] and leases.peers["a"].incarnation == "i2"


def test_any_message_renews_a_lease():
    """A peer that forgot us sends a BootstrapQuery before its next heartbeat: any message
    proves its loop alive. Messages from peers without a lease start none."""
    clock = SimClock()
    leases = Leases(CFG, clock)
    timeout = CFG.heartbeat_interval * CFG.heartbeat_misses
    leases.expect("a")
    clock.advance(timeout - 0.1)
    leases.heard({"a": clock.now(), "stranger": clock.now()})
    assert "stranger" not in leases.peers
    clock.advance(timeout - 0.1)
    assert leases.dead() == []
    leases.heard({"a": clock.now() - timeout})  # an older message never shortens the lease
    clock.advance(0.2)
    assert leases.dead() == ["a"]


def test_every_reason_a_room_can_end_with_is_a_typed_error_code():
    """Each lifecycle reason and each phase's timeout reads back as its own ErrorCode (none
    falls to internal_error), and its HTTP status is the documented one: a request that
    failed in the serving system is worth a retry (503), a deadline over the whole decode a 504."""
    from kvrelay.disagg.lifecycle import Reason, timeout
    from kvrelay.engine.types import ErrorCode, FinishReason, StepOutput
    from kvrelay.server.errors import from_failed_output

    texts = [f"{r.value}: detail {i}" for i, r in enumerate(Reason)]
    texts += [f"{timeout(p)}: detail" for p in (*PPhase, *DPhase) if p.name not in ("DONE", "FAILED", "ABORTED")]
    for text in texts:
        out = StepOutput("r", finish_reason=FinishReason.ERROR, error=text)
        assert out.error_code is not ErrorCode.INTERNAL_ERROR and out.error_code.value == text.split(": ")[0], text
        assert out.error_detail == text.split(": ", 1)[1]
        err = from_failed_output(out)
        want = 400 if out.error_code is ErrorCode.INVALID_REQUEST else 504 if text.startswith("timeout:decode") else 503
        assert (err.status, err.code, err.message) == (want, out.error_code.value, text), text
    odd = StepOutput("r", finish_reason=FinishReason.ERROR, error="no code here")
    assert odd.error_code is ErrorCode.INTERNAL_ERROR and odd.error_detail == "no code here"
    assert (from_failed_output(odd).status, from_failed_output(odd).code) == (500, "internal_error")
