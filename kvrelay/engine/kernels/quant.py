"""Small-batch matmul over 8-bit and 4-bit weights (see gemm_quant.c) for the AVX-512 VNNI
and AVX2 variants; `quant_gemm()` is None when no variant runs. The packed layout is the
same in every variant, so weights packed under one run under any other."""
from __future__ import annotations

import ctypes

import torch

from kvrelay.engine.kernels.variants import native_library, per_isa

_I64, _P, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

QB = 32          # k per block: activations are quantized per row and block
COLS = 16        # output columns per packed block
MODE_INT8_CHANNEL, MODE_8BIT_GROUP, MODE_4BIT_GROUP = 0, 1, 2


class QuantGemm:
    """`__call__(x [M, K], w, scales, mode, gb, n, bias32)` -> [M, n] in x's dtype (float32
    or bfloat16), w and scales as `quant_linear.pack_*` lays them out."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._mm = lib.gemm_quant
        self._mm.restype = _INT
        self._mm.argtypes = [_P, _INT, _I64, _I64, _P, _P, _INT, _I64, _I64, _P, _P, _INT]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, mode: int, gb: int, n: int,
                 bias32: torch.Tensor | None) -> torch.Tensor:
        assert x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
        assert bias32 is None or (bias32.dtype == torch.float32 and bias32.numel() >= n)
        x = x.contiguous()
        M, K = x.shape
        blocks = -(-K // (QB * gb)) * gb
        per_block = QB * COLS // (2 if mode == MODE_4BIT_GROUP else 1)
        assert w.numel() == -(-n // COLS) * blocks * per_block, "x does not match the packed weight"
        bf16 = int(x.dtype == torch.bfloat16)
        out = torch.empty(M, n, dtype=x.dtype)
        rc = self._mm(x.data_ptr(), bf16, M, K, w.data_ptr(), scales.data_ptr(), mode, gb, n,
                      None if bias32 is None else bias32.data_ptr(), out.data_ptr(), bf16)
        if rc != 0:
            raise MemoryError(f"quantized matmul: no scratch memory for {M} x {K} activations")
        return out


@per_isa
def quant_gemm() -> QuantGemm | None:
    lib = native_library()
    return QuantGemm(lib) if lib is not None and lib.gemm_quant_available() else None
