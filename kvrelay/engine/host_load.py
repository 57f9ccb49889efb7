"""The cores of this host that other processes keep busy: what a team of engine threads
cannot count on (`--core-share`, `SchedulerConfig.leave_busy_cores`).

A team of OpenMP threads meets at a barrier after every kernel. On a host where another
process keeps a core busy, one thread of a two-thread team is off its core at most
barriers, and its partner spins there until the scheduler gives the core back: `serve`'s
workers, two threads each on 2 cores beside one busy-looping process, answered 5 requests
of 24 tokens in 53-58 s, against 3.3 s on one thread each (Xeon, AMX). So the busy cores
are left to those processes: the engines split only the rest.

The estimate samples, at most every SAMPLE_PERIOD, the busy time of the cores this process
may run on (/proc/stat, per core, so a container pinned to a few cores of a large host
counts only those) and the CPU time of the engines that share them (their pids). The
difference is what other processes used: the router, the client, any other program. It
rises smoothed over samples, so a short burst (a client starting) takes no core, and falls
to a lower sample at once, so cores a neighbour stopped using come back at the next step:
a core left idle costs a whole thread's work, one shared for a sample costs a few
preempted barriers. (Smoothed both ways, the estimate took 2-4 s to fall from 1.9 cores
after vLLM's run on the same host, and the prefill behind it ran on one thread: 2,844
against ~6,000 tokens/s.)

Invariant: it is advisory. A misread or missing /proc changes a thread count, never a
result; without /proc it reports no cores taken.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable

SAMPLE_PERIOD = 0.5   # seconds between samples
BUSY_FROM = 0.6       # cores: others' load from which one core is theirs (1.6: two, ...)
SMOOTH = 0.25         # weight of a higher newest sample: a second of one busy core (a client starting) stays below BUSY_FROM
_TICK = os.sysconf("SC_CLK_TCK")


def cores_busy_seconds(cpus: Iterable[int], path: str = "/proc/stat") -> float | None:
    """Seconds cores `cpus` have spent busy since boot (user, nice, system, irq, softirq),
    or None where /proc/stat cannot be read."""
    want, total = {f"cpu{c}" for c in cpus}, 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break   # the per-core lines come first; a large host's "intr" line is long
                fields = line.split()
                if fields[0].decode() in want:
                    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
                    total += user + nice + system + irq + softirq
    except (OSError, ValueError):
        return None
    return total / _TICK


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system seconds of process `pid` (all its threads), or None if it is gone."""
    fields = stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / _TICK if fields is not None else None
    except (IndexError, ValueError):
        return None


class OtherLoad:
    """Cores of `cpus` (default: this process's) kept busy by processes other than `pids()`
    (the engines sharing them). `busy` and `cpu` replace /proc, `clock` the time (tests)."""

    def __init__(self, pids: Callable[[], Iterable[int]], cpus: Iterable[int] | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[Iterable[int]], float | None] = cores_busy_seconds,
                 cpu: Callable[[int], float | None] = process_cpu_seconds,
                 period: float = SAMPLE_PERIOD) -> None:
        self._pids, self._clock, self._busy, self._cpu, self.period = pids, clock, busy, cpu, period
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self.load = 0.0   # smoothed cores busy with other processes
        self._last: tuple[float, float, dict[int, float]] | None = None   # (time, busy seconds, pid -> cpu seconds)

    def cores_taken(self) -> int:
        """Whole cores to leave to other processes: 0 below BUSY_FROM of one."""
        self._sample()
        return max(0, int(self.load + 1.0 - BUSY_FROM))

    def _sample(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.period:
            return
        busy = self._busy(self.cpus)
        if busy is None:
            self._last = None
            return
        ours = {pid: s for pid in set(self._pids()) if (s := self._cpu(pid)) is not None}
        last, self._last = self._last, (now, busy, ours)
        if last is None or ours.keys() != last[2].keys() or now <= last[0]:
            return   # the first sample, or engines came or went: no difference to take yet
        theirs = (busy - last[1]) - sum(ours[p] - last[2][p] for p in ours)
        sample = min(max(theirs / (now - last[0]), 0.0), len(self.cpus))
        self.load = sample if sample < self.load else (1 - SMOOTH) * self.load + SMOOTH * sample
