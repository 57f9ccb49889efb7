"""Every attention backend against torch_ref, the reference: the same passes (whole prompts,
decode steps, a chunk after its cached prefix, chunks beside decodes) over the same pages,
on each path cpu_native takes (native decode and prefill, the 8-bit pool's decode, AMX
tiles, the torch fallbacks for other head dims), and the cuda backend's Triton kernels
(on a CPU through Triton's interpreter; on a CUDA device in the gpu-marked tests)."""
from __future__ import annotations

import os

import pytest
import torch

from kvrelay.core.config import ModelOptions
from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine import attention
from kvrelay.engine.attention import ATTENTION_BACKENDS, make_attention_backend, resolve
from kvrelay.engine.kernels import elementwise
from kvrelay.engine.kv_pool import kv_pool_for
from kvrelay.engine.models.layers import RotaryEmbedding
from kvrelay.engine.runner import SeqChunk, build_forward_batch

# On a CPU, the cuda backend's kernels run in Triton's interpreter (read when they are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
S = 4   # tokens per page

# Passes over three sequences: (sequence, new tokens) each; pages are scattered.
PREFILL = [[(0, 5), (1, 17), (2, 1)]]
DECODE = PREFILL + [[(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]
CHUNKED = [[(1, 6)], [(1, 9)], [(1, 3)]]                       # one sequence, chunk after chunk
MIXED = [[(0, 7), (2, 3)], [(0, 9), (2, 1), (1, 4)], [(0, 1), (1, 12), (2, 1)]]
SCRIPTS = {"prefill": PREFILL, "decode": DECODE, "chunked": CHUNKED, "mixed": MIXED}


class Script:
    """Runs passes over a pool of its own with one backend; every backend given the same
    seed sees the same q, k, v."""

    def __init__(self, name: str, dtype: torch.dtype, hq: int, hkv: int, d: int, kv_dtype: str = "",
                 device: str = "cpu", layers: int = 2, seed: int = 0) -> None:
        layout = KVLayout("t", str(dtype).removeprefix("torch."), S, layers, hkv, d, kv_dtype)
        self.kv = kv_pool_for(layout, 40, device=device)
        self.attn = make_attention_backend(name, self.kv, hq)
        self.hq, self.hkv, self.d, self.layers, self.dtype, self.device = hq, hkv, d, layers, dtype, device
        self.table = RotaryEmbedding(d, 256, 10000.0, None).table(torch.device(device))
        self.gen = torch.Generator().manual_seed(seed)
        self.lens = [0, 0, 0]
        self.pages = [[1 + b + 3 * i for i in range(12)] for b in range(3)]   # interleaved

    def run(self, passes) -> list[torch.Tensor]:
        """Per pass, the output of every layer, stacked [layers, T, Hq * D], float32 on the CPU."""
        outs = []
        for p in passes:
            chunks = []
            for b, n in p:
                chunks.append(SeqChunk(list(range(n)), self.lens[b], self.pages[b]))
                self.lens[b] += n
            batch = build_forward_batch(chunks, S)
            if self.device != "cpu":
                batch = batch.to(self.device)
            meta = self.attn.begin(batch, self.table)
            T, width = len(batch.input_ids), self.hq + 2 * self.hkv
            layer_outs = []
            for layer in range(self.layers):
                qkv = torch.randn(T, width, self.d, generator=self.gen).to(self.dtype).to(self.device)
                layer_outs.append(meta(qkv, layer).float().cpu())
            outs.append(torch.stack(layer_outs))
        return outs


def assert_matches_reference(name: str, script: str, dtype: torch.dtype, hq: int, hkv: int, d: int,
                             kv_dtype: str = "", device: str = "cpu") -> None:
    got = Script(name, dtype, hq, hkv, d, kv_dtype, device)
    want = Script("torch_ref", dtype, hq, hkv, d, kv_dtype, device)
    for i, (a, b) in enumerate(zip(got.run(SCRIPTS[script]), want.run(SCRIPTS[script]))):
        assert a.shape == b.shape
        assert torch.isfinite(a).all()
        err = (a - b).abs().max().item()
        assert err < TOL[dtype], f"pass {i}: {name} is {err:.3g} from torch_ref"
    # Both stored the same keys and values (the native RoPE rounds like torch's, within an ulp).
    stored, ref = got.kv.data.float().cpu(), want.kv.data.float().cpu()
    assert (stored - ref).abs().max().item() <= (0.02 if dtype != torch.float32 or kv_dtype else 1e-5)


# ----------------------------------------------------------------- cpu_native


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 64), (6, 2, 32)])   # native head dims, then torch's
def test_cpu_native_matches_torch_ref(script, dtype, hq, hkv, d):
    assert_matches_reference("cpu_native", script, dtype, hq, hkv, d)


@pytest.mark.parametrize("script", ["prefill", "chunked", "mixed"])
def test_cpu_native_bfloat16_prefill_on_amx_tiles_matches_torch_ref(script, monkeypatch):
    """The passes AMX would route to torch's flash kernel, forced whatever this CPU has."""
    from kvrelay.engine.attention import cpu_native

    monkeypatch.setattr(cpu_native, "amx_bf16", lambda: True)
    assert_matches_reference("cpu_native", script, torch.bfloat16, 8, 2, 64)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_native_over_an_8bit_pool_matches_torch_ref(script, kv_dtype, dtype):
    assert_matches_reference("cpu_native", script, dtype, 8, 2, 64, kv_dtype)


# ----------------------------------------------------------------- cuda (Triton)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("dtype,hq,hkv,d", [(torch.float32, 4, 2, 16), (torch.bfloat16, 2, 1, 64),
                                            (torch.float16, 3, 3, 32)])
def test_triton_kernels_match_torch_ref(script, dtype, hq, hkv, d):
    """On a CPU, in Triton's interpreter: the kernels' own arithmetic, slowly, on small shapes."""
    assert_matches_reference("cuda", script, dtype, hq, hkv, d, device=TRITON_DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 12, 64), (8, 1, 80)])
def test_cuda_matches_torch_ref_on_a_gpu(script, dtype, hq, hkv, d):
    assert_matches_reference("cuda", script, dtype, hq, hkv, d, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_torch_ref_reads_an_8bit_pool_on_a_gpu(kv_dtype):
    got = Script("torch_ref", torch.bfloat16, 8, 2, 64, kv_dtype, device="cuda").run(MIXED)
    want = Script("torch_ref", torch.bfloat16, 8, 2, 64, kv_dtype, device="cpu").run(MIXED)
    assert all((a - b).abs().max().item() < TOL[torch.bfloat16] for a, b in zip(got, want))


def test_cuda_refuses_an_8bit_pool():
    kv = kv_pool_for(KVLayout("t", "float32", S, 1, 2, 16, "int8"), 4, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="8-bit KV cache.*torch_ref"):
        make_attention_backend("cuda", kv, 4)


# ----------------------------------------------------------------- choosing a backend


def test_auto_is_cpu_native_where_the_native_kernels_run(monkeypatch):
    monkeypatch.delenv(attention.ENV, raising=False)
    want = "cpu_native" if elementwise() is not None else "torch_ref"
    assert resolve("auto", "cpu", torch.float32) == want
    assert resolve("auto", "cpu", torch.float16) == "torch_ref"        # no native float16 kernels
    assert resolve("torch_ref", "cpu", torch.float32) == "torch_ref"


def test_environment_replaces_auto_but_not_an_explicit_choice(monkeypatch):
    monkeypatch.setenv(attention.ENV, "torch_ref")
    assert resolve("auto", "cpu", torch.float32) == "torch_ref"
    assert resolve("cpu_native", "cpu", torch.float32) == "cpu_native"
    monkeypatch.setenv(attention.ENV, "bogus")
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        resolve("auto", "cpu", torch.float32)


def test_an_unavailable_backend_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend cuda: needs a CUDA device, not cpu"):
        resolve("cuda", "cpu", torch.float32)
    with pytest.raises(ValueError, match="cpu_native: .*float16"):
        resolve("cpu_native", "cpu", torch.float16)


def test_load_model_refuses_an_unavailable_backend_before_loading(tiny_llama_dir, monkeypatch):
    from kvrelay.engine.loader import ModelLoadError, load_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ModelLoadError, match="cuda: needs a CUDA device"):
        load_model(ModelOptions(model=f"random:{tiny_llama_dir}", attention_backend="cuda"))
    loaded = load_model(ModelOptions(model=f"random:{tiny_llama_dir}", dtype="float32", attention_backend="torch_ref"))
    assert loaded.attention_backend == "torch_ref"


def test_flag_choices_are_auto_and_the_registry():
    import dataclasses

    from kvrelay.cli import field_choices

    f = {f.name: f for f in dataclasses.fields(ModelOptions)}["attention_backend"]
    assert field_choices(f) == ("auto", *ATTENTION_BACKENDS.names())
    assert set(ATTENTION_BACKENDS.names()) == {"cpu_native", "torch_ref", "cuda"}


# ----------------------------------------------------------------- a model on each backend


def model_logits(loaded, backend: str, device: str) -> list[torch.Tensor]:
    """Logits of a tiny model's passes: two prompts, a chunk beside a decode, decodes."""
    from kvrelay.engine.runner import ModelRunner

    a = loaded.arch
    kv = kv_pool_for(KVLayout("t", loaded.dtype, S, a.num_layers, a.num_kv_heads, a.head_dim), 40, device=device)
    runner = ModelRunner(loaded.model, kv, backend)
    pages = [[1 + b + 2 * i for i in range(16)] for b in range(2)]
    out = [runner.prefill([SeqChunk(list(range(3, 14)), 0, pages[0]), SeqChunk([5, 6, 7], 0, pages[1])]),
           runner.prefill([SeqChunk(list(range(20, 29)), 11, pages[0]), SeqChunk([8], 3, pages[1])])]
    for step in range(3):
        out.append(runner.decode([9 + step, 30 + step], [20 + step, 4 + step], pages))
    return [o.float().cpu() for o in out]


@pytest.mark.parametrize("backend", ["cpu_native", "cuda"])
def test_a_model_on_each_backend_gives_torch_ref_logits(tiny_loaded, backend):
    device = TRITON_DEVICE if backend == "cuda" else "cpu"
    if device != "cpu":
        tiny_loaded.model.to(device)
    try:
        got, want = model_logits(tiny_loaded, backend, device), model_logits(tiny_loaded, "torch_ref", device)
    finally:
        tiny_loaded.model.to("cpu")
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
