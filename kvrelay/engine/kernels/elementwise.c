/* Fused elementwise kernels for the decoder layers, float32 or bfloat16 in and out,
 * float32 inside, rows spread over torch's OpenMP team (see paged_attention.c).
 *   add_rms_norm: h <- h + delta (rounded to the storage dtype, as an unfused add would
 *                 be), out <- rmsnorm(h) * weight. delta may be NULL (plain RMSNorm).
 *   silu_mul:     out[r, i] <- silu(gate_up[r, i]) * gate_up[r, inter + i].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* The value an unfused add would have stored: rounded through the storage dtype. */
#define BF16_ROUNDTRIP(x) bf16_load(&(uint16_t){bf16_round(x)})
#define F32_ROUNDTRIP(x) (x)

#define DEFINE_ELEMENTWISE(SUFFIX, T, LOAD, STORE, ROUNDTRIP)                                 \
void add_rms_norm_##SUFFIX(T *h, const T *delta, const T *weight, T *out, int64_t rows,      \
                           int64_t dim, float eps) {                                         \
    _Pragma("omp parallel for schedule(static) if(rows * dim >= 32768)")                     \
    for (int64_t r = 0; r < rows; ++r) {                                                     \
        T *hr = h + r * dim;                                                                 \
        float sq = 0.f;                                                                      \
        if (delta) {                                                                         \
            const T *dr = delta + r * dim;                                                   \
            for (int64_t i = 0; i < dim; ++i) {                                              \
                const float v = ROUNDTRIP(LOAD(hr + i) + LOAD(dr + i));                      \
                hr[i] = STORE(v);                                                            \
                sq += v * v;                                                                 \
            }                                                                                \
        } else {                                                                             \
            for (int64_t i = 0; i < dim; ++i) { const float v = LOAD(hr + i); sq += v * v; } \
        }                                                                                    \
        const float scale = 1.f / sqrtf(sq / (float)dim + eps);                              \
        T *o = out + r * dim;                                                                \
        for (int64_t i = 0; i < dim; ++i) o[i] = STORE(LOAD(hr + i) * scale * LOAD(weight + i)); \
    }                                                                                        \
}                                                                                            \
void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter) {             \
    _Pragma("omp parallel for schedule(static) if(rows * inter >= 32768)")                   \
    for (int64_t r = 0; r < rows; ++r) {                                                     \
        const T *g = gate_up + r * 2 * inter, *u = g + inter;                                \
        T *o = out + r * inter;                                                              \
        for (int64_t i = 0; i < inter; ++i) {                                                \
            const float x = LOAD(g + i);                                                     \
            o[i] = STORE(x / (1.f + expf(-x)) * LOAD(u + i));                                \
        }                                                                                    \
    }                                                                                        \
}

DEFINE_ELEMENTWISE(bf16, uint16_t, bf16_load, bf16_round, BF16_ROUNDTRIP)
DEFINE_ELEMENTWISE(f32, float, F32_LOAD, F32_STORE, F32_ROUNDTRIP)
