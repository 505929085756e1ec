/*
 * stria npy: NumPy .npy files read and written, for the tensors of the
 * command-line tools and the tests.
 *
 * Ownership: an array owns its data (stria_npy_free()); stria_npy_write()
 * only reads the caller's. Threads: no state; one thread at a time per
 * array.
 */
#ifndef STRIA_NPY_H
#define STRIA_NPY_H

#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- .npy files -------------------------------------------------------- */

#define STRIA_NPY_MAX_DIMS 8

/* An array read from or written to a .npy file (format 1.0/2.0/3.0, C order,
 * little-endian). Supported element types: float32 ("<f4"), float16 ("<f2"),
 * float64 ("<f8", read only, converted to float32). */
typedef struct {
    stria_dtype_t dtype; /* STRIA_DTYPE_F32 or STRIA_DTYPE_F16 */
    int ndim;
    int64_t shape[STRIA_NPY_MAX_DIMS];
    void *data; /* owned; free with stria_npy_free() */
} stria_npy_t;

/* Reads `path` into *arr (arr->data allocated here). Errors name the file and
 * what is wrong (magic, header, dtype, order, shape, truncation). */
stria_status_t stria_npy_read(const char *path, stria_npy_t *arr);
/* Writes `n_elems` elements of `dtype` (F32 or F16) with the given shape. */
stria_status_t stria_npy_write(const char *path, stria_dtype_t dtype, int ndim,
                               const int64_t *shape, const void *data);
/* Frees arr->data and resets *arr; safe on a zeroed or freed array. */
void stria_npy_free(stria_npy_t *arr);
/* Number of elements (product of the shape). */
int64_t stria_npy_numel(const stria_npy_t *arr);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_NPY_H */
