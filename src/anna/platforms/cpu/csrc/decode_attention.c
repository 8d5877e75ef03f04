/* Decode attention over the paged KV cache (anna_paged_decode_attention), in every stored row
 * format of kv_format.h, and the TurboQuant query rotation it needs. A translation unit of its own
 * so that it compiles in parallel with the weight-streaming kernels (kernels.py builds the units
 * concurrently and links them). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kv_format.h"
#include "vec_math.h"
#include "work_split.h"

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

/* The largest of x[0 .. n - 1] (n >= 1). */
INLINE float tile_max(const float *x, long n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    long i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    float r = hmax8(m);
    for (; i < n; i++) r = fmaxf(r, x[i]);
    return r;
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

/* The next block's key rows into L2, once a block (from the eight positions that p starts, when
 * they are its first): a block's rows are one run, but a sequence's blocks lie anywhere in the
 * pool, so the hardware's prefetchers cannot see the next run coming (the value rows are asked for
 * into L2 while their keys are scored). On a 2-vCPU Zen 4 (benchmarks/attention_bench.py, fp32
 * KV from memory) 16 sequences ran 1.13-1.18x faster at 128 tokens, 1.18x at 1,024, 1.22x at
 * 4,096 (the avx2 level 1.14x, 1.20x, 1.26x); the whole block, not its first rows (1.07-1.08x) or
 * half (4% slower at 4,096); into L2, not L1 (1.05-1.09x). A context already in L3 pays for the
 * prefetches: one sequence of 512 tokens 0.97x. */
INLINE void prefetch_next_block(const uint8_t *cache, const PagedSeq *s, long p, long n) {
    if (s->shift < 0 || (p & (s->block_size - 1)) >= 8) return;
    long q = (p & ~(s->block_size - 1)) + s->block_size;  /* the next block's first position */
    if (q < n) prefetch_rows(paged_row(cache, s, q), n - q < s->block_size ? n - q : s->block_size, s->row_bytes,
                             _MM_HINT_T1);
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
 * scores of head g + h go to scores + h * len. */
INLINE void scores8_512(const float *qv, const float *const rows[8], int nh, long dim, float scale, float *out,
                        long len) {
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
        _mm256_storeu_ps(out + h * len, _mm256_mul_ps(hsum8(r), _mm256_set1_ps(scale)));
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
                          float *out, long len) {
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
    }
}

/* The stored rows of positions p .. p + 15 and their scales times `lscale`, asking for the sixteen
 * ROWS16_AHEAD positions on (up to n) meanwhile, and int8 rows into L2 ROWS16_AHEAD_L2 on. Rows
 * of one block are consecutive, so their addresses follow from the first and their fp16 scales
 * come in one gather (from two bytes before each, so that nothing past a row is read). */
#define ROWS16_AHEAD 32
/* int8 rows of 16 sequences from memory (benchmarks/attention_bench.py, 2-vCPU Zen 4): 1.06-1.13x
 * at 1,024 tokens and 1.08-1.20x at 4,096 over ROWS16_AHEAD alone, one sequence 1.12x at 8,192 and
 * 1.23x at 32,768; 128 positions ahead as fast, 256 1.03-1.07x. turboquant4 rows (34 bytes, bound
 * by their decoding) ran 0.94-1.00x with it, so they go without. */
#define ROWS16_AHEAD_L2 64
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
    q = p + ROWS16_AHEAD_L2;
    if (kind == KV_INT8 && q < n) prefetch_positions(cache, s, q, n - q < 16 ? n - q : 16, _MM_HINT_T1);
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
    float *scores = b->scores, *mx = b->mx, *sum = b->sum, *scratch = b->scratch;
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
        long p = t0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        for (; vnni && p + 16 <= t1; p += 16) {
            const uint8_t *rows[16];
            paged_rows16(kind, k_cache, seq, p, n, dim, lscale, rows, rowscale);
            prefetch_positions(v_cache, seq, p, 16, _MM_HINT_T1);
#define SCORES16(g, nh) scores16_vnni(kind, rows, rowscale, b->qi + (g) * dim, qscale + (g), qsum + (g), nh, dim, \
                                      scale, klut, scores + (g) * ATTN_TILE + p - t0, ATTN_TILE)
            HEAD_PASSES(group, VNNI_MAX_HEADS, SCORES16);
#undef SCORES16
        }
#endif
        /* eight positions at a time: one reduction for eight scores instead of one each */
        for (; dim % 8 == 0 && p + 8 <= t1; p += 8) {
            const float *kr[8];
            paged_rows8(kind, k_cache, seq, p, n, dim, lo, hi, scratch, kr);
            prefetch_next_block(k_cache, seq, p, n);
            for (int j = 0; j < 8; j++) prefetch_rows(paged_row(v_cache, seq, p + j), 1, seq->row_bytes, _MM_HINT_T1);
#ifdef __AVX512F__
            if (dim % 16 == 0) {
#define SCORES(g, nh) scores8_512(qv + (g) * dim, kr, nh, dim, scale, scores + (g) * ATTN_TILE + p - t0, ATTN_TILE)
                HEAD_PASSES(group, HEADS_PER_PASS, SCORES);
#undef SCORES
                continue;
            }
#endif
            for (long g = 0; g < group; g++)
                _mm256_storeu_ps(scores + g * ATTN_TILE + p - t0,
                                 _mm256_mul_ps(dot8(qv + g * dim, kr, dim), _mm256_set1_ps(scale)));
        }
        for (; p < t1; p++) {
            const float *kv = paged_row1(kind, k_cache, seq, p, dim, lo, hi, scratch);
            for (long g = 0; g < group; g++) scores[g * ATTN_TILE + p - t0] = dot(qv + g * dim, kv, dim) * scale;
        }
        /* the tile's weights against the running maximum; the sums so far rescaled where it grew. The
         * tile's maximum is taken here in one pass over its scores: kept up to date while scoring, it
         * cost 1.05-1.10x in the AVX2 loops (a horizontal maximum per eight positions and head). */
        for (long g = 0; g < group; g++) {
            float m = fmaxf(mx[g], tile_max(scores + g * ATTN_TILE, tl));
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

/* attend() for each stored row format, each a function of its own: inlined into one, the six took
 * the compiler most of the kernels' build time (its register passes grow faster than a function). */
typedef void (*AttendFn)(const AnnaKVFormat *, const float *, const uint8_t *, const uint8_t *, const PagedSeq *, long,
                         long, long, long, float, const AttendBuffers *, float *);
#define ATTEND_AS(K, NAME)                                                                                            \
    static __attribute__((noinline)) void NAME(const AnnaKVFormat *f, const float *qv, const uint8_t *k_cache,        \
                                               const uint8_t *v_cache, const PagedSeq *seq, long start, long n,       \
                                               long group, long dim, float scale, const AttendBuffers *b, float *o) { \
        attend(K, f, qv, k_cache, v_cache, seq, start, n, group, dim, scale, b, o);                                   \
    }
ATTEND_AS(KV_F32, attend_f32)
ATTEND_AS(KV_BF16, attend_bf16)
ATTEND_AS(KV_F16, attend_f16)
ATTEND_AS(KV_FP8, attend_fp8)
ATTEND_AS(KV_INT8, attend_int8)
ATTEND_AS(KV_TQ4, attend_tq4)
ATTEND_AS(KV_TQ3, attend_tq3)
#undef ATTEND_AS

static AttendFn attend_as(int kind) {
    switch (kind) {
    case KV_BF16: return attend_bf16;
    case KV_F16: return attend_f16;
    case KV_FP8: return attend_fp8;
    case KV_INT8: return attend_int8;
    case KV_TQ4: return attend_tq4;
    case KV_TQ3: return attend_tq3;
    default: return attend_f32;
    }
}

/* The first position a sequence of n tokens attends to: 0, or the start of its last `window`. */
static inline long attended_from(long n, long window) { return window > 0 && n > window ? n - window : 0; }

#define PART_MIN_POSITIONS 256  /* a context is cut into parts of at least this many positions */

/* The most positions of one KV head's context a job takes: the step's positions over all its
 * (sequence, KV head) pairs shared evenly among the threads, and at least PART_MIN_POSITIONS.
 * Longer contexts are cut into parts (flash decoding), so that one sequence of a model with two KV
 * heads, two jobs, does not leave all but two threads idle however long its context, nor one long
 * sequence beside short ones the threads that took the short ones. Where the pairs already share
 * evenly among the threads nothing is cut: two jobs a thread, for balance, ran 0.93-0.97x where one
 * each was there already (one sequence with two KV heads on 2 threads, 8K and 32K tokens); parts
 * of 128 positions ran 0.92x at 256 tokens, parts of 256 1.47x at 512 (one KV head on 2 threads;
 * benchmarks/attention_bench.py). */
static long part_positions(const long *ctx, long seqs, long kv_heads, long window, int threads) {
    long total = 0;
    for (long sq = 0; sq < seqs; sq++) total += (ctx[sq] - attended_from(ctx[sq], window)) * kv_heads;
    long even = (total + threads - 1) / threads;
    return even > PART_MIN_POSITIONS ? even : PART_MIN_POSITIONS;
}

/* Decode attention over a paged KV cache: one query token per sequence.
 * q, out: [seqs, heads, dim] fp32; caches: [blocks, kv_heads, block_size, row] with rows stored as
 * `f` says (NULL: fp32); tables: [seqs, table_width] block ids; ctx: tokens of each sequence (the new
 * one included); window > 0 limits attention to the last `window` tokens. One job per (sequence,
 * kv head, part of its context): each cached key and value row is read once for all the query heads
 * that share it (GQA). A context in several parts (part_positions) has each part's output and its
 * heads' running maxima and sums kept apart, then merged with the weights their maxima give. */
void anna_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const AnnaKVFormat *f,
                                 const long *tables, long table_width, const long *ctx, long seqs, long heads,
                                 long kv_heads, long dim, long block_size, long window, float scale, float *out,
                                 int threads) {
    long group = heads / kv_heads;
    int kind = f ? f->kind : KV_F32;
    long row_bytes = f ? f->row_bytes : dim * 4;
    int shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctzl(block_size) : -1;
    /* the jobs: first[sq] .. first[sq + 1] are sequence sq's, parts[sq] per KV head */
    long *parts = (long *)malloc(sizeof(long) * seqs), *first = (long *)malloc(sizeof(long) * (seqs + 1));
    first[0] = 0;
    long split = 0;  /* jobs with a partial output of their own: those up to the last cut context's */
    long most = part_positions(ctx, seqs, kv_heads, window, threads);
    for (long sq = 0; sq < seqs; sq++) {
        long n = ctx[sq], start = attended_from(n, window);
        parts[sq] = (n - start + most - 1) / most;
        first[sq + 1] = first[sq] + kv_heads * parts[sq];
        if (parts[sq] > 1) split = first[sq + 1];
    }
    long jobs = first[seqs];
    /* per job of a split context: its heads' normalized output, running maxima and sums */
    float *part_o = split ? (float *)malloc(sizeof(float) * split * group * dim) : 0;
    float *part_mx = split ? (float *)malloc(sizeof(float) * split * group) : 0;
    float *part_sum = split ? (float *)malloc(sizeof(float) * split * group) : 0;
    #pragma omp parallel num_threads(threads)
    {
        /* 64-byte aligned: decoded rows and sums are stored and reloaded in 512-bit vectors */
        long rows_bytes = (sizeof(float) * group * dim + 63) & ~63L;
        AttendBuffers b = {
            .scores = (float *)malloc(sizeof(float) * group * ATTN_TILE),
            .mx = (float *)malloc(sizeof(float) * group),
            .sum = (float *)malloc(sizeof(float) * group),
            .scratch = (float *)aligned_alloc(64, (sizeof(float) * 8 * dim + 63) & ~63L),
            .qr = (float *)aligned_alloc(64, rows_bytes),
            .acc = (float *)aligned_alloc(64, rows_bytes),
            .accq = (float *)aligned_alloc(64, rows_bytes),
            .qi = (int8_t *)malloc(group * dim),
        };
        #pragma omp for schedule(dynamic, 1)
        for (long job = 0; job < jobs; job++) {
            long sq = 0, hi = seqs - 1;  /* the sequence whose jobs hold `job`: first[sq] <= job < first[sq + 1] */
            while (sq < hi) {
                long mid = (sq + hi + 1) / 2;
                if (first[mid] <= job) sq = mid;
                else hi = mid - 1;
            }
            long np = parts[sq], kvh = (job - first[sq]) / np, part = (job - first[sq]) % np;
            long n = ctx[sq], start = attended_from(n, window);
            /* part `part` of [start, n), in whole tiles */
            long size = ((n - start + np - 1) / np + ATTN_TILE - 1) / ATTN_TILE * ATTN_TILE;
            long s0 = start + part * size, s1 = s0 + size < n ? s0 + size : n;
            const float *qv = q + (sq * heads + kvh * group) * dim;  /* the group's query heads, consecutive */
            float *o = np > 1 ? part_o + job * group * dim : out + (sq * heads + kvh * group) * dim;
            if (s0 >= s1) {  /* a part past the end: nothing to add */
                for (long g = 0; g < group; g++) {
                    part_mx[job * group + g] = -INFINITY;
                    part_sum[job * group + g] = 0.0f;
                }
                continue;
            }
            PagedSeq seq = {tables + sq * table_width, block_size, kv_heads, kvh, row_bytes, shift};
            const uint8_t *kc = (const uint8_t *)k_cache, *vc = (const uint8_t *)v_cache;
            attend_as(kind)(f, qv, kc, vc, &seq, s0, s1, group, dim, scale, &b, o);
            if (np > 1)
                for (long g = 0; g < group; g++) {
                    part_mx[job * group + g] = b.mx[g];
                    part_sum[job * group + g] = b.sum[g];
                }
        }
        /* each split (sequence, KV head): out = sum_i w_i o_i, w_i = sum_i e^(mx_i - M) / (the same over i) */
        #pragma omp for schedule(dynamic, 1)
        for (long pair = 0; pair < seqs * kv_heads; pair++) {
            long sq = pair / kv_heads, kvh = pair % kv_heads, np = parts[sq];
            if (np == 1) continue;
            long j0 = first[sq] + kvh * np;
            for (long g = 0; g < group; g++) {
                float m = -INFINITY, total = 0.0f;
                for (long i = 0; i < np; i++) m = fmaxf(m, part_mx[(j0 + i) * group + g]);
                for (long i = 0; i < np; i++) {
                    long at = (j0 + i) * group + g;
                    if (part_sum[at] > 0.0f) total += part_sum[at] * expf(part_mx[at] - m);
                }
                float *og = out + (sq * heads + kvh * group + g) * dim;
                for (long d = 0; d < dim; d++) og[d] = 0.0f;
                for (long i = 0; i < np; i++) {
                    long at = (j0 + i) * group + g;
                    if (part_sum[at] <= 0.0f) continue;
                    float w = part_sum[at] * expf(part_mx[at] - m) / total;
                    const float *oi = part_o + at * dim;
                    for (long d = 0; d < dim; d++) og[d] += w * oi[d];
                }
            }
        }
        free(b.scores);
        free(b.mx);
        free(b.sum);
        free(b.scratch);
        free(b.qr);
        free(b.acc);
        free(b.accq);
        free(b.qi);
    }
    free(parts);
    free(first);
    free(part_o);
    free(part_mx);
    free(part_sum);
}
