/* libstria: sessions (see stria_client.h). A session is admitted once by
 * the coordinator for the bounds of its calls; each rank's worker is opened
 * once (its buffers, pass thread and ring link) on the connection the
 * session keeps to it; then a call is one request per rank (client_call.c).
 * A call that failed retryably is tried again inside the call: a
 * whole-sequence session is opened anew without the workers the try blamed,
 * a sharded one follows the coordinator's replacement of a lost worker (or
 * binds fresh links when every worker is alive). Forwards can be held for
 * their backward (the workers keep Q, K, V, O and LSE), which then brings
 * only dO. The job API (client_job.c) is a session of one forward and one
 * backward call. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_int.h"

_Static_assert(STRIA_JOB_EXPORT_BYTES == 16 + sizeof(stria_job_secret_t),
               "an export: magic, job id, secret");

int stria__lsess_retries(const stria_client_t *c)
{
    int n = c->params.forward_retries;
    return n == 0 ? STRIA__DEFAULT_RETRIES : n < 0 ? 0 : n;
}

/* ---- opening -------------------------------------------------------------------- */

static stria_session_t *sess_new(stria_client_t *client)
{
    stria_session_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->client = client;
    s->pid = getpid();
    s->stats.struct_size = sizeof(s->stats);
    pthread_mutex_init(&s->lock, NULL);
    return s;
}

stria_session_t *stria__lsess_new(stria_client_t *client)
{
    return sess_new(client);
}

static void sess_free(stria_session_t *s)
{
    free(s->groups);
    free(s->group_held);
    stria__lrank_drop_all(s, true);
    free(s->ranks);
    free((void *)s->open.js.cu_seqlens);
    free((void *)s->open.js.label);
    pthread_mutex_destroy(&s->lock);
    stria_auth_wipe(&s->secret, sizeof(s->secret));
    free(s);
}

/* The session's end at the service: its workers let it go (the ranks this
 * handle used), and the coordinator hears that they are done with it. */
static stria_status_t sess_end(stria_session_t *s)
{
    if (s->id == 0)
        return STRIA_OK;
    uint32_t *ranks = calloc((size_t)s->n_ranks + 1, sizeof(*ranks));
    size_t n_used = 0;
    for (int i = 0; i < s->n_ranks && ranks != NULL; i++)
        if (!s->sharded || s->ranks[i].used)
            ranks[n_used++] = (uint32_t)i;
    stria__lrank_drop_all(s, false);
    stria_status_t st = STRIA_OK;
    if (!s->sharded || n_used > 0) /* a sharded session ends when every rank released it */
        st = stria__lcoord_release(s->client, s->id, &s->secret, s->sharded ? ranks : NULL,
                                   s->sharded ? n_used : 0, !s->release_once);
    free(ranks);
    s->id = 0;
    return st;
}

/* Submits the session (without the workers blamed so far, waiting in the
 * queue) and, whole-sequence, opens every rank. */
static stria_status_t submit(stria_session_t *s, stria_progress_cb progress, void *arg)
{
    stria__lsubmit_t sub;
    stria_status_t st =
        stria__lcoord_submit(s->client, &s->open, s->blamed, s->n_blamed, progress, arg, &sub);
    if (st == STRIA_OK) {
        s->secret = sub.secret;
        st = stria__lrank_assign(s, sub.assignment);
    }
    stria_rpc_reply_free(&sub.reply);
    if (st != STRIA_OK) {
        char msg[1024];
        bool retryable = sub.id != 0 ? sub.retryable : stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        for (size_t i = 0; i < sub.n_blamed && s->n_blamed < STRIA__MAX_BLAMED; i++)
            s->blamed[s->n_blamed++] = sub.blamed[i];
        if (sub.id != 0) /* admitted, then failed: it goes */
            stria__lcoord_release(s->client, sub.id, &sub.secret, NULL, 0, false);
        stria_error_set(st, "%s", msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    s->epoch = 0; /* the workers' links of a new session are of generation 0 */
    s->held_mask = 0;
    s->stats.generation++;
    if (s->sharded) /* each trainer rank opens its own at its first call */
        return STRIA_OK;
    int n = s->n_ranks;
    int ranks[n];
    stria__lout_t out[n];
    for (int i = 0; i < n; i++)
        ranks[i] = i;
    stria__lrank_open(s, ranks, n, false, out);
    int pick = -1;
    bool lost = false;
    for (int i = 0; i < n; i++) {
        if (out[i].st == STRIA_OK)
            continue;
        if (out[i].lost && s->n_blamed < STRIA__MAX_BLAMED) {
            s->blamed[s->n_blamed++] = s->ranks[i].worker_id;
            lost = true;
        }
        if (pick < 0 || stria__lrank_explains(&out[i]) > stria__lrank_explains(&out[pick]))
            pick = i;
    }
    if (pick < 0)
        return STRIA_OK;
    st = stria_error_set(out[pick].st, "session %llu open, rank %d (worker %s): %s",
                         (unsigned long long)s->id, pick, s->ranks[pick].rpc_address,
                         out[pick].error);
    stria_error_set_retryable(lost || out[pick].retryable);
    return st;
}

/* Opens the session anew, without the workers its failures were blamed on:
 * tried again while it fails retryably and *retries last. */
static stria_status_t reopen(stria_session_t *s, int *retries, stria_progress_cb progress,
                             void *arg)
{
    for (;;) {
        s->release_once = true;
        sess_end(s);
        s->release_once = false;
        stria_status_t st = submit(s, progress, arg);
        s->stats.reopened++;
        if (st == STRIA_OK || !stria_error_retryable() || *retries <= 0)
            return st;
        (*retries)--;
        s->stats.retries++;
    }
}

stria_status_t stria__lsess_open(stria_client_t *c, const stria__lopen_t *o,
                                 const stria_session_spec_t *spec, stria_progress_cb progress,
                                 void *arg, stria_session_t **out)
{
    stria_session_t *s = sess_new(c);
    if (s == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    s->spec = *spec;
    s->spec.label = NULL;
    s->spec.placement_hosts = NULL;
    s->spec.placement_devices = NULL;
    s->sharded = o->sharded;
    s->job = !o->session;
    /* how to open it again: the documents and label copied (the caller's
     * are read during this call only), the placement used this once */
    s->open = *o;
    s->open.js.cu_seqlens = NULL;
    s->open.js.n_cu_seqlens = 0;
    s->open.js.label = NULL;
    int64_t *cu = o->js.n_cu_seqlens > 0 ? malloc(o->js.n_cu_seqlens * sizeof(int64_t)) : NULL;
    char *label = o->js.label != NULL ? strdup(o->js.label) : NULL;
    if ((o->js.n_cu_seqlens > 0 && cu == NULL) || (o->js.label != NULL && label == NULL)) {
        free(cu);
        free(label);
        sess_free(s);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    }
    if (cu != NULL)
        memcpy(cu, o->js.cu_seqlens, o->js.n_cu_seqlens * sizeof(int64_t));
    s->open.js.cu_seqlens = cu;
    s->open.js.n_cu_seqlens = cu != NULL ? o->js.n_cu_seqlens : 0;
    s->open.js.label = label;
    s->open.exclude = NULL;
    s->open.n_exclude = NULL;
    for (size_t i = 0; o->exclude != NULL && i < *o->n_exclude && s->n_blamed < STRIA__MAX_BLAMED;
         i++)
        s->blamed[s->n_blamed++] = o->exclude[i];
    int retries = o->retries >= 0 ? o->retries : stria__lsess_retries(c);
    stria_status_t st = submit(s, progress, arg);
    s->open.js.placement_hosts = NULL;
    s->open.js.placement_devices = NULL;
    if (st != STRIA_OK && stria_error_retryable() && retries > 0 && !s->sharded)
        st = reopen(s, &retries, progress, arg); /* a worker lost while it opened */
    if (st != STRIA_OK) {
        char msg[1024];
        bool retryable = stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        for (size_t i = 0; o->blame && i < s->n_blamed; i++) { /* the caller's next try */
            bool known = false;
            for (size_t k = 0; k < *o->n_exclude && !known; k++)
                known = o->exclude[k] == s->blamed[i];
            if (!known && *o->n_exclude < STRIA__MAX_BLAMED)
                o->exclude[(*o->n_exclude)++] = s->blamed[i];
        }
        s->release_once = true;
        sess_end(s);
        sess_free(s);
        stria_error_set(st, "%s", msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    *out = s;
    return STRIA_OK;
}

stria_status_t stria__lsess_import(stria_client_t *c, const void *bytes, size_t len, bool job,
                                   stria_session_t **out)
{
    const char *magic = job ? STRIA__JOB_EXPORT_MAGIC : STRIA__SESSION_EXPORT_MAGIC;
    const char *what = job ? "stria_job_import" : "stria_session_import";
    if (c == NULL || bytes == NULL || out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL argument", what);
    if (len != STRIA_JOB_EXPORT_BYTES || memcmp(bytes, magic, 8) != 0)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "%s: %zu bytes that are no %s export (one is %d bytes from %s)",
                               what, len, job ? "job" : "session", STRIA_JOB_EXPORT_BYTES,
                               job ? "stria_job_export" : "stria_session_export");
    stria_session_t *s = sess_new(c);
    if (s == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", what);
    uint64_t id = stria_get_le64((const uint8_t *)bytes + 8);
    memcpy(s->secret.bytes, (const uint8_t *)bytes + 16, sizeof(s->secret.bytes));
    stria__linfo_t info;
    stria_rpc_reply_t reply;
    /* GetJob checks the proof of the secret; a job over because it was
     * replaced (a lost worker's rank on a spare) is imported as its
     * replacement, which holds the same secret */
    stria_status_t st = stria__lcoord_info(c, id, &s->secret, true, &info, &reply);
    if (st == STRIA_OK && info.state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        uint64_t y = stria__lcoord_replacement(c, id, &s->secret, false);
        if (y != 0) {
            stria_rpc_reply_free(&reply);
            id = y;
            st = stria__lcoord_info(c, id, &s->secret, true, &info, &reply);
        }
    }
    const Stria__V1__JobInfo *j =
        st == STRIA_OK ? ((Stria__V1__GetJobReply *)reply.msg)->job : NULL;
    const Stria__V1__Assignment *a = j != NULL ? j->assignment : NULL;
    if (st == STRIA_OK && (a == NULL || a->spec == NULL))
        st = stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: no assignment", (unsigned long long)id);
    if (st == STRIA_OK && (a->spec->session == job || !a->spec->sharded))
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "%s: job %llu is not a sharded %s", what,
                             (unsigned long long)id, job ? "job" : "session");
    if (st == STRIA_OK && info.state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
        st = stria_error_set(STRIA_ERR_CANCELLED, "%s: job %llu is over (%s)", what,
                             (unsigned long long)id, info.failure[0] ? info.failure : "released");
    if (st == STRIA_OK) {
        const Stria__V1__JobSpec *sp = a->spec;
        stria_session_spec_t spec = STRIA_SESSION_SPEC_INIT;
        spec.max_batch = sp->batch;
        spec.max_seq_len = (int64_t)sp->seq_len;
        spec.heads = sp->heads;
        spec.kv_heads = sp->kv_heads;
        spec.head_dim = sp->head_dim;
        spec.dtype = (stria_dtype_t)sp->dtype;
        spec.layout = (stria_layout_kind_t)sp->layout;
        spec.ring_size = (int)a->n_ranks;
        spec.sharded = true;
        spec.idle_timeout_s = sp->ttl_s;
        spec.step_timeout_s = sp->step_timeout_ms / 1000.0;
        spec.arrival_timeout_s = sp->arrival_timeout_s;
        spec.max_held = sp->max_held;
        s->spec = spec;
        s->sharded = true;
        s->job = job;
        s->open = (stria__lopen_t){.session = !job, .sharded = true, .max_held = sp->max_held};
        s->open.js.layout = spec.layout;
        s->stats.generation = 1;
        st = stria__lrank_assign(s, a);
    }
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK) {
        sess_free(s);
        return stria_error_wrap(st, "%s", what);
    }
    *out = s;
    return STRIA_OK;
}

/* ---- calls ---------------------------------------------------------------------- */

/* What the coordinator says of a session whose workers no longer hold it
 * or dropped it: over for good (cancelled, or failed for a cause of its
 * own: why says so), expired (idle past its deadline, or unknown: a
 * restarted coordinator that could not rebuild it), lost (failed for a
 * cause outside it: a worker died or left), or still on. */
enum { ENDED_ON, ENDED_FINAL, ENDED_EXPIRED, ENDED_LOST };

static int ended(stria_session_t *s, char *why, size_t len, stria_status_t *status)
{
    stria__linfo_t info;
    *status = STRIA_ERR_CANCELLED;
    stria_status_t st = stria__lcoord_info(s->client, s->id, &s->secret, false, &info, NULL);
    if (st == STRIA_ERR_NOT_FOUND)
        return ENDED_EXPIRED;
    if (st != STRIA_OK)
        return ENDED_ON;
    snprintf(why, len, "the coordinator ended %s %llu (%s): %s", s->job ? "job" : "session",
             (unsigned long long)s->id,
             info.state == STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED ? "cancelled" : "failed",
             info.failure[0] ? info.failure : "no reason given");
    if (info.state == STRIA__V1__JOB_STATE__JOB_STATE_FAILED && info.failure_status < 0)
        *status = info.failure_status; /* e.g. a rank that never arrived: a deadline */
    switch (info.state) {
    case STRIA__V1__JOB_STATE__JOB_STATE_EXPIRED:
    case STRIA__V1__JOB_STATE__JOB_STATE_RELEASED:
        return ENDED_EXPIRED;
    case STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED:
        return ENDED_FINAL;
    case STRIA__V1__JOB_STATE__JOB_STATE_FAILED:
        return info.failure_retryable ? ENDED_LOST : ENDED_FINAL;
    default:
        return ENDED_ON;
    }
}

/* A sharded rank's call failed: whether the coordinator replaced the
 * session (a lost worker's rank on a spare); if so this handle moves to the
 * replacement (its ranks opened at their next call, the arenas kept). */
static stria_status_t follow(stria_session_t *s, bool lost, bool *followed)
{
    *followed = false;
    uint64_t old = s->id;
    uint64_t y = stria__lcoord_replacement(s->client, old, &s->secret, lost);
    if (y == 0)
        return STRIA_OK;
    stria__linfo_t info;
    stria_rpc_reply_t reply;
    stria_status_t st = stria__lcoord_info(s->client, y, &s->secret, true, &info, &reply);
    const Stria__V1__JobInfo *j =
        st == STRIA_OK ? ((Stria__V1__GetJobReply *)reply.msg)->job : NULL;
    if (st == STRIA_OK && (j->assignment == NULL || (int)j->assignment->n_ranks != s->n_ranks))
        st = stria_error_set(STRIA_ERR_PROTOCOL, "the replacement has no assignment of %d ranks",
                             s->n_ranks);
    if (st == STRIA_OK) {
        stria__lrank_drop_all(s, false); /* the old session's ranks this handle ran */
        st = stria__lrank_assign(s, j->assignment);
    }
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "session %llu, which replaces session %llu",
                                (unsigned long long)y, (unsigned long long)old);
    s->epoch = 0;
    s->held_mask = 0; /* the forwards held there are gone */
    s->stats.generation++;
    *followed = true;
    stria_log_info("session %llu was replaced by session %llu (a worker was lost): this handle "
                   "follows",
                   (unsigned long long)old, (unsigned long long)y);
    return STRIA_OK;
}

/* The region a call uses in the arenas: the held forward's for its
 * backward, else region 0 if no forward holds it (the in-place buffers
 * lie there), else the first free one. */
static int pick_region(const stria_session_t *s, const stria__lreq_t *r)
{
    if (r->use_held)
        for (uint32_t i = 0; i <= s->open.max_held; i++)
            if ((s->held_mask >> i & 1) && s->held_call[i] == r->held)
                return (int)i;
    for (uint32_t i = 0; i <= s->open.max_held; i++)
        if (!(s->held_mask >> i & 1))
            return (int)i;
    return -1;
}

static void fill_stats(stria_call_stats_t *st, const stria__lresult_t *res, double pass_s)
{
    st->upload_s = res->upload_s;
    st->pass_s = pass_s;
    st->download_s = res->download_s;
    st->rank_compute_s_max = res->compute_max_s;
    st->rank_compute_s_min = res->compute_min_s;
    st->rank_wait_s_max = res->wait_max_s;
    st->bytes_up = res->up_bytes;
    st->bytes_down = res->down_bytes;
    st->ring_steps = res->steps;
    st->ring_bytes_sent = res->ring_bytes;
}

/* The checks of a call before its tries. */
static stria_status_t check(stria_session_t *s, const char *fn, const stria__lreq_t *r)
{
    int n_in = r->backward ? 6 : 3, n_out = r->backward ? 3 : 2;
    for (int i = 0; i < n_in; i++)
        if (r->io->in[i] == NULL && !(r->use_held && i < 5))
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: input %d is NULL", fn, i);
    for (int i = 0; i < n_out; i++)
        if (r->io->out[i] == NULL)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: output %d is NULL", fn, i);
    if (getpid() != s->pid)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the session was opened by process %d; this is process %d (a "
                               "forked child): open a session of its own there",
                               fn, (int)s->pid, (int)getpid());
    if (s->id == 0 && s->sharded)
        return stria_error_set(STRIA_ERR_CANCELLED, "%s: the sharded session is closed", fn);
    if (s->sharded && (r->rank < 0 || r->rank >= s->n_ranks))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: rank %d is not a rank of the session (0..%d)", fn, r->rank,
                               s->n_ranks - 1);
    if (!s->sharded && r->rank >= 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the session is whole-sequence: call it without a rank", fn);
    if (r->hold && s->open.max_held == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: the session holds no forwards (its spec's max_held is 0)", fn);
    if (r->hold && pick_region(s, r) < 0)
        return stria_error_set(STRIA_ERR_BUSY,
                               "%s: the session holds %u forward(s) already, its max_held (run "
                               "their backward, or release them)",
                               fn, s->open.max_held);
    if (r->use_held && pick_region(s, r) < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: held forward %llu is not held (never held, its backward ran, "
                               "released, or its session was opened anew)",
                               fn, (unsigned long long)r->held);
    const stria_call_bounds_t b = {.max_batch = s->spec.max_batch,
                                   .max_seq_len = s->spec.max_seq_len,
                                   .n_ranks = s->n_ranks,
                                   .layout = (int)s->layout};
    stria_status_t st = stria_call_shape_check(r->shape, &b);
    return st != STRIA_OK ? stria_error_wrap(st, "%s", fn) : STRIA_OK;
}

/* The ranks a try calls (every rank, or a sharded rank its own) in
 * *ranks_all, with room for their outcomes in *out (both grown to n). */
static stria_status_t try_ranks(stria_session_t *s, const char *fn, int rank, int n, int *cap,
                                int **ranks_all, stria__lout_t **out)
{
    if (n > *cap) {
        int *rk = realloc(*ranks_all, (size_t)n * sizeof(*rk));
        if (rk != NULL)
            *ranks_all = rk;
        stria__lout_t *o = rk != NULL ? realloc(*out, (size_t)n * sizeof(*o)) : NULL;
        if (o == NULL)
            return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
        *out = o;
        *cap = n;
    }
    for (int i = 0; i < n; i++)
        (*ranks_all)[i] = s->sharded ? rank : i;
    return STRIA_OK;
}

/* A call that succeeded: its held forward recorded (or released), its
 * figures in the session's stats and the caller's. */
static void call_done(stria_session_t *s, const stria__lreq_t *r, const stria__lcall_t *c,
                      const stria__lresult_t *res, double call_s, uint64_t *held_out,
                      stria_call_stats_t *stats)
{
    if (r->hold) {
        s->held_mask |= UINT64_C(1) << c->region;
        s->held_call[c->region] = c->call;
        if (held_out != NULL)
            *held_out = c->call;
    }
    if (r->use_held)
        s->held_mask &= ~(UINT64_C(1) << c->region);
    s->stats.last_call_s = call_s;
    s->stats.last_pass_s = res->pass_max_s;
    s->stats.last_minflt = res->minflt;
    s->stats.last_ring_bytes = res->ring_bytes;
    s->stats.last_steps = res->steps;
    fill_stats(stats, res, res->pass_max_s);
}

stria_status_t stria__lsess_call(stria_session_t *s, const char *fn, const stria__lreq_t *r,
                                 uint64_t *held_out)
{
    if (s == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL session", fn);
    pthread_mutex_lock(&s->lock);
    stria_status_t st = STRIA_OK;
    int retries = r->retries >= 0 ? r->retries : stria__lsess_retries(s->client), reopens = 1;
    if (s->id == 0 && !s->sharded && s->pid == getpid()) { /* closed by a failed reopening */
        st = submit(s, NULL, NULL);
        if (st != STRIA_OK && stria_error_retryable() &&
            retries > 0) /* a worker lost as it opened */
            st = reopen(s, &retries, NULL, NULL);
    }
    if (st == STRIA_OK)
        st = check(s, fn, r);
    if (st != STRIA_OK) {
        s->stats.failed++;
        pthread_mutex_unlock(&s->lock);
        return st;
    }
    /* the ranks of each try: a session opened anew may have another ring
     * size (its ring_size 0: as many as the coordinator finds) */
    int n = 0, cap = 0, *ranks_all = NULL;
    stria__lout_t *out = NULL;
    uint64_t call = s->next_call++;
    int attempt = 0;
    double t0 = stria_time_now();
    stria_call_stats_t stats = STRIA_CALL_STATS_INIT;
    stria__lresult_t res;
    for (;; attempt++) {
        n = s->sharded ? 1 : s->n_ranks;
        if ((st = try_ranks(s, fn, r->rank, n, &cap, &ranks_all, &out)) != STRIA_OK)
            break;
        int region = pick_region(s, r);
        const stria__lcall_t c = {.shape = r->shape,
                                  .backward = r->backward,
                                  .hold = r->hold,
                                  .use_held = r->use_held,
                                  .held_call = r->held,
                                  .region = region < 0 ? 0 : region,
                                  .call = call,
                                  .all_heads = r->all_heads,
                                  .part = r->part,
                                  .parts = r->parts,
                                  .io = r->io,
                                  .progress = r->progress,
                                  .progress_arg = r->progress_arg};
        memset(&res, 0, sizeof(res));
        res.out = out;
        double t_try = stria_time_now();
        st = stria__lcall_try(s, &c, ranks_all, n, &res);
        s->stats.bytes_up += res.tcp_up_bytes;
        s->stats.bytes_down += res.tcp_down_bytes;
        if (st == STRIA_OK) {
            call_done(s, r, &c, &res, stria_time_now() - t_try, held_out, &stats);
            break;
        }
        /* the next call binds fresh links (every rank computes the same) */
        s->epoch = stria__lcall_epoch(call, attempt);
        bool retryable = res.retryable, lost = s->sharded && res.out[0].lost;
        char msg[1024], why[600] = "";
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        /* workers that no longer hold the session, dropped it, or lost one
         * of theirs: what the coordinator says decides (expired: open it
         * again; lost: open it again, or follow its replacement; cancelled
         * or failed for its own cause: the call fails with its reason) */
        int v = ENDED_ON;
        if (res.expired || st == STRIA_ERR_CANCELLED || (s->sharded && retryable)) {
            stria_status_t over;
            v = ended(s, why, sizeof(why), &over);
            if (v == ENDED_FINAL) {
                st = stria_error_set(over, "%s: %s", fn, why);
                break;
            }
            res.expired = res.expired || v == ENDED_EXPIRED;
            retryable = retryable || v == ENDED_LOST;
            if (v == ENDED_LOST) /* the ranks may only echo it: the coordinator's account */
                snprintf(msg, sizeof(msg), "%s", why);
        }
        stria_error_set(st, "%s", msg);
        stria_error_set_retryable(retryable);
        if (r->use_held && !s->sharded) /* its forward went with the session */
            break;
        if (s->sharded) {
            /* a sharded session keeps its size: a lost worker's rank moves to
             * a spare (the coordinator's replacement), else, every worker
             * alive, the links are bound anew; an expired one is opened again
             * by the group */
            bool followed = false;
            if (!retryable || retries <= 0 || v == ENDED_EXPIRED)
                break;
            stria_status_t fs = follow(s, lost || v == ENDED_LOST, &followed);
            if (fs != STRIA_OK) {
                st = fs;
                break;
            }
            if (!followed && res.expired) /* dropped, and the coordinator has it on */
                break;
            if (followed && r->use_held) {
                st = stria_error_set(st,
                                     "%s: %s; its held forward was on the replaced session: "
                                     "run the forward again",
                                     fn, msg);
                stria_error_set_retryable(true);
                break;
            }
            if (!followed && (lost || v != ENDED_ON)) { /* no spare took the lost one's place */
                stria_error_set(st, "%s (no replacement of session %llu was made)", msg,
                                (unsigned long long)s->id);
                stria_error_set_retryable(true);
                break;
            }
            retries--;
            s->stats.retries++;
            stats.retries++;
            stria_error_set(st, "%s", msg);
            continue;
        }
        /* an expired session is opened again once; a retryable failure as
         * often as the retries allow */
        if (res.expired && reopens > 0)
            reopens--;
        else if (retryable && retries > 0)
            retries--, s->stats.retries++, stats.retries++;
        else
            break;
        stria_log_info("session %llu: %s; opening it again", (unsigned long long)s->id, msg);
        if ((st = reopen(s, &retries, NULL, NULL)) != STRIA_OK) {
            stria_error_wrap(st, "%s: opening the session again after \"%s\"", fn, msg);
            break;
        }
    }
    free(ranks_all);
    free(out);
    if (st == STRIA_OK)
        s->stats.calls++;
    else
        s->stats.failed++;
    if (r->stats != NULL) {
        stats.queued_s = 0;
        if (st != STRIA_OK)
            stats.pass_s = stria_time_now() - t0;
        stria__labi_write_stats(r->stats, &stats);
    }
    pthread_mutex_unlock(&s->lock);
    return st;
}

/* ---- buffers in the arena ---------------------------------------------------------- */

stria_status_t stria__lsess_buffer(stria_session_t *s, const char *fn, const stria_call_shape_t *c,
                                   int rank, stria_tensor_id_t tensor, stria_shard_buffer_t *out)
{
    stria_layout_t lay;
    stria_docplan_t *plan = NULL;
    if (s == NULL || out == NULL || out->struct_size < sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: NULL argument (or a stria_shard_buffer_t without its "
                               "struct_size: STRIA_SHARD_BUFFER_INIT)",
                               fn);
    if (tensor < STRIA_TENSOR_Q || tensor > STRIA_TENSOR_DV)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: tensor %d is none of the 9", fn,
                               (int)tensor);
    pthread_mutex_lock(&s->lock);
    stria_status_t st = STRIA_OK;
    if (!s->sharded || s->id == 0)
        st = stria_error_set(STRIA_ERR_UNSUPPORTED,
                             "%s: only a sharded session's ranks take their tensors as they are "
                             "(a whole-sequence call's tensors are the full ones)",
                             fn);
    else if (rank < 0 || rank >= s->n_ranks)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "%s: rank %d is not a rank of the session", fn,
                             rank);
    const stria_call_bounds_t b = {.max_batch = s->spec.max_batch,
                                   .max_seq_len = s->spec.max_seq_len,
                                   .n_ranks = s->n_ranks,
                                   .layout = (int)s->layout};
    if (st == STRIA_OK && (st = stria_call_shape_check(c, &b)) != STRIA_OK)
        stria_error_wrap(st, "%s", fn);
    stria__lrank_t *r = st == STRIA_OK ? &s->ranks[rank] : NULL;
    if (st == STRIA_OK && !r->opened) { /* the rank opens on its worker now */
        stria__lout_t o;
        stria__lrank_open(s, &rank, 1, true, &o); /* the ring binds while the caller fills it */
        if ((st = o.st) != STRIA_OK)
            stria_error_set(st, "%s: %s", fn, o.error);
    }
    if (st == STRIA_OK && (r->arena == NULL || r->arena_sock < 0))
        st = stria_error_set(STRIA_ERR_UNSUPPORTED,
                             "%s: rank %d's tensors go over TCP (%s): pass buffers of your own", fn,
                             rank, r->tcp_why[0] ? r->tcp_why : "no arena");
    if (st == STRIA_OK)
        st = stria_docplan_layout(s->layout, c, s->n_ranks, &lay, &plan);
    if (st != STRIA_OK) {
        pthread_mutex_unlock(&s->lock);
        return st;
    }
    /* a call's region (see stria.proto SessionCallRequest): inputs Q, K, V,
     * O, LSE, dO from 0 (a forward writes O and LSE where the backward
     * reads them), dQ, dK, dV after the inputs' room */
    size_t in_room = 0;
    stria__lrank_region(s, &in_room);
    int64_t valid = stria_layout_shard_valid(&lay, rank);
    stria_docplan_unref(plan);
    size_t es = stria_dtype_size(s->spec.dtype);
    size_t qrow = (size_t)(s->spec.heads * s->spec.head_dim) * es;
    size_t kvrow = (size_t)(s->spec.kv_heads * s->spec.head_dim) * es;
    size_t qb = (size_t)(c->batch * valid) * qrow, kvb = (size_t)(c->batch * valid) * kvrow;
    size_t lb = (size_t)(c->batch * s->spec.heads * valid) * 4u;
    /* by stria_tensor_id_t: Q, K, V, dO, O, LSE, dQ, dK, dV */
    const size_t offs[10] = {0,
                             0,
                             qb,
                             qb + kvb,
                             qb + 2 * kvb + qb + lb,
                             qb + 2 * kvb,
                             qb + 2 * kvb + qb,
                             in_room,
                             in_room + qb,
                             in_room + qb + kvb};
    const size_t rows[10] = {0, qrow, kvrow, kvrow, qrow, qrow, 4, qrow, kvrow, kvrow};
    stria_shard_buffer_t b2 = STRIA_SHARD_BUFFER_INIT;
    b2.data = r->arena + offs[tensor];
    b2.outer = tensor == STRIA_TENSOR_LSE ? c->batch * s->spec.heads : c->batch;
    b2.tokens = valid;
    b2.row_bytes = (int64_t)rows[tensor];
    b2.outer_stride = valid * b2.row_bytes;
    pthread_mutex_unlock(&s->lock);
    *out = b2;
    return STRIA_OK;
}

/* ---- closing -------------------------------------------------------------------- */

stria_status_t stria__lsess_close(stria_session_t *s)
{
    if (s == NULL)
        return STRIA_OK;
    pthread_mutex_lock(&s->lock); /* a call still running ends first */
    stria_status_t gst = STRIA_OK;
    for (int g = 0; g < s->n_groups; g++) { /* a head-grouped session's rings */
        stria_status_t st = stria__lsess_close(s->groups[g]);
        gst = gst != STRIA_OK ? gst : st;
    }
    s->release_once = true;
    stria_status_t st = s->n_groups > 0 ? gst : sess_end(s);
    pthread_mutex_unlock(&s->lock);
    sess_free(s);
    return st;
}

/* ---- held forwards let go ------------------------------------------------------- */

stria_status_t stria__lsess_release_held(stria_session_t *s, const char *fn, int rank,
                                         uint64_t held)
{
    if (s == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: NULL session", fn);
    pthread_mutex_lock(&s->lock);
    const stria__lreq_t r = {.rank = rank, .use_held = true, .held = held};
    int region = pick_region(s, &r);
    stria_status_t st = STRIA_OK;
    if (region < 0)
        st = stria_error_set(STRIA_ERR_NOT_FOUND,
                             "%s: held forward %llu is not held (its backward ran, released, or "
                             "its session was opened anew)",
                             fn, (unsigned long long)held);
    for (int i = 0; st == STRIA_OK && i < s->n_ranks; i++) {
        stria__lrank_t *rk = &s->ranks[i];
        if ((s->sharded && i != rank) || rk->conn == NULL ||
            (rk->arena != NULL && rk->arena_sock >= 0))
            continue; /* an arena's forward is in this process's memory */
        stria_status_t rs = stria__lrank_release_held(s, rk, held);
        if (rs != STRIA_OK && rs != STRIA_ERR_NOT_FOUND)
            st = stria_error_wrap(rs, "%s: rank %d", fn, i);
    }
    if (region >= 0)
        s->held_mask &= ~(UINT64_C(1) << region);
    pthread_mutex_unlock(&s->lock);
    return st;
}

/* ---- a call's positions -------------------------------------------------------- */

stria_status_t stria__lcall_positions(const char *fn, stria_layout_kind_t layout, int n_ranks,
                                      const stria_call_shape_t *call, int rank, int64_t *count_out,
                                      int64_t *positions_out)
{
    stria_status_t st;
    if (layout == STRIA_LAYOUT_AUTO)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: layout auto places no tokens (name the layout, or ask the "
                               "session's: stria_session_layout())",
                               fn);
    if (n_ranks < 1 || n_ranks > STRIA_LAYOUT_MAX_RANKS || rank < 0 || rank >= n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: rank %d of a ring of %d ranks", fn, rank,
                               n_ranks);
    stria_call_shape_t shape = *call;
    if (shape.batch < 1) /* positions do not depend on it */
        shape.batch = 1;
    const stria_call_bounds_t b = {.max_batch = shape.batch,
                                   .max_seq_len = shape.seq_len,
                                   .n_ranks = n_ranks,
                                   .layout = (int)layout};
    stria_layout_t lay;
    stria_docplan_t *plan = NULL;
    if ((st = stria_call_shape_check(&shape, &b)) != STRIA_OK ||
        (st = stria_docplan_layout(layout, &shape, n_ranks, &lay, &plan)) != STRIA_OK)
        return stria_error_wrap(st, "%s", fn);
    stria_layout_run_t tmp[STRIA_LAYOUT_MAX_RUNS];
    size_t nr;
    const stria_layout_run_t *runs = stria_layout_runs(&lay, rank, false, &nr, tmp);
    int64_t n = 0;
    for (size_t k = 0; k < nr; k++)
        for (int64_t i = 0; i < runs[k].count; i++, n++)
            if (positions_out != NULL)
                positions_out[n] = runs[k].first + i * runs[k].stride;
    if (count_out != NULL)
        *count_out = n;
    stria_docplan_unref(plan);
    return STRIA_OK;
}
