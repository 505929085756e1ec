/* Memory pools: memory reserved once and kept, handed out lowest address
 * first. See stria_mempool.h.
 *
 * The pool keeps an array of blocks sorted by (region, offset): used and free
 * ranges that together cover every region. A host pool has one region, its
 * address space reservation, of which [0, commit) is usable; a pool over a
 * source has one region per segment. Jobs make a few tens of allocations, so
 * linear scans of the array are cheap next to what the memory is used for. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "stria_mempool.h"
#include "stria_log.h"
#include "stria_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define STRIA__MP_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRIA__MP_ASAN 1
#endif
#endif
#ifdef STRIA__MP_ASAN
#include <sanitizer/asan_interface.h>
#define STRIA__MP_POISON(p, n)   ASAN_POISON_MEMORY_REGION((p), (n))
#define STRIA__MP_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define STRIA__MP_POISON(p, n)   ((void)(p), (void)(n))
#define STRIA__MP_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define STRIA__MP_HUGE       ((size_t)2 << 20)  /* huge page: alignment of large blocks */
#define STRIA__MP_SEGMENT    ((size_t)64 << 20) /* default smallest segment */
#define STRIA__MP_MAX_CAP    ((uint64_t)1 << 44)
#define STRIA__MP_SRC_ALIGN  ((size_t)256) /* what device allocations guarantee */
#define STRIA__MP_HOST_ALIGN ((size_t)64)

typedef struct {
    char *base; /* NULL: a slot of a segment given back */
    size_t size;
} stria__mp_region_t;

typedef struct {
    uint32_t region;
    bool used;
    size_t off, size;
} stria__mp_block_t;

struct stria_mempool {
    pthread_mutex_t lock;
    char name[32];
    uint64_t capacity;
    bool host;
    stria_mempool_source_t src;
    void *map_base; /* host: the whole reservation, for munmap */
    size_t map_len;
    size_t commit; /* host: bytes of region 0 usable from its start */
    size_t reach;  /* host: the highest end allocations reached since the last trim */
    stria__mp_region_t *regions;
    size_t n_regions, cap_regions;
    stria__mp_block_t *blocks;
    size_t n_blocks, cap_blocks;
    uint64_t admitted, in_use, high_water, committed;
};

static size_t stria__mp_round(size_t x, size_t to)
{
    return (x + to - 1) / to * to;
}

static stria_status_t stria__mp_reserve_blocks(stria_mempool_t *p, size_t more)
{
    stria__mp_block_t *b =
        stria_grow(p->blocks, &p->cap_blocks, p->n_blocks + more, sizeof(*b), 64);
    if (b == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s pool: out of memory for its block table",
                               p->name);
    p->blocks = b;
    return STRIA_OK;
}

/* Adds a region (and its one free block); returns its index or -1. */
static long stria__mp_add_region(stria_mempool_t *p, char *base, size_t size)
{
    size_t r = p->n_regions;
    for (size_t i = 0; i < p->n_regions; i++)
        if (p->regions[i].base == NULL) {
            r = i;
            break;
        }
    if (r == p->n_regions) {
        stria__mp_region_t *g =
            stria_grow(p->regions, &p->cap_regions, p->n_regions + 1, sizeof(*g), 8);
        if (g == NULL)
            return -1;
        p->regions = g;
    }
    if (stria__mp_reserve_blocks(p, 1) != STRIA_OK)
        return -1;
    if (r == p->n_regions)
        p->n_regions++;
    p->regions[r].base = base;
    p->regions[r].size = size;
    /* keep the blocks sorted by region */
    size_t at = 0;
    while (at < p->n_blocks && p->blocks[at].region < r)
        at++;
    memmove(&p->blocks[at + 1], &p->blocks[at], (p->n_blocks - at) * sizeof(*p->blocks));
    p->blocks[at] =
        (stria__mp_block_t){.region = (uint32_t)r, .used = false, .off = 0, .size = size};
    p->n_blocks++;
    return (long)r;
}

stria_status_t stria_mempool_create(const char *name, uint64_t capacity,
                                    const stria_mempool_source_t *source,
                                    stria_mempool_t **pool_out)
{
    if (pool_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_mempool_create: pool_out is NULL");
    if (capacity == 0 || capacity > STRIA__MP_MAX_CAP)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s pool: capacity %llu bytes is not in 1..2^44",
                               name ? name : "memory", (unsigned long long)capacity);
    if (source != NULL && (source->map == NULL || source->unmap == NULL))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s pool: a source needs map and unmap",
                               name ? name : "memory");
    stria_mempool_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate a memory pool");
    pthread_mutex_init(&p->lock, NULL);
    snprintf(p->name, sizeof(p->name), "%s", name ? name : "memory");
    p->capacity = capacity;
    p->host = source == NULL;
    if (source != NULL) {
        p->src = *source;
        if (p->src.segment_bytes == 0)
            p->src.segment_bytes = STRIA__MP_SEGMENT;
        *pool_out = p;
        return STRIA_OK;
    }
    /* Twice the capacity of address space, so that fragmentation never
     * refuses what the capacity allows; PROT_NONE costs no commit charge. */
    size_t va = stria__mp_round((size_t)capacity, STRIA__MP_HUGE) * 2;
    p->map_len = va + STRIA__MP_HUGE;
    p->map_base =
        mmap(NULL, p->map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p->map_base == MAP_FAILED) {
        int e = errno;
        pthread_mutex_destroy(&p->lock);
        free(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY,
                               "%s pool: cannot reserve %llu MiB of address space: %s",
                               name ? name : "memory", (unsigned long long)(va >> 20), strerror(e));
    }
    char *base = (char *)stria__mp_round((size_t)(uintptr_t)p->map_base, STRIA__MP_HUGE);
#ifdef MADV_HUGEPAGE
    (void)madvise(base, va, MADV_HUGEPAGE); /* advisory: ignore failure */
#endif
    if (stria__mp_add_region(p, base, va) < 0) {
        stria_mempool_destroy(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate a memory pool");
    }
    *pool_out = p;
    return STRIA_OK;
}

void stria_mempool_destroy(stria_mempool_t *pool)
{
    if (pool == NULL)
        return;
    if (pool->host) {
        if (pool->map_base != NULL && pool->map_base != MAP_FAILED) {
            STRIA__MP_UNPOISON(pool->regions ? pool->regions[0].base : NULL, pool->commit);
            munmap(pool->map_base, pool->map_len);
        }
    } else {
        for (size_t i = 0; i < pool->n_regions; i++)
            if (pool->regions[i].base != NULL)
                pool->src.unmap(pool->src.ctx, pool->regions[i].base, pool->regions[i].size);
    }
    free(pool->regions);
    free(pool->blocks);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

const char *stria_mempool_name(const stria_mempool_t *pool)
{
    return pool ? pool->name : "";
}

stria_status_t stria_mempool_admit(stria_mempool_t *pool, uint64_t bytes, const char *what)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t free_bytes = pool->capacity - pool->admitted;
    if (bytes > free_bytes) {
        pthread_mutex_unlock(&pool->lock);
        return stria_error_set(
            STRIA_ERR_NO_MEMORY, "%s needs %llu MiB of the %s pool, %llu MiB of %llu MiB are free",
            what ? what : "an admission", (unsigned long long)((bytes + (1u << 20) - 1) >> 20),
            pool->name, (unsigned long long)(free_bytes >> 20),
            (unsigned long long)(pool->capacity >> 20));
    }
    pool->admitted += bytes;
    pthread_mutex_unlock(&pool->lock);
    return STRIA_OK;
}

void stria_mempool_retire(stria_mempool_t *pool, uint64_t bytes)
{
    pthread_mutex_lock(&pool->lock);
    pool->admitted -= bytes <= pool->admitted ? bytes : pool->admitted;
    pthread_mutex_unlock(&pool->lock);
}

/* Makes region 0 of a host pool usable up to `end` bytes. Lock held. */
static stria_status_t stria__mp_commit(stria_mempool_t *p, size_t end)
{
    if (end <= p->commit)
        return STRIA_OK;
    size_t to = stria__mp_round(end, STRIA__MP_HUGE);
    if (to > p->regions[0].size)
        to = p->regions[0].size;
    if (mprotect(p->regions[0].base + p->commit, to - p->commit, PROT_READ | PROT_WRITE) != 0)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s pool: cannot commit %zu MiB more: %s",
                               p->name, (to - p->commit) >> 20, strerror(errno));
    /* never handed out yet: poisoned until allocated */
    STRIA__MP_POISON(p->regions[0].base + p->commit, to - p->commit);
    p->committed += to - p->commit;
    p->commit = to;
    return STRIA_OK;
}

/* Splits free block i so that [start, start + size) of its region is used;
 * returns the used block's index, or -1. Lock held. */
static long stria__mp_take(stria_mempool_t *p, size_t i, size_t start, size_t size)
{
    stria__mp_block_t b = p->blocks[i];
    size_t front = start - b.off, tail = b.off + b.size - (start + size);
    size_t extra = (front > 0) + (tail > 0);
    if (stria__mp_reserve_blocks(p, extra) != STRIA_OK)
        return -1;
    memmove(&p->blocks[i + 1 + extra], &p->blocks[i + 1],
            (p->n_blocks - i - 1) * sizeof(*p->blocks));
    p->n_blocks += extra;
    size_t at = i;
    if (front > 0)
        p->blocks[at++] = (stria__mp_block_t){b.region, false, b.off, front};
    size_t used = at;
    p->blocks[at++] = (stria__mp_block_t){b.region, true, start, size};
    if (tail > 0)
        p->blocks[at] = (stria__mp_block_t){b.region, false, start + size, tail};
    return (long)used;
}

/* The first free block (in address order) with room for size at align;
 * -1 when none. Lock held. */
static long stria__mp_find(const stria_mempool_t *p, size_t size, size_t align, size_t *start_out)
{
    for (size_t i = 0; i < p->n_blocks; i++) {
        const stria__mp_block_t *b = &p->blocks[i];
        if (b->used || b->size < size)
            continue;
        uintptr_t base = (uintptr_t)p->regions[b->region].base;
        size_t start = (size_t)(stria__mp_round(base + b->off, align) - base);
        if (start + size <= b->off + b->size) {
            *start_out = start;
            return (long)i;
        }
    }
    return -1;
}

/* Gives back the segments nothing uses. Lock held. */
static void stria__mp_unmap_empty(stria_mempool_t *p)
{
    for (size_t i = 0; i < p->n_blocks;) {
        stria__mp_block_t *b = &p->blocks[i];
        stria__mp_region_t *r = &p->regions[b->region];
        if (b->used || b->off != 0 || b->size != r->size) {
            i++;
            continue;
        }
        p->src.unmap(p->src.ctx, r->base, r->size);
        p->committed -= r->size;
        r->base = NULL;
        r->size = 0;
        memmove(&p->blocks[i], &p->blocks[i + 1], (p->n_blocks - i - 1) * sizeof(*p->blocks));
        p->n_blocks--;
    }
}

/* A new segment with room for `size`, within the capacity. Lock held. */
static stria_status_t stria__mp_grow(stria_mempool_t *p, size_t size)
{
    size_t seg =
        size > p->src.segment_bytes ? stria__mp_round(size, STRIA__MP_HUGE) : p->src.segment_bytes;
    if (p->committed + seg > p->capacity) {
        stria__mp_unmap_empty(p);
        if (p->committed + seg > p->capacity)
            seg = stria__mp_round(size, STRIA__MP_SRC_ALIGN);
        if (p->committed + seg > p->capacity)
            return stria_error_set(STRIA_ERR_NO_MEMORY,
                                   "%s pool: no free range of %zu MiB in its %llu MiB of "
                                   "segments, and no room for another within %llu MiB",
                                   p->name, size >> 20, (unsigned long long)(p->committed >> 20),
                                   (unsigned long long)(p->capacity >> 20));
    }
    void *mem = NULL;
    stria_status_t st = p->src.map(p->src.ctx, seg, &mem);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "%s pool: a %zu MiB segment", p->name, seg >> 20);
    if (stria__mp_add_region(p, mem, seg) < 0) {
        p->src.unmap(p->src.ctx, mem, seg);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s pool: out of memory for its tables",
                               p->name);
    }
    p->committed += seg;
    return STRIA_OK;
}

stria_status_t stria_mempool_alloc(stria_mempool_t *pool, size_t bytes, void **out)
{
    stria_mempool_t *p = pool;
    if (p == NULL || out == NULL || bytes == 0 || bytes > STRIA__MP_MAX_CAP)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_mempool_alloc: %zu bytes from %s",
                               bytes, p ? p->name : "no pool");
    size_t align = p->host ? STRIA__MP_HOST_ALIGN : STRIA__MP_SRC_ALIGN;
    size_t size = stria__mp_round(bytes, align);
    if (p->host && size >= STRIA__MP_HUGE) {
        align = STRIA__MP_HUGE;
        size = stria__mp_round(size, STRIA__MP_HUGE);
    }
    stria_status_t st;
    pthread_mutex_lock(&p->lock);
    if (p->in_use + size > p->capacity) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY,
                             "%s pool: %zu MiB asked, %llu MiB of %llu MiB are in use", p->name,
                             (size + (1u << 20) - 1) >> 20, (unsigned long long)(p->in_use >> 20),
                             (unsigned long long)(p->capacity >> 20));
        goto out;
    }
    size_t start = 0;
    long i = stria__mp_find(p, size, align, &start);
    if (i < 0 && !p->host) {
        if ((st = stria__mp_grow(p, size)) != STRIA_OK)
            goto out;
        i = stria__mp_find(p, size, align, &start);
    }
    if (i < 0) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY,
                             "%s pool: no free range of %zu MiB (%llu MiB of %llu MiB in use)",
                             p->name, size >> 20, (unsigned long long)(p->in_use >> 20),
                             (unsigned long long)(p->capacity >> 20));
        goto out;
    }
    if (p->host && (st = stria__mp_commit(p, start + size)) != STRIA_OK)
        goto out;
    long u = stria__mp_take(p, (size_t)i, start, size);
    if (u < 0) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "%s pool: out of memory for its block table",
                             p->name);
        goto out;
    }
    char *ptr = p->regions[p->blocks[u].region].base + start;
    if (p->host) {
        STRIA__MP_UNPOISON(ptr, size);
        if (start + size > p->reach)
            p->reach = start + size;
    }
    p->in_use += size;
    if (p->in_use > p->high_water)
        p->high_water = p->in_use;
    *out = ptr;
    st = STRIA_OK;
out:
    pthread_mutex_unlock(&p->lock);
    return st;
}

void stria_mempool_free(stria_mempool_t *pool, void *ptr)
{
    if (pool == NULL || ptr == NULL)
        return;
    stria_mempool_t *p = pool;
    pthread_mutex_lock(&p->lock);
    size_t i = 0;
    for (; i < p->n_blocks; i++) {
        stria__mp_block_t *b = &p->blocks[i];
        if (b->used && p->regions[b->region].base + b->off == (char *)ptr)
            break;
    }
    if (i == p->n_blocks) {
        pthread_mutex_unlock(&p->lock);
        stria_log_error("%s pool: %p was not handed out by it (ignored)", p->name, ptr);
        return;
    }
    stria__mp_block_t *b = &p->blocks[i];
    b->used = false;
    p->in_use -= b->size;
    if (p->host)
        STRIA__MP_POISON(ptr, b->size);
    /* merge with the free neighbours of the same region */
    if (i + 1 < p->n_blocks && !p->blocks[i + 1].used && p->blocks[i + 1].region == b->region) {
        b->size += p->blocks[i + 1].size;
        memmove(&p->blocks[i + 1], &p->blocks[i + 2], (p->n_blocks - i - 2) * sizeof(*b));
        p->n_blocks--;
    }
    if (i > 0 && !p->blocks[i - 1].used && p->blocks[i - 1].region == b->region) {
        p->blocks[i - 1].size += b->size;
        memmove(&p->blocks[i], &p->blocks[i + 1], (p->n_blocks - i - 1) * sizeof(*b));
        p->n_blocks--;
    }
    pthread_mutex_unlock(&p->lock);
}

size_t stria_mempool_trim(stria_mempool_t *pool)
{
    if (pool == NULL || !pool->host)
        return 0;
    stria_mempool_t *p = pool;
    pthread_mutex_lock(&p->lock);
    /* the end of the highest block in use (blocks are in address order) */
    size_t used_end = 0;
    for (size_t i = p->n_blocks; i-- > 0;)
        if (p->blocks[i].used) {
            used_end = p->blocks[i].off + p->blocks[i].size;
            break;
        }
    size_t keep = stria__mp_round(p->reach > used_end ? p->reach : used_end, STRIA__MP_HUGE);
    size_t given = 0;
    if (keep < p->commit) {
        char *from = p->regions[0].base + keep;
        size_t len = p->commit - keep;
        /* free, so poisoned already; the pages go back to the system (huge
         * pages whole: both ends are huge-page aligned), and the range is
         * PROT_NONE again, as never committed */
        if (madvise(from, len, MADV_DONTNEED) == 0 && mprotect(from, len, PROT_NONE) == 0) {
            p->committed -= len;
            p->commit = keep;
            given = len;
        } else {
            (void)mprotect(from, len, PROT_READ | PROT_WRITE); /* stays committed */
        }
    }
    p->reach = used_end;
    pthread_mutex_unlock(&p->lock);
    return given;
}

static void *stria__mp_alloc_cb(void *ctx, size_t bytes)
{
    void *ptr = NULL;
    return stria_mempool_alloc(ctx, bytes, &ptr) == STRIA_OK ? ptr : NULL;
}

static void stria__mp_free_cb(void *ctx, void *ptr)
{
    stria_mempool_free(ctx, ptr);
}

stria_allocator_t stria_mempool_allocator(stria_mempool_t *pool)
{
    stria_allocator_t a = {stria__mp_alloc_cb, stria__mp_free_cb, pool};
    return a;
}

void stria_mempool_stats(stria_mempool_t *pool, stria_mempool_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    if (pool == NULL)
        return;
    pthread_mutex_lock(&pool->lock);
    out->capacity = pool->capacity;
    out->admitted = pool->admitted;
    out->in_use = pool->in_use;
    out->high_water = pool->high_water;
    out->committed = pool->committed;
    pthread_mutex_unlock(&pool->lock);
}
