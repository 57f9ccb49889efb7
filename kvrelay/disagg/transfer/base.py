"""The transfer plug-in point: a per-worker manager, a per-room sender (P) and receiver (D).

This layer moves page buffers only (no torch, except a device backend that imports it when
chosen). The engine allocates the KV pool and registers it (`register_kv`, a `KVRegion`);
pages follow `core.kvlayout`: page p is bytes [p * page_bytes, (p + 1) * page_bytes).

Contract shared by every backend (the lifecycle relies on each point):
- `poll()` never blocks and never does I/O; `TransferManager.progress()` is the only pump,
  called once per scheduler iteration.
- After `abort()`, `poll()` returns FAILED, always, on every backend.
- A FAILED sender or receiver has a `failure_reason` (a lifecycle reason code) and a
  `failure_detail`.
- Aux travels last: a receiver reaches SUCCESS only when aux has arrived and, on a
  two-sided backend, every destination page has landed. The receiver then acknowledges;
  the sender reaches SUCCESS only on that ack.
- A sender's source pages stay pinned until SUCCESS or a terminal failure; the caller
  releases them then, never earlier.
- No late write: a two-sided receiver accepts bytes only for pages whose current owner is
  exactly (room, epoch); a one-sided receiver's pages stay quarantined after a failure
  (`may_still_write()`) until P confirms Stopped (or the lifecycle declares P dead or the
  quarantine deadline passes).
- A pending write shows its progress: the backend bumps `WriteJob.bytes_sent` as it hands
  bytes off, so the lifecycle can tell a slow write from a hung one. A backend whose
  writes are opaque in flight (`opaque_writes`) cannot; then only --transfer-timeout
  bounds a write that never completes.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvrelay.core.kvlayout import KVLayout, KVRegion, PagePart
from kvrelay.disagg import wire

if TYPE_CHECKING:
    from kvrelay.disagg.channel import Received


class TransferStatus(enum.IntEnum):
    """Ordered: terminal states last."""
    BOOTSTRAPPING = 0  # P: no destination yet.  D: peer's endpoint not learned yet
    WAITING = 1        # P: destination known, send() not called.  D: ready for send_metadata()
    TRANSFERRING = 2   # P: writing / waiting for ack.  D: metadata sent, waiting for KV + aux
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self >= TransferStatus.SUCCESS


@dataclass(frozen=True)
class PeerInfo:
    """A bootstrapped peer: what its BootstrapQuery/BootstrapInfo said."""
    address: str       # its control-channel address
    worker_id: str
    incarnation: str
    layout: KVLayout
    backend: str
    endpoint: dict = field(default_factory=dict, hash=False, compare=False)


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"  # stopped: no byte of this job will land anymore


@dataclass(eq=False)
class WriteJob:
    """One room's KV write, P side. `runs` are (src offset, dst offset, length) byte runs
    from `kvlayout.paired_runs`. A backend drives `state` from PENDING to DONE or FAILED
    and adds to `bytes_sent` whatever it hands off on the way; `handle` is the backend's
    own bookkeeping."""
    room: int
    epoch: int
    peer: PeerInfo
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    runs: list[tuple[int, int, int]]
    state: WriteState = WriteState.PENDING
    detail: str = ""
    handle: Any = None
    fault: str | None = None  # injected: "hang" (never started, never stops) or "fail"
    started: float = 0.0      # manager clock when the write started
    begun: bool = False       # handed to the backend (`start_job`); a room's last write waits for those ahead
    recorded: bool = False    # counted in the manager's stats (`record_write`)
    aux: wire.Aux | None = None   # what D gets once every byte landed
    aux_in_band: bool = False     # the backend delivers `aux` itself, after the data (NIXL notif)
    bytes_sent: int = 0           # bytes handed off so far (queued to a socket, copied); grows while it moves

    def finish(self) -> None:
        if self.state is WriteState.PENDING:
            self.state = WriteState.DONE

    def fail(self, detail: str) -> None:
        if self.state is WriteState.PENDING:
            self.state, self.detail = WriteState.FAILED, detail


class KVSender(ABC):
    """P side, one per room. BOOTSTRAPPING until D's Destination arrives (the manager calls
    `init`), WAITING until `send`, TRANSFERRING until D's ack (SUCCESS) or a failure."""
    room: int

    @abstractmethod
    def init(self, destination: wire.Destination, src: str) -> None:
        """Called by the manager when D's Destination for this room arrives from `src`.
        Duplicates of the same (room, epoch) are ignored."""

    @abstractmethod
    def send(self, src_pages: list[int], aux: wire.Aux, parts: list[PagePart] | None = None) -> None:
        """Start writing `src_pages` of the local pool into the destination pages, then send
        `aux` (its room/epoch are filled in here) once every byte has landed, those written
        ahead included. `parts`: only these parts of the pages (what `send_ahead` left);
        None: every page, whole. Valid in WAITING; a no-op once FAILED. A page-count
        mismatch, or a part outside the pages, fails with invalid_request."""

    @abstractmethod
    def send_ahead(self, src_pages: list[int], part: PagePart) -> None:
        """While the room's prompt is computing (WAITING): start writing `part` of the
        pages computed so far, `src_pages` (positions 0.. of the room's page list), into
        the destination pages at the same positions. Only where the manager
        `writes_within_pages`. The bytes must be final: nothing rewrites them but a later
        write of the same room. Its progress and failure count as the room's (a failed
        write ahead fails the sender); `send`'s own write starts once every write ahead
        is done. A no-op once FAILED."""

    @abstractmethod
    def poll(self) -> TransferStatus:
        """Never blocks. FAILED after abort(), always."""

    @abstractmethod
    def abort(self, reason: str, detail: str = "") -> None:
        """Fail now with `reason`, tell D (Notice), stop writing. Idempotent."""

    @abstractmethod
    def resend(self) -> None:
        """Re-send the last control message this sender owes D (Aux); idempotent for D."""

    @abstractmethod
    def close(self) -> None:
        """The lifecycle is done with this room (source pages released by the caller).
        A failed sender with a write still in flight keeps cancelling it inside the manager
        and sends Stopped once no byte can land anymore."""

    failure_reason: str | None
    failure_detail: str
    aux_sent: bool             # every byte landed and aux went out: only D's ack is missing
    bytes_sent: int            # of this room's write so far (WriteJob.bytes_sent); 0 before send()
    peer_address: str | None   # D's control address once the destination is known
    epoch: int | None
    dest: wire.Destination | None  # D's destination once init() ran


class KVReceiver(ABC):
    """D side, one per room. `init` starts the rendezvous; WAITING once P's endpoint is known
    and layouts match; `send_metadata` -> TRANSFERRING; SUCCESS when KV + aux are in."""
    room: int

    @abstractmethod
    def init(self, prefill_address: str) -> None:
        """Learn P's endpoint (BootstrapQuery, resent until answered) and check that the
        layouts match; a mismatch fails with invalid_request naming the fields."""

    @abstractmethod
    def send_metadata(self, page_ids: list[int], epoch: int) -> None:
        """Tell P where to write: these pages, tagged `epoch`. Valid in WAITING."""

    @abstractmethod
    def poll(self) -> TransferStatus:
        """Never blocks. FAILED after abort(), always."""

    @abstractmethod
    def aux(self) -> wire.Aux | None:
        """The aux data once SUCCESS, else None."""

    @abstractmethod
    def abort(self, reason: str, detail: str = "") -> None:
        """Fail now with `reason` and tell P (Notice). Idempotent."""

    @abstractmethod
    def resend(self) -> None:
        """Re-send the Destination (after send_metadata); idempotent for P."""

    @abstractmethod
    def ask_stopped(self) -> None:
        """While `may_still_write()`: send the failure Notice again, then the Destination.
        P ends the room on the Notice (same channel, so it comes first) and answers the
        Destination of an ended room with Stopped: a lost Destination or Stopped cannot
        keep the pages quarantined until the backstop."""

    @abstractmethod
    def may_still_write(self) -> bool:
        """True while P might still write into this room's pages: one-sided backend, the
        room failed after send_metadata, and P has not confirmed Stopped."""

    @abstractmethod
    def close(self) -> None:
        """The lifecycle is done with this room and is about to release its pages: every
        later byte for (room, epoch) is dropped."""

    def progress(self) -> int:
        """Bytes of this room that have landed here so far: grows with every data frame
        accepted (a whole page or, layer-wise, one span of a page), never shrinks. 0
        where the receiver cannot see its bytes arrive (one-sided backends: there P's
        write completing means every byte landed)."""
        return 0

    failure_reason: str | None
    failure_detail: str
    peer_address: str | None   # P's control address


class TransferManager(ABC):
    """One per worker. Owns the control channel, the peer table and every sender/receiver.

    `name` is the registry name; `one_sided` says whether P writes straight into D's pool
    (then D must quarantine pages of a failed room). `opaque_writes` says that a pending
    write reports no progress (`bytes_sent` stays 0 until it completes): the lifecycle then
    never fails it for making none, and only --transfer-timeout bounds a hung one.
    `address` is this worker's control address (what the router hands out as P's
    bootstrap address). `writes_within_pages` says that a write may move any byte
    span of a page, not only whole pages: senders then take `send_ahead`, the layer-wise
    transfer (`disagg.layerwise`)."""
    name: str
    one_sided: bool
    opaque_writes: bool
    writes_within_pages: bool = False
    address: str
    worker_id: str
    incarnation: str
    layout: KVLayout
    # Counts and stats (P side), read by the worker's /metrics and its debug view.
    bytes_written: int = 0       # KV bytes of completed writes
    bytes_ahead: int = 0         # of which written ahead, while their prompt computed (send_ahead)
    write_seconds: float = 0.0   # their summed durations, start to every byte landed
    writes_done: int = 0         # rooms whose every write completed

    memory: tuple[str, ...] = ("cpu",)   # device types whose memory this backend moves

    @abstractmethod
    def place_pool(self, nbytes: int) -> memoryview | None:
        """Host memory this backend wants a CPU pool of `nbytes` placed in (shm: a shared
        segment peers map; nixl: huge pages), or None: the engine allocates it. Called at
        most once, before `register_kv`, and only for a pool on the CPU."""

    @abstractmethod
    def register_kv(self, regions: list[KVRegion]) -> None:
        """Register the KV memory the engine allocated, once, before any endpoint is
        published: the pool pages that `send` reads and peers write. A region on a device
        this backend cannot move (`memory`), or in another layout, raises ValueError."""

    @abstractmethod
    def endpoint(self) -> dict:
        """What the bootstrap publishes about this worker's data path (JSON-able)."""

    @abstractmethod
    def connect(self, peer: PeerInfo) -> None:
        """Prepare the data path to a bootstrapped peer (open its segment, add its agent)."""

    @abstractmethod
    def progress(self) -> None:
        """Non-blocking pump: drain the channel, dispatch messages, advance writes."""

    @abstractmethod
    def sender(self, room: int) -> KVSender: ...

    @abstractmethod
    def receiver(self, room: int) -> KVReceiver: ...

    @abstractmethod
    def heartbeat(self, dst: str, rooms: dict[int, str], progress: dict[int, int] | None = None) -> None:
        """Send a Heartbeat listing `rooms` ({room: phase}) and, from D, `progress`
        ({waiting room: KVReceiver.progress()}) to `dst`; a two-sided backend adds how many
        KV bytes from `dst` have landed here in all (wire.Heartbeat.landed)."""

    @abstractmethod
    def take_heartbeats(self) -> list[tuple[str, wire.Heartbeat]]:
        """Heartbeats received since the last call, as (src address, heartbeat)."""

    @abstractmethod
    def peers(self) -> dict[str, PeerInfo]:
        """Bootstrapped peers by control address."""

    @abstractmethod
    def heard(self) -> dict[str, float]:
        """When (manager clock) each peer last sent this worker anything. Every message is
        sent from its sender's scheduler loop, so any message proves that loop alive."""

    @abstractmethod
    def forget_peer(self, address: str) -> None:
        """Drop a dead peer: its PeerInfo and per-peer sockets (a restart re-bootstraps)."""

    @abstractmethod
    def close(self) -> None: ...


class DataPath(ABC):
    """What a backend implements: moving a room's bytes. The manager (`transfer.common`)
    does everything else: bootstrap, dispatch of control messages to senders and receivers,
    acks, notices, Stopped, heartbeats, abort semantics, fault injection (a "hang" job is
    never started and never confirms a stop; a "fail" job fails before `write_start`). Only
    `write_start` must be implemented; a backend gets `self.pool`, `self.layout`,
    `self.channel` and the helpers `owner_ok`, `mark_landed`, `seal_blob`, `open_blob` from
    the manager.

    P side, every backend:
      `write_start(job)` begins writing `job.runs` from `self.pool` into the peer's pool. It
      never blocks: it finishes synchronously (`job.finish()` / `job.fail(detail)`) or leaves
      the job PENDING and finishes it from `write_progress`. It adds the bytes it hands off
      (queued, copied) to `job.bytes_sent` as they go: a pending write whose count stops
      growing while none of its peer's pages land is failed within the lease, unless the
      class sets `opaque_writes` (its writes report nothing in flight).
      `write_progress(job)` is called on every `progress()` while the job is PENDING.
      `write_cancel(job)`: the room failed, stop the job. It returns True once no byte of it
      can land anymore; a one-sided write that may still land returns False and is asked
      again on every `progress()`. Stopped goes to D only after True.
    D side, two-sided backends:
      `on_data(received)` gets every message kind the manager does not know (the backend's
      KV frames). It copies bytes into `self.pool` ONLY IF `self.owner_ok(room, epoch,
      dst_pages)`, then calls `self.mark_landed(room, epoch, dst_pages, offset, length)`
      with the span of each page it copied (length 0: whole pages); a frame that fails
      the check goes to `self.mark_dropped(src, nbytes)` (the link still moved).
    Both sides: `place_pool`, `register_kv`, `endpoint`, `connect`, `disconnect`, `close_backend` and
    `max_data_frame` (the largest raw data frame it sends: the channel's per-frame size
    limit is sized from it), each with the default below.
    """
    layout: KVLayout
    name: str
    memory: tuple[str, ...]
    region: KVRegion | None = None   # the registered pool
    pool: memoryview | None = None   # its host view (None: device memory, see read_pool / write_pool)

    @abstractmethod
    def write_start(self, job: WriteJob) -> None: ...

    def write_progress(self, job: WriteJob) -> None:
        pass

    def write_cancel(self, job: WriteJob) -> bool:
        return True

    def on_data(self, received: "Received") -> None:
        pass

    def place_pool(self, nbytes: int) -> memoryview | None:
        return None

    def register_kv(self, regions: list[KVRegion]) -> None:
        """Default: one region, on a device in `memory`, in this manager's layout. A backend
        that registers memory with a library (nixl) or shares it (cuda_ipc) extends this."""
        self.region, self.pool = self.check_regions(regions), regions[0].host

    def check_regions(self, regions: list[KVRegion]) -> KVRegion:
        """The one region `register_kv` takes, or the error saying why not."""
        if self.region is not None:
            raise RuntimeError("the KV pool is registered once per worker")
        if len(regions) != 1:
            raise ValueError(f"one KV region per worker, got {len(regions)}")
        region = regions[0]
        if region.device_type not in self.memory:
            raise ValueError(f"the {self.name} transfer backend moves {' or '.join(self.memory)} memory, "
                             f"not {region.device}: choose another --transfer-backend or --device")
        if region.layout != self.layout:
            raise ValueError(f"the KV region's layout differs: {', '.join(region.layout.mismatches(self.layout))}")
        return region

    def read_pool(self, offset: int, length: int) -> bytes | memoryview:
        """Bytes [offset, offset + length) of the registered pool (staged from a device).
        A host view aliases the pool: copy it before the pages can change."""
        region = self.region
        assert region is not None, "no KV pool registered"
        if region.host is not None:
            return region.host[offset:offset + length]
        return region.stage.read(offset, length)

    def write_pool(self, offset: int, data) -> None:
        """Store `data` at `offset` of the registered pool (staged to a device)."""
        region = self.region
        assert region is not None, "no KV pool registered"
        if region.host is not None:
            region.host[offset:offset + len(data)] = data
        else:
            region.stage.write(offset, data)

    def endpoint(self) -> dict:
        return {}

    def connect(self, peer: PeerInfo) -> None:
        pass

    def disconnect(self, peer: PeerInfo) -> None:
        """The peer was forgotten or restarted."""

    def close_backend(self) -> None:
        pass

    def max_data_frame(self) -> int:
        return 0


def host_pool(manager: TransferManager, num_pages: int) -> memoryview:
    """What an engine does for a CPU pool, for callers without one (tools, tests): host
    memory where `manager` places it, or a private buffer, registered with it."""
    nbytes = num_pages * manager.layout.page_bytes
    buf = manager.place_pool(nbytes)
    region = KVRegion.of_host(memoryview(bytearray(nbytes)) if buf is None else buf[:nbytes], manager.layout)
    manager.register_kv([region])
    return region.host
