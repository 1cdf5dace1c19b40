/* A Gated DeltaNet layer's mixer over one sequence's tokens of a step, in fp32 (engine-core process):
 * the causal depthwise conv over q, k and v from the sequence's conv state, silu; q and k normalised
 * (L2, eps 1e-6) and q scaled by 1 / sqrt(dk); the decay g = -exp(A_log) softplus(a + dt_bias) and
 * beta = sigmoid(b); then the gated delta rule token by token from the sequence's recurrent state;
 * then each value head's RMSNorm times silu(z). The states are updated in place.
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
    const int64_t history = kernel - 1, group = hv / hk;
    if (stride < conv_dim + value_dim + 2 * hv) return -1;
    if (num_threads < 1 || n * conv_dim < 65536) num_threads = 1;

    /* the conv, token by token (each reads inputs only), a row of channels at a time; input u < 0 is
     * the state's row history + u */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        float *restrict acc = scratch + t * conv_dim;
        for (int64_t c = 0; c < conv_dim; c++) acc[c] = 0.0f;
        for (int64_t j = 0; j < kernel; j++) {
            const int64_t u = t - history + j;
            const float *restrict x = u < 0 ? conv_state + (history + u) * conv_dim : proj + u * stride;
            const float *restrict w = taps + j * conv_dim;
            for (int64_t c = 0; c < conv_dim; c++) acc[c] = acc[c] + w[c] * x[c];
        }
    }
    /* the state keeps the last `history` inputs: [history, conv_dim], oldest first */
    if (n >= history) {
        for (int64_t r = 0; r < history; r++)
            memcpy(conv_state + r * conv_dim, proj + (n - history + r) * stride, sizeof(float) * conv_dim);
    } else {
        memmove(conv_state, conv_state + n * conv_dim, sizeof(float) * (history - n) * conv_dim);
        for (int64_t r = 0; r < n; r++)
            memcpy(conv_state + (history - n + r) * conv_dim, proj + r * stride, sizeof(float) * conv_dim);
    }

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
