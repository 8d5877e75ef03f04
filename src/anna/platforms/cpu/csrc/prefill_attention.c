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

#if ANNA_AMX && defined(__AVX512F__)
/* Prompt attention on AMX bf16 tiles (the amx level's build; emulated in the tests' build): the
 * same attention as above, with both products as TDPBF16PS tile products. On a 2-vCPU AMX Xeon
 * torch's SDPA in bf16 (oneDNN's tiles) ran 2-3x the vdpbf16ps kernel at 256-2,048 tokens, and
 * this ran 1.4-2x SDPA at 64-2,048 (benchmarks/attention_bench.py --prefill), without SDPA's
 * fp32 <-> bf16 copies around it.
 *
 * Transposed, so that a row's softmax bookkeeping is lane-wise: a work item is 16 positions of one
 * query head, and for each block of 64 keys the tiles give S^T = K Q^T, one key per tile row and
 * the 16 positions across it. The running maximum, sum and rescaling are then vectors over the 16
 * positions (no horizontal reductions, no per-row branches); the probabilities go back to the
 * tiles as P^T in TDPBF16PS's pair layout (keys 2j, 2j + 1 of each position in one 32-bit lane),
 * and O^T = V^T P^T. Packed once per call: K as bf16 rows per KV head ([KV][Tp][D]) and V
 * transposed ([KV][D][Tv]), zero-padded to whole blocks. The exponentials are 2^x (exp2_neg), the
 * scores scaled by scale * log2(e); the probabilities are rounded to bf16 for P V, as in the
 * vdpbf16ps kernel. Needs D a multiple of 32, at most AMX_MAX_DIM. */
#define AMX_KEYS 64
#define AMX_ROWS 16
#define AMX_MAX_DIM 256

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
 * even: vcvtne2ps2bf16 and a shuffle where the build has AVX512-BF16 (the amx level's), else in
 * integer arithmetic (the emulated build's; the same bits for finite values) */
INLINE __m512i bf16_pairs(__m512 a, __m512 b) {
#ifdef __AVX512BF16__
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i interleave = _mm512_or_si512(lane, _mm512_slli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), 16));
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
#else
    __m512i x = _mm512_castps_si512(a), y = _mm512_castps_si512(b), one = _mm512_set1_epi32(1),
            half = _mm512_set1_epi32(0x7FFF);
    x = _mm512_add_epi32(x, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(x, 16), one)));
    y = _mm512_add_epi32(y, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(y, 16), one)));
    return _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_and_si512(y, _mm512_set1_epi32((int)0xFFFF0000)));
#endif
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

static void amx_pack(const float *k, const float *v, uint16_t *kh, uint16_t *vt, long T, long KV, long D, long Tp,
                     long Tv) {
    const __m512i keys = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(KV * D)));
    #pragma omp for collapse(2) schedule(static)
    for (long g = 0; g < KV; g++)
        for (long b = 0; b < Tp / AMX_ROWS; b++) {
            long t0 = b * AMX_ROWS;
            __mmask16 real = t0 >= T ? 0 : T - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (T - t0)) - 1);
            for (long t = t0; t < t0 + AMX_ROWS; t++)
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

static void amx_causal_attention(const float *q, const float *k, const float *v, float *out, long Tq, long T,
                                 long H, long KV, long D, float scale, long window, int threads) {
    const long G = H / KV, offset = T - Tq, Tp = (T + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
    const long nqb = (Tq + AMX_ROWS - 1) / AMX_ROWS, steps = D / 32;
    /* V^T's rows are Tv keys apart, not Tp: at Tp = 2,048 a tile's 16 rows 4 KB apart would all fall
     * in one L1 set (12 ways) and evict each other on every load */
    const long Tv = Tp + 32;
    uint16_t *kh = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * KV * Tp * D);
    uint16_t *vt = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * KV * Tv * D);
    const float scale2 = scale * 1.44269504088896341f;  /* scores in log2 units: exp(x) = 2^(x log2 e) */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    #pragma omp parallel num_threads(threads)
    {
        amx_pack(k, v, kh, vt, T, KV, D, Tp, Tv);
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 7; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  /* 0-3: C, 4-5: B, 6: A */
        AMX_LOAD_CONFIG(&cfg);
        /* flush denormals: 2^x of a hidden key (-inf) or a far smaller score underflows, and each
         * vector with such a lane took a microcode assist (half the softmax's time on an AMX Xeon) */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        uint32_t qt[AMX_MAX_DIM / 2 * AMX_ROWS] __attribute__((aligned(64)));  /* Q^T: [D / 2][16] bf16 pairs */
        uint32_t pt[AMX_KEYS / 2 * AMX_ROWS] __attribute__((aligned(64)));    /* P^T: [32][16] bf16 pairs */
        float s[AMX_KEYS * AMX_ROWS] __attribute__((aligned(64)));            /* S^T: [64][16] */
        float pv[AMX_MAX_DIM * AMX_ROWS] __attribute__((aligned(64)));        /* a block's (P V)^T */
        float o[AMX_MAX_DIM * AMX_ROWS] __attribute__((aligned(64)));         /* O^T: [D][16] */
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < H * nqb; item++) {
            const long h = item % H, g = h / G, p0 = (nqb - 1 - item / H) * AMX_ROWS;  /* longest rows first */
            const long rows = Tq - p0 < AMX_ROWS ? Tq - p0 : AMX_ROWS, first = offset + p0, last = first + rows - 1;
            const __mmask16 real = rows == AMX_ROWS ? 0xFFFF : (__mmask16)((1u << rows) - 1);
            const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32((int)first));
            const __m512i row_offsets = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(H * D)));
            const float *qh = q + (p0 * H + h) * D;
            for (long j = 0; j < D / 2; j++)  /* dimensions 2j, 2j + 1 of the 16 positions */
                _mm512_store_si512(qt + j * AMX_ROWS, bf16_pairs(
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, row_offsets, qh + 2 * j, 4),
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, row_offsets, qh + 2 * j + 1, 4)));
            __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();  /* finite: no inf - inf */
            for (long d = 0; d < D; d++) _mm512_store_ps(o + d * AMX_ROWS, _mm512_setzero_ps());
            const long lo = window > 0 && first >= window ? first - window + 1 : 0;
            for (long c0 = lo / AMX_KEYS * AMX_KEYS; c0 <= last; c0 += AMX_KEYS) {
                const uint16_t *kb = kh + (g * Tp + c0) * D;
                AMX_ZERO(0); AMX_ZERO(1); AMX_ZERO(2); AMX_ZERO(3);  /* (tile numbers: constants) */
                for (long st = 0; st < steps; st++) {
                    AMX_LOAD(4, qt + st * 16 * AMX_ROWS, 64);
                    AMX_LOAD(6, kb + 32 * st, D * 2); AMX_DPBF16PS(0, 6, 4);
                    AMX_LOAD(6, kb + 16 * D + 32 * st, D * 2); AMX_DPBF16PS(1, 6, 4);
                    AMX_LOAD(6, kb + 32 * D + 32 * st, D * 2); AMX_DPBF16PS(2, 6, 4);
                    AMX_LOAD(6, kb + 48 * D + 32 * st, D * 2); AMX_DPBF16PS(3, 6, 4);
                }
                AMX_STORE(0, s, 64); AMX_STORE(1, s + 16 * AMX_ROWS, 64);
                AMX_STORE(2, s + 32 * AMX_ROWS, 64); AMX_STORE(3, s + 48 * AMX_ROWS, 64);
                /* key c0 + c is visible to position p when c0 + c <= p and, with a window, p - (c0 + c) < window */
                const int masked = c0 + AMX_KEYS - 1 > first || (window > 0 && c0 <= last - window);
                /* the block's largest raw scores (scale2 > 0: the largest scaled ones too), and below the
                 * sums, in four registers each: the loops are unrolled by hand so that four independent
                 * chains are in flight (an array indexed by c % 4 would live in memory) */
                __m512 top0 = _mm512_set1_ps(-INFINITY), top1 = top0, top2 = top0, top3 = top0;
                for (long c = 0; c < AMX_KEYS; c += 4) {
                    __m512 x0 = _mm512_load_ps(s + c * AMX_ROWS), x1 = _mm512_load_ps(s + (c + 1) * AMX_ROWS),
                           x2 = _mm512_load_ps(s + (c + 2) * AMX_ROWS), x3 = _mm512_load_ps(s + (c + 3) * AMX_ROWS);
                    if (masked) {
                        x0 = hide_keys(x0, pos, c0 + c, window, s + c * AMX_ROWS);
                        x1 = hide_keys(x1, pos, c0 + c + 1, window, s + (c + 1) * AMX_ROWS);
                        x2 = hide_keys(x2, pos, c0 + c + 2, window, s + (c + 2) * AMX_ROWS);
                        x3 = hide_keys(x3, pos, c0 + c + 3, window, s + (c + 3) * AMX_ROWS);
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
                for (long c = 0; c < AMX_KEYS; c += 4) {  /* e = 2^(s scale2 - m); a hidden key's -inf gives 0 */
                    __m512 e0 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + c * AMX_ROWS), sc, m));
                    __m512 e1 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + (c + 1) * AMX_ROWS), sc, m));
                    __m512 e2 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + (c + 2) * AMX_ROWS), sc, m));
                    __m512 e3 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(s + (c + 3) * AMX_ROWS), sc, m));
                    sum0 = _mm512_add_ps(sum0, e0), sum1 = _mm512_add_ps(sum1, e1);
                    sum2 = _mm512_add_ps(sum2, e2), sum3 = _mm512_add_ps(sum3, e3);
                    _mm512_store_si512(pt + c / 2 * AMX_ROWS, bf16_pairs(e0, e1));
                    _mm512_store_si512(pt + (c / 2 + 1) * AMX_ROWS, bf16_pairs(e2, e3));
                }
                const __m512 sums = _mm512_add_ps(_mm512_add_ps(sum0, sum1), _mm512_add_ps(sum2, sum3));
                l = _mm512_fmadd_ps(l, alpha, sums);
                AMX_LOAD(4, pt, 64);
                AMX_LOAD(5, pt + 16 * AMX_ROWS, 64);
                const uint16_t *vb = vt + g * D * Tv + c0;
#define AMX_PV_TILE(u)                                                                                 \
    AMX_ZERO(u);                                                                                        \
    AMX_LOAD(6, vb + (d0 + 16 * u) * Tv, Tv * 2); AMX_DPBF16PS(u, 6, 4);                               \
    AMX_LOAD(6, vb + (d0 + 16 * u) * Tv + 32, Tv * 2); AMX_DPBF16PS(u, 6, 5);                          \
    AMX_STORE(u, pv + (d0 + 16 * u) * AMX_ROWS, 64);
                for (long d0 = 0; d0 < D; d0 += 32) {  /* 16 dimensions per C tile, two at a time */
                    AMX_PV_TILE(0)
                    AMX_PV_TILE(1)
                }
#undef AMX_PV_TILE
                for (long d = 0; d < D; d++)
                    _mm512_store_ps(o + d * AMX_ROWS, _mm512_fmadd_ps(_mm512_load_ps(o + d * AMX_ROWS), alpha,
                                                                      _mm512_load_ps(pv + d * AMX_ROWS)));
            }
            const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
            float *dst = out + (p0 * H + h) * D;
            for (long d = 0; d < D; d++)
                _mm512_mask_i32scatter_ps(dst + d, real, row_offsets, _mm512_mul_ps(_mm512_load_ps(o + d * AMX_ROWS), inv), 4);
        }
        AMX_RELEASE();
        _mm_setcsr(csr);  /* (the caller's thread keeps its own floating-point mode) */
    }
    free(kh);
    free(vt);
}
#endif

/* D: a multiple of 8 (kernels.py routes other head sizes to torch); bf16 (see above) needs D a
 * multiple of 16 and the avx512 levels' build, and runs fp32 otherwise. */
void anna_causal_attention(const float *q, const float *k, const float *v, float *out, long Tq, long T, long H,
                           long KV, long D, float scale, long window, int bf16, int threads) {
    long G = H / KV, nqb = (Tq + BQ - 1) / BQ, nkb = (T + BK - 1) / BK, Tp = nkb * BK, offset = T - Tq;
#if ANNA_AMX && defined(__AVX512F__)
    if (bf16 && D % 32 == 0 && D <= AMX_MAX_DIM) {
        amx_causal_attention(q, k, v, out, Tq, T, H, KV, D, scale, window, threads);
        return;
    }
#endif
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
