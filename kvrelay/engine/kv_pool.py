"""The paged KV pool: one contiguous buffer in the page-major layout of `core.kvlayout`.

The buffer may be provided by the caller (e.g. a shared-memory segment, so a one-sided
transfer backend can write pages straight in); otherwise it is allocated here. The pool
knows nothing about ownership: `engine.allocator.PageAllocator` decides which pages a
request holds.
"""
from __future__ import annotations

import torch

from kvrelay.core.kvlayout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, buffer: memoryview | None = None) -> None:
        self.layout = layout
        self.num_pages = num_pages
        nbytes = num_pages * layout.page_bytes
        if buffer is None:
            flat = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            if len(buffer) < nbytes:
                raise ValueError(f"KV buffer holds {len(buffer)} bytes, need {nbytes}")
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
        self._bytes = flat
        L, S, H, D = layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim
        self.data = flat.view(TORCH_DTYPES[layout.dtype]).view(num_pages, L, 2, H, S, D)
        # One row per (page, layer, K|V, head): a head's keys or values for a whole page.
        # Writes address single token slots inside those rows; gathers take whole rows.
        self._rows = self.data.view(num_pages * L * 2 * H, S, D)
        self._slots = self.data.view(num_pages * L * 2 * H * S, D)
        self._heads = torch.arange(H)

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

    def write(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, H, D] at `slot_ids` (from `slot_ids()`) of `layer`."""
        slots, k_base, v_off = self.store_target(layer)
        D = self.layout.head_dim
        k_slots = slot_ids + k_base
        slots.index_copy_(0, k_slots, k.reshape(-1, D).to(slots.dtype))
        slots.index_copy_(0, k_slots + v_off, v.reshape(-1, D).to(slots.dtype))

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
        """The whole pool as one writable byte buffer (num_pages * page_bytes)."""
        return memoryview(self._bytes.numpy()).cast("B")

    def read_pages(self, page_ids: list[int]) -> bytes:
        idx = torch.tensor(page_ids, dtype=torch.long)
        return self._bytes.view(self.num_pages, self.page_bytes).index_select(0, idx).numpy().tobytes()

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) page, every layer's K and V (copy-on-write of a
        shared page). All sources are read before any destination is written."""
        if not pairs:
            return
        pages = self._bytes.view(self.num_pages, self.page_bytes)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        pages.index_copy_(0, dst, pages.index_select(0, src))

    def write_pages(self, page_ids: list[int], data: bytes | memoryview) -> None:
        expected = len(page_ids) * self.page_bytes
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {len(page_ids)} pages of {self.page_bytes}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(page_ids), self.page_bytes)
        self._bytes.view(self.num_pages, self.page_bytes)[torch.tensor(page_ids, dtype=torch.long)] = src
