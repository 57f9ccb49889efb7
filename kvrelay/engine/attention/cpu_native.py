"""`cpu_native`: the native CPU kernels (`engine.kernels`): RoPE fused with the K/V store,
paged decode (bfloat16, float32, 8-bit pools, and a float32 model's bfloat16 pool) and
paged prefill, reading the pool in place (bfloat16 on the AMX tiles where the CPU has
them, else through torch's flash attention where that is faster); torch paths for the
passes and shapes no kernel takes (gathered pages under a mask, or the fresh K/V
causally)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.engine.attention.base import AttentionBackend, AttentionMetadata, apply_rope, dense_mask, row_slot
from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.kernels import (PagedDecode, PagedPrefill, amx_bf16, elementwise, paged_decode, paged_prefill,
                                    paged_prefill_tiles)
from kvrelay.engine.kernels.kvq import PagedDecodeQ8, paged_decode_q8
from kvrelay.engine.kv_pool import TORCH_DTYPES

# With AMX, the tiles' own prefill kernel (`kernels/prefill_attention_amx.c`) takes every
# bfloat16 prefill pass. Where it is not built, torch's flash attention runs one on the
# tiles: the default model's 30 layers over one 2,048-token prompt took 0.7 s against 3.6 s
# in the native kernel (which computes with vdpbf16ps), 2.4 against 12.1 s at 4,096 tokens,
# on a 2-core Xeon with AMX.
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
class NativeMetadata(AttentionMetadata):
    rope_table: torch.Tensor   # float32 [max_positions, 2, D], for the native RoPE
    native: PagedDecode | PagedDecodeQ8 | None  # the decode kernel, for one-token-per-sequence passes
    prefill: PagedPrefill | None  # the prefill kernel for every other pass, when it applies
    kv_lens: torch.Tensor      # [B] int64
    q_lens: torch.Tensor       # [B] int64
    q_rows: torch.Tensor       # [B] int64: first row in T of each sequence's queries
    row_slot: torch.Tensor     # [T]
    # The torch path over gathered pages only (None otherwise):
    read_rows: torch.Tensor | None   # kv.row_ids(batch.page_table)
    mask: torch.Tensor | None        # dense_mask; None also for one sequence's chunk after its prefix
    masked_out: torch.Tensor | None  # ~mask


class CpuNativeBackend(AttentionBackend):
    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return f"runs on the CPU, not {device.type}"
        ew = elementwise()
        if ew is None:
            return "no native kernel variant runs here (--kernels torch, or no compiler)"
        if not ew.supports(dtype):
            return f"the native kernels compute bfloat16 or float32, not {str(dtype).removeprefix('torch.')}"
        return None

    def begin(self, batch: ForwardBatch, rope: torch.Tensor) -> NativeMetadata:
        decode = max(batch.q_lens) == 1 and not batch.no_prefix
        L, dtype, group = self.kv.layout, self.kv.data.dtype, self.group
        compute = TORCH_DTYPES[L.dtype]   # the queries'; the pool may hold bfloat16 under float32
        if L.quantized:
            # 8-bit pool: its own decode kernel; every other pass the prefill kernel over its
            # keys as the pool holds them, dequantized into pages of one layer (`_held_pages`).
            native = paged_decode_q8() if decode else None
            if native is not None and not native.supports(L.head_dim, group):
                native = None
            prefill = self._prefill_kernel(batch, compute, compute) if not decode else None
        else:
            native = paged_decode() if decode else None
            if native is not None and not native.supports(dtype, L.head_dim, group, compute):
                native = None
            prefill = self._prefill_kernel(batch, dtype, compute) if native is None else None
        # Only the torch path over the pool reads keys by row, under the mask.
        gathered = not batch.no_prefix and native is None and prefill is None
        # One sequence's chunk after its prefix runs unmasked (`_prefix_then_chunk`).
        split = gathered and batch.batch_size == 1 and batch.q_lens[0] > 1
        mask = dense_mask(batch) if gathered and not split else None
        q_lens = torch.tensor(batch.q_lens, dtype=torch.int64)
        return NativeMetadata(
            **self.common(batch, rope), rope_table=rope, native=native, prefill=prefill,
            kv_lens=torch.tensor(batch.kv_lens, dtype=torch.int64), q_lens=q_lens,
            q_rows=torch.cumsum(q_lens, 0) - q_lens, row_slot=row_slot(batch),
            read_rows=self.kv.row_ids(batch.page_table) if gathered or (L.quantized and prefill is not None) else None,
            mask=mask, masked_out=None if mask is None else ~mask)

    def _prefill_kernel(self, batch: ForwardBatch, dtype: torch.dtype, compute: torch.dtype) -> PagedPrefill | None:
        """The tiles' kernel where it runs (every pass: it reads the pool, prefix or not, and
        pads nothing), else the native one unless torch's flash kernel is faster for the pass."""
        head_dim, group = self.kv.layout.head_dim, self.group
        tiles = paged_prefill_tiles()
        if tiles is not None and tiles.supports(dtype, head_dim, group, compute):
            return tiles
        prefill = paged_prefill()
        if prefill is None or not prefill.supports(dtype, head_dim, group, compute) or prefill_on_tiles(batch, compute):
            return None
        return prefill

    def rope_and_store(self, qkv: torch.Tensor, layer: int,
                       meta: NativeMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One native pass, in place (q and k are views of qkv), where the pool holds the
        compute dtype or, under float32, bfloat16. An 8-bit pool is rotated in place the
        same way (the same q and k as `apply_rope`, bit for bit), then quantized on store by
        its `write`, and a pass over its own fresh keys then reads them as the pool holds
        them (dequantized)."""
        hq, hkv = self.num_heads, self.num_kv_heads
        ew = elementwise()
        native = ew is not None and ew.supports(qkv.dtype) and qkv.shape[-1] <= ew.MAX_ROPE_DIM
        if native and not self.kv.layout.quantized and ew.stores(qkv.dtype, self.kv.data.dtype):
            slots, k_base, v_off = self.kv.store_target(layer)
            ew.rope_(qkv, hq + hkv, meta.rope_table, meta.batch.positions,
                     (slots, meta.write_slots, hkv, k_base, v_off))
            return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        if native and self.kv.layout.quantized:
            ew.rope_(qkv, hq + hkv, meta.rope_table, meta.batch.positions)
            q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
        else:
            q, k = apply_rope(qkv[:, :hq + hkv], meta.cos, meta.sin).split([hq, hkv], dim=1)
        v = qkv[:, hq + hkv:]
        held = self.kv.write(layer, meta.write_slots, k, v, held=meta.batch.no_prefix)
        if held is not None and meta.batch.no_prefix:
            k, v = held()
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               meta: NativeMetadata) -> torch.Tensor:
        b, kv, Hq, D = meta.batch, self.kv, self.num_heads, self.head_dim
        if meta.native is not None and kv.layout.quantized:
            out = meta.native(kv.data, kv.scales, b.page_table, meta.kv_lens, q, layer, self.scale)
            return out.view(-1, Hq * D).to(q.dtype)
        if meta.native is not None:  # decode: q rows are already one per sequence
            out = meta.native(kv.data, b.page_table, meta.kv_lens, q, layer,
                              self.num_kv_heads, kv.layout.page_size, self.scale)
            return out.view(-1, Hq * D)
        if meta.prefill is not None and kv.layout.quantized:
            pages, page = self._held_pages(k, v, layer, meta)
            out = meta.prefill(pages, torch.arange(b.batch_size, dtype=torch.int64)[:, None], meta.kv_lens,
                               meta.q_lens, meta.q_rows, q, 0, self.num_kv_heads, page, self.scale)
            return out.view(-1, Hq * D)
        if meta.prefill is not None:  # every query row reads its keys from the pool
            out = meta.prefill(kv.data, b.page_table, meta.kv_lens, meta.q_lens, meta.q_rows, q, layer,
                               self.num_kv_heads, kv.layout.page_size, self.scale)
            return out.view(-1, Hq * D)
        queries = q[b.q_index]                                         # [B, max_q, Hq, D]
        if b.no_prefix:
            # Every sequence starts at position 0 and is right-padded, so the causal mask
            # is exactly the mask for every real query row (padded rows are dropped), and
            # torch's flash kernel skips the blocks above the diagonal (2x faster here).
            keys = k[b.q_index].transpose(1, 2)                        # [B, Hkv, max_q, D]
            values = v[b.q_index].transpose(1, 2)
            mask, causal = None, True
        else:
            keys, values = kv.gather(layer, meta.read_rows, b.batch_size)  # [Hkv, B, max_kv, D]
            keys, values, mask, causal = keys.to(q.dtype), values.to(q.dtype), meta.mask, False
            if queries.shape[1] == 1:
                return self._single_query(queries[:, 0], keys, values, meta.masked_out)
            if mask is None:   # one sequence's chunk after its prefix (begin)
                return self._prefix_then_chunk(queries[0], keys[:, 0], values[:, 0], b.kv_lens[0])
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal, enable_gqa=self.group != 1)
        out = out.transpose(1, 2).reshape(-1, Hq * D)                  # [B * max_q, Hq * D]
        return out[meta.row_slot]

    def _held_pages(self, k: torch.Tensor, v: torch.Tensor, layer: int,
                    meta: NativeMetadata) -> tuple[torch.Tensor, int]:
        """A pass's keys and values on an 8-bit pool as it holds them, dequantized, laid out as
        a pool of one layer with one page per sequence, [B, 1, 2, Hkv, page, D], and that
        page's size: a pass over its own fresh keys only (`no_prefix`) takes k, v [T, Hkv, D]
        (what the store held); any other reads its pages back from the pool."""
        b = meta.batch
        if b.no_prefix:
            pages = torch.stack((k[b.q_index], v[b.q_index]), 1).transpose(2, 3)    # [B, 2, Hkv, max_q, D]
        else:
            keys, values = self.kv.gather(layer, meta.read_rows, b.batch_size)     # [Hkv, B, P * S, D] each
            pages = torch.stack((keys, values), 0).transpose(0, 2).transpose(1, 2)  # [B, 2, Hkv, P * S, D]
        return pages.unsqueeze(1).contiguous(), pages.shape[3]

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
