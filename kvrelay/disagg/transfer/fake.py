"""In-process, deterministic backends for simulation tests.

`FakeManager` is one-sided: P copies straight into D's pool (found through the shared
`InProcNetwork`), like shm or RDMA, so D must quarantine. `FakeTwoSidedManager` sends the
bytes as a data frame and D copies them in only after the (room, epoch) owner check, like
tcp. A write completes on the `write_iters`-th progress() after it starts, so the transfer
phase is observable; its bytes move (and count in `bytes_sent`) only then.

Knobs the simulation sets (the defaults keep the behaviour above):
    chunk_pages     >0: the bytes move in pieces of this many pages (of a job's runs cut at
                    destination page boundaries: a write ahead moves part of each), one piece per
                    progress() and at most one per `chunk_interval` seconds (a slow data
                    path): D sees a room's pages land a few at a time, as over tcp
    frame_pages     two-sided: >0: at most this many whole pages in one data frame (tcp cuts
                    its frames too, so that one crosses a slow link well within a lease)
    land_delay      one-sided: a piece, once posted, is in flight this many seconds before
                    it lands (an RDMA write on a busy fabric); a failed write confirms it
                    stopped (`write_cancel`) only once nothing of it is in flight
    on_land         on_land(pool_id, room, epoch, dst_pages) is called just before bytes of
                    (room, epoch) land in pool `pool_id`: the simulation's eye on the
                    no-late-write invariant
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvrelay.disagg import wire
from kvrelay.disagg.channel import InProcChannel, InProcNetwork, Received
from kvrelay.disagg.transfer.base import WriteJob, WriteState
from kvrelay.disagg.transfer.common import CommonManager


@wire.message("FakeKV")
@dataclass(frozen=True)
class FakeKV(wire.Message):
    """P -> D data header of the two-sided fake: one raw frame follows, the concatenated
    bytes of `dst_pages` in order, whole pages, or (`span_length` > 0) the span
    [span_offset, span_offset + span_length) of each."""
    room: wire.Room
    epoch: wire.Epoch
    dst_pages: wire.PageIds
    span_offset: wire.Count = 0
    span_length: wire.Count = 0


class FakeManager(CommonManager):
    name = "fake"
    one_sided = True
    writes_within_pages = True   # it lands any byte runs (layer-wise transfer)

    def __init__(self, layout, transfer=None, *, network: InProcNetwork | None = None,
                 channel: InProcChannel | None = None, write_iters: int = 1, **kwargs) -> None:
        if channel is None:
            channel = (network or InProcNetwork()).channel()
        self.network = channel.network
        self.write_iters = write_iters
        self.chunk_pages = 0          # 0: every page of a job moves at once
        self.chunk_interval = 0.0     # seconds between two pieces of one job
        self.frame_pages = 0          # two-sided: whole pages per data frame (0: a piece's all)
        self.land_delay = 0.0         # one-sided: seconds a posted piece is in flight
        self.on_land: Callable[[str, int, int, tuple[int, ...]], None] | None = None
        super().__init__(layout, transfer, channel=channel, **kwargs)

    @property
    def pool_id(self) -> str:
        """Where peers find this pool: per incarnation, so a restarted worker's new pool is
        never written by a peer that still holds the old one's (like a new shm segment)."""
        return f"{self.address}#{self.incarnation}"

    def _pools(self) -> dict[str, memoryview]:
        if not hasattr(self.network, "pools"):
            self.network.pools = {}  # type: ignore[attr-defined]
        return self.network.pools  # type: ignore[attr-defined]

    def register_kv(self, regions) -> None:
        super().register_kv(regions)
        self._pools()[self.pool_id] = self.pool

    def endpoint(self) -> dict:
        return {"pool": self.pool_id}

    def _flights(self) -> list[tuple[float, "FakeManager", WriteJob, int, int]]:
        """Pieces posted and not landed yet, of every worker on the network: (lands at,
        writer, job, first page, end). Whichever worker steps first after a piece is due
        lands it, as a NIC would without either CPU."""
        if not hasattr(self.network, "kv_in_flight"):
            self.network.kv_in_flight = []  # type: ignore[attr-defined]
        return self.network.kv_in_flight  # type: ignore[attr-defined]

    def close_backend(self) -> None:
        self._pools().pop(self.pool_id, None)
        flights = self._flights()
        flights[:] = [f for f in flights if f[1] is not self]   # a crashed writer's pieces are lost

    def progress(self) -> None:
        flights = self._flights()
        if flights and flights[0][0] <= self.clock.now():
            self._land_due(flights)
        super().progress()

    def write_start(self, job: WriteJob) -> None:
        # calls to wait, next unit, next piece at, pieces in flight, the units
        job.handle = [self.write_iters, 0, float("-inf"), 0, self._units(job)]
        if not job.handle[4]:
            job.finish()   # nothing left to write (every byte went ahead)
            return
        self.write_progress(job, first=True)

    def _units(self, job: WriteJob) -> list[tuple[int, list[tuple[int, int, int]]]]:
        """The job's runs cut at destination page boundaries and grouped by page, in run
        order: (destination page, its (src, dst, length) pieces). A unit is what moves
        as one "page" (chunk_pages counts units); a whole-page job has one per page."""
        pb, units = self.layout.page_bytes, []
        for s, d, n in job.runs:
            while n > 0:
                page = d // pb
                take = min(n, (page + 1) * pb - d)
                if not units or units[-1][0] != page:
                    units.append((page, []))
                units[-1][1].append((s, d, take))
                s, d, n = s + take, d + take, n - take
        return units

    def write_progress(self, job: WriteJob, first: bool = False) -> None:
        h = job.handle
        n = len(h[4])
        if not first:
            h[0] -= 1
        now = self.clock.now()
        if h[0] > 0 or h[1] == n or now < h[2]:
            return
        end = min(h[1] + self.chunk_pages, n) if self.chunk_pages else n
        if self.land_delay and self.one_sided:
            h[3] += 1
            self._flights().append((now + self.land_delay, self, job, h[1], end))
            job.bytes_sent += sum(k for _, pieces in h[4][h[1]:end] for _, _, k in pieces)
        elif not self._land_pages(job, h[1], end):
            return
        h[1], h[2] = end, now + self.chunk_interval
        self._maybe_done(job)

    def _maybe_done(self, job: WriteJob) -> None:
        h = job.handle
        if h[1] == len(h[4]) and h[3] == 0:
            job.finish()

    def _land_due(self, flights: list) -> None:
        now = self.clock.now()
        while flights and flights[0][0] <= now:   # in posting order: one land_delay for all
            _, writer, job, start, end = flights.pop(0)
            job.handle[3] -= 1
            if job.state is not WriteState.FAILED:
                writer._land_pages(job, start, end, counted=True)
            writer._maybe_done(job)

    def write_cancel(self, job: WriteJob) -> bool:
        return job.handle is None or job.handle[3] == 0  # stopped once nothing of it is in flight

    def _land_pages(self, job: WriteJob, start: int, end: int, counted: bool = False) -> bool:
        """Write units [start, end) of the job into the peer's pool; False if it failed."""
        units = job.handle[4][start:end]
        dst = self._pools().get(job.peer.endpoint.get("pool", ""))
        if dst is None or self.pool is None:
            job.fail("peer pool is gone")
            return False
        if self.on_land is not None:
            self.on_land(job.peer.endpoint["pool"], job.room, job.epoch, tuple(page for page, _ in units))
        for _, pieces in units:
            for s, d, k in pieces:
                dst[d:d + k] = self.pool[s:s + k]
                job.bytes_sent += 0 if counted else k
        return True


class FakeTwoSidedManager(FakeManager):
    """As tcp: units of whole pages go as one frame; a unit that is part of a page (a
    layer-wise write) goes as one frame per span, so D sees a page land in pieces."""
    name = "fake-twosided"
    one_sided = False
    writes_within_pages = True

    def _land_pages(self, job: WriteJob, start: int, end: int, counted: bool = False) -> bool:
        assert self.pool is not None
        pb, units = self.layout.page_bytes, job.handle[4][start:end]
        if all(len(pieces) == 1 and pieces[0][2] == pb for _, pieces in units):
            step = self.frame_pages or len(units)
            msgs = [(FakeKV(job.room, job.epoch, tuple(page for page, _ in units[i:i + step])),
                     b"".join(bytes(self.pool[s:s + k]) for _, pieces in units[i:i + step] for s, _, k in pieces))
                    for i in range(0, len(units), step)]
        else:
            msgs = [(FakeKV(job.room, job.epoch, (page,), d - page * pb, k), bytes(self.pool[s:s + k]))
                    for page, pieces in units for s, d, k in pieces]
        for msg, data in msgs:
            if not self.channel.send(job.peer.address, msg, [data]):
                job.fail("peer unreachable")
                return False
            job.bytes_sent += len(data)
        return True

    def on_data(self, received: Received) -> None:
        msg = received.msg
        if not isinstance(msg, FakeKV) or self.pool is None:
            return
        data, pb = memoryview(received.frames[0]) if received.frames else memoryview(b""), self.layout.page_bytes
        off, length = msg.span_offset, msg.span_length or pb
        if len(data) != len(msg.dst_pages) * length or off + length > pb:
            return  # malformed
        if not self.owner_ok(msg.room, msg.epoch, msg.dst_pages):
            self.mark_dropped(received.src, len(data))
            return  # late or foreign bytes never land
        if self.on_land is not None:
            self.on_land(self.pool_id, msg.room, msg.epoch, msg.dst_pages)
        for i, p in enumerate(msg.dst_pages):
            self.pool[p * pb + off:p * pb + off + length] = data[i * length:(i + 1) * length]
        self.mark_landed(msg.room, msg.epoch, msg.dst_pages, off, msg.span_length)
