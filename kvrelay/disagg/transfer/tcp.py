"""`tcp`: any host, two-sided, over the control channel's zmq sockets.

P sends the KV as TcpKV messages: a JSON header naming (room, epoch, a run of consecutive
destination pages) and one raw frame holding those pages' bytes, a zero-copy view of P's
pool (a device pool's pages are staged through host memory first). Aux follows on the same socket, so it arrives after every KV message. D copies a
frame into its pool only if (room, epoch) still owns every destination page at that
moment; otherwise the frame is dropped, so a late or foreign frame never lands.

Invariants:
- A message carries at most CHUNK_BYTES (whole pages, or one span of each of its pages; a
  page or a span larger than that is sent alone): D checks ownership per chunk and
  copies chunk i while chunk i + 1 is still on the wire, and zmq never allocates one huge
  receive buffer.
- zmq hands D a message only once all of it has arrived, and only arrivals renew P's lease
  and count as progress in D's heartbeats. So one chunk must cross well within a lease on
  the slowest link served: 128 KiB takes 0.5 s at 2 Mbit/s (the lease is 3 s by default).
  A page bigger than that is still sent whole.
- While the socket is full the write stays pending; each chunk it takes counts in
  `job.bytes_sent`, so a write that drains (or whose earlier chunks land at D) is never
  failed for its length, and one whose socket never drains fails within the lease.
- P's source pages stay pinned until ack or a terminal failure (the lifecycle's rule), so
  a zero-copy frame never reads pages of another request while the room is live; after a
  failure, whatever bytes still go out are dropped by D's ownership check.
- D's control socket refuses any frame larger than the largest chunk (`max_data_frame`)
  or a control header (wire.MAX_FRAME_BYTES), whichever is bigger: zmq drops the sending
  connection when the frame's length arrives, before buffering its bytes. A TcpKV header
  is validated like every wire message; a data frame whose length does not match its
  header, or whose pages lie outside the pool, is dropped and counted in
  kvrelay_rejected_input_total{surface="transfer",reason="bad_frame"}.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from kvrelay.disagg import wire
from kvrelay.disagg.channel import Received
from kvrelay.disagg.transfer.base import WriteJob
from kvrelay.disagg.transfer.common import CommonManager
from kvrelay.obs.metrics import reject_input

CHUNK_BYTES = 128 << 10


SpanBytes = Annotated[int, Field(strict=True, ge=0, le=wire.MAX_FRAME_BYTES)]


@wire.message("TcpKV")
@dataclass(frozen=True)
class TcpKV(wire.Message):
    """P -> D data header; one raw frame follows: the bytes of destination pages
    first_page .. first_page + num_pages - 1, whole (span_length 0), or only bytes
    [span_offset, span_offset + span_length) of each, one after the other (layer-wise
    transfer: some layers of each page)."""
    room: wire.Room
    epoch: wire.Epoch
    first_page: wire.PageId
    num_pages: Annotated[int, Field(strict=True, ge=1, le=wire.MAX_PAGES_PER_MSG)]
    span_offset: SpanBytes = 0
    span_length: SpanBytes = 0

    def check(self) -> None:
        if self.first_page + self.num_pages - 1 > wire.MAX_PAGE_ID:
            raise wire.WireError("bad_field", "pages beyond the largest page id")
        if self.span_offset and not self.span_length:
            raise wire.WireError("bad_field", "a span offset without a span length")

    @property
    def dst_pages(self) -> range:
        return range(self.first_page, self.first_page + self.num_pages)


def chunks(runs: list[tuple[int, int, int]], page_bytes: int, limit: int) -> list[tuple[int, int, int]]:
    """Split (src off, dst off, len) runs into pieces of at most `limit` bytes (at least
    one page), cut at page boundaries."""
    step = max(page_bytes, limit - limit % page_bytes)
    return [(s + k, d + k, min(step, n - k)) for s, d, n in runs for k in range(0, n, step)]


@dataclass
class Piece:
    """One TcpKV message of a write: `reads` ((src offset, length) of P's pool) make its
    frame, for destination pages [first_page, first_page + num_pages), whole or the span
    [offset, offset + length) of each (length 0: whole)."""
    reads: list[tuple[int, int]]
    first_page: int
    num_pages: int
    offset: int = 0
    length: int = 0

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.reads)


def pieces(runs: list[tuple[int, int, int]], page_bytes: int, limit: int) -> list[Piece]:
    """The messages that carry `runs`: whole pages in chunks of at most `limit` bytes; a
    run inside one page (`kvlayout.part_runs` makes one per page and span) joins the
    previous piece when it is the same span of the next page and the frame stays within
    `limit`. A run that is neither whole pages nor inside one page raises ValueError."""
    out: list[Piece] = []
    for s, d, n in runs:
        page, off = divmod(d, page_bytes)
        if off == 0 and n % page_bytes == 0:
            out += [Piece([(s2, n2)], d2 // page_bytes, n2 // page_bytes)
                    for s2, d2, n2 in chunks([(s, d, n)], page_bytes, limit)]
            continue
        if off + n > page_bytes:
            raise ValueError(f"a run of {n} bytes at {d} crosses a page boundary")
        last = out[-1] if out else None
        if (last is not None and last.length == n and last.offset == off and last.first_page + last.num_pages == page
                and last.nbytes + n <= limit):
            last.reads.append((s, n))
            last.num_pages += 1
        else:
            out.append(Piece([(s, n)], page, 1, off, n))
    return out


class TcpManager(CommonManager):
    name = "tcp"
    one_sided = False
    writes_within_pages = True   # a TcpKV carries whole pages or one span of each (layer-wise transfer)
    memory = ("cpu", "cuda")   # device pages go through host buffers (KVRegion.stage)
    dropped_frames = 0  # KV messages refused by the ownership check or malformed (a counter)

    def max_data_frame(self) -> int:
        pb = self.layout.page_bytes
        return max(pb, CHUNK_BYTES - CHUNK_BYTES % pb)  # the biggest piece chunks() cuts

    # ---- P side ----------------------------------------------------------------------------
    def write_start(self, job: WriteJob) -> None:
        try:
            job.handle = deque(pieces(job.runs, self.layout.page_bytes, CHUNK_BYTES))
        except ValueError as e:
            job.fail(str(e))
            return
        self.write_progress(job)

    def write_progress(self, job: WriteJob) -> None:
        """Queue as many pieces as the socket takes now; the rest waits for the next call."""
        pending = job.handle
        if not isinstance(pending, deque) or self.region is None:
            return
        while pending:
            piece = pending[0]
            header = TcpKV(job.room, job.epoch, piece.first_page, piece.num_pages, piece.offset, piece.length)
            if len(piece.reads) == 1:
                frame = self.read_pool(*piece.reads[0])   # zero-copy from a host pool
            else:
                frame = b"".join(bytes(self.read_pool(s, n)) for s, n in piece.reads)
            if not self.channel.send(job.peer.address, header, [frame]):
                return  # socket full (high-water mark): retry on the next progress()
            pending.popleft()
            job.bytes_sent += piece.nbytes
        job.handle = None
        job.finish()

    def write_cancel(self, job: WriteJob) -> bool:
        job.handle = None
        return True  # two-sided: D's ownership check stops anything already queued

    # ---- D side ----------------------------------------------------------------------------
    def on_data(self, received: Received) -> None:
        msg = received.msg
        if not isinstance(msg, TcpKV) or self.region is None:
            return
        pb, pages = self.layout.page_bytes, msg.dst_pages
        off, length = msg.span_offset, msg.span_length or pb
        data = memoryview(received.frames[0]) if len(received.frames) == 1 else memoryview(b"")
        if len(data) != len(pages) * length or pages.stop * pb > self.region.nbytes or off + length > pb:
            self.dropped_frames += 1
            reject_input("transfer", "bad_frame", f"{len(data)} bytes for pages {pages}, span {off}+{length}",
                         received.src)
            return
        if not self.owner_ok(msg.room, msg.epoch, pages):
            self.dropped_frames += 1  # late or foreign bytes never land
            self.mark_dropped(received.src, len(data))
            return
        if length == pb:
            self.write_pool(pages.start * pb, data)
        else:
            for i, page in enumerate(pages):
                self.write_pool(page * pb + off, data[i * length:(i + 1) * length])
        self.mark_landed(msg.room, msg.epoch, pages, off, msg.span_length)
