/*
 * stria util: clocks, 64-byte aligned allocation, arrays that grow, a
 * digest of fields, and random bytes from the kernel.
 *
 * Ownership: memory from stria_malloc_aligned() and stria_calloc_aligned(),
 * and the arrays stria_grow() reallocates, belong to the caller, who frees
 * them with stria_free(). Threads: no state of its own; every function may be
 * called from any thread.
 */
#ifndef STRIA_UTIL_H
#define STRIA_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- clocks ------------------------------------------------------------ */

/* Monotonic wall clock in seconds. */
double stria_time_now(void);
/* CPU time consumed by the calling thread, in seconds. */
double stria_time_thread_cpu(void);

/* ---- allocation -------------------------------------------------------- */

/* 64-byte aligned allocation; size 0 returns NULL. Free with stria_free(). */
void *stria_malloc_aligned(size_t size);
/* As stria_malloc_aligned() but zero-filled. */
void *stria_calloc_aligned(size_t size);
void stria_free(void *ptr);
/* Room for `need` elements of `elem` bytes in the array `arr` of capacity
 * *cap (first growth to `first` elements, then doubling, realloc()ed):
 * returns arr when it has room, the grown array (*cap updated), or NULL when
 * out of memory (arr and *cap unchanged). */
void *stria_grow(void *arr, size_t *cap, size_t need, size_t elem, size_t first);
/* stria_free() of each of n pointers; STRIA_FREE_ALL(d->q, d->k, d->v) for a
 * list of them. */
void stria_free_n(void *const *ptrs, size_t n);
#define STRIA_FREE_ALL(...)                                                                        \
    stria_free_n((void *const[]){__VA_ARGS__},                                                     \
                 sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))

/* ---- digests ----------------------------------------------------------- */

/* FNV-1a, 64 bits, of v's 8 bytes (little-endian) after h: fields hashed in
 * a fixed order and width give the same digest on every host. Start from
 * STRIA_FNV64_INIT. Not a MAC: for comparing records, never for secrets. */
#define STRIA_FNV64_INIT 14695981039346656037ull
uint64_t stria_fnv64(uint64_t h, uint64_t v);

/* Fills buf with n bytes from the kernel's random source (getrandom()):
 * unguessable values such as a job's secret. STRIA_ERR_IO when the source
 * fails. */
stria_status_t stria_random_bytes(void *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_UTIL_H */
