/* The bf16 product of the amx variant on matrix tiles (amx_tile.h), with
 * stria_kern_ops_t.gemm_bf16's whole contract. A template: the including
 * file defines STRIA__AMX_NAME (its function is stria__<name>_gemm_bf16)
 * and STRIA__AMX_VEC (a vector bf16 product with the same contract, for
 * what the tiles do not cover), includes amx_tile.h, then this file.
 *
 * The tiles take A as rows along k and B in pairs along k (gemm_bf16's B
 * already is). They cover the first m / 16 * 16 rows of C and the first
 * k / 32 * 32 of k, by blocks of 32 x 32 of C (four accumulator tiles, two
 * of A, two of B: every loaded tile serves two products); the vector
 * product adds the rest of k to those rows and computes the last m % 16
 * rows whole, so no tile reads past the operands. A product with trans_a
 * (A in pairs along k, what the driver's row path hands in) runs on the
 * vector product: the driver's tile path never asks for one. */

#define STRIA__AMX_PASTE_(a, b, c) a##b##c
#define STRIA__AMX_PASTE(a, b, c)  STRIA__AMX_PASTE_(a, b, c)
#define STRIA__AMX_FN(f)           STRIA__AMX_PASTE(stria__, STRIA__AMX_NAME, _##f)

/* C[0..mt)[0..n) (+)= A[0..mt)[0..kt) B[0..kt)[0..n) on tiles: mt a
 * multiple of 16, kt of 32, n of 16. */
static void STRIA__AMX_FN(tile_product)(int mt, int n, int kt, const uint16_t *a, ptrdiff_t lda,
                                        const uint16_t *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                                        bool accumulate)
{
    const ptrdiff_t sa = lda * 2, sb = ldb * 2, sc = ldc * 4; /* bytes between rows */
    stria__tile_config();
    for (int i0 = 0; i0 < mt; i0 += 32) {
        const bool two_i = i0 + 32 <= mt;
        for (int j0 = 0; j0 < n; j0 += 32) {
            const bool two_j = j0 + 32 <= n;
            float *c0 = c + (ptrdiff_t)i0 * ldc + j0, *c1 = c0 + 16 * ldc;
            if (accumulate) {
                STRIA__TILE_LOAD(0, c0, sc);
                if (two_j)
                    STRIA__TILE_LOAD(1, c0 + 16, sc);
                if (two_i)
                    STRIA__TILE_LOAD(2, c1, sc);
                if (two_i && two_j)
                    STRIA__TILE_LOAD(3, c1 + 16, sc);
            } else {
                STRIA__TILE_ZERO(0);
                STRIA__TILE_ZERO(1);
                STRIA__TILE_ZERO(2);
                STRIA__TILE_ZERO(3);
            }
            for (int p = 0; p < kt; p += 32) {
                const uint16_t *ap = a + (ptrdiff_t)i0 * lda + p;
                const uint16_t *bp = b + (ptrdiff_t)(p / 2) * ldb + 2 * j0;
                STRIA__TILE_LOAD(4, ap, sa);
                STRIA__TILE_LOAD(6, bp, sb);
                STRIA__TILE_DPBF16PS(0, 4, 6);
                if (two_j) {
                    STRIA__TILE_LOAD(7, bp + 32, sb);
                    STRIA__TILE_DPBF16PS(1, 4, 7);
                }
                if (two_i) {
                    STRIA__TILE_LOAD(5, ap + 16 * lda, sa);
                    STRIA__TILE_DPBF16PS(2, 5, 6);
                    if (two_j)
                        STRIA__TILE_DPBF16PS(3, 5, 7);
                }
            }
            STRIA__TILE_STORE(0, c0, sc);
            if (two_j)
                STRIA__TILE_STORE(1, c0 + 16, sc);
            if (two_i)
                STRIA__TILE_STORE(2, c1, sc);
            if (two_i && two_j)
                STRIA__TILE_STORE(3, c1 + 16, sc);
        }
    }
    stria__tile_release();
}

/* See stria_kern_ops_t.gemm_bf16 and the top of this file. */
static void STRIA__AMX_FN(gemm_bf16)(int m, int n, int k, const uint16_t *a, ptrdiff_t lda,
                                     bool trans_a, const uint16_t *b, ptrdiff_t ldb, float *c,
                                     ptrdiff_t ldc, const float *c_scale, bool accumulate)
{
    const int mt = m / 16 * 16, kt = k / 32 * 32;
    if (trans_a || mt == 0 || kt == 0) {
        STRIA__AMX_VEC(m, n, k, a, lda, trans_a, b, ldb, c, ldc, c_scale, accumulate);
        return;
    }
    if (accumulate && c_scale != NULL) /* C = beta_i C, then accumulated */
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < n; j++)
                c[(ptrdiff_t)i * ldc + j] *= c_scale[i];
    STRIA__AMX_FN(tile_product)(mt, n, kt, a, lda, b, ldb, c, ldc, accumulate);
    if (kt < k)
        STRIA__AMX_VEC(mt, n, k - kt, a + kt, lda, false, b + (ptrdiff_t)(kt / 2) * ldb, ldb, c,
                       ldc, NULL, true);
    if (mt < m)
        STRIA__AMX_VEC(m - mt, n, k, a + (ptrdiff_t)mt * lda, lda, false, b, ldb,
                       c + (ptrdiff_t)mt * ldc, ldc, c_scale != NULL ? c_scale + mt : NULL,
                       accumulate);
}
