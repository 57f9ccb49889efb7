/* 2^x for x <= 0 on AVX-512F, the softmax numerators of the prefill-attention kernels
 * (prefill_attention_avx512.h, prefill_attention_amx.c): 2^round(x), applied by vscalefps
 * (which underflows to 0), times a degree-5 polynomial of the rest (|f| <= 1/2), within
 * 3.3e-6 relative: inside the ~16 bits (hi + lo bfloat16 parts) or 8 bits (bfloat16) the
 * probabilities keep. Inline, where a vectorized libm call (libmvec's expf) cost a call per
 * 16 scores. */
#ifndef KVRELAY_EXP2_AVX512_H
#define KVRELAY_EXP2_AVX512_H
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.3333558e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

#endif
#endif
