"""Quantized weights (`--quantization int8|int4|gguf`): each native kernel variant the CPU
runs and the torch fallbacks against the dequantized-fp32 matmul over odd shapes; the
quantizers' error bounds; GGUF blocks decoded as llama.cpp's reference does; models
loaded quantized stay close to float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvrelay.core.config import ModelOptions
from kvrelay.engine import kernels
from kvrelay.engine.kernels.quant import quant_gemm
from kvrelay.engine.loader import load_model
from kvrelay.engine.models import quant_linear as ql
from kvrelay.engine.models.base import ModelLoadError
from kvrelay.engine.models.linear import Linear, WeightFormat

VARIANTS = ("avx512_bf16", "avx512_vnni", "avx2", "torch")
SHAPES = [(37, 100), (16, 32), (1, 3), (70, 577), (33, 256)]     # (N, K)
ROWS = (1, 3, 17, 64, 129)
GGUF_SHAPES = [(37, 256), (16, 512), (3, 768)]                    # K whole 256-blocks (Q4_K)
GGUF_TYPES = (ql.GGML_Q8_0, ql.GGML_Q4_0, ql.GGML_Q4_1, ql.GGML_Q4_K)


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Each kernel variant in turn; one the CPU lacks must be refused by name."""
    name = request.param
    if name not in kernels.available_isas():
        with pytest.raises(kernels.IsaUnavailable, match="lacks"):
            kernels.select_isa(name)
        yield None
        return
    before = kernels.isa()
    kernels.select_isa(name)
    yield name
    kernels.select_isa(before)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as gemm_quant.c sees it: int8 per row and block of 32, round half away from zero."""
    M, K = x.shape
    kp = -(-K // 32) * 32
    b = F.pad(x.float(), (0, kp - K)).view(M, -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    s = b * torch.where(amax > 0, 127 / amax, 0)
    q = torch.trunc(s + torch.where(s >= 0, 0.5, -0.5))
    return (q * (amax / 127)).view(M, kp)[:, :K]


def check_matmul(qw: ql.QuantWeight, deq: torch.Tensor, native: bool, seed: int = 0) -> None:
    """quant_forward against x @ deq.T (+ bias) for every row count and both input dtypes.
    The native kernel quantizes activations, so its exact reference uses them quantized;
    it also stays within 2% of the unquantized product."""
    gen = torch.Generator().manual_seed(seed)
    n, k = deq.shape
    bias = torch.randn(n, generator=gen)
    for M in ROWS:
        x = torch.randn(M, k, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            out = ql.quant_forward(xd, qw, bias if M % 2 else None)
            assert out.dtype == dtype and out.shape == (M, n)
            b = bias if M % 2 else torch.zeros(n)
            exact = (quantized_activations(xd) if native else xd.float()) @ deq.T + b
            full = xd.float() @ deq.T + b
            scale = full.abs().max().item() + 1e-6
            tol = 2e-5 if dtype == torch.float32 else 1 / 64
            if qw.path in ("int8pack", "int4pack") and dtype == torch.bfloat16:
                tol = 3e-2   # torch's ops round scales and sums to bfloat16
            assert (out.float() - exact).abs().max().item() <= tol * scale, (qw.kind, M, dtype)
            assert (out.float() - full).norm().item() <= 0.02 * full.norm().item() + 1e-6, (qw.kind, M, dtype)


def reference_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    q, d, mn = ql.quantize_int4(w, group)
    n, k = w.shape
    g = q.float().view(n, -1, group) * d.float()[..., None] + mn.float()[..., None]
    return g.view(n, -1)[:, :k]


@pytest.mark.parametrize("store,group", [("int8", 32), ("int4", 32), ("int4", 128)])
def test_quantized_matmul_matches_dequantized_fp32(variant, store, group):
    if variant is None:
        return
    native = variant != "torch"
    assert (quant_gemm() is not None) == native
    for i, (n, k) in enumerate(SHAPES):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.05
        qw = ql.quantize(w, WeightFormat(torch.float32, store, group))
        assert qw.path == ("native" if native else f"{store}pack")
        deq = ql.dequantize(qw) if qw.path != "int4pack" else reference_int4(w, group)
        if store == "int4":
            assert torch.equal(deq, reference_int4(w, group))   # the packing keeps every code and scale
        check_matmul(qw, deq, native, seed=i)


def random_gguf_blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, row bytes]: gguf's own quantizer where it has one; for Q4_K random codes,
    scales and mins under sane fp16 superblock scales."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize
    rng = np.random.default_rng(seed)
    if qtype != ql.GGML_Q4_K:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return torch.from_numpy(quantize(w, GGMLQuantizationType(qtype)).copy())
    b = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    b[..., 0:2] = (rng.random((n, k // 256, 1)) * 0.004).astype(np.float16).view(np.uint8)
    b[..., 2:4] = (rng.random((n, k // 256, 1)) * 0.004).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def gguf_reference(qtype: int, rows: torch.Tensor) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(dequantize(rows.numpy(), GGMLQuantizationType(qtype)).astype(np.float32))


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_gguf_blocks_matmul_matches_gguf_dequantization(variant, qtype):
    if variant is None:
        return
    for i, (n, k) in enumerate(GGUF_SHAPES):
        rows = random_gguf_blocks(qtype, n, k, seed=i)
        ref = gguf_reference(qtype, rows)
        qw = ql.quantize(ref, WeightFormat(torch.float32, "gguf"), raw=(qtype, rows))
        native = variant != "torch"
        assert qw.path == ("native" if native else "float")
        deq = ql.dequantize(qw)
        # Q4_K's per-32 scales d*sc and dmin*m are kept in fp16: relative 2^-11 of each term.
        tol = 2e-3 * ref.abs().max().item() if qtype == ql.GGML_Q4_K else 1e-6
        assert (deq - ref).abs().max().item() <= tol
        check_matmul(qw, deq, native, seed=i)


def test_gguf_type_without_kernel_keeps_float_weights():
    w = torch.randn(8, 64)
    qw = ql.quantize(w, WeightFormat(torch.float32, "gguf"), raw=(14, torch.zeros(8, 52, dtype=torch.uint8)))
    assert qw.path == "float" and torch.equal(ql.dequantize(qw), w)
    assert torch.allclose(ql.quant_forward(torch.ones(2, 64), qw, None), torch.ones(2, 64) @ w.T)


def test_quantize_dequantize_error_is_bounded():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 300, generator=gen) * torch.logspace(-3, 0, 40)[:, None]   # rows of every scale
    q, d = ql.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * d[:, None] - w).abs() <= d[:, None] / 2 + 1e-7).all()
    for group in (32, 64):
        q, d16, mn16 = ql.quantize_int4(w, group)
        assert q.max() <= 15 and q.shape == (40, -(-300 // group) * group)
        deq = reference_int4(w, group)
        d, mn = d16.float().repeat_interleave(group, 1)[:, :300], mn16.float().repeat_interleave(group, 1)[:, :300]
        bound = d / 2 + 2 ** -10 * (mn.abs() + 16 * d) + 1e-7   # fp16 rounding of d and mn
        assert ((deq - w).abs() <= bound).all()


def test_zero_rows_and_weights_stay_exact(variant):
    if variant is None:
        return
    w = torch.zeros(20, 64)
    w[3] = 0.5
    for store in ("int8", "int4"):
        qw = ql.quantize(w, WeightFormat(torch.float32, store, 32))
        x = torch.zeros(3, 64)
        x[1] = 1.0
        out = ql.quant_forward(x, qw, None)
        expect = x @ w.T
        assert torch.allclose(out, expect, atol=1e-6), store


def test_packed_weights_survive_a_switch_to_torch():
    """The native layout is shared by every variant; with none it is dequantized per call."""
    if kernels.available_isas() == ("torch",):
        return
    before = kernels.isa()
    kernels.select_isa(kernels.available_isas()[0])
    w = torch.randn(24, 96) * 0.1
    qw = ql.quantize(w, WeightFormat(torch.float32, "int4", 32))
    x = torch.randn(5, 96)
    native = ql.quant_forward(x, qw, None)
    try:
        kernels.select_isa("torch")
        fallback = ql.quant_forward(x, qw, None)
    finally:
        kernels.select_isa(before)
    assert torch.allclose(fallback, x @ ql.dequantize(qw).T, atol=1e-5)
    assert (native - fallback).norm() <= 0.02 * fallback.norm()


def test_a_quantized_linear_binds_its_matmul_once_and_again_after_a_variant_switch():
    """Linear.forward keeps `quant_call` (checks and constant arguments taken once) and
    rebinds when the kernel variant changes; every call equals quant_forward's, and an
    input of the wrong width is refused, not computed."""
    if kernels.available_isas() == ("torch",):
        return
    before = kernels.isa()
    kernels.select_isa(kernels.available_isas()[0])
    lin = Linear(96, 24, bias=True)
    lin.weight = torch.nn.Parameter(torch.randn(24, 96) * 0.1, requires_grad=False)
    lin.bias = torch.nn.Parameter(torch.randn(24), requires_grad=False)
    lin.prepare(WeightFormat(torch.float32, "int4", 32))
    qw, x = lin.quant, torch.randn(5, 96)
    try:
        first = lin.forward(x)
        bound = lin.quant_call
        assert bound.kernel is quant_gemm() and bound.kernel is not None
        assert torch.equal(first, ql.quant_forward(x, qw, lin.bias))
        assert torch.equal(lin.forward(x[:2]), ql.quant_forward(x[:2], qw, lin.bias)) and lin.quant_call is bound
        with pytest.raises(ValueError, match="k=96"):
            lin.forward(torch.randn(5, 64))
        kernels.select_isa("torch")
        fallback = lin.forward(x)
        assert lin.quant_call is not bound and lin.quant_call.kernel is None
        assert torch.allclose(fallback, x @ ql.dequantize(qw).T + lin.bias, atol=1e-5)
    finally:
        kernels.select_isa(before)
    assert lin.forward(x).shape == (5, 24) and lin.quant_call.kernel is quant_gemm()


def test_nbytes_counts_codes_and_scales():
    w = torch.randn(64, 256)
    int4 = ql.quantize(w, WeightFormat(torch.float32, "int4", 32))
    int8 = ql.quantize(w, WeightFormat(torch.float32, "int8", 32))
    if int4.path == "native":
        assert int4.nbytes == 64 * 256 // 2 + 64 * (256 // 32) * 2 * 2   # 4 bits, fp16 d and mn per 32
        assert int8.nbytes == 64 * 256 + 64 * 4                          # 8 bits, float32 d per row
    assert int4.nbytes < int8.nbytes < w.numel() * 2


def test_unsupported_int4_group_is_refused():
    with pytest.raises(ModelLoadError, match="group"):
        ql.quantize(torch.randn(16, 64), WeightFormat(torch.float32, "int4", 48))


def test_fused_gguf_parts_join_in_row_order_or_keep_float():
    from kvrelay.engine.models.llama import LlamaForCausalLM
    from kvrelay.engine.models.testing import tiny_arch_config
    arch = tiny_arch_config()
    model = LlamaForCausalLM(arch)
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size

    def rows(n: int, fill: int) -> torch.Tensor:
        return torch.full((n, 40), fill, dtype=torch.uint8)
    parts = [("model.layers.0.mlp.up_proj.weight", 3, rows(inter, 2)),
             ("model.layers.0.mlp.gate_proj.weight", 3, rows(inter, 1)),
             ("model.layers.0.self_attn.q_proj.weight", 8, rows(q, 0)),
             ("model.layers.0.self_attn.k_proj.weight", 8, rows(kv, 0)),
             ("model.layers.0.self_attn.v_proj.weight", 2, rows(kv, 0))]
    ql.attach_gguf_raw(model, parts, model._fused_slices())
    layer = model.model.layers[0]
    qtype, joined = layer.mlp.gate_up_proj.gguf_raw
    assert qtype == 3 and joined.shape == (2 * inter, 40)
    assert joined[:inter].eq(1).all() and joined[inter:].eq(2).all()
    assert layer.self_attn.qkv_proj.gguf_raw is None          # mixed types: float weights
    assert model.model.layers[1].mlp.gate_up_proj.gguf_raw is None


# ------------------------------------------------------------------ models

def _logits(loaded, prompts, steps: int = 3):
    from test_models import PagedSession
    sess = PagedSession(loaded, page_size=16)
    try:
        out = [sess.prefill(prompts, reserve=steps)]
        for _ in range(steps):
            out.append(sess.decode(out[-1].argmax(-1).tolist()))
        return out
    finally:
        sess.close()


@pytest.fixture(scope="module")
def tiny_tied_dir(tmp_path_factory):
    from kvrelay.engine.models.testing import make_tiny_model_dir
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-tied"), arch="llama", seed=1, tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_quantized_follows_float32(tiny_llama_dir, tiny_tied_dir, dtype, tied):
    """Prefill logits (same inputs) against float32's, relative to their norm: the bounds
    are the formats' own error on random weights (the torch fallbacks, which keep the
    activations in float, measure 0.026 and 0.24 too); the native kernels' extra error is
    checked against those fallbacks on the same codes. Each model then decodes its own
    greedy tokens with finite logits. An untied head is a Linear, quantized too."""
    from test_models import random_prompts
    model_dir = str(tiny_tied_dir if tied else tiny_llama_dir)
    prompts = random_prompts(49152, [7, 4, 12])
    ref = _logits(load_model(ModelOptions(model=model_dir, dtype="float32")), prompts)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()
    for quant, tol in (("int8", 0.05), ("int4", 0.35)):
        loaded = load_model(ModelOptions(model=model_dir, dtype=dtype, quantization=quant))
        linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.quant is not None and m.weight.numel() == 0 for m in linears)
        got = _logits(loaded, prompts)
        assert all(torch.isfinite(g).all() for g in got)
        assert rel(got[0], ref[0]) <= tol, quant
        if dtype == "float32" and loaded.kernels != "torch":
            try:
                fallback = load_model(ModelOptions(model=model_dir, dtype=dtype, quantization=quant, kernels="torch"))
                assert rel(got[0], _logits(fallback, prompts, steps=0)[0]) <= 0.03, quant
            finally:
                kernels.select_isa(loaded.kernels)


def test_default_model_gguf_keeps_the_files_blocks():
    """--quantization gguf on the default model (Q4_1): every Linear computes with exactly
    the file's weights (q/k rows un-permuted, fused as the model fuses them), and it says Paris."""
    from test_models import greedy_next_word

    from kvrelay.engine.gguf_file import GGUFFile
    from kvrelay.engine.loader import _unpermute_qk, default_gguf_path
    loaded = load_model(ModelOptions(dtype="float32", quantization="gguf"))
    a = loaded.arch
    reader = GGUFFile(default_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": a.num_heads, "attn_k": a.num_kv_heads}

    def file_weight(layer: int, *names: str) -> torch.Tensor:
        parts = [torch.from_numpy(reader.read(tensors[f"blk.{layer}.{n}.weight"])) for n in names]
        return torch.cat([_unpermute_qk(w, heads[n]) if n in heads else w for n, w in zip(names, parts)])
    for i, layer in enumerate(loaded.model.model.layers):
        for module, names in ((layer.self_attn.qkv_proj, ("attn_q", "attn_k", "attn_v")),
                              (layer.self_attn.o_proj, ("attn_output",)),
                              (layer.mlp.gate_up_proj, ("ffn_gate", "ffn_up")), (layer.mlp.down_proj, ("ffn_down",))):
            assert module.quant.kind == "Q4_1"
            assert module.quant.path == ("float" if loaded.kernels == "torch" else "native")
            assert torch.equal(ql.dequantize(module.quant), file_weight(i, *names)), (i, names)
    head = loaded.model._head_quant   # tied to token_embd, which the file stores as Q8_0
    assert head.kind == "Q8_0" and loaded.weights == "gguf"
    if loaded.kernels != "torch":
        embd = torch.from_numpy(reader.read(tensors["token_embd.weight"]))
        assert torch.equal(ql.dequantize(head), embd)
    assert greedy_next_word(loaded, "The capital of France is") == "Paris"


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_lm_head_quantization_chooses_the_heads_own_format(tiny_llama_dir, tiny_tied_dir, tied):
    """--lm-head-quantization: auto keeps the head int8 under int8 and int4 weights (the
    bytes every decode step reads for it halve against bfloat16), none keeps it float as
    the other weights would be without --quantization, int8/int4 quantize it whatever the
    other weights are. The head's logits follow the float32 model's within its format's error."""
    from test_models import random_prompts
    model_dir = str(tiny_tied_dir if tied else tiny_llama_dir)
    prompts = random_prompts(49152, [5, 9])
    ref = _logits(load_model(ModelOptions(model=model_dir, dtype="float32")), prompts, steps=1)

    def head(loaded):
        m = loaded.model
        return m._head_quant if tied else m.lm_head.quant
    cases = (("int4", "auto", "int8", "int4, lm_head int8"), ("int8", "auto", "int8", "int8"),
             ("int4", "int4", "int4", "int4"), ("int4", "none", None, "int4, lm_head bf16"),
             ("none", "int8", "int8", "bf16, lm_head int8"), ("none", "auto", None, "bf16"))
    for quant, head_choice, kind, weights in cases:
        loaded = load_model(ModelOptions(model=model_dir, quantization=quant, lm_head_quantization=head_choice))
        if loaded.dtype == "bfloat16":
            weights = weights.replace("bf16", "same")
        assert loaded.weights == weights, (quant, head_choice)
        q = head(loaded)
        assert (q.kind if q is not None else None) == kind, (quant, head_choice)
        if q is None:
            assert (loaded.model._head_packed if tied else loaded.model.lm_head.packed) is not None
        got = _logits(loaded, prompts, steps=1)
        assert all(torch.isfinite(g).all() for g in got)
        tol = 0.35 if "int4" in (quant, kind) else 0.05   # the formats' own error, as above
        err = ((got[0] - ref[0]).norm() / ref[0].norm()).item()
        assert err <= tol, (quant, head_choice)


def test_unknown_lm_head_quantization_is_refused(tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="lm-head quantization 'int2'"):
        load_model(ModelOptions(model=str(tiny_llama_dir), lm_head_quantization="int2"))
