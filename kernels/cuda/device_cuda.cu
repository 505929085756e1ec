/* The CUDA device behind kernels/device_int.h: device memory from cudaMalloc,
 * pinned host memory, a compute and a copy stream (both non-blocking), and the
 * attention kernels of attn_fwd.cu, attn_bwd.cu and attn_simt.cu.
 *
 * Every call first makes the device current on the calling thread, validates
 * its arguments with the checks every device shares (validate_int.h), and
 * turns any CUDA error into a stria_status_t whose message names the call.
 *
 * Positions: a call with a mask (causal, documents or a window) expands the
 * query and key position runs into a pinned staging buffer, with the min and
 * max of every STRIA__CU_GRAIN tokens and a copy of cu_seqlens, and uploads
 * them on the compute stream ahead of its kernels, which derive every row's
 * key bounds from them (attn_cuda.cuh). Two staging slots alternate, each
 * guarded by an event, so the host prepares call n + 1 while call n's upload
 * may still be pending; the device-side copy is one buffer, reused in stream
 * order. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn_cuda.cuh"
#include "device_int.h"
#include "validate_int.h"

cudaError_t stria__cu_fwd_init(void);
cudaError_t stria__cu_bwd_init(void);

typedef struct {
    int64_t *host; /* pinned */
    size_t cap;    /* int64 values */
    cudaEvent_t done;
    bool pending;
} stria__cu_slot_t;

typedef struct {
    struct stria_device base; /* first: the front end's view */
    int index;
    cudaStream_t stream[2];
    cudaEvent_t order_ev;
    stria__cu_slot_t slot[2];
    int next_slot;
    int64_t *dpos; /* device copy of the positions and bounds */
    size_t dpos_cap;
} stria__cu_dev_t;

static stria__cu_dev_t *stria__cu(stria_device_t *dev)
{
    return (stria__cu_dev_t *)dev;
}

static stria_status_t stria__cu_status(cudaError_t e)
{
    switch (e) {
    case cudaErrorMemoryAllocation:
        return STRIA_ERR_NO_MEMORY;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
        return STRIA_ERR_INVALID_ARG;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
        return STRIA_ERR_NOT_FOUND;
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
        return STRIA_ERR_UNSUPPORTED;
    default:
        return STRIA_ERR_INTERNAL;
    }
}

/* STRIA_OK for cudaSuccess; otherwise the error, with a message naming the
 * device, the call and CUDA's description. Clears CUDA's last error. */
static stria_status_t stria__cu_check(const stria__cu_dev_t *d, cudaError_t e, const char *call)
{
    if (e == cudaSuccess)
        return STRIA_OK;
    (void)cudaGetLastError();
    return stria_error_set(stria__cu_status(e), "%s: %s: %s (%s)",
                           d != NULL ? d->base.name : "cuda", call, cudaGetErrorString(e),
                           cudaGetErrorName(e));
}

#define STRIA__CU_TRY(d, call)                                                                     \
    do {                                                                                           \
        stria_status_t st_ = stria__cu_check((d), (call), #call);                                  \
        if (st_ != STRIA_OK)                                                                       \
            return st_;                                                                            \
    } while (0)

static stria_status_t stria__cu_current(const stria__cu_dev_t *d)
{
    return stria__cu_check(d, cudaSetDevice(d->index), "cudaSetDevice");
}

static cudaStream_t stria__cu_stream(const stria__cu_dev_t *d, stria_stream_t s)
{
    return d->stream[s == STRIA_STREAM_COPY ? 1 : 0];
}

static stria_status_t stria__cu_bad_stream(const stria__cu_dev_t *d, stria_stream_t s,
                                           const char *fn)
{
    if (s != STRIA_STREAM_COMPUTE && s != STRIA_STREAM_COPY)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s: unknown stream %d", d->base.name, fn,
                               (int)s);
    return STRIA_OK;
}

/* ---- memory, copies, streams ---------------------------------------------- */

static stria_status_t stria__cu_memory(stria_device_t *dev, size_t *free_bytes, size_t *total_bytes)
{
    stria__cu_dev_t *d = stria__cu(dev);
    size_t f = 0, t = 0;
    stria_status_t st = stria__cu_current(d);
    if (st != STRIA_OK)
        return st;
    STRIA__CU_TRY(d, cudaMemGetInfo(&f, &t));
    *free_bytes = f;
    *total_bytes = t;
    return STRIA_OK;
}

/* `bytes` of device memory (cudaMalloc) or, with `host`, of page-aligned
 * pinned host memory usable by every device of the process (cudaHostAlloc);
 * 0 bytes: NULL. */
static stria_status_t stria__cu_alloc_in(stria_device_t *dev, size_t bytes, bool host, void **out)
{
    stria__cu_dev_t *d = stria__cu(dev);
    void *p = NULL;
    stria_status_t st;
    if (bytes == 0) {
        *out = NULL;
        return STRIA_OK;
    }
    if ((st = stria__cu_current(d)) != STRIA_OK)
        return st;
    cudaError_t e = host ? cudaHostAlloc(&p, bytes, cudaHostAllocPortable) : cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return stria_error_set(stria__cu_status(e), "%s: %s of %zu bytes: %s (%s)", d->base.name,
                               host ? "cudaHostAlloc" : "cudaMalloc", bytes, cudaGetErrorString(e),
                               cudaGetErrorName(e));
    }
    *out = p;
    return STRIA_OK;
}

static stria_status_t stria__cu_alloc(stria_device_t *dev, size_t bytes, void **out)
{
    return stria__cu_alloc_in(dev, bytes, false, out);
}

static void stria__cu_free(stria_device_t *dev, void *ptr)
{
    stria__cu_dev_t *d = stria__cu(dev);
    if (ptr == NULL || cudaSetDevice(d->index) != cudaSuccess)
        return;
    (void)cudaFree(ptr);
    (void)cudaGetLastError();
}

static stria_status_t stria__cu_host_alloc(stria_device_t *dev, size_t bytes, void **out)
{
    return stria__cu_alloc_in(dev, bytes, true, out);
}

static void stria__cu_host_free(stria_device_t *dev, void *ptr)
{
    (void)dev;
    if (ptr != NULL) {
        (void)cudaFreeHost(ptr);
        (void)cudaGetLastError();
    }
}

/* A call on one stream: the stream checked (stria__cu_bad_stream), the device
 * made current, then op(the CUDA stream), a callable returning the
 * cudaError_t of the CUDA call named `call`. */
template <typename Op>
static stria_status_t stria__cu_stream_call(stria_device_t *dev, stria_stream_t s, const char *what,
                                            const char *call, Op op)
{
    stria__cu_dev_t *d = stria__cu(dev);
    stria_status_t st = stria__cu_bad_stream(d, s, what);
    if (st == STRIA_OK)
        st = stria__cu_current(d);
    return st != STRIA_OK ? st : stria__cu_check(d, op(stria__cu_stream(d, s)), call);
}

static stria_status_t stria__cu_copy(stria_device_t *dev, stria_stream_t s, void *dst,
                                     const void *src, size_t bytes)
{
    return stria__cu_stream_call(dev, s, "copy", "cudaMemcpyAsync", [=](cudaStream_t cs) {
        return bytes == 0 ? cudaSuccess : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cs);
    });
}

static stria_status_t stria__cu_zero(stria_device_t *dev, stria_stream_t s, void *dst, size_t bytes)
{
    return stria__cu_stream_call(dev, s, "zero", "cudaMemsetAsync", [=](cudaStream_t cs) {
        return bytes == 0 ? cudaSuccess : cudaMemsetAsync(dst, 0, bytes, cs);
    });
}

static stria_status_t stria__cu_add(stria_device_t *dev, stria_stream_t s, float *dst,
                                    const float *src, size_t n)
{
    return stria__cu_stream_call(dev, s, "add_f32", "stria__cu_add_f32", [=](cudaStream_t cs) {
        return stria__cu_add_f32(dst, src, n, cs);
    });
}

static stria_status_t stria__cu_order(stria_device_t *dev, stria_stream_t waiter, stria_stream_t on)
{
    stria__cu_dev_t *d = stria__cu(dev);
    stria_status_t st;
    if ((st = stria__cu_bad_stream(d, waiter, "order")) != STRIA_OK ||
        (st = stria__cu_bad_stream(d, on, "order")) != STRIA_OK ||
        (st = stria__cu_current(d)) != STRIA_OK)
        return st;
    if (waiter == on)
        return STRIA_OK;
    STRIA__CU_TRY(d, cudaEventRecord(d->order_ev, stria__cu_stream(d, on)));
    STRIA__CU_TRY(d, cudaStreamWaitEvent(stria__cu_stream(d, waiter), d->order_ev, 0));
    return STRIA_OK;
}

static stria_status_t stria__cu_sync(stria_device_t *dev, stria_stream_t s)
{
    return stria__cu_stream_call(dev, s, "sync", "cudaStreamSynchronize", cudaStreamSynchronize);
}

/* ---- positions ----------------------------------------------------------- */

static void stria__cu_grain_bounds(const int64_t *pos, int64_t n, int64_t *mn, int64_t *mx)
{
    stria__tile_bounds(pos, n, STRIA__CU_GRAIN, (n + STRIA__CU_GRAIN - 1) / STRIA__CU_GRAIN, mn,
                       mx);
}

/* Validates the position runs of p and the end of its documents (as attn.c
 * does) and, for a call with a mask (causal, documents or a window), uploads
 * positions, grain bounds and cu_seqlens on the compute stream, filling a's
 * mask fields. */
static stria_status_t stria__cu_positions(stria__cu_dev_t *d, const stria_attn_params_t *p,
                                          const char *fn, stria_cu_attn_t *a)
{
    int64_t nqg = (p->q_tokens + STRIA__CU_GRAIN - 1) / STRIA__CU_GRAIN;
    int64_t nkg = (p->kv_tokens + STRIA__CU_GRAIN - 1) / STRIA__CU_GRAIN;
    size_t ncu = p->n_cu_seqlens;
    size_t need = (size_t)(p->q_tokens + p->kv_tokens + 2 * nqg + 2 * nkg) + ncu;
    stria__cu_slot_t *slot = &d->slot[d->next_slot];
    stria_status_t st;

    if (slot->pending) {
        STRIA__CU_TRY(d, cudaEventSynchronize(slot->done));
        slot->pending = false;
    }
    if (slot->cap < need) {
        int64_t *h = NULL;
        size_t cap = need + need / 2;
        STRIA__CU_TRY(d, cudaHostAlloc((void **)&h, cap * sizeof(int64_t), cudaHostAllocPortable));
        (void)cudaFreeHost(slot->host);
        slot->host = h;
        slot->cap = cap;
    }
    int64_t *qpos = slot->host, *kpos = qpos + p->q_tokens;
    int64_t *qmin = kpos + p->kv_tokens, *qmax = qmin + nqg;
    int64_t *kmin = qmax + nqg, *kmax = kmin + nkg, *cu = kmax + nkg;
    if ((st = stria__validate_positions(&p->q_pos, p->q_tokens, fn, "query", qpos)) != STRIA_OK ||
        (st = stria__validate_positions(&p->kv_pos, p->kv_tokens, fn, "key", kpos)) != STRIA_OK ||
        (st = stria__validate_doc_end(p, qpos, p->q_tokens, fn, "query")) != STRIA_OK ||
        (st = stria__validate_doc_end(p, kpos, p->kv_tokens, fn, "key")) != STRIA_OK)
        return st;
    a->causal = p->causal;
    a->bounds = ncu > 0 || p->has_window;
    a->n_cu = (int64_t)ncu;
    a->has_window = p->has_window;
    a->wl = p->window_left;
    a->wr = p->window_right;
    if (!p->causal && !a->bounds)
        return STRIA_OK; /* no mask: nothing to upload */
    stria__cu_grain_bounds(qpos, p->q_tokens, qmin, qmax);
    stria__cu_grain_bounds(kpos, p->kv_tokens, kmin, kmax);
    if (ncu > 0)
        memcpy(cu, p->cu_seqlens, ncu * sizeof(int64_t));
    if (d->dpos_cap < need) {
        int64_t *g = NULL;
        size_t cap = need + need / 2;
        /* the old buffer may be read by queued kernels */
        STRIA__CU_TRY(d, cudaStreamSynchronize(d->stream[0]));
        STRIA__CU_TRY(d, cudaMalloc((void **)&g, cap * sizeof(int64_t)));
        (void)cudaFree(d->dpos);
        d->dpos = g;
        d->dpos_cap = cap;
    }
    STRIA__CU_TRY(d, cudaMemcpyAsync(d->dpos, slot->host, need * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, d->stream[0]));
    STRIA__CU_TRY(d, cudaEventRecord(slot->done, d->stream[0]));
    slot->pending = true;
    d->next_slot ^= 1;
    a->qpos = d->dpos;
    a->kpos = a->qpos + p->q_tokens;
    a->qmin = a->kpos + p->kv_tokens;
    a->qmax = a->qmin + nqg;
    a->kmin = a->qmax + nqg;
    a->kmax = a->kmin + nkg;
    a->cu = ncu > 0 ? a->kmax + nkg : NULL;
    return STRIA_OK;
}

/* ---- kernels --------------------------------------------------------------- */

static stria_cu_view_t stria__cu_view(const stria_tensor_t *t)
{
    stria_cu_view_t v;
    v.p = t->data;
    v.sb = t->stride_batch;
    v.st = t->stride_token;
    v.sh = t->stride_head;
    return v;
}

static void stria__cu_args(const stria_attn_params_t *p, stria_cu_attn_t *a)
{
    memset(a, 0, sizeof(*a));
    static_cast<stria__attn_dims_t &>(*a) = stria__attn_dims(p);
    a->D = (int)p->head_dim;
    a->scale = stria__attn_scale(p);
    a->dtype = STRIA_DTYPE_F32;
}

/* The start of every attention call after its validation: the device made
 * current and the call's shape in a. */
static stria_status_t stria__cu_begin(stria__cu_dev_t *d, const stria_attn_params_t *params,
                                      stria_cu_attn_t *a)
{
    stria_status_t st = stria__cu_current(d);
    if (st == STRIA_OK)
        stria__cu_args(params, a);
    return st;
}

static bool stria__cu_aligned(const stria_cu_view_t *v)
{
    /* 16-byte rows of 16-bit values: pointer and every stride in 8s */
    return ((uintptr_t)v->p % 16) == 0 && v->sb % 8 == 0 && v->st % 8 == 0 && v->sh % 8 == 0;
}

bool stria__cu_mma_ok(const stria_cu_attn_t *a, bool backward)
{
    if (a->dtype != STRIA_DTYPE_BF16 && a->dtype != STRIA_DTYPE_F16)
        return false;
    if (a->D != 64 && a->D != 128)
        return false;
    return stria__cu_aligned(&a->q) && stria__cu_aligned(&a->k) && stria__cu_aligned(&a->v) &&
           (!backward || stria__cu_aligned(&a->d_o));
}

/* The arguments a forward and a backward share, after their validation: the
 * device made current, the shape, the positions and masks, and q, k, v. */
static stria_status_t stria__cu_qkv_args(stria__cu_dev_t *d, const stria_attn_params_t *params,
                                         const char *fn, const stria_tensor_t *q,
                                         const stria_tensor_t *k, const stria_tensor_t *v,
                                         stria_cu_attn_t *a)
{
    stria_status_t st = stria__cu_begin(d, params, a);
    if (st != STRIA_OK)
        return st;
    if ((st = stria__cu_positions(d, params, fn, a)) != STRIA_OK)
        return st;
    a->dtype = q->dtype;
    a->q = stria__cu_view(q);
    a->k = stria__cu_view(k);
    a->v = stria__cu_view(v);
    return STRIA_OK;
}

static stria_status_t stria__cu_attn_fwd(stria_device_t *dev, const stria_attn_params_t *params,
                                         const stria_tensor_t *q, const stria_tensor_t *k,
                                         const stria_tensor_t *v, const stria_tensor_t *o,
                                         float *lse, bool accumulate)
{
    static const char fn[] = "stria_device_attn_fwd";
    stria__cu_dev_t *d = stria__cu(dev);
    stria_cu_attn_t a;
    stria_status_t st;

    if ((st = stria__validate_fwd(params, q, k, v, o, lse, fn)) != STRIA_OK ||
        (st = stria__cu_qkv_args(d, params, fn, q, k, v, &a)) != STRIA_OK)
        return st;
    a.o = stria__cu_view(o);
    a.lse = lse;
    a.accumulate = accumulate;
    if (stria__cu_mma_ok(&a, false))
        STRIA__CU_TRY(d, stria__cu_fwd_mma(&a, d->stream[0]));
    else
        STRIA__CU_TRY(d, stria__cu_fwd_simt(&a, d->stream[0]));
    return STRIA_OK;
}

static stria_status_t stria__cu_attn_bwd(stria_device_t *dev, const stria_attn_params_t *params,
                                         const stria__bwd_io_t *io)
{
    static const char fn[] = "stria_device_attn_bwd";
    stria__cu_dev_t *d = stria__cu(dev);
    stria_cu_attn_t a;
    stria_status_t st;

    if ((st = stria__validate_bwd(params, io->q, io->k, io->v, io->d_o, io->lse, io->delta, io->dq,
                                  io->dk, io->dv, fn)) != STRIA_OK ||
        (st = stria__cu_qkv_args(d, params, fn, io->q, io->k, io->v, &a)) != STRIA_OK)
        return st;
    a.d_o = stria__cu_view(io->d_o);
    a.lse_in = io->lse;
    a.delta = io->delta;
    a.dq = stria__cu_view(io->dq);
    a.dk = stria__cu_view(io->dk);
    a.dv = stria__cu_view(io->dv);
    if (stria__cu_mma_ok(&a, true))
        STRIA__CU_TRY(d, stria__cu_bwd_mma(&a, d->stream[0]));
    else
        STRIA__CU_TRY(d, stria__cu_bwd_simt(&a, d->stream[0]));
    return STRIA_OK;
}

/* The per-row kernels: over a partial output (its rows and, but for
 * FINALIZE, their LSE), or, DELTA, over the output and dO. */
typedef enum {
    STRIA__CU_ROWS_INIT,
    STRIA__CU_ROWS_MERGE,
    STRIA__CU_ROWS_FINALIZE,
    STRIA__CU_ROWS_DELTA,
} stria__cu_rows_t;

/* Checks and runs a per-row kernel on o's rows. vec is o's LSE (INIT,
 * MERGE) or the delta written (DELTA); other is MERGE's second partial (of
 * LSE other_lse), FINALIZE's output, DELTA's dO. */
static stria_status_t stria__cu_rows(stria_device_t *dev, stria__cu_rows_t op,
                                     const stria_attn_params_t *params, const stria_tensor_t *o,
                                     float *vec, const stria_tensor_t *other,
                                     const float *other_lse)
{
    stria__cu_dev_t *d = stria__cu(dev);
    cudaStream_t s = d->stream[0];
    stria_cu_attn_t a;
    stria_status_t st;
    switch (op) {
    case STRIA__CU_ROWS_INIT:
        st = stria__validate_partial_init(params, o, vec, "stria_device_attn_partial_init");
        break;
    case STRIA__CU_ROWS_MERGE:
        st = stria__validate_merge(params, o, vec, other, other_lse, "stria_device_attn_merge");
        break;
    case STRIA__CU_ROWS_FINALIZE:
        st = stria__validate_finalize(params, o, other, "stria_device_attn_finalize");
        break;
    default:
        st = stria__validate_delta(params, o, other, vec, "stria_device_attn_bwd_delta");
        break;
    }
    if (st != STRIA_OK || (st = stria__cu_begin(d, params, &a)) != STRIA_OK)
        return st;
    a.o = stria__cu_view(o);
    a.lse = op == STRIA__CU_ROWS_DELTA ? NULL : vec;
    switch (op) {
    case STRIA__CU_ROWS_INIT:
        STRIA__CU_TRY(d, stria__cu_partial_init(&a, s));
        break;
    case STRIA__CU_ROWS_MERGE:
        STRIA__CU_TRY(d, stria__cu_merge(&a, stria__cu_view(other), other_lse, s));
        break;
    case STRIA__CU_ROWS_FINALIZE:
        STRIA__CU_TRY(d, stria__cu_finalize(&a, stria__cu_view(other), other->dtype, s));
        break;
    default:
        a.d_o = stria__cu_view(other);
        a.dtype = other->dtype;
        STRIA__CU_TRY(d, stria__cu_delta(&a, o->dtype, vec, s));
        break;
    }
    return STRIA_OK;
}

static stria_status_t stria__cu_attn_partial_init(stria_device_t *dev,
                                                  const stria_attn_params_t *params,
                                                  const stria_tensor_t *o, float *lse)
{
    return stria__cu_rows(dev, STRIA__CU_ROWS_INIT, params, o, lse, NULL, NULL);
}

static stria_status_t stria__cu_attn_merge(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *o_a, float *lse_a,
                                           const stria_tensor_t *o_b, const float *lse_b)
{
    return stria__cu_rows(dev, STRIA__CU_ROWS_MERGE, params, o_a, lse_a, o_b, lse_b);
}

static stria_status_t stria__cu_attn_finalize(stria_device_t *dev,
                                              const stria_attn_params_t *params,
                                              const stria_tensor_t *o_part,
                                              const stria_tensor_t *o_out)
{
    return stria__cu_rows(dev, STRIA__CU_ROWS_FINALIZE, params, o_part, NULL, o_out, NULL);
}

static stria_status_t stria__cu_attn_bwd_delta(stria_device_t *dev,
                                               const stria_attn_params_t *params,
                                               const stria_tensor_t *o, const stria_tensor_t *d_o,
                                               float *delta)
{
    return stria__cu_rows(dev, STRIA__CU_ROWS_DELTA, params, o, delta, d_o, NULL);
}

/* ---- open and close ---------------------------------------------------------- */

static void stria__cu_close(stria_device_t *dev)
{
    stria__cu_dev_t *d = stria__cu(dev);
    if (d == NULL)
        return;
    if (cudaSetDevice(d->index) == cudaSuccess) {
        for (int i = 0; i < 2; i++)
            if (d->stream[i] != NULL)
                (void)cudaStreamSynchronize(d->stream[i]);
        for (int i = 0; i < 2; i++) {
            if (d->slot[i].done != NULL)
                (void)cudaEventDestroy(d->slot[i].done);
            if (d->slot[i].host != NULL)
                (void)cudaFreeHost(d->slot[i].host);
        }
        if (d->dpos != NULL)
            (void)cudaFree(d->dpos);
        if (d->order_ev != NULL)
            (void)cudaEventDestroy(d->order_ev);
        for (int i = 1; i >= 0; i--)
            if (d->stream[i] != NULL)
                (void)cudaStreamDestroy(d->stream[i]);
        (void)cudaGetLastError();
    }
    free(d);
}

static const stria_device_ops_t stria__cu_ops = {
    stria__cu_close,
    stria__cu_memory,
    stria__cu_alloc,
    stria__cu_free,
    stria__cu_host_alloc,
    stria__cu_host_free,
    stria__cu_copy,
    stria__cu_zero,
    stria__cu_add,
    stria__cu_order,
    stria__cu_sync,
    stria__cu_attn_fwd,
    stria__cu_attn_partial_init,
    stria__cu_attn_merge,
    stria__cu_attn_finalize,
    stria__cu_attn_bwd_delta,
    stria__cu_attn_bwd,
    /* no forward or backward pass of its own: the front end runs attn_fwd
     * and attn_bwd per block (the CUDA kernels read Q and dO in place,
     * nothing to pack once) */
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

cudaStream_t stria__cuda_stream(stria_device_t *dev, stria_stream_t s)
{
    if (dev == NULL || dev->kind != STRIA_DEVICE_CUDA)
        return NULL;
    return stria__cu_stream(stria__cu(dev), s);
}

extern "C" int stria__cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver, no GPU: not an error */
        return 0;
    }
    return n;
}

extern "C" stria_status_t stria__cuda_device_open(int index, stria_device_t **out)
{
    stria__cu_dev_t *d;
    cudaDeviceProp prop;
    stria_status_t st;

    if (out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "cuda device open: out is NULL");
    if (index < 0 || index >= stria__cuda_device_count())
        return stria_error_set(STRIA_ERR_NOT_FOUND, "cuda:%d: no such GPU (%d visible)", index,
                               stria__cuda_device_count());
    d = (stria__cu_dev_t *)calloc(1, sizeof(*d));
    if (d == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cuda:%d: cannot allocate the device", index);
    d->base.ops = &stria__cu_ops;
    d->base.kind = STRIA_DEVICE_CUDA;
    d->base.host_visible = false;
    snprintf(d->base.name, sizeof(d->base.name), "cuda:%d", index);
    d->index = index;

    if ((st = stria__cu_current(d)) != STRIA_OK)
        goto fail;
    if ((st = stria__cu_check(d, cudaGetDeviceProperties(&prop, index),
                              "cudaGetDeviceProperties")) != STRIA_OK)
        goto fail;
    snprintf(d->base.description, sizeof(d->base.description), "%.80s (sm_%d%d, %.1f GiB)",
             prop.name, prop.major, prop.minor,
             (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    if (prop.major < 8) {
        st = stria_error_set(STRIA_ERR_UNSUPPORTED,
                             "%s: %s is sm_%d%d; the CUDA kernels need sm_80 or newer",
                             d->base.name, prop.name, prop.major, prop.minor);
        goto fail;
    }
    for (int i = 0; i < 2; i++)
        if ((st =
                 stria__cu_check(d, cudaStreamCreateWithFlags(&d->stream[i], cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags")) != STRIA_OK)
            goto fail;
    if ((st = stria__cu_check(d, cudaEventCreateWithFlags(&d->order_ev, cudaEventDisableTiming),
                              "cudaEventCreateWithFlags")) != STRIA_OK)
        goto fail;
    for (int i = 0; i < 2; i++)
        if ((st = stria__cu_check(
                 d, cudaEventCreateWithFlags(&d->slot[i].done, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags")) != STRIA_OK)
            goto fail;
    if ((st = stria__cu_check(d, stria__cu_fwd_init(), "cudaFuncSetAttribute (forward)")) !=
            STRIA_OK ||
        (st = stria__cu_check(d, stria__cu_bwd_init(), "cudaFuncSetAttribute (backward)")) !=
            STRIA_OK)
        goto fail;
    *out = &d->base;
    return STRIA_OK;
fail:
    stria__cu_close(&d->base);
    return st;
}
