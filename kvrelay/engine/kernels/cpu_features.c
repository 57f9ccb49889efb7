/* The CPU's features as the kernels need them, read with cpuid and xgetbv (the OS must
 * save the wide registers too). Built without any -m flag, so it runs on every x86-64;
 * elsewhere it reports nothing and the torch fallbacks run. Bit i of the result is
 * FEATURE_NAMES[i] in variants.py. */
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

int64_t kvrelay_cpu_features(void) {
    unsigned a, b, c, d, max;
    if (!__get_cpuid(0, &max, &b, &c, &d) || max < 7) return 0;
    __cpuid_count(1, 0, a, b, c, d);
    const unsigned ecx1 = c;
    if (!(ecx1 & (1u << 27))) return 0;                       /* no OSXSAVE: no AVX state */
    const uint64_t xcr0 = xgetbv0();
    const int os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;
    const int os_amx = (xcr0 & 0x60000) == 0x60000;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned ebx7 = b, ecx7 = c, edx7 = d;
    __cpuid_count(7, 1, a, b, c, d);
    const unsigned eax71 = a;
    int64_t f = 0;
    if (os_avx) {
        f |= (int64_t)((ecx1 >> 12) & 1) << 0;                /* fma */
        f |= (int64_t)((ecx1 >> 29) & 1) << 1;                /* f16c */
        f |= (int64_t)((ebx7 >> 5) & 1) << 2;                 /* avx2 */
        f |= (int64_t)((ebx7 >> 8) & 1) << 3;                 /* bmi2 */
        f |= (int64_t)((eax71 >> 4) & 1) << 4;                /* avx_vnni */
    }
    if (os_avx512) {
        f |= (int64_t)((ebx7 >> 16) & 1) << 5;                /* avx512f */
        f |= (int64_t)((ebx7 >> 17) & 1) << 6;                /* avx512dq */
        f |= (int64_t)((ebx7 >> 28) & 1) << 7;                /* avx512cd */
        f |= (int64_t)((ebx7 >> 30) & 1) << 8;                /* avx512bw */
        f |= (int64_t)((ebx7 >> 31) & 1) << 9;                /* avx512vl */
        f |= (int64_t)((ecx7 >> 11) & 1) << 10;               /* avx512_vnni */
        f |= (int64_t)((eax71 >> 5) & 1) << 11;               /* avx512_bf16 */
    }
    if (os_amx) {
        f |= (int64_t)((edx7 >> 24) & 1) << 12;               /* amx_tile */
        f |= (int64_t)((edx7 >> 22) & 1) << 13;               /* amx_bf16 */
        f |= (int64_t)((edx7 >> 25) & 1) << 14;               /* amx_int8 */
    }
    return f;
}
#else
int64_t kvrelay_cpu_features(void) { return 0; }
#endif
