"""Mutation checks (#11 item 6): each known bug of the field, put back behind its switch in
the production code (kvrelay/core/mutation.py), must make the simulation fail within a
fixed budget of seeds. A mutant that survives marks a place where the simulation is
blind. The clean sweep (no mutant) is tests/test_sim.py.

Run with `-rP` (or `-s`) to see, per mutant, the seeds it took, the invariant that caught
it and, where shrunk, the length of the shrunk schedule (also in the JUnit properties).
"""
from __future__ import annotations

import pytest

from kvrelay.core import mutation
from kvrelay.sim.__main__ import shrink
from kvrelay.sim.run import Result, SimConfig, run_seed

# The list is kept here, in the test, on purpose: each entry is a bug the simulation must find.
MUTANTS = {
    "poll_ignores_abort": "the seeds' bug: poll() ignores abort and the transfer phase has no deadline",
    "d_timeout_before_first_byte": "SGLang #31800: D's transfer timeout only runs before the first byte",
    "timeouts_only_after_batch": "TensorRT-LLM #17124: timeouts are checked only when a batch ran",
    "reaper_stops_at_first_unexpired": "vLLM #41383: the lease reaper stops at the first unexpired entry",
    "quarantine_on_timer": "SGLang #38961: quarantined pages released on a timer while P may still write",
    "no_p_to_d_abort": "P's aborts and failures are not propagated to D",
    "router_ignores_dead_worker": "the router ignores a dead worker's open legs",
    "oom_after_kv_stranded": "SGLang #6857: a request out of pages on D after its KV arrived is stranded",
    "aux_before_ahead": "layer-wise transfer: the aux goes before the writes made ahead have landed",
    "progress_counts_pages": "D counts progress in pages touched: a layer-wise transfer's later spans look stalled",
    "judge_counts_own_stall": "a lease judge counts its own loop's stall against the workers it holds",
}
# Seeds 0..BUDGET-1. Measured: every mutant but one is caught within its first 45 seeds,
# and each breaks 2% (the rarest: d_timeout_before_first_byte, quarantine_on_timer) to 20%
# of the first 200; progress_counts_pages needs a seed with no fault, the two-sided
# backend and a slow link, and breaks 2 of the first 300 (seeds 91 and 220).
BUDGET = 300
# Shrinking costs a run per fault tried: done for a few mutants only.
SHRINK = ("poll_ignores_abort", "no_p_to_d_abort", "timeouts_only_after_batch", "router_ignores_dead_worker")


@pytest.fixture(autouse=True)
def no_mutant_leaks():
    """Every test starts and ends with every switch off, even if it failed half way."""
    assert not mutation.ACTIVE, f"a mutant was left on: {mutation.ACTIVE}"
    try:
        yield
    finally:
        leaked = set(mutation.ACTIVE)
        mutation.ACTIVE.clear()
    assert not leaked, f"a mutant was left on: {leaked}"


def first_failure() -> Result | None:
    for seed in range(BUDGET):
        r = run_seed(seed)
        if not r.ok:
            return r
    return None


def test_the_list_is_every_switch():
    assert set(MUTANTS) == mutation.MUTANTS


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_simulation_catches_the_mutant(name, record_property):
    with mutation.active(name):   # switched off again on the way out, pass or fail
        r = first_failure()
        assert r is not None, f"{name} ({MUTANTS[name]}) survived {BUDGET} seeds: the simulation is blind there"
        invariant = r.violation.invariant
        record_property("seeds_to_first_failure", r.seed + 1)
        record_property("invariant", invariant)
        line = f"{name}: caught by seed {r.seed} ({r.seed + 1} seeds), invariant {invariant}"
        if name in SHRINK:
            schedule, _ = shrink(r.seed, SimConfig(), r.schedule, invariant)
            again = run_seed(r.seed, schedule=schedule)
            assert not again.ok and again.violation.invariant == invariant, (schedule, again.violation)
            record_property("shrunk_schedule", len(schedule))
            line += f", schedule shrunk {len(r.schedule)} -> {len(schedule)} faults"
    if name in SHRINK:   # the mutant is the cause: without it, the shrunk schedule runs clean
        clean = run_seed(r.seed, schedule=schedule)
        assert clean.ok, clean.violation
    print(line)


def test_active_restores_the_switches_whatever_happens():
    with pytest.raises(RuntimeError):
        with mutation.active("no_p_to_d_abort"):
            assert mutation.on("no_p_to_d_abort") and not mutation.on("quarantine_on_timer")
            raise RuntimeError("boom")
    assert not mutation.ACTIVE
    with pytest.raises(ValueError, match="unknown mutant"):
        with mutation.active("no_such_bug"):
            pass
    assert not mutation.ACTIVE
