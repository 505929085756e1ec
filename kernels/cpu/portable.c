/* Portable C variant: the oracle the SIMD variants are tested against. */
#include "../kernels_int.h"

#include <math.h>

static bool stria__portable_ok(void)
{
    return true;
}

static void stria__portable_gemm(int m, int n, int k, const float *a, ptrdiff_t a_rs,
                                 ptrdiff_t a_ks, const float *b, ptrdiff_t ldb, float *c,
                                 ptrdiff_t ldc, bool accumulate)
{
    for (int i = 0; i < m; i++) {
        float *crow = c + (ptrdiff_t)i * ldc;
        if (!accumulate)
            for (int j = 0; j < n; j++)
                crow[j] = 0.0f;
        for (int p = 0; p < k; p++) {
            float av = a[(ptrdiff_t)i * a_rs + (ptrdiff_t)p * a_ks];
            const float *brow = b + (ptrdiff_t)p * ldb;
            for (int j = 0; j < n; j++)
                crow[j] += av * brow[j];
        }
    }
}

static float stria__portable_row_max(const float *x, int n)
{
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

static float stria__portable_row_exp(float *x, int n, float scale, float sub)
{
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] * scale - sub);
        sum += x[i];
    }
    return sum;
}

static void stria__portable_row_load(stria_dtype_t dtype, const void *src, float *dst, int n)
{
    for (int i = 0; i < n; i++)
        dst[i] = stria_dtype_load(dtype, src, (size_t)i);
}

const stria_kern_ops_t stria__kern_portable = {
    .name = "portable",
    .cpu_ok = stria__portable_ok,
    .gemm = stria__portable_gemm,
    .row_max = stria__portable_row_max,
    .row_exp = stria__portable_row_exp,
    .row_load = stria__portable_row_load,
};
