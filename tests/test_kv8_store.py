"""The native store of an 8-bit KV pool (kernels/kv8_store.c) on every kernel variant this
CPU runs: the bytes it writes (values and scales) are those of the torch path
(`kv_pool.quantize` and index_put_), bit for bit, and no other byte of the pool changes;
`write`'s held() reads them back. And cpu_native's rope_and_store over an 8-bit pool (the
native RoPE, then that store) gives the q, k, v and pool bytes of the torch path."""
from __future__ import annotations

import pytest
import torch

from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine import kernels
from kvrelay.engine.attention import make_attention_backend
from kvrelay.engine.attention.base import apply_rope
from kvrelay.engine.kernels.kv8_store import kv8_store
from kvrelay.engine.kernels.variants import VARIANT_FLAGS
from kvrelay.engine.kv_pool import QuantizedKVPool, kv_pool_for
from kvrelay.engine.models.layers import RotaryEmbedding
from kvrelay.engine.runner import SeqChunk, build_forward_batch

KV8 = ("int8", "fp8_e4m3")
DTYPES = (torch.bfloat16, torch.float32)
S, L, H = 4, 3, 3   # page size, layers, kv heads

# Each tie (x / scale exactly halfway between two representable values) and what it rounds
# to (nearest even), at scale 1: the row's largest magnitude is the format's largest.
TIES = {"int8": ([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 3.5],
                 [127.0, 0.0, 2.0, 2.0, 0.0, -2.0, 126.0, -126.0, 4.0]),
        "fp8_e4m3": ([448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -3 * 2.0 ** -10,
                      5 * 2.0 ** -10, 432.0, -432.0, 13.5],
                     [448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, -2.0 ** -8, 2.0 ** -8, 448.0, -448.0, 14.0])}


@pytest.fixture(params=tuple(VARIANT_FLAGS))
def variant(request):
    """The variant forced for the test, or None when this CPU lacks it (and refuses it)."""
    name = request.param
    if kernels.missing(name):
        with pytest.raises(kernels.IsaUnavailable, match="lacks"):
            kernels.select_isa(name)
        yield None
        return
    assert kernels.select_isa(name) == name
    try:
        yield name
    finally:
        kernels.select_isa("auto")


def torch_path(fn, *args):
    """fn(*args) with the native kernels off (`--kernels torch`), then the variant back."""
    variant = kernels.isa()
    kernels.select_isa("torch")
    try:
        assert kv8_store() is None
        return fn(*args)
    finally:
        kernels.select_isa(variant)


def layout(dtype: torch.dtype, kv_dtype: str, D: int) -> KVLayout:
    return KVLayout("m", str(dtype).removeprefix("torch."), S, L, H, D, kv_dtype)


def vectors(gen: torch.Generator, T: int, D: int, dtype: torch.dtype, kv_dtype: str) -> torch.Tensor:
    """[T, 2 * H, D] keys then values: magnitudes from 1e-37 to 1e37 row by row, a row of
    zeros and one of negative zeros, integers, subnormals, ties, and one near float32's max."""
    x = torch.randn(T, 2 * H, D, generator=gen) * torch.logspace(-37, 37, T)[:, None, None]
    x[0], x[1] = 0.0, -0.0
    x[2] = torch.randint(-127, 128, (2 * H, D), generator=gen).float()
    x[3] = torch.randn(2 * H, D, generator=gen) * 1e-39
    x[3, 1] *= 1e-5                                           # a few of the least subnormals
    for row, kind in ((4, "int8"), (5, "fp8_e4m3"), (6, kv_dtype)):
        ties = torch.tensor(TIES[kind][0])
        x[row, :, :len(ties)] = ties
        x[row, :, len(ties):] = 0.0
    x[7] = torch.tensor(3.0e38)
    x[7, :, ::3] = -1.5e38
    return x.to(dtype)


def written_bytes(lay: KVLayout, n: int, writes) -> torch.Tensor:
    """A bool mask over the pool's bytes: those of the slots `writes` [(layer, pages, offsets)]."""
    mask = kv_pool_for(lay, n)
    ones = torch.full((), -1, dtype=torch.int32).view(torch.float32)   # every byte 0xff
    for layer, pages, offsets in writes:
        at = (pages[:, None, None], mask._kv[None, :, None], mask._heads[None, None, :], offsets[:, None, None])
        mask._raw[:, layer][at] = 255
        mask.scales[:, layer][at] = ones
    return mask._bytes != 0


@pytest.mark.parametrize("T", [9, 300])
@pytest.mark.parametrize("D", [64, 80, 128, 20])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", KV8)
def test_native_store_writes_the_torch_bytes(variant, kv_dtype, dtype, D, T):
    """Two layers written (k and v as strided views of one qkv tensor, then as tensors of
    their own) at scattered (page, offset) slots, over a pool of random bytes."""
    if variant is None:
        return
    assert kv8_store() is not None and kv8_store().supports(dtype)
    lay = layout(dtype, kv_dtype, D)
    n = -(-T // S) + 7
    gen = torch.Generator().manual_seed(D * 1000 + T)
    initial = torch.randint(0, 256, (n * lay.page_bytes,), generator=gen, dtype=torch.uint8)
    native, ref = kv_pool_for(lay, n), kv_pool_for(lay, n)
    assert isinstance(native, QuantizedKVPool)
    native._bytes.copy_(initial)
    ref._bytes.copy_(initial)
    writes, held = [], []
    for layer in (0, 2):
        slot = torch.randperm(n * S, generator=gen)[:T]
        pages, offsets = slot // S, slot % S
        x = vectors(gen, T, D, dtype, kv_dtype)
        if layer == 0:   # what rope_and_store passes: views into qkv rows, 2 query heads first
            qkv = torch.cat((torch.randn(T, 2, D, generator=gen).to(dtype), x), 1)
            k, v = qkv[:, 2:2 + H], qkv[:, 2 + H:]
            assert not k.is_contiguous()
        else:
            k, v = x[:, :H].contiguous(), x[:, H:].contiguous()
        slot_ids = native.slot_ids(pages, offsets)
        # layer 2 asks for held at the store (computed in C), layer 0 reads it back later
        held.append((native.write(layer, slot_ids, k, v, held=layer == 2),
                     torch_path(ref.write, layer, slot_ids, k, v)))
        writes.append((layer, pages, offsets))
    assert torch.equal(native._bytes, ref._bytes)
    touched = written_bytes(lay, n, writes)
    assert torch.equal(native._bytes[~touched], initial[~touched])
    assert touched.sum() == 2 * T * 2 * H * (D + 4)
    for got, want in held:
        for a, b in zip(got(), want()):
            assert a.dtype == dtype and torch.equal(a, b)
    # The ties rounded to even, and the zero rows held as zeros (the torch path's too).
    layer, pages, offsets = writes[-1]
    ties, rounded = TIES[kv_dtype]
    values = native.data[pages[6], layer, :, :, offsets[6], :len(ties)].float()
    scales = native.scales[pages[6], layer, :, :, offsets[6]]
    assert torch.equal(scales, torch.ones(2, H)) and (values == torch.tensor(rounded)).all()
    assert (native.data[pages[:2], layer, :, :, offsets[:2]].float() == 0).all()
    assert (native.scales[pages[:2], layer, :, :, offsets[:2]] == torch.finfo(torch.float32).tiny).all()


@pytest.mark.parametrize("kv_dtype", KV8)
def test_a_slot_outside_the_pool_raises_and_writes_nothing(variant, kv_dtype):
    if variant is None:
        return
    lay = layout(torch.float32, kv_dtype, 64)
    pool = kv_pool_for(lay, 4)
    x = torch.randn(3, H, 64)
    for pages, offsets in [([0, 4, 1], [0, 0, 0]), ([0, 1, 2], [0, S, 1]), ([0, -1, 2], [0, 0, 0])]:
        with pytest.raises(IndexError, match="outside the pool"):
            pool.write(1, pool.slot_ids(torch.tensor(pages), torch.tensor(offsets)), x, x)
        assert not pool._bytes.any()


@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_rope_is_apply_rope_bit_for_bit(variant, dtype, D):
    if variant is None:
        return
    ew = kernels.elementwise()
    rope = RotaryEmbedding(D, 4096, 10000.0, None)
    gen = torch.Generator().manual_seed(D)
    positions = torch.randint(0, 4096, (200,), generator=gen)
    qkv = (torch.randn(200, 9, D, generator=gen) * 4).to(dtype)
    cos, sin = rope.cos_sin(positions, dtype)
    got = qkv.clone()
    ew.rope_(got, 7, rope.table(positions.device), positions)
    assert torch.equal(got[:, :7], apply_rope(qkv[:, :7], cos, sin)) and torch.equal(got[:, 7:], qkv[:, 7:])


# A prefill of three sequences (the pass reads its own keys back from write's held()), then
# two decode steps, over pages scattered between the sequences.
PASSES = [[(0, 5), (1, 17), (2, 1)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", KV8)
def test_rope_and_store_over_an_8bit_pool_is_the_torch_path(variant, kv_dtype, dtype):
    if variant is None:
        return
    hq, hkv, D = 8, 2, 64
    lay = KVLayout("t", str(dtype).removeprefix("torch."), S, 2, hkv, D, kv_dtype)
    pool, ref = kv_pool_for(lay, 24), kv_pool_for(lay, 24)
    attn = make_attention_backend("cpu_native", pool, hq)
    table = RotaryEmbedding(D, 256, 10000.0, None).table(torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    lens, pages = [0, 0, 0], [[1 + b + 3 * i for i in range(7)] for b in range(3)]
    for p in PASSES:
        chunks = []
        for b, n in p:
            chunks.append(SeqChunk(list(range(n)), lens[b], pages[b]))
            lens[b] += n
        meta = attn.begin(build_forward_batch(chunks, S), table)
        # a pass of more than one query a sequence takes the native prefill kernel
        assert (meta.prefill is not None) == (max(meta.batch.q_lens) > 1)
        for layer in range(2):
            qkv = torch.randn(sum(n for _, n in p), hq + 2 * hkv, D, generator=gen).to(dtype)
            q, k = apply_rope(qkv[:, :hq + hkv], meta.cos, meta.sin).split([hq, hkv], dim=1)
            v = qkv[:, hq + hkv:]
            held = torch_path(ref.write, layer, meta.write_slots, k, v)
            if meta.batch.no_prefix:
                k, v = held()
            got = attn.rope_and_store(qkv, layer, meta)
            assert got[0].data_ptr() == qkv.data_ptr()   # rotated in place: the native RoPE ran
            for a, b in zip(got, (q, k, v)):
                assert a.dtype == dtype and torch.equal(a, b)
        assert torch.equal(pool._bytes, ref._bytes)
    assert pool._bytes.any()
