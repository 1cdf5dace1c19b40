/* Top-k logprobs of each row of scores in two passes, for the CPU (engine-core process).
 *
 * torch needs three passes and a [rows, vocab] temporary for the same answer (log_softmax writes
 * every logprob, then top-k reads them back). Here pass one keeps the k largest scores, skipping
 * 16-wide blocks that cannot enter them; pass two sums exp(score - max) with a vectorizable exp.
 * The caller takes logprob = score - lse, lse = max + log(sum). Ties keep the lower token id
 * first, as argmax does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16

#include "vector_exp.h"

/* sum of exp(score - top) over a row: float lanes for 512 scores at a time, then a double total
 * (a float sum of 50k terms drifts by ~1e-4). */
static double sum_exp(const float *scores, int64_t vocab, float top) {
    double total = 0.0;
    int64_t v = 0;
    while (v + 8 <= vocab) {
        float8 lanes = {0};
        for (const int64_t end = v + 512 < vocab ? v + 512 : vocab; v + 8 <= end; v += 8) {
            float8 chunk;
            memcpy(&chunk, scores + v, sizeof chunk);
            lanes += exp_nonpositive(chunk - top);
        }
        for (int i = 0; i < 8; i++) total += lanes[i];
    }
    float8 tail = {0}, tail_scores = {0};
    for (int i = 0; v + i < vocab; i++) tail_scores[i] = scores[v + i] - top;
    tail = exp_nonpositive(tail_scores);
    for (int i = 0; v + i < vocab; i++) total += tail[i];
    return total;
}

static inline int block_has_above(const float *block, float threshold) {
    int count = 0;
#pragma omp simd reduction(+ : count)
    for (int i = 0; i < BLOCK; i++) count += block[i] > threshold;
    return count;
}

static void insert(float *values, int64_t *ids, int k, float value, int64_t id) {
    int place = k - 1;
    while (place > 0 && value > values[place - 1]) { /* strict: an equal, earlier id stays ahead */
        values[place] = values[place - 1];
        ids[place] = ids[place - 1];
        place--;
    }
    values[place] = value;
    ids[place] = id;
}

static void one_row(const float *scores, int64_t vocab, int k, float *values, int64_t *ids, float *lse) {
    for (int i = 0; i < k; i++) {
        values[i] = -INFINITY;
        ids[i] = 0;
    }
    int filled = 0;
    for (int64_t start = 0; start < vocab; start += BLOCK) {
        const int64_t end = start + BLOCK < vocab ? start + BLOCK : vocab;
        if (filled >= k && end - start == BLOCK && !block_has_above(scores + start, values[k - 1])) continue;
        for (int64_t v = start; v < end; v++) {
            if (filled < k) {
                insert(values, ids, filled + 1, scores[v], v);
                filled++;
            } else if (scores[v] > values[k - 1]) {
                insert(values, ids, k, scores[v], v);
            }
        }
    }
    *lse = values[0] + (float)log(sum_exp(scores, vocab, values[0]));
}

/* scores: [num_rows, vocab] (rows `row_stride` apart); values: [num_rows, k] the largest scores, ids:
 * [num_rows, k] int64 theirs, largest first; lse: [num_rows] log-sum-exp of each row. */
void logprob_rows(const float *scores, int64_t num_rows, int64_t vocab, int64_t row_stride, int32_t k,
                  float *values, int64_t *ids, float *lse, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t row = 0; row < num_rows; row++)
        one_row(scores + row * row_stride, vocab, k, values + row * k, ids + row * k, lse + row);
}

/* The index of a row's largest score, the lowest among equals; a NaN counts as the largest, as in
 * torch.argmax. Two passes: the maximum (and whether there is a NaN) on 8 lanes, then its first index. */
static int64_t argmax_row(const float *row, int64_t vocab) {
    float8 tops = (float8){0} - INFINITY, chunk;
    int8x32 nans = {0};
    int64_t v = 0;
    for (; v + 8 <= vocab; v += 8) {
        memcpy(&chunk, row + v, sizeof chunk);
        const int8x32 above = chunk > tops;
        nans |= chunk != chunk;
        tops = (float8)(((int8x32)chunk & above) | ((int8x32)tops & ~above));
    }
    float top = -INFINITY;
    int has_nan = 0;
    for (int i = 0; i < 8; i++) {
        top = tops[i] > top ? tops[i] : top;
        has_nan |= nans[i] != 0;
    }
    for (; v < vocab; v++) {
        top = row[v] > top ? row[v] : top;
        has_nan |= row[v] != row[v];
    }
    for (int64_t i = 0; i < vocab; i++)
        if (has_nan ? row[i] != row[i] : row[i] == top) return i;
    return 0;
}

/* scores: [num_rows, vocab] with rows row_stride apart; ids: [num_rows]. */
void argmax_rows(const float *scores, int64_t num_rows, int64_t vocab, int64_t row_stride, int64_t *ids,
                 int32_t num_threads) {
    if (num_rows * vocab <= (1 << 20) || num_threads <= 1) { /* a decode step's rows: no parallel region */
        for (int64_t r = 0; r < num_rows; r++) ids[r] = argmax_row(scores + r * row_stride, vocab);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) ids[r] = argmax_row(scores + r * row_stride, vocab);
}
