"""The paged KV pool: one contiguous buffer in the page-major layout of `core.kvlayout`.

The buffer may be provided by the caller on the CPU (a transfer backend's placement, e.g. a
shared-memory segment, so a one-sided backend can write pages straight in); otherwise it is
allocated here, on the engine's device. `region()` is what the transfer manager registers.
The pool knows nothing about ownership: `engine.allocator.PageAllocator` decides which
pages a request holds.

`kv_pool_for` picks the pool for a layout: `KVPool` stores K/V in the compute dtype,
`QuantizedKVPool` in 8 bits with a scale per vector inside each page.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import zlib
from typing import Callable

import torch

from kvrelay.core.kvlayout import KVLayout, KVRegion, host_address
from kvrelay.engine.kernels.kv8_store import kv8_store

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV8_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
KV8_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}   # the largest magnitude each format holds


def advise_huge_pages(buf: memoryview) -> bool:
    """Ask Linux to back `buf` with transparent huge pages; whether it accepted the advice.

    Why: a decode step's attention reads each sequence's keys and values a page-layer run at a
    time, runs a page apart (hundreds of KB) in the page-major layout, so with 4 KB pages
    nearly every run costs a TLB miss whose page-table entry is itself out of cache. On a
    2-core Xeon with AMX, 32 sequences x 320 keys: 15.6 -> 10.0 ms a step's attention. Linux
    honours the advice for private memory when /sys/kernel/mm/transparent_hugepage/enabled
    is `madvise` or `always`. A shared-memory pool (the shm transfer backend's segment in
    /dev/shm) is advised too, but there it depends on the tmpfs mount; on that Xeon it kept
    4 KB pages even with `huge=advise` (docs/performance.md)."""
    if not sys.platform.startswith("linux") or len(buf) < (2 << 20):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = host_address(buf)
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE           # whole pages inside buf only
    hi = (start + len(buf)) // mmap.PAGESIZE * mmap.PAGESIZE
    return libc.madvise(lo, hi - lo, mmap.MADV_HUGEPAGE) == 0


def kv_pool_for(layout: KVLayout, num_pages: int, buffer: memoryview | None = None,
                device: torch.device | str = "cpu") -> "KVPool":
    return (QuantizedKVPool if layout.quantized else KVPool)(layout, num_pages, buffer, device)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] in the 8-bit dtype, scale [...] float32) with x ~ q * scale:
    symmetric, one scale per vector, its largest magnitude mapped to the format's largest
    (int8 rounds to nearest: error <= scale / 2; fp8 keeps 3 mantissa bits: <= 1/16 relative)."""
    x = x.float()
    scale = x.abs().amax(-1).div_(KV8_MAX[kv_dtype]).clamp_(min=torch.finfo(torch.float32).tiny)
    y = x / scale[..., None]
    if kv_dtype == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, buffer: memoryview | None = None,
                 device: torch.device | str = "cpu") -> None:
        """`buffer`: host memory to hold the pool (a transfer backend's placement), on the CPU
        only; otherwise the pool is allocated here, on `device`."""
        self.layout = layout
        self.num_pages = num_pages
        self.huge_pages_advised = False   # madvise accepted (advise_huge_pages; Linux may still not honour it)
        nbytes = num_pages * layout.page_bytes
        if buffer is not None and torch.device(device).type != "cpu":
            raise ValueError(f"a KV pool on {device} cannot live in a host buffer")
        self._mapping: mmap.mmap | None = None   # the anonymous memory a CPU pool allocated here
        if buffer is None and torch.device(device).type == "cpu" and nbytes > 0:
            # Zeroed by the kernel; advised before the first touch (advise_huge_pages).
            self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buffer = memoryview(self._mapping)
        if buffer is None:
            flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        else:
            if len(buffer) < nbytes:
                raise ValueError(f"KV buffer holds {len(buffer)} bytes, need {nbytes}")
            self.huge_pages_advised = advise_huge_pages(buffer[:nbytes])
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
        self._bytes = flat
        self.device = flat.device
        self._views(flat)

    def _views(self, flat: torch.Tensor) -> None:
        num_pages, layout = self.num_pages, self.layout
        L, S, H, D = layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim
        self.data = flat.view(TORCH_DTYPES[layout.kv_dtype]).view(num_pages, L, 2, H, S, D)
        # One row per (page, layer, K|V, head): a head's keys or values for a whole page.
        # Writes address single token slots inside those rows; gathers take whole rows.
        self._rows = self.data.view(num_pages * L * 2 * H, S, D)
        self._slots = self.data.view(num_pages * L * 2 * H * S, D)
        self._heads = torch.arange(H, device=flat.device)

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    # Index tensors are built once per forward pass for layer 0's keys; a layer's keys are
    # `layer * 2 * H` rows further on and its values `H` rows after its keys, so each
    # layer only adds a constant.
    def slot_ids(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Token-slot ids [T * H] of (pages[t], offsets[t]) for every head, layer 0 keys."""
        L, S, H = self.layout.num_layers, self.layout.page_size, self.layout.num_kv_heads
        return ((pages * (L * 2 * H))[:, None] + self._heads).mul(S).add(offsets[:, None]).flatten()

    def row_ids(self, page_table: torch.Tensor) -> torch.Tensor:
        """Page-row ids [H * B * pages] (head-major) of page_table [B, pages], layer 0 keys."""
        L, H = self.layout.num_layers, self.layout.num_kv_heads
        return ((page_table.flatten() * (L * 2 * H))[None, :] + self._heads[:, None]).flatten()

    def write(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              held: bool = False) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
        """Store k, v [T, H, D] at `slot_ids` (from `slot_ids()`) of `layer`. None: the cache
        holds them exactly; else a function that gives what it holds (rounded to a bfloat16
        pool under float32 compute; an 8-bit pool's dequantized). `held`: the caller will
        call that function (an 8-bit pool then computes it as it stores)."""
        slots, k_base, v_off = self.store_target(layer)
        D = self.layout.head_dim
        k_slots = slot_ids + k_base
        k_held, v_held = k.to(slots.dtype), v.to(slots.dtype)
        slots.index_copy_(0, k_slots, k_held.reshape(-1, D))
        slots.index_copy_(0, k_slots + v_off, v_held.reshape(-1, D))
        if slots.dtype == k.dtype:
            return None
        return lambda: (k_held.to(k.dtype), v_held.to(k.dtype))

    def store_target(self, layer: int) -> tuple[torch.Tensor, int, int]:
        """For a writer that stores K/V itself with `write`'s addressing: (the pool as slot
        rows [N, D], the offset of `layer`'s keys from `slot_ids()`, values' offset from keys)."""
        H, S = self.layout.num_kv_heads, self.layout.page_size
        return self._slots, layer * 2 * H * S, H * S

    def gather(self, layer: int, row_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at `row_ids` (from `row_ids()`), each [H, batch, pages * S, D]:
        head-major, so attention batches over (head, sequence) without another copy."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        k_rows = row_ids + layer * 2 * H
        shape = (H, batch, -1, D)
        return (self._rows.index_select(0, k_rows).view(shape),
                self._rows.index_select(0, k_rows + H).view(shape))

    def buffer(self) -> memoryview:
        """The whole pool as one writable byte buffer (num_pages * page_bytes); CPU only."""
        return memoryview(self._bytes.numpy()).cast("B")

    def region(self) -> KVRegion:
        """The pool as the transfer manager registers it (`TransferManager.register_kv`)."""
        flat, device = self._bytes, self._bytes.device
        if device.type == "cpu":
            return KVRegion(flat.data_ptr(), flat.numel(), "cpu", self.layout, host=self.buffer(), handle=flat)
        return KVRegion(flat.data_ptr(), flat.numel(), str(device), self.layout, stage=TensorStager(flat),
                        handle=flat)

    def fence(self) -> None:
        """Return once every K/V store issued so far is in the pool's memory, for a reader
        that does not order itself after this device's work (a transfer backend reading
        the pool mid-pass). The CPU stores synchronously: nothing to wait for."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def read_pages(self, page_ids: list[int]) -> bytes:
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        return self._bytes.view(self.num_pages, self.page_bytes).index_select(0, idx).cpu().numpy().tobytes()

    def checksum(self, page_ids: list[int]) -> int:
        """CRC-32 of these pages' bytes, every byte of each (scales, and slots past a
        sequence's end, included), in the order given: two pools holding the same bytes in
        their own page ids agree (`--verify-kv`)."""
        if self.device.type != "cpu":
            return zlib.crc32(self.read_pages(page_ids))
        pages, crc = self._bytes.view(self.num_pages, self.page_bytes).numpy(), 0
        for p in page_ids:
            crc = zlib.crc32(pages[p], crc)
        return crc

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) page, every layer's K and V (copy-on-write of a
        shared page). All sources are read before any destination is written."""
        if not pairs:
            return
        pages = self._bytes.view(self.num_pages, self.page_bytes)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        pages.index_copy_(0, dst, pages.index_select(0, src))

    def write_pages(self, page_ids: list[int], data: bytes | memoryview) -> None:
        expected = len(page_ids) * self.page_bytes
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {len(page_ids)} pages of {self.page_bytes}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(page_ids), self.page_bytes)
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        self._bytes.view(self.num_pages, self.page_bytes)[idx] = src.to(self.device)


class TensorStager:
    """`KVRegion.stage` of a device pool: byte runs to and from host memory, through one
    reused pinned buffer on CUDA (pageable memory elsewhere), in pieces of `PIECE` bytes."""
    PIECE = 8 << 20

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self._host = torch.empty(min(self.PIECE, flat.numel()), dtype=torch.uint8,
                                 pin_memory=flat.device.type == "cuda")

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        for at in range(0, length, self.PIECE):
            n = min(self.PIECE, length - at)
            self._host[:n].copy_(self.flat[offset + at:offset + at + n])
            out[at:at + n] = self._host[:n].numpy().tobytes()
        return bytes(out)

    def write(self, offset: int, data) -> None:
        data = memoryview(data).cast("B")
        for at in range(0, len(data), self.PIECE):
            n = min(self.PIECE, len(data) - at)
            self._host[:n].numpy()[:] = data[at:at + n]
            self.flat[offset + at:offset + at + n].copy_(self._host[:n])


class QuantizedKVPool(KVPool):
    """K/V in 8 bits (int8 or fp8_e4m3), one float32 scale per (layer, K|V, head, token slot)
    inside each page (`core.kvlayout`). `write` quantizes, `gather` dequantizes to the
    compute dtype. Addressing goes through strided views of the pages (values and scales
    interleave page by page), so a write address is (pages, offsets) and a read address is
    the page ids themselves."""

    def _views(self, flat: torch.Tensor) -> None:
        layout, n = self.layout, self.num_pages
        L, S, H, D = layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim
        pages = flat.view(n, layout.page_bytes)
        self._raw = pages[:, :layout.vectors * D].view(n, L, 2, H, S, D)        # uint8
        self.data = self._raw.view(KV8_DTYPES[layout.kv_dtype])                   # [pages, L, 2, H, S, D]
        self.scales = pages[:, layout.scales_offset:].view(torch.float32).view(n, L, 2, H, S)
        self.compute_dtype = TORCH_DTYPES[layout.dtype]
        self._heads, self._kv = torch.arange(H, device=flat.device), torch.arange(2, device=flat.device)

    def slot_ids(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The write address [2, T] of tokens at (pages[t], offsets[t])."""
        return torch.stack((pages, offsets))

    def row_ids(self, page_table: torch.Tensor) -> torch.Tensor:
        """The read address of page_table [B, pages]: its page ids, flat."""
        return page_table.flatten()

    def write(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              held: bool = False) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Quantize and store k, v [T, H, D] at `slot_ids` (from `slot_ids()`) of `layer`.
        Returns a function that gives them as the cache now holds them (dequantized, in the
        compute dtype), for a pass that attends over its own keys without reading the pool.
        On the CPU the native store (`kernels.kv8_store`) quantizes, bit for bit as
        `quantize`, and (`held`) dequantizes what it stored, which the function returns;
        without `held` the function reads the slots back from the pool."""
        store = kv8_store() if self.device.type == "cpu" else None
        if store is not None and store.supports(k.dtype) and v.dtype == k.dtype:
            x = store(self._bytes, self.layout, layer, slot_ids, k, v, held=held)
            if x is not None:
                return lambda: (x[:, 0], x[:, 1])
            return lambda: self._read_slots(layer, slot_ids[0], slot_ids[1])
        pages, offsets = slot_ids
        q, scale = quantize(torch.stack((k, v), 1), self.layout.kv_dtype)    # [T, 2, H, D], [T, 2, H]
        at = (pages[:, None, None], self._kv[None, :, None], self._heads[None, None, :], offsets[:, None, None])
        self._raw[:, layer].index_put_(at, q.view(torch.uint8))
        self.scales[:, layer].index_put_(at, scale)

        def stored() -> tuple[torch.Tensor, torch.Tensor]:
            x = dequantize(q, scale, self.compute_dtype)
            return x[:, 0], x[:, 1]
        return stored

    def _read_slots(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [T, H, D] of `layer` at token slots (pages[t], offsets[t]), dequantized."""
        at = (pages[:, None, None], self._kv[None, :, None], self._heads[None, None, :], offsets[:, None, None])
        q = self._raw[:, layer][at].view(self.data.dtype)                  # [T, 2, H, D]
        x = dequantize(q, self.scales[:, layer][at], self.compute_dtype)
        return x[:, 0], x[:, 1]

    def store_target(self, layer: int):
        raise NotImplementedError("an 8-bit KV pool stores through write(), which quantizes")

    def gather(self, layer: int, row_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` in pages `row_ids` (from `row_ids()`), dequantized, each
        [H, batch, pages * S, D] like `KVPool.gather`."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        q = self.data[:, layer].index_select(0, row_ids)          # [B * pages, 2, H, S, D]
        scale = self.scales[:, layer].index_select(0, row_ids)
        x = dequantize(q, scale, self.compute_dtype).view(batch, -1, 2, H, self.layout.page_size, D)
        x = x.permute(2, 3, 0, 1, 4, 5).reshape(2, H, batch, -1, D)
        return x[0], x[1]
