/*
 * stria mempool: allocators and memory pools, for the ring engine's buffers,
 * the kernels' workspaces and the worker's host, pinned and device memory.
 *
 * Ownership: a pool owns what it reserved or mapped, handed out or not;
 * memory of stria_mempool_alloc() is the caller's until stria_mempool_free()
 * and goes with the pool at stria_mempool_destroy(). A source's ctx is
 * borrowed. Threads: a pool is thread-safe (see below); an allocator is as
 * thread-safe as what it stands for.
 */
#ifndef STRIA_MEMPOOL_H
#define STRIA_MEMPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An allocator hands out memory for a component that does not own where its
 * memory comes from (the ring engine's buffers, the kernels' workspaces, a
 * device's buffers): alloc returns NULL with the thread's error message set
 * when it cannot; free(NULL) does nothing. */
typedef struct {
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *ptr);
    void *ctx;
} stria_allocator_t;

/* A memory pool: memory a process reserves once, up to a capacity, and
 * keeps (a host pool: until stria_mempool_trim() gives back what recent
 * allocations did not reach), so that the buffers of one job are the pages
 * of the previous one (no page fault, no kernel page clearing) instead of
 * fresh mappings.
 *
 * Host pools reserve address space (twice the capacity, PROT_NONE, not
 * committed) and commit it as allocations first reach it; the pages are
 * faulted in by their first use, never at creation, and asked to be
 * transparent huge pages. A pool over a source (device memory, pinned host
 * memory) takes segments of at least source->segment_bytes from it when
 * nothing free fits, up to the capacity, and keeps them; it gives back only
 * segments with nothing in them, when a new one would pass the capacity.
 * Allocations are 64-byte aligned, those of 2 MiB and more 2 MiB aligned, and
 * are placed lowest address first, so the same sequence of allocations after
 * the same frees lands on the same memory. Memory handed out again is not
 * cleared.
 *
 * Two figures bound a pool: admissions (stria_mempool_admit(), what jobs
 * reserve in advance, at most the capacity) and allocations (at most the
 * capacity in use at once). Thread-safe. */
typedef struct stria_mempool stria_mempool_t;

typedef struct {
    /* A segment of `bytes`, suitably aligned for the memory's users. */
    stria_status_t (*map)(void *ctx, size_t bytes, void **out);
    void (*unmap)(void *ctx, void *ptr, size_t bytes);
    void *ctx;            /* borrowed: must outlive the pool */
    size_t segment_bytes; /* smallest segment; 0: 64 MiB */
} stria_mempool_source_t;

typedef struct {
    uint64_t capacity;   /* what the pool may hold */
    uint64_t admitted;   /* reserved by admissions */
    uint64_t in_use;     /* allocated now */
    uint64_t high_water; /* most allocated at once */
    uint64_t committed;  /* host: address space made usable; source: segments held */
} stria_mempool_stats_t;

/* name: for messages ("host", "device", "pinned"; copied). source NULL: host
 * memory of this process. Errors: STRIA_ERR_INVALID_ARG (capacity 0 or over
 * 2^46), STRIA_ERR_NO_MEMORY (no address space). */
stria_status_t stria_mempool_create(const char *name, uint64_t capacity,
                                    const stria_mempool_source_t *source,
                                    stria_mempool_t **pool_out);
/* Gives everything back; NULL is ignored. Allocations still out are lost. */
void stria_mempool_destroy(stria_mempool_t *pool);
const char *stria_mempool_name(const stria_mempool_t *pool);

/* Reserves `bytes` of the capacity for `what` (a job) or refuses with
 * STRIA_ERR_NO_MEMORY naming what, the need and the offer:
 * "<what> needs N MiB of the <name> pool, M MiB of C MiB are free". */
stria_status_t stria_mempool_admit(stria_mempool_t *pool, uint64_t bytes, const char *what);
/* Gives back an admission. */
void stria_mempool_retire(stria_mempool_t *pool, uint64_t bytes);

/* `bytes` (> 0) of the pool's memory. STRIA_ERR_NO_MEMORY when the capacity
 * is in use or no free range (address space, segment) fits. */
stria_status_t stria_mempool_alloc(stria_mempool_t *pool, size_t bytes, void **out);
/* Returns memory of stria_mempool_alloc(); NULL is ignored; a pointer the
 * pool did not hand out is logged and ignored. */
void stria_mempool_free(stria_mempool_t *pool, void *ptr);
/* Host pools: gives back to the system the committed memory above the
 * highest address allocations reached since the previous trim (or the pool's
 * creation), in whole huge pages; what is in use is never touched. Called
 * now and then (a worker: every minute), it bounds what a host pool keeps
 * resident by its recent peak instead of its peak over the process's life
 * (a rare burst of concurrent jobs, or jobs that left holes low in the pool,
 * would otherwise keep pages resident for good). The memory is committed
 * again (fresh pages) when allocations reach it. Returns the bytes given
 * back; 0 for a pool over a source and NULL. */
size_t stria_mempool_trim(stria_mempool_t *pool);
/* The pool as an allocator (valid while the pool lives). */
stria_allocator_t stria_mempool_allocator(stria_mempool_t *pool);
void stria_mempool_stats(stria_mempool_t *pool, stria_mempool_stats_t *out);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_MEMPOOL_H */
