/* The bf16 x bf16 -> fp32 products of gemv.c with AVX512-BF16's dot instruction (vdpbf16ps: 32
 * products summed pairwise into 16 fp32 lanes). Only these functions are built for that target, so
 * the library builds with any x86-64 compiler flags; gemv.c calls them only where the CPU has it.
 * x: [rows, K] bf16 bits (rounded by the caller), w: [N, K] bf16 bits.
 */
#ifndef CORESERVE_GEMV_BF16_DOT_H
#define CORESERVE_GEMV_BF16_DOT_H

#include <immintrin.h>

#define BF16_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

static inline __attribute__((always_inline)) BF16_DOT_TARGET __m512bh load_bf16(const uint16_t *p,
                                                                                 __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

static inline __attribute__((always_inline)) BF16_DOT_TARGET void block_dot(
    const uint16_t *x, int64_t K, const uint16_t *w, int rb, int nb, float sums[RB][NB]) {
    __m512 acc[RB][NB];
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nb; j++) acc[r][j] = _mm512_setzero_ps();
    const char *next_block = (const char *)(w + NB * K);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[NB];
        prefetch(next_block + k * NB * 2, 32 * NB * 2);
        for (int j = 0; j < nb; j++) wv[j] = load_bf16(w + j * K + k, ~(__mmask32)0);
        for (int r = 0; r < rb; r++) {
            const __m512bh xv = load_bf16(x + r * K + k, ~(__mmask32)0);
            for (int j = 0; j < nb; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    if (k < K) { /* the tail, zero padded: no load past a row's end */
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = load_bf16(w + j * K + k, mask);
        for (int r = 0; r < rb; r++) {
            const __m512bh xv = load_bf16(x + r * K + k, mask);
            for (int j = 0; j < nb; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nb; j++) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

/* ns weight rows (1 or 2) against rb activation rows, one accumulator per output summed exactly as
 * block_dot() sums it (32 columns a step, the zero-padded tail last), in sequential streams (see row()
 * in gemv.c). */
static inline __attribute__((always_inline)) BF16_DOT_TARGET void row_dot(
    const uint16_t *x, int64_t K, const uint16_t *w0, const uint16_t *w1, int ns, int rb, float sums[2][RB][NB]) {
    const uint16_t *w[2] = {w0, w1};
    __m512 acc[2][RB];
    for (int s = 0; s < ns; s++)
        for (int r = 0; r < rb; r++) acc[s][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[2];
        for (int s = 0; s < ns; s++) wv[s] = load_bf16(w[s] + k, mask);
        for (int r = 0; r < rb; r++) {
            const __m512bh xv = load_bf16(x + r * K + k, mask);
            for (int s = 0; s < ns; s++) acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xv, wv[s]);
        }
    }
    for (int s = 0; s < ns; s++)
        for (int r = 0; r < rb; r++) sums[s][r][0] = _mm512_reduce_add_ps(acc[s][r]);
}

/* Weight rows [n_start, n_end) against rb (constant) activation rows, the run's two halves side by side. */
static inline __attribute__((always_inline)) BF16_DOT_TARGET void row_dot_run(
    const uint16_t *x, int64_t K, const uint16_t *weights, int rb, const float *bias, float *out, int64_t N,
    int64_t n_start, int64_t n_end) {
    float sums[2][RB][NB];
    const int64_t half = (n_end - n_start) / 2;
    int64_t n = n_start;
    for (; n < n_start + half; n++) {
        row_dot(x, K, weights + n * K, weights + (n + half) * K, 2, rb, sums);
        store(sums[0], rb, 1, bias, out, N, n);
        store(sums[1], rb, 1, bias, out, N, n + half);
    }
    for (n += half; n < n_end; n++) {
        row_dot(x, K, weights + n * K, NULL, 1, rb, sums);
        store(sums[0], rb, 1, bias, out, N, n);
    }
}

static BF16_DOT_TARGET void range_bf16_dot(const void *x, int64_t rows, int64_t K, const void *w,
                                           int64_t N, const float *bias, float *out, int64_t n_start,
                                           int64_t n_end) {
    float sums[RB][NB];
    const uint16_t *weights = w;
    if (rows <= 2) { /* past two rows the x loads cap the dot rate below the memory's */
        if (rows == 1)
            row_dot_run(x, K, weights, 1, bias, out, N, n_start, n_end);
        else
            row_dot_run(x, K, weights, 2, bias, out, N, n_start, n_end);
        return;
    }
    for (int64_t n = n_start; n < n_end;) {
        const int nb = n_end - n < NB ? 1 : NB;
        for (int64_t r = 0; r < rows; r += RB) {
            const int rb = rows - r < RB ? (int)(rows - r) : RB;
            const uint16_t *xr = (const uint16_t *)x + r * K;
            if (nb == NB) {
                switch (rb) {
                case 1: block_dot(xr, K, weights + n * K, 1, NB, sums); break;
                case 2: block_dot(xr, K, weights + n * K, 2, NB, sums); break;
                case 3: block_dot(xr, K, weights + n * K, 3, NB, sums); break;
                default: block_dot(xr, K, weights + n * K, 4, NB, sums); break;
                }
            } else {
                block_dot(xr, K, weights + n * K, rb, 1, sums);
            }
            store(sums, rb, nb, bias, out + r * N, N, n);
        }
        n += nb;
    }
}

#endif
