"""`python -m kvrelay.sim` (and `make sim`): run many seeds, shrink and print any failure.

    python -m kvrelay.sim --seeds 1000            # seeds 0..999
    python -m kvrelay.sim --seeds 5000-5999 --jobs 2
    python -m kvrelay.sim --seeds 17 --schedule '[...]'   # replay one (shrunk) schedule

Exit status 1 if any seed violates an invariant. For each failing seed it prints the
violation, the schedule shrunk to the faults it needs (`shrink`), and the command that
replays it.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

from kvrelay.sim import faults as fl
from kvrelay.sim.run import Result, SimConfig, run_seed


def parse_seeds(text: str) -> range:
    """'N' is seeds 0..N-1; 'A-B' is A..B inclusive."""
    a, sep, b = text.partition("-")
    try:
        return range(int(a), int(b) + 1) if sep else range(int(a))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: give a count (1000) or a range (0-999)") from None


def shrink(seed: int, cfg: SimConfig, schedule: list[fl.Fault], invariant: str) -> tuple[list[fl.Fault], int]:
    """Remove one fault at a time while the run still breaks `invariant`; returns the
    smallest schedule found and the runs it took. Deterministic: same input, same output."""
    current, runs, changed = list(schedule), 0, True
    while changed and current:
        changed = False
        for i in range(len(current)):
            trial = current[:i] + current[i + 1:]
            runs += 1
            r = run_seed(seed, cfg, trial)
            if not r.ok and r.violation.invariant == invariant:
                current, changed = trial, True
                break
    return current, runs


def _batch(args: tuple[list[int], dict]) -> list[Result]:
    seeds, cfg = args
    return [run_seed(s, SimConfig(**cfg)) for s in seeds]


def replay_command(seed: int, cfg: SimConfig, schedule: list[fl.Fault]) -> str:
    base = SimConfig()
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in asdict(cfg).items() if getattr(base, k) != v)
    return f"python -m kvrelay.sim --seeds {seed}-{seed}{flags} --schedule {shlex.quote(fl.to_json(schedule))}"


def report_failure(r: Result, cfg: SimConfig, do_shrink: bool) -> None:
    print(f"\nseed {r.seed}: {r.violation}")
    schedule = r.schedule
    if do_shrink and schedule:
        schedule, runs = shrink(r.seed, cfg, schedule, r.violation.invariant)
        print(f"  shrunk from {len(r.schedule)} to {len(schedule)} faults in {runs} runs:")
    else:
        print(f"  schedule ({len(schedule)} faults):")
    for f in schedule:
        print(f"    {f.describe()}")
    print(f"  replay: {replay_command(r.seed, cfg, schedule)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvrelay.sim", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("100"))
    ap.add_argument("--prefill", dest="num_prefill", type=int, default=SimConfig.num_prefill)
    ap.add_argument("--decode", dest="num_decode", type=int, default=SimConfig.num_decode)
    ap.add_argument("--requests", type=int, default=SimConfig.requests)
    ap.add_argument("--max-n", type=int, default=SimConfig.max_n,
                    help="some requests ask for 2..MAX_N choices (n), drawn per seed (1: none)")
    ap.add_argument("--split", type=int, choices=(0, 1), default=SimConfig.split,
                    help="1: draw the router's adaptive P/D split (--decode-prefill-ttft) per seed; 0: keep it "
                         "off (replays a schedule recorded before the split existed)")
    ap.add_argument("--schedule", help="replay this fault schedule (JSON, as printed) instead of drawing one")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--num-prefill", dest="num_prefill", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--num-decode", dest="num_decode", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = SimConfig(num_prefill=args.num_prefill, num_decode=args.num_decode, requests=args.requests,
                    max_n=args.max_n, split=args.split)
    seeds = list(args.seeds)
    t0 = time.perf_counter()
    if args.schedule is not None:
        results = [run_seed(s, cfg, fl.from_json(args.schedule)) for s in seeds]
    elif args.jobs > 1:
        chunks = [seeds[i:i + 50] for i in range(0, len(seeds), 50)]
        with ProcessPoolExecutor(args.jobs) as pool:
            results = [r for batch in pool.map(_batch, [(c, asdict(cfg)) for c in chunks]) for r in batch]
    else:
        results = [run_seed(s, cfg) for s in seeds]
    elapsed = time.perf_counter() - t0
    failed = [r for r in results if not r.ok]
    outcomes: dict[str, int] = {}
    for r in results:
        for k, v in r.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + v
    print(f"{len(results)} seeds ({cfg.num_prefill}P{cfg.num_decode}D, {cfg.requests} requests each"
          f"{f', n up to {cfg.max_n}' if cfg.max_n > 1 else ''}) in "
          f"{elapsed:.1f} s: {len(results) / elapsed:.1f} seeds/s; {len(failed)} failed")
    print(f"client outcomes: {json.dumps(dict(sorted(outcomes.items())))}")
    for r in failed[:5]:
        report_failure(r, cfg, not args.no_shrink)
    if len(failed) > 5:
        print(f"\n... and {len(failed) - 5} more failing seeds: {[r.seed for r in failed[5:30]]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
