/* What the fused decode stacks (decode_layers.c, decode_hybrid.c) share: the kernels they call
 * and the description of one linear layer's weights, with the call that runs it. */
#ifndef ANNA_DECODE_COMMON_H
#define ANNA_DECODE_COMMON_H

#include <stdint.h>

#include "kv_format.h"

void anna_gemv(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N, long K,
               int bf16_dot_rows, int bf16_pair_max_rows, int threads);
void anna_qgemm(const float *x, const void *w, const void *ws, int kind, long G, const float *bias, float *y,
                long M, long N, long K, int threads);
void anna_add_rmsnorm(float *x, const float *delta, const void *w, int wtype, float *out, long rows, long dim,
                      float eps, int threads);
void anna_silu_mul(const void *gate_up, void *out, long M, long I, int bf16, int threads);
void anna_rotary(float *x, long row_stride, long tokens, long heads, long dim, const float *cos_table,
                 const float *sin_table, const long *positions);
void anna_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const AnnaKVFormat *f,
                                 const long *tables, long table_width, const long *ctx, long seqs, long heads,
                                 long kv_heads, long dim, long block_size, long window, float scale, float *out,
                                 int threads);

typedef struct {
    const void *weight;   /* float weights (wtype 0 bf16, 1 fp16, 2 fp32) or quantized values */
    const void *scales;   /* quantized: int8 row scales (fp32) or int4 group scales (fp16); else NULL */
    const float *bias;    /* fp32 or NULL */
    int wtype;            /* float weights: 0/1/2; quantized: -1 */
    int qkind;            /* quantized: 0 int8, 1 int4 */
    long group;           /* int4 group size */
    long n, k;
    int bf16_dot_rows;    /* bf16 weights: from this many rows of x on, x in bf16 on vdpbf16ps (0: never) */
    int bf16_pair_max_rows; /* bf16 weights, AVX2 builds: up to this many rows of x, no conversion pass */
} AnnaLinear;

static inline void linear(const AnnaLinear *l, const float *x, float *y, long M, int threads) {
    if (l->wtype >= 0) anna_gemv(x, l->weight, l->wtype, l->bias, y, (int)M, l->n, l->k, l->bf16_dot_rows,
                                 l->bf16_pair_max_rows, threads);
    else anna_qgemm(x, l->weight, l->scales, l->qkind, l->group, l->bias, y, M, l->n, l->k, threads);
}

#endif
