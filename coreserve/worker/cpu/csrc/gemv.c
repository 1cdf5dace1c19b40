/* Matrix products, out = x @ W^T (+ bias), for the CPU (engine-core process): few rows and many.
 *
 * At decode a linear layer reads each weight once for a handful of activation rows, so its speed is
 * the memory's: the weights are streamed once, each thread taking its own run of output features
 * (no reduction between threads). Up to four rows a thread reads its weights front to back, one
 * row at a time (one stream, as fast as a plain sum); with more rows, where the arithmetic starts
 * to count, four weight rows at a time against up to four activation rows (sixteen accumulators,
 * each weight block reused from L1 for every group of rows), the next block prefetched; many rows
 * (prefill) in panels that stay in L2 while the thread's weights pass.
 * Every output is summed in one order whatever the row count, the thread count or the split: one
 * accumulator over K, then finish() (batch invariance, docs/decisions.md).
 * fp32 weights: fp32 products. bf16 weights: x is rounded to bf16 (to nearest even) and the exact
 * bf16 x bf16 products are summed in fp32, with AVX512-BF16's dot instruction where the CPU has it
 * (checked at run time; that function alone is built for that target) and by widening the
 * weights to fp32 elsewhere: the same products, summed in another order.
 * The vectors are one register wide: 16 lanes where the build has AVX-512, 8 with AVX2 (64-byte
 * vectors split in two there spilled their accumulators: 14-16 GB/s against 20 on a Zen 3), 4
 * elsewhere, and the accumulators per loop are sized to the 16 registers AVX2 has.
 * x: [rows, K] and W: [N, K] row-major, out: [rows, N] fp32.
 */
#include <omp.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "kernel_parts.h"

#pragma GCC optimize("fp-contract=fast") /* fused multiply-adds in the vector loops */

#define NB 4 /* weight rows per block */
#define RB 4 /* activation rows per group (at most) */
#define ROW_MAX 4 /* up to this many rows, one weight row at a time */
#define SMALL_WORK 32768 /* weights below which one thread is faster than waking the other */
#define PANEL_BYTES (192 * 1024) /* activation rows per panel of a many-row product: L2 holds them */

#ifdef __AVX512F__
#define LANES 16
#define ROW_STREAMS(rb) 2 /* two weight rows at once */
#define BLOCK_RB 4 /* activation rows per block: 16 accumulators */
#define BLOCK_RB_BF16 4
#else /* AVX2's ymm, or SSE's or NEON's 128 bits: 16 registers or more */
#ifdef __AVX__
#define LANES 8
#else
#define LANES 4
#endif
#define ROW_STREAMS(rb) 1 /* two would spill */
#define BLOCK_RB 2 /* 8 accumulators and 4 weight vectors: 10% faster than 4 rows for fp32 */
#define BLOCK_RB_BF16 4 /* spills, yet 12-20% faster: each widened weight serves 4 rows */
#endif

typedef float floatv __attribute__((vector_size(4 * LANES))); /* one register of floats */
typedef uint16_t halfv __attribute__((vector_size(2 * LANES)));
typedef uint32_t bitsv __attribute__((vector_size(4 * LANES)));

typedef void (*range_fn)(const void *x, int64_t rows, int64_t K, const void *w, int64_t N,
                         const float *bias, float *out, int64_t n_start, int64_t n_end);

static inline float hsum(floatv v) {
#ifdef __AVX512F__ /* a tree of shuffles: the lane-by-lane sum was ~5% of a one-row product */
    return _mm512_reduce_add_ps((__m512)v);
#else
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
#endif
}

/* The next weight block, as one stream, as fast as this block is read: the hardware prefetcher
 * alone retrains on each of a block's row streams and stops at page ends (1 thread: 12 -> 18 GB/s). */
static inline void prefetch(const char *start, int num_bytes) {
    for (int offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch(start + offset);
}

static inline floatv widen_bf16(const uint16_t *p) {
#if LANES == 8 && defined(__AVX2__) /* gcc's convertvector took two xmm widenings and an insert */
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (floatv)_mm256_slli_epi32(bits, 16);
#else
    halfv half;
    memcpy(&half, p, sizeof half);
    return (floatv)(__builtin_convertvector(half, bitsv) << 16);
#endif
}

static inline void store(float sums[RB][NB], int rb, int nb, const float *bias, float *out,
                         int64_t N, int64_t n) {
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nb; j++) out[r * N + n + j] = sums[r][j] + (bias ? bias[n + j] : 0.0f);
}

static inline float load_scalar(const void *w, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline floatv load_weights(const void *w, int64_t i, int is_bf16) {
    floatv v;
    if (is_bf16) return widen_bf16((const uint16_t *)w + i);
    memcpy(&v, (const float *)w + i, sizeof v);
    return v;
}

/* The one ending of every product's sum, whatever kernel or tile computed it: the lanes summed by
 * hsum's tree, then the K % LANES tail in order. So each output is summed in one order whatever the
 * row count, the thread count or the split (batch invariance, docs/decisions.md). */
static inline float finish(floatv acc, const float *x, const void *w, int64_t k, int64_t K, int is_bf16) {
    float total = hsum(acc);
    for (int64_t i = k; i < K; i++) total += x[i] * load_scalar(w, i, is_bf16);
    return total;
}

/* ns weight rows (1 or 2) against rb activation rows, one accumulator per output, as block() sums.
 * With a few rows a thread then reads its weights front to back, in ns sequential streams that the
 * hardware prefetcher follows (interleaved rows reached 0.7-0.8 of a plain sum on one thread); two
 * streams far apart in memory read ~10% faster than one on a Sapphire Rapids host (30.7 against
 * 33.9 GB/s for two threads summing 1 GiB). */
static inline __attribute__((always_inline)) void row(const float *x, int64_t K, const void *w0,
                                                      const void *w1, int ns, int is_bf16, int rb,
                                                      float sums[2][RB][NB]) {
    const void *w[2] = {w0, w1};
    floatv acc[2][RB] = {{{0}}}, wv[2], xv;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        for (int s = 0; s < ns; s++) wv[s] = load_weights(w[s], k, is_bf16);
        for (int r = 0; r < rb; r++) {
            memcpy(&xv, x + r * K + k, sizeof xv);
            for (int s = 0; s < ns; s++) acc[s][r] += xv * wv[s];
        }
    }
    for (int s = 0; s < ns; s++)
        for (int r = 0; r < rb; r++) sums[s][r][0] = finish(acc[s][r], x + r * K, w[s], k, K, is_bf16);
}

/* Weight rows [n_start, n_end) against rb (constant) activation rows: the first half of the run
 * and the second half read side by side, two streams, where the registers hold both. */
static inline __attribute__((always_inline)) void row_run(const float *x, int64_t K, const void *w,
                                                          int is_bf16, int rb, const float *bias,
                                                          float *out, int64_t N, int64_t n_start,
                                                          int64_t n_end) {
    const size_t row_bytes = K * (is_bf16 ? sizeof(uint16_t) : sizeof(float));
    const char *weights = w;
    float sums[2][RB][NB];
    int64_t n = n_start;
    if (ROW_STREAMS(rb) == 2) {
        const int64_t half = (n_end - n_start) / 2;
        for (; n < n_start + half; n++) {
            row(x, K, weights + n * row_bytes, weights + (n + half) * row_bytes, 2, is_bf16, rb, sums);
            store(sums[0], rb, 1, bias, out, N, n);
            store(sums[1], rb, 1, bias, out, N, n + half);
        }
        n += half;
    }
    for (; n < n_end; n++) {
        row(x, K, weights + n * row_bytes, NULL, 1, is_bf16, rb, sums);
        store(sums[0], rb, 1, bias, out, N, n);
    }
}

/* rb activation rows against nb weight rows; is_bf16: w holds bf16 bits, x bf16-rounded fp32. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t K, const void *w,
                                                        int is_bf16, int rb, int nb, float sums[RB][NB]) {
    floatv acc[RB][NB] = {{{0}}};
    const int element = is_bf16 ? sizeof(uint16_t) : sizeof(float);
    const char *next_block = (const char *)w + NB * K * element;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        floatv wv[NB], xv;
        prefetch(next_block + k * NB * element, LANES * NB * element);
        for (int j = 0; j < nb; j++) wv[j] = load_weights(w, j * K + k, is_bf16);
        for (int r = 0; r < rb; r++) {
            memcpy(&xv, x + r * K + k, sizeof xv);
            for (int j = 0; j < nb; j++) acc[r][j] += xv * wv[j];
        }
    }
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nb; j++)
            sums[r][j] = finish(acc[r][j], x + r * K, (const char *)w + j * K * element, k, K, is_bf16);
}

/* Output features [n_start, n_end) for every row; the switch gives block() constant sizes. */
static inline __attribute__((always_inline)) void range(const void *x, int64_t rows, int64_t K,
                                                        const void *w, int64_t N, const float *bias,
                                                        float *out, int64_t n_start, int64_t n_end,
                                                        int is_bf16) {
    float sums[RB][NB];
    const size_t element = is_bf16 ? sizeof(uint16_t) : sizeof(float);
    if (rows <= ROW_MAX) { /* memory-bound: sequential streams; the switch gives row() constant sizes */
        switch (rows) {
        case 1: row_run(x, K, w, is_bf16, 1, bias, out, N, n_start, n_end); break;
        case 2: row_run(x, K, w, is_bf16, 2, bias, out, N, n_start, n_end); break;
        case 3: row_run(x, K, w, is_bf16, 3, bias, out, N, n_start, n_end); break;
        default: row_run(x, K, w, is_bf16, 4, bias, out, N, n_start, n_end); break;
        }
        return;
    }
    const int block_rows = is_bf16 ? BLOCK_RB_BF16 : BLOCK_RB;
    int64_t panel = PANEL_BYTES / (K * (int64_t)sizeof(float)) / block_rows * block_rows;
    panel = panel < block_rows ? block_rows : panel;
    for (int64_t p = 0; p < rows; p += panel) { /* a panel of rows stays in L2 while the weights pass */
        const int64_t p_end = rows - p < panel ? rows : p + panel;
        for (int64_t n = n_start; n < n_end;) {
            const int nb = n_end - n < NB ? 1 : NB;
            const void *wn = (const char *)w + n * K * element;
            for (int64_t r = p; r < p_end; r += block_rows) {
                const int rb = p_end - r < block_rows ? (int)(p_end - r) : block_rows;
                const float *xr = (const float *)x + r * K;
                if (nb == NB) {
                    switch (rb) {
                    case 1: block(xr, K, wn, is_bf16, 1, NB, sums); break;
                    case 2: block(xr, K, wn, is_bf16, 2, NB, sums); break;
                    case 3: block(xr, K, wn, is_bf16, 3, NB, sums); break;
                    default: block(xr, K, wn, is_bf16, 4, NB, sums); break;
                    }
                } else {
                    block(xr, K, wn, is_bf16, rb, 1, sums);
                }
                store(sums, rb, nb, bias, out + r * N, N, n);
            }
            n += nb;
        }
    }
}

static void range_f32(const void *x, int64_t rows, int64_t K, const void *w, int64_t N,
                      const float *bias, float *out, int64_t n_start, int64_t n_end) {
    range(x, rows, K, w, N, bias, out, n_start, n_end, 0);
}

static void range_bf16_widened(const void *x, int64_t rows, int64_t K, const void *w, int64_t N,
                               const float *bias, float *out, int64_t n_start, int64_t n_end) {
    range(x, rows, K, w, N, bias, out, n_start, n_end, 1);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define HAS_BF16_DOT_BUILD 1
#include "gemv_bf16_dot.h"
#endif

/* Splits the output features between the threads in whole blocks; one thread for small work. */
static void run(range_fn fn, const void *x, int64_t rows, int64_t K, const void *w, int64_t N,
                const float *bias, float *out, int32_t num_threads) {
    const int64_t num_blocks = (N + NB - 1) / NB;
    if (N * K <= SMALL_WORK || num_threads <= 1) { /* no parallel region: even one not taken costs ~2 us */
        fn(x, rows, K, w, N, bias, out, 0, N);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t start = num_blocks * t / nt * NB, end = num_blocks * (t + 1) / nt * NB;
        if (start < N) fn(x, rows, K, w, N, bias, out, start, end < N ? end : N);
    }
}

void gemv_f32(const float *x, int64_t rows, int64_t K, const float *w, int64_t N, const float *bias,
              float *out, int32_t num_threads) {
    run(range_f32, x, rows, K, w, N, bias, out, num_threads);
}

/* Whether this build and this CPU run the bf16 dot instruction. */
int32_t cpu_has_bf16_dot(void) {
#ifdef HAS_BF16_DOT_BUILD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* The bf16 product to run (the dot instruction's where asked for and present, else the widening
 * one) and x rounded to bf16 into scratch as it reads it: bf16 bits for the dot, fp32 otherwise.
 * scratch: rows * K + 32 elements of 4 bytes. */
static range_fn bf16_product(const float *x, int64_t count, int32_t use_dot, void *scratch) {
#ifdef HAS_BF16_DOT_BUILD
    if (use_dot && cpu_has_bf16_dot()) {
        uint16_t *packed = scratch;
        for (int64_t i = 0; i < count; i++) packed[i] = to_bf16(x[i]);
        return range_bf16_dot;
    }
#endif
    (void)use_dot;
    float *rounded = scratch;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t bits = (uint32_t)to_bf16(x[i]) << 16;
        memcpy(rounded + i, &bits, sizeof bits);
    }
    return range_bf16_widened;
}

/* w: [N, K] bf16 bits. use_dot: take the dot instruction (only where cpu_has_bf16_dot()).
 * Returns 0, or -1 when scratch memory could not be allocated. */
int32_t gemv_bf16(const float *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N,
                  const float *bias, float *out, int32_t use_dot, int32_t num_threads) {
    float *scratch = malloc(sizeof(float) * (rows * K + 32));
    if (!scratch) return -1;
    run(bf16_product(x, rows * K, use_dot, scratch), scratch, rows, K, w, N, bias, out, num_threads);
    free(scratch);
    return 0;
}

/* One thread's part of out = x @ W^T (+ bias) for a caller inside its own parallel region (the fused
 * decode forward): the same sums, output by output, as gemv_f32 and gemv_bf16, whatever the split.
 * The threads take runs of output features from a shared cursor (0 before the first thread starts) by
 * claim_run (kernel_parts.h: a fixed half each waited ~20 us a product at one row). x: [rows, K] fp32. bf16 weights (is_bf16): scratch holds
 * rows * K + 32 elements of 4 bytes, the thread's own, for x rounded to bf16. */
void gemv_share(const float *x, int64_t rows, int64_t K, const void *w, int32_t is_bf16, int32_t use_dot,
                int64_t N, const float *bias, float *out, void *scratch, int64_t *cursor, int num_threads) {
    const range_fn fn = is_bf16 ? bf16_product(x, rows * K, use_dot, scratch) : range_f32;
    const void *input = is_bf16 ? scratch : (const void *)x;
    int64_t start, end;
    while (claim_run(cursor, N, num_threads, &start, &end)) fn(input, rows, K, w, N, bias, out, start, end);
}
