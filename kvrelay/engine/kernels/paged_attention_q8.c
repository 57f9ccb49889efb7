/* Decode attention straight from an 8-bit paged KV pool (kvrelay.core.kvlayout): each page
 * holds its values, 1 byte each, then one float32 scale per vector:
 *     values[page][layer][k|v][kv_head][slot][dim]     (int8, or fp8 e4m3 when fp8 != 0)
 *     scales[page][layer][k|v][kv_head][slot]          (x ~ value * scale)
 * `values` and `scales` point at page 0's; pages are `page_bytes` apart for both.
 * Work item w = (sequence w / H, kv head w % H) covers that kv head's G query heads and
 * writes only its own output rows; items are spread over torch's OpenMP threads.
 * Each key or value row is widened to float32 once and shared by the G query heads; its
 * scale multiplies the dot product (keys) or the probability (values), never the row.
 * fp8 e4m3 widens through float16 (F16C): the bits (s eeee mmm) placed as float16
 * (s 0eeee mmm0000000) are the same number times 2^-8, for normals and subnormals alike,
 * so 256 joins the scale. NaN (0x7f, 0xff) is never stored: the quantizer clamps to 448.
 * Scores are float32, softmax-normalised, then used to accumulate values (two passes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define Q8_MAX_GROUP 16
#define Q8_MAX_DIM 256

int paged_decode_q8_available(void) {
#if defined(__AVX2__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

static inline float fp8_e4m3_to_f32(uint8_t x) {
    const uint32_t em = x & 0x7Fu;
    float f;
    if (em >= 8) {   /* normal: exponent e - 7 + 127, mantissa on top of float32's */
        const uint32_t u = ((uint32_t)(x & 0x80u) << 24) | ((em + (120u << 3)) << 20);
        memcpy(&f, &u, sizeof f);
    } else {         /* subnormal: m * 2^-9 */
        f = (float)em * (1.0f / 512.0f);
        if (x & 0x80u) f = -f;
    }
    return f;
}

/* row[d] = the 8-bit values widened; fp8 rows come out 2^-8 too small (see above). */
static inline void widen(const uint8_t *src, float *row, int64_t D, int fp8) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    if (fp8) {
        const __m128i lo7 = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
        for (; d + 8 <= D; d += 8) {
            const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + d)));
            const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, lo7), 7),
                                           _mm_slli_epi16(_mm_and_si128(u, sign), 8));
            _mm256_storeu_ps(row + d, _mm256_cvtph_ps(h));
        }
    } else {
        for (; d + 8 <= D; d += 8) {
            const __m128i b = _mm_loadl_epi64((const __m128i *)(src + d));
            _mm256_storeu_ps(row + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
        }
    }
#endif
    for (; d < D; ++d) row[d] = fp8 ? fp8_e4m3_to_f32(src[d]) * (1.0f / 256.0f) : (float)(int8_t)src[d];
}

static int item(const uint8_t *values, const uint8_t *scales, int64_t page_bytes, const int64_t *pages,
                int64_t n, const float *q, float *out, int64_t layer, int64_t H, int64_t h, int64_t G,
                int64_t S, int64_t D, float sm_scale, int fp8) {
    float qf[Q8_MAX_GROUP * Q8_MAX_DIM], acc[Q8_MAX_GROUP * Q8_MAX_DIM], row[Q8_MAX_DIM];
    float *scores = malloc(sizeof(float) * (size_t)(G * (n > 0 ? n : 1)));
    if (scores == NULL) return 1;
    const float widen_scale = fp8 ? 256.0f : 1.0f;
    const int64_t k_vec = (layer * 2 * H + h) * S, v_vec = ((layer * 2 + 1) * H + h) * S;
    for (int64_t i = 0; i < G * D; ++i) qf[i] = q[i] * sm_scale;
    for (int64_t t = 0; t < n; ++t) {
        const uint8_t *page = values + pages[t / S] * page_bytes;
        const int64_t vec = k_vec + t % S;
        widen(page + vec * D, row, D, fp8);
        const float s = ((const float *)(scales + pages[t / S] * page_bytes))[vec] * widen_scale;
        for (int64_t g = 0; g < G; ++g) {
            const float *qg = qf + g * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
            scores[g * n + t] = dot * s;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float *sg = scores + g * n, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; ++t) m = sg[t] > m ? sg[t] : m;
        for (int64_t t = 0; t < n; ++t) { sg[t] = expf(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
    }
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
    for (int64_t t = 0; t < n; ++t) {
        const uint8_t *page = values + pages[t / S] * page_bytes;
        const int64_t vec = v_vec + t % S;
        widen(page + vec * D, row, D, fp8);
        const float s = ((const float *)(scales + pages[t / S] * page_bytes))[vec] * widen_scale;
        for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + t] * s;
            float *ag = acc + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(G * D));
    free(scores);
    return 0;
}

/* q, out: float32 [B, H * G, D]; page_table [B, max_pages]; kv_lens [B] (>= 1 each).
 * Returns 0, or nonzero when a shape is unsupported or memory ran out. */
int paged_decode_q8(const uint8_t *values, const uint8_t *scales, int64_t page_bytes,
                    const int64_t *page_table, const int64_t *kv_lens, const float *q, float *out,
                    int64_t B, int64_t max_pages, int64_t layer, int64_t H, int64_t G, int64_t S, int64_t D,
                    float sm_scale, int64_t fp8) {
    if (G > Q8_MAX_GROUP || D > Q8_MAX_DIM || G < 1 || D < 1) return 2;
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) reduction(|:failed)")
    for (int64_t w = 0; w < B * H; ++w) {
        const int64_t b = w / H, h = w % H;
        failed |= item(values, scales, page_bytes, page_table + b * max_pages, kv_lens[b],
                       q + (b * H + h) * G * D, out + (b * H + h) * G * D, layer, H, h, G, S, D,
                       sm_scale, (int)fp8);
    }
    return failed;
}
