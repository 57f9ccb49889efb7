"""A judge's stall is not a peer's fault (issue #53; lifecycle.md invariant 9): the loops
that hold leases measure their own gaps (`core.stall.StallWatch`) and a lease counts only
the time they were looking, for the router's workers (`WorkerTable.expire_leases`) and for
a worker's P<->D peers (`lease.Leases`). Pure, on a SimClock; the simulation's router
stall fault and the chaos router SIGSTOP test the same on whole clusters."""
from __future__ import annotations

import pytest

from kvrelay.core import mutation
from kvrelay.core.clock import SimClock
from kvrelay.core.config import LifecycleConfig
from kvrelay.core.stall import StallWatch
from kvrelay.disagg import wire
from kvrelay.disagg.lease import Leases
from kvrelay.server.pairing import WorkerTable
from kvrelay.server.worker_protocol import WorkerHealth

P, D = "http://p:1", "http://d:1"


def tick(clock: SimClock, watch: StallWatch, seconds: float, every: float = 0.25) -> None:
    for _ in range(round(seconds / every)):
        clock.advance(every)
        watch.look()


def test_only_the_gap_past_the_tolerance_is_a_stall():
    clock = SimClock(0.0)
    w = StallWatch(clock, tolerance=0.5, horizon=60.0)
    tick(clock, w, 2.0)                        # looks every 0.25 s: no stall
    assert (w.count, w.seconds, w.blind(0.0)) == (0, 0.0, 0.0)
    clock.advance(4.0)
    assert w.look() == pytest.approx(3.5)      # blind from 0.5 s after the last look
    assert w.blind(0.0) == pytest.approx(3.5) and w.blind(4.0) == pytest.approx(2.0)
    assert w.silent(2.0) == pytest.approx(6.0 - 2.0 - 3.5)
    clock.advance(100.0)
    w.look()
    assert w.blind(0.0) == pytest.approx(99.5)   # the first stall is past the horizon: forgotten


def health(role: str) -> WorkerHealth:
    return WorkerHealth(role=role, worker_id=role, incarnation="i", model="m", max_model_len=64,
                        transfer_backend="fake", transfer_address="a", live_requests=0, queued_requests=0,
                        free_pages=8, total_pages=8)


def test_the_router_does_not_count_its_own_stall_against_its_workers():
    clock = SimClock(0.0)
    table, stalls = WorkerTable([P], [D], clock), StallWatch(clock, tolerance=0.5, horizon=60.0)
    table.mark_ok(P, health("prefill"))
    table.mark_ok(D, health("decode"))
    tick(clock, stalls, 1.0)
    clock.advance(10.0)                        # the router's loop stood still for 10 s
    stalls.look()
    assert table.expire_leases(3.0, stalls) == []
    with mutation.active("judge_counts_own_stall"):
        assert [w.url for w in table.expire_leases(3.0, stalls)] == [P, D]
    table.mark_ok(P, health("prefill"))
    table.mark_ok(D, health("decode"))
    tick(clock, stalls, 2.5)
    table.mark_ok(P, health("prefill"))        # D falls silent while the router looks
    tick(clock, stalls, 1.0)
    dead = table.expire_leases(3.0, stalls)
    assert [w.url for w in dead] == [D] and "lease 3 s" in dead[0].last_error


def heartbeat(seq: int) -> wire.Heartbeat:
    return wire.Heartbeat("w", "inc", seq, {}, {}, 0)


def test_a_workers_lease_of_its_peer_counts_only_its_own_looking():
    clock = SimClock(0.0)
    cfg = LifecycleConfig(heartbeat_interval=0.5, heartbeat_misses=3)
    stalls = StallWatch(clock, tolerance=0.25, horizon=60.0)
    leases = Leases(cfg, clock, stalls)
    leases.on_heartbeat("tcp://peer:1", heartbeat(1))
    clock.advance(0.2)
    stalls.look()
    clock.advance(5.0)                         # this worker's loop stood still (a long call, SIGSTOP)
    stalls.look()
    assert leases.dead() == []
    tick(clock, stalls, 1.5)                   # then it looked for a whole lease: the peer stayed silent
    assert leases.dead() == ["tcp://peer:1"]
