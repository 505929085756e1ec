/* stria-bench kernels --device cuda[:N]: the CUDA half of the kernels
 * benchmark (bench_cuda.cu, built only with CUDA). */
#ifndef STRIA_BENCH_CUDA_H
#define STRIA_BENCH_CUDA_H

#include <stdbool.h>
#include <stdint.h>

#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *device; /* "cuda" or "cuda:N" */
    int64_t seq, head_dim, heads, kv_heads;
    int reps;
    stria_dtype_t dtype;
    bool causal;
    bool json;
    int64_t gemm_n; /* side of the cuBLAS reference GEMM; 0: skip it */
} stria_bench_cuda_opts_t;

/* Times forward and backward attention on the GPU with CUDA events (median of
 * o->reps after a warm-up) and the GPU's bf16 GEMM rate with cuBLAS in the
 * same run; prints TFLOP/s and the fractions. Returns an exit code. */
int stria_bench_kernels_cuda(const stria_bench_cuda_opts_t *o);

#ifdef __cplusplus
}
#endif

#endif
