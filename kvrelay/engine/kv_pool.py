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
        shape = (num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.data = flat.view(TORCH_DTYPES[layout.dtype]).view(shape)
        L, S, H, D = layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim
        # Two flat views of the same bytes: one row per token slot (for writes), and one
        # row per (page, layer, K|V) holding a whole page's keys or values (for gathers).
        self._slots = self.data.view(num_pages * L * 2 * S, H, D)
        self._page_halves = self.data.view(num_pages * L * 2, S, H, D)

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, H, D] of T tokens at (pages[t], offsets[t]) of `layer`."""
        L, S = self.layout.num_layers, self.layout.page_size
        k_rows = (pages * L + layer) * (2 * S) + offsets
        self._slots.index_copy_(0, k_rows, k.to(self._slots.dtype))
        self._slots.index_copy_(0, k_rows + S, v.to(self._slots.dtype))

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for page_table [B, max_pages]: each [B, max_pages * S, H, D]."""
        B, max_pages = page_table.shape
        L, S = self.layout.num_layers, self.layout.page_size
        k_rows = ((page_table * L + layer) * 2).flatten()
        shape = (B, max_pages * S, *self._page_halves.shape[-2:])
        return (self._page_halves.index_select(0, k_rows).view(shape),
                self._page_halves.index_select(0, k_rows + 1).view(shape))

    def buffer(self) -> memoryview:
        """The whole pool as one writable byte buffer (num_pages * page_bytes)."""
        return memoryview(self._bytes.numpy()).cast("B")

    def read_pages(self, page_ids: list[int]) -> bytes:
        idx = torch.tensor(page_ids, dtype=torch.long)
        return self._bytes.view(self.num_pages, self.page_bytes).index_select(0, idx).numpy().tobytes()

    def write_pages(self, page_ids: list[int], data: bytes | memoryview) -> None:
        expected = len(page_ids) * self.page_bytes
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes for {len(page_ids)} pages of {self.page_bytes}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(page_ids), self.page_bytes)
        self._bytes.view(self.num_pages, self.page_bytes)[torch.tensor(page_ids, dtype=torch.long)] = src
