/* The amx variant's algorithm on any CPU: "amx-emu", registered at start
 * (a constructor) in every test program that links this object, chosen only
 * explicitly (the suites' loops over stria_kernels_variant_names() do). It
 * is the portable variant's operations with the amx variant's bf16 product
 * (kernels/cpu/amx_gemm.h) over the plain-C emulation of the tiles
 * (kernels/cpu/amx_tile.h with STRIA_AMX_EMU, TDPBF16PS's semantics), and the
 * driver's tile path (`tiles`): V^T and K^T packed per key tile, O and dQ
 * transposed, head_dim padded to 32. What the hardware variant adds to it
 * is only the intrinsics of amx_tile.h and avx512's vector code. */
#define STRIA_AMX_EMU 1

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu/amx_tile.h"
#include "kernels_int.h"

/* The bf16 product in plain C (stria_kern_ops_t.gemm_bf16's contract) for
 * what the tiles do not cover, with the same per-pair arithmetic as the
 * emulated tiles. */
static void stria__emu_vec_gemm_bf16(int m, int n, int k, const uint16_t *a, ptrdiff_t lda,
                                     bool trans_a, const uint16_t *b, ptrdiff_t ldb, float *c,
                                     ptrdiff_t ldc, const float *c_scale, bool accumulate)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p += 2) {
                const uint16_t *ap =
                    trans_a ? a + (ptrdiff_t)(p / 2) * lda + 2 * i : a + (ptrdiff_t)i * lda + p;
                const uint16_t *bp = b + (ptrdiff_t)(p / 2) * ldb + 2 * j;
                acc = stria__emu_ftz(acc + stria__emu_bf16((const unsigned char *)ap) *
                                               stria__emu_bf16((const unsigned char *)bp));
                acc = stria__emu_ftz(acc + stria__emu_bf16((const unsigned char *)(ap + 1)) *
                                               stria__emu_bf16((const unsigned char *)(bp + 1)));
            }
            float *cp = c + (ptrdiff_t)i * ldc + j;
            float beta = !accumulate ? 0.0f : c_scale != NULL ? c_scale[i] : 1.0f;
            *cp = accumulate ? beta * *cp + acc : acc;
        }
}

#define STRIA__AMX_NAME amx_emu
#define STRIA__AMX_VEC  stria__emu_vec_gemm_bf16
#include "cpu/amx_gemm.h"

static bool stria__amx_emu_ok(void)
{
    return true;
}

static stria_kern_ops_t stria__kern_amx_emu;

__attribute__((constructor)) static void stria__amx_emu_register(void)
{
    stria__kern_amx_emu = stria__kern_portable;
    stria__kern_amx_emu.name = "amx-emu";
    stria__kern_amx_emu.gemm_bf16 = stria__amx_emu_gemm_bf16;
    stria__kern_amx_emu.gemm_bf16_ok = stria__amx_emu_ok;
    stria__kern_amx_emu.tiles = true;
    if (!stria__kern_register(&stria__kern_amx_emu))
        abort();
}
