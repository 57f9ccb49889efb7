"""The deterministic simulation (kvrelay/sim, docs/simulation.md): a clean sweep of seeds
(about half a minute), one seed replays exactly, and a printed schedule replays the failure it
came from. The mutants it must catch are in test_sim_mutants.py."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from kvrelay.sim import faults as fl
from kvrelay.sim.__main__ import _batch, main, parse_seeds, replay_command
from kvrelay.sim.run import SimConfig, Violation, run_seed

# A smoke sweep (every fault kind and client outcome is drawn by seed 100, checked); `make sim` is the
# search itself.
SWEEP = int(os.environ.get("KVRELAY_SIM_SEEDS", "100"))


def test_a_sweep_of_seeds_breaks_no_invariant():
    seeds = list(range(SWEEP))
    chunks = [seeds[i:i + 25] for i in range(0, len(seeds), 25)]
    with ProcessPoolExecutor(2) as pool:
        results = [r for batch in pool.map(_batch, [(c, asdict(SimConfig())) for c in chunks]) for r in batch]
    failed = [(r.seed, str(r.violation)) for r in results if not r.ok]
    assert failed == [], failed[:5]
    assert len(results) == SWEEP
    kinds = {f.kind for r in results for f in r.schedule}
    assert kinds == set(fl.KINDS), f"fault kinds never drawn: {set(fl.KINDS) - kinds}"
    outcomes = {k for r in results for k in r.outcomes}
    # the sweep reaches successes, client departures and failures with reasons, not only one
    assert {"length", "stop", "left"} <= outcomes and outcomes - {"length", "stop", "left", "abort"}, outcomes
    # the router's adaptive split ran: some requests were prefilled on their decode worker
    assert sum(r.prefilled_on_decode for r in results) > 0


def test_one_seed_replays_exactly():
    for seed in (3, 11):
        a, b = run_seed(seed), run_seed(seed)
        assert a.schedule == b.schedule and a.outcomes == b.outcomes
        assert a.sim_seconds == b.sim_seconds   # every timer fired at the same simulated instant


REPLAY = """
import sys
from kvrelay.sim.run import SimConfig, run_seed
for arg in sys.argv[1:]:
    seed, max_n = map(int, arg.split(":"))
    r = run_seed(seed, SimConfig(max_n=max_n))
    print(arg, repr(r.sim_seconds), sorted(r.outcomes.items()), r.violation, flush=True)
"""
# seed:max_n. 57, 171 and 318 crash a decode worker while it has several legs open: the
# order in which the crash resets them (once a set of objects, iterated by address) decides
# which retry draws which room id, and so every later step.
REPLAYED = ["57:1", "171:1", "318:1", "57:4", "5:4"]


def test_one_seed_replays_exactly_in_another_process():
    """Nothing a seed does may depend on the process it runs in: objects' addresses (the
    order of a set of objects, of asyncio.all_tasks) and strings' hashes (PYTHONHASHSEED)
    differ from one process to the next. Two fresh processes, each seed twice in each."""
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", REPLAY, *REPLAYED, *REPLAYED], cwd=root, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONHASHSEED": hash_seed})
             for hash_seed in ("1", "2")]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    runs: dict[str, set[str]] = {}
    for line in (line for out in outs for line in out.splitlines()):
        runs.setdefault(line.split()[0], set()).add(line)
    assert sorted(runs) == sorted(REPLAYED) and sum(map(len, runs.values())) == len(REPLAYED), \
        [sorted(lines) for lines in runs.values() if len(lines) > 1]


def test_a_given_schedule_replaces_the_drawn_one(capsys):
    drawn = run_seed(5).schedule
    assert drawn, "seed 5 draws faults"
    only_first = drawn[:1]
    r = run_seed(5, schedule=only_first)
    assert r.schedule == only_first and r.ok
    assert fl.from_json(fl.to_json(drawn)) == drawn
    cmd = replay_command(5, SimConfig(), only_first)
    assert cmd.startswith("python -m kvrelay.sim --seeds 5-5 --schedule ")
    assert main(["--seeds", "5-5", "--schedule", fl.to_json(only_first)]) == 0
    assert "1 seeds (1P2D, 20 requests each)" in capsys.readouterr().out


def test_a_violation_crosses_process_boundaries():
    """--jobs sends results back from worker processes: a failing seed must arrive as one."""
    v = pickle.loads(pickle.dumps(Violation("no-late-write", "bytes of room 1 land in page 0")))
    assert (v.invariant, v.detail) == ("no-late-write", "bytes of room 1 land in page 0")


def test_seed_ranges():
    assert parse_seeds("3") == range(3) and parse_seeds("5-7") == range(5, 8)
