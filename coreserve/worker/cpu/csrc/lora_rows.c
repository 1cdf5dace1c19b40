/* LoRA's grouped low-rank products (engine-core process; coreserve/worker/lora/lora_ops.py): one call adds every
 * adapter's delta to its rows of one product's output, in place: for row t of adapter group g,
 * h = A_g x_t (the ranks of all of the group's parts, their A rows concatenated), then for each part p
 * out[t, start_p + j] += (B_p[j, :] . h[offset_p ..]) * scale_p, as PEFT's unmerged forward computes
 * base + B(A x) * scale.
 *
 * Up to RB rows of one adapter share each read of its A and B. A row's numbers depend on its values and
 * its adapter alone: each entry of h sums over 16 lane accumulators in index order (fused multiply-adds)
 * then one fixed tree of the lanes, each output of B in rank order (B kept transposed, 16 outputs a
 * vector), whatever the rows, their groups, their blocks or the threads (which split the blocks), so a
 * row's bits do not depend on its batch (batch invariance).
 * x: [rows, in] fp32; out: [rows, out_width] fp32; group_of_row[t]: its group, -1 for none.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX-512: a register a run of 16; AVX2: two. The same fused multiply-adds as the generic code's. */
#define LORA_AVX2 1
#endif

#pragma GCC optimize("fp-contract=off") /* the fused multiply-adds are the ones written, in every build */

#include "lora_rows.h"

#define LANES 16
#define RB 4 /* rows of one adapter that share each read of its A and B */
#define MAX_RANK 1024 /* h's entries a row: the ranks of a group's parts together */

/* The lanes after the whole runs of 16 (the tail, c from `c`), then the fixed tree: lane l + 8, + 4,
 * + 2, + 1. */
static inline float finish_lanes(float acc[LANES], const float *row, const float *x, int64_t c, int64_t in) {
    for (int l = 0; c + l < in; l++) acc[l] = fmaf(row[c + l], x[c + l], acc[l]);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
}

/* h[i][k] = sum of a[k, c] * x_i[c] for the block's rows i: lane l takes c = l mod 16 in index order
 * (fused multiply-adds), then the fixed tree. A row of A is read once for the block. */
static void a_block(const float *a, int64_t rank, int64_t in, const float *const *x, int nr, float (*h)[MAX_RANK]) {
    for (int64_t k = 0; k < rank; k++) {
        const float *row = a + k * in;
        float acc[RB][LANES];
        int64_t c = 0;
#if defined(__AVX512F__)
        __m512 v[RB];
        for (int i = 0; i < nr; i++) v[i] = _mm512_setzero_ps();
        for (; c + LANES <= in; c += LANES) {
            const __m512 r = _mm512_loadu_ps(row + c);
            for (int i = 0; i < nr; i++) v[i] = _mm512_fmadd_ps(r, _mm512_loadu_ps(x[i] + c), v[i]);
        }
        for (int i = 0; i < nr; i++) _mm512_storeu_ps(acc[i], v[i]);
#elif defined(LORA_AVX2)
        __m256 lo[RB], hi[RB];
        for (int i = 0; i < nr; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (; c + LANES <= in; c += LANES) {
            const __m256 r0 = _mm256_loadu_ps(row + c), r1 = _mm256_loadu_ps(row + c + 8);
            for (int i = 0; i < nr; i++) {
                lo[i] = _mm256_fmadd_ps(r0, _mm256_loadu_ps(x[i] + c), lo[i]);
                hi[i] = _mm256_fmadd_ps(r1, _mm256_loadu_ps(x[i] + c + 8), hi[i]);
            }
        }
        for (int i = 0; i < nr; i++) _mm256_storeu_ps(acc[i], lo[i]), _mm256_storeu_ps(acc[i] + 8, hi[i]);
#else
        for (int i = 0; i < nr; i++)
            for (int l = 0; l < LANES; l++) acc[i][l] = 0.0f;
        for (; c + LANES <= in; c += LANES)
            for (int i = 0; i < nr; i++)
                for (int l = 0; l < LANES; l++) acc[i][l] = fmaf(row[c + l], x[i][c + l], acc[i][l]);
#endif
        for (int i = 0; i < nr; i++) h[i][k] = finish_lanes(acc[i], row, x[i], c, in);
    }
}

/* out_i[j] += (sum over k ascending of bt[k, j] * h_i[k]) * scale for j < width: each output's sum in
 * rank order (fused multiply-adds), 16 outputs a vector, a row of B^T read once for the block. */
static void b_block(const float *bt, int64_t rank, int64_t width, float scale, float (*h)[MAX_RANK],
                    int64_t offset, float *const *out, int nr) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + LANES <= width; j += LANES) {
        __m512 v[RB];
        for (int i = 0; i < nr; i++) v[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const __m512 r = _mm512_loadu_ps(bt + k * width + j);
            for (int i = 0; i < nr; i++) v[i] = _mm512_fmadd_ps(r, _mm512_set1_ps(h[i][offset + k]), v[i]);
        }
        const __m512 s = _mm512_set1_ps(scale);
        for (int i = 0; i < nr; i++)
            _mm512_storeu_ps(out[i] + j, _mm512_add_ps(_mm512_loadu_ps(out[i] + j), _mm512_mul_ps(v[i], s)));
    }
#elif defined(LORA_AVX2)
    for (; j + LANES <= width; j += LANES) {
        __m256 lo[RB], hi[RB];
        for (int i = 0; i < nr; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const float *row = bt + k * width + j;
            const __m256 r0 = _mm256_loadu_ps(row), r1 = _mm256_loadu_ps(row + 8);
            for (int i = 0; i < nr; i++) {
                const __m256 hk = _mm256_set1_ps(h[i][offset + k]);
                lo[i] = _mm256_fmadd_ps(r0, hk, lo[i]), hi[i] = _mm256_fmadd_ps(r1, hk, hi[i]);
            }
        }
        const __m256 s = _mm256_set1_ps(scale);
        for (int i = 0; i < nr; i++) {
            float *o = out[i] + j;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(lo[i], s)));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), _mm256_mul_ps(hi[i], s)));
        }
    }
#endif
    for (; j < width; j += LANES) {
        const int n = width - j < LANES ? (int)(width - j) : LANES;
        for (int i = 0; i < nr; i++) {
            float acc[LANES] = {0};
            for (int64_t k = 0; k < rank; k++)
                for (int l = 0; l < n; l++) acc[l] = fmaf(bt[k * width + j + l], h[i][offset + k], acc[l]);
            for (int l = 0; l < n; l++) out[i][j + l] = out[i][j + l] + acc[l] * scale;
        }
    }
}

/* Rows `rows[0 .. nr)` of group g (up to RB): each row's numbers are those it would have alone. */
static void row_block(const float *x, int64_t in, float *out, int64_t out_width, const int64_t *rows, int nr,
                      const struct lora_group *g) {
    float h[RB][MAX_RANK];
    const float *xs[RB];
    float *outs[RB];
    for (int i = 0; i < nr; i++) xs[i] = x + rows[i] * in, outs[i] = out + rows[i] * out_width;
    a_block(g->a, g->rank, in, xs, nr, h);
    for (int64_t p = 0; p < g->num_parts; p++) {
        const struct lora_part *part = &g->parts[p];
        float *starts[RB];
        for (int i = 0; i < nr; i++) starts[i] = outs[i] + part->start;
        b_block(part->bt, part->rank, part->width, part->scale, h, part->offset, starts, nr);
    }
}

/* The work: blocks of up to RB rows of one group, groups in order, rows ascending within; returns how
 * many (order: the rows by block; block_start: [blocks + 1]; block_group: [blocks]). */
static int64_t plan_blocks(int64_t rows, const int32_t *group_of_row, int32_t num_groups, int64_t *order,
                           int64_t *block_start, int32_t *block_group) {
    int64_t num_ordered = 0, num_blocks = 0;
    for (int32_t g = 0; g < num_groups; g++) {
        int in_block = 0;
        for (int64_t t = 0; t < rows; t++) {
            if (group_of_row[t] != g) continue;
            if (in_block == 0) block_start[num_blocks] = num_ordered, block_group[num_blocks++] = g;
            order[num_ordered++] = t;
            in_block = in_block + 1 == RB ? 0 : in_block + 1;
        }
    }
    block_start[num_blocks] = num_ordered;
    return num_blocks;
}

/* Returns 0; -1 where a group's rank exceeds MAX_RANK, -2 without memory (nothing written). */
int32_t lora_rows(const float *x, int64_t rows, int64_t in, float *out, int64_t out_width,
                  const int32_t *group_of_row, const struct lora_group *groups, int32_t num_groups,
                  int32_t num_threads) {
    for (int32_t g = 0; g < num_groups; g++)
        if (groups[g].rank > MAX_RANK) return -1;
    int64_t *order = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(int64_t));
    int64_t *block_start = malloc((size_t)(rows + 1) * sizeof(int64_t));
    int32_t *block_group = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(int32_t));
    if (!order || !block_start || !block_group) {
        free(order), free(block_start), free(block_group);
        return -2;
    }
    const int64_t num_blocks = plan_blocks(rows, group_of_row, num_groups, order, block_start, block_group);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_blocks > 1)
    for (int64_t b = 0; b < num_blocks; b++)
        row_block(x, in, out, out_width, order + block_start[b], (int)(block_start[b + 1] - block_start[b]),
                  &groups[block_group[b]]);
    free(order), free(block_start), free(block_group);
    return 0;
}

void lora_rows_share(const float *x, int64_t rows, int64_t in, float *out, int64_t out_width,
                     const int32_t *group_of_row, const struct lora_group *groups, int32_t num_groups) {
    int64_t order[LORA_SHARE_ROWS], block_start[LORA_SHARE_ROWS + 1];
    int32_t block_group[LORA_SHARE_ROWS];
    const int64_t num_blocks = plan_blocks(rows, group_of_row, num_groups, order, block_start, block_group);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_blocks; b++)
        row_block(x, in, out, out_width, order + block_start[b], (int)(block_start[b + 1] - block_start[b]),
                  &groups[block_group[b]]);
}
