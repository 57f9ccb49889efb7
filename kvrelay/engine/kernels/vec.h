/* One float32 vector type for the AVX-512F and AVX2+FMA builds, so a kernel is written
 * once: V floats per vector, vf/vi, and the few operations the kernels use. Defines
 * KVRELAY_VEC when either is compiled in (builds without both export stubs instead).
 * bfloat16 is widened by shifts (WIDEN_LO/WIDEN_HI of 32-bit lanes holding two bf16):
 * no BF16 instructions. */
#ifndef KVRELAY_VEC_H
#define KVRELAY_VEC_H

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <stdint.h>
#define KVRELAY_VEC 1

#if defined(__AVX512F__)
#define V 16
typedef __m512 vf;
typedef __m512i vi;
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^n for integral float n in [-126, 127] */
#define VPOW2I(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, v) _mm512_storeu_ps(p, v)
#define VLOADI(p) _mm512_loadu_si512((const void *)(p))
#define WIDEN_LO(x) _mm512_castsi512_ps(_mm512_slli_epi32(x, 16))
#define WIDEN_HI(x) _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)))
/* V bfloat16 at p as float32. */
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vmaxall(vf v) { return _mm512_reduce_max_ps(v); }
static inline void vstore_n(float *p, vf v, int cnt) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << cnt) - 1u), v);
}
/* [sum of a's lanes, b's, c's, d's]. */
static inline __m128 vsum4(vf a, vf b, vf c, vf d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#else
#define V 8
typedef __m256 vf;
typedef __m256i vi;
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2I(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define VLOADF(p) _mm256_loadu_ps(p)
#define VSTOREF(p, v) _mm256_storeu_ps(p, v)
#define VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define WIDEN_LO(x) _mm256_castsi256_ps(_mm256_slli_epi32(x, 16))
#define WIDEN_HI(x) _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)))
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vmaxall(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline void vstore_n(float *p, vf v, int cnt) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, m, v);
}
static inline __m128 vsum4(vf a, vf b, vf c, vf d) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const __m256d x = _mm256_castps_pd(ab), y = _mm256_castps_pd(cd);
    const __m256 u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#endif

/* e^x for x clamped to [-87, 88] (the result stays a normal float): x = n ln2 + r, a
 * degree-6 polynomial of r (Cephes' expf), times 2^n; within 2 ulp of expf. */
static inline vf vexp(vf x) {
    x = VMIN(VMAX(x, VSET1(-87.f)), VSET1(88.f));
    const vf n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    vf r = VFMA(n, VSET1(-0.693359375f), x);
    r = VFMA(n, VSET1(2.12194440e-4f), r);
    vf y = VSET1(1.9875691500e-4f);
    y = VFMA(y, r, VSET1(1.3981999507e-3f));
    y = VFMA(y, r, VSET1(8.3334519073e-3f));
    y = VFMA(y, r, VSET1(4.1665795894e-2f));
    y = VFMA(y, r, VSET1(1.6666665459e-1f));
    y = VFMA(y, r, VSET1(5.0000001201e-1f));
    y = VFMA(y, VMUL(r, r), VADD(r, VSET1(1.f)));
    return VMUL(y, VPOW2I(n));
}

/* silu(x) = x / (1 + e^-x). */
static inline vf vsilu(vf x) { return VDIV(x, VADD(VSET1(1.f), vexp(VMUL(x, VSET1(-1.f))))); }

#endif
#endif
