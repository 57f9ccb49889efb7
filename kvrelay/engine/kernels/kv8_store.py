"""The K/V store of an 8-bit KV pool (kv8_store.c): quantizes each key and value vector and
writes it and its scale into the page bytes in place, where the torch path takes ~15 ops
a layer. `kv8_store()` is None when no variant runs (--kernels torch, KVRELAY_NATIVE=0),
and `QuantizedKVPool.write` quantizes with torch instead."""
from __future__ import annotations

import ctypes

import torch

from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.kernels.variants import native_library, per_isa

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class KV8Store:
    """`__call__` quantizes and stores one layer's new keys and values (bfloat16 or float32)
    into an 8-bit pool; scalar C, vectorized by the compiler, rows over torch's OpenMP
    threads for a prefill pass."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.bfloat16: lib.kv8_store_bf16, torch.float32: lib.kv8_store_f32}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(self, pool: torch.Tensor, layout: KVLayout, layer: int, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, held: bool = False) -> torch.Tensor | None:
        """Store k, v [T, H, D] (one dtype `supports`) at token slots slots[:, t] = (page,
        offset) ([2, T] integers: `QuantizedKVPool.slot_ids`) of `layer`, quantized as
        `kv_pool.quantize(x, layout.kv_dtype)` gives them, bit for bit (values finite): the
        8-bit values and the float32 scale of every (token, K|V, head) vector. `pool` is
        the whole pool's bytes (uint8, CPU, contiguous, whole pages of `layout`); no other
        byte of it is written. Rows of k and v may be strided (views of one qkv tensor); a
        slot outside the pool raises IndexError and writes nothing. `held`: also return
        what the pool now holds, [T, 2, H, D] in k's dtype, as `kv_pool.dequantize` gives it."""
        T, H, D = k.shape
        assert layout.quantized and H == layout.num_kv_heads and D == layout.head_dim and v.shape == k.shape
        assert k.dtype == v.dtype and 0 <= layer < layout.num_layers
        assert pool.dtype == torch.uint8 and pool.is_contiguous() and pool.device.type == "cpu"
        if k.stride(2) != 1 or k.stride(1) != D:
            k = k.contiguous()
        if v.stride(2) != 1 or v.stride(1) != D:
            v = v.contiguous()
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        assert slots.shape == (2, T)
        page_bytes, pages = layout.page_bytes, slots.data_ptr()
        out = torch.empty(T, 2, H, D, dtype=k.dtype) if held else None
        rc = self._fns[k.dtype](k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), T, H, D, pool.data_ptr(),
                                pool.numel() // page_bytes, page_bytes, layout.scales_offset, pages, pages + 8 * T,
                                layer, layout.page_size, int(layout.kv_dtype == "fp8_e4m3"),
                                None if out is None else out.data_ptr())
        if rc != 0:
            raise IndexError(f"a K/V slot outside the pool's {pool.numel() // page_bytes} pages "
                             f"of {layout.page_size} slots")
        return out


@per_isa
def kv8_store() -> KV8Store | None:
    lib = native_library()
    return KV8Store(lib) if lib is not None else None
