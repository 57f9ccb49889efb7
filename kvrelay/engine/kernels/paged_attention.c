/* Decode attention straight from the paged KV pool: one query token per sequence, keys
 * and values read once, in place, from the page-major layout of kvrelay.core.kvlayout:
 *     pool[page][layer][k|v][kv_head][slot][dim]
 * Work item w = (sequence w / H, kv head w % H) covers that kv head's G query heads and
 * writes only its own output rows; items in [lo, hi) are spread over OpenMP threads, a
 * thread done with its part taking DEC_UNIT items at a time from the others' (worksteal.h).
 * Built with -fopenmp and loaded after torch, the library binds to torch's libgomp (same
 * soname), so these threads are torch's own team, not a second one competing for cores.
 * Scores are computed in float32 in a first pass, softmax-normalised, then used to
 * accumulate values in a second pass. Head dims 64 and 128 get fixed-size inner loops:
 * vector items on the AVX-512F and AVX2 builds (paged_attention_f32.h), scalar ones
 * elsewhere.
 * On CPUs with AVX-512 BF16 the bfloat16 path (paged_attention_avx512.h) takes 16 keys
 * at a time: bf16 dot products, one shuffle tree per 16 scores, float32 accumulation.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "worksteal.h"
#include "paged_attention_avx512.h"
#include "prefill_attention_avx512.h"
#include "paged_attention_f32.h"
#include "prefill_attention_f32.h"
#include "prefill_plan.h"

#define MAX_GROUP 16
#define DEC_UNIT 2   /* work items a stolen unit holds (worksteal.h) */

/* One work item, head dim DIM (a constant when specialised); the pool holds T, q and out TQ. */
#define DEFINE_ITEM(NAME, T, LOAD, TQ, LOADQ, STOREQ, DIM)                                    \
static void NAME(const T *pool, const int64_t *pages, int64_t n, const TQ *q, TQ *out,       \
                 int64_t layer, int64_t L, int64_t H, int64_t h, int64_t G, int64_t S,       \
                 float scale, float *scores, const int64_t *next_pages, int64_t next_n,      \
                 int64_t next_h) {                                                           \
    (void)next_pages; (void)next_n; (void)next_h;                                            \
    float qf[MAX_GROUP * DIM], acc[MAX_GROUP * DIM], row[DIM];                               \
    const int64_t page_stride = L * 2 * H * S * DIM, head_stride = S * DIM;                  \
    for (int64_t i = 0; i < G * DIM; ++i) qf[i] = LOADQ(q + i) * scale;                      \
    for (int64_t t = 0; t < n; ++t) {                                                        \
        const T *k = pool + pages[t / S] * page_stride + (layer * 2 * H + h) * head_stride   \
                     + (t % S) * DIM;                                                        \
        for (int64_t d = 0; d < DIM; ++d) row[d] = LOAD(k + d);                              \
        for (int64_t g = 0; g < G; ++g) {                                                    \
            float dot = 0.f;                                                                 \
            for (int64_t d = 0; d < DIM; ++d) dot += qf[g * DIM + d] * row[d];               \
            scores[g * n + t] = dot;                                                         \
        }                                                                                    \
    }                                                                                        \
    for (int64_t g = 0; g < G; ++g) dec_softmax(scores + g * n, n);                          \
    for (int64_t i = 0; i < G * DIM; ++i) acc[i] = 0.f;                                      \
    for (int64_t t = 0; t < n; ++t) {                                                        \
        const T *v = pool + pages[t / S] * page_stride + ((layer * 2 + 1) * H + h)            \
                     * head_stride + (t % S) * DIM;                                          \
        for (int64_t d = 0; d < DIM; ++d) row[d] = LOAD(v + d);                              \
        for (int64_t g = 0; g < G; ++g) {                                                    \
            const float p = scores[g * n + t];                                               \
            for (int64_t d = 0; d < DIM; ++d) acc[g * DIM + d] += p * row[d];                \
        }                                                                                    \
    }                                                                                        \
    for (int64_t i = 0; i < G * DIM; ++i) out[i] = STOREQ(acc[i]);                           \
}

/* FAST: whether T is bfloat16 and the AVX-512 BF16 item is compiled in; else ITEM(64) and
 * ITEM(128) are the items for those head dims, SCRATCH(G, n) their score floats. The pool
 * holds T; q and out hold TQ (float32 over a bfloat16 pool: `--kv-cache-dtype bfloat16`
 * under float32 compute). */
#define DEFINE_KERNEL(NAME, T, TQ, FAST, ITEM, SCRATCH)                                       \
int NAME(const T *pool, const int64_t *page_table, const int64_t *kv_lens, const TQ *q, TQ *out, \
         int64_t max_pages, int64_t layer, int64_t L, int64_t H, int64_t G, int64_t S,       \
         int64_t D, float scale, int64_t lo, int64_t hi) {                                   \
    if ((D != 64 && D != 128) || G > MAX_GROUP) return -2;                                   \
    int64_t longest = 1;                                                                     \
    for (int64_t w = lo; w < hi; ++w)                                                        \
        if (kv_lens[w / H] > longest) longest = kv_lens[w / H];                              \
    int failed = 0;                                                                          \
    uint64_t words[WS_MAX_THREADS];                                                          \
    const int64_t team = ws_team(), n = hi - lo;                                             \
    if (team > 0) ws_init(words, n, team, DEC_UNIT);                                         \
    _Pragma("omp parallel reduction(|:failed)")                                              \
    {                                                                                        \
        float *scores = malloc(sizeof(float) * (size_t)((FAST) ? FAST_SCRATCH(G, longest)    \
                                                               : SCRATCH(G, longest)));      \
        if (!scores) failed = 1;                                                             \
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();                 \
        const int steal = team > 0 && nt == team;                                            \
        int64_t cursor = 0, i0, i1;                                                          \
        while (ws_next(words, steal, n, t, nt, DEC_UNIT, &cursor, &i0, &i1))                 \
        for (int64_t w = lo + i0; w < lo + i1; ++w) {                                        \
            if (failed) continue;                                                            \
            const int64_t b = w / H, h = w % H, off = ((b * H + h) * G) * D;                 \
            /* the item this thread most likely takes next (its part's units go front to    \
             * back, so past this unit's end too), whose rows the item prefetches; one      \
             * another thread took is only a wasted prefetch */                             \
            const int64_t nw = w + 1 < hi ? w + 1 : -1;                                       \
            const int64_t *np = nw < 0 ? 0 : page_table + (nw / H) * max_pages;              \
            const int64_t nn = nw < 0 ? 0 : kv_lens[nw / H];   /* <= longest: nw < hi */     \
            if (FAST)                                                                        \
                FAST_ITEM(pool, page_table + b * max_pages, kv_lens[b], q + off, out + off,   \
                          layer, L, H, h, G, S, D, scale, scores, np, nn, nw % H);            \
            else if (D == 64)                                                                \
                ITEM(64)(pool, page_table + b * max_pages, kv_lens[b], q + off, out + off,    \
                         layer, L, H, h, G, S, scale, scores, np, nn, nw % H);               \
            else                                                                             \
                ITEM(128)(pool, page_table + b * max_pages, kv_lens[b], q + off, out + off,   \
                          layer, L, H, h, G, S, scale, scores, np, nn, nw % H);              \
        }                                                                                    \
        free(scores);                                                                        \
    }                                                                                        \
    return failed ? -1 : 0;                                                                  \
}

#ifdef KVRELAY_FAST_DECODE
#define FAST_SCRATCH(G, n) fast_scratch_floats(G, n)
#define FAST_ITEM(pool, pages, n, q, out, ...) \
    fast_item((const uint16_t *)(pool), pages, n, (const uint16_t *)(q), (uint16_t *)(out), __VA_ARGS__)
#define BF16_FAST 1
#else
#define FAST_SCRATCH(G, n) 0
#define FAST_ITEM(...) (void)0
#define BF16_FAST 0
#endif

/* Every (pool, query) pair and head dim, through DEFINE with the pool loads F32 and BF16. */
#define DEC_ITEMS(DEFINE, F32, BF16)                                                \
    DEFINE(dec_f32_64, float, F32, float, F32_LOAD, F32_STORE, 64)                  \
    DEFINE(dec_f32_128, float, F32, float, F32_LOAD, F32_STORE, 128)                \
    DEFINE(dec_bf16_64, uint16_t, BF16, uint16_t, bf16_load, bf16_round, 64)        \
    DEFINE(dec_bf16_128, uint16_t, BF16, uint16_t, bf16_load, bf16_round, 128)      \
    DEFINE(dec_mixed_64, uint16_t, BF16, float, F32_LOAD, F32_STORE, 64)            \
    DEFINE(dec_mixed_128, uint16_t, BF16, float, F32_LOAD, F32_STORE, 128)
#ifdef KVRELAY_VEC   /* paged_attention_f32.h: vector items, bfloat16 widened on load */
DEC_ITEMS(DEFINE_DEC_ITEM, VLOADF, VLOAD_BF16)
#define ITEM_SCRATCH(G, n) dec_scratch_floats(G, n)
#else                /* portable scalar items */
DEC_ITEMS(DEFINE_ITEM, F32_LOAD, bf16_load)
#define ITEM_SCRATCH(G, n) ((G) * (n))
#endif
#define ITEM_F32(D) dec_f32_##D
#define ITEM_BF16(D) dec_bf16_##D
#define ITEM_MIXED(D) dec_mixed_##D
DEFINE_KERNEL(paged_decode_bf16, uint16_t, uint16_t, BF16_FAST, ITEM_BF16, ITEM_SCRATCH)
DEFINE_KERNEL(paged_decode_f32, float, float, 0, ITEM_F32, ITEM_SCRATCH)
DEFINE_KERNEL(paged_decode_bf16kv_f32, uint16_t, float, 0, ITEM_MIXED, ITEM_SCRATCH)

/* Prefill attention from the pool: B sequences, sequence b with kv_lens[b] keys whose
 * last q_lens[b] are queries at rows q_rows[b].. of q (rows q_stride elements apart); out
 * rows are Hq * D, contiguous. Items (b, kv head, run of query rows: prefill_plan.h) are
 * unequal, so they are handed out dynamically, the costliest first. bfloat16 runs the
 * AVX-512 BF16 item where it is compiled in, else the float32 item with bf16 widened
 * (prefill_attention_f32.h). Returns -2 for a shape without a kernel, -1 out of memory. */
#define DEFINE_PREFILL(NAME, T, TQ, SCRATCH_FLOATS, ITEM)                                              \
int NAME(const T *pool, const int64_t *page_table, const int64_t *kv_lens, const int64_t *q_lens,     \
         const int64_t *q_rows, const TQ *q, int64_t q_stride, TQ *out, int64_t B, int64_t max_pages, \
         int64_t layer, int64_t L, int64_t H, int64_t G, int64_t S, int64_t D, float scale) {         \
    if ((D != 64 && D != 128) || G > MAX_GROUP) return -2;                                           \
    int64_t longest = 1;                                                                             \
    for (int64_t b = 0; b < B; ++b)                                                                  \
        if (kv_lens[b] > longest) longest = kv_lens[b];                                              \
    int failed = 0;                                                                                  \
    const int64_t out_stride = H * G * D;                                                            \
    int64_t count = 0;                                                                               \
    pf_item *items = pf_plan(kv_lens, q_lens, B, H, omp_get_max_threads(), &count);                  \
    if (!items) return -1;                                                                           \
    _Pragma("omp parallel reduction(|:failed)")                                                      \
    {                                                                                                \
        float *scratch = malloc(sizeof(float) * (size_t)SCRATCH_FLOATS(G, longest, D));             \
        if (!scratch) failed = 1;                                                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                                      \
        for (int64_t w = 0; w < count; ++w) {                                                        \
            if (failed) continue;                                                                    \
            const pf_item it = items[w];                                                             \
            const int64_t row = q_rows[it.b] + it.r0;   /* the run is a chunk of its own */          \
            ITEM(pool, page_table + it.b * max_pages, kv_lens[it.b] - q_lens[it.b] + it.r1,          \
                 it.r1 - it.r0, q + row * q_stride, q_stride, out + row * out_stride, out_stride,     \
                 layer, L, H, it.h, G, S, (int)D, scale, scratch);                                   \
        }                                                                                            \
        free(scratch);                                                                               \
    }                                                                                                \
    free(items);                                                                                     \
    return failed ? -1 : 0;                                                                          \
}

#ifdef KVRELAY_VEC
#define PF_SCRATCH(G, longest, D) pf_scratch_floats(longest, D)
DEFINE_PF_ITEM(pf_item_f32, float, F32_LOAD, float, F32_LOAD, F32_STORE)
DEFINE_PREFILL(paged_prefill_f32, float, float, PF_SCRATCH, pf_item_f32)
DEFINE_PF_ITEM(pf_item_mixed, uint16_t, bf16_load, float, F32_LOAD, F32_STORE)
DEFINE_PREFILL(paged_prefill_bf16kv_f32, uint16_t, float, PF_SCRATCH, pf_item_mixed)
#ifdef KVRELAY_FAST_DECODE
DEFINE_PREFILL(paged_prefill_bf16, uint16_t, uint16_t, prefill_scratch_floats, prefill_item)
#else
DEFINE_PF_ITEM(pf_item_bf16, uint16_t, bf16_load, uint16_t, bf16_load, bf16_round)
DEFINE_PREFILL(paged_prefill_bf16, uint16_t, uint16_t, PF_SCRATCH, pf_item_bf16)
#endif
int paged_prefill_available(void) { return 1; }
#else
int paged_prefill_f32(void) { return -2; }
int paged_prefill_bf16(void) { return -2; }
int paged_prefill_bf16kv_f32(void) { return -2; }
int paged_prefill_available(void) { return 0; }
#endif
