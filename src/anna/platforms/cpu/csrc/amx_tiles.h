/* AMX tile operations for the int4 and int8 kernels' AMX path (quant_kernels.c) and prompt
 * attention's (prefill_attention.c), and their emulation.
 *
 * ANNA_AMX is 1 in the amx level's build (-mamx-tile -mamx-int8 -mamx-bf16: kernels.py
 * LEVEL_CFLAGS), where the operations below are the AMX instructions, and in a build with
 * ANNA_AMX_EMULATE defined, where they are plain C with the instructions' semantics (Intel's
 * pseudocode for LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBSUD, TDPBSSD and TDPBF16PS). The
 * emulated build runs the very kernel code that the AMX build runs on CPUs without AMX, so that its
 * layout, padding and scaling are tested everywhere (tests/test_quantization.py,
 * tests/test_cpu_isa.py), and it traps where the CPU would fault (a configuration LDTILECFG
 * rejects, a tile used unconfigured or in mismatched shapes); only the instructions themselves
 * need an AMX CPU.
 *
 * Tiles are thread state: each thread loads the configuration before its first tile operation
 * and releases the tiles when done. Linux also wants the process to ask for the tile data state
 * once before any thread uses it: kernels.py asks before it builds or loads the amx level. */
#ifndef ANNA_AMX_TILES_H
#define ANNA_AMX_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(ANNA_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__))
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
static __thread int amx_emulated_configured;

/* What the CPU faults on (#GP in LDTILECFG, #UD in the tile operations) traps here too, so that a
 * configuration or use the hardware would reject fails the emulated build's tests instead. */
#define AMX_EMULATED_CHECK(ok) ((ok) ? (void)0 : __builtin_trap())

static inline void amx_load_config(const amx_config *cfg) {
    AMX_EMULATED_CHECK(cfg->palette == 1 && cfg->start_row == 0);
    for (int i = 0; i < 14; i++) AMX_EMULATED_CHECK(cfg->reserved[i] == 0);
    for (int t = 8; t < 16; t++) AMX_EMULATED_CHECK(cfg->rows[t] == 0 && cfg->colsb[t] == 0);
    for (int t = 0; t < 8; t++) {
        AMX_EMULATED_CHECK(cfg->rows[t] <= 16 && cfg->colsb[t] <= 64 && (cfg->rows[t] == 0) == (cfg->colsb[t] == 0));
        amx_emulated[t].rows = cfg->rows[t];
        amx_emulated[t].colsb = cfg->colsb[t];
        memset(amx_emulated[t].data, 0, sizeof(amx_emulated[t].data));
    }
    amx_emulated_configured = 1;
}

/* tile t, checked usable: the thread has loaded a configuration that gives it rows */
static inline amx_emulated_tile *amx_emulated_tile_in_use(int t) {
    AMX_EMULATED_CHECK(amx_emulated_configured && amx_emulated[t].rows > 0);
    return &amx_emulated[t];
}

static inline void amx_emulated_load(int t, const void *base, long stride) {
    amx_emulated_tile *tile = amx_emulated_tile_in_use(t);
    for (int r = 0; r < tile->rows; r++) memcpy(tile->data[r], (const uint8_t *)base + r * stride, tile->colsb);
}

static inline void amx_emulated_store(int t, void *base, long stride) {
    amx_emulated_tile *tile = amx_emulated_tile_in_use(t);
    for (int r = 0; r < tile->rows; r++) memcpy((uint8_t *)base + r * stride, tile->data[r], tile->colsb);
}

static inline void amx_emulated_zero(int t) { memset(amx_emulated_tile_in_use(t)->data, 0, sizeof(amx_emulated[t].data)); }

/* dst[m][n] += sum over k, i < 4 of a[m][4k + i] (signed) * b[k][4n + i]: unsigned (TDPBSUD) or,
 * where b_signed, signed (TDPBSSD) */
static inline void amx_emulated_dpbs(int dst, int a, int b, int b_signed) {
    AMX_EMULATED_CHECK(dst != a && dst != b && a != b);
    amx_emulated_tile *c = amx_emulated_tile_in_use(dst), *x = amx_emulated_tile_in_use(a),
                      *w = amx_emulated_tile_in_use(b);
    AMX_EMULATED_CHECK(x->rows == c->rows && x->colsb % 4 == 0 && x->colsb / 4 == w->rows && w->colsb == c->colsb);
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            int32_t sum;
            memcpy(&sum, c->data[m] + 4 * n, 4);
            for (int k = 0; k < x->colsb / 4; k++)
                for (int i = 0; i < 4; i++) {
                    uint8_t wb = w->data[k][4 * n + i];
                    sum += (int32_t)(int8_t)x->data[m][4 * k + i] * (b_signed ? (int32_t)(int8_t)wb : (int32_t)wb);
                }
            memcpy(c->data[m] + 4 * n, &sum, 4);
        }
}

static inline float amx_emulated_bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* dst[m][n] (fp32) += a[m][2k] * b[k][2n] + a[m][2k + 1] * b[k][2n + 1] over k (bf16 pairs; each
 * product is exact in fp32, the sums rounded in this order) */
static inline void amx_emulated_dpbf16ps(int dst, int a, int b) {
    AMX_EMULATED_CHECK(dst != a && dst != b && a != b);
    amx_emulated_tile *c = amx_emulated_tile_in_use(dst), *x = amx_emulated_tile_in_use(a),
                      *w = amx_emulated_tile_in_use(b);
    AMX_EMULATED_CHECK(x->rows == c->rows && x->colsb % 4 == 0 && x->colsb / 4 == w->rows && w->colsb == c->colsb);
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            float sum;
            memcpy(&sum, c->data[m] + 4 * n, 4);
            for (int k = 0; k < x->colsb / 4; k++) {
                sum += amx_emulated_bf16(x->data[m] + 4 * k) * amx_emulated_bf16(w->data[k] + 4 * n);
                sum += amx_emulated_bf16(x->data[m] + 4 * k + 2) * amx_emulated_bf16(w->data[k] + 4 * n + 2);
            }
            memcpy(c->data[m] + 4 * n, &sum, 4);
        }
}

#define AMX_LOAD_CONFIG(cfg) amx_load_config(cfg)
#define AMX_LOAD(t, base, stride) amx_emulated_load(t, base, stride)
#define AMX_STORE(t, base, stride) amx_emulated_store(t, base, stride)
#define AMX_ZERO(t) amx_emulated_zero(t)
#define AMX_DPBSUD(dst, a, b) amx_emulated_dpbs(dst, a, b, 0)
#define AMX_DPBSSD(dst, a, b) amx_emulated_dpbs(dst, a, b, 1)
#define AMX_DPBF16PS(dst, a, b) amx_emulated_dpbf16ps(dst, a, b)
#define AMX_RELEASE() (amx_emulated_configured = 0)
#define AMX_REQUEST_TILES() 0

#else  /* the instructions */

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux's per-process permission for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA; kernels.py asks the same from Python): 0 when granted */
#define AMX_REQUEST_TILES() (syscall(SYS_arch_prctl, 0x1023L, 18L) == 0 ? 0 : -1)

#define AMX_LOAD_CONFIG(cfg) _tile_loadconfig(cfg)
#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DPBSUD(dst, a, b) _tile_dpbsud(dst, a, b)
#define AMX_DPBSSD(dst, a, b) _tile_dpbssd(dst, a, b)
#define AMX_DPBF16PS(dst, a, b) _tile_dpbf16ps(dst, a, b)
#define AMX_RELEASE() _tile_release()

#endif
#endif
#endif
