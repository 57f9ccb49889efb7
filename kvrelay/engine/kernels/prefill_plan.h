/* The work items of one prefill-attention call (paged_attention.c, DEFINE_PREFILL).
 *
 * An item is one kv head of one sequence over a run of its query rows [r0, r1). Rows are
 * independent given the keys each may see (row i of a q_len-row chunk over n keys sees
 * keys [0, n - q_len + i]), so a run is itself a prompt chunk: n' = n - q_len + r1 keys,
 * q_len' = r1 - r0 rows, and the item functions need no change.
 *
 * Why runs: with one item per (sequence, kv head), one 2,048-token prompt of a model with
 * 3 kv heads is 3 items for 2 threads, and the call takes two items' time where 1.5 would
 * do (attention was 1.28 s of that prompt's 2.77 s prefill, Zen 4). Each sequence's rows
 * are cut into runs of at most R rows, R chosen so that the call has about
 * PF_ITEMS_PER_THREAD items a thread, and never below PF_MIN_ROWS rows, because every item
 * re-lays out the keys it sees. A batch of many short prompts keeps one item per
 * (sequence, kv head).
 *
 * Items go most expensive first (a causal run's cost grows with the keys its rows see), so
 * that a dynamic schedule ends with the small ones and the threads finish together.
 */
#ifndef KVRELAY_PREFILL_PLAN_H
#define KVRELAY_PREFILL_PLAN_H
#include <stdint.h>
#include <stdlib.h>

#define PF_ITEMS_PER_THREAD 8
#define PF_MIN_ROWS 64

typedef struct {
    int64_t b, h, r0, r1;
    double cost;   /* query rows x keys they see, summed */
} pf_item;

static int pf_costlier_first(const void *x, const void *y) {
    const double a = ((const pf_item *)x)->cost, b = ((const pf_item *)y)->cost;
    return (a < b) - (a > b);
}

/* The items of B sequences (kv_lens, q_lens) over H kv heads for `threads` threads, into
 * a malloc'ed array the caller frees; *count gets their number. NULL if out of memory. */
static pf_item *pf_plan(const int64_t *kv_lens, const int64_t *q_lens, int64_t B, int64_t H,
                        int64_t threads, int64_t *count) {
    int64_t rows = 0;
    for (int64_t b = 0; b < B; ++b) rows += q_lens[b];
    const int64_t target = PF_ITEMS_PER_THREAD * (threads > 0 ? threads : 1);
    int64_t run = (rows * H + target - 1) / (target > 0 ? target : 1);
    if (run < PF_MIN_ROWS) run = PF_MIN_ROWS;
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b) n += H * ((q_lens[b] + run - 1) / run);
    pf_item *items = malloc(sizeof(pf_item) * (size_t)(n > 0 ? n : 1));
    if (!items) return NULL;
    int64_t k = 0;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t r0 = 0; r0 < q_lens[b]; r0 += run) {
            const int64_t r1 = r0 + run < q_lens[b] ? r0 + run : q_lens[b];
            const double first_seen = (double)(kv_lens[b] - q_lens[b] + r0 + 1);
            const double cost = (double)(r1 - r0) * (first_seen + 0.5 * (double)(r1 - r0 - 1));
            for (int64_t h = 0; h < H; ++h) items[k++] = (pf_item){b, h, r0, r1, cost};
        }
    qsort(items, (size_t)n, sizeof(pf_item), pf_costlier_first);
    *count = n;
    return items;
}

#endif
