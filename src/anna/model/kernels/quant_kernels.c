/* Weight-only quantized matmuls for CPU decode: y[M,N] = x[M,K] . dequant(W)[N,K]^T (+ bias).
 *
 * Weights: int8 with one scale per output row, or int4 with one scale per group of G input
 * columns (symmetric, stored as q + 8 in a nibble). Each group of 32 weights of an int4 row is
 * 16 bytes: byte i holds weight i (low nibble) and weight i + 16 (high nibble).
 * x is quantized on the fly to int8 in blocks of 32 (one fp32 scale per block), so that dot
 * products run on integer units (AVX2 maddubs), as llama.cpp does; K must be a multiple of 32.
 * One call reads each weight row once for all M rows of x (the row stays in L1 meanwhile).
 *
 * Layout ("interleaved rows", as in cpu_kernels.c): rows come in blocks of 4; within a block, each
 * 32-weight block of the 4 rows is contiguous (int4: 4 x 16 bytes, one cache line; int8: 4 x 32
 * bytes), and int4 group scales are [N / 4][K / G][4]. So a block of rows is one stream, not four
 * short ones (an int4 row of K = 896 is 448 bytes). The last N % 4 rows follow row-major, with
 * their scales. linear.py packs the tensors once, after loading. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* sum over the 32 lanes of a (signed) * b (signed) as 8 int32 lanes */
INLINE __m256i dot_s8(__m256i a, __m256i b) {
    __m256i ua = _mm256_sign_epi8(a, a), sb = _mm256_sign_epi8(b, a);
    __m256i p16 = _mm256_maddubs_epi16(ua, sb);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* x [M, K] fp32 -> xq [M, K] int8 and xs [M, K/32] scales */
static void quantize_x(const float *x, int8_t *xq, float *xs, long M, long K) {
    long blocks = K / 32;
    for (long m = 0; m < M; m++)
        for (long b = 0; b < blocks; b++) {
            const float *src = x + m * K + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(src[i]));
            float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
            xs[m * blocks + b] = d;
            int8_t *dst = xq + m * K + b * 32;
            for (int i = 0; i < 32; i++) dst[i] = (int8_t)lrintf(src[i] * id);
        }
}

/* 16 bytes -> 32 stored nibbles q (0..15, the weight is q - 8) */
INLINE __m256i unpack_q4_unsigned(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* int4 dot products without the sign trick: maddubs takes the stored nibbles q (unsigned) against
 * signed x directly (|q * x| pairs stay far below int16's limit), and the -8 offset comes off
 * afterwards as 8 * (sum of x), lane by lane: offset8(x) computed once per block of x. */
INLINE __m256i dot_q4u(__m256i q, __m256i x, __m256i x_offset) {
    __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
    return _mm256_sub_epi32(p32, x_offset);
}

INLINE __m256i offset8(__m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), x), _mm256_set1_epi16(1));
}

#define PACK_ROWS 4
#define PREFETCH_BYTES 1024

/* One row-major row (the tail rows). kind 0: int8 rows (row scale); kind 1: int4 groups of G. */
INLINE float row_dot(int kind, const void *w, const float *ws, long n, long K, long G, const int8_t *xq,
                     const float *xs) {
    long blocks = K / 32;
    __m256 acc = _mm256_setzero_ps();
    if (kind == 0) {
        const int8_t *wr = (const int8_t *)w + n * K;
        for (long b = 0; b < blocks; b++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8(wv, xv)), _mm256_set1_ps(xs[b]), acc);
        }
        return hsum(acc) * ws[n];
    }
    const uint8_t *wr = (const uint8_t *)w + n * (K / 2);
    const float *gs = ws + n * (K / G);
    int pg_shift = G >= 128 ? 2 : G == 64 ? 1 : 0;
    for (long b = 0; b < blocks; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
        __m256i dot = dot_q4u(unpack_q4_unsigned(wr + b * 16), xv, offset8(xv));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xs[b] * gs[b >> pg_shift]), acc);
    }
    return hsum(acc);
}

/* One block of 4 packed rows (starting at `blk`) against one row of x: four independent
 * accumulators. kind 0: int8, row scales; kind 1: int4, group scales; kind 2: int4 already
 * unpacked to one byte per stored nibble (same block order, 4 x 32 bytes per step), group scales.
 * gs: the block's group scales ([K / G][4]); `prefetch` asks for the lines PREFETCH_BYTES ahead. */
INLINE void rows4_dot(int kind, const uint8_t *blk, const float *ws, long n, const float *gs, long K, long G,
                      const int8_t *xq, const float *xs, int prefetch, float out[4]) {
    long blocks = K / 32;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int pg_shift = G >= 128 ? 2 : G == 64 ? 1 : 0;  /* blocks of 32 per group, as a shift: no division */
    long row_step = kind == 1 ? 16 : 32, step = PACK_ROWS * row_step;
    for (long b = 0; b < blocks; b++) {
        const uint8_t *p = blk + b * step;
        if (prefetch) {
            _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
            if (step > 64) _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, _MM_HINT_T0);
        }
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
        __m256i x_offset = kind == 0 ? _mm256_setzero_si256() : offset8(xv);  /* int4 only */
        for (int r = 0; r < 4; r++) {
            __m256i dot;
            if (kind == 0) dot = dot_s8(_mm256_loadu_si256((const __m256i *)(p + r * row_step)), xv);
            else if (kind == 1) dot = dot_q4u(unpack_q4_unsigned(p + r * row_step), xv, x_offset);
            else dot = dot_q4u(_mm256_loadu_si256((const __m256i *)(p + r * row_step)), xv, x_offset);
            float sc = kind == 0 ? xs[b] : xs[b] * gs[(b >> pg_shift) * PACK_ROWS + r];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sc), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum(acc[r]) * (kind == 0 ? ws[n + r] : 1.0f);
}

/* Rows [b, e) of the packed part (multiples of 4) for all M rows of x. */
INLINE void run(int kind, const int8_t *xq, const float *xs, const void *w, const float *ws, const float *bias,
                float *y, long M, long N, long K, long G, long b, long e) {
    long blocks = K / 32;
    long row_bytes = kind == 0 ? K : K / 2, groups = kind == 1 ? K / G : 0;
    /* int4 with several rows of x: unpack each block once (to L1) instead of once per row of x */
    int8_t *unpacked = (kind == 1 && M > 1) ? (int8_t *)malloc(PACK_ROWS * K) : 0;
    for (long n = b; n < e; n += PACK_ROWS) {
        const uint8_t *blk = (const uint8_t *)w + n * row_bytes;
        const float *gs = ws + n * groups;
        int use_kind = kind;
        if (unpacked) {
            for (long bb = 0; bb < blocks; bb++) {
                _mm_prefetch((const char *)blk + bb * 64 + PREFETCH_BYTES, _MM_HINT_T0);
                for (int r = 0; r < PACK_ROWS; r++)
                    _mm256_storeu_si256((__m256i *)(unpacked + (bb * PACK_ROWS + r) * 32), unpack_q4_unsigned(blk + bb * 64 + r * 16));
            }
            blk = (const uint8_t *)unpacked;
            use_kind = 2;
        }
        for (long m = 0; m < M; m++) {
            float out[4];
            if (use_kind == 0)
                rows4_dot(0, blk, ws, n, gs, K, G, xq + m * K, xs + m * blocks, m == 0, out);
            else if (use_kind == 1)
                rows4_dot(1, blk, ws, n, gs, K, G, xq + m * K, xs + m * blocks, m == 0, out);
            else
                rows4_dot(2, blk, ws, n, gs, K, G, xq + m * K, xs + m * blocks, 0, out);
            for (int r = 0; r < 4; r++) y[m * N + n + r] = out[r] + (bias ? bias[n + r] : 0.0f);
        }
    }
    free(unpacked);
}

/* kind: 0 = int8, 1 = int4. ws: int8 row scales [N] or int4 group scales (interleaved, see above). */
void anna_qgemm(const float *x, const void *w, const float *ws, int kind, long G, const float *bias, float *y,
                long M, long N, long K, int threads) {
    int8_t *xq = (int8_t *)malloc(M * K);
    float *xs = (float *)malloc(sizeof(float) * M * (K / 32));
    quantize_x(x, xq, xs, M, K);
    long packed = N / PACK_ROWS * PACK_ROWS;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long per = (N / PACK_ROWS + nt - 1) / nt;
        long b = t * per * PACK_ROWS, e = (t + 1) * per * PACK_ROWS;
        if (e > packed) e = packed;
        if (b < e) {
            if (kind == 0) run(0, xq, xs, w, ws, bias, y, M, N, K, G, b, e);
            else run(1, xq, xs, w, ws, bias, y, M, N, K, G, b, e);
        }
        if (t == nt - 1)
            for (long n = packed; n < N; n++)
                for (long m = 0; m < M; m++)
                    y[m * N + n] = row_dot(kind, w, ws, n, K, G, xq + m * K, xs + m * (K / 32)) + (bias ? bias[n] : 0.0f);
    }
    free(xq);
    free(xs);
}

/* Dequantize rows of packed weights (all N when rows is NULL, else the R listed) to fp32
 * row-major: the "dequant" strategy for large M, and embedding lookups. */
void anna_dequant(const void *w, const float *ws, int kind, long G, const long *rows, long R, long N, long K,
                  float *out, int threads) {
    long packed = N / PACK_ROWS * PACK_ROWS, groups = kind == 1 ? K / G : 0;
    #pragma omp parallel for num_threads(threads) if (R > 16)
    for (long i = 0; i < R; i++) {
        long n = rows ? rows[i] : i;
        int in_block = n < packed;
        long r = in_block ? n % PACK_ROWS : 0, first = in_block ? n - r : n;  /* the block's first row */
        long lanes = in_block ? PACK_ROWS : 1;  /* rows interleaved at this row's position */
        float *o = out + i * K;
        if (kind == 0) {
            const int8_t *base = (const int8_t *)w + first * K;
            for (long k = 0; k < K; k += 32) {
                const int8_t *p = base + k * lanes + r * 32;
                for (int j = 0; j < 32; j++) o[k + j] = p[j] * ws[n];
            }
        } else {
            const uint8_t *base = (const uint8_t *)w + first * (K / 2);
            const float *gs = ws + first * groups;
            for (long k = 0; k < K; k += 32) {
                const uint8_t *p = base + (k / 2) * lanes + r * 16;
                float s = gs[(k / G) * lanes + r];
                for (int j = 0; j < 16; j++) {
                    o[k + j] = (float)((p[j] & 0x0F) - 8) * s;
                    o[k + 16 + j] = (float)((p[j] >> 4) - 8) * s;
                }
            }
        }
    }
}
