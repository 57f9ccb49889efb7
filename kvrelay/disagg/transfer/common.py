"""The manager every backend shares: the transfer contract over the control channel.

`CommonManager` does everything but move bytes: bootstrap, dispatch of messages to the
rooms' senders and receivers (`transfer.endpoints`), acks, notices, Stopped, heartbeat
plumbing, abort semantics. A backend subclasses it and implements the data path
(`transfer.base.DataPath`: `write_start` and the optional hooks), fault injection included.

Authentication comes first, in the channel (`auth=`, disagg.auth): with a cluster key, a
frame not sealed with it is dropped before its header is parsed, so everything below
sees members of the cluster only. Admission (`_admit`, the one place where a decoded
frame is accepted or refused against this worker's state): a Heartbeat or BootstrapInfo is
accepted only from a bootstrapped peer or an address this worker has a reason to talk to
(a P named in one of its rooms, a D whose Destination it holds for a live room, an address
it asked, a sender whose heartbeat lists a room this worker holds). Everything else is dropped and counted in
kvrelay_rejected_input_total{surface="control",reason=...}, e.g. "unknown_peer" (logged at
debug on `kvrelay.input`). So an unknown sender never makes this worker open a socket:
sockets go only to bootstrapped peers (at most MAX_PEERS, the least recently heard one
without live rooms evicted) and to addresses its own rooms name. A BootstrapQuery whose
layout differs is answered (D then fails its rooms naming the fields) but not learned
("bad_layout"); a peer whose connect() raises is not learned ("bad_endpoint") and the
rooms waiting on it fail, nothing else. What a frame carries that only state can check
(destination pages outside the peer's pool, repeated pages) fails that room only.
"""
from __future__ import annotations

import logging

from kvrelay.core import ids, mutation
from kvrelay.core.clock import Clock, MonotonicClock
from kvrelay.core.config import LifecycleConfig, TransferConfig
from kvrelay.core.kvlayout import KVLayout
from kvrelay.disagg import wire
from kvrelay.disagg.auth import ChannelAuth
from kvrelay.disagg.channel import Channel, Received, ZmqChannel
from kvrelay.disagg.faults import Faults, FaultSpec, FaultyChannel
from kvrelay.disagg.transfer.base import DataPath, PeerInfo, TransferManager, TransferStatus, WriteJob
from kvrelay.disagg.transfer.endpoints import CommonReceiver, CommonSender, peer_reason
from kvrelay.obs.metrics import reject_input

S = TransferStatus
log = logging.getLogger("kvrelay.transfer")

MAX_PEERS = 128          # bootstrapped peers one worker keeps
MAX_EARLY_ROOMS = 4096   # rooms with messages buffered before the router's leg arrived


class CommonManager(DataPath, TransferManager):
    name = "common"
    one_sided = False
    opaque_writes = False

    def __init__(self, layout: KVLayout, transfer: TransferConfig | None = None, *,
                 lifecycle: LifecycleConfig | None = None, clock: Clock | None = None,
                 channel: Channel | None = None, worker_id: str | None = None,
                 auth: ChannelAuth | None = None) -> None:
        """`auth`: seal and verify every frame of the channel with the cluster key."""
        self.layout = layout
        self.transfer = transfer or TransferConfig(transfer_backend=self.name)
        self.lifecycle = lifecycle or LifecycleConfig()
        self.clock = clock or MonotonicClock()
        self.incarnation = ids.token_hex(8)
        self.worker_id = worker_id or f"{self.name}-{self.incarnation[:8]}"
        self.faults = Faults(FaultSpec.from_config(self.transfer.fault_spec))
        if channel is None:
            channel = ZmqChannel(self.transfer.transfer_host, self.transfer.transfer_port,
                                 max_msg_size=max(wire.MAX_FRAME_BYTES, self.max_data_frame()), auth=auth)
        elif auth is not None:
            channel.auth = auth
        self._wire = channel   # the channel under any fault injection: seals and opens blobs
        self.channel: Channel = FaultyChannel(channel, self.faults, self.clock)
        self.address = channel.address
        self.region = None                     # the registered KV pool (register_kv)
        self.pool: memoryview | None = None    # its host view
        self.hb_seq = 0
        self._peers: dict[str, PeerInfo] = {}
        self._asked: dict[str, float] = {}              # P address -> last BootstrapQuery time
        self._senders: dict[int, CommonSender] = {}
        self._receivers: dict[int, CommonReceiver] = {}
        self._draining: list[CommonSender] = []          # failed senders still cancelling a write
        self._early: dict[int, tuple[float, list[Received]]] = {}  # room -> (expiry, messages)
        self._closed: dict[int, tuple[float, CommonSender]] = {}   # P tombstones: room -> (expiry, sender)
        self._owner: dict[int, tuple[int, int]] = {}     # D page -> (room, epoch) of its receiver
        self._heartbeats: list[tuple[str, wire.Heartbeat]] = []
        self._await_peer: dict[str, list[Received]] = {}   # Destinations from a peer not yet learned
        self._heard: dict[str, float] = {}                # peer address -> last message time
        self._landed_from: dict[str, int] = {}            # D: peer address -> KV bytes arrived from it
        self.bytes_written = 0       # P: KV bytes of completed writes
        self.bytes_ahead = 0         # P: of which written ahead (layer-wise, send_ahead)
        self.write_seconds = 0.0     # P: their summed durations (start to every byte landed)
        self.writes_done = 0

    # ---- helpers for backends ----------------------------------------------------------
    def owner_ok(self, room: int, epoch: int, dst_pages) -> bool:
        """Two-sided gate: may bytes for (room, epoch) land in these pages right now?"""
        rcv = self._receivers.get(room)
        if rcv is None or rcv.status is not S.TRANSFERRING or rcv.epoch != epoch:
            return False
        return all(self._owner.get(p) == (room, epoch) for p in dst_pages)

    def mark_landed(self, room: int, epoch: int, dst_pages, offset: int = 0, length: int = 0) -> None:
        """Bytes [offset, offset + length) of each of `dst_pages` (length 0: the whole page)
        of (room, epoch) landed (after `owner_ok`). A page is complete once distinct spans
        covering exactly its bytes are in, so a lost or duplicated span (the channel may do
        both) never completes it. Progress counts those spans' bytes, not pages: with
        layer-wise transfer a page's later spans land long after its first one, and they
        move the transfer just the same."""
        rcv = self._receivers.get(room)
        if rcv is not None and rcv.epoch == epoch:
            pb, nbytes, before = self.layout.page_bytes, 0, len(rcv.spans)
            span = (offset, length or pb)
            for p in dst_pages:
                spans = rcv.spans.setdefault(p, set()) if p in rcv.pages else None
                if spans is None or span in spans:
                    continue
                spans.add(span)
                nbytes += span[1]
                if sum(n for _, n in spans) == pb:
                    rcv.whole.add(p)
            if mutation.on("progress_counts_pages"):   # pages touched, not bytes: see core.mutation
                nbytes = len(rcv.spans) - before
            rcv.landed_bytes += nbytes
            if rcv.peer_address is not None:
                self._landed_from[rcv.peer_address] = self._landed_from.get(rcv.peer_address, 0) + nbytes
            rcv._maybe_done()

    def mark_dropped(self, src: str, nbytes: int) -> None:
        """A data frame of `nbytes` from peer `src` failed the owner check (late bytes of a
        room that ended): they land nowhere, but they crossed the link, so they count in
        the link's movement (Heartbeat.landed), not in any room's progress. A room queued
        behind a dead room's bytes is not cut while those drain."""
        if src in self._peers:
            self._landed_from[src] = self._landed_from.get(src, 0) + nbytes

    def seal_blob(self, dst: str, msg: wire.Message) -> bytes:
        """`msg` for `dst` as one byte string, sealed like a channel message: for a
        backend's own message path (e.g. a NIXL notification)."""
        return self._wire.blob(dst, msg)

    def open_blob(self, raw: bytes) -> Received | None:
        """The message of a `seal_blob` string, or None (dropped and counted, like a
        channel frame)."""
        return self._wire.open_blob(raw)

    # ---- jobs (fault hook in front of the backend) --------------------------------------
    def send_ack(self, dst: str, ack: wire.Ack) -> None:
        """D acknowledges a room's KV + aux (a backend may carry it on its data path)."""
        self.channel.send(dst, ack)

    def record_write(self, job: WriteJob, room_done: bool = False) -> None:
        """Count a completed write, once; `room_done`: the room's last."""
        if not job.recorded:
            job.recorded = True
            nbytes = sum(n for _, _, n in job.runs)
            self.bytes_written += nbytes
            self.bytes_ahead += 0 if job.aux is not None else nbytes
            self.write_seconds += self.clock.now() - job.started
        self.writes_done += room_done

    def start_job(self, job: WriteJob) -> None:
        job.started, job.begun = self.clock.now(), True
        job.fault = self.faults.transfer_fault()
        if job.fault == "fail":
            job.fail("injected transfer failure")
        elif job.fault is None:
            self.write_start(job)

    def progress_job(self, job: WriteJob) -> None:
        """Advance a pending write, unless its peer has been silent for the whole lease:
        the peer may already have declared this worker dead and released the pages (a
        one-sided quarantine ends then), and this iteration's watchdog fails the room
        right after the pump. Matters after a pause of both (a clock jump past the lease)."""
        heard = self._heard.get(job.peer.address)
        lease = self.lifecycle.heartbeat_interval * self.lifecycle.heartbeat_misses
        if job.fault is None and (heard is None or self.clock.now() - heard < lease):
            self.write_progress(job)

    def deliver_room_message(self, got: Received) -> None:
        """A room's Aux or Ack that reached this worker through the data path (NIXL's
        notifications) from a bootstrapped peer the backend has authenticated: it proves
        the peer alive, and goes to the room's endpoint as if it came over the channel."""
        self._heard[got.src] = self.clock.now()
        self._dispatch_room(got)

    def cancel_job(self, job: WriteJob) -> bool:
        if job.fault == "hang":
            return False  # a hung write can never confirm that it stopped
        return self.write_cancel(job)

    # ---- TransferManager -----------------------------------------------------------------
    def sender(self, room: int) -> CommonSender:
        if room in self._senders:
            raise ValueError(f"room {room} already has a sender")
        snd = self._senders[room] = CommonSender(self, room)
        _, ended = self._closed.pop(room, (0.0, None))
        if ended is not None and ended.status is S.FAILED:  # a room that ended stays ended
            snd._set_failed(ended.failure_reason or "peer_failed", ended.failure_detail)
        for rcv in self._early.pop(room, (0.0, []))[1]:
            self._dispatch(rcv)
        return snd

    def receiver(self, room: int) -> CommonReceiver:
        if room in self._receivers:
            raise ValueError(f"room {room} already has a receiver")
        rcv = self._receivers[room] = CommonReceiver(self, room)
        return rcv

    def peers(self) -> dict[str, PeerInfo]:
        return dict(self._peers)

    def heard(self) -> dict[str, float]:
        return self._heard

    def heartbeat(self, dst: str, rooms: dict[int, str], progress: dict[int, int] | None = None) -> None:
        self.hb_seq += 1
        self.channel.send(dst, wire.Heartbeat(self.worker_id, self.incarnation, self.hb_seq, rooms,
                                              progress or {}, self._landed_from.get(dst, 0)))

    def take_heartbeats(self) -> list[tuple[str, wire.Heartbeat]]:
        out, self._heartbeats = self._heartbeats, []
        return out

    def forget_peer(self, address: str) -> None:
        self._heard.pop(address, None)
        peer = self._peers.pop(address, None)
        self._asked.pop(address, None)
        self._await_peer.pop(address, None)
        if peer is not None:
            self._disconnect(peer)
        self.channel.forget(address)

    def progress(self) -> None:
        now = self.clock.now()
        expected: set[str] | None = None   # computed once, only if a non-peer speaks
        for rcv in self.channel.recv():
            if rcv.src not in self._peers and expected is None:
                expected = self._expected()
            reason = self._admit(rcv, expected or set())
            if reason:
                reject_input("control", reason, rcv.msg.KIND, rcv.src)
                continue
            if rcv.src in self._peers or rcv.src in (expected or ()):
                self._heard[rcv.src] = now
            self._dispatch(rcv)
        self._ask_unaware()
        for snd in list(self._senders.values()):
            snd.pump()
        self._pump_draining()
        self._reask()
        self._expire()

    def close(self) -> None:
        self._senders.clear()
        self._receivers.clear()
        self._draining.clear()
        self.close_backend()
        self.channel.close()

    # ---- admission ------------------------------------------------------------------------
    def _expected(self) -> set[str]:
        """Addresses this worker has a reason to hear from besides its peers: the P of each
        of its rooms, a D it holds a Destination of, an address it asked."""
        out = {r.peer_address for r in self._receivers.values() if r.peer_address}
        out.update(s.peer_address for s in self._senders.values() if s.peer_address)
        out.update(self._await_peer)
        out.update(self._asked)
        return out

    def _admit(self, r: Received, expected: set[str]) -> str | None:
        """-> None to accept a decoded frame, else the reason code it is dropped with."""
        msg = r.msg
        if isinstance(msg, (wire.Heartbeat, wire.BootstrapInfo)) and r.src not in self._peers \
                and r.src not in expected and not self._names_our_room(msg):
            return "unknown_peer"
        return None

    def _names_our_room(self, msg: wire.Message) -> bool:
        """A heartbeat from a sender that holds a room this worker holds (or recently
        ended: a quarantine waiting for Stopped) too: a peer that knows us while we do not
        know it (this worker restarted, or declared it dead)."""
        rooms = msg.rooms if isinstance(msg, wire.Heartbeat) else {}
        return any(room in self._senders or room in self._receivers or room in self._closed for room in rooms)

    def bad_destination(self, dest: wire.Destination, peer: PeerInfo) -> str:
        """Why D's destination pages cannot be written, or "" (checked before any write)."""
        if len(set(dest.dst_pages)) != len(dest.dst_pages):
            return "destination pages repeat"
        size = peer.endpoint.get("bytes")
        if isinstance(size, int) and dest.dst_pages and \
                (max(dest.dst_pages) + 1) * self.layout.page_bytes > size:
            return "destination pages lie outside the decode worker's pool"
        return ""

    # ---- bootstrap ------------------------------------------------------------------------
    def _identity(self, cls):
        return cls(self.worker_id, self.incarnation, self.layout.to_dict(), self.name, self.endpoint())

    def bootstrap(self, rcv: CommonReceiver) -> None:
        peer = self._peers.get(rcv.peer_address or "")
        if peer is not None:
            rcv.on_peer(peer)
        elif rcv.peer_address:
            self._ask_if_due(rcv.peer_address)

    def _ask(self, address: str) -> None:
        self._asked[address] = self.clock.now()
        self.channel.send(address, self._identity(wire.BootstrapQuery))

    def _ask_if_due(self, address: str) -> None:
        """At most one BootstrapQuery per peer per heartbeat interval."""
        if self.clock.now() - self._asked.get(address, -1e18) >= self.lifecycle.heartbeat_interval:
            self._ask(address)

    def _ask_unaware(self) -> None:
        """Ask to bootstrap every member that sealed a frame for an earlier incarnation of
        this worker (disagg.auth "other_incarnation"): it learns that this one restarted."""
        auth = self._wire.auth
        for address in auth.take_unaware() if auth is not None else ():
            self._ask_if_due(address)

    def _reask(self) -> None:
        """Resend BootstrapQuery while a receiver or a held Destination waits for a peer."""
        waiting = {r.peer_address for r in self._receivers.values() if r.status is S.BOOTSTRAPPING}
        for address in waiting | set(self._await_peer):
            if address and address not in self._peers:
                self._ask_if_due(address)

    def _learn(self, src: str, ident: wire.BootstrapQuery | wire.BootstrapInfo) -> PeerInfo | None:
        """-> the peer, or None when it cannot be kept (peer table full of live peers, or
        its data path cannot be connected): only that peer is refused."""
        old = self._peers.get(src)
        if old is not None and old.incarnation == ident.incarnation:
            return old
        if old is not None:
            self._disconnect(old)
        elif len(self._peers) >= MAX_PEERS and not self._evict_peer():
            reject_input("control", "too_many_peers", ident.KIND, src)
            return None
        peer = PeerInfo(src, ident.worker_id, ident.incarnation, ident.kv_layout,
                        ident.backend, ident.endpoint)
        self._peers[src] = peer
        if not self.layout.mismatches(peer.layout):
            try:
                self.connect(peer)
            except Exception as e:  # noqa: BLE001 - a bad peer endpoint refuses that peer only
                log.warning("cannot connect to peer %s (%s): %r", src, ident.worker_id, e)
                reject_input("control", "bad_endpoint", ident.KIND, src)
                self._peers.pop(src, None)
                for rcv in list(self._receivers.values()):
                    if rcv.peer_address == src:
                        rcv._fail("peer_failed", f"cannot connect to the prefill worker's data path: {e!r}"[:200])
                return None
        return peer

    def _disconnect(self, peer: PeerInfo) -> None:
        try:
            self.disconnect(peer)
        except Exception as e:  # noqa: BLE001 - a peer that is already gone
            log.warning("disconnecting peer %s failed: %r", peer.address, e)

    def _evict_peer(self) -> bool:
        """Forget the least recently heard peer that no live room uses; False if none."""
        busy = self._expected()
        idle = [a for a in self._peers if a not in busy]
        if not idle:
            return False
        self.forget_peer(min(idle, key=lambda a: self._heard.get(a, float("-inf"))))
        return True

    # ---- dispatch -------------------------------------------------------------------------
    def _dispatch(self, r: Received) -> None:
        msg = r.msg
        if isinstance(msg, wire.BootstrapQuery):
            if self.layout.mismatches(msg.kv_layout):
                reject_input("control", "bad_layout", msg.KIND, r.src)
            elif self._learn(r.src, msg) is None:
                return
            self.channel.send(r.src, self._identity(wire.BootstrapInfo))  # D fails a mismatch itself
            if r.src not in self._peers:
                return
        elif isinstance(msg, wire.BootstrapInfo):
            peer = self._learn(r.src, msg)
            if peer is None:
                return
            for rcv in list(self._receivers.values()):
                if rcv.peer_address == r.src:
                    rcv.on_peer(peer)
        elif isinstance(msg, wire.Heartbeat):
            self._on_heartbeat(r.src, msg)
        elif isinstance(msg, (wire.Destination, wire.Ack, wire.Notice, wire.Aux, wire.Stopped)):
            self._dispatch_room(r)
        else:
            self.on_data(r)
        if isinstance(msg, (wire.BootstrapQuery, wire.BootstrapInfo)):
            self._asked.pop(r.src, None)
            for held in self._await_peer.pop(r.src, []):
                self._dispatch_room(held)


    def _dispatch_room(self, r: Received) -> None:
        msg = r.msg
        room = msg.room  # type: ignore[attr-defined]
        snd, rcv = self._senders.get(room), self._receivers.get(room)
        if isinstance(msg, wire.Destination):
            if r.src not in self._peers and snd is None and room not in self._closed:
                self._buffer_early(room, r)  # replayed once the room's leg arrives
            elif r.src not in self._peers:  # e.g. this worker restarted: learn D first
                held = self._await_peer.setdefault(r.src, [])
                if len(held) < 64:
                    held.append(r)
                self._ask_if_due(r.src)
            elif snd is not None:
                snd.init(msg, r.src)
            elif room in self._closed:
                self._closed[room][1].init(msg, r.src)  # a failed tombstone answers with a Notice
            elif (notice := self._early_failure(room, r.src, msg.epoch)) is not None:
                self._stop_unheard(room, notice, msg, r.src)
            else:
                self._buffer_early(room, r)
        elif isinstance(msg, wire.Ack) and snd is not None:
            snd.on_ack(msg)
        elif isinstance(msg, wire.Notice):
            if snd is not None:
                snd.on_notice(msg)
            if rcv is not None:
                rcv.on_notice(msg)
            if snd is None and rcv is None and room not in self._closed:
                self._buffer_early(room, r)
        elif isinstance(msg, wire.Aux) and rcv is not None and not self.faults.hit(self.faults.spec.ignore_aux):
            rcv.on_aux(msg)
        elif isinstance(msg, wire.Stopped) and rcv is not None:
            rcv.on_stopped(msg)

    def _early_failure(self, room: int, src: str, epoch: int) -> wire.Notice | None:
        """The failure Notice `src` sent for (room, epoch) before this worker got the room."""
        for held in self._early.get(room, (0.0, []))[1]:
            msg = held.msg
            if isinstance(msg, wire.Notice) and held.src == src and msg.epoch in (epoch, 0):
                return msg
        return None

    def _stop_unheard(self, room: int, notice: wire.Notice, dest: wire.Destination, src: str) -> None:
        """D ended (room, epoch) before P got the room's leg and asks (Notice, then the
        Destination) whether P may still write. P never wrote into it, so it answers Stopped
        at once, and keeps a failed tombstone for the tombstone TTL: the leg, should it
        still come, starts failed and never writes into pages D has released."""
        self._early.pop(room, None)
        snd = CommonSender(self, room)
        snd._set_failed(peer_reason(notice), f"decode: {notice.reason}")
        snd.init(dest, src)   # a failed sender answers Notice + Stopped
        snd.stopped_sent = True
        self._tombstone(snd)

    def _buffer_early(self, room: int, r: Received) -> None:
        """A message for a room this worker has not been given yet (the router sends to P
        and D at once). Kept for the bootstrap timeout, then dropped."""
        if room not in self._early and len(self._early) >= MAX_EARLY_ROOMS:
            reject_input("control", "too_many_early", r.msg.KIND, r.src)
            return
        expiry, msgs = self._early.get(room, (self.clock.now() + self.lifecycle.bootstrap_timeout, []))
        if len(msgs) < 16:
            msgs.append(r)
        self._early[room] = (expiry, msgs)

    def _on_heartbeat(self, src: str, hb: wire.Heartbeat) -> None:
        self._heartbeats.append((src, hb))
        if src not in self._peers:
            self._ask_if_due(src)  # a peer that knows us but we don't know (we restarted)
        for room, phase in hb.rooms.items():
            if phase == wire.QUARANTINE_PHASE and room in self._closed:
                snd = self._closed[room][1]
                if snd.stopped_sent:
                    snd._send_stopped()  # the first Stopped may have been lost

    # ---- room ownership and teardown ---------------------------------------------------------
    def own_pages(self, rcv: CommonReceiver) -> None:
        for p in rcv.pages:
            self._owner[p] = (rcv.room, rcv.epoch)  # type: ignore[assignment]

    def close_receiver(self, rcv: CommonReceiver) -> None:
        if self._receivers.get(rcv.room) is not rcv:
            return
        del self._receivers[rcv.room]
        for p in rcv.pages:
            if self._owner.get(p) == (rcv.room, rcv.epoch):
                del self._owner[p]

    def close_sender(self, snd: CommonSender) -> None:
        if self._senders.get(snd.room) is not snd:
            return
        del self._senders[snd.room]
        if snd.status is S.FAILED and not snd.stopped_sent:
            self._draining.append(snd)
        self._tombstone(snd)

    def _tombstone(self, snd: CommonSender) -> None:
        ttl = self.lifecycle.bootstrap_timeout + self.lifecycle.transfer_timeout + self.lifecycle.quarantine_grace
        self._closed.pop(snd.room, None)  # re-insert at the end: the dict stays in expiry order
        self._closed[snd.room] = (self.clock.now() + ttl, snd)

    def _pump_draining(self) -> None:
        for snd in self._draining:
            snd.pump()
        self._draining = [s for s in self._draining if not s.stopped_sent]

    def _expire(self) -> None:
        """Both dicts are in expiry order (one TTL each, insertion order), so this stops at
        the first live entry: O(expired) per iteration, not O(entries)."""
        now = self.clock.now()
        for table in (self._early, self._closed):
            while table:
                room, (expiry, _) = next(iter(table.items()))
                if expiry > now:
                    break
                del table[room]

    # ---- introspection (debug rows, tests) ---------------------------------------------------
    def counts(self) -> dict[str, int]:
        return {"senders": len(self._senders), "receivers": len(self._receivers),
                "draining": len(self._draining), "owned_pages": len(self._owner),
                "early": len(self._early)}
