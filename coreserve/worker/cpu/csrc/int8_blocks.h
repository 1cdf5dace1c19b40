/* Integer mode's weight blocks in integers (gemv_int8.c's definition, docs/quantized.md "Integer mode"),
 * shared by its row-by-row products (gemv_int8.c) and its 16-row panels (int8_panels.c), engine-core
 * process: each block's signed integers w, scale and offset by the generic code (decode_block), and on
 * AVX512-VNNI a group of 8 blocks as four registers of unsigned bytes (make_group).
 */
#ifndef CORESERVE_INT8_BLOCKS_H
#define CORESERVE_INT8_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernel_parts.h"
#include "quant_blocks.h"

#define GROUP 8 /* blocks of 32 a group: a K-quant's super-block, the accumulators' count */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_AVX2 1 /* vpmaddubsw: products of byte pairs summed into int16, exact for these weights */
#endif

static inline int has_offset(int type) { return type == TYPE_Q4_1 || type == TYPE_Q4_K || type == TYPE_Q5_K; }

/* What the unsigned weight bytes of the VNNI code (make_group's) exceed the definition's w by: Q8_0's
 * q + 128, Q4_0's q = w + 8, MXFP4's v + 12 (Q6_K's 32 is taken out per 16, under its scales). */
static inline int block_minus(int type) {
    return type == TYPE_Q8_0 ? 128 : type == TYPE_Q4_0 ? 8 : type == TYPE_MXFP4 ? 12 : 0;
}

/* MXFP4's nibble -> v + 12 (block_minus), unsigned: the vector code's lookup (vpshufb) of each nibble. */
#define MXFP4_UNSIGNED 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

/* Weight block j of a row of type `type`: its 32 integers w of the definition (Q4_0 q - 8, Q6_K q - 32,
 * Q8_0 q, MXFP4 its doubled e2m1 values v in -12..12, the others q), its scale (MXFP4 2^(e - 128)) and
 * offset (0 for a type without one), and (sc, where given) Q6_K's two int8 scales of its 16s (1 and 1
 * for the other types). */
static inline void decode_block(const uint8_t *row, int type, int64_t j, int8_t w[QK], float *scale, float *offset,
                                int sc[2]) {
    *offset = 0.0f;
    if (sc) sc[0] = sc[1] = 1;
    if (type == TYPE_MXFP4) {
        const uint8_t *b = row + j * block_bytes(type);
        *scale = mxfp4_half(b[0]);
        for (int i = 0; i < 16; i++) w[i] = MXFP4_VALUES[b[1 + i] & 0x0f], w[i + 16] = MXFP4_VALUES[b[1 + i] >> 4];
        return;
    }
    if (!is_k_type(type)) {
        const uint8_t *b = row + j * block_bytes(type);
        *scale = half_at(b);
        if (type == TYPE_Q8_0) {
            for (int i = 0; i < QK; i++) w[i] = (int8_t)b[2 + i];
            return;
        }
        const uint8_t *qs = b + (type == TYPE_Q4_1 ? 4 : 2);
        const int minus = type == TYPE_Q4_1 ? 0 : 8;
        for (int i = 0; i < 16; i++) w[i] = (int8_t)((qs[i] & 0x0f) - minus), w[i + 16] = (int8_t)((qs[i] >> 4) - minus);
        if (type == TYPE_Q4_1) *offset = half_at(b + 2);
        return;
    }
    const uint8_t *b = row + j / GROUP * block_bytes(type);
    const int sub = (int)(j % GROUP);
    if (type == TYPE_Q6_K) {
        const int h = sub / 4, part = sub % 4; /* half of 128, then 32 weights in it */
        const uint8_t *ql = b + 64 * h + (part % 2) * 32, *qh = b + 128 + 32 * h;
        for (int i = 0; i < QK; i++) {
            const int nibble = part < 2 ? ql[i] & 0x0f : ql[i] >> 4;
            w[i] = (int8_t)((nibble | ((qh[i] >> (2 * part)) & 3) << 4) - 32);
        }
        *scale = half_at(b + 208);
        if (sc) sc[0] = (int8_t)b[192 + 2 * sub], sc[1] = (int8_t)b[192 + 2 * sub + 1];
        return;
    }
    uint64_t scales, mins;
    k_unpack_scales(b + 4, &scales, &mins);
    *scale = half_at(b) * (float)(uint8_t)(scales >> (8 * sub));
    *offset = -half_at(b + 2) * (float)(uint8_t)(mins >> (8 * sub));
    const uint8_t *qs = b + (type == TYPE_Q5_K ? 48 : 16) + 32 * (sub / 2);
    for (int i = 0; i < QK; i++) {
        const int q = sub % 2 ? qs[i] >> 4 : qs[i] & 0x0f;
        w[i] = (int8_t)(type == TYPE_Q5_K ? q | ((b[16 + i] >> sub) & 1) << 4 : q);
    }
}

/* I_j of the definition: weight block j against its activation block a (32 int8). */
static inline int32_t block_sum(const uint8_t *row, int type, int64_t j, const int8_t *a, float *scale, float *offset) {
    int8_t w[QK];
    int sc[2];
    decode_block(row, type, j, w, scale, offset, sc);
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < QK; i++) sums[i / 16] += w[i] * a[i];
    return sc[0] * sums[0] + sc[1] * sums[1];
}


#if defined(INT8_VNNI) || defined(INT8_AVX2)
/* The scales 2^(e - 128) of 8 MXFP4 blocks from b, in block order. */
static inline __m256 mxfp4_scales(const uint8_t *b) {
    float scales[GROUP];
    for (int j = 0; j < GROUP; j++) scales[j] = mxfp4_half(b[j * block_bytes(TYPE_MXFP4)]);
    return _mm256_loadu_ps(scales);
}

/* A Q4_K or Q5_K super-block's 8 sub-block scales d * sc_j and offsets -dmin * m_j, in block order. */
static inline void k_group_scales(const uint8_t *b, __m256 *scale, __m256 *offset) {
    uint64_t scales, mins;
    k_unpack_scales(b + 4, &scales, &mins);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales)));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins)));
    *scale = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), sc);
    *offset = _mm256_mul_ps(_mm256_set1_ps(-half_at(b + 2)), m);
}
#endif

#ifdef INT8_AVX2
/* One group of 8 blocks of a weight row for AVX2: register j holds block j's 32 weights as unsigned bytes
 * (Q4_0's q, Q6_K's q, the K-quants' q; Q8_0's signed w, whose signs go onto the activations: |w| <= 128
 * times |a| <= 127, twice, fits vpmaddubsw's int16 as the others' 63 * 127 * 2 does); the blocks'
 * scales and offsets, `minus` as make_group's, and Q6_K's int16 scales of each register's two 16s. */
struct group2 {
    __m256i w[GROUP], sc[GROUP];
    __m256 scale, offset;
    __m256i sc16; /* Q6_K: the 16 scales as int16 */
    int minus, has_offset;
};

static inline __m256i nibbles_of(const uint8_t *qs) { /* 16 bytes -> low nibbles, then high */
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), nibble = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), nibble), _mm_and_si128(x, nibble));
}

static inline __attribute__((always_inline)) void make_group2(const uint8_t *b, int type, struct group2 *g) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    g->minus = 0, g->has_offset = 0;
    for (int j = 0; j < GROUP; j++) g->sc[j] = ones;
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
        const uint8_t *qs = b + (type == TYPE_Q5_K ? 48 : 16);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int j = 0; j < GROUP; j++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            __m256i w = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(x, 4) : x, nibble);
            if (type == TYPE_Q5_K) { /* bit j of qh[l]: the fifth bit of weight l */
                const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                w = _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                        _mm256_set1_epi8(16)));
            }
            g->w[j] = w;
        }
        k_group_scales(b, &g->scale, &g->offset);
        g->has_offset = 1;
        return;
    }
    if (type == TYPE_Q6_K) {
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int j = 0; j < GROUP; j++) {
            const int h = j / 4, part = j % 4; /* as decode_block's */
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + (part % 2) * 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i low = _mm256_and_si256(part < 2 ? ql : _mm256_srli_epi16(ql, 4), nibble);
            const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * part), 4), top);
            g->w[j] = _mm256_or_si256(low, high);
            const int16_t s0 = (int8_t)b[192 + 2 * j], s1 = (int8_t)b[193 + 2 * j];
            g->sc[j] = _mm256_setr_epi16(s0, s0, s0, s0, s0, s0, s0, s0, s1, s1, s1, s1, s1, s1, s1, s1);
        }
        g->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        g->scale = _mm256_set1_ps(half_at(b + 208));
        return;
    }
    const int bb = block_bytes(type);
    if (type == TYPE_MXFP4) {
        const __m256i table = _mm256_setr_epi8(MXFP4_UNSIGNED, MXFP4_UNSIGNED);
        g->scale = mxfp4_scales(b);
        for (int j = 0; j < GROUP; j++) g->w[j] = _mm256_shuffle_epi8(table, nibbles_of(b + j * bb + 1));
        g->minus = block_minus(type);
        return;
    }
    uint16_t heads[GROUP], mins[GROUP];
    for (int j = 0; j < GROUP; j++) memcpy(&heads[j], b + j * bb, 2), memcpy(&mins[j], b + j * bb + 2, 2);
    g->scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)heads));
    for (int j = 0; j < GROUP; j++)
        g->w[j] = type == TYPE_Q8_0 ? _mm256_loadu_si256((const __m256i *)(b + j * bb + 2))
                                    : nibbles_of(b + j * bb + nibbles_at(type));
    if (type == TYPE_Q4_1) g->offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mins)), g->has_offset = 1;
    if (type == TYPE_Q4_0) g->minus = 8;
}
#endif

#ifdef INT8_VNNI
static inline __m512i two_halves(const void *low, const void *high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)low)),
                              _mm256_loadu_si256((const __m256i *)high), 1);
}

/* One group of 8 blocks of a weight row, made once: 4 registers of unsigned weight bytes (register i:
 * blocks 2i and 2i + 1), the scales and offsets of the 8 blocks, what to take out per block (`minus` times the
 * activations' sums of 32, or Q6_K's sc-weighted sums of 16) and the int32 scales of Q6_K's lanes. */
struct group {
    __m512i w[4], lane_scale[4];
    __m256 scale, offset;
    __m256i sc16; /* Q6_K: the 16 scales as int16 */
    int minus, has_offset;
};

/* Q4_K and Q5_K: each 32 bytes of nibbles hold two sub-blocks (low nibbles, then high), put in block order. */
static inline __attribute__((always_inline)) void group_k(const uint8_t *b, int type, struct group *g) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const uint8_t *qs = b + (type == TYPE_Q5_K ? 48 : 16);
    const __m512i lo = _mm512_loadu_si512(qs), hi = _mm512_loadu_si512(qs + 64);
    g->w[0] = _mm512_and_si512(lo, nibble), g->w[1] = _mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble);
    g->w[2] = _mm512_and_si512(hi, nibble), g->w[3] = _mm512_and_si512(_mm512_srli_epi16(hi, 4), nibble);
    if (type == TYPE_Q5_K) { /* bit s of qh[l]: the fifth bit of sub-block s's weight l */
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        const int first[4] = {0, 1, 4, 5}; /* register i: sub-blocks first[i] (bytes 0-31), first[i] + 2 */
        for (int i = 0; i < 4; i++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << first[i])),
                                                   _mm256_set1_epi8((char)(1 << (first[i] + 2))), 1);
            g->w[i] = _mm512_mask_add_epi8(g->w[i], _mm512_test_epi8_mask(qh, bit), g->w[i], _mm512_set1_epi8(16));
        }
    }
    k_group_scales(b, &g->scale, &g->offset);
    g->has_offset = 1;
    const __m512i p0 = g->w[0], p1 = g->w[1], p2 = g->w[2], p3 = g->w[3]; /* sub-blocks (0, 2) (1, 3) (4, 6) (5, 7) */
    g->w[0] = _mm512_shuffle_i64x2(p0, p1, 0x44), g->w[1] = _mm512_shuffle_i64x2(p0, p1, 0xee);
    g->w[2] = _mm512_shuffle_i64x2(p2, p3, 0x44), g->w[3] = _mm512_shuffle_i64x2(p2, p3, 0xee);
}

/* Q6_K: registers i = 0..3 hold blocks (2i, 2i + 1), q unsigned; the int32 scale of each lane's 16. */
static inline __attribute__((always_inline)) void group_q6(const uint8_t *b, struct group *g) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        const __m512i low = _mm512_loadu_si512(b + 64 * h);
        const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        const __m512i pairs = _mm512_mask_srli_epi16(high, 0xffff0000u, high, 2); /* bytes 32-63: qh >> 2 */
        const __m512i top = _mm512_set1_epi8(0x30);
        /* ternary 0xe4: the first operand's bits where the third's are set, the second's elsewhere */
        g->w[2 * h] = _mm512_ternarylogic_epi32(low, _mm512_and_si512(_mm512_slli_epi16(pairs, 4), top), nibble, 0xe4);
        g->w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 4), _mm512_and_si512(pairs, top), nibble, 0xe4);
    }
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m512i sc32 = _mm512_cvtepi8_epi32(sc);
    for (int i = 0; i < 4; i++) /* lanes 4k .. 4k + 3 of register i: scale group 4i + k */
        g->lane_scale[i] = _mm512_permutexvar_epi32(
            _mm512_add_epi32(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2),
                             _mm512_set1_epi32(4 * i)), sc32);
    g->sc16 = _mm256_cvtepi8_epi16(sc);
    g->scale = _mm256_set1_ps(half_at(b + 208));
}

/* Q8_0, Q4_0, Q4_1, MXFP4: 8 blocks of 32, registers i = 0..3 holding blocks (2i, 2i + 1). */
static inline __attribute__((always_inline)) void group_small(const uint8_t *b, int type, struct group *g) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const int bb = block_bytes(type), start = nibbles_at(type);
    uint16_t heads[GROUP], mins[GROUP];
    for (int i = 0; i < GROUP; i++) memcpy(&heads[i], b + i * bb, 2), memcpy(&mins[i], b + i * bb + 2, 2);
    g->scale = type == TYPE_MXFP4 ? mxfp4_scales(b) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)heads));
    if (type == TYPE_Q8_0) {
        for (int i = 0; i < 4; i++)
            g->w[i] = _mm512_xor_si512(two_halves(b + 2 * i * bb + 2, b + (2 * i + 1) * bb + 2), _mm512_set1_epi8((char)0x80));
        g->minus = block_minus(type);
        return;
    }
    for (int i = 0; i < 4; i++) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2 * i * bb + start));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(b + (2 * i + 1) * bb + start));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q0, q0)), _mm256_set_m128i(q1, q1), 1);
        /* 128-bit lanes 1 and 3 shifted: the high nibbles, weights 16-31 of each block */
        g->w[i] = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xff00ff00u, both, 4), nibble);
        if (type == TYPE_MXFP4) /* each nibble's v + 12 (vpshufb: within each 128-bit lane) */
            g->w[i] = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_setr_epi8(MXFP4_UNSIGNED)), g->w[i]);
    }
    if (type == TYPE_Q4_1) {
        g->offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mins));
        g->has_offset = 1;
    } else {
        g->minus = block_minus(type);
    }
}

static inline __attribute__((always_inline)) void make_group(const uint8_t *b, int type, struct group *g) {
    g->minus = 0, g->has_offset = 0;
    if (type == TYPE_Q4_K || type == TYPE_Q5_K) group_k(b, type, g);
    else if (type == TYPE_Q6_K) group_q6(b, g);
    else group_small(b, type, g);
}

/* int8_panels.c: weight rows [n_start, n_end), whole panels of 16, against every row of x; returns where
 * the panels stop (the rest is the caller's). */
int64_t int8_panels(const struct int8_rows *a, int64_t rows, const uint8_t *w, int type, int64_t N, const float *bias,
                    float *out, int64_t n_start, int64_t n_end);
#endif

#endif
