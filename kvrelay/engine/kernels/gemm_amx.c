/* The small-batch bfloat16 matmul of gemm_bf16.c on AMX tiles (Sapphire Rapids and later):
 * out[M][N] = x[M][K] . W[N][K]^T (+ bias), float32 accumulation, one rounding to bfloat16.
 *
 * Why: at 16-128 rows the vdpbf16ps kernel is bound by its multiply-adds, and oneDNN's
 * AMX matmul reaches 12-19 GB/s of weights on two cores (a 32-row decode step's matmuls:
 * 17 ms for 270 MB). On the tiles a step of 32 k costs 4 tile multiplies for 2 KB of
 * weights, so a call runs at the speed the weights stream from memory.
 *
 * The packed weight is gemm_bf16.c's, unchanged: packed[n / 16][k / 2][n % 16][k % 2].
 * Its 16 rows of k pairs starting at an even k0 / 2 are one B tile (16 k pairs x 16
 * columns, 64-byte rows, contiguous), so both kernels read the same bytes.
 * Requires K % 32 == 0 (Gemm.fits_tiles); the caller routes other shapes elsewhere.
 * Tiles: C 0-3 (rows 0-15 and 16-31 x column blocks j, j+1), A 4-5 (those rows of x),
 * B 6-7 (the two column blocks). A unit of work is one pair of column blocks, over every
 * row; threads split units with worksteal.h.
 *
 * SwiGLU (gemm_bf16_amx_swiglu): a gate-and-up weight packed with its blocks interleaved
 * (gate block j, then up block j: Gemm.pack_swiglu) gives each unit a gate block and its
 * up block, so the unit writes silu(gate) * up from the float32 sums: N / 2 columns out,
 * and no separate pass over the 2N-column product.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"
#include "worksteal.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define AMX_UNIT 1   /* column-block pairs a stolen unit holds */

/* 1 when the kernel is compiled in and the kernel lets this process use the tiles (the
 * caller has checked cpuid amx_bf16). Linux grants the tile state per process, once. */
int gemm_amx_available(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles for a block of rows: r0 (1-16) in tiles 0, 1, 4 and r1 (0-16) in 2, 3, 5. */
static AMX_TARGET void configure(int r0, int r1) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
}

/* out[m][n0 + i] = silu(g[m][i]) * u[m][i] for rows x 16 float32 sums (row stride 16). */
static inline void store_swiglu(const float *g, const float *u, int rows, int64_t n0, int64_t N, uint16_t *out) {
    for (int m = 0; m < rows; ++m) {
        const __m512 r = _mm512_mul_ps(vsilu(_mm512_loadu_ps(g + 16 * m)), _mm512_loadu_ps(u + 16 * m));
        _mm256_storeu_si256((__m256i *)(out + m * N + n0), (__m256i)_mm512_cvtneps_pbh(r));
    }
}

/* rows x 16 float32 sums in c (row stride 16) -> out rows, columns n0.. (cols of them). */
static inline void store_block(const float *c, int rows, const float *bias, int64_t n0, int cols,
                               int64_t N, void *out, int f32) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m) {
        const __m512 r = _mm512_add_ps(_mm512_loadu_ps(c + 16 * m), bv);
        if (f32)
            _mm512_mask_storeu_ps((float *)out + m * N + n0, mask, r);
        else
            _mm256_mask_storeu_epi16((uint16_t *)out + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
    }
}

/* Rows [m0, m0 + r0 + r1) of column blocks b, b + 1 (just b when !two); tiles configured.
 * swiglu: b is a gate block and b + 1 its up block; out has N / 2 bfloat16 columns. */
static AMX_TARGET void block(const uint16_t *x, int64_t m0, int r0, int r1, int64_t K, const uint16_t *packed,
                             int64_t b, int two, const float *bias, int64_t N, void *out, int f32, int swiglu) {
    const int64_t kp = K / 2;
    const uint16_t *w0 = packed + b * kp * 32, *w1 = w0 + kp * 32;
    const uint16_t *x0 = x + m0 * K, *x1 = x0 + 16 * K;
    const int64_t xs = K * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (r1) { _tile_zero(2); _tile_zero(3); }
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        _tile_loadd(6, w0 + k0 * 16, 64);
        _tile_loadd(4, x0 + k0, xs);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + k0 * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (r1) {
            _tile_loadd(5, x1 + k0, xs);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float c[4][256];
    _tile_stored(0, c[0], 64);
    if (two) _tile_stored(1, c[1], 64);
    if (r1) {
        _tile_stored(2, c[2], 64);
        if (two) _tile_stored(3, c[3], 64);
    }
    if (swiglu) {
        uint16_t *o = (uint16_t *)out + m0 * (N / 2);
        store_swiglu(c[0], c[1], r0, b * 8, N / 2, o);
        if (r1) store_swiglu(c[2], c[3], r1, b * 8, N / 2, o + 16 * (N / 2));
        return;
    }
    for (int j = 0; j < 1 + two; ++j) {
        const int64_t n0 = (b + j) * 16;
        const int cols = N - n0 < 16 ? (int)(N - n0) : 16;
        store_block(c[j], r0, bias, n0, cols, N,
                    f32 ? (void *)((float *)out + m0 * N) : (void *)((uint16_t *)out + m0 * N), f32);
        if (r1)
            store_block(c[2 + j], r1, bias, n0, cols, N,
                        f32 ? (void *)((float *)out + (m0 + 16) * N) : (void *)((uint16_t *)out + (m0 + 16) * N), f32);
    }
}

static AMX_TARGET void run(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                           const float *bias, void *out, int f32, int swiglu) {
    const int64_t nblocks = (N + 15) / 16, units = (nblocks + 1) / 2;
    uint64_t words[WS_MAX_THREADS];
    const int64_t team = ws_team();
    if (team > 0) ws_init(words, units, team, AMX_UNIT);
    _Pragma("omp parallel if(units > 1)")
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int steal = team > 0 && nt == team;
        int64_t cursor = 0, u0, u1;
        int cfg0 = 0, cfg1 = -1;
        while (ws_next(words, steal, units, t, nt, AMX_UNIT, &cursor, &u0, &u1))
            for (int64_t u = u0; u < u1; ++u)
                for (int64_t m0 = 0; m0 < M; m0 += 32) {
                    const int r0 = M - m0 < 16 ? (int)(M - m0) : 16;
                    const int r1 = M - m0 - 16 <= 0 ? 0 : (M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16);
                    if (r0 != cfg0 || r1 != cfg1) {
                        configure(r0, r1);
                        cfg0 = r0;
                        cfg1 = r1;
                    }
                    block(x, m0, r0, r1, K, packed, 2 * u, 2 * u + 1 < nblocks, bias, N, out, f32, swiglu);
                }
        if (cfg1 >= 0) _tile_release();
    }
}

/* out [M][N] (row-major), bfloat16 or, when f32, the float32 sums unrounded; bias float32
 * [N] or NULL. K % 32 == 0 and gemm_amx_available() returned 1. */
void gemm_bf16_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                   const float *bias, void *out, int f32) {
    run(x, M, K, packed, N, bias, out, f32, 0);
}

/* out [M][N / 2] bfloat16: silu(gate) * up of a weight [N][K] packed by
 * Gemm.pack_swiglu. N % 32 == 0, K % 32 == 0, gemm_amx_available() returned 1. */
void gemm_bf16_amx_swiglu(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                          uint16_t *out) {
    run(x, M, K, packed, N, NULL, out, 0, 1);
}
#else
int gemm_amx_available(void) { return 0; }
void gemm_bf16_amx(void) {}
void gemm_bf16_amx_swiglu(void) {}
#endif
