"""The 8-bit KV cache (--kv-cache-dtype int8|fp8_e4m3): bytes per token and capacity, the
quantization error bound, scales that travel inside the page bytes, a tiny model whose
logits and greedy tokens stay close to the float32 cache, disaggregated == colocated on
every real transfer backend, and P/D that refuse each other when their KV dtypes differ.
The same for a float32 model's bfloat16 cache (--kv-cache-dtype bfloat16, what auto picks
where --dtype auto computes float32), and how auto resolves."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import httpx
import pytest
import torch

from disagg_helpers import BACKENDS
from serving_helpers import assert_no_leak, gauge, metric_samples, running_server, worker_urls
from kvrelay.core.config import KVCacheConfig, LifecycleConfig, SchedulerConfig, TransferConfig
from kvrelay.core.kvlayout import KVLayout
from kvrelay.disagg import wire
from kvrelay.disagg.decode_worker import DecodeCore
from kvrelay.disagg.prefill_worker import PrefillCore
from kvrelay.engine import kernels
from kvrelay.engine.allocator import PageAllocator
from kvrelay.engine.attention import make_attention_backend
from kvrelay.engine.core import num_pages_for
from kvrelay.engine.engine import AsyncEngine, build_engine
from kvrelay.engine.kernels.kvq import paged_decode_q8
from kvrelay.engine.kv_pool import QuantizedKVPool, dequantize, kv_pool_for, quantize
from kvrelay.engine.runner import SeqChunk, build_forward_batch
from kvrelay.engine.types import FinishReason, GenerateRequest, SamplingParams

KV8 = ("int8", "fp8_e4m3")
REAL = [b for b in BACKENDS if not b.startswith("fake")]
# The default model, SmolLM2-135M: 30 layers, 3 KV heads of 64, pages of 16.
SMOLLM = dict(model_id="smollm2", dtype="bfloat16", page_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
SCHED = SchedulerConfig(max_running_requests=16, max_prefill_tokens=512)
LIFE = LifecycleConfig(heartbeat_interval=0.2, heartbeat_misses=3, bootstrap_timeout=5, queue_timeout=5,
                       waiting_timeout=5, transfer_timeout=5, quarantine_grace=0.5)


def kv_cfg(kv_dtype: str = "auto") -> KVCacheConfig:
    return KVCacheConfig(page_size=16, max_kv_tokens=2048, kv_cache_dtype=kv_dtype)


def greedy(rid: str, prompt, n: int = 12) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


# ---- layout and capacity -----------------------------------------------------------------

def test_bytes_per_token_and_capacity_of_the_default_model():
    """bf16: 30 x 2 x 3 x 64 x 2 = 23040 bytes per token; 8-bit: 11520 of values plus
    30 x 2 x 3 float32 scales = 12240 (6.25% over half). Capacity for the same GiB: 1.88x."""
    bf16 = KVLayout(**SMOLLM)
    assert bf16.kv_dtype == "bfloat16" and bf16.token_bytes == 23040
    for kv_dtype in KV8:
        q = KVLayout(**SMOLLM, kv_dtype=kv_dtype)
        assert q.quantized and q.token_bytes == 12240 and q.scales_offset == 16 * 11520
        cfg = KVCacheConfig(kv_cache_gb=1.0, kv_cache_dtype=kv_dtype)
        ratio = num_pages_for(cfg, q) / num_pages_for(cfg, bf16)
        assert 1.85 < ratio < 1.9
    assert KVLayout(**{**SMOLLM, "dtype": "float32"}, kv_dtype="int8").token_bytes == 12240


def test_layout_names_its_kv_dtype_and_crosses_the_wire():
    a, b = KVLayout(**SMOLLM), KVLayout(**SMOLLM, kv_dtype="int8")
    assert a.mismatches(b) == ["kv_dtype (bfloat16 != int8)"]
    assert KVLayout.from_dict(b.to_dict()) == b
    old = {k: v for k, v in a.to_dict().items() if k != "kv_dtype"}   # a peer that does not send it
    assert KVLayout.from_dict(old) == a
    ident = wire.BootstrapQuery(worker_id="d", incarnation="i", layout=b.to_dict(), backend="tcp")
    assert wire.decode(wire.encode(ident, "tcp://127.0.0.1:1"))[1].kv_layout == b
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        KVLayout(**SMOLLM, kv_dtype="int4")
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        KVCacheConfig(kv_cache_dtype="int4")


# ---- quantization and the pool -------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", KV8)
def test_quantization_error_is_bounded_per_vector(kv_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=g) * torch.logspace(-6, 3, 64)[:, None, None]
    x[0, 0] = 0.0                                   # an all-zero vector stays zero
    q, scale = quantize(x, kv_dtype)
    err = (dequantize(q, scale, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if kv_dtype == "int8":
        assert q.dtype == torch.int8 and (err <= scale[..., None] * 0.5 + amax * 1e-6).all()
    else:   # 3 mantissa bits: 1/16 relative; below the smallest normal, 2^-9 absolute (x scale)
        assert q.dtype == torch.float8_e4m3fn
        assert (err <= torch.maximum(x.abs() / 16, scale[..., None] * 2.0 ** -10) + amax * 1e-6).all()
    assert (err <= amax * (0.5 / 127 if kv_dtype == "int8" else 1 / 16)).all()
    assert err[0, 0].max() == 0


@pytest.mark.parametrize("kv_dtype", KV8)
def test_scales_travel_inside_the_page_bytes(kv_dtype):
    """Pages moved as bytes (what every backend does) and copied page to page (copy-on-write)
    dequantize to the same keys and values: the scales are part of the page."""
    layout = KVLayout("m", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    src, dst = kv_pool_for(layout, 6), kv_pool_for(layout, 6)
    assert isinstance(src, QuantizedKVPool)
    assert src.data.dtype == (torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(1)
    pages, offsets = torch.tensor([1, 1, 1, 1, 4, 4]), torch.tensor([0, 1, 2, 3, 0, 1])
    k = torch.randn(6, 2, 8, generator=g) * 10
    v = torch.randn(6, 2, 8, generator=g) * 0.01
    held = [src.write(layer, src.slot_ids(pages, offsets), k * (layer + 1), v)() for layer in range(2)]
    assert torch.allclose(held[1][0], k * 2, rtol=0.07, atol=0.2)
    assert src.scales[1, 1, 0, 0].tolist() == pytest.approx((k[:4, 0] * 2).abs().amax(-1)
                                                             .div(127 if kv_dtype == "int8" else 448).tolist())
    dst.write_pages([2, 3], src.read_pages([1, 4]))
    dst.copy_pages([(2, 5)])
    table = torch.tensor([[1, 4]])
    for layer in range(2):
        want_k, want_v = src.gather(layer, src.row_ids(table), 1)         # [H, 1, 8, D]
        got_k, got_v = dst.gather(layer, dst.row_ids(torch.tensor([[5, 3]])), 1)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert torch.equal(want_k[:, 0, :6], held[layer][0].transpose(0, 1))   # what write() said it holds
        assert torch.equal(want_v[:, 0, :6], held[layer][1].transpose(0, 1))
        assert torch.allclose(want_v[:, 0, :6], v.transpose(0, 1), atol=1e-3)


@pytest.mark.parametrize("kv_dtype", KV8)
def test_native_decode_matches_dequantized_attention_on_every_variant(kv_dtype):
    """The 8-bit decode kernel against float32 attention over the dequantized pages, for
    each variant this CPU runs: head dims 64, 128, 80 and 20 (whole vectors, more chunks
    than one value pass holds, a short last chunk), groups of 1 to 8 query heads (8: more
    than one pass of heads); the torch variant has no kernel."""
    try:
        for variant in kernels.available_isas():
            kernels.select_isa(variant)
            k = paged_decode_q8()
            assert (k is None) == (variant == "torch")
            if k is not None:
                for D, G, H, S in [(64, 3, 3, 16), (128, 2, 2, 4), (20, 4, 1, 3), (80, 8, 2, 16), (64, 1, 2, 5)]:
                    _check_decode_kernel(k, kv_dtype, D, G, H, S)
    finally:
        kernels.select_isa("auto")


def _check_decode_kernel(k, kv_dtype, D, G, H, S):
    pool = kv_pool_for(KVLayout("m", "float32", S, 2, H, D, kv_dtype), 64)
    g = torch.Generator().manual_seed(D)
    lens, P = [1, 17, 40], 40 // S + 1
    table = torch.randperm(64, generator=g)[:3 * P].view(3, P)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        for layer in range(2):
            pool.write(layer, pool.slot_ids(table[b][pos // S], pos % S),
                       torch.randn(n, H, D, generator=g) * 3, torch.randn(n, H, D, generator=g))
    q = torch.randn(3, H * G, D, generator=g)
    got = k(pool.data, pool.scales, table, torch.tensor(lens), q, 1, D ** -0.5)
    keys, values = pool.gather(1, pool.row_ids(table), 3)                  # [H, B, P * S, D]
    for b, n in enumerate(lens):
        for h in range(H * G):
            probs = torch.softmax(keys[h // G, b, :n] @ q[b, h] * D ** -0.5, 0)
            assert torch.allclose(got[b, h], probs @ values[h // G, b, :n], atol=1e-5), (b, h)
    # bfloat16 q in, bfloat16 out: the float32 result of the same q, rounded as torch rounds it.
    qb = q.bfloat16()
    got_b = k(pool.data, pool.scales, table, torch.tensor(lens), qb, 1, D ** -0.5)
    assert got_b.dtype == torch.bfloat16
    assert torch.equal(got_b, k(pool.data, pool.scales, table, torch.tensor(lens), qb.float(), 1, D ** -0.5).bfloat16())


# ---- a tiny model over the 8-bit cache -----------------------------------------------------

def _teacher_forced_logits(loaded, kv_dtype: str, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt (in two chunks: the second reads the first from the cache)
    and after each of `steps`, fed one at a time."""
    a = loaded.arch
    layout = KVLayout("t", loaded.dtype, 4, a.num_layers, a.num_kv_heads, a.head_dim,
                      kv_dtype="" if kv_dtype == "auto" else kv_dtype)
    kv, alloc = kv_pool_for(layout, 32), PageAllocator(32)
    attn = make_attention_backend("auto", kv, a.num_heads)
    alloc.allocate(-(-(len(prompt) + len(steps)) // 4), "seq")
    pages, seq, out = alloc.pages_of("seq"), [], []
    half = len(prompt) // 2
    for chunk in (prompt[:half], prompt[half:], *([t] for t in steps)):
        out.append(loaded.model(build_forward_batch([SeqChunk(chunk, len(seq), pages)], 4), attn)[0])
        seq += chunk
    return out[1:]


@pytest.mark.parametrize("kv_dtype", [*KV8, "bfloat16"])
def test_logits_stay_close_to_the_float32_cache(tiny_loaded, kv_dtype):
    prompt = list(range(5, 45))
    ref = _teacher_forced_logits(tiny_loaded, "auto", prompt, [])
    steps = []
    for _ in range(8):   # the float32 cache's own greedy continuation
        steps.append(int(ref[-1].argmax()))
        ref = _teacher_forced_logits(tiny_loaded, "auto", prompt, steps)
    got = _teacher_forced_logits(tiny_loaded, kv_dtype, prompt, steps)
    tol = {"bfloat16": 0.01, "int8": 0.02}.get(kv_dtype, 0.1)
    for want, have in zip(ref, got):
        spread = (want.max() - want.min()).item()
        assert (have - want).abs().max().item() < tol * spread


@pytest.mark.parametrize("kv_dtype", [*KV8, "bfloat16"])
def test_greedy_tokens_start_the_same_as_the_float32_cache(tiny_loaded, tiny_engine, kv_dtype):
    engine = build_engine(tiny_loaded, kv_cfg(kv_dtype), SCHED)
    try:
        reqs = [greedy(f"g{i}", range(3 + i, 20 + 7 * i), n=16) for i in range(6)]

        async def main(e):
            return await asyncio.gather(*[_collect(e.generate(r)) for r in reqs])

        want, got = asyncio.run(main(tiny_engine)), asyncio.run(main(engine))
        agree = [next((i for i, (x, y) in enumerate(zip(tokens(w), tokens(h))) if x != y), 16)
                 for w, h in zip(want, got)]
        assert min(agree) >= 3 and sum(agree) >= (30 if kv_dtype == "fp8_e4m3" else 80), agree
        assert engine.core.kv.data.dtype == (torch.bfloat16 if kv_dtype == "bfloat16" else engine.core.kv.data.dtype)
        engine.check_idle(timeout=15)
    finally:
        engine.shutdown()


async def _collect(gen):
    return [o async for o in gen]


# ---- disaggregated over the 8-bit cache ----------------------------------------------------

class Pair:
    """A prefill and a decode worker core in this process, each with its own KV dtype."""

    def __init__(self, loaded, backend: str, p_dtype: str, d_dtype: str) -> None:
        tc = TransferConfig(transfer_backend=backend)
        self.P = AsyncEngine(lambda: PrefillCore(loaded, kv_cfg(p_dtype), SCHED, LIFE, tc))
        self.D = AsyncEngine(lambda: DecodeCore(loaded, kv_cfg(d_dtype), SCHED, LIFE, tc))
        self.room = 100

    async def run(self, greq: GenerateRequest):
        self.room += 1
        return await asyncio.gather(
            _collect(self.P.generate(greq, room=self.room)),
            _collect(self.D.generate(greq, room=self.room, prefill_address=self.P.core.manager.address)))

    def close(self) -> None:
        for e in (self.P, self.D):
            e.shutdown()
            e.core.close()


@contextlib.contextmanager
def pair(loaded, backend: str, p_dtype: str, d_dtype: str):
    p = Pair(loaded, backend, p_dtype, d_dtype)
    try:
        yield p
        for e in (p.P, p.D):   # no leak: free pages == total, no live room, every gauge 0
            e.check_idle(timeout=15)
    finally:
        p.close()


CASES = [(b, "int8") for b in REAL] + [(b, "bfloat16") for b in REAL] + [(REAL[0], "fp8_e4m3")]


@pytest.mark.parametrize("backend,kv_dtype", CASES)
def test_disaggregated_returns_the_colocated_tokens(tiny_loaded, backend, kv_dtype):
    """Batched greedy requests, prompts of 17..55 tokens (pages shared by no one, partial
    last pages): D decodes from the 8-bit pages and scales P wrote, token for token what a
    colocated engine with the same cache returns."""
    reqs = [greedy(f"g{i}", range(3 + i, 20 + 7 * i), n=10 + i) for i in range(6)]
    colocated = build_engine(tiny_loaded, kv_cfg(kv_dtype), SCHED)
    try:
        want = asyncio.run(_all(colocated, reqs))
        colocated.check_idle(timeout=15)
    finally:
        colocated.shutdown()
    with pair(tiny_loaded, backend, kv_dtype, kv_dtype) as p:
        assert p.P.core.engine.layout.kv_dtype == p.D.core.engine.layout.kv_dtype == kv_dtype

        async def main():
            return await asyncio.gather(*[p.run(r) for r in reqs])

        got = asyncio.run(main())
        for r, (pouts, douts), couts in zip(reqs, got, want):
            assert [o.finish_reason for o in pouts] == [FinishReason.LENGTH]
            assert douts[-1].finish_reason is FinishReason.LENGTH
            assert tokens(douts) == tokens(couts), r.rid


async def _all(engine, reqs):
    return await asyncio.gather(*[_collect(engine.generate(r)) for r in reqs])


@pytest.mark.parametrize("p_dtype,d_dtype", [("auto", "int8"), ("fp8_e4m3", "int8"), ("bfloat16", "auto")])
def test_prefill_and_decode_refuse_a_kv_dtype_mismatch(tiny_loaded, p_dtype, d_dtype):
    """The rendezvous layout check: D's leg fails with invalid_request naming kv_dtype,
    P's leg ends too, and neither side keeps anything."""
    with pair(tiny_loaded, REAL[0], p_dtype, d_dtype) as p:
        pouts, douts = asyncio.run(p.run(greedy("mismatch", range(3, 30))))
        assert douts[-1].finish_reason is FinishReason.ERROR
        assert douts[-1].error.startswith("invalid_request") and "kv_dtype" in douts[-1].error, douts[-1].error
        assert pouts[-1].finish_reason in (FinishReason.ERROR, FinishReason.ABORT)


def test_auto_resolves_to_bfloat16_where_dtype_auto_computes_float32(tiny_llama_dir, tiny_loaded):
    """--kv-cache-dtype auto: bfloat16 under --dtype auto resolved to float32 (this CPU
    without AVX-512 BF16, or the avx512_bf16 variant's own bfloat16), the compute dtype under
    an explicit --dtype; float32 under bfloat16 compute is refused in one line."""
    from kvrelay.core.config import ModelOptions
    from kvrelay.engine.core import kv_layout_for
    from kvrelay.engine.loader import load_model

    auto = load_model(ModelOptions(model=f"random:{tiny_llama_dir}", seed=0))
    assert auto.kv_cache == "bfloat16" and kv_layout_for(auto, 16).kv_dtype == "bfloat16"
    assert tiny_loaded.kv_cache == "float32" and kv_layout_for(tiny_loaded, 16).kv_dtype == "float32"
    assert kv_layout_for(tiny_loaded, 16, "bfloat16").kv_dtype == "bfloat16"
    if auto.dtype == "float32":
        assert kv_layout_for(auto, 16, "float32").kv_dtype == "float32"
    bf16 = load_model(ModelOptions(model=f"random:{tiny_llama_dir}", seed=0, dtype="bfloat16"))
    with pytest.raises(ValueError) as err:
        kv_layout_for(bf16, 16, "float32")
    assert "\n" not in str(err.value) and "--dtype float32" in str(err.value)
    with pytest.raises(ValueError, match="must be one of"):
        KVCacheConfig(kv_cache_dtype="float16")


def test_every_real_backend_is_under_test():
    assert {"shm", "tcp"} <= set(REAL), REAL


def test_kvrelay_serve_with_an_8bit_cache_returns_the_colocated_tokens(tiny_llama_dir, tiny_loaded):
    """`kvrelay serve --kv-cache-dtype int8`, as processes: the flag reaches the spawned
    prefill and decode workers (their pools hold the 8-bit page count for --kv-cache-gb),
    whose greedy answers are the colocated server's; nothing is left on the server or any
    worker."""
    args = ("--model", f"random:{tiny_llama_dir}", "--dtype", "float32", "--kv-cache-gb", "0.01",
            "--kv-cache-dtype", "int8")
    a = tiny_loaded.arch
    layout = KVLayout("t", "float32", 16, a.num_layers, a.num_kv_heads, a.head_dim, "int8")
    pages = num_pages_for(KVCacheConfig(kv_cache_gb=0.01, kv_cache_dtype="int8"), layout)
    assert pages > 3 * num_pages_for(KVCacheConfig(kv_cache_gb=0.01), replace(layout, kv_dtype="float32"))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]

    def answers(url: str) -> list[list[str]]:
        out = []
        with httpx.Client(timeout=120) as client:
            for prompt in prompts:
                r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                               "temperature": 0, "logprobs": 0})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["logprobs"]["tokens"])
        assert_no_leak(url)
        return out

    with running_server("--mode", "colocated", *args) as url:
        want = answers(url)
    with running_server("--transfer-backend", "tcp", *args) as url:
        workers = worker_urls(url)
        assert len(workers) == 2
        for u in workers:
            assert gauge(metric_samples(u), "kvrelay_kv_pages_capacity") == [pages], u
        got = answers(url)
    assert got == want and all(len(t) == 12 for t in got)
