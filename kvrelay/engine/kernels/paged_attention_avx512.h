/* The bfloat16 decode-attention work item for CPUs with AVX-512 BF16 (see
 * paged_attention.c for the pool layout and the work split).
 *   scores: 16 keys at a time; per query head, vdpbf16ps gives 16 partial-sum vectors
 *           (bf16 products are exact in float32), one shuffle tree turns them into the
 *           16 scores. No per-key horizontal sum.
 *   values: each 32-value bf16 row splits into its even and odd elements as float32 (a
 *           shift and a mask); up to FAST_GB query heads accumulate in registers.
 * Keys are addressed through a per-item row-pointer array, so the page size is a runtime
 * value with no division per key. Defines KVRELAY_FAST_DECODE when compiled in.
 */
#ifndef KVRELAY_PAGED_ATTENTION_AVX512_H
#define KVRELAY_PAGED_ATTENTION_AVX512_H

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define KVRELAY_FAST_DECODE 1

/* Lane j of the result is the sum of v[j]'s 16 lanes. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 s[8], u[4];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k)  /* lane group L: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {  /* lane group L: the four keys' partial sums over L */
        const __m512d a = _mm512_castps_pd(s[2 * k]), b = _mm512_castps_pd(s[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* s[t] <- exp(s[t] - max s) for t < n; returns their sum (softmax before the division). */
static inline float exp_shifted(float *s, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
    for (int64_t t = 0; t < n; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
    return sum;
}

/* scores[t0 + j] = q . key[j] * scale for the `cnt` (<= 16) keys at rows[0..cnt). */
static inline __attribute__((always_inline)) void score16(const uint16_t *const *rows, int cnt, const __m512bh *q,
                                                          int dv, float scale, float *scores) {
    __m512 part[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
        const uint16_t *k = rows[j < cnt ? j : 0];
        __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < dv; ++c)
            a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * c)));
        part[j] = a;
    }
    const __m512 r = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << cnt) - 1u), r);
}

/* acc (even, odd halves of GB heads x dv chunks) += p[g][t] * value row t, for all t. */
#define FAST_GB 4
static inline __attribute__((always_inline)) void values_block(const uint16_t *const *vrows, int64_t n,
                                                               const float *p, int64_t pstride, int gb,
                                                               int dv, float *out, const uint16_t *const *ahead,
                                                               int64_t ahead_n, int dim) {
    __m512 ev[FAST_GB * 4], od[FAST_GB * 4];
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int i = 0; i < gb * dv; ++i) ev[i] = od[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
        const uint16_t *v = vrows[t];
        if (t < ahead_n)
            for (int c = 0; c < dim * 2; c += 64) {
                _mm_prefetch((const char *)ahead[t] + c, _MM_HINT_T1);
                _mm_prefetch((const char *)ahead[ahead_n + t] + c, _MM_HINT_T1);
            }
#pragma GCC unroll 4
        for (int c = 0; c < dv; ++c) {
            const __m512i x = _mm512_loadu_si512((const void *)(v + 32 * c));
            const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
#pragma GCC unroll 4
            for (int g = 0; g < gb; ++g) {
                const __m512 w = _mm512_set1_ps(p[g * pstride + t]);
                ev[g * dv + c] = _mm512_fmadd_ps(w, e, ev[g * dv + c]);
                od[g * dv + c] = _mm512_fmadd_ps(w, o, od[g * dv + c]);
            }
        }
    }
    for (int g = 0; g < gb; ++g)
        for (int c = 0; c < dv; ++c) {
            float e[16], o[16];
            _mm512_storeu_ps(e, ev[g * dv + c]);
            _mm512_storeu_ps(o, od[g * dv + c]);
            for (int i = 0; i < 16; ++i) {
                out[g * dv * 32 + c * 32 + 2 * i] = e[i];
                out[g * dv * 32 + c * 32 + 2 * i + 1] = o[i];
            }
        }
}

/* Keys are scattered a page (S rows) at a time, which the hardware prefetcher does not
 * follow: the first query head's pass asks for the keys PREFETCH_AHEAD rows on, and for
 * the values of this block (read again by the value pass, so L2 is enough). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 32
#endif
static inline __attribute__((always_inline)) void prefetch_rows(const uint16_t *const *krows,
                                                                const uint16_t *const *vrows, int64_t t,
                                                                int64_t n, int dim) {
    const int64_t end = t + 16 < n ? t + 16 : n;
    for (int64_t j = t; j < end; ++j) {
        for (int c = 0; c < dim * 2; c += 64) {
            if (j + PREFETCH_AHEAD < n) _mm_prefetch((const char *)krows[j + PREFETCH_AHEAD] + c, _MM_HINT_T0);
            _mm_prefetch((const char *)vrows[j] + c, _MM_HINT_T1);
        }
    }
}

/* Floats per query head's scores: n plus a block, a whole number of 64-byte lines, so
 * the row pointers after G of them stay aligned. */
static inline int64_t score_stride(int64_t n) { return (n + 31) / 16 * 16; }

/* One (sequence, kv head) item; `scratch` holds G * score_stride(n) floats, then 2n row
 * pointers, then 2 next_n for the next item (next_pages NULL: none), which the value pass
 * prefetches. */
static inline __attribute__((always_inline)) void fast_item(const uint16_t *pool, const int64_t *pages, int64_t n,
                                                            const uint16_t *q, uint16_t *out, int64_t layer,
                                                            int64_t L, int64_t H, int64_t h, int64_t G, int64_t S,
                                                            int dim, float scale, float *scratch,
                                                            const int64_t *next_pages, int64_t next_n, int64_t next_h) {
    const int dv = dim / 32;
    const int64_t head_stride = S * dim, page_stride = L * 2 * H * head_stride, pstride = score_stride(n);
    float *scores = scratch;
    const uint16_t **krows = (const uint16_t **)(scratch + G * pstride), **vrows = krows + n;
    for (int64_t t = 0, i = 0; t < n; ++i) {
        const uint16_t *k = pool + pages[i] * page_stride + (layer * 2 * H + h) * head_stride;
        for (int64_t j = 0; j < S && t < n; ++j, ++t) {
            krows[t] = k + j * dim;
            vrows[t] = k + H * head_stride + j * dim;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        __m512bh qg[4];
        for (int c = 0; c < dv; ++c) qg[c] = (__m512bh)_mm512_loadu_si512((const void *)(q + g * dim + 32 * c));
        float *sg = scores + g * pstride;
        for (int64_t t = 0; t < n; t += 16) {
            if (g == 0) prefetch_rows(krows, vrows, t, n, dim);
            score16(krows + t, n - t < 16 ? (int)(n - t) : 16, qg, dv, scale, sg + t);
        }
        const float inv = 1.f / exp_shifted(sg, n);
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
    }
    /* The next item's rows, pulled into L2 during the value pass (which reads from cache):
     * its first scoring pass then finds them there. */
    const uint16_t **ahead = vrows + n;
    int64_t ahead_n = 0;
    if (next_pages != 0)
        for (int64_t i = 0; ahead_n < next_n; ++i) {
            const uint16_t *k = pool + next_pages[i] * page_stride + (layer * 2 * H + next_h) * head_stride;
            for (int64_t j = 0; j < S && ahead_n < next_n; ++j, ++ahead_n) {
                ahead[ahead_n] = k + j * dim;
                ahead[next_n + ahead_n] = k + H * head_stride + j * dim;
            }
        }
    float acc[FAST_GB * 128];
    const int gmax = dim == 64 ? FAST_GB : FAST_GB / 2;  /* 16 accumulator registers at most */
    for (int64_t g0 = 0; g0 < G; g0 += gmax) {
        const int gb = G - g0 < gmax ? (int)(G - g0) : gmax;
        const float *p = scores + g0 * pstride;
        if (dim == 64) {
            switch (gb) {
            case 1: values_block(vrows, n, p, pstride, 1, 2, acc, ahead, g0 == 0 ? ahead_n : 0, dim); break;
            case 2: values_block(vrows, n, p, pstride, 2, 2, acc, ahead, g0 == 0 ? ahead_n : 0, dim); break;
            case 3: values_block(vrows, n, p, pstride, 3, 2, acc, ahead, g0 == 0 ? ahead_n : 0, dim); break;
            default: values_block(vrows, n, p, pstride, 4, 2, acc, ahead, g0 == 0 ? ahead_n : 0, dim); break;
            }
        } else {
            switch (gb) {
            case 1: values_block(vrows, n, p, pstride, 1, 4, acc, ahead, g0 == 0 ? ahead_n : 0, dim); break;
            default: values_block(vrows, n, p, pstride, 2, 4, acc, ahead, g0 == 0 ? ahead_n : 0, dim); break;
            }
        }
        for (int64_t i = 0; i < gb * dim; ++i) out[g0 * dim + i] = bf16_round(acc[i]);
    }
}

/* Scratch floats one thread needs for items of up to `longest` keys. */
static inline int64_t fast_scratch_floats(int64_t G, int64_t longest) {
    return G * score_stride(longest) + 4 * longest * (int64_t)(sizeof(void *) / sizeof(float));
}

#endif
#endif
