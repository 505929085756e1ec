/* Portable C variant: the oracle the SIMD variants are tested against. */
#include "../kernels_int.h"

#include <math.h>

static bool stria__portable_ok(void)
{
    return true;
}

static void stria__portable_gemm(int m, int n, int k, const float *a, ptrdiff_t lda, bool trans_a,
                                 const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc,
                                 const float *c_scale, bool accumulate)
{
    ptrdiff_t a_rs = trans_a ? 1 : lda, a_ks = trans_a ? lda : 1;
    for (int i = 0; i < m; i++) {
        float *crow = c + (ptrdiff_t)i * ldc;
        float beta = !accumulate ? 0.0f : c_scale != NULL ? c_scale[i] : 1.0f;
        for (int j = 0; j < n; j++)
            crow[j] = beta == 0.0f ? 0.0f : crow[j] * beta;
        for (int p = 0; p < k; p++) {
            float av = a[(ptrdiff_t)i * a_rs + (ptrdiff_t)p * a_ks];
            const float *brow = b + (ptrdiff_t)p * ldb;
            for (int j = 0; j < n; j++)
                crow[j] += av * brow[j];
        }
    }
}

static void stria__portable_softmax_fwd(float *st, int rows, int cols, ptrdiff_t ld, float scale,
                                        float *m, float *l, float *alpha)
{
    for (int i = 0; i < cols; i++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int j = 0; j < rows; j++) {
            float s = st[(ptrdiff_t)j * ld + i];
            mx = s > mx ? s : mx;
        }
        float m_new = mx * scale > m[i] ? mx * scale : m[i];
        /* a column that has seen no key yet subtracts 0: its scores are -inf */
        float sub = m_new == -INFINITY ? 0.0f : m_new;
        for (int j = 0; j < rows; j++) {
            float *s = &st[(ptrdiff_t)j * ld + i];
            *s = expf(*s * scale - sub);
            sum += *s;
        }
        alpha[i] = expf(m[i] - sub);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = m_new;
    }
}

static void stria__portable_softmax_bwd_p(float *st, int rows, int cols, ptrdiff_t ld, float scale,
                                          const float *lse)
{
    for (int j = 0; j < rows; j++) {
        float *row = st + (ptrdiff_t)j * ld;
        for (int i = 0; i < cols; i++)
            row[i] = expf(row[i] * scale - lse[i]);
    }
}

static void stria__portable_softmax_bwd_ds(const float *pt, float *dpt, int rows, int cols,
                                           ptrdiff_t ld, const float *delta, float scale)
{
    for (int j = 0; j < rows; j++) {
        const float *prow = pt + (ptrdiff_t)j * ld;
        float *drow = dpt + (ptrdiff_t)j * ld;
        for (int i = 0; i < cols; i++)
            drow[i] = prow[i] * (drow[i] - delta[i]) * scale;
    }
}

/* The bf16 operations' softmax passes, as the oracle of the SIMD ones and
 * for the test builds' emulated tile variant (tests/kernels/amx_emu.c): the
 * portable variant itself has no bf16 product (gemm_bf16 NULL), so the
 * driver never calls them on it. */
static void stria__portable_softmax_fwd_bf16(float *st, int rows, int cols, ptrdiff_t ld,
                                             float scale, float *m, float *l, float *alpha,
                                             uint16_t *pb, ptrdiff_t ldp)
{
    stria__portable_softmax_fwd(st, rows, cols, ld, scale, m, l, alpha);
    for (int j = 0; j < rows + rows % 2; j++)
        for (int i = 0; i < cols; i++)
            pb[(ptrdiff_t)(j / 2) * ldp + 2 * i + j % 2] =
                j < rows ? stria_f32_to_bf16(st[(ptrdiff_t)j * ld + i]) : 0;
}

static void stria__portable_softmax_bwd_ds_bf16(const float *pt, const float *dpt, int rows,
                                                int cols, ptrdiff_t ld, const float *delta,
                                                float scale, uint16_t *p_rows, uint16_t *ds_rows,
                                                uint16_t *ds_pairs)
{
    for (int j = 0; j < rows + rows % 2; j++)
        for (int i = 0; i < cols; i++) {
            const ptrdiff_t o = (ptrdiff_t)j * ld + i;
            uint16_t ds = 0;
            if (j < rows) {
                ds = stria_f32_to_bf16(pt[o] * (dpt[o] - delta[i]) * scale);
                p_rows[o] = stria_f32_to_bf16(pt[o]);
                ds_rows[o] = ds;
            }
            ds_pairs[(ptrdiff_t)(j / 2) * 2 * ld + 2 * i + j % 2] = ds;
        }
}

static void stria__portable_scale_cols(float *c, int rows, int cols, ptrdiff_t ld,
                                       const float *scale)
{
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < cols; i++)
            c[(ptrdiff_t)r * ld + i] *= scale[i];
}

static void stria__portable_row_load(stria_dtype_t dtype, const void *src, float *dst, int n)
{
    for (int i = 0; i < n; i++)
        dst[i] = stria_dtype_load(dtype, src, (size_t)i);
}

static void stria__portable_row_store(stria_dtype_t dtype, const float *src, void *dst, int n)
{
    for (int i = 0; i < n; i++)
        stria_dtype_store(dtype, dst, (size_t)i, src[i]);
}

static void stria__portable_row_acc(float *dst, const float *src, int n)
{
    for (int i = 0; i < n; i++)
        dst[i] += src[i];
}

static void stria__portable_row_merge(float *dst, const float *src, float inv, float wa, float wb,
                                      bool accumulate, int n)
{
    if (!accumulate) {
        for (int i = 0; i < n; i++)
            dst[i] = src[i] * inv;
        return;
    }
    for (int i = 0; i < n; i++)
        dst[i] = wa * dst[i] + wb * (src[i] * inv);
}

static void stria__portable_transpose32(const void *src, ptrdiff_t lds, void *dst, ptrdiff_t ldd,
                                        int rows, int cols)
{
    const uint32_t *s = src;
    uint32_t *d = dst;
    /* blocks of 8 x 8 so both sides stay in a few cache lines at a time */
    for (int i0 = 0; i0 < rows; i0 += 8)
        for (int j0 = 0; j0 < cols; j0 += 8)
            for (int j = j0; j < j0 + 8; j++)
                for (int i = i0; i < i0 + 8; i++)
                    d[(ptrdiff_t)j * ldd + i] = s[(ptrdiff_t)i * lds + j];
}

static void stria__portable_mask_causal(float *st, int rows, int cols, ptrdiff_t ld,
                                        const int64_t *kpos, const int64_t *qpos)
{
    for (int j = 0; j < rows; j++) {
        float *row = st + (ptrdiff_t)j * ld;
        for (int i = 0; i < cols; i++)
            if (kpos[j] > qpos[i])
                row[i] = -INFINITY;
    }
}

static void stria__portable_mask_bounds(float *st, int rows, int cols, ptrdiff_t ld,
                                        const int64_t *kpos, const int64_t *qlo, const int64_t *qhi)
{
    for (int j = 0; j < rows; j++) {
        float *row = st + (ptrdiff_t)j * ld;
        for (int i = 0; i < cols; i++)
            if (kpos[j] < qlo[i] || kpos[j] > qhi[i])
                row[i] = -INFINITY;
    }
}

const stria_kern_ops_t stria__kern_portable = {
    STRIA_KERN_OPS(stria__portable),
    .name = "portable",
    .softmax_fwd_bf16 = stria__portable_softmax_fwd_bf16,
    .softmax_bwd_ds_bf16 = stria__portable_softmax_bwd_ds_bf16,
};
