/* Top-k logprobs of each row of scores in two passes, for the CPU (engine-core process).
 *
 * torch needs three passes and a [rows, vocab] temporary for the same answer (log_softmax writes
 * every logprob, then top-k reads them back). Here pass one keeps the k largest scores, skipping
 * 16-wide blocks that cannot enter them; pass two sums exp(score - max) with a vectorizable exp.
 * logprob = score - (max + log(sum)). Ties keep the lower token id first, as argmax does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 16

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
    for (int i = 0; i < k; i++) values[i] -= *lse;
}

/* scores: [num_rows, vocab] (rows `row_stride` apart); values: [num_rows, k] logprobs, ids:
 * [num_rows, k] int64, largest first; lse: [num_rows] log-sum-exp of each row. */
void logprob_rows(const float *scores, int64_t num_rows, int64_t vocab, int64_t row_stride, int32_t k,
                  float *values, int64_t *ids, float *lse, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t row = 0; row < num_rows; row++)
        one_row(scores + row * row_stride, vocab, k, values + row * k, ids + row * k, lse + row);
}
