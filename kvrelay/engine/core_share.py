"""The cores of one host, shared by the engines on it (`--core-share FILE:SLOT`).

`kvrelay serve` runs a prefill and a decode worker on one host. A fixed split (cores /
workers) leaves the prefill worker on one core of two while the decode worker idles, and
the other way round. With a share, each engine posts in FILE, before every step with work
and before the first without, whether it has work, and runs the step on its part of the
host's cores: the cores split evenly among the engines that have work; the cores left over
(fewer than those engines) go to the ones with the most queued compute (prompt tokens not
yet computed, then slot order). An engine with no work runs on all the cores the others
leave: it has nothing to run, and its next step with work posts first.

Prefill first, as a colocated engine's scheduler orders its own steps: an engine whose
next step has only decodes (no prompt tokens to compute) yields while another engine
posts prompt tokens to compute, so that one computes its prompt on all the cores. It
yields for the steps under way when it began (each post marks one step), then runs one step
before it may yield again, so a stream of prompts slows its decodes and never stops them.
That one step runs alone: an engine about to compute a prompt first posts it as pending
(no work yet), and waits, for at most PREFILL_WAIT seconds, while another engine is in a
step of decodes or is owed one (it has yielded since before this prompt's post, and no
other engine computes a prompt it would still yield to). The owed
engine then steps on every core and yields again, to the pending prompt. A step of decodes
beside a prompt's pass costs the pass more than its own time: the two run on three threads
over two cores, and the prompt's threads wait for each other (a yield cut every second lost
0.15-0.25 s of a 1,700-token prompt's 4.5 s, avx2 Zen 2). YIELD_MAX bounds a yield whatever
the others post (a step that hangs). A yielding engine posts no work and keeps running its
loop (its commands, its lifecycle's messages): only its forward pass waits.

Waiting engines sleep on a datagram socket of their slot (an abstract Unix address named
after FILE and the slot), which every post that changes what the others wait on pokes: a
yielding engine takes its step as soon as the prompt's step ends, and wakes every
YIELD_POLL otherwise (for its loop), not every few milliseconds: each wake-up takes a core
from a prompt's threads in the middle of a parallel region. A datagram's bytes are never
read: whoever sends one (any local process can) only wakes a waiter early, which then
reads the file as at any wake-up.

Invariants:
- Every engine runs on at least one thread, and the engines that posted work run on at most
  `cores` threads together, less the cores other processes keep busy (`host_load`; never
  below one thread each), counted from what each read before its own step; an engine in
  the middle of a step keeps its count until the step ends (at most one step late), but
  for a prefill pass, which re-reads it between layers (`EngineCore._between_layers`, at
  most every MID_STEP_PERIOD; posting nothing).
- A slot counts only while its process lives and runs: a dead, stopped (SIGSTOP, a
  debugger) or silent-for-STALE-seconds engine holds no cores.
- The file is advisory: a torn or stale read changes a thread count, never a result.
  Nothing here runs torch; `CoreShare.threads()` returns the count, the engine thread sets it.

File layout: SLOTS slots of five float64 values: pid, has work (0/1), queued compute
(prompt tokens not yet computed), posted at (time.monotonic(), one clock for every process
of the host), yielding since (the same clock; 0 when it does not yield).
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

from kvrelay.core.config import CORE_SHARE_SLOTS, core_share_spec
from kvrelay.engine.host_load import OtherLoad, stat_fields

SLOTS = CORE_SHARE_SLOTS
FIELDS = 5
SLOT_BYTES = FIELDS * 8
MAX_PID = 2 ** 22   # Linux's pid_max limit
STALE = 60.0   # seconds: a post older than this is an engine that no longer steps (no step lasts this long)
# seconds: the longest a decode-only engine waits for another's prompt step before one
# step of its own; above a prefill worker's longest planned step (3 s, 6 s with its stretch)
YIELD_MAX = 8.0
YIELD_POLL = 0.02    # seconds: the longest a waiting engine sleeps before it reads the file again
PREFILL_WAIT = 0.25  # seconds: the longest a prompt's step waits for another engine's decode step
IDLE_REFRESH = 0.5   # seconds: how often an idle engine below every core re-reads its share


@dataclass(frozen=True)
class Post:
    busy: bool
    queued: float = 0.0   # prompt tokens not yet computed: the remainder's tie-break (not busy: a pending prompt)
    at: float = 0.0       # when it was posted: one post per step, so it names the step
    yielding: float = 0.0   # since when its decodes yield to others' prompts (0: they do not)
    pid: int = 0


def share(me: int, posts: dict[int, Post], cores: int, taken: int = 0) -> int:
    """Threads for slot `me` (which has posted) out of `cores`, given every live slot's post;
    the engines with work split the cores other processes leave (`taken`: those they keep
    busy, `host_load`)."""
    busy = sorted((s for s, p in posts.items() if p.busy), key=lambda s: (-posts[s].queued, s))
    if me not in busy:
        return max(1, cores - len(busy))
    base, extra = divmod(max(1, cores - taken), len(busy))
    return max(1, base + (1 if busy.index(me) < extra else 0))


def prompt_steps(me: int, posts: dict[int, Post]) -> frozenset[tuple[int, float]]:
    """The other slots' steps under way (or pending) that compute a prompt, as (slot,
    posted at): slot `me`, with decode work only, leaves its step to them."""
    return frozenset((s, p.at) for s, p in posts.items() if s != me and p.queued > 0)


def owed(me: int, posts: dict[int, Post], at: float) -> bool:
    """Whether another slot yields since before `at` (slot `me`'s pending prompt): it
    yielded to an earlier prompt step, which has ended, and is owed one step. Not while
    another slot computes a prompt: the yielding one waits for that step anyway."""
    others = [p for s, p in posts.items() if s != me]
    return any(0.0 < p.yielding < at for p in others) and not any(p.busy and p.queued > 0 for p in others)


def decoding(me: int, posts: dict[int, Post]) -> bool:
    """Whether another slot is in a step of decodes only (busy, no prompt to compute)."""
    return any(p.busy and p.queued <= 0 for s, p in posts.items() if s != me)


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _runs(pid: int) -> bool:
    """The process exists and is not stopped (or traced)."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in (b"T", b"t", b"Z", b"X")


def wake_address(path: str, slot: int) -> bytes:
    """The abstract Unix address a waiting engine at `slot` of share file `path` sleeps on."""
    digest = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:24]
    return f"\0kvrelay-cores-{digest}-{slot}".encode()


class CoreShare:
    """One engine's slot in a share file (created, zeroed, on first use). `sleep` replaces
    the wait on the slot's socket (tests, with `clock`)."""

    def __init__(self, path: str, slot: int, cores: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic, pid: int | None = None,
                 alive: Callable[[int], bool] = _runs, sleep: Callable[[float], None] | None = None) -> None:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core share slot {slot} is outside 0..{SLOTS - 1}")
        self.path, self.slot = path, slot
        self.cores = cores or host_cores()
        self._clock, self._pid, self._alive = clock, pid or os.getpid(), alive
        self.other_load: OtherLoad | None = None   # cores other processes keep busy (None: not counted)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SLOTS * SLOT_BYTES:
                os.ftruncate(fd, SLOTS * SLOT_BYTES)   # zero-filled: every slot empty
            self._map = mmap.mmap(fd, SLOTS * SLOT_BYTES)
        finally:
            os.close(fd)
        self._table = memoryview(self._map).cast("d")
        self._yielding_since: float | None = None
        self._yielding_for: frozenset[tuple[int, float]] = frozenset()   # the prompt steps it yields to
        self._last: tuple[bool, bool, bool] | None = None   # what its last post told the others
        self._peers = [wake_address(path, s) for s in range(SLOTS)]
        self._sock = self._bind() if sleep is None else None
        self._sleep = sleep if sleep is not None else self._sleep_until_poked

    def _bind(self) -> socket.socket | None:
        """The slot's wake socket; None where it cannot be had (the address is taken by a
        stopped engine of this slot, or no abstract Unix sockets): its waits then sleep."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(self._peers[self.slot])
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        return sock

    @classmethod
    def from_spec(cls, spec: str, leave_busy_cores: bool = True) -> "CoreShare":
        """The slot `spec` names; with `leave_busy_cores`, the engines split only the cores
        that processes other than those posting in the file leave (`host_load.OtherLoad`)."""
        path, slot = core_share_spec(spec)
        cs = cls(path, slot)
        if leave_busy_cores:
            cs.other_load = OtherLoad(lambda: {p.pid for p in cs.posts().values()} | {cs._pid})
        return cs

    def post(self, busy: bool, queued: float = 0.0, *, at: float | None = None, yielding: float = 0.0) -> float:
        """Post this slot's next step; returns its posted-at (`at` keeps a pending prompt's
        step the same step once it computes). Pokes the other slots when it starts a step
        or changes what they wait on."""
        base = self.slot * FIELDS
        at = self._clock() if at is None else at
        self._table[base + 3] = at
        self._table[base + 1] = float(busy)
        self._table[base + 2] = float(queued)
        self._table[base + 4] = float(yielding)
        self._table[base] = float(self._pid)
        state = (busy, queued > 0, yielding > 0)
        if busy or state != self._last:
            self._poke_others()
        self._last = state
        return at

    def _poke_others(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for s in range(SLOTS):
            if s != self.slot and self._table[s * FIELDS] > 0:
                try:
                    sock.sendto(b"!", self._peers[s])
                except OSError:   # nobody there, or its queue is full (it wakes anyway)
                    pass

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, less when another slot posts something new."""
        self._sleep(seconds)

    def _sleep_until_poked(self, seconds: float) -> None:
        sock = self._sock
        if sock is None:
            time.sleep(seconds)
            return
        try:
            sock.settimeout(seconds)
            sock.recv(16)
        except OSError:   # TimeoutError included
            pass
        sock.setblocking(False)
        while True:   # every poke so far is answered by the read that follows
            try:
                sock.recv(16)
            except OSError:
                return

    def posts(self) -> dict[int, Post]:
        """Every live slot's post (this one's as posted)."""
        now, out = self._clock(), {}
        for s in range(SLOTS):
            pid, busy, queued, at, yielding = self._table[s * FIELDS:(s + 1) * FIELDS]
            if not (0 < pid <= MAX_PID and 0 <= queued < 1e18 and abs(at) < 1e18
                    and 0 <= yielding < 1e18):   # NaN fails every test
                continue   # empty, or not written by an engine: counts for nothing
            if s != self.slot and (now - at > STALE or not self._alive(int(pid))):
                continue
            out[s] = Post(busy > 0.5, queued, at, yielding, int(pid))
        return out

    def threads(self, busy: bool, queued: float = 0.0) -> int:
        """Post, then the threads this engine's next step runs on. With prompt tokens
        `queued`, the prompt is first posted pending, and waits (YIELD_POLL at a time,
        PREFILL_WAIT at most) while another engine is in a step of decodes only or is owed
        one: that engine yields to the prompt once its step ends."""
        if not (busy and queued > 0):
            self.post(busy, queued)
            return self.current_threads()
        at = self.post(False, queued)
        posts, started = self.posts(), self._clock()
        for _ in range(math.ceil(PREFILL_WAIT / YIELD_POLL)):   # bounded even by a clock that stands still
            left = PREFILL_WAIT - (self._clock() - started)
            if left <= 0 or not (decoding(self.slot, posts) or owed(self.slot, posts, at)):
                break
            self._sleep(min(YIELD_POLL, left))
            posts = self.posts()
        self.post(True, queued, at=at)
        return self.current_threads()

    def sample_load(self) -> None:
        """Keep the estimate of other processes' load current while this engine idles (the
        estimate samples at most every `host_load.SAMPLE_PERIOD`)."""
        if self.other_load is not None:
            self.other_load.cores_taken()

    def current_threads(self) -> int:
        """The threads of this engine, as it last posted, from the posts now (posts nothing)."""
        taken = self.other_load.cores_taken() if self.other_load is not None else 0
        return share(self.slot, self.posts(), self.cores, taken)

    def should_yield(self, decodes_only: bool) -> bool:
        """Before a step: True if this engine, whose work is `decodes_only`, should skip
        this step for a prompt elsewhere (it then posts no work). A run of Trues lasts while
        one of the prompt steps under way at its first True still runs, and at most
        YIELD_MAX seconds; then False once, whatever the others post."""
        if decodes_only:
            now = self._clock()
            since = self._yielding_since
            steps = prompt_steps(self.slot, self.posts())
            if since is None:
                self._yielding_for = steps
            if steps & self._yielding_for and (since is None or now - since < YIELD_MAX):
                self._yielding_since = now if since is None else since
                self.post(False, yielding=self._yielding_since)
                return True
        self._yielding_since = None   # the steps it yielded to ended (or it yielded YIELD_MAX): one step
        return False

    def leave(self) -> None:
        """Empty this slot (the engine stops)."""
        self._table[self.slot * FIELDS] = 0.0

    def close(self) -> None:
        self.leave()
        if self._sock is not None:
            self._sock.close()
        self._table.release()
        self._map.close()

