/* The float32 decode-attention work item for the AVX-512F and AVX2 builds (vec.h), for
 * float32 pools and for bfloat16 pools on CPUs without AVX-512 BF16 (widened on load).
 * paged_attention.c holds the pool layout and the entry point. One item is one
 * (sequence, kv head) and its G query heads; each key and value row is read from the pool
 * in place, G times from L1/L2, once from DRAM.
 *   scores: V keys at a time, one accumulator a key (DIM / V FMAs each), reduced to one
 *           vector of V scores (dec_reduce), stored contiguous;
 *   values: per query head, DIM / V accumulators, one broadcast probability a key.
 * The pool is larger than the caches, so the item is bound by DRAM: while it scores a
 * block it prefetches that block's values and the keys two blocks on (a page's rows are
 * contiguous, its neighbour is anywhere). Scores, softmax and sums are float32.
 */
#ifndef KVRELAY_PAGED_ATTENTION_F32_H
#define KVRELAY_PAGED_ATTENTION_F32_H
#include <math.h>
#include <stdint.h>

#include "vec.h"

/* s[0..n) <- softmax(s[0..n)), in float32 (every decode item's). */
static inline void dec_softmax(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < n; ++t) { s[t] = expf(s[t] - m); sum += s[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

#ifdef KVRELAY_VEC

/* One vector whose lane j is the sum of a[j]'s lanes. */
static inline vf dec_reduce(const vf *a) {
#if V == 8
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [a0..a3 low halves' sums | a0..a3 high halves' sums], u1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    float s[V];
    for (int j = 0; j < V; ++j) s[j] = vsum(a[j]);
    return VLOADF(s);
#endif
}

static inline void dec_prefetch_row(const void *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T1);
}

/* Floats of score scratch one item of n keys needs. */
static inline int64_t dec_scratch_floats(int64_t G, int64_t n) { return G * ((n + V - 1) / V * V); }

/* Item for sequence keys [0, n) of kv head h; LOADV loads V elements of the pool's T as
 * float32; q and out hold TQ (LOADQ, STOREQ). */
#define DEFINE_DEC_ITEM(NAME, T, LOADV, TQ, LOADQ, STOREQ, DIM)                                   \
static void NAME(const T *pool, const int64_t *pages, int64_t n, const TQ *q, TQ *out,            \
                 int64_t layer, int64_t L, int64_t H, int64_t h, int64_t G, int64_t S,            \
                 float scale, float *scores) {                                                    \
    enum { C = DIM / V };                                                                         \
    float qf[MAX_GROUP * DIM];                                                                    \
    const int64_t head_stride = S * DIM, page_stride = L * 2 * H * head_stride;                   \
    const int64_t k_off = (layer * 2 * H + h) * head_stride, v_off = k_off + H * head_stride;     \
    const int64_t npad = (n + V - 1) / V * V, row_bytes = DIM * (int64_t)sizeof(T);                \
    for (int64_t i = 0; i < G * DIM; ++i) qf[i] = LOADQ(q + i) * scale;                           \
    for (int64_t t0 = 0; t0 < n; t0 += V) {                                                       \
        const T *krow[V];                                                                         \
        for (int j = 0; j < V; ++j) {                                                             \
            const int64_t t = t0 + j < n ? t0 + j : t0;   /* past n: a copy, never read back */   \
            krow[j] = pool + pages[t / S] * page_stride + k_off + (t % S) * DIM;                  \
            if (t0 + j < n) dec_prefetch_row(krow[j] + (v_off - k_off), row_bytes);                \
            const int64_t ahead = t0 + 2 * V + j;                                                 \
            if (ahead < n)                                                                        \
                dec_prefetch_row(pool + pages[ahead / S] * page_stride + k_off + (ahead % S) * DIM, \
                                 row_bytes);                                                      \
        }                                                                                         \
        for (int64_t g = 0; g < G; ++g) {                                                         \
            vf acc[V];                                                                            \
            _Pragma("GCC unroll 16") for (int j = 0; j < V; ++j) acc[j] = VZERO();                \
            _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) {                                \
                const vf qv = VLOADF(qf + g * DIM + c * V);                                       \
                _Pragma("GCC unroll 16") for (int j = 0; j < V; ++j)                              \
                    acc[j] = VFMA(qv, LOADV(krow[j] + c * V), acc[j]);                            \
            }                                                                                     \
            VSTOREF(scores + g * npad + t0, dec_reduce(acc));                                     \
        }                                                                                         \
    }                                                                                             \
    for (int64_t g = 0; g < G; ++g) {                                                             \
        float *sg = scores + g * npad;                                                            \
        dec_softmax(sg, n);                                                                       \
        vf acc[C];                                                                                \
        _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[c] = VZERO();                    \
        for (int64_t t = 0, i = 0; t < n; ++i) {                                                  \
            const T *vpage = pool + pages[i] * page_stride + v_off;                               \
            for (int64_t j = 0; j < S && t < n; ++j, ++t) {                                       \
                const vf p = VSET1(sg[t]);                                                        \
                _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c)                              \
                    acc[c] = VFMA(p, LOADV(vpage + j * DIM + c * V), acc[c]);                     \
            }                                                                                     \
        }                                                                                         \
        float o[DIM];                                                                             \
        _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) VSTOREF(o + c * V, acc[c]);          \
        for (int64_t d = 0; d < DIM; ++d) out[g * DIM + d] = STOREQ(o[d]);                        \
    }                                                                                             \
}

#endif
#endif
