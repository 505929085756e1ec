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

#define SESSION_EXPORT_MAGIC "STRIASS1"
#define JOB_EXPORT_MAGIC     "STRIAJB2"
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

static void sess_free(stria_session_t *s)
{
    free(s->groups);
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
    const char *magic = job ? JOB_EXPORT_MAGIC : SESSION_EXPORT_MAGIC;
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

/* ---- head groups ------------------------------------------------------------------ */

/* A head-grouped session (spec.head_groups G > 1) is G sessions, one per
 * head group: heads / G and kv_heads / G over R = ring_size / G ranks each,
 * opened one after the other, each without the workers of the groups
 * before it (the coordinator orders a ring's workers by host, so a group's
 * ring takes the next R of them: a host's neighbours before another
 * host's). A call runs on the G rings at once, each moving its heads' bytes
 * of every row between the caller's tensors and its shards (client_call.c,
 * full_row and full_off): routing the upload is the all-to-all of head
 * parallelism. Each ring retries on its own, as any session does. */

#define STRIA__MAX_GROUPS 64

static stria_status_t group_spec_check(const stria_session_spec_t *sp)
{
    const uint32_t G = sp->head_groups;
    if (G > STRIA__MAX_GROUPS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_groups must be at most %d (got %u)",
                               STRIA__MAX_GROUPS, G);
    if (sp->kv_heads % G != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_groups %u must divide kv_heads %lld (a GQA "
                               "group of query heads stays whole)",
                               G, (long long)sp->kv_heads);
    if (sp->ring_size < 1 || sp->ring_size % (int)G != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: head_groups %u needs ring_size, a multiple of it "
                               "(head_groups x the ranks of each ring; got %d)",
                               G, sp->ring_size);
    if (sp->sharded)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "session spec: head groups are built for whole-sequence sessions "
                               "only (a sharded session takes head_groups 0 or 1)");
    if (sp->max_held > 0)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "session spec: held forwards are built for sessions without head "
                               "groups only (max_held 0 with head_groups %u)",
                               G);
    return STRIA_OK;
}

/* STRIA_HEAD_GROUPS_AUTO: one group per host of the ring's first
 * ring_size workers (0: all), when each host holds as many and their
 * number divides kv_heads; else 1. Fills in sp's head_groups and
 * ring_size. */
static stria_status_t group_auto(stria_client_t *c, stria_session_spec_t *sp)
{
    const size_t cap = 4096;
    char(*hosts)[STRIA__HOST_LEN] = calloc(cap, sizeof(*hosts));
    if (hosts == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    size_t n = 0;
    stria_status_t st = stria__lcoord_ring_hosts(c, hosts, cap, &n);
    if (st != STRIA_OK) {
        free(hosts);
        return stria_error_wrap(st, "session spec: head_groups auto (the coordinator's ring)");
    }
    if (sp->ring_size > 0 && (size_t)sp->ring_size < n)
        n = (size_t)sp->ring_size;
    /* hosts come in runs in ring order: count the runs, check they are even */
    size_t runs = 0, run_len = 0, len = 0;
    bool even = n > 0;
    for (size_t i = 0; i < n; i++) {
        bool same = i > 0 && strcmp(hosts[i], hosts[i - 1]) == 0;
        len = same ? len + 1 : 1;
        if (!same)
            runs++;
        if (i + 1 == n || strcmp(hosts[i + 1], hosts[i]) != 0) {
            even = even && (run_len == 0 || run_len == len);
            run_len = len;
        }
    }
    free(hosts);
    uint32_t G = even && runs > 1 && sp->kv_heads % (int64_t)runs == 0 ? (uint32_t)runs : 1;
    if (sp->ring_size == 0 && G > 1)
        sp->ring_size = (int)n;
    sp->head_groups = G;
    stria_log_info("session: head_groups auto: %u (%zu workers on %zu hosts%s)", G, n, runs,
                   G > 1       ? ""
                   : runs <= 1 ? ": one host"
                   : !even     ? ": hosts hold unequal shares"
                               : ": the hosts do not divide kv_heads");
    return STRIA_OK;
}

static stria_status_t group_open(stria_client_t *c, const stria__lopen_t *o,
                                 const stria_session_spec_t *sp, stria_session_t **out)
{
    stria_status_t st = group_spec_check(sp);
    if (st != STRIA_OK)
        return st;
    const int G = (int)sp->head_groups, R = sp->ring_size / G;
    stria_session_t *p = sess_new(c);
    uint64_t *taken = calloc((size_t)sp->ring_size, sizeof(*taken));
    if (p == NULL || taken == NULL || (p->groups = calloc((size_t)G, sizeof(*p->groups))) == NULL) {
        free(taken);
        if (p != NULL)
            sess_free(p);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "session: out of memory");
    }
    p->spec = *sp;
    p->spec.label = NULL;
    p->spec.placement_hosts = NULL;
    p->spec.placement_devices = NULL;
    size_t n_taken = 0;
    for (int g = 0; g < G && st == STRIA_OK; g++) {
        stria_session_spec_t gs = *sp;
        gs.heads /= G;
        gs.kv_heads /= G;
        gs.ring_size = R;
        gs.head_groups = 0;
        char label[256]; /* what striactl shows: the group and its session */
        snprintf(label, sizeof(label), "%s%shead group %d of %d", o->js.label ? o->js.label : "",
                 o->js.label ? ", " : "", g, G);
        stria__lopen_t go = *o;
        go.js.label = label;
        go.js.heads = gs.heads;
        go.js.kv_heads = gs.kv_heads;
        go.js.ring_size = R;
        go.exclude = taken;
        go.n_exclude = &n_taken;
        go.blame = false;
        stria_session_t *r = NULL;
        if ((st = stria__lsess_open(c, &go, &gs, NULL, NULL, &r)) != STRIA_OK) {
            char msg[1024];
            bool retryable = stria_error_retryable();
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            stria_error_set(st, "head group %d of %d (its ring of %d): %s", g, G, R, msg);
            stria_error_set_retryable(retryable);
            break;
        }
        r->group = g;
        r->group_of = G;
        p->groups[p->n_groups++] = r;
        for (int i = 0; i < r->n_ranks && n_taken < (size_t)sp->ring_size; i++)
            taken[n_taken++] = r->ranks[i].worker_id;
    }
    free(taken);
    if (st != STRIA_OK) {
        stria__lsess_close(p);
        return st;
    }
    p->id = p->groups[0]->id;
    p->layout = p->groups[0]->layout;
    *out = p;
    return STRIA_OK;
}

/* One head group's part of a call, on a thread of its own. */
typedef struct {
    stria_session_t *s;
    const char *fn;
    stria__lreq_t r;
    stria_status_t st;
    bool retryable;
    char msg[1024];
} group_call_t;

static void *group_call_main(void *arg)
{
    group_call_t *gc = arg;
    gc->st = stria__lsess_call(gc->s, gc->fn, &gc->r, NULL);
    if (gc->st != STRIA_OK) {
        gc->retryable = stria_error_retryable();
        snprintf(gc->msg, sizeof(gc->msg), "%s", stria_error_msg());
    }
    return NULL;
}

static stria_status_t group_call(stria_session_t *p, const char *fn, const stria__lreq_t *r)
{
    if (r->hold || r->use_held)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "%s: held forwards are built for sessions without head groups only",
                               fn);
    pthread_mutex_lock(&p->lock);
    const int G = p->n_groups;
    group_call_t *gc = calloc((size_t)G, sizeof(*gc));
    pthread_t *th = calloc((size_t)G, sizeof(*th));
    bool *started = calloc((size_t)G, sizeof(*started));
    if (gc == NULL || th == NULL || started == NULL) {
        free(gc), free(th), free(started);
        pthread_mutex_unlock(&p->lock);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    const double t0 = stria_time_now();
    for (int g = 0; g < G; g++) {
        gc[g] = (group_call_t){.s = p->groups[g], .fn = fn, .r = *r};
        gc[g].r.progress = NULL; /* (one ring's progress is not the call's) */
        if (g > 0)
            started[g] = pthread_create(&th[g], NULL, group_call_main, &gc[g]) == 0;
    }
    group_call_main(&gc[0]);
    for (int g = 1; g < G; g++) {
        if (started[g])
            pthread_join(th[g], NULL);
        else /* no thread: this one runs it */
            group_call_main(&gc[g]);
    }
    stria_status_t st = STRIA_OK;
    stria_session_stats_t *ps = &p->stats;
    ps->last_pass_s = 0;
    ps->last_ring_bytes = ps->last_minflt = 0;
    ps->last_steps = 0;
    for (int g = 0; g < G; g++) {
        if (gc[g].st != STRIA_OK && st == STRIA_OK) {
            st = stria_error_set(gc[g].st, "head group %d of %d: %s", g, G, gc[g].msg);
            stria_error_set_retryable(gc[g].retryable);
        }
        const stria_session_stats_t *gs = &p->groups[g]->stats;
        ps->last_pass_s = fmax(ps->last_pass_s, gs->last_pass_s);
        ps->last_ring_bytes += gs->last_ring_bytes;
        ps->last_minflt += gs->last_minflt;
        ps->last_steps = gs->last_steps > ps->last_steps ? gs->last_steps : ps->last_steps;
    }
    ps->last_call_s = stria_time_now() - t0;
    if (st == STRIA_OK)
        ps->calls++;
    else
        ps->failed++;
    free(gc), free(th), free(started);
    pthread_mutex_unlock(&p->lock);
    return st;
}

/* A head-grouped session's figures: its own calls, its rings' traffic and
 * openings. */
static void group_stats(const stria_session_t *p, stria_session_stats_t *out)
{
    for (int g = 0; g < p->n_groups; g++) {
        stria_session_t *r = p->groups[g];
        pthread_mutex_lock(&r->lock);
        out->retries += r->stats.retries;
        out->reopened += r->stats.reopened;
        out->bytes_up += r->stats.bytes_up;
        out->bytes_down += r->stats.bytes_down;
        out->generation =
            r->stats.generation > out->generation ? r->stats.generation : out->generation;
        pthread_mutex_unlock(&r->lock);
    }
}

/* ---- the public session API ---------------------------------------------------- */

static stria_status_t read_session_spec(const stria_session_spec_t *in, stria_session_spec_t *out)
{
    stria_status_t st =
        stria__labi_read(out, sizeof(*out), STRIA__V1_END(stria_session_spec_t, placement_fallback),
                         in, "stria_session_spec_t", "STRIA_SESSION_SPEC_INIT");
    if (st != STRIA_OK)
        return st;
    if (out->kv_heads == 0)
        out->kv_heads = out->heads;
    if (out->max_batch < 1 || out->max_seq_len < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: max_batch and max_seq_len (the bounds of a call) "
                               "are required (got %lld, %lld)",
                               (long long)out->max_batch, (long long)out->max_seq_len);
    if (!isfinite(out->idle_timeout_s) || out->idle_timeout_s < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: idle_timeout_s must be finite and >= 0 (got %g)",
                               out->idle_timeout_s);
    if (out->sharded && out->ring_size < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: a sharded session needs ring_size: the trainer's "
                               "world size");
    if (out->max_held > STRIA__MAX_HELD)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "session spec: max_held must be at most %d forwards (got %u)",
                               STRIA__MAX_HELD, out->max_held);
    return STRIA_OK;
}

static void link_session(stria_session_t *s)
{
    s->next = s->client->sessions;
    s->client->sessions = s;
}

static void unlink_session(stria_session_t *s)
{
    stria_session_t **pp = &s->client->sessions;
    while (*pp != NULL && *pp != s)
        pp = &(*pp)->next;
    if (*pp == s)
        *pp = s->next;
}

stria_status_t stria_session_open(stria_client_t *client, const stria_session_spec_t *spec,
                                  stria_session_t **session_out)
{
    stria_session_spec_t sp;
    stria_status_t st;
    if (client == NULL || spec == NULL || session_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_open: NULL argument");
    if ((st = read_session_spec(spec, &sp)) != STRIA_OK)
        return st;
    if (sp.head_groups == STRIA_HEAD_GROUPS_AUTO && !sp.sharded && sp.max_held == 0 &&
        (st = group_auto(client, &sp)) != STRIA_OK)
        return st;
    if (sp.head_groups == STRIA_HEAD_GROUPS_AUTO) /* sharded or held: one ring */
        sp.head_groups = 1;
    /* the job spec of a session: its bounds as batch and seq_len */
    stria__lopen_t o = {
        .session = true, .sharded = sp.sharded, .max_held = sp.max_held, .retries = -1};
    o.js = (stria_job_spec_t)STRIA_JOB_SPEC_INIT;
    o.js.batch = sp.max_batch;
    o.js.seq_len = sp.max_seq_len;
    o.js.heads = sp.heads;
    o.js.kv_heads = sp.kv_heads;
    o.js.head_dim = sp.head_dim;
    o.js.dtype = sp.dtype;
    o.js.causal = true;
    o.js.layout = sp.layout;
    o.js.ring_size = sp.ring_size;
    o.js.step_timeout_s = sp.step_timeout_s;
    o.js.ttl_s = sp.idle_timeout_s;
    o.js.no_queue = sp.no_queue;
    o.js.label = sp.label;
    o.js.arrival_timeout_s = sp.arrival_timeout_s;
    o.js.placement_hosts = sp.placement_hosts;
    o.js.placement_devices = sp.placement_devices;
    o.js.placement_fallback = sp.placement_fallback;
    stria_session_t *s = NULL;
    if ((st = sp.head_groups > 1
                  ? group_open(client, &o, &sp, &s)
                  : stria__lsess_open(client, &o, &sp, NULL, NULL, &s)) != STRIA_OK) {
        char msg[1024];
        bool retryable = stria_error_retryable();
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_error_set(st, "stria_session_open: %s", msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    link_session(s);
    *session_out = s;
    return STRIA_OK;
}

stria_status_t stria_session_export(const stria_session_t *s, void *out, size_t cap,
                                    size_t *len_out)
{
    uint8_t *b = out;
    if (s == NULL || out == NULL || len_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_export: NULL argument");
    if (!s->sharded || s->id == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: only a sharded session can be shared");
    if (cap < STRIA_SESSION_EXPORT_BYTES)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_export: %zu bytes of room, %d needed", cap,
                               STRIA_SESSION_EXPORT_BYTES);
    memcpy(b, s->job ? JOB_EXPORT_MAGIC : SESSION_EXPORT_MAGIC, 8);
    stria_put_le64(b + 8, s->id);
    memcpy(b + 16, s->secret.bytes, sizeof(s->secret.bytes));
    *len_out = STRIA_SESSION_EXPORT_BYTES;
    return STRIA_OK;
}

stria_status_t stria_session_import(stria_client_t *client, const void *bytes, size_t len,
                                    stria_session_t **session_out)
{
    stria_session_t *s = NULL;
    stria_status_t st = stria__lsess_import(client, bytes, len, false, &s);
    if (st != STRIA_OK)
        return st;
    link_session(s);
    *session_out = s;
    return STRIA_OK;
}

/* A call of the public API: its record read, then tried. */
static stria_status_t public_call(stria_session_t *s, const char *fn, const stria_call_t *call,
                                  stria__lreq_t *r, uint64_t *held_out)
{
    stria_call_shape_t c;
    stria_status_t st = stria__labi_call(call, &c);
    if (st != STRIA_OK)
        return st;
    r->shape = &c;
    r->retries = -1;
    if (s != NULL && s->n_groups > 0)
        return group_call(s, fn, r);
    return stria__lsess_call(s, fn, r, held_out);
}

stria_status_t stria_session_forward(stria_session_t *session, const stria_call_t *call,
                                     const void *q, const void *k, const void *v, void *o,
                                     float *lse)
{
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    stria__lreq_t r = {.rank = -1, .io = &io};
    return public_call(session, "stria_session_forward", call, &r, NULL);
}

stria_status_t stria_session_backward(stria_session_t *session, const stria_call_t *call,
                                      const void *q, const void *k, const void *v, const void *o,
                                      const float *lse, const void *d_o, void *dq, void *dk,
                                      void *dv)
{
    const stria__lio_t io = {.in = {q, k, v, o, lse, d_o}, .out = {dq, dk, dv}};
    stria__lreq_t r = {.rank = -1, .backward = true, .io = &io};
    return public_call(session, "stria_session_backward", call, &r, NULL);
}

static stria_status_t must_be_sharded(const stria_session_t *s, const char *fn)
{
    if (s != NULL && !s->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: the session is not sharded", fn);
    return STRIA_OK;
}

stria_status_t stria_session_forward_shard(stria_session_t *session, const stria_call_t *call,
                                           int rank, const void *q, const void *k, const void *v,
                                           void *o, float *lse)
{
    static const char fn[] = "stria_session_forward_shard";
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    stria__lreq_t r = {.rank = rank < 0 ? INT32_MAX : rank, .io = &io};
    stria_status_t st = must_be_sharded(session, fn);
    return st != STRIA_OK ? st : public_call(session, fn, call, &r, NULL);
}

stria_status_t stria_session_backward_shard(stria_session_t *session, const stria_call_t *call,
                                            int rank, const void *q, const void *k, const void *v,
                                            const void *o, const float *lse, const void *d_o,
                                            void *dq, void *dk, void *dv)
{
    static const char fn[] = "stria_session_backward_shard";
    const stria__lio_t io = {.in = {q, k, v, o, lse, d_o}, .out = {dq, dk, dv}};
    stria__lreq_t r = {.rank = rank < 0 ? INT32_MAX : rank, .backward = true, .io = &io};
    stria_status_t st = must_be_sharded(session, fn);
    return st != STRIA_OK ? st : public_call(session, fn, call, &r, NULL);
}

stria_status_t stria_session_forward_held(stria_session_t *session, const stria_call_t *call,
                                          int rank, const void *q, const void *k, const void *v,
                                          void *o, float *lse, uint64_t *held_out)
{
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    stria__lreq_t r = {.rank = rank, .hold = true, .io = &io};
    if (held_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_session_forward_held: NULL held_out");
    return public_call(session, "stria_session_forward_held", call, &r, held_out);
}

stria_status_t stria_session_backward_held(stria_session_t *session, const stria_call_t *call,
                                           int rank, uint64_t held, const void *d_o, void *dq,
                                           void *dk, void *dv)
{
    const stria__lio_t io = {.in = {NULL, NULL, NULL, NULL, NULL, d_o}, .out = {dq, dk, dv}};
    stria__lreq_t r = {.rank = rank, .backward = true, .use_held = true, .held = held, .io = &io};
    return public_call(session, "stria_session_backward_held", call, &r, NULL);
}

stria_status_t stria_session_release_held(stria_session_t *s, int rank, uint64_t held)
{
    static const char fn[] = "stria_session_release_held";
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

stria_status_t stria_session_buffer(stria_session_t *s, const stria_call_t *call, int rank,
                                    stria_tensor_id_t tensor, stria_shard_buffer_t *out)
{
    stria_call_shape_t c;
    stria_status_t st = stria__labi_call(call, &c);
    if (st != STRIA_OK)
        return st;
    return stria__lsess_buffer(s, "stria_session_buffer", &c, rank, tensor, out);
}

int64_t stria_session_shard_tokens(const stria_session_t *s, int64_t seq_len, int rank)
{
    if (s == NULL || s->id == 0)
        return -1;
    stria_call_t call = STRIA_CALL_INIT;
    call.seq_len = seq_len;
    return stria_call_shard_tokens(s->layout, s->n_ranks, &call, rank);
}

stria_status_t stria_session_positions(const stria_session_t *s, int64_t seq_len, int rank,
                                       int64_t *positions_out)
{
    if (s == NULL || s->id == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_positions: NULL or unopened session");
    stria_call_t call = STRIA_CALL_INIT;
    call.seq_len = seq_len;
    return stria_call_positions(s->layout, s->n_ranks, &call, rank, positions_out);
}

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

int64_t stria_call_shard_tokens(stria_layout_kind_t layout, int n_ranks, const stria_call_t *call,
                                int rank)
{
    stria_call_shape_t shape;
    int64_t n;
    if (stria__labi_call(call, &shape) != STRIA_OK ||
        stria__lcall_positions("stria_call_shard_tokens", layout, n_ranks, &shape, rank, &n,
                               NULL) != STRIA_OK)
        return -1;
    return n;
}

stria_status_t stria_call_positions(stria_layout_kind_t layout, int n_ranks,
                                    const stria_call_t *call, int rank, int64_t *positions_out)
{
    stria_call_shape_t shape;
    if (positions_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_call_positions: positions_out is NULL");
    stria_status_t st = stria__labi_call(call, &shape);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "stria_call_positions");
    return stria__lcall_positions("stria_call_positions", layout, n_ranks, &shape, rank, NULL,
                                  positions_out);
}

int stria_session_ring_size(const stria_session_t *s)
{
    if (s != NULL && s->n_groups > 0) /* head groups x the ranks of each ring */
        return s->n_groups * s->groups[0]->n_ranks;
    return s != NULL && s->id != 0 ? s->n_ranks : 0;
}

stria_layout_kind_t stria_session_layout(const stria_session_t *s)
{
    if (s == NULL)
        return STRIA_LAYOUT_STRIPED;
    return s->id != 0 ? s->layout : s->spec.layout; /* auto: as the coordinator chose */
}

stria_status_t stria_session_spec_get(const stria_session_t *s, stria_session_spec_t *out)
{
    if (s == NULL || out == NULL || out->struct_size != sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_spec_get: NULL argument or a struct_size this "
                               "library cannot fill (start from STRIA_SESSION_SPEC_INIT)");
    *out = s->spec; /* its strings and arrays were not kept */
    if (s->id != 0) {
        out->ring_size = stria_session_ring_size(s);
        out->layout = s->layout;
    }
    return STRIA_OK;
}

uint64_t stria_session_id(const stria_session_t *s)
{
    return s != NULL ? s->id : 0;
}

stria_status_t stria_session_stats(const stria_session_t *s, stria_session_stats_t *out)
{
    if (s == NULL || out == NULL || out->struct_size == 0 || out->struct_size > sizeof(*out))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_session_stats: NULL argument or a struct_size this library "
                               "cannot fill (start from STRIA_SESSION_STATS_INIT)");
    size_t size = out->struct_size;
    pthread_mutex_lock((pthread_mutex_t *)&s->lock);
    stria_session_stats_t ours = s->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&s->lock);
    group_stats(s, &ours);
    ours.struct_size = size;
    memcpy(out, &ours, size);
    return STRIA_OK;
}

stria_status_t stria_session_close(stria_session_t *s)
{
    if (s == NULL)
        return STRIA_OK;
    unlink_session(s);
    return stria__lsess_close(s);
}
