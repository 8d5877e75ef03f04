/* A prototype of causal prompt attention on AMX bf16 tiles, to measure what such a kernel would
 * gain over torch's SDPA on an AMX CPU before it is built into Anna's kernels. It reads Anna's
 * layout (q [T, H, D], k and v [T, KV, D], fp32, grouped-query heads) and writes fp32 [T, H, D],
 * so the fp32 <-> bf16 conversions around SDPA would go too. Limits: D = 64, a prompt over itself
 * (no cached prefix, no sliding window), AMX CPUs only. Driven by amx_attention_probe.py, which
 * builds it, checks it against fp64 and times it beside SDPA:
 *
 *   python benchmarks/amx_attention_probe.py
 *
 * Per task (one head, 16 query rows; the longest rows first), for each block of 64 keys up to
 * the diagonal: S = Q K^T on tiles (Q's two 32-wide steps of D against four 16-key tiles of K,
 * packed once per call in TDPBF16PS's pair layout), an online softmax in fp32 on AVX-512 (O
 * rescaled only where a row's maximum grew), P rounded to bf16, and P V on tiles (V packed in
 * pairs of keys, four 16-wide column tiles of D), added to O in fp32.
 *
 * Variants, to split the time: -DPROBE_FAST_EXP takes exp as a degree-4 polynomial (relative error
 * ~4e-5, far under bf16's rounding of P) instead of vec_math.h's exp16 (~2e-7); -DPROBE_TILES_ONLY
 * skips the softmax (P all zeros: wrong results, the tile work and the packing alone). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"
#include "vec_math.h"

#define DIM 64

#ifdef PROBE_FAST_EXP
static inline __m512 softmax_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
    __m512 p = _mm512_set1_ps(1.0f / 24);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#else
#define softmax_exp exp16
#endif
#define KEYS 64 /* keys per block */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Linux's permission for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0 = granted. */
int probe_request_amx(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

static inline __mmask16 visible(long first_key, long limit) {
    __m512i keys = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                    _mm512_set1_epi32((int)first_key));
    return _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32((int)limit));
}

void probe_amx_attention(const float *q, const float *k, const float *v, float *out, long T, long H, long KV,
                         float scale, int threads) {
    const long D = DIM, Tp = (T + KEYS - 1) / KEYS * KEYS, K16 = Tp / 16, K32 = Tp / 32;
    /* kp[g][16-key block][pair of D (32)][key (16)][2]; vp[g][32-key block][16 columns of D (4)][pair of keys (16)][column (16)][2] */
    uint16_t *kp = aligned_alloc(64, KV * Tp * D * 2), *vp = aligned_alloc(64, KV * Tp * D * 2);
    #pragma omp parallel for num_threads(threads) collapse(2)
    for (long g = 0; g < KV; g++)
        for (long b = 0; b < K16; b++)
            for (long r = 0; r < D / 2; r++)
                for (long n = 0; n < 32; n++) {
                    long key = b * 16 + n / 2;
                    kp[((g * K16 + b) * (D / 2) + r) * 32 + n] = key < T ? to_bf16(k[(key * KV + g) * D + 2 * r + n % 2]) : 0;
                }
    #pragma omp parallel for num_threads(threads) collapse(2)
    for (long g = 0; g < KV; g++)
        for (long b = 0; b < K32; b++)
            for (long c = 0; c < D / 16; c++)
                for (long r = 0; r < 16; r++)
                    for (long n = 0; n < 32; n++) {
                        long key = b * 32 + 2 * r + n % 2;
                        vp[(((g * K32 + b) * (D / 16) + c) * 16 + r) * 32 + n] = key < T ? to_bf16(v[(key * KV + g) * D + c * 16 + n / 2]) : 0;
                    }
    const long blocks16 = (T + 15) / 16, group = H / KV;
    #pragma omp parallel num_threads(threads)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 6; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        uint16_t qb[16 * DIM] __attribute__((aligned(64))), p[16 * KEYS] __attribute__((aligned(64)));
        float s[16 * KEYS] __attribute__((aligned(64))), pv[16 * DIM] __attribute__((aligned(64)));
        float o[16 * DIM] __attribute__((aligned(64))), m[16], l[16];
        #pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < H * blocks16; task++) {
            long h = task % H, g = h / group, q0 = (blocks16 - 1 - task / H) * 16;
            long rows = T - q0 < 16 ? T - q0 : 16;
            for (long i = 0; i < 16; i++) {
                for (long d = 0; d < D; d += 16)
                    store16_bf16(qb + i * D + d, i < rows ? _mm512_loadu_ps(q + ((q0 + i) * H + h) * D + d) : _mm512_setzero_ps());
                m[i] = -INFINITY;
                l[i] = 0.0f;
            }
            memset(o, 0, sizeof o);
            for (long kb = 0; kb <= (q0 + rows - 1) / KEYS; kb++) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int step = 0; step < 2; step++) {
                    _tile_loadd(4, qb + 32 * step, D * 2);
                    const uint16_t *kt = kp + ((g * K16 + 4 * kb) * (D / 2) + 16 * step) * 32;
                    _tile_loadd(5, kt, 64); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, kt + 1 * (D / 2) * 32, 64); _tile_dpbf16ps(1, 4, 5);
                    _tile_loadd(5, kt + 2 * (D / 2) * 32, 64); _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(5, kt + 3 * (D / 2) * 32, 64); _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, s, KEYS * 4); _tile_stored(1, s + 16, KEYS * 4);
                _tile_stored(2, s + 32, KEYS * 4); _tile_stored(3, s + 48, KEYS * 4);
#ifdef PROBE_TILES_ONLY
                memset(p, 0, sizeof p);
                for (long i = 0; i < 16; i++) l[i] = 1.0f;
#else
                for (long i = 0; i < 16; i++) {
                    long limit = q0 + i - kb * KEYS;  /* keys kb * KEYS + c with c <= limit are visible */
                    __m512 x[4];
                    for (int u = 0; u < 4; u++) {
                        x[u] = _mm512_mul_ps(_mm512_load_ps(s + i * KEYS + 16 * u), _mm512_set1_ps(scale));
                        if (limit < 16 * u + 15) x[u] = _mm512_mask_blend_ps(visible(16 * u, limit), _mm512_set1_ps(-INFINITY), x[u]);
                    }
                    float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
                    float alpha = 1.0f;
                    if (top > m[i]) {
                        alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - top);
                        m[i] = top;
                    }
                    __m512 sum = _mm512_setzero_ps();
                    for (int u = 0; u < 4; u++) {
                        __m512 e = softmax_exp(_mm512_sub_ps(x[u], _mm512_set1_ps(m[i])));
                        if (limit < 16 * u + 15) e = _mm512_maskz_mov_ps(visible(16 * u, limit), e);
                        sum = _mm512_add_ps(sum, e);
                        store16_bf16(p + i * KEYS + 16 * u, e);
                    }
                    l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
                    if (alpha != 1.0f)
                        for (long d = 0; d < D; d += 16)
                            _mm512_store_ps(o + i * D + d, _mm512_mul_ps(_mm512_load_ps(o + i * D + d), _mm512_set1_ps(alpha)));
                }
#endif
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int half = 0; half < 2; half++) {
                    _tile_loadd(4, p + 32 * half, KEYS * 2);
                    const uint16_t *vt = vp + ((g * K32 + 2 * kb + half) * (D / 16)) * 16 * 32;
                    _tile_loadd(5, vt, 64); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, vt + 1 * 16 * 32, 64); _tile_dpbf16ps(1, 4, 5);
                    _tile_loadd(5, vt + 2 * 16 * 32, 64); _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(5, vt + 3 * 16 * 32, 64); _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, pv, D * 4); _tile_stored(1, pv + 16, D * 4);
                _tile_stored(2, pv + 32, D * 4); _tile_stored(3, pv + 48, D * 4);
                for (long i = 0; i < 16 * D; i += 16) _mm512_store_ps(o + i, _mm512_add_ps(_mm512_load_ps(o + i), _mm512_load_ps(pv + i)));
            }
            for (long i = 0; i < rows; i++)
                for (long d = 0; d < D; d += 16)
                    _mm512_storeu_ps(out + ((q0 + i) * H + h) * D + d, _mm512_mul_ps(_mm512_load_ps(o + i * D + d), _mm512_set1_ps(1.0f / l[i])));
        }
        _tile_release();
    }
    free(kp);
    free(vp);
}
