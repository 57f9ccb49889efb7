"""The Llama family: Llama 2/3 (and SmolLM2), Mistral without sliding window, Qwen2.

Parameter names follow Hugging Face except two fused matmuls: `qkv_proj` holds q, k, v
rows in that order and `mlp.gate_up_proj` holds gate then up rows; `load_weights` maps the
HF names onto their slices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.models.base import MODELS, ArchConfig, CausalLM, ModelLoadError
from kvrelay.engine.models.layers import AttnMeta, PagedAttention, RMSNorm, RotaryEmbedding, SwiGLU, apply_rope

# HF name fragment -> (fused parameter fragment, shard). Shards are laid out in the order
# returned by `_shard_sizes`.
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up"),
}
# Checkpoint entries that hold no weight of ours.
_IGNORED = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.hq * self.d, arch.hidden_size, bias=o_bias)
        self.attn = PagedAttention(self.hq, self.hkv, self.d, layer)

    def forward(self, x: torch.Tensor, meta: AttnMeta, kv) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = apply_rope(q.view(-1, self.hq, self.d), meta.cos, meta.sin)
        k = apply_rope(k.view(-1, self.hkv, self.d), meta.cos, meta.sin)
        return self.o_proj(self.attn(q, k, v.view(-1, self.hkv, self.d), meta, kv))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(self, h: torch.Tensor, meta: AttnMeta, kv) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), meta, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, qkv_bias, o_bias) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


@MODELS.register("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    qkv_bias_always = False  # Qwen2 has q/k/v bias whatever the config says

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        qkv_bias = self.qkv_bias_always or arch.attention_bias
        o_bias = arch.attention_bias and not self.qkv_bias_always
        self.model = LlamaModel(arch, qkv_bias, o_bias)
        # Tied: the head reads embed_tokens.weight, so no second parameter can drift from it.
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        meta = AttnMeta.build(batch, self.rotary, h.dtype)
        for layer in self.model.layers:
            h = layer(h, meta, kv)
        h = self.model.norm(h[batch.logits_index])
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, head).float()

    def _shard_sizes(self, fused: str) -> dict[str, int]:
        a = self.arch
        if fused == ".qkv_proj.":
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return {"q": q, "k": kv, "v": kv}
        return {"gate": a.intermediate_size, "up": a.intermediate_size}

    def _target(self, name: str) -> tuple[str, int, int]:
        """Our parameter name and the row range [start, start + rows) an HF tensor fills."""
        for frag, (fused, shard) in _FUSED.items():
            if frag in name:
                sizes = self._shard_sizes(fused)
                return name.replace(frag, fused), _offset(sizes, shard), sizes[shard]
        return name, 0, -1

    @torch.no_grad()
    def load_weights(self, named) -> None:
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in named:
            if name.endswith(_IGNORED) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, start, rows = self._target(name)
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                                     "is the architecture in config.json right?")
            dest = params[target] if rows < 0 else params[target][start:start + rows]
            if dest.shape != tensor.shape:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(dest.shape)}: the checkpoint does not match its config")
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.numel()
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), first {missing[0]!r}: "
                                 "the file is incomplete or not a checkpoint of this architecture")


def _offset(sizes: dict[str, int], shard: str) -> int:
    start = 0
    for name, n in sizes.items():
        if name == shard:
            return start
        start += n
    raise KeyError(shard)


@MODELS.register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    """Mistral without sliding window: the loader caps the context at the window instead."""


@MODELS.register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_always = True
