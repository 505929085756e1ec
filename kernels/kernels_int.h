/* Internal interface between the attention driver (attn.c) and the per-ISA
 * CPU variants (cpu/<isa>.c). Not part of the public API. */
#ifndef STRIA_KERNELS_INT_H
#define STRIA_KERNELS_INT_H

#include "stria_kernels.h"

#include <stddef.h>

/* Tile sizes of the driver: queries per tile and keys per tile. Packed fp32
 * rows are padded to STRIA__DPAD elements so vector code needs no tails. */
#define STRIA__BQ   64
#define STRIA__BK   64
#define STRIA__DPAD 16

static inline int64_t stria__round_up(int64_t x, int64_t m)
{
    return (x + m - 1) / m * m;
}

/* The operations a CPU variant provides. All buffers are fp32 unless stated. */
typedef struct {
    const char *name;
    /* Whether this CPU can run the variant. */
    bool (*cpu_ok)(void);
    /* C[i][j] (+)= sum_p A(i, p) * B[p][j] for i < m, j < n, p < k, where
     * A(i, p) = a[i * a_rs + p * a_ks]. B rows are ldb apart and padded to a
     * multiple of 16 readable elements; C rows are ldc apart and exactly n
     * elements are written per row. accumulate == false overwrites C. */
    void (*gemm)(int m, int n, int k, const float *a, ptrdiff_t a_rs, ptrdiff_t a_ks,
                 const float *b, ptrdiff_t ldb, float *c, ptrdiff_t ldc, bool accumulate);
    /* max over x[0..n); -inf for n == 0. */
    float (*row_max)(const float *x, int n);
    /* x[i] = exp(x[i] * scale - sub) in place; returns sum of the new x.
     * x[i] = -inf gives 0. */
    float (*row_exp)(float *x, int n, float scale, float sub);
    /* dst[0..n) = fp32 of the n elements of `dtype` at src. */
    void (*row_load)(stria_dtype_t dtype, const void *src, float *dst, int n);
} stria_kern_ops_t;

extern const stria_kern_ops_t stria__kern_portable;
#ifdef STRIA_HAVE_X86_VARIANTS
extern const stria_kern_ops_t stria__kern_avx2;
extern const stria_kern_ops_t stria__kern_avx512;
#endif

/* The variant in use (selected on first call). Returns NULL and sets the error
 * message when STRIA_KERNEL names an unusable variant. */
const stria_kern_ops_t *stria__kern_ops(void);

#endif
