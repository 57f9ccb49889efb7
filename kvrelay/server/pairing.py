"""The router's table of workers and its choice of a (prefill, decode) pair per request.

Pure Python over URLs and counters: no I/O, no asyncio; time comes from a `Clock`. The
router feeds it health results and leg counts; it answers `pick_pair()`.

Invariants:
- Only workers marked up are candidates. A worker is up from a good health check until
  the first definite failure (a refused connection, a broken stream, a wrong role, model
  or key); one is enough, and the next good check brings it back ("rejoins"). A check
  that only timed out makes it `slow`: still up, picked only when its role has no other.
- Each worker is held under a lease: one that answered no health check for `lease`
  seconds is dead (`expire_leases`), once per lease: the router fails every leg it has
  open there. Only a good check starts a new lease; it never revives a failed leg. The
  seconds count the router's own looking: its loop's stalls (`core.stall`) are not the
  worker's silence.
- `outstanding` counts the legs the router has open on a worker: `leg_started` and
  `leg_ended` come in pairs, so it is never negative and is 0 when the router is idle.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvrelay.core import mutation
from kvrelay.core.clock import Clock
from kvrelay.core.stall import StallWatch
from kvrelay.server.worker_protocol import WorkerHealth

ROLES = ("prefill", "decode")


class Change(enum.Enum):
    """What a health result changed about a worker (for the router's log)."""
    JOINED = "joined"          # first good check ever
    REJOINED = "rejoined"      # down, now up again, same process
    RESTARTED = "restarted"    # a new incarnation: the process was restarted
    WENT_DOWN = "went_down"    # was up, now down
    SLOW = "slow"              # up, but its last check timed out
    DIED = "died"              # its lease expired: no good check for `lease` seconds


@dataclass
class Worker:
    url: str
    role: str
    up: bool = False
    health: WorkerHealth | None = None   # the last good health report
    outstanding: int = 0                 # legs the router has open on it
    failures: int = 0                    # consecutive failures since the last good check
    last_error: str | None = None
    since: float = 0.0                   # clock time of the last up/down change
    last_ok: float | None = None         # clock time of the last good check or leg output (None: never)
    dead: bool = False                   # its lease expired; cleared by the next good check
    slow: bool = False                   # up, but its last check timed out; cleared by a good one
    sent_tokens: int = 0                 # prompt tokens of legs started here since the last good check

    @property
    def queue_depth(self) -> int:
        """Requests waiting on this worker: what it reported plus what the router sent
        since (the report is up to one health interval old)."""
        return (self.health.queued_requests if self.health else 0) + self.outstanding

    @property
    def free_pages(self) -> int:
        return self.health.free_pages if self.health else 0

    def predicted_wait(self, prompt_tokens: int = 0, per_token: float | None = None) -> float | None:
        """Seconds until a prompt of `prompt_tokens` sent here now is prefilled: the prompt
        tokens the worker reported queued, those sent since its report, and this one, at
        its measured seconds per prompt token, else at `per_token`. None if neither is known."""
        own = self.health.prefill_s_per_token if self.health else None
        rate = own if own is not None else per_token
        if rate is None:
            return None
        queued = self.health.queued_prompt_tokens if self.health else 0
        return (queued + self.sent_tokens + prompt_tokens) * rate

    def load_key(self) -> tuple[float, ...]:
        """Smaller is better. A decode worker must also hold the request's KV, so among
        equal queues the one with more free pages wins. A prefill worker's first token
        comes soonest where the least prompt work waits (unmeasured: none)."""
        if self.role == "decode":
            return (self.queue_depth, -self.free_pages)
        return (self.predicted_wait() or 0.0, self.queue_depth)


@dataclass(frozen=True)
class Pair:
    """Where a request runs. `prefill` None: the decode worker prefills it too (no transfer)."""
    prefill: Worker | None
    decode: Worker

    @property
    def urls(self) -> frozenset[str]:
        return frozenset(w.url for w in (self.prefill, self.decode) if w is not None)

    @property
    def prefill_url(self) -> str:
        """The worker that computes the prompt."""
        return (self.prefill or self.decode).url


def split(pair: Pair, prompt_tokens: int, limit: float) -> Pair:
    """The adaptive P/D split (--decode-prefill-ttft `limit`; 0: off): a request whose first
    token the prefill worker predicts later than `limit` is prefilled on its decode worker
    instead, when that one predicts it sooner (at its own measured rate, else P's). The
    decode worker pays with its batch's decode steps while it prefills, so it takes only
    what P would serve late."""
    if limit <= 0 or pair.prefill is None:
        return pair
    at_p = pair.prefill.predicted_wait(prompt_tokens)
    if at_p is None or at_p <= limit:
        return pair
    at_d = pair.decode.predicted_wait(prompt_tokens, pair.prefill.health.prefill_s_per_token)
    if at_d is None or at_d >= at_p:
        return pair
    return Pair(None, pair.decode)


@dataclass(frozen=True)
class NoPair:
    """No pair can be formed; `message` says which role has no healthy worker."""
    message: str


class WorkerTable:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], clock: Clock) -> None:
        """Raises ValueError if a role has no URL or a URL is listed twice."""
        self.clock = clock
        self._by_role: dict[str, list[Worker]] = {"prefill": [], "decode": []}
        self._workers: dict[str, Worker] = {}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            if not urls:
                raise ValueError(f"no {role} worker URL given")
            for url in urls:
                if url in self._workers:
                    raise ValueError(f"worker URL {url} is listed twice")
                self._workers[url] = Worker(url, role, since=clock.now())
                self._by_role[role].append(self._workers[url])
        # Round robin among equally loaded workers: the next pick starts after the last one.
        self._cursor = {role: 0 for role in ROLES}

    # -- the table -----------------------------------------------------------------------
    def urls(self) -> list[str]:
        return list(self._workers)

    def get(self, url: str) -> Worker:
        return self._workers[url]

    def workers(self, role: str) -> list[Worker]:
        return list(self._by_role[role])

    def up(self, role: str) -> list[Worker]:
        return [w for w in self._by_role[role] if w.up]

    def rows(self) -> list[dict]:
        """One row per worker, for `GET /workers`."""
        now = self.clock.now()
        return [{"url": w.url, "role": w.role, "up": w.up, "dead": w.dead, "slow": w.slow,
                 "for_s": round(now - w.since, 3),
                 "last_ok_s": None if w.last_ok is None else round(now - w.last_ok, 3),
                 "outstanding": w.outstanding, "failures": w.failures, "last_error": w.last_error,
                 "health": w.health.model_dump() if w.health else None} for w in self._workers.values()]

    def health_view(self) -> dict:
        """The body of the router's /health. "status": "ok" while every worker is up;
        "degraded" while some are down but each role has an up worker (requests are
        served); "unavailable" while a role has none (requests get no_healthy_worker).
        "down" (unless ok), in table order: each worker not up, with its last error as
        "why" and the seconds since it went down (or since the table began) as "since_s"."""
        now = self.clock.now()
        down = [{"url": w.url, "role": w.role, "why": w.last_error or "not checked yet",
                 "since_s": round(now - w.since, 3)} for w in self._workers.values() if not w.up]
        if not down:
            return {"status": "ok"}
        served = all(self.up(role) for role in ROLES)
        return {"status": "degraded" if served else "unavailable", "down": down}

    # -- health results --------------------------------------------------------------------
    def mark_ok(self, url: str, health: WorkerHealth) -> Change | None:
        """A good health check. Returns what changed, if anything worth logging."""
        w = self._workers[url]
        change = None
        if w.health is None:
            change = Change.JOINED
        elif health.incarnation != w.health.incarnation:
            change = Change.RESTARTED
        elif not w.up:
            change = Change.REJOINED
        now = self.clock.now()
        if not w.up:
            w.up, w.since = True, now
        w.health, w.failures, w.last_error, w.last_ok, w.dead, w.slow = health, 0, None, now, False, False
        w.sent_tokens = 0   # the report counts them (up to the legs still on the way)
        return change

    def progress(self, url: str) -> None:
        """The worker's own word that its loop runs (an output of one of its legs): it
        renews the lease of a worker that is up, and never brings one back."""
        w = self._workers[url]
        if w.up and not w.dead and w.last_ok is not None:
            w.last_ok = self.clock.now()

    def mark_slow(self, url: str, error: str) -> Change | None:
        """A check that timed out. A busy worker answers late, so the worker stays up: it
        is picked only when its role has no worker that answered, until a good check, a
        definite failure (`mark_failed`) or the end of its lease (`expire_leases`)."""
        w = self._workers[url]
        w.failures += 1
        w.last_error = error
        if not w.up or w.slow:
            return None
        w.slow = True
        return Change.SLOW

    def mark_failed(self, url: str, error: str) -> Change | None:
        """A definite failure (refused connection, broken stream, wrong role, model or
        key): the worker is down at once."""
        w = self._workers[url]
        w.failures += 1
        w.last_error = error
        w.slow = False
        if not w.up:
            return None
        w.up, w.since = False, self.clock.now()
        return Change.WENT_DOWN

    def expire_leases(self, lease: float, stalls: StallWatch | None = None) -> list[Worker]:
        """Workers whose lease just expired: no good check for `lease` seconds since the
        last one, less the judge's own `stalls` since. Each is marked down and dead and
        returned once, until a good check."""
        now, died = self.clock.now(), []
        for w in self._workers.values():
            if w.last_ok is None:
                continue
            silent = now - w.last_ok
            if stalls is not None and not mutation.on("judge_counts_own_stall"):
                silent -= stalls.blind(w.last_ok)
            if mutation.on("reaper_stops_at_first_unexpired") and silent < lease:
                break  # vLLM #41383: stops at the first live lease, though workers are not in expiry order
            if w.dead or silent < lease:
                continue
            w.dead = True
            if w.up:
                w.up, w.since = False, now
            blind = f", {now - w.last_ok - silent:.1f} s of the router's own stalls not counted" \
                if silent < now - w.last_ok else ""
            w.last_error = f"no good health check for {silent:.1f} s (lease {lease:g} s{blind})"
            died.append(w)
        return died

    # -- legs ------------------------------------------------------------------------------
    def leg_started(self, url: str, prompt_tokens: int = 0) -> None:
        """`prompt_tokens`: what the leg asks the worker to prefill (0 for a decode leg
        whose prompt a prefill worker computes)."""
        w = self._workers[url]
        w.outstanding += 1
        w.sent_tokens += prompt_tokens

    def leg_ended(self, url: str) -> None:
        w = self._workers[url]
        if w.outstanding == 0:
            raise ValueError(f"leg_ended({url}) without a matching leg_started")
        w.outstanding -= 1

    # -- pairing ---------------------------------------------------------------------------
    def pick_pair(self, exclude: Iterable[str] = ()) -> Pair | NoPair:
        """The least loaded up prefill and decode workers; round robin among equals.
        Workers in `exclude` are used only when their role has no other up worker, and
        slow ones only when their role has no other up worker outside `exclude`."""
        excluded = frozenset(exclude)
        chosen = {}
        for role in ROLES:
            worker = self._pick(role, excluded)
            if worker is None:
                return NoPair(f"no healthy {role} worker ({self.down_reasons(role)})")
            chosen[role] = worker
        for role, worker in chosen.items():
            self._cursor[role] = self._by_role[role].index(worker) + 1
        return Pair(chosen["prefill"], chosen["decode"])

    def _pick(self, role: str, excluded: frozenset[str]) -> Worker | None:
        up = self.up(role)
        if not up:
            return None
        tier = min((w.url in excluded, w.slow) for w in up)
        candidates = [w for w in up if (w.url in excluded, w.slow) == tier]
        best = min(w.load_key() for w in candidates)
        tied = [w for w in candidates if w.load_key() == best]
        workers, start = self._by_role[role], self._cursor[role]
        return min(tied, key=lambda w: (workers.index(w) - start) % len(workers))

    def down_reasons(self, role: str) -> str:
        return "; ".join(f"{w.url}: {w.last_error or 'not checked yet'}" for w in self._by_role[role])
