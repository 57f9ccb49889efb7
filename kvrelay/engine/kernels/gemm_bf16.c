/* Small-batch bfloat16 matmul for decode steps: out[M][N] = x[M][K] . W[N][K]^T (+ bias),
 * float32 accumulation, one rounding to bfloat16, on CPUs with AVX-512 BF16.
 *
 * Why: at M <= 64 rows oneDNN splits the work so that the two cores scale only 1.2-1.7x
 * over one (measured 200-300 GFLOPS here against ~170 on one core). This kernel splits
 * the columns between threads, so each weight byte is read from memory once, and every
 * thread runs the same register-blocked loop.
 *
 * Packed weight layout (gemm_pack_bf16): blocks of 16 output columns, then pairs of k:
 *     packed[n / 16][k / 2][n % 16][k % 2]
 * so one 64-byte vector holds 16 columns x 2 k, the operand of one vdpbf16ps. N is padded
 * to a multiple of 16 and K to a multiple of 2 with zeros.
 * Microkernel: MR rows x NB column blocks of accumulators (at most 8 x 3 = 24 registers);
 * per k pair, NB weight vectors are loaded and each row's (x[2k], x[2k+1]) is broadcast.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "worksteal.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

int gemm_bf16_available(void) { return 1; }

void gemm_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    const int64_t kp = (K + 1) / 2, nb = (N + 15) / 16;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t b = 0; b < nb; ++b)
        for (int64_t p = 0; p < kp; ++p)
            for (int64_t j = 0; j < 16; ++j)
                for (int64_t e = 0; e < 2; ++e) {
                    const int64_t n = b * 16 + j, k = 2 * p + e;
                    packed[((b * kp + p) * 16 + j) * 2 + e] = (n < N && k < K) ? w[n * K + k] : 0;
                }
}

#define MR_MAX 8
#define NB_MAX 3

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t K, const uint16_t *packed,
                                                       int64_t kp, int64_t b0, const float *bias, int64_t N,
                                                       void *out, int f32, int mr, int nb) {
    __m512 acc[MR_MAX * NB_MAX];
#pragma GCC unroll 24
    for (int i = 0; i < mr * nb; ++i) acc[i] = _mm512_setzero_ps();
    const uint16_t *wb = packed + b0 * kp * 32;
    const int64_t bstride = kp * 32;
    const int odd = (int)(K & 1);
    for (int64_t p = 0; p < kp - odd; ++p) {
        __m512bh w[NB_MAX];
#pragma GCC unroll 3
        for (int j = 0; j < nb; ++j) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wb + j * bstride + p * 32));
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) {
            uint32_t pair;
            memcpy(&pair, x + m * K + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 3
            for (int j = 0; j < nb; ++j) acc[m * nb + j] = _mm512_dpbf16_ps(acc[m * nb + j], xb, w[j]);
        }
    }
    if (odd) {  /* last k alone: its pair partner is the zero padding */
        const int64_t p = kp - 1;
        for (int m = 0; m < mr; ++m) {
            const uint32_t pair = x[m * K + 2 * p];
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < nb; ++j)
                acc[m * nb + j] = _mm512_dpbf16_ps(acc[m * nb + j], xb,
                                                   (__m512bh)_mm512_loadu_si512((const void *)(wb + j * bstride + p * 32)));
        }
    }
    for (int j = 0; j < nb; ++j) {
        const int64_t n0 = (b0 + j) * 16;
        const int64_t cols = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int m = 0; m < mr; ++m) {
            const __m512 r = _mm512_add_ps(acc[m * nb + j], bv);
            if (f32)
                _mm512_mask_storeu_ps((float *)out + m * N + n0, mask, r);
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
        }
    }
}

#define TILE_CASE(MR, NB) \
    tile(x + m0 * K, K, packed, kp, b0, bias, N, f32 ? (void *)((float *)out + m0 * N) : (void *)((uint16_t *)out + m0 * N), \
         f32, MR, NB)

static void tile_any(const uint16_t *x, int64_t K, const uint16_t *packed, int64_t kp, int64_t b0,
                     const float *bias, int64_t N, void *out, int f32, int64_t m0, int mr, int nb) {
    switch (nb * 16 + mr) {
#define ROWS(NB) case NB * 16 + 1: TILE_CASE(1, NB); break; case NB * 16 + 2: TILE_CASE(2, NB); break; \
    case NB * 16 + 3: TILE_CASE(3, NB); break; case NB * 16 + 4: TILE_CASE(4, NB); break;          \
    case NB * 16 + 5: TILE_CASE(5, NB); break; case NB * 16 + 6: TILE_CASE(6, NB); break;          \
    case NB * 16 + 7: TILE_CASE(7, NB); break; case NB * 16 + 8: TILE_CASE(8, NB); break;
    ROWS(1) ROWS(2) ROWS(3)
#undef ROWS
    default: break;
    }
}

/* Work a stolen unit of column groups holds, in flops (a 32-row decode step: one group
 * of K = 1,536, two of K = 576), and the threads that stealing keeps words for. */
#define UNIT_FLOPS 4000000
#define WORDS WS_MAX_THREADS

/* out [M][N] (row-major), bfloat16 or, when f32, the float32 sums unrounded; bias float32
 * [N] or NULL. Column groups of NB_MAX blocks are cut into one contiguous part per thread
 * of torch's OpenMP team; each thread runs every row block over a unit of groups, then
 * its part's next unit, then units from the backs of the others' (worksteal.h: a thread
 * preempted by the router or the client no longer holds the whole call up). Each column
 * is computed by one thread whatever the schedule, so the result is the same bits. */
void gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
               const float *bias, void *out, int f32) {
    if (M <= 0 || N <= 0) return;
    const int64_t kp = (K + 1) / 2, nblocks = (N + 15) / 16, groups = (nblocks + NB_MAX - 1) / NB_MAX;
    int64_t unit = UNIT_FLOPS / (2 * M * (K > 0 ? K : 1) * 16 * NB_MAX);
    if (unit < 1) unit = 1;
    uint64_t words[WORDS];
    const int64_t team = ws_team(), stealing = team > 0;
    if (stealing) ws_init(words, groups, team, unit);
    _Pragma("omp parallel if(groups > 1)")
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), steal = stealing && T == team;
        int64_t cursor = 0, lo, hi;
        while (ws_next(words, steal, groups, t, T, unit, &cursor, &lo, &hi))
            for (int64_t g = lo; g < hi; ++g) {
                const int64_t b0 = g * NB_MAX;
                const int nb = (int)(nblocks - b0 < NB_MAX ? nblocks - b0 : NB_MAX);
                for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                    const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
                    tile_any(x, K, packed, kp, b0, bias, N, out, f32, m0, mr, nb);
                }
            }
    }
}
#else
int gemm_bf16_available(void) { return 0; }
void gemm_pack_bf16(void) {}
void gemm_bf16(void) {}
#endif
