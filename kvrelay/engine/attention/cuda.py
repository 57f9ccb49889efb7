"""`cuda`: paged attention on a CUDA device with Triton kernels (`triton_kernels.py`, which
ships with torch's CUDA builds): a decode kernel for passes of one query per sequence, and
a varlen causal prefill kernel over the cached prefix for every other pass. Both read the
pool's pages in place. RoPE and the K/V store are the base class's torch ops. An 8-bit pool
is not read here (torch_ref reads it on any device)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from kvrelay.engine.attention.base import AttentionBackend, AttentionMetadata
from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.kv_pool import KVPool

BLOCK_N = 32   # keys per step of either kernel
BLOCK_M = 16   # query rows per program of the prefill kernel (tl.dot takes at least 16)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class CudaMetadata(AttentionMetadata):
    page_table: torch.Tensor   # [B, P] int64, on the pool's device
    kv_lens: torch.Tensor      # [B] int64
    q_lens: torch.Tensor       # [B] int64
    q_rows: torch.Tensor       # [B] int64: first row in T of each sequence's queries
    decode: bool               # one query per sequence
    max_q: int


class CudaBackend(AttentionBackend):
    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
            return f"needs a CUDA device, not {device.type}"
        if importlib.util.find_spec("triton") is None:
            return "needs triton (it ships with torch's CUDA builds: pip install triton)"
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"computes bfloat16, float16 or float32, not {dtype}"
        return None

    def __init__(self, kv: KVPool, num_heads: int) -> None:
        super().__init__(kv, num_heads)
        if kv.layout.quantized:
            raise ValueError(f"--attention-backend cuda does not read an 8-bit KV cache ({kv.layout.kv_dtype}); "
                             "use --kv-cache-dtype auto or --attention-backend torch_ref")
        from kvrelay.engine.attention import triton_kernels   # imports triton: only when this backend is built

        self._k = triton_kernels
        self.block_d = max(16, 1 << (self.head_dim - 1).bit_length())
        self.upcast = kv.data.dtype == torch.float32 or interpreting()

    def begin(self, batch: ForwardBatch, rope: torch.Tensor) -> CudaMetadata:
        dev = self.kv.device
        q_lens = torch.tensor(batch.q_lens, dtype=torch.int64)
        return CudaMetadata(**self.common(batch, rope), page_table=batch.page_table.to(dev),
                            kv_lens=torch.tensor(batch.kv_lens, dtype=torch.int64).to(dev),
                            q_lens=q_lens.to(dev), q_rows=(torch.cumsum(q_lens, 0) - q_lens).to(dev),
                            decode=max(batch.q_lens) == 1, max_q=max(batch.q_lens))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               meta: CudaMetadata) -> torch.Tensor:
        pool = self.kv.data
        sp, sl, skv, sh, ss, _ = pool.stride()
        out = q.new_empty(q.shape)   # contiguous: q is a view of qkv
        B, common = meta.batch.batch_size, dict(GROUP=self.group, PAGE=self.kv.layout.page_size, D=self.head_dim,
                                                BLOCK_D=self.block_d, BLOCK_N=BLOCK_N)
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.page_table.stride(0),
                   sp, skv, sh, ss, layer * sl, self.scale)
        if meta.decode:
            self._k.paged_decode_kernel[(B, self.num_heads)](
                q, out, pool, meta.page_table, meta.kv_lens, *strides, **common)
        else:
            grid = (B, self.num_heads, -(-meta.max_q // BLOCK_M))
            self._k.paged_prefill_kernel[grid](
                q, out, pool, meta.page_table, meta.kv_lens, meta.q_lens, meta.q_rows, *strides,
                BLOCK_M=BLOCK_M, UPCAST=self.upcast, **common)
        return out.view(-1, self.num_heads * self.head_dim)
