"""`torch_ref`: attention in plain torch on any device, the reference every other backend
is tested against. Every pass reads its keys back from the pool (so an 8-bit pool's are
the dequantized ones it holds) and computes an explicit masked softmax in float32. Simple
over fast: it reads every page of the batch and builds the dense mask."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.attention.base import AttentionBackend, AttentionMetadata, dense_mask, row_slot
from kvrelay.engine.forward import ForwardBatch


@dataclass
class TorchRefMetadata(AttentionMetadata):
    read_rows: torch.Tensor   # the pool's read address of batch.page_table (kv.row_ids)
    masked_out: torch.Tensor  # [B, 1, max_q, max_kv] bool, True where a key is hidden
    row_slot: torch.Tensor    # [T]


class TorchRefBackend(AttentionBackend):
    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def begin(self, batch: ForwardBatch, rope: torch.Tensor) -> TorchRefMetadata:
        return TorchRefMetadata(**self.common(batch, rope), read_rows=self.kv.row_ids(batch.page_table),
                                masked_out=~dense_mask(batch), row_slot=row_slot(batch))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               meta: TorchRefMetadata) -> torch.Tensor:
        b = meta.batch
        keys, values = self.kv.gather(layer, meta.read_rows, b.batch_size)        # [Hkv, B, max_kv, D]
        keys = keys.float().repeat_interleave(self.group, 0).transpose(0, 1)       # [B, Hq, max_kv, D]
        values = values.float().repeat_interleave(self.group, 0).transpose(0, 1)
        queries = q[b.q_index].float().transpose(1, 2)                              # [B, Hq, max_q, D]
        scores = (queries @ keys.transpose(-1, -2)).mul_(self.scale)                # [B, Hq, max_q, max_kv]
        scores.masked_fill_(meta.masked_out, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values                               # [B, Hq, max_q, D]
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)
        return out[meta.row_slot].to(q.dtype)
