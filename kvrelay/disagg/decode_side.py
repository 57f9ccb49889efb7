"""The decode worker's request lifecycle: bootstrap -> waiting -> decode -> done, or, for a
request whose prompt this worker prefills itself (the router's adaptive split), decode ->
done with no peer and no transfer.

The decode worker's scheduler loop drives it: `add()` per request, `step()` once per
iteration, `take_ready()` to admit rooms whose KV and first token arrived, `finish()` when
decoding ends.

Invariants:
- `reserve(room, n)` -> (pages, epoch) | None is retried every iteration while the pool is
  full (bounded by the bootstrap deadline and P's lease); the epoch must be new per reuse.
- `release(room, pages)` is called exactly once per reserved room: on finish, or on failure
  (two-sided: at once; one-sided: when the quarantine ends: P confirmed Stopped, a new
  incarnation of P was seen (the writer is gone), or transfer_timeout + quarantine_grace
  passed since the failure). P merely going silent does not end it: a P that D declared
  dead may be alive behind a partition or a pause with a write in flight. A quarantined
  room asks P again every heartbeat interval, so one lost message does not hold it.
- The receiver is closed (its pages stop accepting bytes) before its pages are released.
- Every heartbeat to P reports how many of P's KV bytes have landed here, in all and per
  waiting room (two-sided backends): P fails a transfer for lack of progress, never for
  being slow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvrelay.core import mutation
from kvrelay.core.clock import Clock
from kvrelay.core.config import LifecycleConfig
from kvrelay.disagg import wire
from kvrelay.disagg.lease import Coordinator, PeerLease
from kvrelay.disagg.lifecycle import (D_TRANSITIONS, NO_PEER, DPhase, Lifecycle, Reason, Room, TerminalEvent,
                                      d_deadlines, phase_name)
from kvrelay.disagg.transfer.base import KVReceiver, TransferManager, TransferStatus

S = TransferStatus
Reserve = Callable[[int, int], "tuple[list[int], int] | None"]


@dataclass
class DecodeRoom:
    """D's own state of a room: the pages its KV needs, and once reserved, which (epoch)."""
    n_pages: int
    pages: list[int] | None = None   # reserved in the pool; None before, and once released
    epoch: int | None = None


@dataclass
class Quarantined:
    room: int
    peer: str | None
    pages: list[int]
    until: float
    receiver: KVReceiver
    asked: float = float("-inf")   # last ask_stopped()
    incarnation: str | None = None  # P's incarnation that may still write
    known: frozenset = frozenset()  # incarnations visible at P's address when it began


class DecodeSide(Coordinator):
    side = "decode"

    def __init__(self, cfg: LifecycleConfig, manager: TransferManager, clock: Clock,
                 reserve: Reserve, release: Callable[[int, list[int]], None],
                 on_terminal: Callable[[TerminalEvent], None] | None = None,
                 capacity: int | None = None) -> None:
        lc = Lifecycle(self.side, DPhase, D_TRANSITIONS, d_deadlines(cfg), clock, on_terminal)
        super().__init__(cfg, manager, clock, lc)
        self.reserve, self.release, self.capacity = reserve, release, capacity
        self._receivers: dict[int, KVReceiver] = {}
        self._ready: list[int] = []
        self.quarantine: dict[int, Quarantined] = {}

    def quarantined_pages(self) -> int:
        return sum(len(q.pages) for q in self.quarantine.values())

    # ---- the worker's calls -------------------------------------------------------------
    def add(self, room: int, rid: str, prefill_address: str, n_pages: int) -> None:
        """Admit a request whose KV (n_pages pages) comes from the P at prefill_address."""
        r = self.lc.add(room, rid, peer=prefill_address, data=DecodeRoom(n_pages))
        if not wire.valid_endpoint(prefill_address):  # never connected to: fails this room only
            self._fail(r, Reason.INVALID_REQUEST.value, f"prefill address {repr(prefill_address)[:100]} is not an endpoint")
            return
        self.leases.expect(prefill_address)
        rcv = self._receivers[room] = self.manager.receiver(room)
        rcv.init(prefill_address)
        if self.capacity is not None and n_pages > self.capacity:
            self._fail(r, Reason.INVALID_REQUEST.value,
                       f"needs {n_pages} KV pages, the pool has {self.capacity}")

    def add_local(self, room: int, rid: str) -> None:
        """Admit a request this worker's engine prefills itself: it enters decode at once
        (the engine owns its pages, under its rid) and ends by finish() or abort()."""
        self.lc.add(room, rid, peer=NO_PEER, phase=DPhase.DECODE, data=DecodeRoom(0))

    def take_ready(self) -> list[tuple[int, wire.Aux]]:
        """Rooms whose KV and aux have all arrived; they enter decode and keep their pages
        until finish() or abort()."""
        out = []
        for room in self._ready:
            r = self.lc.rooms.get(room)
            rcv = self._receivers.get(room)
            if r is None or r.phase is not DPhase.WAITING or rcv is None or rcv.poll() is not S.SUCCESS:
                continue
            aux = rcv.aux()
            assert aux is not None
            self.lc.move(room, DPhase.DECODE)
            del self._receivers[room]
            rcv.close()
            out.append((room, aux))
        self._ready = []
        return out

    def finish(self, room: int) -> bool:
        """Decoding ended normally: done, pages released."""
        r = self.lc.rooms.get(room)
        if r is None or r.phase is not DPhase.DECODE:
            return False
        self.lc.end(room, DPhase.DONE)
        self._release(r)
        self._tombstone(r, "done")
        return True

    # ---- reactions --------------------------------------------------------------------------
    def _poll_rooms(self) -> None:
        for r in list(self.lc.rooms.values()):
            rcv = self._receivers.get(r.room)
            if rcv is None:
                continue  # decoding: P is out of the picture
            st = rcv.poll()
            if st is S.FAILED:
                self._fail(r, rcv.failure_reason or Reason.TRANSFER_ERROR.value, rcv.failure_detail)
            elif r.phase is DPhase.BOOTSTRAP and st is S.WAITING:
                self._try_reserve(r, rcv)
            elif r.phase is DPhase.WAITING and st is S.SUCCESS and r.room not in self._ready:
                self._ready.append(r.room)
            if mutation.on("d_timeout_before_first_byte") and r.phase is DPhase.WAITING and rcv.progress():
                r.deadline = None  # SGLang #31800: the timeout only runs until the first byte lands
        self._end_quarantines()

    def _try_reserve(self, r: Room, rcv: KVReceiver) -> None:
        got = self.reserve(r.room, r.data.n_pages)
        if got is None:
            return  # pool full: retry next iteration
        pages, epoch = got
        r.data.pages, r.data.epoch = list(pages), epoch
        rcv.send_metadata(list(pages), epoch)
        self.lc.move(r.room, DPhase.WAITING)

    def _fail(self, r: Room, reason: str, detail: str) -> None:
        rcv = self._receivers.pop(r.room, None)
        if rcv is not None:
            rcv.abort(reason, detail)
        terminal = DPhase.ABORTED if reason == Reason.ABORTED.value else DPhase.FAILED
        self.lc.end(r.room, terminal, reason, detail)
        self._tombstone(r, phase_name(terminal))
        if rcv is not None and rcv.may_still_write():
            until = self.clock.now() + self.cfg.transfer_timeout + self.cfg.quarantine_grace
            if mutation.on("quarantine_on_timer"):  # SGLang #38961: released on a timer while P may write
                until = self.clock.now() + self.cfg.heartbeat_interval
            writer = self._writer_incarnation(r)
            self.quarantine[r.room] = Quarantined(r.room, r.peer, r.data.pages, until, rcv, self.clock.now(),
                                                  writer, frozenset(self._visible(r.peer)) | {writer})
            return
        if rcv is not None:
            rcv.close()
        self._release(r)

    def _release(self, r: Room) -> None:
        pages, r.data.pages = r.data.pages, None
        if pages is not None:
            self.release(r.room, pages)

    def _writer_incarnation(self, r: Room) -> str | None:
        if r.peer_incarnation is not None:
            return r.peer_incarnation
        peer = self.manager.peers().get(r.peer or "")
        return peer.incarnation if peer is not None else None

    def _visible(self, address: str | None) -> set[str]:
        """The incarnations at `address` that the lease and the transfer manager know
        now (either may lag behind the other: an old lease, a fresh bootstrap)."""
        found = (self.leases.peers.get(address or ""), self.manager.peers().get(address or ""))
        return {x.incarnation for x in found if x is not None and x.incarnation is not None}

    def _restarted(self, q: Quarantined) -> bool:
        """An incarnation of q's writer's address appeared that was not there when the
        quarantine began: the writer has been replaced. (An older one still on record,
        a stale lease for instance, proves nothing.)"""
        return q.incarnation is not None and bool(self._visible(q.peer) - q.known)

    def _end_quarantines(self) -> None:
        now = self.clock.now()
        for q in list(self.quarantine.values()):
            if not q.receiver.may_still_write() or now >= q.until or self._restarted(q):
                del self.quarantine[q.room]
                q.receiver.close()
                self.release(q.room, q.pages)
            elif now - q.asked >= self.cfg.heartbeat_interval:
                q.asked = now
                q.receiver.ask_stopped()

    def _peer_restarted(self, address: str) -> None:
        self._end_quarantines()

    def _extra_heartbeat_rooms(self) -> dict[int, str]:
        return {room: wire.QUARANTINE_PHASE for room in self.quarantine}

    def _heartbeat_progress(self) -> dict[int, int]:
        out = {}
        for room, rcv in self._receivers.items():
            r = self.lc.rooms.get(room)
            if r is not None and r.phase is DPhase.WAITING and rcv.progress():
                out[room] = rcv.progress()
        return out

    def _depends_on_peer(self, r: Room) -> bool:
        rcv = self._receivers.get(r.room)
        return rcv is not None and rcv.poll() is not S.SUCCESS  # KV + aux in: P is done with us

    def _on_peer_phase(self, r: Room, phase: str, lease: PeerLease) -> None:
        if not self._depends_on_peer(r):
            return
        if phase in ("failed", "aborted"):
            reason = Reason.ABORTED.value if phase == "aborted" else Reason.PEER_FAILED.value
            self._fail(r, reason, f"prefill side is {phase}")
        elif phase == "bootstrap" and r.phase is DPhase.WAITING:
            self._receivers[r.room].resend()  # the destination may have been lost

    def _backend_status(self, r: Room) -> str:
        rcv = self._receivers.get(r.room)
        return "released" if rcv is None else rcv.poll().name.lower()

    def idle(self) -> bool:
        return not self.lc.rooms and not self.quarantine
