/* The worker's calls to the coordinator (one connection, one call at a
 * time) and the reports of a job's calls: a call's outcome right away from
 * its pass thread, or a failure queued for the heartbeat thread where the
 * thread that saw it must not wait for the coordinator. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker_int.h"

#define COORD_TIMEOUT_S 5.0

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
        p.connect_timeout_s = COORD_TIMEOUT_S;
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
    rq.timeout_s = COORD_TIMEOUT_S;
    memset(reply, 0, sizeof(*reply));
    st = stria_rpc_client_call(w->coord, &rq, reply);
    if (st == STRIA_OK)
        w->coord_session = reply->session;
    pthread_mutex_unlock(&w->coord_lock);
    return st;
}

void stria__wcoord_report(stria_worker_t *w, const stria__wreport_t *r, stria__wverdict_t *out)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    stria__wverdict_t v = {.state = STRIA__V1__JOB_STATE__JOB_STATE_UNSPECIFIED,
                           .retryable = r->retryable};
    stria_rpc_reply_t reply;
    req.worker_id = w->worker_id;
    req.job_id = r->job_id;
    req.rank = (uint32_t)r->rank;
    req.event = r->event;
    req.message = (char *)(r->message ? r->message : "");
    req.step = r->step;
    req.steps_total = r->steps_total;
    req.timeline = r->timeline;
    req.pass = r->pass;
    req.started_ms = r->started_ms;
    req.retryable = r->retryable;
    if (stria__wcoord_call(w, STRIA_RPC_COORDINATOR_REPORT_JOB, &req.base, &reply) == STRIA_OK) {
        const Stria__V1__ReportJobReply *rep = (const Stria__V1__ReportJobReply *)reply.msg;
        v.state = rep->state;
        /* over at the coordinator: its verdict stands (the first failure it
         * recorded; a cancelled or expired job is not worth another try) */
        if (v.state == STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
            v.retryable = rep->failure_retryable;
        else if (v.state > STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
            v.retryable = false;
        v.failure_status = (stria_status_t)rep->failure_status;
        snprintf(v.failure, sizeof(v.failure), "%s", rep->failure ? rep->failure : "");
        stria_rpc_reply_free(&reply);
    } else {
        stria_log_warn("job %llu rank %d: cannot report to the coordinator: %s",
                       (unsigned long long)r->job_id, r->rank, stria_error_msg());
    }
    if (out != NULL)
        *out = v;
}

static void later(stria_worker_t *w, stria__wlater_t *l)
{
    pthread_mutex_lock(&w->lock);
    l->next = w->later;
    w->later = l;
    pthread_cond_broadcast(&w->cv); /* the heartbeat thread reports it */
    pthread_mutex_unlock(&w->lock);
}

void stria__wcoord_fail_later(stria_worker_t *w, uint64_t job_id, int rank, bool retryable,
                              const char *message)
{
    stria__wlater_t *l = calloc(1, sizeof(*l));
    stria_log_warn("job %llu: %s", (unsigned long long)job_id, message);
    if (l == NULL) /* the job then fails at the coordinator by its TTL */
        return;
    l->job_id = job_id;
    l->rank = rank;
    l->event = STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED;
    l->retryable = retryable;
    snprintf(l->message, sizeof(l->message), "%s", message);
    later(w, l);
}

void stria__wcoord_arrived_later(stria_worker_t *w, uint64_t job_id, int rank, uint64_t pass,
                                 bool backward)
{
    stria__wlater_t *l = calloc(1, sizeof(*l));
    if (l == NULL) /* the other ranks' wait then names this one */
        return;
    l->job_id = job_id;
    l->rank = rank;
    l->event = backward ? STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED
                        : STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED;
    l->pass = pass;
    later(w, l);
}

void stria__wcoord_report_later(stria_worker_t *w)
{
    pthread_mutex_lock(&w->lock);
    stria__wlater_t *l = w->later, *oldest = NULL;
    w->later = NULL;
    pthread_mutex_unlock(&w->lock);
    while (l != NULL) { /* newest first: turned around */
        stria__wlater_t *next = l->next;
        l->next = oldest;
        oldest = l;
        l = next;
    }
    while (oldest != NULL) {
        stria__wlater_t *next = oldest->next;
        const bool failed = oldest->event == STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED;
        const stria__wreport_t r = {.job_id = oldest->job_id,
                                    .rank = oldest->rank,
                                    .event = oldest->event,
                                    .message = failed ? oldest->message : NULL,
                                    .pass = (uint32_t)oldest->pass,
                                    .retryable = oldest->retryable};
        stria__wcoord_report(w, &r, NULL);
        free(oldest);
        oldest = next;
    }
}
