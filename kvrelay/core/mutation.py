"""Mutants: known bugs of the field, put back on purpose behind test-only switches.

Each name below re-creates, at the real site in kvrelay's production code, a bug that
shipped in a system of this kind. They are all off unless a test switches one on
(`active`), to prove that the simulation (`kvrelay.sim`) catches it: a mutant the
simulation does not catch marks a place where it is blind. Production never turns one
on; the cost at a site is one set lookup.

    poll_ignores_abort            a transfer endpoint's abort() leaves its status as it was
                                  (poll() never reports FAILED after an abort), and P's
                                  transfer phase has no deadline (the seeds' stuck-inflight bug)
    d_timeout_before_first_byte   D's waiting-phase timeout stops applying once the first KV
                                  page of the room has landed (SGLang #31800)
    timeouts_only_after_batch     the lifecycle watchdog (phase deadlines, dead peers) runs only
                                  in iterations where the engine ran a batch (TensorRT-LLM #17124)
    reaper_stops_at_first_unexpired
                                  a lease reaper (P<->D peer leases, the router's worker leases)
                                  stops at the first entry whose lease has not expired, although
                                  the entries are not in expiry order (vLLM #41383)
    quarantine_on_timer           D releases a failed one-sided room's quarantined pages on a
                                  short fixed timer while P may still write into them, instead
                                  of waiting for Stopped, a restart of P or the transfer deadline
                                  plus grace (SGLang #38961)
    no_p_to_d_abort               P does not tell D when it aborts or fails a room (no Notice)
    router_ignores_dead_worker    the router does nothing with a dead worker's open legs
    oom_after_kv_stranded         a request on D that lost its pages after its KV arrived
                                  (preempted) is never scheduled again and never failed
                                  (SGLang #6857)
    aux_before_ahead              layer-wise transfer: P's last write (and the aux after it)
                                  starts without waiting for the writes made ahead, so D may
                                  decode before their bytes landed
    progress_counts_pages         D's heartbeats count a room's progress in pages with some bytes
                                  in, not bytes landed: once a layer-wise write has touched every
                                  page, its later spans look like no progress and P cuts a
                                  transfer that moves (kvrelay's own, found 2026-12-05)
    judge_counts_own_stall        a lease judge (the router's reaper, a worker's P<->D leases)
                                  counts the time its own loop was stalled against the peers it
                                  holds: a router stall past the lease declares every worker dead
                                  (kvrelay's own, the finding of issue #53)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

MUTANTS = frozenset({
    "poll_ignores_abort", "d_timeout_before_first_byte", "timeouts_only_after_batch",
    "reaper_stops_at_first_unexpired", "quarantine_on_timer", "no_p_to_d_abort",
    "router_ignores_dead_worker", "oom_after_kv_stranded", "aux_before_ahead", "progress_counts_pages",
    "judge_counts_own_stall",
})

ACTIVE: set[str] = set()


def on(name: str) -> bool:
    """Whether mutant `name` is switched on (only ever by a test)."""
    return name in ACTIVE


@contextlib.contextmanager
def active(*names: str) -> Iterator[None]:
    """Switch these mutants on for the duration of the block; the previous set is restored
    on the way out, whatever happens inside."""
    unknown = set(names) - MUTANTS
    if unknown:
        raise ValueError(f"unknown mutant(s) {sorted(unknown)}; known: {sorted(MUTANTS)}")
    before = set(ACTIVE)
    ACTIVE.update(names)
    try:
        yield
    finally:
        ACTIVE.clear()
        ACTIVE.update(before)
