/* Matrix products of bf16 weights with many rows on AMX tiles, for the CPU (engine-core process).
 *
 * out = x @ W^T (+ bias) with x rounded to bf16 and the bf16 products summed in fp32, the numbers of
 * gemv.c's bf16 products (in another order of summation), at the speed of the tile unit: on a
 * Sapphire Rapids host the dot-instruction kernel ran 32 rows of small's gate/up in 1.2 ms and 256
 * in 9.0, slower than MKL's fp32 products. Computed as out^T = W @ x^T, so W's rows are the A tiles
 * as they lie in memory (16 weight rows x 32 inputs a tile, no repacking of the weights); x is packed
 * once a call into the pair-interleaved B layout the tile unit reads. Each thread takes runs of 32
 * output features and holds four fp32 accumulator tiles (32 features x 32 rows).
 * Only for K a multiple of 32 and where the CPU has AMX-BF16 and the kernel grants the tile state
 * (checked at run time); the caller takes gemv.c's products elsewhere and for the last N % 32 features.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_parts.h"

/* CORESERVE_NO_AMX: the build's second try, for an assembler that does not know the tile instructions */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && !defined(CORESERVE_NO_AMX)
#define HAS_AMX_BUILD 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed));

/* x [rows, K] -> [row blocks of 16][K / 2 pairs][16 rows][2] bf16, zero past the last row. */
static void pack_rows(const float *x, int64_t rows, int64_t K, uint16_t *packed) {
    const int64_t num_blocks = (rows + 15) / 16, pairs = K / 2;
    for (int64_t block = 0; block < num_blocks; block++)
        for (int64_t pair = 0; pair < pairs; pair++)
            for (int64_t m = 0; m < 16; m++) {
                const int64_t row = block * 16 + m;
                uint16_t *to = packed + ((block * pairs + pair) * 16 + m) * 2;
                to[0] = row < rows ? to_bf16(x[row * K + 2 * pair]) : 0;
                to[1] = row < rows ? to_bf16(x[row * K + 2 * pair + 1]) : 0;
            }
}

/* tiles 0-3: accumulators [features a/b][rows a/b]; 4, 5: weights a/b; 6, 7: packed rows a/b */
static AMX_TARGET void configure_tiles(void) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
    __asm__ volatile("" ::: "memory"); /* gcc's intrinsic tells it 8 of the 64 bytes are read: keep the stores */
    _tile_loadconfig(&config);
}

/* out[m][n0 + i] (+ bias) from an accumulator tile laid out [16 features][16 rows]. */
static void store_block(const float *tile, int64_t n0, int64_t m0, int64_t rows, int64_t N, const float *bias,
                        float *out) {
    for (int64_t m = 0; m < 16 && m0 + m < rows; m++)
        for (int64_t i = 0; i < 16; i++) out[(m0 + m) * N + n0 + i] = tile[i * 16 + m] + (bias ? bias[n0 + i] : 0.0f);
}

/* Features [n0, n0 + 32) for every row: 32 rows at a time, four tiles accumulated over K. */
static AMX_TARGET void feature_block(const uint16_t *packed, int64_t rows, int64_t K, const uint16_t *w,
                                     int64_t n0, int64_t N, const float *bias, float *out) {
    const int64_t pairs = K / 2, stride = K * sizeof(uint16_t);
    const uint16_t *wa = w + n0 * K, *wb = w + (n0 + 16) * K;
    float tile[4][256];
    for (int64_t m0 = 0; m0 < rows; m0 += 32) {
        const int has_b = m0 + 16 < rows;
        const uint16_t *xa = packed + (m0 / 16) * pairs * 32, *xb = xa + pairs * 32;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(4, wa + k, stride);
            _tile_loadd(5, wb + k, stride);
            _tile_loadd(6, xa + k * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (has_b) {
                _tile_loadd(7, xb + k * 16, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, tile[0], 64);
        _tile_stored(2, tile[2], 64);
        store_block(tile[0], n0, m0, rows, N, bias, out);
        store_block(tile[2], n0 + 16, m0, rows, N, bias, out);
        if (has_b) {
            _tile_stored(1, tile[1], 64);
            _tile_stored(3, tile[3], 64);
            store_block(tile[1], n0, m0 + 16, rows, N, bias, out);
            store_block(tile[3], n0 + 16, m0 + 16, rows, N, bias, out);
        }
    }
}

static AMX_TARGET void thread_blocks(const uint16_t *packed, int64_t rows, int64_t K, const uint16_t *w,
                                     int64_t num_blocks, int64_t N, const float *bias, float *out) {
    configure_tiles();
#pragma omp for schedule(dynamic, 4)
    for (int64_t block = 0; block < num_blocks; block++)
        feature_block(packed, rows, K, w, block * 32, N, bias, out);
    _tile_release();
}
#endif

/* Whether this build and CPU run AMX-BF16 and the kernel lets this process use the tiles (asked once). */
int32_t cpu_has_amx(void) {
#ifdef HAS_AMX_BUILD
    static int32_t answer = -1;
    if (answer < 0) {
        __builtin_cpu_init();
        answer = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
                 syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return answer;
#else
    return 0;
#endif
}

/* out [rows, N] = x [rows, K] @ W^T (+ bias) for features [0, N - N % 32); w: [N, K] bf16 bits, K a
 * multiple of 32. Returns 0; -1 when scratch memory could not be allocated; -2 without AMX. */
int32_t gemm_bf16_amx(const float *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N, const float *bias,
                      float *out, int32_t num_threads) {
#ifdef HAS_AMX_BUILD
    if (!cpu_has_amx() || K % 32) return -2;
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * ((rows + 15) / 16 + 1) * 16 * K);
    if (!packed) return -1;
    pack_rows(x, rows, K, packed);
    const int64_t num_blocks = N / 32;
#pragma omp parallel num_threads(num_threads)
    thread_blocks(packed, rows, K, w, num_blocks, N, bias, out);
    free(packed);
    return 0;
#else
    (void)x, (void)rows, (void)K, (void)w, (void)N, (void)bias, (void)out, (void)num_threads;
    return -2;
#endif
}
