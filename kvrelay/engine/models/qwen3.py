"""Qwen3 (dense): the Llama layout plus an RMSNorm over each query and key head before RoPE
(`self_attn.q_norm`, `self_attn.k_norm`, one weight of head_dim each, shared by the heads)."""
from __future__ import annotations

import torch

from kvrelay.engine.models.base import MODELS, ArchConfig
from kvrelay.engine.models.layers import RMSNorm
from kvrelay.engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, arch: ArchConfig, layer: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(arch, layer, qkv_bias, o_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def before_rope(self, qkv: torch.Tensor) -> None:
        for norm, heads in ((self.q_norm, slice(0, self.hq)), (self.k_norm, slice(self.hq, self.hq + self.hkv))):
            part = qkv[:, heads]
            part.copy_(norm(part.reshape(-1, self.d)).view_as(part))


@MODELS.register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: `attention_bias` (off in every released checkpoint) biases q, k, v and o, as in
    Llama; head_dim is stated in the config (its class defaults it to 128, not hidden / heads);
    served without a sliding window (the loader refuses `use_sliding_window`)."""
    MODEL_TYPES = ("qwen3",)
    CONFIG_DEFAULTS = {"head_dim": 128}
    GGUF_PERMUTED_QK = False
    attention = Qwen3Attention
