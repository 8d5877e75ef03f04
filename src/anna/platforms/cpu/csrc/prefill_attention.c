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
 * to bf16 once and both products run in bf16, two products per fp32 lane (twice the FMA's rate on
 * Zen 4), with the probabilities rounded to bf16 (as a bf16 SDPA rounds them before its second
 * matmul): transposed_attention below, on vdpbf16ps or on AMX tiles. The running maximum, the
 * exponentials, the sums and the output stay fp32. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
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

#ifdef __AVX512F__
/* Prompt attention in bf16, transposed: the same attention as above with both products in bf16,
 * on AMX tiles (TDPBF16PS; the amx level's build, emulated in the tests' build) or on vdpbf16ps
 * (the avx512 levels' builds, on CPUs with AVX512-BF16). On a 2-vCPU AMX Xeon the tiles (with
 * items of one head's 16 positions then) ran 1.4-2x torch's SDPA in bf16 (oneDNN's tiles) at
 * 64-2,048 tokens, without SDPA's fp32 <-> bf16 copies around it. On a 2-core Zen 4 vdpbf16ps in
 * this order ran 1.25-1.7x the same products in a kernel of rows (each row's softmax alone, with
 * horizontal sums) at 16-2,048 tokens: 319-329 GFLOPS at 2,048, 2.7x SDPA in bf16
 * (benchmarks/attention_bench.py --prefill).
 *
 * Transposed, so that a row's softmax bookkeeping is lane-wise: a work item is 16 rows of q that
 * read the same KV head (row r of KV head g: position r / G of query head g G + r % G, so a chunk of
 * one position still fills G lanes), and for each block of 64 keys the products give S^T = K Q^T,
 * one key per row of S^T and the 16 rows of q across it. The running maximum, sum and rescaling
 * are then vectors over the 16 rows (no horizontal reductions, no per-row branches); the
 * probabilities go back as P^T in the pair layout of both TDPBF16PS and vdpbf16ps (keys 2j, 2j + 1
 * of each row in one 32-bit lane), and O^T = V^T P^T. Packed once per call: K as bf16 rows per KV
 * head ([KV][Tp][D]) and V transposed ([KV][D][Tv]), zero-padded to whole blocks. The exponentials
 * are 2^x (exp2_neg), the scores scaled by scale * log2(e); the probabilities are rounded to bf16
 * for P V. Needs D a multiple of 16 (of 32 on tiles), at most T_MAX_DIM. */
#define BF16_TARGET __attribute__((target("avx512bf16")))
#define T_KEYS 64
#define T_ROWS 16
#define T_MAX_DIM 256

/* 2^x for x <= 0 (x < -200, -inf included, gives 0): x = n + f with n the nearest integer (adding
 * and subtracting 1.5 * 2^23 rounds it, on any FP port, where vrndscaleps takes two uops of one),
 * 2^f for |f| <= 1/2 a degree-5 polynomial fitted for relative error (~2.4e-7 in fp32, as exp16's) */
INLINE __m512 exp2_neg(__m512 x) {
    const __m512 round = _mm512_set1_ps(12582912.0f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
    __m512 n = _mm512_sub_ps(_mm512_add_ps(x, round), round), f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3276446843519807e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675533510744572e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092088699e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_scalef_ps(p, n);
}

/* fp32 a, b -> one vector of 16 bf16 pairs (a's in the low half of each lane), rounded to nearest
 * even: vcvtne2ps2bf16 and a shuffle where the CPU has AVX512-BF16 (hw: the vdpbf16ps products, or
 * the amx level's build), else in integer arithmetic (the emulated build's, which also runs on
 * AVX-512 CPUs without it; the same bits for finite values) */
BF16_TARGET INLINE __m512i bf16_pairs(__m512 a, __m512 b, const int hw) {
    if (hw) {
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i interleave = _mm512_or_si512(lane, _mm512_slli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), 16));
        return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    __m512i x = _mm512_castps_si512(a), y = _mm512_castps_si512(b), one = _mm512_set1_epi32(1),
            half = _mm512_set1_epi32(0x7FFF);
    x = _mm512_add_epi32(x, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(x, 16), one)));
    y = _mm512_add_epi32(y, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(y, 16), one)));
    return _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_and_si512(y, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* the scores x of key ``key`` for positions ``pos``, -inf (stored to ``dst``) where a position does
 * not see it: key > position, or, with a window, position - key >= window */
INLINE __m512 hide_keys(__m512 x, __m512i pos, long key, long window, float *dst) {
    const __m512i k = _mm512_set1_epi32((int)key);
    __mmask16 seen = _mm512_cmpge_epi32_mask(pos, k);
    if (window > 0) seen &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos, k), _mm512_set1_epi32((int)window));
    x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x);
    _mm512_store_ps(dst, x);
    return x;
}

static void pack_transposed(const float *k, const float *v, uint16_t *kh, uint16_t *vt, long T, long KV, long D,
                            long Tp, long Tv) {
    const __m512i keys = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(KV * D)));
    #pragma omp for collapse(2) schedule(static)
    for (long g = 0; g < KV; g++)
        for (long b = 0; b < Tp / T_ROWS; b++) {
            long t0 = b * T_ROWS;
            __mmask16 real = t0 >= T ? 0 : T - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (T - t0)) - 1);
            for (long t = t0; t < t0 + T_ROWS; t++)
                for (long d = 0; d < D; d += 16)
                    store16_bf16(kh + (g * Tp + t) * D + d, t < T ? _mm512_loadu_ps(k + (t * KV + g) * D + d)
                                                                  : _mm512_setzero_ps());
            for (long d = 0; d < D; d++)  /* 16 keys' value of dimension d */
                store16_bf16(vt + (g * D + d) * Tv + t0,
                             real ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, keys,
                                                             v + (t0 * KV + g) * D + d, 4)
                                  : _mm512_setzero_ps());
        }
}

#define PAIR(p) ((__m512bh)_mm512_set1_epi32(*(const int32_t *)(p))) /* two bf16 values, in every 32-bit lane */

/* S^T for keys [0, n) of a block (n <= 64, a multiple of 16): s[c][16 rows] = K row c . Q^T,
 * 16 keys at a time, each key's pair of dimensions broadcast against the 16 rows' pairs */
BF16_TARGET INLINE void dot_scores(const uint32_t *qt, const uint16_t *kb, long D, long n, float *s) {
    for (long c0 = 0; c0 < n; c0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        const uint16_t *kr = kb + c0 * D;
        for (long j = 0; j < D / 2; j++) {
            const __m512bh qv = (__m512bh)_mm512_load_si512(qt + j * T_ROWS);
            for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], qv, PAIR(kr + i * D + 2 * j));
        }
        for (int i = 0; i < 16; i++) _mm512_store_ps(s + (c0 + i) * T_ROWS, acc[i]);
    }
}

/* O^T = O^T alpha + V^T P^T over the first `pairs` pairs of the block's keys, 16 dimensions at a
 * time: each dimension's pair of values broadcast against the 16 rows' pairs of probabilities */
BF16_TARGET INLINE void dot_weighted(const uint32_t *pt, const uint16_t *vb, long Tv, long D, long pairs, __m512 alpha,
                                     float *o) {
    for (long d0 = 0; d0 < D; d0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(o + (d0 + i) * T_ROWS), alpha);
        const uint16_t *vr = vb + d0 * Tv;
        for (long j = 0; j < pairs; j++) {
            const __m512bh pv = (__m512bh)_mm512_load_si512(pt + j * T_ROWS);
            for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], pv, PAIR(vr + i * Tv + 2 * j));
        }
        for (int i = 0; i < 16; i++) _mm512_store_ps(o + (d0 + i) * T_ROWS, acc[i]);
    }
}

/* The transposed attention (see above); tiles: the products on AMX tiles, else on vdpbf16ps. */
BF16_TARGET INLINE void transposed_attention(const float *q, const float *k, const float *v, float *out, long Tq,
                                             long T, long H, long KV, long D, float scale, long window, int threads,
                                             const int tiles) {
    const long G = H / KV, offset = T - Tq, Tp = (T + T_KEYS - 1) / T_KEYS * T_KEYS;
    const long kv_rows = Tq * G, nrb = (kv_rows + T_ROWS - 1) / T_ROWS;  /* a KV head's rows of q, in items */
    /* V^T's rows are Tv keys apart, not Tp: at Tp = 2,048 16 rows 4 KB apart would all fall in one
     * L1 set (12 ways) and evict each other on every pass */
    const long Tv = Tp + 32;
#ifdef __AVX512BF16__
    const int hw = 1;
#else
    const int hw = !tiles;
#endif
    uint16_t *kh = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * KV * Tp * D);
    uint16_t *vt = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * KV * Tv * D);
    const float scale2 = scale * 1.44269504088896341f;  /* scores in log2 units: exp(x) = 2^(x log2 e) */
    #pragma omp parallel num_threads(threads)
    {
        pack_transposed(k, v, kh, vt, T, KV, D, Tp, Tv);
#if ANNA_AMX
        if (tiles) {
            amx_config cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 7; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  /* 0-3: C, 4-5: B, 6: A */
            AMX_LOAD_CONFIG(&cfg);
        }
#endif
        /* flush denormals: 2^x of a hidden key (-inf) or a far smaller score underflows, and each
         * vector with such a lane took a microcode assist (half the softmax's time on an AMX Xeon) */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        uint32_t qt[T_MAX_DIM / 2 * T_ROWS] __attribute__((aligned(64)));  /* Q^T: [D / 2][16] bf16 pairs */
        uint32_t pt[T_KEYS / 2 * T_ROWS] __attribute__((aligned(64)));     /* P^T: [32][16] bf16 pairs */
        float s[T_KEYS * T_ROWS] __attribute__((aligned(64)));             /* S^T: [64][16] */
        float o[T_MAX_DIM * T_ROWS] __attribute__((aligned(64)));          /* O^T: [D][16] */
        int32_t lane_pos[T_ROWS] __attribute__((aligned(64))), lane_row[T_ROWS] __attribute__((aligned(64)));
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < KV * nrb; item++) {
            /* rows r0 .. r0 + 16 of KV head g: row r is position r / G of query head g G + r % G */
            const long g = item % KV, r0 = (nrb - 1 - item / KV) * T_ROWS;  /* longest rows first */
            const long rows = kv_rows - r0 < T_ROWS ? kv_rows - r0 : T_ROWS;
            const long first = offset + r0 / G, last = offset + (r0 + rows - 1) / G;
            for (long i = 0; i < T_ROWS; i++) {  /* (lanes past the last row repeat it, unread and unwritten) */
                const long r = r0 + (i < rows ? i : rows - 1);
                lane_pos[i] = (int32_t)(offset + r / G);
                lane_row[i] = (int32_t)((r / G * H + g * G + r % G) * D);
            }
            const __mmask16 real = rows == T_ROWS ? 0xFFFF : (__mmask16)((1u << rows) - 1);
            const __m512i pos = _mm512_load_si512(lane_pos), row_offsets = _mm512_load_si512(lane_row);
            for (long j = 0; j < D / 2; j++)  /* dimensions 2j, 2j + 1 of the 16 rows */
                _mm512_store_si512(qt + j * T_ROWS, bf16_pairs(
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, row_offsets, q + 2 * j, 4),
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, row_offsets, q + 2 * j + 1, 4), hw));
            __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();  /* finite: no inf - inf */
            for (long d = 0; d < D; d++) _mm512_store_ps(o + d * T_ROWS, _mm512_setzero_ps());
            const long lo = window > 0 && first >= window ? first - window + 1 : 0;
            for (long c0 = lo / T_KEYS * T_KEYS; c0 <= last; c0 += T_KEYS) {
                const uint16_t *kb = kh + (g * Tp + c0) * D;
                /* the keys any of the positions sees end at `last`: in the block on the diagonal the
                 * vdpbf16ps products stop at the 16 keys (scores) and the pairs (P V) that hold it */
                const long seen = last - c0 + 1 < T_KEYS ? last - c0 + 1 : T_KEYS;
                if (!tiles) dot_scores(qt, kb, D, (seen + 15) / 16 * 16, s);
#if ANNA_AMX
                if (tiles) {
                    const long steps = D / 32;
                    AMX_ZERO(0); AMX_ZERO(1); AMX_ZERO(2); AMX_ZERO(3);  /* (tile numbers: constants) */
                    for (long st = 0; st < steps; st++) {
                        AMX_LOAD(4, qt + st * 16 * T_ROWS, 64);
                        AMX_LOAD(6, kb + 32 * st, D * 2); AMX_DPBF16PS(0, 6, 4);
                        AMX_LOAD(6, kb + 16 * D + 32 * st, D * 2); AMX_DPBF16PS(1, 6, 4);
                        AMX_LOAD(6, kb + 32 * D + 32 * st, D * 2); AMX_DPBF16PS(2, 6, 4);
                        AMX_LOAD(6, kb + 48 * D + 32 * st, D * 2); AMX_DPBF16PS(3, 6, 4);
                    }
                    AMX_STORE(0, s, 64); AMX_STORE(1, s + 16 * T_ROWS, 64);
                    AMX_STORE(2, s + 32 * T_ROWS, 64); AMX_STORE(3, s + 48 * T_ROWS, 64);
                }
#endif
                /* key c0 + c is visible to position p when c0 + c <= p and, with a window, p - (c0 + c) < window
                 * (the keys past `seen`, whose scores were not computed, are hidden here: c0 + seen > last) */
                const int masked = c0 + T_KEYS - 1 > first || (window > 0 && c0 <= last - window);
                /* the block's largest raw scores (scale2 > 0: the largest scaled ones too), and below the
                 * sums, in four registers each: the loops are unrolled by hand so that four independent
                 * chains are in flight (an array indexed by c % 4 would live in memory) */
                __m512 top0 = _mm512_set1_ps(-INFINITY), top1 = top0, top2 = top0, top3 = top0;
                for (long c = 0; c < T_KEYS; c += 4) {
                    __m512 x0 = _mm512_load_ps(s + c * T_ROWS), x1 = _mm512_load_ps(s + (c + 1) * T_ROWS),
                           x2 = _mm512_load_ps(s + (c + 2) * T_ROWS), x3 = _mm512_load_ps(s + (c + 3) * T_ROWS);
                    if (masked) {
                        x0 = hide_keys(x0, pos, c0 + c, window, s + c * T_ROWS);
                        x1 = hide_keys(x1, pos, c0 + c + 1, window, s + (c + 1) * T_ROWS);
                        x2 = hide_keys(x2, pos, c0 + c + 2, window, s + (c + 2) * T_ROWS);
                        x3 = hide_keys(x3, pos, c0 + c + 3, window, s + (c + 3) * T_ROWS);
                    }
                    top0 = _mm512_max_ps(top0, x0), top1 = _mm512_max_ps(top1, x1);
                    top2 = _mm512_max_ps(top2, x2), top3 = _mm512_max_ps(top3, x3);
                }
                const __m512 sc = _mm512_set1_ps(scale2);
                const __m512 m_new = _mm512_max_ps(m, _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(top0, top1),
                                                                                  _mm512_max_ps(top2, top3)), sc));
                const __m512 alpha = exp2_neg(_mm512_sub_ps(m, m_new));
                m = m_new;
                __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0, sum2 = sum0, sum3 = sum0;
                for (long c = 0; c < T_KEYS; c += 4) {  /* e = 2^(s scale2 - m); a hidden key's -inf gives 0 */
                    __m512 e0 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + c * T_ROWS), sc, m));
                    __m512 e1 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + (c + 1) * T_ROWS), sc, m));
                    __m512 e2 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + (c + 2) * T_ROWS), sc, m));
                    __m512 e3 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + (c + 3) * T_ROWS), sc, m));
                    sum0 = _mm512_add_ps(sum0, e0), sum1 = _mm512_add_ps(sum1, e1);
                    sum2 = _mm512_add_ps(sum2, e2), sum3 = _mm512_add_ps(sum3, e3);
                    _mm512_store_si512(pt + c / 2 * T_ROWS, bf16_pairs(e0, e1, hw));
                    _mm512_store_si512(pt + (c / 2 + 1) * T_ROWS, bf16_pairs(e2, e3, hw));
                }
                const __m512 sums = _mm512_add_ps(_mm512_add_ps(sum0, sum1), _mm512_add_ps(sum2, sum3));
                l = _mm512_fmadd_ps(l, alpha, sums);
                const uint16_t *vb = vt + g * D * Tv + c0;
                if (!tiles) dot_weighted(pt, vb, Tv, D, (seen + 1) / 2, alpha, o);
#if ANNA_AMX
                if (tiles) {
                    float pv[T_MAX_DIM * T_ROWS] __attribute__((aligned(64)));  /* the block's (P V)^T */
                    AMX_LOAD(4, pt, 64);
                    AMX_LOAD(5, pt + 16 * T_ROWS, 64);
#define AMX_PV_TILE(u)                                                                                 \
    AMX_ZERO(u);                                                                                        \
    AMX_LOAD(6, vb + (d0 + 16 * u) * Tv, Tv * 2); AMX_DPBF16PS(u, 6, 4);                               \
    AMX_LOAD(6, vb + (d0 + 16 * u) * Tv + 32, Tv * 2); AMX_DPBF16PS(u, 6, 5);                          \
    AMX_STORE(u, pv + (d0 + 16 * u) * T_ROWS, 64);
                    for (long d0 = 0; d0 < D; d0 += 32) {  /* 16 dimensions per C tile, two at a time */
                        AMX_PV_TILE(0)
                        AMX_PV_TILE(1)
                    }
#undef AMX_PV_TILE
                    for (long d = 0; d < D; d++)
                        _mm512_store_ps(o + d * T_ROWS, _mm512_fmadd_ps(_mm512_load_ps(o + d * T_ROWS), alpha,
                                                                        _mm512_load_ps(pv + d * T_ROWS)));
                }
#endif
            }
            const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
            for (long d = 0; d < D; d++)
                _mm512_mask_i32scatter_ps(out + d, real, row_offsets, _mm512_mul_ps(_mm512_load_ps(o + d * T_ROWS), inv), 4);
        }
#if ANNA_AMX
        if (tiles) AMX_RELEASE();
#endif
        _mm_setcsr(csr);  /* (the caller's thread keeps its own floating-point mode) */
    }
    free(kh);
    free(vt);
}

#if ANNA_AMX
BF16_TARGET static void tile_causal_attention(const float *q, const float *k, const float *v, float *out, long Tq,
                                              long T, long H, long KV, long D, float scale, long window, int threads) {
    transposed_attention(q, k, v, out, Tq, T, H, KV, D, scale, window, threads, 1);
}
#endif

BF16_TARGET static void dot_causal_attention(const float *q, const float *k, const float *v, float *out, long Tq,
                                             long T, long H, long KV, long D, float scale, long window, int threads) {
    transposed_attention(q, k, v, out, Tq, T, H, KV, D, scale, window, threads, 0);
}
#endif

/* D: a multiple of 8 (kernels.py routes other head sizes to torch); bf16 (the transposed kernel
 * above) needs D a multiple of 16, at most T_MAX_DIM, and the avx512 levels' build, and runs fp32
 * otherwise. */
void anna_causal_attention(const float *q, const float *k, const float *v, float *out, long Tq, long T, long H,
                           long KV, long D, float scale, long window, int bf16, int threads) {
    long G = H / KV, nqb = (Tq + BQ - 1) / BQ, nkb = (T + BK - 1) / BK, Tp = nkb * BK, offset = T - Tq;
#ifdef __AVX512F__
    if (bf16 && D % 16 == 0 && D <= T_MAX_DIM) {
#if ANNA_AMX
        if (D % 32 == 0) {
            tile_causal_attention(q, k, v, out, Tq, T, H, KV, D, scale, window, threads);
            return;
        }
#endif
        dot_causal_attention(q, k, v, out, Tq, T, H, KV, D, scale, window, threads);
        return;
    }
#else
    (void)bf16;  /* (the avx2 build has no bf16 products) */
#endif
    float *kt = (float *)aligned_alloc(64, sizeof(float) * KV * D * Tp);
    float *vh = (float *)aligned_alloc(64, sizeof(float) * KV * D * Tp);
    #pragma omp parallel num_threads(threads)
    {
        pack_fp32(k, v, kt, vh, T, KV, D, nkb);
        long max_rows = BQ * G;
        float *S = (float *)aligned_alloc(64, sizeof(float) * max_rows * BK);
        float *O = (float *)aligned_alloc(64, sizeof(float) * max_rows * D);
        float *row_max = (float *)malloc(sizeof(float) * max_rows), *row_sum = (float *)malloc(sizeof(float) * max_rows);
        const float **qr = (const float **)malloc(sizeof(float *) * (max_rows + ROWS_PER_TILE));
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < KV * nqb; item++) {
            long qb = nqb - 1 - item / KV, g = item % KV;  /* the longest rows first */
            long p0 = qb * BQ, np = min_l(BQ, Tq - p0), rows = np * G, end = offset + p0 + np;
            long first_key = window > 0 && offset + p0 >= window ? offset + p0 - window + 1 : 0;  /* the first row's */
            /* row r: query p0 + r / G (position offset + p0 + r / G), head g * G + r % G */
            for (long r = 0; r < rows; r++) {
                long row = (p0 + r / G) * H + g * G + r % G;
                qr[r] = q + row * D;
                row_max[r] = -INFINITY;
                row_sum[r] = 0.0f;
            }
            for (long r = rows; r < rows + ROWS_PER_TILE; r++) qr[r] = qr[rows - 1];
            memset(O, 0, sizeof(float) * rows * D);
            for (long c0 = first_key / BK * BK; c0 < end; c0 += BK) {
                long cols = min_l(BK, end - c0);
                long tiles = (cols + KEYS_PER_TILE - 1) / KEYS_PER_TILE;
                for (long r0 = 0; r0 < rows; r0 += ROWS_PER_TILE) {
                    int n = (int)min_l(ROWS_PER_TILE, rows - r0);
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
                    if (valid <= lo) continue;
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
                    add_weighted_rows(o, s + lo, (int)(valid - lo), vh + (g * Tp + c0 + lo) * D, D, D);
                }
            }
            for (long r = 0; r < rows; r++) {
                float inv = 1.0f / row_sum[r], *dst = out + ((p0 + r / G) * H + g * G + r % G) * D;
                for (long d = 0; d < D; d++) dst[d] = O[r * D + d] * inv;
            }
        }
        free(S);
        free(O);
        free(row_max);
        free(row_sum);
        free(qr);
    }
    free(kt);
    free(vh);
}
