"""Triton kernels of the `cuda` attention backend, over the page-major pool
[pages, layers, 2, kv heads, page_size, D] (`core.kvlayout`). Imported only by `cuda.py`,
when that backend is built. Under TRITON_INTERPRET=1 they run on CPU tensors (the tests).

Both read keys and values in place from the pages of `page_table`, with an online softmax
in float32. UPCAST (float32 pools, and the interpreter, whose dot does not take bfloat16)
multiplies in float32 at full precision; otherwise the dots take the pool's 16-bit values.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def paged_decode_kernel(q_ptr, out_ptr, pool_ptr, page_table_ptr, kv_lens_ptr,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_pt,
                        s_page, s_kv, s_head, s_slot, layer_off, scale,
                        GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One query per sequence: program (b, h) computes query head h of sequence b over
    its kv_lens[b] keys."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + b)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + b * stride_qt + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
    head = layer_off + (h // GROUP) * s_head
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < kv_len
        page = tl.load(page_table_ptr + b * stride_pt + j // PAGE, mask=jm, other=0)
        at = page * s_page + head + (j % PAGE) * s_slot
        lm = jm[:, None] & dm[None, :]
        k = tl.load(pool_ptr + at[:, None] + d[None, :], mask=lm, other=0.0).to(tl.float32)
        s = tl.where(jm, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(pool_ptr + s_kv + at[:, None] + d[None, :], mask=lm, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def paged_prefill_kernel(q_ptr, out_ptr, pool_ptr, page_table_ptr, kv_lens_ptr, q_lens_ptr, q_rows_ptr,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_pt,
                         s_page, s_kv, s_head, s_slot, layer_off, scale,
                         GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Any number of queries per sequence (varlen, causal, after a cached prefix): program
    (b, h, mb) computes query head h of queries mb * BLOCK_M .. of sequence b, rows
    q_rows[b].. of q, the last q_lens[b] of its kv_lens[b] positions."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    mb = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + b)
    kv_len = tl.load(kv_lens_ptr + b)
    row0 = tl.load(q_rows_ptr + b)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < q_len
    q_pos = kv_len - q_len + m                       # a padded row (m >= q_len) sees every key
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    rows = row0 + m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mm[:, None] & dm[None, :], other=0.0)
    head = layer_off + (h // GROUP) * s_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(kv_len, kv_len - q_len + (mb + 1) * BLOCK_M)   # causal: no key past the last row
    for start in range(0, end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < kv_len
        page = tl.load(page_table_ptr + b * stride_pt + j // PAGE, mask=jm, other=0)
        at = page * s_page + head + (j % PAGE) * s_slot
        kt = tl.load(pool_ptr + at[None, :] + d[:, None], mask=jm[None, :] & dm[:, None], other=0.0)
        s = _dot(q, kt, UPCAST) * scale                                  # [BLOCK_M, BLOCK_N]
        # Key 0 is visible to every row, so after the first block no row's maximum is -inf.
        s = tl.where((j[None, :] <= q_pos[:, None]) & jm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(pool_ptr + s_kv + at[:, None] + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & dm[None, :])
