"""The prefill worker's request lifecycle: bootstrap -> queued -> prefill -> transfer -> done.

The prefill worker's scheduler loop drives it: `add()` per request, `step()` once per
iteration, `take_queued()` to pick work, `prefill_done()` when the KV is computed.

Invariants:
- `release_pages(room)` is called exactly once per room, when the room ends, in whatever
  phase (after an ack, or on any failure). The engine must stop using the room's pages then;
  its terminal event says why. `prefill_done` on a room that already ended does nothing.
- A room leaves `transfer` only on D's ack (or D's heartbeat showing it decoding, when the
  ack was lost) or on a terminal failure; the sender is aborted on every failure.
- A room in `transfer` while D's heartbeats keep listing it as waiting fails
  (transfer_error) after `heartbeat_misses` such heartbeats in a row without progress.
  Progress: D reports more of this worker's KV bytes landed than at the previous
  heartbeat (for any room: the link is FIFO, so a room queued behind others moves when
  they do) while some of the room's bytes are still missing, or, while the write is still
  pending (aux not yet out), the backend handed off more of its bytes. A transfer that
  moves is never failed for its length (only the --transfer-timeout backstop bounds it);
  one that stalls, never starts, or whose pages are all in but whose aux or ack never
  comes, never outlives the lease. Exception: a backend whose pending writes are opaque
  (`opaque_writes`, nixl) cannot show a write moving, so its pending writes are bounded
  by --transfer-timeout alone; once the aux is out, the rule holds for it too.
  Heartbeats read in the first pass after the send count for nothing: they waited in the
  queue while the step that computed the room ran (several, when it ran for a few
  heartbeat intervals), so D sent them before it could see the write.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvrelay.core import mutation
from kvrelay.core.clock import Clock
from kvrelay.core.config import LifecycleConfig
from kvrelay.core.kvlayout import PagePart
from kvrelay.disagg import wire
from kvrelay.disagg.lease import Coordinator, PeerLease
from kvrelay.disagg.lifecycle import (P_TRANSITIONS, Lifecycle, PPhase, Reason, Room, TerminalEvent,
                                      p_deadlines, phase_name)
from kvrelay.disagg.transfer.base import KVSender, TransferManager, TransferStatus

S = TransferStatus


@dataclass
class PrefillRoom:
    """P's own state of a room in transfer, judged at each heartbeat of its D."""
    link_landed: int = 0     # bytes from this worker D had reported landed, at the last look
    sent_at_read: int = -1   # `heartbeat_reads` when the write was handed off
    bytes_sent: int = 0      # bytes the backend had handed off, at the last look
    stalled: int = 0         # heartbeats in a row that showed the transfer not moving


class PrefillSide(Coordinator):
    side = "prefill"

    def __init__(self, cfg: LifecycleConfig, manager: TransferManager, clock: Clock,
                 release_pages: Callable[[int], None],
                 on_terminal: Callable[[TerminalEvent], None] | None = None) -> None:
        lc = Lifecycle(self.side, PPhase, P_TRANSITIONS, p_deadlines(cfg), clock, on_terminal)
        super().__init__(cfg, manager, clock, lc)
        self.release_pages = release_pages
        self._senders: dict[int, KVSender] = {}
        self._queue: deque[int] = deque()  # rooms in QUEUED, in arrival order

    # ---- the worker's calls -------------------------------------------------------------
    def add(self, room: int, rid: str) -> None:
        """Admit a request: it waits in bootstrap for D's destination."""
        self.lc.add(room, rid, data=PrefillRoom())
        self._senders[room] = self.manager.sender(room)

    def take_queued(self, max_n: int) -> list[int]:
        """Hand up to max_n queued rooms to the engine (they enter prefill), oldest first."""
        out: list[int] = []
        while self._queue and len(out) < max_n:
            room = self._queue.popleft()
            r = self.lc.rooms.get(room)
            if r is not None and r.phase is PPhase.QUEUED:
                self.lc.move(room, PPhase.PREFILL)
                out.append(room)
        return out

    def send_ahead(self, room: int, src_pages: list[int], parts: list[PagePart]) -> None:
        """While `room` computes its prompt: write `parts` of its pages so far (final
        bytes, `disagg.layerwise`) to D now. Ends no room (a failed write fails the
        sender, and the next `step()` the room)."""
        r = self.lc.rooms.get(room)
        if r is not None and r.phase is PPhase.PREFILL:
            for part in parts:
                self._senders[room].send_ahead(src_pages, part)

    def prefill_done(self, room: int, src_pages: list[int], aux: wire.Aux,
                     parts: list[PagePart] | None = None) -> bool:
        """The KV of `room` is in `src_pages`: start the transfer of `parts` of them
        (None: all; what `send_ahead` did not write). False if the room already ended
        (its pages were released then)."""
        r = self.lc.rooms.get(room)
        if r is None or r.phase is not PPhase.PREFILL:
            return False
        self.lc.move(room, PPhase.TRANSFER)
        lease = self.leases.peers.get(r.peer or "")
        r.data.link_landed = lease.landed if lease is not None else 0  # progress counts from here
        r.data.sent_at_read = self.heartbeat_reads
        self._senders[room].send(list(src_pages), aux, parts)
        return True

    # ---- reactions --------------------------------------------------------------------------
    def _poll_rooms(self) -> None:
        for r in list(self.lc.rooms.values()):
            snd = self._senders[r.room]
            st = snd.poll()
            if r.phase is PPhase.BOOTSTRAP and st is S.WAITING:
                self._paired(r, snd)
            else:
                self._settle(r, snd, st)

    def _poll_settled(self) -> None:
        """Rooms in transfer end inside a pass too, as D's ack (or a failure) arrives: the
        engine no longer computes into their pages, and their transfer phase then measures
        the transfer, not the rest of the step that followed it."""
        for r in [r for r in self.lc.rooms.values() if r.phase is PPhase.TRANSFER]:
            snd = self._senders[r.room]
            self._settle(r, snd, snd.poll())

    def _settle(self, r: Room, snd: KVSender, st: TransferStatus) -> None:
        """End `r` if its sender's status `st` is terminal: failed in any phase, success in transfer."""
        if st is S.FAILED:
            self._fail(r, snd.failure_reason or Reason.TRANSFER_ERROR.value, snd.failure_detail)
        elif r.phase is PPhase.TRANSFER and st is S.SUCCESS:
            self._done(r)

    def _paired(self, r: Room, snd: KVSender) -> None:
        dest = snd.dest
        assert dest is not None
        r.peer, r.peer_incarnation, r.peer_known_seq = snd.peer_address, dest.incarnation, dest.hb_seq
        self.leases.expect(r.peer)  # type: ignore[arg-type]
        self.lc.move(r.room, PPhase.QUEUED)
        self._queue.append(r.room)

    def _done(self, r: Room) -> None:
        self.lc.end(r.room, PPhase.DONE)
        self._release(r, "done")

    def _fail(self, r: Room, reason: str, detail: str) -> None:
        self._senders[r.room].abort(reason, detail)
        terminal = PPhase.ABORTED if reason == Reason.ABORTED.value else PPhase.FAILED
        self.lc.end(r.room, terminal, reason, detail)
        self._release(r, phase_name(terminal))

    def _release(self, r: Room, phase: str) -> None:
        self._senders.pop(r.room).close()
        self.release_pages(r.room)
        self._tombstone(r, phase)

    def _depends_on_peer(self, r: Room) -> bool:
        return r.peer is not None

    def _on_peer_phase(self, r: Room, phase: str, lease: PeerLease) -> None:
        if phase in ("failed", "aborted", wire.QUARANTINE_PHASE):
            reason = Reason.ABORTED.value if phase == "aborted" else Reason.PEER_FAILED.value
            self._fail(r, reason, f"decode side is {phase}")
        elif phase in ("decode", "done"):
            if r.phase is PPhase.TRANSFER:
                self._done(r)  # D decodes only after aux, which is sent last: the ack was lost
            elif r.phase is not PPhase.TRANSFER:
                self._fail(r, Reason.PEER_FAILED.value, f"decode side is {phase} before the transfer")
        elif phase == "waiting" and r.phase is PPhase.TRANSFER:
            if r.data.sent_at_read == self.heartbeat_reads:   # sent before D could see the write
                self._link_moved(r, lease)
            elif self._senders[r.room].aux_sent:
                self._unacked(r, lease)
            elif not self.manager.opaque_writes:
                self._write_pending(r, lease)

    def _unacked(self, r: Room, lease: PeerLease) -> None:
        """D is alive and still waiting although every byte and the aux went out. While D
        reports new bytes of this worker landed, the room is on its way: its own missing
        bytes, or, once they are all in, its aux behind what was queued before it on the
        link (other rooms' bytes: a 2 Mbit/s link took seconds to drain them, and counting
        those heartbeats as stalls failed a room whose bytes had all landed). Otherwise it
        gives up after `heartbeat_misses` heartbeats in a row without progress. The aux is
        resent at every heartbeat without progress, and at every one once all the room's
        bytes are in (then only the aux or the ack is missing, and the aux may have been
        lost). This bounds a stalled transfer by the lease, not by --transfer-timeout,
        and never fails one that moves."""
        landed, snd = lease.progress.get(r.room, 0), self._senders[r.room]
        missing = landed < snd.bytes_sent   # aux out: every byte was handed off
        if mutation.on("progress_counts_pages"):
            missing = landed < len(snd.dest.dst_pages if snd.dest else ())
        n = self._stalls(r, self._link_moved(r, lease))
        if n > self.cfg.heartbeat_misses:
            self._fail(r, Reason.TRANSFER_ERROR.value,
                       f"decode side reported no KV progress ({landed} bytes landed) and no ack "
                       f"in {n} heartbeats")
        elif n or not missing:
            snd.resend()

    def _write_pending(self, r: Room, lease: PeerLease) -> None:
        """D is alive and waiting while this worker's write of the room is still pending
        (a full socket, a slow link, or a write that never started). It moves while D
        reports new bytes landed or the backend hands off more of its bytes; after
        `heartbeat_misses` heartbeats in a row with neither, it fails: a write that never
        completes is bounded by the lease, not by --transfer-timeout."""
        sent = self._senders[r.room].bytes_sent
        moved = sent > r.data.bytes_sent
        r.data.bytes_sent = sent
        n = self._stalls(r, self._link_moved(r, lease) or moved)
        if n > self.cfg.heartbeat_misses:
            self._fail(r, Reason.TRANSFER_ERROR.value,
                       f"the KV write made no progress ({sent} bytes handed off, none newly "
                       f"landed at the decode side) in {n} heartbeats")

    @staticmethod
    def _link_moved(r: Room, lease: PeerLease) -> bool:
        """D reports more of this worker's KV bytes landed than at the previous heartbeat."""
        moved = lease.landed > r.data.link_landed
        r.data.link_landed = lease.landed
        return moved

    @staticmethod
    def _stalls(r: Room, moved: bool) -> int:
        """Heartbeats in a row that showed the room's transfer not moving (0 after one that did)."""
        n = r.data.stalled = 0 if moved else r.data.stalled + 1
        return n

    def _backend_status(self, r: Room) -> str:
        return self._senders[r.room].poll().name.lower()
