/* A stored weight's values as fp32: bf16 (wtype 0), fp16 (1) or fp32 (2), the types of the float
 * kernels' weights (kernels.py: WEIGHT_TYPES). */
#ifndef ANNA_WEIGHT_TYPES_H
#define ANNA_WEIGHT_TYPES_H

#include <immintrin.h>
#include <stdint.h>

#include "vec_math.h"

/* Values i .. i + 7 */
INLINE __m256 load8(const void *w, int wtype, long i) {
    if (wtype == 0) {
        __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    } else if (wtype == 1) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* Value i */
INLINE float load1(const void *w, int wtype, long i) {
    if (wtype == 0) {
        uint32_t bits = ((uint32_t)((const uint16_t *)w)[i]) << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return f;
    } else if (wtype == 1) {
        return _cvtsh_ss(((const uint16_t *)w)[i]);
    }
    return ((const float *)w)[i];
}

#endif
