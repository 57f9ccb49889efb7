"""Layers shared by the decoder-only architectures: RMSNorm, rotary embedding, SwiGLU MLP,
and paged attention over the KV pool (contract in `engine.forward` and `models.base`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.forward import ForwardBatch


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, as the Llama family does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with "linear" or "llama3" scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in `dtype` for absolute `positions` [T]."""
        if self._table is None or self._table.device != positions.device:
            self._table = self._build(positions.device)
        cs = self._table[positions].to(dtype)
        return cs[:, 0:1], cs[:, 1:2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul (gate rows first)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class AttnMeta:
    """Per-forward attention inputs, computed once and shared by every layer."""
    cos: torch.Tensor         # [T, 1, D]
    sin: torch.Tensor         # [T, 1, D]
    mask: torch.Tensor        # [B, 1, max_q, max_kv] bool; every row has at least one True
    q_index: torch.Tensor     # [B, max_q] row in T of each padded query
    row_slot: torch.Tensor    # [T] slot in the flattened [B * max_q] padded queries of each row
    batch: ForwardBatch

    @classmethod
    def build(cls, batch: ForwardBatch, rope: RotaryEmbedding, dtype: torch.dtype) -> "AttnMeta":
        cos, sin = rope.cos_sin(batch.positions, dtype)
        # A padded query row would be fully masked, and softmax over nothing is NaN: let it
        # see key 0. Its output is never gathered back, so real rows are unaffected.
        pad_rows = torch.zeros_like(batch.attn_mask)
        pad_rows[:, 0, :, 0] = ~batch.q_valid
        mask = batch.attn_mask | pad_rows
        # Inverse of q_index over the valid slots, so each layer un-pads with one gather.
        slots = batch.q_valid.flatten().nonzero().squeeze(1)
        row_slot = torch.empty_like(slots).index_copy_(0, batch.q_index.flatten()[slots], slots)
        return cls(cos, sin, mask, batch.q_index, row_slot, batch)


class PagedAttention(nn.Module):
    """Attention of one layer over the paged KV pool. No parameters: the projections and
    RoPE live in the architecture's attention block."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer = layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, kv) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> [T, Hq * D]."""
        b = meta.batch
        # Written before the read, so this pass's tokens see their own keys.
        kv.write(self.layer, b.write_pages, b.write_offsets, k, v)
        queries = q[meta.q_index]                                      # [B, max_q, Hq, D]
        if b.no_prefix:
            keys, values = k[meta.q_index], v[meta.q_index]            # [B, max_q, Hkv, D]
            mask = meta.mask[..., : keys.shape[1]]
        else:
            keys, values = kv.gather(self.layer, b.page_table)         # [B, max_kv, Hkv, D]
            keys, values, mask = keys.to(q.dtype), values.to(q.dtype), meta.mask
        if queries.shape[1] == 1:
            return self._single_query(queries, keys, values, mask)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)  # [B * max_q, Hq * D]
        return out[meta.row_slot]

    def _single_query(self, queries, keys, values, mask) -> torch.Tensor:
        """Decode: one query per sequence, as two batched matmuls (far cheaper on CPU than
        the flash kernel for q_len 1). Query head h reads kv head h // group."""
        B, group = queries.shape[0], self.num_heads // self.num_kv_heads
        q4 = queries.view(B, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(q4, keys.permute(0, 2, 3, 1)).float()   # [B, Hkv, G, max_kv]
        scores.mul_(self.head_dim ** -0.5).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))              # [B, Hkv, G, D]
        return out.reshape(B, self.num_heads * self.head_dim)
