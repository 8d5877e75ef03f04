/* Weight-only quantized matmuls for CPU decode: y[M,N] = x[M,K] . dequant(W)[N,K]^T (+ bias).
 *
 * Weights: int8 with one fp32 scale per output row (G = 0) or one fp16 scale per group of G input
 * columns (a GGUF's Q8_0: G = 32), or int4 with one fp16 scale per group of G input columns
 * (symmetric, stored as q + 8 in a nibble). x is quantized on the fly to int8 in blocks
 * of 32 (one fp32 scale per block), so that dot products run on integer units (AVX2 maddubs), as
 * llama.cpp does; K must be a multiple of 32. One call reads each weight row once for all M rows
 * of x (a tile of rows stays in cache meanwhile). linear.py packs the tensors once, after loading.
 *
 * Both kinds are stored in "row lanes" (below), which the same tiles and drivers read; int8 simply
 * has 8 vectors per block and run (a row's 32 weights, 4 to a lane) where int4 has 4, and its row
 * scales (G = 0, fp32 [N]) are one vector per block. An int8 weight w is read as the unsigned byte
 * w + 128 (its bits with the top one flipped) where the dot products need an unsigned operand
 * (VNNI): a row's sum of a run then starts at -128 * sum(x), 16 times int4's start. The AVX2
 * build multiplies |w| by x carrying w's sign instead (maddubs on w + 128 would saturate).
 *
 * int4 layout ("row lanes"): rows in blocks of 8, one row per 32-bit lane of a vector. For each
 * run of 32 input columns k0..k0+31, a block holds 4 vectors of 32 bytes; in vector l, byte
 * 4j + i holds row j's weights k0 + 4l + i (low nibble) and k0 + 16 + 4l + i (high nibble).
 * maddubs of a vector's low nibbles against x[k0+4l .. +3] broadcast to every lane then yields
 * 8 rows' partial dot products at once, with no horizontal sums. A row's two int16 sums of a run
 * start at -8 x (the x values they take: see quantize_x_row), so that with the stored nibbles
 * q = w + 8 they end at the sum of w * x, at most 16 x 8 x 127 = 16,256 in size: the int16 adds
 * wrap, so that end value is exact whatever the partial sums did, and is widened once per run.
 * Blocks go in pairs ("units" of 16 rows, the kernels' unit of work) whose vectors alternate: per
 * run, vector 0 of the first block, vector 0 of the second, then vector 1 of each, and so on, so
 * that a unit is one contiguous stream in the order the kernels read it (read as two streams, one
 * per block, a 2-core Zen 4's int4 batch-1 decode ran 1.3-1.5x slower: benchmarks/decode_bench.py).
 * Group scales likewise: per unit and group, the first block's 8 scales, then the second's. A last
 * odd block of 8 rows stands alone (its 4 vectors in order, scales [K / G][8]). The last N % 8
 * rows are row-major: each run of 32 weights is 16 bytes, byte i holding weight i (low nibble) and
 * weight i + 16 (high nibble), scales [n][K / G]. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "vec_math.h"
#include "work_split.h"

/* Pins a value to a register at this point. Without it gcc re-associates the int4 kernel's int16
 * sums (adds the products together first), runs out of registers and keeps five of the eight sums
 * in memory, a load and a store per product in the inner loop (1.1-1.2x slower at M = 16). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))

/* Built for the avx512_vnni level (kernels.py: LEVEL_CFLAGS), the dot products run on vpdpbusd:
 * one instruction for 4 byte products summed into an int32 lane, where AVX2 needs maddubs (pairs
 * into int16) and an add or a madd. The integer sums are exact either way, so both builds give
 * the same bits. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ANNA_VNNI 1
#else
#define ANNA_VNNI 0
#endif

/* sum over the 32 lanes of a (signed) * b (signed) as 8 int32 lanes */
INLINE __m256i dot_s8(__m256i a, __m256i b) {
    __m256i ua = _mm256_sign_epi8(a, a), sb = _mm256_sign_epi8(b, a);
#if ANNA_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ua, sb);
#else
    __m256i p16 = _mm256_maddubs_epi16(ua, sb);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

/* acc + the products of 4-byte groups of u (unsigned) and s (signed): int16 pairs on AVX2 (the
 * int4 kernel's sums, which may wrap: see above), int32 quads with VNNI */
INLINE __m256i add_dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if ANNA_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

/* -8 * sum(x) of a run as one int32, from xo as quantize_x_row stores it (where a row's sums of
 * the run start): two int16 halves (AVX2's pairs), or one int32 (VNNI's quads add all four
 * positions). */
INLINE int32_t run_offset(int32_t xo) {
#if ANNA_VNNI
    return xo;
#else
    return (int32_t)(int16_t)(xo & 0xFFFF) + (int32_t)(int16_t)(xo >> 16);
#endif
}

/* The int32 dot products of a row's run from its sums */
INLINE __m256i run_dot(__m256i acc) {
#if ANNA_VNNI
    return acc;
#else
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
}

/* One row of x [K] fp32 -> xq [K] int8, xs [K/32] scales and xo [K/32], where the int4 kernels'
 * sums start: they take the stored nibbles q = w + 8 as they are, so a row's sum over a block
 * must start at -8 * sum(x). In the row-lanes kernel a row has two int16 sums, one taking the
 * block's x at positions 0, 1 (mod 4), the other at 2, 3; xo holds their two starts as int16
 * (low, high), so that it can be broadcast into the sums as it is. With VNNI a row has one int32
 * sum per run, and xo holds its start (a broadcast from memory, where unpacking the halves cost
 * vector instructions in every run of every row of x).
 * Rounds like lrintf(x / scale) (to nearest even), scale = max|x| / 127 per block of 32. */
static void quantize_x_row(const float *x, int8_t *xq, float *xs, int32_t *xo, long K) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* undo the packs' lane interleaving */
    for (long b = 0; b < K / 32; b++) {
        const float *src = x + b * 32;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(src + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
        __m256 mul = _mm256_set1_ps(id);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], mul));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * 32), _mm256_permutevar8x32_epi32(packed, order));
        /* lane j of `sum` adds positions j, j + 8, ...: lanes 0, 1, 4, 5 are positions 0, 1 (mod 4) */
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        __m128i pair = _mm_hadd_epi32(s4, s4);  /* the two sums, at most 16 x 127 in size */
        pair = _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(pair, 3));
        xs[b] = d;
#if ANNA_VNNI
        xo[b] = _mm_cvtsi128_si32(pair) + _mm_extract_epi32(pair, 1);
#else
        xo[b] = _mm_cvtsi128_si32(_mm_packs_epi32(pair, pair));  /* low int16, high int16 */
#endif
    }
}

/* 16 bytes -> 32 stored nibbles q (0..15, the weight is q - 8) */
INLINE __m256i unpack_q4_unsigned(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

#define LANE_ROWS 8   /* rows per block (one per 32-bit lane of a 256-bit vector) */
#define LANE_TILE_X 4 /* rows of x per tile (int4 and int8) */
#define LANE_TILE_X16 8 /* the same for the VNNI build's 16-row tiles (32 vector registers) */
#define X_BLOCK 64    /* rows of x per pass over a thread's weights (at K = 4864, 311 KB: in L2) */
#define LANE_BYTES 32 /* one vector of a block's run (8 rows x 4 bytes) */
#define UNIT_RUN_BYTES (8 * LANE_BYTES) /* int4: a unit's run of 32 columns (2 blocks x 4 vectors) */
#define S8_VECTORS 8  /* int8: vectors of a block's run of 32 columns (int4: 4) */
/* How far ahead the first pass over the weights asks for them: 4 KB measured 1.03-1.16x over 1 KB
 * for int4 at M = 1 (a 0.5B model's 24 layers, weights from memory), 1.2x for its lm_head. */
#define PREFETCH_BYTES 4096

/* int4: outputs of this size or more are written past the caches (non-temporal stores) where their
 * rows are whole cache lines (y 64-byte aligned, N a multiple of 16): no core's cache would keep
 * them until they are read, and a normal store first reads each line in from memory. On a 2-vCPU
 * Zen 4 (benchmarks/kernel_ab.py --quantization int4): the lm_head's logits at 16 rows (9.7 MB)
 * 1.08-1.13x (1.08x at the avx2 level), at 64 rows 1.04-1.05x; a prefill's gate_up at 128 and
 * 1,024 rows (5 and 40 MB) 1.02-1.03x; a 16-row step's gate_up (0.6 MB, read next from L2) stays
 * in the caches. */
#define STREAM_MIN_BYTES (4L << 20)

/* log2 of the runs of 32 columns per group (G = 32, 64, 128): a shift, not a division per run */
INLINE int group_shift(long G) { return G >= 128 ? 2 : G == 64 ? 1 : 0; }

/* int8: the scale applied to a row's whole sum: its own (G = 0), else 1 (each run had its group's) */
INLINE float s8_row_scale(const void *ws, long n, long G) { return G ? 1.0f : ((const float *)ws)[n]; }

/* Bytes of one weight row: kind 0 int8, kind 1 int4 */
INLINE long row_bytes(int kind, long K) { return kind ? K / 2 : K; }

/* The scales of the block or unit that starts at row n: int8's per row (fp32, G = 0), else the
 * group scales (fp16, in the blocks' layout) */
INLINE const void *unit_scales(int kind, const void *ws, long n, long K, long G) {
    return kind == 0 && !G ? (const void *)((const float *)ws + n) : (const void *)((const uint16_t *)ws + n * (K / G));
}

/* One row-major row (the tail rows). kind 0: int8 rows (row or group scales); kind 1: int4 groups of G. */
INLINE float row_dot(int kind, const void *w, const void *ws, long n, long K, long G, const int8_t *xq,
                     const float *xs, const int32_t *xo) {
    long blocks = K / 32;
    __m256 acc = _mm256_setzero_ps();
    if (kind == 0) {
        const int8_t *wr = (const int8_t *)w + n * K;
        const uint16_t *gs = (const uint16_t *)ws + (G ? n * (K / G) : 0);
        int gshift = group_shift(G);
        for (long b = 0; b < blocks; b++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            float sc = G ? xs[b] * _cvtsh_ss(gs[b >> gshift]) : xs[b];
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8(wv, xv)), _mm256_set1_ps(sc), acc);
        }
        return hsum(acc) * s8_row_scale(ws, n, G);
    }
    const uint8_t *wr = (const uint8_t *)w + n * (K / 2);
    const uint16_t *gs = (const uint16_t *)ws + n * (K / G);
    int gshift = group_shift(G);
    float offset = 0.0f;  /* sum over runs of scale * 8 * sum(x): the stored nibbles are w + 8 */
    for (long b = 0; b < blocks; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(unpack_q4_unsigned(wr + b * 16), xv), _mm256_set1_epi16(1));
        float scale = xs[b] * _cvtsh_ss(gs[b >> gshift]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc);
        offset -= (float)run_offset(xo[b]) * scale;
    }
    return hsum(acc) - offset;
}

/* TW blocks' TM output rows of 8; a unit's 16 outputs of a row (one whole line) are written past
 * the caches when `stream` (STREAM_MIN_BYTES) */
INLINE void store_rows8(int TW, int TM, __m256 accf[2][LANE_TILE_X], float *y, long ystride, int stream) {
    if (stream && TW == 2)
        for (int m = 0; m < TM; m++) {
            _mm256_stream_ps(y + m * ystride, accf[0][m]);
            _mm256_stream_ps(y + m * ystride + 8, accf[1][m]);
        }
    else
        for (int t = 0; t < TW; t++)
            for (int m = 0; m < TM; m++) _mm256_storeu_ps(y + m * ystride + t * 8, accf[t][m]);
}

/* Ask for a run's weights: `prefetch`, PREFETCH_BYTES on in the tile's own stream, into L1;
 * `next` (bytes; 0: none), the next unit's run, into L2 (it is read a tile later) */
INLINE void prefetch_run(const char *p, long run, int prefetch, long next) {
    if (prefetch)
        for (long off = 0; off < run; off += 64) _mm_prefetch(p + off + PREFETCH_BYTES, _MM_HINT_T0);
    if (next)
        for (long off = 0; off < run; off += 64) _mm_prefetch(p + off + next, _MM_HINT_T1);
}

/* int4: a unit (TW = 2) or a lone block (TW = 1) of 8 rows each (w; its scales gs; its bias or
 * NULL) against TM rows of x, into y (TM rows of stride ystride, 8 * TW columns). Block t's vector
 * l of run b is at b * run + l * TW * LANE_BYTES + t * LANE_BYTES (the layout above).
 * `prefetch`, `next`: what the tile asks for ahead (prefetch_run, next_unit). */
INLINE void lane_tile(int TW, int TM, const uint8_t *w, const uint16_t *gs, const float *bias, const int8_t *xq,
                      const float *xs, const int32_t *xo, long K, long G, float *y, long ystride, int prefetch,
                      long next, int stream) {
    long blocks = K / 32;
    int gshift = group_shift(G);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const long run = 4 * TW * LANE_BYTES;  /* bytes of one run of 32 columns */
    __m256 accf[2][LANE_TILE_X];
    for (int t = 0; t < TW; t++)
        for (int m = 0; m < TM; m++) accf[t][m] = bias ? _mm256_loadu_ps(bias + t * 8) : _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256i acc[2][LANE_TILE_X];  /* sums of this run, starting at xo (see above) */
        for (int m = 0; m < TM; m++) {
            __m256i start = _mm256_set1_epi32(xo[m * blocks + b]);  /* as the sums hold it */
            for (int t = 0; t < TW; t++) acc[t][m] = start;
        }
        prefetch_run((const char *)(w + b * run), run, prefetch, next);
        /* Not unrolled: unrolled, gcc computes every product first and spills them all. */
        _Pragma("GCC unroll 1") for (int l = 0; l < 4; l++) {
            if (TM == 1) {  /* few sums: both nibbles of a load at once */
                const int8_t *xp = xq + b * 32 + 4 * l;
                __m256i xlo = _mm256_set1_epi32(*(const int32_t *)xp), xhi = _mm256_set1_epi32(*(const int32_t *)(xp + 16));
                for (int t = 0; t < TW; t++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(w + b * run + (l * TW + t) * LANE_BYTES));
                    acc[t][0] = add_dot_u8s8(acc[t][0], _mm256_and_si256(v, low), xlo);
                    acc[t][0] = add_dot_u8s8(acc[t][0], _mm256_and_si256(_mm256_srli_epi16(v, 4), low), xhi);
                }
                continue;
            }
            /* the low nibbles against every row of x, then the high nibbles: the sums, 2 weight
             * vectors, x and a product fit in the 16 registers */
            for (int half = 0; half < 2; half++) {
                __m256i wv[2];
                for (int t = 0; t < TW; t++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(w + b * run + (l * TW + t) * LANE_BYTES));
                    wv[t] = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, low);
                }
                for (int m = 0; m < TM; m++) {
                    __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xq + m * K + b * 32 + 4 * l + 16 * half));
                    for (int t = 0; t < TW; t++) {
                        acc[t][m] = add_dot_u8s8(acc[t][m], wv[t], xv);
                        KEEP_IN_REGISTER(acc[t][m]);
                    }
                }
            }
        }
        for (int t = 0; t < TW; t++) {
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gs + ((b >> gshift) * TW + t) * LANE_ROWS)));
            for (int m = 0; m < TM; m++) {
                __m256i dot = run_dot(acc[t][m]);
                accf[t][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(xs[m * blocks + b])),
                                             accf[t][m]);
            }
        }
    }
    store_rows8(TW, TM, accf, y, ystride, stream);
}

/* int8, the counterpart of lane_tile: TW blocks of 8 rows against TM rows of x. ws: the unit's
 * row scales (fp32, G = 0), applied with the bias once the runs are summed, or its group scales
 * (fp16, laid out as int4's), applied per run. The int32 sums and fp32 operations are
 * lane_tile16_s8's, so both builds give the same bits. */
INLINE void lane_tile_s8(int TW, int TM, const int8_t *w, const void *ws, long G, const float *bias,
                         const int8_t *xq, const float *xs, long K, float *y, long ystride, int prefetch, long next,
                         int stream) {
    long blocks = K / 32;
    int gshift = group_shift(G);
    const long run = S8_VECTORS * TW * LANE_BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 accf[2][LANE_TILE_X];
    for (int t = 0; t < TW; t++)
        for (int m = 0; m < TM; m++) accf[t][m] = G && bias ? _mm256_loadu_ps(bias + t * 8) : _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256i acc[2][LANE_TILE_X];
        for (int t = 0; t < TW; t++)
            for (int m = 0; m < TM; m++) acc[t][m] = _mm256_setzero_si256();
        prefetch_run((const char *)(w + b * run), run, prefetch, next);
        _Pragma("GCC unroll 1") for (int l = 0; l < S8_VECTORS; l++) {
            __m256i wv[2], aw[2];
            for (int t = 0; t < TW; t++) {
                wv[t] = _mm256_loadu_si256((const __m256i *)(w + b * run + (l * TW + t) * LANE_BYTES));
                aw[t] = _mm256_sign_epi8(wv[t], wv[t]);
            }
            for (int m = 0; m < TM; m++) {
                __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xq + m * K + b * 32 + 4 * l));
                for (int t = 0; t < TW; t++) {  /* |w| times x with w's sign: pairs at most 2 x 127 x 127 */
                    __m256i pairs = _mm256_maddubs_epi16(aw[t], _mm256_sign_epi8(xv, wv[t]));
                    acc[t][m] = _mm256_add_epi32(acc[t][m], _mm256_madd_epi16(pairs, ones));
                    KEEP_IN_REGISTER(acc[t][m]);
                }
            }
        }
        for (int t = 0; t < TW; t++) {
            __m256 scale = G ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)ws +
                                                                                  ((b >> gshift) * TW + t) * LANE_ROWS)))
                             : _mm256_setzero_ps();
            for (int m = 0; m < TM; m++) {
                __m256 sx = _mm256_set1_ps(xs[m * blocks + b]);
                accf[t][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][m]), G ? _mm256_mul_ps(scale, sx) : sx, accf[t][m]);
            }
        }
    }
    if (!G)
        for (int t = 0; t < TW; t++) {
            __m256 rs = _mm256_loadu_ps((const float *)ws + t * 8);
            __m256 bv = bias ? _mm256_loadu_ps(bias + t * 8) : _mm256_setzero_ps();
            for (int m = 0; m < TM; m++) accf[t][m] = _mm256_fmadd_ps(accf[t][m], rs, bv);
        }
    store_rows8(TW, TM, accf, y, ystride, stream);
}

#if ANNA_VNNI
/* A unit's 16 group scales (fp16, in the blocks' layout) for run b */
INLINE __m512 run_scales16(const void *ws, long b, int gshift) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)ws + (b >> gshift) * 2 * LANE_ROWS)));
}

/* int8 with a scale per row: the unit's 16 row scales (fp32) times the summed runs, plus the bias */
INLINE void apply_row_scales16(__m512 *accf, int TM, const void *ws, const float *bias) {
    __m512 rs = _mm512_loadu_ps((const float *)ws), bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int m = 0; m < TM; m++) accf[m] = _mm512_fmadd_ps(accf[m], rs, bv);
}

/* A 16-row tile's TM output rows of 16, written past the caches when `stream` (STREAM_MIN_BYTES) */
INLINE void store_rows16(float *y, long ystride, const __m512 *accf, int TM, int stream) {
    if (stream)
        for (int m = 0; m < TM; m++) _mm512_stream_ps(y + m * ystride, accf[m]);
    else
        for (int m = 0; m < TM; m++) _mm512_storeu_ps(y + m * ystride, accf[m]);
}

/* int4, AVX-512 VNNI: lane_tile for a unit, its two blocks' vector l in one 512-bit vector (the
 * first block in the low half), so each instruction serves 16 rows; the int32 sums, the fp32
 * operations and their order are lane_tile's, so the bits are too. */
INLINE void lane_tile16(int TM, const uint8_t *w, const uint16_t *gs, const float *bias, const int8_t *xq,
                        const float *xs, const int32_t *xo, long K, long G, float *y, long ystride, int prefetch,
                        long next, int stream) {
    long blocks = K / 32;
    int gshift = group_shift(G);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 accf[LANE_TILE_X16];
    for (int m = 0; m < TM; m++) accf[m] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i acc[LANE_TILE_X16];
        for (int m = 0; m < TM; m++)
            acc[m] = _mm512_set1_epi32(xo[m * blocks + b]);
        prefetch_run((const char *)(w + b * UNIT_RUN_BYTES), UNIT_RUN_BYTES, prefetch, next);
        _Pragma("GCC unroll 1") for (int l = 0; l < 4; l++) {
            __m512i v = _mm512_loadu_si512(w + b * UNIT_RUN_BYTES + l * 2 * LANE_BYTES);
            __m512i vlo = _mm512_and_si512(v, low), vhi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int m = 0; m < TM; m++) {
                const int8_t *xp = xq + m * K + b * 32 + 4 * l;
                acc[m] = _mm512_dpbusd_epi32(acc[m], vlo, _mm512_set1_epi32(*(const int32_t *)xp));
                acc[m] = _mm512_dpbusd_epi32(acc[m], vhi, _mm512_set1_epi32(*(const int32_t *)(xp + 16)));
            }
        }
        __m512 scale = run_scales16(gs, b, gshift);
        for (int m = 0; m < TM; m++)
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(scale, _mm512_set1_ps(xs[m * blocks + b])),
                                      accf[m]);
    }
    store_rows16(y, ystride, accf, TM, stream);
}
/* int8, AVX-512 VNNI: lane_tile_s8 for a unit, its two blocks' vector l in one 512-bit vector,
 * read as w + 128 against x, so each vpdpbusd serves 16 rows; the sums start at -128 * sum(x). */
INLINE void lane_tile16_s8(int TM, const int8_t *w, const void *ws, long G, const float *bias, const int8_t *xq,
                           const float *xs, const int32_t *xo, long K, float *y, long ystride, int prefetch,
                           long next, int stream) {
    long blocks = K / 32;
    int gshift = group_shift(G);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const long run = 2 * S8_VECTORS * LANE_BYTES;
    __m512 accf[LANE_TILE_X16];
    for (int m = 0; m < TM; m++) accf[m] = G && bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i acc[LANE_TILE_X16];
        for (int m = 0; m < TM; m++) acc[m] = _mm512_set1_epi32(16 * xo[m * blocks + b]);
        prefetch_run((const char *)(w + b * run), run, prefetch, next);
        _Pragma("GCC unroll 1") for (int l = 0; l < S8_VECTORS; l++) {
            __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w + b * run + l * 2 * LANE_BYTES), flip);
            for (int m = 0; m < TM; m++)
                acc[m] = _mm512_dpbusd_epi32(acc[m], v, _mm512_set1_epi32(*(const int32_t *)(xq + m * K + b * 32 + 4 * l)));
        }
        __m512 scale = G ? run_scales16(ws, b, gshift) : _mm512_setzero_ps();
        for (int m = 0; m < TM; m++) {
            __m512 sx = _mm512_set1_ps(xs[m * blocks + b]);
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), G ? _mm512_mul_ps(scale, sx) : sx, accf[m]);
        }
    }
    if (!G) apply_row_scales16(accf, TM, ws, bias);
    store_rows16(y, ystride, accf, TM, stream);
}
#endif

#if ANNA_AMX
#if !ANNA_VNNI
#error "the AMX path is built on the avx512_vnni level's flags (kernels.py: LEVEL_CFLAGS)"
#endif
/* int4 and int8 on AMX int8 tiles (the amx level; amx_tiles.h). Per run of 32 input columns, one
 * tile multiply takes 16 rows of x (tile A: x quantized to int8, signed) times a unit's 16 weight
 * rows (tile B) into 16 x 16 int32 sums (tile C). A unit's row lanes are already B's layout (4
 * consecutive columns of each row side by side): for int8 a unit's run is B as it is, 8 rows of
 * 64 bytes (vector l of both blocks), multiplied signed by signed (TDPBSSD), with no copy; for int4
 * B's row l < 4 is vector l's low nibbles of both blocks, its row 4 + l their high nibbles, the
 * stored q = w + 8 unsigned (TDPBSUD), unpacked once per unit and pass. Each run has its own
 * scales, so C is stored and scaled after every run (32 columns: half a tile's depth), starting
 * from where lane_tile16's (int4) or lane_tile16_s8's (int8) sums would end up and in their fp32
 * operations, so both paths give the same bits. The A tile reads 16 rows of x: qgemm_groups pads
 * xq for the last, short tile. */
#define AMX_ROWS 16       /* rows of x per tile; fewer rows of x run lane_tile16 */
#define AMX_X_BLOCK 128   /* rows of x per pass over a thread's units (not measured on an AMX CPU yet) */
#define AMX_RUN_BYTES 512 /* one run's B tile: 8 rows of 64 bytes */
#define AMX_C 0           /* tile registers (numbers, not an enum: the instructions name them in their text) */
#define AMX_A 1
#define AMX_B 2

static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    cfg.rows[AMX_C] = AMX_ROWS, cfg.colsb[AMX_C] = 64;  /* 16 x 16 int32 */
    cfg.rows[AMX_A] = AMX_ROWS, cfg.colsb[AMX_A] = 32;  /* 16 rows of x x 32 int8 */
    cfg.rows[AMX_B] = 8, cfg.colsb[AMX_B] = 64;         /* 8 groups of 4 columns x 16 weight rows x 4 */
    AMX_LOAD_CONFIG(&cfg);
}

/* An int4 unit's weights (two blocks of 8 rows) as B tiles, [K / 32][8][64] */
static void amx_unpack_unit(const uint8_t *w, long K, uint8_t *tiles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (long b = 0; b < K / 32; b++)
        for (int l = 0; l < 4; l++) {
            __m512i v = _mm512_loadu_si512(w + b * UNIT_RUN_BYTES + l * 2 * LANE_BYTES);
            _mm512_store_si512(tiles + b * AMX_RUN_BYTES + l * 64, _mm512_and_si512(v, low));
            _mm512_store_si512(tiles + b * AMX_RUN_BYTES + (l + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

/* TM (<= 16) rows of x times a unit whose B tiles are `tiles` (kind 1: int4, unpacked; kind 0:
 * int8, the unit's own runs), with the unit's scales `ws` (as run_lanes passes them) and bias:
 * lane_tile16's or lane_tile16_s8's result, stored as they do */
INLINE void amx_tile16(int kind, int TM, const uint8_t *tiles, const void *ws, const float *bias, const int8_t *xq,
                       const float *xs, const int32_t *xo, long K, long G, float *y, long ystride, int stream) {
    long blocks = K / 32;
    int gshift = group_shift(G);
    int row_scales = kind == 0 && !G;  /* int8 with a scale per row: applied with the bias at the end */
    int32_t sums[AMX_ROWS][16] __attribute__((aligned(64)));
    __m512 accf[AMX_ROWS];
    for (int m = 0; m < TM; m++) accf[m] = bias && !row_scales ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        AMX_LOAD(AMX_B, tiles + b * AMX_RUN_BYTES, 64);
        AMX_LOAD(AMX_A, xq + b * 32, K);
        AMX_ZERO(AMX_C);
        if (kind)
            AMX_DPBSUD(AMX_C, AMX_A, AMX_B);
        else
            AMX_DPBSSD(AMX_C, AMX_A, AMX_B);
        AMX_STORE(AMX_C, sums, 64);
        __m512 scale = row_scales ? _mm512_setzero_ps() : run_scales16(ws, b, gshift);
        for (int m = 0; m < TM; m++) {
            __m512i acc = _mm512_load_si512(sums[m]);  /* int8: the sum of w x, where the lanes' sums end */
            if (kind) acc = _mm512_add_epi32(_mm512_set1_epi32(xo[m * blocks + b]), acc);
            __m512 sx = _mm512_set1_ps(xs[m * blocks + b]);
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), row_scales ? sx : _mm512_mul_ps(scale, sx), accf[m]);
        }
    }
    if (row_scales) apply_row_scales16(accf, TM, ws, bias);
    store_rows16(y, ystride, accf, TM, stream);
}

/* Units [u0, u1) of kind 0 (int8) or 1 (int4) on tiles for all M rows of x; an int4 unit's B
 * tiles are unpacked once per AMX_X_BLOCK rows of x and serve all of them. */
static void run_amx(int kind, const int8_t *xq, const float *xs, const int32_t *xo, const void *w, const void *ws,
                    const float *bias, float *y, long M, long N, long K, long G, long u0, long u1, int stream) {
    long unit = 2 * LANE_ROWS, blocks = K / 32;
    uint8_t *tiles = kind ? (uint8_t *)aligned_alloc(64, blocks * AMX_RUN_BYTES) : NULL;
    amx_configure();
    for (long m0 = 0; m0 < M; m0 += AMX_X_BLOCK) {
        long m1 = m0 + AMX_X_BLOCK < M ? m0 + AMX_X_BLOCK : M;
        for (long u = u0; u < u1; u++) {
            long n = u * unit;
            const uint8_t *wp = (const uint8_t *)w + n * row_bytes(kind, K);
            const void *sp = unit_scales(kind, ws, n, K, G);
            const float *bp = bias ? bias + n : NULL;
            if (kind) amx_unpack_unit(wp, K, tiles);
            const uint8_t *bt = kind ? tiles : wp;
            for (long m = m0; m < m1; m += AMX_ROWS) {
                const int8_t *mq = xq + m * K;
                const float *ms = xs + m * blocks;
                const int32_t *mo = xo + m * blocks;
#define AMX_TILE(KIND, TM) amx_tile16(KIND, TM, bt, sp, bp, mq, ms, mo, K, G, y + m * N + n, N, stream)
                if (m1 - m >= AMX_ROWS) {  /* (a whole tile's rows as a constant) */
                    if (kind) AMX_TILE(1, AMX_ROWS);
                    else AMX_TILE(0, AMX_ROWS);
                } else if (kind) {
                    AMX_TILE(1, (int)(m1 - m));
                } else {
                    AMX_TILE(0, (int)(m1 - m));
                }
#undef AMX_TILE
            }
        }
    }
    AMX_RELEASE();
    free(tiles);
}
#endif

/* The first tile of a unit's pass asks for the unit's weights ahead in its stream; the second
 * asks for the next unit's (a unit's bytes on), so that memory keeps streaming while it runs from
 * cache: at int8's bytes per operation the first tile alone left memory idle meanwhile. */
INLINE long next_unit(long m, long tile, long unit_bytes) { return m == tile ? unit_bytes : 0; }

/* TW (1 or 2) blocks of 8 rows starting at row n, kind 0 (int8) or 1 (int4), for rows [m0, m1)
 * of x; `stream`: a unit's outputs (TW = 2) written past the caches (STREAM_MIN_BYTES). The 16-row
 * tiles take it as a constant: passed as a variable, the int4 tiles that never stream ran 1-3%
 * slower. */
INLINE void run_lanes(int kind, int TW, const int8_t *xq, const float *xs, const int32_t *xo, const void *w,
                      const void *ws, const float *bias, float *y, long N, long K, long G, long n, long m0, long m1,
                      int stream) {
    long blocks = K / 32;
    long unit_bytes = 2 * LANE_ROWS * row_bytes(kind, K);
    const uint8_t *wp = (const uint8_t *)w + n * row_bytes(kind, K);
    const void *sp = unit_scales(kind, ws, n, K, G);
    const float *bp = bias ? bias + n : NULL;
#if ANNA_VNNI
    if (TW == 2) {  /* 32 registers: tiles of up to LANE_TILE_X16 rows of x */
        for (long m = m0; m < m1; m += LANE_TILE_X16) {
            long tm = m1 - m < LANE_TILE_X16 ? m1 - m : LANE_TILE_X16;
#define TILE16(T, S) \
    (kind ? lane_tile16(T, wp, (const uint16_t *)sp, bp, xq + m * K, xs + m * blocks, xo + m * blocks, K, G, \
                        y + m * N + n, N, m == m0, next_unit(m - m0, LANE_TILE_X16, unit_bytes), S) \
          : lane_tile16_s8(T, (const int8_t *)wp, sp, G, bp, xq + m * K, xs + m * blocks, xo + m * blocks, K, \
                           y + m * N + n, N, m == m0, next_unit(m - m0, LANE_TILE_X16, unit_bytes), S))
#define LANE_CASE(T) \
    case T: \
        if (stream) TILE16(T, 1); \
        else TILE16(T, 0); \
        break;
            switch (tm) { LANE_CASE(1) LANE_CASE(2) LANE_CASE(3) LANE_CASE(4) LANE_CASE(5) LANE_CASE(6) LANE_CASE(7)
                          default: LANE_CASE(8) }
#undef LANE_CASE
#undef TILE16
        }
        return;
    }
#endif
    for (long m = m0; m < m1; m += LANE_TILE_X) {
        long tm = m1 - m < LANE_TILE_X ? m1 - m : LANE_TILE_X;
        long next = TW == 2 ? next_unit(m - m0, LANE_TILE_X, unit_bytes) : 0;
#define LANE_CASE(T) \
    case T: \
        if (kind) \
            lane_tile(TW, T, wp, (const uint16_t *)sp, bp, xq + m * K, xs + m * blocks, xo + m * blocks, K, G, \
                      y + m * N + n, N, m == m0, next, stream); \
        else \
            lane_tile_s8(TW, T, (const int8_t *)wp, sp, G, bp, xq + m * K, xs + m * blocks, K, y + m * N + n, N, \
                         m == m0, next, stream); \
        break;
        switch (tm) { LANE_CASE(1) LANE_CASE(2) LANE_CASE(3) default: LANE_CASE(4) }
#undef LANE_CASE
    }
}

/* A chunk of units of 2 blocks of 8 rows, [u0, u1), plus the odd block of 8 rows when `odd`. A
 * tile runs over all of K at once (passes over parts of K, which keep less of x in cache,
 * measured slower: the sums go through memory between passes); a unit's weights stay in cache
 * while X_BLOCK rows of x pass. */
INLINE void run_units(int kind, const int8_t *xq, const float *xs, const int32_t *xo, const void *w, const void *ws,
                      const float *bias, float *y, long M, long N, long K, long G, long u0, long u1, int odd,
                      int stream) {
    long unit = 2 * LANE_ROWS;
#if ANNA_AMX
    if (M >= AMX_ROWS && u1 > u0) {  /* the units on tiles; the odd block of 8 rows below */
        run_amx(kind, xq, xs, xo, w, ws, bias, y, M, N, K, G, u0, u1, stream);
        u0 = u1;
    }
#endif
    for (long m0 = 0; m0 < M; m0 += X_BLOCK) {
        long m1 = m0 + X_BLOCK < M ? m0 + X_BLOCK : M;
        for (long u = u0; u < u1; u++)
            run_lanes(kind, 2, xq, xs, xo, w, ws, bias, y, N, K, G, u * unit, m0, m1, stream);
        if (odd) run_lanes(kind, 1, xq, xs, xo, w, ws, bias, y, N, K, G, u1 * unit, m0, m1, 0);
    }
}

#if ANNA_AMX
/* The tiles against the lanes (the path of the levels below amx) on fixed data, which must agree to
 * the bit: 0 when they do, the number of outputs that differ (at most 100) when not, -1 when Linux
 * refuses the tiles. kernels.py runs it in a child process before it trusts the amx level, so that
 * a CPU or hypervisor whose tiles misbehave costs a warning, not a crash or wrong tokens. 20 rows
 * of x (a full tile and a short one), 2 units of 16 weight rows, 4 runs of 32 columns: int4 with a
 * scale per run, int8 with a scale per run and with one per row. */
int anna_amx_self_check(void) {
    enum { M = 20, N = 4 * LANE_ROWS, K = 128, G = 32, BLOCKS = K / 32 };
    if (AMX_REQUEST_TILES() != 0) return -1;
    static float x[M * K], tiles_y[M * N], lanes_y[M * N], bias[N], row_scales[N];
    static int8_t xq[(M + AMX_ROWS) * K];  /* zero past row M: a tile reads 16 rows */
    static float xs[M * BLOCKS];
    static int32_t xo[M * BLOCKS];
    static uint8_t w[N * K];
    static uint16_t ws[N * (K / G)];
    for (long i = 0; i < M * K; i++) x[i] = sinf(0.37f * (float)i) * (float)(1 + i % 7);
    for (long i = 0; i < N * K; i++) w[i] = (uint8_t)(i * 37 + 11);
    for (long i = 0; i < N * (K / G); i++) ws[i] = (uint16_t)(0x3000 + (i * 53) % 0x800);  /* 0.125 .. 0.5 */
    for (long i = 0; i < N; i++) {
        bias[i] = 0.25f * (float)(i % 5) - 0.5f;
        row_scales[i] = 0.01f * (float)(1 + i % 3);
    }
    for (long m = 0; m < M; m++) quantize_x_row(x + m * K, xq + m * K, xs + m * BLOCKS, xo + m * BLOCKS, K);
    long unit = 2 * LANE_ROWS;
    int differ = 0;
    for (int c = 0; c < 3; c++) {  /* int4 groups of G, int8 groups of G, int8 row scales */
        int kind = c == 0;
        long g = c == 2 ? 0 : G;
        const void *scales = c == 2 ? (const void *)row_scales : (const void *)ws;
        run_amx(kind, xq, xs, xo, w, scales, bias, tiles_y, M, N, K, g, 0, N / unit, 0);
        for (long u = 0; u < N / unit; u++)
            run_lanes(kind, 2, xq, xs, xo, w, scales, bias, lanes_y, N, K, g, u * unit, 0, M, 0);
        for (long i = 0; i < M * N; i++) differ += memcmp(&tiles_y[i], &lanes_y[i], sizeof(float)) != 0;
    }
    return differ < 100 ? differ : 100;
}
#endif

/* Several matmuls in one parallel region: group g multiplies rows [starts[g], starts[g + 1]) of x
 * by the weights w[g] (scales ws[g], bias[g] or none) into the same rows of y. Every group has the
 * same N and K. x is quantized once, and the units of all groups form one range that the threads
 * share, so that many small matmuls (a mixture-of-experts layer's experts, a few rows each) keep
 * every thread streaming instead of each paying a parallel region of its own.
 * kind: 0 = int8, 1 = int4. ws: int8 row scales [N] (fp32, G = 0), else group scales (fp16, layouts above). */
static void qgemm_groups(const float *x, const void *const *w, const void *const *ws, const float *const *bias,
                         const int64_t *starts, long groups, int kind, long G, float *y, long N, long K, int threads) {
    long M = starts[groups], blocks = K / 32;
    /* (+ 16 rows: the AMX path's tiles read 16 rows of x where the last tile has fewer) */
    int8_t *xq = (int8_t *)malloc((M + 16) * K);
    memset(xq + M * K, 0, 16 * K);
    float *xs = (float *)malloc(sizeof(float) * M * blocks);
    int32_t *xo = (int32_t *)malloc(sizeof(int32_t) * M * blocks);
    long unit = 2 * LANE_ROWS;  /* rows per unit of work */
    long packed = N / LANE_ROWS * LANE_ROWS, per_group = packed / unit;
    long units = per_group * groups;
    /* outputs too large for the caches go past them, where each row's units are whole lines */
    int stream = M * N * (long)sizeof(float) >= STREAM_MIN_BYTES && N % unit == 0 && (uintptr_t)y % 64 == 0;
    split_range ranges[SPLIT_MAX_THREADS];
    if (threads > SPLIT_MAX_THREADS) threads = SPLIT_MAX_THREADS;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads(), visited = 0;
        long b, e;
        split_start(ranges, units, t, nt);
        for (long m = t; m < M; m += nt)
            quantize_x_row(x + m * K, xq + m * K, xs + m * blocks, xo + m * blocks, K);
        #pragma omp barrier
        while (split_next(ranges, units, t, nt, &visited, &b, &e)) {
            while (b < e) {  /* the chunk, cut at group boundaries */
                long g = b / per_group, u0 = b - g * per_group, u1 = e - g * per_group;
                if (u1 > per_group) u1 = per_group;
                long m0 = starts[g], rows = starts[g + 1] - m0;
                if (kind == 0)  /* (each kind's tiles inlined on their own) */
                    run_units(0, xq + m0 * K, xs + m0 * blocks, xo + m0 * blocks, w[g], ws[g], bias[g], y + m0 * N,
                              rows, N, K, G, u0, u1, 0, stream);
                else
                    run_units(1, xq + m0 * K, xs + m0 * blocks, xo + m0 * blocks, w[g], ws[g], bias[g], y + m0 * N,
                              rows, N, K, G, u0, u1, 0, stream);
                b += u1 - u0;
            }
        }
        if (stream) _mm_sfence();  /* the streamed lines reach memory before the region ends */
        if (t == nt - 1) {
            for (long g = 0; g < groups; g++) {
                long m0 = starts[g], rows = starts[g + 1] - m0;
                const int8_t *gq = xq + m0 * K;
                const float *gs = xs + m0 * blocks;
                const int32_t *go = xo + m0 * blocks;
                float *gy = y + m0 * N;
                /* the odd block of 8 rows, then the row-major tail rows */
                if (per_group * unit < packed)
                    run_units(kind, gq, gs, go, w[g], ws[g], bias[g], gy, rows, N, K, G, per_group, per_group, 1, 0);
                for (long n = packed; n < N; n++)
                    for (long m = 0; m < rows; m++)
                        gy[m * N + n] = row_dot(kind, w[g], ws[g], n, K, G, gq + m * K, gs + m * blocks,
                                                go + m * blocks) + (bias[g] ? bias[g][n] : 0.0f);
            }
        }
    }
    free(xq);
    free(xs);
    free(xo);
}

void anna_qgemm(const float *x, const void *w, const void *ws, int kind, long G, const float *bias, float *y,
                long M, long N, long K, int threads) {
    int64_t starts[2] = {0, M};
    qgemm_groups(x, &w, &ws, &bias, starts, 1, kind, G, y, N, K, threads);
}

/* Group g: rows [starts[g], starts[g + 1]) of x times the weights of expert ids[g], whose values and
 * scales are at w[ids[g]], ws[ids[g]] (tables of every expert's pointers, kept by the caller). */
void anna_qgemm_experts(const float *x, const int64_t *w, const int64_t *ws, const int64_t *ids, const int64_t *starts,
                        long groups, int kind, long G, float *y, long N, long K, int threads) {
    const void **gw = (const void **)malloc(sizeof(void *) * groups);
    const void **gs = (const void **)malloc(sizeof(void *) * groups);
    const float **gb = (const float **)calloc(groups, sizeof(float *));
    for (long g = 0; g < groups; g++) {
        gw[g] = (const void *)(intptr_t)w[ids[g]];
        gs[g] = (const void *)(intptr_t)ws[ids[g]];
    }
    qgemm_groups(x, gw, gs, gb, starts, groups, kind, G, y, N, K, threads);
    free(gw);
    free(gs);
    free(gb);
}

/* Dequantize rows of packed weights (all N when rows is NULL, else the R listed) to row-major fp32,
 * or (bf16 != 0) to bf16 rounded from the same fp32 values: the "dequant" strategy for large M
 * (bf16 where that GEMM runs in bf16), and embedding lookups. Each run of 32 values is computed
 * into `run` and then written in the output's type. */
void anna_dequant(const void *w, const void *ws, int kind, long G, const long *rows, long R, long N, long K,
                  void *out, int bf16, int threads) {
    long packed = N / LANE_ROWS * LANE_ROWS, groups = G ? K / G : 0, bytes = row_bytes(kind, K);
    #pragma omp parallel for num_threads(threads) if (R > 16)
    for (long i = 0; i < R; i++) {
        long n = rows ? rows[i] : i;
        int in_block = n < packed;
        long r = in_block ? n % LANE_ROWS : 0;
        /* the row's unit of 2 blocks (tw = 2, block t of it) or the lone odd block (tw = 1) */
        long tw = 1, start = n - r, t = 0;
        if (in_block && n < N / (2 * LANE_ROWS) * (2 * LANE_ROWS)) {
            tw = 2;
            start = n - n % (2 * LANE_ROWS);
            t = (n - start) / LANE_ROWS;
        }
        const uint8_t *base = (const uint8_t *)w + start * bytes;
        const uint16_t *gs = (const uint16_t *)ws + start * groups;
        for (long k = 0; k < K; k += 32) {
            float run[32];
            /* a row's group scale: in its blocks' layout (in_block) or row-major (a tail row) */
            float s = !G ? ((const float *)ws)[n]
                         : _cvtsh_ss(in_block ? gs[((k / G) * tw + t) * LANE_ROWS + r]
                                              : ((const uint16_t *)ws)[n * groups + k / G]);
            if (in_block && kind == 0) {
                for (long l = 0; l < S8_VECTORS; l++) {  /* this row's 4 weights of vector l */
                    const int8_t *v = (const int8_t *)base + (k / 32) * S8_VECTORS * tw * LANE_BYTES +
                                      (l * tw + t) * LANE_BYTES + 4 * r;
                    _mm_storeu_ps(run + 4 * l, _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(
                                                   _mm_cvtsi32_si128(*(const int32_t *)v))), _mm_set1_ps(s)));
                }
            } else if (in_block) {
                const __m128i low = _mm_set1_epi8(0x0F);
                const __m128 eight = _mm_set1_ps(8.0f), sv = _mm_set1_ps(s);
                for (int l = 0; l < 4; l++) {  /* this row's 4 bytes of vector l: 4 + 4 weights */
                    int32_t word;
                    __builtin_memcpy(&word, base + (k / 32) * 4 * tw * LANE_BYTES + (l * tw + t) * LANE_BYTES + 4 * r, 4);
                    __m128i v = _mm_cvtsi32_si128(word);
                    __m128 lo = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_and_si128(v, low)));
                    __m128 hi = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
                    _mm_storeu_ps(run + 4 * l, _mm_mul_ps(_mm_sub_ps(lo, eight), sv));
                    _mm_storeu_ps(run + 16 + 4 * l, _mm_mul_ps(_mm_sub_ps(hi, eight), sv));
                }
            } else if (kind == 0) {  /* a row-major tail row */
                const int8_t *p = (const int8_t *)w + n * K + k;
                for (int j = 0; j < 32; j++) run[j] = p[j] * s;
            } else {
                const uint8_t *p = (const uint8_t *)w + n * (K / 2) + k / 2;
                for (int j = 0; j < 16; j++) {
                    run[j] = (float)((p[j] & 0x0F) - 8) * s;
                    run[16 + j] = (float)((p[j] >> 4) - 8) * s;
                }
            }
            if (bf16)
                for (int j = 0; j < 32; j += 8) store8_bf16((uint16_t *)out + i * K + k + j, _mm256_loadu_ps(run + j));
            else
                __builtin_memcpy((float *)out + i * K + k, run, sizeof(run));
        }
    }
}
