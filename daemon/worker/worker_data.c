/* The data handlers of the Worker service: PutInput (into the padded
 * buffers, counting each byte once), GetOutput and DropJob. Payloads go from
 * the socket straight into the job's pooled tensors and out of them when the
 * byte range is contiguous there (always without padding; else within one
 * batch row, which is how libstria cuts its chunks); otherwise through
 * staging from the host pool. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker_int.h"

/* ---- PutInput ---------------------------------------------------------------- */

int stria__job_tensor(Stria__V1__Tensor t, bool output)
{
    int first = output ? STRIA__V1__TENSOR__TENSOR_O : STRIA__V1__TENSOR__TENSOR_Q;
    int last = output ? STRIA__V1__TENSOR__TENSOR_DV : STRIA__V1__TENSOR__TENSOR_DO;
    return (int)t >= first && (int)t <= last ? (int)t - 1 : -1;
}

/* State of one PutInput call between its payload callback and its handler
 * (the call's cleanup frees it). */
typedef struct {
    stria_worker_t *w;
    stria_rpc_call_t *call;
    stria__wjob_t *job; /* referenced; NULL until found */
    uint64_t job_id;
    uint32_t rank;
    int tensor;
    uint64_t offset, len, total;
    void *staging; /* when the range is not contiguous in the padded buffer */
    bool handled;  /* the payload arrived whole and the handler ran */
} stria__put_t;

static const char *const stria__input_names[] = {"Q", "K", "V", "dO"};

static void stria__put_cleanup(void *arg)
{
    stria__put_t *p = arg;
    stria_worker_t *w = p->w;
    if (!p->handled && p->job != NULL) {
        /* The connection was lost in the middle of the payload: the client
         * is gone (or broken), and its rank can no longer complete the job,
         * which fails now instead of holding its memory until the TTL. */
        char msg[256];
        pthread_mutex_lock(&w->lock);
        if (!w->stopping && !p->job->dropped) {
            snprintf(msg, sizeof(msg),
                     "rank %d: its client's connection was lost in the middle of an upload "
                     "(%llu bytes of %s at offset %llu)",
                     p->job->rank, (unsigned long long)p->len, stria__input_names[p->tensor],
                     (unsigned long long)p->offset);
            stria__wjob_fail_locked(w, p->job, msg);
        }
        pthread_mutex_unlock(&w->lock);
    }
    stria__wpool_scratch_free(p->w, p->staging);
    if (p->job != NULL)
        stria__wjob_unref(p->w, p->job);
    free(p);
}

/* Checks the range against the job (p->job) and names the buffer the
 * payload goes to: the padded tensor itself when the range is contiguous
 * there, else a staging buffer of at most STRIA__STAGING_MAX bytes. */
static stria_status_t stria__put_buffer(stria__put_t *p, void **buf_out)
{
    stria__wjob_t *j = p->job;
    stria_status_t st = stria_rpc_call_check_job(p->call, &j->secret, j->id);
    if (st != STRIA_OK)
        return st;
    if (j->session)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job %llu is a session: its inputs come with each SessionCall",
                               (unsigned long long)j->id);
    uint64_t total = stria__wjob_compact_bytes(j, p->tensor);
    if (p->total != total || p->offset > total || p->len > total - p->offset)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "PutInput job %llu rank %d tensor %d: bytes [%llu, %llu) of %llu "
                               "do not fit the job's %llu",
                               (unsigned long long)j->id, j->rank, p->tensor,
                               (unsigned long long)p->offset,
                               (unsigned long long)(p->offset + p->len),
                               (unsigned long long)p->total, (unsigned long long)total);
    if (j->running)
        return stria_error_set(STRIA_ERR_BUSY, "job %llu: a pass is running",
                               (unsigned long long)j->id);
    *buf_out = stria__wjob_direct_range(j, p->tensor, p->offset, p->len);
    if (*buf_out != NULL)
        return STRIA_OK;
    if (p->len > STRIA__STAGING_MAX)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "PutInput job %llu: a range that crosses a batch row is limited "
                               "to %u MiB (got %llu bytes); send smaller chunks",
                               (unsigned long long)j->id, STRIA__STAGING_MAX >> 20,
                               (unsigned long long)p->len);
    p->staging = stria__wpool_scratch(p->w, p->len);
    if (p->staging == NULL)
        return stria_error_wrap(STRIA_ERR_NO_MEMORY, "PutInput: staging of %llu bytes",
                                (unsigned long long)p->len);
    *buf_out = p->staging;
    return STRIA_OK;
}

/* A job this worker does not hold yet: its assignment comes from the
 * coordinator, on a thread of its own, so the RPC loop never waits for the
 * coordinator; the connection's payload waits meanwhile. */
static void *stria__put_fetch(void *arg)
{
    stria__put_t *p = arg;
    stria_worker_t *w = p->w;
    void *buf = NULL;
    stria_status_t st = stria__wjob_get(w, p->job_id, p->rank, true, &p->job);
    if (st == STRIA_OK)
        st = stria__put_buffer(p, &buf);
    if (st == STRIA_OK)
        stria_metric_add(w->m_in_bytes, (double)p->len);
    else
        p->handled = true; /* refused, not lost */
    stria_rpc_call_payload_ready(p->call, st, buf, st != STRIA_OK ? stria_error_msg() : NULL);
    pthread_mutex_lock(&w->lock);
    w->fetching--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static stria_status_t stria__put_fetch_start(stria__put_t *p)
{
    stria_worker_t *w = p->w;
    pthread_t th;
    pthread_attr_t attr;
    pthread_mutex_lock(&w->lock);
    if (w->fetching >= STRIA__MAX_FETCHES) {
        pthread_mutex_unlock(&w->lock);
        return stria_error_set(STRIA_ERR_BUSY,
                               "this worker is fetching %d job assignments already; retry",
                               STRIA__MAX_FETCHES);
    }
    w->fetching++;
    pthread_mutex_unlock(&w->lock);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &attr, stria__put_fetch, p);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return STRIA_RPC_PAYLOAD_LATER;
    pthread_mutex_lock(&w->lock);
    w->fetching--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lock);
    return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start a thread");
}

stria_status_t stria__w_on_put_payload(void *ctx, stria_rpc_call_t *call, uint64_t payload_len,
                                       void **buf_out)
{
    stria_worker_t *w = ctx;
    const Stria__V1__PutInputRequest *req =
        (const Stria__V1__PutInputRequest *)stria_rpc_call_request(call);
    int t = stria__job_tensor(req->tensor, false);
    stria_status_t st;

    if (t < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "PutInput: tensor %d is not an input",
                               (int)req->tensor);
    stria__put_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    *p = (stria__put_t){.w = w,
                        .call = call,
                        .job_id = req->job_id,
                        .rank = req->rank,
                        .tensor = t,
                        .offset = req->offset,
                        .len = payload_len,
                        .total = req->total_bytes};
    stria_rpc_call_set_cleanup(call, stria__put_cleanup, p); /* from here on frees p */
    st = stria__wjob_get(w, req->job_id, req->rank, false, &p->job);
    if (st == STRIA_ERR_NOT_FOUND)
        st = stria__put_fetch_start(p);
    else if (st == STRIA_OK)
        st = stria__put_buffer(p, buf_out);
    if (st == STRIA_OK)
        stria_metric_add(w->m_in_bytes, (double)payload_len);
    else if (st != STRIA_RPC_PAYLOAD_LATER)
        p->handled = true; /* refused here, not lost: the job goes on */
    return st;
}

void stria__w_on_put(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__PutInputRequest *req =
        (const Stria__V1__PutInputRequest *)stria_rpc_call_request(call);
    uint64_t len = 0;
    void *payload = stria_rpc_call_payload(call, &len);
    int t = stria__job_tensor(req->tensor, false);
    stria__put_t *p = stria_rpc_call_cleanup_arg(call);
    stria__wjob_t *j;

    if (p != NULL)
        p->handled = true;
    if (len == 0 || payload == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "PutInput without payload bytes");
        return;
    }
    /* the payload callback holds a reference (and checked the job's secret);
     * take another for this handler */
    if (stria__wjob_get(w, req->job_id, req->rank, false, &j) != STRIA_OK) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "%s", stria_error_msg());
        return;
    }
    void *direct = stria__wjob_direct_range(j, t, req->offset, len);
    if (direct != payload) { /* staged: scatter into the padded rows, free the staging now */
        stria__put_t *p = stria_rpc_call_cleanup_arg(call);
        stria__wjob_copy_range(j, t, req->offset, len, payload, true);
        if (p != NULL && p->staging == payload) {
            stria__wpool_scratch_free(w, p->staging);
            p->staging = NULL;
        }
    }
    pthread_mutex_lock(&w->lock);
    stria_status_t st = stria_ranges_add(&j->received[t], req->offset, len);
    j->last_activity = stria_time_now();
    uint64_t got = j->received[t].covered;
    pthread_mutex_unlock(&w->lock);
    if (st != STRIA_OK) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, st, "PutInput job %llu rank %u: %s",
                            (unsigned long long)req->job_id, req->rank, stria_error_msg());
        return;
    }
    uint64_t total = stria__wjob_compact_bytes(j, t);
    Stria__V1__PutInputReply rep = STRIA__V1__PUT_INPUT_REPLY__INIT;
    rep.received_bytes = got;
    rep.complete = got >= total;
    stria__wjob_unref(w, j);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
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
    stria__wpool_scratch_free(g->w, g->copy);
    stria__wjob_unref(g->w, g->job);
    free(g);
}

void stria__w_on_get(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__GetOutputRequest *req =
        (const Stria__V1__GetOutputRequest *)stria_rpc_call_request(call);
    int t = stria__job_tensor(req->tensor, true);
    stria__wjob_t *j;

    if (t < 0) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "GetOutput: tensor %d is not an output",
                            (int)req->tensor);
        return;
    }
    stria_status_t st = stria__wjob_get_checked(w, call, req->job_id, req->rank, false, &j);
    if (st != STRIA_OK) {
        stria_rpc_call_fail(call, st == STRIA_ERR_AUTH ? st : STRIA_ERR_NOT_FOUND, "%s",
                            stria_error_msg());
        return;
    }
    if (j->session) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "job %llu is a session: its outputs come with each SessionCall's reply",
                            (unsigned long long)req->job_id);
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
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "job %llu rank %d: output %d is not ready (run the %s pass first)",
                            (unsigned long long)j->id, j->rank, (int)req->tensor,
                            fwd_out ? "forward" : "backward");
        return;
    }
    uint64_t total = stria__wjob_compact_bytes(j, t);
    uint64_t max = STRIA_RPC_DEFAULT_MAX_PAYLOAD;
    uint64_t n = req->max_bytes > 0 && req->max_bytes < max ? req->max_bytes : max;
    if (req->offset > total) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "GetOutput: offset %llu beyond %llu",
                            (unsigned long long)req->offset, (unsigned long long)total);
        return;
    }
    if (n > total - req->offset)
        n = total - req->offset;
    stria__get_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "out of memory");
        return;
    }
    g->w = w;
    g->job = j;
    void *payload = stria__wjob_direct_range(j, t, req->offset, n);
    if (payload == NULL && n > 0) {
        /* The range crosses batch rows. Memory per reply stays bounded: the
         * rest of this row without a copy when it is large, else a copy of
         * at most STRIA__COPY_MAX bytes; the client asks for what follows. */
        int64_t outer;
        size_t row;
        stria__wjob_geometry(j, t, &outer, &row);
        uint64_t seg = (uint64_t)j->valid * row, left = seg - req->offset % seg;
        if (left >= STRIA__COPY_MAX) {
            n = left;
            payload = stria__wjob_direct_range(j, t, req->offset, n);
        } else if (n > STRIA__COPY_MAX) {
            n = STRIA__COPY_MAX;
        }
    }
    if (payload == NULL && n > 0) {
        g->copy = stria__wpool_scratch(w, n);
        if (g->copy == NULL) {
            stria__get_done(g);
            stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "out of memory");
            return;
        }
        stria__wjob_copy_range(j, t, req->offset, n, g->copy, false);
        payload = g->copy;
    }
    Stria__V1__GetOutputReply rep = STRIA__V1__GET_OUTPUT_REPLY__INIT;
    int64_t outer;
    size_t row;
    stria__wjob_geometry(j, t, &outer, &row);
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

void stria__w_on_drop(void *ctx, stria_rpc_call_t *call)
{
    stria_worker_t *w = ctx;
    const Stria__V1__DropJobRequest *req =
        (const Stria__V1__DropJobRequest *)stria_rpc_call_request(call);
    Stria__V1__DropJobReply rep = STRIA__V1__DROP_JOB_REPLY__INIT;
    pthread_mutex_lock(&w->lock);
    stria__wjob_t *j = stria__wjob_find(w, req->job_id);
    if (j != NULL && stria_rpc_call_check_job(call, &j->secret, req->job_id) != STRIA_OK) {
        pthread_mutex_unlock(&w->lock);
        stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
        return;
    }
    if (j != NULL) {
        rep.dropped = true;
        rep.freed_bytes = j->bytes;
        stria__wjob_drop_locked(w, j);
    }
    pthread_mutex_unlock(&w->lock);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}
