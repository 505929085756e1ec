/* libstria's transfers between a rank's worker and the caller's tensors
 * (client_xfer.c). Internal: not installed. */
#ifndef STRIA_CLIENT_XFER_H
#define STRIA_CLIENT_XFER_H

#include "stria.pb-c.h"
#include "stria_common.h"
#include "stria_rpc.h"

/* One rank's side of the transfers of a job. */
typedef struct {
    stria_rpc_client_t *conn; /* to the rank's worker */
    uint64_t job_id;
    int rank;
    const stria_layout_t *layout;
    int64_t tokens; /* the rank's real tokens */
    double timeout_s;
    uint64_t *progress; /* bytes moved so far, added atomically */
    /* The rank's staging buffer (rows too short to move one by one), kept
     * between calls; freed by the caller. */
    void **stage;
    size_t *stage_cap;
} stria__xfer_t;

/* Sends the rank's shard of a full tensor [outer][layout->seq][row] (a
 * [batch, seq, heads, head_dim] tensor: outer = batch) with PutInput, in
 * chunks, straight from the caller's rows (scattered I/O) unless the rows
 * are too short to be worth a piece each, then packed in the staging
 * buffer. */
stria_status_t stria__xfer_put(const stria__xfer_t *x, Stria__V1__Tensor tensor, const void *full,
                               int64_t outer, size_t row);
/* Receives the rank's shard of an output with GetOutput into its final
 * positions of a full tensor [outer][layout->seq][row] (LSE [batch, heads,
 * seq]: outer = batch * heads, row = 4), likewise. */
stria_status_t stria__xfer_get(const stria__xfer_t *x, Stria__V1__Tensor tensor, void *full,
                               int64_t outer, size_t row);
/* The same for a compact shard the caller holds ([outer][tokens][row]). */
stria_status_t stria__xfer_put_compact(const stria__xfer_t *x, Stria__V1__Tensor tensor,
                                       const void *shard, int64_t outer, size_t row);
stria_status_t stria__xfer_get_compact(const stria__xfer_t *x, Stria__V1__Tensor tensor,
                                       void *shard, int64_t outer, size_t row);

#endif
