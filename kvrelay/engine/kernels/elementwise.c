/* Fused elementwise kernels for the decoder layers, float32 or bfloat16 in and out,
 * float32 inside, rows spread over torch's OpenMP team (see paged_attention.c).
 *   add_rms_norm: h <- h + delta (rounded to the storage dtype, as an unfused add would
 *                 be), out <- rmsnorm(h) * weight. delta may be NULL (plain RMSNorm).
 *   silu_mul:     out[r, i] <- silu(gate_up[r, i]) * gate_up[r, inter + i].
 *   rope_bf16, rope_f32, rope_f32_kv_bf16, argmax_rows_f32, topk_rows_f32: see each function.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"

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
        int64_t i = silu_mul_vec_##SUFFIX(g, u, o, inter);                                   \
        for (; i < inter; ++i) {                                                             \
            const float x = LOAD(g + i);                                                     \
            o[i] = STORE(x / (1.f + expf(-x)) * LOAD(u + i));                                \
        }                                                                                    \
    }                                                                                        \
}

/* The leading columns of one row of silu_mul done in vectors; returns how many. */
static inline int64_t silu_mul_vec_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t inter) {
    (void)g, (void)u, (void)o, (void)inter;
    return 0;
}

static inline int64_t silu_mul_vec_f32(const float *g, const float *u, float *o, int64_t inter) {
    int64_t i = 0;
#ifdef KVRELAY_VEC
    for (; i + V <= inter; i += V) {
        VSTOREF(o + i, VMUL(vsilu(VLOADF(g + i)), VLOADF(u + i)));
    }
#else
    (void)g, (void)u, (void)o, (void)inter;
#endif
    return i;
}

DEFINE_ELEMENTWISE(bf16, uint16_t, bf16_load, bf16_round, BF16_ROUNDTRIP)
DEFINE_ELEMENTWISE(f32, float, F32_LOAD, F32_STORE, F32_ROUNDTRIP)

/* Neox (rotate-half) RoPE in place on the first `heads` heads of each row of x
 * [rows][row_stride] (bfloat16), with the cos/sin of position pos[r] from table
 * [positions][2][dim] (float32). Rounds where the unfused bf16 ops round (cos and sin to
 * bf16, x * cos to bf16, then x * cos + rotate_half(x) * sin once), so it matches them.
 * With `slots` (the KV pool as [slot][dim] rows): row r's kv heads h < hkv, which are the
 * last hkv of the rotated heads (keys) and the hkv after them (values), are also copied
 * to slots[slot_ids[r * hkv + h] + k_base] and [... + k_base + v_off]. */
void rope_bf16(uint16_t *x, const float *table, const int64_t *pos, int64_t rows, int64_t row_stride,
               int64_t heads, int64_t dim, uint16_t *slots, const int64_t *slot_ids, int64_t hkv,
               int64_t k_base, int64_t v_off) {
    const int64_t half = dim / 2;
    _Pragma("omp parallel for schedule(static) if(rows * heads * dim >= 65536)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *cs = table + pos[r] * 2 * dim;
        float c[256], s[256];
        for (int64_t d = 0; d < dim; ++d) {
            c[d] = BF16_ROUNDTRIP(cs[d]);
            s[d] = BF16_ROUNDTRIP(cs[dim + d]);
        }
        uint16_t *row = x + r * row_stride;
        for (int64_t h = 0; h < heads; ++h) {
            uint16_t *v = row + h * dim;
            for (int64_t d = 0; d < half; ++d) {
                const float a = bf16_load(v + d), b = bf16_load(v + d + half);
                v[d] = bf16_round(BF16_ROUNDTRIP(a * c[d]) - b * s[d]);
                v[d + half] = bf16_round(BF16_ROUNDTRIP(b * c[d + half]) + a * s[d + half]);
            }
        }
        if (slots) {
            for (int64_t h = 0; h < hkv; ++h) {
                const int64_t slot = slot_ids[r * hkv + h] + k_base;
                memcpy(slots + slot * dim, row + (heads - hkv + h) * dim, (size_t)dim * sizeof(uint16_t));
                memcpy(slots + (slot + v_off) * dim, row + (heads + h) * dim, (size_t)dim * sizeof(uint16_t));
            }
        }
    }
}

/* rope_bf16 for float32 x, rounding as the float32 torch ops (x * cos, then addcmul's one fma
 * of rotate_half(x) * sin onto it: an explicit fmaf, never left to contraction); the slots hold TS:
 * float32, or bfloat16 (a float32 model's bfloat16 KV cache: SLOT_STORE rounds each key
 * and value once, as it is stored). */
#define DEFINE_ROPE_F32(NAME, TS, SLOT_STORE)                                                      \
void NAME(float *x, const float *table, const int64_t *pos, int64_t rows, int64_t row_stride,     \
          int64_t heads, int64_t dim, TS *slots, const int64_t *slot_ids, int64_t hkv,            \
          int64_t k_base, int64_t v_off) {                                                        \
    const int64_t half = dim / 2;                                                                 \
    _Pragma("omp parallel for schedule(static) if(rows * heads * dim >= 65536)")                  \
    for (int64_t r = 0; r < rows; ++r) {                                                          \
        const float *c = table + pos[r] * 2 * dim, *s = c + dim;                                  \
        float *row = x + r * row_stride;                                                          \
        for (int64_t h = 0; h < heads; ++h) {                                                     \
            float *v = row + h * dim;                                                             \
            for (int64_t d = 0; d < half; ++d) {                                                  \
                const float a = v[d], b = v[d + half];                                            \
                v[d] = fmaf(-b, s[d], a * c[d]);                                                  \
                v[d + half] = fmaf(a, s[d + half], b * c[d + half]);                              \
            }                                                                                     \
        }                                                                                         \
        if (slots) {                                                                              \
            for (int64_t h = 0; h < hkv; ++h) {                                                   \
                const int64_t slot = slot_ids[r * hkv + h] + k_base;                              \
                const float *k = row + (heads - hkv + h) * dim, *val = row + (heads + h) * dim;   \
                TS *ks = slots + slot * dim, *vs = slots + (slot + v_off) * dim;                  \
                for (int64_t d = 0; d < dim; ++d) {                                               \
                    ks[d] = SLOT_STORE(k[d]);                                                     \
                    vs[d] = SLOT_STORE(val[d]);                                                   \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_ROPE_F32(rope_f32, float, F32_STORE)
DEFINE_ROPE_F32(rope_f32_kv_bf16, uint16_t, bf16_round)

/* out[r] = the first index of the largest value of row r of x [rows][n], as torch.argmax
 * gives for rows without NaN (logits here never hold one). */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out) {
    _Pragma("omp parallel for schedule(static) if(rows * n >= 65536)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        float best = row[0];
        for (int64_t i = 1; i < n; ++i) best = row[i] > best ? row[i] : best;
        int64_t at = 0;
        while (at < n - 1 && row[at] != best) ++at;
        out[r] = at;
    }
}

/* idx[r][0..k) = indices of the k largest values of row r of x [rows][n], best first,
 * ties to the lower index. k <= 64. */
void topk_rows_f32(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *idx) {
    _Pragma("omp parallel for schedule(static) if(rows * n >= 65536)")
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        float val[64];
        int64_t at[64];
        int64_t have = 0;
        float floor = -INFINITY;
        for (int64_t i = 0; i < n; ++i) {
            const float v = row[i];
            if (have == k && !(v > floor)) continue;
            int64_t j = have < k ? have++ : k - 1;
            while (j > 0 && v > val[j - 1]) { val[j] = val[j - 1]; at[j] = at[j - 1]; --j; }
            val[j] = v;
            at[j] = i;
            floor = val[have - 1];
        }
        for (int64_t j = 0; j < k; ++j) idx[r * k + j] = j < have ? at[j] : 0;
    }
}
