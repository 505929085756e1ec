/* Internal interface between the device front end (device.c) and the device
 * implementations (device.c's CPU device, cuda/device_cuda.cu). Not part of
 * the public API. */
#ifndef STRIA_DEVICE_INT_H
#define STRIA_DEVICE_INT_H

#include "stria_device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The operands of one backward call (stria_device_attn_bwd()'s, in its
 * order), as the backends take them. */
typedef struct {
    const stria_tensor_t *q, *k, *v, *d_o;
    const float *lse, *delta;
    const stria_tensor_t *dq, *dk, *dv;
} stria__bwd_io_t;

typedef struct {
    void (*close)(stria_device_t *dev);
    stria_status_t (*memory)(stria_device_t *dev, size_t *free_bytes, size_t *total_bytes);
    stria_status_t (*alloc)(stria_device_t *dev, size_t bytes, void **out);
    void (*free)(stria_device_t *dev, void *ptr);
    stria_status_t (*host_alloc)(stria_device_t *dev, size_t bytes, void **out);
    void (*host_free)(stria_device_t *dev, void *ptr);
    stria_status_t (*copy)(stria_device_t *dev, stria_stream_t s, void *dst, const void *src,
                           size_t bytes);
    stria_status_t (*zero)(stria_device_t *dev, stria_stream_t s, void *dst, size_t bytes);
    stria_status_t (*add_f32)(stria_device_t *dev, stria_stream_t s, float *dst, const float *src,
                              size_t n);
    stria_status_t (*order)(stria_device_t *dev, stria_stream_t waiter, stria_stream_t on);
    stria_status_t (*sync)(stria_device_t *dev, stria_stream_t s);
    stria_status_t (*attn_fwd)(stria_device_t *dev, const stria_attn_params_t *params,
                               const stria_tensor_t *q, const stria_tensor_t *k,
                               const stria_tensor_t *v, const stria_tensor_t *o, float *lse,
                               bool accumulate);
    stria_status_t (*attn_partial_init)(stria_device_t *dev, const stria_attn_params_t *params,
                                        const stria_tensor_t *o, float *lse);
    stria_status_t (*attn_merge)(stria_device_t *dev, const stria_attn_params_t *params,
                                 const stria_tensor_t *o_a, float *lse_a, const stria_tensor_t *o_b,
                                 const float *lse_b);
    stria_status_t (*attn_finalize)(stria_device_t *dev, const stria_attn_params_t *params,
                                    const stria_tensor_t *o_part, const stria_tensor_t *o_out);
    stria_status_t (*attn_bwd_delta)(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *o, const stria_tensor_t *d_o,
                                     float *delta);
    stria_status_t (*attn_bwd)(stria_device_t *dev, const stria_attn_params_t *params,
                               const stria__bwd_io_t *io);
    /* Optional (NULL: the front end runs attn_fwd per block): a forward
     * pass over several K/V blocks, stria_attn_fwd_begin() semantics; *impl
     * is the device's own pass object, freed by attn_fwd_end. */
    stria_status_t (*attn_fwd_begin)(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *q, void **impl);
    stria_status_t (*attn_fwd_block)(stria_device_t *dev, void *impl,
                                     const stria_attn_params_t *params, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *o, float *lse,
                                     bool accumulate);
    void (*attn_fwd_end)(stria_device_t *dev, void *impl);
    /* Optional (NULL: the front end runs attn_bwd per block): a backward
     * pass over several K/V blocks, stria_attn_bwd_begin() semantics; *impl
     * is the device's own pass object. */
    stria_status_t (*attn_bwd_begin)(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *q, const stria_tensor_t *d_o,
                                     const float *lse, const float *delta, void **impl);
    stria_status_t (*attn_bwd_block)(stria_device_t *dev, void *impl,
                                     const stria_attn_params_t *params, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *dk,
                                     const stria_tensor_t *dv);
    /* dq NULL: discard. Frees impl. */
    stria_status_t (*attn_bwd_end)(stria_device_t *dev, void *impl, const stria_tensor_t *dq);
} stria_device_ops_t;

/* The common head of every device object; implementations embed it first. */
struct stria_device {
    const stria_device_ops_t *ops;
    stria_device_kind_t kind;
    bool host_visible;
    char name[32];
    char description[128];
    /* stria_device_set_memory(): alloc NULL is the device's own */
    stria_allocator_t mem_device, mem_host;
};

#ifdef STRIA_HAVE_CUDA
/* cuda/device_cuda.cu */
int stria__cuda_device_count(void);
stria_status_t stria__cuda_device_open(int index, stria_device_t **out);
#endif

#ifdef __cplusplus
}
#endif

#endif /* STRIA_DEVICE_INT_H */
