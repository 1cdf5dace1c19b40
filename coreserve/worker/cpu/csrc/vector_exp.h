/* exp(d) for d <= 0 and silu on 8 float lanes, shared by logprob_rows.c, fused_ops.c and recurrent_mixers.c
 * (CPU kernels). */
#ifndef CORESERVE_VECTOR_EXP_H
#define CORESERVE_VECTOR_EXP_H

#include <stdint.h>

typedef float float8 __attribute__((vector_size(32)));
typedef int32_t int8x32 __attribute__((vector_size(32)));

/* exp(d) for d <= 0 on 8 lanes, within 2 ulp: 2^n * poly(r), r = d - n ln2 (Cephes' expf
 * coefficients). Written with vector types: gcc does not vectorize the scalar form of this loop. */
static inline float8 exp_nonpositive(float8 d) {
    const float8 floor_at = (float8){0} - 87.0f; /* exp(-87) is below float's smallest normal */
    const int8x32 low = d < floor_at;
    d = (float8)(((int8x32)d & ~low) | ((int8x32)floor_at & low));
    const int8x32 whole = __builtin_convertvector(d * 1.44269504088896341f - 0.5f, int8x32); /* rounds */
    const float8 n = __builtin_convertvector(whole, float8);
    const float8 r = (d - n * 0.693359375f) - n * -2.12194440e-4f;
    float8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (float8)((whole + 127) << 23); /* 2^n built in the exponent field */
}

/* silu(x) on 8 lanes: sigmoid from exp(-|x|), so exp never sees a positive argument */
static inline float8 silu8(float8 x) {
    const int8x32 negative = x < (float8){0};
    const float8 magnitude = (float8)((int8x32)x & ~((int8x32){0} + (int32_t)0x80000000));
    const float8 e = exp_nonpositive(-magnitude);
    const float8 numerator = (float8)(((int8x32)((float8){0} + 1.0f) & ~negative) | ((int8x32)e & negative));
    return x * (numerator / (1.0f + e));
}

#endif
