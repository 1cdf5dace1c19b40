/* Fused elementwise steps of a decoder layer, for the CPU in fp32 (engine-core process).
 *
 * At decode batch sizes each torch elementwise op is a few microseconds of arithmetic and tens of
 * microseconds of dispatch and thread wake-up, and a layer had about fifteen of them. These do the
 * same arithmetic in one call each, on the calling thread when the work is small.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_parts.h"
#include "vector_exp.h"

#define SMALL_WORK 262144 /* elements below which waking the other threads costs more than it saves */

/* Token t's q and k rotated as HF does (x * cos + rotate_half(x) * sin, the minus folded into
 * signed_sin), q written to q_out, k to k_out and k, v to the cache at the token's slot.
 * qkv: [T, (Hq + 2 Hkv) D]; c, s: [D], the token's cos and signed sin; slots: [T]; q_out: [T, Hq, D];
 * k_out: [T, Hkv, D]; key_cache, value_cache: [Hkv, num_slots, D]. */
void rope_write_kv_token(const float *qkv, const float *c, const float *s, const int64_t *slots, int64_t t,
                         int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, float *q_out, float *k_out,
                         float *key_cache, float *value_cache, int64_t num_slots) {
    const int half = head_dim / 2, num_heads = num_q_heads + 2 * num_kv_heads;
    const float *row = qkv + t * num_heads * head_dim;
    for (int h = 0; h < num_q_heads + num_kv_heads; h++) {
        const float *x = row + h * head_dim;
        float *out = h < num_q_heads ? q_out + (t * num_q_heads + h) * head_dim
                                     : k_out + (t * num_kv_heads + h - num_q_heads) * head_dim;
        if (!c) { /* NoPE: q and k as they are */
            memcpy(out, x, sizeof(float) * head_dim);
        } else {
            for (int i = 0; i < half; i++) out[i] = x[i] * c[i] + x[i + half] * s[i];
            for (int i = half; i < head_dim; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        if (h >= num_q_heads)
            memcpy(key_cache + ((int64_t)(h - num_q_heads) * num_slots + slots[t]) * head_dim, out,
                   sizeof(float) * head_dim);
    }
    for (int h = 0; h < num_kv_heads; h++)
        memcpy(value_cache + ((int64_t)h * num_slots + slots[t]) * head_dim,
               row + (num_q_heads + num_kv_heads + h) * head_dim, sizeof(float) * head_dim);
}

/* Small work runs on the calling thread without entering a parallel region (~2 us even when its
 * `if` clause is false: a tenth of a one-row layer step's elementwise work). */
void rope_write_kv(const float *qkv, const float *cos, const float *signed_sin, const int64_t *slots,
                   int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                   float *q_out, float *k_out, float *key_cache, float *value_cache, int64_t num_slots,
                   int32_t num_threads) {
    const int64_t work = num_tokens * (num_q_heads + 2 * num_kv_heads) * head_dim;
    if (work <= SMALL_WORK || num_threads <= 1) {
        for (int64_t t = 0; t < num_tokens; t++)
            rope_write_kv_token(qkv, cos + t * head_dim, signed_sin + t * head_dim, slots, t, num_q_heads,
                                num_kv_heads, head_dim, q_out, k_out, key_cache, value_cache, num_slots);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++)
        rope_write_kv_token(qkv, cos + t * head_dim, signed_sin + t * head_dim, slots, t, num_q_heads,
                            num_kv_heads, head_dim, q_out, k_out, key_cache, value_cache, num_slots);
}

/* silu(g) * u on 8 lanes (vector_exp.h's silu8) */
static inline float8 silu_mul8(float8 g, float8 u) { return silu8(g) * u; }

/* gate_up: [T, 2 I] (gate then up, as the fused projection lays them out); out: [T, I]. */
void silu_mul_range(const float *gate_up, int64_t t, int64_t intermediate, float *out, int64_t begin, int64_t end) {
    const float *gate = gate_up + t * 2 * intermediate, *up = gate + intermediate;
    float *row = out + t * intermediate;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        float8 g, u, y;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&u, up + i, sizeof u);
        y = silu_mul8(g, u);
        memcpy(row + i, &y, sizeof y);
    }
    for (; i < end; i++) {
        float8 g = {gate[i]}, u = {up[i]};
        row[i] = silu_mul8(g, u)[0];
    }
}

void silu_mul_token(const float *gate_up, int64_t t, int64_t intermediate, float *out) {
    silu_mul_range(gate_up, t, intermediate, out, 0, intermediate);
}

void silu_mul(const float *gate_up, int64_t num_tokens, int64_t intermediate, float *out,
              int32_t num_threads) {
    if (num_tokens * intermediate <= SMALL_WORK || num_threads <= 1) {
        for (int64_t t = 0; t < num_tokens; t++) silu_mul_token(gate_up, t, intermediate, out);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) silu_mul_token(gate_up, t, intermediate, out);
}

/* 1 / (1 + exp(-x)) element by element, each the same scalar steps wherever it sits in x (torch's vector
 * loop and its tail compute it two ways: Qwen3-Next's one gate a token would change with the batch). */
void sigmoid(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f / (1.0f + expf(-x[i]));
}

/* HF's RMSNorm in fp32, x * rsqrt(mean(x^2) + eps) * weight, optionally of x + delta (the residual add
 * before it), whose sum is then written to sum_out. x, delta, sum_out, out: [T, hidden]; weight:
 * [hidden]. The mean of squares is summed in double (torch sums fp32 pairwise: both within rounding). */
void rms_norm_token(const float *x, const float *delta, int64_t t, int64_t hidden,
                           const float *weight, float eps, float *sum_out, float *out) {
    const float *row = x + t * hidden;
    if (delta) {
        float *sum = sum_out + t * hidden;
        for (int64_t i = 0; i < hidden; i++) sum[i] = row[i] + delta[t * hidden + i];
        row = sum;
    }
    double squares = 0.0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; i++) squares += (double)row[i] * row[i];
    const float scale = 1.0f / sqrtf((float)(squares / hidden) + eps);
    float *normed = out + t * hidden;
    for (int64_t i = 0; i < hidden; i++) normed[i] = row[i] * scale * weight[i];
}

void rms_norm(const float *x, const float *delta, int64_t num_tokens, int64_t hidden, const float *weight,
              float eps, float *sum_out, float *out, int32_t num_threads) {
    if (num_tokens * hidden <= SMALL_WORK || num_threads <= 1) {
        for (int64_t t = 0; t < num_tokens; t++) rms_norm_token(x, delta, t, hidden, weight, eps, sum_out, out);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) rms_norm_token(x, delta, t, hidden, weight, eps, sum_out, out);
}
