/* Ceilings of this CPU for Anna's kernels: fp32 FMA (the bf16/fp16 kernels) and int8 maddubs +
 * int16 add (the avx2 level's int4 kernel), on every thread at once, register operands only; built
 * with AVX-512 VNNI (and BF16) flags, also 512-bit vpdpbusd (the avx512_vnni level's int4 kernel)
 * and vdpbf16ps (its bf16 dot products); and the rate at
 * which all threads read 512 MB from memory in runs of 4 KB, 32 KB and 256 KB taken in a random
 * order (decode attention reads a KV head's rows block by block: one run per block) and in one
 * sequential pass (the weights).
 *
 *   cc -O2 -mavx2 -mfma -fopenmp benchmarks/cpu_peak.c -o /tmp/cpu_peak && /tmp/cpu_peak [threads]
 *   cc -O2 -march=native -fopenmp benchmarks/cpu_peak.c -o /tmp/cpu_peak   # + what this CPU has
 *
 * Ten independent accumulators hide the FMA latency; the empty asm keeps the compiler from
 * hoisting the work out of the loop. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define EIGHT(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

static double fma_gflops(int threads, long iters) {
    double t0 = omp_get_wtime();
    volatile float sink = 0;
    #pragma omp parallel num_threads(threads)
    {
        __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
#define INIT(i) __m256 f##i = _mm256_set1_ps((float)i);
        TEN(INIT)
        for (long n = 0; n < iters; n++) {
            __asm__ volatile("" : "+x"(a), "+x"(b));
#define STEP(i) f##i = _mm256_fmadd_ps(a, b, f##i);
            TEN(STEP)
        }
#define SUM(i) + f##i[0]
        sink += 0 TEN(SUM);
    }
    return threads * iters * 10.0 * 16 / (omp_get_wtime() - t0) / 1e9;
}

static double maddubs_gops(int threads, long iters) {
    double t0 = omp_get_wtime();
    volatile int sink = 0;
    #pragma omp parallel num_threads(threads)
    {
        __m256i w0 = _mm256_set1_epi8(1), w1 = _mm256_set1_epi8(2), w2 = _mm256_set1_epi8(3), w3 = _mm256_set1_epi8(4);
        __m256i x0 = _mm256_set1_epi8(5), x1 = _mm256_set1_epi8(6);
#define IINIT(i) __m256i a##i = _mm256_setzero_si256();
        EIGHT(IINIT)
        /* 8 sums + 6 operands + 1 product fit the 16 registers; KEEP pins each sum (without it gcc
         * adds the products together first, runs out of registers and keeps sums in memory, which
         * measured a ceiling 1.3x too low) */
#define KEEP(v) __asm__("" : "+x"(v));
        for (long n = 0; n < iters; n++) {
            __asm__ volatile("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3), "+x"(x0), "+x"(x1));
            /* the int4 kernel's inner step: two products (low and high nibbles) into each sum;
             * x is renewed halfway so that no product is computed once for two sums */
#define ISTEP(i, w, x) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(w, x)); KEEP(a##i)
            ISTEP(0, w0, x0) ISTEP(1, w1, x0) ISTEP(2, w2, x0) ISTEP(3, w3, x0)
            ISTEP(4, w0, x1) ISTEP(5, w1, x1) ISTEP(6, w2, x1) ISTEP(7, w3, x1)
            __asm__ volatile("" : "+x"(x0), "+x"(x1));
            ISTEP(0, w0, x1) ISTEP(1, w1, x1) ISTEP(2, w2, x1) ISTEP(3, w3, x1)
            ISTEP(4, w0, x0) ISTEP(5, w1, x0) ISTEP(6, w2, x0) ISTEP(7, w3, x0)
        }
#define ISUM(i) + _mm256_extract_epi16(a##i, 0)
        sink += 0 EIGHT(ISUM);
    }
    /* each maddubs: 32 multiply-adds = 64 operations */
    return threads * iters * 16.0 * 64 / (omp_get_wtime() - t0) / 1e9;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* vpdpbusd on 512-bit vectors into 8 independent int32 sums (the int4 kernel's tile of 8 rows of
 * x): 64 byte products summed 4 at a time per instruction = 128 operations */
static double dpbusd_gops(int threads, long iters) {
    double t0 = omp_get_wtime();
    volatile int sink = 0;
    #pragma omp parallel num_threads(threads)
    {
        __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
#define VINIT(i) __m512i v##i = _mm512_setzero_si512();
        EIGHT(VINIT)
        for (long n = 0; n < iters; n++) {
            __asm__ volatile("" : "+v"(w), "+v"(x));
#define VSTEP(i) v##i = _mm512_dpbusd_epi32(v##i, w, x); __asm__("" : "+v"(v##i));
            EIGHT(VSTEP)
        }
#define VSUM(i) + _mm512_reduce_add_epi32(v##i)
        sink += 0 EIGHT(VSUM);
    }
    return threads * iters * 8.0 * 128 / (omp_get_wtime() - t0) / 1e9;
}
#endif

#if defined(__AVX512BF16__)
/* vdpbf16ps on 512-bit vectors into 8 independent fp32 sums: 32 bf16 products = 64 operations */
static double dpbf16_gflops(int threads, long iters) {
    double t0 = omp_get_wtime();
    volatile float sink = 0;
    #pragma omp parallel num_threads(threads)
    {
        __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80), x = (__m512bh)_mm512_set1_epi16(0x3f80);
#define BINIT(i) __m512 b##i = _mm512_setzero_ps();
        EIGHT(BINIT)
        for (long n = 0; n < iters; n++) {
            __asm__ volatile("" : "+v"(w), "+v"(x));
#define BSTEP(i) b##i = _mm512_dpbf16_ps(b##i, w, x); __asm__("" : "+v"(b##i));
            EIGHT(BSTEP)
        }
#define BSUM(i) + _mm512_reduce_add_ps(b##i)
        sink += 0 EIGHT(BSUM);
    }
    return threads * iters * 8.0 * 64 / (omp_get_wtime() - t0) / 1e9;
}
#endif

/* GB/s of reading `bytes` at `buf` in runs of `run` bytes, the runs in a shuffled order (run ==
 * bytes: one sequential pass split among the threads); the best of three passes. */
static double read_gbps(int threads, const float *buf, long bytes, long run) {
    long runs = bytes / run, *order = malloc(runs * sizeof(long));
    for (long i = 0; i < runs; i++) order[i] = i;
    srand(1);
    for (long i = runs - 1; i > 0 && run < bytes; i--) {
        long j = rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    long parts = run < bytes ? runs : threads * 64, part = bytes / parts;  /* a sequential pass in slices */
    double best = 1e30;
    volatile float sink = 0;
    for (int pass = 0; pass < 3; pass++) {
        double t0 = omp_get_wtime();
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long r = 0; r < parts; r++) {
            const float *p = buf + (run < bytes ? order[r] * run : r * part) / 4;
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            for (long i = 0; i < part / 4; i += 16) {
                a = _mm256_add_ps(a, _mm256_load_ps(p + i));
                b = _mm256_add_ps(b, _mm256_load_ps(p + i + 8));
            }
            sink += _mm256_cvtss_f32(_mm256_add_ps(a, b));
        }
        double t = omp_get_wtime() - t0;
        best = t < best ? t : best;
    }
    free(order);
    return bytes / best / 1e9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    long iters = 200000000;
    printf("%d threads: fp32 FMA %.0f GFLOPS; int8 maddubs + int16 add %.0f GOPS\n", threads,
           fma_gflops(threads, iters), maddubs_gops(threads, iters / 2));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    printf("%d threads: int8 vpdpbusd (512-bit) %.0f GOPS\n", threads, dpbusd_gops(threads, iters / 2));
#endif
#if defined(__AVX512BF16__)
    printf("%d threads: bf16 vdpbf16ps (512-bit) %.0f GFLOPS\n", threads, dpbf16_gflops(threads, iters / 2));
#endif
    long bytes = 512L << 20;
    float *buf = aligned_alloc(2 << 20, bytes);
    madvise(buf, bytes, MADV_HUGEPAGE);  /* as Anna keeps its KV cache */
    for (long i = 0; i < bytes / 4; i++) buf[i] = 1.0f;
    printf("%d threads reading 512 MB: runs of 4 KB in random order %.1f GB/s, 32 KB %.1f, 256 KB %.1f; "
           "sequential %.1f\n", threads, read_gbps(threads, buf, bytes, 4096), read_gbps(threads, buf, bytes, 32768),
           read_gbps(threads, buf, bytes, 262144), read_gbps(threads, buf, bytes, bytes));
    free(buf);
    return 0;
}
