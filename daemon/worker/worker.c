/*
 * stria-worker: one rank of any job's ring, per GPU (or CPU) of a host.
 *
 * Threads:
 *   - the RPC loop thread (stria_rpc_server): serves the Worker service;
 *     every handler runs there, and never blocks on a pass;
 *   - one pass thread per running RunForward/RunBackward: joins the job's ring
 *     over the ring link, runs the ring engine and replies;
 *   - the heartbeat thread: registers with the coordinator, heartbeats, drops
 *     the jobs the coordinator names;
 *   - the service loop thread: /metrics and the systemd watchdog;
 *   - the main thread: waits for SIGTERM/SIGINT and shuts down.
 * The job table is guarded by one mutex; a job's buffers are pinned by a
 * reference count while a transfer or a pass uses them, so a drop never frees
 * memory in use.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "stria_kernels.h"
#include "stria_ring.h"
#include "stria_service.h"
#include "stria_transport.h"
#include "worker_int.h"

#define STRIA__COORD_TIMEOUT_S 5.0

/* ---- job table ------------------------------------------------------------ */

static stria__wjob_t *stria__job_find(stria_worker_t *w, uint64_t id)
{
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        if (j->id == id)
            return j;
    return NULL;
}

static void stria__job_free(stria_worker_t *w, stria__wjob_t *j)
{
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        stria_free(j->buf[t]);
        stria_device_free(j->dev, j->dbuf[t]);
        stria_ranges_free(&j->received[t]);
    }
    stria_device_close(j->dev);
    w->memory_used -= j->bytes;
    stria_metric_set(w->m_memory, (double)w->memory_used);
    free(j);
}

/* Unlinks and frees a job, or marks it to be freed by its last user. Lock
 * held. */
void stria__job_drop_locked(stria_worker_t *w, stria__wjob_t *j)
{
    stria__wjob_t **pp = &w->jobs;
    while (*pp != NULL && *pp != j)
        pp = &(*pp)->next;
    if (*pp == j) {
        *pp = j->next;
        j->next = NULL;
    }
    if (j->link != NULL) {
        char reason[96];
        snprintf(reason, sizeof(reason),
                 "job %llu is over at the coordinator (cancelled, failed "
                 "or expired)",
                 (unsigned long long)j->id);
        stria_log_info("job %llu: aborting its running pass", (unsigned long long)j->id);
        stria_link_abort(j->link, STRIA_ERR_CANCELLED, reason);
    }
    if (j->refs > 0) {
        j->dropped = true;
        return;
    }
    stria__job_free(w, j);
}

static void stria__job_unref(stria_worker_t *w, stria__wjob_t *j)
{
    pthread_mutex_lock(&w->lock);
    if (--j->refs == 0 && j->dropped)
        stria__job_free(w, j);
    pthread_mutex_unlock(&w->lock);
}

/* Element sizes and shapes of the tensors of a job. */
static void stria__tensor_geometry(const stria__wjob_t *j, int t, int64_t *outer_out,
                                   size_t *row_out)
{
    size_t es = stria_dtype_size(j->dtype);
    switch (t) {
    case STRIA__T_K:
    case STRIA__T_V:
    case STRIA__T_DK:
    case STRIA__T_DV:
        *outer_out = j->batch;
        *row_out = (size_t)(j->kv_heads * j->head_dim) * es;
        return;
    case STRIA__T_LSE:
        *outer_out = j->batch * j->heads;
        *row_out = 4;
        return;
    default:
        *outer_out = j->batch;
        *row_out = (size_t)(j->heads * j->head_dim) * es;
        return;
    }
}

/* Bytes of the compact (real tokens only) form of a tensor: what clients send
 * and receive. */
static uint64_t stria__compact_bytes(const stria__wjob_t *j, int t)
{
    int64_t outer;
    size_t row;
    stria__tensor_geometry(j, t, &outer, &row);
    return (uint64_t)outer * (uint64_t)j->valid * row;
}

/* Copies between a byte range of the compact form and the padded buffer. */
static void stria__copy_range(const stria__wjob_t *j, int t, uint64_t off, uint64_t len,
                              void *compact, bool to_padded)
{
    int64_t outer;
    size_t row;
    stria__tensor_geometry(j, t, &outer, &row);
    uint64_t seg = (uint64_t)j->valid * row;                /* compact bytes per outer index */
    uint64_t pseg = (uint64_t)j->layout.shard_tokens * row; /* padded bytes per outer index */
    char *padded = j->buf[t];
    uint64_t done = 0;
    while (done < len) {
        uint64_t pos = off + done;
        uint64_t o = pos / seg, in = pos % seg;
        uint64_t n = seg - in < len - done ? seg - in : len - done;
        if (to_padded)
            memcpy(padded + o * pseg + in, (char *)compact + done, n);
        else
            memcpy((char *)compact + done, padded + o * pseg + in, n);
        done += n;
    }
}

/* Pointer to a compact range when it is contiguous in the padded buffer. */
static void *stria__direct_range(const stria__wjob_t *j, int t, uint64_t off, uint64_t len)
{
    int64_t outer;
    size_t row;
    stria__tensor_geometry(j, t, &outer, &row);
    uint64_t seg = (uint64_t)j->valid * row;
    uint64_t pseg = (uint64_t)j->layout.shard_tokens * row;
    if (len == 0 || off / seg != (off + len - 1) / seg)
        return NULL;
    return (char *)j->buf[t] + (off / seg) * pseg + off % seg;
}

/* Per-rank memory of a job: its tensors, plus the ring engine's buffers
 * (double-buffered K/V blocks, fp32 dK/dV, fp32 partials) and the kernels'
 * packed copies, estimated generously. */
static uint64_t stria__job_memory(const stria__wjob_t *j)
{
    uint64_t bytes = 0;
    /* the sizes were checked when the job was opened; a failure here means
     * an impossible size, which no worker can hold */
    if (stria_rank_memory(j->batch, j->layout.shard_tokens, j->heads, j->kv_heads, j->head_dim,
                          j->dtype, &bytes) != STRIA_OK)
        return UINT64_MAX;
    return bytes;
}

/* ---- coordinator calls ----------------------------------------------------- */

static stria_status_t stria__coord_call(stria_worker_t *w, uint32_t method,
                                        const ProtobufCMessage *req, stria_rpc_reply_t *reply)
{
    stria_status_t st;
    pthread_mutex_lock(&w->coord_lock);
    if (w->coord == NULL) {
        stria_rpc_client_params_t p;
        memset(&p, 0, sizeof(p));
        p.address = w->cfg.coordinator;
        p.service = &stria__v1__coordinator__descriptor;
        p.token = w->token;
        p.client_name = "stria-worker";
        p.connect_timeout_s = STRIA__COORD_TIMEOUT_S;
        st = stria_rpc_client_connect(&p, &w->coord);
        if (st != STRIA_OK) {
            pthread_mutex_unlock(&w->coord_lock);
            return stria_error_wrap(st, "coordinator %s", w->cfg.coordinator);
        }
    }
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.timeout_s = STRIA__COORD_TIMEOUT_S;
    memset(reply, 0, sizeof(*reply));
    st = stria_rpc_client_call(w->coord, &rq, reply);
    pthread_mutex_unlock(&w->coord_lock);
    return st;
}

/* Reports an event of job j; returns the job's state at the coordinator
 * after the report (a terminal one: the job is over there), or
 * JOB_STATE_UNSPECIFIED when the coordinator could not be told. */
static Stria__V1__JobState stria__report(stria_worker_t *w, const stria__wjob_t *j,
                                         Stria__V1__ReportJobRequest__Event ev, const char *message)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    Stria__V1__JobState state = STRIA__V1__JOB_STATE__JOB_STATE_UNSPECIFIED;
    stria_rpc_reply_t reply;
    req.worker_id = w->worker_id;
    req.job_id = j->id;
    req.rank = (uint32_t)j->rank;
    req.event = ev;
    req.message = (char *)(message ? message : "");
    req.step = j->step;
    req.steps_total = j->steps_total;
    if (stria__coord_call(w, STRIA_RPC_COORDINATOR_REPORT_JOB, &req.base, &reply) == STRIA_OK) {
        state = ((const Stria__V1__ReportJobReply *)reply.msg)->state;
        stria_rpc_reply_free(&reply);
    } else {
        stria_log_warn("job %llu rank %d: cannot report to the coordinator: %s",
                       (unsigned long long)j->id, j->rank, stria_error_msg());
    }
    return state;
}

/* Fetches a job's assignment from the coordinator and creates the job with
 * every buffer allocated (bounded memory: a job that does not fit is refused
 * here, never mid-pass). Lock not held. */
static stria_status_t stria__job_create(stria_worker_t *w, uint64_t job_id, uint32_t rank,
                                        stria__wjob_t **job_out)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    stria_status_t st;
    stria__wjob_t *j = NULL;

    req.job_id = job_id;
    st = stria__coord_call(w, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, &reply);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "job %llu", (unsigned long long)job_id);
    Stria__V1__GetJobReply *gr = (Stria__V1__GetJobReply *)reply.msg;
    const Stria__V1__JobInfo *info = gr->job;
    const Stria__V1__Assignment *a = info ? info->assignment : NULL;
    if (a == NULL || a->spec == NULL || rank >= a->n_ranks || a->ranks[rank] == NULL) {
        st = stria_error_set(STRIA_ERR_NOT_FOUND, "job %llu has no rank %u",
                             (unsigned long long)job_id, rank);
        goto out;
    }
    if (info->state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        st = stria_error_set(STRIA_ERR_CANCELLED, "job %llu is over (%s)",
                             (unsigned long long)job_id,
                             info->failure && info->failure[0] ? info->failure : "released");
        goto out;
    }
    if (a->ranks[rank]->worker_id != w->worker_id) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "job %llu rank %u belongs to worker %llu, not to this worker (%llu)",
                             (unsigned long long)job_id, rank,
                             (unsigned long long)a->ranks[rank]->worker_id,
                             (unsigned long long)w->worker_id);
        goto out;
    }
    const Stria__V1__JobSpec *s = a->spec;
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
        goto out;
    }
    j->id = job_id;
    j->rank = (int)rank;
    j->n_ranks = (int)a->n_ranks;
    j->batch = s->batch;
    j->seq = (int64_t)s->seq_len;
    j->heads = s->heads;
    j->kv_heads = s->kv_heads;
    j->head_dim = s->head_dim;
    j->dtype = (stria_dtype_t)s->dtype;
    j->causal = s->causal;
    j->layout_kind = (stria_layout_kind_t)s->layout;
    j->scale = s->scale;
    j->step_timeout_s =
        s->step_timeout_ms > 0 ? s->step_timeout_ms / 1000.0 : w->cfg.step_timeout_s;
    j->steps_total = (uint32_t)a->n_ranks;
    j->phase = STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
    j->last_activity = stria_time_now();
    const char *next = a->ranks[(rank + 1) % a->n_ranks]->ucx_address;
    if (stria_dtype_size(j->dtype) == 0 || next == NULL || strlen(next) >= sizeof(j->next_ucx)) {
        st = stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: malformed assignment",
                             (unsigned long long)job_id);
        goto out;
    }
    snprintf(j->next_ucx, sizeof(j->next_ucx), "%s", next);
    st = stria_layout_init(j->layout_kind, j->n_ranks, j->seq, &j->layout);
    if (st != STRIA_OK)
        goto out;
    j->valid = stria_layout_shard_valid(&j->layout, j->rank);
    if ((int64_t)a->ranks[rank]->tokens != j->valid) {
        st = stria_error_set(STRIA_ERR_PROTOCOL,
                             "job %llu rank %u: the assignment says %llu tokens, the layout %lld",
                             (unsigned long long)job_id, rank,
                             (unsigned long long)a->ranks[rank]->tokens, (long long)j->valid);
        goto out;
    }
    uint64_t need = stria__job_memory(j);
    if (a->memory_per_rank_bytes > need)
        need = a->memory_per_rank_bytes;
    pthread_mutex_lock(&w->lock);
    stria__wjob_t *other = stria__job_find(w, job_id);
    if (other != NULL) { /* created meanwhile by another request */
        pthread_mutex_unlock(&w->lock);
        free(j);
        j = NULL;
        *job_out = other;
        st = STRIA_OK;
        goto out;
    }
    if (need > (uint64_t)w->cfg.memory_bytes - w->memory_used) {
        pthread_mutex_unlock(&w->lock);
        st = stria_error_set(STRIA_ERR_NO_MEMORY,
                             "job %llu needs %llu MiB on this worker, %llu MiB of %llu are free",
                             (unsigned long long)job_id, (unsigned long long)(need >> 20),
                             (unsigned long long)((w->cfg.memory_bytes - w->memory_used) >> 20),
                             (unsigned long long)(w->cfg.memory_bytes >> 20));
        goto out;
    }
    w->memory_used += need; /* reserved before allocating: no two jobs race for it */
    j->bytes = need;
    pthread_mutex_unlock(&w->lock);
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        int64_t outer;
        size_t row;
        stria__tensor_geometry(j, t, &outer, &row);
        j->buf[t] = stria_calloc_aligned((size_t)outer * (size_t)j->layout.shard_tokens * row);
        if (j->buf[t] == NULL) {
            pthread_mutex_lock(&w->lock);
            stria__job_free(w, j);
            pthread_mutex_unlock(&w->lock);
            j = NULL;
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "job %llu: cannot allocate its tensors",
                                 (unsigned long long)job_id);
            goto out;
        }
    }
    pthread_mutex_lock(&w->lock);
    j->next = w->jobs;
    w->jobs = j;
    stria_metric_set(w->m_memory, (double)w->memory_used);
    pthread_mutex_unlock(&w->lock);
    stria_log_info("job %llu rank %d/%d: %lld of %lld tokens (%s), %llu MiB reserved",
                   (unsigned long long)j->id, j->rank, j->n_ranks, (long long)j->valid,
                   (long long)j->seq, stria_layout_kind_name(j->layout_kind),
                   (unsigned long long)(j->bytes >> 20));
    *job_out = j;
    j = NULL;
    st = STRIA_OK;
out:
    free(j);
    stria_rpc_reply_free(&reply);
    return st;
}

/* ---- PutInput ---------------------------------------------------------------- */

static int stria__input_tensor(Stria__V1__Tensor t)
{
    switch (t) {
    case STRIA__V1__TENSOR__TENSOR_Q:
        return STRIA__T_Q;
    case STRIA__V1__TENSOR__TENSOR_K:
        return STRIA__T_K;
    case STRIA__V1__TENSOR__TENSOR_V:
        return STRIA__T_V;
    case STRIA__V1__TENSOR__TENSOR_DO:
        return STRIA__T_DO;
    default:
        return -1;
    }
}

static int stria__output_tensor(Stria__V1__Tensor t)
{
    switch (t) {
    case STRIA__V1__TENSOR__TENSOR_O:
        return STRIA__T_O;
    case STRIA__V1__TENSOR__TENSOR_LSE:
        return STRIA__T_LSE;
    case STRIA__V1__TENSOR__TENSOR_DQ:
        return STRIA__T_DQ;
    case STRIA__V1__TENSOR__TENSOR_DK:
        return STRIA__T_DK;
    case STRIA__V1__TENSOR__TENSOR_DV:
        return STRIA__T_DV;
    default:
        return -1;
    }
}

/* State of one PutInput call between its payload callback and its handler. */
typedef struct {
    stria_worker_t *w;
    stria__wjob_t *job; /* referenced */
    int tensor;
    uint64_t offset, len;
    void *staging; /* when the range is not contiguous in the padded buffer */
} stria__put_t;

static void stria__put_cleanup(void *arg)
{
    stria__put_t *p = arg;
    stria_free(p->staging);
    if (p->job != NULL)
        stria__job_unref(p->w, p->job);
    free(p);
}

/* Finds or creates the job of a request and takes a reference. */
static stria_status_t stria__job_get(stria_worker_t *w, uint64_t id, uint32_t rank, bool create,
                                     stria__wjob_t **out)
{
    stria__wjob_t *j;
    pthread_mutex_lock(&w->lock);
    j = stria__job_find(w, id);
    if (j != NULL)
        j->refs++;
    bool stopping = w->stopping;
    pthread_mutex_unlock(&w->lock);
    if (stopping && j == NULL)
        return stria_error_set(STRIA_ERR_BUSY, "this worker is shutting down");
    if (j == NULL) {
        if (!create)
            return stria_error_set(STRIA_ERR_NOT_FOUND,
                                   "job %llu is not held by this worker (never loaded, released "
                                   "or expired)",
                                   (unsigned long long)id);
        stria_status_t st = stria__job_create(w, id, rank, &j);
        if (st != STRIA_OK)
            return st;
        pthread_mutex_lock(&w->lock);
        j->refs++;
        pthread_mutex_unlock(&w->lock);
    }
    if ((uint32_t)j->rank != rank) {
        stria__job_unref(w, j);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job %llu: this worker holds rank %d, not %u",
                               (unsigned long long)id, j->rank, rank);
    }
    *out = j;
    return STRIA_OK;
}

stria_status_t stria__put_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                  void **buf_out)
{
    stria_worker_t *w = ctx;
    const Stria__V1__PutInputRequest *req =
        (const Stria__V1__PutInputRequest *)stria_rpc_call_request(call);
    int t = stria__input_tensor(req->tensor);
    stria__wjob_t *j;
    stria_status_t st;

    if (t < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "PutInput: tensor %d is not an input",
                               (int)req->tensor);
    st = stria__job_get(w, req->job_id, req->rank, true, &j);
    if (st != STRIA_OK)
        return st;
    uint64_t total = stria__compact_bytes(j, t);
    if (req->total_bytes != total || req->offset > total || payload_len > total - req->offset) {
        stria__job_unref(w, j);
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "PutInput job %llu rank %d tensor %d: bytes [%llu, %llu) of %llu "
                               "do not fit the job's %llu",
                               (unsigned long long)j->id, j->rank, (int)req->tensor,
                               (unsigned long long)req->offset,
                               (unsigned long long)(req->offset + payload_len),
                               (unsigned long long)req->total_bytes, (unsigned long long)total);
    }
    if (j->running) {
        stria__job_unref(w, j);
        return stria_error_set(STRIA_ERR_BUSY, "job %llu: a pass is running",
                               (unsigned long long)j->id);
    }
    stria__put_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        stria__job_unref(w, j);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    }
    p->w = w;
    p->job = j;
    p->tensor = t;
    p->offset = req->offset;
    p->len = payload_len;
    *buf_out = stria__direct_range(j, t, req->offset, payload_len);
    if (*buf_out == NULL) {
        p->staging = stria_malloc_aligned(payload_len);
        if (p->staging == NULL) {
            stria__put_cleanup(p);
            return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory for %llu bytes",
                                   (unsigned long long)payload_len);
        }
        *buf_out = p->staging;
    }
    stria_rpc_call_set_cleanup(call, stria__put_cleanup, p);
    stria_metric_add(w->m_in_bytes, (double)payload_len);
    return STRIA_OK;
}

void stria__put_handler(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__PutInputRequest *req =
        (const Stria__V1__PutInputRequest *)stria_rpc_call_request(call);
    uint64_t len = 0;
    void *payload = stria_rpc_call_payload(call, &len);
    int t = stria__input_tensor(req->tensor);
    stria__wjob_t *j;

    if (len == 0 || payload == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "PutInput without payload bytes");
        return;
    }
    /* the payload callback holds a reference; take another for this handler */
    if (stria__job_get(w, req->job_id, req->rank, false, &j) != STRIA_OK) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "%s", stria_error_msg());
        return;
    }
    void *direct = stria__direct_range(j, t, req->offset, len);
    if (direct != payload) /* staged: scatter into the padded rows */
        stria__copy_range(j, t, req->offset, len, payload, true);
    pthread_mutex_lock(&w->lock);
    stria_status_t st = stria_ranges_add(&j->received[t], req->offset, len);
    j->last_activity = stria_time_now();
    uint64_t got = j->received[t].covered;
    pthread_mutex_unlock(&w->lock);
    if (st != STRIA_OK) {
        stria__job_unref(w, j);
        stria_rpc_call_fail(call, st, "PutInput job %llu rank %u: %s",
                            (unsigned long long)req->job_id, req->rank, stria_error_msg());
        return;
    }
    uint64_t total = stria__compact_bytes(j, t);
    Stria__V1__PutInputReply rep = STRIA__V1__PUT_INPUT_REPLY__INIT;
    rep.received_bytes = got;
    rep.complete = got >= total;
    stria__job_unref(w, j);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- passes -------------------------------------------------------------------- */

typedef struct {
    stria_worker_t *w;
    stria__wjob_t *job; /* referenced */
    stria_rpc_call_t *call;
    bool backward;
} stria__pass_ctx_t;

/* A tensor of the job as the pass sees it: the host buffer, or its device
 * copy on a staged device. */
static stria_tensor_t stria__tensor(const stria__wjob_t *j, int t)
{
    int64_t heads = (t == STRIA__T_K || t == STRIA__T_V || t == STRIA__T_DK || t == STRIA__T_DV)
                        ? j->kv_heads
                        : j->heads;
    return stria_tensor_contiguous(j->dev != NULL ? j->dbuf[t] : j->buf[t], j->dtype,
                                   j->layout.shard_tokens, heads, j->head_dim);
}

static size_t stria__tensor_bytes(const stria__wjob_t *j, int t)
{
    int64_t outer;
    size_t row;
    stria__tensor_geometry(j, t, &outer, &row);
    return (size_t)outer * (size_t)j->layout.shard_tokens * row;
}

/* Before a pass on a device whose memory is not host memory: the job's
 * device (opened once) and device buffers (allocated once), and the pass's
 * inputs uploaded from the host buffers the RPC layer received them into.
 * Inputs are uploaded at every pass, as the client may have replaced them
 * in between. */
static stria_status_t stria__stage_in(stria_worker_t *w, stria__wjob_t *j, bool backward)
{
    static const int fwd_in[] = {STRIA__T_Q, STRIA__T_K, STRIA__T_V};
    static const int bwd_in[] = {STRIA__T_Q, STRIA__T_K,   STRIA__T_V,
                                 STRIA__T_O, STRIA__T_LSE, STRIA__T_DO};
    const int *in = backward ? bwd_in : fwd_in;
    size_t n_in = backward ? 6 : 3;
    stria_status_t st;
    if (j->dev == NULL &&
        (st = stria_device_open(stria_device_name(w->dev), w->pool, &j->dev)) != STRIA_OK)
        return stria_error_wrap(st, "job %llu", (unsigned long long)j->id);
    for (int t = 0; t < STRIA__T_COUNT; t++)
        if (j->dbuf[t] == NULL &&
            (st = stria_device_alloc(j->dev, stria__tensor_bytes(j, t), &j->dbuf[t])) != STRIA_OK)
            return stria_error_wrap(st, "job %llu: device buffers", (unsigned long long)j->id);
    for (size_t i = 0; i < n_in; i++)
        if ((st = stria_device_copy(j->dev, STRIA_STREAM_COPY, j->dbuf[in[i]], j->buf[in[i]],
                                    stria__tensor_bytes(j, in[i]))) != STRIA_OK)
            return st;
    return stria_device_sync(j->dev, STRIA_STREAM_COPY);
}

/* After a successful pass: its outputs to the host buffers GetOutput reads. */
static stria_status_t stria__stage_out(stria__wjob_t *j, bool backward)
{
    static const int fwd_out[] = {STRIA__T_O, STRIA__T_LSE};
    static const int bwd_out[] = {STRIA__T_DQ, STRIA__T_DK, STRIA__T_DV};
    const int *out = backward ? bwd_out : fwd_out;
    size_t n_out = backward ? 3 : 2;
    stria_status_t st;
    for (size_t i = 0; i < n_out; i++)
        if ((st = stria_device_copy(j->dev, STRIA_STREAM_COPY, j->buf[out[i]], j->dbuf[out[i]],
                                    stria__tensor_bytes(j, out[i]))) != STRIA_OK)
            return st;
    return stria_device_sync(j->dev, STRIA_STREAM_COPY);
}

typedef struct {
    stria_worker_t *w;
    stria__wjob_t *job;
} stria__step_ctx_t;

/* The ring step a pass is at, for heartbeats (and so striactl). */
static void stria__on_step(void *arg, int step, int n_steps)
{
    stria__step_ctx_t *sc = arg;
    pthread_mutex_lock(&sc->w->lock);
    sc->job->step = (uint32_t)step;
    sc->job->steps_total = (uint32_t)n_steps;
    pthread_mutex_unlock(&sc->w->lock);
}

static stria_status_t stria__run_pass(stria_worker_t *w, stria__wjob_t *j, bool backward,
                                      uint32_t pass_id, Stria__V1__PassStats *stats)
{
    stria_ring_shape_t shape;
    stria_ring_opts_t opts;
    stria_ring_pass_t *pass = NULL;
    stria_link_t *link = NULL;
    stria_status_t st;
    double t0 = stria_time_now();

    memset(&shape, 0, sizeof(shape));
    shape.batch = j->batch;
    shape.seq = j->seq;
    shape.heads = j->heads;
    shape.kv_heads = j->kv_heads;
    shape.head_dim = j->head_dim;
    shape.scale = j->scale;
    shape.causal = j->causal;
    shape.dtype = j->dtype;
    memset(&opts, 0, sizeof(opts));
    opts.step_timeout_s = j->step_timeout_s;
    opts.pool = w->pool;
    opts.pass_id = pass_id;
    stria__step_ctx_t step_ctx = {w, j};
    opts.step_cb = stria__on_step;
    opts.step_cb_ctx = &step_ctx;

    stria_ucx_link_params_t rp;
    char next_host[256];
    int next_port;
    st = stria_parse_host_port(j->next_ucx, next_host, sizeof(next_host), &next_port);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "ring link address of rank %d", (j->rank + 1) % j->n_ranks);
    memset(&rp, 0, sizeof(rp));
    rp.job_id = j->id;
    rp.ring_id = pass_id;
    rp.rank = j->rank;
    rp.size = j->n_ranks;
    rp.next_host = next_host;
    rp.next_port = (uint16_t)next_port;
    rp.connect_timeout_s = w->cfg.connect_timeout_s;
    st = stria_link_ucx_connect(w->ucx, &rp, &link);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "ring link to %s", j->next_ucx);
    /* Published for a shutdown that cannot wait for the pass any longer. */
    pthread_mutex_lock(&w->lock);
    if (w->n_links == w->cap_links) {
        size_t cap = w->cap_links ? 2 * w->cap_links : 8;
        stria_link_t **links = realloc(w->links, cap * sizeof(*links));
        if (links != NULL) {
            w->links = links;
            w->cap_links = cap;
        }
    }
    if (w->n_links < w->cap_links) /* else: only its own deadlines end it */
        w->links[w->n_links++] = link;
    j->link = link;
    if (w->abort_passes)
        stria_link_abort(link, STRIA_ERR_CANCELLED, w->abort_reason);
    else if (j->dropped) /* dropped while the link was being set up */
        stria_link_abort(link, STRIA_ERR_CANCELLED, "the job is over at the coordinator");
    pthread_mutex_unlock(&w->lock);
    if (w->dev_staged && (st = stria__stage_in(w, j, backward)) != STRIA_OK) {
        stria_error_wrap(st, "rank %d: staging the inputs on %s", j->rank,
                         stria_device_name(w->dev));
        /* the ring must still hear of it: the other ranks wait for this one */
        stria_link_abort(link, st, stria_error_msg());
    }
    opts.device = j->dev; /* NULL on the host: the pass's own cpu device over w->pool */
    if (st == STRIA_OK)
        st = stria_ring_pass_create(link, &shape, j->layout_kind, &opts, &pass);
    if (st == STRIA_OK) {
        stria_tensor_t q = stria__tensor(j, STRIA__T_Q), k = stria__tensor(j, STRIA__T_K);
        stria_tensor_t v = stria__tensor(j, STRIA__T_V), o = stria__tensor(j, STRIA__T_O);
        float *lse = j->dev != NULL ? j->dbuf[STRIA__T_LSE] : j->buf[STRIA__T_LSE];
        if (!backward) {
            st = stria_ring_fwd(pass, &q, &k, &v, &o, lse);
        } else {
            stria_tensor_t g = stria__tensor(j, STRIA__T_DO), dq = stria__tensor(j, STRIA__T_DQ);
            stria_tensor_t dk = stria__tensor(j, STRIA__T_DK), dv = stria__tensor(j, STRIA__T_DV);
            st = stria_ring_bwd(pass, &q, &k, &v, &o, lse, &g, &dq, &dk, &dv);
        }
        size_t n = 0;
        const stria_ring_step_stats_t *ss = stria_ring_pass_stats(pass, &n);
        for (size_t i = 0; i < n; i++) {
            stats->compute_seconds += ss[i].compute_wall_s;
            stats->wait_seconds += ss[i].wait_s;
            stats->bytes_sent += ss[i].bytes_sent;
            stria_metric_observe(w->m_step_compute, ss[i].compute_wall_s);
            stria_metric_observe(w->m_step_wait, ss[i].wait_s);
            stria_metric_add(w->m_bytes_sent, (double)ss[i].bytes_sent);
            stria_metric_add(w->m_bytes_recv, (double)ss[i].bytes_recv);
        }
        stats->steps = (uint32_t)n;
        stria_metric_add(w->m_steps[backward ? 1 : 0], (double)n);
        stria_ring_pass_destroy(pass);
        if (st == STRIA_OK && j->dev != NULL && (st = stria__stage_out(j, backward)) != STRIA_OK)
            stria_error_wrap(st, "rank %d: fetching the outputs from %s", j->rank,
                             stria_device_name(j->dev));
    }
    pthread_mutex_lock(&w->lock);
    for (size_t i = 0; i < w->n_links; i++)
        if (w->links[i] == link)
            w->links[i--] = w->links[--w->n_links];
    if (j->link == link)
        j->link = NULL;
    pthread_mutex_unlock(&w->lock);
    stria_link_destroy(link);
    stats->seconds = stria_time_now() - t0;
    return st;
}

static void *stria__pass_thread(void *arg)
{
    stria__pass_ctx_t *pc = arg;
    stria_worker_t *w = pc->w;
    stria__wjob_t *j = pc->job;
    Stria__V1__PassStats stats = STRIA__V1__PASS_STATS__INIT;
    int b = pc->backward ? 1 : 0;

    pthread_mutex_lock(&w->lock);
    uint32_t pass_id = j->passes++;
    j->phase = b ? STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_BACKWARD
                 : STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD;
    j->step = 0;
    pthread_mutex_unlock(&w->lock);
    Stria__V1__JobState at_coord =
        stria__report(w, j,
                      b ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED
                        : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED,
                      NULL);
    if (at_coord >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        /* Over at the coordinator (cancelled, say) before the next heartbeat
         * could tell: the pass fails at once on every rank, each of which
         * hears the same in its own report. */
        pthread_mutex_lock(&w->lock);
        stria_log_info("job %llu: over at the coordinator (state %d); dropped",
                       (unsigned long long)j->id, (int)at_coord);
        stria__job_drop_locked(w, j);
        pthread_mutex_unlock(&w->lock);
    }
    stria_log_info("job %llu rank %d: %s pass started", (unsigned long long)j->id, j->rank,
                   b ? "backward" : "forward");

    stria_status_t st = stria__run_pass(w, j, pc->backward, pass_id, &stats);

    pthread_mutex_lock(&w->lock);
    j->running = false;
    j->last_activity = stria_time_now();
    if (st == STRIA_OK) {
        j->step = j->steps_total;
        j->phase =
            b ? STRIA__V1__JOB_STATE__JOB_STATE_DONE : STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE;
    } else {
        j->phase = STRIA__V1__JOB_STATE__JOB_STATE_FAILED;
        snprintf(j->failure, sizeof(j->failure), "%s", stria_error_msg());
    }
    pthread_mutex_unlock(&w->lock);

    stria_metric_add(w->m_passes[b], 1);
    stria_metric_observe(w->m_pass_s[b], stats.seconds);
    if (st == STRIA_OK) {
        stria_log_info("job %llu rank %d: %s pass done in %.3f s (compute %.3f s, wait %.3f s)",
                       (unsigned long long)j->id, j->rank, b ? "backward" : "forward",
                       stats.seconds, stats.compute_seconds, stats.wait_seconds);
        stria__report(w, j,
                      b ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_DONE
                        : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_DONE,
                      NULL);
        Stria__V1__RunForwardReply fr = STRIA__V1__RUN_FORWARD_REPLY__INIT;
        Stria__V1__RunBackwardReply br = STRIA__V1__RUN_BACKWARD_REPLY__INIT;
        fr.stats = br.stats = &stats;
        stria_rpc_call_reply(pc->call, b ? &br.base : &fr.base, NULL, 0, NULL, NULL);
    } else {
        char msg[1024], own[32];
        /* the ring engine's messages name the rank already */
        int n = snprintf(own, sizeof(own), "rank %d", j->rank);
        if (strncmp(stria_error_msg(), own, (size_t)n) == 0)
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        else
            snprintf(msg, sizeof(msg), "rank %d: %s", j->rank, stria_error_msg());
        stria_log_error("job %llu %s pass failed: %s", (unsigned long long)j->id,
                        b ? "backward" : "forward", msg);
        stria_metric_add(w->m_pass_fail[b], 1);
        stria_metric_add(st == STRIA_ERR_TIMEOUT ? w->m_err_timeout
                         : st == STRIA_ERR_PEER || st == STRIA_ERR_TRANSPORT ||
                                 st == STRIA_ERR_CLOSED
                             ? w->m_err_peer
                             : w->m_err_pass,
                         1);
        stria__report(w, j, STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED, msg);
        stria_rpc_call_fail(pc->call, st, "%s", msg);
    }
    stria__job_unref(w, j);
    free(pc);
    /* Only now, with the outcome reported and the call answered, may a
     * shutdown deregister and stop the server. */
    pthread_mutex_lock(&w->lock);
    w->running_passes--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void stria__pass_handler(stria_worker_t *w, stria_rpc_call_t *call, uint64_t job_id,
                                uint32_t rank, bool backward)
{
    stria__wjob_t *j;
    stria_status_t st = stria__job_get(w, job_id, rank, false, &j);
    if (st != STRIA_OK) {
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        return;
    }
    /* inputs complete? */
    const int need[2][3] = {{STRIA__T_Q, STRIA__T_K, STRIA__T_V}, {STRIA__T_DO, -1, -1}};
    pthread_mutex_lock(&w->lock);
    for (int i = 0; i < 3; i++) {
        int t = need[backward][i];
        uint64_t total = t >= 0 ? stria__compact_bytes(j, t) : 0;
        if (t >= 0 && j->received[t].covered < total) {
            uint64_t got = j->received[t].covered;
            uint64_t gap = stria_ranges_first_gap(&j->received[t], total);
            pthread_mutex_unlock(&w->lock);
            stria__job_unref(w, j);
            static const char *const names[] = {"Q", "K", "V", "dO"};
            stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                                "job %llu rank %u: input %s incomplete (%llu of %llu bytes; the "
                                "first missing byte is at offset %llu)",
                                (unsigned long long)job_id, rank, names[t], (unsigned long long)got,
                                (unsigned long long)total, (unsigned long long)gap);
            return;
        }
    }
    if (backward && j->phase != STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE &&
        j->phase != STRIA__V1__JOB_STATE__JOB_STATE_DONE) {
        pthread_mutex_unlock(&w->lock);
        stria__job_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "job %llu rank %u: backward needs a completed forward pass",
                            (unsigned long long)job_id, rank);
        return;
    }
    if (j->running || w->stopping) {
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->lock);
        stria__job_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            stopping ? "this worker is shutting down"
                                     : "job %llu rank %u: a pass is already running",
                            (unsigned long long)job_id, rank);
        return;
    }
    j->running = true;
    w->running_passes++;
    pthread_mutex_unlock(&w->lock);

    stria__pass_ctx_t *pc = calloc(1, sizeof(*pc));
    pthread_t th;
    pthread_attr_t attr;
    if (pc != NULL) {
        pc->w = w;
        pc->job = j;
        pc->call = call;
        pc->backward = backward;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, stria__pass_thread, pc);
        pthread_attr_destroy(&attr);
        if (rc == 0)
            return;
        free(pc);
    }
    pthread_mutex_lock(&w->lock);
    j->running = false;
    w->running_passes--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    stria__job_unref(w, j);
    stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "cannot start a pass thread");
}

void stria__fwd_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__RunForwardRequest *req =
        (const Stria__V1__RunForwardRequest *)stria_rpc_call_request(call);
    stria__pass_handler(ctx, call, req->job_id, req->rank, false);
}

void stria__bwd_handler(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__RunBackwardRequest *req =
        (const Stria__V1__RunBackwardRequest *)stria_rpc_call_request(call);
    stria__pass_handler(ctx, call, req->job_id, req->rank, true);
}

/* ---- GetOutput, DropJob ------------------------------------------------------- */

typedef struct {
    stria_worker_t *w;
    stria__wjob_t *job;
    void *copy;
} stria__get_t;

static void stria__get_done(void *arg)
{
    stria__get_t *g = arg;
    stria_free(g->copy);
    stria__job_unref(g->w, g->job);
    free(g);
}

void stria__get_handler(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__GetOutputRequest *req =
        (const Stria__V1__GetOutputRequest *)stria_rpc_call_request(call);
    int t = stria__output_tensor(req->tensor);
    stria__wjob_t *j;

    if (t < 0) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "GetOutput: tensor %d is not an output",
                            (int)req->tensor);
        return;
    }
    if (stria__job_get(w, req->job_id, req->rank, false, &j) != STRIA_OK) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "%s", stria_error_msg());
        return;
    }
    pthread_mutex_lock(&w->lock);
    Stria__V1__JobState phase = j->phase;
    bool running = j->running;
    j->last_activity = stria_time_now();
    pthread_mutex_unlock(&w->lock);
    bool fwd_out = t == STRIA__T_O || t == STRIA__T_LSE;
    bool ready = !running && (phase == STRIA__V1__JOB_STATE__JOB_STATE_DONE ||
                              (fwd_out && phase == STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE));
    if (!ready) {
        stria__job_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "job %llu rank %d: output %d is not ready (run the %s pass first)",
                            (unsigned long long)j->id, j->rank, (int)req->tensor,
                            fwd_out ? "forward" : "backward");
        return;
    }
    uint64_t total = stria__compact_bytes(j, t);
    uint64_t max = STRIA_RPC_DEFAULT_MAX_PAYLOAD;
    uint64_t n = req->max_bytes > 0 && req->max_bytes < max ? req->max_bytes : max;
    if (req->offset > total) {
        stria__job_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "GetOutput: offset %llu beyond %llu",
                            (unsigned long long)req->offset, (unsigned long long)total);
        return;
    }
    if (n > total - req->offset)
        n = total - req->offset;
    stria__get_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        stria__job_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "out of memory");
        return;
    }
    g->w = w;
    g->job = j;
    void *payload = stria__direct_range(j, t, req->offset, n);
    if (payload == NULL && n > 0) {
        g->copy = stria_malloc_aligned(n);
        if (g->copy == NULL) {
            stria__get_done(g);
            stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "out of memory");
            return;
        }
        stria__copy_range(j, t, req->offset, n, g->copy, false);
        payload = g->copy;
    }
    Stria__V1__GetOutputReply rep = STRIA__V1__GET_OUTPUT_REPLY__INIT;
    int64_t outer;
    size_t row;
    stria__tensor_geometry(j, t, &outer, &row);
    uint64_t shape[4];
    if (t == STRIA__T_LSE) {
        shape[0] = (uint64_t)j->batch;
        shape[1] = (uint64_t)j->heads;
        shape[2] = (uint64_t)j->valid;
        rep.n_shape = 3;
        rep.dtype = STRIA__V1__DTYPE__DTYPE_FP32;
    } else {
        shape[0] = (uint64_t)j->batch;
        shape[1] = (uint64_t)j->valid;
        shape[2] = (uint64_t)(t == STRIA__T_O || t == STRIA__T_DQ ? j->heads : j->kv_heads);
        shape[3] = (uint64_t)j->head_dim;
        rep.n_shape = 4;
        rep.dtype = (Stria__V1__Dtype)j->dtype;
    }
    rep.shape = shape;
    rep.tensor = req->tensor;
    rep.total_bytes = total;
    rep.offset = req->offset;
    stria_metric_add(w->m_out_bytes, (double)n);
    stria_rpc_call_reply(call, &rep.base, payload, n, stria__get_done, g);
}

void stria__drop_handler(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__DropJobRequest *req =
        (const Stria__V1__DropJobRequest *)stria_rpc_call_request(call);
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    pthread_mutex_lock(&w->lock);
    stria__wjob_t *j = stria__job_find(w, req->job_id);
    if (j != NULL) {
        rep.dropped = true;
        rep.freed_bytes = j->bytes;
        stria__job_drop_locked(w, j);
    }
    pthread_mutex_unlock(&w->lock);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- registration and heartbeats ---------------------------------------------- */

static stria_status_t stria__register(stria_worker_t *w)
{
    Stria__V1__RegisterWorkerRequest req = STRIA__V1__REGISTER_WORKER_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.rpc_address = w->rpc_address;
    req.ucx_address = w->ucx_address;
    req.host = w->host;
    req.device = (char *)stria_device_name(w->dev);
    req.memory_bytes = (uint64_t)w->cfg.memory_bytes;
    req.software_version = (char *)STRIA_VERSION;
    req.kernel_variant = (char *)stria_kernels_variant();
    req.incarnation = w->incarnation;
    stria_status_t st =
        stria__coord_call(w, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &req.base, &reply);
    if (st != STRIA_OK)
        return st;
    Stria__V1__RegisterWorkerReply *r = (Stria__V1__RegisterWorkerReply *)reply.msg;
    pthread_mutex_lock(&w->lock);
    w->worker_id = r->worker_id;
    w->heartbeat_ms = r->heartbeat_period_ms > 0 ? r->heartbeat_period_ms : 1000;
    w->registered = true;
    w->last_heartbeat = stria_time_now();
    pthread_mutex_unlock(&w->lock);
    stria_log_info("registered with coordinator %s as worker %llu%s (heartbeat %u ms)",
                   w->cfg.coordinator, (unsigned long long)r->worker_id,
                   r->rejoined ? ", rejoined" : "", r->heartbeat_period_ms);
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

static stria_status_t stria__heartbeat(stria_worker_t *w)
{
    Stria__V1__HeartbeatRequest req = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__WorkerJobStatus *st_arr = NULL, **st_ptrs = NULL;
    size_t n = 0;
    stria_rpc_reply_t reply;
    stria_status_t st;

    pthread_mutex_lock(&w->lock);
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        n++;
    st_arr = calloc(n + 1, sizeof(*st_arr));
    st_ptrs = calloc(n + 1, sizeof(*st_ptrs));
    if (st_arr == NULL || st_ptrs == NULL) {
        pthread_mutex_unlock(&w->lock);
        free(st_arr);
        free(st_ptrs);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "heartbeat: out of memory");
    }
    size_t i = 0;
    double now = stria_time_now();
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next, i++) {
        Stria__V1__WorkerJobStatus init = STRIA__V1__WORKER_JOB_STATUS__INIT;
        st_arr[i] = init;
        st_arr[i].job_id = j->id;
        st_arr[i].phase = j->phase;
        st_arr[i].step = j->step;
        st_arr[i].steps_total = j->steps_total;
        double idle = j->running ? 0.0 : (now - j->last_activity) * 1000.0;
        st_arr[i].idle_ms = idle > 4e9 ? 4000000000u : (uint32_t)idle;
        st_ptrs[i] = &st_arr[i];
    }
    req.worker_id = w->worker_id;
    req.memory_in_use_bytes = w->memory_used;
    pthread_mutex_unlock(&w->lock);
    req.incarnation = w->incarnation;
    req.n_jobs = n;
    req.jobs = st_ptrs;
    st = stria__coord_call(w, STRIA_RPC_COORDINATOR_HEARTBEAT, &req.base, &reply);
    free(st_arr);
    free(st_ptrs);
    if (st != STRIA_OK)
        return st;
    Stria__V1__HeartbeatReply *r = (Stria__V1__HeartbeatReply *)reply.msg;
    pthread_mutex_lock(&w->lock);
    w->last_heartbeat = stria_time_now();
    if (r->heartbeat_period_ms > 0)
        w->heartbeat_ms = r->heartbeat_period_ms;
    for (size_t d = 0; d < r->n_drop_job_ids; d++) {
        stria__wjob_t *j = stria__job_find(w, r->drop_job_ids[d]);
        if (j != NULL) {
            stria_log_info("job %llu: dropped at the coordinator's request",
                           (unsigned long long)j->id);
            stria__job_drop_locked(w, j);
        }
    }
    pthread_mutex_unlock(&w->lock);
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

void *stria__heartbeat_thread(void *arg)
{
    stria_worker_t *w = arg;
    bool ready_sent = false, reachable = true;
    double warn_at = 0;
    char status[1400];

    /* Until it is registered the worker serves nobody: the service manager
     * hears READY=1 only then. */
    snprintf(status, sizeof(status), "STATUS=registering with the coordinator %s",
             w->cfg.coordinator);
    stria_notify(status);
    pthread_mutex_lock(&w->lock);
    while (!w->heartbeat_stop) {
        bool registered = w->registered;
        pthread_mutex_unlock(&w->lock);
        stria_status_t st = registered ? stria__heartbeat(w) : stria__register(w);
        if (st != STRIA_OK && st != STRIA_ERR_NOT_FOUND)
            stria_metric_add(w->m_err_coord, 1);
        if (st == STRIA_ERR_NOT_FOUND) { /* the coordinator forgot us (restart): register */
            pthread_mutex_lock(&w->lock);
            w->registered = false;
            pthread_mutex_unlock(&w->lock);
            continue;
        }
        if (st != STRIA_OK && stria_time_now() >= warn_at) {
            stria_log_warn("coordinator %s: %s", w->cfg.coordinator, stria_error_msg());
            warn_at = stria_time_now() + 10.0;
        }
        pthread_mutex_lock(&w->lock);
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->lock);
        if (st == STRIA_OK && (!ready_sent || !reachable) && !stopping) {
            snprintf(status, sizeof(status),
                     "%sSTATUS=worker %llu serving %s, ring link %s, coordinator %s",
                     ready_sent ? "" : "READY=1\n", (unsigned long long)w->worker_id,
                     w->rpc_address, w->ucx_address, w->cfg.coordinator);
            stria_notify(status);
            ready_sent = true;
        } else if (st != STRIA_OK && ready_sent && reachable && !stopping) {
            snprintf(status, sizeof(status), "STATUS=worker %llu: coordinator %s unreachable",
                     (unsigned long long)w->worker_id, w->cfg.coordinator);
            stria_notify(status);
        }
        reachable = st == STRIA_OK;
        pthread_mutex_lock(&w->lock);
        stria_metric_set(w->m_hb_age, w->registered ? stria_time_now() - w->last_heartbeat : -1);
        size_t njobs = 0;
        for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
            njobs++;
        stria_metric_set(w->m_jobs, (double)njobs);
        double period = (st == STRIA_OK ? w->heartbeat_ms : 1000) / 1000.0;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double when = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + period;
        ts.tv_sec = (time_t)when;
        ts.tv_nsec = (long)((when - (double)ts.tv_sec) * 1e9);
        if (!w->heartbeat_stop)
            pthread_cond_timedwait(&w->cv, &w->lock, &ts);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* Waits until no pass runs or `until` (stria_time_now()) passes. Lock held. */
static void stria__wait_passes_locked(stria_worker_t *w, double until)
{
    while (w->running_passes > 0 && stria_time_now() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&w->cv, &w->lock, &ts);
    }
}

/* Graceful shutdown (SIGTERM/SIGINT): no new jobs or passes. A running pass
 * gets one step deadline to end on its own; then its ring link is aborted,
 * which fails its current step cleanly (its peers hear that this rank left)
 * and it ends within a ring link set-up or the release of its transfers. Heartbeats go on
 * meanwhile, so the coordinator does not take the worker for dead; then the worker deregisters,
 * which takes it out of the ring at once and fails its unfinished jobs with a reason naming it.
 * Returns the passes still running. */
int stria__shutdown(stria_worker_t *w, int signum)
{
    char reason[64], status[128];
    snprintf(reason, sizeof(reason), "shut down (%s)",
             signum == SIGTERM  ? "SIGTERM"
             : signum == SIGINT ? "SIGINT"
                                : "signal");
    pthread_mutex_lock(&w->lock);
    w->stopping = true;
    int running = w->running_passes;
    double deadline = w->cfg.step_timeout_s;
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        if (j->running && j->step_timeout_s > deadline)
            deadline = j->step_timeout_s;
    pthread_mutex_unlock(&w->lock);
    if (running > 0) {
        snprintf(status, sizeof(status), "STATUS=shutting down: finishing %d running pass(es)",
                 running);
        stria_notify(status);
        stria_log_info("shutting down: %d running pass(es) get %.1f s to finish", running,
                       deadline);
    }
    pthread_mutex_lock(&w->lock);
    stria__wait_passes_locked(w, stria_time_now() + deadline);
    if (w->running_passes > 0) {
        stria_log_warn("shutting down: aborting %d pass(es) still running", w->running_passes);
        snprintf(w->abort_reason, sizeof(w->abort_reason), "worker %s", reason);
        w->abort_passes = true;
        for (size_t i = 0; i < w->n_links; i++)
            stria_link_abort(w->links[i], STRIA_ERR_CANCELLED, w->abort_reason);
        /* An aborted pass ends within a ring link set-up, or once the
         * transport has its transfers in flight back (seconds each). */
        stria__wait_passes_locked(w, stria_time_now() + w->cfg.connect_timeout_s + 25.0);
    }
    int still_running = w->running_passes;
    w->heartbeat_stop = true;
    pthread_cond_broadcast(&w->cv);
    bool registered = w->registered;
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->hb_thread, NULL);
    if (!registered)
        return still_running;

    Stria__V1__DeregisterWorkerRequest req = STRIA__V1__DEREGISTER_WORKER_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.worker_id = w->worker_id;
    req.incarnation = w->incarnation;
    req.reason = reason;
    stria_status_t st =
        stria__coord_call(w, STRIA_RPC_COORDINATOR_DEREGISTER_WORKER, &req.base, &reply);
    if (st == STRIA_OK) {
        const Stria__V1__DeregisterWorkerReply *r =
            (const Stria__V1__DeregisterWorkerReply *)reply.msg;
        stria_log_info("deregistered from coordinator %s (%u unfinished job(s) failed)",
                       w->cfg.coordinator, r->jobs_failed);
        stria_rpc_reply_free(&reply);
        return still_running;
    }
    /* An older coordinator, or none: report each held job instead, so that
     * whoever is there fails them with a reason. */
    stria_log_warn("cannot deregister from coordinator %s: %s", w->cfg.coordinator,
                   stria_error_msg());
    size_t n = 0, k = 0;
    pthread_mutex_lock(&w->lock);
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        n++;
    stria__wjob_t *held = calloc(n + 1, sizeof(*held)); /* copies: ids, ranks, steps */
    for (stria__wjob_t *j = w->jobs; j != NULL && held != NULL; j = j->next)
        if (j->phase != STRIA__V1__JOB_STATE__JOB_STATE_DONE)
            held[k++] = *j;
    pthread_mutex_unlock(&w->lock);
    for (size_t i = 0; i < k; i++)
        stria__report(w, &held[i], STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED, reason);
    free(held);
    return still_running;
}

/* ---- configuration --------------------------------------------------------------- */

void stria__metrics_init(stria_worker_t *w)
{
    static const double step_buckets[] = {0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30};
    static const double pass_buckets[] = {0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120, 600};
    static const char *const pass_labels[2] = {"pass=\"forward\"", "pass=\"backward\""};
    stria_metrics_t *m = w->metrics;
    for (int b = 0; b < 2; b++) {
        w->m_passes[b] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_passes_total",
                              "Ring passes run by this worker.", pass_labels[b], NULL, 0);
        w->m_pass_fail[b] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_pass_failures_total",
                              "Ring passes that failed.", pass_labels[b], NULL, 0);
        w->m_pass_s[b] = stria_metrics_get(m, STRIA_METRIC_HISTOGRAM, "stria_worker_pass_seconds",
                                           "Wall time of a ring pass.", pass_labels[b],
                                           pass_buckets, sizeof(pass_buckets) / sizeof(double));
    }
    w->m_step_compute = stria_metrics_get(m, STRIA_METRIC_HISTOGRAM, "stria_worker_step_seconds",
                                          "Time of one ring step, by kind.", "kind=\"compute\"",
                                          step_buckets, sizeof(step_buckets) / sizeof(double));
    w->m_step_wait = stria_metrics_get(m, STRIA_METRIC_HISTOGRAM, "stria_worker_step_seconds",
                                       "Time of one ring step, by kind.", "kind=\"communication\"",
                                       step_buckets, sizeof(step_buckets) / sizeof(double));
    w->m_bytes_sent =
        stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_bytes_total",
                          "Bytes moved over the ring link.", "direction=\"sent\"", NULL, 0);
    w->m_bytes_recv =
        stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_bytes_total",
                          "Bytes moved over the ring link.", "direction=\"received\"", NULL, 0);
    w->m_in_bytes =
        stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_rpc_bytes_total",
                          "Tensor bytes moved to and from clients.", "direction=\"in\"", NULL, 0);
    w->m_out_bytes =
        stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_rpc_bytes_total",
                          "Tensor bytes moved to and from clients.", "direction=\"out\"", NULL, 0);
    w->m_memory =
        stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_memory_in_use_bytes",
                          "Memory reserved by the jobs this worker holds.", NULL, NULL, 0);
    w->m_jobs = stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_jobs",
                                  "Jobs held by this worker.", NULL, NULL, 0);
    w->m_hb_age = stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_heartbeat_age_seconds",
                                    "Seconds since the last heartbeat the coordinator answered "
                                    "(-1: not registered).",
                                    NULL, NULL, 0);
    static const char *const err_help = "Errors, by kind: step_timeout (a ring step missed its "
                                        "deadline), peer (a ring peer failed or left), pass "
                                        "(another pass failure), coordinator (a call to the "
                                        "coordinator failed).";
    w->m_err_timeout = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                         err_help, "kind=\"step_timeout\"", NULL, 0);
    w->m_err_peer = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                      err_help, "kind=\"peer\"", NULL, 0);
    w->m_err_pass = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                      err_help, "kind=\"pass\"", NULL, 0);
    w->m_err_coord = stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_errors_total",
                                       err_help, "kind=\"coordinator\"", NULL, 0);
    for (int b = 0; b < 2; b++)
        w->m_steps[b] =
            stria_metrics_get(m, STRIA_METRIC_COUNTER, "stria_worker_ring_steps_total",
                              "Ring steps run by this worker.", pass_labels[b], NULL, 0);
    char info[512], dev[128], kern[64];
    stria_metrics_escape(stria_device_name(w->dev), dev, sizeof(dev));
    stria_metrics_escape(stria_kernels_variant(), kern, sizeof(kern));
    snprintf(info, sizeof(info), "version=\"%s\",device=\"%s\",kernel=\"%s\"", STRIA_VERSION, dev,
             kern);
    stria_metric_set(stria_metrics_get(m, STRIA_METRIC_GAUGE, "stria_worker_info",
                                       "Constant 1, labelled with the software version, the "
                                       "device and the kernel variant.",
                                       info, NULL, 0),
                     1);
}
