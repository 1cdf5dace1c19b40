/* Matrix products out = x @ W^T (+ bias) with W kept in a GGUF file's block format, for the CPU
 * (engine-core process): Q8_0, Q4_0, Q4_1 and MXFP4, blocks of 32 weights, and the K-quants Q4_K, Q5_K
 * and Q6_K, super-blocks of 256; each row of W a run of blocks.
 * K-quants are made register by register from each super-block's unpacked scales (k_register) in the
 * few-row passes, and dequantized whole (dequant_super_block) into the many-row tiles: gemv_f32's sums.
 * A fused projection of several types is runs of rows, each its own type (QUANT_PARTS, parts_range).
 *
 * Each block is dequantized in registers to exactly the fp32 values of the `gguf` package's numpy
 * routines (the values the loader writes for a dequantized model): Q8_0 d * q, Q4_0 d * (q - 8),
 * Q4_1 d * q + m, with d and m widened from fp16 exactly, MXFP4 2^(e - 128) * v with v its doubled e2m1
 * value (quant_blocks.h). d * q has at most 11 + 8 significant bits, so it is exact in fp32 and a fused
 * multiply-add d * q + m rounds where numpy's two operations round: contraction cannot change the value.
 * Those values then meet the fp32 activations as gemv.c's fp32 path meets its weights: the same
 * lanes (one register), one accumulator per output over K in steps of LANES, fused multiply-adds,
 * hsum's tree, the bias added last. K is a whole number of blocks, so gemv.c's scalar tail is empty.
 * So each output is bit for bit gemv_f32's on the dequantized weights, for any row count, thread
 * count or split (batch invariance, docs/decisions.md; docs/quantized.md).
 * Up to PASS_ROWS rows the weights stream once a pass of up to four rows, dequantized block by block
 * in registers (AVX-512 8 rows, AVX2 32, where the passes beat the tiles on an Intel Xeon and a
 * Zen 3; elsewhere four); with more rows a tile of weight rows (TILE_BYTES, in L2) is dequantized into the
 * thread's scratch once and met by every row of the call (the dequantization paid once per call, not
 * once per row).
 * AVX-512 and AVX2 widen each block's scales where the block is read (block_head), other CPUs 16
 * blocks at a time (block_scales); each block's quants then become floats by a lookup in its 16
 * values (AVX-512; AVX2's MXFP4 in two tables of 8) or by widening, conversion and d * q (+ m) (AVX2;
 * generic vector code elsewhere): the same values either way. docs/benchmarks.md has the figures behind each choice.
 * x: [rows, K] fp32 row-major, w: [N, K / 32 (K-quants: K / 256) blocks] raw bytes, out: [rows, N] fp32.
 */
#include <omp.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "kernel_parts.h"
#include "quant_blocks.h"

#pragma GCC optimize("fp-contract=fast") /* fused multiply-adds, as gemv.c's */

#define NB 4 /* weight rows per block of the many-row product */
#define RB 4 /* activation rows per group */
#define ROW_MAX 4
#define SMALL_WORK 32768
#define TILE_BYTES (512 * 1024) /* the many-row product's dequantized weight rows: a quarter of a 2 MiB L2 */

#ifdef __AVX512F__ /* gemv.c's register width: the lanes must be its lanes */
#define LANES 16
#define ROW_STREAMS 2
#define BLOCK_RB 4 /* activation rows per block of the many-row product: 16 accumulators */
/* rows up to which the few-row product runs in passes of ROW_MAX rows: past 8 the L2 tiles win on an
 * Intel Xeon (AMX host, [8192, 2048] at 16 rows: Q4_0 2.76 either way, Q4_K 3.54 -> 2.64 ms, Q6_K
 * 5.57 -> 3.12; at 32 rows every type 13-52% faster), 2026-12-04 */
#define PASS_ROWS 8
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
#define ROW_STREAMS 2
#define BLOCK_RB 2 /* gemv.c's; 2, 3 or 4 rows within 10% on a Zen 3 (4 rows' 16 accumulators spill) */
#define PASS_ROWS 32
#elif defined(__AVX__)
#define LANES 8
#define ROW_STREAMS 1
#define BLOCK_RB 2
#else
#define LANES 4
#define ROW_STREAMS 1
#define BLOCK_RB 2
#endif
#define STEPS (QK / LANES) /* registers per block */
#ifndef PASS_ROWS
#define PASS_ROWS ROW_MAX
#endif

typedef float floatv __attribute__((vector_size(4 * LANES)));
typedef uint8_t bytev __attribute__((vector_size(LANES)));
typedef int8_t sbytev __attribute__((vector_size(LANES)));


/* Bytes of a row of K weights of the type (0 for a type without a product here). */
int64_t quant_row_bytes(int32_t type, int64_t K) { return K / block_weights(type) * block_bytes(type); }

static inline float hsum(floatv v) { /* gemv.c's */
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
#endif
}


/* The scales of n <= CHUNK consecutive blocks from b, widened from fp16 exactly: d[i] and (Q4_1) m[i]
 * (CPUs without AVX2 or AVX-512; those take block_head). */
#define CHUNK 16
static inline __attribute__((always_inline)) void block_scales(const uint8_t *b, int type, int n, float d[CHUNK],
                                                               float m[CHUNK]) {
    const int bb = block_bytes(type);
    if (type == TYPE_MXFP4) {
        for (int i = 0; i < n; i++) d[i] = mxfp4_half(b[i * bb]), m[i] = 0.0f;
        return;
    }
#if defined(__F16C__)
    /* AVX with F16C: each block's first 4 bytes (d, then Q4_1's m) widened by one vcvtph2ps; stores of
     * whole floats, so the broadcasts that read them back are forwarded. */
    for (int i = 0; i < n; i++) {
        uint32_t head;
        memcpy(&head, b + i * bb, sizeof head);
        const __m128 halves = _mm_cvtph_ps(_mm_cvtsi32_si128((int)head));
        d[i] = _mm_cvtss_f32(halves);
        m[i] = type == TYPE_Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(halves)) : 0.0f;
    }
#else
    for (int i = 0; i < n; i++) {
        d[i] = half_at(b + i * bb);
        m[i] = type == TYPE_Q4_1 ? half_at(b + i * bb + 2) : 0.0f;
    }
#endif
}

#if (defined(__AVX512F__) || (LANES == 8 && ROW_STREAMS == 2)) && defined(__F16C__)
#define REGISTER_SCALES 1 /* row() and dequant_row() take block_head and block_register */
/* A block's d and (Q4_1) m, widened by one vcvtph2ps of its first 4 bytes and broadcast from the
 * register. Widened 16 blocks at a time through memory they cost a store and a reload each, and on
 * AVX-512 a gather, as slow for a row's last 2 blocks as for 16 (docs/benchmarks.md has the figures).
 * Q8_0's and Q4_0's m is their first quants' bits, unused; MXFP4's d is its scale byte's power of two. */
static inline __attribute__((always_inline)) void block_head(const uint8_t *b, int type, floatv *d, floatv *m) {
    if (type == TYPE_MXFP4) {
        const float scale = mxfp4_half(b[0]);
        for (int i = 0; i < LANES; i++) (*d)[i] = scale, (*m)[i] = 0.0f;
        return;
    }
    uint32_t head;
    memcpy(&head, b, sizeof head);
    const __m128 halves = _mm_cvtph_ps(_mm_cvtsi32_si128((int)head));
#ifdef __AVX512F__
    *d = (floatv)_mm512_broadcastss_ps(halves);
    *m = (floatv)_mm512_broadcastss_ps(_mm_movehdup_ps(halves));
#else
    *d = (floatv)_mm256_broadcastss_ps(halves);
    *m = (floatv)_mm256_broadcastss_ps(_mm_movehdup_ps(halves));
#endif
}
#endif

/* One block's 32 weights as STEPS registers, element e in register e / LANES, lane e % LANES, from its
 * widened scales d and m. Q4: elements 0-15 are the low nibbles of the 16 bytes, 16-31 the high ones. */
#if defined(__AVX512F__) && defined(__F16C__)
/* AVX-512. Q4: the block's 16 possible values, T[i] = d * i + m (Q4_1) or d * (i - 8) (Q4_0), are one
 * register, the very values d * q + m and d * (q - 8) give per weight (the same operations on the same
 * operands); each weight is then looked up by its nibble (vpermps reads an index's low 4 bits, so the
 * widened bytes index the low nibbles as they are). That is 2 widenings, 2 conversions and 2 multiply-
 * adds per block replaced by 1 widening, 1 shift and 1 multiply-add. Q8_0: widened by vpmovsx.
 * d and m: the block's scales in every lane (block_head). */
static inline __attribute__((always_inline)) void dequant_block(const uint8_t *b, int type, floatv d, floatv m,
                                                                floatv out[STEPS]) {
    if (type == TYPE_Q8_0) {
        for (int v = 0; v < STEPS; v++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + v * LANES));
            out[v] = (floatv)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), (__m512)d);
        }
        return;
    }
    const __m512 table = type == TYPE_Q4_1
        ? _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), (__m512)d,
                          (__m512)m) /* d * q exact, so one rounding as numpy's two */
        : type == TYPE_MXFP4
        ? _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), (__m512)d)
        : _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), (__m512)d);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + nibbles_at(type))));
    out[0] = (floatv)_mm512_permutexvar_ps(bytes, table);
    out[1] = (floatv)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#elif LANES == 8 && ROW_STREAMS == 2
#define AVX2_BLOCKS 1 /* block_register() takes dequant_step below */
/* AVX2: register v (8 weights) of a block, from its broadcast scales. Q4: the 8 bytes holding the
 * register's nibbles widened by vpmovzxbd, the low nibbles masked or the high ones shifted down, then
 * converted and scaled as d * q + m and d * (q - 8); Q8_0 widened by vpmovsxbd, d * q: the operations
 * of the generic code below. One register at a time, so four streams fit AVX2's 16 registers (a whole
 * block per stream spilled). */
static inline __attribute__((always_inline)) floatv dequant_step(const uint8_t *b, int type, int v, floatv dv,
                                                                 floatv mv) {
    const __m256 d = (__m256)dv, m = (__m256)mv;
    if (type == TYPE_Q8_0) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + v * LANES)));
        return (floatv)_mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    }
    const uint8_t *qs = b + nibbles_at(type) + (v & 1) * LANES;
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i q = v < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0f)) : _mm256_srli_epi32(bytes, 4);
    if (type == TYPE_MXFP4) { /* nibbles 0-7 and 8-15 looked up in a table of 8 each, bit 3 choosing */
        const __m256 positive = _mm256_mul_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12), d);
        const __m256 negative = _mm256_mul_ps(_mm256_setr_ps(0, -1, -2, -3, -4, -6, -8, -12), d);
        return (floatv)_mm256_blendv_ps(_mm256_permutevar8x32_ps(positive, q), _mm256_permutevar8x32_ps(negative, q),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
    }
    if (type == TYPE_Q4_1) return (floatv)_mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    return (floatv)_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))), d);
}

#endif

#ifdef REGISTER_SCALES
/* Register v of a block's weights, from its scales in registers (block_head). AVX2 makes each register
 * just before its products: a whole block's registers made first spilled (Q4, one row: 7 registers to
 * the stack and back each block; Q4_0 at one row 5-13% slower, Q4_1 2-5%, a Zen 3). AVX-512 makes the
 * whole block into wv at v == 0 (one 16-value table a block) and reads it from there. */
static inline __attribute__((always_inline)) floatv block_register(const uint8_t *b, int type, int v, floatv d,
                                                                   floatv m, floatv wv[STEPS]) {
#ifdef AVX2_BLOCKS
    (void)wv;
    return dequant_step(b, type, v, d, m);
#else
    if (v == 0) dequant_block(b, type, d, m, wv);
    return wv[v];
#endif
}
#endif

#ifndef REGISTER_SCALES
static inline __attribute__((always_inline)) void dequant_block(const uint8_t *b, int type, float d, float m,
                                                                floatv out[STEPS]) {
    if (type == TYPE_Q8_0) {
        for (int v = 0; v < STEPS; v++) {
            sbytev q;
            memcpy(&q, b + 2 + v * LANES, sizeof q);
            out[v] = __builtin_convertvector(q, floatv) * d;
        }
        return;
    }
    const uint8_t *qs = b + nibbles_at(type);
    for (int v = 0; v < STEPS; v++) {
        const int e = v * LANES;
        bytev raw;
        memcpy(&raw, qs + e % 16, sizeof raw);
        const bytev nibble = e < 16 ? raw & 0x0f : raw >> 4;
        if (type == TYPE_MXFP4) {
            sbytev value;
            for (int i = 0; i < LANES; i++) value[i] = MXFP4_VALUES[nibble[i]];
            out[v] = __builtin_convertvector(value, floatv) * d; /* exact: see quant_blocks.h */
        } else if (type == TYPE_Q4_1) {
            out[v] = __builtin_convertvector(nibble, floatv) * d + m; /* exact product: see the top */
        } else {
            const sbytev centred = (sbytev)nibble - 8;
            out[v] = __builtin_convertvector(centred, floatv) * d;
        }
    }
}
#endif

/* A K-quant super-block's 256 weights, as the `gguf` package's numpy routines compute them (the values
 * the loader writes), operation for operation in fp32: Q4_K and Q5_K (d * sc) * q - dmin * m, where
 * d * sc and dmin * m (an fp16 times a 6-bit integer) and (d * sc) * q (times 4 or 5 bits) are exact, so
 * the one rounding is the subtraction's, fused or not; Q6_K (d * sc) * q, two products rounded in that
 * order (sc an int8, q in -32..31). Sub-blocks of 32 (Q6_K: 16 for the scales) as ggml lays them out:
 * Q4_K d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (32 bytes per two sub-blocks,
 * low nibbles first); Q5_K the same with 32 bytes of fifth bits before the nibbles; Q6_K 128 bytes of
 * low nibbles, 64 of high bit pairs, 16 int8 scales, then d. Vector code in LANES-wide registers. */
typedef int32_t intv __attribute__((vector_size(4 * LANES)));

/* LANES bytes as floats (exact: 0..255), widened to 32-bit integers first (one zero-extension and one
 * conversion instruction; a direct byte-to-float conversion compiles lane by lane). */
static inline floatv byte_floats(bytev bytes) {
    return __builtin_convertvector(__builtin_convertvector(bytes, intv), floatv);
}

static inline bytev bytes_at(const uint8_t *p) {
    bytev v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define Q6_BYTES 1
/* Q6_K on AVX-512 VBMI: a half super-block's 128 quants made 64 at a time in byte registers (q6_half),
 * then each register of 16 placed by one byte permutation (q6_register). Each quant, q - 32 as an
 * int8, lands in the top byte of its lane, so the lane's integer is (q - 32) * 2^24, converted
 * exactly; the scale is kept as d * sc * 2^-24 (Q6_UNIT: exact, a power of two on a product of at
 * most 19 bits, never below fp32's normals), so (d * sc * 2^-24) * ((q - 32) * 2^24) is the same real
 * product as (d * sc) * (q - 32), rounded once: the same value. The byte ops of one register's 16
 * quants (shifts, masks, or, - 32: ~9 on 16 bytes, gcc's code before) are shared by 64 quants; a
 * register keeps one permutation (the widening) on the shuffle port, ~1.9 byte ops where it took ~9
 * (Q6_K [8192, 2048], one row, one thread: 2.2-2.4 -> 0.92 ms on an Intel Xeon, issue 51). */
#define Q6_UNIT 0x1p-24f
typedef uint8_t byte64 __attribute__((vector_size(64)));
static const byte64 q6_iota = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                               16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                               32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                               48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

/* Half h of a Q6_K super-block (its weights 128h ..): bytes[0] its weights 0-63 (bit pairs 0 and 1),
 * bytes[1] 64-127 (pairs 2 and 3), each q - 32 as an int8, in weight order. */
static inline __attribute__((always_inline)) void q6_half(const uint8_t *b, int h, __m512i bytes[2]) {
    const __m512i low = _mm512_loadu_si512(b + h * 64); /* pairs 0, 1: low nibbles; 2, 3: high */
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + h * 32)));
    const __m512i pairs = _mm512_mask_srli_epi16(high, 0xffff0000u, high, 2); /* bytes 32-63: qh >> 2 */
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    /* ternary 0xe4: the first operand's bits where the third's are set, the second's elsewhere, so
     * nibble | pair << 4 in bits 0-5; bits 6-7 are the next pair's, which vpermb does not read (the
     * mask third: the first operand is overwritten) */
    const __m512i q1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 4), pairs, nibble, 0xe4);
    const __m512i q0 = _mm512_ternarylogic_epi32(low, _mm512_slli_epi16(pairs, 4), nibble, 0xe4);
    const __m512i centred = (__m512i)(q6_iota - 32); /* q -> q - 32 by the index's low 6 bits */
    bytes[0] = _mm512_permutexvar_epi8(q0, centred);
    bytes[1] = _mm512_permutexvar_epi8(q1, centred);
}

/* Weights 16j .. 16j + 15 of bytes (q6_half) as floats times scale (d * sc * Q6_UNIT). */
static inline __attribute__((always_inline)) __m512 q6_register(__m512i bytes, int j, float scale) {
    const __m512i top = (__m512i)(q6_iota / 4 + (uint8_t)(16 * j)); /* lane i's top byte: byte 16j + i */
    const __m512i q = _mm512_maskz_permutexvar_epi8(0x8888888888888888ull, top, bytes); /* (q - 32) * 2^24 */
    return _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(q));
}
#else
#define Q6_UNIT 1.0f
#endif

/* A K-quant super-block's scales, made once for its registers (k_register): Q4_K and Q5_K d * sc and
 * -dmin * m of each sub-block of 32, Q6_K d * sc * Q6_UNIT of each 16; each exact (see the values'
 * note above). */
struct k_scales {
    float scale[16], offset[8];
#ifdef Q6_BYTES
    __m512i q6[2]; /* Q6_K: the quants of the half super-block being read (q6_half) */
#endif
};

typedef float float8 __attribute__((vector_size(32)));
typedef int32_t int8v __attribute__((vector_size(32)));
typedef uint8_t byte8 __attribute__((vector_size(8)));
typedef int8_t sbyte16 __attribute__((vector_size(16)));
typedef int32_t int16v __attribute__((vector_size(64)));
typedef float float16v __attribute__((vector_size(64)));

/* 8 bytes as floats (exact), through 32-bit integers as byte_floats. */
static inline float8 byte8_floats(uint64_t bytes) {
    byte8 b;
    memcpy(&b, &bytes, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, int8v), float8);
}


static inline __attribute__((always_inline)) void k_prepare(const uint8_t *b, int type, struct k_scales *k) {
    if (type == TYPE_Q6_K) {
#if defined(__AVX512F__) && defined(__F16C__)
        /* vpmovsxbd: as generic vector code gcc 12 widened the 16 int8 scales one by one in scalar registers */
        uint16_t half;
        memcpy(&half, b + 208, sizeof half);
        const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(half))) * Q6_UNIT;
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
        _mm512_storeu_ps(k->scale, _mm512_mul_ps(_mm512_set1_ps(d), sc));
#else
        sbyte16 sc;
        memcpy(&sc, b + 192, sizeof sc);
        const float16v scale = half_at(b + 208) * __builtin_convertvector(__builtin_convertvector(sc, int16v), float16v);
        memcpy(k->scale, &scale, sizeof scale);
#endif
        __asm__ volatile("" ::: "memory");
        return;
    }
#if defined(__F16C__)
    uint32_t head;
    memcpy(&head, b, sizeof head);
    const __m128 halves = _mm_cvtph_ps(_mm_cvtsi32_si128((int)head));
    const float d = _mm_cvtss_f32(halves), dmin = _mm_cvtss_f32(_mm_movehdup_ps(halves));
#else
    const float d = half_at(b), dmin = half_at(b + 2);
#endif
    uint64_t scales, mins;
    k_unpack_scales(b + 4, &scales, &mins);
    const float8 scale = d * byte8_floats(scales), offset = -dmin * byte8_floats(mins); /* -: exact */
    memcpy(k->scale, &scale, sizeof scale);
    memcpy(k->offset, &offset, sizeof offset);
    /* Read back from memory: each register broadcasts its scale from there (a load); kept in registers,
     * the compiler took each apart by shuffles, on the port the lookups need (Q4_K 2x slower). */
    __asm__ volatile("" ::: "memory");
}

/* Register v of a K-quant super-block (its weights v * LANES ..), made in registers from its scales:
 * the numpy routines' operations on the same operands, so their values. AVX-512 makes Q4_K's from the
 * sub-block's 16 possible values, T[i] = (d * sc) * i - dmin * m (one rounding, as each weight's),
 * looked up by nibble (vpermps reads an index's low 4 bits), as Q4_0's blocks: 1-2 instructions a
 * register where widening, conversion and a multiply-add take 3. */
static inline __attribute__((always_inline)) floatv k_register(const uint8_t *b, int type, int v,
                                                               struct k_scales *k) {
    const int e = v * LANES; /* the register's first weight */
#ifdef Q6_BYTES
    if (type == TYPE_Q6_K) { /* each half's quants made at its first register */
        if (v % 8 == 0) q6_half(b, v / 8, k->q6);
        return (floatv)q6_register(k->q6[v % 8 / 4], v % 4, k->scale[v]);
    }
#endif
    if (type == TYPE_Q6_K) { /* half h of 128, bit pair j of 32, scale group g of 16 (LANES divides 16) */
        const int h = e / 128, j = e % 128 / 32, g = e % 32 / 16, o = e % 16;
        const uint8_t *l = b + h * 64 + j % 2 * 32 + g * 16 + o, *hb = b + 128 + h * 32 + g * 16 + o;
        const bytev q = ((bytes_at(l) >> (4 * (j / 2))) & 15) | ((bytes_at(hb) >> (2 * j)) & 3) << 4;
        const sbytev centred = (sbytev)q - 32; /* q - 32: exact in an int8 */
        return k->scale[h * 8 + j * 2 + g] * __builtin_convertvector(__builtin_convertvector(centred, intv), floatv);
    }
    const int c = e / 64, high = e % 64 / 32, pos = e % 32, sub = 2 * c + high; /* sub-block 2c + high */
    const uint8_t *qs = b + (type == TYPE_Q5_K ? 48 : 16) + c * 32 + pos;
#if defined(__AVX512F__)
    if (type == TYPE_Q4_K) {
        const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_ps(k->scale[sub]), _mm512_set1_ps(k->offset[sub]));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        return (floatv)_mm512_permutexvar_ps(high ? _mm512_srli_epi32(bytes, 4) : bytes, table);
    }
#endif
    bytev q = high ? bytes_at(qs) >> 4 : bytes_at(qs) & 15;
    if (type == TYPE_Q5_K) q |= ((bytes_at(b + 16 + pos) >> sub) & 1) << 4;
    return k->scale[sub] * byte_floats(q) + k->offset[sub];
}

/* A super-block's 256 values into out, register by register: the few-row passes' values. */
static inline __attribute__((always_inline)) void dequant_super_block(const uint8_t *b, int type, float *out) {
    struct k_scales k;
    k_prepare(b, type, &k);
#pragma GCC unroll 32
    for (int v = 0; v < QK_K / LANES; v++) {
        const floatv weights = k_register(b, type, v, &k);
        memcpy(out + v * LANES, &weights, sizeof weights);
    }
}

/* The row's values: [K] fp32, what the loader's dequantization writes. */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *row, int type, int64_t K, float *out) {
    const int bb = block_bytes(type);
    if (is_k_type(type)) {
        for (int64_t i = 0; i < K / QK_K; i++) dequant_super_block(row + i * bb, type, out + i * QK_K);
        return;
    }
    const int64_t blocks = K / QK;
#ifdef REGISTER_SCALES
    for (int64_t i = 0; i < blocks; i++) {
        floatv d, m, wv[STEPS];
        block_head(row + i * bb, type, &d, &m);
        for (int v = 0; v < STEPS; v++) {
            const floatv weights = block_register(row + i * bb, type, v, d, m, wv);
            memcpy(out + i * QK + v * LANES, &weights, sizeof weights);
        }
    }
#else
    floatv v[STEPS];
    float d[CHUNK], m[CHUNK];
    for (int64_t c = 0; c < blocks; c += CHUNK) {
        const int n = blocks - c < CHUNK ? (int)(blocks - c) : CHUNK;
        block_scales(row + c * bb, type, n, d, m);
        for (int i = 0; i < n; i++) {
            dequant_block(row + (c + i) * bb, type, d[i], m[i], v);
            memcpy(out + (c + i) * QK, v, sizeof v);
        }
    }
#endif
}

static inline void store(float sums[RB][NB], int rb, int nb, const float *bias, float *out, int64_t N, int64_t n) {
    for (int r = 0; r < rb; r++) /* gemv.c's: + 0.0f where there is no bias, as it adds */
        for (int j = 0; j < nb; j++) out[r * N + n + j] = sums[r][j] + (bias ? bias[n + j] : 0.0f);
}

/* ns weight rows (1, 2 or 4) against rb activation rows, dequantized block by block in registers.
 * Each output keeps its one accumulator (gemv.c's order); the streams only interleave outputs. */
static inline __attribute__((always_inline)) void row(const float *x, int64_t K, const uint8_t *const w[4], int type,
                                                      int ns, int rb, float sums[4][RB][NB]) {
    const int bb = block_bytes(type);
    const int64_t blocks = K / QK;
    floatv acc[4][RB] = {{{0}}}, xv;
    if (is_k_type(type)) { /* super-blocks of 256, each stream's made register by register */
        for (int64_t i = 0; i < K / QK_K; i++) {
            struct k_scales k[4];
            for (int s = 0; s < ns; s++) prefetch_ahead(w[s] + i * bb, bb);
            for (int s = 0; s < ns; s++) k_prepare(w[s] + i * bb, type, &k[s]);
#pragma GCC unroll 32
            for (int v = 0; v < QK_K / LANES; v++)
                for (int s = 0; s < ns; s++) {
                    const floatv weights = k_register(w[s] + i * bb, type, v, &k[s]);
                    for (int r = 0; r < rb; r++) {
                        memcpy(&xv, x + r * K + i * QK_K + v * LANES, sizeof xv);
                        acc[s][r] += xv * weights;
                    }
                }
        }
        for (int s = 0; s < ns; s++)
            for (int r = 0; r < rb; r++) sums[s][r][0] = hsum(acc[s][r]);
        return;
    }
#ifdef REGISTER_SCALES /* stream by stream, each block's scales widened where it is read */
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t k = i * QK;
        for (int s = 0; s < ns; s++) {
            const uint8_t *b = w[s] + i * bb;
            floatv d, m, wv[STEPS];
            if (i % 2 == 0) prefetch_ahead(b, 64);
            block_head(b, type, &d, &m);
            for (int v = 0; v < STEPS; v++) {
                const floatv weights = block_register(b, type, v, d, m, wv);
                for (int r = 0; r < rb; r++) {
                    memcpy(&xv, x + r * K + k + v * LANES, sizeof xv);
                    acc[s][r] += xv * weights;
                }
            }
        }
    }
#else
    floatv wv[4][STEPS];
    float d[4][CHUNK], m[4][CHUNK];
    for (int64_t c = 0; c < blocks; c += CHUNK) {
        const int n = blocks - c < CHUNK ? (int)(blocks - c) : CHUNK;
        for (int s = 0; s < ns; s++) block_scales(w[s] + c * bb, type, n, d[s], m[s]);
        for (int i = 0; i < n; i++) {
            const int64_t k = (c + i) * QK;
            for (int s = 0; s < ns; s++) dequant_block(w[s] + (c + i) * bb, type, d[s][i], m[s][i], wv[s]);
            for (int v = 0; v < STEPS; v++)
                for (int r = 0; r < rb; r++) {
                    memcpy(&xv, x + r * K + k + v * LANES, sizeof xv);
                    for (int s = 0; s < ns; s++) acc[s][r] += xv * wv[s][v];
                }
        }
    }
#endif
    for (int s = 0; s < ns; s++)
        for (int r = 0; r < rb; r++) sums[s][r][0] = hsum(acc[s][r]);
}

/* The run in `ns` equal parts side by side (ns streams of weights), then the rest one at a time. */
static inline __attribute__((always_inline)) void row_parts(const float *x, int64_t K, const uint8_t *w, int type,
                                                            int ns, int rb, const float *bias, float *out,
                                                            int64_t N, int64_t n_start, int64_t n_end) {
    const int64_t row_bytes = quant_row_bytes(type, K), part = (n_end - n_start) / ns;
    float sums[4][RB][NB];
    for (int64_t n = n_start; n < n_start + part; n++) {
        const uint8_t *const rows[4] = {w + n * row_bytes, w + (n + part) * row_bytes,
                                        w + (n + (ns > 2 ? 2 : 0) * part) * row_bytes,
                                        w + (n + (ns > 2 ? 3 : 0) * part) * row_bytes};
        row(x, K, rows, type, ns, rb, sums);
        for (int s = 0; s < ns; s++) store(sums[s], rb, 1, bias, out, N, n + s * part);
    }
    for (int64_t n = n_start + ns * part; n < n_end; n++) {
        const uint8_t *const rows[4] = {w + n * row_bytes, NULL, NULL, NULL};
        row(x, K, rows, type, 1, rb, sums);
        store(sums[0], rb, 1, bias, out, N, n);
    }
}

/* Up to ROW_MAX rows. Four streams for one row (AVX-512: one or two rows): each output's sum is one
 * chain of dependent multiply-adds (the fixed order), so two chains left the FMA units waiting on their
 * latency once the dequantization is in registers; four keep them busy. AVX2 has the registers for
 * four at one row only (a Zen 3, Q4_1 at 1 row: 5.0, 3.2, 3.0 ns a block for 1, 2, 4 streams; at 2 rows
 * 3.4 ns for 2 streams, 3.9 for 4). */
static inline __attribute__((always_inline)) void row_run(const float *x, int64_t K, const uint8_t *w, int type,
                                                          int rb, const float *bias, float *out, int64_t N,
                                                          int64_t n_start, int64_t n_end) {
    if (ROW_STREAMS == 2 && (rb == 1 || (rb == 2 && LANES == 16)))
        row_parts(x, K, w, type, 4, rb, bias, out, N, n_start, n_end);
    else if (ROW_STREAMS == 2)
        row_parts(x, K, w, type, 2, rb, bias, out, N, n_start, n_end);
    else
        row_parts(x, K, w, type, 1, rb, bias, out, N, n_start, n_end);
}

/* One register of floats from p. Returned by value: a memcpy into an array element became two 16-byte
 * stores read back by one 32-byte load (gcc, Zen 3), which the store forwarding could not serve. */
static inline floatv load(const float *p) {
    floatv v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rb activation rows against nb dequantized tile rows (fp32, [nb, K]) over k in [k0, k1), the sums
 * carried in acc (memory between calls): gemv.c's block() accumulators cut at k0 and k1, so the same
 * operations in the same order; the caller's hsum of each ends gemv.c's sums. */
static inline __attribute__((always_inline)) void block_part(const float *x, int64_t K, const float *w, int rb, int nb,
                                                             int64_t k0, int64_t k1, floatv acc[RB][NB]) {
    floatv a[RB][NB];
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nb; j++) a[r][j] = acc[r][j];
    for (int64_t k = k0; k < k1; k += LANES) {
        floatv wv[NB], xv;
        for (int j = 0; j < nb; j++) wv[j] = load(w + j * K + k);
        for (int r = 0; r < rb; r++) {
            memcpy(&xv, x + r * K + k, sizeof xv);
            for (int j = 0; j < nb; j++) a[r][j] += xv * wv[j];
        }
    }
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nb; j++) acc[r][j] = a[r][j];
}

/* Many rows: up to tile_rows weight rows dequantized into tile ([tile_rows, K] fp32, in L2) once, then
 * every activation row met by them, BLOCK_RB rows by NB weight rows a block (the switch gives the
 * blocks constant sizes). Each weight is dequantized once per call (up to 256 rows, quant_linear.py's
 * chunks), not once per row. K is cut into runs of K_RUN: the rows' run (BLOCK_RB x K_RUN floats)
 * stays in L1 while every NB tile rows' run meets it, the sums carried in acc between runs, so a
 * block reads one operand from L1 and one from L2 (whole-K blocks read both from L2, its bandwidth the
 * bound: 0.36-0.42 of the FMA peak at 256 rows on an Intel Xeon). */
#define K_RUN 1024
static inline __attribute__((always_inline)) void panels(const float *x, int64_t rows, int64_t K, const uint8_t *w,
                                                        int type, int64_t N, const float *bias, float *out,
                                                        int64_t n_start, int64_t n_end, float *tile,
                                                        int64_t tile_rows, floatv (*acc)[RB][NB]) {
    const int64_t row_bytes = quant_row_bytes(type, K);
    float sums[RB][NB];
    for (int64_t t = n_start; t < n_end; t += tile_rows) {
        const int64_t t_end = n_end - t < tile_rows ? n_end : t + tile_rows;
        for (int64_t n = t; n < t_end; n++) dequant_row(w + n * row_bytes, type, K, tile + (n - t) * K);
        for (int64_t r = 0; r < rows; r += BLOCK_RB) {
            const int rb = rows - r < BLOCK_RB ? (int)(rows - r) : BLOCK_RB;
            const float *xr = x + r * K;
            const int64_t groups = (t_end - t) / NB + (t_end - t) % NB; /* NB rows each, then single rows */
            memset(acc, 0, sizeof(*acc) * (size_t)groups);
            for (int64_t k0 = 0; k0 < K; k0 += K_RUN) {
                const int64_t k1 = K - k0 < K_RUN ? K : k0 + K_RUN;
                for (int64_t n = t, g = 0; n < t_end; g++) {
                    const int nb = t_end - n < NB ? 1 : NB;
                    const float *wt = tile + (n - t) * K;
                    if (nb == NB) {
                        switch (rb) {
                        case 1: block_part(xr, K, wt, 1, NB, k0, k1, acc[g]); break;
                        case 2: block_part(xr, K, wt, 2, NB, k0, k1, acc[g]); break;
                        case 3: block_part(xr, K, wt, 3, NB, k0, k1, acc[g]); break;
                        default: block_part(xr, K, wt, BLOCK_RB, NB, k0, k1, acc[g]); break;
                        }
                    } else {
                        block_part(xr, K, wt, rb, 1, k0, k1, acc[g]);
                    }
                    n += nb;
                }
            }
            for (int64_t n = t, g = 0; n < t_end; g++) {
                const int nb = t_end - n < NB ? 1 : NB;
                for (int i = 0; i < rb; i++)
                    for (int j = 0; j < nb; j++) sums[i][j] = hsum(acc[g][i][j]);
                store(sums, rb, nb, bias, out + r * N, N, n);
                n += nb;
            }
        }
    }
}

/* Output features [n_start, n_end) for every row. Returns 0, or -1 when the tile cannot be allocated.
 * Inlined once per type (range()), so the block loops carry no type test. */
static inline __attribute__((always_inline)) int range_of(const float *x, int64_t rows, int64_t K, const uint8_t *w,
                                                          int type, int64_t N, const float *bias, float *out,
                                                          int64_t n_start, int64_t n_end) {
    if (rows <= PASS_ROWS) { /* ROW_MAX rows a pass over the weights */
        for (int64_t r = 0; r < rows; r += ROW_MAX) {
            const float *xr = x + r * K;
            float *out_r = out + r * N;
            switch (rows - r < ROW_MAX ? rows - r : ROW_MAX) {
            case 1: row_run(xr, K, w, type, 1, bias, out_r, N, n_start, n_end); break;
            case 2: row_run(xr, K, w, type, 2, bias, out_r, N, n_start, n_end); break;
            case 3: row_run(xr, K, w, type, 3, bias, out_r, N, n_start, n_end); break;
            default: row_run(xr, K, w, type, 4, bias, out_r, N, n_start, n_end); break;
            }
        }
        return 0;
    }
    int64_t tile_rows = TILE_BYTES / (K * (int64_t)sizeof(float)) / NB * NB;
    tile_rows = tile_rows < NB ? NB : tile_rows;
    float *tile = aligned_alloc(64, sizeof(float) * tile_rows * K); /* whole cache lines: no load splits */
    floatv (*acc)[RB][NB] = aligned_alloc(64, sizeof(*acc) * (size_t)(tile_rows / NB + NB)); /* panels' groups */
    if (!tile || !acc) {
        free(tile);
        free(acc);
        return -1;
    }
    panels(x, rows, K, w, type, N, bias, out, n_start, n_end, tile, tile_rows, acc);
    free(tile);
    free(acc);
    return 0;
}

static int range(const float *x, int64_t rows, int64_t K, const uint8_t *w, int type, int64_t N,
                 const float *bias, float *out, int64_t n_start, int64_t n_end) {
    switch (type) {
    case TYPE_Q8_0: return range_of(x, rows, K, w, TYPE_Q8_0, N, bias, out, n_start, n_end);
    case TYPE_Q4_1: return range_of(x, rows, K, w, TYPE_Q4_1, N, bias, out, n_start, n_end);
    case TYPE_Q4_K: return range_of(x, rows, K, w, TYPE_Q4_K, N, bias, out, n_start, n_end);
    case TYPE_Q5_K: return range_of(x, rows, K, w, TYPE_Q5_K, N, bias, out, n_start, n_end);
    case TYPE_Q6_K: return range_of(x, rows, K, w, TYPE_Q6_K, N, bias, out, n_start, n_end);
    case TYPE_MXFP4: return range_of(x, rows, K, w, TYPE_MXFP4, N, bias, out, n_start, n_end);
    default: return range_of(x, rows, K, w, TYPE_Q4_0, N, bias, out, n_start, n_end);
    }
}

/* Output features [n_start, n_end) of a product of QUANT_PARTS (kernel_parts.h): each part's rows with
 * its own type, its outputs and bias at its first row's column (out's rows stay N long). */
static int parts_range(const float *x, int64_t rows, int64_t K, const struct quant_part *parts, int64_t N,
                       const float *bias, float *out, int64_t n_start, int64_t n_end) {
    int failed = 0;
    int64_t first = 0;
    for (const struct quant_part *p = parts; p->rows > 0 && first < n_end; first += p->rows, p++) {
        const int64_t lo = n_start > first ? n_start : first;
        const int64_t hi = n_end < first + p->rows ? n_end : first + p->rows;
        if (lo < hi)
            failed |= range(x, rows, K, p->w, (int)p->type, N, bias ? bias + first : NULL, out + first, lo - first,
                            hi - first);
    }
    return failed;
}

static int any_range(const float *x, int64_t rows, int64_t K, const uint8_t *w, int type, int64_t N,
                     const float *bias, float *out, int64_t n_start, int64_t n_end) {
    return type == QUANT_PARTS ? parts_range(x, rows, K, (const struct quant_part *)w, N, bias, out, n_start, n_end)
                               : range(x, rows, K, w, type, N, bias, out, n_start, n_end);
}

/* Whether the type has a product here and K fills whole blocks. */
int32_t quant_type_supported(int32_t type, int64_t K) {
    return block_bytes(type) > 0 && K > 0 && K % block_weights(type) == 0;
}

/* Whether every part has a product here (QUANT_PARTS: kernel_parts.h) and their rows make N. */
static int parts_supported(const struct quant_part *parts, int64_t K, int64_t N) {
    int64_t total = 0;
    for (const struct quant_part *p = parts; p->rows > 0; p++) {
        if (!quant_type_supported((int32_t)p->type, K)) return 0;
        total += p->rows;
    }
    return total == N;
}

/* Whether the product of w (of ggml type `type`, or QUANT_PARTS and w its parts) has a kernel here (in
 * either mode) for rows of K values and N outputs. */
int quant_product_supported(const uint8_t *w, int32_t type, int64_t K, int64_t N) {
    return type == QUANT_PARTS ? parts_supported((const struct quant_part *)w, K, N) : quant_type_supported(type, K);
}

/* w: [N, K / 32] blocks of ggml type `type` (K-quants: [N, K / 256]), or type QUANT_PARTS and w its
 * parts. Returns 0; -1: no memory for a tile; -2: a type without a product here or K not a whole number
 * of blocks. */
int32_t gemv_quant(const float *x, int64_t rows, int64_t K, const uint8_t *w, int32_t type, int64_t N,
                   const float *bias, float *out, int32_t num_threads) {
    if (!quant_product_supported(w, type, K, N)) return -2;
    if (N * K <= SMALL_WORK || num_threads <= 1) return any_range(x, rows, K, w, type, N, bias, out, 0, N);
    const int64_t num_blocks = (N + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t start = num_blocks * t / nt * NB, end = num_blocks * (t + 1) / nt * NB;
        if (start < N) failed |= any_range(x, rows, K, w, type, N, bias, out, start, end < N ? end : N) != 0;
    }
    return failed ? -1 : 0;
}

/* rows [rows, K / 32 blocks] -> out [rows, K] fp32: the values the products use. Returns 0, or -2 as
 * gemv_quant. */
int32_t dequantize_rows(const uint8_t *w, int32_t type, int64_t rows, int64_t K, float *out) {
    if (!quant_type_supported(type, K)) return -2;
    const int64_t row_bytes = quant_row_bytes(type, K);
    for (int64_t r = 0; r < rows; r++) dequant_row(w + r * row_bytes, type, K, out + r * K);
    return 0;
}

/* One thread's part of the product for the fused decode forward, runs taken from the shared cursor
 * as gemv_share takes them (kernel_parts.h). Returns 0, or -1 when a tile could not be allocated. */
int gemv_quant_share(const float *x, int64_t rows, int64_t K, const uint8_t *w, int type, int64_t N,
                     const float *bias, float *out, int64_t *cursor, int num_threads) {
    int64_t start, end;
    int failed = 0;
    while (claim_run(cursor, N, num_threads, &start, &end)) failed |= any_range(x, rows, K, w, type, N, bias, out, start, end);
    return failed ? -1 : 0;
}
