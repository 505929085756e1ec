/* The matrix tiles of the amx variant: the only code that differs between
 * the hardware and its emulation, kept to a handful of one-line mappings.
 *
 * Every tile is configured alike, 16 rows of 64 bytes: a C tile is 16 x 16
 * fp32; an A tile 16 rows of 32 bf16 along k; a B tile 16 rows of 16 pairs
 * of bf16 (rows are pairs of k, VNNI order: B(p, j) at row p / 2, element
 * 2 j + p % 2). TDPBF16PS adds A B to C: for every (m, n), over the 16 pairs
 * of k in order, the product of the pair's even elements, then of its odd
 * ones, each added in fp32 to nearest even; bf16 inputs that are subnormal
 * count as zero and subnormal sums are flushed to zero (Intel SDM,
 * TDPBF16PS; MXCSR is not consulted).
 *
 * Built with STRIA_AMX_EMU the same operations are plain C on thread-local
 * tiles (the test builds' amx-emu variant, tests/kernels/amx_emu.c, runs the
 * tile path of the driver on any CPU); otherwise they are the AMX
 * intrinsics (compile with -mamx-tile -mamx-bf16; run only after
 * stria__amx_why_not() said yes). Tile numbers are constants. */
#ifndef STRIA_AMX_TILE_H
#define STRIA_AMX_TILE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define STRIA__TILE_ROWS  16
#define STRIA__TILE_BYTES 64

#ifndef STRIA_AMX_EMU
#include <immintrin.h>

/* Palette 1, tiles 0..7 all STRIA__TILE_ROWS x STRIA__TILE_BYTES. */
static inline void stria__tile_config(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = STRIA__TILE_BYTES;
        cfg.rows[t] = STRIA__TILE_ROWS;
    }
    _tile_loadconfig(&cfg);
}

#define stria__tile_release()              _tile_release()
#define STRIA__TILE_ZERO(t)                _tile_zero(t)
#define STRIA__TILE_LOAD(t, base, stride)  _tile_loadd(t, base, stride)
#define STRIA__TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define STRIA__TILE_DPBF16PS(c, a, b)      _tile_dpbf16ps(c, a, b)

#else /* the emulation */

typedef struct {
    unsigned char row[STRIA__TILE_ROWS][STRIA__TILE_BYTES];
} stria__emu_tile_t;

static _Thread_local stria__emu_tile_t stria__emu_tiles[8];

static inline void stria__tile_config(void)
{
    memset(stria__emu_tiles, 0, sizeof(stria__emu_tiles));
}

static inline void stria__tile_release(void) {}

static inline void stria__emu_tile_zero(int t)
{
    memset(&stria__emu_tiles[t], 0, sizeof(stria__emu_tiles[t]));
}

static inline void stria__emu_tile_load(int t, const void *base, ptrdiff_t stride)
{
    for (int r = 0; r < STRIA__TILE_ROWS; r++)
        memcpy(stria__emu_tiles[t].row[r], (const char *)base + r * stride, STRIA__TILE_BYTES);
}

static inline void stria__emu_tile_store(int t, void *base, ptrdiff_t stride)
{
    for (int r = 0; r < STRIA__TILE_ROWS; r++)
        memcpy((char *)base + r * stride, stria__emu_tiles[t].row[r], STRIA__TILE_BYTES);
}

/* A bf16 input as TDPBF16PS reads it: subnormals are zero. */
static inline float stria__emu_bf16(const unsigned char *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7f800000u) == 0)
        u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A sum as TDPBF16PS writes it: subnormals flushed to zero. */
static inline float stria__emu_ftz(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0)
        u &= 0x80000000u;
    memcpy(&x, &u, 4);
    return x;
}

static inline void stria__emu_tile_dpbf16ps(int c, int a, int b)
{
    for (int m = 0; m < STRIA__TILE_ROWS; m++)
        for (int n = 0; n < STRIA__TILE_BYTES / 4; n++) {
            float acc;
            memcpy(&acc, &stria__emu_tiles[c].row[m][4 * n], 4);
            for (int k = 0; k < STRIA__TILE_BYTES / 4; k++) {
                const unsigned char *ap = &stria__emu_tiles[a].row[m][4 * k];
                const unsigned char *bp = &stria__emu_tiles[b].row[k][4 * n];
                acc = stria__emu_ftz(acc + stria__emu_bf16(ap) * stria__emu_bf16(bp));
                acc = stria__emu_ftz(acc + stria__emu_bf16(ap + 2) * stria__emu_bf16(bp + 2));
            }
            memcpy(&stria__emu_tiles[c].row[m][4 * n], &acc, 4);
        }
}

#define STRIA__TILE_ZERO(t)                stria__emu_tile_zero(t)
#define STRIA__TILE_LOAD(t, base, stride)  stria__emu_tile_load(t, base, stride)
#define STRIA__TILE_STORE(t, base, stride) stria__emu_tile_store(t, base, stride)
#define STRIA__TILE_DPBF16PS(c, a, b)      stria__emu_tile_dpbf16ps(c, a, b)

#endif

#endif
