"""The byte layout of the paged KV cache, shared by the engine and the transfer layer.

Layout is page-major: the pool is one contiguous buffer of `num_pages` pages, and each
page holds, for every layer, K then V, each head-major over `page_size` tokens:
    [num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]
so one page is one contiguous run of `page_bytes` bytes, and a page set moves as a list
of (offset, length) runs without knowing anything about tensors.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_bytes(self) -> int:
        return (self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

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
