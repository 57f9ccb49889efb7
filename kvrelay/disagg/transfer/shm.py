"""`shm`: one host, one-sided. Every worker's KV pool is a POSIX shared-memory segment named
after its incarnation; the bootstrap endpoint publishes that name, P attaches D's segment
and copies its source runs straight into D's pages.

Invariants:
- A write is a memcpy per page run, done synchronously in write_start by the scheduler
  thread (helped by one copy thread for large runs, joined before write_start returns),
  so nothing is ever in flight between two calls: a cancelled job has stopped
  (write_cancel is always True) and its Stopped is honest. A job is pending only under
  the hang fault, and then shows no progress: P fails it within the lease. (One copy is not split across
  iterations: a 256 MiB copy stalls the loop less than the prefill that produced it.)
- D unlinks its segment on close(); the creating process's resource tracker unlinks it if
  the process dies first. An attaching P never registers the segment (it does not own it).
"""
from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import numpy as np

from kvrelay.core.kvlayout import host_address
from kvrelay.disagg.transfer.base import PeerInfo, WriteJob
from kvrelay.disagg.transfer.common import CommonManager

SEGMENT_PREFIX = "kvrelay_"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory

_CREATED: set[str] = set()  # segments this process created (and its resource tracker owns)

# Runs at least this long are copied by two threads (numpy releases the GIL while copying):
# one core alone does not saturate memory bandwidth.
PARALLEL_COPY_MIN = 4 << 20
_copier: ThreadPoolExecutor | None = None


def copy_runs(dst: memoryview, src: memoryview, runs: list[tuple[int, int, int]]) -> None:
    """dst[d:d+n] = src[s:s+n] for every (s, d, n) run; large runs split across two threads."""
    global _copier
    for s, d, n in runs:
        if n < PARALLEL_COPY_MIN:
            dst[d:d + n] = src[s:s + n]
            continue
        if _copier is None:
            _copier = ThreadPoolExecutor(1, thread_name_prefix="kvrelay-shm-copy")
        half = n // 2
        a, b = np.frombuffer(dst, np.uint8, n, d), np.frombuffer(src, np.uint8, n, s)
        other = _copier.submit(np.copyto, a[:half], b[:half])
        np.copyto(a[half:], b[half:])
        other.result()


def create_segment(name: str, nbytes: int) -> shared_memory.SharedMemory:
    """A new segment of nbytes. Fails now, loudly, when /dev/shm cannot hold it: a sparse
    segment larger than its filesystem would only fail later, with SIGBUS on first touch."""
    if os.path.isdir(SHM_DIR):
        st = os.statvfs(SHM_DIR)
        if nbytes > st.f_bavail * st.f_frsize:
            raise RuntimeError(f"{SHM_DIR} has {st.f_bavail * st.f_frsize} bytes free but the KV pool "
                               f"needs {nbytes}: enlarge it (docker --shm-size) or use another "
                               f"--transfer-backend")
    seg = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    _CREATED.add(seg.name)
    return seg


class AttachedSegment:
    """A mapping of someone else's segment, made without the resource tracker: Python
    3.11's SharedMemory registers every attach, and unregistering it again would also drop
    the owner's registration when both processes share one tracker (a child started by
    multiprocessing does). Same surface as SharedMemory for what this module uses."""

    def __init__(self, name: str) -> None:
        import _posixshmem  # CPython's own shm_open binding (what SharedMemory uses)

        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        if self._mmap is not None:
            self._mmap.close()  # BufferError while a view is exported: see close_segment
            self._mmap = None


Segment = shared_memory.SharedMemory | AttachedSegment


def attach_segment(name: str) -> Segment:
    """Map an existing segment; this process's own segments are mapped as they are."""
    if name.lstrip("/") in {n.lstrip("/") for n in _CREATED}:
        return shared_memory.SharedMemory(name=name)
    return AttachedSegment(name)


def close_segment(seg: Segment) -> None:
    """Unmap, or, while a view is still exported (the engine's KV tensor, a test's
    memoryview), leave the mapping to die with its last view; the fd is closed either way."""
    try:
        seg.close()
    except BufferError:
        if isinstance(seg, AttachedSegment):
            seg._mmap = None  # the mapping lives on in the exported view
            return
        # SharedMemory.close() stopped at the mmap; finish its work without the unmap so
        # that __del__ does not retry and warn.
        seg._mmap = None  # type: ignore[attr-defined]
        if seg._fd >= 0:  # type: ignore[attr-defined]
            os.close(seg._fd)  # type: ignore[attr-defined]
            seg._fd = -1  # type: ignore[attr-defined]


def unlink_segment(seg: shared_memory.SharedMemory) -> None:
    _CREATED.discard(seg.name)
    seg.unlink()


class ShmManager(CommonManager):
    name = "shm"
    one_sided = True
    writes_within_pages = True   # a write's runs are any byte spans (layer-wise transfer)

    def __init__(self, layout, transfer=None, **kwargs) -> None:
        super().__init__(layout, transfer, **kwargs)
        self.segment: shared_memory.SharedMemory | None = None
        self._attached: dict[str, Segment | str] = {}  # peer address -> segment | error

    # ---- pool and endpoint ---------------------------------------------------------------
    def place_pool(self, nbytes: int) -> memoryview:
        if self.segment is not None:
            raise RuntimeError("the KV pool is placed once per worker")
        self.segment = create_segment(SEGMENT_PREFIX + self.incarnation, nbytes)
        return self.segment.buf[:nbytes]

    def register_kv(self, regions) -> None:
        # Peers map the segment: the pool must be the memory place_pool handed out.
        region, seg = self.check_regions(regions), self.segment
        if seg is None or region.ptr != host_address(seg.buf):
            raise ValueError("the shm backend moves a pool placed in its segment (place_pool)")
        self.region, self.pool = region, region.host

    def endpoint(self) -> dict:
        if self.segment is None or self.region is None:
            return {}
        return {"segment": self.segment.name, "bytes": self.region.nbytes}

    def connect(self, peer: PeerInfo) -> None:
        name = peer.endpoint.get("segment")
        if not name:
            return  # a peer without a pool is never written to
        try:
            seg = attach_segment(name)
        except OSError as e:  # not on this host, or already gone
            self._attached[peer.address] = f"cannot attach shm segment {name}: {e}"
            return
        if seg.size < int(peer.endpoint.get("bytes", 0)):
            close_segment(seg)
            self._attached[peer.address] = f"shm segment {name} is smaller than advertised"
            return
        self._attached[peer.address] = seg

    def disconnect(self, peer: PeerInfo) -> None:
        seg = self._attached.pop(peer.address, None)
        if seg is not None and not isinstance(seg, str):
            close_segment(seg)

    # ---- P side ----------------------------------------------------------------------------
    def write_start(self, job: WriteJob) -> None:
        seg = self._attached.get(job.peer.address)
        if seg is None or isinstance(seg, str):
            job.fail(seg or "decode worker's shm segment is not attached")
            return
        src, dst = self.pool, seg.buf
        if src is None or any(d + n > len(dst) for _, d, n in job.runs):
            job.fail("destination pages lie outside the decode worker's segment")
            return
        copy_runs(dst, src, job.runs)
        job.bytes_sent += sum(n for _, _, n in job.runs)
        job.finish()

    def write_cancel(self, job: WriteJob) -> bool:
        return True  # every copy completes inside write_start: nothing is ever in flight

    # ---- teardown --------------------------------------------------------------------------
    def close_backend(self) -> None:
        for address in list(self._attached):
            seg = self._attached.pop(address)
            if not isinstance(seg, str):
                close_segment(seg)
        if self.segment is not None:
            self.pool = None
            close_segment(self.segment)
            unlink_segment(self.segment)
            self.segment = None
