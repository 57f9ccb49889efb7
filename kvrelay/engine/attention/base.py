"""The attention plug-in point: `AttentionBackend` (the contract), the per-pass metadata
every backend's extends, and the pieces several backends share (RoPE in torch, the dense
mask, the un-padding index)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.kv_pool import TORCH_DTYPES, KVPool


@dataclass
class AttentionMetadata:
    """What one forward pass's layers share, built once by `AttentionBackend.begin`.
    `meta(qkv, layer)` is that layer's attention (`AttentionBackend.forward`)."""
    backend: "AttentionBackend"
    batch: ForwardBatch
    cos: torch.Tensor          # [T, 1, D] in the compute dtype
    sin: torch.Tensor
    write_slots: torch.Tensor  # the pool's write address of the new tokens (kv.slot_ids)

    def __call__(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        return self.backend.forward(qkv, layer, self)


class AttentionBackend(ABC):
    """Attention of every layer of one model over one paged KV pool (`engine.kv_pool`).
    Models never address the pool: they hand a backend q, k and v and get the output.

    - `__init__(kv, num_heads)`: built once per (model, pool); the pool gives the KV heads,
      head_dim, page size, compute dtype and device; the model gives its query heads
      (a multiple of the KV heads: query head h reads KV head h // group).
    - `unavailable(device, dtype)` (class method): None when the backend runs on `device`
      computing in `dtype`, else why not, in a few words (`attention.resolve` reports it).
    - `begin(batch, rope)` runs once per forward pass, before layer 0, and returns the
      pass's metadata: every index tensor the layers need is built there, never per layer.
      `rope` is the model's float32 cos/sin table [max_positions, 2, D] (neox rotate-half).
    - `forward(qkv, layer, meta)`, per layer: qkv [T, Hq + 2 * Hkv, D] in the compute dtype,
      rows in the batch's token order, before RoPE (it may be rotated in place) ->
      [T, Hq * D] in the compute dtype. It applies RoPE to q and k at `batch.positions`,
      stores this pass's k and v in the pool at `layer` (`batch.write_pages`,
      `write_offsets`), and attends: query i of sequence b sees keys 0 .. its own position
      of b, the cached prefix included, with softmax scale D ** -0.5. The keys a pass reads
      are the ones the pool holds (an 8-bit pool's, dequantized), also those it just
      stored, so tokens never depend on how a prompt was chunked.
      The default is `rope_and_store` then `attend`; a backend may fuse them.
    - Every output row is finite: padded query rows never reach softmax with no key.
    """

    def __init__(self, kv: KVPool, num_heads: int) -> None:
        L = kv.layout
        self.kv = kv
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, L.num_kv_heads, L.head_dim
        self.group = num_heads // L.num_kv_heads
        self.dtype = TORCH_DTYPES[L.dtype]
        self.scale = L.head_dim ** -0.5

    @classmethod
    @abstractmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None: ...

    @abstractmethod
    def begin(self, batch: ForwardBatch, rope: torch.Tensor) -> AttentionMetadata: ...

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] with RoPE applied and already in the pool -> [T, Hq * D]."""

    def forward(self, qkv: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(*self.rope_and_store(qkv, layer, meta), layer, meta)

    def rope_and_store(self, qkv: torch.Tensor, layer: int,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) of qkv, RoPE applied to q and k, k and v written to the pool."""
        hq, hkv = self.num_heads, self.num_kv_heads
        q, k = apply_rope(qkv[:, :hq + hkv], meta.cos, meta.sin).split([hq, hkv], dim=1)
        v = qkv[:, hq + hkv:]
        self.kv.write(layer, meta.write_slots, k, v)
        return q, k, v

    def common(self, batch: ForwardBatch, rope: torch.Tensor) -> dict:
        """The base metadata's fields, for a subclass's `begin`."""
        cs = rope[batch.positions].to(self.dtype)
        return dict(backend=self, batch=batch, cos=cs[:, 0:1], sin=cs[:, 1:2],
                    write_slots=self.kv.slot_ids(batch.write_pages, batch.write_offsets))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D] (rotate-half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


def dense_mask(batch: ForwardBatch) -> torch.Tensor:
    """[B, 1, max_q, max_pages * page_size] bool, True where query i of sequence b may read
    key j: j <= its position and j < kv_len. A padded query row sees key 0 only, so softmax
    never sees an empty row (its output is never gathered)."""
    max_kv = batch.page_table.shape[1] * batch.kv_page_size
    q_pos = torch.zeros_like(batch.q_index)
    q_pos[batch.q_valid] = batch.positions
    k_pos = torch.arange(max_kv, device=q_pos.device)
    kv_len = torch.tensor(batch.kv_lens, dtype=torch.long, device=q_pos.device)
    m = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_len[:, None, None])
    m &= batch.q_valid[:, :, None]
    m[:, :, 0] |= ~batch.q_valid
    return m[:, None]


def row_slot(batch: ForwardBatch) -> torch.Tensor:
    """[T]: the slot in the flattened [B * max_q] padded queries of each row (the inverse of
    q_index over the valid slots), so attention un-pads with one gather."""
    slots = batch.q_valid.flatten().nonzero().squeeze(1)
    return torch.empty_like(slots).index_copy_(0, batch.q_index.flatten()[slots], slots)
