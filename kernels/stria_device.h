/*
 * stria devices: where a rank's tensors live and its kernels run.
 *
 * A device is a small vtable (ggml's backend idea) with two implementations:
 *
 *   "cpu"        host memory and the CPU kernels of stria_kernels.h. Device
 *                memory is host memory (stria_device_host_visible() is true),
 *                so callers skip every staging copy; copies are memcpy and run
 *                at once.
 *   "cuda:N"     GPU N through the CUDA runtime (only in builds with CUDA):
 *                device memory from cudaMalloc, pinned host memory for the
 *                transport, two streams (compute and copy) and the CUDA
 *                kernels of kernels/cuda/.
 *
 * and one for tests:
 *
 *   "cpu:staged" the CPU kernels, but device buffers are separate
 *                allocations and stria_device_host_visible() is false, so a
 *                caller runs exactly the staging path it would run on a GPU
 *                (copies between host and device buffers, stream ordering).
 *                It lets CI check that path without a GPU.
 *
 * Every function returns a stria_status_t and sets the thread's error
 * message; none exits. Functions that take a stream enqueue work on it and
 * may return before it is done (CUDA), or do it at once (CPU). Errors of
 * enqueued work surface at the latest from stria_device_sync().
 *
 * Kernel entry points mirror stria_kernels.h one to one (same params struct,
 * same tensor views and semantics), with every tensor pointer, lse and delta
 * in device memory. Position runs in params stay in host memory; the device
 * copies what it needs. Kernels run on STRIA_STREAM_COMPUTE.
 *
 * Threading: a device object is used by one thread at a time.
 */
#ifndef STRIA_DEVICE_H
#define STRIA_DEVICE_H

#include "stria_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    STRIA_DEVICE_CPU = 0,
    STRIA_DEVICE_CUDA = 1,
} stria_device_kind_t;

typedef enum {
    STRIA_STREAM_COMPUTE = 0,
    STRIA_STREAM_COPY = 1,
} stria_stream_t;

typedef struct stria_device stria_device_t;

/* Number of CUDA GPUs visible to this process: 0 in a build without CUDA,
 * without a driver, or without a GPU (never an error). */
int stria_cuda_device_count(void);

/* Whether this build has the CUDA device. */
bool stria_cuda_built(void);

/* Opens a device by name: "cpu", "cpu:staged", "cuda" (= "cuda:0"),
 * "cuda:N", or "auto" (cuda:0 when a GPU is visible, else cpu). pool: the
 * CPU kernels' thread pool (borrowed, may be NULL; unused by CUDA).
 * Errors: STRIA_ERR_INVALID_ARG (malformed name), STRIA_ERR_UNSUPPORTED
 * (a build without CUDA), STRIA_ERR_NOT_FOUND (no such GPU), or the CUDA
 * runtime's error, with a message naming the device. */
stria_status_t stria_device_open(const char *name, stria_pool_t *pool, stria_device_t **out);
void stria_device_close(stria_device_t *dev);

stria_device_kind_t stria_device_kind(const stria_device_t *dev);
/* Canonical name ("cpu", "cpu:staged", "cuda:0"). */
const char *stria_device_name(const stria_device_t *dev);
/* Human description, e.g. "NVIDIA H200 (sm_90, 139.8 GiB)" or the CPU
 * kernel variant ("cpu (avx512)"). */
const char *stria_device_description(const stria_device_t *dev);
/* True when device memory is ordinary host memory that the transport may
 * read and write directly (no staging). */
bool stria_device_host_visible(const stria_device_t *dev);
/* Free and total device memory in bytes (CPU: available and total RAM). */
stria_status_t stria_device_memory(stria_device_t *dev, size_t *free_bytes, size_t *total_bytes);

/* Device memory, 256-byte aligned. bytes == 0 gives NULL and STRIA_OK. */
stria_status_t stria_device_alloc(stria_device_t *dev, size_t bytes, void **out);
void stria_device_free(stria_device_t *dev, void *ptr);
/* Host memory suited to copies from and to the device (pinned for CUDA),
 * 64-byte aligned. */
stria_status_t stria_device_host_alloc(stria_device_t *dev, size_t bytes, void **out);
void stria_device_host_free(stria_device_t *dev, void *ptr);

/* Where this object's later stria_device_alloc() (device_mem) and
 * stria_device_host_alloc() (host_mem) take their memory, and where
 * stria_device_free()/host_free() give it back: e.g. a worker's pools of
 * device and pinned host memory, whose segments come from
 * stria_device_alloc_raw() of a device of the same kind (the same GPU). NULL
 * keeps the device's own. Copied; the contexts are borrowed for the
 * object's life. Set it before allocating anything. */
stria_status_t stria_device_set_memory(stria_device_t *dev, const stria_allocator_t *device_mem,
                                       const stria_allocator_t *host_mem);
/* The device's own memory (host: pinned), whatever stria_device_set_memory()
 * says, and its release (host as given to the alloc). */
stria_status_t stria_device_alloc_raw(stria_device_t *dev, bool host, size_t bytes, void **out);
void stria_device_free_raw(stria_device_t *dev, bool host, void *ptr);

/* Copies bytes between any two of host and device memory, enqueued on
 * `stream`. A host buffer must stay valid and unchanged until the copy is
 * known to be done (stria_device_sync() of that stream). */
stria_status_t stria_device_copy(stria_device_t *dev, stria_stream_t stream, void *dst,
                                 const void *src, size_t bytes);
/* Sets bytes of device memory to zero, enqueued on `stream`. */
stria_status_t stria_device_zero(stria_device_t *dev, stria_stream_t stream, void *dst,
                                 size_t bytes);
/* dst[i] += src[i] for n fp32 values in device memory, on `stream`. */
stria_status_t stria_device_add_f32(stria_device_t *dev, stria_stream_t stream, float *dst,
                                    const float *src, size_t n);
/* Work enqueued on `waiter` from now on starts only after all work
 * enqueued on `on` so far has finished (an event, not a host wait). */
stria_status_t stria_device_order(stria_device_t *dev, stria_stream_t waiter, stria_stream_t on);
/* Blocks until all work enqueued on `stream` has finished; returns the first
 * error of that work. */
stria_status_t stria_device_sync(stria_device_t *dev, stria_stream_t stream);

/* ---- kernels (stria_kernels.h semantics, device memory) -------------------- */

stria_status_t stria_device_attn_fwd(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *q, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *o, float *lse,
                                     bool accumulate);
stria_status_t stria_device_attn_partial_init(stria_device_t *dev,
                                              const stria_attn_params_t *params,
                                              const stria_tensor_t *o, float *lse);
stria_status_t stria_device_attn_merge(stria_device_t *dev, const stria_attn_params_t *params,
                                       const stria_tensor_t *o_a, float *lse_a,
                                       const stria_tensor_t *o_b, const float *lse_b);
stria_status_t stria_device_attn_finalize(stria_device_t *dev, const stria_attn_params_t *params,
                                          const stria_tensor_t *o_part,
                                          const stria_tensor_t *o_out);
stria_status_t stria_device_attn_bwd_delta(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *o, const stria_tensor_t *d_o,
                                           float *delta);
stria_status_t stria_device_attn_bwd(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *q, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *d_o,
                                     const float *lse, const float *delta, const stria_tensor_t *dq,
                                     const stria_tensor_t *dk, const stria_tensor_t *dv);

/* A forward pass over several K/V blocks (stria_attn_fwd_begin() of
 * stria_kernels.h): the query side is prepared once. On a device without a
 * pass of its own (CUDA, whose kernels read Q in place), every block runs
 * stria_device_attn_fwd() with the q given to begin, which must then stay
 * valid until end. end(NULL) does nothing. */
typedef struct stria_device_fwd_pass stria_device_fwd_pass_t;

stria_status_t stria_device_attn_fwd_begin(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *q, stria_device_fwd_pass_t **pass);
stria_status_t stria_device_attn_fwd_block(stria_device_fwd_pass_t *pass,
                                           const stria_attn_params_t *params,
                                           const stria_tensor_t *k, const stria_tensor_t *v,
                                           const stria_tensor_t *o, float *lse, bool accumulate);
void stria_device_attn_fwd_end(stria_device_fwd_pass_t *pass);

/* A backward pass over several K/V blocks (stria_attn_bwd_begin() of
 * stria_kernels.h): the query side is prepared once and dQ accumulates in
 * the pass; end adds it into dq (the view given to begin, device memory).
 * On a device without a pass of its own (CUDA), every block runs
 * stria_device_attn_bwd() into dq directly and end adds nothing. q, d_o,
 * lse, delta and dq must stay valid until end; end(keep = false) discards
 * the pass after an error. The pass is freed by end whatever the result. */
typedef struct stria_device_bwd_pass stria_device_bwd_pass_t;

stria_status_t stria_device_attn_bwd_begin(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *q, const stria_tensor_t *d_o,
                                           const float *lse, const float *delta,
                                           const stria_tensor_t *dq,
                                           stria_device_bwd_pass_t **pass);
stria_status_t stria_device_attn_bwd_block(stria_device_bwd_pass_t *pass,
                                           const stria_attn_params_t *params,
                                           const stria_tensor_t *k, const stria_tensor_t *v,
                                           const stria_tensor_t *dk, const stria_tensor_t *dv);
stria_status_t stria_device_attn_bwd_end(stria_device_bwd_pass_t *pass, bool keep);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_DEVICE_H */
