"""Test helpers: tiny random-weight Hugging Face model directories (no download needed).

`make_tiny_model_dir` writes config.json + model.safetensors (built by transformers, so
the checkpoint is a genuine HF one) + the default model's tokenizer (or the one saved in
the directory that KVRELAY_TEST_TOKENIZER names). Every parameter is
random, biases and norm weights included, so a wrong name mapping cannot hide behind an
all-zero bias or an all-one norm.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from kvrelay.engine.models.base import ArchConfig

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}


def tiny_config_kwargs(arch: str = "llama", vocab_size: int = 49152, **overrides) -> dict:
    """HF config fields of a tiny model: 64 hidden, 3 layers, 4 heads over 2 KV heads."""
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
              rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1,
              tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        kw["sliding_window"] = None
    if arch == "qwen3":   # a head_dim other than hidden / heads, as the released Qwen3 models have
        kw["head_dim"] = 32
    kw.update(overrides)
    return kw


def tiny_arch_config(architecture: str = "LlamaForCausalLM", **overrides) -> ArchConfig:
    """An ArchConfig of the same tiny shape, for model tests that need no checkpoint."""
    kw = dict(architecture=architecture, vocab_size=512, hidden_size=64, intermediate_size=128,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    kw.update(overrides)
    return ArchConfig(**kw)


def make_tiny_model_dir(path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random `arch` ("llama", "qwen2", "qwen3", "mistral") model to `path` and return it.
    `overrides` are HF config fields (e.g. rope_scaling=..., num_hidden_layers=2)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from kvrelay.engine.loader import default_tokenizer
    from kvrelay.engine.sources import auto_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Where the default model's package cannot be installed (a GPU machine with nothing to
    # download), its tokenizer travels as files: benchmarks/gpu/prepare.sh.
    saved = os.environ.get("KVRELAY_TEST_TOKENIZER")
    tokenizer = auto_tokenizer(Path(saved)) if saved else default_tokenizer()
    config_class = getattr(transformers, _CONFIG_CLASSES[arch])
    cfg = config_class(**tiny_config_kwargs(arch, len(tokenizer), **overrides))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        _randomise_all(model, cfg.initializer_range)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def _randomise_all(model: torch.nn.Module, std: float) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(std * torch.randn_like(p))
