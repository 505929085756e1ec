/* Passes: RunForward/RunBackward, the pass threads, the job's ring pass
 * object and the ring link of each pass. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker_int.h"

/* ---- passes -------------------------------------------------------------------- */

typedef struct {
    stria_worker_t *w;
    stria__wjob_t *job; /* referenced */
    stria_rpc_call_t *call;
    bool backward;
} stria__pass_ctx_t;

/* A tensor of the job as the pass sees it: the host buffer, or its device
 * copy on a staged device. */
static stria_tensor_t stria__wpass_tensor(const stria__wjob_t *j, int t)
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
    stria__wjob_geometry(j, t, &outer, &row);
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
    if (j->dev == NULL) {
        if ((st = stria_device_open(stria_device_name(w->dev), w->pool, &j->dev)) != STRIA_OK)
            return stria_error_wrap(st, "job %llu", (unsigned long long)j->id);
        /* its device buffers, the ring's and their pinned messages: the pools */
        if ((st = stria__wpool_device(w, j->dev)) != STRIA_OK)
            return st;
    }
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

/* ---- the parked link: what a job's pass object is bound to between passes */

static stria_status_t stria__parked_post(stria_link_t *link, uint64_t tag, const void *buf,
                                         size_t len, stria_link_req_t **req_out)
{
    (void)tag, (void)buf, (void)len;
    *req_out = NULL;
    return stria_error_set(STRIA_ERR_CLOSED, "rank %d: no pass runs (parked link)", link->rank);
}

static stria_status_t stria__parked_recv(stria_link_t *link, uint64_t tag, void *buf, size_t len,
                                         stria_link_req_t **req_out)
{
    return stria__parked_post(link, tag, buf, len, req_out);
}

static stria_status_t stria__parked_wait(stria_link_t *link, stria_link_req_t *req,
                                         double timeout_s)
{
    (void)req, (void)timeout_s;
    return stria_error_set(STRIA_ERR_CLOSED, "rank %d: no pass runs (parked link)", link->rank);
}

static void stria__parked_cancel(stria_link_t *link, stria_link_req_t *req)
{
    (void)link, (void)req;
}

static void stria__parked_abort(stria_link_t *link, stria_status_t reason, const char *msg)
{
    (void)link, (void)reason, (void)msg;
}

static void stria__parked_destroy(stria_link_t *link)
{
    (void)link;
}

/* name, isend, irecv, wait, cancel, abort, destroy */
static const stria_link_ops_t stria__parked_ops = {"parked",
                                                   stria__parked_post,
                                                   stria__parked_recv,
                                                   stria__parked_wait,
                                                   stria__parked_cancel,
                                                   stria__parked_abort,
                                                   stria__parked_destroy};

void stria__wpass_park_init(stria__wjob_t *j)
{
    j->parked.ops = &stria__parked_ops;
    j->parked.rank = j->rank;
    j->parked.size = j->n_ranks;
}

void stria__wpass_free(stria__wjob_t *j)
{
    stria_ring_pass_destroy(j->pass);
    j->pass = NULL;
}

/* ---- one pass ------------------------------------------------------------------ */

/* The ring step a pass is at, for heartbeats (and so striactl). */
static void stria__on_step(void *arg, int step, int n_steps)
{
    stria__wjob_t *j = arg;
    pthread_mutex_lock(&j->w->lock);
    j->step = (uint32_t)step;
    j->steps_total = (uint32_t)n_steps;
    pthread_mutex_unlock(&j->w->lock);
}

stria_status_t stria__wjob_connect(stria_worker_t *w, stria__wjob_t *j, uint32_t ring_id,
                                   stria_link_t **link_out)
{
    const stria_worker_link_request_t rq = {.job_id = j->id,
                                            .ring_id = ring_id,
                                            .rank = j->rank,
                                            .size = j->n_ranks,
                                            .next_address = j->next_ucx,
                                            .connect_timeout_s = w->connect_timeout_s,
                                            .key = j->ring_key,
                                            .cancel = &j->connect_cancel};
    return w->factory.connect(w->factory.ctx, &rq, link_out);
}

/* Connects the pass's ring link through the link factory and publishes it,
 * for a drop or a shutdown that cannot wait for the pass any longer. */
static stria_status_t stria__pass_link(stria_worker_t *w, stria__wjob_t *j, uint32_t pass_id,
                                       stria_link_t **link_out)
{
    stria_link_t *link = NULL;
    stria_status_t st = stria__wjob_connect(w, j, pass_id, &link);
    if (st != STRIA_OK)
        return st;
    pthread_mutex_lock(&w->lock);
    stria_link_t **links = stria_grow(w->links, &w->cap_links, w->n_links + 1, sizeof(*links), 8);
    if (links != NULL)
        w->links = links;
    if (w->n_links < w->cap_links) /* else: only its own deadlines end it */
        w->links[w->n_links++] = link;
    j->link = link;
    if (w->abort_passes)
        stria_link_abort(link, STRIA_ERR_CANCELLED, w->abort_reason);
    else if (j->dropped) /* dropped while the link was being set up */
        stria_link_abort(link, STRIA_ERR_CANCELLED, "the job is over at the coordinator");
    pthread_mutex_unlock(&w->lock);
    *link_out = link;
    return STRIA_OK;
}

/* Parks the job's pass object, unpublishes the link and destroys it. */
static void stria__pass_unlink(stria_worker_t *w, stria__wjob_t *j, stria_link_t *link)
{
    if (j->pass != NULL)
        stria_ring_pass_set_link(j->pass, &j->parked); /* cannot fail: no call runs */
    pthread_mutex_lock(&w->lock);
    for (size_t i = 0; i < w->n_links; i++)
        if (w->links[i] == link)
            w->links[i--] = w->links[--w->n_links];
    if (j->link == link)
        j->link = NULL;
    pthread_mutex_unlock(&w->lock);
    stria_link_destroy(link);
}

stria_ring_shape_t stria__wjob_ring_shape(const stria__wjob_t *j, const stria_call_shape_t *c)
{
    return (stria_ring_shape_t){.call = *c,
                                .heads = j->heads,
                                .kv_heads = j->kv_heads,
                                .head_dim = j->head_dim,
                                .dtype = j->dtype};
}

/* The job's pass object: made by its first pass on `link`, rebound to
 * `link` by the later ones. */
static stria_status_t stria__pass_object(stria_worker_t *w, stria__wjob_t *j, stria_link_t *link)
{
    if (j->pass != NULL)
        return stria_ring_pass_set_link(j->pass, link);
    stria_ring_opts_t opts;
    /* the job (and its documents) outlives its pass object */
    stria_ring_shape_t shape = stria__wjob_ring_shape(j, &j->call);
    memset(&opts, 0, sizeof(opts));
    opts.step_timeout_s = j->step_timeout_s;
    opts.pool = w->pool;
    opts.device = j->dev; /* NULL on the host: the pass's own cpu device over w->pool */
    opts.pass_id = 0;     /* every pass has a link of its own */
    opts.step_cb = stria__on_step;
    opts.step_cb_ctx = j;
    opts.host_memory = &w->alloc_host; /* ring buffers and kernel workspaces: the pool */
    stria__wpass_park_init(j);
    return stria_ring_pass_create(link, &shape, j->layout_kind, &opts, &j->pass);
}

/* Runs the pass on the job's pass object and adds up its step statistics. */
static stria_status_t stria__pass_compute(stria_worker_t *w, stria__wjob_t *j, bool backward,
                                          Stria__V1__PassStats *stats)
{
    stria_status_t st;
    stria_tensor_t q = stria__wpass_tensor(j, STRIA__T_Q), k = stria__wpass_tensor(j, STRIA__T_K);
    stria_tensor_t v = stria__wpass_tensor(j, STRIA__T_V), o = stria__wpass_tensor(j, STRIA__T_O);
    float *lse = j->dev != NULL ? j->dbuf[STRIA__T_LSE] : j->buf[STRIA__T_LSE];
    if (!backward) {
        st = stria_ring_fwd(j->pass, &q, &k, &v, &o, lse);
    } else {
        stria_tensor_t g = stria__wpass_tensor(j, STRIA__T_DO),
                       dq = stria__wpass_tensor(j, STRIA__T_DQ);
        stria_tensor_t dk = stria__wpass_tensor(j, STRIA__T_DK),
                       dv = stria__wpass_tensor(j, STRIA__T_DV);
        st = stria_ring_bwd(j->pass, &q, &k, &v, &o, lse, &g, &dq, &dk, &dv);
    }
    size_t n = 0;
    const stria_ring_step_stats_t *ss = stria_ring_pass_stats(j->pass, &n);
    for (size_t i = 0; i < n; i++) {
        stats->compute_seconds += ss[i].compute_wall_s;
        stats->wait_seconds += ss[i].wait_s;
        stats->bytes_sent += ss[i].bytes_sent;
        stria_metric_observe(w->m_step_compute, ss[i].compute_wall_s);
        stria_metric_observe(w->m_step_wait, ss[i].wait_s);
        stria_metric_add(w->m_bytes_sent, (double)ss[i].bytes_sent);
        stria_metric_add(w->m_bytes_recv, (double)ss[i].bytes_recv);
    }
    stats->steps = (uint32_t)stria_ring_pass_steps(j->pass);
    stria_metric_add(w->m_steps[backward ? 1 : 0], (double)stats->steps);
    return st;
}

static stria_status_t stria__run_pass(stria_worker_t *w, stria__wjob_t *j, bool backward,
                                      uint32_t pass_id, Stria__V1__PassStats *stats)
{
    stria_link_t *link = NULL;
    double t0 = stria_time_now();
    stria_status_t st = stria__pass_link(w, j, pass_id, &link);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "ring link to %s", j->next_ucx);
    if (w->dev_staged && (st = stria__stage_in(w, j, backward)) != STRIA_OK) {
        stria_error_wrap(st, "rank %d: staging the inputs on %s", j->rank,
                         stria_device_name(w->dev));
        /* the ring must still hear of it: the other ranks wait for this one */
        stria_link_abort(link, st, stria_error_msg());
    }
    if (st == STRIA_OK && (st = stria__pass_object(w, j, link)) != STRIA_OK)
        stria_link_abort(link, st, stria_error_msg());
    if (st == STRIA_OK) {
        st = stria__pass_compute(w, j, backward, stats);
        if (st == STRIA_OK && j->dev != NULL && (st = stria__stage_out(j, backward)) != STRIA_OK)
            stria_error_wrap(st, "rank %d: fetching the outputs from %s", j->rank,
                             stria_device_name(j->dev));
    }
    stria__pass_unlink(w, j, link);
    stats->seconds = stria_time_now() - t0;
    return st;
}

/* A sharded job's pass starts only when every rank arrived with its inputs
 * (the coordinator counts the STARTED reports of the pass): reports again,
 * with a growing pause, until it says so, the job ended (a rank missed its
 * arrival deadline, or failed), or this worker stops or drops the job. */
static stria_status_t stria__await_ranks(stria_worker_t *w, stria__wjob_t *j, bool backward,
                                         uint32_t pass_id, Stria__V1__JobState state,
                                         stria__warrival_t *arr)
{
    Stria__V1__ReportJobRequest__Event ev =
        backward ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED
                 : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED;
    double start = stria_time_now(), pause = 0.0005;
    for (;;) {
        if (state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
            return stria_error_set(arr->failure_status < 0 ? arr->failure_status
                                                           : STRIA_ERR_CANCELLED,
                                   "%s", arr->failure[0] ? arr->failure : "the job is over");
        if (state != STRIA__V1__JOB_STATE__JOB_STATE_UNSPECIFIED && arr->all_arrived)
            return STRIA_OK;
        pthread_mutex_lock(&w->lock);
        bool gone = w->abort_passes || j->dropped;
        pthread_mutex_unlock(&w->lock);
        if (gone)
            return stria_error_set(STRIA_ERR_CANCELLED,
                                   "rank %d: the job was dropped while it waited for the other "
                                   "ranks",
                                   j->rank);
        if (state == STRIA__V1__JOB_STATE__JOB_STATE_UNSPECIFIED &&
            stria_time_now() - start > j->arrival_timeout_s + 10.0)
            return stria_error_set(STRIA_ERR_TIMEOUT,
                                   "rank %d: the coordinator was out of reach while the rank "
                                   "waited for the others",
                                   j->rank);
        struct timespec ts = {0, (long)(pause * 1e9)};
        nanosleep(&ts, NULL);
        pause = pause * 2 < 0.02 ? pause * 2 : 0.02;
        state = stria__wcoord_report_started(w, j, ev, pass_id, arr);
    }
}

/* Whether a pass that failed with `st` may succeed when the job is
 * submitted again: a ring link that broke or a peer that stalled, vanished
 * or aborted (the coordinator's verdict, when it has one, stands over this:
 * see stria__wcoord_report_failed()); not the rank's own failures (no
 * memory, a bad input, a cancellation). */
static bool stria__pass_retryable(stria_status_t st)
{
    return st == STRIA_ERR_PEER || st == STRIA_ERR_TRANSPORT || st == STRIA_ERR_CLOSED ||
           st == STRIA_ERR_TIMEOUT || st == STRIA_ERR_IO;
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
    stria__warrival_t arrival;
    Stria__V1__JobState at_coord = stria__wcoord_report_started(
        w, j,
        b ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED
          : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED,
        pass_id, &arrival);
    stria_status_t st = STRIA_OK;
    if (j->sharded)
        st = stria__await_ranks(w, j, pc->backward, pass_id, at_coord, &arrival);
    else if (at_coord >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        /* Over at the coordinator (cancelled, say) before the next heartbeat
         * could tell: the pass fails at once on every rank, each of which
         * hears the same in its own report. */
        pthread_mutex_lock(&w->lock);
        stria_log_info("job %llu: over at the coordinator (state %d); dropped",
                       (unsigned long long)j->id, (int)at_coord);
        stria__wjob_drop_locked(w, j);
        pthread_mutex_unlock(&w->lock);
    }
    if (st == STRIA_OK) {
        stria_log_info("job %llu rank %d: %s pass started", (unsigned long long)j->id, j->rank,
                       b ? "backward" : "forward");
        stria__wjob_mem_prepare(j, pc->backward);
        st = stria__run_pass(w, j, pc->backward, pass_id, &stats);
    }
    /* the step times go with the report (not when the pass never ran), read
     * while the job still counts as running: no other pass can start on its
     * pass object */
    stria__wtimeline_t tl;
    bool have_tl =
        j->pass != NULL && stria__wtimeline_build(j, j->pass, pass_id, b == 1, &tl) == STRIA_OK;

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
        stria__wcoord_report_pass(w, j,
                                  b ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_DONE
                                    : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_DONE,
                                  NULL, have_tl ? &tl.msg : NULL);
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
        bool retryable = stria__wcoord_report_failed(w, j, msg, have_tl ? &tl.msg : NULL,
                                                     stria__pass_retryable(st));
        stria_rpc_call_fail_r(pc->call, st, retryable, "%s", msg);
    }
    if (have_tl)
        stria__wtimeline_free(&tl);
    stria__wjob_unref(w, j);
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
    stria_status_t st = stria__wjob_get_checked(w, call, job_id, rank, false, &j);
    if (st != STRIA_OK) {
        stria_rpc_call_fail(call, st, "%s", stria_error_msg());
        return;
    }
    if (j->session) {
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "job %llu is a session: run its calls with SessionCall",
                            (unsigned long long)job_id);
        return;
    }
    /* inputs complete? */
    const int need[2][3] = {{STRIA__T_Q, STRIA__T_K, STRIA__T_V}, {STRIA__T_DO, -1, -1}};
    pthread_mutex_lock(&w->lock);
    for (int i = 0; i < 3; i++) {
        int t = need[backward][i];
        uint64_t total = t >= 0 ? stria__wjob_compact_bytes(j, t) : 0;
        if (t >= 0 && j->received[t].covered < total) {
            uint64_t got = j->received[t].covered;
            uint64_t gap = stria_ranges_first_gap(&j->received[t], total);
            pthread_mutex_unlock(&w->lock);
            stria__wjob_unref(w, j);
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
        stria__wjob_unref(w, j);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "job %llu rank %u: backward needs a completed forward pass",
                            (unsigned long long)job_id, rank);
        return;
    }
    if (j->running || w->stopping) {
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->lock);
        stria__wjob_unref(w, j);
        /* a worker that leaves is a cause outside the job */
        stria_rpc_call_fail_r(call, STRIA_ERR_BUSY, stopping,
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
    stria__wjob_unref(w, j);
    stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "cannot start a pass thread");
}

void stria__w_on_forward(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__RunForwardRequest *req =
        (const Stria__V1__RunForwardRequest *)stria_rpc_call_request(call);
    stria__pass_handler(ctx, call, req->job_id, req->rank, false);
}

void stria__w_on_backward(void *ctx, stria_rpc_call_t *call)
{
    const Stria__V1__RunBackwardRequest *req =
        (const Stria__V1__RunBackwardRequest *)stria_rpc_call_request(call);
    stria__pass_handler(ctx, call, req->job_id, req->rank, true);
}
