"""The per-request state machines of both sides: phases, transition tables, deadlines,
reasons. Pure Python on an injectable clock.

Invariants:
- A live room is in exactly one non-terminal phase; every move is checked against the
  side's transition table; terminal phases come last in each enum.
- Every non-terminal phase has a deadline (None only where the table says the phase is
  bounded by compute), set on entry from LifecycleConfig; `expired()` scans EVERY live room.
- Ending a room removes it from the live table and emits exactly one TerminalEvent.
"""
from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

from kvrelay.core import mutation
from kvrelay.core.clock import Clock
from kvrelay.core.config import LifecycleConfig


class PPhase(enum.IntEnum):
    BOOTSTRAP = 0   # waiting for D's destination
    QUEUED = 1      # destination known, waiting for compute
    PREFILL = 2     # forward pass running
    TRANSFER = 3    # KV + aux handed to the backend ("inflight"), waiting for D's ack
    DONE = 4
    FAILED = 5
    ABORTED = 6


class DPhase(enum.IntEnum):
    BOOTSTRAP = 0   # learning P's endpoint, reserving pages
    WAITING = 1     # destination sent, waiting for KV + aux
    DECODE = 2      # in the engine: decoding (a room prefilled here enters at DECODE: NO_PEER)
    DONE = 3
    FAILED = 4
    ABORTED = 5


NO_PEER = ""   # a room's peer when it has none: a decode room whose prompt its own engine prefills


def _table(chain, done, failed, aborted) -> dict:
    """Each phase may move to the next in `chain`; every non-terminal phase may end
    failed or aborted; the last chain phase ends done."""
    t = {p: {failed, aborted} for p in chain}
    for a, b in zip(chain, chain[1:]):
        t[a].add(b)
    t[chain[-1]].add(done)
    return t


P_TRANSITIONS = _table([PPhase.BOOTSTRAP, PPhase.QUEUED, PPhase.PREFILL, PPhase.TRANSFER],
                       PPhase.DONE, PPhase.FAILED, PPhase.ABORTED)
D_TRANSITIONS = _table([DPhase.BOOTSTRAP, DPhase.WAITING, DPhase.DECODE],
                       DPhase.DONE, DPhase.FAILED, DPhase.ABORTED)


def p_deadlines(cfg: LifecycleConfig) -> dict:
    transfer: float | None = cfg.transfer_timeout
    if mutation.on("poll_ignores_abort"):  # the seeds' bug: the transfer phase has no deadline
        transfer = None
    return {PPhase.BOOTSTRAP: cfg.bootstrap_timeout, PPhase.QUEUED: cfg.queue_timeout,
            PPhase.PREFILL: None, PPhase.TRANSFER: transfer}


def d_deadlines(cfg: LifecycleConfig) -> dict:
    return {DPhase.BOOTSTRAP: cfg.bootstrap_timeout, DPhase.WAITING: cfg.waiting_timeout,
            DPhase.DECODE: cfg.max_request_time}


class Reason(str, enum.Enum):
    ABORTED = "aborted"
    PEER_FAILED = "peer_failed"
    TRANSFER_ERROR = "transfer_error"
    OVERLOADED = "overloaded"
    INVALID_REQUEST = "invalid_request"


def timeout(phase: enum.Enum) -> str:
    return f"timeout:{phase_name(phase)}"


def phase_name(phase: enum.Enum) -> str:
    return phase.name.lower()


class TransitionError(RuntimeError):
    pass


@dataclass
class Room:
    room: int
    rid: str
    phase: enum.IntEnum
    created: float
    entered: float
    deadline: float | None
    peer: str | None = None
    peer_incarnation: str | None = None
    peer_known_seq: int | None = None  # a peer heartbeat with a higher seq must list this room
    data: Any = None   # the side's own per-room state (prefill_side.PrefillRoom, decode_side.DecodeRoom)


@dataclass(frozen=True)
class TerminalEvent:
    side: str          # "prefill" | "decode"
    room: int
    rid: str
    phase: str         # done | failed | aborted
    from_phase: str    # the phase it was in when it ended
    reason: str | None  # None for done
    detail: str
    age: float


class Lifecycle:
    """The live rooms of one side, their phases and deadlines."""

    def __init__(self, side: str, phases: type[enum.IntEnum], transitions: dict, deadlines: dict,
                 clock: Clock, on_terminal: Callable[[TerminalEvent], None] | None = None) -> None:
        self.side, self.phases, self.transitions = side, phases, transitions
        self.deadlines, self.clock, self.on_terminal = deadlines, clock, on_terminal
        self.first = next(iter(phases))
        self.rooms: dict[int, Room] = {}
        self.events: deque[TerminalEvent] = deque(maxlen=10_000)
        self.terminal_counts: Counter = Counter()  # (phase, reason) -> n
        self.on_leave: Callable[[str, float], None] | None = None  # (phase left, seconds in it)

    def add(self, room: int, rid: str, peer: str | None = None, phase=None, data: Any = None) -> Room:
        """`phase`: where the room enters (default the first); a room with no peer may
        enter later in the chain (the decode room prefilled here enters at DECODE).
        `data`: the side's own state of the room (`Room.data`)."""
        if room in self.rooms:
            raise ValueError(f"room {room} is already live on the {self.side} side")
        phase = self.first if phase is None else phase
        if phase not in self.transitions or (phase != self.first and peer != NO_PEER):
            raise TransitionError(f"{self.side} room {room} cannot enter at {phase_name(phase)}")
        now = self.clock.now()
        r = Room(room, rid, phase, now, now, self._deadline(phase, now), peer, data=data)
        self.rooms[room] = r
        return r

    def _deadline(self, phase, now: float) -> float | None:
        limit = self.deadlines.get(phase)
        return None if limit is None else now + limit

    def move(self, room: int, phase) -> Room:
        r = self.rooms[room]
        if phase not in self.transitions.get(r.phase, ()):
            raise TransitionError(f"{self.side} room {room}: {phase_name(r.phase)} -> {phase_name(phase)}")
        now = self.clock.now()
        self._left(r, now)
        r.phase, r.entered, r.deadline = phase, now, self._deadline(phase, now)
        return r

    def _left(self, r: Room, now: float) -> None:
        if self.on_leave is not None:
            self.on_leave(phase_name(r.phase), now - r.entered)

    def end(self, room: int, phase, reason: str | None = None, detail: str = "") -> TerminalEvent:
        r = self.rooms[room]
        if phase not in self.transitions.get(r.phase, ()):
            raise TransitionError(f"{self.side} room {room}: {phase_name(r.phase)} -> {phase_name(phase)}")
        del self.rooms[room]
        self._left(r, self.clock.now())
        ev = TerminalEvent(self.side, room, r.rid, phase_name(phase), phase_name(r.phase),
                           reason, detail, self.clock.now() - r.created)
        self.events.append(ev)
        self.terminal_counts[(ev.phase, reason)] += 1
        if self.on_terminal is not None:
            self.on_terminal(ev)
        return ev

    def expired(self) -> list[Room]:
        """Every live room past its phase deadline (the watchdog's input)."""
        now = self.clock.now()
        return [r for r in self.rooms.values() if r.deadline is not None and now >= r.deadline]

    def phase_counts(self) -> dict[str, int]:
        counts = {phase_name(p): 0 for p in self.phases if p in self.transitions}
        for r in self.rooms.values():
            counts[phase_name(r.phase)] += 1
        return counts

    def oldest_age(self) -> float:
        now = self.clock.now()
        return max((now - r.created for r in self.rooms.values()), default=0.0)

    def row(self, r: Room, backend: str) -> dict:
        now = self.clock.now()
        return {"side": self.side, "room": r.room, "rid": r.rid, "phase": phase_name(r.phase),
                "age": round(now - r.created, 3), "in_phase": round(now - r.entered, 3),
                "deadline_in": None if r.deadline is None else round(r.deadline - now, 3),
                "peer": r.peer, "backend": backend}
