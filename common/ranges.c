/* Covered byte ranges of a chunked transfer (stria_ranges.h). */
#include <stdlib.h>
#include <string.h>

#include "stria_ranges.h"
#include "stria_util.h"

/* Index of the first range whose end reaches `start` (ranges that touch or
 * overlap [start, ...) begin there), by binary search. */
static size_t stria__ranges_lower(const stria_ranges_t *set, uint64_t start)
{
    size_t lo = 0, hi = set->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (set->r[mid][1] < start)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

stria_status_t stria_ranges_add(stria_ranges_t *set, uint64_t start, uint64_t len)
{
    if (len == 0)
        return STRIA_OK;
    if (start > UINT64_MAX - len)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "byte range at %llu of %llu bytes wraps",
                               (unsigned long long)start, (unsigned long long)len);
    uint64_t end = start + len;
    /* Ranges i .. j-1 touch or overlap [start, end) and merge with it. */
    size_t i = stria__ranges_lower(set, start), j = i;
    uint64_t merged_old = 0;
    while (j < set->n && set->r[j][0] <= end) {
        if (set->r[j][0] < start)
            start = set->r[j][0];
        if (set->r[j][1] > end)
            end = set->r[j][1];
        merged_old += set->r[j][1] - set->r[j][0];
        j++;
    }
    if (i == j) { /* disjoint from every range: insert at i */
        if (set->n >= STRIA_RANGES_MAX)
            return stria_error_set(STRIA_ERR_BUSY,
                                   "more than %d disjoint byte ranges outstanding: send the "
                                   "chunks of a tensor in order",
                                   STRIA_RANGES_MAX);
        void *r = stria_grow(set->r, &set->cap, set->n + 1, sizeof(*set->r), 4);
        if (r == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for byte ranges");
        set->r = r;
        memmove(set->r + i + 1, set->r + i, (set->n - i) * sizeof(*set->r));
        set->n++;
        j = i + 1;
    }
    set->r[i][0] = start;
    set->r[i][1] = end;
    if (j > i + 1) {
        memmove(set->r + i + 1, set->r + j, (set->n - j) * sizeof(*set->r));
        set->n -= j - i - 1;
    }
    set->covered += (end - start) - merged_old;
    return STRIA_OK;
}

uint64_t stria_ranges_first_gap(const stria_ranges_t *set, uint64_t total)
{
    /* Ranges never touch, so only a range starting at 0 can hide the gap. */
    if (set->n == 0 || set->r[0][0] > 0)
        return 0;
    return set->r[0][1] < total ? set->r[0][1] : total;
}

void stria_ranges_free(stria_ranges_t *set)
{
    free(set->r);
    memset(set, 0, sizeof(*set));
}
