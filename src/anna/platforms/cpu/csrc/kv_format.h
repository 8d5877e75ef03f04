/* The stored form of KV cache rows (model/kv_format.py is the reference): float rows (fp32, bf16,
 * fp16), or bytes - the row's data, then one fp16 scale.
 * Attention decodes rows eight at a time into fp32 in L1 and runs its fp32 loops on them. */
#ifndef ANNA_KV_FORMAT_H
#define ANNA_KV_FORMAT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8 = 3, KV_INT8 = 4, KV_TQ4 = 5, KV_TQ3 = 6 };

typedef struct {
    int kind;              /* KV_* */
    long dim;              /* values per row (head_dim); a multiple of 8 for the quantized kinds */
    long row_bytes;        /* bytes per stored row */
    const float *rotation; /* TurboQuant: [dim, dim], a unit row u is stored as the levels nearest R u */
    const float *levels;   /* TurboQuant: 16 (4 bits) or 8 (3 bits) levels */
    const float *bounds;   /* TurboQuant: the levels' cell boundaries, ascending */
} AnnaKVFormat;

static inline long kv_data_bytes(int kind, long dim) {
    return kind == KV_TQ4 ? dim / 2 : kind == KV_TQ3 ? dim * 3 / 8 : dim;
}

/* The row's scale (fp8: times 256, see kv_load8); 1 for float rows. */
static inline __attribute__((always_inline)) float kv_row_scale(int kind, const uint8_t *row, long dim) {
    if (kind <= KV_F16) return 1.0f;
    uint16_t h;
    memcpy(&h, row + kv_data_bytes(kind, dim), 2);
    float s = _cvtsh_ss(h);
    return kind == KV_FP8 ? s * 256.0f : s;
}

/* Values d .. d + 7 of a row, before its scale. fp8 e4m3 goes through fp16: its sign, exponent and
 * mantissa bits shifted into an fp16's give the value times 2^-8, subnormals included. TurboQuant:
 * the indices select levels from registers (lo: levels 0-7, hi: 8-15). */
static inline __attribute__((always_inline)) __m256 kv_load8(int kind, const uint8_t *row, long d, __m256 lo,
                                                             __m256 hi) {
    switch (kind) {
    case KV_BF16: {
        __m128i v = _mm_loadu_si128((const __m128i *)(row + 2 * d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    case KV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * d)));
    case KV_FP8: {
        __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + d)));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
        return _mm256_cvtph_ps(h);
    }
    case KV_INT8:
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
    case KV_TQ4: {
        uint32_t w;
        memcpy(&w, row + d / 2, 4);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                                         _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(15));
        __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
        return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
    case KV_TQ3: {
        const uint8_t *p = row + d * 3 / 8;
        uint32_t w = p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                                         _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21)),
                                       _mm256_set1_epi32(7));
        return _mm256_permutevar8x32_ps(lo, idx);
    }
    default:
        return _mm256_loadu_ps((const float *)row + d);
    }
}

/* A whole row, scale applied, into out[dim] (dim a multiple of 8). */
static inline __attribute__((always_inline)) void kv_decode_row(int kind, const uint8_t *row, long dim, __m256 lo,
                                                                __m256 hi, float *out) {
    __m256 s = _mm256_set1_ps(kv_row_scale(kind, row, dim));
    for (long d = 0; d < dim; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(kv_load8(kind, row, d, lo, hi), s));
}

#ifdef __AVX512F__
/* Values d .. d + 15 of a row, before its scale, in one 512-bit vector (levels: TurboQuant's 16 or
 * 8 levels in the low lanes). */
static inline __attribute__((always_inline)) __m512 kv_load16(int kind, const uint8_t *row, long d, __m512 levels) {
    switch (kind) {
    case KV_BF16: {
        __m256i v = _mm256_loadu_si256((const __m256i *)(row + 2 * d));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    case KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * d)));
    case KV_FP8: {
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + d)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
        return _mm512_cvtph_ps(h);
    }
    case KV_INT8:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
    case KV_TQ4: {
        __m128i b = _mm_loadl_epi64((const __m128i *)(row + d / 2));
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), levels);
    }
    case KV_TQ3: {
        const uint8_t *p = row + d * 3 / 8;
        uint32_t w0 = p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
        uint32_t w1 = p[3] | ((uint32_t)p[4] << 8) | ((uint32_t)p[5] << 16);
        __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32((int)w0)),
                                           _mm256_set1_epi32((int)w1), 1);
        __m512i shifts = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
        return _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(7)),
                                     levels);
    }
    default:
        return _mm512_loadu_ps((const float *)row + d);
    }
}

static inline __attribute__((always_inline)) void kv_decode_row16(int kind, const uint8_t *row, long dim,
                                                                  __m512 levels, float *out) {
    __m512 s = _mm512_set1_ps(kv_row_scale(kind, row, dim));
    for (long d = 0; d < dim; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(kv_load16(kind, row, d, levels), s));
}
#endif

/* The rows' values, written by attention's callers (csrc/kv_cache.c). */
void anna_kv_store_row(const AnnaKVFormat *f, const float *x, uint8_t *dst);
void anna_kv_write(const AnnaKVFormat *f, const float *rows, long row_stride, long tokens, long kv_heads,
                   void *cache, const long *slots, long block_size);

#endif
