/*
 * stria ranges: the bytes of a buffer that a transfer in chunks has covered
 * so far, so that a receiver (the worker's data paths) knows when a tensor
 * is complete whatever order its chunks come in.
 *
 * Ownership: a set owns its array of ranges (stria_ranges_free()).
 * Threads: a set is used by one thread at a time.
 */
#ifndef STRIA_RANGES_H
#define STRIA_RANGES_H

#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The bytes of a buffer that a transfer in chunks has covered so far, as
 * disjoint merged ranges [start, end). Chunks may arrive in any order and may
 * repeat: a byte is counted once however often it comes. Zero-initialise;
 * free with stria_ranges_free(). Not thread-safe. */
typedef struct {
    uint64_t (*r)[2]; /* sorted, disjoint, non-adjacent [start, end) */
    size_t n, cap;
    uint64_t covered; /* bytes in all ranges */
} stria_ranges_t;

/* Most ranges a set holds: a sender that scatters more disjoint pieces than
 * this is refused rather than allowed to grow the bookkeeping without bound
 * (senders of stria send in order, leaving one range). */
#define STRIA_RANGES_MAX 4096

/* Adds [start, start + len); len 0 adds nothing. Errors: STRIA_ERR_INVALID_ARG
 * (the range wraps around), STRIA_ERR_NO_MEMORY, STRIA_ERR_BUSY (more than
 * STRIA_RANGES_MAX disjoint ranges); the set is unchanged on error. */
stria_status_t stria_ranges_add(stria_ranges_t *set, uint64_t start, uint64_t len);
/* The first byte in [0, total) no range covers, or total if there is none. */
uint64_t stria_ranges_first_gap(const stria_ranges_t *set, uint64_t total);
void stria_ranges_free(stria_ranges_t *set);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_RANGES_H */
