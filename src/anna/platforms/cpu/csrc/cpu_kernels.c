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

#include "bf16.h"
#include "kv_format.h"
#include "work_split.h"

#define INLINE static inline __attribute__((always_inline))

/* Weight layout ("interleaved rows"): the kernels read W as blocks of PACK_ROWS consecutive rows; in a
 * block, columns come in chunks of 8, and each chunk holds those 8 columns of row 0, then of row
 * 1, 2, 3. A block is one contiguous stream of 4 * K values, which keeps the memory system busier
 * than four separate rows when rows are short (K = 896: 1,792 bytes), and each step of the kernels
 * reads one 64-byte line of bf16 weights. The last N % 4 rows, if any, follow row-major.
 * Python packs a weight once, after loading (linear.py: interleave_rows). K must be a multiple of 8. */
#define PACK_ROWS 4
#define PREFETCH_BYTES 1024  /* how far ahead of the current weight line to prefetch */

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

/* One block (4 rows of W, in type st, starting at blk) against MM rows of x (K apart):
 * y[m * N + n + r] for r < 4, m < MM. 4 x MM accumulators stay in registers; `prefetch` asks for
 * the weight lines PREFETCH_BYTES ahead (streaming from memory, not re-reading a block in L1). */
#define DEFINE_BLOCK(MM)                                                                                     \
    INLINE void block_##MM(const float *x, const void *blk, int st, const float *bias, float *y, long N,       \
                           long n, long K, int prefetch) {                                                   \
        __m256 acc[PACK_ROWS][MM];                                                                           \
        for (int r = 0; r < PACK_ROWS; r++)                                                                  \
            for (int m = 0; m < MM; m++) acc[r][m] = _mm256_setzero_ps();                                    \
        long esize = st == 2 ? 4 : 2;                                                                        \
        for (long k = 0; k < K; k += 8) {                                                                    \
            long off = k * PACK_ROWS;                                                                        \
            if (prefetch) _mm_prefetch((const char *)blk + off * esize + PREFETCH_BYTES, _MM_HINT_T0);      \
            __m256 xv[MM];                                                                                   \
            for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(x + m * K + k);                            \
            for (int r = 0; r < PACK_ROWS; r++) {                                                            \
                __m256 wv = load8(blk, st, off + r * 8);                                                     \
                for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);             \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < PACK_ROWS; r++)                                                                  \
            for (int m = 0; m < MM; m++) y[m * N + n + r] = hsum(acc[r][m]) + (bias ? bias[n + r] : 0.0f);   \
    }
DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)

/* Rows [b, e) of W (b, e multiples of 4) for all M rows of x. With two or more groups of 3 rows of
 * x, each half-precision block is converted to fp32 once (into L1/L2) and reused by every group;
 * groups of 3 x rows keep 12 accumulators + 3 x vectors + 1 weight vector in the 16 registers. */
INLINE void run_blocks(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N,
                       long b, long e, long K) {
    float *wf = (wtype != 2 && M >= 6) ? (float *)aligned_alloc(32, sizeof(float) * PACK_ROWS * K) : 0;
    for (long n = b; n < e; n += PACK_ROWS) {
        const void *blk = (const char *)w + n * K * (wtype == 2 ? 4 : 2);
        const void *src = blk;
        int st = wtype;
        if (wf) {
            for (long i = 0; i < PACK_ROWS * K; i += 8) {
                if ((i & 31) == 0) _mm_prefetch((const char *)blk + i * 2 + PREFETCH_BYTES, _MM_HINT_T0);
                _mm256_store_ps(wf + i, load8(blk, wtype, i));
            }
            src = wf;
            st = 2;
        }
        int pf = !wf, m = 0;
        /* groups of 3 rows of x, then of 2: a lone last row would do 4 FMAs per 5 loads */
        int threes = (M % 3 == 1 && M >= 4) ? M / 3 - 1 : M / 3;
        for (int g = 0; g < threes; g++, m += 3)
            block_3(x + (long)m * K, src, st, bias, y + (long)m * N, N, n, K, pf && m == 0);
        for (; m + 2 <= M; m += 2) block_2(x + (long)m * K, src, st, bias, y + (long)m * N, N, n, K, pf && m == 0);
        if (m < M) block_1(x + (long)m * K, src, st, bias, y + (long)m * N, N, n, K, pf && m == 0);
    }
    free(wf);
}

#ifdef __AVX512F__
/* The avx512 levels' build (kernels.py: LEVEL_CFLAGS): the same blocks of 4 interleaved rows, 16
 * columns of a row per 512-bit vector (its two runs of 8, 32 values apart), 32 registers, so up
 * to 6 rows of x share each weight vector (24 accumulators). K must be a multiple of 16. */
#define X_ROWS16 6

INLINE __m512 load16(const void *blk, int st, long off, int r) {
    if (st == 3) return _mm512_load_ps((const float *)blk + off + r * 16);  /* the converted block below */
    if (st == 2) {
        const float *f = (const float *)blk + off + r * 8;
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(f)), _mm256_loadu_ps(f + 32), 1);
    }
    const uint16_t *h = (const uint16_t *)blk + off + r * 8;
    __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)h)),
                                           _mm_loadu_si128((const __m128i *)(h + 32)), 1);
    if (st == 1) return _mm512_cvtph_ps(both);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
}

#define DEFINE_BLOCK16(MM)                                                                                   \
    INLINE void block16_##MM(const float *x, const void *blk, int st, const float *bias, float *y, long N,    \
                             long n, long K, int prefetch) {                                                 \
        __m512 acc[PACK_ROWS][MM];                                                                           \
        for (int r = 0; r < PACK_ROWS; r++)                                                                  \
            for (int m = 0; m < MM; m++) acc[r][m] = _mm512_setzero_ps();                                    \
        long esize = st >= 2 ? 4 : 2;                                                                        \
        for (long k = 0; k < K; k += 16) {                                                                   \
            long off = k * PACK_ROWS;                                                                        \
            if (prefetch) {                                                                                  \
                _mm_prefetch((const char *)blk + off * esize + PREFETCH_BYTES, _MM_HINT_T0);                \
                _mm_prefetch((const char *)blk + off * esize + PREFETCH_BYTES + 64, _MM_HINT_T0);           \
            }                                                                                                \
            __m512 xv[MM];                                                                                   \
            for (int m = 0; m < MM; m++) xv[m] = _mm512_loadu_ps(x + m * K + k);                            \
            for (int r = 0; r < PACK_ROWS; r++) {                                                            \
                __m512 wv = load16(blk, st, off, r);                                                         \
                for (int m = 0; m < MM; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);             \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < PACK_ROWS; r++)                                                                  \
            for (int m = 0; m < MM; m++)                                                                     \
                y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.0f);          \
    }
DEFINE_BLOCK16(1)
DEFINE_BLOCK16(2)
DEFINE_BLOCK16(3)
DEFINE_BLOCK16(4)
DEFINE_BLOCK16(5)
DEFINE_BLOCK16(6)

/* run_blocks for this build: with more than one group of x rows, each half-precision block is
 * converted once, into fp32 in the order the vectors are read (st 3), and reused by every group. */
INLINE void run_blocks16(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N,
                         long b, long e, long K) {
    float *wf = (wtype != 2 && M > X_ROWS16) ? (float *)aligned_alloc(64, sizeof(float) * PACK_ROWS * K) : 0;
    for (long n = b; n < e; n += PACK_ROWS) {
        const void *blk = (const char *)w + n * K * (wtype == 2 ? 4 : 2);
        const void *src = blk;
        int st = wtype;
        if (wf) {
            for (long k = 0; k < K; k += 16) {
                _mm_prefetch((const char *)blk + k * PACK_ROWS * 2 + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)blk + k * PACK_ROWS * 2 + PREFETCH_BYTES + 64, _MM_HINT_T0);
                for (int r = 0; r < PACK_ROWS; r++) _mm512_store_ps(wf + k * PACK_ROWS + r * 16, load16(blk, wtype, k * PACK_ROWS, r));
            }
            src = wf;
            st = 3;
        }
        int pf = !wf;
        for (int m = 0; m < M; m += X_ROWS16) {
            const float *xm = x + (long)m * K;
            float *ym = y + (long)m * N;
            int p = pf && m == 0;
            switch (M - m < X_ROWS16 ? M - m : X_ROWS16) {
            case 1: block16_1(xm, src, st, bias, ym, N, n, K, p); break;
            case 2: block16_2(xm, src, st, bias, ym, N, n, K, p); break;
            case 3: block16_3(xm, src, st, bias, ym, N, n, K, p); break;
            case 4: block16_4(xm, src, st, bias, ym, N, n, K, p); break;
            case 5: block16_5(xm, src, st, bias, ym, N, n, K, p); break;
            default: block16_6(xm, src, st, bias, ym, N, n, K, p); break;
            }
        }
    }
    free(wf);
}
#define RUN_BLOCKS(x, w, t, bias, y, M, N, b, e, K) \
    (((K) % 16 == 0) ? run_blocks16(x, w, t, bias, y, M, N, b, e, K) : run_blocks(x, w, t, bias, y, M, N, b, e, K))
#else
#define RUN_BLOCKS run_blocks
#endif

/* The row-major tail rows [b, e) (N % 4 of them), one dot product per row of x. */
INLINE void run_tail(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N,
                     long b, long e, long K) {
    for (long n = b; n < e; n++)
        for (int m = 0; m < M; m++) {
            __m256 a = _mm256_setzero_ps();
            for (long k = 0; k < K; k += 8) a = _mm256_fmadd_ps(load8(w, wtype, n * K + k), _mm256_loadu_ps(x + m * K + k), a);
            y[m * N + n] = hsum(a) + (bias ? bias[n] : 0.0f);
        }
}

/* Several matmuls in one parallel region: group g multiplies rows [starts[g], starts[g + 1]) of x by
 * the weight w[g] (bias[g] or none) into the same rows of y; every group has the same N and K, and
 * the blocks of all groups form one range that the threads share (many small matmuls, such as a
 * mixture-of-experts layer's experts, then keep every thread streaming).
 * x, bias, y fp32; W bf16 (wtype 0), fp16 (1) or fp32 (2), rows interleaved (see above). */
static void gemv_groups(const float *x, const void *const *w, const float *const *bias, const int64_t *starts,
                        long groups, int wtype, float *y, long N, long K, int threads) {
    long per_group = N / PACK_ROWS, full = per_group * PACK_ROWS, units = per_group * groups;
    split_range ranges[SPLIT_MAX_THREADS];
    if (threads > SPLIT_MAX_THREADS) threads = SPLIT_MAX_THREADS;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads(), visited = 0;
        long b, e;
        split_start(ranges, units, t, nt);
        #pragma omp barrier
        while (split_next(ranges, units, t, nt, &visited, &b, &e)) {
            while (b < e) {  /* the chunk, cut at group boundaries */
                long g = b / per_group, u0 = b - g * per_group, u1 = e - g * per_group;
                if (u1 > per_group) u1 = per_group;
                long m0 = starts[g];
                int rows = (int)(starts[g + 1] - m0);
                const float *gx = x + m0 * K;
                float *gy = y + m0 * N;
                /* wtype is a literal at each call, so the loops are compiled once per type */
                if (wtype == 0) RUN_BLOCKS(gx, w[g], 0, bias[g], gy, rows, N, u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                else if (wtype == 1) RUN_BLOCKS(gx, w[g], 1, bias[g], gy, rows, N, u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                else RUN_BLOCKS(gx, w[g], 2, bias[g], gy, rows, N, u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                b += u1 - u0;
            }
        }
        if (t == nt - 1 && full < N)
            for (long g = 0; g < groups; g++)
                run_tail(x + starts[g] * K, w[g], wtype, bias[g], y + starts[g] * N, (int)(starts[g + 1] - starts[g]),
                         N, full, N, K);
    }
}

/* y[M, N] = x[M, K] . W^T (+ bias): each block of W's rows is read once for all of x. */
void anna_gemv(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N, long K,
               int threads) {
    int64_t starts[2] = {0, M};
    gemv_groups(x, &w, &bias, starts, 1, wtype, y, N, K, threads);
}

/* Group g: rows [starts[g], starts[g + 1]) of x times the weight of expert ids[g], at w[ids[g]] (a
 * table of every expert's pointer, kept by the caller). */
void anna_gemv_experts(const float *x, const int64_t *w, const int64_t *ids, const int64_t *starts, long groups,
                       int wtype, float *y, long N, long K, int threads) {
    const void **gw = (const void **)malloc(sizeof(void *) * groups);
    const float **gb = (const float **)calloc(groups, sizeof(float *));
    for (long g = 0; g < groups; g++) gw[g] = (const void *)(intptr_t)w[ids[g]];
    gemv_groups(x, gw, gb, starts, groups, wtype, y, N, K, threads);
    free(gw);
    free(gb);
}

/* Packed W -> fp32 row-major [N, K]: the weight torch's GEMM reads when M is too large for the
 * kernel above (prefill). One pass, vectorized: about 4x faster here than torch's bf16 -> fp32. */
void anna_deinterleave_rows(const void *w, int wtype, long N, long K, float *out, int threads) {
    long blocks = N / PACK_ROWS, full = blocks * PACK_ROWS;
    #pragma omp parallel for num_threads(threads)
    for (long b = 0; b < blocks; b++)
        for (long k = 0; k < K; k += 8)
            for (int r = 0; r < PACK_ROWS; r++)
                _mm256_storeu_ps(out + (b * PACK_ROWS + r) * K + k, load8(w, wtype, b * PACK_ROWS * K + k * PACK_ROWS + r * 8));
    for (long n = full; n < N; n++)
        for (long k = 0; k < K; k += 8) _mm256_storeu_ps(out + n * K + k, load8(w, wtype, n * K + k));
}

/* The same for a 16-bit weight (bf16 / fp16) kept in its own type: the operand of a bf16 GEMM. */
void anna_deinterleave_rows16(const uint16_t *w, long N, long K, uint16_t *out, int threads) {
    long blocks = N / PACK_ROWS, full = blocks * PACK_ROWS;
    #pragma omp parallel for num_threads(threads)
    for (long b = 0; b < blocks; b++)
        for (long k = 0; k < K; k += 8)
            for (int r = 0; r < PACK_ROWS; r++)
                _mm_storeu_si128((__m128i *)(out + (b * PACK_ROWS + r) * K + k),
                                 _mm_loadu_si128((const __m128i *)(w + b * PACK_ROWS * K + k * PACK_ROWS + r * 8)));
    for (long i = full * K; i < N * K; i++) out[i] = w[i];
}

/* ---- fused elementwise kernels for decode: one call instead of a chain of small torch ops ---- */

/* exp(x), 8 lanes: 2^n * p(r) with r = x - n ln 2 (Cephes' polynomial; relative error ~2e-7,
 * against ~1e-7 for libm's expf). Inputs are clamped to the range where expf is finite/nonzero. */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The gated MLP's activation: out[t, i] = silu(gate[t, i]) * up[t, i], where each row of gate_up
 * is [gate (I values), up (I values)]; fp32 in and out, or (bf16 != 0) bf16 in and out, computed
 * in fp32 (a bf16 GEMM's output feeding the next bf16 GEMM). Vectorized and split across
 * threads: as a scalar loop it was 5% of a 16-sequence decode step, with the other thread waiting. */
void anna_silu_mul(const void *gate_up, void *out, long M, long I, int bf16, int threads) {
    long chunks = (I + 255) / 256;
    int wtype = bf16 ? 0 : 2;
    #pragma omp parallel for num_threads(threads) if (M * I >= 16384)
    for (long job = 0; job < M * chunks; job++) {
        long t = job / chunks, b = (job % chunks) * 256, e = b + 256 < I ? b + 256 : I;
        long g = t * 2 * I, u = g + I, o = t * I;
        long i = b;
        for (; i + 8 <= e; i += 8) {
            __m256 gv = load8(gate_up, wtype, g + i);
            __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            __m256 r = _mm256_mul_ps(sig, load8(gate_up, wtype, u + i));
            if (bf16) store8_bf16((uint16_t *)out + o + i, r);
            else _mm256_storeu_ps((float *)out + o + i, r);
        }
        for (; i < e; i++) {
            float gi = load1(gate_up, wtype, g + i), r = gi / (1.0f + expf(-gi)) * load1(gate_up, wtype, u + i);
            if (bf16) ((uint16_t *)out)[o + i] = to_bf16(r);
            else ((float *)out)[o + i] = r;
        }
    }
}

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

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums for about the price of one. */
INLINE __m256 hsum8(const __m256 a[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE float hmax8(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* q . k[j] for eight key rows at once (dim a multiple of 8). */
INLINE __m256 dot8(const float *q, const float *const k[8], long dim) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (long d = 0; d < dim; d += 8) {
        __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), a[j]);
    }
    return hsum8(a);
}

/* One sequence's view of a paged cache [blocks, kv_heads, block_size, row], for KV head h. */
typedef struct {
    const long *table;  /* the sequence's block ids */
    long block_size, kv_heads, h, row_bytes;
    int shift;          /* log2(block_size) when it is a power of two, else -1 */
} PagedSeq;

/* Position p's row: a shift and a mask when the block size is a power of two, else a division. */
INLINE const uint8_t *paged_row(const uint8_t *cache, const PagedSeq *s, long p) {
    long blk = s->shift >= 0 ? p >> s->shift : p / s->block_size;
    long r = s->shift >= 0 ? p & (s->block_size - 1) : p % s->block_size;
    return cache + ((s->table[blk] * s->kv_heads + s->h) * s->block_size + r) * s->row_bytes;
}

/* Whether positions p .. p + count - 1 lie in one block (their rows consecutive in memory). */
INLINE int same_block(const PagedSeq *s, long p, long count) {
    return s->shift >= 0 && (p >> s->shift) == ((p + count - 1) >> s->shift);
}

/* Ask for the lines of `count` consecutive rows from `row` on. */
INLINE void prefetch_rows(const uint8_t *row, long count, long row_bytes, int hint) {
    const char *a = (const char *)((uintptr_t)row & ~(uintptr_t)63), *end = (const char *)row + count * row_bytes;
    for (; a < end; a += 64) {
        if (hint == _MM_HINT_T0) _mm_prefetch(a, _MM_HINT_T0);
        else _mm_prefetch(a, _MM_HINT_T1);
    }
}

/* Ask for the rows of positions p .. p + count - 1: one span where they share a block. */
INLINE void prefetch_positions(const uint8_t *cache, const PagedSeq *s, long p, long count, int hint) {
    if (same_block(s, p, count)) {
        prefetch_rows(paged_row(cache, s, p), count, s->row_bytes, hint);
        return;
    }
    for (long j = 0; j < count; j++) prefetch_rows(paged_row(cache, s, p + j), 1, s->row_bytes, hint);
}

/* The rows of positions p .. p + 7 as fp32 into rows[], asking for the next eight (up to n)
 * meanwhile: fp32 rows where they lie, others decoded into `scratch` [8, dim] (in L1). */
INLINE void paged_rows8(int kind, const uint8_t *cache, const PagedSeq *s, long p, long n, long dim, __m256 lo,
                        __m256 hi, float *scratch, const float *rows[8]) {
    for (int j = 0; j < 8; j++) {
        const uint8_t *row = paged_row(cache, s, p + j);
        if (kind == KV_F32) {
            rows[j] = (const float *)row;
        } else {
#ifdef __AVX512F__
            if (dim % 16 == 0)
                kv_decode_row16(kind, row, dim, _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1), scratch + j * dim);
            else
#endif
            kv_decode_row(kind, row, dim, lo, hi, scratch + j * dim);
            rows[j] = scratch + j * dim;
        }
        if (p + 8 + j < n) prefetch_rows(paged_row(cache, s, p + 8 + j), 1, s->row_bytes, _MM_HINT_T0);
    }
}

INLINE const float *paged_row1(int kind, const uint8_t *cache, const PagedSeq *s, long p, long dim, __m256 lo,
                               __m256 hi, float *scratch) {
    const uint8_t *row = paged_row(cache, s, p);
    if (kind == KV_F32) return (const float *)row;
    kv_decode_row(kind, row, dim, lo, hi, scratch);
    return scratch;
}

/* y[g] = R x[g] for `group` rows of dim (R: [dim, dim]); inverse: y[g] = R^T x[g]. */
INLINE void rotate_rows(const float *R, const float *x, float *y, long group, long dim, int inverse) {
    for (long g = 0; g < group; g++) {
        const float *xg = x + g * dim;
        float *yg = y + g * dim;
        if (!inverse) {
            for (long i = 0; i < dim; i++) yg[i] = dot(R + i * dim, xg, dim);
        } else {
            for (long i = 0; i < dim; i++) yg[i] = 0.0f;
            for (long i = 0; i < dim; i++) {
                __m256 xi = _mm256_set1_ps(xg[i]);
                for (long j = 0; j < dim; j += 8)
                    _mm256_storeu_ps(yg + j, _mm256_fmadd_ps(xi, _mm256_loadu_ps(R + i * dim + j),
                                                             _mm256_loadu_ps(yg + j)));
            }
        }
    }
}

#ifdef __AVX512F__
#define HEADS_PER_PASS 2  /* query heads sharing each pass over eight key or value rows (3 measured no faster) */

/* Eight positions' scores for query heads g .. g + nh - 1 (nh <= HEADS_PER_PASS, a constant at each
 * call: each key row is loaded once for all of them); rows[j] fp32, dim a multiple of 16. The
 * scores of head g + h go to scores + h * len, its running maximum to mx[h]. */
INLINE void scores8_512(const float *qv, const float *const rows[8], int nh, long dim, float scale, float *out,
                        long len, float *mx) {
    __m512 a[HEADS_PER_PASS][8];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < 8; j++) a[h][j] = _mm512_setzero_ps();
    for (long d = 0; d < dim; d += 16) {
        __m512 q[HEADS_PER_PASS];
        for (int h = 0; h < nh; h++) q[h] = _mm512_loadu_ps(qv + h * dim + d);
        for (int j = 0; j < 8; j++) {
            __m512 k = _mm512_loadu_ps(rows[j] + d);
            for (int h = 0; h < nh; h++) a[h][j] = _mm512_fmadd_ps(q[h], k, a[h][j]);
        }
    }
    for (int h = 0; h < nh; h++) {
        __m256 r[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_add_ps(_mm512_castps512_ps256(a[h][j]), _mm512_extractf32x8_ps(a[h][j], 1));
        __m256 sc = _mm256_mul_ps(hsum8(r), _mm256_set1_ps(scale));
        _mm256_storeu_ps(out + h * len, sc);
        mx[h] = fmaxf(mx[h], hmax8(sc));
    }
}

#define V_HEADS_PER_PASS 8  /* value rows: the weights are broadcast from memory, so more heads fit */

/* acc[h] += sum_j w[h * len + j] * rows[j] for heads h < nh (nh <= V_HEADS_PER_PASS, a constant at
 * each call: each value row loaded once for all of them); w: normalized probabilities. */
INLINE void accumulate8_512(const float *const rows[8], const float *w, long len, int nh, long dim, float *acc) {
    for (long i = 0; i < dim; i += 16) {
        __m512 o[V_HEADS_PER_PASS];
        for (int h = 0; h < nh; h++) o[h] = _mm512_loadu_ps(acc + h * dim + i);
        for (int j = 0; j < 8; j++) {
            __m512 v = _mm512_loadu_ps(rows[j] + i);
            for (int h = 0; h < nh; h++) o[h] = _mm512_fmadd_ps(_mm512_set1_ps(w[h * len + j]), v, o[h]);
        }
        for (int h = 0; h < nh; h++) _mm512_storeu_ps(acc + h * dim + i, o[h]);
    }
}

/* The heads of a group in passes of PER heads, the last pass taking what is left; CALL(g, nh) runs
 * one pass (nh a constant in each expansion). */
#define HEAD_PASSES(group, PER, CALL)                                                 \
    do {                                                                              \
        long g_ = 0;                                                                  \
        for (; g_ + (PER) <= (group); g_ += (PER)) CALL(g_, PER);                     \
        switch ((group) - g_) {                                                       \
        case 7: if ((PER) > 7) CALL(g_, 7); break;                                    \
        case 6: if ((PER) > 6) CALL(g_, 6); break;                                    \
        case 5: if ((PER) > 5) CALL(g_, 5); break;                                    \
        case 4: if ((PER) > 4) CALL(g_, 4); break;                                    \
        case 3: if ((PER) > 3) CALL(g_, 3); break;                                    \
        case 2: if ((PER) > 2) CALL(g_, 2); break;                                    \
        case 1: CALL(g_, 1); break;                                                   \
        }                                                                             \
    } while (0)
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Keys stored as int8 values (int8 rows, or TurboQuant 4-bit levels mapped to int8) score on VNNI's
 * u8 x s8 dot products instead of decoded fp32: sixteen rows at a time, transposed into dword columns
 * (column c: values 4c .. 4c + 3 of each row), so that one vpdpbusd per column and head adds four
 * products to each of the sixteen rows' sums with no horizontal reduction. Keys enter as u8 (value
 * + 128) and queries as s8 (each head's rotated query quantized to int8 with a scale of its own),
 * the 128 * sum(q) this adds taken off once per head. */
#define VNNI_MAX_HEADS 8

INLINE void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[4b + m], 128-bit lane L: dword 4L + m of rows 4b .. 4b + 3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        __m512i v3 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE), v4 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(v1, v2, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(v1, v2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(v3, v4, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(v3, v4, 0xDD);
    }
}

/* 64 values of a row from `slice` (their first byte) as u8 (value + 128): int8 rows flip the sign
 * bit; TurboQuant 4-bit rows look their nibbles up in `lut` (the int8 levels + 128, in each lane). */
INLINE __m512i key_slice_u8(int kind, const uint8_t *slice, __m512i lut) {
    if (kind == KV_INT8) return _mm512_xor_si512(_mm512_loadu_si512(slice), _mm512_set1_epi8((char)0x80));
    __m256i b = _mm256_loadu_si256((const __m256i *)slice);
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(15));
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15));
    __m256i a = _mm256_unpacklo_epi8(lo, hi), c = _mm256_unpackhi_epi8(lo, hi);  /* values 0-15|32-47, 16-31|48-63 */
    __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(a, c, 0x20)),
                                       _mm256_permute2x128_si256(a, c, 0x31), 1);
    return _mm512_shuffle_epi8(lut, codes);
}

/* Scores of sixteen rows for heads h < nh (a constant at each call); qi: the heads' int8 queries
 * [nh][dim], qscale/qsum: their scales and sums; rowscale: each row's value scale. */
INLINE void scores16_vnni(int kind, const uint8_t *const rows[16], const float *rowscale, const int8_t *qi,
                          const float *qscale, const int32_t *qsum, int nh, long dim, float scale, __m512i lut,
                          float *out, long len, float *mx) {
    __m512i acc[VNNI_MAX_HEADS];
    for (int h = 0; h < nh; h++) acc[h] = _mm512_setzero_si512();
    long slice_bytes = kind == KV_TQ4 ? 32 : 64;
    for (long s = 0; s < dim / 64; s++) {
        __m512i col[16];
        for (int j = 0; j < 16; j++) col[j] = key_slice_u8(kind, rows[j] + s * slice_bytes, lut);
        transpose16_epi32(col);
        for (int c = 0; c < 16; c++)
            for (int h = 0; h < nh; h++) {
                int32_t qd;
                memcpy(&qd, qi + h * dim + s * 64 + c * 4, 4);
                acc[h] = _mm512_dpbusd_epi32(acc[h], col[c], _mm512_set1_epi32(qd));
            }
    }
    __m512 rs = _mm512_mul_ps(_mm512_loadu_ps(rowscale), _mm512_set1_ps(scale));
    for (int h = 0; h < nh; h++) {
        __m512i dots = _mm512_sub_epi32(acc[h], _mm512_set1_epi32(128 * qsum[h]));
        __m512 sc = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), rs), _mm512_set1_ps(qscale[h]));
        _mm512_storeu_ps(out + h * len, sc);
        float m = _mm512_reduce_max_ps(sc);
        if (m > mx[h]) mx[h] = m;
    }
}

/* The stored rows of positions p .. p + 15 and their scales times `lscale`, asking for the sixteen
 * ROWS16_AHEAD positions on (up to n) meanwhile. Rows of one block are consecutive, so their
 * addresses follow from the first and their fp16 scales come in one gather (from two bytes before
 * each, so that nothing past a row is read). */
#define ROWS16_AHEAD 32
INLINE void paged_rows16(int kind, const uint8_t *cache, const PagedSeq *s, long p, long n, long dim, float lscale,
                         const uint8_t *rows[16], float *rowscale) {
    if (same_block(s, p, 16)) {
        const uint8_t *first = paged_row(cache, s, p);
        long rb = s->row_bytes;
        for (int j = 0; j < 16; j++) rows[j] = first + j * rb;
        __m512i offs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)rb));
        __m512i words = _mm512_i32gather_epi32(offs, first + kv_data_bytes(kind, dim) - 2, 1);
        __m512 sc = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
        _mm512_storeu_ps(rowscale, _mm512_mul_ps(sc, _mm512_set1_ps(lscale)));
    } else {
        for (int j = 0; j < 16; j++) {
            rows[j] = paged_row(cache, s, p + j);
            rowscale[j] = kv_row_scale(kind, rows[j], dim) * lscale;
        }
    }
    long q = p + ROWS16_AHEAD;
    if (q < n) prefetch_positions(cache, s, q, n - q < 16 ? n - q : 16, _MM_HINT_T0);
}

/* Each head's query as int8 with its own scale (round to nearest), and the sum of its int8 values. */
static void quantize_queries(const float *q, long group, long dim, int8_t *qi, float *qscale, int32_t *qsum) {
    for (long g = 0; g < group; g++) {
        const float *x = q + g * dim;
        float amax = 0.0f;
        for (long d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(x[d]));
        float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
        int32_t sum = 0;
        for (long d = 0; d < dim; d++) {
            int v = (int)nearbyintf(x[d] * inv);
            qi[g * dim + d] = (int8_t)v;
            sum += v;
        }
        qscale[g] = s;
        qsum[g] = sum;
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Values stored as int8 (int8 rows, TurboQuant 4-bit levels mapped to int8) are summed on VNNI too.
 * Each head's weights for sixteen rows (probability times the row's scale) become 16-bit integers
 * with one scale per head and sixteen rows, split into low and high bytes; four rows' values are
 * interleaved into dwords, and two vpdpbusd (low bytes, high bytes) add four rows' products to
 * sixteen of a head's outputs: half the fp32 multiply-adds, with no decode to fp32. The weights
 * keep 16 bits (8 bits cost about 0.4% of the output's scale, as much as int8 rows themselves
 * lose). The sums come out in vnni_value_order's order, put back once per job. */

/* 64 values of a value row from `slice` as s8: int8 rows as stored; TurboQuant 4-bit rows' low
 * nibbles (even values) then high nibbles (odd values), looked up in `lut` (the int8 levels). */
INLINE __m512i value_slice_s8(int kind, const uint8_t *slice, __m512i lut) {
    if (kind == KV_INT8) return _mm512_loadu_si512(slice);
    __m256i b = _mm256_loadu_si256((const __m256i *)slice);
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(15));
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15));
    return _mm512_shuffle_epi8(lut, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

/* Where the sum in lane m of vector c (of four per 64-value slice) belongs within the slice. */
INLINE long vnni_value_order(int kind, int c, int m) {
    long k = (m / 4) * 16 + c * 4 + m % 4;  /* the byte of value_slice_s8 (the interleave below) */
    return kind == KV_TQ4 ? (k < 32 ? 2 * k : 2 * (k - 32) + 1) : k;
}

/* acc[h] += sum_j w[h * stride + j] * rowscale[j] * values of rows[j], for sixteen rows and heads h < nh. */
INLINE void values16_vnni(int kind, const uint8_t *const rows[16], const float *rowscale, const float *w,
                          long stride, long nh, long dim, __m512i lut, float *acc) {
    uint32_t wlo[VNNI_MAX_HEADS][4], whi[VNNI_MAX_HEADS][4];
    float ws[VNNI_MAX_HEADS];
    __m512 rs = _mm512_loadu_ps(rowscale);
    for (long h = 0; h < nh; h++) {
        __m512 e = _mm512_mul_ps(_mm512_loadu_ps(w + h * stride), rs);
        float emax = _mm512_reduce_max_ps(e);
        ws[h] = emax / 65535.0f;
        if (!(emax > 0.0f)) continue;
        __m512i u = _mm512_cvtps_epi32(_mm512_mul_ps(e, _mm512_set1_ps(65535.0f / emax)));
        _mm_storeu_si128((__m128i *)wlo[h], _mm512_cvtepi32_epi8(_mm512_and_si512(u, _mm512_set1_epi32(255))));
        _mm_storeu_si128((__m128i *)whi[h], _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
    }
    long slice_bytes = kind == KV_TQ4 ? 32 : 64;
    for (long s = 0; s < dim / 64; s++) {
        __m512i x[16];  /* x[4g + c], dword m: values (m / 4) * 16 + 4c + m % 4 of rows 4g .. 4g + 3 */
        for (int g = 0; g < 4; g++) {
            __m512i r0 = value_slice_s8(kind, rows[4 * g] + s * slice_bytes, lut);
            __m512i r1 = value_slice_s8(kind, rows[4 * g + 1] + s * slice_bytes, lut);
            __m512i r2 = value_slice_s8(kind, rows[4 * g + 2] + s * slice_bytes, lut);
            __m512i r3 = value_slice_s8(kind, rows[4 * g + 3] + s * slice_bytes, lut);
            __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
            __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
            x[4 * g] = _mm512_unpacklo_epi16(a, c);
            x[4 * g + 1] = _mm512_unpackhi_epi16(a, c);
            x[4 * g + 2] = _mm512_unpacklo_epi16(b, d);
            x[4 * g + 3] = _mm512_unpackhi_epi16(b, d);
        }
        for (long h = 0; h < nh; h++) {
            if (!(ws[h] > 0.0f)) continue;
            __m512i al[4], ah[4];
            for (int c = 0; c < 4; c++) al[c] = ah[c] = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                __m512i bl = _mm512_set1_epi32((int)wlo[h][g]), bh = _mm512_set1_epi32((int)whi[h][g]);
                for (int c = 0; c < 4; c++) {
                    al[c] = _mm512_dpbusd_epi32(al[c], bl, x[4 * g + c]);
                    ah[c] = _mm512_dpbusd_epi32(ah[c], bh, x[4 * g + c]);
                }
            }
            float *dst = acc + h * dim + s * 64;
            __m512 sc = _mm512_set1_ps(ws[h]);
            for (int c = 0; c < 4; c++) {
                __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(ah[c], 8), al[c]);
                _mm512_storeu_ps(dst + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sc, _mm512_loadu_ps(dst + 16 * c)));
            }
        }
    }
}
#endif

#define ATTN_TILE 256  /* positions per pass: their scores stay in L1 from the keys to the values */

/* One thread's buffers for attend(). */
typedef struct {
    float *scores;    /* [group, ATTN_TILE]: a tile's scores, then their weights exp(score - max) */
    float *mx, *sum;  /* [group]: the running maximum score and the sum of the weights so far */
    float *tmax;      /* [group]: the tile's maximum score */
    float *scratch;   /* [8, dim]: decoded rows, 64-byte aligned */
    float *qr;        /* [group, dim]: rotated queries (TurboQuant) */
    float *acc;       /* [group, dim]: TurboQuant's weighted sum of rotated values (others sum into the output) */
    float *accq;      /* [group, dim]: the part of it summed on VNNI, in vnni_value_order */
    int8_t *qi;       /* [group, dim]: int8 queries for VNNI keys */
} AttendBuffers;

/* One (sequence, KV head) job of decode attention, for rows stored as `kind` (constant after
 * inlining, so each kind gets its own loops). One pass over the context in tiles of ATTN_TILE
 * positions (online softmax): a tile's keys are scored, its weights taken against the running
 * maximum (earlier sums rescaled when it grows) and its values summed while the scores are in L1. */
INLINE void attend(int kind, const AnnaKVFormat *f, const float *qv, const uint8_t *k_cache,
                   const uint8_t *v_cache, const PagedSeq *seq, long start, long n, long group, long dim,
                   float scale, const AttendBuffers *b, float *o) {
    int rotated = kind == KV_TQ4 || kind == KV_TQ3;
    float *scores = b->scores, *mx = b->mx, *sum = b->sum, *tmax = b->tmax, *scratch = b->scratch;
    float *acc = rotated ? b->acc : o;  /* TurboQuant: rotated back into o at the end */
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    if (rotated) {  /* scores against rotated keys: rotate the queries instead of each key back */
        lo = _mm256_loadu_ps(f->levels);
        if (kind == KV_TQ4) hi = _mm256_loadu_ps(f->levels + 8);
        rotate_rows(f->rotation, qv, b->qr, group, dim, 0);
        qv = b->qr;
    }
    for (long g = 0; g < group; g++) {
        mx[g] = -INFINITY;
        sum[g] = 0.0f;
    }
    for (long i = 0; i < group * dim; i++) acc[i] = 0.0f;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    int vnni = (kind == KV_INT8 || kind == KV_TQ4) && dim % 64 == 0 && group <= VNNI_MAX_HEADS;
    float qscale[VNNI_MAX_HEADS], rowscale[16], lscale = 1.0f;
    int32_t qsum[VNNI_MAX_HEADS];
    __m512i klut = _mm512_setzero_si512(), vlut = _mm512_setzero_si512();
    if (vnni) {
        quantize_queries(qv, group, dim, b->qi, qscale, qsum);
        if (kind == KV_TQ4) {  /* levels as int8, 127 at the largest (keys: + 128) */
            int8_t l8[16];
            lscale = f->levels[15] / 127.0f;
            for (int c = 0; c < 16; c++) l8[c] = (int8_t)nearbyintf(f->levels[c] / lscale);
            vlut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)l8));
            klut = _mm512_xor_si512(vlut, _mm512_set1_epi8((char)0x80));
        }
        for (long i = 0; i < group * dim; i++) b->accq[i] = 0.0f;
    }
#endif
    for (long t0 = start; t0 < n; t0 += ATTN_TILE) {
        long t1 = n - t0 < ATTN_TILE ? n : t0 + ATTN_TILE, tl = t1 - t0;
        for (long g = 0; g < group; g++) tmax[g] = -INFINITY;
        long p = t0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        for (; vnni && p + 16 <= t1; p += 16) {
            const uint8_t *rows[16];
            paged_rows16(kind, k_cache, seq, p, n, dim, lscale, rows, rowscale);
            prefetch_positions(v_cache, seq, p, 16, _MM_HINT_T1);
#define SCORES16(g, nh) scores16_vnni(kind, rows, rowscale, b->qi + (g) * dim, qscale + (g), qsum + (g), nh, dim, \
                                      scale, klut, scores + (g) * ATTN_TILE + p - t0, ATTN_TILE, tmax + (g))
            HEAD_PASSES(group, VNNI_MAX_HEADS, SCORES16);
#undef SCORES16
        }
#endif
        /* eight positions at a time: one reduction for eight scores instead of one each */
        for (; dim % 8 == 0 && p + 8 <= t1; p += 8) {
            const float *kr[8];
            paged_rows8(kind, k_cache, seq, p, n, dim, lo, hi, scratch, kr);
            for (int j = 0; j < 8; j++) prefetch_rows(paged_row(v_cache, seq, p + j), 1, seq->row_bytes, _MM_HINT_T1);
#ifdef __AVX512F__
            if (dim % 16 == 0) {
#define SCORES(g, nh) scores8_512(qv + (g) * dim, kr, nh, dim, scale, scores + (g) * ATTN_TILE + p - t0, ATTN_TILE, \
                                  tmax + (g))
                HEAD_PASSES(group, HEADS_PER_PASS, SCORES);
#undef SCORES
                continue;
            }
#endif
            for (long g = 0; g < group; g++) {
                __m256 sc = _mm256_mul_ps(dot8(qv + g * dim, kr, dim), _mm256_set1_ps(scale));
                _mm256_storeu_ps(scores + g * ATTN_TILE + p - t0, sc);
                tmax[g] = fmaxf(tmax[g], hmax8(sc));
            }
        }
        for (; p < t1; p++) {
            const float *kv = paged_row1(kind, k_cache, seq, p, dim, lo, hi, scratch);
            for (long g = 0; g < group; g++) {
                float sc = dot(qv + g * dim, kv, dim) * scale;
                scores[g * ATTN_TILE + p - t0] = sc;
                tmax[g] = fmaxf(tmax[g], sc);
            }
        }
        /* the tile's weights against the running maximum; the sums so far rescaled where it grew */
        for (long g = 0; g < group; g++) {
            float m = fmaxf(mx[g], tmax[g]);
            if (m > mx[g] && mx[g] > -INFINITY) {
                float c = expf(mx[g] - m);
                sum[g] *= c;
                for (long i = 0; i < dim; i++) acc[g * dim + i] *= c;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                if (vnni)
                    for (long i = 0; i < dim; i++) b->accq[g * dim + i] *= c;
#endif
            }
            mx[g] = m;
            float *sg = scores + g * ATTN_TILE;
            __m256 vmax = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
            long i = 0;
            for (; i + 8 <= tl; i += 8) {
                __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vmax));
                _mm256_storeu_ps(sg + i, ev);
                vsum = _mm256_add_ps(vsum, ev);
            }
            float s = hsum(vsum);
            for (; i < tl; i++) {
                sg[i] = expf(sg[i] - m);
                s += sg[i];
            }
            sum[g] += s;
        }
        p = t0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        for (; vnni && p + 16 <= t1; p += 16) {
            const uint8_t *rows[16];
            paged_rows16(kind, v_cache, seq, p, n, dim, lscale, rows, rowscale);
            values16_vnni(kind, rows, rowscale, scores + p - t0, ATTN_TILE, group, dim, vlut, b->accq);
        }
#endif
        /* eight positions at a time: each output row is read and written once per eight value
         * rows (once per value row, the loop was bound by its stores) */
        for (; dim % 8 == 0 && p + 8 <= t1; p += 8) {
            const float *vr[8];
            paged_rows8(kind, v_cache, seq, p, n, dim, lo, hi, scratch, vr);
#ifdef __AVX512F__
            if (dim % 16 == 0) {
#define ACCUMULATE(g, nh) accumulate8_512(vr, scores + (g) * ATTN_TILE + p - t0, ATTN_TILE, nh, dim, acc + (g) * dim)
                HEAD_PASSES(group, V_HEADS_PER_PASS, ACCUMULATE);
#undef ACCUMULATE
                continue;
            }
#endif
            for (long g = 0; g < group; g++) {
                const float *sg = scores + g * ATTN_TILE + p - t0;
                __m256 wv[8];
                for (int j = 0; j < 8; j++) wv[j] = _mm256_set1_ps(sg[j]);
                float *og = acc + g * dim;
                for (long i = 0; i < dim; i += 8) {
                    /* two chains of four fmas instead of one of eight */
                    __m256 a = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(vr[0] + i), _mm256_loadu_ps(og + i));
                    __m256 c = _mm256_mul_ps(wv[1], _mm256_loadu_ps(vr[1] + i));
                    for (int j = 2; j < 8; j += 2) {
                        a = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(vr[j] + i), a);
                        c = _mm256_fmadd_ps(wv[j + 1], _mm256_loadu_ps(vr[j + 1] + i), c);
                    }
                    _mm256_storeu_ps(og + i, _mm256_add_ps(a, c));
                }
            }
        }
        for (; p < t1; p++) {
            const float *vv = paged_row1(kind, v_cache, seq, p, dim, lo, hi, scratch);
            for (long g = 0; g < group; g++) {
                float wgt = scores[g * ATTN_TILE + p - t0];
                float *og = acc + g * dim;
                long i = 0;
                __m256 wv = _mm256_set1_ps(wgt);
                for (; i + 8 <= dim; i += 8)
                    _mm256_storeu_ps(og + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(vv + i), _mm256_loadu_ps(og + i)));
                for (; i < dim; i++) og[i] += wgt * vv[i];
            }
        }
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (vnni)
        for (long g = 0; g < group; g++)
            for (long s = 0; s < dim / 64; s++)
                for (int c = 0; c < 4; c++)
                    for (int m = 0; m < 16; m++)
                        acc[g * dim + s * 64 + vnni_value_order(kind, c, m)] += b->accq[g * dim + s * 64 + 16 * c + m];
#endif
    for (long g = 0; g < group; g++) {
        float inv = 1.0f / sum[g];
        for (long i = 0; i < dim; i++) acc[g * dim + i] *= inv;
    }
    if (rotated) rotate_rows(f->rotation, acc, o, group, dim, 1);
}

/* Decode attention over a paged KV cache: one query token per sequence.
 * q, out: [seqs, heads, dim] fp32; caches: [blocks, kv_heads, block_size, row] with rows stored as
 * `f` says (NULL: fp32); tables: [seqs, table_width] block ids; ctx: tokens of each sequence (the new
 * one included); window > 0 limits attention to the last `window` tokens. One job per (sequence,
 * kv head): each cached key and value row is read once for all the query heads that share it (GQA). */
void anna_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const AnnaKVFormat *f,
                                 const long *tables, long table_width, const long *ctx, long seqs, long heads,
                                 long kv_heads, long dim, long block_size, long window, float scale, float *out,
                                 int threads) {
    long group = heads / kv_heads;
    int kind = f ? f->kind : KV_F32;
    long row_bytes = f ? f->row_bytes : dim * 4;
    int shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctzl(block_size) : -1;
    #pragma omp parallel num_threads(threads)
    {
        /* 64-byte aligned: decoded rows and sums are stored and reloaded in 512-bit vectors */
        long rows_bytes = (sizeof(float) * group * dim + 63) & ~63L;
        AttendBuffers b = {
            .scores = (float *)malloc(sizeof(float) * group * ATTN_TILE),
            .mx = (float *)malloc(sizeof(float) * group),
            .sum = (float *)malloc(sizeof(float) * group),
            .tmax = (float *)malloc(sizeof(float) * group),
            .scratch = (float *)aligned_alloc(64, (sizeof(float) * 8 * dim + 63) & ~63L),
            .qr = (float *)aligned_alloc(64, rows_bytes),
            .acc = (float *)aligned_alloc(64, rows_bytes),
            .accq = (float *)aligned_alloc(64, rows_bytes),
            .qi = (int8_t *)malloc(group * dim),
        };
        #pragma omp for schedule(dynamic, 1)
        for (long job = 0; job < seqs * kv_heads; job++) {
            long sq = job / kv_heads, kvh = job % kv_heads;
            long n = ctx[sq], start = (window > 0 && n > window) ? n - window : 0;
            const float *qv = q + (sq * heads + kvh * group) * dim;  /* the group's query heads, consecutive */
            float *o = out + (sq * heads + kvh * group) * dim;
            PagedSeq seq = {tables + sq * table_width, block_size, kv_heads, kvh, row_bytes, shift};
            const uint8_t *kc = (const uint8_t *)k_cache, *vc = (const uint8_t *)v_cache;
#define ATTEND(K) attend(K, f, qv, kc, vc, &seq, start, n, group, dim, scale, &b, o)
            switch (kind) {
            case KV_BF16: ATTEND(KV_BF16); break;
            case KV_F16: ATTEND(KV_F16); break;
            case KV_FP8: ATTEND(KV_FP8); break;
            case KV_INT8: ATTEND(KV_INT8); break;
            case KV_TQ4: ATTEND(KV_TQ4); break;
            case KV_TQ3: ATTEND(KV_TQ3); break;
            default: ATTEND(KV_F32);
            }
#undef ATTEND
        }
        free(b.scores);
        free(b.mx);
        free(b.sum);
        free(b.tmax);
        free(b.scratch);
        free(b.qr);
        free(b.acc);
        free(b.accq);
        free(b.qi);
    }
}

/* out[r] = index of the largest of x[r, 0..n) (the first one on ties; the first NaN if there
 * is one, as torch.argmax): greedy sampling. torch's argmax runs at about 1 value per ns on
 * this class of CPU, 3 ms for 16 rows of a 152k vocabulary; this one reads at memory speed. */
void anna_argmax_rows(const float *x, long rows, long n, long *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * n;
        __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            vmax = _mm256_max_ps(vmax, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8], best = -INFINITY;
        _mm256_storeu_ps(lanes, vmax);
        for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (long j = i; j < n; j++) {
            has_nan |= isnan(row[j]);
            best = row[j] > best ? row[j] : best;
        }
        long found = 0;  /* a row of -inf only: index 0, as torch */
        for (long j = 0; j < n; j++)
            if (has_nan ? isnan(row[j]) : row[j] == best) {
                found = j;
                break;
            }
        out[r] = found;
    }
}
