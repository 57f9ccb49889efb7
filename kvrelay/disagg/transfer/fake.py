"""In-process, deterministic backends for simulation tests.

`FakeManager` is one-sided: P copies straight into D's pool (found through the shared
`InProcNetwork`), like shm or RDMA, so D must quarantine. `FakeTwoSidedManager` sends the
bytes as a data frame and D copies them in only after the (room, epoch) owner check, like
tcp. A write completes on the `write_iters`-th progress() after it starts, so the transfer
phase is observable; its bytes move (and count in `bytes_sent`) only then.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrelay.disagg import wire
from kvrelay.disagg.channel import InProcChannel, InProcNetwork, Received
from kvrelay.disagg.transfer.base import WriteJob
from kvrelay.disagg.transfer.common import CommonManager


@wire.message("FakeKV")
@dataclass(frozen=True)
class FakeKV(wire.Message):
    """P -> D data header of the two-sided fake: one raw frame follows, the concatenated
    bytes of `dst_pages` in order."""
    room: wire.Room
    epoch: wire.Epoch
    dst_pages: wire.PageIds


class FakeManager(CommonManager):
    name = "fake"
    one_sided = True

    def __init__(self, layout, transfer=None, *, network: InProcNetwork | None = None,
                 channel: InProcChannel | None = None, write_iters: int = 1, **kwargs) -> None:
        if channel is None:
            channel = (network or InProcNetwork()).channel()
        self.network = channel.network
        self.write_iters = write_iters
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

    def allocate_pool(self, num_pages: int) -> memoryview:
        pool = super().allocate_pool(num_pages)
        self._pools()[self.pool_id] = pool
        return pool

    def endpoint(self) -> dict:
        return {"pool": self.pool_id}

    def close_backend(self) -> None:
        self._pools().pop(self.pool_id, None)

    def write_start(self, job: WriteJob) -> None:
        job.handle = self.write_iters
        if job.handle <= 0:
            self._land(job)

    def write_progress(self, job: WriteJob) -> None:
        job.handle -= 1
        if job.handle <= 0:
            self._land(job)

    def write_cancel(self, job: WriteJob) -> bool:
        return True  # nothing is in flight between progress() calls

    def _land(self, job: WriteJob) -> None:
        dst = self._pools().get(job.peer.endpoint.get("pool", ""))
        if dst is None or self.pool is None:
            job.fail("peer pool is gone")
            return
        for s, d, n in job.runs:
            dst[d:d + n] = self.pool[s:s + n]
            job.bytes_sent += n
        job.finish()


class FakeTwoSidedManager(FakeManager):
    name = "fake-twosided"
    one_sided = False

    def _land(self, job: WriteJob) -> None:
        assert self.pool is not None
        pb = self.layout.page_bytes
        data = b"".join(bytes(self.pool[p * pb:(p + 1) * pb]) for p in job.src_pages)
        if self.channel.send(job.peer.address, FakeKV(job.room, job.epoch, job.dst_pages), [data]):
            job.bytes_sent += len(data)
            job.finish()
        else:
            job.fail("peer unreachable")

    def on_data(self, received: Received) -> None:
        msg = received.msg
        if not isinstance(msg, FakeKV) or self.pool is None:
            return
        data, pb = memoryview(received.frames[0]) if received.frames else memoryview(b""), self.layout.page_bytes
        if len(data) != len(msg.dst_pages) * pb:
            return  # malformed
        if not self.owner_ok(msg.room, msg.epoch, msg.dst_pages):
            return  # late or foreign bytes never land
        for i, p in enumerate(msg.dst_pages):
            self.pool[p * pb:(p + 1) * pb] = data[i * pb:(i + 1) * pb]
        self.mark_landed(msg.room, msg.epoch, msg.dst_pages)
