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
    const stria_job_secret_t *secret; /* proven on every request */
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

/* A tensor of a transfer: the rank's shard of a full tensor
 * [outer][layout->seq_len][row] (a [batch, seq, heads, head_dim] tensor: outer =
 * batch; LSE [batch, heads, seq]: outer = batch * heads, row = 4), or with
 * `compact` a shard the caller holds, [outer][tokens][row]. */
typedef struct {
    Stria__V1__Tensor tensor;
    void *data;
    int64_t outer;
    size_t row;
    bool compact;
} stria__xfer_item_t;

/* Sends the rank's shards of the items with PutInput, or receives them with
 * GetOutput into their final positions: in chunks pipelined on the rank's
 * connection (several in flight, across the items), straight from and into
 * the caller's rows (scattered I/O) unless the rows are too short to be
 * worth a piece each, which go through the staging buffer. */
stria_status_t stria__xfer_put(const stria__xfer_t *x, const stria__xfer_item_t *items, size_t n);
stria_status_t stria__xfer_get(const stria__xfer_t *x, const stria__xfer_item_t *items, size_t n);

#endif
