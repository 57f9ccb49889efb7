/* Small-batch matmul over quantized weights: out[M][N] = x[M][K] . W[N][K]^T (+ bias),
 * x float32 or bfloat16, W 8-bit or 4-bit with float scales, the weights never widened
 * to floats in memory: decode is bound by memory bandwidth, and 4-bit weights are a
 * quarter of bfloat16's bytes.
 *
 * Activations are quantized on the fly, per row and block of QB=32 k, to int8 with a
 * float scale dx (x ~ dx * xq) and xs = dx * sum(xq) (as llama.cpp's Q8_1), so that each
 * block's dot product is integer: vpdpbusd on AVX-512 VNNI, vpmaddubsw on AVX2.
 *
 * Weight formats (`mode`), k in blocks of QB, groups of `gb` blocks share a scale:
 *   0  8-bit, one float32 scale per output column:   w = d[n] * q,        q in [-128, 127]
 *   1  8-bit, fp16 scale per group and column:       w = d[g][n] * q      (GGUF Q8_0)
 *   2  4-bit, fp16 scale and min per group/column:   w = d[g][n] * q + mn (Q4_0, Q4_1, Q4_K, int4)
 * Packed layout (kvrelay/engine/models/quant_linear.py packs it), blocks of 16 columns:
 *   8-bit bytes  w[n/16][kb][t<8][n%16][j<4] = q[n][32kb + 4t + j] + 128
 *   4-bit bytes  w[n/16][kb][t<4][n%16][j<4] = q[n][32kb+8t+j] | q[n][32kb+8t+4+j] << 4
 *   scales       mode 0: float d[Np];  mode 1: fp16 d[n/16][g][n%16];
 *                mode 2: fp16 [n/16][g][2][n%16] (d, then mn)
 * so one 64-byte row t holds 16 columns x 4 k, the operand of one vpdpbusd whose other
 * operand is 4 activation bytes broadcast. N is padded to 16 and K to gb * QB with q = 0.
 *
 * vpdpbusd multiplies unsigned by signed bytes: the 8-bit weights are stored +128 and
 * the offset is taken back as 128 * xs per block. AVX2 has no vpdpbusd; vpmaddubsw
 * saturates 16-bit pair sums, so the 8-bit path multiplies |w| by x carrying w's sign
 * (<= 2 * 128 * 127 per pair), and the 4-bit one sums 8 pairs (<= 8 * 2 * 15 * 127) in
 * 16 bits before widening once per block.
 *
 * Threads split the column blocks in contiguous ranges (each weight byte is read by one
 * thread once); each runs MR rows x NB column blocks at a time over all of K, and at each
 * kb prefetches the next tile's bytes at that kb into L2 (one tile ahead, at the rate this
 * one reads): int4 decode steps of the default model, one row, spent 5.8-6.0 ms in these
 * matmuls against 6.0-6.5 without it (avx2, Zen 2).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 32

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QG_NATIVE 1
typedef __m512i vi;
typedef __m512 vf;
#define VL 16       /* float lanes = columns per vector */
#define VPB 1       /* vectors per 16-column block */
#define MR_MAX 4
#define NB_MAX 2    /* column blocks per tile, several rows */
#define NB_ONE 4    /* column blocks per tile, one row: more loads in flight */
#define U8_OFFSET 1
static inline vi ld(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi zi(void) { return _mm512_setzero_si512(); }
static inline vf zf(void) { return _mm512_setzero_ps(); }
static inline vi bc32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline vi nib_lo(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vi nib_hi(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
static inline vi dot4(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
static inline vi fin4(vi acc) { return acc; }
static inline void prep8(vi v, vi *a, vi *b) { *a = v; *b = v; }
static inline vi dot8(vi acc, vi a, vi b, vi x) { (void)b; return _mm512_dpbusd_epi32(acc, a, x); }
static inline vf cvt(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vf fmaf_(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf fmsf_(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
static inline vf mulf(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf subf(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf set1f(float v) { return _mm512_set1_ps(v); }
static inline vf ldh(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf ldf(const float *p) { return _mm512_loadu_ps(p); }
static inline void stf(float *p, vf v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QG_NATIVE 1
typedef __m256i vi;
typedef __m256 vf;
#define VL 8
#define VPB 2
#define MR_MAX 3    /* 16 ymm registers: 2 x MR accumulators per block */
#define NB_MAX 1
#define NB_ONE 2
#define U8_OFFSET 0
static inline vi ld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi zi(void) { return _mm256_setzero_si256(); }
static inline vf zf(void) { return _mm256_setzero_ps(); }
static inline vi bc32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline vi nib_lo(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline vi nib_hi(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
static inline vi dot4(vi acc, vi w, vi x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
static inline vi fin4(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
static inline void prep8(vi v, vi *a, vi *b) {
    *b = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));  /* q as signed */
    *a = _mm256_abs_epi8(*b);
}
static inline vi dot8(vi acc, vi a, vi b, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(x, b)),
                                                   _mm256_set1_epi16(1)));
}
static inline vf cvt(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vf fmaf_(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf fmsf_(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
static inline vf mulf(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf subf(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf set1f(float v) { return _mm256_set1_ps(v); }
static inline vf ldh(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf ldf(const float *p) { return _mm256_loadu_ps(p); }
static inline void stf(float *p, vf v) { _mm256_storeu_ps(p, v); }
#endif

#ifdef QG_NATIVE
#include "worksteal.h"

/* Multiply-adds a stolen unit of column blocks holds (one row: 16 blocks at K = 576). */
#define UNIT_MACS 150000

typedef struct {
    const int8_t *xq;     /* [M][Kp] */
    const float *dx, *xs; /* [M][KB] */
    const uint8_t *w;
    const void *sc;
    const float *bias;
    void *out;
    int64_t M, N, Kp, KB, G, gb;
    int obf16;
} Job;

int gemm_quant_available(void) { return 1; }

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row m, block b of x -> xq (zero past K), dx, xs. */
static void quant_block(const void *x, int xbf16, int64_t K, int64_t m, int64_t b, const Job *J) {
    float v[QB];
    const int64_t k0 = b * QB;
    for (int i = 0; i < QB; ++i) {
        const int64_t k = k0 + i;
        v[i] = k >= K ? 0.0f : xbf16 ? from_bf16(((const uint16_t *)x)[m * K + k]) : ((const float *)x)[m * K + k];
    }
    float amax = 0.0f;
    for (int i = 0; i < QB; ++i) amax = v[i] > amax ? v[i] : -v[i] > amax ? -v[i] : amax;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t *q = (int8_t *)J->xq + m * J->Kp + k0;
    int sum = 0;
    for (int i = 0; i < QB; ++i) {
        const float s = v[i] * id;
        const int r = (int)(s + (s >= 0.0f ? 0.5f : -0.5f));
        q[i] = (int8_t)r;
        sum += r;
    }
    ((float *)J->dx)[m * J->KB + b] = amax / 127.0f;
    ((float *)J->xs)[m * J->KB + b] = amax / 127.0f * (float)sum;
}

#define JV_MAX (NB_ONE * VPB)


/* Rows m0..m0+mr, column blocks b0..b0+nb; mode, mr, nb are constants after inlining. */
static inline __attribute__((always_inline)) void tile(const Job *J, int64_t m0, int64_t b0, const int mode,
                                                       const int mr, const int nb) {
    const int nv = nb * VPB;
    const int64_t KB = J->KB, Kp = J->Kp;
    const int64_t bbytes = mode == 2 ? QB * 16 / 2 : QB * 16;  /* bytes per block of 16 columns x QB k */
    vf acc[MR_MAX * JV_MAX];
    vi is[MR_MAX * JV_MAX];
#pragma GCC unroll 16
    for (int i = 0; i < mr * nv; ++i) acc[i] = zf();
    for (int64_t kb = 0; kb < KB; ++kb) {
#pragma GCC unroll 16
        for (int i = 0; i < mr * nv; ++i) is[i] = zi();
        const int8_t *xb = J->xq + m0 * Kp + kb * QB;
        /* the next tile's blocks at this kb into L2: one tile ahead, at the rate this one reads */
#pragma GCC unroll 4
        for (int j = 0; j < nb; ++j)
#pragma GCC unroll 8
            for (int64_t t = 0; t < bbytes; t += 64)
                _mm_prefetch((const char *)J->w + ((b0 + nb + j) * KB + kb) * bbytes + t, _MM_HINT_T1);
        if (mode == 2) {
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) {
                vi lo[JV_MAX], hi[JV_MAX];
#pragma GCC unroll 8
                for (int v = 0; v < nv; ++v) {
                    const vi r = ld(J->w + ((b0 + v / VPB) * KB + kb) * bbytes + t * 64 + (v % VPB) * (64 / VPB));
                    lo[v] = nib_lo(r);
                    hi[v] = nib_hi(r);
                }
#pragma GCC unroll 4
                for (int m = 0; m < mr; ++m) {
                    const vi xl = bc32(xb + m * Kp + 8 * t), xh = bc32(xb + m * Kp + 8 * t + 4);
#pragma GCC unroll 8
                    for (int v = 0; v < nv; ++v) is[m * nv + v] = dot4(dot4(is[m * nv + v], lo[v], xl), hi[v], xh);
                }
            }
        } else {
#pragma GCC unroll 8
            for (int t = 0; t < 8; ++t) {
                vi a[JV_MAX], s[JV_MAX];
#pragma GCC unroll 8
                for (int v = 0; v < nv; ++v) {
                    const vi r = ld(J->w + ((b0 + v / VPB) * KB + kb) * bbytes + t * 64 + (v % VPB) * (64 / VPB));
                    prep8(r, &a[v], &s[v]);
                }
#pragma GCC unroll 4
                for (int m = 0; m < mr; ++m) {
                    const vi xv = bc32(xb + m * Kp + 4 * t);
#pragma GCC unroll 8
                    for (int v = 0; v < nv; ++v) is[m * nv + v] = dot8(is[m * nv + v], a[v], s[v], xv);
                }
            }
        }
        const int64_t g = kb / J->gb;
        const float *dx = J->dx + m0 * KB + kb, *xs = J->xs + m0 * KB + kb;
#pragma GCC unroll 8
        for (int v = 0; v < nv; ++v) {
            const int64_t blk = b0 + v / VPB, h = (v % VPB) * VL;
            if (mode == 0) {
#pragma GCC unroll 4
                for (int m = 0; m < mr; ++m)
                    acc[m * nv + v] = fmaf_(cvt(is[m * nv + v]), set1f(dx[m * KB]), acc[m * nv + v]);
            } else if (mode == 1) {
                const vf d = ldh((const uint16_t *)J->sc + (blk * J->G + g) * 16 + h);
#pragma GCC unroll 4
                for (int m = 0; m < mr; ++m) {
                    const vf c = U8_OFFSET ? fmsf_(cvt(is[m * nv + v]), set1f(dx[m * KB]), set1f(128.0f * xs[m * KB]))
                                           : mulf(cvt(is[m * nv + v]), set1f(dx[m * KB]));
                    acc[m * nv + v] = fmaf_(c, d, acc[m * nv + v]);
                }
            } else {
                const uint16_t *sp = (const uint16_t *)J->sc + (blk * J->G + g) * 32 + h;
                const vf d = ldh(sp), mn = ldh(sp + 16);
#pragma GCC unroll 4
                for (int m = 0; m < mr; ++m) {
                    const vf c = fmaf_(cvt(fin4(is[m * nv + v])), mulf(d, set1f(dx[m * KB])), acc[m * nv + v]);
                    acc[m * nv + v] = fmaf_(mn, set1f(xs[m * KB]), c);
                }
            }
        }
    }
    for (int v = 0; v < nv; ++v) {
        const int64_t n0 = (b0 + v / VPB) * 16 + (v % VPB) * VL;
        if (n0 >= J->N) continue;
        const int cols = J->N - n0 < VL ? (int)(J->N - n0) : VL;
        for (int m = 0; m < mr; ++m) {
            vf r = acc[m * nv + v];
            if (mode == 0) {
                if (U8_OFFSET) {
                    float xsum = 0.0f;
                    for (int64_t b = 0; b < KB; ++b) xsum += J->xs[(m0 + m) * KB + b];
                    r = subf(r, set1f(128.0f * xsum));
                }
                r = mulf(r, ldf((const float *)J->sc + n0));
            }
            float tmp[VL];
            stf(tmp, r);
            const int64_t o = (m0 + m) * J->N + n0;
            for (int c = 0; c < cols; ++c) {
                const float y = tmp[c] + (J->bias ? J->bias[n0 + c] : 0.0f);
                if (J->obf16)
                    ((uint16_t *)J->out)[o + c] = to_bf16(y);
                else
                    ((float *)J->out)[o + c] = y;
            }
        }
    }
}

#define TILE(MODE, MR, NB) tile(J, m0, b0, MODE, MR, NB)
#define ROWS(MODE, NB)                                                                 \
    switch (mr) {                                                                      \
    case 2: TILE(MODE, 2, NB); break;                                                  \
    MORE_ROWS(MODE, NB)                                                                \
    default: break;                                                                    \
    }
#if MR_MAX == 4
#define MORE_ROWS(MODE, NB) case 3: TILE(MODE, 3, NB); break; case 4: TILE(MODE, 4, NB); break;
#else
#define MORE_ROWS(MODE, NB) case 3: TILE(MODE, 3, NB); break;
#endif
#if NB_ONE > 2
#define WIDE(MODE) case 3: TILE(MODE, 1, 3); break; case 4: TILE(MODE, 1, 4); break;
#else
#define WIDE(MODE)
#endif
#if NB_MAX > 1
#define WIDE_ROWS(MODE) ROWS(MODE, NB_MAX)
#else
#define WIDE_ROWS(MODE)
#endif
/* mr <= MR_MAX (3 or 4); nb <= NB_MAX, or nb <= NB_ONE when mr == 1 */
#define DISPATCH(MODE)                                                                 \
    if (mr == 1) {                                                                     \
        switch (nb) { case 1: TILE(MODE, 1, 1); break; case 2: TILE(MODE, 1, 2); break; \
                      WIDE(MODE) default: break; }                                     \
    } else if (nb == 1) {                                                              \
        ROWS(MODE, 1)                                                                  \
    } else {                                                                           \
        WIDE_ROWS(MODE)                                                                \
    }

static void tile_mode(const Job *J, int64_t m0, int64_t b0, int mode, int mr, int nb) {
    if (mode == 0) {
        DISPATCH(0)
    } else if (mode == 1) {
        DISPATCH(1)
    } else {
        DISPATCH(2)
    }
}

/* x [M][K] float32 or (xbf16) bfloat16 -> out [M][N] float32 or (obf16) bfloat16; w and
 * sc packed as above for `mode`, with groups of gb blocks; bias float32 [N] or NULL.
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int gemm_quant(const void *x, int xbf16, int64_t M, int64_t K, const uint8_t *w, const void *sc, int mode,
               int64_t gb, int64_t N, const float *bias, void *out, int obf16) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t G = (K + QB * gb - 1) / (QB * gb), KB = G * gb, Kp = KB * QB;
    int8_t *xq = (int8_t *)malloc((size_t)(M * Kp));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * KB));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * KB));
    if (!xq || !dx || !xs) {
        free(xq), free(dx), free(xs);
        return -1;
    }
    const Job job = {xq, dx, xs, w, sc, bias, out, M, N, Kp, KB, G, gb, obf16};
    const Job *J = &job;
    const int64_t nblocks = (N + 15) / 16;
    const int nbmax = M == 1 ? NB_ONE : NB_MAX;
    /* a stolen unit (worksteal.h): whole tiles of column blocks, about UNIT_MACS */
    int64_t unit = (UNIT_MACS / (M * Kp * 16) + nbmax - 1) / nbmax * nbmax;
    if (unit < nbmax) unit = nbmax;
    uint64_t words[WS_MAX_THREADS];
    const int64_t team = ws_team();
    if (team > 0) ws_init(words, nblocks, team, unit);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * KB; ++i) quant_block(x, xbf16, K, i / KB, i % KB, J);
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int steal = team > 0 && nt == team;
        int64_t cursor = 0, lo, hi;
        while (ws_next(words, steal, nblocks, tid, nt, unit, &cursor, &lo, &hi))
            for (int64_t b0 = lo; b0 < hi; b0 += nbmax) {
                const int nb = (int)(hi - b0 < nbmax ? hi - b0 : nbmax);
                for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                    const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
                    tile_mode(J, m0, b0, mode, mr, nb);
                }
            }
    }
    free(xq), free(dx), free(xs);
    return 0;
}
#else
int gemm_quant_available(void) { return 0; }
int gemm_quant(void) { return -2; }
#endif
