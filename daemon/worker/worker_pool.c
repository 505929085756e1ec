/* The worker's memory pools: created at start with the capacity the worker
 * offers (--memory), kept for its life, and the only memory sessions use,
 * so that the regions, ring buffers and kernel workspaces of a session are
 * the pages of the sessions before it.
 *
 *   host    host memory (an address space reservation, committed on first
 *           use): on a host-visible device everything: the sessions'
 *           regions and padded tensors, the ring buffers and the kernels'
 *           workspaces; on a staged device the kernels' workspaces
 *           (cpu:staged);
 *   device  (staged devices) device memory in segments: the device copies
 *           of the tensors and the ring's device buffers;
 *   pinned  (staged devices) pinned host memory in segments, at most half
 *           of the host's memory: the sessions' regions the RPC layer fills
 *           and sends from, and the ring's message buffers.
 *
 * Admission reserves a session's memory (stria_session_rank_memory(), the
 * coordinator's figure) in the pools that hold it, so that a session that
 * does not fit is refused when it opens, never in the middle of a call. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "worker_int.h"

static void maps_expire(stria_worker_t *w, double before);

static stria_status_t seg_map(stria_device_t *dev, bool host, size_t bytes, void **out)
{
    return stria_device_alloc_raw(dev, host, bytes, out);
}

static stria_status_t dev_map(void *ctx, size_t bytes, void **out)
{
    return seg_map(ctx, false, bytes, out);
}

static void dev_unmap(void *ctx, void *ptr, size_t bytes)
{
    (void)bytes;
    stria_device_free_raw(ctx, false, ptr);
}

static stria_status_t pinned_map(void *ctx, size_t bytes, void **out)
{
    return seg_map(ctx, true, bytes, out);
}

static void pinned_unmap(void *ctx, void *ptr, size_t bytes)
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
    stria_mempool_source_t dsrc = {dev_map, dev_unmap, w->dev, 0};
    stria_mempool_source_t psrc = {pinned_map, pinned_unmap, w->dev, 0};
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
    maps_expire(w, INFINITY);
    stria_mempool_destroy(w->mem_pinned);
    stria_mempool_destroy(w->mem_dev);
    stria_mempool_destroy(w->mem_host);
    w->mem_pinned = w->mem_dev = w->mem_host = w->mem_jobs = NULL;
}

/* The pool whose figures the worker reports: where a session's memory is
 * bounded (the device's on a staged device). */
static stria_mempool_t *primary(const stria_worker_t *w)
{
    return w->mem_dev != NULL ? w->mem_dev : w->mem_host;
}

stria_status_t stria__wpool_admit(stria_worker_t *w, uint64_t id, uint64_t need)
{
    char what[64];
    snprintf(what, sizeof(what), "session %llu", (unsigned long long)id);
    stria_status_t st = stria_mempool_admit(w->mem_jobs, need, what);
    if (st != STRIA_OK)
        return st;
    if (w->mem_dev != NULL && (st = stria_mempool_admit(w->mem_dev, need, what)) != STRIA_OK) {
        stria_mempool_retire(w->mem_jobs, need);
        return st;
    }
    return STRIA_OK;
}

void stria__wpool_retire(stria_worker_t *w, uint64_t bytes)
{
    stria_mempool_retire(w->mem_jobs, bytes);
    if (w->mem_dev != NULL)
        stria_mempool_retire(w->mem_dev, bytes);
}

void stria__wpool_figures(stria_worker_t *w, stria_mempool_stats_t *out)
{
    stria_mempool_stats(primary(w), out);
}

stria_status_t stria__wpool_alloc(stria_worker_t *w, size_t bytes, void **out)
{
    return stria_mempool_alloc(w->mem_jobs, bytes, out);
}

void stria__wpool_free(stria_worker_t *w, void *p)
{
    stria_mempool_free(w->mem_jobs, p);
}

/* A session's own device object draws from the device and pinned pools. */
stria_status_t stria__wpool_device(stria_worker_t *w, stria_device_t *dev)
{
    return stria_device_set_memory(dev, &w->alloc_dev, &w->alloc_pinned);
}

/* ---- arena mappings ---------------------------------------------------------- */

stria_status_t stria__wpool_map(stria_worker_t *w, int fd, size_t size, stria__wmap_t *out)
{
    struct stat sb;
    memset(out, 0, sizeof(*out));
    if (fstat(fd, &sb) != 0)
        return stria_error_set(STRIA_ERR_IO, "cannot stat the arena: %m");
    out->size = size;
    out->dev = (uint64_t)sb.st_dev;
    out->ino = (uint64_t)sb.st_ino;
    /* the same memfd (a mapping holds its file: its inode is not reused
     * while the mapping lives) */
    pthread_mutex_lock(&w->maps_lock);
    for (int i = 0; i < w->n_maps; i++) {
        stria__wmap_t *m = &w->maps[i];
        if (m->dev == out->dev && m->ino == out->ino && m->size == size) {
            out->base = m->base;
            *m = w->maps[--w->n_maps];
            break;
        }
    }
    pthread_mutex_unlock(&w->maps_lock);
    if (out->base != NULL)
        return STRIA_OK;
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return stria_error_set(STRIA_ERR_IO, "cannot map the arena's %zu bytes: %m", size);
    out->base = base;
    return STRIA_OK;
}

/* Unmaps the kept mappings older than `before` (all: +inf). */
static void maps_expire(stria_worker_t *w, double before)
{
    stria__wmap_t gone[STRIA__MAPS_KEPT];
    int n = 0;
    pthread_mutex_lock(&w->maps_lock);
    for (int i = 0; i < w->n_maps;) {
        if (w->maps[i].kept_at < before) {
            gone[n++] = w->maps[i];
            w->maps[i] = w->maps[--w->n_maps];
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&w->maps_lock);
    for (int i = 0; i < n; i++)
        munmap(gone[i].base, gone[i].size);
}

void stria__wpool_unmap(stria_worker_t *w, stria__wmap_t *map)
{
    if (map->base == NULL)
        return;
    stria__wmap_t gone = {0};
    map->kept_at = stria_time_now();
    pthread_mutex_lock(&w->maps_lock);
    if (w->n_maps == STRIA__MAPS_KEPT) { /* the oldest goes */
        int old = 0;
        for (int i = 1; i < w->n_maps; i++)
            if (w->maps[i].kept_at < w->maps[old].kept_at)
                old = i;
        gone = w->maps[old];
        w->maps[old] = w->maps[--w->n_maps];
    }
    w->maps[w->n_maps++] = *map;
    pthread_mutex_unlock(&w->maps_lock);
    if (gone.base != NULL)
        munmap(gone.base, gone.size);
    memset(map, 0, sizeof(*map));
}

void stria__wpool_trim(stria_worker_t *w)
{
    double now = stria_time_now();
    maps_expire(w, now - STRIA__MAP_KEEP_S);
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
    stria_mempool_stats_t s;
    stria_mempool_stats(primary(w), &s);
    stria_metric_set(w->m_memory, (double)s.admitted);
}
