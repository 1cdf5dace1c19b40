/* Integer mode's many-row products (engine-core process, AVX512-VNNI): 16 weight rows at a time
 * repacked into panels, so that one register holds 4 weights of each of the 16 rows and vpdpbusd against
 * 4 activation bytes broadcast gives 16 rows' partial sums with no horizontal sum. The weights are
 * make_group's unsigned bytes; what they exceed the definition's w by is taken out with the activations'
 * sums, as the row-by-row products do. Each output is the
 * definition's sequence (gemv_int8.c), bit for bit the row-by-row products'.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_blocks.h"

#pragma GCC optimize("fp-contract=off") /* the fused multiply-adds are the definition's, written out */

#ifdef INT8_VNNI
/* One block of 32 weights of 16 weight rows, repacked so that register c holds weights 4c .. 4c + 3 of
 * each row in lane l (one vpdpbusd operand, unsigned: w + block_minus, Q6_K's q), beside the block's
 * scales per row. */
struct panel_block {
    uint8_t w[8][64];
    int32_t sc[2][16]; /* Q6_K: the scales of the block's two 16s */
    float scale[16], offset[16];
};

/* Row `lane` of the panel, staged: its unsigned bytes in block order into stage ([K] bytes), its scales,
 * offsets (and Q6_K's scales of 16) into the panel; groups of 8 blocks made by make_group, a tail of
 * fewer than 8 blocks (Q8_0, Q4_0, Q4_1, MXFP4) by the generic code. */
static void panel_stage(const uint8_t *row, int type, int64_t blocks, int lane, uint8_t *stage, struct panel_block *pb) {
    const int64_t group_bytes = is_k_type(type) ? block_bytes(type) : GROUP * block_bytes(type);
    const int64_t groups = blocks / GROUP;
    for (int64_t gi = 0; gi < groups; gi++) {
        struct group g;
        make_group(row + gi * group_bytes, type, &g);
        float scale[GROUP], offset[GROUP];
        _mm256_storeu_ps(scale, g.scale);
        _mm256_storeu_ps(offset, g.has_offset ? g.offset : _mm256_setzero_ps());
        for (int i = 0; i < 4; i++) _mm512_storeu_si512(stage + gi * QK_K + 64 * i, g.w[i]);
        for (int b = 0; b < GROUP; b++) {
            struct panel_block *p = &pb[gi * GROUP + b];
            p->scale[lane] = scale[b], p->offset[lane] = offset[b];
        }
        if (type == TYPE_Q6_K)
            for (int b = 0; b < GROUP; b++)
                for (int h = 0; h < 2; h++)
                    pb[gi * GROUP + b].sc[h][lane] = (int8_t)row[gi * group_bytes + 192 + 2 * b + h];
    }
    for (int64_t j = groups * GROUP; j < blocks; j++) {
        float scale, offset;
        int8_t w[QK];
        decode_block(row, type, j, w, &scale, &offset, NULL);
        for (int i = 0; i < QK; i++) stage[j * QK + i] = (uint8_t)(w[i] + block_minus(type));
        pb[j].scale[lane] = scale, pb[j].offset[lane] = offset;
    }
}

/* Block j of the panel's 16 staged rows (stage: [16, K]) into its registers: register c lane l = row
 * l's weights 4c .. 4c + 3, an 8 x 8 transpose of dwords in each 256-bit half (rows 0-7 and 8-15). */
static inline void panel_transpose(const uint8_t *stage, int64_t K, int64_t j, struct panel_block *p) {
    __m512i z[8], t[8], u[8];
    for (int m = 0; m < 8; m++) z[m] = two_halves(stage + m * K + j * QK, stage + (m + 8) * K + j * QK);
    for (int m = 0; m < 8; m += 2)
        t[m] = _mm512_unpacklo_epi32(z[m], z[m + 1]), t[m + 1] = _mm512_unpackhi_epi32(z[m], z[m + 1]);
    for (int m = 0; m < 8; m += 4) { /* u[m + c]: columns c and c + 4 of rows m .. m + 3 */
        u[m] = _mm512_unpacklo_epi64(t[m], t[m + 2]), u[m + 1] = _mm512_unpackhi_epi64(t[m], t[m + 2]);
        u[m + 2] = _mm512_unpacklo_epi64(t[m + 1], t[m + 3]), u[m + 3] = _mm512_unpackhi_epi64(t[m + 1], t[m + 3]);
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int c = 0; c < 4; c++) {
        _mm512_store_si512(p->w[c], _mm512_permutex2var_epi64(u[c], first, u[c + 4]));
        _mm512_store_si512(p->w[c + 4], _mm512_permutex2var_epi64(u[c], second, u[c + 4]));
    }
}

/* The panel's 16 weight rows against rows r, r + 1 (nr of them) of x: out[i][l] for row r + i and
 * weight row l, each the definition's sequence. */
static inline __attribute__((always_inline)) void panel_dot(const struct panel_block *pb, int64_t blocks, int type,
                                                            const struct int8_rows *a, int64_t r, int nr,
                                                            float out[2][16]) {
    const int64_t K = a->K;
    __m512 f[2][GROUP];
    for (int i = 0; i < nr; i++)
        for (int b = 0; b < GROUP; b++) f[i][b] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < blocks; j0 += GROUP) {
#pragma GCC unroll 8
        for (int b = 0; b < GROUP; b++) {
            const int64_t j = j0 + b;
            if (j >= blocks) break;
            const struct panel_block *p = &pb[j];
            __m512i sums[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()},
                                  {_mm512_setzero_si512(), _mm512_setzero_si512()}};
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m512i w = _mm512_load_si512(p->w[c]);
                const int h = type == TYPE_Q6_K ? c / 4 : 0;
                for (int i = 0; i < nr; i++) {
                    int32_t word;
                    memcpy(&word, a->q + (r + i) * K + j * QK + 4 * c, 4);
                    sums[i][h] = _mm512_dpbusd_epi32(sums[i][h], w, _mm512_set1_epi32(word));
                }
            }
            const __m512 scale = _mm512_load_ps(p->scale);
            for (int i = 0; i < nr; i++) {
                const int16_t *s16 = a->s16 + (r + i) * (K / 16) + 2 * j; /* the activations' sums of 16 */
                __m512i s = sums[i][0];
                if (type == TYPE_Q6_K) /* sc_g * (sum of q a - 32 * sum of a), each 16 */
                    s = _mm512_add_epi32(
                        _mm512_mullo_epi32(_mm512_sub_epi32(s, _mm512_set1_epi32(32 * s16[0])), _mm512_load_si512(p->sc[0])),
                        _mm512_mullo_epi32(_mm512_sub_epi32(sums[i][1], _mm512_set1_epi32(32 * s16[1])),
                                           _mm512_load_si512(p->sc[1])));
                else if (block_minus(type))
                    s = _mm512_sub_epi32(s, _mm512_set1_epi32(block_minus(type) * (s16[0] + s16[1])));
                const int64_t at = (r + i) * (K / QK) + j;
                f[i][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(a->d[at])), f[i][b]);
                if (has_offset(type))
                    f[i][b] = _mm512_fmadd_ps(_mm512_load_ps(p->offset), _mm512_set1_ps(a->ds[at]), f[i][b]);
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        const __m512 total = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f[i][0], f[i][4]), _mm512_add_ps(f[i][2], f[i][6])),
                                           _mm512_add_ps(_mm512_add_ps(f[i][1], f[i][5]), _mm512_add_ps(f[i][3], f[i][7])));
        _mm512_storeu_ps(out[i], total);
    }
}

/* Weight rows [n_start, n_end), whole panels of 16, against every row of x; returns where the panels
 * stop: the rest takes pass_of (all of it where the panel's memory cannot be had: the same bits). */
static inline __attribute__((always_inline)) int64_t panels_of(const struct int8_rows *a, int64_t rows,
                                                               const uint8_t *w, int type, int64_t N,
                                                               const float *bias, float *out, int64_t n_start,
                                                               int64_t n_end) {
    const int64_t blocks = a->K / QK, row_bytes = quant_row_bytes(type, a->K);
    const int64_t end = n_start + (n_end - n_start) / 16 * 16;
    if (end == n_start) return n_start;
    struct panel_block *pb = aligned_alloc(64, sizeof(*pb) * (size_t)blocks + 16 * (size_t)a->K);
    if (!pb) return n_start;
    uint8_t *stage = (uint8_t *)(pb + blocks); /* [16, K] the rows' bytes before the transpose */
    float lanes[2][16];
    for (int64_t n0 = n_start; n0 < end; n0 += 16) {
        for (int l = 0; l < 16; l++) panel_stage(w + (n0 + l) * row_bytes, type, blocks, l, stage + l * a->K, pb);
        for (int64_t j = 0; j < blocks; j++) panel_transpose(stage, a->K, j, &pb[j]);
        for (int64_t r = 0; r < rows; r += 2) {
            const int nr = rows - r < 2 ? 1 : 2;
            if (nr == 2) panel_dot(pb, blocks, type, a, r, 2, lanes);
            else panel_dot(pb, blocks, type, a, r, 1, lanes);
            for (int i = 0; i < nr; i++)
                for (int l = 0; l < 16; l++)
                    out[(r + i) * N + n0 + l] = bias ? lanes[i][l] + bias[n0 + l] : lanes[i][l];
        }
    }
    free(pb);
    return end;
}
int64_t int8_panels(const struct int8_rows *a, int64_t rows, const uint8_t *w, int type, int64_t N, const float *bias,
                    float *out, int64_t n_start, int64_t n_end) {
    switch (type) { /* each type's panel_dot inlined with its type a constant */
    case TYPE_Q8_0: return panels_of(a, rows, w, TYPE_Q8_0, N, bias, out, n_start, n_end);
    case TYPE_Q4_1: return panels_of(a, rows, w, TYPE_Q4_1, N, bias, out, n_start, n_end);
    case TYPE_Q4_K: return panels_of(a, rows, w, TYPE_Q4_K, N, bias, out, n_start, n_end);
    case TYPE_Q5_K: return panels_of(a, rows, w, TYPE_Q5_K, N, bias, out, n_start, n_end);
    case TYPE_Q6_K: return panels_of(a, rows, w, TYPE_Q6_K, N, bias, out, n_start, n_end);
    case TYPE_MXFP4: return panels_of(a, rows, w, TYPE_MXFP4, N, bias, out, n_start, n_end);
    default: return panels_of(a, rows, w, TYPE_Q4_0, N, bias, out, n_start, n_end);
    }
}
#endif
