/* The recurrent mixers over one sequence's tokens of a step, in fp32 (engine-core process). A Gated
 * DeltaNet layer's (Qwen3.5): the causal depthwise conv over q, k and v from the sequence's conv state,
 * silu; q and k normalised (L2, eps 1e-6) and q scaled by 1 / sqrt(dk); the decay g = -exp(A_log)
 * softplus(a + dt_bias) and beta = sigmoid(b); then the gated delta rule token by token from the
 * sequence's recurrent state; then each value head's RMSNorm times silu(z). A Mamba2 layer's (Granite
 * 4.0-H): the conv over x, B and C plus its bias, silu; each head's state decays by exp(dt A) and takes
 * (dt B) x^T, dt = softplus(dt + dt_bias), A = -exp(A_log); y = S C + D x; then y silu(z) normed over
 * each group's slice, times the norm's weight. The states are updated in place.
 *
 * Every value is computed token by token in one fixed order, whatever the number of tokens given: a
 * prompt's tokens in one call and the same tokens one call each (decoding) give the same bits, and
 * a sequence's numbers never depend on the others of the step (each has its own call). The threads
 * split channels and heads, never a sum.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_exp.h"

/* x[i] = silu(x[i]), or x[i] * silu(gate[i]) where gate is given: 8 at a time, the rest one lane each
 * of the same arithmetic, so an element's value never depends on where it falls */
static void silu_in_place(float *restrict x, int64_t count, const float *restrict gate) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        float8 v, g;
        memcpy(&v, x + i, sizeof v);
        if (gate) {
            memcpy(&g, gate + i, sizeof g);
            v = v * silu8(g);
        } else {
            v = silu8(v);
        }
        memcpy(x + i, &v, sizeof v);
    }
    for (; i < count; i++) x[i] = gate ? x[i] * silu8((float8){gate[i]})[0] : silu8((float8){x[i]})[0];
}

#define LANES 32 /* the columns of S a pass keeps in registers: four 8-lane vectors */

/* kv[j] = sum_i s[i][j] k[i] over columns j0..j0 + LANES - 1, i ascending */
static inline void state_times_k(const float *restrict s, const float *restrict k, int64_t dk, int64_t dv,
                                 int64_t j0, float *restrict kv) {
    float8 acc[4] = {{0}, {0}, {0}, {0}};
    for (int64_t i = 0; i < dk; i++) {
        const float8 ki = (float8){0} + k[i];
        for (int m = 0; m < 4; m++) {
            float8 si;
            memcpy(&si, s + i * dv + j0 + 8 * m, sizeof si);
            acc[m] = acc[m] + si * ki;
        }
    }
    memcpy(kv + j0, acc, sizeof acc);
}

/* s = decay s + k delta^T and o = s^T q over columns j0..j0 + LANES - 1, i ascending */
static inline void update_and_read(float *restrict s, const float *restrict k, const float *restrict q,
                                   const float *restrict delta, float decay, int64_t dk, int64_t dv, int64_t j0,
                                   float *restrict o) {
    float8 d[4], acc[4] = {{0}, {0}, {0}, {0}};
    memcpy(d, delta + j0, sizeof d);
    const float8 decay8 = (float8){0} + decay;
    for (int64_t i = 0; i < dk; i++) {
        const float8 ki = (float8){0} + k[i], qi = (float8){0} + q[i];
        for (int m = 0; m < 4; m++) {
            float8 si;
            memcpy(&si, s + i * dv + j0 + 8 * m, sizeof si);
            si = decay8 * si + ki * d[m];
            memcpy(s + i * dv + j0 + 8 * m, &si, sizeof si);
            acc[m] = acc[m] + si * qi;
        }
    }
    memcpy(o + j0, acc, sizeof acc);
}

/* One token of one value head: kv = S^T k, delta = (v - decay kv) beta, S = decay S + k delta^T,
 * o = S^T q. s: [dk, dv]; delta: [dv] room. Columns LANES at a time (the rest one at a time, in the same
 * order of sums). */
static void delta_rule_token(float *restrict s, const float *restrict q, const float *restrict k,
                             const float *restrict v, float decay, float beta, int64_t dk, int64_t dv,
                             float *restrict delta, float *restrict o) {
    const int64_t blocked = dv - dv % LANES;
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES) state_times_k(s, k, dk, dv, j0, delta);
    for (int64_t j = blocked; j < dv; j++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < dk; i++) acc = acc + s[i * dv + j] * k[i];
        delta[j] = acc;
    }
    for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - decay * delta[j]) * beta;
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES) update_and_read(s, k, q, delta, decay, dk, dv, j0, o);
    for (int64_t j = blocked; j < dv; j++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            s[i * dv + j] = decay * s[i * dv + j] + k[i] * delta[j];
            acc = acc + s[i * dv + j] * q[i];
        }
        o[j] = acc;
    }
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold */

/* The causal depthwise conv of `channels` columns of rows in[t * stride] (t < n), token by token (each reads
 * inputs only), a row of channels at a time, oldest tap first, plus bias where given: out [n, channels].
 * conv_state: [kernel - 1, channels], the last inputs, oldest first (input u < 0 is its row history + u),
 * advanced in place; taps: [kernel, channels], the weight transposed (taps[j][c] is channel c's weight
 * of input t - (kernel - 1) + j). */
static void causal_conv(const float *in, int64_t stride, int64_t n, float *conv_state, const float *taps,
                        const float *bias, int64_t channels, int64_t kernel, float *out, int32_t num_threads) {
    const int64_t history = kernel - 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        float *restrict acc = out + t * channels;
        for (int64_t c = 0; c < channels; c++) acc[c] = 0.0f;
        for (int64_t j = 0; j < kernel; j++) {
            const int64_t u = t - history + j;
            const float *restrict x = u < 0 ? conv_state + (history + u) * channels : in + u * stride;
            const float *restrict w = taps + j * channels;
            for (int64_t c = 0; c < channels; c++) acc[c] = acc[c] + w[c] * x[c];
        }
        if (bias)
            for (int64_t c = 0; c < channels; c++) acc[c] = acc[c] + bias[c];
    }
    if (n >= history) {
        for (int64_t r = 0; r < history; r++)
            memcpy(conv_state + r * channels, in + (n - history + r) * stride, sizeof(float) * channels);
    } else {
        memmove(conv_state, conv_state + n * channels, sizeof(float) * (history - n) * channels);
        for (int64_t r = 0; r < n; r++)
            memcpy(conv_state + (history - n + r) * channels, in + r * stride, sizeof(float) * channels);
    }
}

/* proj: [n, stride] rows of the layer's input projection: conv_dim channels (q, k, v), then z
 * [hv * dv], then b [hv], then a [hv]. conv_state: [kernel - 1, conv_dim], the last inputs, oldest first;
 * ssm_state: [hv, dk, dv]; taps: [kernel, conv_dim], the conv's weight transposed (taps[j][c] is channel
 * c's weight of input t - (kernel - 1) + j, once a step for every sequence); scratch: [n, conv_dim];
 * out: [n, hv * dv]. Returns 0, or -1 for shapes it does not take. */
int gated_deltanet_span(const float *proj, int64_t stride, int64_t n, float *conv_state, float *ssm_state,
                        const float *taps, const float *a_log, const float *dt_bias,
                        const float *norm_weight, float eps, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                        int64_t kernel, float *scratch, float *out, int32_t num_threads) {
    if (n < 1 || kernel < 2 || hk < 1 || hv < 1 || dk < 1 || dv < 1 || hv % hk) return -1;
    const int64_t key_dim = hk * dk, value_dim = hv * dv, conv_dim = 2 * key_dim + value_dim;
    const int64_t group = hv / hk;
    if (stride < conv_dim + value_dim + 2 * hv) return -1;
    if (num_threads < 1 || n * conv_dim < 65536) num_threads = 1;
    causal_conv(proj, stride, n, conv_state, taps, NULL, conv_dim, kernel, scratch, num_threads);

    /* the conv's silu; q and k of each token and key head L2-normalised, q scaled */
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        silu_in_place(scratch + t * conv_dim, conv_dim, NULL);
        for (int64_t h = 0; h < 2 * hk; h++) {
            float *x = scratch + t * conv_dim + h * dk;
            float sum = 0.0f;
            for (int64_t i = 0; i < dk; i++) sum += x[i] * x[i];
            const float inv = 1.0f / sqrtf(sum + 1e-6f);
            for (int64_t i = 0; i < dk; i++) x[i] = h < hk ? x[i] * inv * q_scale : x[i] * inv;
        }
    }

    /* the delta rule, a value head a thread's, token by token */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t h = 0; h < hv; h++) {
        float delta[dv > 0 ? dv : 1];
        const float decay_rate = -expf(a_log[h]);
        for (int64_t t = 0; t < n; t++) {
            const float *row = proj + t * stride;
            const float *q = scratch + t * conv_dim + (h / group) * dk;
            const float decay = expf(decay_rate * softplus(row[conv_dim + value_dim + hv + h] + dt_bias[h]));
            const float beta = 1.0f / (1.0f + expf(-row[conv_dim + value_dim + h]));
            delta_rule_token(ssm_state + h * dk * dv, q, q + key_dim, scratch + t * conv_dim + 2 * key_dim + h * dv,
                             decay, beta, dk, dv, delta, out + t * value_dim + h * dv);
        }
    }

    /* each head's RMSNorm, times its weight, times silu(z) */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t h = 0; h < hv; h++) {
            float *o = out + t * value_dim + h * dv;
            const float *z = proj + t * stride + conv_dim + h * dv;
            float sum = 0.0f;
            for (int64_t j = 0; j < dv; j++) sum += o[j] * o[j];
            const float inv = 1.0f / sqrtf(sum / (float)dv + eps);
            for (int64_t j = 0; j < dv; j++) o[j] = norm_weight[j] * (o[j] * inv);
            silu_in_place(o, dv, z);
        }
    }
    return 0;
}

/* One head's token: s = decay s + (dt B) x^T, y = s C + D x. s: [p, size]; x: [p]; b, c: [size]; db: [size]
 * room. The sums over the state's columns 8 lanes at a time (the rest one at a time), in one fixed order. */
static void mamba2_token(float *restrict s, const float *restrict x, const float *restrict b,
                         const float *restrict c, float dt, float decay, float d, int64_t p, int64_t size,
                         float *restrict db, float *restrict y) {
    const int64_t blocked = size - size % 8;
    const float8 decay8 = (float8){0} + decay;
    for (int64_t j = 0; j < size; j++) db[j] = b[j] * dt;
    for (int64_t i = 0; i < p; i++) {
        float *restrict row = s + i * size;
        const float8 xi = (float8){0} + x[i];
        float8 acc = {0};
        for (int64_t j = 0; j < blocked; j += 8) {
            float8 si, dbj, cj;
            memcpy(&si, row + j, sizeof si);
            memcpy(&dbj, db + j, sizeof dbj);
            memcpy(&cj, c + j, sizeof cj);
            si = si * decay8 + dbj * xi;
            memcpy(row + j, &si, sizeof si);
            acc = acc + si * cj;
        }
        float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (int64_t j = blocked; j < size; j++) {
            row[j] = row[j] * decay + db[j] * x[i];
            sum = sum + row[j] * c[j];
        }
        y[i] = sum + d * x[i];
    }
}

/* proj: [n, stride] rows of the layer's input projection: z [heads * p], then the conv's channels x
 * [heads * p], B [groups * size], C [groups * size], then dt [heads]. conv_state: [kernel - 1, conv_dim];
 * ssm_state: [heads, p, size]; taps: [kernel, conv_dim] (as causal_conv's); conv_bias: [conv_dim] or NULL;
 * a_log, dt_bias, d: [heads]; norm_weight: [heads * p]; scratch: [n, conv_dim]; out: [n, heads * p].
 * Returns 0, or -1 for shapes it does not take. */
int mamba2_span(const float *proj, int64_t stride, int64_t n, float *conv_state, float *ssm_state,
                const float *taps, const float *conv_bias, const float *a_log, const float *dt_bias,
                const float *d, const float *norm_weight, float eps, int64_t heads, int64_t p, int64_t groups,
                int64_t size, int64_t kernel, float *scratch, float *out, int32_t num_threads) {
    if (n < 1 || kernel < 2 || heads < 1 || p < 1 || groups < 1 || size < 1 || heads % groups) return -1;
    const int64_t inner = heads * p, conv_dim = inner + 2 * groups * size, per_group = heads / groups;
    if (stride < inner + conv_dim + heads) return -1;
    if (num_threads < 1 || n * conv_dim < 65536) num_threads = 1;
    causal_conv(proj + inner, stride, n, conv_state, taps, conv_bias, conv_dim, kernel, scratch, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) silu_in_place(scratch + t * conv_dim, conv_dim, NULL);

    /* the SSM, a head a thread's, token by token */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t h = 0; h < heads; h++) {
        float db[size];
        const float rate = -expf(a_log[h]);
        const int64_t g = h / per_group;
        for (int64_t t = 0; t < n; t++) {
            const float *row = scratch + t * conv_dim;
            const float dt = softplus(proj[t * stride + inner + conv_dim + h] + dt_bias[h]);
            mamba2_token(ssm_state + h * p * size, row + h * p, row + inner + g * size,
                         row + inner + (groups + g) * size, dt, expf(dt * rate), d[h], p, size, db,
                         out + t * inner + h * p);
        }
    }

    /* y silu(z), each group's slice RMS-normed, times the weight */
    const int64_t width = inner / groups;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        silu_in_place(out + t * inner, inner, proj + t * stride);
        for (int64_t g = 0; g < groups; g++) {
            float *o = out + t * inner + g * width;
            float sum = 0.0f;
            for (int64_t j = 0; j < width; j++) sum += o[j] * o[j];
            const float inv = 1.0f / sqrtf(sum / (float)width + eps);
            for (int64_t j = 0; j < width; j++) o[j] = norm_weight[g * width + j] * (o[j] * inv);
        }
    }
    return 0;
}
