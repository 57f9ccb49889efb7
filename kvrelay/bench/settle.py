"""Waiting for a quiet host before each measured run (`kvrelay bench --settle`).

A server can keep a core busy after its last answer: vLLM-CPU's worker spins about one
second (its OpenMP threads wait actively), so whichever server runs next on a 2-core host
computes its first prompt on one core. Before each run the bench samples the host's CPU
time and waits until a window shows the host quiet, or `--settle` seconds have passed.

Invariant: this only delays a run; it never changes what is sent or how it is timed. On a
system without /proc/stat it does not wait.
"""
from __future__ import annotations

import asyncio
import os
import time

WINDOW = 0.25       # seconds per sample
QUIET_CORES = 0.25  # busy CPU time per second of wall time (in cores) below which the host is quiet
PROC_STAT = "/proc/stat"


def cpu_times(text: str) -> tuple[int, int]:
    """(all, idle) jiffies of the first `cpu` line of /proc/stat; idle counts iowait."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            return sum(values[:8]), values[3] + (values[4] if len(values) > 4 else 0)   # guest time is in user
    raise ValueError("no aggregate cpu line in /proc/stat")


def busy_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores kept busy on average between two `cpu_times` samples."""
    total, idle = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    return cores * (total - idle) / total


def _sample(path: str) -> tuple[int, int] | None:
    try:
        with open(path) as f:
            return cpu_times(f.read())
    except (OSError, ValueError):
        return None


async def settle(limit: float, *, path: str = PROC_STAT, window: float = WINDOW,
                 quiet: float = QUIET_CORES) -> float:
    """Wait until one `window` shows fewer than `quiet` busy cores, at most `limit`
    seconds; returns the seconds waited (0 without /proc/stat or with `limit` 0)."""
    start = time.perf_counter()
    if limit <= 0:
        return 0.0
    cores = os.cpu_count() or 1
    last = _sample(path)
    while last is not None and time.perf_counter() - start < limit:
        await asyncio.sleep(window)
        now = _sample(path)
        if now is None or busy_cores(last, now, cores) < quiet:
            break
        last = now
    return time.perf_counter() - start
