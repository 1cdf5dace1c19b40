/* Integer mode's products (engine-core process, opt-in: quantized_activations="int8"): out = x @ W^T
 * (+ bias) with W kept in a GGUF block format (Q8_0, Q4_0, Q4_1, MXFP4, Q4_K, Q5_K, Q6_K) and x quantized to
 * int8, as llama.cpp multiplies, but with one order of summation for every row count, thread count and
 * kernel, so every bitwise guarantee of exact mode holds here too (docs/quantized.md "Integer mode").
 *
 * The definition, which the generic code below states and the vector code computes bit for bit:
 * - x's rows are quantized in blocks of 32 values (quantize_block): amax = max |x|, d = amax / 127,
 *   q = x * (127 / amax) rounded to nearest even, clamped to [-127, 127] (q = 0 and d = 0 where amax is
 *   0). Each block keeps d (fp32), d * (its sum of q) (fp32), and its two sums of 16 q (int16).
 * - Weight block j (32 weights; a K-quant's sub-block) is scale_j * q + offset_j with integer q: Q8_0
 *   and Q4_0 d * q and d * (q - 8), Q4_1 d * q + m, MXFP4 2^(e - 128) * v (v its e2m1 value doubled, an
 *   integer in -12..12: the block's exact values), Q4_K and Q5_K (d * sc_j) * q - dmin * m_j, Q6_K
 *   d * sc_g * (q - 32) with sc_g an int8 per 16 weights (folded into the integer sum below).
 * - It meets activation block j in integers: I_j = sum of w_q * a_q, exact in int32 (Q6_K: the sum of
 *   sc_g * (sum over group g of (q - 32) * a_q), at most 2^24 in size, so exact in fp32 too).
 * - Then floats, in one order: acc[j % 8] = fma(I_j, scale_j * d_j, acc[j % 8]), then for types with an
 *   offset acc[j % 8] = fma(offset_j, d_j * sum_j, acc[j % 8]); eight accumulators from 0, blocks in
 *   order; out = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)), then + bias.
 * So an output is one function of its row of x and its row of W: the same bits in any batch, chunk or
 * thread split. The products of one row of x are computed whole per weight row, never split along K:
 * here up to 4 rows of x a pass over 4 weight rows side by side (each a memory stream, prefetched), and
 * from PANEL_ROWS rows of x on, 16 weight rows at a time in int8_panels.c.
 *
 * AVX512-VNNI (vpdpbusd: unsigned weight bytes times signed activation bytes, four products a lane
 * summed into int32) computes I for 8 blocks at once (int8_blocks.h's make_group); the weights are made
 * unsigned (Q8_0 + 128, Q4_0's q, MXFP4's v + 12, Q6_K's q) and the offsets taken out again with the activations'
 * integer sums. AVX2 (vpmaddubsw: byte pairs into int16, then vpmaddwd into int32, exact for every
 * type's range) computes the same sums a block a register (make_group2); elsewhere the generic code
 * runs: the same numbers, slower.
 * x: [rows, K] fp32, w: [N, K / 32 (K-quants: K / 256) blocks], out: [rows, N] fp32.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "int8_blocks.h"

#pragma GCC optimize("fp-contract=off") /* the fused multiply-adds are the definition's, written out */

#define RG 4 /* rows of x a pass over one weight row */
#define STREAMS 4 /* weight rows read side by side (each its own memory stream) */
#define TILE_BYTES (512 * 1024) /* weight rows met by every row of x while in L2 */
#define PANEL_ROWS 16 /* rows of x from which weight rows are repacked into panels (AVX512-VNNI) */
#define NB 4 /* weight rows a thread's share is rounded to */
#define SMALL_WORK 32768


/* ---- the activations ---- */

int64_t int8_rows_bytes(int64_t rows, int64_t K) {
    return rows * K + rows * (K / QK) * 2 * (int64_t)sizeof(float) + rows * (K / 16) * 2 + 4 * 64;
}

/* The int8_rows of `rows` rows of K values carved from memory (int8_rows_bytes of it). */
struct int8_rows int8_rows_at(void *memory, int64_t rows, int64_t K) {
    uint8_t *next = (uint8_t *)(((uintptr_t)memory + 63) & ~(uintptr_t)63);
    struct int8_rows a;
    a.K = K;
    a.q = (int8_t *)next, next += rows * K;
    a.d = (float *)next, next += rows * (K / QK) * sizeof(float);
    a.ds = (float *)next, next += rows * (K / QK) * sizeof(float);
    a.s16 = (int16_t *)next;
    return a;
}

/* One block of 32 values: q (32 int8), and the block's d, d * sum(q) and two sums of 16. */
static inline void quantize_block(const float *x, int8_t *q, float *d, float *ds, int16_t *s16) {
#ifdef __AVX512F__
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
    const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inverse))), low), high);
    const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inverse))), low), high);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    const int sum0 = _mm512_reduce_add_epi32(q0), sum1 = _mm512_reduce_add_epi32(q1);
#else
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum0 = 0, sum1 = 0;
    for (int i = 0; i < QK; i++) {
        float v = nearbyintf(x[i] * inverse); /* to nearest even: cvtps2dq's rounding */
        v = !(v >= -127.0f) ? -127.0f : v > 127.0f ? 127.0f : v; /* NaN -> -127, as cvtps2dq's INT_MIN clamped */
        q[i] = (int8_t)v;
        if (i < 16) sum0 += q[i];
        else sum1 += q[i];
    }
#endif
    *d = amax / 127.0f;
    *ds = *d * (float)(sum0 + sum1);
    s16[0] = (int16_t)sum0, s16[1] = (int16_t)sum1;
}

/* Rows [r0, r1) of x ([rows, a->K] fp32) quantized into a (each row on its own: any split gives the
 * same bytes). */
void int8_quantize_rows(const float *x, int64_t r0, int64_t r1, const struct int8_rows *a) {
    const int64_t K = a->K, blocks = K / QK;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t j = 0; j < blocks; j++)
            quantize_block(x + r * K + j * QK, a->q + r * K + j * QK, a->d + r * blocks + j, a->ds + r * blocks + j,
                           a->s16 + r * (K / 16) + 2 * j);
    }
}

/* ---- the generic code: the definition ---- */

/* Blocks [j0, j1) of one weight row against row r of x, into acc (the definition's order). */
static void blocks_generic(const uint8_t *row, int type, const struct int8_rows *a, int64_t r, int64_t j0, int64_t j1,
                           float acc[GROUP]) {
    const int64_t K = a->K, blocks = K / QK;
    for (int64_t j = j0; j < j1; j++) {
        float scale, offset;
        const int32_t sum = block_sum(row, type, j, a->q + r * K + j * QK, &scale, &offset);
        float *lane = &acc[j % GROUP];
        *lane = fmaf((float)sum, scale * a->d[r * blocks + j], *lane);
        if (has_offset(type)) *lane = fmaf(offset, a->ds[r * blocks + j], *lane);
    }
}

static inline float sum_lanes(const float acc[GROUP]) {
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

#if defined(INT8_VNNI) || defined(INT8_AVX2)
/* A group's 8 integer sums of row r of x, of the unsigned weight bytes (Q6_K: each 16's already times its
 * scale) -> the definition's I_j (the bytes' excess taken out with the activations' sums), then its
 * floats into acc. The VNNI and the AVX2 code's one ending. */
static inline __attribute__((always_inline)) __m256 finish_group(__m256i sums, __m256i sc16, int minus, __m256 scale,
                                                                 __m256 offset, int has_offset, int type,
                                                                 const struct int8_rows *a, int64_t r, int64_t gi,
                                                                 __m256 acc) {
    const int64_t K = a->K, blocks = K / QK;
    const __m256i s16 = _mm256_loadu_si256((const __m256i *)(a->s16 + r * (K / 16) + 16 * gi));
    if (type == TYPE_Q6_K)
        sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(_mm256_madd_epi16(sc16, s16), 5)); /* 32 * sc-weighted sums */
    else if (minus)
        sums = _mm256_sub_epi32(sums, _mm256_mullo_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)),
                                                         _mm256_set1_epi32(minus)));
    const __m256 d = _mm256_loadu_ps(a->d + r * blocks + GROUP * gi);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, d), acc);
    if (has_offset) acc = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a->ds + r * blocks + GROUP * gi), acc);
    return acc;
}
#endif

#ifdef INT8_VNNI
/* ---- AVX512-VNNI ---- */

/* Four registers of 16 int32 partial sums, register i's lanes 0-7 block 2i's and lanes 8-15 block
 * 2i + 1's, -> the 8 blocks' sums in block order. */
static inline __m256i sum_blocks(__m512i z0, __m512i z1, __m512i z2, __m512i z3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(z0, z1), _mm512_unpackhi_epi32(z0, z1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(z2, z3), _mm512_unpackhi_epi32(z2, z3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    /* 128-bit lane 0 + 1: [z0, z1, z2, z3] of their first blocks; lane 2 + 3: of their second */
    const __m512i v = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v));
}

/* The group against row r of x (group index gi: its blocks 8 gi ..), into acc. */
static inline __attribute__((always_inline)) __m256 group_row(const struct group *g, int type, const struct int8_rows *a,
                                                              int64_t r, int64_t gi, __m256 acc) {
    const int64_t K = a->K;
    const int8_t *q = a->q + r * K + gi * QK_K;
    __m512i z[4];
    for (int i = 0; i < 4; i++) z[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g->w[i], _mm512_loadu_si512(q + 64 * i));
    if (type == TYPE_Q6_K)
        for (int i = 0; i < 4; i++) z[i] = _mm512_mullo_epi32(z[i], g->lane_scale[i]);
    return finish_group(sum_blocks(z[0], z[1], z[2], z[3]), g->sc16, g->minus, g->scale, g->offset, g->has_offset,
                        type, a, r, gi, acc);
}

#define VECTOR_GROUP struct group
#define MAKE_GROUP make_group
#define GROUP_ROW group_row
#elif defined(INT8_AVX2)
/* ---- AVX2: vpmaddubsw ---- */

/* Eight registers of 8 int32 -> their 8 sums, in register order. */
static inline __m256i sum_eight(const __m256i z[GROUP]) {
    const __m256i t0 = _mm256_hadd_epi32(z[0], z[1]), t1 = _mm256_hadd_epi32(z[2], z[3]);
    const __m256i t2 = _mm256_hadd_epi32(z[4], z[5]), t3 = _mm256_hadd_epi32(z[6], z[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3); /* 128-bit lanes: halves */
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* The group against row r of x (group index gi), into acc: make_group's sums and floats, 256 bits wide. */
static inline __attribute__((always_inline)) __m256 group_row2(const struct group2 *g, int type,
                                                               const struct int8_rows *a, int64_t r, int64_t gi,
                                                               __m256 acc) {
    const int64_t K = a->K;
    const int8_t *q = a->q + r * K + gi * QK_K;
    __m256i z[GROUP];
    for (int j = 0; j < GROUP; j++) {
        __m256i w = g->w[j], x = _mm256_loadu_si256((const __m256i *)(q + QK * j));
        if (type == TYPE_Q8_0) x = _mm256_sign_epi8(x, w), w = _mm256_sign_epi8(w, w); /* |w| and a * sign(w) */
        z[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), g->sc[j]);
    }
    return finish_group(sum_eight(z), g->sc16, g->minus, g->scale, g->offset, g->has_offset, type, a, r, gi, acc);
}

#define VECTOR_GROUP struct group2
#define MAKE_GROUP make_group2
#define GROUP_ROW group_row2
#endif

#if defined(INT8_VNNI) || defined(INT8_AVX2)
/* ns weight rows (streams: rows far apart, so the memory reads of several run at once) against rows
 * r .. r + nr - 1 of x, in either vector code's groups (VECTOR_GROUP): sums[s][i] for weight row s and
 * row r + i of x. Each (weight row, row of x) pair is the definition's sequence whatever ns and nr are. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *rows[STREAMS], int ns, int type,
                                                           const struct int8_rows *a, int64_t r, int nr,
                                                           float sums[STREAMS][RG]) {
    const int64_t blocks = a->K / QK, groups = blocks / GROUP;
    const int64_t group_bytes = is_k_type(type) ? block_bytes(type) : GROUP * block_bytes(type);
    __m256 acc[STREAMS][RG];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nr; i++) acc[s][i] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < groups; gi++)
        for (int s = 0; s < ns; s++) {
            VECTOR_GROUP g;
            prefetch_ahead(rows[s] + gi * group_bytes, group_bytes);
            MAKE_GROUP(rows[s] + gi * group_bytes, type, &g);
            for (int i = 0; i < nr; i++) acc[s][i] = GROUP_ROW(&g, type, a, r + i, gi, acc[s][i]);
        }
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nr; i++) {
            float lanes[GROUP];
            _mm256_storeu_ps(lanes, acc[s][i]);
            blocks_generic(rows[s], type, a, r + i, groups * GROUP, blocks, lanes); /* a tail of < 8 blocks */
            sums[s][i] = sum_lanes(lanes);
        }
}
#else
static inline void dot_rows(const uint8_t *rows[STREAMS], int ns, int type, const struct int8_rows *a, int64_t r,
                            int nr, float sums[STREAMS][RG]) {
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nr; i++) {
            float lanes[GROUP] = {0};
            blocks_generic(rows[s], type, a, r + i, 0, a->K / QK, lanes);
            sums[s][i] = sum_lanes(lanes);
        }
}
#endif

/* ---- the products ---- */

/* Weight rows [n_start, n_end) against rows r .. r + nr - 1 of x, in STREAMS parts side by side. */
static inline __attribute__((always_inline)) void pass_of(const struct int8_rows *a, int64_t r, int nr,
                                                          const uint8_t *w, int type, int64_t N, const float *bias,
                                                          float *out, int64_t n_start, int64_t n_end) {
    const int64_t row_bytes = quant_row_bytes(type, a->K), part = (n_end - n_start) / STREAMS;
    float sums[STREAMS][RG];
    for (int64_t n = n_start; n < n_end;) {
        const int ns = n < n_start + part ? STREAMS : 1;
        const int64_t step = ns == STREAMS ? part : 0;
        const uint8_t *rows[STREAMS];
        for (int s = 0; s < STREAMS; s++) rows[s] = w + (n + s * step) * row_bytes;
        if (ns == STREAMS) dot_rows(rows, STREAMS, type, a, r, nr, sums);
        else dot_rows(rows, 1, type, a, r, nr, sums);
        for (int s = 0; s < ns; s++)
            for (int i = 0; i < nr; i++)
                out[(r + i) * N + n + s * step] = bias ? sums[s][i] + bias[n + s * step] : sums[s][i];
        n = ns == STREAMS && n + 1 == n_start + part ? n_start + STREAMS * part : n + 1;
    }
}

/* Weight rows [n_start, n_end) for every row of x: tiles of weight rows that stay in L2 while every
 * RG rows of x meet them (the first pass reads them from memory, in STREAMS streams). */
static inline __attribute__((always_inline)) void range_of(const struct int8_rows *a, int64_t rows, const uint8_t *w,
                                                           int type, int64_t N, const float *bias, float *out,
                                                           int64_t n_start, int64_t n_end) {
#ifdef INT8_VNNI
    if (rows >= PANEL_ROWS) { /* whole panels of 16 weight rows, the rest below */
        n_start = int8_panels(a, rows, w, type, N, bias, out, n_start, n_end);
    }
#endif
    int64_t tile = TILE_BYTES / quant_row_bytes(type, a->K);
    tile = tile < STREAMS ? STREAMS : tile;
    for (int64_t t = n_start; t < n_end; t += tile) {
        const int64_t t_end = n_end - t < tile ? n_end : t + tile;
        for (int64_t r = 0; r < rows; r += RG) {
            switch (rows - r < RG ? rows - r : RG) {
            case 1: pass_of(a, r, 1, w, type, N, bias, out, t, t_end); break;
            case 2: pass_of(a, r, 2, w, type, N, bias, out, t, t_end); break;
            case 3: pass_of(a, r, 3, w, type, N, bias, out, t, t_end); break;
            default: pass_of(a, r, RG, w, type, N, bias, out, t, t_end); break;
            }
        }
    }
}

static void range(const struct int8_rows *a, int64_t rows, const uint8_t *w, int type, int64_t N, const float *bias,
                  float *out, int64_t n_start, int64_t n_end) {
    switch (type) {
    case TYPE_Q8_0: range_of(a, rows, w, TYPE_Q8_0, N, bias, out, n_start, n_end); break;
    case TYPE_Q4_1: range_of(a, rows, w, TYPE_Q4_1, N, bias, out, n_start, n_end); break;
    case TYPE_Q4_K: range_of(a, rows, w, TYPE_Q4_K, N, bias, out, n_start, n_end); break;
    case TYPE_Q5_K: range_of(a, rows, w, TYPE_Q5_K, N, bias, out, n_start, n_end); break;
    case TYPE_Q6_K: range_of(a, rows, w, TYPE_Q6_K, N, bias, out, n_start, n_end); break;
    case TYPE_MXFP4: range_of(a, rows, w, TYPE_MXFP4, N, bias, out, n_start, n_end); break;
    default: range_of(a, rows, w, TYPE_Q4_0, N, bias, out, n_start, n_end); break;
    }
}

/* A QUANT_PARTS product (kernel_parts.h): each part's rows with its own type. */
static void any_range(const struct int8_rows *a, int64_t rows, const uint8_t *w, int type, int64_t N,
                      const float *bias, float *out, int64_t n_start, int64_t n_end) {
    if (type != QUANT_PARTS) {
        range(a, rows, w, type, N, bias, out, n_start, n_end);
        return;
    }
    int64_t first = 0;
    for (const struct quant_part *p = (const struct quant_part *)w; p->rows > 0 && first < n_end; first += p->rows, p++) {
        const int64_t lo = n_start > first ? n_start : first, hi = n_end < first + p->rows ? n_end : first + p->rows;
        if (lo < hi)
            range(a, rows, p->w, (int)p->type, N, bias ? bias + first : NULL, out + first, lo - first, hi - first);
    }
}

/* x: [rows, K] fp32; w and type as gemv_quant's. Returns 0; -1: no memory for x's integers; -2: a type
 * without a product here or K not a whole number of blocks. */
int32_t gemv_int8(const float *x, int64_t rows, int64_t K, const uint8_t *w, int32_t type, int64_t N,
                  const float *bias, float *out, int32_t num_threads) {
    if (!quant_product_supported(w, type, K, N)) return -2;
    void *memory = malloc((size_t)int8_rows_bytes(rows, K));
    if (!memory) return -1;
    const struct int8_rows a = int8_rows_at(memory, rows, K);
    if (N * K <= SMALL_WORK || num_threads <= 1) {
        int8_quantize_rows(x, 0, rows, &a);
        any_range(&a, rows, w, type, N, bias, out, 0, N);
        free(memory);
        return 0;
    }
    const int64_t num_blocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int8_quantize_rows(x, rows * t / nt, rows * (t + 1) / nt, &a);
#pragma omp barrier
        const int64_t start = num_blocks * t / nt * NB, end = num_blocks * (t + 1) / nt * NB;
        if (start < N) any_range(&a, rows, w, type, N, bias, out, start, end < N ? end : N);
    }
    free(memory);
    return 0;
}

/* One thread's part of an integer-mode product in the fused decode forward: a's rows quantized
 * already (int8_quantize_rows), runs taken from the shared cursor as gemv_quant_share takes them. */
void gemv_int8_share(const struct int8_rows *a, int64_t rows, const uint8_t *w, int type, int64_t N,
                     const float *bias, float *out, int64_t *cursor, int num_threads) {
    int64_t start, end;
    while (claim_run(cursor, N, num_threads, &start, &end)) any_range(a, rows, w, type, N, bias, out, start, end);
}

/* Which code this build computes integer mode with: 2 AVX512-VNNI, 1 AVX2 (vpmaddubsw), 0 the generic. */
int32_t int8_kernel_kind(void) {
#ifdef INT8_VNNI
    return 2;
#elif defined(INT8_AVX2)
    return 1;
#else
    return 0;
#endif
}
