"""Native kernels in C, loaded with ctypes from the variant `variants.py` picks for this CPU
(AVX-512 BF16, AVX-512 VNNI or AVX2; built on first use into a per-user cache). Everything
here has a pure-torch fallback: each factory below returns None when no variant runs or the
active one lacks that kernel, and the model uses torch ops instead.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kvrelay.engine.kernels.variants import (  # noqa: F401  (the kernels' public API)
    SOURCES, IsaUnavailable, available_isas, cache_dir, cpu_features, fallback_reason, isa, missing, native_library,
    per_isa, requested, select_isa)

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


# (pool dtype, query dtype) pairs with a kernel: the compute dtype's own pool, and a float32
# model's bfloat16 pool (`--kv-cache-dtype bfloat16`), read widened with float32 queries.
_POOL_QUERY = ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32))


class _PoolAttention:
    """An attention kernel over the pool: one C function per _POOL_QUERY pair, named
    `<prefix>bf16`, `<prefix>f32`, `<prefix>bf16kv_f32`, all with `argtypes`."""

    head_dims = (64, 128)
    max_group = 16

    def __init__(self, lib: ctypes.CDLL, prefix: str, argtypes: list) -> None:
        self._fns = {pair: getattr(lib, prefix + suffix)
                     for pair, suffix in zip(_POOL_QUERY, ("bf16", "f32", "bf16kv_f32"))}
        for fn in self._fns.values():
            fn.restype, fn.argtypes = ctypes.c_int, argtypes

    def supports(self, dtype: torch.dtype, head_dim: int, group: int, q_dtype: torch.dtype | None = None) -> bool:
        """Whether a pool of `dtype` and queries of `q_dtype` (default: the pool's) have a kernel."""
        return ((dtype, q_dtype or dtype) in self._fns and head_dim in self.head_dims
                and group <= self.max_group)


class PagedDecode(_PoolAttention):
    """`__call__` computes one layer's decode attention from the pool (see the C source for
    the layout). It reads keys and values once, in place, on torch's own OpenMP threads,
    where the torch path gathers every page into a new tensor and reads it again."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, "paged_decode_", [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32,
                                                _I64, _I64])

    def __call__(self, pool: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor, q: torch.Tensor,
                 layer: int, num_kv_heads: int, page_size: int, scale: float) -> torch.Tensor:
        """pool [pages, L, 2, H, S, D]; page_table [B, P] int64; kv_lens [B] int64;
        q [B, Hq, D] (a dtype `supports`) -> out [B, Hq, D] in q's dtype."""
        B, Hq, D = q.shape
        L, H = pool.shape[1], num_kv_heads
        q = q.contiguous()
        out = torch.empty_like(q)
        fn = self._fns[pool.dtype, q.dtype]
        rc = fn(pool.data_ptr(), page_table.data_ptr(), kv_lens.data_ptr(), q.data_ptr(), out.data_ptr(),
                page_table.shape[1], layer, L, H, Hq // H, page_size, D, scale, 0, B * H)
        if rc != 0:
            raise RuntimeError(f"native decode attention failed ({rc}): out of memory or unsupported shape")
        return out


class PagedPrefill(_PoolAttention):
    """`__call__` computes one layer's attention for a prefill pass (every query row sees
    the keys up to its own position, cached prefix included) from the pool, in place of
    gathering the pages and torch's flash kernel (~3x faster on a Zen 4). bfloat16 through
    vdpbf16ps on CPUs with AVX-512 BF16; float32, and bfloat16 widened to float32, on
    every variant (AVX-512F or AVX2, prefill_attention_f32.h). With AMX, torch's flash
    kernel runs bfloat16 on the tiles and is faster (`attention.cpu_native.prefill_on_tiles`),
    and PagedPrefillTiles faster still."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, "paged_prefill_", [_P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                                 _I64, _I64, _F32])

    def __call__(self, pool: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor, q_lens: torch.Tensor,
                 q_rows: torch.Tensor, q: torch.Tensor, layer: int, num_kv_heads: int, page_size: int,
                 scale: float) -> torch.Tensor:
        """pool [pages, L, 2, H, S, D]; page_table [B, P], kv_lens, q_lens, q_rows [B] int64
        (sequence b's queries are rows q_rows[b].. of q, the last q_lens[b] of its kv_lens[b]
        positions); q [T, Hq, D] (a dtype `supports`) with contiguous rows -> out [T, Hq, D]."""
        T, Hq, D = q.shape
        assert (pool.dtype, q.dtype) in self._fns and q.stride(2) == 1 and q.stride(1) == D
        out = q.new_empty(T, Hq, D)
        H = num_kv_heads
        fn = self._fns[pool.dtype, q.dtype]
        rc = fn(pool.data_ptr(), page_table.data_ptr(), kv_lens.data_ptr(), q_lens.data_ptr(), q_rows.data_ptr(),
                q.data_ptr(), q.stride(0), out.data_ptr(), page_table.shape[0], page_table.shape[1], layer,
                pool.shape[1], H, Hq // H, page_size, D, scale)
        if rc != 0:
            raise RuntimeError(f"native prefill attention failed ({rc}): out of memory or unsupported shape")
        return out


class PagedPrefillTiles(PagedPrefill):
    """PagedPrefill for a bfloat16 pool and queries on the AMX tiles
    (`prefill_attention_amx.c`): the same arguments and result. On a 2-core Emerald Rapids,
    8 prompts of 256 tokens took 1.6 ms a layer here against 2.2-2.5 ms in torch's flash
    kernel, which also needs the rows gathered into a padded batch (~0.9 ms a layer) and,
    when a prompt continues after a cached prefix, the pages gathered too."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_prefill_amx_bf16
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32]
        self._fns = {(torch.bfloat16, torch.bfloat16): fn}


class Gemm:
    """Small-batch bfloat16 matmul (see gemm_bf16.c): `pack` a weight [N, K] once, then
    `__call__(x [M, K], packed, N, bias32)` -> [M, N] bfloat16. AVX-512 BF16 CPUs only:
    `gemm()` is None elsewhere. With `tiles=True` the same packed weight is multiplied on
    the AMX tiles (gemm_amx.c); only where `fits_tiles(K)`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack, self._mm = lib.gemm_pack_bf16, lib.gemm_bf16
        self._pack.restype, self._pack.argtypes = None, [_P, _I64, _I64, _P]
        self._mm.restype, self._mm.argtypes = None, [_P, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int]
        # cpuid first: the permission request is a Linux syscall, made only on a CPU with tiles.
        self._amx = lib.gemm_bf16_amx if amx_bf16() and lib.gemm_amx_available() else None
        self._swiglu = lib.gemm_bf16_amx_swiglu
        if self._amx is not None:
            self._amx.restype, self._amx.argtypes = None, self._mm.argtypes
            self._swiglu.restype, self._swiglu.argtypes = None, [_P, _I64, _I64, _P, _I64, _P]

    @property
    def tiles(self) -> bool:
        """The AMX kernel runs here: cpuid amx_bf16, compiled in, and Linux granted the tiles."""
        return self._amx is not None

    def fits_tiles(self, k: int) -> bool:
        """Whether a weight with k input features can be multiplied on the tiles: gemm_amx.c
        steps through k a whole tile (32) at a time. Pure Python: it guards every call."""
        return self._amx is not None and k > 0 and k % 32 == 0

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        assert w.dtype == torch.bfloat16 and w.dim() == 2
        w = w.contiguous()
        N, K = w.shape
        packed = torch.empty(-(-N // 16) * -(-K // 2) * 32, dtype=torch.bfloat16)
        self._pack(w.data_ptr(), N, K, packed.data_ptr())
        return packed

    def pack_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """`gate_up` [2I, K] (gate rows first) packed for `swiglu`, its 16-row blocks
        interleaved (gate block j, up block j); None where the tiles cannot run it."""
        two_i, k = gate_up.shape
        if not self.fits_tiles(k) or two_i % 32:
            return None
        inter = two_i // 2
        order = torch.arange(two_i).view(2, inter // 16, 16).transpose(0, 1).reshape(-1)
        return self.pack(gate_up[order])

    def swiglu(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
        """silu(x . gate^T) * (x . up^T) -> [M, inter] bfloat16, on the tiles, from
        `pack_swiglu`'s weight: the float32 sums are never rounded before the product."""
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and self.fits_tiles(x.shape[1])
        x = x.contiguous()
        M, K = x.shape
        assert packed.numel() == 2 * inter * K, "x does not match the packed weight"
        out = torch.empty(M, inter, dtype=torch.bfloat16)
        self._swiglu(x.data_ptr(), M, K, packed.data_ptr(), 2 * inter, out.data_ptr())
        return out

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias32: torch.Tensor | None,
                 out_dtype: torch.dtype = torch.bfloat16, tiles: bool = False) -> torch.Tensor:
        """out_dtype float32 returns the float32 sums, never rounded to bfloat16."""
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and out_dtype in (torch.bfloat16, torch.float32)
        x = x.contiguous()
        M, K = x.shape
        assert packed.numel() == -(-n // 16) * -(-K // 2) * 32, "x does not match the packed weight"
        assert not tiles or self.fits_tiles(K), "this matmul cannot run on the tiles"
        out = torch.empty(M, n, dtype=out_dtype)
        bias = None if bias32 is None else bias32.data_ptr()
        (self._amx if tiles else self._mm)(x.data_ptr(), M, K, packed.data_ptr(), n, bias, out.data_ptr(),
                                           int(out_dtype == torch.float32))
        return out


class Elementwise:
    """Fused residual-add + RMSNorm, SiLU-and-multiply and RoPE, in place of 4-8 torch ops
    (and their bf16<->float32 copies) each; row-wise argmax and top-k over float32 logits
    (torch's take ~1.2 ms for 32 x 49152 here, these ~0.1-0.3 ms)."""

    MAX_TOPK = 64
    MAX_ROPE_DIM = 256

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = {torch.bfloat16: lib.add_rms_norm_bf16, torch.float32: lib.add_rms_norm_f32}
        self._silu = {torch.bfloat16: lib.silu_mul_bf16, torch.float32: lib.silu_mul_f32}
        for fn in self._norm.values():
            fn.restype, fn.argtypes = None, [_P, _P, _P, _P, _I64, _I64, _F32]
        for fn in self._silu.values():
            fn.restype, fn.argtypes = None, [_P, _P, _I64, _I64]
        # (x dtype, KV pool dtype) -> RoPE that also stores the keys and values
        self._rope = {(torch.bfloat16, torch.bfloat16): lib.rope_bf16, (torch.float32, torch.float32): lib.rope_f32,
                      (torch.float32, torch.bfloat16): lib.rope_f32_kv_bf16}
        for fn in self._rope.values():
            fn.restype, fn.argtypes = None, [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64]
        self._argmax, self._topk = lib.argmax_rows_f32, lib.topk_rows_f32
        self._argmax.restype, self._argmax.argtypes = None, [_P, _I64, _I64, _P]
        self._topk.restype, self._topk.argtypes = None, [_P, _I64, _I64, _I64, _P]

    def stores(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether `rope_` rotates x of `dtype` and stores into a pool of `kv_dtype`."""
        return (dtype, kv_dtype) in self._rope

    def rope_(self, x: torch.Tensor, heads: int, table: torch.Tensor, positions: torch.Tensor,
              store: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None) -> None:
        """Rotate the first `heads` heads of x [T, H, D] (bfloat16 or float32, rows contiguous) in place
        by the float32 cos/sin table [max_positions, 2, D] at `positions` [T] (int64).
        `store` = (slots [N, D] in a dtype `stores` pairs with x's, slot_ids [T * hkv] int64,
        hkv, k_base, v_off) also copies the keys (the last hkv rotated heads) to
        slots[slot_ids + k_base] and the values (the hkv heads after them) to
        slots[slot_ids + k_base + v_off], rounded to bfloat16 for a bfloat16 pool."""
        T, _, D = x.shape
        assert x.stride(2) == 1 and x.stride(1) == D and table.is_contiguous()
        assert D <= self.MAX_ROPE_DIM and D % 2 == 0
        positions = positions.contiguous()
        slots, slot_ids, hkv, k_base, v_off = store if store is not None else (None, None, 0, 0, 0)
        kv_dtype = x.dtype if slots is None else slots.dtype
        assert self.stores(x.dtype, kv_dtype)
        if slots is not None:
            assert slots.is_contiguous() and slot_ids.is_contiguous()
            assert x.shape[1] >= heads + hkv and slot_ids.numel() == T * hkv
        self._rope[x.dtype, kv_dtype](x.data_ptr(), table.data_ptr(), positions.data_ptr(), T, x.stride(0), heads, D,
                   None if slots is None else slots.data_ptr(), None if slot_ids is None else slot_ids.data_ptr(),
                   hkv, k_base, v_off)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, -1) for float32 [B, N] without NaN."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def topk_indices(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices [B, k] of each row's k largest values (float32 [B, N], k <= MAX_TOPK)."""
        x = x.contiguous()
        k = min(k, x.shape[1])
        if k > self.MAX_TOPK:
            raise ValueError(f"top-k of at most {self.MAX_TOPK}")
        out = torch.empty(x.shape[0], k, dtype=torch.int64)
        self._topk(x.data_ptr(), x.shape[0], x.shape[1], k, out.data_ptr())
        return out

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._norm

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h += delta (in place, when given); returns rmsnorm(h) * weight. h contiguous [T, dim]."""
        out = torch.empty_like(h)
        if delta is not None:
            delta = delta.contiguous()
        self._norm[h.dtype](h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), h.shape[0], h.shape[1], eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, inter)
        self._silu[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, inter)
        return out


@lru_cache(maxsize=1)
def amx_bf16() -> bool:
    """The CPU has AMX tiles for bfloat16 (cpuid amx_bf16: Sapphire Rapids and later), on
    which oneDNN's matmuls and torch's flash attention run bfloat16."""
    return "amx_bf16" in cpu_features()


@per_isa
def paged_decode() -> PagedDecode | None:
    lib = native_library()
    return PagedDecode(lib) if lib is not None else None


@per_isa
def paged_prefill() -> PagedPrefill | None:
    lib = native_library()
    return PagedPrefill(lib) if lib is not None and lib.paged_prefill_available() else None


@per_isa
def paged_prefill_tiles() -> PagedPrefillTiles | None:
    """The AMX prefill attention, where the CPU has the tiles and Linux grants them."""
    lib = native_library()
    return (PagedPrefillTiles(lib) if lib is not None and amx_bf16() and lib.paged_prefill_amx_available()
            else None)


@per_isa
def gemm() -> Gemm | None:
    lib = native_library()
    return Gemm(lib) if lib is not None and lib.gemm_bf16_available() else None


@per_isa
def elementwise() -> Elementwise | None:
    lib = native_library()
    return Elementwise(lib) if lib is not None else None
