"""Every native kernel under every kernel variant, against float32 torch references.

Each test runs once per variant (best first). A variant this CPU runs is forced with
`kernels.select_isa`; one it lacks must be refused with `IsaUnavailable`, which is then
the whole test: nothing is skipped."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.core.config import ModelOptions
from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine import kernels
from kvrelay.engine.allocator import PageAllocator
from kvrelay.engine.attention import make_attention_backend
from kvrelay.engine.kernels.variants import VARIANT_FLAGS
from kvrelay.engine.kernels.wide import wide_gemm
from kvrelay.engine.kv_pool import KVPool
from kvrelay.engine.loader import load_model
from kvrelay.engine.models.linear import Linear, WeightFormat
from kvrelay.engine.models.quant_linear import quant_forward, quantize
from kvrelay.engine.models.testing import make_tiny_model_dir
from kvrelay.engine.runner import SeqChunk, build_forward_batch
from kernel_helpers import assert_more_threads_than_cores_give_the_one_thread_result

VARIANTS = tuple(VARIANT_FLAGS)


@pytest.fixture(params=VARIANTS)
def variant(request):
    """The variant forced for the test, or None when this CPU lacks it (and refuses it)."""
    name = request.param
    if kernels.missing(name):
        with pytest.raises(kernels.IsaUnavailable, match="lacks"):
            kernels.select_isa(name)
        assert name not in kernels.available_isas()
        yield None
        return
    assert kernels.select_isa(name) == name == kernels.isa()
    try:
        yield name
    finally:
        kernels.select_isa("auto")


def test_variants_cover_the_cpu():
    assert kernels.available_isas()[-1] == "torch"
    assert all(not kernels.missing(v) for v in kernels.available_isas()[:-1])
    # A CPU that runs a variant runs the ones below it (AVX-512 BF16 > AVX-512F > AVX2).
    runs = [not kernels.missing(v) for v in VARIANTS]
    assert runs == sorted(runs)


def test_only_the_avx512_bf16_variant_offers_the_tiles_prefill_kernel(variant):
    """The AMX prefill attention is built into the AVX-512 BF16 library only, and offered
    only where the CPU has AMX; every other variant reports it unavailable."""
    if variant is None:
        return
    want = variant == "avx512_bf16" and "amx_bf16" in kernels.cpu_features()
    assert (kernels.paged_prefill_tiles() is not None) == want


def make_pool(gen, dtype, lens, S, D, H, L=3):
    B = len(lens)
    max_pages = -(-max(lens) // S)
    P = B * max_pages + 3
    pool = torch.randn(P, L, 2, H, S, D, generator=gen).to(dtype)
    page_table = torch.randperm(P, generator=gen)[: B * max_pages].view(B, max_pages).contiguous()
    return pool, page_table, torch.tensor(lens, dtype=torch.int64)


def keys_values(pool, page_table, b, n, layer, H, S, D):
    pages = page_table[b, : -(-n // S)]
    k = pool[pages, layer, 0].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n].float()
    v = pool[pages, layer, 1].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n].float()
    return k, v


# (page size, head dim, query heads per kv head, kv lengths): odd lengths, partial pages.
SHAPES = [(4, 64, 3, [1, 5, 17, 33]), (16, 64, 8, [16, 31, 100]), (16, 128, 5, [7, 48, 129]),
          (8, 128, 1, [2, 15, 64]), (16, 64, 16, [1, 40, 77])]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}   # by the queries' dtype
# (pool, queries): each compute dtype's own pool, and a float32 model's bfloat16 pool.
POOL_QUERY = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype,q_dtype", POOL_QUERY)
@pytest.mark.parametrize("S,D,G,lens", SHAPES)
def test_decode_attention(variant, dtype, q_dtype, S, D, G, lens):
    if variant is None:
        return
    kernel = kernels.paged_decode()
    assert kernel.supports(dtype, D, G, q_dtype) and not kernel.supports(torch.float32, D, G, torch.bfloat16)
    gen = torch.Generator().manual_seed(10)
    H = 2
    pool, page_table, kv_lens = make_pool(gen, dtype, lens, S, D, H)
    q = torch.randn(len(lens), H * G, D, generator=gen).to(q_dtype)
    out = kernel(pool, page_table, kv_lens, q, layer=1, num_kv_heads=H, page_size=S, scale=D ** -0.5)
    assert out.dtype == q_dtype
    for b, n in enumerate(lens):
        k, v = keys_values(pool, page_table, b, n, 1, H, S, D)
        want = F.scaled_dot_product_attention(q[b].float().view(H * G, 1, D), k, v, enable_gqa=True).view(H * G, D)
        assert (out[b].float() - want).abs().max().item() < TOL[q_dtype]


@pytest.mark.parametrize("dtype,q_dtype", POOL_QUERY)
@pytest.mark.parametrize("S,D,G,lens", SHAPES)
def test_prefill_attention(variant, dtype, q_dtype, S, D, G, lens):
    if variant is None:
        return
    kernel = kernels.paged_prefill()
    assert kernel.supports(dtype, D, G, q_dtype) and not kernel.supports(torch.float32, D, G, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    H = 2
    pool, page_table, kv_lens = make_pool(gen, dtype, lens, S, D, H)
    q_lens = torch.tensor([min(n, 1 + n // 2 + b) for b, n in enumerate(lens)], dtype=torch.int64)  # prefix + chunk
    q_rows = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), H * G + 2 * H, D, generator=gen).to(q_dtype)[:, : H * G]  # strided rows
    out = kernel(pool, page_table, kv_lens, q_lens, q_rows, q, 2, H, S, D ** -0.5)
    assert out.dtype == q_dtype
    for b, n in enumerate(lens):
        m, r0 = int(q_lens[b]), int(q_rows[b])
        k, v = keys_values(pool, page_table, b, n, 2, H, S, D)
        mask = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
        want = F.scaled_dot_product_attention(q[r0:r0 + m].float().transpose(0, 1), k, v, attn_mask=mask,
                                              enable_gqa=True).transpose(0, 1)
        assert (out[r0:r0 + m].float() - want).abs().max().item() < TOL[q_dtype]


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K,bias", [(1, 576, 1536, True), (5, 37, 11, True), (13, 100, 64, False),
                                        (32, 960, 576, False), (128, 33, 7, True), (7, 1, 3, False),
                                        (300, 40, 1536, True), (2, 17, 70000, False)])
def test_wide_gemm(variant, stored, M, N, K, bias):
    if variant is None:
        return
    g = wide_gemm()
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen).to(stored)
    b = torch.randn(N, generator=gen) if bias else None
    want = x @ w.float().t() + (b if bias else 0)
    got = g(x, g.pack(w), N, g.pad_bias(b))
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * K ** 0.5)


def test_wide_gemm_of_no_rows_is_empty(variant):
    """0 rows: [0, N], not a division by zero in the unit size (SIGFPE, the whole process)."""
    if variant is None:
        return
    g = wide_gemm()
    packed = g.pack(torch.randn(64, 32).bfloat16())
    got = g(torch.empty(0, 32), packed, 64, None)
    assert got.shape == (0, 64) and got.dtype == torch.float32


def test_work_split_among_more_threads_than_cores_gives_the_one_thread_result(variant):
    """Each part of a kernel's work, and each unit a thread takes from another's part
    (worksteal.h), is computed exactly once and the same way: with 4 threads on this
    machine's cores (threads preempted, parts taken over) the float32 matmul, the
    quantized matmul and the decode attention equal their one-thread results bit for bit."""
    if variant is None:
        return
    gen = torch.Generator().manual_seed(14)
    g = wide_gemm()
    x, w = torch.randn(32, 576, generator=gen), torch.randn(960, 576, generator=gen).bfloat16()
    packed = g.pack(w)
    qw = quantize(torch.randn(1000, 576, generator=gen), WeightFormat(compute=torch.float32, store="int4"))
    pool, page_table, kv_lens = make_pool(gen, torch.bfloat16, [33, 100, 7, 64] * 4, 16, 64, 3)
    q = torch.randn(16, 9, 64, generator=gen)
    attend = kernels.paged_decode()

    def run():
        return [g(x, packed, 960, None), quant_forward(x[:3], qw, None),
                attend(pool, page_table, kv_lens, q, layer=1, num_kv_heads=3, page_size=16, scale=0.125)]

    assert_more_threads_than_cores_give_the_one_thread_result(run)


@pytest.mark.parametrize("rows", [1, 32, 129, 300])
def test_float32_linear_takes_the_path_of_the_variant(variant, rows):
    """float32 compute over bfloat16-stored weights: the AVX2 variant's kernel takes every
    row count and no oneDNN copy is kept; the AVX-512F variants hand rows past
    GEMM_MAX_ROWS to oneDNN. Either way each row count matches a float32 matmul of the
    bfloat16-rounded weight."""
    if variant is None:
        return
    from kvrelay.engine.models import linear
    gen = torch.Generator().manual_seed(14)
    w, bias = torch.randn(70, 96, generator=gen), torch.randn(70, generator=gen)
    packed = linear.pack_weight(w, bias, WeightFormat(torch.float32, "bf16"))
    assert packed.wide and packed.native is not None and packed.serves_every_row_count
    if variant == "avx2":
        assert wide_gemm().all_rows and packed.onednn is None
        assert linear.native_max_rows(packed) == linear.ALL_ROWS
    else:
        assert not wide_gemm().all_rows
        assert linear.native_max_rows(packed) == linear.GEMM_MAX_ROWS
    x = torch.randn(rows, 96, generator=gen)
    want = x @ w.bfloat16().float().t() + bias
    assert torch.allclose(linear.fast_linear(x, w, bias, packed), want, rtol=1e-5, atol=1e-4)


def test_elementwise_float32(variant):
    if variant is None:
        return
    from kvrelay.engine.attention.base import apply_rope
    from kvrelay.engine.models.layers import RotaryEmbedding
    ew = kernels.elementwise()
    gen = torch.Generator().manual_seed(13)
    h, delta, w = torch.randn(7, 100, generator=gen), torch.randn(7, 100, generator=gen), torch.randn(100, generator=gen)
    got_h = h.clone()
    got = ew.add_rms_norm(got_h, delta, w, 1e-6)
    assert torch.allclose(got_h, h + delta)
    assert torch.allclose(got, F.rms_norm(h + delta, (100,), w, 1e-6), atol=1e-5)
    gate_up = torch.randn(5, 2 * 43, generator=gen)
    assert torch.allclose(ew.silu_mul(gate_up), F.silu(gate_up[:, :43]) * gate_up[:, 43:], atol=1e-5)
    rope = RotaryEmbedding(64, 512, 10000.0, None)
    positions = torch.randint(0, 512, (37,), generator=gen)
    qkv = torch.randn(37, 6, 64, generator=gen)
    cos, sin = rope.cos_sin(positions, torch.float32)
    want = apply_rope(qkv[:, :4], cos, sin)
    slots = torch.zeros(100, 64)
    slot_ids = torch.randperm(40, generator=gen)[:37]
    got = qkv.clone()
    ew.rope_(got, 4, rope.table(positions.device), positions, (slots, slot_ids, 1, 3, 50))
    assert torch.allclose(got[:, :4], want, atol=1e-5) and torch.equal(got[:, 4:], qkv[:, 4:])
    assert torch.equal(slots[slot_ids + 3], got[:, 3]) and torch.equal(slots[slot_ids + 53], qkv[:, 4])
    # A float32 model's bfloat16 pool: the same rotation, keys and values rounded as stored.
    slots16, again = torch.zeros(100, 64, dtype=torch.bfloat16), qkv.clone()
    assert ew.stores(torch.float32, torch.bfloat16) and not ew.stores(torch.bfloat16, torch.float32)
    ew.rope_(again, 4, rope.table(positions.device), positions, (slots16, slot_ids, 1, 3, 50))
    assert torch.equal(again, got)
    assert torch.equal(slots16[slot_ids + 3], got[:, 3].bfloat16())
    assert torch.equal(slots16[slot_ids + 53], qkv[:, 4].bfloat16())
    x = torch.randn(9, 5003, generator=gen)
    assert torch.equal(ew.argmax(x), x.argmax(dim=-1))
    assert torch.equal(x.gather(1, ew.topk_indices(x, 7)), x.topk(7, dim=-1).values)


# ------------------------------------------------------------------ a tiny model per variant

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Head dim 64 (the attention kernels' size) and a tied lm_head (the embedding's packing)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-d64"), head_dim=64, tie_word_embeddings=True)


def run_logits(loaded, prompts: list[list[int]], steps: int = 2, S: int = 4) -> list[torch.Tensor]:
    """Logits of a prefill of `prompts`, then of `steps` greedy decode steps."""
    a = loaded.arch
    kv = KVPool(KVLayout("t", loaded.dtype, S, a.num_layers, a.num_kv_heads, a.head_dim), 64)
    attn = make_attention_backend("auto", kv, a.num_heads)
    alloc = PageAllocator(64)
    for b, p in enumerate(prompts):
        assert alloc.allocate(-(-(len(p) + steps) // S), b) is not None
    seqs = [list(p) for p in prompts]
    out = [loaded.model(build_forward_batch([SeqChunk(s, 0, alloc.pages_of(b)) for b, s in enumerate(seqs)], S), attn)]
    for _ in range(steps):
        nxt = out[-1].argmax(-1).tolist()
        chunks = [SeqChunk([t], len(s), alloc.pages_of(b)) for b, (s, t) in enumerate(zip(seqs, nxt))]
        for s, t in zip(seqs, nxt):
            s.append(t)
        out.append(loaded.model(build_forward_batch(chunks, S), attn))
    return out


def load(tiny_dir, variant: str, fmt: WeightFormat, round_weights: bool = False):
    """The tied embedding is bfloat16-exact in every model (a bf16-stored lm_head rounds
    it for the head, never for the lookup); round_weights rounds every Linear too: the
    float32 model that bf16-stored weights compute."""
    # Loaded without native kernels, its float weights stay in place (packing may free them)
    # to be rounded; then packed again, once, for `variant`.
    loaded = load_model(ModelOptions(model=str(tiny_dir), dtype="float32", kernels="torch"))
    with torch.no_grad():
        for m in loaded.model.modules():
            if isinstance(m, torch.nn.Embedding) or (round_weights and isinstance(m, Linear)):
                m.weight.copy_(m.weight.bfloat16().float())
    kernels.select_isa(variant)
    loaded.model.prepare(fmt)
    return loaded


PROMPTS = [[5, 17, 300, 2000, 41, 9, 77], [1000, 3], list(range(100, 119))]


def test_tiny_model_bf16_stored_weights_follow_float32(variant, tiny_dir):
    if variant is None:
        return
    try:
        kernels.select_isa("torch")
        want_rounded = run_logits(load(tiny_dir, "torch", WeightFormat(torch.float32), round_weights=True), PROMPTS)
        want_exact = run_logits(load(tiny_dir, "torch", WeightFormat(torch.float32)), PROMPTS)
    finally:
        kernels.select_isa(variant)
    got_bf16 = run_logits(load(tiny_dir, variant, WeightFormat(torch.float32, "bf16")), PROMPTS)
    got_exact = run_logits(load(tiny_dir, variant, WeightFormat(torch.float32)), PROMPTS)
    for got, want in [(got_bf16, want_rounded), (got_exact, want_exact)]:
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and (g - w).abs().max().item() < 2e-3
    assert (got_bf16[0] - want_exact[0]).abs().max().item() < 0.1   # bf16 weights: close, not equal
