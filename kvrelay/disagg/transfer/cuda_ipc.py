"""`cuda_ipc`: two processes on one GPU host, one-sided. D's pool is a CUDA allocation
(`--device cuda`); its bootstrap endpoint carries the pool's CUDA IPC handle, P opens it
once per peer and writes a room's pages into D's pool with device-to-device copies.

Invariants (the rules every backend keeps, in CUDA terms):
- A write is the room's runs enqueued on this manager's own stream, followed by an event.
  It is DONE when the event has completed: every byte is then in D's memory, ordered
  before the Aux that the manager sends next.
- Cancelling a write that is still on the stream cannot recall it: `write_cancel` returns
  True only once its event has completed, so Stopped reaches D only when no byte of the
  room can land anymore, and D keeps the pages quarantined until then (one-sided rule).
- The endpoint is data from the network: each field is checked for type and range before
  torch sees it, it is never unpickled, and a handle that CUDA refuses fails the rooms
  that need that peer, not this worker.
- Both pools must be in one layout (the bootstrap's check) and P's pool on a CUDA device
  too: pages are copied as bytes, so P's and D's devices may differ if peer access allows.

torch is imported when the backend is chosen (a device backend), never by the registry.
"""
from __future__ import annotations

import base64
import binascii

import torch

from kvrelay.disagg.transfer.base import PeerInfo, WriteJob
from kvrelay.disagg.transfer.common import CommonManager

HANDLE_FIELDS = ("handle", "ref_counter", "event")   # base64 bytes of _share_cuda_()
MAX_HANDLE_BYTES = 256                               # a cudaIpcMemHandle is 64 bytes


def export_handle(flat: torch.Tensor) -> dict:
    """The JSON-able endpoint fields that let a process on this host map `flat` (uint8, CUDA)."""
    (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = flat.untyped_storage()._share_cuda_()
    return {"device": int(device), "handle": _b64(handle), "size": int(size), "offset": int(offset),
            "ref_counter": _b64(ref_handle), "ref_offset": int(ref_offset), "event": _b64(event),
            "event_sync": bool(event_sync), "pool_offset": flat.storage_offset(), "bytes": flat.numel()}


def import_handle(ep: dict) -> torch.Tensor:
    """D's pool as a uint8 tensor on this process's view of its device. ValueError on a
    malformed endpoint; CUDA's own error (RuntimeError) on a handle it refuses."""
    ints = {k: ep.get(k) for k in ("device", "size", "offset", "ref_offset", "pool_offset", "bytes")}
    if not all(type(v) is int and v >= 0 for v in ints.values()) or type(ep.get("event_sync")) is not bool:
        raise ValueError("cuda_ipc endpoint: malformed integer or flag fields")
    raw = {k: _unb64(ep.get(k)) for k in HANDLE_FIELDS}
    if ints["device"] >= torch.cuda.device_count():
        raise ValueError(f"cuda_ipc endpoint names device {ints['device']}, this process sees "
                         f"{torch.cuda.device_count()}")
    if ints["pool_offset"] + ints["bytes"] > ints["size"]:
        raise ValueError("cuda_ipc endpoint: the pool lies outside the shared allocation")
    storage = torch.UntypedStorage._new_shared_cuda(
        ints["device"], raw["handle"], ints["size"], ints["offset"], raw["ref_counter"], ints["ref_offset"],
        raw["event"], ep["event_sync"])
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ints['device']}")
    return flat.set_(storage, ints["pool_offset"], (ints["bytes"],))


def _b64(b: bytes) -> str:
    return base64.b64encode(bytes(b)).decode()


def _unb64(v) -> bytes:
    if not isinstance(v, str) or len(v) > 2 * MAX_HANDLE_BYTES:
        raise ValueError("cuda_ipc endpoint: malformed handle field")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("cuda_ipc endpoint: malformed handle field") from None


class CudaIpcManager(CommonManager):
    name = "cuda_ipc"
    one_sided = True
    writes_within_pages = True   # a write's runs are any byte spans (layer-wise transfer)
    memory = ("cuda",)

    def __init__(self, layout, transfer=None, **kwargs) -> None:
        super().__init__(layout, transfer, **kwargs)
        self._peer_pools: dict[str, torch.Tensor | str] = {}   # peer address -> its pool | error
        self._stream: torch.cuda.Stream | None = None
        self._endpoint: dict | None = None

    # ---- pool and endpoint ---------------------------------------------------------------
    def register_kv(self, regions) -> None:
        super().register_kv(regions)
        flat = regions[0].handle
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.device.type != "cuda":
            raise ValueError("the cuda_ipc backend shares a KV pool allocated by torch on a CUDA device")
        self._stream = torch.cuda.Stream(device=flat.device)
        self._endpoint = export_handle(flat)

    def endpoint(self) -> dict:
        return dict(self._endpoint or {})

    def connect(self, peer: PeerInfo) -> None:
        if "handle" not in peer.endpoint:
            return  # a peer without a pool is never written to
        try:
            self._peer_pools[peer.address] = import_handle(peer.endpoint)
        except (ValueError, RuntimeError) as e:   # another host, a foreign GPU, a forged handle
            self._peer_pools[peer.address] = f"cannot open the decode worker's CUDA IPC handle: {e}"

    def disconnect(self, peer: PeerInfo) -> None:
        self._peer_pools.pop(peer.address, None)

    # ---- P side ----------------------------------------------------------------------------
    def write_start(self, job: WriteJob) -> None:
        dst = self._peer_pools.get(job.peer.address)
        if dst is None or isinstance(dst, str):
            job.fail(dst or "decode worker's CUDA IPC handle is not open")
            return
        if any(d + n > dst.numel() for _, d, n in job.runs):
            job.fail("destination pages lie outside the decode worker's pool")
            return
        src = self.region.handle
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(src.device))   # the pages P's forward pass wrote
        with torch.cuda.stream(stream):
            for s, d, n in job.runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
            job.handle = torch.cuda.Event()
            job.handle.record(stream)
        job.bytes_sent += sum(n for _, _, n in job.runs)
        self.write_progress(job)

    def write_progress(self, job: WriteJob) -> None:
        if job.handle is not None and job.handle.query():
            job.handle = None
            job.finish()

    def write_cancel(self, job: WriteJob) -> bool:
        return job.handle is None or job.handle.query()   # enqueued copies cannot be recalled

    # ---- teardown --------------------------------------------------------------------------
    def close_backend(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()   # nothing of ours still writes into a peer's pool
        self._peer_pools.clear()
