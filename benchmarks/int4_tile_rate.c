/* The int4 kernel's own rate, without the call around it: run_units (csrc/quant_kernels.c; kind
 * 1, the int4 tiles that anna_qgemm's threads run) on one thread, over a unit of 16 weight rows
 * that stays in L1 and over units streamed from memory, against the instruction ceiling that
 * benchmarks/cpu_peak.c measures. What it shows: how far the tiles themselves are from that
 * ceiling, apart from x's quantization and the parallel region (outputs of STREAM_MIN_BYTES or
 * more are stored past the caches, as anna_qgemm stores them).
 *
 *   cc -O3 -fopenmp -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512vnni \
 *      -Isrc/anna/platforms/cpu/csrc benchmarks/int4_tile_rate.c -o /tmp/int4_tile_rate -lm
 *   /tmp/int4_tile_rate 16 896          # rows of x, K (the avx512_vnni level's tiles)
 *   (the avx2 level's: build with -mavx2 -mfma -mf16c only)
 *
 * Prints G int8 operations per second (2 per multiply-add) for each case: best of 5 passes. */
#include <stdio.h>
#include <time.h>

#include "quant_kernels.c"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* G operations per second of run_units (int4) over `units` units of 16 rows, repeated to ~0.4 G MACs */
static double rate(long M, long K, long units) {
    long N = units * 2 * LANE_ROWS, blocks = K / 32;
    uint8_t *w = aligned_alloc(64, N * K / 2);
    uint16_t *ws = aligned_alloc(64, N * blocks * sizeof(uint16_t) + 64);
    int8_t *xq = aligned_alloc(64, M * K);
    float *xs = aligned_alloc(64, M * blocks * sizeof(float)), *y = aligned_alloc(64, M * N * sizeof(float));
    int32_t *xo = aligned_alloc(64, M * blocks * sizeof(int32_t));
    for (long i = 0; i < N * K / 2; i++) w[i] = (uint8_t)(i * 37 + 11);
    for (long i = 0; i < N * blocks; i++) ws[i] = (uint16_t)(0x3000 + (i * 53) % 0x800);
    for (long i = 0; i < M * K; i++) xq[i] = (int8_t)((i * 7) % 200 - 100);
    for (long i = 0; i < M * blocks; i++) xs[i] = 0.01f, xo[i] = -800;
    double macs = (double)M * N * K;
    long reps = (long)(4e8 / macs) + 1;
    int stream = M * N * (long)sizeof(float) >= STREAM_MIN_BYTES;  /* as anna_qgemm decides */
    double best = 1e30;
    for (int pass = 0; pass < 5; pass++) {
        double t = now();
        for (long r = 0; r < reps; r++) {
            run_units(1, xq, xs, xo, w, ws, NULL, y, M, N, K, 32, 0, units, 0, stream);
            __asm__ volatile("" : : "r"(y) : "memory");  /* the outputs count: the calls stay */
        }
        t = now() - t;
        if (t < best) best = t;
    }
    free(w), free(ws), free(xq), free(xs), free(y), free(xo);
    return 2.0 * macs * reps / best / 1e9;
}

int main(int argc, char **argv) {
    long M = argc > 1 ? atol(argv[1]) : 16, K = argc > 2 ? atol(argv[2]) : 896;
    long streamed = (256L << 20) / (2 * LANE_ROWS * K / 2);  /* 256 MB of weights: from memory */
    printf("int4 tiles (%s build), one thread, %ld rows of x, K = %ld\n", ANNA_VNNI ? "avx512_vnni" : "avx2", M, K);
    printf("  one unit in L1:            %6.1f G ops/s\n", rate(M, K, 1));
    printf("  %ld units from memory:  %6.1f G ops/s\n", streamed, rate(M, K, streamed));
    return 0;
}
