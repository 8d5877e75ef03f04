/* Gated DeltaNet decode steps (model/gated_delta.py): one new token per sequence, each reading and
 * updating its own state slot in place, so a decode step moves each state through the cache once
 * instead of torch's gather, several elementwise passes and scatter.
 *
 * Conv: state [slots, K - 1, C] (time first), weight [K, C], out = silu(sum_j window[j] * w[j]).
 * Gated delta rule, per sequence and value head, S [Dk, Dv] fp32:
 *   S *= exp(g); err = v - S^T k; S += k (beta err)^T; out = S^T q
 * done as two sweeps over S: the first reads S^T k, the second updates S and accumulates S^T q.
 * All tensors are fp32 and contiguous; slots are int64. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

void anna_conv_step(const float *x, float *state, const int64_t *slots, long batch, long channels, long kernel,
                    const float *weight, float *out, int threads) {
    long hist = kernel - 1;
    #pragma omp parallel for num_threads(threads) collapse(2) schedule(static)
    for (long b = 0; b < batch; b++) {
        for (long c0 = 0; c0 < channels; c0 += 64) {
            long c1 = c0 + 64 < channels ? c0 + 64 : channels;
            float *s = state + slots[b] * hist * channels;
            const float *xb = x + b * channels;
            float *ob = out + b * channels;
            for (long c = c0; c < c1; c++) {
                float acc = xb[c] * weight[hist * channels + c];
                for (long j = 0; j < hist; j++)
                    acc += s[j * channels + c] * weight[j * channels + c];
                ob[c] = silu(acc);
            }
            for (long j = 0; j + 1 < hist; j++)  /* shift the window by one step */
                memcpy(s + j * channels + c0, s + (j + 1) * channels + c0, sizeof(float) * (c1 - c0));
            if (hist > 0)
                memcpy(s + (hist - 1) * channels + c0, xb + c0, sizeof(float) * (c1 - c0));
        }
    }
}

void anna_gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                           float *state, const int64_t *slots, long batch, long heads, long dk, long dv, float *out,
                           int threads) {
    #pragma omp parallel for num_threads(threads) collapse(2) schedule(static)
    for (long b = 0; b < batch; b++) {
        for (long h = 0; h < heads; h++) {
            float *s = state + (slots[b] * heads + h) * dk * dv;
            const float *qh = q + (b * heads + h) * dk, *kh = k + (b * heads + h) * dk;
            const float *vh = v + (b * heads + h) * dv;
            float *restrict oh = out + (b * heads + h) * dv;
            float decay = expf(g[b * heads + h]), bt = beta[b * heads + h];
            float err[dv];
            for (long j = 0; j < dv; j++) err[j] = 0.0f;
            for (long i = 0; i < dk; i++) {  /* err = (S^T k), still undecayed */
                float ki = kh[i];
                const float *row = s + i * dv;
                for (long j = 0; j < dv; j++) err[j] += row[j] * ki;
            }
            for (long j = 0; j < dv; j++) {
                err[j] = bt * (vh[j] - decay * err[j]);
                oh[j] = 0.0f;
            }
            for (long i = 0; i < dk; i++) {
                float ki = kh[i], qi = qh[i];
                float *restrict row = s + i * dv;
                for (long j = 0; j < dv; j++) {
                    float updated = decay * row[j] + ki * err[j];
                    row[j] = updated;
                    oh[j] += updated * qi;
                }
            }
        }
    }
}
