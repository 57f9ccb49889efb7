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
        b, G, D = meta.batch, self.group, self.head_dim
        B, max_q, Hkv = b.batch_size, b.q_index.shape[1], self.num_kv_heads
        keys, values = self.kv.gather(layer, meta.read_rows, B)                   # [Hkv, B, max_kv, D]
        f32 = dict(dtype=torch.float32, memory_format=torch.contiguous_format)
        keys, values = keys.transpose(0, 1).to(**f32), values.transpose(0, 1).to(**f32)   # [B, Hkv, max_kv, D]
        # Query head h reads kv head h // G: the G heads of a kv head are rows of one matmul.
        queries = q.float()[b.q_index].view(B, max_q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * max_q, D)
        scores = (queries @ keys.transpose(-1, -2)).mul_(self.scale)              # [B, Hkv, G * max_q, max_kv]
        scores.view(B, Hkv, G, max_q, -1).masked_fill_(meta.masked_out[:, :, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values                               # [B, Hkv, G * max_q, D]
        out = out.view(B, Hkv, G, max_q, D).permute(0, 3, 1, 2, 4).reshape(B * max_q, Hkv * G * D)
        return out[meta.row_slot].to(q.dtype)
