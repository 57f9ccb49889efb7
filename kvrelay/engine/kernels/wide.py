"""Small-batch float32 matmul with bfloat16- or float32-stored weights (see gemm_wide.c),
for the AVX-512F and AVX2 variants; `wide_gemm()` is None when no variant runs."""
from __future__ import annotations

import ctypes

import torch

from kvrelay.engine.kernels.variants import isa, native_library, per_isa

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class WideGemm:
    """`pack(w [N, K])` once (bfloat16 or float32), then `__call__(x [M, K] float32, packed,
    N, bias)` -> float32 [M, N]. The bias must come from `pad_bias`. `all_rows`: whether it
    should take prefill-sized row counts too, where oneDNN would otherwise (models.linear)."""

    def __init__(self, lib: ctypes.CDLL, all_rows: bool) -> None:
        self.all_rows = all_rows
        self._pack, self._mm = lib.gemm_wide_pack, lib.gemm_wide
        self._pack.restype, self._pack.argtypes = None, [_P, _I64, _I64, ctypes.c_int, _P]
        self._mm.restype, self._mm.argtypes = None, [_P, _I64, _I64, _P, _I64, ctypes.c_int, _P, _P]
        block = lib.gemm_wide_block
        block.restype, block.argtypes = ctypes.c_int64, []
        self.block = int(block())

    def _padded(self, n: int) -> int:
        return -(-n // self.block) * self.block

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        assert w.dtype in (torch.bfloat16, torch.float32) and w.dim() == 2
        w = w.detach().contiguous()
        N, K = w.shape
        packed = torch.empty(self._padded(N) * K, dtype=w.dtype)
        self._pack(w.data_ptr(), N, K, int(w.dtype == torch.bfloat16), packed.data_ptr())
        return packed

    def pad_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        if bias is None:
            return None
        out = torch.zeros(self._padded(bias.shape[0]), dtype=torch.float32)
        out[: bias.shape[0]] = bias.detach().float()
        return out

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.dim() == 2
        x = x.contiguous()
        M, K = x.shape
        assert packed.numel() == self._padded(n) * K, "x does not match the packed weight"
        assert bias is None or bias.numel() == self._padded(n)
        out = torch.empty(M, n, dtype=torch.float32)
        self._mm(x.data_ptr(), M, K, packed.data_ptr(), n, int(packed.dtype == torch.bfloat16),
                 None if bias is None else bias.data_ptr(), out.data_ptr())
        return out


@per_isa
def wide_gemm() -> WideGemm | None:
    """The AVX2 variant takes every row count: on a Zen 2 its 6-row tiles ran the default
    model's shapes at 190-210 GFLOPS from 32 to 2,048 rows, oneDNN's float32 at 120-158.
    The AVX-512F variant leaves rows past GEMM_MAX_ROWS to oneDNN (not measured against it)."""
    lib = native_library()
    if lib is None or not lib.gemm_wide_available():
        return None
    return WideGemm(lib, all_rows=isa() == "avx2")
