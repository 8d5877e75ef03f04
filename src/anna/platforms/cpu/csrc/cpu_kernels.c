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
#include "vec_math.h"
#include "weight_types.h"
#include "work_split.h"

/* Weight layout ("interleaved rows"): the kernels read W as blocks of PACK_ROWS consecutive rows; in a
 * block, columns come in chunks of 8, and each chunk holds those 8 columns of row 0, then of row
 * 1, 2, 3. A block is one contiguous stream of 4 * K values, which keeps the memory system busier
 * than four separate rows when rows are short (K = 896: 1,792 bytes), and each step of the kernels
 * reads one 64-byte line of bf16 weights. The last N % 4 rows, if any, follow row-major.
 * Python packs a weight once, after loading (linear.py: interleave_rows). K must be a multiple of 8. */
#define PACK_ROWS 4
/* How far ahead of the current weight line to prefetch: 4 KB, as the int4 kernel does. Over 1 KB
 * on a 2-vCPU Zen 4: 0.98-1.09x per matmul at M = 1 (1.00-1.12x at the avx2 level;
 * benchmarks/kernel_ab.py), batch-1 bf16 decode 40.8-44.0 tok/s against 31.0-41.5 (five
 * alternated runs each of benchmarks/decode_bench.py, medians 42.4 and 39.1). */
#define PREFETCH_BYTES 4096

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
 * groups of 3 x rows keep 12 accumulators + 3 x vectors + 1 weight vector in the 16 registers.
 * (bf16 weights in the AVX2 build take block_pairs below, which needs no conversion.) */
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

/* bf16 weights on AVX512-BF16 (vdpbf16ps: two products per fp32 lane, twice the FMA's rate where the
 * CPU runs it at full width, as Zen 4 does), x rounded to bf16 once per call (xb, [M, K]). One
 * 64-byte line of an interleaved block holds 8 columns of each of its 4 rows; against those 8
 * columns of x repeated in all four 128-bit quarters, one vdpbf16ps adds the 4 rows' products into
 * the quarters of one accumulator, summed at the end. NB blocks at once against MM rows of x: each
 * x vector serves NB weight lines, and the NB x MM accumulators are enough independent sums to hide
 * the instruction's latency. Only called where the CPU has avx512_bf16 (the caller's bf16_dot_rows). */
#define DPBF16_BLOCKS 4  /* 4 blocks x 6 rows of x: measured ahead of 2 x 8 and 3 x 8 (Zen 4) */
#define DPBF16_X_ROWS 6
/* How a pass over a chunk of blocks prefetches. The first group of rows of x streams the chunk from
 * memory (its lines PREFETCH_BYTES ahead); the later groups re-read it from cache and meanwhile
 * ask for the next chunk, so that memory stays busy while they compute (Zen 4, weights from memory:
 * 1.24-1.41x at 16 rows of x, 1.13-1.18x at 32, benchmarks/kernel_ab.py --bf16-dot-min-rows 1). */
#define DPBF16_PREFETCH_NONE 0
#define DPBF16_PREFETCH_AHEAD 1
#define DPBF16_PREFETCH_NEXT 2

/* Lane 4r + j of s, summed over j, for r < 4: row r's dot product. */
__attribute__((target("avx512bf16"))) INLINE __m128 quarter_sums(__m512 s) {
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));  /* lanes (0+1, 2+3) of each quarter */
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));  /* every lane of quarter r: row r's sum */
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0), s));
}

#define DEFINE_BLOCKS_DPBF16(NB, MM)                                                                           \
    __attribute__((target("avx512bf16"))) static void blocks##NB##_dpbf16_##MM(                                \
        const uint16_t *xb, const uint16_t *blk, const float *bias, float *y, long N, long n, long K, int prefetch) { \
        __m512 acc[NB][MM];                                                                                    \
        for (int b = 0; b < NB; b++)                                                                           \
            for (int m = 0; m < MM; m++) acc[b][m] = _mm512_setzero_ps();                                      \
        const long next = NB * PACK_ROWS * K; /* the next chunk of blocks: the same line there */              \
        for (long k = 0; k < K; k += 8) {                                                                      \
            __m512bh w[NB];                                                                                    \
            for (int b = 0; b < NB; b++) {                                                                     \
                const uint16_t *line = blk + b * PACK_ROWS * K + k * PACK_ROWS;                                \
                if (prefetch == DPBF16_PREFETCH_AHEAD)                                                         \
                    _mm_prefetch((const char *)line + PREFETCH_BYTES, _MM_HINT_T0);                            \
                else if (prefetch == DPBF16_PREFETCH_NEXT)                                                     \
                    _mm_prefetch((const char *)(line + next), _MM_HINT_T1);                                    \
                w[b] = (__m512bh)_mm512_loadu_si512(line);                                                     \
            }                                                                                                  \
            for (int m = 0; m < MM; m++) {                                                                     \
                __m512bh xv = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xb + m * K + k))); \
                for (int b = 0; b < NB; b++) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], w[b], xv);               \
            }                                                                                                  \
        }                                                                                                      \
        for (int b = 0; b < NB; b++)                                                                           \
            for (int m = 0; m < MM; m++) {                                                                     \
                __m128 rows = quarter_sums(acc[b][m]);                                                         \
                if (bias) rows = _mm_add_ps(rows, _mm_loadu_ps(bias + n + b * PACK_ROWS));                     \
                _mm_storeu_ps(y + m * N + n + b * PACK_ROWS, rows);                                            \
            }                                                                                                  \
    }
#define DEFINE_DPBF16(MM) DEFINE_BLOCKS_DPBF16(4, MM) DEFINE_BLOCKS_DPBF16(1, MM)
DEFINE_DPBF16(1)
DEFINE_DPBF16(2)
DEFINE_DPBF16(3)
DEFINE_DPBF16(4)
DEFINE_DPBF16(5)
DEFINE_DPBF16(6)

/* Blocks [b, e) of W: DPBF16_BLOCKS at a time, the rest one by one; x in groups of DPBF16_X_ROWS. */
static void run_blocks_dpbf16(const uint16_t *xb, const uint16_t *w, const float *bias, float *y, int M, long N,
                              long b, long e, long K) {
    for (long n = b; n < e;) {
        int four = n + DPBF16_BLOCKS * PACK_ROWS <= e;
        const uint16_t *blk = w + n * K;
        for (int m = 0; m < M; m += DPBF16_X_ROWS) {
            const uint16_t *xm = xb + (long)m * K;
            float *ym = y + (long)m * N;
            int rows = M - m < DPBF16_X_ROWS ? M - m : DPBF16_X_ROWS;
            int p = m == 0 ? DPBF16_PREFETCH_AHEAD : four ? DPBF16_PREFETCH_NEXT : DPBF16_PREFETCH_NONE;
#define CALL_DPBF16(MM) (four ? blocks4_dpbf16_##MM : blocks1_dpbf16_##MM)(xm, blk, bias, ym, N, n, K, p)
            switch (rows) {
            case 1: CALL_DPBF16(1); break;
            case 2: CALL_DPBF16(2); break;
            case 3: CALL_DPBF16(3); break;
            case 4: CALL_DPBF16(4); break;
            case 5: CALL_DPBF16(5); break;
            default: CALL_DPBF16(6); break;
            }
#undef CALL_DPBF16
        }
        n += (four ? DPBF16_BLOCKS : 1) * PACK_ROWS;
    }
}

/* x [M, K] fp32 -> bf16, rounding to nearest even (as torch converts). */
static uint16_t *x_to_bf16(const float *x, long M, long K) {
    uint16_t *xb = (uint16_t *)aligned_alloc(64, ((sizeof(uint16_t) * M * K + 63) / 64) * 64);
    long i = 0, n = M * K;
    for (; i + 8 <= n; i += 8) store8_bf16(xb + i, _mm256_loadu_ps(x + i));
    for (; i < n; i++) xb[i] = to_bf16(x[i]);
    return xb;
}
#else
/* bf16 weights on AVX2, with no conversion pass: bf16 is the top half of an fp32, so a 32-bit lane
 * holding columns 2j and 2j + 1 of a row gives column 2j as an fp32 when shifted left by 16 and
 * column 2j + 1 when its low half is masked off. A 32-byte load of an interleaved block holds 8
 * columns of two rows (one per 128-bit half), so 2 loads and 4 integer operations give a block's
 * 32 weights of a run as fp32, where load8 takes 4 loads and 8 operations (run_blocks converted
 * each block to fp32 in memory instead, and read it back once per 3 rows of x). x is reordered to
 * match (pair_x): each run of 8 columns as [x0 x2 x4 x6 | x1 x3 x5 x7], each half broadcast to
 * both 128-bit halves. Accumulators hold two rows each, so up to PAIR_X_ROWS rows of x share each
 * weight vector with 2 accumulators per row. A run's even columns go first, then its odd ones, so
 * that 2 weight registers, 1 of x and the mask leave 12 of the 16 for accumulators: 5 rows of x
 * (6 spilled, at 0.54-0.78x the speed of 4 rows; 5 against 4: 1.11-1.24x at M = 5, 1.03-1.13x at
 * M = 9-13 on a Zen 3; benchmarks/kernel_ab.py). The m loops are unrolled by pragma: left to
 * itself gcc kept a copy of every accumulator on the stack, stored in every run.
 * Each group of rows of x widens the weights again, where run_blocks converts a block once for
 * all rows of x: from some M on that costs more than it saves. Where depends on the core (a Zen 1,
 * whose FMA and vector integer units are 128 bits wide, lost from M = 32; an AVX2-only Zen 4 gained
 * up to M = 64), so the caller passes the largest M (bf16_pair_max_rows, a calibrated setting). */
#define PAIR_X_ROWS 5
/* Fewer rows of x stream the weights from memory, where load8's blocks were as fast (0.93-1.02x
 * for block_pairs at 1-3 rows; 1.08-1.65x at 4) */
#define PAIR_MIN_ROWS 4
#define PAIR_ROWS(rows, max_rows) ((rows) >= PAIR_MIN_ROWS && (rows) <= (max_rows))

#define DEFINE_BLOCK_PAIRS(MM)                                                                               \
    INLINE void block_pairs_##MM(const float *xp, const uint16_t *blk, const float *bias, float *y, long N,   \
                                 long n, long K, int prefetch) {                                             \
        const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);                                            \
        /* with 1 or 2 rows of x, registers are left for the odd columns' own sums (odd01, odd23):    \
         * chains of 1 FMA per run, not 2, which one row of x waits on at memory speed */              \
        __m256 acc01[MM], acc23[MM], odd01[MM], odd23[MM];                                                  \
        _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++)                                                 \
            acc01[m] = acc23[m] = odd01[m] = odd23[m] = _mm256_setzero_ps();                                 \
        for (long k = 0; k < K; k += 8) {                                                                    \
            const uint16_t *p = blk + k * PACK_ROWS;                                                         \
            if (prefetch) _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);                       \
            __m256i v01 = _mm256_loadu_si256((const __m256i *)p), v23 = _mm256_loadu_si256((const __m256i *)(p + 16)); \
            __m256 e01 = _mm256_castsi256_ps(_mm256_slli_epi32(v01, 16));                                    \
            __m256 e23 = _mm256_castsi256_ps(_mm256_slli_epi32(v23, 16));                                    \
            _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) {                                           \
                __m256 xe = _mm256_broadcast_ps((const __m128 *)(xp + m * K + k));                           \
                acc01[m] = _mm256_fmadd_ps(e01, xe, acc01[m]);                                               \
                acc23[m] = _mm256_fmadd_ps(e23, xe, acc23[m]);                                               \
            }                                                                                                \
            __m256 o01 = _mm256_castsi256_ps(_mm256_and_si256(v01, odd));                                    \
            __m256 o23 = _mm256_castsi256_ps(_mm256_and_si256(v23, odd));                                    \
            _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) {                                           \
                __m256 xo = _mm256_broadcast_ps((const __m128 *)(xp + m * K + k + 4));                       \
                if (MM <= 2) {                                                                               \
                    odd01[m] = _mm256_fmadd_ps(o01, xo, odd01[m]);                                           \
                    odd23[m] = _mm256_fmadd_ps(o23, xo, odd23[m]);                                           \
                } else {                                                                                     \
                    acc01[m] = _mm256_fmadd_ps(o01, xo, acc01[m]);                                           \
                    acc23[m] = _mm256_fmadd_ps(o23, xo, acc23[m]);                                           \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) {                                               \
            if (MM <= 2) {                                                                                   \
                acc01[m] = _mm256_add_ps(acc01[m], odd01[m]);                                                \
                acc23[m] = _mm256_add_ps(acc23[m], odd23[m]);                                                \
            }                                                                                                \
            /* halves: row 0 | row 1 and row 2 | row 3 -> [r0 r2 r0 r2 | r1 r3 r1 r3] -> [r0 r1 r2 r3] */ \
            __m256 s = _mm256_hadd_ps(acc01[m], acc23[m]);                                                   \
            s = _mm256_hadd_ps(s, s);                                                                        \
            __m128 r = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5))); \
            if (bias) r = _mm_add_ps(r, _mm_loadu_ps(bias + n));                                             \
            _mm_storeu_ps(y + m * N + n, r);                                                                 \
        }                                                                                                    \
    }
DEFINE_BLOCK_PAIRS(1)
DEFINE_BLOCK_PAIRS(2)
DEFINE_BLOCK_PAIRS(3)
DEFINE_BLOCK_PAIRS(4)
DEFINE_BLOCK_PAIRS(5)

/* Rows [m0, m1) of x [., K] reordered for block_pairs into xp (same shape). */
static void pair_x(const float *x, float *xp, long m0, long m1, long K) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (long i = m0 * K; i < m1 * K; i += 8)
        _mm256_storeu_ps(xp + i, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + i), order));
}

/* bf16 rows [b, e) of W (multiples of 4) for all M rows of x, reordered by pair_x (xp). The blocks
 * go in chunks of PAIR_CHUNK_BYTES, each group of x rows running the whole chunk, so that the
 * chunk's weights stay in L2 and the group's x in L1 (1.03-1.11x over block by block at K = 896,
 * M = 16-64, on a 2-vCPU AMD EPYC without AVX-512; at K = 4864 a chunk is one block anyway). */
#define PAIR_CHUNK_BYTES 65536
static void run_blocks_pairs(const float *xp, const uint16_t *w, const float *bias, float *y, int M, long N,
                             long b, long e, long K) {
    long chunk = PAIR_CHUNK_BYTES / (PACK_ROWS * K * 2) * PACK_ROWS;
    if (chunk < PACK_ROWS) chunk = PACK_ROWS;
    /* Groups of 4 or 5 rows of x where M splits so (every M but 6, 7 and 11; 16 as 4 x 4, not 5, 5,
     * 5, 1), else of 4 and a last smaller group (6 as 4 + 2: 3 + 3 ran 0.85-0.91x) */
    int groups = (M + PAIR_X_ROWS - 1) / PAIR_X_ROWS, even = M <= PAIR_X_ROWS || M / groups >= PAIR_X_ROWS - 1;
    if (!even) groups = (M + PAIR_X_ROWS - 2) / (PAIR_X_ROWS - 1);
    for (long c = b; c < e; c += chunk) {
        long ce = c + chunk < e ? c + chunk : e;
        for (int g = 0, m = 0; g < groups; g++) {
            int rows = even ? (M - m) / (groups - g) : (M - m < PAIR_X_ROWS - 1 ? M - m : PAIR_X_ROWS - 1);
            const float *xm = xp + (long)m * K;
            float *ym = y + (long)m * N;
            int p = m == 0;
            m += rows;
            for (long n = c; n < ce; n += PACK_ROWS) {
                const uint16_t *blk = w + n * K;
                switch (rows) {
                case 1: block_pairs_1(xm, blk, bias, ym, N, n, K, p); break;
                case 2: block_pairs_2(xm, blk, bias, ym, N, n, K, p); break;
                case 3: block_pairs_3(xm, blk, bias, ym, N, n, K, p); break;
                case 4: block_pairs_4(xm, blk, bias, ym, N, n, K, p); break;
                default: block_pairs_5(xm, blk, bias, ym, N, n, K, p); break;
                }
            }
        }
    }
}
#define RUN_BLOCKS run_blocks
#endif

/* The row-major tail rows [b, e) (N % 4 of them), one dot product per row of x (x of type xtype:
 * fp32, or bf16 where the rest of the matmul multiplies x rounded to bf16). */
INLINE void run_tail(const void *x, int xtype, const void *w, int wtype, const float *bias, float *y, int M, long N,
                     long b, long e, long K) {
    for (long n = b; n < e; n++)
        for (int m = 0; m < M; m++) {
            __m256 a = _mm256_setzero_ps();
            for (long k = 0; k < K; k += 8) a = _mm256_fmadd_ps(load8(w, wtype, n * K + k), load8(x, xtype, m * K + k), a);
            y[m * N + n] = hsum(a) + (bias ? bias[n] : 0.0f);
        }
}

/* Several matmuls in one parallel region: group g multiplies rows [starts[g], starts[g + 1]) of x by
 * the weight w[g] (bias[g] or none) into the same rows of y; every group has the same N and K, and
 * the blocks of all groups form one range that the threads share (many small matmuls, such as a
 * mixture-of-experts layer's experts, then keep every thread streaming).
 * x, bias, y fp32; W bf16 (wtype 0), fp16 (1) or fp32 (2), rows interleaved (see above). bf16 weights
 * skip the conversion to fp32 in groups of bf16_dot_rows rows or more on AVX512-BF16 builds (x rounded
 * to bf16, run_blocks_dpbf16), in groups of PAIR_MIN_ROWS to bf16_pair_max_rows rows on AVX2 builds
 * (block_pairs); each build ignores the other's bound. */
static void gemv_groups(const float *x, const void *const *w, const float *const *bias, const int64_t *starts,
                        long groups, int wtype, float *y, long N, long K, int bf16_dot_rows, int bf16_pair_max_rows,
                        int threads) {
    long per_group = N / PACK_ROWS, full = per_group * PACK_ROWS, units = per_group * groups;
    split_range ranges[SPLIT_MAX_THREADS];
    if (threads > SPLIT_MAX_THREADS) threads = SPLIT_MAX_THREADS;
    const uint16_t *xb = 0;  /* x in bf16, where some group has bf16_dot_rows rows or more */
#ifdef __AVX512F__
    (void)bf16_pair_max_rows;
    int most = 0;  /* the most rows of x of any group */
    for (long g = 0; g < groups; g++) most = starts[g + 1] - starts[g] > most ? (int)(starts[g + 1] - starts[g]) : most;
    if (wtype == 0 && bf16_dot_rows > 0 && most >= bf16_dot_rows)
        xb = x_to_bf16(x + starts[0] * K, starts[groups] - starts[0], K);
#else
    (void)bf16_dot_rows;
    /* bf16 weights: x reordered for block_pairs, each thread a share of the rows */
    int pairs = 0;  /* some group has rows for block_pairs */
    for (long g = 0; g < groups && wtype == 0; g++)
        pairs |= PAIR_ROWS(starts[g + 1] - starts[g], bf16_pair_max_rows);
    long x0 = starts[0], x1 = starts[groups];
    float *xp = pairs ? (float *)aligned_alloc(32, ((sizeof(float) * (x1 - x0) * K + 31) / 32) * 32) : 0;
#endif
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads(), visited = 0;
        long b, e;
        split_start(ranges, units, t, nt);
#ifndef __AVX512F__
        if (xp) {
            long share = (x1 - x0 + nt - 1) / nt, r0 = x0 + t * share, r1 = r0 + share < x1 ? r0 + share : x1;
            if (r0 < r1) pair_x(x + x0 * K, xp, r0 - x0, r1 - x0, K);
        }
#endif
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
#ifdef __AVX512F__
                if (xb && rows >= bf16_dot_rows) run_blocks_dpbf16(xb + (m0 - starts[0]) * K, (const uint16_t *)w[g], bias[g], gy, rows, N,
                                          u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                else
#endif
#ifndef __AVX512F__
                if (xp && PAIR_ROWS(rows, bf16_pair_max_rows)) run_blocks_pairs(xp + (m0 - x0) * K, (const uint16_t *)w[g], bias[g], gy, rows, N, u0 * PACK_ROWS,
                                         u1 * PACK_ROWS, K);
                else
#endif
                if (wtype == 0) RUN_BLOCKS(gx, w[g], 0, bias[g], gy, rows, N, u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                else if (wtype == 1) RUN_BLOCKS(gx, w[g], 1, bias[g], gy, rows, N, u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                else RUN_BLOCKS(gx, w[g], 2, bias[g], gy, rows, N, u0 * PACK_ROWS, u1 * PACK_ROWS, K);
                b += u1 - u0;
            }
        }
        if (t == nt - 1 && full < N)
            for (long g = 0; g < groups; g++) {
                int rows = (int)(starts[g + 1] - starts[g]), dot = xb && rows >= bf16_dot_rows;
                const void *gx = dot ? (const void *)(xb + (starts[g] - starts[0]) * K) : (const void *)(x + starts[g] * K);
                run_tail(gx, dot ? 0 : 2, w[g], wtype, bias[g], y + starts[g] * N, rows, N, full, N, K);
            }
    }
    free((void *)xb);
#ifndef __AVX512F__
    free(xp);
#endif
}

/* y[M, N] = x[M, K] . W^T (+ bias): each block of W's rows is read once for all of x. */
void anna_gemv(const float *x, const void *w, int wtype, const float *bias, float *y, int M, long N, long K,
               int bf16_dot_rows, int bf16_pair_max_rows, int threads) {
    int64_t starts[2] = {0, M};
    gemv_groups(x, &w, &bias, starts, 1, wtype, y, N, K, bf16_dot_rows, bf16_pair_max_rows, threads);
}

/* Group g: rows [starts[g], starts[g + 1]) of x times the weight of expert ids[g], at w[ids[g]] (a
 * table of every expert's pointer, kept by the caller). */
void anna_gemv_experts(const float *x, const int64_t *w, const int64_t *ids, const int64_t *starts, long groups,
                       int wtype, float *y, long N, long K, int bf16_dot_rows, int bf16_pair_max_rows,
                       int threads) {
    const void **gw = (const void **)malloc(sizeof(void *) * groups);
    const float **gb = (const float **)calloc(groups, sizeof(float *));
    for (long g = 0; g < groups; g++) gw[g] = (const void *)(intptr_t)w[ids[g]];
    gemv_groups(x, gw, gb, starts, groups, wtype, y, N, K, bf16_dot_rows, bf16_pair_max_rows, threads);
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
#ifdef __AVX512F__
        for (; i + 16 <= e; i += 16) {
            __m512 gv = bf16 ? load16_bf16((const uint16_t *)gate_up + g + i) : _mm512_loadu_ps((const float *)gate_up + g + i);
            __m512 uv = bf16 ? load16_bf16((const uint16_t *)gate_up + u + i) : _mm512_loadu_ps((const float *)gate_up + u + i);
            __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            if (bf16) store16_bf16((uint16_t *)out + o + i, _mm512_mul_ps(sig, uv));
            else _mm512_storeu_ps((float *)out + o + i, _mm512_mul_ps(sig, uv));
        }
#endif
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

/* x += delta (when given), then out = rmsnorm(x) * w, row by row. x, delta, out fp32. The sum of
 * squares in fp64 (as the scalar loop this replaced: the same norms to the last bit, nearly
 * always), 8 values a step: a 2,048-token prefill's 49 norms took 70 ms as a scalar loop. */
void anna_add_rmsnorm(float *x, const float *delta, const void *w, int wtype, float *out, long rows, long dim,
                      float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        const float *dr = delta ? delta + r * dim : NULL;
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        long i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            if (dr) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(dr + i));
                _mm256_storeu_ps(xr + i, v);
            }
            __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            s0 = _mm256_fmadd_pd(lo, lo, s0);
            s1 = _mm256_fmadd_pd(hi, hi, s1);
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
        double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; i < dim; i++) {
            if (dr) xr[i] += dr[i];
            ss += (double)xr[i] * xr[i];
        }
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        float *orow = out + r * dim;
        __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(orow + i, _mm256_mul_ps(load8(w, wtype, i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv)));
        for (; i < dim; i++) orow[i] = load1(w, wtype, i) * (xr[i] * inv);
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


/* out[r] = index of the largest of x[r, 0..n) (the first one on ties; the first NaN if there
 * is one, as torch.argmax): greedy sampling. torch's argmax runs at about 1 value per ns on
 * this class of CPU, 3 ms for 16 rows of a 152k vocabulary; this one reads at memory speed. */
/* The first index of a row's largest value, or of its first NaN where it has one (as torch); a
 * row of -inf only: 0. Four independent maxima (one chain was bound by the max's latency), then a
 * search eight values at a time for the first that equals it (it was a scalar loop). */
static long argmax_row(const float *row, long n) {
    __m256 mx[4], nan = _mm256_setzero_ps();
    for (int a = 0; a < 4; a++) mx[a] = _mm256_set1_ps(-INFINITY);
    long i = 0;
    for (; i + 32 <= n; i += 32)
        for (int a = 0; a < 4; a++) {
            __m256 v = _mm256_loadu_ps(row + i + 8 * a);
            mx[a] = _mm256_max_ps(mx[a], v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(row + i);
        mx[0] = _mm256_max_ps(mx[0], v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3])));
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (long j = i; j < n; j++) {
        has_nan |= isnan(row[j]);
        best = row[j] > best ? row[j] : best;
    }
    __m256 want = _mm256_set1_ps(best);
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(row + j);
        int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz(hit);
    }
    for (; j < n; j++)
        if (has_nan ? isnan(row[j]) : row[j] == best) return j;
    return 0;
}

void anna_argmax_rows(const float *x, long rows, long n, long *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}
