"""The two ends of one room's transfer: `CommonSender` (P) and `CommonReceiver` (D).

They hold a room's transfer state and speak the control messages; the manager
(`transfer.common.CommonManager`) owns the channel and the data path and dispatches each
message to the room's endpoint. Neither end moves bytes itself: a sender hands its
`WriteJob` to the manager (`start_job`, `progress_job`, `cancel_job`), and a receiver learns
which of its pages landed from the manager (`mark_landed`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvrelay.core import mutation
from kvrelay.core.kvlayout import PagePart, paired_runs, part_runs
from kvrelay.disagg import wire
from kvrelay.disagg.transfer.base import (KVReceiver, KVSender, PeerInfo, TransferStatus, WriteJob,
                                          WriteState)

if TYPE_CHECKING:
    from kvrelay.disagg.transfer.common import CommonManager

S = TransferStatus


class _Endpoint:
    """Fail/abort bookkeeping shared by sender and receiver."""
    status: TransferStatus
    failure_reason: str | None = None
    failure_detail: str = ""

    def poll(self) -> TransferStatus:
        return self.status

    def _set_failed(self, reason: str, detail: str) -> bool:
        """-> True if this call moved the endpoint to FAILED."""
        if self.status is S.FAILED:
            return False
        self.status, self.failure_reason, self.failure_detail = S.FAILED, reason, detail
        return True


def notice_kind(reason: str) -> str:
    return "aborted" if reason == "aborted" else "failed"


# A failed transfer (or a request the pair cannot serve) is one event for both sides: it
# keeps its code, so both legs and the client report it alike. Any other failure of the
# peer (its own deadline, its death) is `peer_failed` here; the detail names the cause.
_SHARED_REASONS = ("transfer_error", "invalid_request")


def peer_reason(notice: wire.Notice) -> str:
    if notice.kind == "aborted":
        return "aborted"
    return notice.reason if notice.reason in _SHARED_REASONS else "peer_failed"


class CommonSender(_Endpoint, KVSender):
    def __init__(self, manager: "CommonManager", room: int) -> None:
        self.m, self.room = manager, room
        self.status = S.BOOTSTRAPPING
        self.dest: wire.Destination | None = None
        self.peer_address: str | None = None
        self.epoch: int | None = None
        self.job: WriteJob | None = None        # the last write, with the aux after it
        self.ahead: list[WriteJob] = []          # writes made while the prompt computed
        self._settled = 0                        # ahead[:_settled] are done and counted
        self.pending_aux: wire.Aux | None = None
        self.aux_sent = False
        self.stopped_sent = False

    @property
    def bytes_sent(self) -> int:
        return sum(job.bytes_sent for job in self.jobs)

    def init(self, destination: wire.Destination, src: str) -> None:
        if self.dest is not None:
            return  # duplicate or late: the first destination stands
        if self.status is S.FAILED:  # failed before D spoke: tell it now; nothing was written
            reason = self.failure_reason or ""
            if not mutation.on("no_p_to_d_abort"):  # P's aborts and failures are never propagated to D
                self.m.channel.send(src, wire.Notice(self.room, destination.epoch, notice_kind(reason), reason))
            self.m.channel.send(src, wire.Stopped(self.room, destination.epoch))
            return
        self.dest, self.peer_address, self.epoch = destination, src, destination.epoch
        self.status = S.WAITING

    def send_ahead(self, src_pages: list[int], part: PagePart) -> None:
        if self.status is not S.WAITING:
            if self.status is S.FAILED:
                return
            raise RuntimeError(f"send_ahead() on room {self.room} in {self.status.name}")
        if not self.m.writes_within_pages:
            raise RuntimeError(f"the {self.m.name} transfer backend writes whole pages only")
        job = self._job(src_pages, [part], None, whole=False)
        if job is not None:
            self.ahead.append(job)
            self.m.start_job(job)
            self.pump()

    def send(self, src_pages: list[int], aux: wire.Aux, parts: list[PagePart] | None = None) -> None:
        if self.status is not S.WAITING:
            if self.status is S.FAILED:
                return
            raise RuntimeError(f"send() on room {self.room} in {self.status.name}")
        dest = self.dest
        assert dest is not None
        self.pending_aux = replace(aux, room=self.room, epoch=dest.epoch)
        self.job = self._job(src_pages, parts, self.pending_aux, whole=True)
        if self.job is None:
            return
        self.status = S.TRANSFERRING
        self.pump()

    def _job(self, src_pages: list[int], parts: list[PagePart] | None, aux: wire.Aux | None,
             whole: bool) -> WriteJob | None:
        """The write of `parts` of `src_pages` (None: every page, whole) into the
        destination, or None after failing the room for what makes it impossible. `whole`:
        `src_pages` are all the room's pages (their count must be the destination's)."""
        dest = self.dest
        assert dest is not None and self.peer_address is not None
        if len(src_pages) > len(dest.dst_pages) or whole and len(src_pages) != len(dest.dst_pages):
            self._fail("invalid_request",
                       f"{len(src_pages)} KV pages for {len(dest.dst_pages)} destination pages")
            return None
        peer = self.m.peers().get(self.peer_address)
        if peer is None:
            self._fail("peer_failed", "decode worker not bootstrapped (or forgotten)")
            return None
        bad = self.m.bad_destination(dest, peer)
        if bad:
            self._fail("invalid_request", bad)
            return None
        pb = self.m.layout.page_bytes
        try:
            runs = (paired_runs(src_pages, dest.dst_pages, pb) if parts is None
                    else part_runs(parts, src_pages, dest.dst_pages, pb))
        except ValueError as e:
            self._fail("invalid_request", str(e))
            return None
        return WriteJob(self.room, dest.epoch, peer, tuple(src_pages), dest.dst_pages, runs, aux=aux)

    @property
    def jobs(self) -> list[WriteJob]:
        """Every write of this room: those ahead of the prompt's end, then the last."""
        return self.ahead + ([self.job] if self.job is not None else [])

    def pump(self) -> None:
        """Advance the writes; start the last one once every write ahead is done (so that
        aux, which follows it, follows every byte); send aux once it is done; send Stopped
        once a failed room's writes have quiesced."""
        if self.status is S.FAILED:
            pending = False
            for job in self.jobs:
                if job.state is WriteState.PENDING and job.begun and self.m.cancel_job(job):
                    job.state = WriteState.CANCELLED
                pending = pending or job.state is WriteState.PENDING and job.begun
            if not self.stopped_sent and not pending:
                self._send_stopped()
            return
        for job in self.ahead[self._settled:]:
            if job.state is WriteState.PENDING:
                self.m.progress_job(job)
            if job.state is WriteState.FAILED:
                self._fail("transfer_error", job.detail or "write failed")
                return
            if job.state is WriteState.DONE and not job.recorded:
                self.m.record_write(job)
        while self._settled < len(self.ahead) and self.ahead[self._settled].recorded:
            settled = self.ahead[self._settled]
            settled.runs, settled.src_pages = [], ()   # done and counted: only its byte count is read again
            self._settled += 1
        job = self.job
        if job is None or self.status is not S.TRANSFERRING:
            return
        if not job.begun:
            if self._settled < len(self.ahead) and not mutation.on("aux_before_ahead"):
                return   # a write ahead is still under way
            self.m.start_job(job)
        if job.state is WriteState.PENDING:
            self.m.progress_job(job)
        if job.state is WriteState.FAILED:
            self._fail("transfer_error", job.detail or "write failed")
        elif job.state is WriteState.DONE and not self.aux_sent:
            self.aux_sent = True
            self.m.record_write(job, room_done=True)
            if not job.aux_in_band:
                self.resend()

    def _send_stopped(self) -> None:
        self.stopped_sent = True
        if self.dest is not None and self.peer_address is not None:
            self.m.channel.send(self.peer_address, wire.Stopped(self.room, self.dest.epoch))

    def on_ack(self, ack: wire.Ack) -> None:
        if self.status is S.TRANSFERRING and self.aux_sent and ack.epoch == self.epoch:
            self.status = S.SUCCESS

    def on_notice(self, notice: wire.Notice) -> None:
        if self.epoch is None or notice.epoch in (self.epoch, 0):
            self._fail(peer_reason(notice), f"decode: {notice.reason}", notify=False)

    def abort(self, reason: str, detail: str = "") -> None:
        if mutation.on("poll_ignores_abort"):  # the seeds' bug: poll() ignores the abort flag
            return
        if self.status is S.SUCCESS:  # D has everything: nothing to tell it
            self.status, self.failure_reason, self.failure_detail = S.FAILED, reason, detail
            self.stopped_sent = True
            return
        self._fail(reason, detail)

    def _fail(self, reason: str, detail: str, notify: bool = True) -> None:
        if not self._set_failed(reason, detail):
            return
        if mutation.on("no_p_to_d_abort"):  # P's aborts and failures are never propagated to D
            notify = False
        if notify and self.dest is not None and self.peer_address is not None:
            self.m.channel.send(self.peer_address, wire.Notice(self.room, self.dest.epoch,
                                                               notice_kind(reason), reason))
        self.pump()

    def resend(self) -> None:
        if self.aux_sent and self.status is S.TRANSFERRING and self.pending_aux and self.peer_address:
            self.m.channel.send(self.peer_address, self.pending_aux)

    def close(self) -> None:
        self.m.close_sender(self)


class CommonReceiver(_Endpoint, KVReceiver):
    def __init__(self, manager: "CommonManager", room: int) -> None:
        self.m, self.room = manager, room
        self.status = S.BOOTSTRAPPING
        self.peer_address: str | None = None
        self.pages: tuple[int, ...] = ()
        self.epoch: int | None = None
        self.spans: dict[int, set[tuple[int, int]]] = {}   # page -> distinct (offset, length) landed
        self.whole: set[int] = set()    # pages whose every byte landed (completeness, two-sided)
        self.landed_bytes = 0           # bytes of distinct spans that landed (progress)
        self._aux: wire.Aux | None = None
        self.stopped = False
        self.dest: wire.Destination | None = None

    def init(self, prefill_address: str) -> None:
        self.peer_address = prefill_address
        self.m.bootstrap(self)

    def on_peer(self, peer: PeerInfo) -> None:
        """P's BootstrapInfo arrived (or was already known)."""
        if self.status is not S.BOOTSTRAPPING:
            return
        bad = self.m.layout.mismatches(peer.layout)
        if bad:
            self._fail("invalid_request", "KV layout mismatch: " + ", ".join(bad))
        else:
            self.status = S.WAITING

    def send_metadata(self, page_ids: list[int], epoch: int) -> None:
        if self.status is not S.WAITING:
            if self.status is S.FAILED:
                return
            raise RuntimeError(f"send_metadata() on room {self.room} in {self.status.name}")
        self.pages, self.epoch = tuple(page_ids), epoch
        self.m.own_pages(self)
        self.dest = wire.Destination(self.room, epoch, self.pages, self.m.worker_id,
                                     self.m.incarnation, self.m.hb_seq)
        self.status = S.TRANSFERRING
        self.resend()

    def resend(self) -> None:
        if self.dest is not None and self.status is S.TRANSFERRING and self.peer_address:
            self.m.channel.send(self.peer_address, self.dest)

    def on_aux(self, aux: wire.Aux) -> None:
        if aux.epoch != self.epoch:
            return
        if self.status is S.SUCCESS:
            self.m.send_ack(self.peer_address, wire.Ack(self.room, aux.epoch))  # P lost the ack
        elif self.status is S.TRANSFERRING:
            self._aux = aux
            self._maybe_done()

    def _maybe_done(self) -> None:
        complete = self.m.one_sided or len(self.whole) == len(self.pages)
        if self.status is S.TRANSFERRING and self._aux is not None and complete:
            self.status = S.SUCCESS
            self.m.send_ack(self.peer_address, wire.Ack(self.room, self._aux.epoch))

    def on_notice(self, notice: wire.Notice) -> None:
        if self.epoch is None or notice.epoch in (self.epoch, 0):
            self._fail(peer_reason(notice), f"prefill: {notice.reason}", notify=False)

    def on_stopped(self, msg: wire.Stopped) -> None:
        if msg.epoch == self.epoch:
            self.stopped = True

    def aux(self) -> wire.Aux | None:
        return self._aux if self.status is S.SUCCESS else None

    def progress(self) -> int:
        return self.landed_bytes

    def abort(self, reason: str, detail: str = "") -> None:
        if mutation.on("poll_ignores_abort"):  # the seeds' bug: poll() ignores the abort flag
            return
        self._fail(reason, detail)

    def _fail(self, reason: str, detail: str, notify: bool = True) -> None:
        if self._set_failed(reason, detail) and notify and self.peer_address:
            self.m.channel.send(self.peer_address, wire.Notice(self.room, self.epoch or 0,
                                                               notice_kind(reason), reason))

    def ask_stopped(self) -> None:
        if self.may_still_write() and self.peer_address and self.dest is not None:
            reason = self.failure_reason or ""
            self.m.channel.send(self.peer_address, wire.Notice(self.room, self.dest.epoch,
                                                               notice_kind(reason), reason))
            self.m.channel.send(self.peer_address, self.dest)

    def may_still_write(self) -> bool:
        return (self.m.one_sided and self.status is S.FAILED and self.dest is not None
                and not self.stopped)

    def close(self) -> None:
        self.m.close_receiver(self)
