/* libstria's calls to the coordinator: one connection per client, calls
 * tried again while the coordinator restarts; a session's submission and
 * its wait in the queue; what the coordinator says of a session (its state,
 * its failure's verdict, the workers it blames, its replacement); its
 * release. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client_int.h"

/* Whether a failed coordinator call is worth another try: the connection
 * broke or was refused (the coordinator restarts; the next call connects
 * again), or a job-scoped call was answered busy because a restarted
 * coordinator is still rebuilding its jobs. */
static bool transient(stria_client_t *c, uint32_t method, stria_status_t st)
{
    if (!stria_rpc_client_server_error(c->coord))
        return st == STRIA_ERR_CLOSED || st == STRIA_ERR_IO || st == STRIA_ERR_TRANSPORT ||
               st == STRIA_ERR_TIMEOUT;
    return st == STRIA_ERR_BUSY &&
           (method == STRIA_RPC_COORDINATOR_GET_JOB || method == STRIA_RPC_COORDINATOR_RELEASE_JOB);
}

static void pause_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

stria_status_t stria__lcoord_call(stria_client_t *c, uint32_t method, const ProtobufCMessage *req,
                                  const stria_job_secret_t *secret, uint64_t id,
                                  stria_rpc_reply_t *reply, bool patient)
{
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.timeout_s = STRIA__COORD_TIMEOUT_S;
    rq.job_secret = secret;
    rq.job_id = secret != NULL ? id : 0;
    memset(reply, 0, sizeof(*reply));
    double give_up = stria_time_now() + STRIA__RECONNECT_S, pause = 0.1;
    for (int tries = 1;; tries++) {
        stria_status_t st = stria_rpc_client_call(c->coord, &rq, reply);
        if (st == STRIA_OK)
            return STRIA_OK;
        /* one try: but a connection found broken (a coordinator that
         * restarted since) is connected anew at once, once */
        if (!patient && tries == 1 && st != STRIA_ERR_TIMEOUT && transient(c, method, st) &&
            !stria_rpc_client_server_error(c->coord))
            continue;
        if (!patient || !transient(c, method, st) || stria_time_now() >= give_up)
            return stria_error_wrap(st, "coordinator %s%s", c->coordinator,
                                    tries > 1 ? " (out of reach or recovering for too long)" : "");
        pause_s(pause);
        pause = pause * 2 < 1.0 ? pause * 2 : 1.0;
    }
}

/* ---- what the coordinator says of a session ------------------------------------- */

static void info_of(const Stria__V1__JobInfo *j, stria__linfo_t *out)
{
    memset(out, 0, sizeof(*out));
    out->state = j->state;
    out->queue_position = j->queue_position;
    out->step = j->step;
    out->steps_total = j->steps_total;
    out->replaced_by = j->replaced_by;
    out->replacement_pending = j->replacement_pending;
    out->failure_retryable = j->failure_retryable;
    out->failure_status = (stria_status_t)j->failure_status;
    snprintf(out->failure, sizeof(out->failure), "%s", j->failure ? j->failure : "");
    for (size_t i = 0; i < j->n_blamed_worker_ids && out->n_blamed < STRIA__MAX_BLAMED; i++)
        out->blamed[out->n_blamed++] = j->blamed_worker_ids[i];
}

stria_status_t stria__lcoord_info(stria_client_t *c, uint64_t id, const stria_job_secret_t *secret,
                                  bool patient, stria__linfo_t *out, stria_rpc_reply_t *reply)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t local;
    stria_rpc_reply_t *r = reply != NULL ? reply : &local;
    req.job_id = id;
    stria_status_t st =
        stria__lcoord_call(c, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, secret, id, r, patient);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__JobInfo *j = ((const Stria__V1__GetJobReply *)r->msg)->job;
    if (j == NULL) {
        stria_rpc_reply_free(r);
        return stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: empty job info",
                               (unsigned long long)id);
    }
    info_of(j, out);
    if (reply == NULL)
        stria_rpc_reply_free(r);
    return STRIA_OK;
}

/* The coordinator's heartbeat period (its verdicts take 3), or 1 s. */
static double heartbeat_period(stria_client_t *c)
{
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    double period = 1.0;
    if (stria__lcoord_call(c, STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, NULL, 0, &reply, true) ==
        STRIA_OK) {
        uint32_t ms = ((const Stria__V1__GetStatusReply *)reply.msg)->heartbeat_period_ms;
        period = ms > 0 ? ms / 1000.0 : period;
        stria_rpc_reply_free(&reply);
    }
    return period;
}

uint64_t stria__lcoord_replacement(stria_client_t *c, uint64_t id, const stria_job_secret_t *secret,
                                   bool lost)
{
    uint64_t found = 0;
    /* The waits scale with the coordinator's: a verdict takes 3 heartbeat
     * periods, and a failed sharded session waits 6 for one. */
    double period = lost ? heartbeat_period(c) : 1.0;
    double now = stria_time_now();
    double give_up = now + fmax(STRIA__REPLACE_WAIT_S, 10 * period);
    double on_until = lost ? now + fmax(STRIA__VERDICT_WAIT_S, 5 * period) : 0;
    for (int hops = 0; hops < 16;) {
        stria__linfo_t info;
        if (stria__lcoord_info(c, id, secret, true, &info, NULL) != STRIA_OK)
            break;
        bool pending = info.replacement_pending;
        if (found == 0 && info.state < STRIA__V1__JOB_STATE__JOB_STATE_FAILED &&
            stria_time_now() < on_until)
            pending = true; /* the coordinator has not seen the loss yet */
        if (info.replaced_by != 0) {
            found = id = info.replaced_by;
            hops++;
            continue;
        }
        if (!pending || stria_time_now() >= give_up)
            break;
        pause_s(STRIA__POLL_S);
    }
    return found;
}

stria_status_t stria__lcoord_release(stria_client_t *c, uint64_t id,
                                     const stria_job_secret_t *secret, const uint32_t *ranks,
                                     size_t n, bool patient)
{
    Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.job_id = id;
    req.ranks = (uint32_t *)ranks;
    req.n_ranks = n;
    stria_status_t st = stria__lcoord_call(c, STRIA_RPC_COORDINATOR_RELEASE_JOB, &req.base, secret,
                                           id, &reply, patient);
    stria_rpc_reply_free(&reply);
    return st;
}

/* ---- submission ------------------------------------------------------------------- */

/* The protocol's spec of ours (pointing into ours and `win`, `pl`). */
static void spec_to_proto(const stria__lopen_t *o, Stria__V1__JobSpec *spec,
                          Stria__V1__JobSpec__Window *win, Stria__V1__JobSpec__Placement **pl,
                          Stria__V1__JobSpec__Placement *pls)
{
    const stria_job_spec_t *s = &o->js;
    const stria_call_shape_t call = stria__labi_job_call(s);
    stria_call_shape_to_spec(&call, spec, win);
    spec->heads = (uint32_t)s->heads;
    spec->kv_heads = (uint32_t)s->kv_heads;
    spec->head_dim = (uint32_t)s->head_dim;
    spec->dtype = (Stria__V1__Dtype)s->dtype;
    spec->layout = (Stria__V1__Layout)s->layout;
    spec->ring_size = (uint32_t)s->ring_size;
    spec->ttl_s = (uint32_t)ceil(s->ttl_s);
    spec->step_timeout_ms = (uint32_t)ceil(s->step_timeout_s * 1000.0);
    spec->no_queue = s->no_queue;
    spec->label = (char *)(s->label ? s->label : "");
    spec->sharded = o->sharded;
    spec->session = o->session;
    spec->max_held = o->max_held;
    spec->head_group = o->head_group;
    spec->head_groups = o->head_groups;
    spec->head_group_tag = o->head_group_tag;
    spec->arrival_timeout_s = s->arrival_timeout_s;
    spec->placement_fallback = s->placement_fallback;
    for (int r = 0; s->placement_hosts != NULL && r < s->ring_size; r++) {
        stria__v1__job_spec__placement__init(&pls[r]);
        pls[r].host = (char *)s->placement_hosts[r];
        if (s->placement_devices != NULL && s->placement_devices[r] >= 0) {
            pls[r].has_device_index = true;
            pls[r].device_index = (uint32_t)s->placement_devices[r];
        }
        pl[r] = &pls[r];
        spec->n_placement = (size_t)r + 1;
    }
    spec->placement = pl;
}

/* Waits while the submitted session is queued (its state and place as last
 * seen); the coordinator's verdict when it ended there. */
static stria_status_t wait_queued(stria_client_t *c, stria__lsubmit_t *out,
                                  Stria__V1__JobState state, uint32_t qpos,
                                  stria_progress_cb progress, void *arg)
{
    while (state == STRIA__V1__JOB_STATE__JOB_STATE_PENDING) {
        if (progress != NULL)
            progress(arg, STRIA_PHASE_QUEUED, qpos, qpos);
        pause_s(STRIA__POLL_S);
        stria__linfo_t info;
        stria_status_t st = stria__lcoord_info(c, out->id, &out->secret, true, &info, NULL);
        if (st != STRIA_OK)
            return st;
        state = info.state;
        qpos = info.queue_position;
        if (state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
            /* a worker of the queued session died or was drained: retryable */
            out->retryable = info.failure_retryable;
            memcpy(out->blamed, info.blamed, sizeof(out->blamed));
            out->n_blamed = info.n_blamed;
            st = stria_error_set(STRIA_ERR_CANCELLED, "job %llu ended while queued: %s",
                                 (unsigned long long)out->id,
                                 info.failure[0] ? info.failure : "no reason given");
            stria_error_set_retryable(out->retryable);
            return st;
        }
    }
    return STRIA_OK;
}

static stria_status_t submit_once(stria_client_t *c, const stria__lopen_t *o,
                                  const uint64_t *exclude, size_t n_exclude,
                                  stria_progress_cb progress, void *arg, stria__lsubmit_t *out)
{
    Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__JobSpec__Window win = STRIA__V1__JOB_SPEC__WINDOW__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    size_t n_pl = o->js.placement_hosts != NULL ? (size_t)o->js.ring_size : 0;
    Stria__V1__JobSpec__Placement **pl = calloc(n_pl + 1, sizeof(*pl));
    Stria__V1__JobSpec__Placement *pls = calloc(n_pl + 1, sizeof(*pls));
    if (pl == NULL || pls == NULL) {
        free(pl);
        free(pls);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the placement");
    }
    spec_to_proto(o, &spec, &win, pl, pls);
    req.spec = &spec;
    req.exclude_worker_ids = (uint64_t *)exclude;
    req.n_exclude_worker_ids = n_exclude;
    /* sent again as is when the connection breaks: a coordinator that made
     * the job before the reply was lost answers with that job */
    uint8_t key[16];
    if (stria_auth_random(key, sizeof(key)) == STRIA_OK) {
        req.submit_key.data = key;
        req.submit_key.len = sizeof(key);
    }
    stria_status_t st = stria__lcoord_call(c, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, 0,
                                           &out->reply, true);
    free(pl);
    free(pls);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "submit");
    const Stria__V1__SubmitJobReply *sr = (const Stria__V1__SubmitJobReply *)out->reply.msg;
    if (sr->assignment == NULL)
        return stria_error_set(STRIA_ERR_PROTOCOL, "submit: reply without assignment");
    out->id = sr->assignment->job_id;
    out->assignment = sr->assignment;
    if ((st = stria_auth_open(&out->reply.session, "job secret", out->id, sr->job_secret.data,
                              sr->job_secret.len, out->secret.bytes)) != STRIA_OK)
        return st;
    return wait_queued(c, out, sr->state, sr->queue_position, progress, arg);
}

stria_status_t stria__lcoord_submit(stria_client_t *c, const stria__lopen_t *o,
                                    const uint64_t *exclude, size_t n_exclude,
                                    stria_progress_cb progress, void *arg, stria__lsubmit_t *out)
{
    memset(out, 0, sizeof(*out));
    for (int again = 0;; again++) {
        stria_status_t st = submit_once(c, o, exclude, n_exclude, progress, arg, out);
        if (st != STRIA_ERR_NOT_FOUND || out->id == 0 || again >= 3)
            return st;
        stria_rpc_reply_free(&out->reply);
        memset(out, 0, sizeof(*out));
    }
}

stria_status_t stria__lcoord_ring_hosts(stria_client_t *c, char (*hosts)[STRIA__HOST_LEN],
                                        size_t cap, size_t *n_out)
{
    Stria__V1__GetRingRequest req = STRIA__V1__GET_RING_REQUEST__INIT;
    stria_rpc_reply_t r;
    *n_out = 0;
    stria_status_t st =
        stria__lcoord_call(c, STRIA_RPC_COORDINATOR_GET_RING, &req.base, NULL, 0, &r, true);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__GetRingReply *ring = (const Stria__V1__GetRingReply *)r.msg;
    for (size_t i = 0; i < ring->n_members && *n_out < cap; i++) {
        const Stria__V1__RingMember *m = ring->members[i];
        if (m == NULL || m->rank < 0 || m->worker == NULL || m->worker->host == NULL)
            continue;
        snprintf(hosts[*n_out], STRIA__HOST_LEN, "%s", m->worker->host);
        (*n_out)++;
    }
    stria_rpc_reply_free(&r);
    return STRIA_OK;
}
