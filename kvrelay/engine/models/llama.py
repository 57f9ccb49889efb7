"""The Llama family: Llama 2/3 (and SmolLM2), Mistral without sliding window, Qwen2.

Parameter names follow Hugging Face except two fused matmuls: `self_attn.qkv_proj` holds
q, k, v rows in that order and `mlp.gate_up_proj` holds gate then up rows; `load_weights`
maps the HF names onto their row slices.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvrelay.engine.attention.base import AttentionBackend, AttentionMetadata
from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.models.base import MODELS, ArchConfig, CausalLM, ModelLoadError
from kvrelay.engine.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from kvrelay.engine.models.linear import (QUANTIZED, Linear, PackedWeight, WeightFormat, lm_head_logits,
                                          pack_weight)
from kvrelay.engine.models.quant_linear import QuantWeight, quant_forward, quantize

# Checkpoint entries that hold no weight of ours.
_IGNORED = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=qkv_bias)
        self.o_proj = Linear(self.hq * self.d, arch.hidden_size, bias=o_bias)
        self.layer = layer

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x).view(-1, self.hq + 2 * self.hkv, self.d)
        self.before_rope(qkv)
        return self.o_proj.forward(attn(qkv, self.layer))

    def before_rope(self, qkv: torch.Tensor) -> None:
        """What an architecture does to q, k, v [T, heads, D] in place before RoPE (Qwen3's
        per-head norms); Llama does nothing."""


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, qkv_bias: bool, o_bias: bool,
                 attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = attention(arch, layer, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, attn: AttentionMetadata):
        """Residual stream `h` plus the previous layer's pending output `delta` ->
        (new stream, this layer's pending MLP output). Each add is fused into the norm
        that follows it; `h` is updated in place."""
        x, h = self.input_layernorm.add_and_norm(h, delta)
        x, h = self.post_attention_layernorm.add_and_norm(h, self.self_attn.forward(x, attn))
        return h, self.mlp.forward(x)


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, qkv_bias: bool, o_bias: bool, attention: type[LlamaAttention]) -> None:
        super().__init__()
        # An uninitialised weight: it is loaded or set by init_random_weights (see Linear).
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.embed_tokens.gguf_raw = None   # its GGUF blocks, for a tied head under --quantization gguf
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, qkv_bias, o_bias, attention)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


@MODELS.register("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    MODEL_TYPES = ("llama",)
    CONFIG_DEFAULTS = {"eos_token_id": 2}
    GGUF_PERMUTED_QK = True
    # `arch.attention_bias` puts a bias on q, k, v and o in Llama, on q, k, v only in Qwen2.
    o_proj_bias = True
    attention: type[LlamaAttention] = LlamaAttention

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        qkv_bias = arch.attention_bias
        o_bias = arch.attention_bias and self.o_proj_bias
        self.model = LlamaModel(arch, qkv_bias, o_bias, self.attention)
        # Tied: the head reads embed_tokens.weight, so no second parameter can drift from it.
        self.lm_head = (None if arch.tie_word_embeddings
                        else Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self._head_packed: PackedWeight | None = None   # a tied head kept float
        self._head_quant: QuantWeight | None = None     # a tied head kept quantized
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                      arch.rope_scaling)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attention: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        attn = attention.begin(batch, self.rotary.table(h.device))
        delta = None
        # The decoder's modules carry no hooks, so their forward is called directly:
        # nn.Module.__call__ costs 1-2 us a call, ~200 calls a decode step (3-5% of a
        # one-sequence int4 step on a Zen 2).
        for done, layer in enumerate(self.model.layers, 1):
            h, delta = layer.forward(h, delta, attn)
            if after_layer is not None:
                after_layer(done)
        rows = batch.logits_index
        h, _ = self.model.norm.add_and_norm(h[rows], delta[rows])
        return self.head_logits(h)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of final-normed hidden states `h`."""
        head = self.lm_head
        quant = self._head_quant if head is None else head.quant
        if quant is not None:
            return quant_forward(h, quant, None, out_dtype=torch.float32)
        if head is not None:
            return lm_head_logits(h, head.weight, head.packed)
        return lm_head_logits(h, self.model.embed_tokens.weight, self._head_packed)

    def prepare(self, fmt: WeightFormat | None = None) -> None:
        """The head takes `fmt.for_head`; a tied head keeps its own quantized or packed copy
        (the embedding lookup still reads the float rows)."""
        fmt = fmt or WeightFormat()
        head_fmt = fmt.for_head
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(head_fmt if module is self.lm_head else fmt)
        for module in self.modules():
            if isinstance(module, SwiGLU):
                module.fuse()
        if self.lm_head is None:
            embed = self.model.embed_tokens
            if head_fmt.store in QUANTIZED:
                self._head_quant = quantize(embed.weight.detach(), head_fmt, raw=embed.gguf_raw)
            else:
                self._head_packed = pack_weight(embed.weight, None, head_fmt)
        self.model.embed_tokens.gguf_raw = None

    def _fused_slices(self) -> dict[str, tuple[str, int, int]]:
        """HF projection name -> (our fused projection, first row, row count)."""
        a = self.arch
        q, kv, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                "v_proj": ("qkv_proj", q + kv, kv),
                "gate_proj": ("gate_up_proj", 0, i), "up_proj": ("gate_up_proj", i, i)}

    @torch.no_grad()
    def load_weights(self, named) -> None:
        params, slices = dict(self.named_parameters()), self._fused_slices()
        filled: dict[str, int] = {}
        for name, tensor in named:
            if name.endswith(_IGNORED) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            target, start, rows = name, 0, None
            if len(parts) >= 2 and parts[-2] in slices:
                fused, start, rows = slices[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                                     "is the architecture in config.json right?")
            dest = params[target] if rows is None else params[target][start:start + rows]
            if dest.shape != tensor.shape:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(dest.shape)}: the checkpoint does not match its config")
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.numel()
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), first {missing[0]!r}: "
                                 "the file is incomplete or not a checkpoint of this architecture")


@MODELS.register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    """Mistral without sliding window: the loader caps the context at the window instead."""
    MODEL_TYPES = ("mistral",)
    CONFIG_DEFAULTS = {"eos_token_id": 2, "sliding_window": 4096}
    CONTEXT_IS_WINDOW = True


@MODELS.register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: q/k/v bias (the loader sets `attention_bias` for it), no sliding window."""
    MODEL_TYPES = ("qwen2",)
    CONFIG_DEFAULTS = {}
    GGUF_PERMUTED_QK = False
    QKV_BIAS = True
    o_proj_bias = False
