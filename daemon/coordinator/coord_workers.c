/* The coordinator's workers: their table (a worker found by id, forgotten)
 * and their handlers: registration, heartbeats, job reports,
 * deregistration. */
#include "coord_int.h"
#include "stria_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- handlers: workers --------------------------------------------------- */

/* Copies a bounded string field, or returns false. */
static bool stria__copy_str(char dst[STRIA__COORD_STR], const char *src)
{
    size_t n = strlen(src);
    if (n >= STRIA__COORD_STR)
        return false;
    memcpy(dst, src, n + 1);
    return true;
}

static stria_status_t stria__check_address(const char *what, const char *addr)
{
    char host[STRIA__COORD_STR];
    uint16_t port;
    if (addr[0] == '\0')
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s is missing", what);
    if (stria_addr_parse(addr, host, sizeof(host), &port) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "%s", what);
    if (port == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s '%s' has port 0", what, addr);
    return STRIA_OK;
}

stria__cworker_t *stria__cworker_find(stria_coord_t *co, uint64_t id)
{
    return stria__index_get(&co->worker_ids, id, 0);
}

void stria__cworker_forget(stria_coord_t *co, stria__cworker_t *w, const char *why)
{
    uint32_t k = 0;
    stria_log_info("worker %llu (%s, %s) forgotten: %s", (unsigned long long)w->id, w->host,
                   w->rpc_address, why);
    for (uint32_t i = 0; i < co->n_workers; i++)
        if (co->workers[i] != w)
            co->workers[k++] = co->workers[i];
    co->n_workers = k;
    stria__index_del(&co->worker_ids, w->id, 0);
    stria__cmet_worker_forget(co, w);
    stria__recover_worker_gone(co, w);
    w->forgotten = true;
    if (w->job_refs == 0)
        free(w);
}

/* A full table: forgets the dead or departed worker silent longest, if
 * any, to make room for a registration. */
static bool stria__make_room(stria_coord_t *co)
{
    stria__cworker_t *oldest = NULL;
    for (uint32_t i = 0; i < co->n_workers; i++) {
        stria__cworker_t *w = co->workers[i];
        if (w->dead && (oldest == NULL || w->last_seen < oldest->last_seen))
            oldest = w;
    }
    if (oldest == NULL)
        return false;
    stria__cworker_forget(co, oldest, "the worker table is full");
    return true;
}

/* The id of a worker this coordinator does not know: the one it had before
 * (`previous`, from a coordinator that restarted) when no known worker holds
 * it, else the next unused one. */
static uint64_t stria__new_worker_id(stria_coord_t *co, uint64_t previous)
{
    if (previous == 0 || previous >= STRIA__MAX_WORKER_ID ||
        stria__index_get(&co->worker_ids, previous, 0) != NULL)
        return co->next_worker_id++;
    if (previous >= co->next_worker_id)
        co->next_worker_id = previous + 1;
    return previous;
}

void stria__cworker_on_register(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__RegisterWorkerRequest *req =
        STRIA__REQ(Stria__V1__RegisterWorkerRequest, call);
    Stria__V1__RegisterWorkerReply rep = STRIA__V1__REGISTER_WORKER_REPLY__INIT;
    stria__cworker_t *w = NULL, tmp;
    bool rejoined = false;

    memset(&tmp, 0, sizeof(tmp));
    if (stria__check_address("rpc_address", req->rpc_address) != STRIA_OK ||
        stria__check_address("ucx_address", req->ucx_address) != STRIA_OK) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "RegisterWorker: %s", stria_error_msg());
        return;
    }
    if (req->host[0] == '\0' || req->device[0] == '\0' || req->memory_bytes == 0) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "RegisterWorker: host, device and memory_bytes are required");
        return;
    }
    if (!stria__copy_str(tmp.rpc_address, req->rpc_address) ||
        !stria__copy_str(tmp.ucx_address, req->ucx_address) ||
        !stria__copy_str(tmp.host, req->host) || !stria__copy_str(tmp.device, req->device) ||
        !stria__copy_str(tmp.version, req->software_version) ||
        !stria__copy_str(tmp.shm_socket, req->shm_socket) ||
        !stria__copy_str(tmp.kernel_variant, req->kernel_variant)) {
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "RegisterWorker: a string field is longer than %d bytes",
                            STRIA__COORD_STR - 1);
        return;
    }
    for (uint32_t i = 0; i < co->n_workers; i++)
        if (strcmp(co->workers[i]->rpc_address, req->rpc_address) == 0)
            w = co->workers[i];
    if (w != NULL) {
        rejoined = true;
        if (w->incarnation != req->incarnation && !w->left) {
            stria__cmet_count_error(co, STRIA__E_WORKER_RESTARTED);
            stria__cjob_fail_worker(co, w, "restarted and lost the job");
            stria__replace_lost(co, w);
        }
        tmp.id = w->id;
        tmp.reserved = w->reserved;
        tmp.draining = w->draining;
        tmp.registered_ms = w->registered_ms;
        tmp.job_refs = w->job_refs;
        if (strcmp(w->host, tmp.host) != 0)
            stria__cmet_worker_forget(co, w); /* labelled with the old host */
        tmp.m_age = w->m_age;
        tmp.m_in_use = w->m_in_use;
        tmp.m_reserved = w->m_reserved;
        stria_log_info(
            "worker %llu (%s, %s) %s", (unsigned long long)w->id, req->host, req->rpc_address,
            w->left   ? "is back after its shutdown"
            : w->dead ? "rejoins"
                      : (w->incarnation != req->incarnation ? "restarted" : "registers again"));
    } else {
        if (co->n_workers >= co->max_workers && !stria__make_room(co)) {
            stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                                "RegisterWorker: the coordinator already knows %u live workers",
                                co->max_workers);
            return;
        }
        w = calloc(1, sizeof(*w));
        if (w == NULL) {
            stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "RegisterWorker: out of memory");
            return;
        }
        tmp.id = stria__new_worker_id(co, req->previous_worker_id);
        if (stria__index_put(&co->worker_ids, tmp.id, 0, w) != STRIA_OK) {
            free(w);
            stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "RegisterWorker: out of memory");
            return;
        }
        co->workers[co->n_workers++] = w;
        tmp.registered_ms = stria__coord_wall_ms();
        stria_log_info("worker %llu registered: %s, %s, device %s, %llu MiB",
                       (unsigned long long)tmp.id, req->host, req->rpc_address, req->device,
                       (unsigned long long)(req->memory_bytes >> 20));
        if (req->previous_worker_id != 0 && req->previous_worker_id != tmp.id)
            stria_log_warn("worker %llu (%s) was worker %llu before, an id another worker holds "
                           "now (or out of range)",
                           (unsigned long long)tmp.id, req->rpc_address,
                           (unsigned long long)req->previous_worker_id);
    }
    tmp.memory_bytes = req->memory_bytes;
    tmp.incarnation = req->incarnation;
    /* its jobs come in its next heartbeat: nothing new starts there before */
    tmp.awaiting_jobs = req->held_jobs > 0 && stria__recover_active(co);
    tmp.has_device_index = req->has_device_index;
    tmp.device_index = req->device_index;
    tmp.last_seen = stria_time_now();
    *w = tmp;
    rep.worker_id = w->id;
    rep.heartbeat_period_ms = (uint32_t)ceil(co->heartbeat_period_s * 1000.0);
    rep.rejoined = rejoined;
    stria__cjob_schedule(co);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

stria__cworker_t *stria__cworker_of_call(stria_coord_t *co, stria_rpc_call_t *call,
                                         const char *method, uint64_t id, uint64_t incarnation,
                                         bool heartbeat)
{
    stria__cworker_t *w = stria__cworker_find(co, id);
    if (w != NULL && w->incarnation == incarnation && !(heartbeat && w->left))
        return w;
    stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND,
                        "%s: worker %llu (incarnation %llu) is not registered here%s", method,
                        (unsigned long long)id, (unsigned long long)incarnation,
                        heartbeat ? "; register again" : "");
    return NULL;
}

/* Job j starts its forward (`bwd` false) or backward pass, begun at
 * `started_ms` (0: now): it moves to running it and every rank's done flag
 * of that pass clears. Only from the state before the pass (a late or
 * repeated report of a pass that is over changes nothing). */
static void stria__pass_begin(stria__cjob_t *j, bool bwd, uint64_t started_ms)
{
    Stria__V1__JobState running = bwd ? S_RUNNING_BACKWARD : S_RUNNING_FORWARD;
    if (j->state == running)
        return;
    if (bwd && j->times.forward_done_ms == 0)
        j->times.forward_done_ms = stria__coord_wall_ms();
    j->state = running;
    *(bwd ? &j->times.backward_started_ms : &j->times.forward_started_ms) =
        started_ms > 0 ? started_ms : stria__coord_wall_ms();
    *(bwd ? &j->times.backward_done_ms : &j->times.forward_done_ms) = 0;
    for (uint32_t r = 0; r < j->n_ranks; r++)
        *(bwd ? &j->ranks[r].bwd_done : &j->ranks[r].fwd_done) = false;
}

/* Whether job j is where pass `bwd` may begin: loading for the forward,
 * the forward done for the backward. */
static bool stria__pass_due(const stria__cjob_t *j, bool bwd)
{
    return bwd ? j->state == S_FORWARD_DONE : j->state == S_LOADING;
}

void stria__cworker_on_heartbeat(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__HeartbeatRequest *req = STRIA__REQ(Stria__V1__HeartbeatRequest, call);
    Stria__V1__HeartbeatReply rep = STRIA__V1__HEARTBEAT_REPLY__INIT;
    stria__cworker_t *w =
        stria__cworker_of_call(co, call, "Heartbeat", req->worker_id, req->incarnation, true);
    double now = stria_time_now();
    uint64_t *drop;

    if (w == NULL)
        return;
    if (req->n_jobs > STRIA_COORD_MAX_HEARTBEAT_JOBS ||
        req->n_held_jobs > STRIA_COORD_MAX_HEARTBEAT_JOBS) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(
            call, STRIA_ERR_INVALID_ARG, "Heartbeat: %zu job %s, more than the limit of %d",
            req->n_jobs > STRIA_COORD_MAX_HEARTBEAT_JOBS ? req->n_jobs : req->n_held_jobs,
            req->n_jobs > STRIA_COORD_MAX_HEARTBEAT_JOBS ? "entries" : "descriptions",
            STRIA_COORD_MAX_HEARTBEAT_JOBS);
        return;
    }
    drop = calloc(req->n_jobs + req->n_held_jobs + 1, sizeof(*drop));
    if (drop == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "Heartbeat: out of memory");
        return;
    }
    if (w->dead) {
        w->dead = false;
        rep.rejoined = true;
        stria_log_info("worker %llu (%s, %s) is back and rejoins the ring",
                       (unsigned long long)w->id, w->host, w->rpc_address);
    }
    w->last_seen = now;
    w->in_use = req->memory_in_use_bytes;
    w->pool[0] = req->pool_reserved_bytes;
    w->pool[1] = req->pool_in_use_bytes;
    w->pool[2] = req->pool_high_water_bytes;
    w->pool[3] = req->pool_committed_bytes;
    w->current_job = 0;
    w->step = w->steps_total = 0;
    /* descriptions of held jobs (after a restart): rebuild or refuse */
    bool describe = false;
    for (size_t i = 0; i < req->n_held_jobs; i++)
        if (!stria__recover_held(co, call, w, req->held_jobs[i], &describe))
            drop[rep.n_drop_job_ids++] = req->held_jobs[i]->job_id;
    size_t refused = rep.n_drop_job_ids;
    w->awaiting_jobs = false;
    for (size_t i = 0; i < req->n_jobs; i++) {
        const Stria__V1__WorkerJobStatus *js = req->jobs[i];
        stria__cjob_t *j = stria__cjob_find(co, js->job_id);
        int r = j != NULL && !stria__terminal(j->state) ? stria__cjob_rank_of(co, j, w) : -1;
        if (r >= 0) {
            stria__crank_t *cr = &j->ranks[r];
            cr->step = js->step;
            cr->steps_total = js->steps_total;
            if (js->session != NULL) {
                cr->s_calls = js->session->calls;
                cr->s_failed = js->session->failed_calls;
                cr->s_bytes = js->session->bytes;
                cr->s_p50_ms = js->session->call_p50_ms;
                cr->s_p99_ms = js->session->call_p99_ms;
            }
            if (js->timeline != NULL && j->spec.session)
                stria__timeline_store(co, j, (uint32_t)r, js->timeline);
        } else {
            bool known = false; /* refused above: in drop already */
            for (size_t k = 0; k < refused && !known; k++)
                known = drop[k] == js->job_id;
            if (j == NULL && !known && stria__recover_active(co)) {
                /* may be rebuilt yet: kept, described if it was not */
                describe = describe || !stria__recover_pending(co, js->job_id);
                continue;
            }
            if (!known)
                drop[rep.n_drop_job_ids++] = js->job_id;
            continue;
        }
        if (js->phase == S_RUNNING_FORWARD || js->phase == S_RUNNING_BACKWARD) {
            w->current_job = j->id;
            w->step = js->step;
            w->steps_total = js->steps_total;
            /* a job's call under way: its pass is running (its outcome
             * comes with the call's report) */
            bool bwd = js->phase == S_RUNNING_BACKWARD;
            if (!j->spec.session && stria__pass_due(j, bwd))
                stria__pass_begin(j, bwd, 0);
        }
        if (js->idle_ms < 1000.0 * (now - j->last_activity))
            j->last_activity = now - js->idle_ms / 1000.0;
    }
    rep.drop_job_ids = drop;
    rep.heartbeat_period_ms = (uint32_t)ceil(co->heartbeat_period_s * 1000.0);
    rep.draining = w->draining;
    rep.describe_jobs = describe;
    if (rep.rejoined || req->n_held_jobs > 0)
        stria__cjob_schedule(co);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
    free(drop);
}

/* A rank of job j (on worker w) starts a forward (`bwd` false) or backward
 * pass (req: its report); returns whether every rank has arrived at that pass
 * (stria__cjob_arrive). The first rank moves the job to running it. */
static bool stria__pass_started(stria__cjob_t *j, const Stria__V1__ReportJobRequest *req,
                                stria__cworker_t *w, bool bwd)
{
    bool all_arrived = stria__cjob_arrive(j, req->rank, req->pass, bwd);
    /* (a rank's arrival may come after its own or every rank's outcome: the
     * pass then began already) */
    if (stria__pass_due(j, bwd))
        stria__pass_begin(j, bwd, 0);
    w->current_job = j->id;
    return all_arrived;
}

/* A rank of job j (on worker w) finished its pass (its done flag set): when
 * every rank has, the job moves to the pass's done state and it is counted. */
static void stria__pass_done(stria_coord_t *co, stria__cjob_t *j, stria__crank_t *cr,
                             stria__cworker_t *w, bool bwd)
{
    bool all = true;
    *(bwd ? &cr->bwd_done : &cr->fwd_done) = true;
    if (w->current_job == j->id)
        w->current_job = 0;
    for (uint32_t r = 0; r < j->n_ranks; r++)
        all = all && (bwd ? j->ranks[r].bwd_done : j->ranks[r].fwd_done);
    if (all)
        j->arrival_deadline = 0; /* every rank came: none is late */
    if (all && j->state == (bwd ? S_RUNNING_BACKWARD : S_RUNNING_FORWARD)) {
        uint64_t *done_ms = bwd ? &j->times.backward_done_ms : &j->times.forward_done_ms;
        j->state = bwd ? S_DONE : S_FORWARD_DONE;
        *done_ms = stria__coord_wall_ms();
        stria__cmet_count_pass(
            co, bwd, bwd ? j->times.backward_started_ms : j->times.forward_started_ms, *done_ms);
    }
}

void stria__cworker_on_report(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__ReportJobRequest *req = STRIA__REQ(Stria__V1__ReportJobRequest, call);
    Stria__V1__ReportJobReply rep = STRIA__V1__REPORT_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__cjob_find(co, req->job_id);
    stria__crank_t *cr;
    stria__cworker_t *w;

    if (j == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "ReportJob: job %llu is unknown",
                            (unsigned long long)req->job_id);
        return;
    }
    if (req->rank >= j->n_ranks || j->ranks[req->rank].worker->id != req->worker_id) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(
            call, STRIA_ERR_INVALID_ARG, "ReportJob: worker %llu is not rank %u of job %llu",
            (unsigned long long)req->worker_id, req->rank, (unsigned long long)req->job_id);
        return;
    }
    cr = &j->ranks[req->rank];
    w = cr->worker;
    if (stria__terminal(j->state) || j->state == S_PENDING) {
        /* Over (the worker must drop it) or not started (nothing to report). */
        rep.state = j->state;
        rep.failure = j->failure;
        rep.failure_status = j->failure_status;
        rep.failure_retryable = j->failure_retryable;
        stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
        return;
    }
    j->last_activity = stria_time_now();
    cr->step = req->step;
    cr->steps_total = req->steps_total;
    if (req->timeline != NULL)
        stria__timeline_store(co, j, req->rank, req->timeline);
    /* the pass a STARTED or DONE event is of */
    const bool bwd = req->event == STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED ||
                     req->event == STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_DONE;
    switch (req->event) {
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_LOADED:
        cr->loaded = true;
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED:
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED:
        if (bwd && j->state == S_LOADING) {
            stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                                "ReportJob: job %llu cannot run backward before forward",
                                (unsigned long long)j->id);
            return;
        }
        rep.all_arrived = stria__pass_started(j, req, w, bwd);
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_DONE:
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_DONE:
        /* a call's outcome carries its start: the pass began then if no
         * rank's report or heartbeat said so yet */
        if (stria__pass_due(j, bwd))
            stria__pass_begin(j, bwd, req->started_ms);
        stria__pass_done(co, j, cr, w, bwd);
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED:
        stria__cmet_count_error(co, STRIA__E_PASS_FAILED);
        if (stria__cjob_finish(co, j, S_FAILED, "rank %u (worker %llu at %s): %.400s", req->rank,
                               (unsigned long long)w->id, w->rpc_address,
                               req->message[0] ? req->message : "failed without a reason") &&
            req->retryable) {
            stria__cjob_retryable(j, NULL);
            stria__replace_wait(co, j); /* its worker may be the one lost */
        }
        stria__cjob_schedule(co);
        break;
    default:
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "ReportJob: unknown event %d",
                            (int)req->event);
        return;
    }
    rep.state = j->state;
    rep.failure = j->failure;
    rep.failure_status = j->failure_status;
    rep.failure_retryable = j->failure_retryable;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* A worker shutting down: out of the ring now, not after missed heartbeats,
 * and its jobs fail at once with a reason an operator understands. */
void stria__cworker_on_deregister(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__DeregisterWorkerRequest *req =
        STRIA__REQ(Stria__V1__DeregisterWorkerRequest, call);
    Stria__V1__DeregisterWorkerReply rep = STRIA__V1__DEREGISTER_WORKER_REPLY__INIT;
    stria__cworker_t *w = stria__cworker_of_call(co, call, "DeregisterWorker", req->worker_id,
                                                 req->incarnation, false);
    char why[600];

    if (w == NULL)
        return;
    if (strlen(req->reason) > 256) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "DeregisterWorker: reason is longer than 256 bytes");
        return;
    }
    if (!w->left) {
        snprintf(why, sizeof(why), "worker %llu (%s) %.256s", (unsigned long long)w->id,
                 w->rpc_address, req->reason[0] ? req->reason : "shut down");
        for (uint32_t i = 0; i < co->n_jobs; i++) {
            stria__cjob_t *j = co->jobs[i];
            if (stria__terminal(j->state) || !stria__cjob_has_worker(j, w))
                continue;
            if (stria__cjob_finish(co, j, S_FAILED, "%s", why))
                stria__cjob_retryable(j, w);
            rep.jobs_failed++;
        }
        w->left = true;
        w->dead = true;
        w->last_seen = stria_time_now(); /* the retention counts from here */
        w->current_job = 0;
        w->step = w->steps_total = 0;
        w->in_use = 0;
        stria__replace_lost(co, w);
        stria_log_info("worker %llu (%s, %s) left the ring: %s; %u unfinished job(s) failed",
                       (unsigned long long)w->id, w->host, w->rpc_address,
                       req->reason[0] ? req->reason : "shut down", rep.jobs_failed);
        stria__cjob_schedule(co);
    }
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}
