"""--core-share: the engines of one host split its cores among those that have work."""
from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from array import array

import pytest
import torch

from kvrelay.core.config import KVCacheConfig, SchedulerConfig
from kvrelay.engine.core import EngineCore
from kvrelay.engine.core_share import (FIELDS, IDLE_REFRESH, PREFILL_WAIT, STALE, YIELD_MAX, YIELD_POLL, CoreShare, Post, _runs,
                                       host_cores, owed, share, prompt_steps)
from kvrelay.engine.types import GenerateRequest, SamplingParams


def test_the_engines_with_work_split_the_cores_evenly_and_the_rest_goes_to_the_most_queued():
    assert share(0, {0: Post(True, 10)}, 8) == 8                       # alone with work: every core
    assert share(0, {0: Post(True, 10), 1: Post(False)}, 8) == 8       # the other has none
    assert [share(s, {0: Post(True, 5), 1: Post(True, 900)}, 2) for s in (0, 1)] == [1, 1]
    # 3 cores, 2 with work: the one with more prompt tokens to compute gets the spare core
    assert [share(s, {0: Post(True, 5), 1: Post(True, 900)}, 3) for s in (0, 1)] == [1, 2]
    assert [share(s, {0: Post(True, 0), 1: Post(True, 0)}, 3) for s in (0, 1)] == [2, 1]   # a tie: slot order
    assert share(1, {0: Post(True, 0), 1: Post(False)}, 4) == 3        # idle: what the others leave
    assert share(2, {0: Post(True), 1: Post(True), 2: Post(True)}, 2) == 1   # more engines than cores: one each


def test_the_threads_of_the_engines_with_work_never_exceed_the_cores():
    rng = random.Random(7)
    for _ in range(2000):
        cores = rng.randint(1, 64)
        slots = rng.sample(range(64), rng.randint(1, 8))
        posts = {s: Post(rng.random() < 0.6, rng.choice([0, 1, 50, 4096])) for s in slots}
        threads = {s: share(s, posts, cores) for s in posts}
        busy = [s for s in posts if posts[s].busy]
        assert all(t >= 1 for t in threads.values())
        if busy and len(busy) <= cores:
            assert sum(threads[s] for s in busy) == cores   # every core used, none twice
        elif busy:
            assert all(threads[s] == 1 for s in busy)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_share_file_counts_live_running_engines_only(tmp_path):
    path, clock, dead = str(tmp_path / "cores"), Clock(), set()
    a = CoreShare(path, 0, cores=2, clock=clock, pid=1001, alive=lambda pid: pid not in dead)
    b = CoreShare(path, 5, cores=2, clock=clock, pid=1002, alive=lambda pid: pid not in dead)
    assert a.threads(True) == 2            # b never posted
    assert b.threads(True) == 1 and a.threads(True) == 1
    assert b.threads(False) == 1 and a.threads(True) == 2
    b.post(True)
    dead.add(1002)                          # b's process died (or was stopped) with work posted
    assert a.threads(True) == 2
    dead.clear()
    assert a.threads(True) == 1
    clock.t += STALE + 1                    # b posted nothing for longer than any step takes
    assert a.threads(True) == 2
    b.leave()
    clock.t = 100.0
    assert a.threads(True) == 2            # an emptied slot counts for nothing
    for garbage in ([float("nan")] * 4, [1e300, 1, 0, 100], [1003, 1, float("inf"), 100], [1003, 1, 0, float("nan")]):
        b._table[5 * 4:6 * 4] = array("d", garbage)   # not written by an engine: counts for nothing
        assert a.threads(True) == 2
    a.close()
    b.close()
    with pytest.raises(ValueError, match="slot 64"):
        CoreShare(path, 64)


def test_a_stopped_or_reaped_process_does_not_run():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _runs(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        os.waitpid(child.pid, os.WUNTRACED)
        assert not _runs(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        assert _runs(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not _runs(child.pid)


@pytest.mark.parametrize("spec", ["nofile", "/x:", ":3", "/x:64", "/x:-1", "/x:one"])
def test_a_bad_spec_names_the_flag(spec):
    with pytest.raises(ValueError, match="--core-share must be FILE:SLOT"):
        SchedulerConfig(core_share=spec)


@pytest.fixture
def shared_engine(tiny_loaded, tmp_path):
    """An engine at slot 0 of a share file, and another slot (this process, running) at 1."""
    before, path = torch.get_num_threads(), str(tmp_path / "cores")
    other = CoreShare(path, 1)
    # leave_busy_cores off: these tests count threads out of every core, whatever else runs
    core = EngineCore(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=512),
                      SchedulerConfig(core_share=f"{path}:0", leave_busy_cores=False))
    try:
        yield core, other
    finally:
        torch.set_num_threads(before)
        other.close()
        core.core_share.close()


def test_an_engine_runs_each_step_on_its_part_of_the_cores(shared_engine):
    """While the other slot has work, a step with work runs on the cores it leaves; once it
    has none, on all of them."""
    core, other = shared_engine
    cores, outs = host_cores(), []
    other.post(True, 0)
    core.add(GenerateRequest("r", tuple(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0)), outs.append)
    core.step()   # the prompt: more queued than the other, so the spare core (if odd) is this one's
    assert torch.get_num_threads() == cores // 2 + cores % 2
    other.post(False)
    core.step()
    assert torch.get_num_threads() == cores
    assert core.engine_stats(0, 0).threads == cores
    while core.has_work:
        core.step()
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3
    core.check_idle()


def test_a_prompt_pass_takes_the_cores_another_engine_stops_using_between_layers(shared_engine):
    """A prompt's pass begun while the other slot had work runs on its part of the cores;
    once the other posts none, the pass re-reads its share after its next layer and goes on
    on every core (posting nothing), not only from its next step."""
    core, other = shared_engine
    cores, outs, seen = host_cores(), [], []
    inner = core.runner.between_layers

    def layer(done: int) -> None:
        other.post(False)   # the other engine's work ended while this pass computed
        entered = torch.get_num_threads()
        inner(done)
        seen.append((entered, torch.get_num_threads()))

    core.runner.between_layers = layer
    other.post(True, 0)
    core.add(GenerateRequest("r", tuple(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0)), outs.append)
    core.step()   # the prompt's pass
    assert seen and seen[0] == (cores // 2 + cores % 2, cores)
    assert core.core_share.posts()[0].busy   # its own post is the step's: nothing re-posted mid-pass
    while core.has_work:
        core.step()
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3
    core.check_idle()


def test_an_engine_with_decodes_only_yields_for_the_prompt_step_under_way_then_steps_once(tmp_path):
    path, clock = str(tmp_path / "cores"), Clock()
    d = CoreShare(path, 0, cores=2, clock=clock, pid=1001, alive=lambda pid: True)
    p = CoreShare(path, 1, cores=2, clock=clock, pid=1002, alive=lambda pid: True)
    assert prompt_steps(0, {0: Post(True), 1: Post(True, 300)})
    assert not prompt_steps(0, {0: Post(True), 1: Post(True, 0)})          # the other decodes too
    assert prompt_steps(0, {0: Post(True), 1: Post(False, 300)})           # pending: about to compute
    assert not prompt_steps(0, {0: Post(True), 1: Post(False)})            # posted no work
    assert not prompt_steps(0, {0: Post(True, 300)})                       # its own prompt does not count
    p.post(True, 0)
    assert not d.should_yield(True)          # the other has no prompt to compute
    p.post(True, 2048)
    assert not d.should_yield(False)         # this step computes a prompt of its own: no yield
    assert d.should_yield(True)
    assert p.threads(True, 2048) == 2        # the yielding engine posted no work: every core to the prompt
    clock.t += YIELD_MAX / 2
    assert d.should_yield(True)              # the same step, still under way
    clock.t += 0.5
    p.threads(True, 1024)                    # the prompt's next step
    assert not d.should_yield(True)          # the step it yielded to ended: one step of its own
    assert d.should_yield(True)              # then it yields to the new one
    clock.t += YIELD_MAX
    assert not d.should_yield(True)          # a step that runs YIELD_MAX: one step, whatever it posts
    assert d.should_yield(True)              # and then a new while
    p.post(False)
    assert not d.should_yield(True)          # the prompt is done
    assert not d.should_yield(True)
    d.close()
    p.close()


def test_a_prompt_waits_a_bounded_while_for_a_decode_step_to_end_then_takes_every_core(tmp_path):
    """A thread count is read once per step: a prompt that read the decoding engine as
    busy would run its whole step on half the cores. It waits, YIELD_POLL at a time, for
    that step to end (the other then yields to it), and no longer than PREFILL_WAIT."""
    path, clock = str(tmp_path / "cores"), Clock()
    d = CoreShare(path, 0, cores=2, clock=clock, pid=1001, alive=lambda pid: True)
    slept: list[float] = []

    def step_ends_after(polls: int):
        def sleep(seconds: float) -> None:
            slept.append(seconds)
            clock.t += seconds
            if len(slept) == polls:
                assert d.should_yield(True)   # its next step sees the prompt and yields
        return sleep

    p = CoreShare(path, 1, cores=2, clock=clock, pid=1002, alive=lambda pid: True, sleep=step_ends_after(7))
    d.post(True, 0)                              # in the middle of a step of decodes
    assert p.threads(True, 2048) == 2            # waited for that step, then took both cores
    assert slept == [YIELD_POLL] * 7
    slept.clear()
    d.post(True, 0)
    p._sleep = step_ends_after(10**6)            # a decode step that does not end in time
    assert p.threads(True, 2048) == 1            # waited PREFILL_WAIT, then its even share
    assert len(slept) == math.ceil(PREFILL_WAIT / YIELD_POLL) and sum(slept) == pytest.approx(PREFILL_WAIT)
    slept.clear()
    assert p.threads(True, 0) == 1 and not slept   # a step without a prompt never waits
    d.post(True, 512)
    assert p.threads(True, 2048) == 1 and not slept   # nor for another engine's prompt
    d.close()
    p.close()


def test_a_prompt_lets_an_engine_that_yielded_to_the_prompt_before_take_its_one_step_alone(tmp_path):
    """At a prompt step's end, the decode engine that yielded to it is owed one step. The
    next prompt step posts itself pending (no work) and waits while that engine is owed
    its step or runs it, so the step runs on every core and the prompt's after it, never
    the two beside each other on three threads; the decode engine then yields again."""
    path, clock = str(tmp_path / "cores"), Clock()
    d = CoreShare(path, 0, cores=2, clock=clock, pid=1001, alive=lambda pid: True)
    events: list[str] = []

    def sleep(seconds: float) -> None:   # what the decode engine does while the prompt waits
        clock.t += seconds
        if not events:
            assert not d.should_yield(True)       # the prompt step it yielded to ended
            assert d.threads(True, 0) == 2        # its one step: the pending prompt holds no core
            events.append("decode step")
        elif events == ["decode step"]:
            assert d.should_yield(True)           # its next step yields to the pending prompt
            events.append("yields")

    p = CoreShare(path, 1, cores=2, clock=clock, pid=1002, alive=lambda pid: True, sleep=sleep)
    first_at = p.post(True, 2048)
    assert d.should_yield(True)                   # yields to the first prompt step
    assert owed(1, p.posts(), clock.t + 1) and not owed(1, p.posts(), clock.t)
    # another engine's prompt under way: the yielding engine waits for it anyway, nobody owes
    assert not owed(1, {**p.posts(), 2: Post(True, 512, clock.t)}, clock.t + 1)
    clock.t += 3.0                                # the prompt step ends; its next one
    assert p.threads(True, 1024) == 2
    assert events == ["decode step", "yields"]    # the decode step ran first, alone
    post = p.posts()[1]
    assert post.busy and post.queued == 1024 and post.at > first_at
    assert d.should_yield(True)                   # the step it now yields to is that same step
    events.append("done")
    assert p.threads(True, 512) == 2              # nobody owed: no wait
    d.close()
    p.close()


def test_a_waiting_engine_wakes_when_another_posts(tmp_path):
    """The sockets: a wait ends as soon as another slot posts something new, not after
    its timeout; an engine waits its whole timeout when nothing changes."""
    path = str(tmp_path / "cores")
    d, p = CoreShare(path, 0, cores=2), CoreShare(path, 1, cores=2)
    d.post(False)
    p.post(False)                                 # p's first post pokes d
    started = time.monotonic()
    d.wait(30.0)
    assert time.monotonic() - started < 10.0
    started = time.monotonic()
    d.wait(0.2)                                   # nothing new since: the whole wait
    assert time.monotonic() - started >= 0.19
    timer = threading.Timer(0.3, p.post, (True, 2048))
    timer.start()
    started = time.monotonic()
    d.wait(30.0)
    assert time.monotonic() - started < 10.0      # poked at ~0.3 s, long before its timeout
    timer.join()
    p.post(True, 2048)                            # a new step pokes too: read by the next wait
    started = time.monotonic()
    d.wait(30.0)
    assert time.monotonic() - started < 10.0
    d.close()
    p.close()


def test_a_dead_or_stopped_prompt_engine_holds_no_decodes(tmp_path):
    path, clock, dead = str(tmp_path / "cores"), Clock(), set()
    d = CoreShare(path, 0, cores=2, clock=clock, pid=1001, alive=lambda pid: pid not in dead)
    p = CoreShare(path, 1, cores=2, clock=clock, pid=1002, alive=lambda pid: pid not in dead)
    p.post(True, 4096)
    assert d.should_yield(True)
    dead.add(1002)   # frozen (SIGSTOP) or killed in the middle of its prompt
    assert not d.should_yield(True)
    d.close()
    p.close()


def test_an_engine_skips_its_decode_steps_while_another_computes_a_prompt(shared_engine):
    """Slot 0 decodes; slot 1 posts a prompt. Slot 0's steps yield (no token, no work
    posted) until the prompt is done, then its decodes go on; nothing leaks."""
    core, other = shared_engine
    outs = []
    other.post(True, 1000)
    core.add(GenerateRequest("r", tuple(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0)), outs.append)
    core.step()   # its own prompt: computed beside the other's, no yield
    assert core.yielded_steps == 0 and len(outs) == 1
    for _ in range(5):
        core.step()
    assert core.yielded_steps == 5 and len(outs) == 1       # decodes only: every step yielded
    assert core.engine_stats(0, 0).yielded_seconds >= 5 * YIELD_POLL   # kvrelay_engine_yielded_seconds
    assert not other.posts()[0].busy and other.posts()[0].queued == 0            # and posted no work meanwhile
    other.post(True, 0)
    while core.has_work:
        core.step()
    assert core.yielded_steps == 5
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 4
    core.check_idle()


def test_an_idle_engine_takes_every_core_back_once_the_other_is_idle_too(shared_engine):
    """An engine that went idle while the other decoded read its share then (the cores the
    other left); once the other is idle too it re-reads the file within IDLE_REFRESH and
    runs on every core, without posting again."""
    core, other = shared_engine
    cores, outs = host_cores(), []
    core.add(GenerateRequest("r", tuple(range(3, 20)), SamplingParams(max_tokens=2, temperature=0.0)), outs.append)
    while core.has_work:
        core.step()
    other.post(True, 0)                      # the other decodes as this one goes idle
    core.step()
    assert torch.get_num_threads() == max(1, cores - 1)
    stamp = core.core_share._table[0 * FIELDS + 3]
    other.post(False)
    deadline = time.monotonic() + 10 * IDLE_REFRESH
    while torch.get_num_threads() != cores and time.monotonic() < deadline:
        time.sleep(IDLE_REFRESH / 5)
        core.step()
    assert torch.get_num_threads() == cores
    assert core.core_share._table[0 * FIELDS + 3] == stamp   # read, not posted
    assert outs[-1].finished
    core.check_idle()


def test_an_idle_engine_posts_no_work_once_then_leaves_the_file_alone(shared_engine):
    """A step with work posts busy; the first idle step after it posts no work; later idle
    steps (a decode worker polls every few ms while a prompt computes elsewhere) write
    nothing, and the other slot reads this one as idle throughout."""
    core, other = shared_engine
    stamp = lambda: core.core_share._table[0 * FIELDS + 3]   # this slot's posted-at
    outs = []
    core.add(GenerateRequest("r", tuple(range(3, 20)), SamplingParams(max_tokens=2, temperature=0.0)), outs.append)
    while core.has_work:
        core.step()
        assert other.posts()[0].busy
    core.step()   # the first idle step
    assert not other.posts()[0].busy and other.posts()[0].queued == 0
    posted = stamp()
    for _ in range(5):
        time.sleep(0.002)
        core.step()
    assert stamp() == posted and not other.posts()[0].busy and other.posts()[0].queued == 0
    core.add(GenerateRequest("s", tuple(range(3, 20)), SamplingParams(max_tokens=1, temperature=0.0)), outs.append)
    core.step()   # work again: posted first
    assert stamp() > posted
    while core.has_work:
        core.step()
    assert [o.finished for o in outs].count(True) == 2
    core.check_idle()
