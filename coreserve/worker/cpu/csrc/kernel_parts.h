/* The per-thread pieces of the CPU kernels that decode_forward.c strings together inside one parallel
 * region: each does one token's or one thread's share of its work, with no parallel region of its
 * own. Defined in fused_ops.c, decode_attention.c, gemv.c and gemv_quant.c; and the bf16 rounding every bf16
 * product shares (engine-core process).
 */
#ifndef CORESERVE_KERNEL_PARTS_H
#define CORESERVE_KERNEL_PARTS_H

#include <stdint.h>
#include <string.h>

/* fp32 -> bf16 bits, to nearest even, as torch rounds (a NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* fused_ops.c: token t of RMSNorm (of x + delta, written to sum_out, when delta is given), of
 * silu(gate) * up, and of RoPE (c, s: the token's cos and signed sin rows; c NULL: none, NoPE) with the
 * KV-cache write. */
void rms_norm_token(const float *x, const float *delta, int64_t t, int64_t hidden, const float *weight,
                    float eps, float *sum_out, float *out);
void silu_mul_token(const float *gate_up, int64_t t, int64_t intermediate, float *out);
/* silu_mul_token's elements [begin, end) (begin a multiple of 8: the same values as the whole row's). */
void silu_mul_range(const float *gate_up, int64_t t, int64_t intermediate, float *out, int64_t begin, int64_t end);
void rope_write_kv_token(const float *qkv, const float *c, const float *s, const int64_t *slots, int64_t t,
                         int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, float *q_out, float *k_out,
                         float *key_cache, float *value_cache, int64_t num_slots);

/* decode_attention.c: one (row, KV head) task over context positions [start, context_len). sinks: the
 * group's [group] sink logits (gpt-oss), NULL for none; scores: [group, context_len - start] scratch; acc:
 * [group, head_dim] scratch. */
void attend_one(const float *q, float *out, const float *keys, const float *values, const int32_t *table,
                int start, int context_len, int group, int head_dim, int block_size, float scale, float softcap,
                const float *sinks, float *scores, float *acc);

/* The next run [*start, *end) of a shared product's N output features for the calling thread, taken
 * from the shared *cursor: large runs first and smaller ones as the features run out (as OpenMP's guided
 * schedule; a run is a multiple of 4 rows, at least 32: two streams of 16), so that a thread the memory
 * serves more slowly gets less and both finish together. Returns 0 when none is left. */
static inline int claim_run(int64_t *cursor, int64_t N, int num_threads, int64_t *start, int64_t *end) {
    int64_t at = __atomic_load_n(cursor, __ATOMIC_RELAXED);
    while (at < N) {
        int64_t size = (N - at) / (2 * num_threads);
        size = (size < 32 ? 32 : size + 3) / 4 * 4;
        const int64_t until = at + size < N ? at + size : N;
        if (__atomic_compare_exchange_n(cursor, &at, until, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *start = at, *end = until;
            return 1;
        } /* else at now holds the cursor another thread moved */
    }
    return 0;
}

/* gemv.c: a thread's part of out = x @ W^T (+ bias), fp32 or bf16 weights, in runs taken from the
 * shared *cursor (0 before the threads start); scratch: the thread's own rows * K + 32 elements of
 * 4 bytes (bf16 weights only). */
void gemv_share(const float *x, int64_t rows, int64_t K, const void *w, int32_t is_bf16, int32_t use_dot,
                int64_t N, const float *bias, float *out, void *scratch, int64_t *cursor, int num_threads);

/* A run of a product's weight rows in GGUF blocks of one ggml type. A fused projection whose GGUF
 * tensors differ in type (a Q4_K_M file's Q4_K q and k beside a Q6_K v) is its runs one after another:
 * its type is QUANT_PARTS and its weight pointer an array of these, ended by one of 0 rows. */
struct quant_part {
    const uint8_t *w; /* [rows, row bytes of its type] */
    int64_t type, rows;
};
#define QUANT_PARTS (-1)

/* gemv_quant.c: the same for weights in a GGUF block format (ggml type Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or
 * Q6_K, or QUANT_PARTS; K whole blocks), the sums bit for bit gemv_share's on the dequantized weights
 * (0, or -1: no memory); and rows of such weights dequantized to fp32 (0, or -2: an unsupported type
 * or K). */
int gemv_quant_share(const float *x, int64_t rows, int64_t K, const uint8_t *w, int type, int64_t N,
                     const float *bias, float *out, int64_t *cursor, int num_threads);
int32_t dequantize_rows(const uint8_t *w, int32_t type, int64_t rows, int64_t K, float *out);
int64_t quant_row_bytes(int32_t type, int64_t K);
int quant_product_supported(const uint8_t *w, int32_t type, int64_t K, int64_t N); /* gemv_quant.c */

/* gemv_int8.c: integer mode (quantized_activations="int8"). Rows of x quantized to int8 in blocks of
 * 32 with fp32 scales, carved from int8_rows_bytes(rows, K) bytes by int8_rows_at, filled row by row by
 * int8_quantize_rows; then a thread's part of the product in runs from the shared cursor. */
struct int8_rows {
    int8_t *q;     /* [rows, K] */
    float *d;      /* [rows, K / 32] each block's scale */
    float *ds;     /* [rows, K / 32] scale * the block's sum of q */
    int16_t *s16;  /* [rows, K / 16] sums of q per 16 */
    int64_t K;
};
int64_t int8_rows_bytes(int64_t rows, int64_t K);
struct int8_rows int8_rows_at(void *memory, int64_t rows, int64_t K);
void int8_quantize_rows(const float *x, int64_t r0, int64_t r1, const struct int8_rows *a);
void gemv_int8_share(const struct int8_rows *a, int64_t rows, const uint8_t *w, int type, int64_t N,
                     const float *bias, float *out, int64_t *cursor, int num_threads);

#endif
