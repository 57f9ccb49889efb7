/* Quantizing K/V store into an 8-bit paged KV pool (kvrelay.core.kvlayout): each page of
 * `page_bytes` holds
 *     values[layer][k|v][kv_head][slot][dim]   1 byte: int8, or fp8 e4m3fn when fp8 != 0
 *     scales[layer][k|v][kv_head][slot]        float32, from the page's byte `scales_offset`
 * kv8_store_bf16 / kv8_store_f32: for each row r < rows and kv head h < heads, the key
 * k[r * k_stride + h * dim ...] and the value v[r * v_stride + h * dim ...] (dim elements
 * each) are quantized, one scale per vector, into page pages[r], slot offsets[r] of `layer`.
 * Nothing else in the pool is written; `held` (NULL: none), [rows][k|v][heads][dim] of T,
 * gets what the pool now holds, dequantized as kv_pool.dequantize gives it. Returns 0, or -1 (having written nothing) when some
 * pages[r] is outside [0, num_pages) or offsets[r] outside [0, page_size).
 *
 * The result is bit for bit kvrelay.engine.kv_pool.quantize (torch) for finite inputs:
 *     scale = max(amax|x| / M, FLT_MIN), M = 127 (int8) or 448 (fp8); y = x / scale;
 *     int8: round half to even, clamp to +-127;
 *     fp8:  clamp to +-448, then c10's fp8e4m3fn_from_fp32_value (nearest even, subnormals
 *           included, the sign kept on zeros).
 * So this whole file is compiled without -ffast-math and without contraction: every step
 * above is one IEEE float32 operation (fast-math would divide by a reciprocal of scale).
 * amax is taken over the bits of |x|, which order as the values do for finite x.
 * Rows are spread over torch's OpenMP team for prefill-sized passes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* GCC builds every kernel (variants._compiler: they run on torch's libgomp). */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
/* Defined here, not taken from bf16.h: gcc inlines no function built with -ffast-math into these. */
static inline float load_bf16(const uint16_t *p) { return bits_f32((uint32_t)*p << 16); }
static inline float load_f32(const float *p) { return *p; }

/* c10::detail::fp8e4m3fn_from_fp32_value. */
static inline uint8_t fp8_e4m3fn(float f) {
    uint32_t u = f32_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u >= 0x43F00000u) {                   /* >= 480, or NaN: never after the clamp */
        r = 0x7f;
    } else if (u < (121u << 23)) {            /* below 2^-6: adding 2^14 rounds to a multiple of 2^-9 */
        r = (uint8_t)(f32_bits(bits_f32(u) + bits_f32(141u << 23)) - (141u << 23));
    } else {                                  /* rebias the exponent, round the mantissa to 3 bits */
        u += (uint32_t)(7 - 127) * (1u << 23) + 0x7FFFFu + ((u >> 20) & 1u);
        r = (uint8_t)(u >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

static inline uint8_t to_int8(float y) {
    float q = rintf(y);                       /* the default rounding mode: half to even */
    q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
    return (uint8_t)(int8_t)(int)q;
}

/* The e4m3fn byte as float32, exactly (NaN never stored). */
static inline float fp8_value(uint8_t b) {
    const uint32_t em = b & 0x7Fu;
    const float f = em >= 8 ? bits_f32(((em >> 3) + 120u) << 23 | (em & 7u) << 20)
                            : (float)em * (1.0f / 512.0f);      /* subnormal: m * 2^-9 */
    return b & 0x80u ? -f : f;
}
static inline uint16_t store_bf16(float f) {   /* round to nearest even, as torch's .to() */
    const uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float store_f32(float f) { return f; }

static inline uint8_t to_fp8(float y) {
    return fp8_e4m3fn(y > 448.f ? 448.f : (y < -448.f ? -448.f : y));
}

/* held (NULL: none) <- what the pool now holds, dequantized: value * scale in T, as
 * kv_pool.dequantize rounds it. */
#define DEFINE_QUANTIZE(SUFFIX, T, LOAD, STORE)                                               \
static inline void quantize_##SUFFIX(const T *restrict x, int64_t dim, int fp8, uint8_t *restrict out, \
                                     float *restrict scale_out, T *restrict held) {       \
    uint32_t top = 0;                                                                         \
    for (int64_t i = 0; i < dim; ++i) {                                                       \
        const uint32_t a = f32_bits(LOAD(x + i)) & 0x7FFFFFFFu;                               \
        top = a > top ? a : top;                                                              \
    }                                                                                         \
    float scale = bits_f32(top) / (fp8 ? 448.f : 127.f);                                      \
    scale = scale < FLT_MIN ? FLT_MIN : scale;                                                \
    *scale_out = scale;                                                                       \
    if (fp8) {                                                                                \
        for (int64_t i = 0; i < dim; ++i) out[i] = to_fp8(LOAD(x + i) / scale);               \
    } else {                                                                                  \
        for (int64_t i = 0; i < dim; ++i) out[i] = to_int8(LOAD(x + i) / scale);              \
    }                                                                                         \
    if (held) {                                                                               \
        for (int64_t i = 0; i < dim; ++i)                                                     \
            held[i] = STORE((fp8 ? fp8_value(out[i]) : (float)(int8_t)out[i]) * scale);       \
    }                                                                                         \
}

#define DEFINE_KV8_STORE(SUFFIX, T)                                                           \
int kv8_store_##SUFFIX(const T *k, const T *v, int64_t k_stride, int64_t v_stride, int64_t rows, \
                       int64_t heads, int64_t dim, uint8_t *pool, int64_t num_pages, int64_t page_bytes, \
                       int64_t scales_offset, const int64_t *pages, const int64_t *offsets, int64_t layer, \
                       int64_t page_size, int64_t fp8, T *held) {                             \
    for (int64_t r = 0; r < rows; ++r) {                                                      \
        if (pages[r] < 0 || pages[r] >= num_pages || offsets[r] < 0 || offsets[r] >= page_size) \
            return -1;                                                                        \
    }                                                                                         \
    _Pragma("omp parallel for schedule(static) if(rows * heads * dim >= 32768)")              \
    for (int64_t r = 0; r < rows; ++r) {                                                      \
        uint8_t *page = pool + pages[r] * page_bytes;                                         \
        float *scales = (float *)(page + scales_offset);                                      \
        for (int64_t c = 0; c < 2; ++c) {                                                     \
            const T *src = c ? v + r * v_stride : k + r * k_stride;                           \
            for (int64_t h = 0; h < heads; ++h) {                                             \
                const int64_t vec = ((layer * 2 + c) * heads + h) * page_size + offsets[r];   \
                quantize_##SUFFIX(src + h * dim, dim, (int)fp8, page + vec * dim, scales + vec,   \
                                  held ? held + ((r * 2 + c) * heads + h) * dim : NULL);       \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    return 0;                                                                                 \
}

DEFINE_QUANTIZE(bf16, uint16_t, load_bf16, store_bf16)
DEFINE_QUANTIZE(f32, float, load_f32, store_f32)
DEFINE_KV8_STORE(bf16, uint16_t)
DEFINE_KV8_STORE(f32, float)

#pragma GCC pop_options
