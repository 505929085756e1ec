#include "stria_util.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

double stria_time_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double stria_time_thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void *stria_malloc_aligned(size_t size)
{
    void *ptr = NULL;
    if (size == 0 || size > SIZE_MAX - 63)
        return NULL;
    /* Round up so that vector loops may read a whole cache line past the end. */
    size = (size + 63) & ~(size_t)63;
    if (posix_memalign(&ptr, 64, size) != 0)
        return NULL;
    return ptr;
}

void *stria_calloc_aligned(size_t size)
{
    void *ptr = stria_malloc_aligned(size);
    if (ptr != NULL)
        memset(ptr, 0, (size + 63) & ~(size_t)63);
    return ptr;
}

void stria_free(void *ptr)
{
    free(ptr);
}

void *stria_grow(void *arr, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return arr;
    size_t c = *cap ? *cap : first > 0 ? first : 1;
    while (c < need && c <= SIZE_MAX / 2)
        c *= 2;
    if (c < need || elem == 0 || c > SIZE_MAX / elem)
        return NULL; /* the size would not fit a size_t */
    void *grown = realloc(arr, c * elem);
    if (grown != NULL)
        *cap = c;
    return grown;
}

void stria_free_n(void *const *ptrs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        stria_free(ptrs[i]);
}

stria_status_t stria_random_bytes(void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom((char *)buf + got, n - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return stria_error_set(STRIA_ERR_IO, "getrandom: %s", strerror(errno));
        got += (size_t)r;
    }
    return STRIA_OK;
}

uint64_t stria_fnv64(uint64_t h, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xffu;
        h *= 1099511628211ull;
    }
    return h;
}
