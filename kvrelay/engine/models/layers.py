"""Layers shared by the decoder-only architectures: RMSNorm, rotary embedding, SwiGLU MLP.
Attention over the KV pool is a backend's (`engine.attention`)."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.kernels import elementwise, gemm
from kvrelay.engine.models.linear import GEMM_MAX_ROWS, Linear


class RMSNorm(nn.Module):
    """RMSNorm that accumulates in float32 and rounds once (the Hugging Face reference
    rounds twice in bfloat16: at most one ulp apart). `add_and_norm` also folds in the
    residual add before it, natively when the kernels are built."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_and_norm(x.contiguous().clone(), None)[0]

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(h + delta), h + delta); `h` (contiguous, owned by the caller's residual
        stream) is updated in place."""
        ew = elementwise()
        if ew is not None and ew.supports(h.dtype) and h.is_contiguous():
            return ew.add_rms_norm(h, delta, self.weight, self.eps), h
        if delta is not None:
            h += delta
        return F.rms_norm(h, self.weight.shape, self.weight, self.eps), h


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with "linear" or "llama3" scaling."""
    # On the CPU even under a meta-device build: meta arithmetic imports torch._dynamo.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE. The cos/sin table covers `max_positions` and is built
    on first use, on the device of the positions (so a meta-device build stays cheap)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        rope_inv_freq(head_dim, theta, scaling)  # fail at build time on an unsupported type
        self._table: torch.Tensor | None = None  # [max_positions, 2, head_dim] float32

    def _build(self, device: torch.device) -> torch.Tensor:
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos(), emb.sin()), dim=1)

    def table(self, device: torch.device) -> torch.Tensor:
        """cos and sin of every position, float32 [max_positions, 2, head_dim]."""
        if self._table is None or self._table.device != device:
            self._table = self._build(device)
        return self._table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in `dtype` for absolute `positions` [T]."""
        cs = self.table(positions.device)[positions].to(dtype)
        return cs[:, 0:1], cs[:, 1:2]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul (gate rows first).
    On AMX tiles (`fuse`, after the Linears' `prepare`), decode-sized batches run the gate,
    up and silu-product in one kernel (`Gemm.swiglu`); gate_up_proj keeps oneDNN's copy for
    larger ones."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self._fused: torch.Tensor | None = None   # Gemm.pack_swiglu's weight

    def fuse(self) -> None:
        """Pack gate_up for `Gemm.swiglu` where its rows go to the tiles (`PackedWeight.tiles`);
        the native copy it replaces is dropped, oneDNN's is kept for larger batches."""
        p, g = self.gate_up_proj.packed, gemm()
        self._fused = None
        if p is None or not p.tiles or p.onednn is None or g is None:
            return
        self._fused = g.pack_swiglu(self.gate_up_proj.weight.detach())
        if self._fused is not None:
            self.gate_up_proj.packed = replace(p, native=None, tiles=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and x.shape[0] <= GEMM_MAX_ROWS:   # fuse() saw the tiles
            return self.down_proj.forward(gemm().swiglu(x, self._fused, self.intermediate))
        gate_up = self.gate_up_proj.forward(x)   # no hooks: see LlamaForCausalLM.forward
        ew = elementwise()
        if ew is not None and ew.supports(gate_up.dtype):
            return self.down_proj.forward(ew.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)
