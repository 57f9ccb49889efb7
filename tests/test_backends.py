"""Data paths of the real transfer backends (shm, tcp, nixl), below the lifecycle: bytes land
exactly, stale tcp frames are dropped, shm segments are cleaned up, injected transfer
faults end the room, and a transfer works between two processes.

The lifecycle invariants on these backends are in test_disagg_invariants.py and
test_late_write.py (parametrized over every backend)."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from disagg_helpers import LAYOUT, checksum, opened, pattern
from kvrelay.core.config import TransferConfig
from kvrelay.disagg import wire
from kvrelay.disagg.auth import ChannelAuth
from kvrelay.disagg.transfer import TRANSFER_BACKENDS, create_manager
from kvrelay.disagg.transfer.base import TransferStatus as S, host_pool


def importable(name: str) -> bool:
    try:
        TRANSFER_BACKENDS.get(name)
        return True
    except ImportError:  # nixl is an optional extra
        return False


# Backends that move host memory (a device backend, cuda_ipc, runs in tests/test_gpu.py).
REAL = [b for b in TRANSFER_BACKENDS.names()
        if not b.startswith("fake") and importable(b) and "cpu" in TRANSFER_BACKENDS.get(b).memory]
PB = LAYOUT.page_bytes
REAL_TIME_LIMIT = 30.0  # seconds of wall time any pump loop may take before the test fails


@pytest.fixture(params=REAL)
def backend(request):
    return request.param


class Pair:
    """A P and a D manager on one backend in this process, pumped together."""

    def __init__(self, backend: str, num_pages: int = 16, p_faults: str | None = None,
                 key: bytes | None = None) -> None:
        """`key`: both managers seal and verify every frame with it (a cluster key's
        control derivation)."""
        self.p = create_manager(backend, LAYOUT, TransferConfig(transfer_backend=backend, fault_spec=p_faults),
                                auth=ChannelAuth(key) if key else None)
        self.d = create_manager(backend, LAYOUT, TransferConfig(transfer_backend=backend),
                                auth=ChannelAuth(key) if key else None)
        self.ppool = host_pool(self.p, num_pages)
        self.dpool = host_pool(self.d, num_pages)

    def pump_until(self, cond) -> bool:
        deadline = time.monotonic() + REAL_TIME_LIMIT
        while not cond():
            if time.monotonic() > deadline:
                return False
            self.p.progress()
            self.d.progress()
        return True

    def rendezvous(self, room: int, dst_pages: list[int], epoch: int):
        rcv, snd = self.d.receiver(room), self.p.sender(room)
        rcv.init(self.p.address)
        assert self.pump_until(lambda: rcv.poll() is not S.BOOTSTRAPPING)
        rcv.send_metadata(dst_pages, epoch)
        assert self.pump_until(lambda: snd.poll() is not S.BOOTSTRAPPING)
        return snd, rcv

    def fill(self, pages: list[int], seed: int) -> bytes:
        data = pattern(seed, len(pages) * PB)
        for i, p in enumerate(pages):
            self.ppool[p * PB:(p + 1) * PB] = data[i * PB:(i + 1) * PB]
        return data

    def d_bytes(self, pages) -> bytes:
        return b"".join(bytes(self.dpool[p * PB:(p + 1) * PB]) for p in pages)

    def close(self) -> None:
        self.p.close()
        self.d.close()


def assert_idle(pair: Pair) -> None:
    for m in (pair.p, pair.d):
        c = m.counts()
        assert c["senders"] == c["receivers"] == c["owned_pages"] == c["draining"] == 0, c


# ---- bytes land exactly --------------------------------------------------------------------

@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["plain", "keyed"])
@pytest.mark.parametrize("src,dst", [
    ([0, 1, 2, 3], [4, 5, 6, 7]),            # one run
    ([9, 3, 4, 12, 0], [1, 2, 3, 15, 8]),    # scattered: several runs on both sides
])
def test_bytes_land_exactly(backend, src, dst, key):
    pair = Pair(backend, key=key)
    try:
        data = pair.fill(src, seed=11)
        untouched = [p for p in range(16) if p not in dst]
        before = checksum(pair.d_bytes(untouched))
        snd, rcv = pair.rendezvous(1, dst, epoch=3)
        snd.send(src, wire.Aux(0, 0, first_token=42, logprob=-1.5, top_logprobs=((42, -1.5), (7, -2.0)),
                               prompt_tokens=17))
        assert pair.pump_until(lambda: snd.poll() is S.SUCCESS and rcv.poll() is S.SUCCESS)
        assert checksum(pair.d_bytes(dst)) == checksum(data)
        assert checksum(pair.d_bytes(untouched)) == before     # no byte outside the destination
        aux = rcv.aux()
        assert (aux.room, aux.epoch, aux.first_token, aux.prompt_tokens) == (1, 3, 42, 17)
        assert aux.top_logprobs == ((42, -1.5), (7, -2.0))
        snd.close()
        rcv.close()
        assert_idle(pair)
    finally:
        pair.close()


def test_tcp_splits_large_transfers_into_chunks(monkeypatch):
    from kvrelay.disagg.transfer import tcp
    monkeypatch.setattr(tcp, "CHUNK_BYTES", 3 * PB + 1)  # rounds down to 3 pages per message
    assert tcp.chunks([(0, 0, 8 * PB)], PB, tcp.CHUNK_BYTES) == [(0, 0, 3 * PB), (3 * PB, 3 * PB, 3 * PB),
                                                (6 * PB, 6 * PB, 2 * PB)]
    sent = []
    pair = Pair("tcp", num_pages=32)
    real_send = pair.p.channel.send
    pair.p.channel.send = lambda dst, msg, frames=(): sent.append(msg) or real_send(dst, msg, frames)
    try:
        src, dst = list(range(10)), list(range(20, 30))
        data = pair.fill(src, seed=5)
        snd, rcv = pair.rendezvous(1, dst, epoch=1)
        snd.send(src, wire.Aux(0, 0, first_token=1))
        assert pair.pump_until(lambda: rcv.poll() is S.SUCCESS)
        assert pair.d_bytes(dst) == data
        kv = [m for m in sent if isinstance(m, tcp.TcpKV)]
        assert [(m.first_page, m.num_pages) for m in kv] == [(20, 3), (23, 3), (26, 3), (29, 1)]
        assert isinstance(sent[-1], wire.Aux)              # aux after every KV message
        snd.close()
        rcv.close()
    finally:
        pair.close()


# ---- tcp: D checks (room, epoch) before copying ----------------------------------------------

def drain(pair: Pair) -> None:
    """Pump D until a heartbeat sent after everything else arrives: the channel keeps order
    between two workers, so every earlier frame has been judged by then."""
    pair.d.take_heartbeats()
    pair.p.heartbeat(pair.d.address, {})
    assert pair.pump_until(lambda: pair.d.take_heartbeats() != [])


def test_tcp_drops_stale_and_foreign_frames():
    from kvrelay.disagg.transfer.tcp import TcpKV
    pair = Pair("tcp")
    try:
        dst = [4, 5]
        snd, rcv = pair.rendezvous(1, dst, epoch=7)
        pair.dpool[4 * PB:6 * PB] = pattern(99, 2 * PB)
        before = checksum(pair.d_bytes(range(16)))
        junk = pattern(13, 2 * PB)
        frames = [
            TcpKV(1, 6, 4, 2),    # old epoch of the right room
            TcpKV(2, 7, 4, 2),    # another room, same epoch
            TcpKV(1, 7, 8, 2),    # right (room, epoch), pages it does not own
            TcpKV(1, 7, 5, 2),    # partly owned: page 6 is not the room's
            TcpKV(1, 7, 4, 3),    # frame shorter than the pages it claims
        ]
        for hdr in frames:
            pair.p.channel.send(pair.d.address, hdr, [junk])
        spans = [
            (TcpKV(1, 7, 4, 2, PB - 8, 16), pattern(14, 32)),   # a span past its page's end
            (TcpKV(1, 7, 4, 2, 0, 16), pattern(14, 24)),        # a frame shorter than its spans
        ]
        for hdr, data in spans:
            pair.p.channel.send(pair.d.address, hdr, [data])
        frames += [hdr for hdr, _ in spans]
        drain(pair)
        assert pair.d.dropped_frames == len(frames)
        assert checksum(pair.d_bytes(range(16))) == before
        assert rcv.spans == {}
        rcv.abort("aborted")
        rcv.close()                              # closed: even the right header is dropped now
        pair.p.channel.send(pair.d.address, TcpKV(1, 7, 4, 2), [junk])
        drain(pair)
        assert pair.d.dropped_frames == len(frames) + 1
        assert checksum(pair.d_bytes(range(16))) == before
        snd.close()
    finally:
        pair.close()


# ---- shm: segments ---------------------------------------------------------------------------

def shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("kvrelay_")}


def test_shm_segments_are_unlinked_on_close():
    before = shm_files()
    pair = Pair("shm")
    mine = {pair.p.segment.name.lstrip("/"), pair.d.segment.name.lstrip("/")}
    try:
        assert mine <= shm_files()
        snd, rcv = pair.rendezvous(1, [0, 1], epoch=1)   # P attaches D's segment
        assert pair.d.address in pair.p._attached
        pair.p.close()                                    # an attacher never unlinks the owner's
        assert pair.d.segment.name.lstrip("/") in shm_files()
    finally:
        pair.d.close()
    assert shm_files() == before


def test_shm_pool_larger_than_dev_shm_fails_loudly(monkeypatch):
    from kvrelay.disagg.transfer import shm

    class Tiny:
        f_bavail, f_frsize = 1, 4096
    monkeypatch.setattr(shm.os, "statvfs", lambda path: Tiny())
    with opened("shm") as m, pytest.raises(RuntimeError, match="shm-size"):
        host_pool(m, 16)


def test_shm_unattachable_peer_fails_the_write():
    pair = Pair("shm")
    try:
        snd, rcv = pair.rendezvous(1, [0], epoch=1)
        pair.p.disconnect(pair.p.peers()[pair.d.address])  # as if D's segment were elsewhere
        pair.p._attached[pair.d.address] = "cannot attach shm segment x: not on this host"
        snd.send([3], wire.Aux(0, 0, first_token=1))
        assert snd.poll() is S.FAILED and snd.failure_reason == "transfer_error"
        assert "not on this host" in snd.failure_detail
        assert pair.pump_until(lambda: rcv.poll() is S.FAILED)  # D told by a Notice
        snd.close()
        rcv.close()
    finally:
        pair.close()


# ---- fault hooks on every backend ------------------------------------------------------------

def test_injected_transfer_failure_ends_both_sides(backend):
    pair = Pair(backend, p_faults="fail_transfer=1")
    try:
        snd, rcv = pair.rendezvous(1, [2, 3], epoch=1)
        snd.send([0, 1], wire.Aux(0, 0, first_token=1))
        assert snd.poll() is S.FAILED and snd.failure_reason == "transfer_error"
        assert pair.pump_until(lambda: rcv.poll() is S.FAILED)
        assert rcv.failure_reason == "transfer_error"                # one event, one reason on both sides
        assert pair.pump_until(lambda: not rcv.may_still_write())  # P confirmed Stopped
        snd.close()
        rcv.close()
        assert_idle(pair)
    finally:
        pair.close()


def test_hung_transfer_never_completes_and_abort_fails_it(backend):
    pair = Pair(backend, p_faults="hang_transfer=1")
    try:
        snd, rcv = pair.rendezvous(1, [2, 3], epoch=1)
        snd.send([0, 1], wire.Aux(0, 0, first_token=1))
        for _ in range(200):
            pair.p.progress()
            pair.d.progress()
        assert snd.poll() is S.TRANSFERRING and rcv.poll() is S.TRANSFERRING
        snd.abort("aborted")
        assert snd.poll() is S.FAILED
        assert pair.pump_until(lambda: rcv.poll() is S.FAILED)
        assert rcv.failure_reason == "aborted"
        assert rcv.may_still_write() == pair.d.one_sided  # a hung write never confirms a stop
        for _ in range(50):
            pair.p.progress()
        assert snd.poll() is S.FAILED                     # always, after abort
        snd.close()
        rcv.close()
    finally:
        pair.close()


# ---- two processes ---------------------------------------------------------------------------

def _decode_process(backend: str, prefill_address: str, dst: list[int], out, done) -> None:
    """D in its own process: rendezvous, receive, report the checksum, linger for the ack."""
    d = create_manager(backend, LAYOUT, TransferConfig(transfer_backend=backend))
    pool = host_pool(d, 16)
    rcv = d.receiver(1)
    rcv.init(prefill_address)
    deadline = time.monotonic() + REAL_TIME_LIMIT
    sent = False
    while rcv.poll() not in (S.SUCCESS, S.FAILED) and time.monotonic() < deadline:
        d.progress()
        if not sent and rcv.poll() is S.WAITING:
            rcv.send_metadata(dst, 5)
            sent = True
    aux = rcv.aux()
    out.put((rcv.poll().name, checksum(b"".join(bytes(pool[p * PB:(p + 1) * PB]) for p in dst)),
             aux.first_token if aux else None, d.endpoint().get("segment")))
    while not done.is_set() and time.monotonic() < deadline:
        d.progress()  # keep answering (a lost ack is re-sent on a resent aux)
    rcv.close()
    d.close()


def test_transfer_between_two_processes(backend):
    ctx = multiprocessing.get_context("spawn")
    p = create_manager(backend, LAYOUT, TransferConfig(transfer_backend=backend))
    ppool = host_pool(p, 16)
    src, dst = [1, 2, 3, 8], [10, 11, 0, 5]
    data = pattern(77, len(src) * PB)
    for i, page in enumerate(src):
        ppool[page * PB:(page + 1) * PB] = data[i * PB:(i + 1) * PB]
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_decode_process, args=(backend, p.address, dst, out, done))
    child.start()
    try:
        snd = p.sender(1)
        deadline = time.monotonic() + 2 * REAL_TIME_LIMIT  # includes the child's start-up
        while snd.poll() is S.BOOTSTRAPPING and time.monotonic() < deadline:
            p.progress()
        snd.send(src, wire.Aux(0, 0, first_token=9))
        while snd.poll() is S.TRANSFERRING and time.monotonic() < deadline:
            p.progress()
        assert snd.poll() is S.SUCCESS, (snd.failure_reason, snd.failure_detail)
        status, digest, token, segment = out.get(timeout=REAL_TIME_LIMIT)
        assert (status, digest, token) == ("SUCCESS", checksum(data), 9)
        snd.close()
    finally:
        done.set()
        child.join(REAL_TIME_LIMIT)
        if child.is_alive():
            child.kill()
        p.close()
    assert child.exitcode == 0
    if backend == "shm":
        assert segment and segment.lstrip("/") not in shm_files()
