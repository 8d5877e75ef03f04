/* Causal attention of a prompt chunk over its context, fp32: out[Tq, H, D] = softmax(q k^T *
 * scale, causal) v, with q [Tq, H, D] the last Tq of the Tk positions whose keys and values are
 * k, v [Tk, KV, D] (Tq = Tk: a prompt over itself; Tq < Tk: a chunk after a cached prefix), query
 * i seeing keys 0 .. Tk - Tq + i; each query head h reads KV head h / (H / KV) (grouped-query
 * attention). window > 0: a sliding window, query i sees only its last `window` keys (its own
 * included), as in Mistral's and Qwen2's sliding-window layers.
 *
 * Flash-attention's order of work: a work item is BQ positions of one KV head with all the G =
 * H / KV query heads that share it (BQ * G rows of q that read the same keys and values), and
 * walks the keys up to its last position in blocks of BK, keeping each row's running maximum,
 * sum and output (online softmax), so that no T x T score matrix exists. K is transposed once per
 * call ([KV][D][T], zero-padded to whole blocks), so that a block's scores are vector FMAs over
 * 16 keys at a time for 4 rows of q at once. Work items go to threads longest first (causal rows
 * differ in length). On a 2-core Zen 4 this ran 130-143 GFLOPS at 512-2,048 tokens, torch's SDPA
 * 59-120 in fp32 or bf16 (benchmarks/attention_bench.py --prefill).
 *
 * The scores and the exponentials are fp32 (exp8: ~2e-7 relative), so the result differs from an
 * exact softmax by rounding only.
 *
 * bf16 = 1 (a bf16 model on a CPU with AVX512-BF16; the avx512 levels' builds): q, k, v are rounded
 * to bf16 once and both products run on vdpbf16ps, two products per fp32 lane, twice the FMA's rate
 * on Zen 4: scores over pairs of head dimensions, q . k for 16 keys per instruction; the weighted
 * sum of V over pairs of keys, 16 output columns per instruction, with the probabilities rounded to
 * bf16 (as a bf16 SDPA rounds them before its second matmul). The running maximum, the
 * exponentials, the sums and the output stay fp32. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec_math.h"

#define BQ 8   /* positions per work item */
#define BK 64  /* keys per block */
#define ROWS_PER_TILE 4
#define KEYS_PER_TILE 16

static long min_l(long a, long b) { return a < b ? a : b; }

/* S[r][0..16) = q_r . kb[:, 0..16) for rows [r0, r0 + n) (n <= 4); kb: 16 keys' columns of a
 * transposed block, rows BK floats apart */
INLINE void score_tile(int n, const float *const *qr, const float *kb, long D, float *S, long r0) {
    __m256 acc[ROWS_PER_TILE][2];
    for (int i = 0; i < ROWS_PER_TILE; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (long d = 0; d < D; d++) {
        const float *kp = kb + d * BK;
        __m256 k0 = _mm256_loadu_ps(kp), k1 = _mm256_loadu_ps(kp + 8);
        for (int i = 0; i < n; i++) {
            __m256 b = _mm256_broadcast_ss(qr[i] + d);
            acc[i][0] = _mm256_fmadd_ps(b, k0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, k1, acc[i][1]);
        }
    }
    for (int i = 0; i < n; i++) {
        _mm256_storeu_ps(S + (r0 + i) * BK, acc[i][0]);
        _mm256_storeu_ps(S + (r0 + i) * BK + 8, acc[i][1]);
    }
}

/* o[0..8W) += sum over c < n of p[c] * v rows c (v_stride floats apart); W vectors in registers */
INLINE void add_weighted_cols(int W, float *o, const float *p, int n, const float *v, long v_stride) {
    __m256 acc[8];
    for (int j = 0; j < W; j++) acc[j] = _mm256_loadu_ps(o + 8 * j);
    for (int c = 0; c < n; c++) {
        __m256 b = _mm256_broadcast_ss(p + c);
        const float *vr = v + c * v_stride;
        for (int j = 0; j < W; j++) acc[j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(vr + 8 * j), acc[j]);
    }
    for (int j = 0; j < W; j++) _mm256_storeu_ps(o + 8 * j, acc[j]);
}

/* o[0..D) += sum over c < n of p[c] * v rows c, 64 columns at a time */
static void add_weighted_rows(float *o, const float *p, int n, const float *v, long v_stride, long D) {
    long d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) add_weighted_cols(8, o + d0, p, n, v + d0, v_stride);
    for (; d0 < D; d0 += 8) add_weighted_cols(1, o + d0, p, n, v + d0, v_stride);
}

#ifdef __AVX512F__
#define BF16_TARGET __attribute__((target("avx512bf16")))
#define PAIR(p) _mm512_set1_epi32(*(const int32_t *)(p)) /* two bf16 values, in every 32-bit lane */

/* S[r][0..BK) = q_r . the block's BK keys for rows [r0, r0 + n) (n <= 4). kb: the block as bf16
 * pairs, [D / 2][BK][2] (pair i of key c: its dimensions 2i, 2i + 1), so one vector holds 16 keys'
 * pairs; qr: rows of q in bf16. */
BF16_TARGET INLINE void score_tile_bf16(int n, const uint16_t *const *qr, const uint16_t *kb, long D, float *S,
                                        long r0) {
    __m512 acc[ROWS_PER_TILE][BK / 16];
    for (int i = 0; i < n; i++)
        for (int t = 0; t < BK / 16; t++) acc[i][t] = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 2) {
        __m512bh k[BK / 16];
        for (int t = 0; t < BK / 16; t++) k[t] = (__m512bh)_mm512_loadu_si512(kb + (d / 2 * BK + 16 * t) * 2);
        for (int i = 0; i < n; i++) {
            __m512bh qv = (__m512bh)PAIR(qr[i] + d);
            for (int t = 0; t < BK / 16; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], k[t], qv);
        }
    }
    for (int i = 0; i < n; i++)
        for (int t = 0; t < BK / 16; t++) _mm512_storeu_ps(S + (r0 + i) * BK + 16 * t, acc[i][t]);
}

/* O[r][d0 .. d0 + 16W) += sum over keys c in [c0, c1) (c0 even) of P[r][c] v_c, rows r < n (n <= 4).
 * P: bf16 rows BK apart, zero where a row does not see the key; vp: the block's values as bf16
 * pairs, [BK / 2][D][2] (pair j, column d: keys 2j and 2j + 1), so one vector is 16 columns of a
 * pair of keys. */
BF16_TARGET INLINE void weighted_tile_bf16(int n, int W, const uint16_t *P, long c0, long c1, const uint16_t *vp,
                                           long D, float *O, long d0) {
    __m512 acc[ROWS_PER_TILE][4];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < W; j++) acc[i][j] = _mm512_loadu_ps(O + i * D + d0 + 16 * j);
    for (long c = c0; c < c1; c += 2) {
        __m512bh v[4];
        for (int j = 0; j < W; j++) v[j] = (__m512bh)_mm512_loadu_si512(vp + (c / 2 * D + d0 + 16 * j) * 2);
        for (int i = 0; i < n; i++) {
            __m512bh pv = (__m512bh)PAIR(P + i * BK + c);
            for (int j = 0; j < W; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], v[j], pv);
        }
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < W; j++) _mm512_storeu_ps(O + i * D + d0 + 16 * j, acc[i][j]);
}

/* The tiles of rows [r0, r0 + n) over keys [c0, c1) of a block, 64 output columns at a time */
BF16_TARGET static void weighted_rows_bf16(int n, const uint16_t *P, long c0, long c1, const uint16_t *vp, long D,
                                           float *O) {
    long d0 = 0;
#define WEIGHTED_CASE(N)                                                                              \
    case N:                                                                                           \
        for (d0 = 0; d0 + 64 <= D; d0 += 64) weighted_tile_bf16(N, 4, P, c0, c1, vp, D, O, d0);      \
        for (; d0 < D; d0 += 16) weighted_tile_bf16(N, 1, P, c0, c1, vp, D, O, d0);                  \
        break;
    switch (n) { WEIGHTED_CASE(1) WEIGHTED_CASE(2) WEIGHTED_CASE(3) default: WEIGHTED_CASE(4) }
#undef WEIGHTED_CASE
}

BF16_TARGET static void score_rows_bf16(int n, const uint16_t *const *qr, const uint16_t *kb, long D, float *S,
                                        long r0) {
    switch (n) {
    case 1: score_tile_bf16(1, qr, kb, D, S, r0); break;
    case 2: score_tile_bf16(2, qr, kb, D, S, r0); break;
    case 3: score_tile_bf16(3, qr, kb, D, S, r0); break;
    default: score_tile_bf16(4, qr, kb, D, S, r0); break;
    }
}
#endif

/* K per head in transposed blocks, [KV][T / BK][D][BK] (zero-padded): a block is one contiguous
 * 16 KB at D = 64 (rows of a whole-T transpose, a power of two apart, would fall in the same cache
 * sets); V per head, [KV][T][D]. The threads share the (head, block) pairs. */
static void pack_fp32(const float *k, const float *v, float *kt, float *vh, long T, long KV, long D, long nkb) {
    long Tp = nkb * BK;
    #pragma omp for collapse(2) schedule(static)
    for (long g = 0; g < KV; g++)
        for (long b = 0; b < nkb; b++) {
            float *dst = kt + (g * nkb + b) * D * BK;
            for (long c = 0; c < BK; c++) {
                long t = b * BK + c;
                for (long d = 0; d < D; d++) dst[d * BK + c] = t < T ? k[(t * KV + g) * D + d] : 0.0f;
                if (t < T) memcpy(vh + (g * Tp + t) * D, v + (t * KV + g) * D, sizeof(float) * D);
            }
        }
}

/* The bf16 layouts (zero-padded to whole blocks): K per head and block as pairs of dimensions,
 * [KV][T / BK][D / 2][BK][2]; V per head as pairs of keys, [KV][T / 2][D][2]; q row by row. */
static void pack_bf16(const float *q, const float *k, const float *v, uint16_t *qh, uint16_t *kp, uint16_t *vp,
                      long Tq, long H, long T, long KV, long D, long nkb) {
    long Tp = nkb * BK;
    #pragma omp for collapse(2) schedule(static)
    for (long g = 0; g < KV; g++)
        for (long b = 0; b < nkb; b++) {
            uint16_t *kd = kp + (g * nkb + b) * D * BK, *vd = vp + (g * Tp + b * BK) * D;
            for (long c = 0; c < BK; c++) {
                long t = b * BK + c;
                for (long d = 0; d < D; d++) {
                    kd[(d / 2 * BK + c) * 2 + d % 2] = t < T ? to_bf16(k[(t * KV + g) * D + d]) : 0;
                    vd[(c / 2 * D + d) * 2 + c % 2] = t < T ? to_bf16(v[(t * KV + g) * D + d]) : 0;
                }
            }
        }
    #pragma omp for schedule(static)
    for (long i = 0; i < Tq * H * D; i += 8) store8_bf16(qh + i, _mm256_loadu_ps(q + i));  /* D % 16 == 0 */
}

/* D: a multiple of 8 (kernels.py routes other head sizes to torch); bf16 (see above) needs D a
 * multiple of 16 and the avx512 levels' build, and runs fp32 otherwise. */
void anna_causal_attention(const float *q, const float *k, const float *v, float *out, long Tq, long T, long H,
                           long KV, long D, float scale, long window, int bf16, int threads) {
    long G = H / KV, nqb = (Tq + BQ - 1) / BQ, nkb = (T + BK - 1) / BK, Tp = nkb * BK, offset = T - Tq;
#ifdef __AVX512F__
    bf16 = bf16 && D % 16 == 0;
#else
    bf16 = 0;
#endif
    float *kt = NULL, *vh = NULL;
    uint16_t *qh = NULL, *kp = NULL, *vp = NULL;  /* bf16: q, K, V rounded (pack_bf16) */
    if (bf16) {
        qh = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * Tq * H * D + 64);
        kp = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * KV * D * Tp);
        vp = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * KV * D * Tp);
    } else {
        kt = (float *)aligned_alloc(64, sizeof(float) * KV * D * Tp);
        vh = (float *)aligned_alloc(64, sizeof(float) * KV * D * Tp);
    }
    #pragma omp parallel num_threads(threads)
    {
        if (bf16)
            pack_bf16(q, k, v, qh, kp, vp, Tq, H, T, KV, D, nkb);
        else
            pack_fp32(k, v, kt, vh, T, KV, D, nkb);
        long max_rows = BQ * G;
        float *S = (float *)aligned_alloc(64, sizeof(float) * max_rows * BK);
        float *O = (float *)aligned_alloc(64, sizeof(float) * max_rows * D);
        uint16_t *P = bf16 ? (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * max_rows * BK) : NULL;  /* S's probabilities */
        float *row_max = (float *)malloc(sizeof(float) * max_rows), *row_sum = (float *)malloc(sizeof(float) * max_rows);
        long *row_lo = (long *)malloc(sizeof(long) * max_rows), *row_end = (long *)malloc(sizeof(long) * max_rows);
        const float **qr = (const float **)malloc(sizeof(float *) * (max_rows + ROWS_PER_TILE));
        const uint16_t **qbr = (const uint16_t **)malloc(sizeof(uint16_t *) * max_rows);
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < KV * nqb; item++) {
            long qb = nqb - 1 - item / KV, g = item % KV;  /* the longest rows first */
            long p0 = qb * BQ, np = min_l(BQ, Tq - p0), rows = np * G, end = offset + p0 + np;
            long first_key = window > 0 && offset + p0 >= window ? offset + p0 - window + 1 : 0;  /* the first row's */
            /* row r: query p0 + r / G (position offset + p0 + r / G), head g * G + r % G */
            for (long r = 0; r < rows; r++) {
                long row = (p0 + r / G) * H + g * G + r % G;
                qr[r] = q + row * D;
                if (bf16) qbr[r] = qh + row * D;
                row_max[r] = -INFINITY;
                row_sum[r] = 0.0f;
            }
            for (long r = rows; r < rows + ROWS_PER_TILE; r++) qr[r] = qr[rows - 1];
            memset(O, 0, sizeof(float) * rows * D);
            for (long c0 = first_key / BK * BK; c0 < end; c0 += BK) {
                long cols = min_l(BK, end - c0);
                long tiles = bf16 ? BK / KEYS_PER_TILE : (cols + KEYS_PER_TILE - 1) / KEYS_PER_TILE;
                for (long r0 = 0; r0 < rows; r0 += ROWS_PER_TILE) {
                    int n = (int)min_l(ROWS_PER_TILE, rows - r0);
#ifdef __AVX512F__
                    if (bf16) {
                        score_rows_bf16(n, qbr + r0, kp + (g * nkb + c0 / BK) * D * BK, D, S, r0);
                        continue;
                    }
#endif
                    const float *kb = kt + (g * nkb + c0 / BK) * D * BK;
                    for (long t = 0; t < tiles; t++) {
                        if (n == ROWS_PER_TILE)
                            score_tile(ROWS_PER_TILE, qr + r0, kb + t * KEYS_PER_TILE, D, S + t * KEYS_PER_TILE, r0);
                        else
                            score_tile(n, qr + r0, kb + t * KEYS_PER_TILE, D, S + t * KEYS_PER_TILE, r0);
                    }
                }
                long width = tiles * KEYS_PER_TILE;
                for (long r = 0; r < rows; r++) {
                    /* this row's keys in the block: [lo, valid), up to its position and within its window */
                    long pos = offset + p0 + r / G, valid = min_l(cols, pos - c0 + 1);
                    long lo = window > 0 && pos - window + 1 > c0 ? pos - window + 1 - c0 : 0;
                    row_lo[r] = lo, row_end[r] = valid;
                    if (valid <= lo) {
                        if (bf16) memset(P + r * BK, 0, sizeof(uint16_t) * BK);
                        continue;
                    }
                    float *s = S + r * BK;
                    for (long c = 0; c < lo; c++) s[c] = -INFINITY;
                    for (long c = valid; c < width; c++) s[c] = -INFINITY;
                    __m256 mx = _mm256_set1_ps(-INFINITY), sc = _mm256_set1_ps(scale);
                    for (long c = 0; c < width; c += 8) {
                        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + c), sc);
                        _mm256_storeu_ps(s + c, x);
                        mx = _mm256_max_ps(mx, x);
                    }
                    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
                    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                    float block_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
                    float new_max = block_max > row_max[r] ? block_max : row_max[r];
                    float alpha = expf(row_max[r] - new_max);  /* 0 at the first block (-inf) */
                    __m256 nm = _mm256_set1_ps(new_max), sum = _mm256_setzero_ps();
                    for (long c = 0; c < width; c += 8)
                        _mm256_storeu_ps(s + c, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), nm)));
                    for (long c = 0; c < lo; c++) s[c] = 0.0f;  /* (exp8 clamps -inf to ~1e-38) */
                    for (long c = valid; c < width; c++) s[c] = 0.0f;
                    for (long c = 0; c < width; c += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(s + c));
                    row_sum[r] = row_sum[r] * alpha + hsum(sum);
                    row_max[r] = new_max;
                    float *o = O + r * D;
                    if (alpha != 1.0f)
                        for (long d = 0; d < D; d++) o[d] *= alpha;
                    if (bf16)
                        for (long c = 0; c < width; c += 8) store8_bf16(P + r * BK + c, _mm256_loadu_ps(s + c));
                    else
                        add_weighted_rows(o, s + lo, (int)(valid - lo), vh + (g * Tp + c0 + lo) * D, D, D);
                }
#ifdef __AVX512F__
                if (bf16)  /* tiles of rows over the keys any of them sees (the others' P are 0) */
                    for (long r0 = 0; r0 < rows; r0 += ROWS_PER_TILE) {
                        int n = (int)min_l(ROWS_PER_TILE, rows - r0);
                        long c_lo = BK, c_end = 0;
                        for (long r = r0; r < r0 + n; r++)
                            if (row_end[r] > row_lo[r]) {
                                c_lo = min_l(c_lo, row_lo[r]);
                                c_end = row_end[r] > c_end ? row_end[r] : c_end;
                            }
                        if (c_end > c_lo)
                            weighted_rows_bf16(n, P + r0 * BK, c_lo & ~1L, (c_end + 1) & ~1L, vp + (g * Tp + c0) * D,
                                               D, O + r0 * D);
                    }
#endif
            }
            for (long r = 0; r < rows; r++) {
                float inv = 1.0f / row_sum[r], *dst = out + ((p0 + r / G) * H + g * G + r % G) * D;
                for (long d = 0; d < D; d++) dst[d] = O[r * D + d] * inv;
            }
        }
        free(S);
        free(O);
        free(P);
        free(row_max);
        free(row_sum);
        free(row_lo);
        free(row_end);
        free(qr);
        free(qbr);
    }
    free(kt);
    free(vh);
    free(qh);
    free(kp);
    free(vp);
}
