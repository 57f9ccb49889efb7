"""Leases: a room stays alive while its counterpart keeps appearing in the peer's heartbeats.

Rules (lifecycle.md, "Deadlines that never kill a healthy slow request"):
- A peer that has not been heard for `heartbeat_interval * heartbeat_misses` is dead: all
  its rooms fail (peer_failed) and it is forgotten. Any message renews the lease, not only
  heartbeats: a peer that forgot us (declared us dead) re-bootstraps before it beats again.
- A heartbeat with a new incarnation at the same address is a restart: every room paired
  with the old incarnation fails.
- A room fails when a heartbeat newer than the one that last listed it (or newer than the
  point where the peer must know it) no longer lists it: the peer forgot it.
- Heartbeats older than the newest one seen (reordered, duplicated) are ignored entirely.
- A lease counts this worker's own looking, not the wall clock: `step()` and `mid_step()`
  measure the loop's gaps (`core.stall`), and a stall of this loop (a long call, the
  thread off its core, a paused process) is not a peer's silence.
- Progress, not age, bounds a moving transfer: D's heartbeats carry how many KV bytes from
  P have landed in all and per waiting room, and P fails a room in transfer only after
  `heartbeat_misses` heartbeats in a row that show it waiting with no new byte landed
  and, while P's write is still pending, no new byte handed off by P's backend
  (prefill_side; a backend with opaque pending writes leaves those to --transfer-timeout).
  Every message renews the lease, KV data frames included.
`Coordinator` is the machinery both PrefillSide and DecodeSide share: heartbeats out from
`step()`, lease checks in, the watchdog pass, tombstones, debug rows.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvrelay.core import mutation
from kvrelay.core.clock import Clock
from kvrelay.core.config import LifecycleConfig
from kvrelay.core.stall import StallWatch
from kvrelay.disagg import wire
from kvrelay.disagg.lifecycle import Lifecycle, Reason, Room, phase_name, timeout
from kvrelay.disagg.transfer.base import TransferManager


@dataclass
class PeerLease:
    address: str
    incarnation: str | None
    last_heard: float
    last_seq: int = -1
    rooms: dict[int, str] = field(default_factory=dict)  # from the newest heartbeat
    progress: dict[int, int] = field(default_factory=dict)  # from the newest heartbeat
    landed: int = 0                                          # from the newest heartbeat


class Leases:
    def __init__(self, cfg: LifecycleConfig, clock: Clock, stalls: StallWatch | None = None) -> None:
        self.cfg, self.clock, self.stalls = cfg, clock, stalls
        self.peers: dict[str, PeerLease] = {}

    @property
    def timeout(self) -> float:
        return self.cfg.heartbeat_interval * self.cfg.heartbeat_misses

    def expect(self, address: str) -> None:
        """Start the lease at first contact, so a peer that never speaks dies too."""
        if address not in self.peers:
            self.peers[address] = PeerLease(address, None, self.clock.now())

    def on_heartbeat(self, src: str, hb: wire.Heartbeat) -> str:
        """-> "ok", "stale" (ignored) or "restarted" (old incarnation replaced)."""
        lease = self.peers.get(src)
        verdict = "ok"
        if lease is not None and lease.incarnation not in (None, hb.incarnation):
            lease, verdict = None, "restarted"
        if lease is None:
            lease = self.peers[src] = PeerLease(src, hb.incarnation, self.clock.now())
        elif hb.seq <= lease.last_seq:
            return "stale"
        lease.incarnation, lease.last_heard = hb.incarnation, self.clock.now()
        lease.last_seq, lease.rooms, lease.progress = hb.seq, dict(hb.rooms), dict(hb.progress)
        lease.landed = hb.landed
        return verdict

    def heard(self, last_message: dict[str, float]) -> None:
        """Any message from a known peer renews its lease (heartbeats also carry rooms)."""
        for address, t in last_message.items():
            lease = self.peers.get(address)
            if lease is not None and t > lease.last_heard:
                lease.last_heard = t

    def silent(self, lease: PeerLease) -> float:
        """Seconds `lease`'s peer has been silent while this loop looked."""
        quiet = self.clock.now() - lease.last_heard
        if self.stalls is None or mutation.on("judge_counts_own_stall"):
            return quiet
        return quiet - self.stalls.blind(lease.last_heard)

    def dead(self) -> list[str]:
        if mutation.on("reaper_stops_at_first_unexpired"):  # vLLM #41383: peers are not in expiry order
            return list(itertools.takewhile(lambda a: self.silent(self.peers[a]) >= self.timeout, self.peers))
        return [a for a, lease in self.peers.items() if self.silent(lease) >= self.timeout]

    def forget(self, address: str) -> None:
        self.peers.pop(address, None)


class Coordinator(ABC):
    """Shared by both sides. Subclasses define the side's reactions; `step()` order:
    pump the backend, poll every room, read heartbeats, watchdog, heartbeat out."""
    side = ""

    def __init__(self, cfg: LifecycleConfig, manager: TransferManager, clock: Clock,
                 lifecycle: Lifecycle) -> None:
        self.cfg, self.manager, self.clock, self.lc = cfg, manager, clock, lifecycle
        lease = cfg.heartbeat_interval * cfg.heartbeat_misses
        self.stalls = StallWatch(clock, tolerance=cfg.heartbeat_interval / 2, horizon=max(60.0, 10 * lease),
                                 name=f"{self.side} worker")
        self.leases = Leases(cfg, clock, self.stalls)
        self._last_beat = float("-inf")
        self._tombstones: dict[int, tuple[str | None, str, float]] = {}  # room -> (peer, phase, expiry)
        self.heartbeat_reads = 0   # passes of `step()` that read the peers' heartbeats so far

    # ---- the side's reactions -----------------------------------------------------------
    @abstractmethod
    def _poll_rooms(self) -> None:
        """Advance every live room from its sender/receiver status."""

    @abstractmethod
    def _fail(self, r: Room, reason: str, detail: str) -> None:
        """End `r` failed/aborted: abort the transfer endpoint, release pages once."""

    @abstractmethod
    def _depends_on_peer(self, r: Room) -> bool:
        """Whether `r` can still be harmed by its peer dying or forgetting it."""

    @abstractmethod
    def _on_peer_phase(self, r: Room, phase: str, lease: PeerLease) -> None:
        """The peer's newest heartbeat (`lease`) lists `r` in `phase`."""

    def _backend_status(self, r: Room) -> str:
        return ""

    def abort(self, room: int, reason: str = Reason.ABORTED.value, detail: str = "") -> bool:
        """End the room now, in any phase; the peer is told. False if it is not live."""
        r = self.lc.rooms.get(room)
        if r is None:
            return False
        self._fail(r, reason, detail)
        return True

    def _extra_heartbeat_rooms(self) -> dict[int, str]:
        return {}

    def _heartbeat_progress(self) -> dict[int, int]:
        """{room: bytes landed} to report for rooms still receiving KV (D side)."""
        return {}

    def quarantined_pages(self) -> int:
        """Pool pages held back after a failed one-sided transfer (D side; P holds none)."""
        return 0

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduler iteration. Never blocks."""
        self.stalls.look()
        self.manager.progress()
        # The rooms' own endpoints first: a peer sends a room's Notice before any heartbeat
        # that lists the room ended, so when both arrived in one iteration the Notice's
        # reason (transfer_error, say) is the one the room ends with, not peer_failed.
        self._poll_rooms()
        self._read_heartbeats()
        if not mutation.on("timeouts_only_after_batch"):  # TensorRT-LLM #17124: see WorkerCore.step
            self._watchdog()
        self._beat()
        self._expire_tombstones()

    def mid_step(self) -> None:
        """Inside a long forward pass (between its layers): pump the backend and heartbeat
        out, so that a busy worker keeps its leases and its transfers move, then
        `_poll_settled`. Invariant: it ends no room the pass may be computing into, and
        frees no page of one; reading heartbeats and the watchdog wait for `step()`."""
        self.stalls.look()
        self.manager.progress()
        self._beat()
        self._poll_settled()

    def _poll_settled(self) -> None:
        """Inside a pass: end the rooms whose backend status is already terminal and that
        no pass computes into (none, unless a side overrides it)."""

    def _read_heartbeats(self) -> None:
        self.leases.heard(self.manager.heard())
        for src, hb in self.manager.take_heartbeats():
            verdict = self.leases.on_heartbeat(src, hb)
            if verdict == "stale":
                continue
            if verdict == "restarted":
                for r in self._rooms_of(src):
                    if r.peer_incarnation not in (None, hb.incarnation):
                        self._fail(r, Reason.PEER_FAILED.value, "peer restarted")
                self._peer_restarted(src)
            for r in self._rooms_of(src):
                self._check_lease(r, self.leases.peers[src])
        self.heartbeat_reads += 1

    def _check_lease(self, r: Room, lease: PeerLease) -> None:
        phase = lease.rooms.get(r.room)
        if phase is None:
            if r.peer_known_seq is not None and lease.last_seq > r.peer_known_seq \
                    and self._depends_on_peer(r):
                self._fail(r, Reason.PEER_FAILED.value, "peer no longer holds the room")
            return
        r.peer_known_seq = lease.last_seq
        if r.peer_incarnation is None:
            r.peer_incarnation = lease.incarnation  # the incarnation that holds the room
        self._on_peer_phase(r, phase, lease)

    def _watchdog(self) -> None:
        """Every live room, every iteration: phase deadlines, then dead peers."""
        for r in self.lc.expired():
            if r.room in self.lc.rooms:
                self._fail(r, timeout(r.phase), f"{phase_name(r.phase)} deadline passed")
        for address in self.manager.peers():
            self.leases.expect(address)
        for address in self.leases.dead():
            for r in self._rooms_of(address):
                if self._depends_on_peer(r):
                    self._fail(r, Reason.PEER_FAILED.value,
                               f"peer missed {self.cfg.heartbeat_misses} heartbeats")
            self._peer_dead(address)

    def _peer_dead(self, address: str) -> None:
        """Silent for a whole lease: its rooms here have failed and it is forgotten. It
        may still be alive (a partition, a pause): nothing here assumes it stopped."""
        self.leases.forget(address)
        self.manager.forget_peer(address)

    def _peer_restarted(self, address: str) -> None:
        """A new incarnation speaks at `address`: the old one can no longer act."""

    def _rooms_of(self, address: str) -> list[Room]:
        return [r for r in list(self.lc.rooms.values()) if r.peer == address]

    def _beat(self) -> None:
        now = self.clock.now()
        if now - self._last_beat < self.cfg.heartbeat_interval:
            return
        self._last_beat = now
        targets = set(self.manager.peers()) | {r.peer for r in self.lc.rooms.values() if r.peer}
        extra, progress = self._extra_heartbeat_rooms(), self._heartbeat_progress()
        for address in sorted(targets):
            rooms = {r.room: phase_name(r.phase) for r in self.lc.rooms.values()
                     if r.peer in (None, address)}
            rooms.update({room: ph for room, (peer, ph, _) in self._tombstones.items()
                          if peer in (None, address)})
            rooms.update(extra)
            self.manager.heartbeat(address, rooms, {room: n for room, n in progress.items() if room in rooms})

    def _tombstone(self, r: Room, phase: str) -> None:
        """A finished room stays in heartbeats a while so the peer learns its outcome even
        when the Notice or Ack was lost."""
        linger = self.cfg.heartbeat_interval * (self.cfg.heartbeat_misses + 1)
        self._tombstones[r.room] = (r.peer, phase, self.clock.now() + linger)

    def _expire_tombstones(self) -> None:
        now = self.clock.now()
        for room in [k for k, (_, _, t) in self._tombstones.items() if t <= now]:
            del self._tombstones[room]

    # ---- views ------------------------------------------------------------------------------
    def live(self) -> list[dict]:
        """Rows for GET /debug/requests."""
        return [self.lc.row(r, self._backend_status(r)) for r in self.lc.rooms.values()]

    def phase_counts(self) -> dict[str, int]:
        return self.lc.phase_counts()

    def oldest_age(self) -> float:
        return self.lc.oldest_age()

    @property
    def events(self):
        return self.lc.events

    def idle(self) -> bool:
        return not self.lc.rooms
