/* The whole decoder stack for a decode-only batch (one new token per sequence) in one call.
 *
 * A decode step of a small model on a CPU spends as much time in Python and in launching small
 * ops as in reading weights. This runs every layer - RMSNorm with the residual add, the q/k/v
 * matmul, optional q/k norms, rotary, the KV cache write, paged attention, o, the gated MLP -
 * with the kernels of cpu_kernels.c and quant_kernels.c, and hands back the final normed hidden
 * states. The torch path computes the same thing op by op (and is what prefill uses). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode_common.h"

typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm NULL when absent */
    int norm_wtype;
    AnnaLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [blocks, kv_heads, block_size, row] */
    const AnnaKVFormat *kv_format; /* how the cache rows are stored */
} AnnaLayer;

void anna_decode_layers(const AnnaLayer *layers, long num_layers, const float *embeddings, long M, long hidden,
                        long heads, long kv_heads, long head_dim, long intermediate, float eps,
                        const long *positions, const long *slots, const long *tables, long table_width,
                        const long *ctx, long block_size, long window, float scale, const float *cos_table,
                        const float *sin_table, const void *final_norm, float *out, int threads) {
    long q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_width = q_size + 2 * kv_size;
    float *residual = malloc(sizeof(float) * M * hidden);
    float *normed = malloc(sizeof(float) * M * hidden);
    float *h = malloc(sizeof(float) * M * hidden);
    float *qkv = malloc(sizeof(float) * M * qkv_width);
    float *q = malloc(sizeof(float) * M * q_size);
    float *attn = malloc(sizeof(float) * M * q_size);
    float *gate_up = malloc(sizeof(float) * M * 2 * intermediate);
    float *act = malloc(sizeof(float) * M * intermediate);
    float *head_tmp = malloc(sizeof(float) * head_dim);
    memcpy(residual, embeddings, sizeof(float) * M * hidden);
    for (long li = 0; li < num_layers; li++) {
        const AnnaLayer *L = layers + li;
        anna_add_rmsnorm(residual, li == 0 ? NULL : h, L->input_norm, L->norm_wtype, normed, M, hidden, eps, threads);
        linear(&L->qkv, normed, qkv, M, threads);
        if (L->q_norm) {
            for (long t = 0; t < M; t++) {
                for (long hh = 0; hh < heads + kv_heads; hh++) {
                    float *v = qkv + t * qkv_width + hh * head_dim;
                    memcpy(head_tmp, v, sizeof(float) * head_dim);
                    anna_add_rmsnorm(head_tmp, NULL, hh < heads ? L->q_norm : L->k_norm, L->norm_wtype, v, 1,
                                     head_dim, eps, 1);
                }
            }
        }
        anna_rotary(qkv, qkv_width, M, heads, head_dim, cos_table, sin_table, positions);
        anna_rotary(qkv + q_size, qkv_width, M, kv_heads, head_dim, cos_table, sin_table, positions);
        anna_kv_write(L->kv_format, qkv + q_size, qkv_width, M, kv_heads, L->k_cache, slots, block_size);
        anna_kv_write(L->kv_format, qkv + q_size + kv_size, qkv_width, M, kv_heads, L->v_cache, slots, block_size);
        for (long t = 0; t < M; t++) memcpy(q + t * q_size, qkv + t * qkv_width, sizeof(float) * q_size);
        anna_paged_decode_attention(q, L->k_cache, L->v_cache, L->kv_format, tables, table_width, ctx, M, heads,
                                    kv_heads, head_dim, block_size, window, scale, attn, threads);
        linear(&L->o, attn, h, M, threads);
        anna_add_rmsnorm(residual, h, L->post_norm, L->norm_wtype, normed, M, hidden, eps, threads);
        linear(&L->gate_up, normed, gate_up, M, threads);
        anna_silu_mul(gate_up, act, M, intermediate, 0, threads);
        linear(&L->down, act, h, M, threads);
    }
    anna_add_rmsnorm(residual, h, final_norm, layers[0].norm_wtype, out, M, hidden, eps, threads);
    free(residual); free(normed); free(h); free(qkv); free(q); free(attn); free(gate_up); free(act); free(head_tmp);
}
