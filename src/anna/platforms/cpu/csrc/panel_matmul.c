/* Large-M matmuls of float weights on AVX2 FMA, reading the weights in the kernels' interleaved
 * layout (cpu_kernels.c) as they are stored: the prefill path of CPUs without bf16 arithmetic.
 *
 * y[M, N] = x[M, K] W^T (+ bias), x and y fp32 row-major, W bf16, fp16 or fp32 [N, K] in blocks of
 * 4 interleaved rows (the last N % 4 rows row-major). Without this kernel a large M went to the
 * weight-streaming kernel, whose dot products end in a horizontal sum per output and which reads
 * every row of x once per block of 4 weight rows, or to torch's fp32 GEMM on a row-major fp32 copy
 * of W made for every call.
 *
 * This is a GEMM in the usual register blocking: a microkernel keeps a 6 x 16 block of y in 12
 * registers, and for each column k of a chunk of K multiplies 6 broadcast values of x (6 rows) by
 * 16 weights (two vectors: 16 weight rows at column k), 12 FMAs per 2 loads of W and 6 of x, with
 * no horizontal sums. The 16 weight rows of a panel are widened to fp32 and transposed once per
 * call into [K][16] (pack_panel), so that each vector is one aligned load; a thread packs a group
 * of panels (PACK_BYTES), then runs every block of x rows (X_BLOCK_BYTES, in L2) over each of them.
 * K goes in chunks of at most KC_MAX columns (a panel's chunk stays in L2), the sums parked in y
 * between chunks.
 *
 * The gated MLP's first matmul (anna_panel_gated_act) pairs gate rows j .. j + 7 with up rows
 * I + j .. in a panel, so that the microkernel's two vectors are the same 8 columns of gate and up,
 * and writes silu(gate) * up (anna_silu_mul's operations) instead of the [M, 2I] rows.
 *
 * Products and sums are fp32, as in an fp32 GEMM of the same weight values: the result differs from
 * torch's by summation order only. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "thread_buffer.h"
#include "vec_math.h"
#include "weight_types.h"

#ifndef __AVX512F__

#define PACK_ROWS 4                /* cpu_kernels.c's interleaved blocks */
#define PANEL_ROWS 16              /* weight rows per panel: two vectors */
#define MR 6                       /* rows of x per microkernel call */
#define KC_MAX 2048                /* columns of K per chunk: a panel's chunk is at most 128 KB */
#define X_BLOCK_BYTES (192 << 10)  /* a block of x rows (one chunk of K) that stays in L2 */
#define PACK_BYTES (2 << 20)       /* a thread's packed panels per group */

/* What one call computes: y = x W^T (+ bias) (gated = 0; panel p: rows 16p .. 16p + 15), or act =
 * silu(gate) * up of [gate | up] = x W^T (+ bias) (gated = 1, W [2I, K]; panel p: gate rows 8p ..
 * 8p + 7 and up rows I + 8p ..). N: y's columns (gated: I). */
typedef struct {
    const float *x, *bias;
    const void *w;
    int wtype;
    float *y;
    long M, N, K;
    int gated;
} panel_job;

INLINE long panel_count(const panel_job *job) {
    return job->gated ? (job->N + 7) / 8 : (job->N + PANEL_ROWS - 1) / PANEL_ROWS;
}

/* Panel p's 16 weight rows, columns [k0, k0 + kc), widened to fp32 into out[k][16]: four groups
 * of 4 rows (plain: rows 16p ..; gated: gate rows 8p .. 8p + 7, then up rows I + 8p ..), each a
 * whole interleaved block where it can be, or rows of the row-major tail, or zero past the end.
 * The groups go column by column, so that each 64-byte line of out is written whole at once
 * (group by group over all of K, four passes each wrote a quarter of every line, at 2.4 cycles a
 * weight where a pass that fills lines runs several times faster). */
static void pack_panel(const panel_job *job, long p, long k0, long kc, float *out) {
    const long K = job->K, rows = job->gated ? 2 * job->N : job->N, full = rows / PACK_ROWS * PACK_ROWS;
    long first[4], end[4];  /* group g: rows first[g] .., those before end[g] real */
    for (int g = 0; g < 4; g++) {
        first[g] = job->gated ? (g < 2 ? 0 : job->N) + 8 * p + 4 * (g & 1) : PANEL_ROWS * p + 4 * g;
        end[g] = job->gated ? (g < 2 ? job->N : rows) : rows;
    }
    for (long k = k0; k < k0 + kc; k += 8) {
        float *ok = out + (k - k0) * PANEL_ROWS;
        for (int g = 0; g < 4; g++) {
            if (first[g] + PACK_ROWS <= full && first[g] + PACK_ROWS <= end[g]) {
                /* 8 columns of the block's 4 rows -> 8 columns x 4 rows: u_j holds columns j and j + 4 */
                const long at = first[g] * K + k * PACK_ROWS;
                __m256 r0 = load8(job->w, job->wtype, at), r1 = load8(job->w, job->wtype, at + 8);
                __m256 r2 = load8(job->w, job->wtype, at + 16), r3 = load8(job->w, job->wtype, at + 24);
                __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                               _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
                for (int j = 0; j < 4; j++) {
                    _mm_store_ps(ok + j * PANEL_ROWS + 4 * g, _mm256_castps256_ps128(u[j]));
                    _mm_store_ps(ok + (j + 4) * PANEL_ROWS + 4 * g, _mm256_extractf128_ps(u[j], 1));
                }
            } else {  /* the row-major tail rows, and zero rows past the end */
                for (int r = 0; r < PACK_ROWS; r++) {
                    const long i = first[g] + r;
                    for (int c = 0; c < 8; c++)
                        ok[c * PANEL_ROWS + 4 * g + r] = i < end[g] ? load1(job->w, job->wtype, i * K + k + c) : 0.0f;
                }
            }
        }
    }
}

/* All ones in lanes [0, valid) */
INLINE __m256i lanes_below(long valid) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Lanes [0, valid) of v to y (8 lanes when valid >= 8) */
INLINE void store_cols(float *y, __m256 v, long valid) {
    if (valid >= 8) _mm256_storeu_ps(y, v);
    else if (valid > 0) _mm256_maskstore_ps(y, lanes_below(valid), v);
}

/* Lanes [0, valid) of y, zero above */
INLINE __m256 load_cols(const float *y, long valid) {
    return valid >= 8 ? _mm256_loadu_ps(y) : _mm256_maskload_ps(y, lanes_below(valid));
}

INLINE __m256 bias_cols(const float *bias, long at, long valid) {
    return bias ? load_cols(bias + at, valid) : _mm256_setzero_ps();
}

/* Rows m .. m + R - 1 of x against panel p (packed: b, columns k0 .. k0 + kc): the 6 x 16 block of
 * sums starts at zero (the first chunk) or at what y holds, and is stored back raw, or finished
 * (bias; gated: the activation) after the last chunk. */
#define DEFINE_MICRO(R)                                                                                      \
    static void micro_##R(const panel_job *job, const float *b, long p, long m, long k0, long kc) {          \
        const long K = job->K, N = job->N;                                                                   \
        const int first = k0 == 0, last = k0 + kc == K;                                                      \
        const float *x = job->x + m * K + k0;                                                                \
        /* the panel's output columns: y[., c0 .. c0 + 16) (gated: act[., c0 .. c0 + 8)) */                 \
        const long c0 = job->gated ? 8 * p : PANEL_ROWS * p;                                                 \
        const long v0 = N - c0, v1 = N - c0 - 8; /* valid lanes of each vector (gated: v0 for both) */       \
        __m256 a0[R], a1[R];                                                                                 \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                \
            if (first) { /* (always, gated: its K is one chunk) */                                           \
                a0[r] = _mm256_setzero_ps();                                                                 \
                a1[r] = _mm256_setzero_ps();                                                                 \
            } else {                                                                                         \
                a0[r] = load_cols(job->y + (m + r) * N + c0, v0);                                            \
                a1[r] = load_cols(job->y + (m + r) * N + c0 + 8, v1);                                        \
            }                                                                                                \
        }                                                                                                    \
        for (long k = 0; k < kc; k++) {                                                                      \
            __m256 w0 = _mm256_load_ps(b + k * PANEL_ROWS), w1 = _mm256_load_ps(b + k * PANEL_ROWS + 8);      \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                            \
                __m256 xv = _mm256_broadcast_ss(x + r * K + k);                                              \
                a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);                                                      \
                a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);                                                      \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                \
            float *yr = job->y + (m + r) * N + c0;                                                           \
            if (!last) {                                                                                     \
                store_cols(yr, a0[r], v0);                                                                   \
                store_cols(yr + 8, a1[r], v1);                                                               \
            } else if (job->gated) {                                                                         \
                __m256 g = _mm256_add_ps(a0[r], bias_cols(job->bias, c0, v0));                               \
                __m256 u = _mm256_add_ps(a1[r], bias_cols(job->bias, N + c0, v0));                           \
                __m256 sig = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))); \
                store_cols(yr, _mm256_mul_ps(sig, u), v0);                                                   \
            } else {                                                                                         \
                store_cols(yr, _mm256_add_ps(a0[r], bias_cols(job->bias, c0, v0)), v0);                      \
                store_cols(yr + 8, _mm256_add_ps(a1[r], bias_cols(job->bias, c0 + 8, v1)), v1);              \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_MICRO(1)
DEFINE_MICRO(2)
DEFINE_MICRO(3)
DEFINE_MICRO(4)
DEFINE_MICRO(5)
DEFINE_MICRO(6)

/* One thread's part: rows [m0, m1) of x against panels [p0, p1). */
static void run_panels(const panel_job *job, long m0, long m1, long p0, long p1) {
    const long K = job->K;
    const long chunks = (K + KC_MAX - 1) / KC_MAX;
    const long kc_max = (K / chunks + 7) / 8 * 8;
    long per_group = PACK_BYTES / (kc_max * PANEL_ROWS * 4);
    if (per_group < 1) per_group = 1;
    if (per_group > p1 - p0) per_group = p1 - p0;
    long x_block = X_BLOCK_BYTES / (kc_max * 4) / MR * MR;
    if (x_block < MR) x_block = MR;
    float *packed = (float *)thread_buffer(0, per_group * kc_max * PANEL_ROWS * sizeof(float));
    for (long k0 = 0; k0 < K; k0 += kc_max) {
        const long kc = K - k0 < kc_max ? K - k0 : kc_max;
        for (long g0 = p0; g0 < p1; g0 += per_group) {
            const long g1 = g0 + per_group < p1 ? g0 + per_group : p1;
            for (long p = g0; p < g1; p++) pack_panel(job, p, k0, kc, packed + (p - g0) * kc * PANEL_ROWS);
            for (long mb = m0; mb < m1; mb += x_block) {
                const long me = mb + x_block < m1 ? mb + x_block : m1;
                for (long p = g0; p < g1; p++) {
                    const float *b = packed + (p - g0) * kc * PANEL_ROWS;
                    for (long m = mb; m < me; m += MR) {
                        switch (me - m < MR ? me - m : MR) {
                        case 1: micro_1(job, b, p, m, k0, kc); break;
                        case 2: micro_2(job, b, p, m, k0, kc); break;
                        case 3: micro_3(job, b, p, m, k0, kc); break;
                        case 4: micro_4(job, b, p, m, k0, kc); break;
                        case 5: micro_5(job, b, p, m, k0, kc); break;
                        default: micro_6(job, b, p, m, k0, kc); break;
                        }
                    }
                }
            }
        }
    }
}

/* The thread's share: a share of the panels for all rows of x where there are panels enough for
 * every thread to keep several, else a share of the rows for all panels. */
static void run_job(const panel_job *job, int threads) {
    const long panels = panel_count(job);
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long m0 = 0, m1 = job->M, p0 = 0, p1 = panels;
        if (panels >= 4L * nt) {
            const long per = (panels + nt - 1) / nt;
            p0 = t * per < panels ? t * per : panels;
            p1 = p0 + per < panels ? p0 + per : panels;
        } else {
            long per = (job->M + nt - 1) / nt;
            per = (per + MR - 1) / MR * MR;
            m0 = t * per < job->M ? t * per : job->M;
            m1 = m0 + per < job->M ? m0 + per : job->M;
        }
        if (m0 < m1 && p0 < p1) run_panels(job, m0, m1, p0, p1);
    }
}

/* y[M, N] = x W^T (+ bias): x fp32 [M, K], W interleaved [N, K] of type wtype (K a multiple of 8),
 * y fp32. */
void anna_panel_matmul(const float *x, const void *w, int wtype, const float *bias, float *y, long M, long N, long K,
                       int threads) {
    const panel_job job = {x, bias, w, wtype, y, M, N, K, 0};
    run_job(&job, threads);
}

/* act[M, I] = silu(gate) * up with [gate | up] = x W^T (+ bias), W interleaved [2I, K] of type
 * wtype: I a multiple of 4 (gate and up rows in whole blocks), K a multiple of 8 and at most
 * KC_MAX (the activation needs each sum whole). */
void anna_panel_gated_act(const float *x, const void *w, int wtype, const float *bias, float *act, long M, long I,
                          long K, int threads) {
    const panel_job job = {x, bias, w, wtype, act, M, I, K, 1};
    run_job(&job, threads);
}

int anna_panel_kc_max(void) { return KC_MAX; }

#endif
