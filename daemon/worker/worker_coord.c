/* The worker's side of the coordinator: calls, job reports, registration,
 * heartbeats (which carry the drops the coordinator asks for) and the
 * heartbeat thread. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker_int.h"

#define STRIA__COORD_TIMEOUT_S 5.0

/* ---- coordinator calls ----------------------------------------------------- */

stria_status_t stria__wcoord_call(stria_worker_t *w, uint32_t method, const ProtobufCMessage *req,
                                  stria_rpc_reply_t *reply)
{
    stria_status_t st;
    pthread_mutex_lock(&w->coord_lock);
    if (w->coord == NULL) {
        stria_rpc_client_params_t p;
        memset(&p, 0, sizeof(p));
        p.address = w->coordinator;
        p.service = &stria__v1__coordinator__descriptor;
        p.token = w->worker_token;
        p.client_name = "stria-worker";
        p.connect_timeout_s = STRIA__COORD_TIMEOUT_S;
        st = stria_rpc_client_connect(&p, &w->coord);
        if (st != STRIA_OK) {
            pthread_mutex_unlock(&w->coord_lock);
            return stria_error_wrap(st, "coordinator %s", w->coordinator);
        }
    }
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.timeout_s = STRIA__COORD_TIMEOUT_S;
    memset(reply, 0, sizeof(*reply));
    st = stria_rpc_client_call(w->coord, &rq, reply);
    if (st == STRIA_OK)
        w->coord_session = reply->session;
    pthread_mutex_unlock(&w->coord_lock);
    return st;
}

/* Reports an event of job j (a STARTED one with the pass number and, into
 * `arrival`, whether every rank has arrived; a DONE or FAILED one with the
 * pass's step times); returns the job's state at the coordinator after the
 * report (a terminal one: the job is over there), or JOB_STATE_UNSPECIFIED
 * when the coordinator could not be told. */
static Stria__V1__JobState stria__report(stria_worker_t *w, const stria__wjob_t *j,
                                         Stria__V1__ReportJobRequest__Event ev, const char *message,
                                         uint32_t pass, stria__warrival_t *arrival,
                                         Stria__V1__PassTimeline *timeline, bool retryable)
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
    req.timeline = timeline;
    req.pass = pass;
    req.retryable = retryable;
    if (arrival != NULL)
        memset(arrival, 0, sizeof(*arrival));
    if (stria__wcoord_call(w, STRIA_RPC_COORDINATOR_REPORT_JOB, &req.base, &reply) == STRIA_OK) {
        const Stria__V1__ReportJobReply *r = (const Stria__V1__ReportJobReply *)reply.msg;
        state = r->state;
        if (arrival != NULL) {
            arrival->all_arrived = r->all_arrived;
            arrival->failure_status = (stria_status_t)r->failure_status;
            arrival->failure_retryable = r->failure_retryable;
            snprintf(arrival->failure, sizeof(arrival->failure), "%s", r->failure);
        }
        stria_rpc_reply_free(&reply);
    } else {
        stria_log_warn("job %llu rank %d: cannot report to the coordinator: %s",
                       (unsigned long long)j->id, j->rank, stria_error_msg());
    }
    return state;
}

Stria__V1__JobState stria__wcoord_report(stria_worker_t *w, const stria__wjob_t *j,
                                         Stria__V1__ReportJobRequest__Event ev, const char *message)
{
    return stria__report(w, j, ev, message, 0, NULL, NULL, false);
}

Stria__V1__JobState stria__wcoord_report_pass(stria_worker_t *w, const stria__wjob_t *j,
                                              Stria__V1__ReportJobRequest__Event ev,
                                              const char *message,
                                              Stria__V1__PassTimeline *timeline)
{
    return stria__report(w, j, ev, message, 0, NULL, timeline, false);
}

bool stria__wcoord_report_failed(stria_worker_t *w, const stria__wjob_t *j, const char *message,
                                 Stria__V1__PassTimeline *timeline, bool retryable)
{
    stria__warrival_t verdict;
    Stria__V1__JobState st = stria__report(w, j, STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED,
                                           message, 0, &verdict, timeline, retryable);
    if (st == STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
        return verdict.failure_retryable;
    if (st > STRIA__V1__JOB_STATE__JOB_STATE_FAILED) /* cancelled, released, expired */
        return false;
    return retryable;
}

Stria__V1__JobState stria__wcoord_report_started(stria_worker_t *w, const stria__wjob_t *j,
                                                 Stria__V1__ReportJobRequest__Event ev,
                                                 uint32_t pass, stria__warrival_t *out)
{
    return stria__report(w, j, ev, NULL, pass, out, NULL, false);
}

void stria__wcoord_report_fails(stria_worker_t *w)
{
    pthread_mutex_lock(&w->lock);
    stria__wfail_t *f = w->fails;
    w->fails = NULL;
    pthread_mutex_unlock(&w->lock);
    while (f != NULL) {
        stria__wfail_t *next = f->next;
        stria__wjob_t job; /* what a report reads of a job */
        memset(&job, 0, sizeof(job));
        job.id = f->job_id;
        job.rank = f->rank;
        stria__wcoord_report(w, &job, STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED,
                             f->message);
        free(f);
        f = next;
    }
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
    req.memory_bytes = (uint64_t)w->memory_bytes;
    req.software_version = (char *)STRIA_VERSION;
    req.kernel_variant = (char *)stria_kernels_variant();
    req.incarnation = w->incarnation;
    req.shm_socket = w->shm_socket;
    req.has_device_index = w->has_device_index;
    req.device_index = w->device_index;
    pthread_mutex_lock(&w->lock);
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        req.held_jobs++;
    req.previous_worker_id = w->worker_id;
    pthread_mutex_unlock(&w->lock);
    stria_status_t st =
        stria__wcoord_call(w, STRIA_RPC_COORDINATOR_REGISTER_WORKER, &req.base, &reply);
    if (st != STRIA_OK)
        return st;
    Stria__V1__RegisterWorkerReply *r = (Stria__V1__RegisterWorkerReply *)reply.msg;
    pthread_mutex_lock(&w->lock);
    w->worker_id = r->worker_id;
    w->heartbeat_ms = r->heartbeat_period_ms > 0 ? r->heartbeat_period_ms : 1000;
    w->registered = true;
    w->describe = true; /* a restarted coordinator rebuilds our jobs from them */
    w->last_heartbeat = stria_time_now();
    pthread_mutex_unlock(&w->lock);
    stria_log_info("registered with coordinator %s as worker %llu%s (heartbeat %u ms)",
                   w->coordinator, (unsigned long long)r->worker_id,
                   r->rejoined ? ", rejoined" : "", r->heartbeat_period_ms);
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

/* The held jobs of a heartbeat, described in full (HeldJob), with what
 * their messages point to. */
typedef struct {
    Stria__V1__HeldJob *arr, **ptrs;
    Stria__V1__JobSpec **specs; /* unpacked, freed with the set */
    uint8_t (*sealed)[2][STRIA_AUTH_SEALED_BYTES];
    size_t n;
} stria__held_t;

#define STRIA__HELD_BYTES (768u << 10) /* of descriptions per heartbeat */

static void stria__held_free(stria__held_t *h)
{
    for (size_t i = 0; h->specs != NULL && i < h->n; i++)
        stria__v1__job_spec__free_unpacked(h->specs[i], NULL);
    free(h->arr);
    free(h->ptrs);
    free(h->specs);
    free(h->sealed);
    memset(h, 0, sizeof(*h));
}

/* Describes up to n held jobs (lock held), their keys sealed under the
 * session of the coordinator's last reply; *all_out: every job fitted. */
static void stria__held_build(stria_worker_t *w, size_t n, const stria_auth_session_t *session,
                              stria__held_t *h, bool *all_out)
{
    size_t bytes = 0;
    memset(h, 0, sizeof(*h));
    *all_out = false;
    h->arr = calloc(n + 1, sizeof(*h->arr));
    h->ptrs = calloc(n + 1, sizeof(*h->ptrs));
    h->specs = calloc(n + 1, sizeof(*h->specs));
    h->sealed = calloc(n + 1, sizeof(*h->sealed));
    if (h->arr == NULL || h->ptrs == NULL || h->specs == NULL || h->sealed == NULL)
        return;
    stria__wjob_t *j = w->jobs;
    for (; j != NULL && h->n < n; j = j->next) {
        if (j->spec_pb == NULL || bytes + j->spec_len > STRIA__HELD_BYTES)
            break;
        Stria__V1__HeldJob *hj = &h->arr[h->n];
        stria__v1__held_job__init(hj);
        hj->spec = stria__v1__job_spec__unpack(NULL, j->spec_len, j->spec_pb);
        if (hj->spec == NULL ||
            stria_auth_seal(session, "held job secret", j->id, j->secret.bytes,
                            h->sealed[h->n][0]) != STRIA_OK ||
            stria_auth_seal(session, "held ring key", j->id, j->ring_key, h->sealed[h->n][1]) !=
                STRIA_OK) {
            if (hj->spec != NULL)
                stria__v1__job_spec__free_unpacked(hj->spec, NULL);
            break;
        }
        h->specs[h->n] = hj->spec;
        hj->job_id = j->id;
        hj->phase = j->phase;
        hj->passes = j->passes;
        hj->replaces = j->replaces;
        hj->generation = j->generation;
        hj->rank = (uint32_t)j->rank;
        hj->job_secret.data = h->sealed[h->n][0];
        hj->job_secret.len = STRIA_AUTH_SEALED_BYTES;
        hj->ring_key.data = h->sealed[h->n][1];
        hj->ring_key.len = STRIA_AUTH_SEALED_BYTES;
        h->ptrs[h->n++] = hj;
        bytes += j->spec_len + 2 * STRIA_AUTH_SEALED_BYTES + 32;
    }
    *all_out = j == NULL || h->n == n;
}

static stria_status_t stria__heartbeat(stria_worker_t *w)
{
    Stria__V1__HeartbeatRequest req = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__WorkerJobStatus *st_arr = NULL, **st_ptrs = NULL;
    Stria__V1__SessionStats *ss_arr = NULL;
    stria__wtimeline_t *tl_arr = NULL;
    size_t n = 0;
    stria_rpc_reply_t reply;
    stria_status_t st;
    stria__held_t held = {0};
    stria_auth_session_t session;
    bool described = false;

    pthread_mutex_lock(&w->coord_lock);
    session = w->coord_session;
    pthread_mutex_unlock(&w->coord_lock);
    pthread_mutex_lock(&w->lock);
    for (stria__wjob_t *j = w->jobs; j != NULL && n < STRIA__HB_MAX_JOBS; j = j->next)
        n++;
    st_arr = calloc(n + 1, sizeof(*st_arr));
    st_ptrs = calloc(n + 1, sizeof(*st_ptrs));
    ss_arr = calloc(n + 1, sizeof(*ss_arr));
    tl_arr = calloc(n + 1, sizeof(*tl_arr));
    if (st_arr == NULL || st_ptrs == NULL || ss_arr == NULL || tl_arr == NULL) {
        pthread_mutex_unlock(&w->lock);
        free(st_arr);
        free(st_ptrs);
        free(ss_arr);
        free(tl_arr);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "heartbeat: out of memory");
    }
    size_t i = 0;
    double now = stria_time_now();
    for (stria__wjob_t *j = w->jobs; j != NULL && i < n; j = j->next, i++) {
        Stria__V1__WorkerJobStatus init = STRIA__V1__WORKER_JOB_STATUS__INIT;
        st_arr[i] = init;
        st_arr[i].job_id = j->id;
        st_arr[i].phase = j->phase;
        st_arr[i].step = j->step;
        st_arr[i].steps_total = j->steps_total;
        double idle = j->running ? 0.0 : (now - j->last_activity) * 1000.0;
        st_arr[i].idle_ms = idle > 4e9 ? 4000000000u : (uint32_t)idle;
        if (j->sess != NULL) {
            stria__wsess_stats_locked(j, &ss_arr[i]);
            st_arr[i].session = &ss_arr[i];
            if (stria__wsess_timeline_take_locked(j, &tl_arr[i]))
                st_arr[i].timeline = &tl_arr[i].msg;
        }
        st_ptrs[i] = &st_arr[i];
    }
    req.worker_id = w->worker_id;
    if (w->describe) {
        stria__held_build(w, n, &session, &held, &described);
        req.held_jobs = held.ptrs;
        req.n_held_jobs = held.n;
    }
    pthread_mutex_unlock(&w->lock);
    stria_mempool_stats_t ps;
    stria__wpool_figures(w, &ps);
    req.memory_in_use_bytes = ps.admitted;
    req.pool_reserved_bytes = ps.capacity;
    req.pool_in_use_bytes = ps.in_use;
    req.pool_high_water_bytes = ps.high_water;
    req.pool_committed_bytes = ps.committed;
    stria__wpool_publish(w);
    req.incarnation = w->incarnation;
    req.n_jobs = n;
    req.jobs = st_ptrs;
    st = stria__wcoord_call(w, STRIA_RPC_COORDINATOR_HEARTBEAT, &req.base, &reply);
    free(st_arr);
    free(st_ptrs);
    free(ss_arr);
    for (size_t k = 0; k < n; k++)
        stria__wtimeline_free(&tl_arr[k]);
    free(tl_arr);
    stria__held_free(&held);
    if (st != STRIA_OK)
        return st;
    Stria__V1__HeartbeatReply *r = (Stria__V1__HeartbeatReply *)reply.msg;
    pthread_mutex_lock(&w->lock);
    w->last_heartbeat = stria_time_now();
    /* described in full (else the rest goes in the next heartbeat, at
     * once), unless the coordinator asks again */
    if (w->describe && described)
        w->describe = false;
    if (r->describe_jobs)
        w->describe = true;
    if (r->heartbeat_period_ms > 0)
        w->heartbeat_ms = r->heartbeat_period_ms;
    if (w->draining != r->draining)
        stria_log_info("%s", r->draining ? "draining: sessions move off this worker at their next "
                                           "call"
                                         : "no longer draining");
    w->draining = r->draining;
    for (size_t d = 0; d < r->n_drop_job_ids; d++) {
        stria__wjob_t *j = stria__wjob_find(w, r->drop_job_ids[d]);
        if (j != NULL) {
            stria_log_info("job %llu: dropped at the coordinator's request",
                           (unsigned long long)j->id);
            stria__wjob_drop_locked(w, j);
        }
    }
    pthread_mutex_unlock(&w->lock);
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

void *stria__wcoord_thread(void *arg)
{
    stria_worker_t *w = arg;
    bool ready_sent = false, reachable = true;
    int quick = 0; /* heartbeats sent at once in a row */
    double warn_at = 0;
    char status[1400];

    /* Until it is registered the worker serves nobody: the service manager
     * hears READY=1 only then. */
    snprintf(status, sizeof(status), "STATUS=registering with the coordinator %s", w->coordinator);
    if (w->notify_status)
        stria_notify(status);
    pthread_mutex_lock(&w->lock);
    while (!w->heartbeat_stop) {
        bool registered = w->registered;
        pthread_mutex_unlock(&w->lock);
        if (registered)
            stria__wcoord_report_fails(w);
        stria_status_t st = registered ? stria__heartbeat(w) : stria__register(w);
        if (st != STRIA_OK && st != STRIA_ERR_NOT_FOUND)
            stria_metric_add(w->m_err_coord, 1);
        if (st == STRIA_ERR_NOT_FOUND) { /* the coordinator forgot us (restart): register */
            pthread_mutex_lock(&w->lock);
            w->registered = false;
            pthread_mutex_unlock(&w->lock);
            continue;
        }
        /* Jobs to describe (a restarted coordinator rebuilds them from that):
         * the next heartbeat goes at once, a few times in a row at most. */
        pthread_mutex_lock(&w->lock);
        bool describe_now = st == STRIA_OK && w->describe && w->jobs != NULL && !w->heartbeat_stop;
        pthread_mutex_unlock(&w->lock);
        if (describe_now && ++quick <= 8)
            continue;
        quick = 0;
        if (st != STRIA_OK && stria_time_now() >= warn_at) {
            stria_log_warn("coordinator %s: %s", w->coordinator, stria_error_msg());
            warn_at = stria_time_now() + 10.0;
        }
        pthread_mutex_lock(&w->lock);
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->lock);
        if (st == STRIA_OK && (!ready_sent || !reachable) && !stopping) {
            snprintf(status, sizeof(status),
                     "%sSTATUS=worker %llu serving %s, ring link %s, coordinator %s",
                     ready_sent ? "" : "READY=1\n", (unsigned long long)w->worker_id,
                     w->rpc_address, w->ucx_address, w->coordinator);
            if (w->notify_status)
                stria_notify(status);
            ready_sent = true;
        } else if (st != STRIA_OK && ready_sent && reachable && !stopping) {
            snprintf(status, sizeof(status), "STATUS=worker %llu: coordinator %s unreachable",
                     (unsigned long long)w->worker_id, w->coordinator);
            if (w->notify_status)
                stria_notify(status);
        }
        reachable = st == STRIA_OK;
        pthread_mutex_lock(&w->lock);
        stria_metric_set(w->m_hb_age, w->registered ? stria_time_now() - w->last_heartbeat : -1);
        size_t njobs = 0;
        for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
            njobs++;
        stria_metric_set(w->m_jobs, (double)njobs);
        stria__wmetrics_ring(w);
        stria__wmetrics_heap(w);
        stria__wpool_trim(w);
        /* out of reach: try again every period, at most every second (a
         * restarted coordinator hears of our jobs within its window) */
        uint32_t retry_ms = w->heartbeat_ms > 0 && w->heartbeat_ms < 1000 ? w->heartbeat_ms : 1000;
        double period = (st == STRIA_OK ? w->heartbeat_ms : retry_ms) / 1000.0;
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

void stria__wcoord_leave(stria_worker_t *w, const char *reason)
{
    Stria__V1__DeregisterWorkerRequest req = STRIA__V1__DEREGISTER_WORKER_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.worker_id = w->worker_id;
    req.incarnation = w->incarnation;
    req.reason = (char *)reason;
    stria_status_t st =
        stria__wcoord_call(w, STRIA_RPC_COORDINATOR_DEREGISTER_WORKER, &req.base, &reply);
    if (st == STRIA_OK) {
        const Stria__V1__DeregisterWorkerReply *r =
            (const Stria__V1__DeregisterWorkerReply *)reply.msg;
        stria_log_info("deregistered from coordinator %s (%u unfinished job(s) failed)",
                       w->coordinator, r->jobs_failed);
        stria_rpc_reply_free(&reply);
        return;
    }
    /* An older coordinator, or none: report each held job instead, so that
     * whoever is there fails them with a reason. */
    stria_log_warn("cannot deregister from coordinator %s: %s", w->coordinator, stria_error_msg());
    size_t n = 0, k = 0;
    pthread_mutex_lock(&w->lock);
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        n++;
    stria__wjob_t *held = calloc(n + 1, sizeof(*held)); /* copies: ids, ranks, steps */
    for (stria__wjob_t *j = w->jobs; j != NULL && held != NULL; j = j->next)
        if (j->phase != STRIA__V1__JOB_STATE__JOB_STATE_DONE)
            held[k++] = *j;
    pthread_mutex_unlock(&w->lock);
    for (size_t i = 0; i < k; i++) /* the worker leaves: retryable elsewhere */
        stria__report(w, &held[i], STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED, reason, 0,
                      NULL, NULL, true);
    free(held);
}
