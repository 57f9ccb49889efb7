/* Prefill attention from the pool on AMX tiles, bfloat16 (Sapphire Rapids and later): the
 * same contract as paged_attention.c's paged_prefill_bf16, so the caller swaps one for the
 * other. Sequence b has kv_lens[b] keys in the pool; its last q_lens[b] positions are the
 * queries at rows q_rows[b].. of q, and each sees the keys up to its own position.
 *
 * Why: torch's flash kernel took 2.2-2.5 ms a layer for 8 prompts of 256 tokens (default
 * model, 2-core Emerald Rapids), and a pass with a cached prefix first gathered the pages
 * and ran it under a dense mask; the vdpbf16ps kernel took 6.1-6.9 ms. Here: 1.6 ms.
 *
 * Two phases in one parallel region:
 * 1. Pack, per (sequence, kv head), its keys and values from the pool into tile layouts,
 *    zero-padded to a multiple of 32 keys. Keys: per 16 keys and 32 dims, one B tile
 *    [16 dim pairs][16 keys][2]. Values: per 32 keys and 16 dims, one B tile
 *    [16 key pairs][16 dims][2].
 * 2. Items (sequence, query head, 16 query rows), the last rows of the longest sequences
 *    first (they read the most keys): scores = Q K^T on the tiles (float32), a softmax
 *    per row over the keys it sees, O = P V on the tiles, O / sum. P goes to the tiles as
 *    two bfloat16 parts, P's rounding and what it left (~16 bits of P against 8): with P
 *    rounded once, the default model's perplexity went from 28.680 (torch's flash kernel;
 *    float32: 28.690) to 28.738 and greedy answers agreed with float32's over 49.8% of
 *    their tokens against 57.4%; with both parts 28.722 and 58.0%, for 5% more time.
 *    A row's scores are all kept (16 x keys float32 per thread), so the prompt's length
 *    is bounded by memory, not by the kernel.
 * Tiles: C 0-3, A 4-5 (Q's two halves, or P's two parts), B 6-7, every tile 16 rows x 64
 * bytes.
 * Invariant: keys past a row's position never reach its softmax (the row's count of
 * visible keys bounds every read), and padded keys are zeros. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp2_avx512.h"
#include "vec.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define PA_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define PA_ROWS 16
#define PA_TILE 512   /* uint16 in one B tile: 16 rows x 32 */

int gemm_amx_available(void);   /* gemm_amx.c: asks Linux for the tile state once */

int paged_prefill_amx_available(void) { return gemm_amx_available(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} pa_config;

static PA_TARGET void pa_configure(void) {
    pa_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = PA_ROWS;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

static inline int64_t up32(int64_t n) { return (n + 31) & ~(int64_t)31; }

/* Keys and values of kv head h of one sequence (n keys, n32 = up32(n)) into kp and vp. */
static void pa_pack(const uint16_t *pool, const int64_t *pages, int64_t n, int64_t layer, int64_t L, int64_t H,
                    int64_t h, int64_t S, int64_t D, uint16_t *kp, uint16_t *vp) {
    const int64_t n32 = up32(n), dc = D / 32, dj = D / 16;
    memset(kp, 0, sizeof(uint16_t) * (size_t)(n32 * D));
    memset(vp, 0, sizeof(uint16_t) * (size_t)(n32 * D));
    const int64_t page_elems = L * 2 * H * S * D, kv_half = H * S * D;
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t *k = pool + pages[j / S] * page_elems + layer * 2 * kv_half + (h * S + j % S) * D;
        const uint16_t *v = k + kv_half;
        /* key j: dim pair p of chunk c goes to row p, column j % 16 of tile (j / 16, c) */
        uint32_t *kt = (uint32_t *)(kp + (j / 16) * dc * PA_TILE) + (j % 16);
        for (int64_t c = 0; c < dc; ++c)
            for (int64_t p = 0; p < 16; ++p)
                kt[c * (PA_TILE / 2) + p * 16] = ((const uint32_t *)k)[c * 16 + p];
        /* value j: dim d goes to row (j % 32) / 2, column d % 16, half j % 2 of tile (j / 32, d / 16) */
        uint16_t *vt = vp + (j / 32) * dj * PA_TILE + ((j % 32) / 2) * 32 + (j % 2);
        for (int64_t d = 0; d < D; ++d)
            vt[(d / 16) * PA_TILE + (d % 16) * 2] = v[d];
    }
}

/* Scratch of one thread: scores [16][n32max] float32, P [2][16][n32max] bf16 (its rounding,
 * then the rest), Q [16][D] bf16, O [16][D] float32. */
typedef struct {
    float *scores, *o;
    uint16_t *p, *q;
    int64_t stride;   /* n32max */
} pa_scratch;

/* Rows i0.. (r of them) of query head hq of one sequence: n keys, m queries (row i is
 * position n - m + i), kp/vp its kv head's packed keys and values. */
static PA_TARGET void pa_item(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t n,
                              int64_t m, int64_t i0, int r, int64_t D, float scale, const uint16_t *kp,
                              const uint16_t *vp, pa_scratch *s) {
    const int64_t dc = D / 32, dj = D / 16, W = s->stride;
    const int64_t first = n - m + i0;          /* position of row 0 */
    const int64_t nk = first + r, nk32 = up32(nk);
    for (int i = 0; i < PA_ROWS; ++i)
        if (i < r)
            memcpy(s->q + i * D, q + (i0 + i) * q_stride, sizeof(uint16_t) * (size_t)D);
        else
            memset(s->q + i * D, 0, sizeof(uint16_t) * (size_t)D);
    if (dc == 2) {
        _tile_loadd(4, s->q, D * 2);
        _tile_loadd(5, s->q + 32, D * 2);
    }
    for (int64_t kb = 0; kb < nk32; kb += 32) {
        _tile_zero(0);
        _tile_zero(1);
        const uint16_t *k0 = kp + (kb / 16) * dc * PA_TILE, *k1 = k0 + dc * PA_TILE;
        for (int64_t c = 0; c < dc; ++c) {
            if (dc != 2) _tile_loadd(4, s->q + c * 32, D * 2);
            _tile_loadd(6, k0 + c * PA_TILE, 64);
            _tile_loadd(7, k1 + c * PA_TILE, 64);
            if (dc == 2 && c == 1) {
                _tile_dpbf16ps(0, 5, 6);
                _tile_dpbf16ps(1, 5, 7);
            } else {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, s->scores + kb, W * 4);
        _tile_stored(1, s->scores + kb + 16, W * 4);
    }
    float sums[PA_ROWS];
    for (int i = 0; i < PA_ROWS; ++i) {
        float *row = s->scores + i * W;
        uint16_t *p = s->p + i * W;
        const int64_t seen = i < r ? first + i + 1 : 0;   /* keys row i sees */
        __m512 mx = _mm512_set1_ps(-3.0e38f);
        for (int64_t j = 0; j < seen; j += 16) {
            const __mmask16 k = seen - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - j)) - 1u);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-3.0e38f), k, row + j));
        }
        /* e^(scale (s - max)) = 2^(s l - max l), l = scale log2(e) */
        const float l = scale * 1.44269504088896341f;
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * l), sc = _mm512_set1_ps(l);
        __m512 acc = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j < seen; j += 16) {
            const int64_t left = seen - j;
            const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(k, exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), sc, top)));
            acc = _mm512_add_ps(acc, e);
            const __m256bh hi = _mm512_cvtneps_pbh(e);
            _mm256_storeu_si256((__m256i *)(p + j), (__m256i)hi);
            _mm256_storeu_si256((__m256i *)(p + PA_ROWS * W + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_cvtpbh_ps(hi))));
        }
        for (; j < nk32; j += 16) {
            _mm256_storeu_si256((__m256i *)(p + j), _mm256_setzero_si256());
            _mm256_storeu_si256((__m256i *)(p + PA_ROWS * W + j), _mm256_setzero_si256());
        }
        sums[i] = _mm512_reduce_add_ps(acc);
    }
    for (int64_t g = 0; g < dj; g += 4) {   /* 64 output dims at a time: C 0-3 */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < nk32; kb += 32) {
            const uint16_t *v = vp + (kb / 32) * dj * PA_TILE + g * PA_TILE;
            _tile_loadd(4, s->p + kb, W * 2);
            _tile_loadd(5, s->p + PA_ROWS * W + kb, W * 2);
            _tile_loadd(6, v, 64);
            _tile_loadd(7, v + PA_TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
            _tile_loadd(6, v + 2 * PA_TILE, 64);
            _tile_loadd(7, v + 3 * PA_TILE, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, s->o + g * 16, D * 4);
        _tile_stored(1, s->o + g * 16 + 16, D * 4);
        _tile_stored(2, s->o + g * 16 + 32, D * 4);
        _tile_stored(3, s->o + g * 16 + 48, D * 4);
    }
    for (int i = 0; i < r; ++i) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[i]);
        uint16_t *o = out + (i0 + i) * out_stride;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s->o + i * D + d), inv)));
    }
}

/* See paged_prefill_bf16 (paged_attention.c): the same arguments and result (0; -1 out of
 * memory; -2 a shape without a kernel: D not 64 or 128). */
PA_TARGET int paged_prefill_amx_bf16(const uint16_t *pool, const int64_t *page_table, const int64_t *kv_lens,
                                     const int64_t *q_lens, const int64_t *q_rows, const uint16_t *q, int64_t q_stride,
                                     uint16_t *out, int64_t B, int64_t max_pages, int64_t layer, int64_t L, int64_t H,
                                     int64_t G, int64_t S, int64_t D, float scale) {
    if (D != 64 && D != 128) return -2;
    int64_t longest = 32, packed = 0, items = 0;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * B + 1));   /* packed offset, first item */
    if (!first) return -1;
    int64_t *item0 = first + B;
    for (int64_t b = 0; b < B; ++b) {
        if (q_lens[b] > kv_lens[b] || q_lens[b] < 0) {
            free(first);
            return -2;
        }
        if (up32(kv_lens[b]) > longest) longest = up32(kv_lens[b]);
        first[b] = packed;
        packed += 2 * H * up32(kv_lens[b]) * D;
        item0[b] = items;
        items += H * G * ((q_lens[b] + PA_ROWS - 1) / PA_ROWS);
    }
    item0[B] = items;
    uint16_t *kv = aligned_alloc(64, sizeof(uint16_t) * (size_t)(packed + 32));
    if (!kv) {
        free(first);
        return -1;
    }
    int failed = 0;
    const int64_t out_stride = H * G * D;
    _Pragma("omp parallel reduction(|:failed)")
    {
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t w = 0; w < B * H; ++w) {
            const int64_t b = w / H, h = w % H, n32 = up32(kv_lens[b]);
            uint16_t *kp = kv + first[b] + 2 * h * n32 * D;
            pa_pack(pool, page_table + b * max_pages, kv_lens[b], layer, L, H, h, S, D, kp, kp + n32 * D);
        }
        pa_scratch s;
        s.stride = longest;
        s.scores = aligned_alloc(64, sizeof(float) * (size_t)(PA_ROWS * (longest + D)));
        s.p = aligned_alloc(64, sizeof(uint16_t) * (size_t)(PA_ROWS * (2 * longest + D)));
        if (!s.scores || !s.p) failed = 1;
        s.o = s.scores ? s.scores + PA_ROWS * longest : NULL;
        s.q = s.p ? s.p + 2 * PA_ROWS * longest : NULL;
        int configured = 0;
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t w = 0; w < items; ++w) {
            if (failed) continue;
            int64_t b = 0;   /* item w counts from the end: the last, longest rows first */
            const int64_t x = items - 1 - w;
            while (item0[b + 1] <= x) ++b;
            const int64_t blocks = (q_lens[b] + PA_ROWS - 1) / PA_ROWS, y = x - item0[b];
            const int64_t hq = y / blocks, i0 = (y % blocks) * PA_ROWS;
            const int r = q_lens[b] - i0 < PA_ROWS ? (int)(q_lens[b] - i0) : PA_ROWS;
            const int64_t n32 = up32(kv_lens[b]);
            const uint16_t *kp = kv + first[b] + 2 * (hq / G) * n32 * D;
            if (!configured) {
                pa_configure();
                configured = 1;
            }
            pa_item(q + q_rows[b] * q_stride + hq * D, q_stride, out + q_rows[b] * out_stride + hq * D, out_stride,
                    kv_lens[b], q_lens[b], i0, r, D, scale, kp, kp + n32 * D, &s);
        }
        if (configured) _tile_release();
        free(s.scores);
        free(s.p);
    }
    free(kv);
    free(first);
    return failed ? -1 : 0;
}
#else
int paged_prefill_amx_available(void) { return 0; }
int paged_prefill_amx_bf16(void) { return -2; }
#endif
