/* The heartbeat thread: registration with the coordinator, heartbeats
 * (every session's progress and statistics; after a registration, or when
 * asked, each session described in full so that a restarted coordinator
 * rebuilds it), the drops the coordinator names in its replies, the queued
 * failure reports, the gauges of each beat; and the leave at shutdown. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "stria_kernels.h"
#include "worker_int.h"

/* ---- registration ---------------------------------------------------------------- */

static stria_status_t register_worker(stria_worker_t *w)
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
    for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next)
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
    w->describe = true; /* a restarted coordinator rebuilds our sessions from them */
    w->last_heartbeat = stria_time_now();
    pthread_mutex_unlock(&w->lock);
    stria_log_info("registered with coordinator %s as worker %llu%s (heartbeat %u ms)",
                   w->coordinator, (unsigned long long)r->worker_id,
                   r->rejoined ? ", rejoined" : "", r->heartbeat_period_ms);
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

/* ---- heartbeats ------------------------------------------------------------------ */

/* The sessions of a heartbeat described in full (HeldJob), with what their
 * messages point to. */
typedef struct {
    Stria__V1__HeldJob *arr, **ptrs;
    Stria__V1__JobSpec **specs; /* unpacked, freed with the set */
    uint8_t (*sealed)[2][STRIA_AUTH_SEALED_BYTES];
    size_t n;
} held_t;

#define HELD_BYTES (768u << 10) /* of descriptions per heartbeat */

static void held_free(held_t *h)
{
    for (size_t i = 0; h->specs != NULL && i < h->n; i++)
        stria__v1__job_spec__free_unpacked(h->specs[i], NULL);
    free(h->arr);
    free(h->ptrs);
    free(h->specs);
    free(h->sealed);
    memset(h, 0, sizeof(*h));
}

/* Describes up to n held sessions (w->lock held), their keys sealed under
 * the session of the coordinator's last reply; *all_out: every one fitted. */
static void held_build(stria_worker_t *w, size_t n, const stria_auth_session_t *session, held_t *h,
                       bool *all_out)
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
    stria__wsess_t *s = w->sessions;
    for (; s != NULL && h->n < n; s = s->next) {
        if (s->spec_pb == NULL || bytes + s->spec_len > HELD_BYTES)
            break;
        Stria__V1__HeldJob *hj = &h->arr[h->n];
        stria__v1__held_job__init(hj);
        hj->spec = stria__v1__job_spec__unpack(NULL, s->spec_len, s->spec_pb);
        if (hj->spec == NULL ||
            stria_auth_seal(session, "held job secret", s->id, s->secret.bytes,
                            h->sealed[h->n][0]) != STRIA_OK ||
            stria_auth_seal(session, "held ring key", s->id, s->ring_key, h->sealed[h->n][1]) !=
                STRIA_OK) {
            if (hj->spec != NULL)
                stria__v1__job_spec__free_unpacked(hj->spec, NULL);
            break;
        }
        h->specs[h->n] = hj->spec;
        hj->job_id = s->id;
        pthread_mutex_lock(&s->lock);
        hj->phase = s->sh.phase;
        hj->passes = (uint32_t)(s->sh.calls + s->sh.failed);
        pthread_mutex_unlock(&s->lock);
        hj->replaces = s->replaces;
        hj->generation = s->generation;
        hj->rank = (uint32_t)s->rank;
        hj->job_secret.data = h->sealed[h->n][0];
        hj->job_secret.len = STRIA_AUTH_SEALED_BYTES;
        hj->ring_key.data = h->sealed[h->n][1];
        hj->ring_key.len = STRIA_AUTH_SEALED_BYTES;
        h->ptrs[h->n++] = hj;
        bytes += s->spec_len + 2 * STRIA_AUTH_SEALED_BYTES + 32;
    }
    *all_out = s == NULL || h->n == n;
}

static stria_status_t heartbeat(stria_worker_t *w)
{
    Stria__V1__HeartbeatRequest req = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    stria_rpc_reply_t reply;
    held_t held = {0};
    bool described = false;
    size_t n = 0;

    pthread_mutex_lock(&w->coord_lock);
    stria_auth_session_t session = w->coord_session;
    pthread_mutex_unlock(&w->coord_lock);
    pthread_mutex_lock(&w->lock);
    for (stria__wsess_t *s = w->sessions; s != NULL && n < STRIA__HB_MAX_JOBS; s = s->next)
        n++;
    Stria__V1__WorkerJobStatus *st_arr = calloc(n + 1, sizeof(*st_arr));
    Stria__V1__WorkerJobStatus **st_ptrs = calloc(n + 1, sizeof(*st_ptrs));
    Stria__V1__SessionStats *ss_arr = calloc(n + 1, sizeof(*ss_arr));
    stria__wtimeline_t *tl_arr = calloc(n + 1, sizeof(*tl_arr));
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
    for (stria__wsess_t *s = w->sessions; s != NULL && i < n; s = s->next, i++) {
        stria__wsess_status(s, now, &st_arr[i], &ss_arr[i], &tl_arr[i]);
        st_ptrs[i] = &st_arr[i];
    }
    req.worker_id = w->worker_id;
    if (w->describe) {
        held_build(w, n, &session, &held, &described);
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
    stria_status_t st = stria__wcoord_call(w, STRIA_RPC_COORDINATOR_HEARTBEAT, &req.base, &reply);
    free(st_arr);
    free(st_ptrs);
    free(ss_arr);
    for (size_t k = 0; k < n; k++)
        stria__wtimeline_free(&tl_arr[k]);
    free(tl_arr);
    held_free(&held);
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
    if (r->draining && !w->draining && w->ucx != NULL) /* idle endpoints close now */
        stria_ucx_ctx_drop_endpoints(w->ucx, NULL);
    w->draining = r->draining;
    for (size_t d = 0; d < r->n_drop_job_ids; d++) {
        stria__wsess_t *s = stria__wsess_find(w, r->drop_job_ids[d]);
        if (s != NULL) {
            char why[96];
            snprintf(why, sizeof(why),
                     "job %llu is over at the coordinator (cancelled, failed, released or "
                     "expired)",
                     (unsigned long long)s->id);
            stria_log_info("job %llu: dropped at the coordinator's request",
                           (unsigned long long)s->id);
            stria__wsess_drop_locked(s, STRIA_ERR_CANCELLED, why);
        }
    }
    pthread_mutex_unlock(&w->lock);
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

/* The gauges of a beat, the trim of the host pool, and the wait for the
 * next (w->lock held). */
static void between_beats(stria_worker_t *w, stria_status_t st)
{
    stria_metric_set(w->m_hb_age, w->registered ? stria_time_now() - w->last_heartbeat : -1);
    size_t n = 0;
    for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next)
        n++;
    stria_metric_set(w->m_jobs, (double)n);
    stria__wmet_ring(w);
    stria__wmet_heap(w);
    stria__wmet_plans(w);
    stria__wpool_trim(w);
    /* out of reach: try again every period, at most every second (a
     * restarted coordinator hears of our sessions within its window) */
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

void *stria__wbeat_thread(void *arg)
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
            stria__wcoord_report_later(w);
        stria_status_t st = registered ? heartbeat(w) : register_worker(w);
        if (st != STRIA_OK && st != STRIA_ERR_NOT_FOUND)
            stria_metric_add(w->m_err_coord, 1);
        if (st == STRIA_ERR_NOT_FOUND) { /* the coordinator forgot us (restart): register */
            pthread_mutex_lock(&w->lock);
            w->registered = false;
            continue;
        }
        /* Sessions to describe (a restarted coordinator rebuilds them from
         * that): the next heartbeat goes at once, a few times in a row at
         * most. */
        pthread_mutex_lock(&w->lock);
        bool describe_now =
            st == STRIA_OK && w->describe && w->sessions != NULL && !w->heartbeat_stop;
        bool stopping = w->stopping;
        pthread_mutex_unlock(&w->lock);
        if (describe_now && ++quick <= 8) {
            pthread_mutex_lock(&w->lock);
            continue;
        }
        quick = 0;
        if (st != STRIA_OK && stria_time_now() >= warn_at) {
            stria_log_warn("coordinator %s: %s", w->coordinator, stria_error_msg());
            warn_at = stria_time_now() + 10.0;
        }
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
        between_beats(w, st);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* ---- leaving ---------------------------------------------------------------------- */

void stria__wbeat_leave(stria_worker_t *w, const char *reason)
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
    /* An older coordinator, or none: report each held session instead, so
     * that whoever is there fails them with a reason. */
    stria_log_warn("cannot deregister from coordinator %s: %s", w->coordinator, stria_error_msg());
    size_t n = 0, k = 0;
    pthread_mutex_lock(&w->lock);
    for (stria__wsess_t *s = w->sessions; s != NULL; s = s->next)
        n++;
    stria__wreport_t *held = calloc(n + 1, sizeof(*held)); /* ids and ranks */
    for (stria__wsess_t *s = w->sessions; s != NULL && held != NULL; s = s->next) {
        pthread_mutex_lock(&s->lock);
        bool done = s->sh.phase == STRIA__V1__JOB_STATE__JOB_STATE_DONE;
        pthread_mutex_unlock(&s->lock);
        if (!done)
            held[k++] =
                (stria__wreport_t){.job_id = s->id,
                                   .rank = s->rank,
                                   .event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED,
                                   .message = reason,
                                   .retryable = true}; /* the worker leaves: retryable elsewhere */
    }
    pthread_mutex_unlock(&w->lock);
    for (size_t i = 0; i < k; i++)
        stria__wcoord_report(w, &held[i], NULL);
    free(held);
}
