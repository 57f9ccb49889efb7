"""The cores other processes keep busy (`engine/host_load.py`), and the core share leaving
them to those processes: from /proc's figures (here scripted), from a real busy process,
and in the thread counts the engines split."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvrelay.engine.core_share import Post, share
from kvrelay.engine.host_load import BUSY_FROM, SAMPLE_PERIOD, OtherLoad, cores_busy_seconds, process_cpu_seconds


class Host:
    """A scripted /proc: cores busy `busy` seconds, engine pids at `cpu` seconds, time `now`."""

    def __init__(self, pids=(10, 11)) -> None:
        self.now, self.busy, self.cpu = 0.0, 100.0, {p: 5.0 for p in pids}

    def run(self, seconds: float, ours: float, theirs: float) -> None:
        """`seconds` pass; the engines use `ours` cores (split evenly), others `theirs`."""
        self.now += seconds
        self.busy += (ours + theirs) * seconds
        for p in self.cpu:
            self.cpu[p] += ours * seconds / len(self.cpu)

    def load(self) -> OtherLoad:
        return OtherLoad(lambda: list(self.cpu), cpus=[0, 1], clock=lambda: self.now,
                         busy=lambda cpus: self.busy, cpu=self.cpu.get)


def test_only_the_engines_busy_leaves_every_core_to_them():
    host = Host()
    load = host.load()
    assert load.cores_taken() == 0   # the first sample: nothing to compare yet
    for _ in range(6):
        host.run(SAMPLE_PERIOD, ours=2.0, theirs=0.1)   # the router and the client: a tenth of a core
        assert load.cores_taken() == 0
    assert load.load < 0.2


def test_a_busy_process_beside_the_engines_takes_its_core_and_gives_it_back():
    host = Host()
    load = host.load()
    load.cores_taken()
    taken = []
    for _ in range(4):
        host.run(SAMPLE_PERIOD, ours=1.0, theirs=1.0)
        taken.append(load.cores_taken())
    assert taken[0] == 0 and taken[-1] == 1 and taken == sorted(taken)   # smoothed: it rises to one core, never past it
    host.run(SAMPLE_PERIOD, ours=2.0, theirs=0.05)
    assert load.cores_taken() == 0 and load.load == pytest.approx(0.05)   # the core comes back at once


def test_a_neighbour_on_every_core_that_stops_leaves_them_at_the_next_sample():
    host = Host()
    load = host.load()
    load.cores_taken()
    for _ in range(12):
        host.run(SAMPLE_PERIOD, ours=0.0, theirs=2.0)   # another server's run: both cores
        load.cores_taken()
    assert load.cores_taken() == 2
    host.run(SAMPLE_PERIOD, ours=1.0, theirs=1.0)   # it stops half way through a sample
    assert load.cores_taken() == 1
    host.run(SAMPLE_PERIOD, ours=2.0, theirs=0.0)
    assert load.cores_taken() == 0 and load.load == 0.0


def test_samples_are_rate_limited_and_skip_a_change_of_engines():
    host = Host()
    load = host.load()
    load.cores_taken()
    host.run(SAMPLE_PERIOD / 4, ours=0.0, theirs=2.0)
    assert load.cores_taken() == 0 and load.load == 0.0   # within the period: not sampled
    for _ in range(2):
        host.run(SAMPLE_PERIOD, ours=0.0, theirs=2.0)
        load.cores_taken()
    high = load.load
    assert high >= BUSY_FROM
    host.cpu[12] = 50.0   # an engine joins: its past CPU time is no one's load now
    host.run(SAMPLE_PERIOD, ours=0.0, theirs=2.0)
    load.cores_taken()
    assert load.load == high   # that sample only sets the new baseline


def test_without_proc_nothing_is_taken():
    load = OtherLoad(lambda: [1], cpus=[0], busy=lambda cpus: None, cpu=lambda pid: None)
    assert load.cores_taken() == 0


def test_the_proc_readers(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text(f"cpu  9 9 9 9 9 9 9 0 0 0\ncpu0 {tick} 0 {tick} 50 7 0 0 0 0 0\n"
                    f"cpu1 0 {2 * tick} 0 50 7 0 {tick} 0 0 0\ncpu2 {5 * tick} 0 0 0 0 0 0 0 0 0\nintr 1 2\n")
    assert cores_busy_seconds([0, 1], str(stat)) == 5.0   # cpu2 is not ours; idle and iowait are not busy
    assert cores_busy_seconds([0], str(tmp_path / "missing")) is None
    assert process_cpu_seconds(os.getpid()) > 0
    assert process_cpu_seconds(2 ** 22 + 1) is None


def test_a_real_busy_process_is_seen():
    """Against this host's /proc: a process spinning on one of the cores this one may use
    counts as at least BUSY_FROM of a core (whatever else runs, it only adds)."""
    cpus = sorted(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[0]}}})\n"
                            "while True: pass"])
    try:
        load = OtherLoad(lambda: [os.getpid()], cpus=cpus[:1])
        load.cores_taken()
        deadline = time.monotonic() + 10
        while load.cores_taken() < 1 and time.monotonic() < deadline:
            time.sleep(SAMPLE_PERIOD / 2)
        assert load.cores_taken() == 1, load.load
    finally:
        hog.kill()
        hog.wait()


def test_the_engines_with_work_split_only_the_cores_left_to_them():
    two = {0: Post(True, 100.0), 1: Post(True, 0.0)}
    assert [share(s, two, 2, taken=1) for s in (0, 1)] == [1, 1]    # never below one each
    assert [share(s, two, 4, taken=1) for s in (0, 1)] == [2, 1]    # the prompt takes the odd core
    assert [share(s, two, 4) for s in (0, 1)] == [2, 2]
    one = {0: Post(True, 0.0), 1: Post(False)}
    assert share(0, one, 4, taken=3) == 1
    assert share(1, one, 4, taken=3) == 3   # an idle engine runs nothing: its count is the others' leftover


def idle_steps(core, seconds: float = 8 * SAMPLE_PERIOD) -> None:
    """Step `core` with nothing to run for `seconds`, as a loop does between requests: its
    idle steps keep the estimate current (one core busy reads 0.68 after four samples)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        core.step()
        time.sleep(SAMPLE_PERIOD / 5)


def first_step_beside_a_busy_process(make_core, cases) -> None:
    """For each (leave_busy_cores, threads wanted, threads before): an engine from
    `make_core(leave)` idles beside a process spinning on a core, then takes a request. Its
    first step with work runs on at most `wanted` threads (exactly, with the flag off) and
    reports the estimate (at least BUSY_FROM; 0 off); then it finishes and holds nothing."""
    import torch

    from kvrelay.engine.types import GenerateRequest, SamplingParams

    before = torch.get_num_threads()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for leave, want, threads in cases:
            torch.set_num_threads(threads)
            core = make_core(leave)
            try:
                idle_steps(core)
                outs = []
                core.add(GenerateRequest("r", tuple(range(3, 30)), SamplingParams(max_tokens=2, temperature=0.0)),
                         outs.append)
                core.step()
                n = torch.get_num_threads()
                assert (n <= want) if leave else (n == want), (leave, n)
                other = core.engine_stats(0, 0).other_load   # kvrelay_engine_other_load_cores
                assert other >= BUSY_FROM if leave else other == 0.0, (leave, other)
                while core.has_work:
                    core.step()
                assert outs[-1].finished
                core.check_idle()
            finally:
                if core.core_share is not None:
                    core.core_share.close()
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(before)


def test_an_engine_beside_a_busy_process_steps_on_the_cores_it_leaves(tiny_loaded, tmp_path):
    """`--core-share` with leave_busy_cores (the default): an engine that idled beside a
    process spinning on one of this host's cores runs its first step with work on at most
    the other cores (one thread at least); with it off, on every core."""
    from kvrelay.core.config import KVCacheConfig, SchedulerConfig
    from kvrelay.engine.core import EngineCore
    from kvrelay.engine.core_share import host_cores

    cores = host_cores()
    first_step_beside_a_busy_process(
        lambda leave: EngineCore(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=512),
                                 SchedulerConfig(core_share=f"{tmp_path / str(leave)}:0", leave_busy_cores=leave)),
        [(True, max(1, cores - 1), cores), (False, cores, cores)])


def test_an_engine_of_its_own_leaves_busy_cores_too(tiny_loaded):
    """Without a core share (colocated), an engine started on two threads that idled beside
    a process spinning on a core it may use runs its first step with work on at most the
    cores left free (one on 2 cores); with leave_busy_cores off, on two."""
    from kvrelay.core.config import KVCacheConfig, SchedulerConfig
    from kvrelay.engine.core import EngineCore
    from kvrelay.engine.core_share import host_cores

    first_step_beside_a_busy_process(
        lambda leave: EngineCore(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=512),
                                 SchedulerConfig(leave_busy_cores=leave)),
        [(True, min(2, max(1, host_cores() - 1)), 2), (False, 2, 2)])


def test_a_prompt_pass_begun_beside_a_burst_takes_the_core_back_between_layers(tiny_loaded):
    """Without a core share, an engine that starts a prompt's pass while another process
    keeps a core busy starts it on one thread; when that process stops, the pass goes on
    on two from the next sample, read between layers, not at the next step. (A scripted
    host and the engine's simulated clock: each layer takes a sample period.)"""
    import torch

    from kvrelay.core.clock import SimClock
    from kvrelay.core.config import KVCacheConfig, SchedulerConfig
    from kvrelay.engine.core import MID_STEP_PERIOD, EngineCore
    from kvrelay.engine.types import GenerateRequest, SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        clock = SimClock()
        core = EngineCore(tiny_loaded, KVCacheConfig(page_size=16, max_kv_tokens=512),
                          SchedulerConfig(leave_busy_cores=True), clock=clock)
        host = Host(pids=(os.getpid(),))
        core._other_load = OtherLoad(lambda: list(host.cpu), cpus=[0, 1], clock=lambda: host.now,
                                     busy=lambda cpus: host.busy, cpu=host.cpu.get)
        core._other_load.cores_taken()
        for _ in range(6):   # a neighbour on one core for 3 s
            host.run(SAMPLE_PERIOD, ours=0.0, theirs=1.0)
            core._other_load.cores_taken()
        threads = []   # (on entering a layer boundary, after it)
        inner = core.runner.between_layers

        def layer(done: int) -> None:
            host.run(SAMPLE_PERIOD, ours=float(torch.get_num_threads()), theirs=0.0)   # the neighbour stopped
            clock.advance(MID_STEP_PERIOD)
            entered = torch.get_num_threads()
            inner(done)
            threads.append((entered, torch.get_num_threads()))

        core.runner.between_layers = layer
        outs = []
        core.add(GenerateRequest("r", tuple(range(3, 40)), SamplingParams(max_tokens=2, temperature=0.0)), outs.append)
        core.step()   # the prompt's pass
        assert threads, "the pass called between_layers"
        assert threads[0] == (1, 2)   # begun on one thread (the neighbour's core), on two after the first layer
        assert all(after == 2 for _, after in threads)
        while core.has_work:
            core.step()
        assert outs[-1].finished
        core.check_idle()
    finally:
        torch.set_num_threads(before)
