/* What every C product of GGUF blocks reads about the block formats (gemv_quant.c, exact; gemv_int8.c,
 * integer mode): ggml's type numbers, each block's bytes and weights, fp16 widened exactly, MXFP4's
 * scale byte and values, and the K-quants' packed 6-bit scales (engine-core process).
 */
#ifndef CORESERVE_QUANT_BLOCKS_H
#define CORESERVE_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define QK 32 /* weights per block (a K-quant's sub-block) */
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14,
       TYPE_MXFP4 = 39 }; /* ggml's */
#define QK_K 256 /* weights per K-quant super-block */

static inline int is_k_type(int type) { return type >= TYPE_Q4_K && type <= TYPE_Q6_K; }

static inline int block_bytes(int type) { /* bytes of one block (32 weights; K-quants: 256) */
    switch (type) {
    case TYPE_Q8_0: return 34;
    case TYPE_Q4_1: return 20;
    case TYPE_Q4_0: return 18;
    case TYPE_Q4_K: return 144;
    case TYPE_Q5_K: return 176;
    case TYPE_Q6_K: return 210;
    case TYPE_MXFP4: return 17;
    default: return 0;
    }
}

static inline int block_weights(int type) { return is_k_type(type) ? QK_K : QK; }

/* Where a block of 32 keeps its 16 bytes of nibbles (elements 0-15 the low nibbles, 16-31 the high ones):
 * after Q4_0's fp16 d, Q4_1's d and m, MXFP4's scale byte. */
static inline int nibbles_at(int type) { return type == TYPE_Q4_1 ? 4 : type == TYPE_MXFP4 ? 1 : 2; }

/* MXFP4 (ggml's block_mxfp4: a scale byte e, then 16 bytes of nibbles): weight = MXFP4_VALUES[nibble] *
 * mxfp4_half(e), the e2m1 value doubled (an integer) times 2^(e - 128), as ggml and the `gguf` package
 * compute it. Their product has at most 2 significant bits, so it is exact in fp32 (subnormal scales
 * included: e = 0 and 1) until it overflows, which a kept weight never does (finite_weights.py refuses
 * such blocks). e = 255 is e8m0's NaN in the OCP format, but ggml, gguf and transformers all read it as
 * 2^127 here: so does this. */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float mxfp4_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* fp16 bits (little-endian at p) -> fp32, exactly (subnormals included): F16C's conversion where the
 * CPU has it, else the bits placed by hand (the same value). */
static inline float half_at(const uint8_t *p) {
#ifdef __F16C__
    uint16_t half;
    memcpy(&half, p, sizeof half);
    return _cvtsh_ss(half);
#else
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 0x1p-24f; /* exact: 10 bits times a power of two */
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | mantissa << 13;
    } else {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

/* Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins unpacked 8 at a time: bytes
 * 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7; bytes 4-7 the same for the
 * mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibbles) and mins 4-7 (high nibbles). */
static inline void k_unpack_scales(const uint8_t *s, uint64_t *scales, uint64_t *mins) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, top2 = 0x30303030u, nibble = 0x0f0f0f0fu;
    *scales = (uint64_t)(a & low6) | (uint64_t)((c & nibble) | ((a >> 2) & top2)) << 32;
    *mins = (uint64_t)(b & low6) | (uint64_t)(((c >> 4) & nibble) | ((b >> 2) & top2)) << 32;
}

/* The cache lines of the `bytes` bytes of a weight row PREFETCH_BYTES past p, asked for now: the few-row
 * products read rows from memory, and the hardware's prefetcher alone left each thread's stream short of
 * the memory's bandwidth (docs/benchmarks.md, "Prefetching the weight streams"). A prefetch past the end
 * of the weights never faults. */
#define PREFETCH_BYTES 1024
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + PREFETCH_BYTES + line, 0, 3);
}

#endif
