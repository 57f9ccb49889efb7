"""engine.heap: an engine process pins glibc's heap thresholds, so a step's large
temporaries come back from its arena instead of fresh zero-filled pages every step.

Each case runs in a fresh interpreter (thresholds are per process, and glibc's dynamic
ones depend on the process's history): a non-main thread, as an engine's compute thread,
allocates and frees a 40 MiB buffer eight times, touching every page, and counts its own
minor page faults."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvrelay.engine import heap

MIB = 1 << 20
PAGES = 40 * MIB // 4096
CHILD = """
import resource, sys, threading
from kvrelay.engine.heap import pin_heap_thresholds
said = pin_heap_thresholds() if sys.argv[1] == "pin" else "-"
n, faults = 40 << 20, []
def work():
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        b = bytearray(n)
        b[0:n:4096] = b"\\x01" * (n // 4096)
        del b
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=work)
t.start()
t.join()
print(sum(faults[2:]), said, sep="|")
"""


def run(mode: str, **env: str) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60,
                         env={**clean, **env}, check=True).stdout.strip()
    faults, said = out.split("|")
    return int(faults), said


def test_pinned_thresholds_reuse_a_freed_buffer_instead_of_faulting_in_fresh_pages():
    default, _ = run("default")
    pinned, said = run("pin")
    assert said == f"mmap threshold {heap.MMAP_THRESHOLD >> 20} MiB, trim threshold {heap.TRIM_THRESHOLD >> 20} MiB"
    # Iterations 3-8: glibc's default maps 40 MiB afresh each time (above its 32 MiB
    # dynamic ceiling); pinned, the arena keeps the memory and no page is faulted in again.
    assert default >= 6 * PAGES // 2
    assert pinned < 6 * PAGES // 20


def test_thresholds_the_user_set_are_left_alone():
    _, said = run("pin", MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    assert said == "left as set by MALLOC_TRIM_THRESHOLD_"


def test_a_second_call_changes_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_done", None)
    first = heap.pin_heap_thresholds()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")   # would change the answer of a new decision
    assert heap.pin_heap_thresholds() is first


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_either_glibc_variable_counts_as_the_users_choice(monkeypatch, name):
    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setenv(name, "1048576")
    assert heap.pin_heap_thresholds() == f"left as set by {name}"
