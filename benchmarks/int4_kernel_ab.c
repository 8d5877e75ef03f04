/* Two builds of the int4 kernel alternated on one decode step's matmuls of the Qwen2.5-0.5B shape
 * (24 layers x qkv 1152x896, o 896x896, gate_up 9728x896, down 896x4864), each layer with weights
 * of its own so that they come from memory as in the engine. Alternating within one process is
 * what makes a 5% difference visible on a machine whose speed moves 30% between runs.
 *
 *   git show HEAD~1:src/anna/platforms/cpu/csrc/quant_kernels.c > /tmp/base.c
 *   cc -O3 -mavx2 -mfma -mf16c -fopenmp -Isrc/anna/platforms/cpu/csrc -c /tmp/base.c -o /tmp/base.o
 *   nm -g --defined-only /tmp/base.o | awk '/ T anna_/ {print $3, "base_" substr($3, 6)}' > /tmp/base.syms
 *   objcopy --redefine-syms=/tmp/base.syms /tmp/base.o   # every anna_* of the base build as base_*
 *   cc -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/int4_kernel_ab.c /tmp/base.o \
 *      src/anna/platforms/cpu/csrc/quant_kernels.c -o /tmp/int4_ab
 *   /tmp/int4_ab 16      # rows of x (M): 1 for batch-1 decode, 16 for 16 streams
 *
 * Prints the median and best time per pass of each build and the median of the per-round
 * ratios (base / this build: above 1 means this build is faster). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void base_qgemm(const float *x, const void *w, const void *ws, int kind, long G, const float *bias, float *y, long M,
                long N, long K, int threads);
void anna_qgemm(const float *x, const void *w, const void *ws, int kind, long G, const float *bias, float *y, long M,
                long N, long K, int threads);

#define LAYERS 24
#define ROUNDS 11

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    long M = argc > 1 ? atol(argv[1]) : 16;
    const long NS[4] = {1152, 896, 9728, 896}, KS[4] = {896, 896, 896, 4864};
    uint8_t *w[LAYERS][4];
    uint16_t *s[LAYERS][4];
    for (int l = 0; l < LAYERS; l++)
        for (int j = 0; j < 4; j++) {
            long wb = NS[j] * KS[j] / 2, sb = NS[j] * KS[j] / 32;
            w[l][j] = malloc(wb);
            s[l][j] = malloc(2 * sb);
            for (long i = 0; i < wb; i++) w[l][j][i] = (uint8_t)rand();
            for (long i = 0; i < sb; i++) s[l][j][i] = 0x2000 + (rand() & 0xff);  /* small positive fp16 */
        }
    float *x = malloc(sizeof(float) * M * 4864), *y = malloc(sizeof(float) * M * 9728);
    for (long i = 0; i < M * 4864; i++) x[i] = (rand() % 2000 - 1000) * 1e-3f;
    double base[ROUNDS], mine[ROUNDS], ratio[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now();
        for (int l = 0; l < LAYERS; l++)
            for (int j = 0; j < 4; j++) base_qgemm(x, w[l][j], s[l][j], 1, 32, NULL, y, M, NS[j], KS[j], 2);
        double t1 = now();
        for (int l = 0; l < LAYERS; l++)
            for (int j = 0; j < 4; j++) anna_qgemm(x, w[l][j], s[l][j], 1, 32, NULL, y, M, NS[j], KS[j], 2);
        double t2 = now();
        base[r] = (t1 - t0) * 1e3;
        mine[r] = (t2 - t1) * 1e3;
        ratio[r] = base[r] / mine[r];
    }
    qsort(base, ROUNDS, sizeof(double), by_value);
    qsort(mine, ROUNDS, sizeof(double), by_value);
    qsort(ratio, ROUNDS, sizeof(double), by_value);
    printf("M=%ld, 24 layers: base median %.1f ms (best %.1f) | this build median %.1f ms (best %.1f) | speedup median %.2fx\n",
           M, base[ROUNDS / 2], base[0], mine[ROUNDS / 2], mine[0], ratio[ROUNDS / 2]);
    return 0;
}
