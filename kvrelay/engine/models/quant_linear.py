"""Linear weights kept quantized (`--quantization int8|int4|gguf`): quantized at load or
taken from the GGUF file's blocks, packed for `kernels/gemm_quant.c`, with torch fallbacks.

Formats (w ~ what the matmul sees; q integer codes):
- int8: per output channel, symmetric, w = d[n] * q, q in [-127, 127], d float32;
- int4: per group of `group_size` k and channel, w = d * q + mn, q in [0, 15], d and mn
  fp16 (Q4_1-like: min and max of the group map to 0 and 15);
- gguf: Q8_0 (w = d * q), Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) and Q4_K
  (w = d * sc * q - dmin * m per 32 k) with their codes as stored; Q4_K's per-32 scales
  d * sc and dmin * m are rounded to fp16 (relative 2^-11). Other ggml types keep the
  float weight the loader dequantized (logged).

Without a native kernel: int8 runs `aten._weight_int8pack_mm`, int4
`aten._weight_int4pack_mm_for_cpu`, gguf the float weight (dequantized once, logged).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvrelay.engine.kernels.quant import (COLS, MODE_4BIT_GROUP, MODE_8BIT_GROUP, MODE_INT8_CHANNEL, QB,
                                          quant_gemm)
from kvrelay.engine.models.base import ModelLoadError

log = logging.getLogger("kvrelay.quant")
INT4_GROUP_SIZES = (32, 64, 128, 256)   # multiples of the kernel's block; torch's int4 op takes these
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K = 2, 3, 8, 12
_GGML_NAMES = {GGML_Q4_0: "Q4_0", GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0", GGML_Q4_K: "Q4_K"}
_warned: set[str] = set()


@dataclass(frozen=True)
class QuantWeight:
    """A weight [n, k]. `path` says what `data`/`scales` hold:
    "native": gemm_quant.c's packed bytes and scales for `mode`, `gb` blocks of 32 k per scale;
    "int8pack": int8 codes [n, k padded to 32] and float32 scales [n] (aten._weight_int8pack_mm);
    "int4pack": torch's int4 layout for [n padded to 16, k padded to group] and float32
                scales-and-zeros [groups, n padded, 2] (aten._weight_int4pack_mm_for_cpu);
    "float": the weight itself (a GGUF type without a kernel, or no kernel at all)."""
    kind: str            # int8, int4, Q8_0, Q4_0, Q4_1, Q4_K, or float
    path: str
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    mode: int = 0
    gb: int = 1
    group_size: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales) if t is not None)


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


# ---------------------------------------------------------------- quantize

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes int8 [n, k] and float32 scales [n]: w ~ d[:, None] * q."""
    w = w.float()
    d = w.abs().amax(1) / 127
    q = torch.round(w / torch.where(d > 0, d, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, d


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes uint8 in [0, 15] [n, k padded to `group`] (0 past k) and fp16 d, mn [n, groups]:
    w ~ d * q + mn. d and mn are rounded to fp16 before q is chosen, so q is best for them."""
    w = w.float()
    n, k = w.shape
    kp = -(-k // group) * group
    g = F.pad(w, (0, kp - k), value=float("nan")).view(n, kp // group, group)
    lo = torch.where(g.isnan(), torch.inf, g).amin(-1)
    hi = torch.where(g.isnan(), -torch.inf, g).amax(-1)
    d, mn = ((hi - lo) / 15).half(), lo.half()
    q = torch.round((g - mn.float()[..., None]) / torch.where(d > 0, d.float(), 1)[..., None])
    q = q.nan_to_num_(0).clamp_(0, 15).to(torch.uint8).view(n, kp)
    return q, d, mn


def decode_gguf(qtype: int, rows: torch.Tensor, k: int):
    """GGUF blocks uint8 [n, row bytes] -> (bits, codes [n, k], d fp16 [n, k/32], mn fp16 or
    None), w ~ d * q (+ mn) per 32 k; None for a type without a kernel."""
    n = rows.shape[0]
    if qtype == GGML_Q8_0:
        b = rows.view(n, k // 32, 34)
        return 8, b[..., 2:].contiguous().view(torch.int8).view(n, k), _f16(b[..., :2]), None
    if qtype in (GGML_Q4_0, GGML_Q4_1):
        head = 2 if qtype == GGML_Q4_0 else 4
        b = rows.view(n, k // 32, head + 16)
        qs = b[..., head:]
        q = torch.cat([qs & 0xF, qs >> 4], -1).reshape(n, k)   # low nibbles are k 0..15
        d = _f16(b[..., :2])
        mn = (d.float() * -8).half() if qtype == GGML_Q4_0 else _f16(b[..., 2:4])
        return 4, q, d, mn
    if qtype == GGML_Q4_K:
        return _decode_q4_k(rows.view(n, k // 256, 144), n, k)
    return None


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    return two_bytes.contiguous().view(torch.float16).squeeze(-1)


def _decode_q4_k(b: torch.Tensor, n: int, k: int):
    """Q4_K superblocks of 256: fp16 d, dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks
    of 32, then 128 bytes where each 32 bytes hold two sub-blocks (low, then high nibbles)."""
    d, dmin = _f16(b[..., 0:2]).float(), _f16(b[..., 2:4]).float()
    s = b[..., 4:16].long()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], 3).reshape(n, k)
    scale = (d[..., None] * sc).half().reshape(n, k // 32)
    mn = (-(dmin[..., None] * mins)).half().reshape(n, k // 32)
    return 4, q, scale, mn


def quantize(weight: torch.Tensor, fmt, raw=None) -> QuantWeight:
    """`weight` [n, k] (float, the loaded values) kept as `fmt.store` (int8, int4 or gguf).
    For gguf, `raw` is (ggml type, uint8 block rows [n, row bytes]) in the weight's row order."""
    weight = weight.detach()
    n, k = weight.shape
    native = quant_gemm() is not None
    if fmt.store == "int8":
        q, d = quantize_int8(weight)
        if native:
            return QuantWeight("int8", "native", n, k, pack_8bit(q, 1), _pad_rows(d, 0), MODE_INT8_CHANNEL,
                               -(-k // QB))
        return QuantWeight("int8", "int8pack", n, k, _pad_k(q, 1, 0), d)  # its bfloat16 path reads K in 32s
    if fmt.store == "int4":
        group = fmt.group_size
        if group not in INT4_GROUP_SIZES:
            raise ModelLoadError(f"--quant-group-size {group} is not supported; choose one of "
                                 f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        q, d, mn = quantize_int4(weight, group)
        if native:
            return QuantWeight("int4", "native", n, k, pack_4bit(q, group // QB), pack_scales(d, mn),
                               MODE_4BIT_GROUP, group // QB, group)
        return _int4pack(q, d, mn, n, k, group)
    if fmt.store == "gguf":
        return _from_gguf(weight, raw, native, fmt.compute)
    raise ValueError(f"unknown quantized store {fmt.store!r}")


def _from_gguf(weight: torch.Tensor, raw, native: bool, compute: torch.dtype) -> QuantWeight:
    n, k = weight.shape
    keep_float = QuantWeight("float", "float", n, k, weight.to(compute).contiguous())
    if raw is None:
        _warn_once("--quantization gguf: a weight without GGUF blocks (not a .gguf model, or parts of "
                   "mixed ggml types) keeps its float values")
        return keep_float
    qtype, rows = raw
    decoded = decode_gguf(qtype, rows, k) if rows.shape[0] == n else None
    if decoded is None:
        _warn_once(f"--quantization gguf: ggml type {qtype} has no kernel; those weights are dequantized "
                   "to float once and run as float matmuls")
        return keep_float
    name = _GGML_NAMES[qtype]
    if not native:
        _warn_once(f"--quantization gguf: no native kernel (--kernels {_isa()}); {name} weights are "
                   "dequantized to float once and run as float matmuls")
        return QuantWeight(name, "float", n, k, weight.to(compute).contiguous())
    bits, q, d, mn = decoded
    if bits == 8:
        return QuantWeight(name, "native", n, k, pack_8bit(q, 1), pack_scales(d), MODE_8BIT_GROUP, 1, QB)
    return QuantWeight(name, "native", n, k, pack_4bit(q, 1), pack_scales(d, mn), MODE_4BIT_GROUP, 1, QB)


def _isa() -> str:
    from kvrelay.engine.kernels import isa
    return isa()


def _int4pack(q: torch.Tensor, d: torch.Tensor, mn: torch.Tensor, n: int, k: int, group: int) -> QuantWeight:
    """torch's int4 matmul computes w = (q - 8) * s + z, with N a multiple of 16."""
    q = _pad_rows(q.to(torch.int32), 0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    s, z = d.float(), mn.float() + 8 * d.float()
    sz = _pad_rows(torch.stack([s, z], -1), 0).transpose(0, 1).contiguous()   # [groups, n padded, 2]
    return QuantWeight("int4", "int4pack", n, k, packed, sz, group_size=group)


# ---------------------------------------------------------------- packing (see gemm_quant.c)

def _pad_rows(t: torch.Tensor, value) -> torch.Tensor:
    n = t.shape[0]
    return F.pad(t, (*[0, 0] * (t.dim() - 1), 0, -(-n // COLS) * COLS - n), value=value)


def _pad_k(q: torch.Tensor, gb: int, value) -> torch.Tensor:
    k = q.shape[1]
    return F.pad(q, (0, -(-k // (QB * gb)) * QB * gb - k), value=value)


def pack_8bit(q: torch.Tensor, gb: int) -> torch.Tensor:
    """int8 codes [n, k] -> bytes [n/16][kb][t<8][16][4] of q + 128."""
    u = (_pad_rows(_pad_k(q.to(torch.int16), gb, 0), 0) + 128).to(torch.uint8)
    nb, kb = u.shape[0] // COLS, u.shape[1] // QB
    return u.view(nb, COLS, kb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)


def pack_4bit(q: torch.Tensor, gb: int) -> torch.Tensor:
    """codes in [0, 15] [n, k] -> bytes [n/16][kb][t<4][16][4], k 8t+j low, 8t+4+j high."""
    u = _pad_rows(_pad_k(q.to(torch.uint8), gb, 0), 0)
    nb, kb = u.shape[0] // COLS, u.shape[1] // QB
    u = u.view(nb, COLS, kb, 4, 2, 4)
    byte = u[..., 0, :] | (u[..., 1, :] << 4)                 # [nb, 16, kb, 4, 4]
    return byte.permute(0, 2, 3, 1, 4).contiguous().view(-1)


def pack_scales(d: torch.Tensor, mn: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 [n, groups] -> [n/16][g][16], or with mn [n/16][g][2][16] (d, then mn)."""
    s = d.half()[..., None] if mn is None else torch.stack([d.half(), mn.half()], -1)
    s = _pad_rows(s, 0)
    nb, g, two = s.shape[0] // COLS, s.shape[1], s.shape[2]
    return s.view(nb, COLS, g, two).permute(0, 2, 3, 1).contiguous().view(-1)


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The float32 weight [n, k] that `qw`'s matmul computes with."""
    n, k = qw.n, qw.k
    if qw.path == "float":
        return qw.data.float()
    if qw.path == "int8pack":
        return (qw.data.float() * qw.scales[:, None])[:, :k]
    if qw.path == "int4pack":
        raise ValueError("torch's int4 layout is opaque; dequantize before packing")
    nb = -(-n // COLS)
    kb = qw.data.numel() // nb // (QB * COLS // (2 if qw.mode == MODE_4BIT_GROUP else 1))
    if qw.mode == MODE_4BIT_GROUP:
        b = qw.data.view(nb, kb, 4, COLS, 4)
        q = torch.stack([b & 0xF, b >> 4], 3)                  # [nb, kb, 4, 2, 16, 4]
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(nb * COLS, kb * QB).float()
    else:
        q = qw.data.view(nb, kb, 8, COLS, 4).permute(0, 3, 1, 2, 4).reshape(nb * COLS, kb * QB).float() - 128
    if qw.mode == MODE_INT8_CHANNEL:
        w = q * qw.scales[:, None]
    else:
        two = 2 if qw.mode == MODE_4BIT_GROUP else 1
        s = qw.scales.view(nb, -1, two, COLS).permute(0, 3, 1, 2).reshape(nb * COLS, -1, two).float()
        s = s.repeat_interleave(qw.gb * QB, 1)[:, :kb * QB]
        w = q * s[..., 0] + (s[..., 1] if two == 2 else 0)
    return w[:n, :k].contiguous()


# ---------------------------------------------------------------- forward

def quant_call(qw: QuantWeight, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`quant_forward(x, qw, bias)` as one callable, bound to the kernel variant that runs
    now (`QuantGemm.bind`: the native path's checks and constant arguments taken once);
    `.kernel` is that kernel, so a caller that keeps it rebinds when the variant changes."""
    kernel = quant_gemm()
    if qw.path == "native" and kernel is not None:
        call = kernel.bind(qw.data, qw.scales, qw.mode, qw.gb, qw.n, qw.k,
                           None if bias is None else bias.detach().float().contiguous())
    else:
        def call(x: torch.Tensor) -> torch.Tensor:
            return quant_forward(x, qw, bias)
    call.kernel = kernel
    return call


def quant_forward(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [T, k] float32 or bfloat16, in `out_dtype` (default x's)."""
    out_dtype = out_dtype or x.dtype
    if qw.path == "native":
        kernel = quant_gemm()
        if kernel is not None:
            b32 = None if bias is None else bias.detach().float().contiguous()
            out = kernel(x, qw.data, qw.scales, qw.mode, qw.gb, qw.n, b32)
            return out if out.dtype == out_dtype else out.to(out_dtype)
        _warn_once("quantized weights packed for the native kernels run without them (the kernel "
                   "variant changed to torch): dequantizing on every call, rebuild the model")
        return F.linear(x.float(), dequantize(qw), None if bias is None else bias.float()).to(out_dtype)
    if qw.path == "int8pack":
        kp = qw.data.shape[1]
        xp = F.pad(x, (0, kp - qw.k)) if kp != qw.k else x
        out = torch.ops.aten._weight_int8pack_mm(xp.contiguous(), qw.data, qw.scales.to(x.dtype))
    elif qw.path == "int4pack":
        kp = qw.scales.shape[0] * qw.group_size
        xp = F.pad(x, (0, kp - qw.k)) if kp != qw.k else x
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xp.contiguous(), qw.data, qw.group_size,
                                                         qw.scales.to(x.dtype))[:, :qw.n]
    else:
        out = F.linear(x, qw.data.to(x.dtype), None)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


def attach_gguf_raw(model: torch.nn.Module, parts, slices: dict[str, tuple[str, int, int]]) -> None:
    """Set `gguf_raw` = (ggml type, uint8 rows) on each module whose weight the (HF name,
    ggml type, rows [r, row bytes]) `parts` cover; a projection fused from several parts
    (`slices`: HF projection -> (fused module, first row, rows)) gets their rows in order,
    and none when their types differ (it then keeps its float weight)."""
    modules = dict(model.named_modules())
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for name, qtype, rows in parts:
        path, _, leaf = name.rpartition(".")
        parent, _, proj = path.rpartition(".")
        start = 0
        if proj in slices:
            fused, start, _ = slices[proj]
            path = f"{parent}.{fused}" if parent else fused
        if leaf == "weight" and hasattr(modules.get(path), "gguf_raw"):
            pieces.setdefault(path, []).append((start, qtype, rows))
    for path, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        module, types = modules[path], {p[1] for p in ps}
        rows = sum(p[2].shape[0] for p in ps)
        if len(types) == 1 and rows == module.weight.shape[0]:
            module.gguf_raw = (ps[0][1], torch.cat([p[2] for p in ps]) if len(ps) > 1 else ps[0][2])
        else:
            log.info("%s: GGUF parts of ggml types %s cannot be fused; it keeps float weights",
                     path, sorted(types))
