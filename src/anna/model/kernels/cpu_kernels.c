/* Weight-streaming matmuls for CPU decode: y[M,N] = x[M,K] . W[N,K]^T (+ bias), M small.
 *
 * Decode is bound by reading weights. torch's half-precision GEMM on CPUs without native
 * bf16/fp16 matrix instructions runs far below memory bandwidth and re-reads W once per row
 * of x. These kernels read each weight row once for all M rows of x, convert bf16/fp16 to
 * fp32 in registers (AVX2 + F16C), and split the output rows across threads.
 * x, bias and y are fp32; W is bf16 (wtype 0), fp16 (1) or fp32 (2). */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include <math.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))

/* Weight rows are streamed from DRAM; the hardware prefetcher alone keeps too few in flight,
 * so each loop prefetches the rows it will read next, one cache line (64 bytes) at a time. */
INLINE void prefetch_rows(const void *w, int wtype, long row, int nrows, long K, long k) {
    long esize = wtype == 2 ? 4 : 2;
    const char *base = (const char *)w + (row * K + k) * esize;
    for (int r = 0; r < nrows; r++) _mm_prefetch(base + r * K * esize, _MM_HINT_T0);
}

INLINE __m256 load8(const void *w, int wtype, long i) {
    if (wtype == 0) {
        __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    } else if (wtype == 1) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

INLINE float load1(const void *w, int wtype, long i) {
    if (wtype == 0) {
        uint32_t bits = ((uint32_t)((const uint16_t *)w)[i]) << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return f;
    } else if (wtype == 1) {
        return _cvtsh_ss(((const uint16_t *)w)[i]);
    }
    return ((const float *)w)[i];
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* M == 1: four weight rows at a time, four independent FMA chains. */
INLINE void gemv_rows(const float *x, const void *w, int wtype, const float *bias, float *y,
                      long n_begin, long n_end, long K) {
    long K8 = K & ~7L;
    long n = n_begin;
    for (; n + 4 <= n_end; n += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int ahead = n + 8 <= n_end;
        for (long k = 0; k < K8; k += 8) {
            __m256 xv = _mm256_loadu_ps(x + k);
            if (ahead && (k & 31) == 0) prefetch_rows(w, wtype, n + 4, 4, K, k);
            a0 = _mm256_fmadd_ps(load8(w, wtype, (n + 0) * K + k), xv, a0);
            a1 = _mm256_fmadd_ps(load8(w, wtype, (n + 1) * K + k), xv, a1);
            a2 = _mm256_fmadd_ps(load8(w, wtype, (n + 2) * K + k), xv, a2);
            a3 = _mm256_fmadd_ps(load8(w, wtype, (n + 3) * K + k), xv, a3);
        }
        float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
        for (long k = K8; k < K; k++)
            for (int r = 0; r < 4; r++) s[r] += load1(w, wtype, (n + r) * K + k) * x[k];
        for (int r = 0; r < 4; r++) y[n + r] = s[r] + (bias ? bias[n + r] : 0.0f);
    }
    for (; n < n_end; n++) {
        __m256 a = _mm256_setzero_ps();
        for (long k = 0; k < K8; k += 8) a = _mm256_fmadd_ps(load8(w, wtype, n * K + k), _mm256_loadu_ps(x + k), a);
        float s = hsum(a);
        for (long k = K8; k < K; k++) s += load1(w, wtype, n * K + k) * x[k];
        y[n] = s + (bias ? bias[n] : 0.0f);
    }
}

/* 2 <= M <= 8: one weight row at a time, used for every row of x. One function per M so
 * that the accumulators live in registers. */
#define DEFINE_GEMM_ROWS(MM)                                                                          \
    INLINE void gemm_rows_##MM(const float *x, const void *w, int wtype, const float *bias, float *y, \
                               long N, long n_begin, long n_end, long K) {                            \
        long K8 = K & ~7L;                                                                            \
        for (long n = n_begin; n < n_end; n++) {                                                      \
            __m256 acc[MM];                                                                           \
            for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                               \
            for (long k = 0; k < K8; k += 8) {                                                        \
                                 \
                __m256 wv = load8(w, wtype, n * K + k);                                              \
                for (int m = 0; m < MM; m++)                                                          \
                    acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);            \
            }                                                                                         \
            for (int m = 0; m < MM; m++) {                                                            \
                float s = hsum(acc[m]);                                                               \
                for (long k = K8; k < K; k++) s += load1(w, wtype, n * K + k) * x[m * K + k];        \
                y[m * N + n] = s + (bias ? bias[n] : 0.0f);                                          \
            }                                                                                         \
        }                                                                                             \
    }
DEFINE_GEMM_ROWS(2)
DEFINE_GEMM_ROWS(3)
DEFINE_GEMM_ROWS(4)

/* M >= 4: tiles of 3 weight rows x 4 rows of x, twelve accumulators in registers. Each 3-row
 * slice of W stays in L1 while every group of 4 x rows passes over it, so W is read from memory
 * once however large M is; per 8 columns the tile does 12 FMAs for 7 loads. */
/* One 3-row slice of W (rows r0..r0+2 of src, in src's type st) against every group of 4 rows
 * of x; y rows n..n+2. */
INLINE void tile_block(const float *x, const void *src, int st, long r0, const void *w, int wtype, const float *bias,
                       float *y, int M4, long N, long n, long K) {
    long K8 = K & ~7L;
    for (int m = 0; m < M4; m += 4) {
        __m256 acc[3][4];
        for (int r = 0; r < 3; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
        for (long k = 0; k < K8; k += 8) {
            __m256 w0 = load8(src, st, (r0 + 0) * K + k);
            __m256 w1 = load8(src, st, (r0 + 1) * K + k);
            __m256 w2 = load8(src, st, (r0 + 2) * K + k);
            for (int j = 0; j < 4; j++) {
                __m256 xv = _mm256_loadu_ps(x + (m + j) * K + k);
                acc[0][j] = _mm256_fmadd_ps(w0, xv, acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(w1, xv, acc[1][j]);
                acc[2][j] = _mm256_fmadd_ps(w2, xv, acc[2][j]);
            }
        }
        for (int r = 0; r < 3; r++)
            for (int j = 0; j < 4; j++) {
                float s = hsum(acc[r][j]);
                for (long k = K8; k < K; k++) s += load1(w, wtype, (n + r) * K + k) * x[(m + j) * K + k];
                y[(m + j) * N + n + r] = s + (bias ? bias[n + r] : 0.0f);
            }
    }
}

/* M >= 4: tiles of 3 weight rows x 4 rows of x, twelve accumulators in registers. Each 3-row
 * slice of W stays in L1 while every group of 4 x rows passes over it, so W is read from memory
 * once however large M is; per 8 columns the tile does 12 FMAs for 7 loads. With several groups
 * of x rows, half-precision slices are converted to fp32 once instead of once per group. */
INLINE void gemm_tiles(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N,
                       long n_begin, long n_end, long K) {
    long K8 = K & ~7L;
    int M4 = M & ~3;
    long n = n_begin;
    float *wf = (wtype != 2 && M4 >= 8) ? (float *)malloc(sizeof(float) * 3 * K) : 0;
    for (; n + 3 <= n_end; n += 3) {
        if (wf) {
            for (int r = 0; r < 3; r++)
                for (long k = 0; k < K8; k += 8) _mm256_storeu_ps(wf + r * K + k, load8(w, wtype, (n + r) * K + k));
            tile_block(x, wf, 2, 0, w, wtype, bias, y, M4, N, n, K);
        } else {
            tile_block(x, w, wtype, n, w, wtype, bias, y, M4, N, n, K);
        }
    }
    free(wf);
    /* leftovers: the last rows of W for all of x, and the last M % 4 rows of x */
    if (n < n_end) {
        for (int m = 0; m < M4; m += 4) gemm_rows_4(x + (long)m * K, w, wtype, bias, y + (long)m * N, N, n, n_end, K);
    }
    if (M4 < M) {
        int rest = M - M4;
        const float *xr = x + (long)M4 * K;
        float *yr = y + (long)M4 * N;
        if (rest == 1) gemv_rows(xr, w, wtype, bias, yr, n_begin, n_end, K);
        else if (rest == 2) gemm_rows_2(xr, w, wtype, bias, yr, N, n_begin, n_end, K);
        else gemm_rows_3(xr, w, wtype, bias, yr, N, n_begin, n_end, K);
    }
}

/* wtype is a literal at each call of run_rows, so every row loop is compiled once per weight type. */
INLINE void run_rows(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N,
                     long b, long e, long K) {
    if (M == 1) gemv_rows(x, w, wtype, bias, y, b, e, K);
    else if (M == 2) gemm_rows_2(x, w, wtype, bias, y, N, b, e, K);
    else if (M == 3) gemm_rows_3(x, w, wtype, bias, y, N, b, e, K);
    else gemm_tiles(x, w, wtype, bias, y, M, N, b, e, K);
}

void anna_gemv(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N, long K,
               int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long chunk = ((N + nt - 1) / nt + 11) / 12 * 12;  /* multiple of the 4-row and 3-row blocks */
        long b = t * chunk, e = b + chunk < N ? b + chunk : N;
        if (b < e) {
            if (wtype == 0) run_rows(x, w, 0, bias, y, M, N, b, e, K);
            else if (wtype == 1) run_rows(x, w, 1, bias, y, M, N, b, e, K);
            else run_rows(x, w, 2, bias, y, M, N, b, e, K);
        }
    }
}

/* ---- fused elementwise kernels for decode: one call instead of a chain of small torch ops ---- */

/* x += delta (when given), then out = rmsnorm(x) * w, row by row. x, delta, out fp32. */
void anna_add_rmsnorm(float *x, const float *delta, const void *w, int wtype, float *out, long rows, long dim,
                      float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        if (delta) {
            const float *dr = delta + r * dim;
            for (long i = 0; i < dim; i++) xr[i] += dr[i];
        }
        double ss = 0.0;
        for (long i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        float *orow = out + r * dim;
        for (long i = 0; i < dim; i++) orow[i] = load1(w, wtype, i) * (xr[i] * inv);
    }
}

/* Neox-style rotary embedding, in place, on `heads` heads of size dim per token row. */
void anna_rotary(float *x, long row_stride, long tokens, long heads, long dim, const float *cos_table,
                 const float *sin_table, const long *positions) {
    long half = dim / 2;
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (long h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * dim;
            for (long i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

INLINE float dot(const float *a, const float *b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Decode attention over a paged fp32 KV cache: one query token per sequence.
 * q, out: [seqs, heads, dim]; caches: [blocks, block_size, kv_heads, dim];
 * tables: [seqs, table_width] block ids; ctx: tokens of each sequence (the new one included);
 * window > 0 limits attention to the last `window` tokens. One job per (sequence, kv head): each
 * cached key and value row is read once for all the query heads that share it (GQA). */
void anna_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const long *tables,
                                 long table_width, const long *ctx, long seqs, long heads, long kv_heads, long dim,
                                 long block_size, long window, float scale, float *out, int threads) {
    long group = heads / kv_heads;
    long kv_row = kv_heads * dim;
    #pragma omp parallel num_threads(threads)
    {
        long cap = 0;
        float *scores = 0;
        float *mx = (float *)malloc(sizeof(float) * group), *inv = (float *)malloc(sizeof(float) * group);
        #pragma omp for schedule(dynamic, 1)
        for (long job = 0; job < seqs * kv_heads; job++) {
            long sq = job / kv_heads, kvh = job % kv_heads;
            long n = ctx[sq], start = (window > 0 && n > window) ? n - window : 0, len = n - start;
            if (group * len > cap) {
                free(scores);
                cap = group * len;
                scores = (float *)malloc(sizeof(float) * cap);
            }
            const float *qv = q + (sq * heads + kvh * group) * dim;  /* the group's query heads, consecutive */
            const long *table = tables + sq * table_width;
            for (long g = 0; g < group; g++) mx[g] = -INFINITY;
            for (long p = start; p < n; p++) {
                const float *kv = k_cache + (table[p / block_size] * block_size + p % block_size) * kv_row + kvh * dim;
                for (long g = 0; g < group; g++) {
                    float sc = dot(qv + g * dim, kv, dim) * scale;
                    scores[g * len + p - start] = sc;
                    if (sc > mx[g]) mx[g] = sc;
                }
            }
            for (long g = 0; g < group; g++) {
                float sum = 0.0f, *sg = scores + g * len;
                for (long i = 0; i < len; i++) {
                    sg[i] = expf(sg[i] - mx[g]);
                    sum += sg[i];
                }
                inv[g] = 1.0f / sum;
            }
            float *o = out + (sq * heads + kvh * group) * dim;
            for (long i = 0; i < group * dim; i++) o[i] = 0.0f;
            for (long p = start; p < n; p++) {
                const float *vv = v_cache + (table[p / block_size] * block_size + p % block_size) * kv_row + kvh * dim;
                for (long g = 0; g < group; g++) {
                    float wgt = scores[g * len + p - start] * inv[g];
                    float *og = o + g * dim;
                    long i = 0;
                    __m256 wv = _mm256_set1_ps(wgt);
                    for (; i + 8 <= dim; i += 8)
                        _mm256_storeu_ps(og + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(vv + i), _mm256_loadu_ps(og + i)));
                    for (; i < dim; i++) og[i] += wgt * vv[i];
                }
            }
        }
        free(scores);
        free(mx);
        free(inv);
    }
}
