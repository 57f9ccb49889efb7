"""Decode attention over an 8-bit KV pool (see paged_attention_q8.c): int8 or fp8 e4m3
values with a float32 scale per vector, read in place; `paged_decode_q8()` is None when no
variant runs, and the model gathers and dequantizes with torch instead."""
from __future__ import annotations

import ctypes

import torch

from kvrelay.engine.kernels.variants import native_library, per_isa

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class PagedDecodeQ8:
    max_group = 16
    max_head_dim = 256

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.paged_decode_q8
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I64,
                             _I64]

    def supports(self, head_dim: int, group: int) -> bool:
        return head_dim <= self.max_head_dim and group <= self.max_group

    def __call__(self, values: torch.Tensor, scales: torch.Tensor, page_table: torch.Tensor,
                 kv_lens: torch.Tensor, q: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """values [pages, L, 2, H, S, D] int8 or float8_e4m3fn and scales [pages, L, 2, H, S]
        float32: the strided views of one pool's pages (`QuantizedKVPool.data`, `.scales`);
        page_table [B, P] int64; kv_lens [B] int64; q [B, Hq, D] -> out [B, Hq, D], bfloat16
        for a bfloat16 q, else float32."""
        assert values.dtype in (torch.int8, torch.float8_e4m3fn) and scales.dtype == torch.float32
        page_bytes = values.stride(0)
        assert scales.stride(0) * 4 == page_bytes and values[0, 0, 0, 0, 0].is_contiguous()
        B, Hq, D = q.shape
        _, _, _, H, S, _ = values.shape
        q = (q if q.dtype == torch.bfloat16 else q.float()).contiguous()
        page_table, kv_lens = page_table.contiguous(), kv_lens.contiguous()
        out = torch.empty_like(q)
        rc = self._fn(values.data_ptr(), scales.data_ptr(), page_bytes, page_table.data_ptr(), kv_lens.data_ptr(),
                      q.data_ptr(), out.data_ptr(), B, page_table.shape[1], layer, H, Hq // H, S, D, scale,
                      int(values.dtype == torch.float8_e4m3fn), int(q.dtype == torch.bfloat16))
        if rc != 0:
            raise RuntimeError(f"native 8-bit decode attention failed ({rc}): out of memory or unsupported shape")
        return out


@per_isa
def paged_decode_q8() -> PagedDecodeQ8 | None:
    lib = native_library()
    return PagedDecodeQ8(lib) if lib is not None and lib.paged_decode_q8_available() else None
