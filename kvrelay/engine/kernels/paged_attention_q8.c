/* Decode attention straight from an 8-bit paged KV pool (kvrelay.core.kvlayout): each page
 * holds its values, 1 byte each, then one float32 scale per vector:
 *     values[page][layer][k|v][kv_head][slot][dim]     (int8, or fp8 e4m3 when fp8 != 0)
 *     scales[page][layer][k|v][kv_head][slot]          (x ~ value * scale)
 * `values` and `scales` point at page 0's; pages are `page_bytes` apart for both.
 * Work item w = (sequence w / H, kv head w % H) covers that kv head's G query heads and
 * writes only its own output rows; items are spread over torch's OpenMP threads, a thread
 * done with its part taking Q8_UNIT items at a time from the others' (worksteal.h).
 *
 * One source for the AVX-512F and AVX2+FMA builds (vec.h). Rows are widened to float32 in
 * registers, V lanes at a time, a short last chunk loaded with the bytes past the row as
 * zeros; up to GB query heads share each widened row. A key's scale multiplies its dot
 * products, a value's folds into its probabilities: rows are never rescaled. Softmax is
 * two passes (max, then exp and sum); its division is applied to the accumulated values.
 * fp8 e4m3 widens through float16 (F16C): the bits (s eeee mmm) placed as float16
 * (s 0eeee mmm0000000) are the same number times 2^-8, for normals and subnormals alike,
 * so 256 joins the query (keys) and the probabilities (values). NaN (0x7f, 0xff) is never
 * stored: the quantizer clamps to 448.
 * Pages are scattered, which the hardware prefetcher does not follow: walking the keys,
 * each key asks for the key in its slot Q8_AHEAD pages on (into L1) and for its own value
 * (into L2, read by the value pass that follows), one row each: a page's rows asked at once
 * queue behind the core's miss buffers and stall the loads behind them. The value pass
 * asks for the next item's keys (into L2) the same way, spread over its rows.
 * q and out are float32, or bfloat16 when `bf16` (out rounded to nearest even, as torch).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"
#include "worksteal.h"

#define Q8_MAX_GROUP 16
#define Q8_MAX_DIM 256
#define Q8_AHEAD 4      /* pages the key walk prefetches ahead */
#define Q8_CHUNKS 4     /* V-lane chunks of a value row accumulated per value pass */
#define Q8_UNIT 2       /* work items a stolen unit holds (worksteal.h) */

#if defined(KVRELAY_VEC) && defined(__F16C__)
#define Q8_VECTOR 1
#define Q8_GB (V == 16 ? 4 : 3)  /* query heads per pass: GB x Q8_CHUNKS accumulators fit the registers */

int paged_decode_q8_available(void) { return 1; }

/* V bytes at p, of which the first cnt (1..V) are the row's, as float32 (fp8: 2^-8 too small). */
static inline __attribute__((always_inline)) vf widen8(const uint8_t *p, int cnt, const int fp8) {
#if V == 16
    const __m128i b = cnt >= 16 ? _mm_loadu_si128((const __m128i *)p)
                                : _mm_maskz_loadu_epi8((__mmask16)((1u << cnt) - 1u), p);
    if (fp8) {
        const __m256i u = _mm256_cvtepu8_epi16(b);
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7F)), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#else
    __m128i b;
    if (cnt >= 8) {
        b = _mm_loadl_epi64((const __m128i *)p);
    } else {
        uint8_t tail[8] = {0};
        memcpy(tail, p, (size_t)cnt);
        b = _mm_loadl_epi64((const __m128i *)tail);
    }
    if (fp8) {
        const __m128i u = _mm_cvtepu8_epi16(b);
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7),
                                       _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8));
        return _mm256_cvtph_ps(h);
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#endif
}

/* Where one item reads: its pages, and its (layer, K|V, head) vectors within a page; and
 * the keys of the item its thread most likely takes next (next_n = 0: none), which its
 * value pass pulls into L2 for that item's key walk. */
typedef struct {
    const uint8_t *values, *scales;   /* page 0's */
    int64_t page_bytes;
    const int64_t *pages;
    int64_t n, k_vec, v_vec, S, D, DP;  /* keys; first key/value vector; slots a page; dim, padded to V */
    const int64_t *next_pages;
    int64_t next_n, next_k_vec;
} q8_span;

/* A row of `bytes` at p into L1 (l1) or L2: one prefetch per 64-byte line. */
static inline __attribute__((always_inline)) void prefetch_row(const uint8_t *p, int64_t bytes, const int l1) {
    for (int64_t off = 0; off < bytes; off += 64) {
        if (l1) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
        else _mm_prefetch((const char *)p + off, _MM_HINT_T1);
    }
}

/* sg[g * stride + t] = qf[g] . key t * its scale, for g < gb and every key t. `prefetch`:
 * the first pass over the keys asks, with each key j of a page, for key j Q8_AHEAD pages
 * on and for value j of this page (one row each, so the requests never queue up). */
static inline __attribute__((always_inline)) void q8_scores(const q8_span *x, const float *qf, float *sg,
                                                            int64_t stride, const int gb, const int fp8,
                                                            int prefetch, const int dc) {
    const int64_t D = dc ? dc : x->D, nc = (D + V - 1) / V, DP = nc * V, S = x->S, np = (x->n + S - 1) / S;
    if (prefetch)
        for (int64_t i = 0; i < Q8_AHEAD && i < np; ++i) {
            const int64_t off = x->pages[i] * x->page_bytes;
            prefetch_row(x->values + off + x->k_vec * D, S * D, 1);
            prefetch_row(x->scales + off + x->k_vec * 4, S * 4, 1);
        }
    for (int64_t i = 0, t = 0; t < x->n; ++i) {
        const int64_t off = x->pages[i] * x->page_bytes;
        const uint8_t *keys = x->values + off + x->k_vec * D, *vals = x->values + off + x->v_vec * D;
        const uint8_t *ahead = i + Q8_AHEAD < np ? x->values + x->pages[i + Q8_AHEAD] * x->page_bytes : NULL;
        if (prefetch) {
            prefetch_row(x->scales + off + x->v_vec * 4, S * 4, 0);
            if (ahead) prefetch_row(x->scales + (ahead - x->values) + x->k_vec * 4, S * 4, 1);
        }
        const float *ks = (const float *)(x->scales + off) + x->k_vec;
        const int64_t cnt = x->n - t < S ? x->n - t : S;
        int64_t j = 0;
        for (; j + 4 <= cnt; j += 4, t += 4) {   /* four keys: one reduction tree per head */
            vf a[4][4];
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) {
                if (prefetch) {
                    if (ahead) prefetch_row(ahead + x->k_vec * D + (j + u) * D, D, 1);
                    prefetch_row(vals + (j + u) * D, D, 0);
                }
#pragma GCC unroll 4
                for (int g = 0; g < gb; ++g) a[g][u] = VZERO();
#pragma GCC unroll 16
                for (int64_t c = 0; c < nc; ++c) {
                    const int64_t left = D - c * V;
                    const vf k = widen8(keys + (j + u) * D + c * V, left < V ? (int)left : V, fp8);
#pragma GCC unroll 4
                    for (int g = 0; g < gb; ++g) a[g][u] = VFMA(VLOADF(qf + g * DP + c * V), k, a[g][u]);
                }
            }
            const __m128 s4 = _mm_loadu_ps(ks + j);
#pragma GCC unroll 4
            for (int g = 0; g < gb; ++g)
                _mm_storeu_ps(sg + g * stride + t, _mm_mul_ps(vsum4(a[g][0], a[g][1], a[g][2], a[g][3]), s4));
        }
        for (; j < cnt; ++j, ++t) {
            if (prefetch) {
                if (ahead) prefetch_row(ahead + x->k_vec * D + j * D, D, 1);
                prefetch_row(vals + j * D, D, 0);
            }
            vf a[4];
#pragma GCC unroll 4
            for (int g = 0; g < gb; ++g) a[g] = VZERO();
#pragma GCC unroll 16
            for (int64_t c = 0; c < nc; ++c) {
                const int64_t left = D - c * V;
                const vf k = widen8(keys + j * D + c * V, left < V ? (int)left : V, fp8);
#pragma GCC unroll 4
                for (int g = 0; g < gb; ++g) a[g] = VFMA(VLOADF(qf + g * DP + c * V), k, a[g]);
            }
#pragma GCC unroll 4
            for (int g = 0; g < gb; ++g) sg[g * stride + t] = vsum(a[g]) * ks[j];
        }
    }
}

/* s[t] <- e^(s[t] - max s) for t < n; returns their sum. */
static inline float q8_exp(float *s, int64_t n) {
    vf m = VSET1(-INFINITY);
    int64_t t = 0;
    for (; t + V <= n; t += V) m = VMAX(m, VLOADF(s + t));
    float mx = vmaxall(m), sum = 0.f;
    for (int64_t u = t; u < n; ++u) mx = s[u] > mx ? s[u] : mx;
    const vf neg = VSET1(-mx);
    vf acc = VZERO();
    for (t = 0; t + V <= n; t += V) {
        const vf e = vexp(VADD(VLOADF(s + t), neg));
        VSTOREF(s + t, e);
        acc = VADD(acc, e);
    }
    for (; t < n; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
    return sum + vsum(acc);
}

/* res[g * D + d] = sum_t p[g][t] * value t [d] * inv[g], p[g] = sg + g * stride, g < gb.
 * `prefetch`: the last pass of heads over the values asks for the next item's keys. */
static inline __attribute__((always_inline)) void q8_values(const q8_span *x, const float *sg, int64_t stride,
                                                            const float *inv, float *res, const int gb,
                                                            const int fp8, int prefetch, const int dc) {
    const int64_t D = dc ? dc : x->D, nc = (D + V - 1) / V, S = x->S;
    const float widen_scale = fp8 ? 256.f : 1.f;
    for (int64_t c0 = 0; c0 < nc; c0 += Q8_CHUNKS) {
        vf acc[4][Q8_CHUNKS];
        for (int g = 0; g < 4; ++g)
            for (int c = 0; c < Q8_CHUNKS; ++c) acc[g][c] = VZERO();
        /* the next item's key rows (its page ni, slot nj) and scales, into L2: as many
         * by value row t + 1 as (t + 1) next_n / n, so the last row asks for the last */
        int64_t asked = 0, ni = 0, nj = 0;
        const int ask = c0 == 0 && prefetch;
        for (int64_t i = 0, t = 0; t < x->n; ++i) {
            const int64_t off = x->pages[i] * x->page_bytes;
            const uint8_t *vals = x->values + off + x->v_vec * D;
            const float *vs = (const float *)(x->scales + off) + x->v_vec;
            const int64_t cnt = x->n - t < S ? x->n - t : S;
            for (int64_t j = 0; j < cnt; ++j, ++t) {
                for (; ask && asked * x->n < (t + 1) * x->next_n; ++asked) {
                    const int64_t noff = x->next_pages[ni] * x->page_bytes;
                    if (nj == 0) prefetch_row(x->scales + noff + x->next_k_vec * 4, S * 4, 0);
                    prefetch_row(x->values + noff + (x->next_k_vec + nj) * D, D, 0);
                    if (++nj == S) nj = 0, ++ni;
                }
                const float w = vs[j] * widen_scale;
                vf p[4];
#pragma GCC unroll 4
                for (int g = 0; g < gb; ++g) p[g] = VSET1(sg[g * stride + t] * w);
#pragma GCC unroll 4
                for (int c = 0; c < Q8_CHUNKS; ++c) {
                    if (c0 + c >= nc) break;
                    const int64_t left = D - (c0 + c) * V;
                    const vf v = widen8(vals + j * D + (c0 + c) * V, left < V ? (int)left : V, fp8);
#pragma GCC unroll 4
                    for (int g = 0; g < gb; ++g) acc[g][c] = VFMA(p[g], v, acc[g][c]);
                }
            }
        }
        for (int g = 0; g < gb; ++g)
            for (int c = 0; c < Q8_CHUNKS && c0 + c < nc; ++c) {
                const int64_t left = D - (c0 + c) * V;
                vstore_n(res + g * D + (c0 + c) * V, VMUL(acc[g][c], VSET1(inv[g])), left < V ? (int)left : V);
            }
    }
}

/* Query heads [g0, g0 + gb) of one item: scores, softmax, values into res + g0 * D. */
static inline __attribute__((always_inline)) void q8_heads(const q8_span *x, const float *qf, float *sg,
                                                           int64_t stride, float *res, int64_t g0, int64_t G,
                                                           const int gb, const int fp8, const int dc) {
    float inv[4];
    q8_scores(x, qf + g0 * x->DP, sg, stride, gb, fp8, g0 == 0, dc);
    for (int g = 0; g < gb; ++g) inv[g] = 1.f / q8_exp(sg + g * stride, x->n);
    q8_values(x, sg, stride, inv, res + g0 * x->D, gb, fp8, g0 + gb == G, dc);
}

/* Every pass of heads of one item, for head dim DC (0: any, x->D). */
static inline __attribute__((always_inline)) void q8_passes(const q8_span *x, const float *qf, float *sg,
                                                            int64_t stride, float *res, int64_t G, const int fp8,
                                                            const int dc) {
    if (dc == 0) {   /* other head dims: one head a pass, so fewer copies to compile */
        for (int64_t g0 = 0; g0 < G; ++g0) q8_heads(x, qf, sg, stride, res, g0, G, 1, fp8, 0);
        return;
    }
    for (int64_t g0 = 0; g0 < G; g0 += Q8_GB) {
        switch (G - g0 < Q8_GB ? G - g0 : Q8_GB) {
        case 1: q8_heads(x, qf, sg, stride, res, g0, G, 1, fp8, dc); break;
        case 2: q8_heads(x, qf, sg, stride, res, g0, G, 2, fp8, dc); break;
        case 3: q8_heads(x, qf, sg, stride, res, g0, G, 3, fp8, dc); break;
        default: q8_heads(x, qf, sg, stride, res, g0, G, Q8_GB, fp8, dc); break;
        }
    }
}

/* Head dims 64 and 128 get whole chunks known at compile time; others the general loop. */
#define Q8_ITEM(NAME, FP8)                                                                       \
static void NAME(const q8_span *x, const float *qf, float *sg, int64_t stride, float *res, int64_t G) { \
    if (x->D == 64) q8_passes(x, qf, sg, stride, res, G, FP8, 64);                               \
    else if (x->D == 128) q8_passes(x, qf, sg, stride, res, G, FP8, 128);                        \
    else q8_passes(x, qf, sg, stride, res, G, FP8, 0);                                           \
}
Q8_ITEM(q8_item_int8, 0)
Q8_ITEM(q8_item_fp8, 1)

#else
int paged_decode_q8_available(void) { return 0; }
#endif

/* q, out: [B, H * G, D], float32 (or bfloat16 when bf16); page_table [B, max_pages]; kv_lens
 * [B] (a sequence with none gets zeros). Returns 0, 2 for an unsupported shape or build,
 * 1 when memory ran out. */
int paged_decode_q8(const uint8_t *values, const uint8_t *scales, int64_t page_bytes,
                    const int64_t *page_table, const int64_t *kv_lens, const void *q, void *out,
                    int64_t B, int64_t max_pages, int64_t layer, int64_t H, int64_t G, int64_t S, int64_t D,
                    float sm_scale, int64_t fp8, int64_t bf16) {
#ifdef Q8_VECTOR
    if (G > Q8_MAX_GROUP || D > Q8_MAX_DIM || G < 1 || D < 1 || S < 1) return 2;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; ++b) longest = kv_lens[b] > longest ? kv_lens[b] : longest;
    const int64_t DP = (D + V - 1) / V * V, stride = (longest + 15) / 16 * 16;
    const float q_scale = sm_scale * (fp8 ? 256.f : 1.f);
    int failed = 0;
    uint64_t words[WS_MAX_THREADS];
    const int64_t team = ws_team(), items = B * H;
    if (team > 0) ws_init(words, items, team, Q8_UNIT);
    _Pragma("omp parallel reduction(|:failed)")
    {
        float *sg = malloc(sizeof(float) * (size_t)(Q8_GB * stride));
        float qf[Q8_MAX_GROUP * (Q8_MAX_DIM + 16)], res[Q8_MAX_GROUP * Q8_MAX_DIM];
        failed |= sg == NULL;
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t cursor = 0, i0, i1;
        while (ws_next(words, team > 0 && nt == team, items, t, nt, Q8_UNIT, &cursor, &i0, &i1))
        for (int64_t w = i0; w < i1; ++w) {
            const int64_t b = w / H, h = w % H, n = kv_lens[b], row = (b * H + h) * G * D;
            if (sg == NULL) continue;
            if (n < 1) {
                memset(res, 0, sizeof(float) * (size_t)(G * D));
            } else {
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t d = 0; d < DP; ++d) {
                        const int64_t i = row + g * D + d;
                        const float v = d >= D ? 0.f : bf16 ? bf16_load((const uint16_t *)q + i) : ((const float *)q)[i];
                        qf[g * DP + d] = v * q_scale;
                    }
                /* the item this thread most likely takes next (worksteal.h: a part's units go
                 * front to back); one another thread took is only a wasted prefetch */
                const int64_t nw = w + 1 < items ? w + 1 : -1;
                const q8_span x = {values, scales, page_bytes, page_table + b * max_pages, n,
                                   (layer * 2 * H + h) * S, ((layer * 2 + 1) * H + h) * S, S, D, DP,
                                   nw < 0 ? page_table : page_table + (nw / H) * max_pages,
                                   nw < 0 ? 0 : kv_lens[nw / H], (layer * 2 * H + nw % H) * S};
                if (fp8) q8_item_fp8(&x, qf, sg, stride, res, G);
                else q8_item_int8(&x, qf, sg, stride, res, G);
            }
            for (int64_t i = 0; i < G * D; ++i) {
                if (bf16) ((uint16_t *)out)[row + i] = bf16_round(res[i]);
                else ((float *)out)[row + i] = res[i];
            }
        }
        free(sg);
    }
    return failed;
#else
    (void)values, (void)scales, (void)page_bytes, (void)page_table, (void)kv_lens, (void)q, (void)out, (void)B;
    (void)max_pages, (void)layer, (void)H, (void)G, (void)S, (void)D, (void)sm_scale, (void)fp8, (void)bf16;
    return 2;
#endif
}
