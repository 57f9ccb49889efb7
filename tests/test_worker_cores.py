"""The prefill and decode worker cores in one process, on each real transfer backend, over
a tiny random model: same tokens as the colocated engine, one answer per leg, aborts in
every phase, and nothing left behind on either side."""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from disagg_helpers import BACKENDS
from kvrelay.core.config import KVCacheConfig, LifecycleConfig, SchedulerConfig, TransferConfig
from kvrelay.disagg.decode_worker import DecodeCore
from kvrelay.disagg.prefill_worker import PrefillCore
from kvrelay.engine.engine import AsyncEngine
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, SamplingParams

REAL = [b for b in BACKENDS if not b.startswith("fake")]
KV = KVCacheConfig(page_size=16, max_kv_tokens=2048)
SCHED = SchedulerConfig(max_running_requests=16, max_prefill_tokens=512)
# A 1.6 s lease, well under every phase deadline: two engines in one process share the GIL,
# and on a loaded 2-core machine a 0.6 s one ran out on both sides of a healthy pair.
LIFE = LifecycleConfig(heartbeat_interval=0.2, heartbeat_misses=8, bootstrap_timeout=5, queue_timeout=5,
                       waiting_timeout=5, transfer_timeout=5, quarantine_grace=0.5)


class Pair:
    def __init__(self, loaded, backend: str, d_faults: str | None = None, cluster_key=None,
                 life: LifecycleConfig = LIFE, layerwise: bool = True, verify: bool = False) -> None:
        tc = TransferConfig(transfer_backend=backend, layerwise_transfer=layerwise, verify_kv=verify)
        self.P = AsyncEngine(lambda: PrefillCore(loaded, KV, SCHED, life, tc, cluster_key=cluster_key))
        dtc = TransferConfig(transfer_backend=backend, fault_spec=d_faults)
        self.D = AsyncEngine(lambda: DecodeCore(loaded, KV, SCHED, life, dtc, cluster_key=cluster_key))
        self.paddr = self.P.core.manager.address
        self.room = 100

    async def run(self, greq: GenerateRequest, *, p_first: float = 0.0, d_delay: float = 0.0):
        """Both legs of one request; returns (prefill outputs, decode outputs)."""
        self.room += 1
        room = self.room

        async def leg(engine, delay, **kw):
            await asyncio.sleep(delay)
            return [o async for o in engine.generate(greq, room=room, **kw)]

        return await asyncio.gather(leg(self.P, p_first), leg(self.D, d_delay, prefill_address=self.paddr))

    def close(self) -> None:
        for e in (self.P, self.D):
            e.shutdown()
            e.core.close()

    def assert_idle(self) -> None:
        for e in (self.P, self.D):
            e.check_idle(timeout=15)


async def reach(engine: AsyncEngine, phase: str, timeout: float = 10.0) -> None:
    """Return once one of `engine`'s rooms is in `phase` (polled, never a fixed sleep)."""
    async with asyncio.timeout(timeout):
        while not (await engine.acall(lambda c: c.debug_view()["phases"], readonly=True)).get(phase):
            await asyncio.sleep(0.005)


@pytest.fixture(params=REAL)
def pair(request, tiny_loaded):
    p = Pair(tiny_loaded, request.param)
    yield p
    p.close()


def greedy(rid: str, prompt, n: int = 12, **kw) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw))


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def colocated(engine, greq: GenerateRequest):
    return [o async for o in engine.generate(greq)]


def both_ways(pair: Pair, engine, reqs: list[GenerateRequest]):
    """Each request disaggregated over `pair` (all at once) and colocated on `engine`:
    ([(prefill outputs, decode outputs)], [colocated outputs])."""
    async def main():
        got = await asyncio.gather(*[pair.run(r) for r in reqs])
        want = [await colocated(engine, r) for r in reqs]
        return got, want

    return asyncio.run(main())


def test_same_tokens_as_colocated(pair, tiny_engine):
    """Greedy, seeded sampling and logprobs: disaggregated == colocated, batched."""
    reqs = [greedy(f"g{i}", range(3 + i, 20 + 7 * i), n=10 + i) for i in range(6)]
    reqs.append(GenerateRequest("seeded", tuple(range(40, 70)),
                                SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)))
    reqs.append(greedy("lp", range(9, 30), n=6, logprobs=3))

    got, want = both_ways(pair, tiny_engine, reqs)
    for r, (pouts, douts), couts in zip(reqs, got, want):
        assert [o.finish_reason for o in pouts] == [FinishReason.LENGTH]
        assert douts[-1].finish_reason is FinishReason.LENGTH
        assert tokens(douts) == tokens(couts), r.rid
        assert "".join(o.text for o in douts) == "".join(o.text for o in couts)
    lp_d = [lp for o in got[-1][1] for lp in o.logprobs]
    lp_c = [lp for o in want[-1] for lp in o.logprobs]
    assert [x.token_id for x in lp_d] == [x.token_id for x in lp_c]
    assert [len(x.top) for x in lp_d] == [3] * 6
    assert lp_d[0].logprob == pytest.approx(lp_c[0].logprob, abs=1e-4)
    pair.assert_idle()


@pytest.mark.parametrize("backend", REAL)
def test_verify_kv_agrees_on_every_backend_and_a_mismatch_fails_before_decoding(tiny_loaded, tiny_engine, backend):
    """--verify-kv: the CRC-32 P sends of its pages matches D's copy on every backend, with
    layer-wise writes, for prompts that end on and past a page boundary (the tokens are
    colocated's); a CRC that disagrees fails the request with transfer_error before it
    decodes a token, and leaves nothing behind on either side."""
    pair = Pair(tiny_loaded, backend, verify=True)
    try:
        reqs = [greedy(f"v{n}", range(5, 5 + n), n=6) for n in (16, 17, 32, 45)]
        got, want = both_ways(pair, tiny_engine, reqs)
        for r, (pouts, douts), couts in zip(reqs, got, want):
            assert douts[-1].finish_reason is FinishReason.LENGTH, (r.rid, douts[-1].error)
            assert tokens(douts) == tokens(couts), r.rid
        kv = pair.P.core.engine.kv
        honest = kv.checksum
        kv.checksum = lambda pages: honest(pages) ^ 1
        _, douts = asyncio.run(pair.run(greedy("flipped", range(5, 45), n=6)))
        assert tokens(douts) == []
        assert douts[-1].finish_reason is FinishReason.ERROR
        assert "transfer_error" in douts[-1].error and "--verify-kv" in douts[-1].error, douts[-1].error
        pair.assert_idle()
    finally:
        pair.close()


def test_one_token_and_stop_on_first_token(pair, tiny_engine):
    """max_tokens=1 ends at once on D with the token P sampled; so does a stop token."""
    one = greedy("one", range(5, 25), n=1)
    first = asyncio.run(colocated(tiny_engine, one))[0].token_ids[0]
    stop = GenerateRequest("stop", one.prompt_ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                                  stop_token_ids=(first,)))
    p1, d1 = asyncio.run(pair.run(one))
    p2, d2 = asyncio.run(pair.run(stop))
    assert tokens(d1) == [first] and d1[-1].finish_reason is FinishReason.LENGTH
    assert tokens(d2) == [first] and d2[-1].finish_reason is FinishReason.STOP
    assert p1[-1].finish_reason is p2[-1].finish_reason is FinishReason.LENGTH
    pair.assert_idle()


@pytest.mark.parametrize("phase", ["p-bootstrap", "d-decode", "d-bootstrap"])
def test_abort_in_any_phase_ends_both_legs(pair, phase):
    """An abort on one side reaches the other; each leg gets exactly one final output."""
    greq = greedy(f"ab-{phase}", range(5, 60), n=400)

    async def main():
        pair.room += 1
        room = pair.room
        p_outs, d_outs = [], []

        async def p_leg():
            async for o in pair.P.generate(greq, room=room):
                p_outs.append(o)

        async def d_leg():
            async for o in pair.D.generate(greq, room=room, prefill_address=pair.paddr):
                d_outs.append(o)

        if phase == "p-bootstrap":  # P holds the room; D never came: abort it on P
            t = asyncio.create_task(p_leg())
            await reach(pair.P, "bootstrap")
            await pair.P.abort(greq.rid)
            await asyncio.wait_for(t, 10)
            return p_outs, d_outs
        if phase == "d-bootstrap":  # D waits for a P that never hears of the room
            t = asyncio.create_task(d_leg())
            await reach(pair.D, "waiting")   # D reserved its pages and told P, which never heard of the room
            await pair.D.abort(greq.rid)
            await asyncio.wait_for(t, 10)
            return p_outs, d_outs
        tp, td = asyncio.create_task(p_leg()), asyncio.create_task(d_leg())
        for _ in range(200):
            await asyncio.sleep(0.02)
            if len(d_outs) >= 3:
                break
        await pair.D.abort(greq.rid)
        await asyncio.wait_for(asyncio.gather(tp, td), 10)
        return p_outs, d_outs

    p_outs, d_outs = asyncio.run(main())
    for outs in (p_outs, d_outs):
        if outs:
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
    if phase == "p-bootstrap":
        assert p_outs[-1].finish_reason is FinishReason.ABORT and not d_outs
    elif phase == "d-bootstrap":
        assert d_outs[-1].finish_reason is FinishReason.ABORT and not p_outs
    else:
        assert d_outs[-1].finish_reason is FinishReason.ABORT
        assert 3 <= len(tokens(d_outs)) < 400
        assert p_outs[-1].finish_reason is FinishReason.LENGTH  # P was done before D aborted
    pair.assert_idle()


def test_a_leg_the_decode_worker_prefills_itself_matches_colocated_and_ends_by_abort_or_deadline(pair, tiny_engine):
    """A decode leg with no prefill address (the router's adaptive split): D's engine
    prefills it beside legs whose KV comes from P; greedy, seeded and n=2 outputs equal
    colocated ones; its room is in decode from the start and reports its prompt as queued
    work; an abort and --max-request-time end it with one final output per choice; nothing
    is left on either side."""
    here = [greedy(f"here{i}", range(4 + i, 30 + 9 * i), n=8 + i) for i in range(3)]
    here.append(GenerateRequest("here-seeded-n2", tuple(range(50, 75)),
                                SamplingParams(max_tokens=9, temperature=0.8, seed=3, n=2, ignore_eos=True)))
    via_p = [greedy(f"via-p{i}", range(7 + i, 40 + 5 * i), n=10) for i in range(2)]

    async def local(greq, engine=None):
        pair.room += 1
        return [o async for o in (engine or pair.D).generate(greq, room=pair.room, prefill_address=None)]

    async def main():
        got = await asyncio.gather(*[local(r) for r in here], *[pair.run(r) for r in via_p])
        want = [await colocated(tiny_engine, r) for r in here + via_p]
        return got, want

    got, want = asyncio.run(main())
    for r, outs, couts in zip(here, got, want):
        for i in range(r.params.n):
            mine = [o for o in outs if o.index == i]
            assert tokens(mine) == tokens([o for o in couts if o.index == i]), (r.rid, i)
            assert sum(o.finished for o in mine) == 1 and mine[-1].finish_reason is FinishReason.LENGTH
    for r, (pouts, douts), couts in zip(via_p, got[len(here):], want[len(here):]):
        assert tokens(douts) == tokens(couts), r.rid
    events = [e for e in pair.D.call(lambda c: list(c.side.lc.events)) if e.rid.startswith("here")]
    assert sorted((e.rid, e.phase, e.from_phase) for e in events) == sorted((r.rid, "done", "decode") for r in here)

    aborted, seen = greedy("here-abort", range(5, 60), n=400), {}

    async def abort_it():
        task = asyncio.create_task(local(aborted))
        while not seen.get("phases"):
            await asyncio.sleep(0.01)
            view = pair.D.call(lambda c: (c.debug_view()["phases"], c.queued_prompt_tokens()))
            if view[0]["decode"] == 1:
                seen["phases"], seen["queued"] = view
        await asyncio.sleep(0.2)
        await pair.D.abort(aborted.rid)
        return await asyncio.wait_for(task, 10)

    outs = asyncio.run(abort_it())
    assert seen["phases"] == {"bootstrap": 0, "waiting": 0, "decode": 1}
    assert seen["queued"] in (0, 55)   # its prompt, until the engine computed it
    assert sum(o.finished for o in outs) == 1 and outs[-1].finish_reason is FinishReason.ABORT
    assert 1 <= len(tokens(outs)) < 400
    pair.assert_idle()

    slow = replace(LIFE, max_request_time=0.05)   # far less than 960 tokens take
    D = AsyncEngine(lambda: DecodeCore(pair.D.core.loaded, KV, SCHED, slow, TransferConfig(transfer_backend="shm")))
    try:
        outs = asyncio.run(local(greedy("here-deadline", range(5, 60), n=960), engine=D))
        assert sum(o.finished for o in outs) == 1 and outs[-1].finish_reason is FinishReason.ERROR
        assert outs[-1].error.startswith("timeout:decode"), outs[-1].error
        D.check_idle(timeout=15)
    finally:
        D.shutdown()
        D.core.close()


def test_decode_failure_before_kv_reaches_prefill(pair):
    """D gives up (abort while waiting for KV): P's leg fails with the reason, not silence."""
    greq = greedy("dfail", range(5, 40), n=8)

    async def main():
        pair.room += 1
        room = pair.room
        # P learns of the room only after D has reserved and sent its destination.
        d = asyncio.create_task(asyncio.wait_for(
            _collect(pair.D.generate(greq, room=room, prefill_address=pair.paddr)), 10))
        await reach(pair.D, "waiting")
        await pair.D.abort(greq.rid)
        douts = await d
        pouts = await asyncio.wait_for(_collect(pair.P.generate(greq, room=room)), 10)
        return pouts, douts

    pouts, douts = asyncio.run(main())
    assert douts[-1].finish_reason is FinishReason.ABORT
    assert pouts[-1].finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
    assert pouts[-1].error and pouts[-1].error.split(":")[0] in ("aborted", "peer_failed")
    pair.assert_idle()


async def _collect(gen):
    return [o async for o in gen]


def test_rejects_bad_legs(pair):
    """A leg that can never run is rejected before it is added; a duplicate room is too."""
    too_long = greedy("long", range(5, 3000), n=4)
    with pytest.raises(RequestRejected):
        pair.P.core.validate_leg(too_long)
    bad = GenerateRequest("bad", (1, 2, 3), SamplingParams(max_tokens=4, top_p=0.0))
    with pytest.raises(RequestRejected):
        pair.D.core.validate_leg(bad)

    async def dup():
        greq = greedy("dup-a", range(5, 20), n=2)
        t = asyncio.create_task(_collect(pair.P.generate(greq, room=77)))
        await reach(pair.P, "bootstrap")
        with pytest.raises(RequestRejected):
            await _collect(pair.P.generate(greedy("dup-b", range(5, 20)), room=77))
        await pair.P.abort("dup-a")
        return await asyncio.wait_for(t, 10)

    outs = asyncio.run(dup())
    assert outs[-1].finish_reason is FinishReason.ABORT
    pair.assert_idle()


@contextlib.contextmanager
def _pair(loaded, backend, **kw):
    p = Pair(loaded, backend, **kw)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("backend", REAL)
def test_unacknowledged_transfer_fails_within_the_lease(tiny_loaded, backend):
    """The stuck-inflight scenario in process: D never completes the receive (ignore_aux),
    so it never acknowledges. P's transfer phase ends within a few heartbeats with
    transfer_error (far below --transfer-timeout), D's leg gets that reason, and the
    next request (faults off) succeeds."""
    with _pair(tiny_loaded, backend, d_faults="ignore_aux=1") as pair:
        greq = greedy("stuck", range(5, 40), n=4)

        async def main():
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            res = await asyncio.wait_for(pair.run(greq), 20)
            return res, loop.time() - t0

        (pouts, douts), took = asyncio.run(main())
        assert pouts[-1].finish_reason is FinishReason.ERROR and douts[-1].finish_reason is FinishReason.ERROR
        # P ends the stalled transfer (transfer_error). On a loaded 2-core machine D's lease
        # on P can run out first (seen once in CI at 0.6 s): then both end with D's verdict.
        assert douts[-1].error.split(":")[0] in ("transfer_error", "peer_failed")
        assert (pouts[-1].error.startswith("transfer_error")
                or pouts[-1].error.startswith("peer_failed: decode: peer_failed")
                and douts[-1].error.startswith("peer_failed")), (pouts[-1].error, douts[-1].error)
        lease = LIFE.heartbeat_interval * (LIFE.heartbeat_misses + 2)
        assert took < lease + 1.0 < LIFE.transfer_timeout
        pair.assert_idle()
        pair.D.call(lambda c: setattr(c.manager.faults, "spec", type(c.manager.faults.spec)()))
        pouts, douts = asyncio.run(pair.run(greedy("after", range(5, 40), n=4)))
        assert douts[-1].finish_reason is FinishReason.LENGTH and len(tokens(douts)) == 4
        pair.assert_idle()


def test_prefill_steps_stay_inside_the_heartbeat_interval(tiny_loaded):
    """A worker sizes each prefill step from the measured rate to take a share of a
    heartbeat interval (never above --max-prefill-tokens, never below a page): half of one
    on a decode worker, whose decodes wait on the step, and LONG_STEP_SHARE on a prefill
    worker, which heartbeats between the layers of a pass. A long prompt is chunked
    instead of silencing the worker past its lease. (The pair runs under a 6 s lease: what
    is tested here is the budget; a 0.6 s one ran out on a loaded 2-core machine.)"""
    from kvrelay.disagg.worker_core import FIRST_BUDGET, LONG_STEP_SHARE, LONG_STEP_STRETCH, STEP_GRANULE, STEP_SHARE
    with _pair(tiny_loaded, REAL[0], life=replace(LIFE, heartbeat_misses=30)) as pair:
        assert pair.P.call(lambda c: c.step_share) == LONG_STEP_SHARE
        assert pair.D.call(lambda c: c.step_share) == STEP_SHARE
        # only the long steps take a prompt's short rest whole (a decode waits on D's steps)
        assert pair.P.call(lambda c: c.engine.scheduler.prefill_stretch) == LONG_STEP_STRETCH > 1
        assert pair.D.call(lambda c: c.engine.scheduler.prefill_stretch) == 1
        for engine, step_share in ((pair.P, LONG_STEP_SHARE), (pair.D, STEP_SHARE)):
            def fit(tokens, seconds, engine=engine):
                def run(c):
                    c.engine.last_prefill = (tokens, seconds)
                    c._fit_prefill_budget()
                    return c.engine.scheduler.prefill_budget
                return engine.call(run)

            def full_step(rate, engine=engine):   # a step the budget cut, at `rate` tokens/s
                budget = engine.call(lambda c: c.engine.scheduler.prefill_budget)
                return fit(budget, budget / rate)

            first = engine.call(lambda c: c.engine.scheduler.prefill_budget)
            assert first == min(SCHED.max_prefill_tokens, FIRST_BUDGET)
            step_s = LIFE.heartbeat_interval * step_share
            budgets = [full_step(100 / step_s) for _ in range(12)]   # 100 tokens fill the step time
            assert budgets[-1] == 100 // KV.page_size * KV.page_size   # the measured rate, down to a page
            assert all(b >= KV.page_size for b in budgets)
            budgets = [full_step(300 / step_s) for _ in range(12)]   # 300: above the granule
            assert budgets[-1] == 300 // STEP_GRANULE * STEP_GRANULE
            assert all(b % STEP_GRANULE == 0 for b in budgets if b >= STEP_GRANULE)
            # a short prompt's whole rest, in time, measures nothing: its fixed cost swamps it
            assert fit(4, step_s / 2) == budgets[-1]
            assert fit(10**9, 1.0) <= SCHED.max_prefill_tokens and fit(1, 100.0) >= KV.page_size
        # A real prompt longer than the budget is prefilled in chunks and still served.
        pair.P.call(lambda c: setattr(c.engine.scheduler, "prefill_budget", 64))
        pouts, douts = asyncio.run(pair.run(greedy("chunked", range(5, 400), n=4)))
        assert douts[-1].finish_reason is FinishReason.LENGTH and len(tokens(douts)) == 4
        pair.assert_idle()


def test_a_prefill_step_longer_than_the_lease_keeps_its_pair_and_answers_reads(tiny_loaded):
    """A prefill pass twice the 1.6 s lease: between its layers the prefill worker
    heartbeats its peer and answers read-only calls (/health, /metrics); other commands
    wait for the step's end. The pass stands in for a long one of many layers: each of
    the tiny model's layer ends takes LAYER_S, with the engine's between-layer work run
    every 50 ms of it as a real layer boundary would."""
    import threading
    import time

    lease = LIFE.heartbeat_interval * LIFE.heartbeat_misses
    layer_s = 2 * lease / tiny_loaded.arch.num_layers
    with _pair(tiny_loaded, REAL[0]) as pair:
        marks: dict[str, float] = {}
        slow_now = threading.Event()

        def slow_layers(c):
            inner = c.engine.runner.between_layers

            def between_layers(layers):
                if slow_now.is_set():
                    marks.setdefault("start", time.monotonic())
                    end = time.monotonic() + layer_s
                    while time.monotonic() < end:
                        time.sleep(0.05)
                        inner(layers)
                    marks["end"] = time.monotonic()
                else:
                    inner(layers)
            c.engine.runner.between_layers = between_layers
        pair.P.call(slow_layers)
        slow_now.set()
        with ThreadPoolExecutor(1) as pool:
            legs = pool.submit(asyncio.run, pair.run(greedy("long-step", range(5, 60), n=4)))
            deadline = time.monotonic() + 30
            while "start" not in marks and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(lease / 2)
            read = pair.P.call(lambda c: (c.health()["live_requests"], time.monotonic()), readonly=True)
            waited = pair.P.call(lambda c: time.monotonic())
            pouts, douts = legs.result(timeout=60)
        slow_now.clear()
        assert marks["end"] - marks["start"] > 1.5 * lease   # the pass outlasted the lease
        assert read[0] == 1 and marks["start"] < read[1] < marks["end"]   # answered inside the pass
        assert waited >= marks["end"]                                       # a command waits for its end
        assert pouts[-1].error is None and douts[-1].error is None, (pouts[-1], douts[-1])
        assert douts[-1].finish_reason is FinishReason.LENGTH and len(tokens(douts)) == 4
        pair.assert_idle()


def test_calibration_sizes_the_first_prefill_step(tiny_loaded):
    """At start-up a worker times one pass of FIRST_BUDGET tokens into scratch pages and
    sizes its first prefill step from that rate, as it sizes later steps from theirs. The
    pass leaves nothing behind: every page free, no request, no token counted, no cost
    sample. A rate slower than FIRST_BUDGET allows (a pass timed while another worker
    loads) keeps FIRST_BUDGET, as does a pool too small for the pass."""
    from kvrelay.disagg.worker_core import FIRST_BUDGET, step_budget
    tc = TransferConfig(transfer_backend=REAL[0])
    core = PrefillCore(tiny_loaded, KV, SCHED, LIFE, tc)
    try:
        e = core.engine
        assert e.scheduler.prefill_budget == FIRST_BUDGET and e.scheduler.costs.per_token is None
        seconds = e.time_prefill(FIRST_BUDGET)
        assert seconds > 0 and e.scheduler.costs.per_token is None
        assert e.allocator.num_free == e.allocator.num_total
        assert e.prompt_tokens_done == 0 and e.tokens_sampled == 0 and not e.has_work
        e.time_prefill = lambda tokens: tokens / 10.0   # 10 tokens/s: under FIRST_BUDGET a step
        core.calibrate()
        assert e.scheduler.prefill_budget == FIRST_BUDGET
        rates = iter([100.0, 1_000.0])   # tokens a second, cold then warm: the faster pass counts
        e.time_prefill = lambda tokens: tokens / next(rates)
        core.calibrate()
        want = step_budget(1_000.0 * LIFE.heartbeat_interval * core.step_share, KV.page_size, SCHED.max_prefill_tokens)
        assert e.scheduler.prefill_budget == want > FIRST_BUDGET
        core.check_idle()
    finally:
        core.close()
    for cls, kv in ((PrefillCore, replace(KV, max_kv_tokens=FIRST_BUDGET // 2)), (DecodeCore, KV)):
        core = cls(tiny_loaded, kv, SCHED, LIFE, tc)
        try:
            timed = []
            core.engine.time_prefill = lambda tokens, real=core.engine.time_prefill: timed.append(real(tokens)) or timed[-1]
            core.calibrate()
            assert core.engine.scheduler.prefill_budget == FIRST_BUDGET
            assert timed == ([None, None] if cls is PrefillCore else [])   # no room for the pass; no pass
            core.check_idle()
        finally:
            core.close()


def test_a_step_budget_keeps_to_a_few_sizes():
    """Long prompts are chunked in multiples of STEP_GRANULE (of a page below it), so their
    matmul and attention shapes repeat from prompt to prompt."""
    from kvrelay.disagg.worker_core import STEP_GRANULE, step_budget
    sizes = {step_budget(t, 16, 4096) for t in range(STEP_GRANULE, 5000)}
    assert sizes == set(range(STEP_GRANULE, 4096 + 1, STEP_GRANULE))
    assert {step_budget(t, 16, 4096) for t in range(0, STEP_GRANULE)} == set(range(16, STEP_GRANULE, 16))
    assert all(step_budget(t, 16, 4096) <= t for t in range(16, 4096))   # never above the target
    assert step_budget(10**9, 16, 1000) == 1000 and step_budget(0.0, 16, 1000) == 16
    assert step_budget(255.9, 16, 4096) == 128 and step_budget(256, 16, 4096) == 256
