/* bfloat16 <-> float32 for the kernels: bf16 is the upper half of a float32. */
#ifndef KVRELAY_BF16_H
#define KVRELAY_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even; values here are finite */
    return (uint16_t)(u >> 16);
}

#define F32_LOAD(p) (*(p))
#define F32_STORE(x) (x)

#endif
