"""Attention backends, chosen with --attention-backend and imported only when chosen.

Every backend is an `attention.base.AttentionBackend` (the contract is its docstring). A new
backend is one module and one `register_lazy` line here: the CLI's choices and the test
matrices read this registry. `auto` is resolved by `resolve`; KVRELAY_ATTENTION_BACKEND
replaces `auto` (to run a whole test suite or a deployment under one backend).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvrelay.core.registry import Registry

if TYPE_CHECKING:
    import torch

    from kvrelay.engine.attention.base import AttentionBackend
    from kvrelay.engine.kv_pool import KVPool

ATTENTION_BACKENDS: Registry = Registry("attention backend")
ATTENTION_BACKENDS.register_lazy("cpu_native", "kvrelay.engine.attention.cpu_native:CpuNativeBackend")
ATTENTION_BACKENDS.register_lazy("torch_ref", "kvrelay.engine.attention.torch_ref:TorchRefBackend")
ATTENTION_BACKENDS.register_lazy("cuda", "kvrelay.engine.attention.cuda:CudaBackend")

ENV = "KVRELAY_ATTENTION_BACKEND"


def resolve(name: str, device: "torch.device | str", dtype: "torch.dtype") -> str:
    """The backend `name` stands for on `device` computing in `dtype`. auto (unless
    KVRELAY_ATTENTION_BACKEND names one): cpu_native on a CPU where the native kernels run,
    cuda on a CUDA device, torch_ref otherwise. A backend named explicitly (flag or
    environment) that cannot run there is a ValueError saying what to change, never a
    silent fallback."""
    import torch

    device = torch.device(device)
    explicit = name if name != "auto" else os.environ.get(ENV) or "auto"
    if explicit == "auto":
        candidate = {"cpu": "cpu_native", "cuda": "cuda"}.get(device.type)
        if candidate is not None and ATTENTION_BACKENDS.get(candidate).unavailable(device, dtype) is None:
            return candidate
        return "torch_ref"
    if explicit not in ATTENTION_BACKENDS.names():
        raise ValueError(f"unknown attention backend {explicit!r}; choose auto or one of: "
                         f"{', '.join(ATTENTION_BACKENDS.names())}")
    why = ATTENTION_BACKENDS.get(explicit).unavailable(device, dtype)
    if why is not None:
        source = "--attention-backend" if name != "auto" else ENV
        raise ValueError(f"{source} {explicit}: {why}; choose another --attention-backend (auto picks one that runs)")
    return explicit


def make_attention_backend(name: str, kv: "KVPool", num_heads: int) -> "AttentionBackend":
    """The backend `name` (auto resolved for the pool's device and compute dtype) built
    once for pool `kv` and a model with `num_heads` query heads."""
    from kvrelay.engine.kv_pool import TORCH_DTYPES

    dtype = TORCH_DTYPES[kv.layout.dtype]
    return ATTENTION_BACKENDS.get(resolve(name, kv.device, dtype))(kv, num_heads)
