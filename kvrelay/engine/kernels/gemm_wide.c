/* Small-batch float32 matmul for CPUs without AVX-512 BF16: out[M][N] = x[M][K] . W[N][K]^T
 * (+ bias), float32 activations, sums and output; the weight stored as bfloat16 (widened
 * in registers by a shift, no BF16 instructions) or as float32. AVX-512F or AVX2+FMA.
 *
 * Why: a decode step reads every weight once per step; at M <= 128 rows oneDNN and torch's
 * GEMV split the work so that the cores scale poorly, and a float32 weight is twice the
 * bytes of a bfloat16 one. Columns are split between threads (each weight byte is read by
 * one thread), every thread runs the same register-blocked loop over all rows.
 *
 * Packed layouts, V = floats per vector (16 on AVX-512, 8 on AVX2), column blocks of 2V:
 *   bf16: packed[n / 2V][k][2V] uint16, where 32-bit lane i of a k row holds column i in
 *         its low half and column V + i in its high half: `x << 16` widens columns
 *         0..V-1, `x & 0xFFFF0000` columns V..2V-1, one load for both;
 *   f32:  packed[n / 2V][k][2V] float, columns in order.
 * N is padded to a multiple of 2V with zero columns; bias (when given) must be padded too.
 * Microkernel: MR rows x NB blocks (2 NB vectors) of accumulators.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"
#include "worksteal.h"

#ifdef KVRELAY_VEC
#include <omp.h>

#if V == 16
#define MR_MAX 6
#define NB_MAX 2
#else
#define MR_MAX 6   /* 12 accumulators, 2 weight vectors and a broadcast: 15 of 16 registers */
#define NB_MAX 1
#endif
#define BLOCK (2 * V)
/* Rows a thread runs over its columns before the next rows: their float32 x, ROW_BYTES,
 * stays in L2 while the weight blocks stream past (at 2,048 rows, without it, x came from
 * L3 once per column block: 170-190 against 190-210 GFLOPS on a Zen 2). */
#define ROW_BYTES (256 * 1024)
/* Work a stolen unit of column blocks holds, in flops (a 32-row decode step: 1 block of
 * K = 1,536; one row: ~30 blocks), and the runs x threads that stealing keeps words for. */
#define UNIT_FLOPS 1000000
#define WORDS 2048

int gemm_wide_available(void) { return 1; }
int64_t gemm_wide_block(void) { return BLOCK; }

/* Packs w [N][K] (bfloat16 when bf16, else float32) into `packed` (layouts above). */
void gemm_wide_pack(const void *w, int64_t N, int64_t K, int bf16, void *packed) {
    const int64_t nb = (N + BLOCK - 1) / BLOCK;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t b = 0; b < nb; ++b)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < BLOCK; ++j) {
                const int64_t n = b * BLOCK + j;
                if (bf16) {
                    const int64_t at = j < V ? 2 * j : 2 * (j - V) + 1;
                    ((uint16_t *)packed)[(b * K + k) * BLOCK + at] = n < N ? ((const uint16_t *)w)[n * K + k] : 0;
                } else {
                    ((float *)packed)[(b * K + k) * BLOCK + j] = n < N ? ((const float *)w)[n * K + k] : 0.f;
                }
            }
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const void *packed, int64_t b0,
                                                       const float *bias, float *out, int64_t N, int mr, int nb,
                                                       int bf16, const char *pf, int64_t pf_every, int pf_lines) {
    vf acc[6 * 2 * NB_MAX];  /* ROW_CASES instantiates up to 6 rows */
#pragma GCC unroll 24
    for (int i = 0; i < mr * 2 * nb; ++i) acc[i] = VZERO();
    const int64_t bstride = K * BLOCK;
    const uint16_t *wh = (const uint16_t *)packed + b0 * bstride;
    const float *wf = (const float *)packed + b0 * bstride;
    int64_t cd = pf_every;
    for (int64_t k = 0; k < K; ++k) {
        vf w[2 * NB_MAX];
        if (--cd == 0) {   /* this tile's share of the next blocks (gemm_wide) */
            cd = pf_every;
            for (int e = 0; e < pf_lines; ++e) _mm_prefetch(pf + 64 * e, _MM_HINT_T1);
            pf += 64 * pf_lines;
        }
#pragma GCC unroll 4
        for (int j = 0; j < nb; ++j) {
            if (bf16) {
                const vi raw = VLOADI(wh + j * bstride + k * BLOCK);
                w[2 * j] = WIDEN_LO(raw);
                w[2 * j + 1] = WIDEN_HI(raw);
            } else {
                w[2 * j] = VLOADF(wf + j * bstride + k * BLOCK);
                w[2 * j + 1] = VLOADF(wf + j * bstride + k * BLOCK + V);
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) {
            const vf xb = VSET1(x[m * K + k]);
#pragma GCC unroll 4
            for (int j = 0; j < 2 * nb; ++j) acc[m * 2 * nb + j] = VFMA(xb, w[j], acc[m * 2 * nb + j]);
        }
    }
    for (int j = 0; j < 2 * nb; ++j) {
        const int64_t n0 = b0 * BLOCK + j * V;
        if (n0 >= N) break;
        const int cols = N - n0 < V ? (int)(N - n0) : V;
        const vf bv = bias ? VLOADF(bias + n0) : VZERO();
        for (int m = 0; m < mr; ++m) {
            const vf r = VADD(acc[m * 2 * nb + j], bv);
            if (cols == V)
                memcpy(out + m * N + n0, &r, sizeof r);
            else
                vstore_n(out + m * N + n0, r, cols);
        }
    }
}

#define TILE(MR, NB, BF) tile(x + m0 * K, K, packed, b0, bias, out + m0 * N, N, MR, NB, BF, pf, pf_every, pf_lines)
#define ROW_CASES(NB, BF) \
    case (BF * 4 + NB) * 16 + 1: TILE(1, NB, BF); break; case (BF * 4 + NB) * 16 + 2: TILE(2, NB, BF); break; \
    case (BF * 4 + NB) * 16 + 3: TILE(3, NB, BF); break; case (BF * 4 + NB) * 16 + 4: TILE(4, NB, BF); break; \
    case (BF * 4 + NB) * 16 + 5: TILE(5, NB, BF); break; case (BF * 4 + NB) * 16 + 6: TILE(6, NB, BF); break;

static void tile_any(const float *x, int64_t K, const void *packed, int64_t b0, const float *bias, float *out,
                     int64_t N, int64_t m0, int mr, int nb, int bf16, const char *pf, int64_t pf_every,
                     int pf_lines) {
    switch ((bf16 * 4 + nb) * 16 + mr) {
    ROW_CASES(1, 0) ROW_CASES(1, 1)
#if NB_MAX >= 2
    ROW_CASES(2, 0) ROW_CASES(2, 1)
#endif
    default: break;
    }
}

/* out [M][N] float32 (row-major) from x [M][K] float32 and a packed weight; bias float32
 * padded to a multiple of 2V, or NULL. Each thread takes an equal contiguous part of the
 * column blocks and runs a run of rows (ROW_BYTES of x) over them, then the next run;
 * a thread done with its part takes units (UNIT_FLOPS) from the others' (worksteal.h).
 * The rows of a run are cut into tiles of near-equal height (32 rows: 6,6,5,5,5,5, not
 * 6,6,6,6,6,2), since a short tile has too few accumulators to hide the FMA latency.
 * Weights stream from DRAM (a model's are larger than L3), so while a block runs its tiles
 * the next blocks are prefetched into L2, each tile its 1/tiles share, a line (or a few)
 * every pf_every steps of k: without it the first tile of each block waited for them
 * (a decode step's matmuls, 32 rows, Zen 2: 150 -> 165 GFLOPS); all of a block's lines
 * in its first tile instead of a share in each ran 8 rows at 113 against 124 GFLOPS. */
void gemm_wide(const float *x, int64_t M, int64_t K, const void *packed, int64_t N, int bf16,
               const float *bias, float *out) {
    if (M <= 0 || N <= 0) return;
    const int64_t nblocks = (N + BLOCK - 1) / BLOCK, esize = bf16 ? 2 : 4;
    int64_t run = ROW_BYTES / (K * (int64_t)sizeof(float)) / MR_MAX * MR_MAX;
    if (run < MR_MAX) run = MR_MAX;
    const int64_t nruns = (M + run - 1) / run;
    int64_t unit = (UNIT_FLOPS / (2 * (M < run ? M : run) * K * BLOCK) + NB_MAX - 1) / NB_MAX * NB_MAX;
    if (unit < NB_MAX) unit = NB_MAX;
    uint64_t words[WORDS];   /* run r's parts: words[r * team ..] */
    const int64_t team = ws_team(), stealing = team > 0 && nruns * team <= WORDS;
    if (stealing)
        for (int64_t r = 0; r < nruns; ++r) ws_init(words + r * team, nblocks, team, unit);
    _Pragma("omp parallel if(nblocks > 1)")
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), steal = stealing && T == team;
        for (int64_t r = 0, r0 = 0; r0 < M; ++r, r0 += run) {
            const int64_t rows = M - r0 < run ? M - r0 : run;
            const int64_t tiles = (rows + MR_MAX - 1) / MR_MAX, base = rows / tiles, extra = rows % tiles;
            /* each tile's prefetch share of the next NB_MAX blocks: `share` lines, pf_lines
             * of them every pf_every steps of k */
            const int64_t share = (NB_MAX * K * BLOCK * esize / tiles + 63) / 64;
            const int pf_lines = (int)((share + K - 1) / K);
            const int64_t pf_every = K / ((share + pf_lines - 1) / pf_lines);
            int64_t cursor = 0, lo, hi;
            while (ws_next(words + r * team, steal, nblocks, t, T, unit, &cursor, &lo, &hi)) {
                for (int64_t b0 = lo; b0 < hi; b0 += NB_MAX) {
                    const int nb = (int)(hi - b0 < NB_MAX ? hi - b0 : NB_MAX);
                    const char *next = (const char *)packed + (b0 + nb) * K * BLOCK * esize;
                    for (int64_t i = 0, m0 = r0; i < tiles; ++i) {
                        const int mr = (int)(base + (i < extra));
                        tile_any(x, K, packed, b0, bias, out, N, m0, mr, nb, bf16, next + i * share * 64, pf_every,
                                 pf_lines);
                        m0 += mr;
                    }
                }
            }
        }
    }
}
#else
int gemm_wide_available(void) { return 0; }
int64_t gemm_wide_block(void) { return 0; }
void gemm_wide_pack(void) {}
void gemm_wide(void) {}
#endif
