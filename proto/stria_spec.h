/*
 * What the daemons keep of a JobSpec beyond its scalar fields: the documents
 * and the window, copied out of a decoded message (whose memory goes with
 * the RPC call) into memory the job owns.
 */
#ifndef STRIA_SPEC_H
#define STRIA_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t *cu_seqlens; /* owned; NULL when n_cu_seqlens is 0 */
    size_t n_cu_seqlens;
    bool has_window;
    int64_t window_left, window_right;
} stria_job_masks_t;

/* Copies the documents and window of a validated spec into *m (zeroed
 * first). Returns false when out of memory (*m then holds nothing). */
bool stria_job_masks_copy(const Stria__V1__JobSpec *s, stria_job_masks_t *m);
/* Frees what stria_job_masks_copy() allocated and zeroes *m. */
void stria_job_masks_free(stria_job_masks_t *m);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_SPEC_H */
