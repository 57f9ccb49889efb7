"""What the runner hands a model for one forward pass (pure data, built by the runner).

Tokens of all B sequences in the batch are flattened into T rows. Each sequence has
`q_lens[b]` new tokens this pass and `kv_lens[b]` tokens of KV after it (cached + new);
prefill passes have q_len > 1 (kv_len > q_len for a later chunk), decode passes q_len = 1.
Key position j of sequence b lives in page `page_table[b, j // page_size]` at slot
`j % page_size`; the mask is False for padding, future positions and j >= kv_len.
Every mask row has at least one True (padded query rows see key 0), so softmax never
produces NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64, absolute positions (RoPE)
    q_lens: list[int]            # [B] new tokens per sequence; sum == T
    kv_lens: list[int]           # [B] KV length per sequence after this pass
    write_pages: torch.Tensor    # [T] int64: page that receives each new token's K/V
    write_offsets: torch.Tensor  # [T] int64: slot within that page
    page_table: torch.Tensor     # [B, max_pages] int64: the pages of each sequence, in order (0 = pad)
    kv_page_size: int            # tokens per page (keys are read a whole page at a time)
    q_index: torch.Tensor        # [B, max_q] int64 row in T of each padded query (0 where padded)
    q_valid: torch.Tensor        # [B, max_q] bool, False where padded
    logits_index: torch.Tensor   # [B] int64 row in T whose logits are returned (last new token)
    no_prefix: bool = False      # True when every kv_len == q_len: attention may use the fresh K/V
    # [B, 1, max_q, max_pages * page_size] bool, True = may attend; None until `mask()` builds
    # it: only the torch attention path reads it, and a mixed pass's (decodes beside a long
    # chunk) would be tens of MB.
    attn_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    def mask(self) -> torch.Tensor:
        if self.attn_mask is None:
            max_kv = self.page_table.shape[1] * self.kv_page_size
            q_pos = torch.zeros_like(self.q_index)
            q_pos[self.q_valid] = self.positions
            k_pos = torch.arange(max_kv)
            kv_len = torch.tensor(self.kv_lens, dtype=torch.long)
            m = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_len[:, None, None])
            m &= self.q_valid[:, :, None]
            m[:, :, 0] |= ~self.q_valid   # padded query rows see key 0: softmax never sees an empty row
            self.attn_mask = m[:, None, :, :]
        return self.attn_mask
