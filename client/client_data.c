/* libstria: one rank's data with its worker. Its connection and path
 * (shared memory, or TCP through client_xfer.c), the pass call, and the rank
 * functions of the whole-sequence calls' phases. */
#include "client_int.h"

#include "client_xfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Rows (outer index) and bytes per token of a rank's tensor. */
static void stria__geom(const stria_job_t *job, stria_tensor_id_t t, int64_t *outer, size_t *row)
{
    switch (t) {
    case STRIA_TENSOR_K:
    case STRIA_TENSOR_V:
    case STRIA_TENSOR_DK:
    case STRIA_TENSOR_DV:
        *outer = job->spec.batch;
        *row = stria__row_bytes(job, job->spec.kv_heads);
        return;
    case STRIA_TENSOR_LSE:
        *outer = job->spec.batch * job->spec.heads;
        *row = 4;
        return;
    default:
        *outer = job->spec.batch;
        *row = stria__row_bytes(job, job->spec.heads);
        return;
    }
}

uint64_t stria__rank_bytes(const stria_job_t *job, const stria__rank_t *r, stria_tensor_id_t t)
{
    int64_t outer;
    size_t row;
    stria__geom(job, t, &outer, &row);
    return (uint64_t)outer * (uint64_t)r->tokens * row;
}

/* The path of the rank: shared memory when the client's path allows it and
 * the worker's socket answers as that worker; r->shm_why says why not. */
static stria_status_t stria__rank_path(stria_job_t *job, stria__rank_t *r)
{
    stria_data_path_t path = job->client->params.data_path;
    if (r->shm_tried)
        return STRIA_OK;
    r->shm_tried = true;
    if (path == STRIA_DATA_PATH_TCP) {
        snprintf(r->shm_why, sizeof(r->shm_why), "the client's path is tcp");
        return STRIA_OK;
    }
    stria_status_t st = STRIA_ERR_UNSUPPORTED;
    if (r->shm_socket[0] == '\0')
        stria_error_set(st, "its worker %s has no shared-memory socket (no runtime directory)",
                        r->rpc_address);
    else
        st = stria__shm_attach(job, r);
    if (st == STRIA_OK)
        return STRIA_OK;
    snprintf(r->shm_why, sizeof(r->shm_why), "%s", stria_error_msg());
    if (path == STRIA_DATA_PATH_SHM)
        return stria_error_set(st, "rank %d: no shared memory with its worker (path shm): %s",
                               r->rank, r->shm_why);
    return STRIA_OK;
}

stria_status_t stria__rank_connect(stria_job_t *job, stria__rank_t *r)
{
    stria_rpc_client_params_t rp;
    /* A sharded handle that reaches a rank's worker acts as that rank: its
     * release releases the rank (and its shared memory goes with it). */
    r->used = true;
    if (r->conn == NULL) {
        memset(&rp, 0, sizeof(rp));
        rp.address = r->rpc_address;
        rp.service = &stria__v1__worker__descriptor;
        rp.token = job->client->token;
        rp.client_name = job->client->client_name;
        rp.connect_timeout_s = job->client->params.connect_timeout_s;
        stria_status_t st = stria_rpc_client_connect(&rp, &r->conn);
        if (st != STRIA_OK)
            return st;
    }
    return stria__rank_path(job, r);
}

/* Moves this rank's real tokens between a full [outer, seq, row] tensor and
 * a shard whose outer rows are `stride` bytes apart (tokens rows at the
 * start of each). */
static void stria__scatter(const stria_job_t *job, const stria__rank_t *r, int64_t outer,
                           size_t row, uint64_t stride, void *full, void *shard, bool to_shard)
{
    for (int64_t b = 0; b < outer; b++)
        for (int64_t i = 0; i < r->tokens; i++) {
            int64_t pos = stria_layout_position(&job->layout, r->rank, i);
            char *f = (char *)full + (size_t)(b * job->spec.seq_len + pos) * row;
            char *s = (char *)shard + (size_t)b * stride + (size_t)i * row;
            if (to_shard)
                memcpy(s, f, row);
            else
                memcpy(f, s, row);
        }
}

/* The rank's side of the job's TCP transfers (client_xfer.c). */
static stria__xfer_t stria__rank_xfer(stria_job_t *job, stria__rank_t *r)
{
    stria__xfer_t x;
    memset(&x, 0, sizeof(x));
    x.conn = r->conn;
    x.job_id = job->id;
    x.secret = &job->secret;
    x.rank = r->rank;
    x.layout = &job->layout;
    x.tokens = r->tokens;
    x.timeout_s = job->client->params.rpc_timeout_s;
    x.progress = &r->bytes;
    x.stage = &r->stage;
    x.stage_cap = &r->stage_cap;
    return x;
}

/* A transfer item of tensor t: the rank's shard of a full tensor, or
 * (compact) the shard the caller holds. */
static stria__xfer_item_t stria__item(const stria_job_t *job, stria_tensor_id_t t, void *data,
                                      bool compact)
{
    stria__xfer_item_t it = {.tensor = (Stria__V1__Tensor)t, .data = data, .compact = compact};
    stria__geom(job, t, &it.outer, &it.row);
    return it;
}

stria_status_t stria__rank_put(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t,
                               const void *compact)
{
    stria_status_t st = stria__retired_check(job, r, compact);
    if (st != STRIA_OK)
        return st;
    if (r->shm.sock >= 0) {
        stria__shm_copy(r, t, (void *)compact, true);
        __atomic_fetch_add(&r->bytes, stria__rank_bytes(job, r, t), __ATOMIC_RELAXED);
        return stria__shm_commit(job, r, t);
    }
    stria__xfer_t x = stria__rank_xfer(job, r);
    stria__xfer_item_t it = stria__item(job, t, (void *)compact, true);
    return stria__xfer_put(&x, &it, 1);
}

stria_status_t stria__rank_get(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t,
                               void *compact)
{
    stria_status_t st = stria__retired_check(job, r, compact);
    if (st != STRIA_OK)
        return st;
    if (r->shm.sock >= 0) {
        stria__shm_copy(r, t, compact, false);
        __atomic_fetch_add(&r->bytes, stria__rank_bytes(job, r, t), __ATOMIC_RELAXED);
        return STRIA_OK;
    }
    stria__xfer_t x = stria__rank_xfer(job, r);
    stria__xfer_item_t it = stria__item(job, t, compact, true);
    return stria__xfer_get(&x, &it, 1);
}

stria_status_t stria__rank_run(stria_job_t *job, stria__rank_t *r, bool backward, double extra_s)
{
    stria_rpc_request_t rq;
    stria_rpc_reply_t reply;
    Stria__V1__RunForwardRequest fw = STRIA__V1__RUN_FORWARD_REQUEST__INIT;
    Stria__V1__RunBackwardRequest bw = STRIA__V1__RUN_BACKWARD_REQUEST__INIT;

    memset(&rq, 0, sizeof(rq));
    fw.job_id = bw.job_id = job->id;
    fw.rank = bw.rank = (uint32_t)r->rank;
    rq.method = backward ? STRIA_RPC_WORKER_RUN_BACKWARD : STRIA_RPC_WORKER_RUN_FORWARD;
    rq.request = backward ? &bw.base : &fw.base;
    rq.timeout_s = job->pass_timeout_s + extra_s;
    rq.job_secret = &job->secret;
    rq.job_id = job->id;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st = stria_rpc_client_call(r->conn, &rq, &reply);
    if (st != STRIA_OK)
        return st;
    /* RunForwardReply and RunBackwardReply both hold PassStats as field 1. */
    Stria__V1__PassStats *stats = backward ? ((Stria__V1__RunBackwardReply *)reply.msg)->stats
                                           : ((Stria__V1__RunForwardReply *)reply.msg)->stats;
    if (stats != NULL) {
        r->compute_s = stats->compute_seconds;
        r->wait_s = stats->wait_seconds;
        r->steps = stats->steps;
        r->bytes_sent = stats->bytes_sent;
    }
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

void stria__rank_drop(stria_job_t *job, stria__rank_t *r)
{
    Stria__V1__DropJobRequest dq = STRIA__V1__DROP_JOB_REQUEST__INIT;
    stria_rpc_request_t rq;
    stria_rpc_reply_t reply;
    if (r->conn == NULL)
        return;
    dq.job_id = job->id;
    memset(&rq, 0, sizeof(rq));
    rq.method = STRIA_RPC_WORKER_DROP_JOB;
    rq.request = &dq.base;
    rq.timeout_s = STRIA__COORD_TIMEOUT_S;
    rq.job_secret = &job->secret;
    rq.job_id = job->id;
    memset(&reply, 0, sizeof(reply));
    if (stria_rpc_client_call(r->conn, &rq, &reply) == STRIA_OK)
        stria_rpc_reply_free(&reply);
}

/* ---- the phases of a whole-sequence call ------------------------------------ */

/* what: the part of the phase that failed, or NULL when the phase's name says
 * it already (the phase's status names the phase). */
bool stria__rank_lost(const stria__rank_t *r, stria_status_t st)
{
    if (st != STRIA_ERR_IO && st != STRIA_ERR_CLOSED && st != STRIA_ERR_TIMEOUT &&
        st != STRIA_ERR_TRANSPORT)
        return false;
    return r->conn == NULL || !stria_rpc_client_server_error(r->conn);
}

void stria__rank_fail(stria__rank_t *r, stria_status_t st, const char *what)
{
    const char *msg = stria_error_msg()[0] ? stria_error_msg() : stria_status_str(st);
    r->conn_lost = stria__rank_lost(r, st);
    r->retryable = r->conn_lost || stria_error_retryable();
    r->status = st;
    if (what != NULL)
        snprintf(r->error, sizeof(r->error), "%s: %s", what, msg);
    else
        snprintf(r->error, sizeof(r->error), "%s", msg);
}

/* One tensor of a full call between the full tensor and the rank's shared
 * memory (no copy on the worker's side). */
static stria_status_t stria__rank_full_shm(stria_job_t *job, stria__rank_t *r, stria_tensor_id_t t,
                                           void *full, bool up)
{
    int64_t outer;
    size_t row;
    stria__geom(job, t, &outer, &row);
    const stria__shm_tensor_t *s = &r->shm.t[t];
    if (up)
        stria__shm_write(job, r, t, full, true);
    else
        stria__scatter(job, r, outer, row, s->outer_stride, full, (char *)r->shm.base + s->offset,
                       false);
    __atomic_fetch_add(&r->bytes, stria__rank_bytes(job, r, t), __ATOMIC_RELAXED);
    return up ? stria__shm_commit(job, r, t) : STRIA_OK;
}

/* The tensors ts[0 .. n) of a full call to (up) or from the rank: through
 * its shared memory, or over TCP straight from and into the caller's rows. */
static stria_status_t stria__rank_full(stria_job_t *job, stria__rank_t *r,
                                       const stria_tensor_id_t *ts, void *const *full, int n,
                                       bool up)
{
    stria_status_t st = STRIA_OK;
    if (r->shm.sock >= 0) {
        for (int i = 0; i < n && st == STRIA_OK; i++)
            st = stria__rank_full_shm(job, r, ts[i], full[i], up);
        return st;
    }
    stria__xfer_t x = stria__rank_xfer(job, r);
    stria__xfer_item_t items[4];
    for (int i = 0; i < n; i++)
        items[i] = stria__item(job, ts[i], full[i], false);
    return up ? stria__xfer_put(&x, items, (size_t)n) : stria__xfer_get(&x, items, (size_t)n);
}

/* Upload phase: this rank's shards of the phase's input tensors. */
void stria__rank_upload(stria__phase_t *ph, stria__rank_t *r)
{
    static const stria_tensor_id_t fwd[3] = {STRIA_TENSOR_Q, STRIA_TENSOR_K, STRIA_TENSOR_V};
    static const stria_tensor_id_t bwd[1] = {STRIA_TENSOR_DO};
    stria_job_t *job = ph->job;
    stria_status_t st = stria__rank_connect(job, r);
    if (st != STRIA_OK) {
        stria__rank_fail(r, st, "connect");
        return;
    }
    void *in[3] = {(void *)ph->in[0], (void *)ph->in[1], (void *)ph->in[2]};
    st = stria__rank_full(job, r, ph->backward ? bwd : fwd, in, ph->n_in, true);
    if (st != STRIA_OK)
        stria__rank_fail(r, st, "upload");
}

void stria__rank_pass(stria__phase_t *ph, stria__rank_t *r)
{
    stria_status_t st = stria__rank_run(ph->job, r, ph->backward, 0);
    if (st != STRIA_OK)
        stria__rank_fail(r, st, NULL);
}

/* Download phase: this rank's shards of the outputs, into their final
 * positions of the caller's tensors. */
void stria__rank_download(stria__phase_t *ph, stria__rank_t *r)
{
    static const stria_tensor_id_t fwd[2] = {STRIA_TENSOR_O, STRIA_TENSOR_LSE};
    static const stria_tensor_id_t bwd[3] = {STRIA_TENSOR_DQ, STRIA_TENSOR_DK, STRIA_TENSOR_DV};
    void *out[3] = {ph->out[0], ph->backward ? ph->out[1] : ph->lse_out, ph->out[2]};
    stria_status_t st = stria__rank_full(ph->job, r, ph->backward ? bwd : fwd, out,
                                         ph->backward ? ph->n_out : 2, false);
    if (st != STRIA_OK)
        stria__rank_fail(r, st, "download");
}
