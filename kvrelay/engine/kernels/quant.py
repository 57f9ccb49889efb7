"""Small-batch matmul over 8-bit and 4-bit weights (see gemm_quant.c) for the AVX-512 VNNI
and AVX2 variants; `quant_gemm()` is None when no variant runs. The packed layout is the
same in every variant, so weights packed under one run under any other."""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from kvrelay.engine.kernels.variants import native_library, per_isa

_I64, _P, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

QB = 32          # k per block: activations are quantized per row and block
COLS = 16        # output columns per packed block
MODE_INT8_CHANNEL, MODE_8BIT_GROUP, MODE_4BIT_GROUP = 0, 1, 2
_DTYPES = (torch.float32, torch.bfloat16)


class QuantGemm:
    """`__call__(x [M, K], w, scales, mode, gb, n, bias32)` -> [M, n] in x's dtype (float32
    or bfloat16), w and scales as `quant_linear.pack_*` lays them out."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._mm = lib.gemm_quant
        self._mm.restype = _INT
        self._mm.argtypes = [_P, _INT, _I64, _I64, _P, _P, _INT, _I64, _I64, _P, _P, _INT]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, mode: int, gb: int, n: int,
                 bias32: torch.Tensor | None) -> torch.Tensor:
        assert x.dim() == 2
        return self.bind(w, scales, mode, gb, n, x.shape[1], bias32)(x)

    def bind(self, w: torch.Tensor, scales: torch.Tensor, mode: int, gb: int, n: int, k: int,
             bias32: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The matmul of one packed weight [n, k]: x [M, k] -> [M, n] in x's dtype. The
        layout is checked and the constant arguments are taken once: a decode step makes
        ~120 of these calls, which spent ~6 us each in Python around the kernel."""
        assert bias32 is None or (bias32.dtype == torch.float32 and bias32.numel() >= n)
        blocks = -(-k // (QB * gb)) * gb
        per_block = QB * COLS // (2 if mode == MODE_4BIT_GROUP else 1)
        assert w.numel() == -(-n // COLS) * blocks * per_block, "k does not match the packed weight"
        mm, wp, sp = self._mm, w.data_ptr(), scales.data_ptr()
        bp = None if bias32 is None else bias32.data_ptr()

        def matmul(x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 2 or x.shape[1] != k or x.dtype not in _DTYPES:
                raise ValueError(f"quantized matmul over k={k}: got x {tuple(x.shape)} {x.dtype}")
            x = x.contiguous()
            bf16 = int(x.dtype is torch.bfloat16)
            out = torch.empty(x.shape[0], n, dtype=x.dtype)
            if mm(x.data_ptr(), bf16, x.shape[0], k, wp, sp, mode, gb, n, bp, out.data_ptr(), bf16) != 0:
                raise MemoryError(f"quantized matmul: no scratch memory for {x.shape[0]} x {k} activations")
            return out

        matmul.holds = (w, scales, bias32)   # the pointers above stay valid while the matmul lives
        return matmul


@per_isa
def quant_gemm() -> QuantGemm | None:
    lib = native_library()
    return QuantGemm(lib) if lib is not None and lib.gemm_quant_available() else None
