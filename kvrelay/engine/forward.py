"""What the runner hands a model for one forward pass (pure data, built by the runner).

Tokens of all B sequences in the batch are flattened into T rows. Each sequence has
`q_lens[b]` new tokens this pass and `kv_lens[b]` tokens of KV after it (cached + new);
prefill passes have q_len > 1 (kv_len > q_len for a later chunk), decode passes q_len = 1.
Key position j of sequence b lives in page `page_table[b, j // page_size]` at slot
`j % page_size`. Query i of sequence b (position `positions[q_index[b, i]]`) sees the keys
at positions up to its own. How attention reads them is the attention backend's
(`engine.attention`); a backend that wants a dense mask builds it (`attention.base.dense_mask`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

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

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    def to(self, device: torch.device | str) -> "ForwardBatch":
        """The same batch with its tensors on `device` (a model and pool on an accelerator)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})
