/*
 * Devices: the front end of stria_device.h (name parsing, argument checks,
 * dispatch through the ops table) and the CPU device in its two flavours,
 * "cpu" (device memory is host memory) and "cpu:staged" (separate device
 * allocations, host_visible false, so callers run their GPU staging path).
 */
#include "device_int.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the CPU device -------------------------------------------------------- */

typedef struct {
    stria_device_t head;
    stria_pool_t *pool; /* borrowed */
} stria__cpu_device_t;

static stria__cpu_device_t *stria__cpu(stria_device_t *dev)
{
    return (stria__cpu_device_t *)dev;
}

static void stria__cpu_close(stria_device_t *dev)
{
    free(dev);
}

/* MemAvailable of /proc/meminfo (kB), or -1 when it cannot be read. */
static long long stria__meminfo_available_kb(void)
{
    char line[256];
    long long kb = -1;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1)
            break;
    fclose(f);
    return kb;
}

static stria_status_t stria__cpu_memory(stria_device_t *dev, size_t *free_bytes,
                                        size_t *total_bytes)
{
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
    long page = sysconf(_SC_PAGESIZE);
    long long kb = stria__meminfo_available_kb();
    if (pages <= 0 || page <= 0)
        return stria_error_set(STRIA_ERR_IO, "%s: cannot read the size of physical memory: %s",
                               dev->name, strerror(errno));
    /* MemAvailable counts reclaimable caches; the free page count does not
     * and would understate what jobs can get. */
    *total_bytes = (size_t)pages * (size_t)page;
    *free_bytes = kb >= 0 ? (size_t)kb * 1024 : (size_t)(avail > 0 ? avail : 0) * (size_t)page;
    if (*free_bytes > *total_bytes)
        *free_bytes = *total_bytes;
    return STRIA_OK;
}

static stria_status_t stria__cpu_alloc(stria_device_t *dev, size_t bytes, void **out)
{
    void *p = NULL;
    size_t rounded = (bytes + 255) & ~(size_t)255;
    if (rounded < bytes || posix_memalign(&p, 256, rounded) != 0)
        return stria_error_set(STRIA_ERR_NO_MEMORY,
                               "%s: cannot allocate %zu bytes of device memory", dev->name, bytes);
    *out = p;
    return STRIA_OK;
}

static void stria__cpu_free(stria_device_t *dev, void *ptr)
{
    (void)dev;
    free(ptr);
}

static stria_status_t stria__cpu_host_alloc(stria_device_t *dev, size_t bytes, void **out)
{
    /* stria_malloc_aligned() rounds the size up to 64 bytes without an
     * overflow check. */
    void *p = bytes <= SIZE_MAX - 64 ? stria_malloc_aligned(bytes) : NULL;
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: cannot allocate %zu bytes of host memory",
                               dev->name, bytes);
    *out = p;
    return STRIA_OK;
}

static void stria__cpu_host_free(stria_device_t *dev, void *ptr)
{
    (void)dev;
    stria_free(ptr);
}

static stria_status_t stria__cpu_copy(stria_device_t *dev, stria_stream_t s, void *dst,
                                      const void *src, size_t bytes)
{
    (void)dev;
    (void)s;
    if (dst != src)
        memmove(dst, src, bytes);
    return STRIA_OK;
}

static stria_status_t stria__cpu_zero(stria_device_t *dev, stria_stream_t s, void *dst,
                                      size_t bytes)
{
    (void)dev;
    (void)s;
    memset(dst, 0, bytes);
    return STRIA_OK;
}

static stria_status_t stria__cpu_add_f32(stria_device_t *dev, stria_stream_t s, float *restrict dst,
                                         const float *restrict src, size_t n)
{
    (void)dev;
    (void)s;
    stria_f32_add(dst, src, n);
    return STRIA_OK;
}

/* Work runs when it is enqueued: nothing to order or wait for. */
static stria_status_t stria__cpu_order(stria_device_t *dev, stria_stream_t waiter,
                                       stria_stream_t on)
{
    (void)dev;
    (void)waiter;
    (void)on;
    return STRIA_OK;
}

static stria_status_t stria__cpu_sync(stria_device_t *dev, stria_stream_t s)
{
    (void)dev;
    (void)s;
    return STRIA_OK;
}

/* The kernels run on the pool given at open, whatever params->pool says. */
static stria_attn_params_t stria__cpu_params(stria_device_t *dev, const stria_attn_params_t *p)
{
    stria_attn_params_t a = *p;
    a.pool = stria__cpu(dev)->pool;
    return a;
}

static stria_status_t stria__cpu_attn_fwd(stria_device_t *dev, const stria_attn_params_t *params,
                                          const stria_tensor_t *q, const stria_tensor_t *k,
                                          const stria_tensor_t *v, const stria_tensor_t *o,
                                          float *lse, bool accumulate)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_fwd(&a, q, k, v, o, lse, accumulate);
}

static stria_status_t stria__cpu_attn_partial_init(stria_device_t *dev,
                                                   const stria_attn_params_t *params,
                                                   const stria_tensor_t *o, float *lse)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_partial_init(&a, o, lse);
}

static stria_status_t stria__cpu_attn_merge(stria_device_t *dev, const stria_attn_params_t *params,
                                            const stria_tensor_t *o_a, float *lse_a,
                                            const stria_tensor_t *o_b, const float *lse_b)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_merge(&a, o_a, lse_a, o_b, lse_b);
}

static stria_status_t stria__cpu_attn_finalize(stria_device_t *dev,
                                               const stria_attn_params_t *params,
                                               const stria_tensor_t *o_part,
                                               const stria_tensor_t *o_out)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_finalize(&a, o_part, o_out);
}

static stria_status_t stria__cpu_attn_bwd_delta(stria_device_t *dev,
                                                const stria_attn_params_t *params,
                                                const stria_tensor_t *o, const stria_tensor_t *d_o,
                                                float *delta)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_bwd_delta(&a, o, d_o, delta);
}

static stria_status_t stria__cpu_attn_bwd(stria_device_t *dev, const stria_attn_params_t *params,
                                          const stria__bwd_io_t *io)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_bwd(&a, io->q, io->k, io->v, io->d_o, io->lse, io->delta, io->dq, io->dk,
                          io->dv);
}

static stria_status_t stria__cpu_attn_fwd_begin(stria_device_t *dev,
                                                const stria_attn_params_t *params,
                                                const stria_tensor_t *q, void **impl)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    stria_attn_fwd_pass_t *pass = NULL;
    stria_status_t st = stria_attn_fwd_begin(&a, q, &pass);
    *impl = pass;
    return st;
}

static stria_status_t stria__cpu_attn_fwd_block(stria_device_t *dev, void *impl,
                                                const stria_attn_params_t *params,
                                                const stria_tensor_t *k, const stria_tensor_t *v,
                                                const stria_tensor_t *o, float *lse,
                                                bool accumulate)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_fwd_block(impl, &a, k, v, o, lse, accumulate);
}

static void stria__cpu_attn_fwd_end(stria_device_t *dev, void *impl)
{
    (void)dev;
    stria_attn_fwd_end(impl);
}

static stria_status_t stria__cpu_attn_bwd_begin(stria_device_t *dev,
                                                const stria_attn_params_t *params,
                                                const stria_tensor_t *q, const stria_tensor_t *d_o,
                                                const float *lse, const float *delta, void **impl)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    stria_attn_bwd_pass_t *pass = NULL;
    stria_status_t st = stria_attn_bwd_begin(&a, q, d_o, lse, delta, &pass);
    *impl = pass;
    return st;
}

static stria_status_t stria__cpu_attn_bwd_block(stria_device_t *dev, void *impl,
                                                const stria_attn_params_t *params,
                                                const stria_tensor_t *k, const stria_tensor_t *v,
                                                const stria_tensor_t *dk, const stria_tensor_t *dv)
{
    stria_attn_params_t a = stria__cpu_params(dev, params);
    return stria_attn_bwd_block(impl, &a, k, v, dk, dv);
}

static stria_status_t stria__cpu_attn_bwd_end(stria_device_t *dev, void *impl,
                                              const stria_tensor_t *dq)
{
    (void)dev;
    return stria_attn_bwd_end(impl, dq);
}

static const stria_device_ops_t stria__cpu_ops = {
    .close = stria__cpu_close,
    .memory = stria__cpu_memory,
    .alloc = stria__cpu_alloc,
    .free = stria__cpu_free,
    .host_alloc = stria__cpu_host_alloc,
    .host_free = stria__cpu_host_free,
    .copy = stria__cpu_copy,
    .zero = stria__cpu_zero,
    .add_f32 = stria__cpu_add_f32,
    .order = stria__cpu_order,
    .sync = stria__cpu_sync,
    .attn_fwd = stria__cpu_attn_fwd,
    .attn_partial_init = stria__cpu_attn_partial_init,
    .attn_merge = stria__cpu_attn_merge,
    .attn_finalize = stria__cpu_attn_finalize,
    .attn_bwd_delta = stria__cpu_attn_bwd_delta,
    .attn_bwd = stria__cpu_attn_bwd,
    .attn_fwd_begin = stria__cpu_attn_fwd_begin,
    .attn_fwd_block = stria__cpu_attn_fwd_block,
    .attn_fwd_end = stria__cpu_attn_fwd_end,
    .attn_bwd_begin = stria__cpu_attn_bwd_begin,
    .attn_bwd_block = stria__cpu_attn_bwd_block,
    .attn_bwd_end = stria__cpu_attn_bwd_end,
};

static stria_status_t stria__cpu_open(bool staged, stria_pool_t *pool, stria_device_t **out)
{
    stria__cpu_device_t *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot open device %s: out of memory",
                               staged ? "cpu:staged" : "cpu");
    d->head.ops = &stria__cpu_ops;
    d->head.kind = STRIA_DEVICE_CPU;
    d->head.host_visible = !staged;
    snprintf(d->head.name, sizeof(d->head.name), "%s", staged ? "cpu:staged" : "cpu");
    snprintf(d->head.description, sizeof(d->head.description), "cpu (%s, %d thread%s%s)",
             stria_kernels_variant(), pool != NULL ? stria_pool_size(pool) : 1,
             pool != NULL && stria_pool_size(pool) > 1 ? "s" : "", staged ? ", staged copies" : "");
    d->pool = pool;
    *out = &d->head;
    return STRIA_OK;
}

/* ---- front end ------------------------------------------------------------- */

#define STRIA__CUDA_MAX_INDEX 4095

int stria_cuda_device_count(void)
{
#ifdef STRIA_HAVE_CUDA
    return stria__cuda_device_count();
#else
    return 0;
#endif
}

bool stria_cuda_built(void)
{
#ifdef STRIA_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

/* Parses "cuda" or "cuda:N" (N: decimal digits, no sign, no leading zeros
 * except "0"). Returns false when the name is not of that form. */
static bool stria__parse_cuda(const char *name, int *index)
{
    const char *d;
    long v = 0;
    if (strcmp(name, "cuda") == 0) {
        *index = 0;
        return true;
    }
    if (strncmp(name, "cuda:", 5) != 0)
        return false;
    d = name + 5;
    if (*d == '\0' || (d[0] == '0' && d[1] != '\0'))
        return false;
    for (; *d != '\0'; d++) {
        if (!isdigit((unsigned char)*d))
            return false;
        v = v * 10 + (*d - '0');
        if (v > STRIA__CUDA_MAX_INDEX)
            return false;
    }
    *index = (int)v;
    return true;
}

static stria_status_t stria__cuda_open(const char *name, int index, stria_device_t **out)
{
#ifdef STRIA_HAVE_CUDA
    int count = stria__cuda_device_count();
    if (index >= count)
        return stria_error_set(STRIA_ERR_NOT_FOUND,
                               "device '%s': no such GPU (%d CUDA GPU%s visible to this process)",
                               name, count, count == 1 ? "" : "s");
    return stria__cuda_device_open(index, out);
#else
    (void)index;
    (void)out;
    return stria_error_set(STRIA_ERR_UNSUPPORTED,
                           "device '%s': this build has no CUDA support (nvcc was not found when "
                           "it was configured, or it was configured with -DSTRIA_CUDA=OFF)",
                           name);
#endif
}

stria_status_t stria_device_open(const char *name, stria_pool_t *pool, stria_device_t **out)
{
    int index;
    if (out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_device_open: out is NULL");
    if (name == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_device_open: device name is NULL");
    if (strcmp(name, "cpu") == 0)
        return stria__cpu_open(false, pool, out);
    if (strcmp(name, "cpu:staged") == 0)
        return stria__cpu_open(true, pool, out);
    if (strcmp(name, "auto") == 0)
        return stria_cuda_device_count() > 0 ? stria__cuda_open("cuda:0", 0, out)
                                             : stria__cpu_open(false, pool, out);
    if (stria__parse_cuda(name, &index))
        return stria__cuda_open(name, index, out);
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "unknown device '%.64s%s' (expected cpu, cpu:staged, cuda, cuda:N with "
                           "N in 0..%d, or auto)",
                           name, strlen(name) > 64 ? "..." : "", STRIA__CUDA_MAX_INDEX);
}

void stria_device_close(stria_device_t *dev)
{
    if (dev != NULL)
        dev->ops->close(dev);
}

stria_device_kind_t stria_device_kind(const stria_device_t *dev)
{
    return dev != NULL ? dev->kind : STRIA_DEVICE_CPU;
}

const char *stria_device_name(const stria_device_t *dev)
{
    return dev != NULL ? dev->name : "(none)";
}

const char *stria_device_description(const stria_device_t *dev)
{
    return dev != NULL ? dev->description : "(none)";
}

bool stria_device_host_visible(const stria_device_t *dev)
{
    return dev != NULL && dev->host_visible;
}

#define STRIA__CHECK_DEV(dev, fn)                                                                  \
    do {                                                                                           \
        if ((dev) == NULL)                                                                         \
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: device is NULL", fn);               \
    } while (0)

static stria_status_t stria__check_stream(const stria_device_t *dev, const char *fn,
                                          stria_stream_t s)
{
    if (s != STRIA_STREAM_COMPUTE && s != STRIA_STREAM_COPY)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s on %s: unknown stream %d", fn, dev->name,
                               (int)s);
    return STRIA_OK;
}

stria_status_t stria_device_memory(stria_device_t *dev, size_t *free_bytes, size_t *total_bytes)
{
    size_t f = 0, t = 0;
    stria_status_t st;
    STRIA__CHECK_DEV(dev, "stria_device_memory");
    if ((st = dev->ops->memory(dev, &f, &t)) != STRIA_OK)
        return st;
    if (free_bytes != NULL)
        *free_bytes = f;
    if (total_bytes != NULL)
        *total_bytes = t;
    return STRIA_OK;
}

/* stria_device_alloc() and stria_device_host_alloc(): from the allocator
 * the program set (stria_device_set_memory()), else the device's own. */
static stria_status_t stria__alloc(stria_device_t *dev, bool host, size_t bytes, void **out,
                                   const char *fn)
{
    const stria_allocator_t *mem = host ? &dev->mem_host : &dev->mem_device;
    if (out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s on %s: out is NULL", fn, dev->name);
    *out = NULL;
    if (bytes == 0)
        return STRIA_OK;
    if (mem->alloc == NULL)
        return stria_device_alloc_raw(dev, host, bytes, out);
    if ((*out = mem->alloc(mem->ctx, bytes)) == NULL)
        return stria_error_wrap(STRIA_ERR_NO_MEMORY, "%s: %zu bytes of %s memory", dev->name, bytes,
                                host ? "host" : "device");
    return STRIA_OK;
}

/* stria_device_free() and stria_device_host_free(): to the allocator the
 * memory came from. */
static void stria__release(stria_device_t *dev, bool host, void *ptr)
{
    if (dev == NULL || ptr == NULL)
        return;
    const stria_allocator_t *mem = host ? &dev->mem_host : &dev->mem_device;
    if (mem->alloc != NULL)
        mem->free(mem->ctx, ptr);
    else
        stria_device_free_raw(dev, host, ptr);
}

stria_status_t stria_device_alloc(stria_device_t *dev, size_t bytes, void **out)
{
    STRIA__CHECK_DEV(dev, "stria_device_alloc");
    return stria__alloc(dev, false, bytes, out, "stria_device_alloc");
}

stria_status_t stria_device_host_alloc(stria_device_t *dev, size_t bytes, void **out)
{
    STRIA__CHECK_DEV(dev, "stria_device_host_alloc");
    return stria__alloc(dev, true, bytes, out, "stria_device_host_alloc");
}

void stria_device_free(stria_device_t *dev, void *ptr)
{
    stria__release(dev, false, ptr);
}

void stria_device_host_free(stria_device_t *dev, void *ptr)
{
    stria__release(dev, true, ptr);
}

stria_status_t stria_device_set_memory(stria_device_t *dev, const stria_allocator_t *device_mem,
                                       const stria_allocator_t *host_mem)
{
    STRIA__CHECK_DEV(dev, "stria_device_set_memory");
    if ((device_mem != NULL && (device_mem->alloc == NULL || device_mem->free == NULL)) ||
        (host_mem != NULL && (host_mem->alloc == NULL || host_mem->free == NULL)))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_device_set_memory on %s: an allocator needs alloc and free",
                               dev->name);
    memset(&dev->mem_device, 0, sizeof(dev->mem_device));
    memset(&dev->mem_host, 0, sizeof(dev->mem_host));
    if (device_mem != NULL)
        dev->mem_device = *device_mem;
    if (host_mem != NULL)
        dev->mem_host = *host_mem;
    return STRIA_OK;
}

/* The device's own memory, whatever stria_device_set_memory() said: the
 * segments of a pool of this device's memory. */
stria_status_t stria_device_alloc_raw(stria_device_t *dev, bool host, size_t bytes, void **out)
{
    STRIA__CHECK_DEV(dev, "stria_device_alloc_raw");
    if (out == NULL || bytes == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_device_alloc_raw on %s: out is NULL or bytes 0", dev->name);
    return host ? dev->ops->host_alloc(dev, bytes, out) : dev->ops->alloc(dev, bytes, out);
}

void stria_device_free_raw(stria_device_t *dev, bool host, void *ptr)
{
    if (dev == NULL || ptr == NULL)
        return;
    if (host)
        dev->ops->host_free(dev, ptr);
    else
        dev->ops->free(dev, ptr);
}

/* The stream operations on a span of n bytes or values. */
typedef enum { STRIA__SPAN_COPY, STRIA__SPAN_ZERO, STRIA__SPAN_ADD_F32 } stria__span_op_t;

/* Checks and runs a span operation on dst (and src, but for ZERO). */
static stria_status_t stria__span(stria_device_t *dev, stria__span_op_t op, stria_stream_t stream,
                                  void *dst, const void *src, size_t n)
{
    static const char *const fns[] = {"stria_device_copy", "stria_device_zero",
                                      "stria_device_add_f32"};
    const char *fn = fns[op];
    stria_status_t st;
    if (dev == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: device is NULL", fn);
    if ((st = stria__check_stream(dev, fn, stream)) != STRIA_OK || n == 0)
        return st;
    if (dst == NULL || (op != STRIA__SPAN_ZERO && src == NULL))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s on %s: NULL %s for %zu %s", fn, dev->name,
                               dst == NULL ? "destination" : "source", n,
                               op == STRIA__SPAN_ADD_F32 ? "values" : "bytes");
    switch (op) {
    case STRIA__SPAN_COPY:
        return dev->ops->copy(dev, stream, dst, src, n);
    case STRIA__SPAN_ZERO:
        return dev->ops->zero(dev, stream, dst, n);
    default:
        return dev->ops->add_f32(dev, stream, dst, src, n);
    }
}

stria_status_t stria_device_copy(stria_device_t *dev, stria_stream_t stream, void *dst,
                                 const void *src, size_t bytes)
{
    return stria__span(dev, STRIA__SPAN_COPY, stream, dst, src, bytes);
}

stria_status_t stria_device_zero(stria_device_t *dev, stria_stream_t stream, void *dst,
                                 size_t bytes)
{
    return stria__span(dev, STRIA__SPAN_ZERO, stream, dst, NULL, bytes);
}

stria_status_t stria_device_add_f32(stria_device_t *dev, stria_stream_t stream, float *dst,
                                    const float *src, size_t n)
{
    return stria__span(dev, STRIA__SPAN_ADD_F32, stream, dst, src, n);
}

stria_status_t stria_device_order(stria_device_t *dev, stria_stream_t waiter, stria_stream_t on)
{
    stria_status_t st;
    STRIA__CHECK_DEV(dev, "stria_device_order");
    if ((st = stria__check_stream(dev, "stria_device_order", waiter)) != STRIA_OK ||
        (st = stria__check_stream(dev, "stria_device_order", on)) != STRIA_OK)
        return st;
    if (waiter == on)
        return STRIA_OK; /* a stream is ordered after itself */
    return dev->ops->order(dev, waiter, on);
}

stria_status_t stria_device_sync(stria_device_t *dev, stria_stream_t stream)
{
    stria_status_t st;
    STRIA__CHECK_DEV(dev, "stria_device_sync");
    if ((st = stria__check_stream(dev, "stria_device_sync", stream)) != STRIA_OK)
        return st;
    return dev->ops->sync(dev, stream);
}

/* ---- kernels ----------------------------------------------------------------- */

#define STRIA__CHECK_KERNEL(dev, params, fn)                                                       \
    do {                                                                                           \
        STRIA__CHECK_DEV(dev, fn);                                                                 \
        if ((params) == NULL)                                                                      \
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s on %s: params is NULL", fn,          \
                                   (dev)->name);                                                   \
    } while (0)

/* A pass's begin: pass_out set to NULL first. */
#define STRIA__CHECK_BEGIN(dev, params, pass_out, fn)                                              \
    do {                                                                                           \
        if ((pass_out) == NULL)                                                                    \
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);                 \
        *(pass_out) = NULL;                                                                        \
        STRIA__CHECK_KERNEL(dev, params, fn);                                                      \
    } while (0)

/* A call on a pass object. */
#define STRIA__CHECK_PASS(pass, params, fn)                                                        \
    do {                                                                                           \
        if ((pass) == NULL)                                                                        \
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: pass is NULL", fn);                 \
        STRIA__CHECK_KERNEL((pass)->head.dev, params, fn);                                         \
    } while (0)

stria_status_t stria_device_attn_fwd(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *q, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *o, float *lse,
                                     bool accumulate)
{
    STRIA__CHECK_KERNEL(dev, params, "stria_device_attn_fwd");
    return dev->ops->attn_fwd(dev, params, q, k, v, o, lse, accumulate);
}

stria_status_t stria_device_attn_partial_init(stria_device_t *dev,
                                              const stria_attn_params_t *params,
                                              const stria_tensor_t *o, float *lse)
{
    STRIA__CHECK_KERNEL(dev, params, "stria_device_attn_partial_init");
    return dev->ops->attn_partial_init(dev, params, o, lse);
}

stria_status_t stria_device_attn_merge(stria_device_t *dev, const stria_attn_params_t *params,
                                       const stria_tensor_t *o_a, float *lse_a,
                                       const stria_tensor_t *o_b, const float *lse_b)
{
    STRIA__CHECK_KERNEL(dev, params, "stria_device_attn_merge");
    return dev->ops->attn_merge(dev, params, o_a, lse_a, o_b, lse_b);
}

stria_status_t stria_device_attn_finalize(stria_device_t *dev, const stria_attn_params_t *params,
                                          const stria_tensor_t *o_part, const stria_tensor_t *o_out)
{
    STRIA__CHECK_KERNEL(dev, params, "stria_device_attn_finalize");
    return dev->ops->attn_finalize(dev, params, o_part, o_out);
}

stria_status_t stria_device_attn_bwd_delta(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *o, const stria_tensor_t *d_o,
                                           float *delta)
{
    STRIA__CHECK_KERNEL(dev, params, "stria_device_attn_bwd_delta");
    return dev->ops->attn_bwd_delta(dev, params, o, d_o, delta);
}

stria_status_t stria_device_attn_bwd(stria_device_t *dev, const stria_attn_params_t *params,
                                     const stria_tensor_t *q, const stria_tensor_t *k,
                                     const stria_tensor_t *v, const stria_tensor_t *d_o,
                                     const float *lse, const float *delta, const stria_tensor_t *dq,
                                     const stria_tensor_t *dk, const stria_tensor_t *dv)
{
    STRIA__CHECK_KERNEL(dev, params, "stria_device_attn_bwd");
    const stria__bwd_io_t io = {q, k, v, d_o, lse, delta, dq, dk, dv};
    return dev->ops->attn_bwd(dev, params, &io);
}

/* ---- passes ------------------------------------------------------------------ */

/* What the forward and the backward pass object start with. */
typedef struct {
    stria_device_t *dev;
    void *impl; /* the device's own pass, or NULL: the one-block call per block */
} stria__pass_head_t;

/* A zeroed pass object of `size` bytes (a stria__pass_head_t first) for dev;
 * NULL, with the error set, when out of memory. */
static void *stria__pass_new(stria_device_t *dev, size_t size, const char *fn)
{
    stria__pass_head_t *h = calloc(1, size);
    if (h == NULL) {
        stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
        return NULL;
    }
    h->dev = dev;
    return h;
}

/* The end of a pass's begin: obj, from stria__pass_new(), when st (the status
 * of the device's own begin; STRIA_OK where it has none) is STRIA_OK; NULL,
 * obj freed, otherwise. */
static void *stria__pass_made(stria_status_t st, void *obj)
{
    if (st == STRIA_OK)
        return obj;
    free(obj);
    return NULL;
}

/* ---- forward pass ------------------------------------------------------------ */

struct stria_device_fwd_pass {
    stria__pass_head_t head; /* impl NULL: attn_fwd per block */
    stria_tensor_t q;
};

stria_status_t stria_device_attn_fwd_begin(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *q, stria_device_fwd_pass_t **pass)
{
    static const char fn[] = "stria_device_attn_fwd_begin";
    stria_device_fwd_pass_t *fp;
    stria_status_t st = STRIA_OK;

    STRIA__CHECK_BEGIN(dev, params, pass, fn);
    if (q == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s on %s: q is NULL", fn, dev->name);
    if ((fp = stria__pass_new(dev, sizeof(*fp), fn)) == NULL)
        return STRIA_ERR_NO_MEMORY;
    fp->q = *q;
    if (dev->ops->attn_fwd_begin != NULL)
        st = dev->ops->attn_fwd_begin(dev, params, q, &fp->head.impl);
    *pass = stria__pass_made(st, fp);
    return st;
}

stria_status_t stria_device_attn_fwd_block(stria_device_fwd_pass_t *pass,
                                           const stria_attn_params_t *params,
                                           const stria_tensor_t *k, const stria_tensor_t *v,
                                           const stria_tensor_t *o, float *lse, bool accumulate)
{
    static const char fn[] = "stria_device_attn_fwd_block";
    STRIA__CHECK_PASS(pass, params, fn);
    stria_device_t *dev = pass->head.dev;
    if (pass->head.impl != NULL)
        return dev->ops->attn_fwd_block(dev, pass->head.impl, params, k, v, o, lse, accumulate);
    return dev->ops->attn_fwd(dev, params, &pass->q, k, v, o, lse, accumulate);
}

void stria_device_attn_fwd_end(stria_device_fwd_pass_t *pass)
{
    if (pass == NULL)
        return;
    if (pass->head.impl != NULL)
        pass->head.dev->ops->attn_fwd_end(pass->head.dev, pass->head.impl);
    free(pass);
}

/* ---- backward pass ----------------------------------------------------------- */

struct stria_device_bwd_pass {
    stria__pass_head_t head; /* impl NULL: attn_bwd per block */
    stria_tensor_t q, d_o, dq;
    const float *lse, *delta;
};

stria_status_t stria_device_attn_bwd_begin(stria_device_t *dev, const stria_attn_params_t *params,
                                           const stria_tensor_t *q, const stria_tensor_t *d_o,
                                           const float *lse, const float *delta,
                                           const stria_tensor_t *dq, stria_device_bwd_pass_t **pass)
{
    static const char fn[] = "stria_device_attn_bwd_begin";
    stria_device_bwd_pass_t *bp;
    stria_status_t st = STRIA_OK;

    STRIA__CHECK_BEGIN(dev, params, pass, fn);
    if (q == NULL || d_o == NULL || dq == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s on %s: %s is NULL", fn, dev->name,
                               q == NULL     ? "q"
                               : d_o == NULL ? "d_o"
                                             : "dq");
    if ((bp = stria__pass_new(dev, sizeof(*bp), fn)) == NULL)
        return STRIA_ERR_NO_MEMORY;
    bp->q = *q;
    bp->d_o = *d_o;
    bp->dq = *dq;
    bp->lse = lse;
    bp->delta = delta;
    if (dev->ops->attn_bwd_begin != NULL)
        st = dev->ops->attn_bwd_begin(dev, params, q, d_o, lse, delta, &bp->head.impl);
    *pass = stria__pass_made(st, bp);
    return st;
}

stria_status_t stria_device_attn_bwd_block(stria_device_bwd_pass_t *pass,
                                           const stria_attn_params_t *params,
                                           const stria_tensor_t *k, const stria_tensor_t *v,
                                           const stria_tensor_t *dk, const stria_tensor_t *dv)
{
    static const char fn[] = "stria_device_attn_bwd_block";
    STRIA__CHECK_PASS(pass, params, fn);
    stria_device_t *dev = pass->head.dev;
    if (pass->head.impl != NULL)
        return dev->ops->attn_bwd_block(dev, pass->head.impl, params, k, v, dk, dv);
    const stria__bwd_io_t io = {&pass->q,    k,         v,  &pass->d_o, pass->lse,
                                pass->delta, &pass->dq, dk, dv};
    return dev->ops->attn_bwd(dev, params, &io);
}

stria_status_t stria_device_attn_bwd_end(stria_device_bwd_pass_t *pass, bool keep)
{
    stria_status_t st = STRIA_OK;
    if (pass == NULL)
        return STRIA_OK;
    if (pass->head.impl != NULL)
        st = pass->head.dev->ops->attn_bwd_end(pass->head.dev, pass->head.impl,
                                               keep ? &pass->dq : NULL);
    free(pass);
    return st;
}
