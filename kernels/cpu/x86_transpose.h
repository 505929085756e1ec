/* 8 x 8 transpose of 32-bit elements in 256-bit registers, shared by the
 * x86 variants (each compiles it for its own ISA, which includes AVX). */
#ifndef STRIA_X86_TRANSPOSE_H
#define STRIA_X86_TRANSPOSE_H

#include <immintrin.h>
#include <stddef.h>

/* d[j][i] = s[i][j] for i, j < 8: rows of s lds floats apart, of d ldd. Bit
 * patterns are kept (NaNs included): only shuffles touch the data. */
static inline __attribute__((always_inline)) void stria__tr8x8(const float *s, ptrdiff_t lds,
                                                               float *d, ptrdiff_t ldd)
{
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm256_loadu_ps(s + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(d + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(d + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

/* See stria_kern_ops_t.transpose32. */
static inline __attribute__((always_inline)) void
stria__x86_transpose32(const void *src, ptrdiff_t lds, void *dst, ptrdiff_t ldd, int rows, int cols)
{
    const float *s = src;
    float *d = dst;
    for (int i = 0; i < rows; i += 8)
        for (int j = 0; j < cols; j += 8)
            stria__tr8x8(s + i * lds + j, lds, d + j * ldd + i, ldd);
}

#endif
