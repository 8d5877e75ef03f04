/* Large-M matmuls of bf16 weights on AMX tiles, reading the weights in the kernels' interleaved
 * layout (cpu_kernels.c) as they are stored: the amx level's prefill path.
 *
 * y[M, N] = x[M, K] W^T (+ bias), x bf16 row-major, W bf16 [N, K] in blocks of 4 interleaved
 * rows, y fp32 or bf16. Without this kernel a
 * large M went to torch's bf16 GEMM (oneDNN, on the same tiles) on a row-major copy of W made for
 * every call: a pass writing the whole weight, about a seventh of a 512-token bf16 prefill of the
 * 0.5B shape on a 2-vCPU AMX Xeon.
 *
 * A panel is two B tiles' worth of weight rows (16 + 16), repacked once per call into the tiles'
 * pair layout ([K / 32][16 pairs of k][16 rows][2], pack_rows16) in a per-thread buffer. Then
 * every 32 rows of x (two A tiles, loaded straight from x) against the panel accumulate four
 * 16 x 16 fp32 C tiles over K: 4 TDPBF16PS per 2 A and 2 B tile loads. x goes in blocks of rows
 * that stay in L2 (X_BLOCK_BYTES), the thread's packed panels in groups that stay in L3
 * (PACK_BYTES), each panel serving every row block; each thread keeps both buffers from one call
 * to the next (at most 9 MB per thread).
 *
 * The gated MLP's first matmul (anna_tile_gated_act) pairs gate row j with up row I + j in a
 * panel, so that C tiles hold both halves of the same 16 columns, and writes silu(gate) * up
 * (the activation cpu_kernels.c's anna_silu_mul computes, in its operations) instead of the
 * [M, 2I] gate and up rows, which a 2,048-token prefill wrote to memory and read back.
 *
 * Products are exact in fp32 and summed in fp32 (TDPBF16PS), so the result differs from an fp32
 * matmul of the same bf16 values by summation order only. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "thread_buffer.h"
#include "vec_math.h"

#if ANNA_AMX

#define PACK_ROWS 4                 /* cpu_kernels.c's interleaved blocks */
#define TILE_X_ROWS 32              /* rows of x per step: two A tiles */
#define X_BLOCK_BYTES (1 << 20)     /* rows of x per block: 1 MB of them in bf16 */
#define PACK_BYTES (8 << 20)        /* a thread's packed panels per group */
#define PANEL_BYTES(K) (32 * (K) * 2)
/* fp32 outputs over this many bytes are written past the caches, which they would leave anyway:
 * 1.27x for the q/k/v projection at 2,048 tokens of the 0.5B shape (9 MB of output) */
#define STREAM_MIN_BYTES (4 << 20)
/* tile registers, C[x tile][weight tile] (numbers, not an enum: the instructions name them in their text) */
#define C00 0
#define C01 1
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7

static void tile_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;  /* 16 x 16 fp32; 16 x 32 bf16 */
    AMX_LOAD_CONFIG(&cfg);
}

/* 16 weight rows from row n (a multiple of 4) of the interleaved W -> one B tile per 32 columns of
 * K: row p of tile b holds columns 32b + 2p and 32b + 2p + 1 of each of the 16 rows. A 64-byte line
 * of a block is 4 rows x 4 pairs (row-major); one permute makes it 4 pairs x 4 rows, and four
 * lines (the 4 blocks) transposed by 128-bit lanes give 4 rows of the tile. */
static void pack_rows16(const uint16_t *w, long n, long K, uint16_t *out) {
    const __m512i pairs_first = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const uint16_t *blk = w + n * K;
    for (long c = 0; c < K / 8; c++) {  /* 8 columns: pairs 4c .. 4c + 3 of the tile rows */
        __m512i l[4];
        for (int b = 0; b < 4; b++)
            l[b] = _mm512_permutexvar_epi32(pairs_first, _mm512_loadu_si512(blk + b * PACK_ROWS * K + c * 32));
        __m512i lo01 = _mm512_shuffle_i64x2(l[0], l[1], 0x44), hi01 = _mm512_shuffle_i64x2(l[0], l[1], 0xEE);
        __m512i lo23 = _mm512_shuffle_i64x2(l[2], l[3], 0x44), hi23 = _mm512_shuffle_i64x2(l[2], l[3], 0xEE);
        uint16_t *o = out + c * 4 * 32;
        _mm512_store_si512(o, _mm512_shuffle_i64x2(lo01, lo23, 0x88));
        _mm512_store_si512(o + 32, _mm512_shuffle_i64x2(lo01, lo23, 0xDD));
        _mm512_store_si512(o + 64, _mm512_shuffle_i64x2(hi01, hi23, 0x88));
        _mm512_store_si512(o + 96, _mm512_shuffle_i64x2(hi01, hi23, 0xDD));
    }
}

/* C tiles of 32 rows of x from xb against a packed panel, over all of K */
INLINE void panel_step(const uint16_t *xb, const uint16_t *panel, long K) {
    const uint16_t *x1 = xb + 16 * K, *p1 = panel + 16 * K;
    AMX_ZERO(C00);
    AMX_ZERO(C01);
    AMX_ZERO(C10);
    AMX_ZERO(C11);
    for (long kb = 0; kb < K / 32; kb++) {
        AMX_LOAD(A0, xb + kb * 32, K * 2);
        AMX_LOAD(B0, panel + kb * 512, 64);
        AMX_DPBF16PS(C00, A0, B0);
        AMX_LOAD(B1, p1 + kb * 512, 64);
        AMX_DPBF16PS(C01, A0, B1);
        AMX_LOAD(A1, x1 + kb * 32, K * 2);
        AMX_DPBF16PS(C10, A1, B0);
        AMX_DPBF16PS(C11, A1, B1);
    }
}

/* 16 outputs at y + i: bf16, or fp32, where `stream` bypassing the caches (a whole 64-byte line:
 * no read of the line before it is written) */
INLINE void store16(void *y, int bf16, int stream, long i, __m512 v) {
    if (bf16) store16_bf16((uint16_t *)y + i, v);
    else if (stream && ((uintptr_t)((float *)y + i) & 63) == 0) _mm512_stream_ps((float *)y + i, v);
    else _mm512_storeu_ps((float *)y + i, v);
}

INLINE __m512 bias16(const float *bias, long n) { return bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps(); }

/* Rows [m, m + rows) of x (bf16, or fp32 when xf32) as bf16 into xl, zero rows after them up to a
 * multiple of 32: the block of x one thread's A tiles read. Each thread keeps its own copy in its
 * L2, so that the tiles do not read lines that the other cores wrote last (the previous op's
 * output, split among the threads), which slowed a matmul right after such an op by half. */
static void load_x_block(const void *x, int xf32, long m, long rows, long K, uint16_t *xl) {
    if (xf32) {
        const float *src = (const float *)x + m * K;
        for (long i = 0; i < rows * K; i += 16) store16_bf16(xl + i, _mm512_loadu_ps(src + i));
    } else {
        memcpy(xl, (const uint16_t *)x + m * K, rows * K * 2);
    }
    long padded = (rows + TILE_X_ROWS - 1) / TILE_X_ROWS * TILE_X_ROWS;
    memset(xl + rows * K, 0, (padded - rows) * K * 2);
}

/* One thread's work: the panels [p0, p1) for the rows [m0, m1) of x. Panel p's weight rows: row0(p) .. + 16 and
 * row1(p) .. + 16; its 32 rows of x at mb + m are written by `epilogue` from the four C tiles. */
#define PANELS(row0, row1, epilogue)                                                                        \
    do {                                                                                                     \
        long per_group = PACK_BYTES / PANEL_BYTES(K), x_block = X_BLOCK_BYTES / (2 * K) / TILE_X_ROWS * TILE_X_ROWS; \
        if (per_group < 1) per_group = 1;                                                                    \
        if (x_block < TILE_X_ROWS) x_block = TILE_X_ROWS;                                                    \
        uint16_t *packed = (uint16_t *)thread_buffer(0, (per_group < p1 - p0 ? per_group : p1 - p0) * PANEL_BYTES(K)); \
        uint16_t *xl = (uint16_t *)thread_buffer(1, x_block * K * 2);                                        \
        float c[4][16][16] __attribute__((aligned(64)));                                                     \
        tile_configure();                                                                                    \
        for (long g0 = p0; g0 < p1; g0 += per_group) {                                                       \
            long g1 = g0 + per_group < p1 ? g0 + per_group : p1;                                             \
            for (long p = g0; p < g1; p++) {                                                                 \
                pack_rows16(w, (row0), K, packed + (p - g0) * 32 * K);                                       \
                pack_rows16(w, (row1), K, packed + (p - g0) * 32 * K + 16 * K);                              \
            }                                                                                                \
            for (long mb = m0; mb < m1; mb += x_block) {                                                     \
                long rows = m1 - mb < x_block ? m1 - mb : x_block;                                           \
                load_x_block(x, xf32, mb, rows, K, xl);                                                      \
                for (long p = g0; p < g1; p++)                                                               \
                    for (long m = 0; m < rows; m += TILE_X_ROWS) {                                           \
                        panel_step(xl + m * K, packed + (p - g0) * 32 * K, K);                               \
                        AMX_STORE(C00, c[0], 64);                                                            \
                        AMX_STORE(C01, c[1], 64);                                                            \
                        AMX_STORE(C10, c[2], 64);                                                            \
                        AMX_STORE(C11, c[3], 64);                                                            \
                        for (int r = 0; r < TILE_X_ROWS && m + r < rows; r++) {                              \
                            const float *lo = c[r < 16 ? 0 : 2][r & 15], *hi = c[r < 16 ? 1 : 3][r & 15];  \
                            long row = mb + m + r;                                                           \
                            epilogue;                                                                        \
                        }                                                                                    \
                    }                                                                                        \
            }                                                                                                \
        }                                                                                                    \
        AMX_RELEASE();                                                                                       \
        _mm_sfence();                                                                                        \
    } while (0)

/* The thread's share of the work: all rows of x for a share of the panels, or all panels for a
 * share of the rows, whichever reads less twice. Every thread reads all of x in the first (each
 * converts and copies it into its own blocks: M x K x (4 or 2) + 2 bytes), all of W in the second
 * (packs it: 2 bytes per weight); at 2,048 rows of the 0.5B shape the first read 11 MB of x per
 * thread for the 2 MB q/k/v weight. */
static void thread_work(long M, long panels, long K, int xf32, long *m0, long *m1, long *p0, long *p1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    *m0 = 0, *m1 = M, *p0 = 0, *p1 = panels;
    if (panels * 32 * 2 < M * (xf32 ? 6 : 4)) {
        long per = (M + nt - 1) / nt;
        per = (per + TILE_X_ROWS - 1) / TILE_X_ROWS * TILE_X_ROWS;
        *m0 = t * per < M ? t * per : M;
        *m1 = *m0 + per < M ? *m0 + per : M;
    } else {
        long per = (panels + nt - 1) / nt;
        *p0 = t * per < panels ? t * per : panels;
        *p1 = *p0 + per < panels ? *p0 + per : panels;
    }
}

/* y[M, N] = x W^T (+ bias), x fp32 (xf32 = 1) or bf16: N and K multiples of 32; y fp32 (ybf16 = 0) or bf16. */
void anna_tile_matmul(const void *x, int xf32, const uint16_t *w, const float *bias, void *y, int ybf16, long M,
                      long N, long K, int threads) {
    int stream = !ybf16 && M * N * 4 > STREAM_MIN_BYTES;
    #pragma omp parallel num_threads(threads)
    {
        long m0, m1, p0, p1;
        thread_work(M, N / 32, K, xf32, &m0, &m1, &p0, &p1);
        if (m0 < m1 && p0 < p1)
            PANELS(32 * p, 32 * p + 16, {
                long at = row * N + 32 * p;
                store16(y, ybf16, stream, at, _mm512_add_ps(_mm512_load_ps(lo), bias16(bias, 32 * p)));
                store16(y, ybf16, stream, at + 16, _mm512_add_ps(_mm512_load_ps(hi), bias16(bias, 32 * p + 16)));
            });
    }
}

/* act[M, I] (bf16, the down projection's input) = silu(gate) * up with [gate | up] = x W^T (+ bias)
 * (x as in anna_tile_matmul), W [2I, K]: I a multiple of 16, K of 32. */
void anna_tile_gated_act(const void *x, int xf32, const uint16_t *w, const float *bias, uint16_t *act, long M,
                         long I, long K, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        long m0, m1, p0, p1;
        thread_work(M, I / 16, K, xf32, &m0, &m1, &p0, &p1);
        if (m0 < m1 && p0 < p1)
            PANELS(16 * p, I + 16 * p, {
                __m512 gv = _mm512_add_ps(_mm512_load_ps(lo), bias16(bias, 16 * p));
                __m512 uv = _mm512_add_ps(_mm512_load_ps(hi), bias16(bias, I + 16 * p));
                __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                store16_bf16(act + row * I + 16 * p, _mm512_mul_ps(sig, uv));
            });
    }
}

#endif
