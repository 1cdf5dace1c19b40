/* A benchmark probe, not part of the engine: the sum of a[0..n), each thread reading its share as two
 * sequential streams, the way the few-row products (coreserve/worker/cpu/csrc/gemv.c) read their weights. It
 * tells the memory read rate those products can reach; scripts/bench_decode_step.py builds it
 * (scripts/stream_read.py) and compares it with torch's sum.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float floatv __attribute__((vector_size(4 * LANES)));

static float hsum(floatv v) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
}

float stream_sum(const float *a, int64_t n, int32_t num_threads) {
    float total = 0.0f;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t start = n * t / nt, end = n * (t + 1) / nt, half = (end - start) / 2;
        const float *first = a + start, *second = first + half;
        floatv s0 = {0}, s1 = {0}, v;
        int64_t i = 0;
        for (; i + LANES <= half; i += LANES) {
            memcpy(&v, first + i, sizeof v);
            s0 += v;
            memcpy(&v, second + i, sizeof v);
            s1 += v;
        }
        float part = hsum(s0 + s1);
        for (; i < half; i++) part += first[i] + second[i];
        for (int64_t j = start + 2 * half; j < end; j++) part += a[j];
        total += part;
    }
    return total;
}
