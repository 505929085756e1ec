/* stria-bench kernels --device cuda[:N]: forward and backward attention on a
 * GPU through the stria device API, timed with CUDA events on the device's
 * compute stream, beside the GPU's own bf16 matrix-multiply rate measured in
 * the same run with cuBLAS (cublasGemmEx, bf16 inputs and output, fp32
 * accumulation, N x N x N). Every figure is the median of --reps timed runs
 * after one warm-up run. FLOPs are counted as on the CPU: forward
 * 4 * S^2 * D * H (half when causal), backward (D = rowsum(dO * O) and the
 * dQ, dK, dV kernels) 2.5x forward. */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_cuda.h"
#include "bench_util.h"
#include "cuda/attn_cuda.cuh"
#include "stria_device.h"

/* The median of n (at most 1000, --reps) times. */
static float stria__bc_median(const float *v, int n)
{
    double d[1000];
    n = n < 1000 ? n : 1000;
    for (int i = 0; i < n; i++)
        d[i] = v[i];
    return (float)stria_bench_median(d, n);
}

static int stria__bc_fail(const char *what)
{
    fprintf(stderr, "stria-bench kernels: %s: %s\n", what, stria_error_msg());
    return 1;
}

static int stria__bc_cuda_fail(const char *what, cudaError_t e)
{
    fprintf(stderr, "stria-bench kernels: %s: %s\n", what, cudaGetErrorString(e));
    return 1;
}

/* Milliseconds of the median cuBLAS bf16 GEMM of side n; <= 0 on failure. */
static float stria__bc_gemm(int64_t n, int reps, cudaStream_t stream)
{
    cublasHandle_t h = NULL;
    void *a = NULL, *b = NULL, *c = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float *ms = (float *)calloc((size_t)reps, sizeof(float)), result = -1.0f;
    const float alpha = 1.0f, beta = 0.0f;
    size_t bytes = (size_t)(n * n) * 2;
    uint16_t *host = (uint16_t *)malloc(bytes);

    if (ms == NULL || host == NULL || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(h, stream) != CUBLAS_STATUS_SUCCESS ||
        cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess ||
        cudaMalloc(&c, bytes) != cudaSuccess || cudaEventCreate(&e0) != cudaSuccess ||
        cudaEventCreate(&e1) != cudaSuccess) {
        fprintf(stderr, "stria-bench kernels: cannot set up the cuBLAS GEMM of side %lld\n",
                (long long)n);
        goto out;
    }
    stria_bench_fill(host, STRIA_DTYPE_BF16, (size_t)(n * n), 11);
    if (cudaMemcpy(a, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(b, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
        goto out;
    for (int r = -1; r < reps; r++) {
        cudaEventRecord(e0, stream);
        cublasStatus_t st =
            cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, (int)n, (int)n, &alpha, a,
                         CUDA_R_16BF, (int)n, b, CUDA_R_16BF, (int)n, &beta, c, CUDA_R_16BF, (int)n,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        cudaEventRecord(e1, stream);
        if (st != CUBLAS_STATUS_SUCCESS || cudaEventSynchronize(e1) != cudaSuccess) {
            fprintf(stderr, "stria-bench kernels: cublasGemmEx failed (status %d)\n", (int)st);
            goto out;
        }
        if (r >= 0)
            cudaEventElapsedTime(&ms[r], e0, e1);
    }
    result = stria__bc_median(ms, reps);
out:
    if (e0 != NULL)
        cudaEventDestroy(e0);
    if (e1 != NULL)
        cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    if (h != NULL)
        cublasDestroy(h);
    free(ms);
    free(host);
    return result;
}

typedef struct {
    stria_attn_params_t p;
    stria_tensor_t q, k, v, d_o, o, dq, dk, dv;
    float *lse, *delta;
    size_t nq, nk, nl;
} stria__bc_data_t;

static void stria__bc_data_free(stria_device_t *dev, stria__bc_data_t *d)
{
    void *ptrs[] = {d->q.data,  d->k.data,  d->v.data,  d->d_o.data, d->o.data,
                    d->dq.data, d->dk.data, d->dv.data, d->lse,      d->delta};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++)
        stria_device_free(dev, ptrs[i]);
}

static stria_status_t stria__bc_tensor(stria_device_t *dev, stria_tensor_t *t, stria_dtype_t dt,
                                       int64_t tokens, int64_t heads, int64_t dim, uint64_t seed)
{
    size_t n = (size_t)(tokens * heads * dim), bytes = n * stria_dtype_size(dt);
    void *ptr = NULL, *host = NULL;
    stria_status_t st = stria_device_alloc(dev, bytes, &ptr);
    *t = stria_tensor_contiguous(ptr, dt, tokens, heads, dim);
    if (st != STRIA_OK || seed == 0)
        return st;
    if ((host = malloc(bytes)) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate %zu bytes", bytes);
    stria_bench_fill(host, dt, n, seed);
    st = stria_device_copy(dev, STRIA_STREAM_COMPUTE, ptr, host, bytes);
    if (st == STRIA_OK)
        st = stria_device_sync(dev, STRIA_STREAM_COMPUTE);
    free(host);
    return st;
}

static void stria__bc_report(const stria_bench_cuda_opts_t *o, const char *dev_name,
                             const char *desc, const char *pass, float ms, double flops,
                             double gemm_tflops)
{
    double tflops = ms > 0 ? flops / (ms * 1e-3) * 1e-12 : 0.0;
    double frac = gemm_tflops > 0 ? tflops / gemm_tflops : 0.0;
    if (o->json)
        printf("{\"name\":\"attention\",\"pass\":\"%s\",\"device\":\"%s\",\"gpu\":\"%s\","
               "\"seq\":%lld,\"head_dim\":%lld,\"heads\":%lld,\"kv_heads\":%lld,"
               "\"dtype\":\"%s\",\"causal\":%s,\"reps\":%d,\"seconds\":%.6f,\"tflops\":%.3f,"
               "\"cublas_tflops\":%.3f,\"fraction_of_cublas\":%.4f}\n",
               pass, dev_name, desc, (long long)o->seq, (long long)o->head_dim, (long long)o->heads,
               (long long)o->kv_heads, stria_dtype_name(o->dtype), o->causal ? "true" : "false",
               o->reps, ms * 1e-3, tflops, gemm_tflops, frac);
    else
        printf("  %-4s %10.3f ms %8.1f TFLOP/s %6.1f%% of the cuBLAS bf16 rate\n", pass, ms, tflops,
               100.0 * frac);
    fflush(stdout);
}

int stria_bench_kernels_cuda(const stria_bench_cuda_opts_t *o)
{
    stria_device_t *dev = NULL;
    stria__bc_data_t d;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaStream_t stream;
    float *ms = NULL, gemm_ms = 0.0f;
    double gemm_tflops = 0.0, fwd_flops;
    const char *desc;
    int rc = 1;
    cudaError_t ce;

    memset(&d, 0, sizeof(d));
    if (stria_device_open(o->device, NULL, &dev) != STRIA_OK)
        return stria__bc_fail(o->device);
    desc = stria_device_description(dev);
    stream = stria__cuda_stream(dev, STRIA_STREAM_COMPUTE);
    if ((ce = cudaEventCreate(&e0)) != cudaSuccess || (ce = cudaEventCreate(&e1)) != cudaSuccess) {
        rc = stria__bc_cuda_fail("cudaEventCreate", ce);
        goto out;
    }
    ms = (float *)calloc((size_t)o->reps, sizeof(float));
    if (ms == NULL)
        goto out;
    if (!o->json)
        printf("stria-bench kernels: %s, %s: S=%lld H=%lld/%lld D=%lld %s %s, median of %d\n",
               stria_device_name(dev), desc, (long long)o->seq, (long long)o->heads,
               (long long)o->kv_heads, (long long)o->head_dim, o->causal ? "causal" : "non-causal",
               stria_dtype_name(o->dtype), o->reps);

    if (o->gemm_n > 0) {
        gemm_ms = stria__bc_gemm(o->gemm_n, o->reps, stream);
        if (gemm_ms <= 0.0f)
            goto out;
        double n = (double)o->gemm_n;
        gemm_tflops = 2.0 * n * n * n / (gemm_ms * 1e-3) * 1e-12;
        if (o->json)
            printf("{\"name\":\"cublas_gemm\",\"pass\":\"gemm\",\"device\":\"%s\",\"gpu\":\"%s\","
                   "\"n\":%lld,\"dtype\":\"bf16\",\"reps\":%d,\"seconds\":%.6f,\"tflops\":%.3f}\n",
                   stria_device_name(dev), desc, (long long)o->gemm_n, o->reps, gemm_ms * 1e-3,
                   gemm_tflops);
        else
            printf("  cuBLAS bf16 GEMM %lld^3 (fp32 accumulation): %.3f ms, %.1f TFLOP/s\n",
                   (long long)o->gemm_n, gemm_ms, gemm_tflops);
    }

    d.p.batch = 1;
    d.p.q_tokens = d.p.kv_tokens = o->seq;
    d.p.heads = o->heads;
    d.p.kv_heads = o->kv_heads;
    d.p.head_dim = o->head_dim;
    d.p.causal = o->causal;
    d.nl = (size_t)(o->seq * o->heads);
    if (stria__bc_tensor(dev, &d.q, o->dtype, o->seq, o->heads, o->head_dim, 1) != STRIA_OK ||
        stria__bc_tensor(dev, &d.k, o->dtype, o->seq, o->kv_heads, o->head_dim, 2) != STRIA_OK ||
        stria__bc_tensor(dev, &d.v, o->dtype, o->seq, o->kv_heads, o->head_dim, 3) != STRIA_OK ||
        stria__bc_tensor(dev, &d.d_o, o->dtype, o->seq, o->heads, o->head_dim, 4) != STRIA_OK ||
        stria__bc_tensor(dev, &d.o, STRIA_DTYPE_F32, o->seq, o->heads, o->head_dim, 0) !=
            STRIA_OK ||
        stria__bc_tensor(dev, &d.dq, STRIA_DTYPE_F32, o->seq, o->heads, o->head_dim, 0) !=
            STRIA_OK ||
        stria__bc_tensor(dev, &d.dk, STRIA_DTYPE_F32, o->seq, o->kv_heads, o->head_dim, 0) !=
            STRIA_OK ||
        stria__bc_tensor(dev, &d.dv, STRIA_DTYPE_F32, o->seq, o->kv_heads, o->head_dim, 0) !=
            STRIA_OK ||
        stria_device_alloc(dev, d.nl * 4, (void **)&d.lse) != STRIA_OK ||
        stria_device_alloc(dev, d.nl * 4, (void **)&d.delta) != STRIA_OK) {
        rc = stria__bc_fail("cannot set up the attention tensors");
        goto out;
    }
    fwd_flops = 4.0 * (double)o->seq * (double)o->seq * (double)o->head_dim * (double)o->heads;
    if (o->causal)
        fwd_flops *= 0.5;

    for (int pass = 0; pass < 2; pass++) {
        for (int r = -1; r < o->reps; r++) { /* r = -1: warm-up */
            stria_status_t st = STRIA_OK;
            if (pass == 1) { /* backward accumulates: start from zero, untimed */
                size_t qb = (size_t)(o->seq * o->heads * o->head_dim) * 4;
                size_t kb = (size_t)(o->seq * o->kv_heads * o->head_dim) * 4;
                st = stria_device_zero(dev, STRIA_STREAM_COMPUTE, d.dq.data, qb);
                if (st == STRIA_OK)
                    st = stria_device_zero(dev, STRIA_STREAM_COMPUTE, d.dk.data, kb);
                if (st == STRIA_OK)
                    st = stria_device_zero(dev, STRIA_STREAM_COMPUTE, d.dv.data, kb);
            }
            if (st == STRIA_OK) {
                cudaEventRecord(e0, stream);
                if (pass == 0) {
                    st = stria_device_attn_fwd(dev, &d.p, &d.q, &d.k, &d.v, &d.o, d.lse, false);
                } else {
                    st = stria_device_attn_bwd_delta(dev, &d.p, &d.o, &d.d_o, d.delta);
                    if (st == STRIA_OK)
                        st = stria_device_attn_bwd(dev, &d.p, &d.q, &d.k, &d.v, &d.d_o, d.lse,
                                                   d.delta, &d.dq, &d.dk, &d.dv);
                }
                cudaEventRecord(e1, stream);
            }
            if (st == STRIA_OK)
                st = stria_device_sync(dev, STRIA_STREAM_COMPUTE);
            if (st != STRIA_OK) {
                rc = stria__bc_fail(pass == 0 ? "forward" : "backward");
                goto out;
            }
            if (r >= 0)
                cudaEventElapsedTime(&ms[r], e0, e1);
        }
        stria__bc_report(o, stria_device_name(dev), desc, pass == 0 ? "fwd" : "bwd",
                         stria__bc_median(ms, o->reps), pass == 0 ? fwd_flops : 2.5 * fwd_flops,
                         gemm_tflops);
    }
    rc = 0;
out:
    if (e0 != NULL)
        cudaEventDestroy(e0);
    if (e1 != NULL)
        cudaEventDestroy(e1);
    free(ms);
    stria__bc_data_free(dev, &d);
    stria_device_close(dev);
    return rc;
}
