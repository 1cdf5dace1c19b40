/* Matrix products with few rows, out = x @ W^T (+ bias), for the CPU (engine-core process).
 *
 * At decode a linear layer reads each weight once for a handful of activation rows, so its speed is
 * the memory's: the weights are streamed once, each thread taking its own run of output features
 * (no reduction between threads). Up to four rows a thread reads its weights front to back, one
 * row at a time (one stream, as fast as a plain sum); with more rows, where the arithmetic starts
 * to count, four weight rows at a time against up to four activation rows (sixteen accumulators,
 * each weight block reused from L1 for every group of rows), the next block prefetched.
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

#pragma GCC optimize("fp-contract=fast") /* fused multiply-adds in the vector loops */

#define NB 4 /* weight rows per block */
#define RB 4 /* activation rows per group (at most) */
#define ROW_MAX 4 /* up to this many rows, one weight row at a time */
#define SMALL_WORK 32768 /* weights below which one thread is faster than waking the other */

#ifdef __AVX512F__
#define LANES 16
#define ROW_UNROLL(rb) 4 /* vectors per row and step: 16 accumulators at most of 32 registers */
#define BLOCK_RB 4 /* activation rows per block: 16 accumulators */
#define BLOCK_RB_BF16 4
#else /* AVX2's ymm, or SSE's or NEON's 128 bits: 16 registers or more */
#ifdef __AVX__
#define LANES 8
#else
#define LANES 4
#endif
#define ROW_UNROLL(rb) ((rb) <= 2 ? 4 : 2) /* at most 8 accumulators of 16 registers */
#define BLOCK_RB 2 /* 8 accumulators and 4 weight vectors: 10% faster than 4 rows for fp32 */
#define BLOCK_RB_BF16 4 /* spills, yet 12-20% faster: each widened weight serves 4 rows */
#endif

typedef float floatv __attribute__((vector_size(4 * LANES))); /* one register of floats */
typedef uint16_t halfv __attribute__((vector_size(2 * LANES)));
typedef uint32_t bitsv __attribute__((vector_size(4 * LANES)));

typedef void (*range_fn)(const void *x, int64_t rows, int64_t K, const void *w, int64_t N,
                         const float *bias, float *out, int64_t n_start, int64_t n_end);

static inline float hsum(floatv v) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
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

/* One weight row against rb activation rows, ROW_UNROLL(rb) vectors at a time: with a few rows a
 * thread then reads its weights front to back, one stream, which the hardware prefetcher follows at
 * the speed of a plain sum (interleaved rows reached 0.7-0.8 of it on one thread). */
static inline __attribute__((always_inline)) void row(const float *x, int64_t K, const void *w,
                                                      int is_bf16, int rb, float sums[RB][NB]) {
    enum { U = 4 };
    const int unroll = ROW_UNROLL(rb);
    floatv acc[RB][U] = {{{0}}}, wv[U], xv;
    int64_t k = 0;
    for (; k + unroll * LANES <= K; k += unroll * LANES) {
        for (int u = 0; u < unroll; u++) wv[u] = load_weights(w, k + LANES * u, is_bf16);
        for (int r = 0; r < rb; r++)
            for (int u = 0; u < unroll; u++) {
                memcpy(&xv, x + r * K + k + LANES * u, sizeof xv);
                acc[r][u] += xv * wv[u];
            }
    }
    for (; k + LANES <= K; k += LANES) {
        wv[0] = load_weights(w, k, is_bf16);
        for (int r = 0; r < rb; r++) {
            memcpy(&xv, x + r * K + k, sizeof xv);
            acc[r][0] += xv * wv[0];
        }
    }
    for (int r = 0; r < rb; r++) {
        for (int u = 1; u < unroll; u++) acc[r][0] += acc[r][u];
        float total = hsum(acc[r][0]);
        for (int64_t i = k; i < K; i++) total += x[r * K + i] * load_scalar(w, i, is_bf16);
        sums[r][0] = total;
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
        for (int j = 0; j < nb; j++) {
            float total = hsum(acc[r][j]);
            for (int64_t i = k; i < K; i++) total += x[r * K + i] * load_scalar(w, j * K + i, is_bf16);
            sums[r][j] = total;
        }
}

/* Output features [n_start, n_end) for every row; the switch gives block() constant sizes. */
static inline __attribute__((always_inline)) void range(const void *x, int64_t rows, int64_t K,
                                                        const void *w, int64_t N, const float *bias,
                                                        float *out, int64_t n_start, int64_t n_end,
                                                        int is_bf16) {
    float sums[RB][NB];
    const size_t element = is_bf16 ? sizeof(uint16_t) : sizeof(float);
    if (rows <= ROW_MAX) { /* memory-bound: one stream; the switch gives row() a constant size */
        for (int64_t n = n_start; n < n_end; n++) {
            const void *wn = (const char *)w + n * K * element;
            switch (rows) {
            case 1: row(x, K, wn, is_bf16, 1, sums); break;
            case 2: row(x, K, wn, is_bf16, 2, sums); break;
            case 3: row(x, K, wn, is_bf16, 3, sums); break;
            default: row(x, K, wn, is_bf16, 4, sums); break;
            }
            store(sums, (int)rows, 1, bias, out, N, n);
        }
        return;
    }
    for (int64_t n = n_start; n < n_end;) {
        const int nb = n_end - n < NB ? 1 : NB;
        const void *wn = (const char *)w + n * K * element;
        const int block_rows = is_bf16 ? BLOCK_RB_BF16 : BLOCK_RB;
        for (int64_t r = 0; r < rows; r += block_rows) {
            const int rb = rows - r < block_rows ? (int)(rows - r) : block_rows;
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

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
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

/* w: [N, K] bf16 bits. use_dot: take the dot instruction (only where cpu_has_bf16_dot()).
 * Returns 0, or -1 when scratch memory could not be allocated. */
int32_t gemv_bf16(const float *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N,
                  const float *bias, float *out, int32_t use_dot, int32_t num_threads) {
    const int64_t count = rows * K;
#ifdef HAS_BF16_DOT_BUILD
    if (use_dot && cpu_has_bf16_dot()) {
        uint16_t *packed = malloc(sizeof(uint16_t) * (count + 32));
        if (!packed) return -1;
        for (int64_t i = 0; i < count; i++) packed[i] = to_bf16(x[i]);
        run(range_bf16_dot, packed, rows, K, w, N, bias, out, num_threads);
        free(packed);
        return 0;
    }
#endif
    float *rounded = malloc(sizeof(float) * (count + 16));
    if (!rounded) return -1;
    for (int64_t i = 0; i < count; i++) {
        uint32_t bits = (uint32_t)to_bf16(x[i]) << 16;
        memcpy(rounded + i, &bits, sizeof bits);
    }
    run(range_bf16_widened, rounded, rows, K, w, N, bias, out, num_threads);
    free(rounded);
    return 0;
}
