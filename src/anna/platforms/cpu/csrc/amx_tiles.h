/* AMX tile operations for the int4 kernel's AMX path (quant_kernels.c), and their emulation.
 *
 * ANNA_AMX is 1 in the amx level's build (-mamx-tile -mamx-int8: kernels.py LEVEL_CFLAGS), where
 * the operations below are the AMX instructions, and in a build with ANNA_AMX_EMULATE defined,
 * where they are plain C with the instructions' semantics (Intel's pseudocode for LDTILECFG,
 * TILELOADD, TILESTORED, TILEZERO and TDPBSUD). The emulated build runs the very kernel code that
 * the AMX build runs on CPUs without AMX, so that its layout, padding and scaling are tested
 * everywhere (tests/test_cpu_kernels.py); only the instructions themselves need an AMX CPU.
 *
 * Tiles are thread state: each thread loads the configuration before its first tile operation
 * and releases the tiles when done. Linux also wants the process to ask for the tile data state
 * once before any thread uses it: kernels.py asks before it builds or loads the amx level. */
#ifndef ANNA_AMX_TILES_H
#define ANNA_AMX_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(ANNA_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_INT8__))
#define ANNA_AMX 1
#else
#define ANNA_AMX 0
#endif

#if ANNA_AMX

/* LDTILECFG's 64-byte operand (palette 1: 8 tiles of up to 16 rows of 64 bytes) */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];  /* bytes per row of tile i */
    uint8_t rows[16];    /* rows of tile i */
} __attribute__((packed, aligned(64))) amx_config;

#ifdef ANNA_AMX_EMULATE

typedef struct {
    int rows, colsb;
    uint8_t data[16][64];
} amx_emulated_tile;

static __thread amx_emulated_tile amx_emulated[8];

static inline void amx_load_config(const amx_config *cfg) {
    for (int t = 0; t < 8; t++) {
        amx_emulated[t].rows = cfg->rows[t];
        amx_emulated[t].colsb = cfg->colsb[t];
        memset(amx_emulated[t].data, 0, sizeof(amx_emulated[t].data));
    }
}

static inline void amx_emulated_load(int t, const void *base, long stride) {
    for (int r = 0; r < amx_emulated[t].rows; r++)
        memcpy(amx_emulated[t].data[r], (const uint8_t *)base + r * stride, amx_emulated[t].colsb);
}

static inline void amx_emulated_store(int t, void *base, long stride) {
    for (int r = 0; r < amx_emulated[t].rows; r++)
        memcpy((uint8_t *)base + r * stride, amx_emulated[t].data[r], amx_emulated[t].colsb);
}

/* dst[m][n] += sum over k, i < 4 of a[m][4k + i] (signed) * b[k][4n + i] (unsigned) */
static inline void amx_emulated_dpbsud(int dst, int a, int b) {
    amx_emulated_tile *c = &amx_emulated[dst], *x = &amx_emulated[a], *w = &amx_emulated[b];
    if (x->rows != c->rows || x->colsb / 4 != w->rows || w->colsb != c->colsb) __builtin_trap();  /* #UD */
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            int32_t sum;
            memcpy(&sum, c->data[m] + 4 * n, 4);
            for (int k = 0; k < x->colsb / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (int32_t)(int8_t)x->data[m][4 * k + i] * (int32_t)w->data[k][4 * n + i];
            memcpy(c->data[m] + 4 * n, &sum, 4);
        }
}

#define AMX_LOAD_CONFIG(cfg) amx_load_config(cfg)
#define AMX_LOAD(t, base, stride) amx_emulated_load(t, base, stride)
#define AMX_STORE(t, base, stride) amx_emulated_store(t, base, stride)
#define AMX_ZERO(t) memset(amx_emulated[t].data, 0, sizeof(amx_emulated[t].data))
#define AMX_DPBSUD(dst, a, b) amx_emulated_dpbsud(dst, a, b)
#define AMX_RELEASE() ((void)0)

#else  /* the instructions */

#include <immintrin.h>

#define AMX_LOAD_CONFIG(cfg) _tile_loadconfig(cfg)
#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DPBSUD(dst, a, b) _tile_dpbsud(dst, a, b)
#define AMX_RELEASE() _tile_release()

#endif
#endif
#endif
