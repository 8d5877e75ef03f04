/* Writing KV cache rows in their stored form (kv_format.h; model/kv_format.py is the reference and
 * gives the same bytes for float, int8 and fp8 rows; TurboQuant's rotation sums in another order,
 * so a coordinate within rounding of a cell boundary may land in the neighbouring cell). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kv_format.h"

/* float -> float8 e4m3 (|x| <= 448), rounding to nearest even, as torch's conversion. */
static uint8_t to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(x);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);  /* subnormal steps of 2^-9 (8: the smallest normal) */
    memcpy(&u, &a, 4);
    u += 0x7FFFF + ((u >> 20) & 1);  /* round the 23-bit mantissa to 3 bits */
    int e = (int)(u >> 23) - 127 + 7;
    uint8_t m = (uint8_t)((u >> 20) & 7);
    if (e > 15 || (e == 15 && m == 7)) return sign | 0x7E;  /* 448 */
    return sign | (uint8_t)(e << 3) | m;
}

static inline uint16_t to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

static void store_scaled(int kind, const float *x, long dim, uint8_t *dst) {
    float amax = 0.0f;
    for (long d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    uint16_t h = to_f16(amax / (kind == KV_FP8 ? 448.0f : 127.0f));
    float s = _cvtsh_ss(h);
    for (long d = 0; d < dim; d++) {
        float v = s > 0.0f ? x[d] / s : 0.0f;
        if (kind == KV_INT8)
            dst[d] = (uint8_t)(int8_t)fminf(fmaxf(nearbyintf(v), -127.0f), 127.0f);
        else
            dst[d] = to_e4m3(fminf(fmaxf(v, -448.0f), 448.0f));
    }
    memcpy(dst + dim, &h, 2);
}

static void store_turboquant(const AnnaKVFormat *f, const float *x, uint8_t *dst) {
    long dim = f->dim, n_bounds = f->kind == KV_TQ4 ? 15 : 7;
    float sq = 0.0f;
    for (long d = 0; d < dim; d++) sq += x[d] * x[d];
    float norm = sqrtf(sq), inv = norm > 0.0f ? 1.0f / norm : 0.0f;
    uint8_t idx[1024];
    float kept = 0.0f;  /* the levels' squared norm: the scale makes the decoded row as long as x */
    for (long i = 0; i < dim; i++) {
        const float *r = f->rotation + i * dim;
        float y = 0.0f;
        for (long j = 0; j < dim; j++) y += r[j] * x[j];
        y *= inv;
        uint8_t k = 0;
        while (k < n_bounds && f->bounds[k] < y) k++;
        idx[i] = k;
        kept += f->levels[k] * f->levels[k];
    }
    long bytes = kv_data_bytes(f->kind, dim);
    if (f->kind == KV_TQ4) {
        for (long i = 0; i < dim; i += 2) dst[i / 2] = (uint8_t)(idx[i] | (idx[i + 1] << 4));
    } else {
        for (long g = 0; g < dim / 8; g++) {
            uint32_t w = 0;
            for (int j = 0; j < 8; j++) w |= (uint32_t)idx[g * 8 + j] << (3 * j);
            dst[g * 3] = (uint8_t)w;
            dst[g * 3 + 1] = (uint8_t)(w >> 8);
            dst[g * 3 + 2] = (uint8_t)(w >> 16);
        }
    }
    uint16_t h = to_f16(norm / sqrtf(kept));
    memcpy(dst + bytes, &h, 2);
}

void anna_kv_store_row(const AnnaKVFormat *f, const float *x, uint8_t *dst) {
    long dim = f->dim;
    switch (f->kind) {
    case KV_BF16:
        for (long d = 0; d < dim; d++) ((uint16_t *)dst)[d] = to_bf16(x[d]);
        break;
    case KV_F16:
        for (long d = 0; d < dim; d++) ((uint16_t *)dst)[d] = to_f16(x[d]);
        break;
    case KV_FP8:
    case KV_INT8:
        store_scaled(f->kind, x, dim, dst);
        break;
    case KV_TQ4:
    case KV_TQ3:
        store_turboquant(f, x, dst);
        break;
    default:
        memcpy(dst, x, sizeof(float) * dim);
    }
}

/* rows: token t's KV head h at rows + t * row_stride + h * dim; written at slots[t] of a cache
 * [blocks, kv_heads, block_size, row]. */
void anna_kv_write(const AnnaKVFormat *f, const float *rows, long row_stride, long tokens, long kv_heads,
                   void *cache, const long *slots, long block_size) {
    for (long t = 0; t < tokens; t++) {
        long blk = slots[t] / block_size, off = slots[t] % block_size;
        for (long h = 0; h < kv_heads; h++)
            anna_kv_store_row(f, rows + t * row_stride + h * f->dim,
                              (uint8_t *)cache + ((blk * kv_heads + h) * block_size + off) * f->row_bytes);
    }
}
