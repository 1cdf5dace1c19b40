/* The whole model forward of a decode-only step with few rows, in one call and one parallel region,
 * for the CPU (engine-core process): embedding lookup, every decoder layer, the final norm.
 *
 * At one row a layer is four weight streams (qkv, o, gate/up, down) and a little work between them.
 * Called op by op from Python, a layer paid ~120 us on top of its products (~10 calls through
 * ctypes, each entering and leaving a parallel region), about 1.4 ms of a 21 ms step of the `small`
 * preset, more when the weights just streamed through have evicted the interpreter from the caches.
 * Here the threads stay in one region for the whole forward and meet at a barrier between dependent
 * steps. Every step is the same per-token or per-thread function the separate kernels run
 * (kernel_parts.h), so the numbers are those of the op-by-op path bit for bit, except Qwen3's
 * per-head q/k norms (C's RMSNorm here, torch's there: equal to float rounding).
 *
 * A layer: h = x + o(attention(rope(qkv(norm(x))))); out = h + down(silu(gate(norm(h))) * up(...)).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_parts.h"

/* model[]: what every step of the model shares (worker/cpu/fused_decode.py keeps the order). */
enum { M_EMBED, M_EMBED_IS_BF16, M_FINAL_NORM, M_COS, M_SIGNED_SIN, M_NUM_LAYERS, M_LAYERS, M_COUNT };
/* layer[]: a layer's weights and shapes (every layer of one model has the same shapes). */
enum {
    L_INPUT_NORM, L_QKV, L_QKV_BIAS, L_Q_NORM, L_K_NORM, L_O, L_O_BIAS, L_POST_NORM, L_GATE_UP, L_DOWN,
    L_KEY_CACHE, L_VALUE_CACHE, L_HIDDEN, L_NUM_Q_HEADS, L_NUM_KV_HEADS, L_HEAD_DIM, L_INTERMEDIATE,
    L_NUM_SLOTS, L_IS_BF16, L_WINDOW, L_COUNT
};
/* step[]: this step's rows. */
enum {
    S_INPUT_IDS, S_POSITIONS, S_SLOTS, S_ROWS, S_BLOCK_TABLES, S_MAX_BLOCKS, S_CONTEXT_LENS, S_NUM_TOKENS,
    S_BLOCK_SIZE, S_USE_DOT, S_NUM_THREADS, S_COUNT
};

#define PTR(array, index, type) ((type)(intptr_t)(array)[index])

struct buffers {
    float *qkv, *q, *k, *attn, *o_out, *normed, *gate_up, *act, *down, *streams[2];
    int64_t *cursors; /* [num_layers, 4]: where the threads stand in each product (gemv_share) */
};

/* The shapes every layer shares, and this step's. */
struct shapes {
    int64_t T, H, I, qkv_size, q_size;
    int num_q, num_kv, head_dim, group, is_bf16, use_dot, block_size, max_len;
};

struct thread_scratch {
    int team;
    float *scores, *rounded; /* attention's [group, max_len + head_dim]; x rounded to bf16 */
};

static float *carve(float **next, int64_t count) {
    float *start = *next;
    *next += count + 16; /* a cache line apart */
    return start;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* Qwen3: RMSNorm over each head of q and k, in place in the qkv row, before RoPE. */
static void norm_heads(float *row, const float *q_norm, const float *k_norm, int num_q_heads, int num_kv_heads,
                       int head_dim, float eps) {
    for (int h = 0; h < num_q_heads + num_kv_heads; h++) {
        const float *weight = h < num_q_heads ? q_norm : k_norm;
        rms_norm_token(row + (int64_t)h * head_dim, NULL, 0, head_dim, weight, eps, NULL,
                       row + (int64_t)h * head_dim);
    }
}

/* The attention half: b->o_out = o(attention(rope(qkv(norm(x))))), the KV cache written. */
static void attention_half(const int64_t *model, const int64_t *layer, const int64_t *step, const struct shapes *s,
                           const struct buffers *b, int64_t *cursors, const float *x,
                           const struct thread_scratch *own, float eps, float scale) {
    const int64_t T = s->T, num_slots = layer[L_NUM_SLOTS], D = s->head_dim;
    const int64_t *rows = PTR(step, S_ROWS, const int64_t *), *positions = PTR(step, S_POSITIONS, const int64_t *);
    const int32_t *context_lens = PTR(step, S_CONTEXT_LENS, const int32_t *);
    const float *q_norm = PTR(layer, L_Q_NORM, const float *), *k_norm = PTR(layer, L_K_NORM, const float *);
    const int window = (int)layer[L_WINDOW];
#pragma omp for
    for (int64_t t = 0; t < T; t++)
        rms_norm_token(x, NULL, t, s->H, PTR(layer, L_INPUT_NORM, const float *), eps, NULL, b->normed);
    gemv_share(b->normed, T, s->H, PTR(layer, L_QKV, const void *), s->is_bf16, s->use_dot, s->qkv_size,
               PTR(layer, L_QKV_BIAS, const float *), b->qkv, own->rounded, &cursors[0], own->team);
#pragma omp barrier
#pragma omp for
    for (int64_t t = 0; t < T; t++) {
        if (q_norm) norm_heads(b->qkv + t * s->qkv_size, q_norm, k_norm, s->num_q, s->num_kv, s->head_dim, eps);
        rope_write_kv_token(b->qkv, PTR(model, M_COS, const float *) + positions[t] * D,
                            PTR(model, M_SIGNED_SIN, const float *) + positions[t] * D,
                            PTR(step, S_SLOTS, const int64_t *), t, s->num_q, s->num_kv, s->head_dim, b->q, b->k,
                            PTR(layer, L_KEY_CACHE, float *), PTR(layer, L_VALUE_CACHE, float *), num_slots);
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t i = 0; i < T; i++)
        for (int h = 0; h < s->num_kv; h++) {
            const int64_t q_offset = (rows[i] * s->num_q + (int64_t)h * s->group) * D;
            const int64_t head_offset = (int64_t)h * num_slots * D;
            const int start = window > 0 && context_lens[i] > window ? context_lens[i] - window : 0;
            attend_one(b->q + q_offset, b->attn + q_offset, PTR(layer, L_KEY_CACHE, const float *) + head_offset,
                       PTR(layer, L_VALUE_CACHE, const float *) + head_offset,
                       PTR(step, S_BLOCK_TABLES, const int32_t *) + i * step[S_MAX_BLOCKS], start, context_lens[i],
                       s->group, s->head_dim, s->block_size, scale, own->scores,
                       own->scores + (int64_t)s->group * s->max_len);
        }
    gemv_share(b->attn, T, s->q_size, PTR(layer, L_O, const void *), s->is_bf16, s->use_dot, s->H,
               PTR(layer, L_O_BIAS, const float *), b->o_out, own->rounded, &cursors[1], own->team);
#pragma omp barrier
}

/* The MLP half: out = h + down(silu(gate(norm(h))) * up(norm(h))), h = x + b->o_out. */
static void mlp_half(const int64_t *layer, const struct shapes *s, const struct buffers *b, int64_t *cursors,
                     const float *x, float *out, const struct thread_scratch *own, float eps) {
    const int64_t T = s->T;
#pragma omp for
    for (int64_t t = 0; t < T; t++) /* out = h for now */
        rms_norm_token(x, b->o_out, t, s->H, PTR(layer, L_POST_NORM, const float *), eps, out, b->normed);
    gemv_share(b->normed, T, s->H, PTR(layer, L_GATE_UP, const void *), s->is_bf16, s->use_dot, 2 * s->I, NULL,
               b->gate_up, own->rounded, &cursors[0], own->team);
#pragma omp barrier
#pragma omp for
    for (int64_t t = 0; t < T; t++) silu_mul_token(b->gate_up, t, s->I, b->act);
    gemv_share(b->act, T, s->I, PTR(layer, L_DOWN, const void *), s->is_bf16, s->use_dot, s->H, NULL, b->down,
               own->rounded, &cursors[1], own->team);
#pragma omp barrier
#pragma omp for
    for (int64_t i = 0; i < T * s->H; i++) out[i] += b->down[i];
}

/* x[t] = the embedding table's row of token t, widened to fp32 from bf16 bits where it is bf16. */
static void embed(const int64_t *model, const int64_t *step, int64_t T, int64_t H, float *x) {
    const int64_t *input_ids = PTR(step, S_INPUT_IDS, const int64_t *);
#pragma omp for
    for (int64_t t = 0; t < T; t++) {
        if (!model[M_EMBED_IS_BF16]) {
            memcpy(x + t * H, PTR(model, M_EMBED, const float *) + input_ids[t] * H, sizeof(float) * H);
            continue;
        }
        const uint16_t *row = PTR(model, M_EMBED, const uint16_t *) + input_ids[t] * H;
        for (int64_t i = 0; i < H; i++) {
            const uint32_t bits = (uint32_t)row[i] << 16;
            memcpy(x + t * H + i, &bits, sizeof bits);
        }
    }
}

static struct shapes shapes_of(const int64_t *layer, const int64_t *step) {
    struct shapes s;
    s.T = step[S_NUM_TOKENS], s.H = layer[L_HIDDEN], s.I = layer[L_INTERMEDIATE];
    s.num_q = (int)layer[L_NUM_Q_HEADS], s.num_kv = (int)layer[L_NUM_KV_HEADS], s.head_dim = (int)layer[L_HEAD_DIM];
    s.group = s.num_q / s.num_kv, s.is_bf16 = (int)layer[L_IS_BF16], s.use_dot = (int)step[S_USE_DOT];
    s.block_size = (int)step[S_BLOCK_SIZE];
    s.qkv_size = (int64_t)(s.num_q + 2 * s.num_kv) * s.head_dim, s.q_size = (int64_t)s.num_q * s.head_dim;
    const int32_t *context_lens = PTR(step, S_CONTEXT_LENS, const int32_t *);
    s.max_len = 1;
    for (int64_t i = 0; i < s.T; i++) s.max_len = context_lens[i] > s.max_len ? context_lens[i] : s.max_len;
    return s;
}

/* Every thread runs this: embedding, the layers (their outputs turn about between two buffers), the
 * final norm into out. */
static void forward(const int64_t *model, const int64_t *step, const struct shapes *s, const struct buffers *b,
                    float *out, const struct thread_scratch *own, float eps, float scale) {
    const int64_t *layers = PTR(model, M_LAYERS, const int64_t *);
    embed(model, step, s->T, s->H, b->streams[0]);
    for (int64_t l = 0; l < model[M_NUM_LAYERS]; l++) {
        const int64_t *layer = PTR(layers, l, const int64_t *);
        const float *input = b->streams[l % 2];
        attention_half(model, layer, step, s, b, b->cursors + 4 * l, input, own, eps, scale);
        mlp_half(layer, s, b, b->cursors + 4 * l + 2, input, b->streams[(l + 1) % 2], own, eps);
    }
#pragma omp for
    for (int64_t t = 0; t < s->T; t++)
        rms_norm_token(b->streams[model[M_NUM_LAYERS] % 2], NULL, t, s->H, PTR(model, M_FINAL_NORM, const float *),
                       eps, NULL, out);
}

/* out: [num_tokens, hidden] fp32, the final-normed hidden states. Returns 0, or -1 when scratch
 * memory could not be allocated. */
int decode_forward(const int64_t *model, const int64_t *step, float *out, float eps, float scale) {
    const struct shapes s = shapes_of(PTR(PTR(model, M_LAYERS, const int64_t *), 0, const int64_t *), step);
    const int64_t T = s.T;
    const int64_t num_scores = s.group * ((int64_t)s.max_len + s.head_dim);
    const int64_t rounding = T * max3(s.H, s.q_size, s.I) + 32; /* x rounded to bf16 */
    const int num_threads = (int)step[S_NUM_THREADS] > 0 ? (int)step[S_NUM_THREADS] : 1;
    const int64_t per_thread = num_scores + rounding + 16;
    const int64_t total = T * (s.qkv_size + 3 * s.q_size + 6 * s.H + 3 * s.I + (int64_t)s.num_kv * s.head_dim);
    float *memory = malloc(sizeof(float) * (total + 12 * 16 + per_thread * num_threads)), *next = memory;
    struct buffers b;
    b.cursors = calloc(4 * model[M_NUM_LAYERS], sizeof(int64_t));
    if (!memory || !b.cursors) {
        free(memory);
        free(b.cursors);
        return -1;
    }
    b.qkv = carve(&next, T * s.qkv_size);
    b.q = carve(&next, T * s.q_size);
    b.k = carve(&next, T * s.num_kv * s.head_dim);
    b.attn = carve(&next, T * s.q_size);
    b.o_out = carve(&next, T * s.H);
    b.normed = carve(&next, T * s.H);
    b.gate_up = carve(&next, 2 * T * s.I);
    b.act = carve(&next, T * s.I);
    b.down = carve(&next, T * s.H);
    b.streams[0] = carve(&next, T * s.H); /* the residual stream: layer l reads [l % 2], writes the other */
    b.streams[1] = carve(&next, T * s.H);
#pragma omp parallel num_threads(num_threads)
    {
        struct thread_scratch own;
        own.team = omp_get_num_threads();
        own.scores = next + per_thread * omp_get_thread_num(), own.rounded = own.scores + num_scores;
        forward(model, step, &s, &b, out, &own, eps, scale);
    }
    free(memory);
    free(b.cursors);
    return 0;
}
