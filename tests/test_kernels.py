"""The native decode-attention kernel against torch's attention, and its fallback."""
import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine import kernels


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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_decode_matches_torch_attention(dtype, tol):
    kernel = kernels.paged_decode()
    assert kernel is not None, "the C compiler is part of the supported setup"
    gen = torch.Generator().manual_seed(0)
    P, L, H, S, D, G, B = 40, 3, 2, 4, 64, 3, 4
    pool = torch.randn(P, L, 2, H, S, D, generator=gen).to(dtype)
    perm = torch.randperm(P, generator=gen)
    page_table = perm[: B * 8].view(B, 8).contiguous()
    kv_lens = torch.tensor([1, 5, 17, 32], dtype=torch.int64)   # partial and full last pages
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


def test_native_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("KVRELAY_NATIVE", "0")
    kernels.paged_decode.cache_clear()
    try:
        assert kernels.paged_decode() is None
    finally:
        monkeypatch.delenv("KVRELAY_NATIVE")
        kernels.paged_decode.cache_clear()
    assert kernels.paged_decode() is not None
