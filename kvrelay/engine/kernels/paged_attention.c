/* Decode attention straight from the paged KV pool: one query token per sequence, keys
 * and values read once, in place, from the page-major layout of kvrelay.core.kvlayout:
 *     pool[page][layer][k|v][kv_head][slot][dim]
 * Work item w = (sequence w / H, kv head w % H) covers that kv head's G query heads;
 * [lo, hi) lets the caller split the items between threads (each writes only its rows).
 * Scores are computed in float32 in a first pass, softmax-normalised, then used to
 * accumulate values in a second pass.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even; values here are finite */
    return (uint16_t)(u >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                   \
int NAME(const T *pool, const int64_t *page_table, const int64_t *kv_lens, const T *q, T *out, \
         int64_t max_pages, int64_t layer, int64_t L, int64_t H, int64_t G, int64_t S,       \
         int64_t D, float scale, int64_t lo, int64_t hi) {                                   \
    int64_t longest = 0;                                                                     \
    for (int64_t w = lo; w < hi; ++w)                                                        \
        if (kv_lens[w / H] > longest) longest = kv_lens[w / H];                              \
    float *scores = malloc(sizeof(float) * (size_t)(G * (longest > 0 ? longest : 1)));     \
    float *qf = malloc(sizeof(float) * (size_t)(G * D));                                     \
    float *acc = malloc(sizeof(float) * (size_t)(G * D));                                    \
    if (!scores || !qf || !acc) { free(scores); free(qf); free(acc); return -1; }            \
    const int64_t page_stride = L * 2 * H * S * D, head_stride = S * D;                      \
    for (int64_t w = lo; w < hi; ++w) {                                                      \
        const int64_t b = w / H, h = w % H, n = kv_lens[b];                                  \
        const int64_t *pages = page_table + b * max_pages;                                   \
        for (int64_t g = 0; g < G; ++g)                                                      \
            for (int64_t d = 0; d < D; ++d)                                                  \
                qf[g * D + d] = LOAD(q + ((b * H + h) * G + g) * D + d) * scale;             \
        for (int64_t t = 0; t < n; ++t) {                                                    \
            const T *k = pool + pages[t / S] * page_stride + (layer * 2 * H + h) * head_stride \
                         + (t % S) * D;                                                      \
            for (int64_t g = 0; g < G; ++g) {                                                \
                float dot = 0.f;                                                             \
                for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * LOAD(k + d);          \
                scores[g * n + t] = dot;                                                     \
            }                                                                                \
        }                                                                                    \
        for (int64_t g = 0; g < G; ++g) {                                                    \
            float *sg = scores + g * n, m = -INFINITY, sum = 0.f;                            \
            for (int64_t t = 0; t < n; ++t) m = sg[t] > m ? sg[t] : m;                      \
            for (int64_t t = 0; t < n; ++t) { sg[t] = expf(sg[t] - m); sum += sg[t]; }      \
            for (int64_t t = 0; t < n; ++t) sg[t] /= sum;                                   \
        }                                                                                    \
        memset(acc, 0, sizeof(float) * (size_t)(G * D));                                     \
        for (int64_t t = 0; t < n; ++t) {                                                    \
            const T *v = pool + pages[t / S] * page_stride + ((layer * 2 + 1) * H + h)        \
                         * head_stride + (t % S) * D;                                        \
            for (int64_t g = 0; g < G; ++g) {                                                \
                const float p = scores[g * n + t];                                           \
                for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * LOAD(v + d);           \
            }                                                                                \
        }                                                                                    \
        for (int64_t g = 0; g < G; ++g)                                                      \
            for (int64_t d = 0; d < D; ++d)                                                  \
                out[((b * H + h) * G + g) * D + d] = STORE(acc[g * D + d]);                  \
    }                                                                                        \
    free(scores); free(qf); free(acc);                                                       \
    return 0;                                                                                \
}

#define F32_LOAD(p) (*(p))
#define F32_STORE(x) (x)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_load, bf16_round)
DEFINE_KERNEL(paged_decode_f32, float, F32_LOAD, F32_STORE)
