/* The whole model forward of a decode-only step with few rows, in one call and one parallel region,
 * for the CPU (engine-core process): embedding lookup, every decoder layer, the final norm.
 *
 * At one row a layer is four weight streams (qkv, o, gate/up, down) and a little work between them.
 * Called op by op from Python, a layer pays ~10 calls through ctypes on top of its products, each
 * entering and leaving a parallel region, and more once the weights just streamed through have evicted
 * the interpreter from the caches (docs/benchmarks.md has the figures).
 * Here the threads stay in one region for the whole forward and meet at a barrier between dependent
 * steps; each thread computes the norms before the products itself (a row's few thousand operations
 * against a barrier each), and SiLU is split within a row. Every step is the same per-token or per-thread function the separate kernels run
 * (kernel_parts.h), so the numbers are those of the op-by-op path bit for bit (Qwen3's per-head q/k
 * norms too: the op-by-op path norms each head with rms_norm_token as well).
 *
 * A layer: h = x + o(attention(rope(qkv(norm(x))))); out = h + down(silu(gate(norm(h))) * up(...)); a NoPE
 * layer's q and k are not rotated.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_forward.h"
#include "kernel_parts.h"

struct buffers {
    float *qkv, *q, *k, *attn, *o_out, *gate_up, *act, *down, *streams[2];
    int64_t *cursors; /* [num_layers, 4]: where the threads stand in each product (gemv_share) */
    int *failed;      /* a quantized product found no memory for its tile */
    void *int8;       /* integer mode: int8_rows_bytes(T, the widest K) for each product's x */
};

/* The shapes every layer shares, and this step's. */
struct shapes {
    int64_t T, H, I, qkv_size, q_size;
    int num_q, num_kv, head_dim, group, is_bf16, use_dot, block_size, max_len, is_int8;
};

struct thread_scratch {
    int team, me;
    float *scores, *rounded; /* attention's [group, max_len + head_dim]; x rounded to bf16 */
    float *normed, *sum;     /* [T, H] each: the thread's own copy of a norm's output and of the residual sum */
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

/* A thread's part of one of a layer's four products: fp32 or bf16 weights (gemv.c) or GGUF blocks of
 * ggml type `type` (gemv_quant.c; each product its own type), the same sums either way as the op-by-op
 * path's. */
static void product(const struct shapes *s, const struct buffers *b, const float *x, int64_t K, const void *w,
                    int64_t type, int64_t N, const float *bias, float *out, const struct thread_scratch *own,
                    int64_t *cursor) {
    if (type && s->is_int8) { /* x's rows quantized once, a row a thread (every thread holds the same x) */
        const struct int8_rows a = int8_rows_at(b->int8, s->T, K);
#pragma omp for
        for (int64_t t = 0; t < s->T; t++) int8_quantize_rows(x, t, t + 1, &a);
        gemv_int8_share(&a, s->T, w, (int)type, N, bias, out, cursor, own->team);
        return;
    }
    if (type) {
        if (gemv_quant_share(x, s->T, K, w, (int)type, N, bias, out, cursor, own->team))
            __atomic_store_n(b->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    gemv_share(x, s->T, K, w, s->is_bf16, s->use_dot, N, bias, out, own->rounded, cursor, own->team);
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

/* A position's full rows from the half tables: c = [cos, cos], s = [-sin, sin] (rotate_half's minus). */
static void rope_rows(const float *cos, const float *sin, int64_t D, float *c, float *s) {
    for (int64_t i = 0; i < D / 2; i++) {
        c[i] = c[i + D / 2] = cos[i];
        s[i] = -sin[i];
        s[i + D / 2] = sin[i];
    }
}

/* LoRA's deltas of product `which` (lora_products' index) added to its rows of out, x its input; every
 * thread calls it after the product's barrier, and leaves at the team's barrier. */
static void lora_deltas(const struct step_desc *step, int64_t which, const float *x, int64_t T, int64_t in,
                        float *out, int64_t out_width) {
    if (!step->lora_groups || !step->lora_products[which]) return;
    lora_rows_share(x, T, in, out, out_width, step->lora_groups, step->lora_products[which],
                    (int32_t)step->num_lora_groups);
}

/* The attention half: b->o_out = o(attention(rope(qkv(norm(x))))), the KV cache written. */
static void attention_half(const struct model_desc *model, const struct layer_desc *layer, const struct step_desc *step, const struct shapes *s,
                           const struct buffers *b, int64_t *cursors, const float *x,
                           const struct thread_scratch *own, float eps, float scale, int64_t l) {
    const int64_t T = s->T, num_slots = layer->num_slots, D = s->head_dim;
    const int64_t *rows = step->rows, *positions = step->positions;
    const int32_t *context_lens = step->context_lens;
    const float *q_norm = layer->q_norm, *k_norm = layer->k_norm;
    const int window = (int)layer->window;
    for (int64_t t = 0; t < T; t++) /* each thread its own copy: no barrier between the norm and the product */
        rms_norm_token(x, NULL, t, s->H, layer->input_norm, eps, NULL, own->normed);
    product(s, b, own->normed, s->H, layer->qkv, layer->qkv_type, s->qkv_size, layer->qkv_bias, b->qkv, own,
            &cursors[0]);
#pragma omp barrier
    lora_deltas(step, 4 * l, own->normed, T, s->H, b->qkv, s->qkv_size);
#pragma omp for
    for (int64_t t = 0; t < T; t++) {
        if (q_norm) norm_heads(b->qkv + t * s->qkv_size, q_norm, k_norm, s->num_q, s->num_kv, s->head_dim, eps);
        float c[D], signed_s[D];
        if (!layer->is_nope)
            rope_rows(model->cos + positions[t] * (D / 2), model->sin + positions[t] * (D / 2), D, c, signed_s);
        rope_write_kv_token(b->qkv, layer->is_nope ? NULL : c, signed_s, step->slots, t, s->num_q, s->num_kv,
                            s->head_dim, b->q, b->k, layer->key_cache, layer->value_cache, num_slots);
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t i = 0; i < T; i++)
        for (int h = 0; h < s->num_kv; h++) {
            const int64_t q_offset = (rows[i] * s->num_q + (int64_t)h * s->group) * D;
            const int64_t head_offset = (int64_t)h * num_slots * D;
            const int start = window > 0 && context_lens[i] > window ? context_lens[i] - window : 0;
            attend_one(b->q + q_offset, b->attn + q_offset, layer->key_cache + head_offset,
                       layer->value_cache + head_offset,
                       step->block_tables + i * step->max_blocks, start, context_lens[i],
                       s->group, s->head_dim, s->block_size, scale, 0.0f, NULL, own->scores,
                       own->scores + (int64_t)s->group * s->max_len);
        }
    product(s, b, b->attn, s->q_size, layer->o, layer->o_type, s->H, layer->o_bias, b->o_out, own, &cursors[1]);
#pragma omp barrier
    lora_deltas(step, 4 * l + 1, b->attn, T, s->q_size, b->o_out, s->H);
}

/* The MLP half: out = h + down(silu(gate(norm(h))) * up(norm(h))), h = x + b->o_out. */
static void mlp_half(const struct layer_desc *layer, const struct step_desc *step, const struct shapes *s,
                     const struct buffers *b, int64_t *cursors, const float *x, float *out,
                     const struct thread_scratch *own, float eps, int64_t l) {
    const int64_t T = s->T;
    for (int64_t t = 0; t < T; t++) /* h and its norm, each thread its own copy (no barrier before the product) */
        rms_norm_token(x, b->o_out, t, s->H, layer->post_norm, eps, own->sum, own->normed);
    product(s, b, own->normed, s->H, layer->gate_up, layer->gate_up_type, 2 * s->I, NULL, b->gate_up, own,
            &cursors[0]);
#pragma omp barrier
    lora_deltas(step, 4 * l + 2, own->normed, T, s->H, b->gate_up, 2 * s->I);
    const int64_t I = s->I, team = own->team;
#pragma omp for
    for (int64_t item = 0; item < T * team; item++) { /* a row in team parts, each a multiple of 8 long */
        const int64_t t = item / team, part = item % team;
        silu_mul_range(b->gate_up, t, I, b->act, I / 8 * part / team * 8,
                       part + 1 == team ? I : I / 8 * (part + 1) / team * 8);
    }
    product(s, b, b->act, s->I, layer->down, layer->down_type, s->H, NULL, b->down, own, &cursors[1]);
#pragma omp barrier
    lora_deltas(step, 4 * l + 3, b->act, T, s->I, b->down, s->H);
#pragma omp for
    for (int64_t i = 0; i < T * s->H; i++) out[i] = own->sum[i] + b->down[i];
}

/* x[t] = the embedding table's row of token t, widened to fp32 from bf16 bits where it is bf16,
 * dequantized from GGUF blocks where it is blocks. */
static void embed(const struct model_desc *model, const struct step_desc *step, int64_t T, int64_t H, float *x) {
    const int64_t *input_ids = step->input_ids;
#pragma omp for
    for (int64_t t = 0; t < T; t++) {
        if (model->embed_quant_type) {
            const int32_t type = (int32_t)model->embed_quant_type;
            const uint8_t *row = (const uint8_t *)model->embed + input_ids[t] * quant_row_bytes(type, H);
            dequantize_rows(row, type, 1, H, x + t * H);
            continue;
        }
        if (!model->embed_is_bf16) {
            memcpy(x + t * H, (const float *)model->embed + input_ids[t] * H, sizeof(float) * H);
            continue;
        }
        const uint16_t *row = (const uint16_t *)model->embed + input_ids[t] * H;
        for (int64_t i = 0; i < H; i++) {
            const uint32_t bits = (uint32_t)row[i] << 16;
            memcpy(x + t * H + i, &bits, sizeof bits);
        }
    }
}

static struct shapes shapes_of(const struct layer_desc *layer, const struct step_desc *step) {
    struct shapes s;
    s.T = step->num_tokens, s.H = layer->hidden, s.I = layer->intermediate;
    s.num_q = (int)layer->num_q_heads, s.num_kv = (int)layer->num_kv_heads, s.head_dim = (int)layer->head_dim;
    s.group = s.num_q / s.num_kv, s.is_bf16 = (int)layer->is_bf16, s.use_dot = (int)step->use_dot;
    s.block_size = (int)step->block_size;
    s.qkv_size = (int64_t)(s.num_q + 2 * s.num_kv) * s.head_dim, s.q_size = (int64_t)s.num_q * s.head_dim;
    const int32_t *context_lens = step->context_lens;
    s.max_len = 1;
    for (int64_t i = 0; i < s.T; i++) s.max_len = context_lens[i] > s.max_len ? context_lens[i] : s.max_len;
    return s;
}

/* Every thread runs this: embedding, the layers (their outputs turn about between two buffers), the
 * final norm into out, and lm_head's products into the step's logits where it asks. */
static void forward(const struct model_desc *model, const struct step_desc *step, const struct shapes *s, const struct buffers *b,
                    float *out, const struct thread_scratch *own, float eps, float scale) {
    embed(model, step, s->T, s->H, b->streams[0]);
    for (int64_t l = 0; l < model->num_layers; l++) {
        const struct layer_desc *layer = &model->layers[l];
        const float *input = b->streams[l % 2];
        attention_half(model, layer, step, s, b, b->cursors + 4 * l, input, own, eps, scale, l);
        mlp_half(layer, step, s, b, b->cursors + 4 * l + 2, input, b->streams[(l + 1) % 2], own, eps, l);
    }
#pragma omp for
    for (int64_t t = 0; t < s->T; t++)
        rms_norm_token(b->streams[model->num_layers % 2], NULL, t, s->H, model->final_norm,
                       eps, NULL, out);
    if (!step->logits) return;
    int64_t *cursor = b->cursors + 4 * model->num_layers; /* the op-by-op path's few-row product, in C */
    if (model->lm_head_quant_type)
        product(s, b, out, s->H, model->lm_head, model->lm_head_quant_type, model->vocab, model->lm_head_bias,
                step->logits, own, cursor);
    else
        gemv_share(out, s->T, s->H, model->lm_head, (int32_t)model->lm_head_is_bf16, s->use_dot, model->vocab,
                   model->lm_head_bias, step->logits, own->rounded, cursor, own->team);
    if (step->lora_groups && step->lora_products[4 * model->num_layers]) {
#pragma omp barrier
        lora_deltas(step, 4 * model->num_layers, out, s->T, s->H, step->logits, model->vocab);
    }
}

/* out: [num_tokens, hidden] fp32, the final-normed hidden states. Returns 0, or -1 when scratch
 * memory could not be allocated. */
int decode_forward(const struct model_desc *model, const struct step_desc *step, float *out, float eps, float scale) {
    struct shapes s = shapes_of(&model->layers[0], step);
    s.is_int8 = (int)model->int8_activations;
    const int64_t T = s.T;
    const int64_t num_scores = s.group * ((int64_t)s.max_len + s.head_dim);
    const int64_t rounding = T * max3(s.H, s.q_size, s.I) + 32; /* x rounded to bf16 */
    const int num_threads = (int)step->num_threads > 0 ? (int)step->num_threads : 1;
    const int64_t per_thread = num_scores + rounding + 2 * T * s.H + 48;
    const int64_t total = T * (s.qkv_size + 3 * s.q_size + 6 * s.H + 3 * s.I + (int64_t)s.num_kv * s.head_dim);
    float *memory = malloc(sizeof(float) * (total + 12 * 16 + per_thread * num_threads)), *next = memory;
    struct buffers b;
    int failed = 0;
    b.failed = &failed;
    b.cursors = calloc(4 * model->num_layers + 1, sizeof(int64_t));
    b.int8 = s.is_int8 ? malloc((size_t)int8_rows_bytes(T, max3(s.H, s.q_size, s.I))) : NULL;
    if (!memory || !b.cursors || (s.is_int8 && !b.int8)) {
        free(memory);
        free(b.cursors);
        free(b.int8);
        return -1;
    }
    b.qkv = carve(&next, T * s.qkv_size);
    b.q = carve(&next, T * s.q_size);
    b.k = carve(&next, T * s.num_kv * s.head_dim);
    b.attn = carve(&next, T * s.q_size);
    b.o_out = carve(&next, T * s.H);
    b.gate_up = carve(&next, 2 * T * s.I);
    b.act = carve(&next, T * s.I);
    b.down = carve(&next, T * s.H);
    b.streams[0] = carve(&next, T * s.H); /* the residual stream: layer l reads [l % 2], writes the other */
    b.streams[1] = carve(&next, T * s.H);
#pragma omp parallel num_threads(num_threads)
    {
        struct thread_scratch own;
        own.team = omp_get_num_threads();
        own.me = omp_get_thread_num();
        own.scores = next + per_thread * own.me, own.rounded = own.scores + num_scores;
        own.normed = own.rounded + rounding + 16, own.sum = own.normed + T * s.H + 16;
        forward(model, step, &s, &b, out, &own, eps, scale);
    }
    free(memory);
    free(b.cursors);
    free(b.int8);
    return failed ? -1 : 0;
}

/* The layout of decode_forward.h's structs (and kernel_parts.h's quant_part) by name, for the test that checks coreserve/worker/cpu/bindings.py's
 * ctypes mirrors: the offset of `field` in `struct type`, its size where field is "" (-1: unknown). */
#define FIELD(type, field) {#type, #field, (int64_t)offsetof(struct type, field)}
#define SIZE(type) {#type, "", (int64_t)sizeof(struct type)}
static const struct {
    const char *type, *field;
    int64_t value;
} LAYOUT[] = {
    SIZE(layer_desc), FIELD(layer_desc, input_norm), FIELD(layer_desc, qkv), FIELD(layer_desc, qkv_bias),
    FIELD(layer_desc, q_norm), FIELD(layer_desc, k_norm), FIELD(layer_desc, o), FIELD(layer_desc, o_bias),
    FIELD(layer_desc, post_norm), FIELD(layer_desc, gate_up), FIELD(layer_desc, down),
    FIELD(layer_desc, key_cache), FIELD(layer_desc, value_cache), FIELD(layer_desc, hidden),
    FIELD(layer_desc, num_q_heads), FIELD(layer_desc, num_kv_heads), FIELD(layer_desc, head_dim),
    FIELD(layer_desc, intermediate), FIELD(layer_desc, num_slots), FIELD(layer_desc, is_bf16),
    FIELD(layer_desc, window), FIELD(layer_desc, qkv_type), FIELD(layer_desc, o_type),
    FIELD(layer_desc, gate_up_type), FIELD(layer_desc, down_type), FIELD(layer_desc, is_nope),
    SIZE(model_desc), FIELD(model_desc, embed), FIELD(model_desc, embed_is_bf16), FIELD(model_desc, final_norm),
    FIELD(model_desc, cos), FIELD(model_desc, sin), FIELD(model_desc, num_layers),
    FIELD(model_desc, layers), FIELD(model_desc, embed_quant_type), FIELD(model_desc, lm_head),
    FIELD(model_desc, lm_head_bias), FIELD(model_desc, lm_head_is_bf16), FIELD(model_desc, lm_head_quant_type),
    FIELD(model_desc, vocab), FIELD(model_desc, int8_activations),
    SIZE(step_desc), FIELD(step_desc, input_ids), FIELD(step_desc, positions), FIELD(step_desc, slots),
    FIELD(step_desc, rows), FIELD(step_desc, block_tables), FIELD(step_desc, max_blocks),
    FIELD(step_desc, context_lens), FIELD(step_desc, num_tokens), FIELD(step_desc, block_size),
    FIELD(step_desc, use_dot), FIELD(step_desc, num_threads), FIELD(step_desc, logits),
    FIELD(step_desc, lora_groups), FIELD(step_desc, lora_products), FIELD(step_desc, num_lora_groups),
    SIZE(quant_part), FIELD(quant_part, w), FIELD(quant_part, type), FIELD(quant_part, rows),
};

int64_t decode_forward_layout(const char *type, const char *field) {
    for (size_t i = 0; i < sizeof LAYOUT / sizeof LAYOUT[0]; i++)
        if (!strcmp(LAYOUT[i].type, type) && !strcmp(LAYOUT[i].field, field)) return LAYOUT[i].value;
    return -1;
}
