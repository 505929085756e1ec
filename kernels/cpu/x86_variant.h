/* What the x86 variants share: the softmax passes, the polynomial of their
 * exp, the column scale of the tile path and the transpose entry, written once over a vector of
 * STRIA__X86_BITS / 32 floats (see stria_kern_ops_t for what each pass computes). Each variant
 * includes this file once, after defining STRIA__INLINE (static inline, always inlined),
 * STRIA__X86_BITS (256 or 512: its vectors are __m256, its intrinsics
 * _mm256_*) and STRIA__X86_NAME (avx2: its functions are
 * stria__avx2_softmax_fwd, ...); after the include it defines
 * stria__round(x) (to the nearest integers), stria__exp(x) (exp to about
 * 1 ulp, 0 below ln(FLT_MIN), NaN kept; with stria__exp_poly()) and
 * stria__sub_of(m, ninf) (m, or 0 where m is -inf). Both variants run the
 * same arithmetic in the same order; only the vector width differs. */

#include "x86_transpose.h"

#define STRIA__PASTE3_(a, b, c) a##b##c
#define STRIA__PASTE3(a, b, c)  STRIA__PASTE3_(a, b, c)
#define STRIA__V                STRIA__PASTE3(__m, STRIA__X86_BITS, )
#define STRIA__VW               (STRIA__X86_BITS / 32)
#define STRIA__VX(op)           STRIA__PASTE3(_mm, STRIA__X86_BITS, _##op)
#define STRIA__VFN(f)           STRIA__PASTE3(stria__, STRIA__X86_NAME, _##f)

STRIA__INLINE STRIA__V stria__round(STRIA__V x);
STRIA__INLINE STRIA__V stria__exp(STRIA__V x);
STRIA__INLINE STRIA__V stria__sub_of(STRIA__V m, STRIA__V ninf);

/* exp(x) * 2^-n for n = round(x / ln 2), written to *n: Cephes' expf
 * polynomial on the reduced argument; the variant applies 2^n. */
STRIA__INLINE STRIA__V stria__exp_poly(STRIA__V x, STRIA__V *n_out)
{
    STRIA__V n = stria__round(STRIA__VX(mul_ps)(x, STRIA__VX(set1_ps)(1.44269504088896341f)));
    STRIA__V r = STRIA__VX(fnmadd_ps)(n, STRIA__VX(set1_ps)(0.693359375f), x);
    r = STRIA__VX(fnmadd_ps)(n, STRIA__VX(set1_ps)(-2.12194440e-4f), r);
    STRIA__V z = STRIA__VX(mul_ps)(r, r);
    STRIA__V y = STRIA__VX(set1_ps)(1.9875691500e-4f);
    y = STRIA__VX(fmadd_ps)(y, r, STRIA__VX(set1_ps)(1.3981999507e-3f));
    y = STRIA__VX(fmadd_ps)(y, r, STRIA__VX(set1_ps)(8.3334519073e-3f));
    y = STRIA__VX(fmadd_ps)(y, r, STRIA__VX(set1_ps)(4.1665795894e-2f));
    y = STRIA__VX(fmadd_ps)(y, r, STRIA__VX(set1_ps)(1.6666665459e-1f));
    y = STRIA__VX(fmadd_ps)(y, r, STRIA__VX(set1_ps)(5.0000001201e-1f));
    y = STRIA__VX(fmadd_ps)(y, z, r);
    *n_out = n;
    return STRIA__VX(add_ps)(y, STRIA__VX(set1_ps)(1.0f));
}

static void STRIA__VFN(softmax_fwd)(float *st, int rows, int cols, ptrdiff_t ld, float scale,
                                    float *m, float *l, float *alpha)
{
    const STRIA__V vscale = STRIA__VX(set1_ps)(scale);
    const STRIA__V ninf = STRIA__VX(set1_ps)(-__builtin_inff());

    for (int i = 0; i < cols; i += STRIA__VW) {
        float *col = st + i;
        STRIA__V mx0 = ninf, mx1 = ninf;
        int j = 0;
        for (; j + 1 < rows; j += 2) {
            mx0 = STRIA__VX(max_ps)(mx0, STRIA__VX(loadu_ps)(col + (ptrdiff_t)j * ld));
            mx1 = STRIA__VX(max_ps)(mx1, STRIA__VX(loadu_ps)(col + (ptrdiff_t)(j + 1) * ld));
        }
        if (j < rows)
            mx0 = STRIA__VX(max_ps)(mx0, STRIA__VX(loadu_ps)(col + (ptrdiff_t)j * ld));
        STRIA__V m_old = STRIA__VX(loadu_ps)(m + i);
        STRIA__V m_new =
            STRIA__VX(max_ps)(STRIA__VX(mul_ps)(STRIA__VX(max_ps)(mx0, mx1), vscale), m_old);
        /* columns that have seen no key subtract 0: their scores are all -inf */
        STRIA__V sub = stria__sub_of(m_new, ninf);
        STRIA__V s0 = STRIA__VX(setzero_ps)(), s1 = STRIA__VX(setzero_ps)();
        for (j = 0; j + 1 < rows; j += 2) {
            float *r0 = col + (ptrdiff_t)j * ld, *r1 = r0 + ld;
            STRIA__V p0 = stria__exp(STRIA__VX(fmsub_ps)(STRIA__VX(loadu_ps)(r0), vscale, sub));
            STRIA__V p1 = stria__exp(STRIA__VX(fmsub_ps)(STRIA__VX(loadu_ps)(r1), vscale, sub));
            STRIA__VX(storeu_ps)(r0, p0);
            STRIA__VX(storeu_ps)(r1, p1);
            s0 = STRIA__VX(add_ps)(s0, p0);
            s1 = STRIA__VX(add_ps)(s1, p1);
        }
        if (j < rows) {
            float *r0 = col + (ptrdiff_t)j * ld;
            STRIA__V p0 = stria__exp(STRIA__VX(fmsub_ps)(STRIA__VX(loadu_ps)(r0), vscale, sub));
            STRIA__VX(storeu_ps)(r0, p0);
            s0 = STRIA__VX(add_ps)(s0, p0);
        }
        STRIA__V a = stria__exp(STRIA__VX(sub_ps)(m_old, sub));
        STRIA__VX(storeu_ps)(alpha + i, a);
        STRIA__VX(storeu_ps)
        (l + i, STRIA__VX(fmadd_ps)(STRIA__VX(loadu_ps)(l + i), a, STRIA__VX(add_ps)(s0, s1)));
        STRIA__VX(storeu_ps)(m + i, m_new);
    }
}

static void STRIA__VFN(softmax_bwd_p)(float *st, int rows, int cols, ptrdiff_t ld, float scale,
                                      const float *lse)
{
    const STRIA__V vscale = STRIA__VX(set1_ps)(scale);
    for (int i = 0; i < cols; i += STRIA__VW) {
        STRIA__V sub = STRIA__VX(loadu_ps)(lse + i);
        for (int j = 0; j < rows; j++) {
            float *p = st + (ptrdiff_t)j * ld + i;
            STRIA__VX(storeu_ps)
            (p, stria__exp(STRIA__VX(fmsub_ps)(STRIA__VX(loadu_ps)(p), vscale, sub)));
        }
    }
}

static void STRIA__VFN(softmax_bwd_ds)(const float *pt, float *dpt, int rows, int cols,
                                       ptrdiff_t ld, const float *delta, float scale)
{
    const STRIA__V vscale = STRIA__VX(set1_ps)(scale);
    for (int i = 0; i < cols; i += STRIA__VW) {
        STRIA__V d = STRIA__VX(loadu_ps)(delta + i);
        for (int j = 0; j < rows; j++) {
            const float *p = pt + (ptrdiff_t)j * ld + i;
            float *g = dpt + (ptrdiff_t)j * ld + i;
            STRIA__V x = STRIA__VX(mul_ps)(STRIA__VX(loadu_ps)(p),
                                           STRIA__VX(sub_ps)(STRIA__VX(loadu_ps)(g), d));
            STRIA__VX(storeu_ps)(g, STRIA__VX(mul_ps)(x, vscale));
        }
    }
}

static void STRIA__VFN(scale_cols)(float *c, int rows, int cols, ptrdiff_t ld, const float *scale)
{
    for (int i = 0; i < cols; i += STRIA__VW) {
        const STRIA__V s = STRIA__VX(loadu_ps)(scale + i);
        for (int r = 0; r < rows; r++) {
            float *p = c + (ptrdiff_t)r * ld + i;
            STRIA__VX(storeu_ps)(p, STRIA__VX(mul_ps)(STRIA__VX(loadu_ps)(p), s));
        }
    }
}

static void STRIA__VFN(transpose32)(const void *src, ptrdiff_t lds, void *dst, ptrdiff_t ldd,
                                    int rows, int cols)
{
    stria__x86_transpose32(src, lds, dst, ldd, rows, cols);
}
