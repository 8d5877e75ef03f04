/* Gated DeltaNet decode steps (model/gated_delta.py): one new token per sequence, each reading and
 * updating its own state slot in place, so a decode step moves each state through the cache once
 * instead of torch's gather, several elementwise passes and scatter.
 *
 * Conv: state [slots, K - 1, C] (time first), weight [K, C], out = silu(sum_j window[j] * w[j]).
 * Gated delta rule, per sequence and value head, S [Dk, Dv] fp32:
 *   S *= exp(g); err = v - S^T k; S += k (beta err)^T; out = S^T q
 * done as two sweeps over S: the first reads S^T k, the second updates S and accumulates S^T q;
 * anna_gated_delta_decode also does the gates before it and the gated norm after it.
 * All tensors are fp32 and contiguous unless said; slots are int64. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* Rows are taken in order within each block of channels (the blocks run in parallel), so a row
 * may continue the state the row before it wrote: row b reads the state in src_slots[b] (NULL:
 * slots[b]) and writes its result to slots[b], without a copy in between. Speculative decoding verifies a sequence's proposed
 * tokens as such a chain, each token's state kept in a slot of its own. */
void anna_conv_step(const float *x, float *state, const int64_t *slots, const int64_t *src_slots, long batch,
                    long channels, long kernel, const float *weight, float *out, int threads) {
    long hist = kernel - 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long c0 = 0; c0 < channels; c0 += 64) {
        long c1 = c0 + 64 < channels ? c0 + 64 : channels;
        for (long b = 0; b < batch; b++) {
            float *s = state + slots[b] * hist * channels;
            const float *in = src_slots ? state + src_slots[b] * hist * channels : s;
            const float *xb = x + b * channels;
            float *ob = out + b * channels;
            for (long c = c0; c < c1; c++) {
                float acc = xb[c] * weight[hist * channels + c];
                for (long j = 0; j < hist; j++)
                    acc += in[j * channels + c] * weight[j * channels + c];
                ob[c] = silu(acc);
            }
            for (long j = 0; j + 1 < hist; j++)  /* the window one step on (memmove: in may be s) */
                memmove(s + j * channels + c0, in + (j + 1) * channels + c0, sizeof(float) * (c1 - c0));
            if (hist > 0)
                memcpy(s + (hist - 1) * channels + c0, xb + c0, sizeof(float) * (c1 - c0));
        }
    }
}

static inline float load_weight(const void *w, int wtype, long i) {
    if (wtype == 2) return ((const float *)w)[i];
    uint16_t bits = ((const uint16_t *)w)[i];
    if (wtype == 0) {
        uint32_t u = (uint32_t)bits << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return _cvtsh_ss(bits);
}

static inline float l2_inverse(const float *x, long n) {
    float sum = 0.0f;
    for (long i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum + 1e-6f);
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* The rest of a Gated DeltaNet layer's decode after its conv, per sequence and value head:
 * q, k (of the key head serving it) L2-normalised, q scaled by dk^-1/2; beta = sigmoid(b),
 * g = -exp(A_log) * softplus(a + dt_bias); the delta rule on the state slot, in place; then the
 * output's RMSNorm times the norm weight times silu(z).
 * conved [B, 2 * key_heads * dk + heads * dv] (q | k | v), z [B, heads * dv], ba [B, 2 * heads]
 * (b | a), state [slots, heads, dk, dv], out [B, heads * dv]. */
void anna_gated_delta_decode(const float *conved, const float *z, const float *ba, float *state,
                             const int64_t *slots, const int64_t *src_slots, const float *a_log, const float *dt_bias,
                             const void *norm_weight, int norm_wtype, float eps, long batch, long key_heads,
                             long heads, long dk, long dv, float *out, int threads) {
    long channels = 2 * key_heads * dk + heads * dv, repeat = heads / key_heads;
    float q_scale = 1.0f / sqrtf((float)dk);
    /* heads in parallel, rows in order within a head: a row may continue the row before it (see
     * anna_conv_step) */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long h = 0; h < heads; h++) {
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush denormals here: decayed states would crawl through them */
        for (long b = 0; b < batch; b++) {
            const float *row = conved + b * channels;
            const float *kq = row + (h / repeat) * dk, *kk = row + key_heads * dk + (h / repeat) * dk;
            const float *vh = row + 2 * key_heads * dk + h * dv;
            float qh[dk], kh[dk], err[dv];
            float qn = l2_inverse(kq, dk) * q_scale, kn = l2_inverse(kk, dk);
            for (long i = 0; i < dk; i++) { qh[i] = kq[i] * qn; kh[i] = kk[i] * kn; }
            float bt = 1.0f / (1.0f + expf(-ba[b * 2 * heads + h]));
            float decay = expf(-expf(a_log[h]) * softplus(ba[b * 2 * heads + heads + h] + dt_bias[h]));
            float *s = state + (slots[b] * heads + h) * dk * dv;  /* written; read from `in` (may be s) */
            const float *in = src_slots ? state + (src_slots[b] * heads + h) * dk * dv : s;
            float *restrict oh = out + b * heads * dv + h * dv;
            for (long j = 0; j < dv; j++) err[j] = 0.0f;
            for (long i = 0; i < dk; i++) {  /* err = (S^T k), still undecayed */
                float ki = kh[i];
                const float *srow = in + i * dv;
                for (long j = 0; j < dv; j++) err[j] += srow[j] * ki;
            }
            for (long j = 0; j < dv; j++) {
                err[j] = bt * (vh[j] - decay * err[j]);
                oh[j] = 0.0f;
            }
            for (long i = 0; i < dk; i++) {
                float ki = kh[i], qi = qh[i];
                const float *srow = in + i * dv;
                float *orow = s + i * dv;
                for (long j = 0; j < dv; j++) {
                    float updated = decay * srow[j] + ki * err[j];
                    orow[j] = updated;
                    oh[j] += updated * qi;
                }
            }
            float var = 0.0f;
            for (long j = 0; j < dv; j++) var += oh[j] * oh[j];
            float inv = 1.0f / sqrtf(var / (float)dv + eps);
            const float *zh = z + b * heads * dv + h * dv;
            for (long j = 0; j < dv; j++)
                oh[j] = oh[j] * inv * load_weight(norm_weight, norm_wtype, j) * silu(zh[j]);
        }
        _mm_setcsr(csr);  /* (the caller's thread keeps its own floating-point mode) */
    }
}
