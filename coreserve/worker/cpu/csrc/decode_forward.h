/* What the fused decode forward reads (decode_forward.c), as named structs; coreserve/worker/cpu/bindings.py
 * mirrors them with ctypes.Structure and tests/test_cpu_bindings.py checks both layouts agree through
 * decode_forward_layout(). Every field is 8 bytes (a pointer or an int64), so no padding is implied.
 */
#ifndef CORESERVE_DECODE_FORWARD_H
#define CORESERVE_DECODE_FORWARD_H

#include <stdint.h>

#include "lora_rows.h"

/* One decoder layer's weights, KV cache and shapes (every layer of one model has the same shapes). */
struct layer_desc {
    const float *input_norm;  /* [hidden] */
    const void *qkv;          /* [(Hq + 2 Hkv) D, hidden] fp32, bf16 bits (is_bf16) or blocks (qkv_type) */
    const float *qkv_bias;    /* [(Hq + 2 Hkv) D] or NULL */
    const float *q_norm;      /* [D] Qwen3's per-head norm, or NULL */
    const float *k_norm;      /* [D] or NULL (set together with q_norm) */
    const void *o;            /* [hidden, Hq D] */
    const float *o_bias;      /* [hidden] or NULL */
    const float *post_norm;   /* [hidden] */
    const void *gate_up;      /* [2 I, hidden] */
    const void *down;         /* [hidden, I] */
    float *key_cache;         /* [Hkv, num_slots, D] */
    float *value_cache;       /* [Hkv, num_slots, D] */
    int64_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate, num_slots;
    int64_t is_bf16;          /* the products' float weights are bf16 (every layer alike) */
    int64_t window;           /* sliding window in positions, 0 for none */
    /* each product's weights are GGUF blocks of this ggml type; 0: floats (fp32, or bf16 by is_bf16);
     * QUANT_PARTS (kernel_parts.h): runs of rows of different types, and the pointer their array */
    int64_t qkv_type, o_type, gate_up_type, down_type;
    int64_t is_nope;          /* no RoPE in this layer (SmolLM3's listed layers): q and k as the product gives them */
};

/* What every step of one model shares. */
struct model_desc {
    const void *embed;                /* [vocab, hidden] fp32, or bf16 bits where embed_is_bf16 */
    int64_t embed_is_bf16;
    const float *final_norm;          /* [hidden] */
    const float *cos, *sin;           /* [max_positions, D / 2]: the half HF's [max_positions, D] repeats */
    int64_t num_layers;
    const struct layer_desc *layers;  /* [num_layers] */
    int64_t embed_quant_type;         /* embed is GGUF blocks of this ggml type; 0: not */
    const void *lm_head;              /* [vocab, hidden] fp32, bf16 bits or GGUF blocks (as the layers' kinds) */
    const float *lm_head_bias;        /* [vocab] or NULL */
    int64_t lm_head_is_bf16, lm_head_quant_type, vocab;
    int64_t int8_activations;         /* integer mode: the GGUF-block products take gemv_int8.c's */
};

/* This step's rows: T decode tokens, one per request. */
struct step_desc {
    const int64_t *input_ids, *positions, *slots;  /* [T]; positions: rows of cos, sin (StepInputs.rope_rows) */
    const int64_t *rows;                           /* [T] rows of the flattened batch */
    const int32_t *block_tables;                   /* [T, max_blocks] */
    int64_t max_blocks;
    const int32_t *context_lens;                   /* [T] tokens attended to, this one's included */
    int64_t num_tokens, block_size;
    int64_t use_dot;                               /* bf16 products take the dot instruction */
    int64_t num_threads;
    float *logits;                                 /* [T, vocab]: lm_head's products too; NULL: not */
    /* LoRA (lora_rows.h): each row's adapter group (-1: none), and for each layer's qkv, o, gate_up and
     * down (4 l + 0..3) and lm_head (4 num_layers) the groups' parts of that product (NULL: no group
     * has any); lora_groups NULL: no row has an adapter */
    const int32_t *lora_groups;
    const struct lora_group *const *lora_products;
    int64_t num_lora_groups;
};

#endif
