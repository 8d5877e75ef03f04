/* The whole decoder stack of a hybrid Qwen3.5-family model (dense MLPs) for a decode-only batch
 * in one call: decode_layers.c's reason (per-op dispatch costs as much as the weight reads at
 * this size) for model/qwen3_5.py's layers. Each layer is Gated DeltaNet (in_proj and b/a
 * matmuls, the conv step, gated_delta.c's decode, out_proj) or gated attention (q|gate, k, v in
 * one matmul, per-head q/k norms, rotary on the first rope_dim of each head, the KV write, paged
 * attention, times sigmoid(gate), o), then the gated MLP. Norm weights are fp32 (zero-centred
 * norms are stored as 1 + w). The torch path computes the same thing op by op. Rows may chain
 * their recurrent states (state_src_slots, see gated_delta.c): speculative decoding's verification. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode_common.h"

void anna_conv_step(const float *x, float *state, const int64_t *slots, const int64_t *src_slots, long batch,
                    long channels, long kernel, const float *weight, float *out, int threads);
void anna_gated_delta_decode(const float *conved, const float *z, const float *ba, float *state,
                             const int64_t *slots, const int64_t *src_slots, const float *a_log, const float *dt_bias,
                             const void *norm_weight, int norm_wtype, float eps, long batch, long key_heads,
                             long heads, long dk, long dv, float *out, int threads);

typedef struct {
    int linear;  /* 1: Gated DeltaNet; 0: gated attention */
    const float *input_norm, *post_norm;  /* fp32 */
    AnnaLinear gate_up, down;
    /* gated attention */
    AnnaLinear qkv, o;
    const float *q_norm, *k_norm;  /* fp32 */
    void *k_cache, *v_cache;
    const AnnaKVFormat *kv_format;
    /* Gated DeltaNet */
    AnnaLinear in_proj, ba, out_proj;
    const float *conv_weight, *a_log, *dt_bias;
    const void *gated_norm;
    int gated_norm_wtype;
    float *conv_state, *recurrent_state;
} AnnaHybridLayer;

static void norm_heads(float *x, long stride, long M, long heads, long head_stride, long dim, const float *w,
                       float eps, float *tmp) {
    for (long t = 0; t < M; t++)
        for (long hh = 0; hh < heads; hh++) {
            float *v = x + t * stride + hh * head_stride;
            memcpy(tmp, v, sizeof(float) * dim);
            anna_add_rmsnorm(tmp, NULL, w, 2, v, 1, dim, eps, 1);
        }
}

static void rotate_heads(float *x, long stride, long M, long heads, long head_stride, long rope_dim,
                         const float *cos_table, const float *sin_table, const long *positions) {
    for (long hh = 0; hh < heads; hh++)
        anna_rotary(x + hh * head_stride, stride, M, 1, rope_dim, cos_table, sin_table, positions);
}

void anna_decode_hybrid_layers(const AnnaHybridLayer *layers, long num_layers, const float *embeddings, long M,
                               long hidden, long heads, long kv_heads, long head_dim, long rope_dim,
                               long intermediate, float eps, const long *positions, const long *slots,
                               const long *tables, long table_width, const long *ctx, long block_size, float scale,
                               const float *cos_table, const float *sin_table, const int64_t *state_slots,
                               const int64_t *state_src_slots, long key_heads, long value_heads, long dk, long dv, long conv_kernel,
                               const float *final_norm, float *out, int threads) {
    long q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_width = 2 * q_size + 2 * kv_size;
    long channels = 2 * key_heads * dk + value_heads * dv, value_dim = value_heads * dv;
    long mixer_width = qkv_width > channels + value_dim ? qkv_width : channels + value_dim;
    float *residual = malloc(sizeof(float) * M * hidden);
    float *normed = malloc(sizeof(float) * M * hidden);
    float *h = malloc(sizeof(float) * M * hidden);
    float *mix = malloc(sizeof(float) * M * mixer_width);
    float *a = malloc(sizeof(float) * M * (channels > q_size ? channels : q_size));
    float *b = malloc(sizeof(float) * M * (value_dim > q_size ? value_dim : q_size));
    float *c = malloc(sizeof(float) * M * (value_dim > q_size ? value_dim : q_size));
    float *ba = malloc(sizeof(float) * M * 2 * value_heads);
    float *gate_up = malloc(sizeof(float) * M * 2 * intermediate);
    float *act = malloc(sizeof(float) * M * intermediate);
    float *tmp = malloc(sizeof(float) * (head_dim > dv ? head_dim : dv));
    memcpy(residual, embeddings, sizeof(float) * M * hidden);
    for (long li = 0; li < num_layers; li++) {
        const AnnaHybridLayer *L = layers + li;
        anna_add_rmsnorm(residual, li == 0 ? NULL : h, L->input_norm, 2, normed, M, hidden, eps, threads);
        if (L->linear) {
            long width = channels + value_dim;
            linear(&L->in_proj, normed, mix, M, threads);
            linear(&L->ba, normed, ba, M, threads);
            for (long t = 0; t < M; t++) {  /* q|k|v and z, each contiguous */
                memcpy(a + t * channels, mix + t * width, sizeof(float) * channels);
                memcpy(b + t * value_dim, mix + t * width + channels, sizeof(float) * value_dim);
            }
            anna_conv_step(a, L->conv_state, state_slots, state_src_slots, M, channels, conv_kernel, L->conv_weight,
                           mix, threads);
            anna_gated_delta_decode(mix, b, ba, L->recurrent_state, state_slots, state_src_slots, L->a_log,
                                    L->dt_bias, L->gated_norm, L->gated_norm_wtype, eps, M, key_heads, value_heads,
                                    dk, dv, c, threads);
            linear(&L->out_proj, c, h, M, threads);
        } else {
            linear(&L->qkv, normed, mix, M, threads);
            norm_heads(mix, qkv_width, M, heads, 2 * head_dim, head_dim, L->q_norm, eps, tmp);
            norm_heads(mix + 2 * q_size, qkv_width, M, kv_heads, head_dim, head_dim, L->k_norm, eps, tmp);
            rotate_heads(mix, qkv_width, M, heads, 2 * head_dim, rope_dim, cos_table, sin_table, positions);
            rotate_heads(mix + 2 * q_size, qkv_width, M, kv_heads, head_dim, rope_dim, cos_table, sin_table,
                         positions);
            anna_kv_write(L->kv_format, mix + 2 * q_size, qkv_width, M, kv_heads, L->k_cache, slots, block_size);
            anna_kv_write(L->kv_format, mix + 2 * q_size + kv_size, qkv_width, M, kv_heads, L->v_cache, slots,
                          block_size);
            for (long t = 0; t < M; t++)
                for (long hh = 0; hh < heads; hh++)
                    memcpy(a + t * q_size + hh * head_dim, mix + t * qkv_width + hh * 2 * head_dim,
                           sizeof(float) * head_dim);
            anna_paged_decode_attention(a, L->k_cache, L->v_cache, L->kv_format, tables, table_width, ctx, M, heads,
                                        kv_heads, head_dim, block_size, 0, scale, b, threads);
            for (long t = 0; t < M; t++)
                for (long hh = 0; hh < heads; hh++) {
                    const float *gate = mix + t * qkv_width + hh * 2 * head_dim + head_dim;
                    float *o = b + t * q_size + hh * head_dim;
                    for (long j = 0; j < head_dim; j++) o[j] *= 1.0f / (1.0f + expf(-gate[j]));
                }
            linear(&L->o, b, h, M, threads);
        }
        anna_add_rmsnorm(residual, h, L->post_norm, 2, normed, M, hidden, eps, threads);
        linear(&L->gate_up, normed, gate_up, M, threads);
        anna_silu_mul(gate_up, act, M, intermediate, 0, threads);
        linear(&L->down, act, h, M, threads);
    }
    anna_add_rmsnorm(residual, h, final_norm, 2, out, M, hidden, eps, threads);
    free(residual); free(normed); free(h); free(mix); free(a); free(b); free(c); free(ba); free(gate_up); free(act);
    free(tmp);
}
