/* fp32 -> bf16, rounding to nearest even (finite values; what torch's conversion gives them): for
 * kernels whose output feeds a bf16 GEMM. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

static inline __attribute__((always_inline)) void store8_bf16(uint16_t *dst, __m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void store16_bf16(uint16_t *dst, __m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(b));
}

static inline __attribute__((always_inline)) __m512 load16_bf16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}
#endif

static inline __attribute__((always_inline)) uint16_t to_bf16(float f) {
    uint32_t b;
    __builtin_memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
