/* Memory pools (common/mempool.c): nothing committed at creation, the same
 * memory for the same allocations after frees, admission and capacity
 * refusals that name the need and the offer, huge-page alignment, segments
 * from a source kept and given back only when empty, host memory above the
 * recent reach given back by a trim. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "stria_common.h"

#define MiB ((size_t)1 << 20)

static stria_mempool_t *host_pool(uint64_t cap)
{
    stria_mempool_t *p = NULL;
    cr_assert_eq(stria_mempool_create("host", cap, NULL, &p), STRIA_OK, "%s", stria_error_msg());
    return p;
}

static void *take(stria_mempool_t *p, size_t n)
{
    void *ptr = NULL;
    cr_assert_eq(stria_mempool_alloc(p, n, &ptr), STRIA_OK, "%zu bytes: %s", n, stria_error_msg());
    cr_assert_not_null(ptr);
    memset(ptr, 0xa5, n); /* usable: committed and writable */
    return ptr;
}

Test(mempool, nothing_committed_until_used_and_memory_reused)
{
    stria_mempool_t *p = host_pool(256 * MiB);
    stria_mempool_stats_t s;
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.capacity, 256 * MiB);
    cr_expect_eq(s.committed, 0, "a new pool commits nothing (got %llu)",
                 (unsigned long long)s.committed);
    cr_expect_eq(s.in_use + s.high_water + s.admitted, 0);

    /* a "job": three tensors and a small buffer */
    void *a = take(p, 40 * MiB), *b = take(p, 3 * MiB + 5), *c = take(p, 100),
         *d = take(p, 9 * MiB);
    cr_expect_eq((uintptr_t)a % (2 * MiB), 0, "large blocks are huge-page aligned");
    cr_expect_eq((uintptr_t)b % (2 * MiB), 0);
    cr_expect_eq((uintptr_t)c % 64, 0);
    stria_mempool_stats(p, &s);
    uint64_t in_use = s.in_use, committed = s.committed;
    cr_expect_geq(in_use, 52 * MiB + 100);
    cr_expect_eq(s.high_water, in_use);
    cr_expect_geq(committed, in_use);
    cr_expect_leq(committed, in_use + 4 * MiB, "commits what is used (and a huge page more)");
    stria_mempool_free(p, b);
    stria_mempool_free(p, d);
    stria_mempool_free(p, a);
    stria_mempool_free(p, c);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.in_use, 0);
    cr_expect_eq(s.high_water, in_use);
    cr_expect_eq(s.committed, committed, "freed memory stays committed for the next job");

    /* the same job again: the same memory, nothing more committed */
    void *a2 = take(p, 40 * MiB), *b2 = take(p, 3 * MiB + 5), *c2 = take(p, 100);
    void *d2 = take(p, 9 * MiB);
    cr_expect_eq(a2, a);
    cr_expect_eq(b2, b);
    cr_expect_eq(c2, c);
    cr_expect_eq(d2, d);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, committed);
    cr_expect_eq(s.high_water, in_use);
    /* a hole is filled before the pool grows */
    stria_mempool_free(p, b2);
    void *e = take(p, 2 * MiB);
    cr_expect_eq(e, b2);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, committed);
    stria_mempool_free(p, e);
    stria_mempool_free(p, a2);
    stria_mempool_free(p, c2);
    stria_mempool_free(p, d2);
    /* everything merged back: the whole capacity fits at once */
    void *all = take(p, 256 * MiB);
    stria_mempool_free(p, all);
    stria_mempool_free(p, NULL);
    stria_mempool_destroy(p);
}

/* Resident pages of [p, p + n). */
static size_t resident_bytes(void *p, size_t n)
{
    long page = sysconf(_SC_PAGESIZE);
    size_t pages = (n + (size_t)page - 1) / (size_t)page, res = 0;
    unsigned char *vec = calloc(pages, 1);
    cr_assert_not_null(vec);
    cr_assert_eq(mincore(p, n, vec), 0);
    for (size_t i = 0; i < pages; i++)
        res += vec[i] & 1;
    free(vec);
    return res * (size_t)page;
}

Test(mempool, trim_gives_back_what_recent_allocations_did_not_reach)
{
    stria_mempool_t *p = host_pool(256 * MiB);
    stria_mempool_stats_t s;
    cr_expect_eq(stria_mempool_trim(p), 0, "nothing committed, nothing to give back");
    /* a job held for long, low in the pool, and a burst above it */
    unsigned char *low = take(p, 8 * MiB);
    unsigned char *burst = take(p, 24 * MiB);
    cr_expect_eq(burst, low + 8 * MiB);
    stria_mempool_free(p, burst);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, 32 * MiB);
    cr_expect_geq(resident_bytes(burst, 24 * MiB), 24 * MiB);
    /* the burst is recent: kept */
    cr_expect_eq(stria_mempool_trim(p), 0);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, 32 * MiB);
    /* no allocation reached it since: given back, the job in use untouched */
    cr_expect_eq(stria_mempool_trim(p), 24 * MiB);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, 8 * MiB);
    cr_expect_eq(s.in_use, 8 * MiB);
    cr_expect_eq(resident_bytes(burst, 24 * MiB), 0, "the pages went back to the system");
    for (size_t i = 0; i < 8 * MiB; i += 4096)
        cr_assert_eq(low[i], 0xa5, "memory in use kept its contents");
    /* the next burst lands on the same addresses, committed again */
    unsigned char *again = take(p, 24 * MiB);
    cr_expect_eq(again, burst);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, 32 * MiB);
    stria_mempool_free(p, again);
    stria_mempool_free(p, low);
    cr_expect_eq(stria_mempool_trim(p), 0, "reached since the last trim: kept");
    cr_expect_eq(stria_mempool_trim(p), 32 * MiB, "nothing in use, nothing reached: all back");
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, 0);
    cr_expect_eq(s.high_water, 32 * MiB, "the high water is history, not what is kept");
    /* the whole capacity still fits */
    void *all = take(p, 256 * MiB);
    stria_mempool_free(p, all);
    cr_expect_eq(stria_mempool_trim(NULL), 0);
    stria_mempool_destroy(p);
}

Test(mempool, admission_and_capacity_refusals_name_need_and_offer)
{
    stria_mempool_t *p = host_pool(100 * MiB);
    cr_assert_eq(stria_mempool_admit(p, 60 * MiB, "job 1"), STRIA_OK);
    cr_expect_eq(stria_mempool_admit(p, 50 * MiB, "job 2"), STRIA_ERR_NO_MEMORY);
    cr_expect_str_eq(stria_error_msg(),
                     "job 2 needs 50 MiB of the host pool, 40 MiB of 100 MiB are free");
    cr_assert_eq(stria_mempool_admit(p, 40 * MiB, "job 3"), STRIA_OK);
    stria_mempool_stats_t s;
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.admitted, 100 * MiB);
    cr_expect_eq(s.committed, 0, "admission commits nothing");
    stria_mempool_retire(p, 60 * MiB);
    cr_expect_eq(stria_mempool_admit(p, 50 * MiB, "job 2"), STRIA_OK);
    stria_mempool_retire(p, 90 * MiB);
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.admitted, 0);

    /* allocations: at most the capacity in use at once */
    void *a = take(p, 70 * MiB), *x = NULL;
    cr_expect_eq(stria_mempool_alloc(p, 40 * MiB, &x), STRIA_ERR_NO_MEMORY);
    cr_expect(strstr(stria_error_msg(), "host pool: 40 MiB asked, 70 MiB of 100 MiB are in use") !=
                  NULL,
              "%s", stria_error_msg());
    cr_expect_null(x);
    cr_expect_eq(stria_mempool_alloc(p, 0, &x), STRIA_ERR_INVALID_ARG);
    stria_mempool_free(p, a);
    stria_mempool_destroy(p);

    cr_expect_eq(stria_mempool_create("host", 0, NULL, &p), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "capacity 0") != NULL, "%s", stria_error_msg());
}

/* A source of "device" memory: malloc, counted. */
typedef struct {
    int maps, unmaps;
    size_t held;
} src_t;

static stria_status_t src_map(void *ctx, size_t bytes, void **out)
{
    src_t *s = ctx;
    if ((*out = aligned_alloc(256, (bytes + 255) / 256 * 256)) == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "no memory");
    s->maps++;
    s->held += bytes;
    return STRIA_OK;
}

static void src_unmap(void *ctx, void *ptr, size_t bytes)
{
    src_t *s = ctx;
    s->unmaps++;
    s->held -= bytes;
    free(ptr);
}

Test(mempool, segments_from_a_source_are_kept_and_reused)
{
    src_t src = {0};
    stria_mempool_source_t so = {src_map, src_unmap, &src, 8 * MiB};
    stria_mempool_t *p = NULL;
    cr_assert_eq(stria_mempool_create("device", 64 * MiB, &so, &p), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(src.maps, 0, "nothing taken at creation");
    void *a = take(p, 1 * MiB), *b = take(p, 2 * MiB), *c = take(p, 20 * MiB);
    cr_expect_eq(src.maps, 2, "small blocks share a segment, a large one gets its own");
    cr_expect_eq((uintptr_t)a % 256, 0);
    stria_mempool_stats_t s;
    stria_mempool_stats(p, &s);
    cr_expect_eq(s.committed, src.held);
    stria_mempool_free(p, a);
    stria_mempool_free(p, b);
    stria_mempool_free(p, c);
    cr_expect_eq(src.unmaps, 0, "segments are kept");
    void *c2 = take(p, 20 * MiB), *a2 = take(p, 1 * MiB);
    cr_expect_eq(c2, c);
    cr_expect_eq(a2, a);
    cr_expect_eq(src.maps, 2);
    stria_mempool_free(p, c2);
    stria_mempool_free(p, a2);
    /* no room for another segment within the capacity: empty ones go back */
    void *big = take(p, 50 * MiB);
    cr_expect_geq(src.unmaps, 1);
    stria_mempool_stats(p, &s);
    cr_expect_leq(s.committed, 64 * MiB);
    cr_expect_eq(s.committed, src.held);
    stria_mempool_free(p, big);
    cr_expect_eq(stria_mempool_trim(p), 0, "a trim leaves a source's segments alone");
    cr_expect_eq(src.held, s.committed);
    stria_mempool_destroy(p);
    cr_expect_eq(src.held, 0, "destroy gives every segment back");
}
