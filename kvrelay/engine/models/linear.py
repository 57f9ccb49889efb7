"""Linear layers for CPU inference: pre-packed weights and the fastest matmul per row count.

Measured here (2 cores, AVX-512 BF16, the default model's shapes, bfloat16):
- up to GEMM_MAX_ROWS rows (decode steps), the native kernel (`kernels/gemm_bf16.c`)
  splits columns between the cores: 25 ms for one 32-row decode step's matmuls against
  31-34 ms through oneDNN, and 9 ms against 15 ms (torch's GEMV) for one row;
- more rows (prefill chunks), oneDNN with the weight pre-packed: ~400 GFLOPS;
- without either, F.linear, with torch's native GEMV for one row (2x oneDNN there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.kernels import elementwise, gemm

# oneDNN weight packing: the packed layout serves every row count; 32 is only its tuning hint.
_PACK_HINT_ROWS = 32
GEMM_MAX_ROWS = 128
REFINE_TOP = 8


@dataclass(frozen=True)
class PackedWeight:
    """A loaded weight [N, K] in the layouts `fast_linear` reads; None where unavailable."""
    onednn: torch.Tensor | None
    native: torch.Tensor | None      # kernels.Gemm layout
    bias32: torch.Tensor | None      # float32 bias for the native kernel
    out_features: int


def pack_weight(w: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """None unless `w` is a CPU bfloat16 weight (float32 runs plain F.linear)."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        return None
    w = w.detach()
    onednn = (torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)
              if torch.backends.mkldnn.is_available() else None)
    g = gemm()
    native = g.pack(w) if g is not None else None
    bias32 = bias.detach().float().contiguous() if bias is not None and native is not None else None
    return PackedWeight(onednn, native, bias32, w.shape[0])


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: PackedWeight | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [T, K], through the fastest path for T rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if packed.native is not None and rows <= GEMM_MAX_ROWS:
        return gemm()(x, packed.native, packed.out_features, packed.bias32)
    if packed.onednn is not None and rows > 1:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    torch._C._set_mkldnn_enabled(False)  # only the engine thread runs torch
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(True)


def lm_head_logits(h: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    """float32 logits [B, vocab]. A bfloat16 matmul rounds its output to bfloat16, 1/8 apart
    at |logit| ~ 25, which makes near-ties between the best tokens (seen: "The" vs "L" at
    the start of the default model's answer). The REFINE_TOP best are recomputed with a
    float32 dot product, so greedy picks what full-precision accumulation would. The native
    kernel returns its float32 sums unrounded, which needs no refinement."""
    if packed is not None and packed.native is not None and h.shape[0] <= GEMM_MAX_ROWS:
        return gemm()(h, packed.native, packed.out_features, None, out_dtype=torch.float32)
    logits = fast_linear(h, weight, None, packed).float()
    if h.dtype == torch.float32:
        return logits
    ew = elementwise()
    k = min(REFINE_TOP, logits.shape[-1])
    top = ew.topk_indices(logits, k) if ew is not None else logits.topk(k, dim=-1).indices  # [B, k]
    exact = torch.einsum("bd,bkd->bk", h.float(), weight[top].float())
    return logits.scatter_(1, top, exact)


class Linear(nn.Linear):
    """nn.Linear whose forward is `fast_linear`; `prepare()` packs the loaded weight."""

    packed: PackedWeight | None = None

    def prepare(self) -> None:
        self.packed = pack_weight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight, self.bias, self.packed)
