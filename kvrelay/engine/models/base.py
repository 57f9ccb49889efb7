"""The model plug-in point: an architecture config, the CausalLM contract, a registry."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from kvrelay.core.registry import Registry
from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.sources import ModelLoadError  # noqa: F401 (re-exported: the models raise it)

if TYPE_CHECKING:
    from kvrelay.engine.models.linear import WeightFormat


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only model, read from a HF config.json or GGUF metadata."""
    architecture: str            # registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v bias


class CausalLM(nn.Module):
    """Contract for every architecture:

    - `__init__(arch: ArchConfig)` builds the module with uninitialised weights.
    - `forward(batch, attention, after_layer=None)` computes the new tokens of `batch`: it
      calls `attention.begin(batch, rope_table)` once, then each layer hands its qkv to the
      metadata that returns (`meta(qkv, layer)`), which applies RoPE, stores this pass's K
      and V in the pool and attends (`engine.attention.base`); models never address the pool.
      It returns float32 logits [B, vocab] for the rows in `batch.logits_index`.
      `after_layer`, when given, is called once after each layer with the number of layers
      done (1, 2, ...; their K/V is in the pool then), on the calling thread; what it
      does must not touch the pool pages of `batch` or the model (the engine heartbeats
      its peers, answers read-only calls and sends finished layers' KV there).
    - `load_weights(named)` takes (HF-style name, tensor) pairs, already un-permuted.
    - `prepare(fmt)` runs once after the weights are final (e.g. to pre-pack them for the
      CPU's matmul library, or to quantize them, as `fmt` says); weights must not change
      afterwards.

    Each class declares itself to the one generic loader (`engine.loader`) with the class
    attributes below; a new architecture is a new module and one line in `models/__init__.py`.
    """

    MODEL_TYPES: tuple[str, ...] = ()
    """Hugging Face `model_type` values (also GGUF `general.architecture`) it serves."""
    CONFIG_DEFAULTS: dict = {}
    """Defaults of its transformers config class that differ from the shared ones
    (`loader._SHARED_DEFAULTS`), so a config.json that leaves them out still reads as
    transformers reads it."""
    GGUF_PERMUTED_QK = False
    """GGUF stores q/k projection rows permuted for llama.cpp's RoPE layout (undone on load)."""
    QKV_BIAS = False
    """q, k and v carry a bias whatever the config's `attention_bias` says (Qwen2)."""
    CONTEXT_IS_WINDOW = False
    """Served without its sliding window, so the context is capped at the window (Mistral)."""

    def prepare(self, fmt: WeightFormat | None = None) -> None:
        pass

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv, after_layer: Callable[[int], None] | None = None) -> torch.Tensor: ...

    @abstractmethod
    def load_weights(self, named) -> None: ...


MODELS: Registry[type[CausalLM]] = Registry("model architecture")


def model_types() -> dict[str, str]:
    """Hugging Face / GGUF model type -> registered architecture name."""
    return {t: name for name in MODELS.names() for t in MODELS.get(name).MODEL_TYPES}
