/* LoRA's grouped low-rank products (csrc/lora_rows.c): an adapter's parts of one product as the kernels
 * read them (coreserve/worker/cpu/bindings.py mirrors the structs), read by lora_rows() on its own and by the
 * fused decode forward (decode_forward.c) inside its threads' region. */
#ifndef CORESERVE_LORA_ROWS_H
#define CORESERVE_LORA_ROWS_H

#include <stdint.h>

struct lora_part {
    int64_t start;  /* first output column */
    int64_t width;  /* output columns */
    int64_t offset; /* first entry of h it reads */
    int64_t rank;
    const float *bt; /* [rank, width]: B transposed */
    float scale;
};

struct lora_group {
    const float *a; /* [rank, in]: the parts' A rows, concatenated */
    int64_t rank;
    int64_t num_parts;
    const struct lora_part *parts;
};

/* Inside a parallel region, every thread of the team calling it: adds the groups' deltas to their rows
 * of out (at most LORA_SHARE_ROWS rows), the same bits as lora_rows(); ends with the team's barrier. */
#define LORA_SHARE_ROWS 64
void lora_rows_share(const float *x, int64_t rows, int64_t in, float *out, int64_t out_width,
                     const int32_t *group_of_row, const struct lora_group *groups, int32_t num_groups);

#endif
