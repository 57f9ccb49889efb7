/* The float32 prefill-attention work item for the AVX-512F and AVX2 builds (vec.h), for
 * float32 pools and for bfloat16 pools on CPUs without AVX-512 BF16 (widened on the copy
 * in). paged_attention.c holds the pool layout and the entry points. One item is one
 * (sequence, kv head) over a chunk of query rows (a run of them: prefill_plan.h); its keys
 * and values are copied from the pool once, as float32:
 *   kt: keys transposed, kt[dim][key] (npad keys a row, zero past n), so a block of
 *       scores is a register-blocked product q rows x kt with no horizontal sums;
 *   vv: values as they are, vv[key][dim].
 * Both passes are one microkernel, c[r][:] = sum_k a[r][k] * b[k][:], over PF_MR query
 * rows of one query head at a time: scores = q . kt, then out = p . vv. Query row i of
 * the item's q_len sees keys [0, n - q_len + i]; the keys a row may not see get
 * probability 0. Scores, softmax and sums are float32.
 */
#ifndef KVRELAY_PREFILL_ATTENTION_F32_H
#define KVRELAY_PREFILL_ATTENTION_F32_H
#include "vec.h"
#ifdef KVRELAY_VEC
#include <math.h>
#include <stdint.h>

#define PF_MR 6
#if V == 16
#define PF_NV 4  /* 24 accumulators of 32 registers */
#else
#define PF_NV 2  /* 12 accumulators of 16 registers (two FMA pipes of latency 5 need 10) */
#endif
#define PF_KEY_PAD (PF_NV * V)

/* c[r][j * V ..] (+)= sum over k < kn of a[r * lda + k] * b[k * ldb + j * V ..] for r < mr,
 * j < nv; `scale` multiplies the sums. */
static inline __attribute__((always_inline)) void pf_kernel(const float *a, int64_t lda, const float *b,
                                                            int64_t ldb, int64_t kn, float scale, float *c,
                                                            int64_t ldc, int mr, int nv) {
    vf acc[PF_MR * 4];  /* pf_matmul instantiates up to 4 vectors a row */
#pragma GCC unroll 24
    for (int i = 0; i < mr * nv; ++i) acc[i] = VZERO();
    for (int64_t k = 0; k < kn; ++k) {
        vf w[4];
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) w[j] = VLOADF(b + k * ldb + j * V);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const vf x = VSET1(a[r * lda + k]);
#pragma GCC unroll 4
            for (int j = 0; j < nv; ++j) acc[r * nv + j] = VFMA(x, w[j], acc[r * nv + j]);
        }
    }
    const vf sc = VSET1(scale);
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) VSTOREF(c + r * ldc + j * V, VMUL(acc[r * nv + j], sc));
}

/* c [mr][ncols] = scale * a [mr][kn] . b [kn][ncols]; ncols a multiple of V. */
static void pf_matmul(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t kn, float scale,
                      float *c, int64_t ldc, int mr, int64_t ncols) {
    for (int64_t c0 = 0; c0 < ncols; c0 += PF_NV * V) {
        const int nv = ncols - c0 >= PF_NV * V ? PF_NV : (int)((ncols - c0) / V);
        switch (mr * 8 + nv) {
#define PF_CASE(MR, NV) case MR * 8 + NV: pf_kernel(a, lda, b + c0, ldb, kn, scale, c + c0, ldc, MR, NV); break;
#define PF_ROWS(MR) PF_CASE(MR, 1) PF_CASE(MR, 2) PF_CASE(MR, 3) PF_CASE(MR, 4)
        PF_ROWS(1) PF_ROWS(2) PF_ROWS(3) PF_ROWS(4) PF_ROWS(5) PF_ROWS(6)
#undef PF_ROWS
#undef PF_CASE
        default: break;
        }
    }
}

/* Row r of s [mr][ld] holds scores for keys [0, m0 + r + 1); they become the softmax's
 * numerators exp(score - max) and the rest (up to width) 0; inv[r] gets 1 / their sum (the
 * value sum is divided once, not every probability). Two passes a row: max, then exp and
 * sum, on vectors (vexp), the tail past the last whole vector in scalar code. */
static void pf_softmax_rows(float *s, int64_t ld, int mr, int64_t m0, int64_t width, float *inv) {
    for (int r = 0; r < mr; ++r) {
        float *row = s + r * ld;
        const int64_t m = m0 + r + 1, whole = m / V * V;
        vf vmx = VSET1(-INFINITY);
        for (int64_t t = 0; t < whole; t += V) vmx = VMAX(vmx, VLOADF(row + t));
        float mx = vmaxall(vmx);
        for (int64_t t = whole; t < m; ++t) mx = row[t] > mx ? row[t] : mx;
        const vf vm = VSET1(mx);
        vf vs = VZERO();
        for (int64_t t = 0; t < whole; t += V) {
            const vf e = vexp(VADD(VLOADF(row + t), VMUL(vm, VSET1(-1.f))));
            VSTOREF(row + t, e);
            vs = VADD(vs, e);
        }
        float sum = vsum(vs);
        for (int64_t t = whole; t < m; ++t) { row[t] = expf(row[t] - mx); sum += row[t]; }
        inv[r] = 1.f / sum;
        for (int64_t t = m; t < width; ++t) row[t] = 0.f;
    }
}

/* Floats of scratch one thread needs for items of up to `longest` keys. */
static inline int64_t pf_scratch_floats(int64_t longest, int64_t dim) {
    const int64_t npad = (longest + PF_KEY_PAD - 1) / PF_KEY_PAD * PF_KEY_PAD;
    return 2 * npad * dim + PF_MR * npad + PF_MR * dim + PF_MR * dim;
}

/* One (sequence, kv head) item: the pool holds T (LOAD), q and out TQ (LOADQ, STOREQ). */
#define DEFINE_PF_ITEM(NAME, T, LOAD, TQ, LOADQ, STOREQ)                                         \
static void NAME(const T *pool, const int64_t *pages, int64_t n, int64_t q_len, const TQ *q,     \
                 int64_t q_stride, TQ *out, int64_t out_stride, int64_t layer, int64_t L, int64_t H, \
                 int64_t h, int64_t G, int64_t S, int64_t dim, float scale, float *scratch) {       \
    const int64_t npad = (n + PF_KEY_PAD - 1) / PF_KEY_PAD * PF_KEY_PAD;                         \
    const int64_t head_stride = S * dim, page_stride = L * 2 * H * head_stride;                  \
    float *kt = scratch, *vv = kt + npad * dim, *s = vv + npad * dim;                           \
    float *qf = s + PF_MR * npad, *of = qf + PF_MR * dim;                                        \
    for (int64_t t = 0, i = 0; t < n; ++i) {                                                     \
        const T *kpage = pool + pages[i] * page_stride + (layer * 2 * H + h) * head_stride;     \
        for (int64_t j = 0; j < S && t < n; ++j, ++t) {                                          \
            const T *k = kpage + j * dim, *v = kpage + H * head_stride + j * dim;                \
            for (int64_t d = 0; d < dim; ++d) {                                                  \
                kt[d * npad + t] = LOAD(k + d);                                                  \
                vv[t * dim + d] = LOAD(v + d);                                                   \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int64_t d = 0; d < dim; ++d)                                                            \
        for (int64_t t = n; t < npad; ++t) kt[d * npad + t] = 0.f;                               \
    for (int64_t t = n; t < npad; ++t)                                                           \
        for (int64_t d = 0; d < dim; ++d) vv[t * dim + d] = 0.f;                                 \
    for (int64_t g = 0; g < G; ++g)                                                              \
        for (int64_t i0 = 0; i0 < q_len; i0 += PF_MR) {                                          \
            const int mr = q_len - i0 < PF_MR ? (int)(q_len - i0) : PF_MR;                       \
            const int64_t m0 = n - q_len + i0;          /* row r sees keys [0, m0 + r] */        \
            const int64_t width = (m0 + mr + V - 1) / V * V;                                     \
            for (int r = 0; r < mr; ++r)                                                         \
                for (int64_t d = 0; d < dim; ++d)                                                \
                    qf[r * dim + d] = LOADQ(q + (i0 + r) * q_stride + (h * G + g) * dim + d);      \
            pf_matmul(qf, dim, kt, npad, dim, scale, s, npad, mr, width);                        \
            float inv[PF_MR];                                                                    \
            pf_softmax_rows(s, npad, mr, m0, width, inv);                                        \
            pf_matmul(s, npad, vv, dim, m0 + mr, 1.f, of, dim, mr, dim);                         \
            for (int r = 0; r < mr; ++r)                                                         \
                for (int64_t d = 0; d < dim; ++d)                                                \
                    out[(i0 + r) * out_stride + (h * G + g) * dim + d] = STOREQ(of[r * dim + d] * inv[r]); \
        }                                                                                        \
}

#endif
#endif
