"""The byte layout of the paged KV cache, shared by the engine and the transfer layer.

Layout is page-major: the pool is one contiguous buffer of `num_pages` pages, and each
page holds, for every layer, K then V, each head-major over `page_size` tokens:
    [num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]
so one page is one contiguous run of `page_bytes` bytes, and a page set moves as a list
of (offset, length) runs without knowing anything about tensors.

An 8-bit KV cache (`kv_dtype` int8 or fp8_e4m3) stores each token's key or value vector of
one head quantized with its own float32 scale (x ~ q * scale), and the scales travel inside
the page, after its values:
    values [num_layers, 2, num_kv_heads, page_size, head_dim]  (1 byte each)
    scales [num_layers, 2, num_kv_heads, page_size]            (float32)
A vector is quantized once, when its token is written, and never again; every transfer
backend moves the scales with the values because they are bytes of the same page.
"""
from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any, Protocol

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}     # compute dtypes
QUANTIZED_KV = ("int8", "fp8_e4m3")
KV_DTYPE_BYTES = {**DTYPE_BYTES, "int8": 1, "fp8_e4m3": 1}
SCALE_BYTES = 4  # one float32 scale per (layer, K|V, head, token slot) of an 8-bit page


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = ""  # how the cache stores K/V: "" means `dtype`, else one of KV_DTYPE_BYTES

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.dtype)
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"unknown KV cache dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPE_BYTES)}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in QUANTIZED_KV

    @property
    def vectors(self) -> int:
        """Key and value vectors per page: (layer, K|V, head, token slot)."""
        return self.num_layers * 2 * self.num_kv_heads * self.page_size

    @property
    def scales_offset(self) -> int:
        """Where a page's scales start (8-bit only): after its values, aligned for float32."""
        values = self.vectors * self.head_dim * KV_DTYPE_BYTES[self.kv_dtype]
        return -(-values // SCALE_BYTES) * SCALE_BYTES

    @property
    def page_bytes(self) -> int:
        return self.scales_offset + (self.vectors * SCALE_BYTES if self.quantized else 0)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's values in a page: K then V of every head."""
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * KV_DTYPE_BYTES[self.kv_dtype]

    def layer_spans(self, first: int, last: int) -> tuple[tuple[int, int], ...]:
        """The (offset, length) byte spans within a page that hold layers [first, last):
        their values, then, 8-bit, their scales. A page's layers are contiguous, so any
        range of them is one span of values (and one of scales)."""
        if not 0 <= first < last <= self.num_layers:
            raise ValueError(f"layers [{first}, {last}) of a model of {self.num_layers}")
        spans = [(first * self.layer_bytes, (last - first) * self.layer_bytes)]
        if self.quantized:
            per_layer = 2 * self.num_kv_heads * self.page_size * SCALE_BYTES
            spans.append((self.scales_offset + first * per_layer, (last - first) * per_layer))
        return tuple(spans)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV cache per token (all layers, K and V, scales included)."""
        return self.page_bytes // self.page_size

    def mismatches(self, other: "KVLayout") -> list[str]:
        """Names of the fields that differ, for a rendezvous error that names them."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k} ({mine[k]} != {theirs[k]})" for k in mine if mine[k] != theirs[k]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(**d)


def _consecutive(pages) -> bool:
    return pages[-1] - pages[0] == len(pages) - 1 and list(pages) == list(range(pages[0], pages[-1] + 1))


def paired_runs(src_pages, dst_pages, page_bytes: int) -> list[tuple[int, int, int]]:
    """Coalesce a page-to-page mapping into (src offset, dst offset, length) byte runs:
    neighbouring pairs merge when both the source and the destination pages are consecutive."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    n = len(src_pages)
    if n and _consecutive(src_pages) and _consecutive(dst_pages):  # the common case, without a loop in Python
        return [(src_pages[0] * page_bytes, dst_pages[0] * page_bytes, n * page_bytes)]
    runs: list[list[int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s * page_bytes, d * page_bytes, n * page_bytes) for s, d, n in runs]


@dataclass(frozen=True)
class PagePart:
    """Part of a room's KV: the pages at positions [first, first + count) of its page
    list, whole (`spans` None) or only the (offset, length) byte spans `spans` of each
    (`KVLayout.layer_spans`)."""
    first: int
    count: int
    spans: tuple[tuple[int, int], ...] | None = None


def part_runs(parts, src_pages, dst_pages, page_bytes: int) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, length) byte runs moving `parts` from `src_pages` to
    `dst_pages` (position i of one to position i of the other); whole pages coalesce as
    in `paired_runs`, spans come one span at a time over the part's pages. A part outside
    either list, or a span outside a page, raises."""
    runs: list[tuple[int, int, int]] = []
    for part in parts:
        end = part.first + part.count
        if part.first < 0 or part.count < 1 or end > min(len(src_pages), len(dst_pages)):
            raise ValueError(f"pages [{part.first}, {end}) of {len(src_pages)} source and "
                             f"{len(dst_pages)} destination pages")
        src, dst = src_pages[part.first:end], dst_pages[part.first:end]
        if part.spans is None:
            runs += paired_runs(src, dst, page_bytes)
            continue
        if any(off < 0 or n < 1 or off + n > page_bytes for off, n in part.spans):
            raise ValueError(f"byte spans {part.spans} outside a page of {page_bytes}")
        # span by span, so that one span of consecutive pages stays together (tcp sends it as one message)
        runs += [(s * page_bytes + off, d * page_bytes + off, n) for off, n in part.spans for s, d in zip(src, dst)]
    return runs


class Stager(Protocol):
    """Copies bytes between device KV memory and host memory, for a backend that moves pages
    through host buffers (tcp). Both calls are synchronous."""

    def read(self, offset: int, length: int) -> bytes: ...

    def write(self, offset: int, data) -> None: ...


@dataclass(frozen=True, eq=False)
class KVRegion:
    """A piece of KV memory the engine allocated and registers with its transfer manager
    (`TransferManager.register_kv`): `nbytes` at address `ptr` on `device` ("cpu", "cuda:0"),
    pages in `layout` (page p is bytes [p * page_bytes, (p + 1) * page_bytes)).

    Exactly one of `host` and `stage` is set: `host` is a writable byte view of memory the
    CPU addresses; device memory comes with `stage`, which copies runs through host memory.
    `handle` is the engine's own object for the memory (e.g. the torch tensor), for a
    backend that shares it with a peer by its device's means (cuda_ipc)."""
    ptr: int
    nbytes: int
    device: str
    layout: KVLayout
    host: memoryview | None = None
    stage: Stager | None = None
    handle: Any = None

    def __post_init__(self) -> None:
        if (self.host is None) == (self.stage is None):
            raise ValueError("a KV region has either a host view or a stager")
        if self.nbytes % self.layout.page_bytes:
            raise ValueError(f"a KV region of {self.nbytes} bytes is not whole pages of {self.layout.page_bytes}")

    @property
    def device_type(self) -> str:
        return self.device.partition(":")[0]

    @property
    def num_pages(self) -> int:
        return self.nbytes // self.layout.page_bytes

    @classmethod
    def of_host(cls, buf: memoryview, layout: KVLayout) -> "KVRegion":
        """A region over host bytes (a bytearray, an mmap, a shared-memory segment)."""
        view = memoryview(buf).cast("B")
        return cls(host_address(view), len(view), "cpu", layout, host=view)


def host_address(buf) -> int:
    """The address of a writable host buffer's first byte (0 when it is empty)."""
    view = memoryview(buf).cast("B")
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0
