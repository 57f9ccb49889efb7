"""`n > 1` choices share the prompt's KV pages (#12): one prefill, pages forked with a
reference count and copied on write, each choice sampled, stopped and finished on its
own; colocated (the engine) and disaggregated (P prefills and sends the KV once, D forks
it), with aborts, failures and preemption, and nothing left behind."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from cluster_helpers import Cluster, router_client
from kvrelay.core.config import KVCacheConfig, SchedulerConfig
from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.allocator import IntegrityError, PageAllocator
from kvrelay.engine.engine import build_engine
from kvrelay.engine.request import Req, ReqStatus
from kvrelay.engine.scheduler import Scheduler, pages_for
from kvrelay.engine.types import MAX_N, FinishReason, GenerateRequest, RequestRejected, SamplingParams, StepOutput
from kvrelay.server.worker_protocol import output_from_json, output_to_json
from kvrelay.sim.run import SimConfig, run_seed
from serving_helpers import gauge, metric_samples

PROMPT = tuple(range(100, 140))   # 40 tokens: two full pages of 16 and a partial third


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(client, greq: GenerateRequest) -> list:
    return [o async for o in client.generate(greq)]


def by_choice(outs, n: int) -> list[list[int]]:
    return [[t for o in outs if o.index == i for t in o.token_ids] for i in range(n)]


def finals(outs) -> dict[int, FinishReason]:
    """Each choice's final reason; fails if a choice ended twice."""
    ended = [(o.index, o.finish_reason) for o in outs if o.finished]
    assert len({i for i, _ in ended}) == len(ended), ended
    return dict(ended)


class Probe:
    """Counts what the engine thread computes: prompt tokens prefilled, KV pages copied,
    and the pages in use at each decode step (read on the engine thread, between steps).
    A context manager: the engine's own methods come back on the way out."""

    def __init__(self, engine) -> None:
        self.core = core = engine.core
        self.prefill_tokens, self.copies, self.decode_used = 0, 0, []
        self.saved = prefill, decode, copy = core.runner.prefill, core.runner.decode, core.kv.copy_pages

        def counted_prefill(chunks):
            self.prefill_tokens += sum(len(c.tokens) for c in chunks)
            return prefill(chunks)

        def counted_decode(*args):
            self.decode_used.append(core.allocator.num_used)
            return decode(*args)

        def counted_copy(pairs):
            self.copies += len(pairs)
            return copy(pairs)

        core.runner.prefill, core.runner.decode, core.kv.copy_pages = counted_prefill, counted_decode, counted_copy

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc) -> None:
        del self.core.runner.prefill, self.core.runner.decode, self.core.kv.copy_pages   # the class's again


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    e = build_engine(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=2048),
                     SchedulerConfig(max_running_requests=16, max_prefill_tokens=1024))
    yield e
    e.shutdown()


# ---------------------------------------------------------------- the allocator

def test_shared_pages_are_reference_counted():
    a = PageAllocator(6)
    pages = a.allocate(3, "r")
    assert a.share("r", ("r", 1)) == pages and a.share("r", ("r", 2)) == pages
    assert [a.refcount(p) for p in pages] == [3, 3, 3] and a.num_free == 3
    assert a.holders(pages[0]) == ["r", ("r", 1), ("r", 2)] and a.owner_of(pages[0]) is None
    a.check_integrity()
    # copy-on-write: choice 1 trades its reference to the last page for a page of its own
    copy = a.unshare(("r", 1), pages[2])
    assert copy not in pages and a.pages_of(("r", 1)) == [pages[0], pages[1], copy]
    assert a.refcount(pages[2]) == 2 and a.refcount(copy) == 1 and a.owner_of(copy) == ("r", 1)
    a.check_integrity()
    with pytest.raises(ValueError):
        a.unshare(("r", 1), copy)   # not shared: nothing to copy
    # a holder drops only its own references; a page is free with its last one
    assert a.free("r") == 3 and a.num_free == 2
    assert [a.refcount(p) for p in pages] == [2, 2, 1] and a.pages_of(("r", 2)) == pages
    a.transfer(("r", 2), ("room", 9))   # the room takes choice 2's place in the group
    a.check_integrity()
    assert a.free(("r", 1)) == 3 and a.free(("room", 9)) == 3 and a.free(("room", 9)) == 0
    a.check_integrity()
    assert a.num_free == a.num_total == 6 and a.refcount(pages[0]) == 0


def test_unshare_needs_a_free_page():
    a = PageAllocator(2)
    (p, q) = a.allocate(2, "r")
    a.share("r", ("r", 1))
    assert a.unshare(("r", 1), q) is None           # no page free: no change
    assert a.pages_of(("r", 1)) == [p, q] and a.refcount(q) == 2
    a.check_integrity()


def test_integrity_check_sees_a_wrong_refcount_and_a_page_across_groups():
    a = PageAllocator(4)
    (p,) = a.allocate(1, "r")
    a.share("r", ("r", 1))
    a._holders[p].append(("r", 2))        # a holder the page lists but that does not hold it
    with pytest.raises(IntegrityError, match="reference count"):
        a.check_integrity()
    b = PageAllocator(4)
    (p,) = b.allocate(1, "r")
    b.allocate(1, "other")
    b._pages["other"].append(p)           # held by another owner group
    b._holders[p].append("other")
    with pytest.raises(IntegrityError, match="owner group"):
        b.check_integrity()


def test_preempting_a_choice_releases_only_its_references():
    """Scheduler level: forked choices share the prompt's pages; the first decode step
    copies the partial last page for all but one writer; preempting a choice drops its
    references and leaves its siblings' pages intact."""
    alloc = PageAllocator(8)
    s = Scheduler(SchedulerConfig(max_running_requests=8, max_prefill_tokens=64), alloc, 4)
    params = SamplingParams(max_tokens=8, n=3)
    lead = Req("r", list(range(1, 7)), params)   # 6 tokens: one full page of 4 and a partial one
    s.add(lead)
    batch = s.schedule()
    s.on_prefill_done(batch.prefill)
    others = [Req("r", list(range(1, 7)), params, index=i) for i in (1, 2)]
    s.fork(lead, others)
    shared = list(lead.pages)
    assert all(c.pages == shared for c in others) and [alloc.refcount(p) for p in shared] == [3, 3]
    assert alloc.num_used == 2
    for c in [lead, *others]:
        c.output_ids.append(7)
    batch = s.schedule()   # writes position 6, in the shared partial page
    assert len(batch.decode) == 3 and len(batch.copies) == 2
    assert all(src == shared[1] for src, _ in batch.copies)
    tails = [c.pages[1] for c in [lead, *others]]
    assert len(set(tails)) == 3 and alloc.refcount(shared[0]) == 3 and alloc.num_used == 4
    s._preempt(others[0])
    assert others[0].status == ReqStatus.WAITING and others[0].pages == []
    assert alloc.refcount(shared[0]) == 2 and alloc.num_used == 3
    assert lead.pages[0] == others[1].pages[0] == shared[0]
    alloc.check_integrity()
    for c in [lead, *others]:
        s.finish(c, FinishReason.ABORT)
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_total


# ---------------------------------------------------------------- the engine

def test_n_choices_cost_one_prefill_and_share_the_prompt_pages(engine):
    """n=4 greedy: the 40 prompt tokens are computed once; the choices share the prompt's
    two full pages and each has its own third page (the partial page copied for three of
    them); every choice is the n=1 greedy answer."""
    with Probe(engine) as probe:
        outs = asyncio.run(collect(engine, GenerateRequest("four", PROMPT, greedy(8, n=4))))
    assert probe.prefill_tokens == len(PROMPT)
    assert probe.copies == 3
    full = len(PROMPT) // 16
    per_choice = pages_for(len(PROMPT) + 8, 16) - full
    assert max(probe.decode_used) == full + 4 * per_choice == 6
    assert max(probe.decode_used) < 4 * pages_for(len(PROMPT) + 8, 16)   # n separate requests: 12
    one = asyncio.run(collect(engine, GenerateRequest("one", PROMPT, greedy(8))))
    assert by_choice(outs, 4) == by_choice(one, 1) * 4
    assert finals(outs) == {i: FinishReason.LENGTH for i in range(4)}
    assert all(o.prompt_tokens == len(PROMPT) for o in outs)
    assert {o.index: o.completion_tokens for o in outs if o.finished} == {i: 8 for i in range(4)}
    engine.check_idle()


def test_seeded_choices_are_reproducible_and_differ(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=2, ignore_eos=True, logprobs=1)
    first = asyncio.run(collect(engine, GenerateRequest("s1", PROMPT, params)))
    again = asyncio.run(collect(engine, GenerateRequest("s2", PROMPT, params)))
    alone = asyncio.run(collect(engine, GenerateRequest("s3", PROMPT, SamplingParams(
        max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True))))
    a, b = by_choice(first, 2)
    assert by_choice(again, 2) == [a, b]
    assert a != b
    assert a == by_choice(alone, 1)[0]    # choice 0 keeps the request's seed
    assert [len(o.logprobs) for o in first] == [len(o.token_ids) for o in first]
    engine.check_idle()


def test_a_stop_ends_one_choice_only(engine):
    """Each choice stops on its own: a stop token seen by one choice (seeded sampling)
    ends that choice, the others go on to their length."""
    n = 3
    free = by_choice(asyncio.run(collect(engine, GenerateRequest("free", PROMPT, SamplingParams(
        max_tokens=12, temperature=1.0, seed=7, n=n, ignore_eos=True)))), n)
    stop = free[0][3]
    assert stop not in free[1] and stop not in free[2]   # the seeds give the choices different tokens
    outs = asyncio.run(collect(engine, GenerateRequest("stop", PROMPT, SamplingParams(
        max_tokens=12, temperature=1.0, seed=7, n=n, ignore_eos=True, stop_token_ids=(stop,)))))
    got = by_choice(outs, n)
    assert got[0] == free[0][: free[0].index(stop) + 1] and got[1:] == free[1:]
    assert finals(outs) == {0: FinishReason.STOP, 1: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    engine.check_idle()


def test_abort_mid_way_ends_every_choice_and_frees_every_page(engine):
    async def main():
        gen = engine.generate(GenerateRequest("ab", PROMPT, greedy(400, n=4)))
        outs = []
        async for out in gen:
            outs.append(out)
            if len(outs) == 8:   # each choice is decoding
                await engine.abort("ab")
        return outs

    outs = asyncio.run(main())
    assert finals(outs) == {i: FinishReason.ABORT for i in range(4)}
    assert outs[-1].finished   # the generator stopped after the fourth final output
    engine.check_idle()
    assert engine.call(lambda c: c.allocator.num_free == c.allocator.num_total)

    async def leave():   # a consumer that goes away (client disconnect) aborts all choices too
        gen = engine.generate(GenerateRequest("gone", PROMPT, greedy(400, n=3)))
        async for out in gen:
            if out.token_ids:
                break
        await gen.aclose()

    asyncio.run(leave())
    engine.check_idle()


def test_choices_under_preemption_in_a_tiny_pool(tiny_loaded):
    """Three requests of two choices each in a pool that holds one at a time: choices are
    preempted (each dropping only its references) and recomputed, and every choice still
    gives the greedy answer of its prompt alone."""
    small = build_engine(tiny_loaded, KVCacheConfig(page_size=4, max_kv_tokens=64),
                         SchedulerConfig(max_running_requests=8, max_prefill_tokens=256))
    try:
        prompts = [tuple(range(200 + 10 * i, 210 + 10 * i + i)) for i in range(3)]
        alone = [by_choice(asyncio.run(collect(small, GenerateRequest(f"a{i}", p, greedy(14)))), 1)[0]
                 for i, p in enumerate(prompts)]

        async def together():
            return await asyncio.gather(*[collect(small, GenerateRequest(f"t{i}", p, greedy(14, n=2)))
                                          for i, p in enumerate(prompts)])

        got = asyncio.run(together())
        assert small.call(lambda c: c.scheduler.num_preemptions) > 0
        for want, outs in zip(alone, got):
            assert by_choice(outs, 2) == [want, want]
            assert finals(outs) == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH}
        small.check_idle()
    finally:
        small.shutdown()


@pytest.mark.parametrize("n,why", [(0, "n must be"), (MAX_N + 1, "n must be"), (17, "--max-running-requests"),
                                   (12, "KV pages")])
def test_n_is_validated(engine, n, why):
    """n outside [1, MAX_N], above the running batch, or whose choices cannot fit the KV
    pool (2048 tokens: 128 pages; 12 choices of 40 + 600 tokens need 2 + 12 * 39) is a 400
    naming n."""
    greq = GenerateRequest("bad", PROMPT, greedy(600 if why == "KV pages" else 8, n=n))
    with pytest.raises(RequestRejected, match=why) as exc:
        asyncio.run(collect(engine, greq))
    assert exc.value.param == "n"
    engine.check_idle()


def test_output_lines_carry_the_choice():
    out = output_from_json(output_to_json(StepOutput("x", token_ids=[5], index=3, finish_reason=FinishReason.STOP)))
    assert (out.index, out.token_ids, out.finish_reason) == (3, [5], FinishReason.STOP)
    assert output_from_json('{"rid":"x","token_ids":[],"text":"","logprobs":[],"prompt_tokens":0,'
                            '"completion_tokens":0,"finish_reason":null,"error":null}').index == 0
    with pytest.raises(ValueError):
        output_from_json('{"rid":"x","index":-1,"token_ids":[],"text":"","logprobs":[],"prompt_tokens":0,'
                         '"completion_tokens":0,"finish_reason":null,"error":null}')


# ---------------------------------------------------------------- the simulation

def test_the_simulation_with_choices_is_clean_and_sees_a_shared_page_written(monkeypatch):
    """Seeds whose requests ask for up to 3 sampled choices (kvrelay.sim --max-n 3) break
    no invariant; with copy-on-write switched off (choices write into the shared last
    page), the simulation sees a choice whose pages do not hold its own KV."""
    seeds = range(16)
    failed = [(r.seed, str(r.violation)) for r in (run_seed(s, SimConfig(max_n=3)) for s in seeds) if not r.ok]
    assert failed == []
    monkeypatch.setattr(Scheduler, "_own_write_page", lambda self, req: True)
    caught = next((r for r in (run_seed(s, SimConfig(max_n=3)) for s in seeds) if not r.ok), None)
    assert caught is not None and caught.violation.invariant in ("kv-intact", "same-tokens"), caught


# ---------------------------------------------------------------- disaggregated

def worker_counter(url: str, name: str) -> float:
    return sum(gauge(metric_samples(url), name))


def assert_workers_whole(cluster: Cluster, timeout: float = 15.0) -> None:
    """Every phase gauge 0 and free pages == total pages on every worker."""
    deadline = time.monotonic() + timeout
    for w in cluster.workers:
        while True:
            s = metric_samples(w.url)
            phases = gauge(s, "kvrelay_requests")
            free, total = gauge(s, "kvrelay_kv_pages_free"), gauge(s, "kvrelay_kv_pages_capacity")
            if phases and not any(phases) and free == total:
                break
            assert time.monotonic() < deadline, f"leak on {w.name}: {phases} {free} {total}\n{cluster.logs()}"
            time.sleep(0.2)


def test_disaggregated_n_choices_one_prefill_one_transfer(tiny_llama_dir, tiny_loaded, engine):
    """A P and a D worker process: n=3 is prefilled once on P and its KV sent once (P's
    transfer bytes grow by the prompt's pages exactly once); D decodes the three choices,
    each index-tagged, each the colocated engine's answer (seeded: P samples each choice's
    first token with that choice's seed). A failed leg ends every choice with one error
    each; an abort ends each with one abort. Nothing leaks on either worker."""
    cluster = Cluster(["--model", f"random:{tiny_llama_dir}"], ["--dtype", "float32", "--max-kv-tokens", "4096"],
                      num_prefill=1, num_decode=1)
    p = cluster.prefill[0]
    arch = tiny_loaded.arch
    page_bytes = KVLayout("t", "float32", 16, arch.num_layers, arch.num_kv_heads, arch.head_dim).page_bytes
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=99, n=3, ignore_eos=True, logprobs=2)
    want = by_choice(asyncio.run(collect(engine, GenerateRequest("colocated", PROMPT, seeded))), 3)
    try:
        for w in cluster.workers:
            w.start()
        for w in cluster.workers:
            w.wait_healthy()

        async def main():
            async with router_client([p.url for p in cluster.prefill], [d.url for d in cluster.decode]) as router:
                before = worker_counter(p.url, "kvrelay_transfer_bytes_total")
                outs = await collect(router, GenerateRequest("three", PROMPT, seeded))
                sent = worker_counter(p.url, "kvrelay_transfer_bytes_total") - before
                whole = await collect(router, GenerateRequest("whole", PROMPT, greedy(6, n=3), whole=True))

                cluster.set_faults([p], "fail_transfer=1")
                failed = await collect(router, GenerateRequest("failed", PROMPT, greedy(6, n=3)))
                cluster.set_faults([p], "")

                gen = router.generate(GenerateRequest("aborted", PROMPT, greedy(400, n=3)))
                aborted = []
                async for out in gen:
                    aborted.append(out)
                    if len(aborted) == 6:
                        await router.abort("aborted")
                return outs, sent, whole, failed, aborted

        outs, sent, whole, failed, aborted = asyncio.run(main())
        assert by_choice(outs, 3) == want and want[0] != want[1]
        assert finals(outs) == {i: FinishReason.LENGTH for i in range(3)}
        assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
        assert sent == pages_for(len(PROMPT), 16) * page_bytes   # one transfer of the prompt's 3 pages
        assert sorted(o.index for o in whole) == [0, 1, 2]   # whole: one merged output per choice
        assert all(o.finished and len(o.token_ids) == 6 for o in whole)
        assert len({tuple(o.token_ids) for o in whole}) == 1   # greedy: the same answer three times
        assert finals(failed) == {i: FinishReason.ERROR for i in range(3)}
        assert len({o.error for o in failed}) == 1 and failed[0].error.startswith("transfer_error"), failed
        assert finals(aborted) == {i: FinishReason.ABORT for i in range(3)}
        assert_workers_whole(cluster)
    finally:
        for w in cluster.workers:   # side by side: SIGTERM both, then wait for each
            if w.popen is not None and w.popen.poll() is None:
                w.signal(signal.SIGTERM)
        cluster.stop()
