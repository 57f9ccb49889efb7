"""The native decode-attention kernel against torch's attention, and its fallback."""
import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine import kernels
from kernel_helpers import assert_more_threads_than_cores_give_the_one_thread_result

# The bfloat16 small-batch matmul is compiled only for CPUs with AVX-512 BF16, as on the
# project's machines; elsewhere the torch paths run (tests/test_kernels_variants.py covers
# the other variants).
HAS_AVX512_BF16 = "avx512_bf16" in open("/proc/cpuinfo").read()
HAS_AMX_BF16 = "amx_bf16" in open("/proc/cpuinfo").read()


def reference(pool, page_table, kv_lens, q, layer, H, S, scale):
    B, Hq, D = q.shape
    outs = []
    for b in range(B):
        n = int(kv_lens[b])
        pages = page_table[b, : -(-n // S)]
        k = pool[pages, layer, 0].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n].float()
        v = pool[pages, layer, 1].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n].float()
        qb = q[b].float().view(Hq, 1, D)
        outs.append(F.scaled_dot_product_attention(qb, k, v, scale=scale, enable_gqa=True).view(Hq, D))
    return torch.stack(outs)


# (page size, head dim, query heads per kv head, kv lengths): partial and full last pages,
# lengths on both sides of the 16-key blocks, and query-head counts that split into
# several register blocks on the bfloat16 fast path.
SHAPES = [(4, 64, 3, [1, 5, 17, 32]), (16, 64, 8, [16, 31, 33, 100]), (16, 128, 5, [7, 48, 64, 120]),
          (8, 128, 1, [2, 15, 16, 64]), (16, 64, 16, [1, 40, 80, 128])]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("S,D,G,lens", SHAPES)
def test_native_decode_matches_torch_attention(dtype, tol, S, D, G, lens):
    kernel = kernels.paged_decode()
    assert kernel is not None, "the C compiler is part of the supported setup"
    gen = torch.Generator().manual_seed(0)
    L, H, B = 3, 2, len(lens)
    max_pages = -(-max(lens) // S)
    P = B * max_pages + 3
    pool = torch.randn(P, L, 2, H, S, D, generator=gen).to(dtype)
    perm = torch.randperm(P, generator=gen)
    page_table = perm[: B * max_pages].view(B, max_pages).contiguous()
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(B, H * G, D, generator=gen).to(dtype)
    out = kernel(pool, page_table, kv_lens, q, layer=2, num_kv_heads=H, page_size=S, scale=D ** -0.5)
    ref = reference(pool, page_table, kv_lens, q, 2, H, S, D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max().item() < tol


def test_unsupported_shapes_use_the_torch_path():
    kernel = kernels.paged_decode()
    assert kernel.supports(torch.bfloat16, 64, 3) and kernel.supports(torch.float32, 128, 8)
    assert not kernel.supports(torch.bfloat16, 80, 3)        # head dim without a fixed-size loop
    assert not kernel.supports(torch.float16, 64, 3)
    assert not kernel.supports(torch.float32, 64, 32)        # more query heads per kv head than scratch


def test_native_kernel_can_be_switched_off():
    from kvrelay.engine.kernels.wide import wide_gemm
    factories = (kernels.paged_decode, kernels.paged_prefill, kernels.gemm, kernels.elementwise, wide_gemm)
    kernels.select_isa("torch")
    try:
        assert kernels.isa() == "torch" and kernels.native_library() is None
        assert all(f() is None for f in factories)
    finally:
        kernels.select_isa("auto")
    assert kernels.paged_decode() is not None and kernels.elementwise() is not None
    assert kernels.paged_prefill() is not None and wide_gemm() is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_add_rms_norm_and_silu_mul_match_torch(dtype, tol):
    ew = kernels.elementwise()
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(7, 96, generator=gen).to(dtype)
    delta = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    want_h = (h.float() + delta.float()).to(dtype)
    want = F.rms_norm(want_h.float(), (96,), w.float(), 1e-6)
    got_h = h.clone()
    got = ew.add_rms_norm(got_h, delta, w, 1e-6)
    assert torch.equal(got_h, want_h)                       # the stream holds the rounded sum
    assert (got.float() - want).abs().max().item() < tol
    plain = ew.add_rms_norm(h.clone(), None, w, 1e-6)
    assert (plain.float() - F.rms_norm(h.float(), (96,), w.float(), 1e-6)).abs().max().item() < tol
    gate_up = torch.randn(5, 2 * 40, generator=gen).to(dtype)
    want_act = F.silu(gate_up[:, :40].float()) * gate_up[:, 40:].float()
    assert (ew.silu_mul(gate_up).float() - want_act).abs().max().item() < tol


def test_native_rope_matches_the_torch_ops():
    from kvrelay.engine.attention.base import apply_rope
    from kvrelay.engine.models.layers import RotaryEmbedding
    ew = kernels.elementwise()
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 512, 10000.0, None)
    positions = torch.randint(0, 512, (37,), generator=gen)
    qkv = torch.randn(37, 5, 64, generator=gen).to(torch.bfloat16)
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    want = apply_rope(qkv[:, :4], cos, sin)
    got = qkv.clone()
    ew.rope_(got, 4, rope.table(positions.device), positions)
    assert torch.equal(got[:, 4], qkv[:, 4])                # heads past `heads` are untouched
    diff = (got[:, :4].float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-30).all()  # at most one bf16 ulp apart
    assert (diff == 0).float().mean().item() > 0.99           # and nearly always identical
    slots = torch.zeros(100, 64, dtype=torch.bfloat16)
    slot_ids = torch.randperm(40, generator=gen)[:37]       # one kv head: one slot per token
    stored = qkv.clone()
    ew.rope_(stored, 4, rope.table(positions.device), positions, (slots, slot_ids, 1, 3, 50))
    assert torch.equal(stored, got)
    assert torch.equal(slots[slot_ids + 3], got[:, 3])       # keys: the last rotated head
    assert torch.equal(slots[slot_ids + 53], qkv[:, 4])      # values: the head after them


def test_native_argmax_and_topk_match_torch():
    ew = kernels.elementwise()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5000, generator=gen)
    x[3, 10] = x[3, 4000] = x[3].max() + 1                   # a tie: the first index wins
    x[5, :] = float("-inf")
    x[5, 77] = 0.0
    assert torch.equal(ew.argmax(x), x.argmax(dim=-1))
    top = ew.topk_indices(x, 8)
    want = x.topk(8, dim=-1)
    assert torch.equal(x.gather(1, top), want.values)        # best first
    assert top[3, 0].item() == 10 and top[3, 1].item() == 4000


# The prefill kernels: vdpbf16ps (every AVX-512 BF16 CPU) and, with AMX, the tiles, whose
# query blocks of 16 rows and key blocks of 32 the longer shapes cross, partly filled.
PREFILLS = ["native", pytest.param("tiles", marks=pytest.mark.skipif(not HAS_AMX_BF16, reason="no AMX on this CPU"))]
PREFILL_SHAPES = SHAPES + [(16, 64, 3, [1, 255, 256, 300, 33]), (16, 128, 2, [97, 130]), (4, 64, 9, [70, 3]),
                          (16, 64, 3, [700])]   # one prompt alone: runs of rows (prefill_plan.h)


def prefill_kernel(name: str):
    kernel = kernels.paged_prefill() if name == "native" else kernels.paged_prefill_tiles()
    assert kernel is not None, f"the {name} prefill kernel runs on this CPU"
    return kernel


def test_the_tiles_prefill_kernel_is_there_exactly_where_amx_is():
    assert (kernels.paged_prefill_tiles() is not None) == HAS_AMX_BF16


@pytest.mark.parametrize("name", PREFILLS)
@pytest.mark.parametrize("S,D,G,lens", PREFILL_SHAPES)
def test_native_prefill_matches_causal_attention(name, S, D, G, lens):
    kernel = prefill_kernel(name)
    gen = torch.Generator().manual_seed(4)
    L, H, B = 3, 2, len(lens)
    max_pages = -(-max(lens) // S)
    P = B * max_pages + 3
    pool = torch.randn(P, L, 2, H, S, D, generator=gen).to(torch.bfloat16)
    page_table = torch.randperm(P, generator=gen)[: B * max_pages].view(B, max_pages).contiguous()
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    q_lens = torch.tensor([min(n, 1 + n // 2 + b) for b, n in enumerate(lens)], dtype=torch.int64)  # prefix + chunk
    q_rows = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), H * G + 2 * H, D, generator=gen).to(torch.bfloat16)[:, : H * G]  # strided rows
    out = kernel(pool, page_table, kv_lens, q_lens, q_rows, q, 1, H, S, D ** -0.5)
    for b in range(B):
        n, m = lens[b], int(q_lens[b])
        pages = page_table[b, : -(-n // S)]
        k = pool[pages, 1, 0].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n].float()
        v = pool[pages, 1, 1].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n].float()
        qb = q[int(q_rows[b]): int(q_rows[b]) + m].float().transpose(0, 1)           # [Hq, m, D]
        mask = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]        # causal, after the prefix
        want = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)
        got = out[int(q_rows[b]): int(q_rows[b]) + m].float()
        assert (got - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("M,N,K,bias", [(32, 960, 576, False), (1, 576, 1536, True), (5, 37, 11, True),
                                        (13, 100, 64, False), (128, 48, 30, True)])
def test_native_gemm_matches_float32_matmul(M, N, K, bias):
    g = kernels.gemm()
    assert (g is not None) == HAS_AVX512_BF16
    if g is None:
        return
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(N, generator=gen) if bias else None
    want = x.float() @ w.float().t() + (b if bias else 0)
    got = g(x, g.pack(w), N, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    # float32 accumulation, then one rounding to bfloat16: within half a bf16 ulp (+ sum order)
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * K ** 0.5).all()
    exact = g(x, g.pack(w), N, b, out_dtype=torch.float32)  # unrounded: float32 up to sum order
    assert exact.dtype == torch.float32 and torch.allclose(exact, want, rtol=1e-5, atol=1e-4)


def test_native_gemm_of_no_rows_is_empty():
    """A matmul of 0 rows returns [0, N]: the kernel sizes its stolen units by the rows, and
    once divided by zero (SIGFPE, the whole process)."""
    g = kernels.gemm()
    assert (g is not None) == HAS_AVX512_BF16
    if g is None:
        return
    packed = g.pack(torch.randn(64, 32).bfloat16())
    for dt in (torch.bfloat16, torch.float32):
        got = g(torch.empty(0, 32, dtype=torch.bfloat16), packed, 64, torch.zeros(64), out_dtype=dt)
        assert got.shape == (0, 64) and got.dtype == dt


def test_native_gemm_split_among_more_threads_than_cores_gives_the_one_thread_result():
    """Every column group is computed once, by one thread, whichever thread takes it
    (gemm_bf16.c steals units of groups from a preempted thread's part): with 4 threads on
    this machine's cores the result equals the one-thread result bit for bit, row counts
    of one tile, of several and of a short last one."""
    g = kernels.gemm()
    assert (g is not None) == HAS_AVX512_BF16
    if g is None:
        return
    gen = torch.Generator().manual_seed(15)
    cases = [(torch.randn(M, K, generator=gen).bfloat16(), torch.randn(N, K, generator=gen).bfloat16(), N)
             for M, N, K in [(32, 4096, 576), (1, 1000, 64), (13, 3072, 96)]]
    packed = [g.pack(w) for _, w, _ in cases]
    bias = torch.randn(4096, generator=gen)

    def run():
        return [g(x, p, n, bias[:n], out_dtype=dt) for (x, _, n), p in zip(cases, packed)
                for dt in (torch.bfloat16, torch.float32)]

    assert_more_threads_than_cores_give_the_one_thread_result(run)


# Row counts on both sides of the tiles' 16 and the kernel's 32-row blocks, column counts
# that leave half a tile pair and a partial block, K from one tile step to many.
@pytest.mark.parametrize("M,N,K,bias", [(32, 960, 576, False), (1, 576, 1536, True), (17, 37, 64, True),
                                        (40, 100, 96, False), (128, 48, 32, True), (5, 16, 32, False)])
def test_gemm_on_amx_tiles_matches_float32_matmul(M, N, K, bias):
    g = kernels.gemm()
    assert (g is not None and g.tiles) == (HAS_AVX512_BF16 and HAS_AMX_BF16)
    if g is None or not g.tiles:   # a CPU without tiles: reported unavailable, never chosen
        assert g is None or not g.fits_tiles(K)
        return
    assert g.fits_tiles(K) and not g.fits_tiles(K + 16)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(N, generator=gen) if bias else None
    want = x.float() @ w.float().t() + (b if bias else 0)
    packed = g.pack(w)
    got = g(x, packed, N, b, tiles=True)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * K ** 0.5).all()
    exact = g(x, packed, N, b, out_dtype=torch.float32, tiles=True)
    assert exact.dtype == torch.float32 and torch.allclose(exact, want, rtol=1e-5, atol=1e-4)
    assert torch.allclose(exact, g(x, packed, N, b, out_dtype=torch.float32), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,inter,K", [(1, 48, 64), (17, 1536, 576), (32, 16, 32), (40, 80, 96), (128, 32, 64)])
def test_swiglu_on_amx_tiles_matches_float32(M, inter, K):
    """Gate, up and silu(gate) * up in one pass over a weight packed with its gate and up
    blocks interleaved; the float32 sums meet before the one rounding to bfloat16."""
    g = kernels.gemm()
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(2 * inter, K, generator=gen) * 0.2).to(torch.bfloat16)
    if g is None or not g.tiles:   # reported unavailable, never chosen
        assert g is None or g.pack_swiglu(w) is None
        return
    assert g.pack_swiglu(w[:, :K - 16]) is None and g.pack_swiglu(w[:2 * inter - 16]) is None  # K, I off the tiles
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    got = g.swiglu(x, g.pack_swiglu(w), inter)
    sums = x.float() @ w.float().t()
    want = F.silu(sums[:, :inter]) * sums[:, inter:]
    assert got.dtype == torch.bfloat16 and got.shape == (M, inter)
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-4 * K).all()
