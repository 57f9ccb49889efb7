"""The router's worker table: who is up, and which (prefill, decode) pair a request gets."""
from __future__ import annotations

import pytest

from kvrelay.core.clock import SimClock
from kvrelay.server.pairing import Change, NoPair, Pair, WorkerTable, split
from kvrelay.server.worker_protocol import WorkerHealth

P1, P2 = "http://p1:8000", "http://p2:8000"
D1, D2, D3 = "http://d1:8000", "http://d2:8000", "http://d3:8000"


def health(role: str, queued: int = 0, free: int = 100, incarnation: str = "a", tokens: int = 0,
           per_token: float | None = None) -> WorkerHealth:
    return WorkerHealth(role=role, worker_id="w", incarnation=incarnation, model="m", max_model_len=2048,
                        transfer_backend="shm", transfer_address="tcp://127.0.0.1:5000", live_requests=queued,
                        queued_requests=queued, free_pages=free, total_pages=100, queued_prompt_tokens=tokens,
                        prefill_s_per_token=per_token)


def table(prefill=(P1,), decode=(D1,), clock=None) -> WorkerTable:
    t = WorkerTable(prefill, decode, clock or SimClock())
    for url in t.urls():
        t.mark_ok(url, health(t.get(url).role))
    return t


def pick(t: WorkerTable, **kw) -> tuple[str, str]:
    pair = t.pick_pair(**kw)
    assert isinstance(pair, Pair), pair
    return pair.prefill.url, pair.decode.url


def test_the_least_queued_workers_are_picked():
    t = table(prefill=(P1, P2), decode=(D1, D2))
    t.mark_ok(P1, health("prefill", queued=3))
    t.mark_ok(D2, health("decode", queued=1))
    assert pick(t) == (P2, D1)


def test_legs_the_router_has_open_count_as_load_until_they_end():
    t = table(prefill=(P1, P2))
    t.leg_started(P1)
    t.leg_started(P1)
    assert pick(t)[0] == P2
    t.leg_started(P2)
    assert pick(t)[0] == P2   # 1 open leg beats 2
    t.leg_ended(P1)
    t.leg_ended(P1)
    assert pick(t)[0] == P1
    assert t.get(P1).outstanding == 0


def test_leg_ended_without_leg_started_is_refused():
    t = table()
    with pytest.raises(ValueError):
        t.leg_ended(P1)


def test_among_equal_queues_the_decode_worker_with_more_free_pages_wins():
    t = table(decode=(D1, D2, D3))
    t.mark_ok(D1, health("decode", free=10))
    t.mark_ok(D2, health("decode", free=90))
    t.mark_ok(D3, health("decode", queued=1, free=100))
    assert [pick(t)[1] for _ in range(3)] == [D2, D2, D2]


def test_the_prefill_worker_with_the_soonest_predicted_first_token_is_picked():
    t = table(prefill=(P1, P2))
    # P1 has fewer requests queued but more prompt work: 3,000 tokens at 1 ms vs 400 at 2 ms.
    t.mark_ok(P1, health("prefill", queued=1, tokens=3000, per_token=0.001))
    t.mark_ok(P2, health("prefill", queued=4, tokens=400, per_token=0.002))
    assert t.get(P1).predicted_wait(100) == pytest.approx(3.1)
    assert t.get(P2).predicted_wait(100) == pytest.approx(1.0)
    assert pick(t)[0] == P2
    # What the router sent since the last report counts until the next report.
    t.leg_started(P2, 1500)
    assert t.get(P2).predicted_wait() == pytest.approx(3.8)
    assert pick(t)[0] == P1
    t.mark_ok(P2, health("prefill", queued=5, tokens=1900, per_token=0.002))
    assert (t.get(P2).sent_tokens, t.get(P2).predicted_wait()) == (0, pytest.approx(3.8))
    # Not measured yet (no prefill since it started): no prediction.
    t.mark_ok(P1, health("prefill", queued=0, tokens=0))
    assert t.get(P1).predicted_wait(100) is None and pick(t)[0] == P1


def test_the_adaptive_split_sends_to_the_decode_worker_only_what_p_would_serve_late_and_d_sooner():
    t = table()
    pair = t.pick_pair()
    assert isinstance(pair, Pair)
    assert split(pair, 100, 1.0) is pair   # nothing measured: no prediction, no move
    t.mark_ok(P1, health("prefill", tokens=2000, per_token=0.001))
    pair = t.pick_pair()
    assert split(pair, 100, 0.0) is pair   # off
    assert split(pair, 100, 3.0) is pair   # P predicts 2.1 s: within the limit
    moved = split(pair, 100, 1.0)          # D predicts 0.1 s at P's rate (it measured none)
    assert moved.prefill is None and moved.decode is pair.decode
    assert (moved.urls, moved.prefill_url) == (frozenset({D1}), D1)
    # D's own queue and rate count: 1,500 tokens at 2 ms (3.2 s) is later than P's 2.1 s.
    t.mark_ok(D1, health("decode", tokens=1500, per_token=0.002))
    assert split(t.pick_pair(), 100, 1.0).prefill is not None
    # What the router sent D since its report counts: 300 tokens at 1 ms beat P's 2.1 s, 2,300 do not.
    t.mark_ok(D1, health("decode", tokens=200, per_token=0.001))
    assert split(t.pick_pair(), 100, 1.0).prefill is None
    t.leg_started(D1, 2000)
    assert split(t.pick_pair(), 100, 1.0).prefill is not None


def test_equally_loaded_workers_take_turns():
    t = table(prefill=(P1, P2), decode=(D1, D2, D3))
    picks = [pick(t) for _ in range(6)]
    assert [p for p, _ in picks] == [P1, P2, P1, P2, P1, P2]
    assert [d for _, d in picks] == [D1, D2, D3, D1, D2, D3]


def test_round_robin_skips_a_worker_that_is_down_and_continues_after_it_rejoins():
    t = table(decode=(D1, D2, D3))
    assert pick(t)[1] == D1
    t.mark_failed(D2, "connection refused")
    assert [pick(t)[1] for _ in range(3)] == [D3, D1, D3]
    t.mark_ok(D2, health("decode"))
    assert [pick(t)[1] for _ in range(3)] == [D1, D2, D3]


def test_one_failure_marks_a_worker_down_and_a_good_check_brings_it_back():
    clock = SimClock()
    t = table(decode=(D1, D2), clock=clock)
    clock.advance(5)
    assert t.mark_failed(D1, "ConnectError: refused") is Change.WENT_DOWN
    assert t.mark_failed(D1, "ConnectError: refused") is None   # already down
    row = next(r for r in t.rows() if r["url"] == D1)
    assert (row["up"], row["failures"], row["last_error"]) == (False, 2, "ConnectError: refused")
    assert {pick(t)[1] for _ in range(4)} == {D2}
    clock.advance(2)
    assert t.mark_ok(D1, health("decode")) is Change.REJOINED
    row = next(r for r in t.rows() if r["url"] == D1)
    assert (row["up"], row["failures"], row["last_error"], row["for_s"]) == (True, 0, None, 0.0)
    assert {pick(t)[1] for _ in range(4)} == {D1, D2}


def test_a_slow_worker_stays_up_but_is_picked_only_when_its_role_has_no_other():
    clock = SimClock()
    t = table(prefill=(P1, P2), decode=(D1,), clock=clock)
    late = "no answer to GET /health within --health-timeout 2 s"
    assert t.mark_slow(P1, late) is Change.SLOW
    assert t.mark_slow(P1, late) is None   # reported once
    assert [pick(t)[0] for _ in range(3)] == [P2, P2, P2]
    assert pick(t, exclude={P2})[0] == P1   # an answering worker that failed this request loses to a slow one
    row = next(r for r in t.rows() if r["url"] == P1)
    assert (row["up"], row["slow"], row["failures"], row["last_error"]) == (True, True, 2, late)
    # The only decode worker is slow: it is still picked; a busy worker is not a dead one.
    assert t.mark_slow(D1, late) is Change.SLOW
    assert pick(t)[1] == D1
    # A good check clears it; a definite failure takes it down; the lease still ends it.
    assert t.mark_ok(P1, health("prefill")) is None and not t.get(P1).slow
    assert t.mark_slow(P1, late) is Change.SLOW
    assert t.mark_failed(P1, "ConnectError: refused") is Change.WENT_DOWN and not t.get(P1).slow
    t.mark_ok(P1, health("prefill"))
    clock.advance(3)
    t.mark_ok(P1, health("prefill"))
    t.mark_ok(P2, health("prefill"))
    assert [w.url for w in t.expire_leases(3.0)] == [D1]
    assert isinstance(t.pick_pair(), NoPair)


def test_health_changes_are_reported_once():
    t = WorkerTable((P1,), (D1,), SimClock())
    assert t.mark_ok(P1, health("prefill")) is Change.JOINED
    assert t.mark_ok(P1, health("prefill", queued=2)) is None
    assert t.mark_ok(P1, health("prefill", incarnation="b")) is Change.RESTARTED
    t.mark_failed(P1, "gone")
    assert t.mark_ok(P1, health("prefill", incarnation="c")) is Change.RESTARTED   # restarted while down
    assert t.get(P1).up


def test_no_pair_names_the_role_without_a_healthy_worker():
    t = WorkerTable((P1,), (D1, D2), SimClock())
    t.mark_ok(P1, health("prefill"))
    result = t.pick_pair()
    assert isinstance(result, NoPair)
    assert "no healthy decode worker" in result.message and "not checked yet" in result.message
    t.mark_ok(D2, health("decode"))
    t.mark_failed(P1, "ReadTimeout")
    result = t.pick_pair()
    assert isinstance(result, NoPair)
    assert result.message == f"no healthy prefill worker ({P1}: ReadTimeout)"


def test_excluded_workers_are_used_only_when_their_role_has_no_other():
    t = table(prefill=(P1,), decode=(D1, D2))
    for _ in range(4):
        assert pick(t, exclude={P1, D1}) == (P1, D2)
    t.mark_ok(D2, health("decode", queued=50))
    assert pick(t, exclude={D1}) == (P1, D2)   # even when more loaded
    t.mark_failed(D2, "down")
    assert pick(t, exclude={D1}) == (P1, D1)


def test_a_worker_table_needs_each_role_and_distinct_urls():
    with pytest.raises(ValueError, match="no decode worker"):
        WorkerTable((P1,), (), SimClock())
    with pytest.raises(ValueError, match="listed twice"):
        WorkerTable((P1,), (P1,), SimClock())
    t = WorkerTable((P1,), (D1,), SimClock())
    assert not t.up("prefill") and not t.up("decode")   # nobody is up before a good check


def test_a_worker_silent_for_the_lease_dies_once_and_a_good_check_starts_a_new_lease():
    clock = SimClock()
    t = table(prefill=(P1,), decode=(D1, D2), clock=clock)
    clock.advance(2.9)
    t.mark_ok(D2, health("decode"))
    assert t.expire_leases(3.0) == []            # 2.9 s of silence: still within the lease
    clock.advance(0.1)
    died = t.expire_leases(3.0)
    assert sorted(w.url for w in died) == [D1, P1]
    assert all(w.dead and not w.up and "lease 3 s" in w.last_error for w in died)
    assert t.get(D2).up and not t.get(D2).dead
    clock.advance(10)
    assert [w.url for w in t.expire_leases(3.0)] == [D2]   # each death is reported once
    assert t.expire_leases(3.0) == []
    assert isinstance(t.pick_pair(), NoPair)
    assert t.mark_ok(D1, health("decode")) is Change.REJOINED
    assert t.get(D1).up and not t.get(D1).dead
    clock.advance(3.0)
    assert [w.url for w in t.expire_leases(3.0)] == [D1]    # the new lease ends like the first


def test_a_worker_never_checked_holds_no_lease():
    clock = SimClock()
    t = WorkerTable((P1,), (D1,), clock)
    clock.advance(100)
    assert t.expire_leases(1.0) == []
    assert [row["last_ok_s"] for row in t.rows()] == [None, None]
