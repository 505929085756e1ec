/* The coordinator's handlers for clients and admins: submit, get, release,
 * cancel, status, ring, lists, drain. */
#include "coord_int.h"
#include "stria_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- handlers: clients --------------------------------------------------- */

/* The client of a call: the host of its peer address, without the port. */
static void stria__client_of(stria_rpc_call_t *call, char *out, size_t cap)
{
    const char *peer = stria_rpc_call_peer(call);
    uint16_t port;
    if (stria_addr_parse(peer, out, cap, &port) != STRIA_OK)
        snprintf(out, cap, "%s", peer);
}

static void stria__count_workers(const stria_coord_t *co, uint32_t *healthy, uint32_t *draining,
                                 uint32_t *dead, uint32_t *left)
{
    *healthy = *draining = *dead = *left = 0;
    for (uint32_t i = 0; i < co->n_workers; i++) {
        const stria__cworker_t *w = co->workers[i];
        if (w->left)
            (*left)++;
        else if (w->dead)
            (*dead)++;
        else if (w->draining)
            (*draining)++;
        else
            (*healthy)++;
    }
}

#define STRIA__MAX_EXCLUDE 1024

/* Removes the workers a request excludes from ring[0 .. count), keeping the
 * others in order; returns how many it removed. */
static uint32_t stria__ring_exclude(stria__cworker_t **ring, uint32_t count, const uint64_t *ids,
                                    size_t n_ids)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < count; i++) {
        bool out = false;
        for (size_t e = 0; e < n_ids && !out; e++)
            out = ring[i]->id == ids[e];
        if (!out)
            ring[k++] = ring[i];
    }
    return count - k;
}

/* The workers of a job's ranks, into chosen[0 .. n): the spec's placement,
 * or a window of the ring. False when refused (the call is answered). */
static bool stria__submit_workers(stria_coord_t *co, stria_rpc_call_t *call,
                                  const Stria__V1__JobSpec *s, stria__cworker_t **ring,
                                  uint32_t count, uint32_t n, const stria_layout_t *layout,
                                  uint64_t need, stria__cworker_t **chosen, bool *fallback,
                                  bool *now)
{
    uint64_t best_cap = 0;
    if (s->n_placement > 0) {
        stria_status_t st = stria__place_named(co, s, ring, count, n, need, chosen, fallback, now);
        if (st == STRIA_OK)
            return true;
        stria__cmet_count_error(co, st == STRIA_ERR_NO_MEMORY ? STRIA__E_SUBMIT_NO_MEMORY
                                                              : STRIA__E_SUBMIT_NO_WORKERS);
        stria_rpc_call_fail(call, st, "SubmitJob: %s", stria_error_msg());
        return false;
    }
    int64_t start = stria__place_window(co, ring, count, n, need, now, &best_cap);
    if (start < 0) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_NO_MEMORY);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY,
                            "SubmitJob: the job needs %llu MiB per rank (%u ranks of %lld tokens) "
                            "but the workers of the best ring of %u offer %llu MiB each; use a "
                            "larger ring, a smaller batch or a shorter sequence",
                            (unsigned long long)(need >> 20), n, (long long)layout->shard_tokens, n,
                            (unsigned long long)(best_cap >> 20));
        return false;
    }
    memcpy(chosen, ring + start, n * sizeof(*chosen));
    return true;
}

/* The checks of a submission before the workers are chosen: the spec, the
 * request's exclusions and key, the client's and the coordinator's job
 * limits. False when refused (the call is answered); `client` is set, and
 * *again to the job of an earlier copy of the submission (a resend), which
 * skips the limits. */
static bool stria__submit_checks(stria_coord_t *co, stria_rpc_call_t *call,
                                 const Stria__V1__SubmitJobRequest *req, char *client, size_t cap,
                                 stria__cjob_t **again)
{
    const Stria__V1__JobSpec *s = req->spec;
    if (s == NULL) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "SubmitJob: the spec is missing");
        return false;
    }
    if (stria__cjob_spec_check(s) != STRIA_OK) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "SubmitJob: %s", stria_error_msg());
        return false;
    }
    if (s->step_timeout_ms > co->max_step_timeout_ms) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "SubmitJob: step_timeout_ms must be at most %u (the coordinator's "
                            "--max-step-timeout) (got %u)",
                            co->max_step_timeout_ms, s->step_timeout_ms);
        return false;
    }
    if (req->n_exclude_worker_ids > STRIA__MAX_EXCLUDE) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "SubmitJob: exclude_worker_ids has %zu entries, more than %d",
                            req->n_exclude_worker_ids, STRIA__MAX_EXCLUDE);
        return false;
    }
    if (req->submit_key.len != 0 && req->submit_key.len != STRIA__SUBMIT_KEY_BYTES) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "SubmitJob: submit_key has %zu bytes (%d, or none)",
                            req->submit_key.len, STRIA__SUBMIT_KEY_BYTES);
        return false;
    }
    stria__client_of(call, client, cap);
    if ((*again = stria__cjob_submitted_before(co, client, &req->submit_key)) != NULL)
        return true; /* a resend: its job counts already */
    if (stria__cjob_count_unfinished(co, client) >= co->max_jobs_per_client) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: client %s holds %u pending or active jobs, the "
                            "coordinator's limit per client (--max-jobs-per-client); release "
                            "some first",
                            client, co->max_jobs_per_client);
        return false;
    }
    uint64_t held = 0;
    if (stria__cjob_count_sessions(co, client, &held) >= co->max_sessions_per_client) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: client %s holds %u open sessions and jobs, the "
                            "coordinator's limit per client (--max-sessions-per-client); close "
                            "some first",
                            client, co->max_sessions_per_client);
        return false;
    }
    if (co->max_session_bytes_per_client > 0 && held >= co->max_session_bytes_per_client) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: client %s's open sessions and jobs hold %llu MiB of "
                            "worker memory, "
                            "the coordinator's limit per client (--max-session-memory-per-client "
                            "%llu MiB); close some first",
                            client, (unsigned long long)(held >> 20),
                            (unsigned long long)(co->max_session_bytes_per_client >> 20));
        return false;
    }
    if (stria__cjob_count_unfinished(co, NULL) >= co->max_jobs) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: %u jobs are pending or active, the coordinator's limit",
                            co->max_jobs);
        return false;
    }
    return true;
}

/* Answers a submission with job j: its state, assignment and queue place,
 * and its secret sealed for this connection; false when that failed (the
 * call is answered). */
static bool stria__submit_reply(stria_coord_t *co, stria_rpc_call_t *call, const stria__cjob_t *j)
{
    Stria__V1__SubmitJobReply rep = STRIA__V1__SUBMIT_JOB_REPLY__INIT;
    uint8_t sealed[STRIA_AUTH_SEALED_BYTES];
    stria__scratch_t b = {0};
    if (stria_auth_seal(stria_rpc_call_session(call), "job secret", j->id, j->secret.bytes,
                        sealed) != STRIA_OK) {
        stria_rpc_call_fail(call, STRIA_ERR_INTERNAL, "SubmitJob: %s", stria_error_msg());
        return false;
    }
    rep.state = j->state;
    rep.assignment = stria__reply_assignment(&b, j);
    rep.queue_position = stria__cjob_queue_position(co, j);
    rep.job_secret.data = sealed;
    rep.job_secret.len = sizeof(sealed);
    stria__reply_send(&b, call, &rep.base);
    stria_auth_wipe(sealed, sizeof(sealed));
    return true;
}

/* Whether every worker of these runs its passes on host memory (device
 * "cpu"), where packed passes run. */
static bool on_host(stria__cworker_t *const *ring, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(ring[i]->device, "cpu") != 0)
            return false;
    return true;
}

void stria__cclient_on_submit(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__SubmitJobRequest *req = STRIA__REQ(Stria__V1__SubmitJobRequest, call);
    const Stria__V1__JobSpec *s = req->spec;
    stria__cworker_t **ring = NULL;
    uint32_t count, n, healthy, draining, dead, left;
    stria_layout_t layout;
    uint64_t need = 0;
    stria__cjob_t *j = NULL;
    stria__cworker_t **chosen = NULL;
    bool now = false, *fallback = NULL;
    char client[64];

    if (!stria__submit_checks(co, call, req, client, sizeof(client), &j))
        return;
    if (j != NULL) {
        stria_log_info("job %llu: its submission came again from %s (the reply was lost): the "
                       "same job answers",
                       (unsigned long long)j->id, client);
        stria__submit_reply(co, call, j);
        return;
    }
    ring = malloc((co->n_workers + 1) * sizeof(*ring));
    if (ring == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "SubmitJob: out of memory");
        return;
    }
    count = stria__place_ring(co, ring);
    uint32_t excluded =
        stria__ring_exclude(ring, count, req->exclude_worker_ids, req->n_exclude_worker_ids);
    count -= excluded;
    stria__count_workers(co, &healthy, &draining, &dead, &left);
    n = s->ring_size ? s->ring_size : count;
    if (count == 0 || n > count) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_NO_WORKERS);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: the job needs %u workers but %u are available (%u "
                            "healthy, %u draining, %u dead, %u left; %u excluded by the "
                            "request)",
                            n ? n : 1, count, healthy, draining, dead, left, excluded);
        goto free_ring;
    }
    /* auto takes packed for documents (a job's, or a session's calls') on
     * workers whose devices run packed passes (host memory) */
    const bool packs = (s->session || s->n_cu_seqlens > 2) && on_host(ring, count);
    if (stria_layout_init(
            stria_layout_kind_resolve((stria_layout_kind_t)s->layout, s->window != NULL, packs),
            (int)n, (int64_t)s->seq_len, &layout) != STRIA_OK) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "SubmitJob: %s", stria_error_msg());
        goto free_ring;
    }
    for (uint32_t r = 0; r < n; r++) {
        if (stria_layout_shard_valid(&layout, (int)r) < 1) {
            stria__cmet_count_error(co, STRIA__E_SUBMIT_INVALID);
            stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                                "SubmitJob: seq_len %llu leaves rank %u of a %u-rank ring "
                                "without tokens; use a longer sequence or a smaller ring_size",
                                (unsigned long long)s->seq_len, r, n);
            goto free_ring;
        }
    }
    if (stria_session_rank_memory(s->batch, layout.shard_tokens, s->heads, s->kv_heads, s->head_dim,
                                  (stria_dtype_t)s->dtype, s->max_held, &need) != STRIA_OK) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_NO_MEMORY);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY,
                            "SubmitJob: the job needs more memory per rank than any worker has "
                            "(%s)",
                            stria_error_msg());
        goto free_ring;
    }
    chosen = calloc(n, sizeof(*chosen));
    fallback = calloc(n, sizeof(*fallback));
    if (chosen == NULL || fallback == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "SubmitJob: out of memory");
        goto free_ring;
    }
    if (!stria__submit_workers(co, call, s, ring, count, n, &layout, need, chosen, fallback, &now))
        goto free_ring;
    if (!now && s->no_queue) {
        stria__cmet_count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: not enough free memory on the workers now (the job needs "
                            "%llu MiB per rank) and no_queue is set",
                            (unsigned long long)(need >> 20));
        goto free_ring;
    }
    stria__cjob_t keys;
    memset(&keys, 0, sizeof(keys));
    if (stria__recover_new_keys(co, &keys, false) == STRIA_OK)
        j = stria__cjob_add(co, s, &layout, chosen, fallback, n, need, client, &keys);
    stria_auth_wipe(&keys, sizeof(keys));
    if (j == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "SubmitJob: out of memory or no secret");
        goto free_ring;
    }
    if (req->submit_key.len == STRIA__SUBMIT_KEY_BYTES) {
        memcpy(j->submit_key, req->submit_key.data, sizeof(j->submit_key));
        j->keyed = true;
    }
    stria__cmet_count_submitted(co);
    stria_log_info("job %llu submitted: batch %u, seq %llu, heads %u/%u, dim %u, %s, %u ranks "
                   "from worker %llu%s, %llu MiB per rank%s%s",
                   (unsigned long long)j->id, j->spec.batch, (unsigned long long)j->spec.seq_len,
                   j->spec.heads, j->spec.kv_heads, j->spec.head_dim,
                   stria_dtype_name((stria_dtype_t)j->spec.dtype), n,
                   (unsigned long long)chosen[0]->id, j->placed ? " (placed)" : "",
                   (unsigned long long)(need >> 20), j->spec.sharded ? ", sharded" : "",
                   now ? "" : ", queued");
    stria__cjob_schedule(co);
    if (!stria__submit_reply(co, call, j))
        stria__cjob_finish(co, j, S_FAILED, "the job's secret could not be sealed for its client");
free_ring:
    free(ring);
    free(chosen);
    free(fallback);
}

/* Whether the call proves job j's secret; false after failing the call. */
static bool stria__job_proven(stria_rpc_call_t *call, const stria__cjob_t *j)
{
    if (stria_rpc_call_check_job(call, &j->secret, j->id) == STRIA_OK)
        return true;
    stria_rpc_call_fail(call, STRIA_ERR_AUTH, "%s", stria_error_msg());
    return false;
}

/* Who may see a job, and how: its owner (a proof of its secret: renews its
 * TTL), an admin (a view), a worker (its keys, sealed for the connection).
 * Returns false after failing the call. */
static bool stria__get_job_access(stria_rpc_call_t *call, const Stria__V1__GetJobRequest *req,
                                  stria__cjob_t *j, bool *owner, uint8_t *secret, uint8_t *ring)
{
    unsigned roles = stria_rpc_call_roles(call);
    const stria_auth_session_t *session = stria_rpc_call_session(call);
    *owner = false;
    if (req->job_proof.len > 0 || !(roles & (STRIA_RPC_ROLE_ADMIN | STRIA_RPC_ROLE_WORKER))) {
        if (!stria__job_proven(call, j))
            return false;
        *owner = true;
    }
    if ((roles & STRIA_RPC_ROLE_WORKER) &&
        (stria_auth_seal(session, "job secret", j->id, j->secret.bytes, secret) != STRIA_OK ||
         stria_auth_seal(session, "ring key", j->id, j->ring_key, ring) != STRIA_OK)) {
        stria_rpc_call_fail(call, STRIA_ERR_INTERNAL, "GetJob: %s", stria_error_msg());
        return false;
    }
    return true;
}

/* A job id the coordinator does not know: not found, or, while it rebuilds
 * its jobs after a restart, busy to an owner's call (`owner`: it proves a
 * secret, and libstria waits and tries again: the job may be rebuilt yet);
 * an admin's view or cancel is answered not found, saying so. */
static void stria__unknown_job(const stria_coord_t *co, stria_rpc_call_t *call, const char *method,
                               uint64_t id, bool owner)
{
    if (stria__recover_active(co) && owner)
        stria_rpc_call_fail_r(call, STRIA_ERR_BUSY, true,
                              "%s: job %llu is not known yet: the coordinator restarted and "
                              "rebuilds its jobs from the workers' reports for %.1f s more; try "
                              "again",
                              method, (unsigned long long)id, stria__recover_left(co));
    else if (stria__recover_active(co))
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND,
                            "%s: job %llu is unknown (the coordinator restarted and rebuilds its "
                            "jobs from the workers' reports for %.1f s more)",
                            method, (unsigned long long)id, stria__recover_left(co));
    else
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "%s: job %llu is unknown", method,
                            (unsigned long long)id);
}

/* The job a call names, or NULL after failing the call (stria__unknown_job). */
static stria__cjob_t *stria__call_job(stria_coord_t *co, stria_rpc_call_t *call, const char *method,
                                      uint64_t id, bool owner)
{
    stria__cjob_t *j = stria__cjob_find(co, id);
    if (j == NULL)
        stria__unknown_job(co, call, method, id, owner);
    return j;
}

void stria__cclient_on_get_job(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__GetJobRequest *req = STRIA__REQ(Stria__V1__GetJobRequest, call);
    Stria__V1__GetJobReply rep = STRIA__V1__GET_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__call_job(co, call, "GetJob", req->job_id, req->job_proof.len > 0);
    uint8_t secret[STRIA_AUTH_SEALED_BYTES], ring[STRIA_AUTH_SEALED_BYTES];
    bool owner;
    stria__scratch_t b = {0};

    if (j == NULL || !stria__get_job_access(call, req, j, &owner, secret, ring))
        return;
    /* Only its owner keeps a job alive (workers do, through heartbeats). */
    if (owner && !stria__terminal(j->state))
        j->last_activity = stria_time_now();
    if (owner && j->client[0] == '\0') /* rebuilt after a restart: its owner is back */
        stria__client_of(call, j->client, sizeof(j->client));
    rep.job = stria__reply_job(&b, co, j);
    if (rep.job == NULL)
        b.oom = true;
    Stria__V1__PassTimeline **held = NULL;
    size_t n_held = 0;
    if (rep.job != NULL && req->include_timelines &&
        !stria__timeline_fill(&b, j, rep.job, &held, &n_held))
        b.oom = true;
    if (stria_rpc_call_roles(call) & STRIA_RPC_ROLE_WORKER) {
        rep.job_secret.data = secret;
        rep.job_secret.len = sizeof(secret);
        rep.ring_key.data = ring;
        rep.ring_key.len = sizeof(ring);
    }
    stria__reply_send(&b, call, &rep.base);
    stria__timeline_release(held, n_held);
}

/* Marks the ranks of a release (none: all) released, and ends the job when
 * none is held; returns how many are held (0 for a whole release). */
static uint32_t stria__release_ranks(stria_coord_t *co, stria__cjob_t *j,
                                     const Stria__V1__ReleaseJobRequest *req)
{
    uint32_t held = 0;
    for (size_t i = 0; i < req->n_ranks; i++)
        j->ranks[req->ranks[i]].released = true;
    for (uint32_t r = 0; r < j->n_ranks && req->n_ranks > 0; r++)
        held += !j->ranks[r].released;
    if (!stria__terminal(j->state) && held == 0) {
        stria__cjob_finish(co, j, S_RELEASED, NULL);
        stria__cjob_schedule(co);
    } else if (!stria__terminal(j->state)) {
        j->last_activity = stria_time_now();
    }
    return held;
}

void stria__cclient_on_release(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__ReleaseJobRequest *req = STRIA__REQ(Stria__V1__ReleaseJobRequest, call);
    Stria__V1__ReleaseJobReply rep = STRIA__V1__RELEASE_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__call_job(co, call, "ReleaseJob", req->job_id, true);

    if (j == NULL || !stria__job_proven(call, j))
        return;
    for (size_t i = 0; i < req->n_ranks; i++) {
        if (req->ranks[i] >= j->n_ranks) {
            stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                                "ReleaseJob: job %llu has no rank %u (ring of %u)",
                                (unsigned long long)j->id, req->ranks[i], j->n_ranks);
            return;
        }
    }
    rep.ranks_held = stria__release_ranks(co, j, req);
    /* A rank that never moved to the job's replacement releases it too (a
     * replacement has the same ranks; its chain is short). */
    for (stria__cjob_t *y = stria__cjob_find(co, j->replaced_by); y != NULL;
         y = stria__cjob_find(co, y->replaced_by))
        stria__release_ranks(co, y, req);
    rep.state = j->state;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

void stria__cclient_on_cancel(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__CancelJobRequest *req = STRIA__REQ(Stria__V1__CancelJobRequest, call);
    Stria__V1__CancelJobReply rep = STRIA__V1__CANCEL_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__call_job(co, call, "CancelJob", req->job_id, false);

    if (j == NULL)
        return;
    if (!stria__terminal(j->state)) {
        stria__cjob_finish(co, j, S_CANCELLED, "cancelled by an admin from %s%s%.300s",
                           stria_rpc_call_peer(call), req->reason[0] ? ": " : "", req->reason);
        stria__cjob_schedule(co);
    }
    rep.state = j->state;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- handlers: status ---------------------------------------------------- */

void stria__cclient_on_status(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    Stria__V1__GetStatusReply rep = STRIA__V1__GET_STATUS_REPLY__INIT;

    rep.software_version = (char *)STRIA_VERSION;
    rep.protocol_version = STRIA_RPC_VERSION;
    rep.uptime_ms = (uint64_t)((stria_time_now() - co->started_at) * 1000.0);
    rep.started_ms = co->started_ms;
    rep.heartbeat_period_ms = (uint32_t)ceil(co->heartbeat_period_s * 1000.0);
    rep.job_ttl_s = (uint32_t)ceil(co->job_ttl_s);
    stria__count_workers(co, &rep.workers_healthy, &rep.workers_draining, &rep.workers_dead,
                         &rep.workers_left);
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        Stria__V1__JobState st = co->jobs[i]->state;
        rep.jobs_pending += st == S_PENDING;
        rep.jobs_active += st >= S_LOADING && st <= S_DONE;
    }
    rep.jobs_submitted = co->jobs_submitted;
    rep.jobs_failed = co->jobs_failed;
    rep.recovery_left_ms = (uint32_t)ceil(1000.0 * stria__recover_left(co));
    rep.jobs_recovered = (uint32_t)co->jobs_recovered;
    rep.auth_required = co->auth_required;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* Ring (as_members) or worker list: every worker in ring order, then the
 * draining and dead ones. */
static void stria__cclient_on_workers(stria_coord_t *co, stria_rpc_call_t *call, bool as_members)
{
    Stria__V1__GetRingReply ring_rep = STRIA__V1__GET_RING_REPLY__INIT;
    Stria__V1__ListWorkersReply list_rep = STRIA__V1__LIST_WORKERS_REPLY__INIT;
    uint32_t n_ring = 0;
    stria__cworker_t **all = stria__place_ordered(co, &n_ring);
    stria__scratch_t b = {0};
    size_t n = co->n_workers;
    Stria__V1__RingMember **members = NULL;
    Stria__V1__WorkerInfo **infos = NULL;

    if (all == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "out of memory");
        return;
    }
    infos = stria__scratch_alloc(&b, (n + 1) * sizeof(*infos));
    if (as_members)
        members = stria__scratch_alloc(&b, (n + 1) * sizeof(*members));
    for (size_t i = 0; i < n && !b.oom; i++) {
        int idx = i < n_ring ? (int)i : -1;
        infos[i] = stria__scratch_alloc(&b, sizeof(**infos));
        if (infos[i] == NULL)
            break;
        stria__reply_worker(&b, co, all[i], idx, infos[i]);
        if (as_members) {
            members[i] = stria__scratch_alloc(&b, sizeof(**members));
            if (members[i] == NULL)
                break;
            stria__v1__ring_member__init(members[i]);
            members[i]->rank = idx;
            members[i]->worker = infos[i];
        }
    }
    free(all);
    if (as_members) {
        ring_rep.n_members = n;
        ring_rep.members = members;
        stria__reply_send(&b, call, &ring_rep.base);
    } else {
        list_rep.n_workers = n;
        list_rep.workers = infos;
        stria__reply_send(&b, call, &list_rep.base);
    }
}

void stria__cclient_on_ring(void *ctx, stria_rpc_call_t *call)
{
    stria__cclient_on_workers(ctx, call, true);
}

void stria__cclient_on_list_workers(void *ctx, stria_rpc_call_t *call)
{
    stria__cclient_on_workers(ctx, call, false);
}

void stria__cclient_on_list_jobs(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__ListJobsRequest *req = STRIA__REQ(Stria__V1__ListJobsRequest, call);
    Stria__V1__ListJobsReply rep = STRIA__V1__LIST_JOBS_REPLY__INIT;
    stria__scratch_t b = {0};
    Stria__V1__JobInfo **jobs = stria__scratch_alloc(&b, (co->n_jobs + 1) * sizeof(*jobs));

    for (uint32_t i = 0; i < co->n_jobs && jobs != NULL; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state) && !req->include_finished)
            continue;
        jobs[rep.n_jobs] = stria__reply_job(&b, co, j);
        if (jobs[rep.n_jobs] == NULL) {
            b.oom = true;
            break;
        }
        /* documents stay out of the list (up to 65536 entries per job) */
        jobs[rep.n_jobs]->assignment->spec->n_cu_seqlens = 0;
        jobs[rep.n_jobs]->assignment->spec->cu_seqlens = NULL;
        rep.n_jobs++;
    }
    rep.jobs = jobs;
    stria__reply_send(&b, call, &rep.base);
}

void stria__cclient_on_drain(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__DrainWorkerRequest *req = STRIA__REQ(Stria__V1__DrainWorkerRequest, call);
    Stria__V1__DrainWorkerReply rep = STRIA__V1__DRAIN_WORKER_REPLY__INIT;
    Stria__V1__WorkerInfo info;
    stria__cworker_t *w = stria__cworker_find(co, req->worker_id);
    stria__cworker_t **ring;
    int idx = -1;
    uint32_t n;
    stria__scratch_t b = {0};

    if (w == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "DrainWorker: worker %llu is unknown",
                            (unsigned long long)req->worker_id);
        return;
    }
    if (w->draining != req->drain) {
        w->draining = req->drain;
        stria_log_info("worker %llu (%s) %s by %s", (unsigned long long)w->id, w->rpc_address,
                       req->drain ? "drained" : "undrained", stria_rpc_call_peer(call));
        stria__cjob_schedule(co);
    }
    ring = malloc((co->n_workers + 1) * sizeof(*ring));
    if (ring == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "DrainWorker: out of memory");
        return;
    }
    n = stria__place_ring(co, ring);
    for (uint32_t i = 0; i < n; i++)
        if (ring[i] == w)
            idx = (int)i;
    free(ring);
    stria__reply_worker(&b, co, w, idx, &info);
    rep.worker = &info;
    stria__reply_send(&b, call, &rep.base);
}
