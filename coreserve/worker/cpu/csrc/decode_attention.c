/* Decode attention over the paged, head-major KV cache, for the CPU (engine-core process).
 *
 * One call per layer covers every decode row of the step: each (row, KV head) task reads that head's
 * keys, then its values, block by block, straight from the cache (no gather copy), for all the query
 * heads that share it (grouped-query attention). Softmax in float32, as the torch path does (exp on
 * 8 lanes, within 2 ulp).
 * Built by coreserve/worker/cpu/kernels.py with the OpenMP runtime torch already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_parts.h"
#include "vector_exp.h"

/* 8-lane vectors with two accumulators: the `omp simd` loops spent more on their per-call set-up and
 * remainder than on a head's 64 or 128 products (84 us a layer for one row at 140 positions). */
typedef float float4 __attribute__((vector_size(16)));

/* dot()'s two accumulators over its first n - n % 16 elements; returns that count. */
static inline __attribute__((always_inline)) int dot_pairs(const float *a, const float *b, int n, float8 *acc0,
                                                           float8 *acc1) {
    float8 x, y;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        *acc0 += x * y;
        memcpy(&x, a + i + 8, sizeof x);
        memcpy(&y, b + i + 8, sizeof y);
        *acc1 += x * y;
    }
    return i;
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    float8 acc0 = {0}, acc1 = {0}, x, y;
    int i = dot_pairs(a, b, n, &acc0, &acc1);
    for (; i + 8 <= n; i += 8) {
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc0 += x * y;
    }
    acc0 += acc1;
    float4 half = __builtin_shufflevector(acc0, acc0, 0, 1, 2, 3) + __builtin_shufflevector(acc0, acc0, 4, 5, 6, 7);
    half += __builtin_shufflevector(half, half, 2, 3, 0, 1);
    float total = half[0] + half[1];
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* dot()'s sums before its last steps, for n a multiple of 16: acc0 + acc1 (the tail loops are empty). */
static inline __attribute__((always_inline)) float8 dot_lanes(const float *a, const float *b, int n) {
    float8 acc0 = {0}, acc1 = {0};
    dot_pairs(a, b, n, &acc0, &acc1);
    return acc0 + acc1;
}

/* dot()'s last steps for 8 keys at once: lane k of the result is ((a0 + a4) + (a2 + a6)) +
 * ((a1 + a5) + (a3 + a7)) of sums[k], the very additions dot() makes for one key, in 7 vector additions
 * and 12 shuffles where 8 keys took 8 chains of 3 dependent additions and their extractions. */
static inline __attribute__((always_inline)) float8 finish_8(const float8 sums[8]) {
    float8 h[4];
    for (int k = 0; k < 4; k++) /* lanes j and j + 4 of keys k (low half) and k + 4 (high half) */
        h[k] = __builtin_shufflevector(sums[k], sums[k + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(sums[k], sums[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    const float8 u01 = __builtin_shufflevector(h[0], h[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(h[0], h[1], 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 u23 = __builtin_shufflevector(h[2], h[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(h[2], h[3], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u01, u23, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(u01, u23, 1, 3, 9, 11, 5, 7, 13, 15);
}

static inline void axpy(float *y, float w, const float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        float8 xv, yv;
        memcpy(&xv, x + i, sizeof xv);
        memcpy(&yv, y + i, sizeof yv);
        yv += w * xv;
        memcpy(y + i, &yv, sizeof yv);
    }
    for (; i < n; i++) y[i] += w * x[i];
}

/* acc[d] = sum over positions of weights[pos - start] * value[pos][d], head_dim a multiple of 8: up
 * to 64 columns at a time in registers over all positions (an axpy per position into memory waited on
 * its own stores). Each column's sum is its own chain of multiply-then-add in position order, so the
 * width only sets how many chains run side by side: 8 for 64 columns keep both adders busy, where 4
 * waited on the adds' latency (a Zen 3). */
#define VALUE_COLUMNS(width)                                                                          \
    do {                                                                                              \
        float8 s[(width) / 8] = {{0}}, v;                                                             \
        for (int pos = start; pos < context_len;) {                                                   \
            const int offset = pos % block_size;                                                      \
            const int count = context_len - pos < block_size - offset ? context_len - pos : block_size - offset; \
            const float *value = values + ((int64_t)table[pos / block_size] * block_size + offset) * head_dim + d; \
            const float *w = weights + pos - start;                                                   \
            for (int t = 0; t < count; t++, value += head_dim)                                        \
                for (int j = 0; j < (width) / 8; j++) {                                               \
                    memcpy(&v, value + 8 * j, sizeof v);                                              \
                    s[j] += w[t] * v;                                                                 \
                }                                                                                     \
            pos += count;                                                                             \
        }                                                                                             \
        memcpy(acc + d, s, sizeof s);                                                                 \
        d += (width);                                                                                 \
    } while (0)

static inline __attribute__((always_inline)) void weighted_values(float *acc, const float *weights,
                                                                  const float *values, const int32_t *table,
                                                                  int start, int context_len, int head_dim,
                                                                  int block_size) {
    for (int d = 0; d < head_dim;) {
        if (head_dim - d >= 64)
            VALUE_COLUMNS(64);
        else if (head_dim - d >= 32)
            VALUE_COLUMNS(32);
        else
            VALUE_COLUMNS(8);
    }
}

static inline __attribute__((always_inline)) void attend(const float *q, float *out, const float *keys,
                                                        const float *values, const int32_t *table, int start,
                                                        int context_len, int group, int head_dim, int block_size,
                                                        float scale, float softcap, const float *sinks, float *scores,
                                                        float *acc) {
    const int span = context_len - start;
    float scaled_q[group * head_dim];
    for (int i = 0; i < group * head_dim; i++) scaled_q[i] = q[i] * scale;
    for (int pos = start; pos < context_len;) {
        const int offset = pos % block_size;
        const int count = context_len - pos < block_size - offset ? context_len - pos : block_size - offset;
        const float *key = keys + ((int64_t)table[pos / block_size] * block_size + offset) * head_dim;
        int t = 0;
        if (head_dim % 16 == 0) /* 8 keys at a time: finish_8 */
            for (; t + 8 <= count; t += 8, key += 8 * head_dim)
                for (int g = 0; g < group; g++) {
                    float8 sums[8];
                    for (int k = 0; k < 8; k++) sums[k] = dot_lanes(scaled_q + g * head_dim, key + k * head_dim, head_dim);
                    const float8 eight = finish_8(sums);
                    memcpy(scores + g * span + pos - start + t, &eight, sizeof eight);
                }
        for (; t < count; t++, key += head_dim)
            for (int g = 0; g < group; g++)
                scores[g * span + pos - start + t] = dot(scaled_q + g * head_dim, key, head_dim);
        pos += count;
    }
    if (softcap > 0.0f) /* Gemma 2's soft-capping of the scores, before the softmax: cap tanh(s / cap) */
        for (int j = 0; j < group * span; j++) scores[j] = softcap * tanhf(scores[j] / softcap);
    /* Softmax: each row's largest score (a maximum in any order is the same value), then its exps and
     * their sum in position order, the rows side by side so that their sums' chains overlap. */
    float totals[group], tops[group];
    for (int g = 0; g < group; g++) {
        const float *row = scores + g * span;
        float top = row[0];
        int i = 1;
        if (span >= 9) {
            float8 best, lanes;
            memcpy(&best, row + 1, sizeof best);
            for (i = 9; i + 8 <= span; i += 8) {
                memcpy(&lanes, row + i, sizeof lanes);
                const int8x32 above = lanes > best;
                best = (float8)(((int8x32)lanes & above) | ((int8x32)best & ~above));
            }
            for (int lane = 0; lane < 8; lane++) top = best[lane] > top ? best[lane] : top;
        }
        for (; i < span; i++) top = row[i] > top ? row[i] : top;
        if (sinks) top = sinks[g] > top ? sinks[g] : top; /* the sink is one more logit of the row */
        tops[g] = top;
        totals[g] = 0.0f;
    }
    int i = 0;
    for (; i + 8 <= span; i += 8) /* 8 lanes: the scalar expf was ~15 cycles a score */
        for (int g = 0; g < group; g++) {
            float *row = scores + g * span;
            float8 lanes;
            memcpy(&lanes, row + i, sizeof lanes);
            lanes = exp_nonpositive(lanes - tops[g]);
            memcpy(row + i, &lanes, sizeof lanes);
            float total = totals[g]; /* in a register for the 8 additions (the array is in memory) */
            for (int lane = 0; lane < 8; lane++) total += lanes[lane];
            totals[g] = total;
        }
    for (int g = 0; g < group; g++) {
        float *row = scores + g * span;
        for (int j = i; j < span; j++) {
            row[j] = expf(row[j] - tops[g]);
            totals[g] += row[j];
        }
        if (sinks) totals[g] += expf(sinks[g] - tops[g]); /* in the denominator only: it has no value */
    }
    if (head_dim % 8 == 0) {
        for (int g = 0; g < group; g++)
            weighted_values(acc + g * head_dim, scores + g * span, values, table, start, context_len,
                            head_dim, block_size);
    } else {
        memset(acc, 0, sizeof(float) * group * head_dim);
        for (int pos = start; pos < context_len;) {
            const int offset = pos % block_size;
            const int count = context_len - pos < block_size - offset ? context_len - pos : block_size - offset;
            const float *value = values + ((int64_t)table[pos / block_size] * block_size + offset) * head_dim;
            for (int t = 0; t < count; t++, value += head_dim)
                for (int g = 0; g < group; g++)
                    axpy(acc + g * head_dim, scores[g * span + pos - start + t], value, head_dim);
            pos += count;
        }
    }
    for (int g = 0; g < group; g++)
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g * head_dim + d] / totals[g];
}

/* One (row, KV head) task over context positions [start, context_len): start > 0 when a sliding window
 * has left the first positions behind. scores: [group, span] scratch; acc: [group, head_dim] scratch.
 * The common head sizes are inlined with the size a constant, so the
 * compiler unrolls dot() and the value columns; the same operations in the same order as any other size. */
void attend_one(const float *q, float *out, const float *keys, const float *values, const int32_t *table,
                int start, int context_len, int group, int head_dim, int block_size, float scale, float softcap,
                const float *sinks, float *scores, float *acc) {
    if (head_dim == 64)
        attend(q, out, keys, values, table, start, context_len, group, 64, block_size, scale, softcap, sinks, scores,
               acc);
    else if (head_dim == 128)
        attend(q, out, keys, values, table, start, context_len, group, 128, block_size, scale, softcap, sinks, scores,
               acc);
    else
        attend(q, out, keys, values, table, start, context_len, group, head_dim, block_size, scale, softcap, sinks,
               scores, acc);
}

/* q, out: [num_tokens, num_q_heads, head_dim]; key_cache, value_cache: [num_kv_heads, num_slots,
 * head_dim]; rows: [num_rows] the token rows to attend; block_tables: [num_rows, max_blocks];
 * context_lens: [num_rows]; window: a sliding window (each row attends to its last `window` positions),
 * 0 for none; softcap: scores soft-capped to (-softcap, softcap) (Gemma 2), 0 for none; sinks: [num_q_heads] a
 * logit a head that joins each softmax's maximum and denominator (gpt-oss), NULL for none. Returns 0, or -1 when
 * scratch memory could not be allocated. */
int decode_attention(const float *q, float *out, const float *key_cache, const float *value_cache,
                     int64_t num_slots, const int64_t *rows, const int32_t *block_tables,
                     int32_t max_blocks, const int32_t *context_lens, int32_t num_rows,
                     int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                     float scale, int32_t window, float softcap, const float *sinks, int32_t num_threads) {
    const int group = num_q_heads / num_kv_heads;
    int max_len = 1, failed = 0;
    for (int i = 0; i < num_rows; i++) max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * (max_len + head_dim));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int i = 0; i < num_rows; i++)
            for (int h = 0; h < num_kv_heads; h++) {
                if (!scores) continue;
                const int64_t q_offset = (rows[i] * num_q_heads + (int64_t)h * group) * head_dim;
                const int64_t head_offset = (int64_t)h * num_slots * head_dim;
                const int start = window > 0 && context_lens[i] > window ? context_lens[i] - window : 0;
                attend_one(q + q_offset, out + q_offset, key_cache + head_offset,
                           value_cache + head_offset, block_tables + (int64_t)i * max_blocks, start,
                           context_lens[i], group, head_dim, block_size, scale, softcap,
                           sinks ? sinks + (int64_t)h * group : NULL, scores, scores + group * max_len);
            }
        free(scores);
    }
    return failed ? -1 : 0;
}
