/* The bfloat16 prefill-attention work item for CPUs with AVX-512 BF16 (paged_attention.c
 * holds the pool layout and the entry point). One item is one (sequence, kv head) over a
 * chunk of query rows (a run of them: prefill_plan.h); its keys and values are read from
 * the pool once and re-laid out for vdpbf16ps:
 *   kt: keys transposed per 16-key block, kt[block][dim pair][key] (one 32-bit pair of
 *       dims per lane), so 16 scores come from D/2 dot-product steps with no reduction;
 *   vp: values interleaved per key pair, vp[key pair][dim][key % 2], so each step adds
 *       two keys' contributions; each probability goes in as two bfloat16 parts (hi + lo),
 *       which keeps it to about 16 bits.
 * The G query heads of the kv head score together, three a pass.
 * Query row i of the item's q_len sees keys [0, n - q_len + i]. Scores and softmax are
 * float32. Needs the helpers of paged_attention_avx512.h.
 */
#ifndef KVRELAY_PREFILL_ATTENTION_AVX512_H
#define KVRELAY_PREFILL_ATTENTION_AVX512_H
#include "exp2_avx512.h"
#ifdef KVRELAY_FAST_DECODE

/* Scores of gh (<= 3) query heads against r (<= 8) 16-key blocks of kt starting at block
 * b, times scale, into s (head g's at s + g * sstride): gh * r independent accumulators
 * (vdpbf16ps has a latency of several cycles), and each key vector loaded once for all gh
 * heads, which share the kv head's keys (one head at a time, the loads outnumbered the dot
 * products). qp: the heads' query pairs, head g's at qp + g * pairs. */
static inline __attribute__((always_inline)) void kt_group(const uint32_t *kt, int64_t b, int r, const uint32_t *qp,
                                                           int gh, int pairs, float scale, float *s, int64_t sstride) {
    __m512 a[3 * 8];
#pragma GCC unroll 24
    for (int j = 0; j < 3 * 8; ++j) a[j] = _mm512_setzero_ps();
    const uint32_t *k = kt + b * pairs * 16;
    for (int p = 0; p < pairs; ++p) {
        __m512bh x[3];
#pragma GCC unroll 3
        for (int g = 0; g < 3; ++g)
            if (g < gh) x[g] = (__m512bh)_mm512_set1_epi32((int)qp[g * pairs + p]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
            if (j < r) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(k + (j * pairs + p) * 16));
#pragma GCC unroll 3
                for (int g = 0; g < 3; ++g)
                    if (g < gh) a[g * 8 + j] = _mm512_dpbf16_ps(a[g * 8 + j], x[g], kv);
            }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < gh; ++g)
        for (int j = 0; j < r; ++j) _mm512_storeu_ps(s + g * sstride + (b + j) * 16, _mm512_mul_ps(a[g * 8 + j], sc));
}

/* Scores of gh heads against `blocks` 16-key blocks of kt (kt_group), r and gh constant
 * in each call below, so that the compiler keeps every accumulator in a register. */
static inline __attribute__((always_inline)) void kt_scores_gh(const uint32_t *kt, int64_t blocks, const uint32_t *qp,
                                                               int gh, int pairs, float scale, float *s,
                                                               int64_t sstride) {
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) kt_group(kt, b, 8, qp, gh, pairs, scale, s, sstride);
    if (b < blocks) kt_group(kt, b, (int)(blocks - b), qp, gh, pairs, scale, s, sstride);
}

/* Scores of G query heads (q: head g at q + g * 2 * pairs) against `blocks` 16-key blocks
 * of kt, times scale, head g's into s + g * sstride, three heads a pass. */
static void kt_scores(const uint32_t *kt, int64_t blocks, const uint16_t *q, int64_t G, int pairs, float scale,
                      float *s, int64_t sstride) {
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const uint32_t *qp = (const uint32_t *)(q + g0 * 2 * pairs);
        float *sg = s + g0 * sstride;
        switch (G - g0 < 3 ? G - g0 : 3) {
        case 1: kt_scores_gh(kt, blocks, qp, 1, pairs, scale, sg, sstride); break;
        case 2: kt_scores_gh(kt, blocks, qp, 2, pairs, scale, sg, sstride); break;
        default: kt_scores_gh(kt, blocks, qp, 3, pairs, scale, sg, sstride); break;
        }
    }
}

/* The softmax numerators of s[0, m), e[t] = exp(s[t] - max), as bfloat16 pairs split in two
 * so that hi + lo carries each to about 16 bits: hi[t / 2] holds (e[t], e[t + 1]) rounded,
 * lo the rest. (bf16 probabilities alone flip the default model's near-tie first token.)
 * Entries from m to the next multiple of 16 are 0 (the pair past an odd m carries 0 for
 * the key nobody may see); s must be readable that far. Returns the sum of the e[t]: the
 * value sum divides by it once at its end, not every probability here. Two passes: the
 * maximum, then exp (exp2_avx512.h), sum and split. */
static inline float softmax_to_pairs(const float *s, int64_t m, uint16_t *hi, uint16_t *lo) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= m; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    if (t < m) vmax = _mm512_mask_max_ps(vmax, (__mmask16)((1u << (m - t)) - 1u), vmax, _mm512_loadu_ps(s + t));
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 top = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(vmax)), log2e);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t < m; t += 16) {
        const __mmask16 keep = m - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (m - t)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), log2e, top)));
        sum = _mm512_add_ps(sum, e);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
        const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_storeu_si256((__m256i *)(hi + t), h);
        _mm256_storeu_si256((__m256i *)(lo + t), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, back)));
    }
    return _mm512_reduce_add_ps(sum);
}

/* out[g][d] = inv[g] * sum over key pairs tp < npairs of (hi + lo)[g][tp] . vp[tp][d], for gb heads. */
static inline __attribute__((always_inline)) void vp_values(const uint32_t *vp, int64_t npairs, const uint16_t *hi,
                                                            const uint16_t *lo, int64_t pstride, const float *inv,
                                                            int gb, int dv16, uint16_t *out, int dim) {
    __m512 acc[4 * 8];
#pragma GCC unroll 16
    for (int i = 0; i < gb * dv16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t tp = 0; tp < npairs; ++tp) {
        const uint32_t *v = vp + tp * dim;
        __m512bh ph[4], pl[4];
#pragma GCC unroll 4
        for (int g = 0; g < gb; ++g) {
            uint32_t a, b;
            memcpy(&a, hi + g * pstride + 2 * tp, sizeof a);
            memcpy(&b, lo + g * pstride + 2 * tp, sizeof b);
            ph[g] = (__m512bh)_mm512_set1_epi32((int)a);
            pl[g] = (__m512bh)_mm512_set1_epi32((int)b);
        }
#pragma GCC unroll 8
        for (int c = 0; c < dv16; ++c) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512((const void *)(v + 16 * c));
#pragma GCC unroll 4
            for (int g = 0; g < gb; ++g)
                acc[g * dv16 + c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g * dv16 + c], ph[g], x), pl[g], x);
        }
    }
    for (int g = 0; g < gb; ++g) {
        const __m512 scale = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < dv16; ++c)
            _mm256_storeu_si256((__m256i *)(out + g * dim + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g * dv16 + c], scale)));
    }
}

static void prefill_item(const uint16_t *pool, const int64_t *pages, int64_t n, int64_t q_len,
                         const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride,
                         int64_t layer, int64_t L, int64_t H, int64_t h, int64_t G, int64_t S, int dim,
                         float scale, float *scratch) {
    const int pairs = dim / 2;
    const int64_t blocks = (n + 15) / 16, npad = blocks * 16;
    const int64_t head_stride = S * dim, page_stride = L * 2 * H * head_stride;
    uint32_t *kt = (uint32_t *)scratch;                 /* blocks * pairs * 16 */
    uint32_t *vp = kt + npad * pairs;                   /* npad / 2 * dim */
    float *s = (float *)(vp + npad / 2 * dim);          /* G * npad */
    uint16_t *hi = (uint16_t *)(s + G * npad), *lo = hi + G * npad;  /* G * npad each */
    memset(kt, 0, sizeof(uint32_t) * (size_t)(npad * pairs + npad / 2 * dim));
    for (int64_t t = 0, i = 0; t < n; ++i) {
        const uint16_t *kpage = pool + pages[i] * page_stride + (layer * 2 * H + h) * head_stride;
        for (int64_t j = 0; j < S && t < n; ++j, ++t) {
            const uint32_t *k = (const uint32_t *)(kpage + j * dim);
            const uint16_t *v = kpage + H * head_stride + j * dim;
            uint32_t *kb = kt + (t / 16) * pairs * 16 + t % 16;
            for (int p = 0; p < pairs; ++p) kb[p * 16] = k[p];
            uint16_t *vb = (uint16_t *)(vp + (t / 2) * dim) + t % 2;
            for (int d = 0; d < dim; ++d) vb[2 * d] = v[d];
        }
    }
    const int gmax = dim == 64 ? 4 : 2;  /* at most 16 accumulator registers */
    for (int64_t i = 0; i < q_len; ++i) {
        const int64_t m = n - q_len + i + 1, mb = (m + 15) / 16;
        const uint16_t *qi = q + i * q_stride + h * G * dim;
        kt_scores(kt, mb, qi, G, pairs, scale, s, npad);
        float inv[16];   /* G <= MAX_GROUP (16): DEFINE_PREFILL refuses more */
        for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / softmax_to_pairs(s + g * npad, m, hi + g * npad, lo + g * npad);
        uint16_t *oi = out + i * out_stride + h * G * dim;
        const int64_t npairs = (m + 1) / 2;
        for (int64_t g0 = 0; g0 < G; g0 += gmax) {
            const int gb = G - g0 < gmax ? (int)(G - g0) : gmax;
            const uint16_t *h = hi + g0 * npad, *l = lo + g0 * npad;
            if (dim == 64) {
                switch (gb) {
                case 1: vp_values(vp, npairs, h, l, npad, inv + g0, 1, 4, oi + g0 * dim, 64); break;
                case 2: vp_values(vp, npairs, h, l, npad, inv + g0, 2, 4, oi + g0 * dim, 64); break;
                case 3: vp_values(vp, npairs, h, l, npad, inv + g0, 3, 4, oi + g0 * dim, 64); break;
                default: vp_values(vp, npairs, h, l, npad, inv + g0, 4, 4, oi + g0 * dim, 64); break;
                }
            } else {
                switch (gb) {
                case 1: vp_values(vp, npairs, h, l, npad, inv + g0, 1, 8, oi + g0 * dim, 128); break;
                default: vp_values(vp, npairs, h, l, npad, inv + g0, 2, 8, oi + g0 * dim, 128); break;
                }
            }
        }
    }
}

/* Floats of scratch one thread needs for items of up to `longest` keys. */
static inline int64_t prefill_scratch_floats(int64_t G, int64_t longest, int64_t dim) {
    const int64_t npad = (longest + 15) / 16 * 16;
    return npad * dim / 2 + npad / 2 * dim + G * npad + G * npad + 16;
}

#endif
#endif
