/* The worker's memory pools: created at start with the capacity the worker
 * offers (--memory), kept for its life, and the only memory jobs use, so
 * that the tensors, ring buffers and kernel workspaces of a job are the
 * pages of the jobs before it.
 *
 *   host    host memory (an address space reservation, committed on first
 *           use): on a host-visible device everything: the job tensors, the
 *           ring buffers and the kernels' workspaces; on a staged device the
 *           kernels' workspaces (cpu:staged) and transfer staging;
 *   device  (staged devices) device memory in segments: the device copies
 *           of the tensors and the ring's device buffers;
 *   pinned  (staged devices) pinned host memory in segments, at most half
 *           of the host's memory: the job tensors the RPC layer fills and
 *           sends from, and the ring's message buffers.
 *
 * Admission reserves a job's memory (stria_rank_memory(), the coordinator's
 * figure) in the pools that hold it, so that a job that does not fit is
 * refused when it arrives, never in the middle of a pass. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker_int.h"

static stria_status_t stria__seg_map(stria_device_t *dev, bool host, size_t bytes, void **out)
{
    return stria_device_alloc_raw(dev, host, bytes, out);
}

static stria_status_t stria__dev_map(void *ctx, size_t bytes, void **out)
{
    return stria__seg_map(ctx, false, bytes, out);
}

static void stria__dev_unmap(void *ctx, void *ptr, size_t bytes)
{
    (void)bytes;
    stria_device_free_raw(ctx, false, ptr);
}

static stria_status_t stria__pinned_map(void *ctx, size_t bytes, void **out)
{
    return stria__seg_map(ctx, true, bytes, out);
}

static void stria__pinned_unmap(void *ctx, void *ptr, size_t bytes)
{
    (void)bytes;
    stria_device_free_raw(ctx, true, ptr);
}

stria_status_t stria__wpool_start(stria_worker_t *w)
{
    stria_status_t st;
    uint64_t cap = (uint64_t)w->memory_bytes;
    if ((st = stria_mempool_create("host", cap, NULL, &w->mem_host)) != STRIA_OK)
        return st;
    w->alloc_host = stria_mempool_allocator(w->mem_host);
    w->mem_jobs = w->mem_host;
    if (!w->dev_staged)
        return STRIA_OK;
    stria_mempool_source_t dsrc = {stria__dev_map, stria__dev_unmap, w->dev, 0};
    stria_mempool_source_t psrc = {stria__pinned_map, stria__pinned_unmap, w->dev, 0};
    /* Pinned memory is locked host memory: at most half of it, whatever
     * the device offers. */
    uint64_t pinned_cap = cap;
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psize > 0 && (uint64_t)pages * (uint64_t)psize / 2 < pinned_cap)
        pinned_cap = (uint64_t)pages * (uint64_t)psize / 2;
    if ((st = stria_mempool_create("device", cap, &dsrc, &w->mem_dev)) != STRIA_OK ||
        (st = stria_mempool_create("pinned", pinned_cap, &psrc, &w->mem_pinned)) != STRIA_OK)
        return st;
    w->alloc_dev = stria_mempool_allocator(w->mem_dev);
    w->alloc_pinned = stria_mempool_allocator(w->mem_pinned);
    w->mem_jobs = w->mem_pinned;
    return STRIA_OK;
}

void stria__wpool_stop(stria_worker_t *w)
{
    stria_mempool_destroy(w->mem_pinned);
    stria_mempool_destroy(w->mem_dev);
    stria_mempool_destroy(w->mem_host);
    w->mem_pinned = w->mem_dev = w->mem_host = w->mem_jobs = NULL;
}

/* The pool whose figures the worker reports: where a job's memory is
 * bounded (the device's on a staged device). */
static stria_mempool_t *stria__primary(const stria_worker_t *w)
{
    return w->mem_dev != NULL ? w->mem_dev : w->mem_host;
}

stria_status_t stria__wpool_admit(stria_worker_t *w, stria__wjob_t *j, uint64_t need)
{
    char what[64];
    snprintf(what, sizeof(what), "job %llu", (unsigned long long)j->id);
    stria_status_t st = stria_mempool_admit(w->mem_jobs, need, what);
    if (st != STRIA_OK)
        return st;
    if (w->mem_dev != NULL && (st = stria_mempool_admit(w->mem_dev, need, what)) != STRIA_OK) {
        stria_mempool_retire(w->mem_jobs, need);
        return st;
    }
    j->bytes = need;
    return STRIA_OK;
}

void stria__wpool_retire(stria_worker_t *w, stria__wjob_t *j)
{
    stria_mempool_retire(w->mem_jobs, j->bytes);
    if (w->mem_dev != NULL)
        stria_mempool_retire(w->mem_dev, j->bytes);
    j->bytes = 0;
}

uint64_t stria__wpool_admitted(stria_worker_t *w)
{
    stria_mempool_stats_t s;
    stria_mempool_stats(stria__primary(w), &s);
    return s.admitted;
}

void stria__wpool_figures(stria_worker_t *w, stria_mempool_stats_t *out)
{
    stria_mempool_stats(stria__primary(w), out);
}

/* Zeroes the padded rows of a tensor (pool memory is handed out as the last
 * job left it; the engine never reads them, but no job's bytes should reach
 * another's ring). */
static void stria__zero_padding(const stria__wjob_t *j, int t)
{
    int64_t outer;
    size_t row;
    stria__wjob_geometry(j, t, &outer, &row);
    size_t real = (size_t)j->valid * row, padded = (size_t)j->layout.shard_tokens * row;
    if (real == padded)
        return;
    for (int64_t o = 0; o < outer; o++)
        memset((char *)j->buf[t] + (size_t)o * padded + real, 0, padded - real);
}

stria_status_t stria__wpool_tensors(stria_worker_t *w, stria__wjob_t *j)
{
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        int64_t outer;
        size_t row;
        stria__wjob_geometry(j, t, &outer, &row);
        size_t bytes = (size_t)outer * (size_t)j->layout.shard_tokens * row;
        stria_status_t st = stria_mempool_alloc(w->mem_jobs, bytes, &j->buf[t]);
        if (st != STRIA_OK)
            return stria_error_wrap(st, "job %llu: its tensors", (unsigned long long)j->id);
        if (t == STRIA__T_Q || t == STRIA__T_K || t == STRIA__T_V || t == STRIA__T_DO)
            stria__zero_padding(j, t);
    }
    return STRIA_OK;
}

void stria__wpool_tensors_free(stria_worker_t *w, stria__wjob_t *j)
{
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        stria_mempool_free(w->mem_jobs, j->buf[t]);
        j->buf[t] = NULL;
    }
}

/* A job's own device object draws from the device and pinned pools. */
stria_status_t stria__wpool_device(stria_worker_t *w, stria_device_t *dev)
{
    return stria_device_set_memory(dev, &w->alloc_dev, &w->alloc_pinned);
}

/* Staging for a transfer whose bytes are not contiguous in the tensors. */
void *stria__wpool_scratch(stria_worker_t *w, size_t bytes)
{
    void *p = NULL;
    return stria_mempool_alloc(w->mem_host, bytes, &p) == STRIA_OK ? p : NULL;
}

void stria__wpool_scratch_free(stria_worker_t *w, void *p)
{
    stria_mempool_free(w->mem_host, p);
}

void stria__wpool_trim(stria_worker_t *w)
{
    double now = stria_time_now();
    if (now < w->pool_trim_at)
        return;
    w->pool_trim_at = now + STRIA__POOL_TRIM_S;
    size_t given = stria_mempool_trim(w->mem_host);
    if (given > 0) {
        stria_log_debug("host pool: %zu KiB above the last minute's reach given back", given >> 10);
        stria__wpool_publish(w);
    }
}

void stria__wpool_publish(stria_worker_t *w)
{
    stria_mempool_t *pools[3] = {w->mem_host, w->mem_dev, w->mem_pinned};
    for (int i = 0; i < 3; i++) {
        stria_mempool_stats_t s;
        if (pools[i] == NULL || w->m_pool[i][0] == NULL)
            continue;
        stria_mempool_stats(pools[i], &s);
        stria_metric_set(w->m_pool[i][0], (double)s.capacity);
        stria_metric_set(w->m_pool[i][1], (double)s.in_use);
        stria_metric_set(w->m_pool[i][2], (double)s.high_water);
        stria_metric_set(w->m_pool[i][3], (double)s.committed);
    }
    stria_metric_set(w->m_memory, (double)stria__wpool_admitted(w));
}
