"""Linear layers for CPU inference: pre-packed weights and the fastest matmul per row count.

Measured here (2 cores, AVX-512 BF16, the default model's shapes, bfloat16):
- up to GEMM_MAX_ROWS rows (decode steps), the native kernel (`kernels/gemm_bf16.c`)
  splits columns between the cores: 25 ms for one 32-row decode step's matmuls against
  31-34 ms through oneDNN, and 9 ms against 15 ms (torch's GEMV) for one row;
- more rows (prefill chunks), oneDNN with the weight pre-packed: ~400 GFLOPS;
- without either, F.linear, with torch's native GEMV for one row (2x oneDNN there).
float32 compute (every variant, `kernels/gemm_wide.c`, weights stored as bfloat16 or
float32): up to GEMM_MAX_ROWS rows the native kernel, else oneDNN pre-packed from the
same (bfloat16-rounded) values. Against F.linear on float32 weights, the default model's
matmuls at 32 rows took ~40 ms against ~110 (oneDNN pre-packed: ~40), at one row 8 ms
against 14 (shared, noisy cores: ratios, not absolutes). The AVX2 variant's kernel takes
every row count (`WideGemm.all_rows`) and no oneDNN copy is kept: on a Zen 2 it ran the
default model's shapes at 190-210 GFLOPS from 32 to 2,048 rows, oneDNN at 120-158.
With AMX (Sapphire Rapids and later; cpuid amx_bf16), the same packed weight is multiplied
on the tiles (`kernels/gemm_amx.c`) up to GEMM_MAX_ROWS rows where K is a multiple of 32.
On a 2-core Xeon with AMX, weights streamed from memory, per layer of the default model:
330 us at 32 rows against 471 through oneDNN (pre-packed) and 1,290 on the vdpbf16ps
kernel; 290 against 406 at 8 rows, 638 against 746 at 128. Where K does not fit the tiles,
oneDNN's AMX matmul beats the vdpbf16ps kernel from 16 rows, so that kernel takes only up
to AMX_NATIVE_MAX_ROWS rows there.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.kernels import amx_bf16, elementwise, gemm
from kvrelay.engine.kernels.wide import wide_gemm
from kvrelay.engine.kernels.quant import quant_gemm
from kvrelay.engine.models.quant_linear import QuantWeight, quant_call, quantize

# oneDNN weight packing: the packed layout serves every row count; 32 is only its tuning hint.
_PACK_HINT_ROWS = 32
GEMM_MAX_ROWS = 128
ALL_ROWS = sys.maxsize
AMX_NATIVE_MAX_ROWS = 8
REFINE_TOP = 8


QUANTIZED = ("int8", "int4", "gguf")


@dataclass(frozen=True)
class WeightFormat:
    """How `prepare()` keeps every Linear's weight (the loader derives it from --dtype and
    --quantization). `store`: "same" (as loaded, in the compute dtype); "bf16" (float32
    compute, the weight stored as bfloat16 and widened in registers); "int8" or "int4"
    (quantized at load, `group_size` weights per int4 scale); "gguf" (the file's blocks)."""
    compute: torch.dtype = torch.bfloat16
    store: str = "same"
    group_size: int = 32
    head: WeightFormat | None = None   # the output head's own format (--lm-head-quantization)

    @property
    def for_head(self) -> WeightFormat:
        return self.head or self


@dataclass(frozen=True)
class PackedWeight:
    """A loaded weight [N, K] in the layouts `fast_linear` reads; None where unavailable.
    Weights stored as bfloat16 for float32 compute are the bfloat16-rounded values in every
    layout, so each path computes the same function."""
    onednn: torch.Tensor | None
    native: torch.Tensor | None      # kernels.Gemm layout, or WideGemm's when `wide`
    bias32: torch.Tensor | None      # float32 bias for the native kernel (padded for WideGemm)
    out_features: int
    wide: bool = False               # native is WideGemm's: float32 activations and output
    native_rows: int = GEMM_MAX_ROWS  # most rows the native kernel takes; oneDNN the rest
    tiles: bool = False              # native runs on the AMX tiles (Gemm.fits_tiles)

    @property
    def serves_every_row_count(self) -> bool:
        """Whether fast_linear never needs the float weight (module docstring)."""
        return self.native is not None and (self.onednn is not None or self.native_rows == ALL_ROWS)


def pack_weight(w: torch.Tensor, bias: torch.Tensor | None = None,
                fmt: WeightFormat = WeightFormat()) -> PackedWeight | None:
    """None unless `w` is a CPU bfloat16 or float32 weight. A float32 weight with
    fmt.store "bf16" is rounded to bfloat16 and kept that way for the native kernel."""
    if w.dtype not in (torch.bfloat16, torch.float32) or w.device.type != "cpu":
        return None
    w = w.detach()
    if w.dtype == torch.float32:
        return _pack_float32(w, bias, fmt.store == "bf16")
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS) if _onednn_bf16() else None
    g = gemm()
    native = g.pack(w) if g is not None else None
    bias32 = bias.detach().float().contiguous() if bias is not None and native is not None else None
    tiles = g is not None and amx_bf16() and g.fits_tiles(w.shape[1])
    rows = AMX_NATIVE_MAX_ROWS if onednn is not None and amx_bf16() and not tiles else GEMM_MAX_ROWS
    return PackedWeight(onednn, native, bias32, w.shape[0], native_rows=rows, tiles=tiles)


@lru_cache(maxsize=1)
def _onednn_bf16() -> bool:
    """oneDNN packs bfloat16 weights only on CPUs with AVX-512BW/VL/DQ or AVX-NE-CONVERT
    (an AVX2-only Zen 3 has neither); elsewhere a bfloat16 weight stays unpacked."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack_float32(w: torch.Tensor, bias: torch.Tensor | None, as_bf16: bool) -> PackedWeight:
    stored = w.bfloat16() if as_bf16 else w
    g = wide_gemm()
    native = g.pack(stored) if g is not None else None
    bias32 = g.pad_bias(bias) if g is not None else None
    if g is not None and g.all_rows:
        return PackedWeight(None, native, bias32, w.shape[0], wide=True, native_rows=ALL_ROWS)
    onednn = (torch.ops.mkldnn._reorder_linear_weight(stored.float() if as_bf16 else w, _PACK_HINT_ROWS)
              if torch.backends.mkldnn.is_available() else None)
    return PackedWeight(onednn, native, bias32, w.shape[0], wide=True)


def native_max_rows(packed: PackedWeight) -> int:
    """Most rows the native kernel takes for `packed`; oneDNN takes more (module docstring)."""
    return packed.native_rows


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: PackedWeight | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [T, K], through the fastest path for T rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if packed.native is not None and rows <= native_max_rows(packed):
        if packed.wide:
            return wide_gemm()(x, packed.native, packed.out_features, packed.bias32)
        return gemm()(x, packed.native, packed.out_features, packed.bias32, tiles=packed.tiles)
    if packed.onednn is not None and (rows > 1 or packed.wide):
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
    kernels return their float32 sums unrounded, which needs no refinement."""
    if packed is not None and packed.native is not None and h.shape[0] <= native_max_rows(packed):
        if packed.wide:
            return wide_gemm()(h, packed.native, packed.out_features, None)
        return gemm()(h, packed.native, packed.out_features, None, out_dtype=torch.float32, tiles=packed.tiles)
    logits = fast_linear(h, weight, None, packed).float()
    if h.dtype == torch.float32:
        return logits
    ew = elementwise()
    k = min(REFINE_TOP, logits.shape[-1])
    top = ew.topk_indices(logits, k) if ew is not None else logits.topk(k, dim=-1).indices  # [B, k]
    exact = torch.einsum("bd,bkd->bk", h.float(), weight[top].float())
    return logits.scatter_(1, top, exact)


class Linear(nn.Linear):
    """nn.Linear whose forward is `fast_linear`; `prepare(fmt)` packs the loaded weight, or
    quantizes it. Where the packed copies serve every row count (float32 compute with both
    the native and the oneDNN layout) or the weight is quantized, the float weight is freed:
    nothing reads `weight` after that."""

    packed: PackedWeight | None = None
    quant: QuantWeight | None = None
    quant_call = None   # quant_call(quant, bias), made at the first forward
    gguf_raw = None   # the loader's raw GGUF blocks for this weight, for --quantization gguf

    def reset_parameters(self) -> None:
        """No initial values: every weight is loaded, or set by `init_random_weights`. (The
        default init on the meta device imports torch._dynamo: seconds at every start.)"""

    def prepare(self, fmt: WeightFormat = WeightFormat()) -> None:
        if fmt.store in QUANTIZED:
            self.quant = quantize(self.weight.detach(), fmt, raw=self.gguf_raw)
            self.quant_call = None
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            self.gguf_raw = None
            return
        self.packed = pack_weight(self.weight, self.bias, fmt)
        p = self.packed
        if p is not None and p.wide and p.serves_every_row_count:
            # float32 compute reads only the packed copies from now on (fast_linear)
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            call = self.quant_call
            if call is None or call.kernel is not quant_gemm():   # packed, or the kernel variant changed
                call = self.quant_call = quant_call(self.quant, self.bias)
            return call(x)
        return fast_linear(x, self.weight, self.bias, self.packed)
