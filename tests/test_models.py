"""Logits parity with transformers: the default GGUF model and tiny random Llama, Qwen2 and
Mistral models, over batched prefill (prompts of different lengths in one ForwardBatch),
chunked prefill and decode steps through the paged KV pool."""
from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import pytest
import torch

from kvrelay.core.config import ModelOptions
from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.allocator import PageAllocator
from kvrelay.engine.attention import make_attention_backend
from kvrelay.engine.kv_pool import KVPool
from kvrelay.engine.loader import default_gguf_path, load_model
from kvrelay.engine.models.testing import make_tiny_model_dir
from kvrelay.engine.runner import SeqChunk, build_forward_batch

TOL = 1e-3
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


class PagedSession:
    """Sequences over a small paged pool. Pages are handed out one per sequence in turn,
    so every sequence's pages are scattered, not contiguous."""

    def __init__(self, loaded, page_size: int = 4, num_pages: int = 64, attention: str = "auto") -> None:
        a = loaded.arch
        self.model, self.page_size = loaded.model, page_size
        self.kv = KVPool(KVLayout("t", loaded.dtype, page_size, a.num_layers, a.num_kv_heads, a.head_dim),
                         num_pages, device=loaded.device)
        self.attn = make_attention_backend(attention, self.kv, a.num_heads)
        self.alloc = PageAllocator(num_pages)
        self.seqs: list[list[int]] = []

    def add(self, prompts: list[list[int]], reserve: int) -> None:
        self.seqs = [list(p) for p in prompts]
        need = [-(-(len(p) + reserve) // self.page_size) for p in prompts]
        for round_ in range(max(need)):
            for b, n in enumerate(need):
                if round_ < n:
                    assert self.alloc.allocate(1, b) is not None

    def run(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Each (seq, tokens) appends tokens to seq in one forward pass; logits [B, vocab]."""
        batch = [SeqChunk(toks, len(self.seqs[b]) - len(toks), self.alloc.pages_of(b)) for b, toks in chunks]
        return self.model(build_forward_batch(batch, self.page_size).to(self.kv.device), self.attn)

    def prefill(self, prompts, reserve: int) -> torch.Tensor:
        self.add(prompts, reserve)
        return self.run(list(enumerate(self.seqs)))

    def decode(self, tokens: list[int]) -> torch.Tensor:
        for b, t in enumerate(tokens):
            self.seqs[b].append(t)
        return self.run([(b, [t]) for b, t in enumerate(tokens)])

    def close(self) -> None:
        for owner in self.alloc.owners():
            self.alloc.free(owner)
        self.alloc.check_integrity()
        assert self.alloc.num_free == self.kv.num_pages


def greedy_next_word(loaded, text: str) -> str:
    """The word the model puts after `text`: one prefill over a paged pool, argmax."""
    sess = PagedSession(loaded, page_size=16)
    try:
        logits = sess.prefill([loaded.tokenizer.encode(text)], reserve=0)
    finally:
        sess.close()
    return loaded.tokenizer.decode(logits.argmax(-1)).strip()


@torch.no_grad()
def reference_last_logits(hf, seqs: list[list[int]]) -> torch.Tensor:
    return torch.stack([hf(torch.tensor([s], device=hf.device)).logits[0, -1].float() for s in seqs])


def check_prefill_and_decode(loaded, hf, prompts, steps: int = 3, page_size: int = 4,
                             attention: str = "auto") -> None:
    sess = PagedSession(loaded, page_size, attention=attention)
    try:
        ours = sess.prefill(prompts, reserve=steps)
        ref = reference_last_logits(hf, sess.seqs)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < TOL
        for _ in range(steps):
            ours = sess.decode(ref.argmax(-1).tolist())
            ref = reference_last_logits(hf, sess.seqs)
            assert (ours - ref).abs().max().item() < TOL
    finally:
        sess.close()


# The parity tests run on the native kernels and on the reference every backend is tested against.
@pytest.fixture(params=["cpu_native", "torch_ref"])
def backend(request) -> str:
    return request.param


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------ tiny random models

TINY_CASES = {
    "llama": dict(arch="llama"),
    "llama-tied-mha": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen3-biased-tied": dict(arch="qwen3", attention_bias=True, tie_word_embeddings=True),
    "mistral": dict(arch="mistral"),
}


@pytest.fixture(scope="module", params=sorted(TINY_CASES))
def tiny_pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), seed=1, **TINY_CASES[request.param])
    loaded = load_model(ModelOptions(model=str(d), dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=torch.float32).eval()
    return loaded, hf


def test_tiny_prefill_batch_and_decode_match_transformers(tiny_pair, backend):
    loaded, hf = tiny_pair
    prompts = random_prompts(loaded.arch.vocab_size, [5, 17, 1, 9, 70])
    check_prefill_and_decode(loaded, hf, prompts, steps=3, attention=backend)


def test_greedy_32_tokens_are_transformers_tokens(tiny_pair, backend):
    """Each sequence decoded greedily on its own over 32 tokens (a batch of two over the
    paged pool) gives the tokens transformers' own greedy loop gives."""
    loaded, hf = tiny_pair
    prompts = random_prompts(loaded.arch.vocab_size, [7, 21], seed=7)
    assert greedy_paged(PagedSession(loaded, page_size=4, attention=backend), prompts, 32) == \
        greedy_reference(hf, prompts, 32)


def greedy_paged(sess: PagedSession, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens of each prompt, decoded as one paged batch (the session is closed)."""
    try:
        ours = [[t] for t in sess.prefill(prompts, reserve=n).argmax(-1).tolist()]
        for _ in range(n - 1):
            for seq, t in zip(ours, sess.decode([seq[-1] for seq in ours]).argmax(-1).tolist()):
                seq.append(t)
        return ours
    finally:
        sess.close()


@torch.inference_mode()
def greedy_reference(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens of each prompt from transformers, recomputing every prefix."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        for seq, t in zip(seqs, reference_last_logits(hf, seqs).argmax(-1).tolist()):
            seq.append(t)
    return [seq[len(p):] for seq, p in zip(seqs, prompts)]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_bf16_greedy_32_tokens_are_transformers_tokens(arch, tmp_path):
    """On a GPU in bfloat16 (the cuda attention backend): 5 prompts decoded greedily as one
    paged batch over 32 tokens give the tokens of transformers' greedy loop on the same GPU."""
    from transformers import AutoModelForCausalLM

    d = make_tiny_model_dir(tmp_path, seed=1, arch=arch)
    loaded = load_model(ModelOptions(model=str(d), dtype="bfloat16", device="cuda"))
    assert loaded.attention_backend == "cuda" and loaded.device.startswith("cuda")
    hf = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=torch.bfloat16).to("cuda").eval()
    prompts = random_prompts(loaded.arch.vocab_size, [7, 21, 3, 40, 12], seed=11)
    assert greedy_paged(PagedSession(loaded, page_size=16), prompts, 32) == greedy_reference(hf, prompts, 32)


def test_tiny_logits_are_not_trivially_small(tiny_pair):
    # Parity at 1e-3 means something only if the logits themselves are O(1).
    loaded, hf = tiny_pair
    ref = reference_last_logits(hf, random_prompts(loaded.arch.vocab_size, [8]))
    assert ref.std().item() > 0.1


def test_chunked_prefill_and_mixed_batch(tiny_pair, backend):
    """A prompt prefilled in two chunks (the second reads the first's KV from the pool) in
    the same pass as another sequence's decode step."""
    loaded, hf = tiny_pair
    a, b = random_prompts(loaded.arch.vocab_size, [23, 6], seed=3)
    sess = PagedSession(loaded, page_size=8, attention=backend)
    try:
        sess.add([a[:10], b], reserve=20)
        sess.run([(0, a[:10]), (1, b)])
        sess.seqs[0] += a[10:]
        sess.seqs[1].append(7)
        ours = sess.run([(0, a[10:]), (1, [7])])
        ref = reference_last_logits(hf, sess.seqs)
        assert (ours - ref).abs().max().item() < TOL
    finally:
        sess.close()


def test_one_chunk_after_its_prefix_matches_transformers(tiny_pair, monkeypatch):
    """A prompt prefilled one sequence at a time in three chunks: each later chunk runs as
    two flash passes (the prefix, then its own keys causally) merged by log-sum-exp (cpu_native,
    for a head_dim its prefill kernel does not take)."""
    from kvrelay.engine.attention.cpu_native import CpuNativeBackend

    calls = []
    real = CpuNativeBackend._prefix_then_chunk
    monkeypatch.setattr(CpuNativeBackend, "_prefix_then_chunk", lambda *a: calls.append(a[-1]) or real(*a))
    loaded, hf = tiny_pair
    (a,) = random_prompts(loaded.arch.vocab_size, [23], seed=5)
    sess = PagedSession(loaded, page_size=4, attention="cpu_native")
    try:
        sess.add([a], reserve=0)
        for start, end in ((0, 10), (10, 17), (17, 23)):
            sess.seqs[0] = a[:end]
            ours = sess.run([(0, a[start:end])])
            ref = reference_last_logits(hf, sess.seqs)
            assert (ours - ref).abs().max().item() < TOL, end
    finally:
        sess.close()
    assert sorted(set(calls)) == [17, 23]      # the two chunks with a prefix, once per layer


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefix_then_chunk_equals_one_masked_pass(dtype, tol):
    from kvrelay.engine.attention.cpu_native import CpuNativeBackend

    gen = torch.Generator().manual_seed(6)
    Hq, Hkv, D, n, m = 6, 2, 64, 70, 29
    q = torch.randn(m, Hq, D, generator=gen).to(dtype)
    keys = torch.randn(Hkv, n + 5, D, generator=gen).to(dtype)   # padded past n, as gathered pages are
    values = torch.randn(Hkv, n + 5, D, generator=gen).to(dtype)
    kv = KVPool(KVLayout("t", str(dtype).removeprefix("torch."), 4, 1, Hkv, D), 1)
    got = CpuNativeBackend(kv, Hq)._prefix_then_chunk(q, keys, values, n)
    mask = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys[:, :n].float(), values[:, :n].float(), attn_mask=mask, enable_gqa=True)
    assert got.dtype == dtype and got.shape == (m, Hq * D)
    assert (got.float() - want.transpose(0, 1).reshape(m, -1)).abs().max().item() < tol


def test_after_layer_runs_once_per_layer_and_changes_no_logit(tiny_pair):
    """The engine's between-layer callback (heartbeats and reads inside a long prefill
    pass) runs once after each layer and leaves the logits exactly as without it."""
    loaded, _ = tiny_pair
    prompts = random_prompts(loaded.arch.vocab_size, [11, 30])
    plain, called = PagedSession(loaded), PagedSession(loaded)
    try:
        want = plain.prefill(prompts, reserve=0)
        called.add(prompts, reserve=0)
        batch = [SeqChunk(p, 0, called.alloc.pages_of(b)) for b, p in enumerate(called.seqs)]
        calls = []
        got = loaded.model(build_forward_batch(batch, called.page_size), called.attn, calls.append)
        assert calls == list(range(1, loaded.arch.num_layers + 1))
        assert torch.equal(got, want)
    finally:
        plain.close()
        called.close()


def test_fully_masked_padding_rows_do_not_leak_nan(tiny_pair, backend, monkeypatch):
    """Padded query rows that attend to nothing (the dense mask's guard stripped) change no
    real row: their output is never gathered."""
    from kvrelay.engine.attention import base, cpu_native, torch_ref

    loaded, _ = tiny_pair
    prompts = random_prompts(loaded.arch.vocab_size, [3, 12])
    sess = PagedSession(loaded, attention=backend)
    try:
        sess.add(prompts, reserve=0)
        chunks = [SeqChunk(p, 0, sess.alloc.pages_of(b)) for b, p in enumerate(prompts)]
        batch = build_forward_batch(chunks, sess.page_size)
        expected = loaded.model(batch, sess.attn)
        unguarded = lambda b: base.dense_mask(b) & b.q_valid[:, None, :, None]   # noqa: E731
        monkeypatch.setattr(cpu_native, "dense_mask", unguarded)
        monkeypatch.setattr(torch_ref, "dense_mask", unguarded)
        for no_prefix in (True, False):
            out = loaded.model(dataclasses.replace(batch, no_prefix=no_prefix), sess.attn)
            assert torch.isfinite(out).all()
            assert (out - expected).abs().max().item() < 1e-4
    finally:
        sess.close()


def test_bfloat16_model_follows_float32(tiny_llama_dir):
    prompts = random_prompts(49152, [7, 4])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(ModelOptions(model=str(tiny_llama_dir), dtype=dtype))
        assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)
        sess = PagedSession(loaded)
        try:
            logits[dtype] = sess.prefill(prompts, reserve=0)
        finally:
            sess.close()
    assert logits["bfloat16"].dtype == torch.float32
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() < 0.1


HAS_AMX = "amx_bf16" in open("/proc/cpuinfo").read()


@pytest.mark.parametrize("path", ["native", "flash", pytest.param(
    "tiles", marks=pytest.mark.skipif(not HAS_AMX, reason="the tiles' kernel needs AMX"))])
def test_bfloat16_prefill_attention_takes_the_path_chosen_for_this_cpu(path, tmp_path, monkeypatch):
    """With AMX, a bfloat16 prefill pass goes through the tiles' kernel, every pass; with AMX
    but without that kernel, through torch's flash attention unless padding would multiply
    its query-key pairs by more than TILE_PAD_LIMIT; without AMX, and in float32, through
    the native kernel. Each is forced, and each follows float32: a whole prompt, a chunk
    over the cached prefix, prompts beside a decode."""
    from kvrelay.engine.attention import cpu_native as layers
    from kvrelay.engine.kernels import paged_prefill, paged_prefill_tiles

    assert not layers.prefill_on_tiles(build_forward_batch([SeqChunk([1, 2], 0, [1])], 4), torch.float32)
    if paged_prefill() is None:   # no native prefill here: torch's path is the only one
        return

    def counted(name, real):
        class Counted:
            def supports(self, *a):
                return real.supports(*a)

            def __call__(self, *a, **k):
                calls.append(name)
                return real(*a, **k)
        return Counted

    calls: list[str] = []
    monkeypatch.setattr(layers, "amx_bf16", lambda: path != "native")
    monkeypatch.setattr(layers, "paged_prefill", counted("native", paged_prefill()))
    monkeypatch.setattr(layers, "paged_prefill_tiles",
                        counted("tiles", paged_prefill_tiles()) if path == "tiles" else lambda: None)
    d = make_tiny_model_dir(tmp_path, head_dim=64, num_attention_heads=2, num_key_value_heads=1, hidden_size=128)
    full = random_prompts(49152, [30, 9, 5], seed=4)
    # (sequence, start, end) per pass: a whole prompt beside another, a chunk over the cached
    # prefix, then a last chunk beside a whole prompt and a decode.
    passes = ([(0, 0, 12), (2, 0, 4)], [(0, 12, 24)], [(0, 24, 30), (1, 0, 9), (2, 4, 5)])
    logits, kernel = {}, {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(ModelOptions(model=str(d), dtype=dtype))
        sess = PagedSession(loaded, attention="cpu_native")
        kernel[dtype] = []
        try:
            sess.add(list(full), reserve=0)
            out = []
            for p in passes:
                for seq, _, end in p:   # run() reads each sequence's length after the pass
                    sess.seqs[seq] = full[seq][:end]
                calls.clear()
                out.append(sess.run([(seq, full[seq][start:end]) for seq, start, end in p]))
                kernel[dtype].append(calls[0] if calls else "flash")
            logits[dtype] = torch.cat(out)
        finally:
            sess.close()
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() < 0.1
    assert kernel["float32"] == ["native"] * 3                # float32 never goes to the tiles
    # The last pass: 6 x 30 + 9 x 9 + 1 x 5 query-key pairs, padded to 3 sequences x 9
    # queries x 8 pages of 4 keys: more than TILE_PAD_LIMIT times, so flash leaves it native.
    assert 3 * 9 * 32 > layers.TILE_PAD_LIMIT * (6 * 30 + 9 * 9 + 1 * 5)
    want = {"native": ["native"] * 3, "flash": ["flash", "flash", "native"], "tiles": ["tiles"] * 3}
    assert kernel["bfloat16"] == want[path]


# ------------------------------------------------------------------ the default model (GGUF)

@pytest.fixture(scope="module")
def default_pair():
    return load_model(ModelOptions(dtype="float32")), hf_reference_from_gguf()


@functools.lru_cache(maxsize=1)
def hf_reference_from_gguf():
    """transformers' own GGUF conversion (name mapping, q/k un-permute) into its Llama.
    Built on the meta device and assigned, since from_pretrained(gguf_file=...) needs
    `accelerate`. Built once per test session: callers only run it.
    transformers parses the file twice (config, then tensors) and rebuilds gguf's tensor
    name map once per module, 397 times: both are pure functions of their arguments, so
    they run cached here (the conversion itself stays transformers' own; ~30 s before)."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_gguf_path()
    with mock.patch.object(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map)):
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False, assign=True)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(cfg)  # its buffers are not in the state dict
    return hf.eval()


def test_default_model_prefill_batch_and_decode_match_transformers(default_pair, backend):
    loaded, hf = default_pair
    texts = ["The capital of France is", "Hello",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    check_prefill_and_decode(loaded, hf, prompts, steps=3, page_size=16, attention=backend)


def test_default_model_says_paris(default_pair):
    loaded, _ = default_pair
    assert greedy_next_word(loaded, "The capital of France is") == "Paris"


def test_bfloat16_logits_resolve_near_ties_in_float32():
    from kvrelay.engine.models.linear import REFINE_TOP, lm_head_logits

    gen = torch.Generator().manual_seed(3)
    h = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    w = (torch.randn(5000, 64, generator=gen) * 3).to(torch.bfloat16)
    got = lm_head_logits(h, w, None)
    exact = h.float() @ w.float().t()
    rounded = torch.nn.functional.linear(h, w).float()              # what bf16 alone gives
    kth = rounded.topk(REFINE_TOP, dim=-1).values[:, -1:]
    refined = (got - exact).abs() < 1e-4
    # The candidates are the REFINE_TOP best bf16 logits (any of those tied at the edge).
    assert refined[rounded > kth].all()
    assert (refined & (rounded >= kth)).sum(-1).eq(REFINE_TOP).all()
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("amx", [False, True])
def test_each_row_count_takes_the_path_chosen_for_this_cpu_and_computes_the_same(amx, monkeypatch):
    """bfloat16 matmuls: with AMX (cpuid amx_bf16) the native kernel takes up to
    GEMM_MAX_ROWS rows on the tiles where K fits them, else up to AMX_NATIVE_MAX_ROWS rows
    and oneDNN the rest; without AMX, the native kernel takes up to GEMM_MAX_ROWS. Both are
    forced here (the tiles only where this CPU has them); every row count matches a float32
    matmul of the same bfloat16 values, and the logits match their float32 sums."""
    from kvrelay.engine.kernels import gemm
    from kvrelay.engine.models import linear

    monkeypatch.setattr(linear, "amx_bf16", lambda: amx)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(200, 96, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(200, generator=gen).to(torch.bfloat16)
    packed = linear.pack_weight(w, bias)
    limit = linear.AMX_NATIVE_MAX_ROWS if amx else linear.GEMM_MAX_ROWS
    if gemm() is None or packed.onednn is None:   # no native bf16 kernel, or no oneDNN bf16: one path only
        assert packed is None or packed.native is None or packed.onednn is None
    else:
        assert packed.tiles == (amx and gemm().tiles)
        limit = linear.GEMM_MAX_ROWS if packed.tiles else limit
        assert linear.native_max_rows(packed) == limit
    calls = []
    real_gemm = gemm()
    if real_gemm is not None:
        monkeypatch.setattr(linear, "gemm", lambda: (lambda *a, **k: calls.append(a[0].shape[0]) or real_gemm(*a, **k)))
    for rows in (1, 8, 9, 40, 129):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        want = x.float() @ w.float().t() + bias.float()
        got = linear.fast_linear(x, w, bias, packed)
        assert got.shape == (rows, 200) and torch.allclose(got.float(), want, atol=0.05, rtol=0.02), rows
        logits = linear.lm_head_logits(x, w, packed)
        assert torch.equal(logits.argmax(-1), (x.float() @ w.float().t()).argmax(-1)), rows
    if real_gemm is not None and packed.onednn is not None:
        assert calls and all(r <= limit for r in calls)
        assert set(calls) == {r for r in (1, 8, 9, 40, 129) if r <= limit}


def test_the_mlp_runs_fused_on_amx_tiles_and_computes_what_the_two_passes_do(tiny_llama_dir):
    """bfloat16 on a CPU with AMX tiles: every SwiGLU packs gate and up for `Gemm.swiglu`
    (elsewhere none does), and a decode-sized batch through it matches gate_up_proj's
    matmul followed by silu(gate) * up; a batch past GEMM_MAX_ROWS takes the two passes."""
    from kvrelay.engine.kernels import gemm
    from kvrelay.engine.models import linear
    from kvrelay.engine.models.layers import SwiGLU

    loaded = load_model(ModelOptions(model=str(tiny_llama_dir), dtype="bfloat16"))
    mlps = [m for m in loaded.model.modules() if isinstance(m, SwiGLU)]
    tiles = gemm() is not None and gemm().tiles
    assert mlps and all((m._fused is not None) == tiles for m in mlps)
    mlp = mlps[0]
    gen = torch.Generator().manual_seed(8)
    w = mlp.gate_up_proj.weight.detach().float()
    for rows in (1, 32, linear.GEMM_MAX_ROWS + 3):
        x = torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16)
        sums = x.float() @ w.t()
        inner = (torch.nn.functional.silu(sums[:, :mlp.intermediate]) * sums[:, mlp.intermediate:])
        want = inner @ mlp.down_proj.weight.detach().float().t()
        got = mlp(x).float()
        assert got.shape == want.shape
        assert ((got - want).abs() <= 0.03 * want.abs() + 0.03 * want.abs().max()).all(), rows
