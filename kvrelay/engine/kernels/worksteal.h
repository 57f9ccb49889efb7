/* Work stealing for a kernel's OpenMP team: n items are cut into one contiguous part per
 * thread, as a static schedule would; each part is counted in units of a few items. A
 * thread takes units from the front of its own part, then from the backs of the others'.
 *
 * Why: a host whose cores also run the router, the client and the workers' event loops
 * preempts one thread of a team now and then. Under a static schedule the whole call
 * then waits for that thread's part; here the other threads take what it has not begun
 * (a 32-row decode step's matmuls beside a 10%-of-a-core interferer, Zen 2: 49.9 -> 47.5
 * ms; `serve` on workload (b): 174.0 -> 178.8 output tokens/s, alternated rounds).
 * Without interference the owner's front-to-back order keeps the static schedule's
 * locality; a claim is one compare-and-swap.
 *
 * Use: ws_init() every part's word before the parallel region, then loop on ws_next()
 * inside it, stealing only when the team has the ws_team() threads the words are for. */
#ifndef KVRELAY_WORKSTEAL_H
#define KVRELAY_WORKSTEAL_H
#include <stdint.h>
#include <omp.h>

#define WS_MAX_THREADS 256

/* [*lo, *hi): part v of nt over n items. */
static inline void ws_part(int64_t n, int64_t v, int64_t nt, int64_t *lo, int64_t *hi) {
    *lo = n * v / nt;
    *hi = n * (v + 1) / nt;
}

/* The team size the words are laid out for; 0 when it is too large for them. */
static inline int64_t ws_team(void) {
    const int64_t t = omp_get_max_threads();
    return t <= WS_MAX_THREADS ? t : 0;
}

/* words[v]: part v's units [front, back), front in the low half and back in the high one. */
static inline void ws_init(uint64_t *words, int64_t n, int64_t nt, int64_t unit) {
    for (int64_t v = 0; v < nt; ++v) {
        int64_t lo, hi;
        ws_part(n, v, nt, &lo, &hi);
        words[v] = (uint64_t)((hi - lo + unit - 1) / unit) << 32;
    }
}

/* One unit of *word from its front (front != 0) or back; -1 when none is left. */
static inline int64_t ws_claim(uint64_t *word, int front) {
    uint64_t s = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint64_t f = s & 0xFFFFFFFFu, b = s >> 32;
        if (f >= b) return -1;
        const uint64_t want = front ? s + 1 : ((b - 1) << 32) | f;
        if (__atomic_compare_exchange_n(word, &s, want, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return (int64_t)(front ? f : b - 1);
    }
}

/* Thread t's next items [*lo, *hi) of n: its own part's front first, then the other
 * parts' backs in turn (*cursor, from 0, is how far it has gone); without `steal` (a team
 * of another size than the words') its whole part, once. 0 when all are taken. */
static inline int ws_next(uint64_t *words, int steal, int64_t n, int64_t t, int64_t nt, int64_t unit,
                          int64_t *cursor, int64_t *lo, int64_t *hi) {
    if (!steal) {
        ws_part(n, t, nt, lo, hi);
        return (*cursor)++ == 0;
    }
    for (; *cursor < nt; ++*cursor) {
        const int64_t v = (t + *cursor) % nt;
        const int64_t u = ws_claim(&words[v], *cursor == 0);
        if (u < 0) continue;
        int64_t plo, phi;
        ws_part(n, v, nt, &plo, &phi);
        *lo = plo + u * unit;
        *hi = *lo + unit < phi ? *lo + unit : phi;
        return 1;
    }
    return 0;
}

#endif
