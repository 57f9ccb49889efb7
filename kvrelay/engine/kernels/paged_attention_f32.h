/* The float32 decode-attention work item for the AVX-512F and AVX2 builds (vec.h), for
 * float32 pools and for bfloat16 pools on CPUs without AVX-512 BF16 (widened on load).
 * paged_attention.c holds the pool layout and the entry point. One item is one
 * (sequence, kv head) and its G query heads, taken DEC_GC at a time: each key and value
 * vector is loaded and widened once for DEC_GC heads (a Zen 2, 32 sequences x 320 keys,
 * 30 layers: 16.7 -> 14.1 ms from DRAM, 14.4 -> 9.2 from L3, against one head at a time).
 *   scores: 4 keys x DEC_GC heads of accumulators, each reduced to a score (dec_reduce4);
 *   values: 4 value vectors x DEC_GC heads of accumulators, one broadcast probability a
 *           key and head.
 * The pool is larger than the caches, so the item is bound by DRAM: while it scores a
 * block it prefetches that block's values and the keys two blocks on (a page's rows are
 * contiguous, its neighbour is anywhere), and its first value pass, which reads from
 * cache, prefetches the next item's rows (a Zen 4 forced to avx2 or avx512_vnni, the same
 * batch: 18.5-20.5 -> 15.6-17.7 ms). Scores, softmax and sums are float32.
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

static inline void dec_prefetch_row(const void *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T1);
}

/* Floats of score scratch one item of n keys needs. */
static inline int64_t dec_scratch_floats(int64_t G, int64_t n) { return G * ((n + V - 1) / V * V); }

/* dst[j] = the sum of a[j]'s lanes, j < 4. */
static inline void dec_reduce4(const vf *a, float *dst) {
#if V == 8
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    /* u = [a0..a3's low-half sums | a0..a3's high-half sums] */
    _mm_storeu_ps(dst, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
#else
    for (int j = 0; j < 4; ++j) dst[j] = vsum(a[j]);
#endif
}

/* Query heads g0 .. g0 + GC of 4 keys (krow[jb ..]): each key vector is widened once for
 * the GC heads; GC x 4 accumulators (12 of AVX2's 16 registers at GC = 3, with 3 query
 * vectors and a key). The c loop stays rolled: unrolled, gcc spilled accumulators (one
 * layer from L3: 0.35 against 0.30 ms). */
#define DEC_SCORE4(GC, LOADV)                                                                     \
    {                                                                                             \
        vf acc[GC * 4];                                                                           \
        _Pragma("GCC unroll 12") for (int i = 0; i < GC * 4; ++i) acc[i] = VZERO();               \
        _Pragma("GCC unroll 1") for (int c = 0; c < C; ++c) {                                     \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {                                 \
                const vf kv = LOADV(krow[jb + j] + c * V);                                        \
                _Pragma("GCC unroll 3") for (int gg = 0; gg < GC; ++gg)                           \
                    acc[gg * 4 + j] =                                                             \
                        VFMA(VLOADF(qf + (g0 + gg) * HD + c * V), kv, acc[gg * 4 + j]);           \
            }                                                                                     \
        }                                                                                         \
        for (int gg = 0; gg < GC; ++gg)                                                           \
            dec_reduce4(acc + gg * 4, scores + (g0 + gg) * npad + t0 + jb);                       \
    }

/* Query heads g0 .. g0 + GC, value vectors c0 .. c0 + 4 of every key: each value vector is
 * widened once for the GC heads' probabilities; GC x 4 accumulators. */
#define DEC_VALUES4(GC, T, LOADV)                                                                 \
    {                                                                                             \
        vf acc[GC * 4];                                                                           \
        _Pragma("GCC unroll 12") for (int i = 0; i < GC * 4; ++i) acc[i] = VZERO();               \
        for (int64_t t = 0, i = 0; t < n; ++i) {                                                  \
            const T *vpage = pool + pages[i] * page_stride + v_off + c0 * V;                      \
            for (int64_t j = 0; j < S && t < n; ++j, ++t) {                                       \
                if (t < ahead_n) {   /* the next item's key and value row t */                    \
                    const T *nrow = pool + next_pages[np] * page_stride + nk_off + ns * HD;       \
                    dec_prefetch_row(nrow, row_bytes);                                            \
                    dec_prefetch_row(nrow + H * head_stride, row_bytes);                          \
                    if (++ns == S) { ns = 0; ++np; }                                              \
                }                                                                                 \
                vf p[GC];                                                                         \
                _Pragma("GCC unroll 3") for (int gg = 0; gg < GC; ++gg)                           \
                    p[gg] = VSET1(scores[(g0 + gg) * npad + t]);                                  \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {                             \
                    const vf vv = LOADV(vpage + j * HD + c * V);                                  \
                    _Pragma("GCC unroll 3") for (int gg = 0; gg < GC; ++gg)                       \
                        acc[gg * 4 + c] = VFMA(p[gg], vv, acc[gg * 4 + c]);                       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 12") for (int i = 0; i < GC * 4; ++i)                                 \
            VSTOREF(o + (g0 + i / 4) * HD + (c0 + i % 4) * V, acc[i]);                            \
    }

/* Item for sequence keys [0, n) of kv head h; LOADV loads V elements of the pool's T as
 * float32; q and out hold TQ (LOADQ, STOREQ). Query heads go DEC_GC at a time, so each
 * key and value vector is widened once per DEC_GC heads, not once per head. Keys are
 * walked by (page, slot) counters: no division in the loop. */
#define DEC_GC 3
/* BLOCK(GC, ...) for the GC = min(DEC_GC, G - g0) heads from g0, GC a constant. */
#define DEC_HEADS(BLOCK, ...)                                                                     \
    switch (G - g0 < DEC_GC ? G - g0 : DEC_GC) {                                                  \
    case 1: BLOCK(1, __VA_ARGS__) break;                                                          \
    case 2: BLOCK(2, __VA_ARGS__) break;                                                          \
    default: BLOCK(3, __VA_ARGS__) break;                                                         \
    }
#define DEFINE_DEC_ITEM(NAME, T, LOADV, TQ, LOADQ, STOREQ, DIM)                                   \
static void NAME(const T *pool, const int64_t *pages, int64_t n, const TQ *q, TQ *out,            \
                 int64_t layer, int64_t L, int64_t H, int64_t h, int64_t G, int64_t S,            \
                 float scale, float *scores, const int64_t *next_pages, int64_t next_n,           \
                 int64_t next_h) {                                                                \
    enum { HD = DIM, C = DIM / V };   /* C: a multiple of 4 (DIM 64 or 128, V 8 or 16) */         \
    float qf[MAX_GROUP * DIM], o[MAX_GROUP * DIM];                                                \
    const int64_t head_stride = S * DIM, page_stride = L * 2 * H * head_stride;                   \
    const int64_t k_off = (layer * 2 * H + h) * head_stride, v_off = k_off + H * head_stride;     \
    const int64_t npad = (n + V - 1) / V * V, row_bytes = DIM * (int64_t)sizeof(T);                \
    for (int64_t i = 0; i < G * DIM; ++i) qf[i] = LOADQ(q + i) * scale;                           \
    /* (page index, slot) of the next key to score and of the next to prefetch, 2V on */          \
    int64_t kp = 0, ks = 0, ap = (2 * V) / S, as = (2 * V) % S;                                   \
    for (int64_t t0 = 0; t0 < n; t0 += V) {                                                       \
        const T *krow[V];                                                                         \
        for (int j = 0; j < V; ++j) {                                                             \
            if (t0 + j < n) {                                                                     \
                krow[j] = pool + pages[kp] * page_stride + k_off + ks * DIM;                      \
                dec_prefetch_row(krow[j] + (v_off - k_off), row_bytes);                           \
                if (++ks == S) { ks = 0; ++kp; }                                                  \
            } else {                                                                              \
                krow[j] = krow[0];   /* past n: a copy, its score never read back */              \
            }                                                                                     \
            if (t0 + 2 * V + j < n) {                                                             \
                dec_prefetch_row(pool + pages[ap] * page_stride + k_off + as * DIM, row_bytes);   \
                if (++as == S) { as = 0; ++ap; }                                                  \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g0 = 0; g0 < G; g0 += DEC_GC)                                                \
            for (int jb = 0; jb < V && t0 + jb < n; jb += 4)                                      \
                DEC_HEADS(DEC_SCORE4, LOADV)                                                      \
    }                                                                                             \
    for (int64_t g = 0; g < G; ++g) dec_softmax(scores + g * npad, n);                            \
    /* The first value pass (from L2) pulls the next item's rows in: its scoring pass then */     \
    /* reads them from L2 too (next_pages NULL: no next item). */                                 \
    const int64_t nk_off = (layer * 2 * H + next_h) * head_stride;                                \
    int64_t np = 0, ns = 0, ahead_n = next_pages ? next_n : 0;                                    \
    for (int64_t g0 = 0; g0 < G; g0 += DEC_GC)                                                    \
        for (int c0 = 0; c0 < C; c0 += 4, ahead_n = 0)                                            \
            DEC_HEADS(DEC_VALUES4, T, LOADV)                                                      \
    for (int64_t i = 0; i < G * DIM; ++i) out[i] = STOREQ(o[i]);                                  \
}

#endif
#endif
