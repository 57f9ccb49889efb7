"""`nixl`: one-sided RDMA-style writes through NVIDIA NIXL's UCX backend, on DRAM.

Each worker owns one NIXL agent (named after its incarnation) and registers its KV pool
with it. The agent's metadata and the pool's address travel in the bootstrap endpoint, so
no NIXL listener or metadata server is needed. P posts one WRITE per room (every page run
as one descriptor) with the room's Aux as the WRITE's notification: NIXL delivers it to D
after the data, so Aux still travels last and needs no control hop of its own; D's Ack
goes back the same way, as a notification to P's agent. P polls
the WRITE from progress(); DONE means the bytes are visible in D's memory.

Invariants:
- Nothing here blocks: posting and state checks return at once; no progress thread runs
  (it would burn a core while idle), so progress() pumps the agent on both sides.
- write_cancel() is True only once the WRITE has reached DONE or ERR: a transfer in
  flight may still land, so D's quarantine holds until then (Stopped is honest).
- A WRITE in flight is opaque (UCX reports only PROC, DONE or ERR), so `opaque_writes`:
  P never fails a pending write for showing no progress, since a slow link would look
  the same as a hung write. A hung one is bounded by --transfer-timeout (its pages on D by
  the quarantine after it); a WRITE that completed but whose Aux or Ack is missing is
  still bounded by the lease.
- The pool's memory outlives its registration (the manager keeps both until close).
- With a cluster key, a notification is sealed like a channel message (`seal_blob`), and
  one is accepted only if it verifies and comes from the agent its `src` bootstrapped as;
  agent metadata itself arrives only in authenticated bootstrap messages.
`nixl` is an optional dependency: import this module only when the backend is chosen.
"""
from __future__ import annotations

import base64
import logging
import mmap
import os

# UCX's InfiniBand modules make processes crash at exit on hosts without IB; UCX reads
# this when the first agent is created.
os.environ.setdefault("UCX_MODULES", "^ib")

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

from kvrelay.disagg import wire  # noqa: E402
from kvrelay.disagg.transfer.base import PeerInfo, WriteJob  # noqa: E402
from kvrelay.disagg.transfer.common import CommonManager  # noqa: E402
from kvrelay.obs.metrics import reject_input  # noqa: E402

logging.getLogger("nixl").setLevel(logging.WARNING)


def mem_kind(device: str) -> tuple[str, int]:
    """NIXL's memory type and device id of a KV region on `device` ("cpu", "cuda:1")."""
    kind, _, index = device.partition(":")
    return ("DRAM", 0) if kind == "cpu" else ("VRAM", int(index or 0))


class NixlManager(CommonManager):
    name = "nixl"
    memory = ("cpu", "cuda")
    one_sided = True
    writes_within_pages = True   # a write's runs are any byte spans (layer-wise transfer)
    opaque_writes = True

    def __init__(self, layout, transfer=None, **kwargs) -> None:
        super().__init__(layout, transfer, **kwargs)
        self.agent_name = f"kvrelay-{self.worker_id}-{self.incarnation}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False,
                                                                   backends=["UCX"]))
        self._mem: mmap.mmap | None = None
        self._mem_kind: tuple[str, int] = ("DRAM", 0)   # NIXL's memory type and device of the pool
        self._base = 0
        self._reg = None
        self._remote: dict[str, tuple | str] = {}  # peer address -> (agent, base, bytes, (mem, dev)) | error
        self._handles: set = set()  # posted WRITEs not yet released
        self._endpoint: dict | None = None

    # ---- pool and endpoint ---------------------------------------------------------------
    def place_pool(self, nbytes: int) -> memoryview:
        # Private anonymous memory on transparent huge pages where the kernel allows: UCX's
        # cross-memory copies walk far fewer pages (about 1.5x faster than 4 KiB pages).
        if self._mem is not None:
            raise RuntimeError("the KV pool is placed once per worker")
        self._mem = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mem.madvise(mmap.MADV_HUGEPAGE)
        return memoryview(self._mem)[:nbytes]

    def register_kv(self, regions) -> None:
        super().register_kv(regions)
        region = regions[0]
        self._mem_kind = mem_kind(region.device)
        self._base = region.ptr
        self._reg = self.agent.register_memory([(region.ptr, max(region.nbytes, 1), self._mem_kind[1], "")],
                                               self._mem_kind[0])
        self._endpoint = None

    def endpoint(self) -> dict:
        if self._endpoint is None:
            md = self.agent.get_agent_metadata()  # includes the registered pool
            self._endpoint = {"agent": self.agent_name, "metadata": base64.b64encode(md).decode(),
                              "base": self._base, "bytes": self.region.nbytes if self.region else 0,
                              "mem": self._mem_kind[0], "dev": self._mem_kind[1]}
        return self._endpoint

    def connect(self, peer: PeerInfo) -> None:
        ep = peer.endpoint
        if "metadata" not in ep:
            return
        try:
            name = self.agent.add_remote_agent(base64.b64decode(ep["metadata"]))
        except Exception as e:  # noqa: BLE001 - a bad peer fails its rooms, not this worker
            self._remote[peer.address] = f"cannot add NIXL agent {ep.get('agent')}: {e}"
            return
        name = name.decode() if isinstance(name, bytes) else name
        kind = (str(ep.get("mem", "DRAM")), int(ep.get("dev", 0)))
        if kind[0] not in ("DRAM", "VRAM"):
            self._remote[peer.address] = f"NIXL agent {ep.get('agent')} registered {kind[0]!r} memory"
            return
        self._remote[peer.address] = (name, int(ep["base"]), int(ep["bytes"]), kind)

    def disconnect(self, peer: PeerInfo) -> None:
        remote = self._remote.pop(peer.address, None)
        if isinstance(remote, tuple):
            try:
                self.agent.remove_remote_agent(remote[0])
            except Exception:  # noqa: BLE001 - already gone
                pass

    def progress(self) -> None:
        # Drives UCX (connection set-up, target-side progress) and collects the Aux that
        # P's writes carry as their notification: it arrives after the write's data.
        for agent, msgs in self.agent.get_new_notifs().items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for raw in msgs:
                got = self.open_blob(raw)
                if got is None or not isinstance(got.msg, (wire.Aux, wire.Ack)):
                    continue
                remote = self._remote.get(got.src)
                if not (isinstance(remote, tuple) and remote[0] == agent):
                    reject_input("control", "unknown_peer", got.msg.KIND, got.src)  # not the agent src bootstrapped
                    continue
                self.deliver_room_message(got)
        super().progress()

    def send_ack(self, dst: str, ack: wire.Ack) -> None:
        # Back to P's agent as a NIXL notification: no control hop (fault injection still
        # applies; a dropped Ack is recovered like any lost Ack).
        remote = self._remote.get(dst)
        if not isinstance(remote, tuple):
            super().send_ack(dst, ack)
        elif not self.faults.drops(ack):
            self.agent.send_notif(remote[0], self.seal_blob(dst, ack))

    # ---- P side ----------------------------------------------------------------------------
    def write_start(self, job: WriteJob) -> None:
        remote = self._remote.get(job.peer.address)
        if not isinstance(remote, tuple):
            job.fail(remote or "decode worker's NIXL agent is not connected")
            return
        agent_name, base, nbytes, (kind, dev) = remote
        if any(d + n > nbytes for _, d, n in job.runs):
            job.fail("destination pages lie outside the decode worker's pool")
            return
        if not job.runs:
            job.finish()
            return
        try:
            mine, my_dev = self._mem_kind
            local = self.agent.get_xfer_descs([(self._base + s, n, my_dev) for s, _, n in job.runs], mine)
            remote = self.agent.get_xfer_descs([(base + d, n, dev) for _, d, n in job.runs], kind)
            job.handle = self.agent.initialize_xfer("WRITE", local, remote, agent_name)
        except Exception as e:  # noqa: BLE001 - NIXL reports errors as exceptions
            job.fail(f"NIXL write could not be prepared: {e}")
            return
        self._handles.add(job.handle)
        # Aux rides on the write as its notification (one control hop fewer); a dropped one
        # (fault injection) is recovered like a lost control Aux, by resending over the channel.
        notif = b""
        if job.aux is not None and not self.faults.drops(job.aux):
            notif, job.aux_in_band = self.seal_blob(job.peer.address, job.aux), True
        try:
            state = self.agent.transfer(job.handle, notif)
        except Exception as e:  # noqa: BLE001
            state = f"ERR ({e})"
        self._settle(job, state)

    def _settle(self, job: WriteJob, state: str) -> None:
        """Record a WRITE's state on its job; release the handle once it is final."""
        if state == "PROC":
            return
        self._release(job.handle)
        job.handle = None
        if state == "DONE":
            job.finish()
        else:
            job.fail(f"NIXL write ended in {state}")

    def _release(self, handle) -> None:
        self._handles.discard(handle)
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - the agent keeps it and retries at teardown
            pass

    def write_progress(self, job: WriteJob) -> None:
        if job.handle is not None and job.handle in self._handles:
            self._settle(job, self.agent.check_xfer_state(job.handle))

    def write_cancel(self, job: WriteJob) -> bool:
        handle = job.handle
        if handle is None or handle not in self._handles:
            return True
        state = self.agent.check_xfer_state(handle)
        if state == "PROC":
            return False  # may still land: D keeps the pages quarantined
        self._release(handle)
        job.handle = None
        return True

    # ---- teardown --------------------------------------------------------------------------
    def close_backend(self) -> None:
        for handle in list(self._handles):
            self._release(handle)
        for address in list(self._remote):
            remote = self._remote.pop(address)
            if isinstance(remote, tuple):
                try:
                    self.agent.remove_remote_agent(remote[0])
                except Exception:  # noqa: BLE001
                    pass
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
        self.pool = None
        self.agent = None  # the agent and its UCX worker go with the last reference
        # self._mem stays mapped while views exported by place_pool() live
