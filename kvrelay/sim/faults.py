"""The fault schedule of one simulated run, drawn from its seed.

A schedule is a list of `Fault`s, each applied at a simulated time (seconds after the
cluster is up) and, where it has one, undone `duration` seconds later. It round-trips
through JSON, so a shrunk schedule can be printed and replayed (`--schedule`).

    link        P<->D link faults for a while: drop, dup, reorder, extra delay
    partition   nothing crosses one P<->D link for a while
    http_cut    the router cannot reach a worker for a while (calls hang, then time out)
    freeze      a worker stops iterating for a while (SIGSTOP), below or above its leases
    crash       a worker loses everything; it restarts (a new incarnation) after `duration`
    slow        a worker's steps cost `factor` times more for a while
    transfer    a prefill worker's writes hang or fail (fault spec) for a while
    clock_jump  simulated time leaps forward (a paused VM), up to a few seconds
    abort       the client of request `target` aborts it
    disconnect  the client of request `target` leaves after `count` outputs (at `at` if none came)
    stall       the router's event loop stands still for a while (a long synchronous call in
                it): the judge of every worker's lease is blind, and no worker is at fault
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

KINDS = ("link", "partition", "http_cut", "freeze", "crash", "slow", "transfer", "clock_jump", "abort",
         "disconnect", "stall")
ROUTER = "router"   # the target of a stall


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    target: str = ""                 # a worker name, a link "P>D", or a request id
    duration: float = 0.0
    params: dict = field(default_factory=dict, hash=False)

    def describe(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        span = f" for {self.duration:.2f}s" if self.duration else ""
        return f"{self.at:.2f}s {self.kind} {self.target}{span}{(' ' + extra) if extra else ''}"


def to_json(faults: list[Fault]) -> str:
    return json.dumps([asdict(f) for f in faults], separators=(",", ":"))


def from_json(text: str) -> list[Fault]:
    return [Fault(**d) for d in json.loads(text)]


def draw(rng: random.Random, prefill: list[str], decode: list[str], requests: list[str],
         window: float, lease: float, max_faults: int = 4) -> list[Fault]:
    """Up to `max_faults` process/network faults within `window` seconds, plus client
    aborts and disconnects on some requests."""
    workers = prefill + decode
    links = [f"{p}>{d}" for p in prefill for d in decode]
    out: list[Fault] = []
    for _ in range(rng.randint(0, max_faults)):
        kind = rng.choice(KINDS[:8])
        at = round(rng.uniform(0.0, window), 3)
        if kind == "link":
            params = {k: round(rng.choice([0.0, 0.1, 0.3, 0.6]), 2) for k in ("drop", "dup", "reorder")}
            params["delay"] = round(rng.choice([0.0, 0.0, 0.05, 0.5]), 3)
            out.append(Fault(at, kind, rng.choice(links), round(rng.uniform(0.2, 3 * lease), 3), params))
        elif kind == "partition":
            out.append(Fault(at, kind, rng.choice(links), round(rng.uniform(0.1, 3 * lease), 3)))
        elif kind in ("http_cut", "freeze"):
            out.append(Fault(at, kind, rng.choice(workers), round(rng.uniform(0.05, 3 * lease), 3)))
        elif kind == "crash":
            out.append(Fault(at, kind, rng.choice(workers), round(rng.uniform(0.0, 2 * lease), 3)))
        elif kind == "slow":
            out.append(Fault(at, kind, rng.choice(workers), round(rng.uniform(0.2, 3 * lease), 3),
                             {"factor": rng.choice([3, 10, 50])}))
        elif kind == "transfer":
            what = rng.choice(["hang_transfer", "fail_transfer"])
            out.append(Fault(at, kind, rng.choice(prefill), round(rng.uniform(0.1, 2 * lease), 3),
                             {what: rng.choice([0.3, 1.0])}))
        else:
            out.append(Fault(at, kind, "", 0.0, {"seconds": round(rng.uniform(0.01, 3.0), 3)}))
    for rid in requests:
        r = rng.random()
        if r < 0.08:
            out.append(Fault(round(rng.uniform(0.0, window + 1.0), 3), "abort", rid))
        elif r < 0.16:
            out.append(Fault(round(rng.uniform(0.0, window + 1.0), 3), "disconnect", rid, 0.0,
                             {"count": rng.randint(0, 4)}))
    return sorted(out, key=lambda f: (f.at, f.kind, f.target))


def draw_stalls(rng: random.Random, window: float, lease: float) -> list[Fault]:
    """Some seeds' router stalls (from a stream of their own, so that every other draw of a
    seed stays what it was): below and above the router's lease of its workers."""
    if rng.random() >= 0.3:
        return []
    return [Fault(round(rng.uniform(0.0, window), 3), "stall", ROUTER, round(rng.uniform(0.2, 3 * lease), 3))]
