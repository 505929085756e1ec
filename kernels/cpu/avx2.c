/* AVX2 + FMA variant (with F16C for fp16 loads). Compiled with those flags
 * and only called after stria__avx2_ok() said yes.
 *
 * With 16 ymm registers the micro-kernel keeps a 6 x 16 block of C in 12
 * accumulators, two B vectors and one broadcast: 12 FMAs per 8 loads. */
#include "../kernels_int.h"
#include "x86_transpose.h"

#include <immintrin.h>

#define STRIA__MR 6 /* rows of C per micro-kernel */
#define STRIA__NV 2 /* ymm vectors of C per row (16 columns) */

#define STRIA__INLINE static inline __attribute__((always_inline))

static bool stria__avx2_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* ---- GEMM ---------------------------------------------------------------- */

/* C block [mr][16] (see stria_kern_ops_t.gemm); a points at row 0 of the
 * block (column 0 when trans_a). */
STRIA__INLINE void stria__uk(const int mr, const bool trans_a, int k, const float *a, ptrdiff_t lda,
                             const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                             const float *c_scale, bool accumulate)
{
    __m256 acc[STRIA__MR][STRIA__NV];

#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 2
        for (int j = 0; j < STRIA__NV; j++)
            acc[i][j] = _mm256_setzero_ps();
    for (int p = 0; p < k; p++) {
        const float *bp = b + (ptrdiff_t)p * ldb;
        __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m256 av = _mm256_broadcast_ss(trans_a ? &a[(ptrdiff_t)p * lda + i]
                                                    : &a[(ptrdiff_t)i * lda + p]);
            acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        float *cr = c + (ptrdiff_t)i * ldc;
#pragma GCC unroll 2
        for (int j = 0; j < STRIA__NV; j++) {
            __m256 v = acc[i][j];
            if (accumulate && c_scale != NULL)
                v = _mm256_fmadd_ps(_mm256_loadu_ps(cr + 8 * j), _mm256_set1_ps(c_scale[i]), v);
            else if (accumulate)
                v = _mm256_add_ps(_mm256_loadu_ps(cr + 8 * j), v);
            _mm256_storeu_ps(cr + 8 * j, v);
        }
    }
}

#define STRIA__UK_CASE(MR)                                                                         \
    case MR:                                                                                       \
        if (trans_a)                                                                               \
            stria__uk(MR, true, k, ai, lda, b + j0, ldb, ci, ldc, cs, accumulate);                 \
        else                                                                                       \
            stria__uk(MR, false, k, ai, lda, b + j0, ldb, ci, ldc, cs, accumulate);                \
        break;

static void stria__avx2_gemm(int m, int n, int k, const float *a, ptrdiff_t lda, bool trans_a,
                             const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                             const float *c_scale, bool accumulate)
{
    for (int j0 = 0; j0 < n; j0 += 8 * STRIA__NV) {
        for (int i0 = 0; i0 < m; i0 += STRIA__MR) {
            int mr = m - i0 < STRIA__MR ? m - i0 : STRIA__MR;
            const float *ai = trans_a ? a + i0 : a + (ptrdiff_t)i0 * lda;
            const float *cs = c_scale != NULL ? c_scale + i0 : NULL;
            float *ci = c + (ptrdiff_t)i0 * ldc + j0;
            switch (mr) {
                STRIA__UK_CASE(1)
                STRIA__UK_CASE(2)
                STRIA__UK_CASE(3)
                STRIA__UK_CASE(4)
                STRIA__UK_CASE(5)
                STRIA__UK_CASE(6)
            default:
                break;
            }
        }
    }
}
#undef STRIA__UK_CASE

/* ---- exp and the softmax passes --------------------------------------- */

#define STRIA__X86_BITS 256
#define STRIA__X86_NAME avx2
#include "x86_variant.h"

STRIA__INLINE __m256 stria__round(__m256 x)
{
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

STRIA__INLINE __m256 stria__sub_of(__m256 m, __m256 ninf)
{
    return _mm256_andnot_ps(_mm256_cmp_ps(m, ninf, _CMP_EQ_OQ), m);
}

/* x < ln(FLT_MIN) gives exactly 0 (so -inf does, and no denormals reach the
 * GEMMs); NaN stays NaN; x > 88.7 saturates at inf. */
STRIA__INLINE __m256 stria__exp(__m256 x)
{
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_NLT_UQ);
    /* max/min return their second operand for NaN: keep NaN in that slot */
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.7228f), x);
    __m256 n, y = stria__exp_poly(x, &n);
    /* 2^n for n in [-126, 128] (128 encodes inf) */
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

/* ---- conversions ------------------------------------------------------- */

static void stria__avx2_row_load(stria_dtype_t dtype, const void *src, float *dst, int n)
{
    const uint16_t *h = src;
    const float *f = src;
    switch (dtype) {
    case STRIA_DTYPE_BF16:
        for (int i = 0; i < n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        break;
    case STRIA_DTYPE_F16:
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        break;
    case STRIA_DTYPE_F32:
    default:
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_loadu_ps(f + i));
        break;
    }
}

/* Eight bf16 of x in the low half of each 128-bit lane pair, rounded to
 * nearest even, NaN quiet (stria_f32_to_bf16()'s bits). */
STRIA__INLINE __m128i stria__avx2_bf16x8(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)),
                           nan);
    /* 32-bit lanes 0-3 | 4-7 to 16-bit: pack within the 128-bit halves */
    const __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

static void stria__avx2_row_store(stria_dtype_t dtype, const float *src, void *dst, int n)
{
    uint16_t *h = dst;
    switch (dtype) {
    case STRIA_DTYPE_BF16:
        for (int i = 0; i < n; i += 8)
            _mm_storeu_si128((__m128i *)(h + i), stria__avx2_bf16x8(_mm256_loadu_ps(src + i)));
        break;
    case STRIA_DTYPE_F16:
        for (int i = 0; i < n; i += 8) {
            const __m256 x = _mm256_loadu_ps(src + i);
            __m128i r = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            /* a NaN becomes the sign and 0x7e00, as stria_f32_to_f16() makes it */
            const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            const __m128i nan16 =
                _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
            r = _mm_blendv_epi8(r,
                                _mm_or_si128(_mm_and_si128(r, _mm_set1_epi16((short)0x8000)),
                                             _mm_set1_epi16(0x7e00)),
                                nan16);
            _mm_storeu_si128((__m128i *)(h + i), r);
        }
        break;
    case STRIA_DTYPE_F32:
    default:
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps((float *)dst + i, _mm256_loadu_ps(src + i));
        break;
    }
}

static void stria__avx2_row_acc(float *dst, const float *src, int n)
{
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i)));
}

static void stria__avx2_row_merge(float *dst, const float *src, float inv, float wa, float wb,
                                  bool accumulate, int n)
{
    const __m256 vi = _mm256_set1_ps(inv), va = _mm256_set1_ps(wa), vb = _mm256_set1_ps(wb);
    if (!accumulate) {
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), vi));
        return;
    }
    for (int i = 0; i < n; i += 8) {
        __m256 t = _mm256_mul_ps(vb, _mm256_mul_ps(_mm256_loadu_ps(src + i), vi));
        _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(dst + i), t));
    }
}

/* Eight 32-bit lane masks from the 64-bit compares of elements 0-3 (a) and
 * 4-7 (b): each 64-bit result is all ones or all zeros, so its low half is
 * its value. */
STRIA__INLINE __m256 stria__avx2_mask8(__m256i a, __m256i b)
{
    /* per 128-bit lane: a0 a1 b0 b1 | a2 a3 b2 b3, then pairs reordered */
    __m256 s = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xd8));
}

static void stria__avx2_mask_causal(float *st, int rows, int cols, ptrdiff_t ld,
                                    const int64_t *kpos, const int64_t *qpos)
{
    if (cols != 16) { /* the last chunk of a block: rare */
        for (int j = 0; j < rows; j++)
            for (int i = 0; i < cols; i++)
                if (kpos[j] > qpos[i])
                    st[(ptrdiff_t)j * ld + i] = -__builtin_inff();
        return;
    }
    __m256i q[4];
    for (int g = 0; g < 4; g++)
        q[g] = _mm256_loadu_si256((const __m256i *)(qpos + 4 * g));
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    for (int j = 0; j < rows; j++) {
        float *row = st + (ptrdiff_t)j * ld;
        const __m256i k = _mm256_set1_epi64x(kpos[j]);
        __m256 m0 = stria__avx2_mask8(_mm256_cmpgt_epi64(k, q[0]), _mm256_cmpgt_epi64(k, q[1]));
        __m256 m1 = stria__avx2_mask8(_mm256_cmpgt_epi64(k, q[2]), _mm256_cmpgt_epi64(k, q[3]));
        _mm256_storeu_ps(row, _mm256_blendv_ps(_mm256_loadu_ps(row), ninf, m0));
        _mm256_storeu_ps(row + 8, _mm256_blendv_ps(_mm256_loadu_ps(row + 8), ninf, m1));
    }
}

static void stria__avx2_mask_bounds(float *st, int rows, int cols, ptrdiff_t ld,
                                    const int64_t *kpos, const int64_t *qlo, const int64_t *qhi)
{
    if (cols != 16) { /* the last chunk of a block: rare */
        for (int j = 0; j < rows; j++)
            for (int i = 0; i < cols; i++)
                if (kpos[j] < qlo[i] || kpos[j] > qhi[i])
                    st[(ptrdiff_t)j * ld + i] = -__builtin_inff();
        return;
    }
    __m256i lo[4], hi[4];
    for (int g = 0; g < 4; g++) {
        lo[g] = _mm256_loadu_si256((const __m256i *)(qlo + 4 * g));
        hi[g] = _mm256_loadu_si256((const __m256i *)(qhi + 4 * g));
    }
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    for (int j = 0; j < rows; j++) {
        float *row = st + (ptrdiff_t)j * ld;
        const __m256i k = _mm256_set1_epi64x(kpos[j]);
        __m256i out[4];
        for (int g = 0; g < 4; g++)
            out[g] = _mm256_or_si256(_mm256_cmpgt_epi64(k, hi[g]), _mm256_cmpgt_epi64(lo[g], k));
        __m256 m0 = stria__avx2_mask8(out[0], out[1]);
        __m256 m1 = stria__avx2_mask8(out[2], out[3]);
        _mm256_storeu_ps(row, _mm256_blendv_ps(_mm256_loadu_ps(row), ninf, m0));
        _mm256_storeu_ps(row + 8, _mm256_blendv_ps(_mm256_loadu_ps(row + 8), ninf, m1));
    }
}

const stria_kern_ops_t stria__kern_avx2 = {
    STRIA_KERN_OPS(stria__avx2),
    .name = "avx2",
};
