/*
 * stria dtype: the storage dtypes of tensors (fp32, bf16, fp16): their
 * names and sizes, and conversions between them.
 *
 * Threads: no state; every function may be called from any thread.
 * Buffers belong to the caller.
 */
#ifndef STRIA_DTYPE_H
#define STRIA_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "fp32", "bf16", "fp16". */
const char *stria_dtype_name(stria_dtype_t dtype);
/* Accepts fp32|f32|float32, bf16|bfloat16, fp16|f16|float16. */
stria_status_t stria_dtype_parse(const char *name, stria_dtype_t *dtype_out);
/* Bytes per element (4 or 2); 0 for an unknown dtype. */
size_t stria_dtype_size(stria_dtype_t dtype);

/* Round-to-nearest-even conversions; NaN stays NaN, overflow gives inf. */
uint16_t stria_f32_to_bf16(float x);
float stria_bf16_to_f32(uint16_t x);
uint16_t stria_f32_to_f16(float x);
float stria_f16_to_f32(uint16_t x);
/* Element i of a buffer of `dtype`, as fp32. */
float stria_dtype_load(stria_dtype_t dtype, const void *base, size_t i);
/* Stores x (rounded) as element i of a buffer of `dtype`. */
void stria_dtype_store(stria_dtype_t dtype, void *base, size_t i, float x);
/* Converts n elements; src and dst must not overlap. */
void stria_dtype_convert(stria_dtype_t src_dtype, const void *src, stria_dtype_t dst_dtype,
                         void *dst, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_DTYPE_H */
