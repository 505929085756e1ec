/* AVX-512 variant (F, BW, VL, DQ), and the amx variant: the same operations
 * with every bf16 product on AMX tiles (amx_gemm.h). Compiled with the
 * AVX-512 flags (and AMX's, where the compiler has them: STRIA_HAVE_AMX) and
 * only called after stria__avx512_ok() (stria__amx_ok()) said yes.
 *
 * The GEMM micro-kernel keeps a 6 x 64 block of C in 24 zmm accumulators:
 * every k step loads four vectors of B and broadcasts six scalars of A, so 24
 * FMAs run per 10 loads and the two FMA pipes never wait on a single chain. */
#include "../kernels_int.h"
#include "x86_transpose.h"

#include <immintrin.h>

#define STRIA__MR 6 /* rows of C per micro-kernel */
#define STRIA__NV 4 /* zmm vectors of C per row */

#define STRIA__INLINE static inline __attribute__((always_inline))

static bool stria__avx512_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
}

/* ---- GEMM ---------------------------------------------------------------- */

/* Zeroes the mr x nv accumulators of a micro-kernel, fully unrolled (the
 * bounds are compile-time constants after inlining). */
#define STRIA__ACC_ZERO(acc, mr, nv)                                                               \
    _Pragma("GCC unroll 6") for (int i_ = 0; i_ < (mr); i_++)                                      \
        _Pragma("GCC unroll 4") for (int j_ = 0; j_ < (nv); j_++)(acc)[i_][j_] =                   \
            _mm512_setzero_ps()

/* Writes the mr x nv accumulators to C [mr][16 nv]: stored, or added to C
 * (scaled per row by c_scale when given); see stria_kern_ops_t.gemm. */
#define STRIA__ACC_STORE(acc, mr, nv, c, ldc, c_scale, accumulate)                                 \
    _Pragma("GCC unroll 6") for (int i_ = 0; i_ < (mr); i_++)                                      \
    {                                                                                              \
        float *cr_ = (c) + (ptrdiff_t)i_ * (ldc);                                                  \
        if (!(accumulate)) {                                                                       \
            _Pragma("GCC unroll 4") for (int j_ = 0; j_ < (nv); j_++)                              \
                _mm512_storeu_ps(cr_ + 16 * j_, (acc)[i_][j_]);                                    \
        } else if ((c_scale) != NULL) {                                                            \
            __m512 beta_ = _mm512_set1_ps((c_scale)[i_]);                                          \
            _Pragma("GCC unroll 4") for (int j_ = 0; j_ < (nv); j_++)                              \
                _mm512_storeu_ps(cr_ + 16 * j_, _mm512_fmadd_ps(_mm512_loadu_ps(cr_ + 16 * j_),    \
                                                                beta_, (acc)[i_][j_]));            \
        } else {                                                                                   \
            _Pragma("GCC unroll 4") for (int j_ = 0; j_ < (nv); j_++) _mm512_storeu_ps(            \
                cr_ + 16 * j_, _mm512_add_ps(_mm512_loadu_ps(cr_ + 16 * j_), (acc)[i_][j_]));      \
        }                                                                                          \
    }

/* C block [mr][16 nv] (see stria_kern_ops_t.gemm); a points at row 0 of the
 * block (column 0 when trans_a). mr, nv and trans_a are compile-time
 * constants after inlining, so the accumulators live in registers. */
STRIA__INLINE void stria__uk(const int mr, const int nv, const bool trans_a, int k, const float *a,
                             ptrdiff_t lda, const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                             const float *c_scale, bool accumulate)
{
    __m512 acc[STRIA__MR][STRIA__NV];
    STRIA__ACC_ZERO(acc, mr, nv);
    for (int p = 0; p < k; p++) {
        const float *bp = b + (ptrdiff_t)p * ldb;
        __m512 bv[STRIA__NV];
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            bv[j] = _mm512_loadu_ps(bp + 16 * j);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m512 av =
                _mm512_set1_ps(trans_a ? a[(ptrdiff_t)p * lda + i] : a[(ptrdiff_t)i * lda + p]);
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++)
                acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
        }
    }
    STRIA__ACC_STORE(acc, mr, nv, c, ldc, c_scale, accumulate);
}

#define STRIA__UK_CASE(MR, NV)                                                                     \
    case (MR)*8 + (NV):                                                                            \
        if (trans_a)                                                                               \
            stria__uk(MR, NV, true, k, a, lda, b, ldb, c, ldc, c_scale, accumulate);               \
        else                                                                                       \
            stria__uk(MR, NV, false, k, a, lda, b, ldb, c, ldc, c_scale, accumulate);              \
        break;
#define STRIA__UK_ROW(MR)                                                                          \
    STRIA__UK_CASE(MR, 1) STRIA__UK_CASE(MR, 2) STRIA__UK_CASE(MR, 3) STRIA__UK_CASE(MR, 4)

static void stria__uk_dispatch(int mr, int nv, bool trans_a, int k, const float *a, ptrdiff_t lda,
                               const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                               const float *c_scale, bool accumulate)
{
    switch (mr * 8 + nv) {
        STRIA__UK_ROW(1)
        STRIA__UK_ROW(2)
        STRIA__UK_ROW(3)
        STRIA__UK_ROW(4)
        STRIA__UK_ROW(5)
        STRIA__UK_ROW(6)
    default:
        break;
    }
}

static void stria__avx512_gemm(int m, int n, int k, const float *a, ptrdiff_t lda, bool trans_a,
                               const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                               const float *c_scale, bool accumulate)
{
    /* Column blocks outside: the [k][64] panel of B stays in L1 while the row
     * blocks of A stream past it. */
    for (int j0 = 0; j0 < n; j0 += 16 * STRIA__NV) {
        int nv = (n - j0) / 16 < STRIA__NV ? (n - j0) / 16 : STRIA__NV;
        for (int i0 = 0; i0 < m; i0 += STRIA__MR) {
            int mr = m - i0 < STRIA__MR ? m - i0 : STRIA__MR;
            const float *ai = trans_a ? a + i0 : a + (ptrdiff_t)i0 * lda;
            stria__uk_dispatch(mr, nv, trans_a, k, ai, lda, b + j0, ldb,
                               c + (ptrdiff_t)i0 * ldc + j0, ldc,
                               c_scale != NULL ? c_scale + i0 : NULL, accumulate);
        }
    }
}

/* ---- bf16 GEMM (AVX512-BF16) --------------------------------------------- */

static bool stria__avx512_bf16_ok(void)
{
    __builtin_cpu_init();
    return stria__avx512_ok() && __builtin_cpu_supports("avx512bf16");
}

/* As stria__uk, but every step takes a pair of k: vdpbf16ps multiplies two
 * bf16 pairs per lane into the fp32 accumulator, twice the work of an fp32
 * FMA per instruction. A pair of A is broadcast as one 32-bit word: adjacent
 * in a row of A, or (trans_a) a word of A's pairs along k. */
STRIA__INLINE void stria__uk_bf16(const int mr, const int nv, const bool trans_a, int k,
                                  const uint16_t *a, ptrdiff_t lda, const uint16_t *b,
                                  ptrdiff_t ldb, float *c, ptrdiff_t ldc, const float *c_scale,
                                  bool accumulate)
{
    __m512 acc[STRIA__MR][STRIA__NV];
    STRIA__ACC_ZERO(acc, mr, nv);
    for (int p = 0; p < k; p += 2) {
        const uint16_t *bp = b + (ptrdiff_t)(p / 2) * ldb;
        __m512bh bv[STRIA__NV];
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            bv[j] = (__m512bh)_mm512_loadu_si512(bp + 32 * j);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            __builtin_memcpy(
                &pair, trans_a ? a + (ptrdiff_t)(p / 2) * lda + 2 * i : a + (ptrdiff_t)i * lda + p,
                sizeof(pair));
            __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
        }
    }
    STRIA__ACC_STORE(acc, mr, nv, c, ldc, c_scale, accumulate);
}

#define STRIA__UKB_CASE(MR, NV)                                                                    \
    case (MR)*8 + (NV):                                                                            \
        if (trans_a)                                                                               \
            stria__uk_bf16(MR, NV, true, k, a, lda, b, ldb, c, ldc, c_scale, accumulate);          \
        else                                                                                       \
            stria__uk_bf16(MR, NV, false, k, a, lda, b, ldb, c, ldc, c_scale, accumulate);         \
        break;
#define STRIA__UKB_ROW(MR)                                                                         \
    STRIA__UKB_CASE(MR, 1) STRIA__UKB_CASE(MR, 2) STRIA__UKB_CASE(MR, 3) STRIA__UKB_CASE(MR, 4)

static void stria__ukb_dispatch(int mr, int nv, bool trans_a, int k, const uint16_t *a,
                                ptrdiff_t lda, const uint16_t *b, ptrdiff_t ldb, float *c,
                                ptrdiff_t ldc, const float *c_scale, bool accumulate)
{
    switch (mr * 8 + nv) {
        STRIA__UKB_ROW(1)
        STRIA__UKB_ROW(2)
        STRIA__UKB_ROW(3)
        STRIA__UKB_ROW(4)
        STRIA__UKB_ROW(5)
        STRIA__UKB_ROW(6)
    default:
        break;
    }
}

static void stria__avx512_gemm_bf16(int m, int n, int k, const uint16_t *a, ptrdiff_t lda,
                                    bool trans_a, const uint16_t *b, ptrdiff_t ldb, float *c,
                                    ptrdiff_t ldc, const float *c_scale, bool accumulate)
{
    for (int j0 = 0; j0 < n; j0 += 16 * STRIA__NV) {
        int nv = (n - j0) / 16 < STRIA__NV ? (n - j0) / 16 : STRIA__NV;
        for (int i0 = 0; i0 < m; i0 += STRIA__MR) {
            int mr = m - i0 < STRIA__MR ? m - i0 : STRIA__MR;
            const uint16_t *ai = trans_a ? a + 2 * (ptrdiff_t)i0 : a + (ptrdiff_t)i0 * lda;
            stria__ukb_dispatch(mr, nv, trans_a, k, ai, lda, b + 2 * j0, ldb,
                                c + (ptrdiff_t)i0 * ldc + j0, ldc,
                                c_scale != NULL ? c_scale + i0 : NULL, accumulate);
        }
    }
}

/* ---- exp and the softmax passes --------------------------------------- */

#define STRIA__X86_BITS 512
#define STRIA__X86_NAME avx512
#include "x86_variant.h"

STRIA__INLINE __m512 stria__round(__m512 x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* 2^n applied with vscalefps. x < ln(FLT_MIN) gives exactly 0 (so -inf
 * does, and no denormals reach the GEMMs); NaN stays NaN. */
STRIA__INLINE __m512 stria__exp(__m512 x)
{
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_NLT_UQ);
    __m512 n, y = stria__exp_poly(x, &n);
    return _mm512_maskz_scalef_ps(keep, y, n);
}

STRIA__INLINE __m512 stria__sub_of(__m512 m, __m512 ninf)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ), m, _mm512_setzero_ps());
}

/* ---- the softmax passes of the bf16 products ---------------------------- */

/* The bf16 pairs (x0[i], x1[i]) as 16 words, rounded to nearest even; *rows
 * gets bf16(x0) in its low and bf16(x1) in its high 256 bits. */
STRIA__INLINE __m512i stria__bf16_pairs(__m512 x0, __m512 x1, __m512i *rows)
{
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i r = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    if (rows != NULL)
        *rows = r;
    return _mm512_permutexvar_epi16(idx, r);
}

/* exp(x) to about 1 ulp where it matters, for the bf16 path's softmax: 2^t
 * for t = x log2(e), t split into round(t) (applied with vscalefps) and a
 * fraction in [-1/2, 1/2] whose 2^f is a degree-6 polynomial (relative error
 * 0.7 ulp; fitted to 2^f in relative terms). Three operations fewer than
 * stria__exp's Cody-Waite reduction; the product's rounding costs a relative
 * error of about |x| 2^-24, which only the terms far below the row's max
 * (exp(x) < e^-16 for more than 1 ulp) see. x < -87.3 (t < -126) gives
 * exactly 0, so -inf does; NaN stays NaN. */
STRIA__INLINE __m512 stria__exp_bf16(__m512 x)
{
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    __m512 n = stria__round(t);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.5345810970757157e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3399930903688073e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.618489071726799e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550328642129898e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022646248340607e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931471824645996e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, y, n);
}

/* See stria_kern_ops_t.softmax_fwd_bf16: softmax_fwd's arithmetic (its exp
 * cheaper, stria__exp_bf16), with the probabilities of each pair of rows
 * stored once, as bf16 pairs. */
static void stria__avx512_softmax_fwd_bf16(float *st, int rows, int cols, ptrdiff_t ld, float scale,
                                           float *m, float *l, float *alpha, uint16_t *pb,
                                           ptrdiff_t ldp)
{
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());

    for (int i = 0; i < cols; i += 16) {
        float *col = st + i;
        __m512 mx0 = ninf, mx1 = ninf;
        int j = 0;
        for (; j + 1 < rows; j += 2) {
            mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(col + (ptrdiff_t)j * ld));
            mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(col + (ptrdiff_t)(j + 1) * ld));
        }
        if (j < rows)
            mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(col + (ptrdiff_t)j * ld));
        __m512 m_old = _mm512_loadu_ps(m + i);
        __m512 m_new = _mm512_max_ps(_mm512_mul_ps(_mm512_max_ps(mx0, mx1), vscale), m_old);
        /* columns that have seen no key subtract 0: their scores are all -inf */
        __m512 sub = stria__sub_of(m_new, ninf);
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (j = 0; j < rows; j += 2) {
            const float *r0 = col + (ptrdiff_t)j * ld;
            __m512 p0 = stria__exp_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(r0), vscale, sub));
            __m512 p1 = _mm512_setzero_ps();
            if (j + 1 < rows)
                p1 = stria__exp_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(r0 + ld), vscale, sub));
            _mm512_storeu_si512(pb + (ptrdiff_t)(j / 2) * ldp + 2 * i,
                                stria__bf16_pairs(p0, p1, NULL));
            s0 = _mm512_add_ps(s0, p0);
            s1 = _mm512_add_ps(s1, p1);
        }
        __m512 a = stria__exp_bf16(_mm512_sub_ps(m_old, sub));
        _mm512_storeu_ps(alpha + i, a);
        _mm512_storeu_ps(l + i, _mm512_fmadd_ps(_mm512_loadu_ps(l + i), a, _mm512_add_ps(s0, s1)));
        _mm512_storeu_ps(m + i, m_new);
    }
}

/* See stria_kern_ops_t.softmax_bwd_ds_bf16. */
static void stria__avx512_softmax_bwd_ds_bf16(const float *pt, const float *dpt, int rows, int cols,
                                              ptrdiff_t ld, const float *delta, float scale,
                                              uint16_t *p_rows, uint16_t *ds_rows,
                                              uint16_t *ds_pairs)
{
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int i = 0; i < cols; i += 16) {
        __m512 d = _mm512_loadu_ps(delta + i);
        for (int j = 0; j < rows; j += 2) {
            const ptrdiff_t o0 = (ptrdiff_t)j * ld + i, o1 = o0 + ld;
            const bool two = j + 1 < rows;
            __m512 p0 = _mm512_loadu_ps(pt + o0);
            __m512 p1 = two ? _mm512_loadu_ps(pt + o1) : _mm512_setzero_ps();
            __m512 g0 = _mm512_mul_ps(
                _mm512_mul_ps(p0, _mm512_sub_ps(_mm512_loadu_ps(dpt + o0), d)), vscale);
            __m512 g1 =
                two ? _mm512_mul_ps(_mm512_mul_ps(p1, _mm512_sub_ps(_mm512_loadu_ps(dpt + o1), d)),
                                    vscale)
                    : _mm512_setzero_ps();
            __m512i pr = (__m512i)_mm512_cvtne2ps_pbh(p1, p0), gr;
            _mm512_storeu_si512(ds_pairs + (ptrdiff_t)(j / 2) * 2 * ld + 2 * i,
                                stria__bf16_pairs(g0, g1, &gr));
            _mm256_storeu_si256((__m256i *)(p_rows + o0), _mm512_castsi512_si256(pr));
            _mm256_storeu_si256((__m256i *)(ds_rows + o0), _mm512_castsi512_si256(gr));
            if (two) {
                _mm256_storeu_si256((__m256i *)(p_rows + o1), _mm512_extracti64x4_epi64(pr, 1));
                _mm256_storeu_si256((__m256i *)(ds_rows + o1), _mm512_extracti64x4_epi64(gr, 1));
            }
        }
    }
}

/* ---- causal mask ------------------------------------------------------- */

/* The 16 positions of a chunk (cols of them valid, the rest 0) in two
 * vectors of 8. */
STRIA__INLINE void stria__load_pos(const int64_t *pos, __mmask16 valid, __m512i v[2])
{
    v[0] = _mm512_maskz_loadu_epi64((__mmask8)valid, pos);
    v[1] = _mm512_maskz_loadu_epi64((__mmask8)(valid >> 8), pos + 8);
}

/* -inf into the columns of row that m marks. */
STRIA__INLINE void stria__hide(float *row, __mmask16 m, int cols)
{
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    if (cols == 16)
        _mm512_storeu_ps(row, _mm512_mask_blend_ps(m, _mm512_loadu_ps(row), ninf));
    else
        _mm512_mask_storeu_ps(row, m, ninf);
}

static void stria__avx512_mask_causal(float *st, int rows, int cols, ptrdiff_t ld,
                                      const int64_t *kpos, const int64_t *qpos)
{
    const __mmask16 valid = (__mmask16)(0xffffu >> (16 - cols));
    __m512i q[2];
    stria__load_pos(qpos, valid, q);
    for (int j = 0; j < rows; j++) {
        const __m512i k = _mm512_set1_epi64(kpos[j]);
        __mmask16 m = (__mmask16)((unsigned)_mm512_cmpgt_epi64_mask(k, q[0]) |
                                  ((unsigned)_mm512_cmpgt_epi64_mask(k, q[1]) << 8));
        stria__hide(st + (ptrdiff_t)j * ld, m & valid, cols);
    }
}

static void stria__avx512_mask_bounds(float *st, int rows, int cols, ptrdiff_t ld,
                                      const int64_t *kpos, const int64_t *qlo, const int64_t *qhi)
{
    const __mmask16 valid = (__mmask16)(0xffffu >> (16 - cols));
    __m512i lo[2], hi[2];
    stria__load_pos(qlo, valid, lo);
    stria__load_pos(qhi, valid, hi);
    for (int j = 0; j < rows; j++) {
        const __m512i k = _mm512_set1_epi64(kpos[j]);
        unsigned m0 = (unsigned)_mm512_cmpgt_epi64_mask(k, hi[0]) |
                      (unsigned)_mm512_cmplt_epi64_mask(k, lo[0]);
        unsigned m1 = (unsigned)_mm512_cmpgt_epi64_mask(k, hi[1]) |
                      (unsigned)_mm512_cmplt_epi64_mask(k, lo[1]);
        stria__hide(st + (ptrdiff_t)j * ld, (__mmask16)((m0 | (m1 << 8)) & valid), cols);
    }
}

/* ---- conversions ------------------------------------------------------- */

STRIA__INLINE __m512 stria__load16(stria_dtype_t dtype, const void *src, int i, __mmask16 mk)
{
    switch (dtype) {
    case STRIA_DTYPE_BF16: {
        __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)src + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case STRIA_DTYPE_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)src + i));
    case STRIA_DTYPE_F32:
    default:
        return _mm512_maskz_loadu_ps(mk, (const float *)src + i);
    }
}

static void stria__avx512_row_load(stria_dtype_t dtype, const void *src, float *dst, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, stria__load16(dtype, src, i, 0xffff));
    if (i < n) {
        __mmask16 mk = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(dst + i, mk, stria__load16(dtype, src, i, mk));
    }
}

/* 16 values of x in `dtype` (16-bit: bf16, fp16) as stria_dtype_store()
 * makes them: to nearest even, a NaN quiet (bf16: its high bits and 0x40;
 * fp16: its sign and 0x7e00). */
STRIA__INLINE __m256i stria__store16(stria_dtype_t dtype, __m512 x)
{
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (dtype == STRIA_DTYPE_F16) {
        const __m256i r = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i q = _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi16((short)0x8000)),
                                          _mm256_set1_epi16(0x7e00));
        return _mm256_mask_blend_epi16(nan, r, q);
    }
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                             _mm512_set1_epi32(0x7fff))),
        16);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static void stria__avx512_row_store(stria_dtype_t dtype, const float *src, void *dst, int n)
{
    int i = 0;
    if (dtype == STRIA_DTYPE_F32) {
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps((float *)dst + i, _mm512_loadu_ps(src + i));
        if (i < n) {
            __mmask16 mk = (__mmask16)((1u << (n - i)) - 1u);
            _mm512_mask_storeu_ps((float *)dst + i, mk, _mm512_maskz_loadu_ps(mk, src + i));
        }
        return;
    }
    uint16_t *h = dst;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(h + i), stria__store16(dtype, _mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 mk = (__mmask16)((1u << (n - i)) - 1u);
        _mm256_mask_storeu_epi16(h + i, mk,
                                 stria__store16(dtype, _mm512_maskz_loadu_ps(mk, src + i)));
    }
}

static void stria__avx512_row_acc(float *dst, const float *src, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i,
                         _mm512_add_ps(_mm512_loadu_ps(dst + i), _mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 mk = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(
            dst + i, mk,
            _mm512_add_ps(_mm512_maskz_loadu_ps(mk, dst + i), _mm512_maskz_loadu_ps(mk, src + i)));
    }
}

static void stria__avx512_row_merge(float *dst, const float *src, float inv, float wa, float wb,
                                    bool accumulate, int n)
{
    const __m512 vi = _mm512_set1_ps(inv), va = _mm512_set1_ps(wa), vb = _mm512_set1_ps(wb);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(src + i), vi);
        if (accumulate)
            t = _mm512_fmadd_ps(va, _mm512_loadu_ps(dst + i), _mm512_mul_ps(vb, t));
        _mm512_storeu_ps(dst + i, t);
    }
    if (i < n) {
        __mmask16 mk = (__mmask16)((1u << (n - i)) - 1u);
        __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, src + i), vi);
        if (accumulate)
            t = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(mk, dst + i), _mm512_mul_ps(vb, t));
        _mm512_mask_storeu_ps(dst + i, mk, t);
    }
}

/* The softmax passes of the bf16 products (avx512 and amx). */
#define STRIA__AVX512_BF16_PASSES                                                                  \
    .softmax_fwd_bf16 = stria__avx512_softmax_fwd_bf16,                                            \
    .softmax_bwd_ds_bf16 = stria__avx512_softmax_bwd_ds_bf16

const stria_kern_ops_t stria__kern_avx512 = {
    STRIA_KERN_OPS(stria__avx512),
    .name = "avx512",
    .gemm_bf16 = stria__avx512_gemm_bf16,
    .gemm_bf16_ok = stria__avx512_bf16_ok,
    STRIA__AVX512_BF16_PASSES,
};

const stria_kern_ops_t stria__kern_avx512_nobf16 = {
    STRIA_KERN_OPS(stria__avx512),
    .name = "avx512-nobf16",
};

#ifdef STRIA_HAVE_AMX
/* ---- amx: avx512 with the bf16 products on matrix tiles ------------------ */

#include "amx_tile.h"
#define STRIA__AMX_NAME amx
#define STRIA__AMX_VEC  stria__avx512_gemm_bf16
#include "amx_gemm.h"

static bool stria__amx_ok(void)
{
    return stria__amx_why_not() == NULL;
}

const stria_kern_ops_t stria__kern_amx = {
    .cpu_ok = stria__amx_ok,
    STRIA_KERN_OPS_BODY(stria__avx512),
    .name = "amx",
    .gemm_bf16 = stria__amx_gemm_bf16,
    .gemm_bf16_ok = stria__amx_ok,
    STRIA__AVX512_BF16_PASSES,
    .tiles = true,
    .why_not = stria__amx_why_not,
};
#endif
