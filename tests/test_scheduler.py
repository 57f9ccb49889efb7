"""The allocator and the continuous-batching scheduler, pure Python (no model)."""
import pytest

from kvrelay.core.clock import SimClock
from kvrelay.core.config import SchedulerConfig
from kvrelay.engine.allocator import IntegrityError, PageAllocator
from kvrelay.engine.request import Req, ReqStatus
from kvrelay.engine.scheduler import Scheduler, StepCosts
from kvrelay.engine.types import FinishReason, SamplingParams


def make(num_pages=8, page_size=4, max_running=8, budget=64):
    alloc = PageAllocator(num_pages)
    return alloc, Scheduler(SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=budget), alloc, page_size)


def req(rid, prompt_len, max_tokens=8):
    return Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, token=7):
    """Simulate one engine step: mark compute done and append a sampled token."""
    batch = s.schedule()
    s.on_decode_done(batch.decode)
    for r in batch.decode:
        r.output_ids.append(token)
    s.on_prefill_done(batch.prefill)
    for item in batch.prefill:
        if item.completes:
            item.req.output_ids.append(token)
    return batch


def test_mixed_steps_decode_beside_a_prompt_chunk_sized_by_the_measured_costs():
    alloc = PageAllocator(64)
    s = Scheduler(SchedulerConfig(max_running_requests=8, max_prefill_tokens=64, target_tpot=0.1), alloc, 4)
    s.add(req("old", 8, max_tokens=50))
    first = run_step(s)
    assert [i.length for i in first.prefill] == [8] and not first.decode   # nothing runs yet: prefill alone
    s.add(req("long", 200))
    nothing_measured = run_step(s)   # no costs yet: the whole budget beside the decode
    assert [r.rid for r in nothing_measured.decode] == ["old"] and nothing_measured.prefill[0].length == 64
    s.costs.observe(decodes=1, tokens=0, seconds=0.04)
    s.costs.observe(decodes=1, tokens=40, seconds=0.04 + 40 * 0.002)
    assert s.costs.decode == pytest.approx(0.04) and s.costs.per_token == pytest.approx(0.002)
    fits = run_step(s)   # (0.1 - 0.04) / 0.002 = 30 tokens fit: the floor of 32 applies
    assert [r.rid for r in fits.decode] == ["old"] and fits.prefill[0].length == 32
    s.costs.per_token = 0.0005   # 120 fit, the budget caps it at 64
    assert run_step(s).prefill[0].length == 64


def test_prefill_only_passes_are_fitted_so_their_fixed_cost_is_not_charged_per_token():
    fixed, per = 0.02, 0.001   # a pass that only prefills: 20 ms whatever its size, 1 ms a token
    costs = StepCosts()
    costs.observe(decodes=0, tokens=8, seconds=fixed + 8 * per)
    costs.observe(decodes=0, tokens=8, seconds=fixed + 8 * per)
    assert costs.per_token == pytest.approx((fixed + 8 * per) / 8)   # one size: no line yet, the ratio
    for tokens in (512, 64, 1024, 16, 256, 2048, 128, 1024, 32, 512, 64, 1024, 256, 2048, 16, 512):
        costs.observe(decodes=0, tokens=tokens, seconds=fixed + tokens * per)
    assert costs.per_token == pytest.approx(per, rel=0.05)   # a 16-token pass alone: 2.25 ms a token
    # A mixed pass still charges the prompt tokens what the pass took beyond its decodes.
    mixed = StepCosts()
    mixed.observe(decodes=4, tokens=0, seconds=0.05)
    mixed.observe(decodes=4, tokens=100, seconds=0.05 + 100 * per)
    assert (mixed.decode, mixed.per_token) == (pytest.approx(0.05), pytest.approx(per))


def test_without_a_target_tpot_a_prefill_step_runs_alone():
    alloc = PageAllocator(64)
    s = Scheduler(SchedulerConfig(max_running_requests=8, max_prefill_tokens=64, target_tpot=0), alloc, 4)
    s.add(req("old", 8, max_tokens=50))
    run_step(s)
    s.add(req("long", 100))
    kinds = [(bool(b.prefill), bool(b.decode)) for b in (run_step(s), run_step(s), run_step(s))]
    assert kinds == [(True, False), (True, False), (False, True)]   # 64 + 36 prompt tokens, then both decode


def test_allocator_owner_and_integrity():
    a = PageAllocator(4)
    got = a.allocate(3, "x")
    assert sorted(got) == [0, 1, 2] and a.num_free == 1
    assert a.allocate(2, "y") is None and a.num_free == 1
    assert all(a.owner_of(p) == "x" for p in got)
    a.transfer("x", ("quarantine", "x"))
    assert a.pages_of(("quarantine", "x")) == got and a.pages_of("x") == []
    assert a.free(("quarantine", "x")) == 3 and a.free(("quarantine", "x")) == 0
    a.check_integrity()
    assert a.num_free == a.num_total == 4


def test_allocator_detects_double_ownership():
    a = PageAllocator(2)
    a.allocate(1, "x")
    a._pages.setdefault("y", []).append(a.pages_of("x")[0])
    with pytest.raises(IntegrityError):
        a.check_integrity()


def shortest_first(clock, num_pages=64, budget=16, max_wait=2.0, max_running=8):
    alloc = PageAllocator(num_pages)
    cfg = SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=budget,
                          queue_order="shortest-first", max_queue_wait=max_wait)
    return alloc, Scheduler(cfg, alloc, 4, clock)


def arrive(s, clock, rid, prompt_len, max_tokens=8):
    r = req(rid, prompt_len, max_tokens)
    r.arrival = clock.now()
    s.add(r)
    return r


def test_shortest_first_prefills_fewer_prompt_tokens_first_and_fcfs_keeps_arrival_order():
    for order, expected in (("shortest-first", ["c", "b", "a"]), ("fcfs", ["a", "b", "c"])):
        clock = SimClock()
        alloc = PageAllocator(64)
        s = Scheduler(SchedulerConfig(max_prefill_tokens=12, queue_order=order), alloc, 4, clock)
        for rid, n in (("a", 12), ("b", 8), ("c", 4)):
            arrive(s, clock, rid, n)
            clock.advance(0.1)
        taken = []
        while s.waiting:
            taken += [i.req.rid for i in run_step(s).prefill]
        assert taken == expected, order
        for r in list(s.running):
            s.finish(r, FinishReason.STOP)
        assert alloc.num_free == alloc.num_total


def test_shortest_first_ages_a_long_prompt_ahead_of_newer_short_ones():
    clock = SimClock()
    alloc, s = shortest_first(clock, num_pages=128, budget=4, max_wait=2.0, max_running=64)   # one short prompt a step
    long = arrive(s, clock, "long", 40)
    started = []
    for i in range(12):   # a short prompt arrives every half second, forever shorter than "long"
        arrive(s, clock, f"s{i}", 4, max_tokens=1)
        started += [item.req.rid for item in run_step(s).prefill]
        clock.advance(0.5)
        if long.num_computed:
            break
    waited = clock.now() - long.arrival
    assert long.num_computed > 0 and started[-1] == "long"
    assert 2.0 <= waited <= 2.5   # taken in the first step after it aged, not before
    assert started[:4] == ["s0", "s1", "s2", "s3"]   # the young short ones went first
    while long.status == ReqStatus.WAITING:   # once started it keeps going, whatever arrives
        arrive(s, clock, f"late{long.num_computed}", 4, max_tokens=1)
        assert run_step(s).prefill[0].req is long
    for r in list(s.running) + list(s.waiting):
        s.finish(r, FinishReason.STOP)
    assert alloc.num_free == alloc.num_total


def test_shortest_first_finishes_a_started_chunked_prompt_before_shorter_arrivals():
    clock = SimClock()
    alloc, s = shortest_first(clock, budget=8)
    long = arrive(s, clock, "long", 20)
    assert [i.req.rid for i in run_step(s).prefill] == ["long"]   # 8 of 20 tokens
    arrive(s, clock, "short", 4)
    order = [i.req.rid for i in run_step(s).prefill]
    assert order == ["long"] and long.num_computed == 16   # started work holds its place (and its pages)
    assert [i.req.rid for i in run_step(s).prefill] == ["long", "short"]   # 4 + 4 tokens
    for r in list(s.running):
        s.finish(r, FinishReason.STOP)
    assert alloc.num_free == alloc.num_total


def test_predicted_wait_counts_the_prompt_tokens_taken_before_and_with_a_request():
    clock = SimClock()
    for order, expected in (("fcfs", {"a": 40, "b": 48, "c": 52}), ("shortest-first", {"a": 52, "b": 12, "c": 4})):
        alloc = PageAllocator(64)
        s = Scheduler(SchedulerConfig(queue_order=order), alloc, 4, clock)
        reqs = {rid: arrive(s, clock, rid, n) for rid, n in (("a", 40), ("b", 8), ("c", 4))}
        assert s.predicted_wait(reqs["a"]) is None   # nothing measured yet
        s.costs.per_token = 0.01
        assert {rid: round(s.predicted_wait(r) / 0.01) for rid, r in reqs.items()} == expected, order
        for r in reqs.values():
            s.finish(r, FinishReason.ABORT)
        assert alloc.num_free == alloc.num_total


def test_admission_waits_for_pages_in_fifo_order():
    alloc, s = make(num_pages=4, page_size=4)
    a, b = req("a", 12), req("b", 8)  # a needs 3 pages, b needs 2
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [i.req.rid for i in batch.prefill] == ["a"]
    assert alloc.num_free == 1 and b.status == ReqStatus.WAITING
    s.finish(a, FinishReason.STOP)
    assert [i.req.rid for i in s.schedule().prefill] == ["b"]
    s.finish(b, FinishReason.ABORT)
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_total


def test_prefill_budget_chunks_long_prompts():
    alloc, s = make(num_pages=16, page_size=4, budget=10)
    r = req("long", 25)
    s.add(r)
    lengths = []
    while r.status == ReqStatus.WAITING:
        batch = run_step(s)
        lengths += [i.length for i in batch.prefill]
    assert lengths == [10, 10, 5]
    assert r.num_computed == 25 and r.output_ids == [7] and r.status == ReqStatus.RUNNING
    s.finish(r, FinishReason.LENGTH)
    assert alloc.num_free == alloc.num_total


def test_prefill_stretch_takes_a_short_rest_whole():
    """With prefill_stretch, a prompt whose rest is within the budget times it runs in one
    step; a longer one is still cut at the budget, and its rest is taken whole once it fits."""
    alloc, s = make(num_pages=32, page_size=4, budget=10)
    s.prefill_stretch = 2.0
    lengths = {}
    for rid, n in (("whole", 20), ("cut", 25)):
        r = req(rid, n)
        s.add(r)
        lengths[rid] = []
        while r.status == ReqStatus.WAITING:
            lengths[rid] += [i.length for i in run_step(s).prefill]
        assert r.num_computed == n and r.status == ReqStatus.RUNNING
        s.finish(r, FinishReason.LENGTH)
    assert lengths == {"whole": [20], "cut": [10, 15]}
    assert alloc.num_free == alloc.num_total


def test_max_running_requests_caps_the_batch():
    alloc, s = make(num_pages=32, page_size=4, max_running=2)
    for i in range(3):
        s.add(req(f"r{i}", 4))
    first = run_step(s)
    assert [i.req.rid for i in first.prefill] == ["r0", "r1"]
    decode = run_step(s)
    assert [r.rid for r in decode.decode] == ["r0", "r1"] and len(s.waiting) == 1
    for r in list(s.running) + list(s.waiting):
        s.finish(r, FinishReason.ABORT)
    assert alloc.num_free == alloc.num_total and s.num_requests == 0


def test_decode_preempts_newest_when_pool_is_full_and_recomputes_it():
    alloc, s = make(num_pages=4, page_size=4)
    old, new = req("old", 8), req("new", 8)   # 2 pages each: the pool is full after prefill
    s.add(old)
    s.add(new)
    run_step(s)
    assert alloc.num_free == 0
    batch = run_step(s)                        # both need a third page: "new" is preempted
    assert [r.rid for r in batch.decode] == ["old"]
    assert new.status == ReqStatus.WAITING and new.num_preemptions == 1 and new.pages == []
    assert new.output_ids == [7]               # kept: recomputed from prompt + output later
    s.finish(old, FinishReason.STOP)
    batch = run_step(s)
    assert batch.prefill[0].req is new and batch.prefill[0].length == 9
    s.finish(new, FinishReason.STOP)
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_total


def test_a_preempted_request_never_waits_for_pages_a_partial_prefill_holds():
    """Found by chaos (seed 0, and every reference run on a 64-page decode pool): two long
    decodes outgrew the pool. The newer was preempted and partly re-prefilled, holding
    pages while it waited; the older then could not grow, preempted itself, and went to the
    head of the waiting queue, where its prefill no longer fit. Nothing ran again, and the
    clients waited for --request-timeout. A partly prefilled waiting request now gives its
    pages back before a running one is preempted."""
    alloc, s = make(num_pages=8, page_size=4, budget=8)
    s.add(req("old", 4, max_tokens=20))
    run_step(s)
    s.add(req("new", 30, max_tokens=2))   # prefilled in chunks of 8
    for _ in range(200):
        if not s.num_requests:
            break
        assert not run_step(s).empty, f"nothing scheduled: waiting {[r.rid for r in s.waiting]}, running none"
        for r in list(s.running):
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, FinishReason.LENGTH)
    assert not s.num_requests
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_total
