"""Layers shared by the decoder-only architectures: RMSNorm, rotary embedding, SwiGLU MLP,
and paged attention over the KV pool (contract in `engine.forward` and `models.base`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.kernels import PagedDecode, PagedPrefill, amx_bf16, elementwise, paged_decode, paged_prefill
from kvrelay.engine.kernels.kvq import PagedDecodeQ8, paged_decode_q8
from kvrelay.engine.models.linear import Linear


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


def rope_and_store(qkv: torch.Tensor, hq: int, hkv: int, meta: "AttnMeta", kv,
                   layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, hq + 2 * hkv, D] -> (q, k, v) with RoPE applied to q and k, and this pass's
    k and v stored in the pool at meta.write_slots of `layer`. On CPU (bfloat16, float32) it is
    one native pass, in place (q and k are views of qkv). An 8-bit pool quantizes on store,
    and the k and v returned are the dequantized ones it holds."""
    ew = elementwise()
    if (ew is not None and qkv.dtype == kv.data.dtype and ew.supports(qkv.dtype)
            and qkv.device.type == "cpu" and qkv.shape[-1] <= ew.MAX_ROPE_DIM):
        slots, k_base, v_off = kv.store_target(layer)
        ew.rope_(qkv, hq + hkv, meta.rope_table, meta.batch.positions, (slots, meta.write_slots, hkv, k_base, v_off))
        return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    q, k = apply_rope(qkv[:, :hq + hkv], meta.cos, meta.sin).split([hq, hkv], dim=1)
    v = qkv[:, hq + hkv:]
    held = kv.write(layer, meta.write_slots, k, v)
    if held is not None and meta.batch.no_prefix:
        # 8-bit cache: attention reads keys and values as the cache holds them, also in a
        # pass that attends over its own (every other pass reads the pool), so tokens do not
        # depend on how a prompt was chunked (a prefill worker chunks unlike a colocated engine).
        k, v = held()
    return q, k, v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul (gate rows first)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ew = elementwise()
        if ew is not None and ew.supports(gate_up.dtype):
            return self.down_proj(ew.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# With AMX, torch's flash attention runs a bfloat16 prefill on the tiles: the default model's
# 30 layers over one 2,048-token prompt took 0.7 s against 3.6 s in the native kernel (which
# computes with vdpbf16ps), 2.4 against 12.1 s at 4,096 tokens, on a 2-core Xeon with AMX.
# Torch pads every sequence of a pass to the longest query run and key run, so it takes a
# pass only while that padding at most multiplies the query-key pairs by TILE_PAD_LIMIT: a
# chunk beside a batch of decodes (one query each) stays on the native kernel.
TILE_PAD_LIMIT = 2


def prefill_on_tiles(batch: ForwardBatch, dtype: torch.dtype) -> bool:
    """Whether a prefill pass (some sequence has more than one query) goes through torch's
    flash attention rather than the native prefill kernel (the comment above)."""
    if dtype != torch.bfloat16 or not amx_bf16():
        return False
    real = sum(q * kv for q, kv in zip(batch.q_lens, batch.kv_lens))
    padded = batch.batch_size * max(batch.q_lens) * batch.page_table.shape[1] * batch.kv_page_size
    return padded <= TILE_PAD_LIMIT * real


@dataclass
class AttnMeta:
    """Per-forward attention inputs, computed once and shared by every layer."""
    cos: torch.Tensor         # [T, 1, D]
    sin: torch.Tensor         # [T, 1, D]
    mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool, every row has a True; None: no torch path over
    # the pool, or one sequence's chunk after its prefix on CPU (two unmasked passes)
    q_index: torch.Tensor     # [B, max_q] row in T of each padded query
    row_slot: torch.Tensor    # [T] slot in the flattened [B * max_q] padded queries of each row
    batch: ForwardBatch
    write_slots: torch.Tensor  # KV-pool slots of the new tokens (kv.slot_ids)
    read_rows: torch.Tensor | None  # KV-pool rows of batch.page_table (kv.row_ids); None: no_prefix
    masked_out: torch.Tensor | None  # ~mask, for masked_fill
    native: PagedDecode | PagedDecodeQ8 | None  # the native decode kernel, for one-token-per-sequence passes
    kv_lens: torch.Tensor      # [B] int64
    rope_table: torch.Tensor   # float32 [max_positions, 2, D], for the native RoPE
    prefill: PagedPrefill | None  # the native kernel for every other pass, when it applies
    q_lens: torch.Tensor       # [B] int64
    q_rows: torch.Tensor       # [B] int64: first row in T of each sequence's queries

    @classmethod
    def build(cls, batch: ForwardBatch, rope: RotaryEmbedding, dtype: torch.dtype, kv, group: int) -> "AttnMeta":
        cos, sin = rope.cos_sin(batch.positions, dtype)
        # Inverse of q_index over the valid slots, so each layer un-pads with one gather.
        slots = batch.q_valid.flatten().nonzero().squeeze(1)
        row_slot = torch.empty_like(slots).index_copy_(0, batch.q_index.flatten()[slots], slots)
        decode = max(batch.q_lens) == 1 and not batch.no_prefix
        L = kv.layout
        if L.quantized:  # 8-bit pool: its own decode kernel; other passes gather and dequantize
            native, prefill = paged_decode_q8() if decode else None, None
            if native is not None and not native.supports(L.head_dim, group):
                native = None
        else:
            native = paged_decode() if decode else None
            if native is not None and not native.supports(kv.data.dtype, L.head_dim, group):
                native = None
            prefill = paged_prefill() if native is None else None
            if prefill is not None and (not prefill.supports(kv.data.dtype, L.head_dim, group)
                                        or prefill_on_tiles(batch, kv.data.dtype)):
                prefill = None
        # Only the torch path over the pool reads keys by row, under the mask (a padded query
        # row sees key 0, so softmax never sees an empty row; its output is never gathered).
        gathered = not batch.no_prefix and native is None and prefill is None
        read_rows = kv.row_ids(batch.page_table) if gathered else None
        # One sequence's chunk after its prefix runs unmasked on CPU (`_prefix_then_chunk`).
        split = gathered and batch.batch_size == 1 and batch.q_lens[0] > 1 and batch.positions.device.type == "cpu"
        mask = None
        if gathered and not split:
            mask = batch.mask().clone()
            mask[:, 0, :, 0] |= ~batch.q_valid
        q_lens = torch.tensor(batch.q_lens, dtype=torch.int64)
        return cls(cos, sin, mask, batch.q_index, row_slot, batch,
                   kv.slot_ids(batch.write_pages, batch.write_offsets), read_rows,
                   None if mask is None else ~mask, native,
                   torch.tensor(batch.kv_lens, dtype=torch.int64), rope.table(batch.positions.device),
                   prefill, q_lens, torch.cumsum(q_lens, 0) - q_lens)


class PagedAttention(nn.Module):
    """Attention of one layer over the paged KV pool. No parameters: the projections and
    RoPE live in the architecture's attention block."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer = layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, kv) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied, already stored in the pool by
        `rope_and_store`, so this pass's tokens see their own keys) -> [T, Hq * D]."""
        b = meta.batch
        if meta.native is not None and kv.layout.quantized:
            out = meta.native(kv.data, kv.scales, b.page_table, meta.kv_lens, q, self.layer, self.head_dim ** -0.5)
            return out.view(-1, self.num_heads * self.head_dim).to(q.dtype)
        if meta.native is not None:  # decode: q rows are already one per sequence
            out = meta.native(kv.data, b.page_table, meta.kv_lens, q.to(kv.data.dtype), self.layer,
                              self.num_kv_heads, kv.layout.page_size, self.head_dim ** -0.5)
            return out.view(-1, self.num_heads * self.head_dim).to(q.dtype)
        if meta.prefill is not None:  # every query row reads its keys from the pool
            out = meta.prefill(kv.data, b.page_table, meta.kv_lens, meta.q_lens, meta.q_rows, q, self.layer,
                               self.num_kv_heads, kv.layout.page_size, self.head_dim ** -0.5)
            return out.view(-1, self.num_heads * self.head_dim)
        queries = q[meta.q_index]                                      # [B, max_q, Hq, D]
        causal = b.no_prefix
        if causal:
            # Every sequence starts at position 0 and is right-padded, so the causal mask
            # is exactly the mask for every real query row (padded rows are dropped), and
            # torch's flash kernel skips the blocks above the diagonal (2x faster here).
            keys = k[meta.q_index].transpose(1, 2)                     # [B, Hkv, max_q, D]
            values = v[meta.q_index].transpose(1, 2)
            mask = None
        else:
            keys, values = kv.gather(self.layer, meta.read_rows, b.batch_size)  # [Hkv, B, max_kv, D]
            keys, values, mask = keys.to(q.dtype), values.to(q.dtype), meta.mask
            if queries.shape[1] == 1:
                return self._single_query(queries[:, 0], keys, values, meta.masked_out)
            if mask is None:   # one sequence's chunk on CPU (AttnMeta.build)
                return self._prefix_then_chunk(queries[0], keys[:, 0], values[:, 0], b.kv_lens[0])
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values,
            attn_mask=mask, is_causal=causal, enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)  # [B * max_q, Hq * D]
        return out[meta.row_slot]

    def _prefix_then_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
        """One sequence's chunk q [m, Hq, D] after a cached prefix, keys/values [Hkv, >= n, D]:
        attention over the prefix (every key visible, no mask) and over the chunk's own keys
        (causal) as two flash passes, merged by their log-sum-exps. The same softmax as one
        masked pass, which on CPU computes the blocks its mask hides too."""
        m, Hq, D = q.shape
        group = Hq // keys.shape[0]
        k = keys[:, :n].repeat_interleave(group, 0)[None]            # [1, Hq, n, D]
        v = values[:, :n].repeat_interleave(group, 0)[None]
        qh = q.transpose(0, 1)[None]                                  # [1, Hq, m, D]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        own, own_lse = flash(qh, k[:, :, n - m:], v[:, :, n - m:], 0.0, True)
        if n > m:
            pre, pre_lse = flash(qh, k[:, :, :n - m], v[:, :, :n - m], 0.0, False)
            top = torch.maximum(own_lse, pre_lse)
            w_own, w_pre = (own_lse - top).exp_().unsqueeze(-1), (pre_lse - top).exp_().unsqueeze(-1)
            own = (own.float() * w_own + pre.float() * w_pre).div_(w_own + w_pre)
        return own[0].transpose(0, 1).reshape(m, Hq * D).to(q.dtype)

    def _single_query(self, queries, keys, values, masked_out) -> torch.Tensor:
        """Decode: one query per sequence against head-major keys [Hkv, B, L, D], as two
        batched matmuls over (kv head, sequence) that read the gathered keys in place (far
        cheaper on CPU than the flash kernel for q_len 1). Query head h reads kv head h // G."""
        Hkv, B, L, D = keys.shape
        group = self.num_heads // Hkv
        q = queries.view(B, Hkv, group, D).transpose(0, 1).reshape(Hkv * B, group, D)
        scores = torch.bmm(q, keys.view(Hkv * B, L, D).transpose(1, 2)).float()   # [Hkv*B, G, L]
        scores = scores.view(Hkv, B, group, L).mul_(D ** -0.5)
        scores.masked_fill_(masked_out.view(1, B, 1, L), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(Hkv * B, group, L)
        out = torch.bmm(probs, values.view(Hkv * B, L, D))                           # [Hkv*B, G, D]
        return out.view(Hkv, B, group, D).transpose(0, 1).reshape(B, self.num_heads * D)
