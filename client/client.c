/*
 * libstria: submit, scatter, run, gather. See stria_client.h; the rooms of
 * the library are listed in client_int.h.
 *
 * Each call proceeds in phases (upload, pass, download); within a phase one
 * thread per rank talks to that rank's worker over its own connection, and the
 * calling thread waits for them, reporting progress. Phases are separated by a
 * join, so every rank starts its pass only once every rank has its inputs:
 * the ring never waits on a slow upload.
 */
#include "client_int.h"
#include "stria_spec.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- helpers ------------------------------------------------------------ */

size_t stria__row_bytes(const stria_job_t *job, int64_t heads)
{
    return (size_t)heads * (size_t)job->spec.head_dim * stria_dtype_size(job->spec.dtype);
}

/* Adds a worker to those a failed try is blamed on (once). */
static void stria__blame(stria_job_t *job, uint64_t worker_id)
{
    for (size_t i = 0; i < job->n_blamed; i++)
        if (job->blamed[i] == worker_id)
            return;
    if (worker_id != 0 && job->n_blamed < STRIA__MAX_BLAMED)
        job->blamed[job->n_blamed++] = worker_id;
}

/* How well a rank's failure explains the phase's: its own failure best, then
 * a cancellation (the rank that heard of it first aborts the ring with it),
 * last a peer's abort, which only echoes another rank's failure. */
static int stria__failure_rank(stria_status_t st)
{
    if (st == STRIA_ERR_PEER)
        return 1;
    if (st == STRIA_ERR_CANCELLED)
        return 2;
    return 3;
}

/* The same for a rank's failure, a rank given up on explaining nothing. */
static int stria__explains(const stria__rank_t *r)
{
    return r->abandoned ? 0 : stria__failure_rank(r->status);
}

/* The status of a phase: the first rank whose failure explains the others
 * best (see stria__failure_rank()). */
static stria_status_t stria__phase_status(stria_job_t *job, const char *phase)
{
    int pick = -1;
    for (int i = 0; i < job->n_ranks; i++) {
        if (job->ranks[i].status == STRIA_OK)
            continue;
        if (pick < 0 || stria__explains(&job->ranks[i]) > stria__explains(&job->ranks[pick]))
            pick = i;
    }
    if (pick < 0)
        return STRIA_OK;
    /* the workers that were lost are to blame; the others only heard of it */
    for (int i = 0; i < job->n_ranks; i++)
        if (job->ranks[i].status != STRIA_OK && job->ranks[i].conn_lost)
            stria__blame(job, job->ranks[i].worker_id);
    stria__rank_t *r = &job->ranks[pick];
    job->retryable = r->retryable;
    stria_error_set(r->status, "job %llu, %s, rank %d (worker %s): %s", (unsigned long long)job->id,
                    phase, r->rank, r->rpc_address, r->error);
    stria_error_set_retryable(r->retryable);
    return r->status;
}

/* Whether a failed coordinator call is worth another try: the connection
 * broke or was refused (the coordinator restarts; the next call connects
 * again), or a job-scoped call was answered busy because a restarted
 * coordinator is still rebuilding its jobs. */
static bool stria__coord_transient(stria_client_t *c, uint32_t method, stria_status_t st)
{
    if (!stria_rpc_client_server_error(c->coord))
        return st == STRIA_ERR_CLOSED || st == STRIA_ERR_IO || st == STRIA_ERR_TRANSPORT ||
               st == STRIA_ERR_TIMEOUT;
    return st == STRIA_ERR_BUSY &&
           (method == STRIA_RPC_COORDINATOR_GET_JOB || method == STRIA_RPC_COORDINATOR_RELEASE_JOB);
}

stria_status_t stria__coord_call_ex(stria_client_t *c, uint32_t method, const ProtobufCMessage *req,
                                    const stria_job_t *job, stria_rpc_reply_t *reply, bool patient)
{
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.timeout_s = STRIA__COORD_TIMEOUT_S;
    if (job != NULL) {
        rq.job_secret = &job->secret;
        rq.job_id = job->id;
    }
    double give_up = stria_time_now() + STRIA__RECONNECT_S, pause = 0.1;
    for (int tries = 1;; tries++) {
        stria_status_t st = stria_rpc_client_call(c->coord, &rq, reply);
        if (st == STRIA_OK)
            return STRIA_OK;
        /* one try: but a connection found broken (a coordinator that
         * restarted since) is connected anew at once, once */
        if (!patient && tries == 1 && st != STRIA_ERR_TIMEOUT &&
            stria__coord_transient(c, method, st) && !stria_rpc_client_server_error(c->coord))
            continue;
        if (!patient || !stria__coord_transient(c, method, st) || stria_time_now() >= give_up)
            return stria_error_wrap(st, "coordinator %s%s", c->coordinator,
                                    tries > 1 ? " (out of reach or recovering for too long)" : "");
        struct timespec ts = {0, (long)(pause * 1e9)};
        nanosleep(&ts, NULL);
        pause = pause * 2 < 1.0 ? pause * 2 : 1.0;
    }
}

stria_status_t stria__coord_call(stria_client_t *c, uint32_t method, const ProtobufCMessage *req,
                                 const stria_job_t *job, stria_rpc_reply_t *reply)
{
    return stria__coord_call_ex(c, method, req, job, reply, true);
}

/* ---- ABI ------------------------------------------------------------------ */

unsigned stria_client_abi_version(void)
{
    return STRIA_CLIENT_ABI_VERSION;
}

/* The sizes of the structs as ABI 1 declared them: the smallest a caller may
 * pass. Later versions add fields at the end and keep these. */
#define STRIA__V1_END(type, last) (offsetof(type, last) + sizeof(((type *)0)->last))
#define STRIA__PARAMS_V1_SIZE     STRIA__V1_END(stria_client_params_t, client_name)
#define STRIA__SPEC_V1_SIZE       STRIA__V1_END(stria_job_spec_t, label)
#define STRIA__STATS_V1_SIZE      STRIA__V1_END(stria_call_stats_t, bytes_down)
_Static_assert(STRIA__PARAMS_V1_SIZE <= sizeof(stria_client_params_t) &&
                   STRIA__SPEC_V1_SIZE <= sizeof(stria_job_spec_t) &&
                   STRIA__STATS_V1_SIZE <= sizeof(stria_call_stats_t),
               "ABI 1 sizes: a struct grew; keep these at its ABI 1 end");
/* A struct_size beyond this is no size at all: the caller's header predates
 * struct_size (its first field is a pointer) or the struct is uninitialised. */
#define STRIA__ABI_MAX_GROWTH 4096

/* Whether `theirs`, a caller's struct_size, can be the size of a version of
 * a struct whose ABI 1 size is v1 and whose current size is ours. */
static stria_status_t stria__abi_size_ok(size_t theirs, size_t v1, size_t ours, const char *what,
                                         const char *init)
{
    if (theirs >= v1 && theirs <= ours + STRIA__ABI_MAX_GROWTH && theirs % sizeof(void *) == 0)
        return STRIA_OK;
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "%s: struct_size is %zu, not a size of this struct: set it to "
                           "sizeof(%s) (start from %s); a program built against a libstria "
                           "header older than ABI %d must be rebuilt",
                           what, theirs, what, init, STRIA_CLIENT_ABI_VERSION);
}

/* Reads a caller's struct that starts with its struct_size into ours (`size`
 * bytes, zeroed first): a smaller struct (an older header; at least `v1`,
 * the first version's size) leaves our later fields at their zero defaults,
 * a larger one (a newer header) is accepted only when the bytes this library
 * does not know are all zero. */
static stria_status_t stria__abi_read(void *dst, size_t size, size_t v1, const void *src,
                                      const char *what, const char *init)
{
    size_t theirs;
    memcpy(&theirs, src, sizeof(theirs));
    stria_status_t st = stria__abi_size_ok(theirs, v1, size, what, init);
    if (st != STRIA_OK)
        return st;
    for (size_t i = size; i < theirs; i++)
        if (((const unsigned char *)src)[i] != 0)
            return stria_error_set(STRIA_ERR_UNSUPPORTED,
                                   "%s: a field at byte %zu is set, which this libstria (ABI %d, "
                                   "%zu-byte %s) does not know: use a newer library",
                                   what, i, STRIA_CLIENT_ABI_VERSION, size, what);
    memset(dst, 0, size);
    memcpy(dst, src, theirs < size ? theirs : size);
    memcpy(dst, &size, sizeof(size));
    return STRIA_OK;
}

/* Copies our stats into the caller's struct, as far as its struct_size
 * reaches (its struct_size stays); fields of a newer header that this
 * library does not fill are zeroed. */
static void stria__abi_write_stats(stria_call_stats_t *out, const stria_call_stats_t *ours)
{
    size_t theirs = out->struct_size;
    size_t n = theirs < sizeof(*ours) ? theirs : sizeof(*ours);
    memcpy((char *)out + sizeof(size_t), (const char *)ours + sizeof(size_t), n - sizeof(size_t));
    if (theirs > n)
        memset((char *)out + n, 0, theirs - n);
}

static stria_status_t stria__check_stats(const stria_call_stats_t *stats)
{
    if (stats == NULL)
        return STRIA_OK;
    return stria__abi_size_ok(stats->struct_size, STRIA__STATS_V1_SIZE, sizeof(*stats),
                              "stria_call_stats_t", "STRIA_CALL_STATS_INIT");
}

/* ---- client ------------------------------------------------------------- */

stria_status_t stria_client_connect(const stria_client_params_t *params,
                                    stria_client_t **client_out)
{
    stria_client_t *c;
    stria_rpc_client_params_t rp;
    stria_rpc_reply_t reply;
    stria_client_params_t p;
    stria_status_t st;

    if (params == NULL || client_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_client_connect: NULL argument");
    st = stria__abi_read(&p, sizeof(p), STRIA__PARAMS_V1_SIZE, params, "stria_client_params_t",
                         "STRIA_CLIENT_PARAMS_INIT");
    if (st != STRIA_OK)
        return st;
    params = &p;
    if (params->coordinator == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_connect: the coordinator address is required");
    if (params->token != NULL && params->token_file != NULL)
        return stria_error_set(
            STRIA_ERR_INVALID_ARG,
            "stria_client_connect: token and token_file are both set (give one)");
    if (params->forward_retries > 16)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_connect: forward_retries %d is more than 16",
                               params->forward_retries);
    if ((unsigned)params->data_path > STRIA_DATA_PATH_SHM)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_connect: data_path %d is none of auto (0), tcp (1), "
                               "shm (2)",
                               (int)params->data_path);
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate client");
    c->params = *params;
    c->coordinator = strdup(params->coordinator);
    c->token = params->token ? strdup(params->token) : NULL;
    c->client_name = strdup(params->client_name ? params->client_name : "libstria");
    if (c->coordinator == NULL || c->client_name == NULL || (params->token && c->token == NULL)) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate client");
        goto err;
    }
    if (params->token_file != NULL &&
        (st = stria_rpc_token_read(params->token_file, &c->token)) != STRIA_OK)
        goto err;
    if (c->params.connect_timeout_s <= 0)
        c->params.connect_timeout_s = 10.0;
    if (c->params.rpc_timeout_s <= 0)
        c->params.rpc_timeout_s = 120.0;

    memset(&rp, 0, sizeof(rp));
    rp.address = c->coordinator;
    rp.service = &stria__v1__coordinator__descriptor;
    rp.token = c->token;
    rp.client_name = c->client_name;
    rp.connect_timeout_s = c->params.connect_timeout_s;
    st = stria_rpc_client_connect(&rp, &c->coord);
    if (st != STRIA_OK) {
        stria_error_wrap(st, "coordinator %s", c->coordinator);
        goto err;
    }
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    memset(&reply, 0, sizeof(reply));
    st = stria__coord_call(c, STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, NULL, &reply);
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK)
        goto err;
    *client_out = c;
    return STRIA_OK;
err:
    stria_rpc_client_close(c->coord);
    free(c->coordinator);
    stria_auth_free_secret(c->token);
    free(c->client_name);
    free(c);
    return st;
}

void stria_client_close(stria_client_t *client)
{
    if (client == NULL)
        return;
    while (client->sessions != NULL)
        stria_session_close(client->sessions);
    while (client->jobs != NULL)
        stria_client_release(client->jobs);
    stria_rpc_client_close(client->coord);
    free(client->coordinator);
    stria_auth_free_secret(client->token);
    free(client->client_name);
    free(client);
}

/* ---- rank threads ------------------------------------------------------- */

typedef struct {
    stria__phase_t *ph;
    stria__rank_t *r;
} stria__thread_arg_t;

static void *stria__rank_thread(void *arg)
{
    stria__thread_arg_t *ta = arg;
    stria__phase_t *ph = ta->ph;
    ta->r->status = STRIA_OK;
    ta->r->error[0] = '\0';
    ta->r->retryable = ta->r->conn_lost = false;
    ph->fn(ph, ta->r);
    pthread_mutex_lock(&ph->lock);
    stria__rank_t *r = ta->r;
    r->done = true;
    if (r->abandoned && r->status != STRIA_OK) { /* its own error only says "abandoned" */
        r->status = ph->abandon_retryable ? STRIA_ERR_PEER : STRIA_ERR_CANCELLED;
        r->conn_lost = false;
        r->retryable = ph->abandon_retryable;
        snprintf(r->error, sizeof(r->error), "no answer; given up on, as %s", ph->abandon_why);
    }
    if (r->abandoned) { /* its connection is good for nothing now */
        stria_rpc_client_close(r->conn);
        r->conn = NULL;
    } else if (r->status != STRIA_OK && ph->first_fail == 0) {
        ph->first_fail = stria_time_now();
    }
    ph->remaining--;
    pthread_cond_signal(&ph->cv);
    pthread_mutex_unlock(&ph->lock);
    return NULL;
}

/* Polls the coordinator for the slowest rank's step while a pass runs. */
static void stria__poll_progress(stria__phase_t *ph, stria_progress_cb progress, void *arg,
                                 stria_phase_t phase)
{
    stria_job_t *job = ph->job;
    if (phase == STRIA_PHASE_UPLOAD || phase == STRIA_PHASE_DOWNLOAD) {
        uint64_t done = 0, total = 0;
        for (int i = 0; i < job->n_ranks; i++)
            done += __atomic_load_n(&job->ranks[i].bytes, __ATOMIC_RELAXED);
        int n_tensors = phase == STRIA_PHASE_UPLOAD ? ph->n_in : ph->n_out;
        (void)n_tensors;
        total = 0;
        for (int i = 0; i < job->n_ranks; i++) {
            int64_t t = job->ranks[i].tokens * job->spec.batch;
            if (phase == STRIA_PHASE_UPLOAD)
                total += (uint64_t)t * (ph->backward
                                            ? stria__row_bytes(job, job->spec.heads)
                                            : stria__row_bytes(job, job->spec.heads) +
                                                  2 * stria__row_bytes(job, job->spec.kv_heads));
            else
                total +=
                    (uint64_t)t * (ph->backward ? stria__row_bytes(job, job->spec.heads) +
                                                      2 * stria__row_bytes(job, job->spec.kv_heads)
                                                : stria__row_bytes(job, job->spec.heads) +
                                                      (uint64_t)job->spec.heads * 4);
        }
        progress(arg, phase, (double)done, (double)total);
        return;
    }
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.job_id = job->id;
    memset(&reply, 0, sizeof(reply));
    if (stria__coord_call_ex(job->client, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, job, &reply,
                             false) == STRIA_OK) {
        Stria__V1__GetJobReply *r = (Stria__V1__GetJobReply *)reply.msg;
        if (r->job != NULL && r->job->steps_total > 0)
            progress(arg, phase, (double)r->job->step, (double)r->job->steps_total);
    }
    stria_rpc_reply_free(&reply);
}

/* Gives up on the ranks still running (lock held): their calls fail at
 * once (see stria_rpc_client_abort()). */
static void stria__abandon_locked(stria__phase_t *ph, const char *why, bool retryable)
{
    stria_job_t *job = ph->job;
    snprintf(ph->abandon_why, sizeof(ph->abandon_why), "%s", why);
    ph->abandon_retryable = retryable;
    ph->abandoned = true;
    for (int i = 0; i < job->n_ranks; i++) {
        stria__rank_t *r = &job->ranks[i];
        if (r->done)
            continue;
        r->abandoned = true;
        stria_rpc_client_abort(__atomic_load_n(&r->conn, __ATOMIC_ACQUIRE));
    }
}

bool stria__job_ended(stria_job_t *job, char *why, size_t len, bool *retryable)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    bool ended = false;
    req.job_id = job->id;
    memset(&reply, 0, sizeof(reply));
    /* one try: the watch must not wait out a coordinator that restarts */
    if (stria__coord_call_ex(job->client, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, job, &reply,
                             false) != STRIA_OK)
        return false;
    const Stria__V1__JobInfo *info = ((Stria__V1__GetJobReply *)reply.msg)->job;
    if (info != NULL && info->state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED &&
        info->state != STRIA__V1__JOB_STATE__JOB_STATE_RELEASED) {
        ended = true;
        *retryable =
            info->state == STRIA__V1__JOB_STATE__JOB_STATE_FAILED && info->failure_retryable;
        snprintf(why, len, "the coordinator ended the job: %s",
                 info->failure && info->failure[0] ? info->failure : "no reason given");
    }
    stria_rpc_reply_free(&reply);
    return ended;
}

/* While a phase runs (lock held): once a rank failed it, the ranks silent
 * STRIA__ABANDON_S later are given up on; so are all of them once the
 * coordinator ended the job (asked every STRIA__WATCH_S). */
static void stria__watch_locked(stria__phase_t *ph, double started, double *next_watch)
{
    double now = stria_time_now();
    if (ph->abandoned || ph->remaining == 0)
        return;
    if (ph->first_fail > 0 && now - ph->first_fail >= STRIA__ABANDON_S) {
        char why[96];
        snprintf(why, sizeof(why), "another rank failed the phase %.1f s before",
                 now - ph->first_fail);
        stria__abandon_locked(ph, why, true);
        return;
    }
    if (ph->ended_at > 0) {
        if (now - ph->ended_at >= STRIA__ABANDON_S)
            stria__abandon_locked(ph, ph->ended_why, ph->ended_retryable);
        return;
    }
    if (ph->job->id == 0 || now < *next_watch || now - started < STRIA__WATCH_S)
        return;
    *next_watch = now + STRIA__WATCH_S;
    char why[512];
    bool retryable = false;
    pthread_mutex_unlock(&ph->lock);
    bool ended = stria__job_ended(ph->job, why, sizeof(why), &retryable);
    pthread_mutex_lock(&ph->lock);
    if (ended && ph->ended_at == 0) {
        ph->ended_at = stria_time_now();
        ph->ended_retryable = retryable;
        snprintf(ph->ended_why, sizeof(ph->ended_why), "%s", why);
    }
}

/* Runs fn on one thread per rank and waits for all of them. */
static stria_status_t stria__run_phase(stria__phase_t *ph, const char *name,
                                       stria_progress_cb progress, void *arg, stria_phase_t phase)
{
    stria_job_t *job = ph->job;
    pthread_t *th = calloc((size_t)job->n_ranks, sizeof(pthread_t));
    stria__thread_arg_t *ta = calloc((size_t)job->n_ranks, sizeof(*ta));
    int started = 0;

    if (th == NULL || ta == NULL) {
        free(th);
        free(ta);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot start rank threads");
    }
    pthread_mutex_init(&ph->lock, NULL);
    pthread_cond_init(&ph->cv, NULL);
    ph->remaining = job->n_ranks;
    ph->first_fail = ph->ended_at = 0;
    ph->abandoned = false;
    double t_start = stria_time_now(), next_watch = 0;
    for (int i = 0; i < job->n_ranks; i++)
        job->ranks[i].done = job->ranks[i].abandoned = false;
    for (int i = 0; i < job->n_ranks; i++) {
        job->ranks[i].bytes = 0;
        ta[i].ph = ph;
        ta[i].r = &job->ranks[i];
        if (pthread_create(&th[i], NULL, stria__rank_thread, &ta[i]) != 0) {
            job->ranks[i].status = STRIA_ERR_NO_MEMORY;
            snprintf(job->ranks[i].error, sizeof(job->ranks[i].error), "cannot start a thread");
            pthread_mutex_lock(&ph->lock);
            job->ranks[i].done = true;
            if (ph->first_fail == 0)
                ph->first_fail = stria_time_now();
            ph->remaining--;
            pthread_mutex_unlock(&ph->lock);
            continue;
        }
        started++;
    }
    pthread_mutex_lock(&ph->lock);
    while (ph->remaining > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(STRIA__POLL_S * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&ph->cv, &ph->lock, &ts);
        stria__watch_locked(ph, t_start, &next_watch);
        if (ph->remaining > 0 && progress != NULL) {
            pthread_mutex_unlock(&ph->lock);
            stria__poll_progress(ph, progress, arg, phase);
            pthread_mutex_lock(&ph->lock);
        }
    }
    pthread_mutex_unlock(&ph->lock);
    for (int i = 0; i < job->n_ranks; i++)
        if (job->ranks[i].status != STRIA_ERR_NO_MEMORY || started == job->n_ranks)
            pthread_join(th[i], NULL);
    pthread_cond_destroy(&ph->cv);
    pthread_mutex_destroy(&ph->lock);
    free(th);
    free(ta);
    return stria__phase_status(job, name);
}

/* ---- jobs --------------------------------------------------------------- */

/* A job is one call: its record (documents borrowed from the spec), checked
 * and sent as a session's calls are. */
static stria_call_shape_t stria__job_call(const stria_job_spec_t *s)
{
    return (stria_call_shape_t){.batch = s->batch,
                                .seq_len = s->seq_len,
                                .causal = s->causal,
                                .scale = s->scale,
                                .cu_seqlens = s->cu_seqlens,
                                .n_cu_seqlens = s->n_cu_seqlens,
                                .has_window = s->has_window,
                                .window_left = s->window_left,
                                .window_right = s->window_right};
}

static stria_status_t stria__check_spec(const stria_job_spec_t *s)
{
    if (s == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec is NULL");
    if (s->batch < 1 || s->seq_len < 1 || s->heads < 1 || s->kv_heads < 1 || s->head_dim < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job spec: batch, seq_len, heads, kv_heads and head_dim must be "
                               ">= 1");
    if (s->batch > UINT32_MAX || s->heads > UINT32_MAX || s->kv_heads > UINT32_MAX ||
        s->head_dim > UINT32_MAX || s->ring_size < 0 || s->step_timeout_s < 0 || s->ttl_s < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec: a field is out of range");
    if (stria_dtype_size(s->dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec: unknown dtype");
    const stria_call_shape_t call = stria__job_call(s);
    if (stria_call_masks_check(&call) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "job spec");
    if (!isfinite(s->arrival_timeout_s) || s->arrival_timeout_s < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job spec: arrival_timeout_s must be finite and >= 0 (got %g)",
                               s->arrival_timeout_s);
    if (s->placement_devices != NULL && s->placement_hosts == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job spec: placement_devices without placement_hosts");
    if (s->placement_hosts != NULL && s->ring_size < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job spec: placement_hosts needs ring_size (one host per rank)");
    for (int r = 0; s->placement_hosts != NULL && r < s->ring_size; r++)
        if (s->placement_hosts[r] == NULL || s->placement_hosts[r][0] == '\0')
            return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec: placement_hosts[%d] is %s", r,
                                   s->placement_hosts[r] == NULL ? "NULL" : "empty");
    return STRIA_OK;
}

stria_status_t stria__read_spec(const stria_job_spec_t *in, stria_job_spec_t *out)
{
    if (in == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec is NULL");
    stria_status_t st = stria__abi_read(out, sizeof(*out), STRIA__SPEC_V1_SIZE, in,
                                        "stria_job_spec_t", "STRIA_JOB_SPEC_INIT");
    return st != STRIA_OK ? st : stria__check_spec(out);
}

/* Builds the job from the coordinator's assignment and checks that it agrees
 * with the layout this library scatters with. */
stria_status_t stria__job_from_assignment(stria_job_t *job, const Stria__V1__Assignment *a)
{
    const Stria__V1__JobSpec *s = a->spec;
    stria_status_t st;

    if (s == NULL || a->n_ranks == 0 || a->n_ranks > STRIA_LAYOUT_MAX_RANKS)
        return stria_error_set(STRIA_ERR_PROTOCOL, "coordinator sent an assignment without "
                                                   "spec or ranks");
    job->id = a->job_id;
    job->spec.ring_size = (int)a->n_ranks;
    if (s->scale > 0)
        job->spec.scale = s->scale;
    if (s->step_timeout_ms > 0)
        job->spec.step_timeout_s = s->step_timeout_ms / 1000.0;
    /* The assignment names the layout the coordinator chose (auto resolved);
     * a layout the caller named must come back as it was. */
    if ((unsigned)s->layout > STRIA__V1__LAYOUT__LAYOUT_ZIGZAG ||
        (job->spec.layout != STRIA_LAYOUT_AUTO &&
         (stria_layout_kind_t)s->layout != job->spec.layout))
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "coordinator assigned layout %d to a job submitted as %s",
                               (int)s->layout, stria_layout_kind_name(job->spec.layout));
    job->spec.layout = (stria_layout_kind_t)s->layout;
    st = stria_layout_init(job->spec.layout, (int)a->n_ranks, job->spec.seq_len, &job->layout);
    if (st != STRIA_OK)
        return st;
    job->n_ranks = (int)a->n_ranks;
    job->ranks = calloc(a->n_ranks, sizeof(stria__rank_t));
    if (job->ranks == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate ranks");
    for (size_t i = 0; i < a->n_ranks; i++)
        job->ranks[i].shm.sock = -1;
    for (size_t i = 0; i < a->n_ranks; i++) {
        const Stria__V1__RankAssignment *ra = a->ranks[i];
        stria__rank_t *r = &job->ranks[i];
        r->rank = (int)i;
        if (ra->rank != i || ra->rpc_address == NULL ||
            strlen(ra->rpc_address) >= sizeof(r->rpc_address))
            return stria_error_set(STRIA_ERR_PROTOCOL, "assignment rank %zu is malformed", i);
        snprintf(r->rpc_address, sizeof(r->rpc_address), "%s", ra->rpc_address);
        r->worker_id = ra->worker_id;
        if (strlen(ra->shm_socket) < sizeof(r->shm_socket)) /* else: TCP */
            snprintf(r->shm_socket, sizeof(r->shm_socket), "%s", ra->shm_socket);
        r->tokens = stria_layout_shard_valid(&job->layout, (int)i);
        if ((int64_t)ra->tokens != r->tokens)
            return stria_error_set(STRIA_ERR_PROTOCOL,
                                   "assignment gives rank %zu %llu tokens, the %s layout %lld", i,
                                   (unsigned long long)ra->tokens,
                                   stria_layout_kind_name(job->spec.layout), (long long)r->tokens);
    }
    double step = job->spec.step_timeout_s > 0 ? job->spec.step_timeout_s : STRIA__DEFAULT_STEP_S;
    /* Workers enforce the per-step deadline; this only guards against a
     * worker that stops answering altogether. */
    job->pass_timeout_s = step * (job->n_ranks + 2) + 30.0;
    return STRIA_OK;
}

void stria__job_free(stria_job_t *job)
{
    if (job == NULL)
        return;
    for (int i = 0; i < job->n_ranks; i++) {
        stria_rpc_client_close(job->ranks[i].conn);
        stria__shm_detach(&job->ranks[i].shm);
        stria_free(job->ranks[i].stage);
    }
    free(job->ranks);
    for (size_t i = 0; i < job->n_retired; i++)
        stria__shm_detach(&job->retired[i].shm);
    free(job->retired);
    stria_auth_wipe(&job->secret, sizeof(job->secret));
    free(job);
}

void stria__job_link(stria_job_t *job)
{
    job->next = job->client->jobs;
    job->client->jobs = job;
}

static void stria__job_unlink(stria_job_t *job)
{
    stria_job_t **pp = &job->client->jobs;
    while (*pp != NULL && *pp != job)
        pp = &(*pp)->next;
    if (*pp == job)
        *pp = job->next;
}

/* The protocol's spec of ours (pointing into ours and `win`, `pl`). */
static stria_status_t stria__spec_to_proto(const stria_job_spec_t *s, bool sharded,
                                           Stria__V1__JobSpec *spec,
                                           Stria__V1__JobSpec__Window *win,
                                           Stria__V1__JobSpec__Placement **pl,
                                           Stria__V1__JobSpec__Placement *pls)
{
    const stria_call_shape_t call = stria__job_call(s);
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
    spec->sharded = sharded;
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
    return STRIA_OK;
}

stria_status_t stria__wait_queued(stria_client_t *c, stria_job_t *job, Stria__V1__JobState state,
                                  uint32_t qpos, stria_progress_cb progress, void *arg)
{
    stria_rpc_reply_t reply;
    while (state == STRIA__V1__JOB_STATE__JOB_STATE_PENDING) {
        if (progress != NULL)
            progress(arg, STRIA_PHASE_QUEUED, qpos, qpos);
        struct timespec ts = {0, (long)(STRIA__POLL_S * 1e9)};
        nanosleep(&ts, NULL);
        Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
        gq.job_id = job->id;
        memset(&reply, 0, sizeof(reply));
        stria_status_t st =
            stria__coord_call(c, STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, job, &reply);
        if (st != STRIA_OK)
            return st;
        Stria__V1__GetJobReply *gr = (Stria__V1__GetJobReply *)reply.msg;
        if (gr->job == NULL) {
            stria_rpc_reply_free(&reply);
            return stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: empty job info",
                                   (unsigned long long)job->id);
        }
        state = gr->job->state;
        qpos = gr->job->queue_position;
        if (state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
            /* a worker of the queued job died or was drained: retryable */
            st = stria_error_set(
                STRIA_ERR_CANCELLED, "job %llu ended while queued: %s", (unsigned long long)job->id,
                gr->job->failure && gr->job->failure[0] ? gr->job->failure : "no reason given");
            job->retryable = gr->job->failure_retryable;
            for (size_t i = 0; i < gr->job->n_blamed_worker_ids; i++)
                stria__blame(job, gr->job->blamed_worker_ids[i]);
            stria_error_set_retryable(job->retryable);
            stria_rpc_reply_free(&reply);
            return st;
        }
        stria_rpc_reply_free(&reply);
    }
    return STRIA_OK;
}

static stria_status_t stria__submit_once(stria_client_t *c, stria_job_t *job, bool sharded,
                                         stria_progress_cb progress, void *arg)
{
    const stria_job_spec_t *s = &job->spec;
    Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__JobSpec__Window win = STRIA__V1__JOB_SPEC__WINDOW__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    size_t n_pl = s->placement_hosts != NULL ? (size_t)s->ring_size : 0;
    Stria__V1__JobSpec__Placement **pl = calloc(n_pl + 1, sizeof(*pl));
    Stria__V1__JobSpec__Placement *pls = calloc(n_pl + 1, sizeof(*pls));
    stria_rpc_reply_t reply;
    stria_status_t st;

    if (pl == NULL || pls == NULL) {
        free(pl);
        free(pls);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the placement");
    }
    stria__spec_to_proto(s, sharded, &spec, &win, pl, pls);
    spec.session = job->session;
    req.spec = &spec;
    req.exclude_worker_ids = (uint64_t *)job->exclude;
    req.n_exclude_worker_ids = job->n_exclude;
    /* sent again as is when the connection breaks: a coordinator that made
     * the job before the reply was lost answers with that job */
    uint8_t key[16];
    if (stria_auth_random(key, sizeof(key)) == STRIA_OK) {
        req.submit_key.data = key;
        req.submit_key.len = sizeof(key);
    }
    memset(&reply, 0, sizeof(reply));
    st = stria__coord_call(c, STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, NULL, &reply);
    free(pl);
    free(pls);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "submit");
    Stria__V1__SubmitJobReply *sr = (Stria__V1__SubmitJobReply *)reply.msg;
    if (sr->assignment == NULL) {
        stria_rpc_reply_free(&reply);
        return stria_error_set(STRIA_ERR_PROTOCOL, "submit: reply without assignment");
    }
    st = stria__job_from_assignment(job, sr->assignment);
    if (st == STRIA_OK)
        st = stria_auth_open(&reply.session, "job secret", job->id, sr->job_secret.data,
                             sr->job_secret.len, job->secret.bytes);
    job->sharded = sharded;
    Stria__V1__JobState state = sr->state;
    uint32_t qpos = sr->queue_position;
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK)
        return st;
    return stria__wait_queued(c, job, state, qpos, progress, arg);
}

/* A queued job the coordinator no longer knows (it restarted, and no
 * worker held the job: nothing of it ran) is submitted again, a few times
 * at most. */
stria_status_t stria__submit(stria_client_t *c, stria_job_t *job, bool sharded,
                             stria_progress_cb progress, void *arg)
{
    for (int again = 0;; again++) {
        stria_status_t st = stria__submit_once(c, job, sharded, progress, arg);
        if (st != STRIA_ERR_NOT_FOUND || job->id == 0 || again >= 3)
            return st;
        for (int i = 0; i < job->n_ranks; i++)
            stria_rpc_client_close(job->ranks[i].conn);
        free(job->ranks);
        job->ranks = NULL;
        job->n_ranks = 0;
        job->id = 0;
    }
}

static void stria__collect_stats(const stria_job_t *job, stria_call_stats_t *stats)
{
    stats->rank_compute_s_max = 0;
    stats->rank_compute_s_min = INFINITY;
    stats->rank_wait_s_max = 0;
    stats->ring_steps = 0;
    stats->ring_bytes_sent = 0;
    for (int i = 0; i < job->n_ranks; i++) {
        const stria__rank_t *r = &job->ranks[i];
        stats->ring_steps = r->steps > stats->ring_steps ? r->steps : stats->ring_steps;
        stats->ring_bytes_sent += r->bytes_sent;
        stats->rank_compute_s_max = fmax(stats->rank_compute_s_max, r->compute_s);
        stats->rank_compute_s_min = fmin(stats->rank_compute_s_min, r->compute_s);
        stats->rank_wait_s_max = fmax(stats->rank_wait_s_max, r->wait_s);
    }
}

static uint64_t stria__phase_bytes(const stria_job_t *job)
{
    uint64_t b = 0;
    for (int i = 0; i < job->n_ranks; i++)
        b += job->ranks[i].bytes;
    return b;
}

/* Upload, pass, download. */
static stria_status_t stria__run_call(stria_job_t *job, stria__phase_t *ph,
                                      stria_progress_cb progress, void *arg,
                                      stria_call_stats_t *stats)
{
    stria_phase_t pass_phase = ph->backward ? STRIA_PHASE_BACKWARD : STRIA_PHASE_FORWARD;
    double t0 = stria_time_now(), t1, t2;
    stria_status_t st;

    ph->job = job;
    ph->fn = stria__rank_upload;
    st = stria__run_phase(ph, "upload", progress, arg, STRIA_PHASE_UPLOAD);
    if (st != STRIA_OK)
        return st;
    if (stats)
        stats->bytes_up = stria__phase_bytes(job);
    t1 = stria_time_now();
    ph->fn = stria__rank_pass;
    st = stria__run_phase(ph, ph->backward ? "backward pass" : "forward pass", progress, arg,
                          pass_phase);
    if (st != STRIA_OK)
        return st;
    t2 = stria_time_now();
    ph->fn = stria__rank_download;
    st = stria__run_phase(ph, "download", progress, arg, STRIA_PHASE_DOWNLOAD);
    if (st != STRIA_OK)
        return st;
    if (stats != NULL) {
        stats->upload_s = t1 - t0;
        stats->pass_s = t2 - t1;
        stats->download_s = stria_time_now() - t2;
        stats->bytes_down = stria__phase_bytes(job);
        stria__collect_stats(job, stats);
    }
    return STRIA_OK;
}

/* After a failed try of a job the coordinator admitted, its verdict: once
 * the job is over there, whether the first failure it recorded is
 * retryable and the workers it blames (a worker the ranks lost keeps the
 * try retryable); cancelled or expired is not. While the coordinator has
 * not heard of the failure yet, what the ranks saw stands. */
static void stria__try_verdict(stria_job_t *job, char *why, size_t len)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    bool lost = job->n_blamed > 0;
    req.job_id = job->id;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st =
        stria__coord_call(job->client, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, job, &reply);
    if (st == STRIA_ERR_NOT_FOUND) /* a restarted coordinator could not rebuild it */
        job->retryable = true;
    if (st != STRIA_OK)
        return;
    const Stria__V1__JobInfo *info = ((Stria__V1__GetJobReply *)reply.msg)->job;
    if (info != NULL && info->state == STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        snprintf(why, len, "%s", info->failure ? info->failure : "");
        job->retryable = info->failure_retryable || lost;
        for (size_t i = 0; i < info->n_blamed_worker_ids; i++)
            stria__blame(job, info->blamed_worker_ids[i]);
    } else if (info != NULL && info->state > STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        job->retryable = false;
    }
    stria_rpc_reply_free(&reply);
}

void stria__failure_msg(stria_job_t *job, char *msg, size_t len)
{
    char why[512] = "";
    snprintf(msg, len, "%s", stria_error_msg());
    if (job->id != 0)
        stria__try_verdict(job, why, sizeof(why));
    if (why[0] != '\0' && strstr(msg, why) == NULL) {
        size_t at = strlen(msg);
        snprintf(msg + at, len - at, " (the coordinator: %s)", why);
    }
}

/* Releases a failed try's job and frees it, keeping the failure's status,
 * message and verdict (into *retryable; its blamed workers are added to
 * blamed[0 .. *n_blamed), at most STRIA__MAX_BLAMED). */
static stria_status_t stria__try_fail(stria_job_t *job, stria_status_t st, bool *retryable,
                                      uint64_t *blamed, size_t *n_blamed)
{
    char msg[1024];
    stria__failure_msg(job, msg, sizeof(msg));
    *retryable = job->retryable;
    for (size_t i = 0; i < job->n_blamed; i++) {
        bool known = false;
        for (size_t k = 0; k < *n_blamed && !known; k++)
            known = blamed[k] == job->blamed[i];
        if (!known && *n_blamed < STRIA__MAX_BLAMED)
            blamed[(*n_blamed)++] = job->blamed[i];
    }
    if (job->id != 0) { /* linked or not, release unlinks it */
        stria_client_release(job);
    } else {
        stria__job_free(job);
    }
    stria_error_set(st, "%s", msg);
    stria_error_set_retryable(*retryable);
    return st;
}

/* One try of a whole-sequence forward, on a ring without the workers in
 * blamed[0 .. *n_blamed) (to which a failed try adds its own). */
static stria_status_t stria__forward_try(stria_client_t *client, const stria_job_spec_t *spec,
                                         const void *const in[3], void *o, float *lse,
                                         stria_progress_cb progress, void *progress_arg,
                                         stria_call_stats_t *local, stria_job_t **job_out,
                                         uint64_t *blamed, size_t *n_blamed, bool *retryable)
{
    stria__phase_t ph;
    double t0 = stria_time_now();
    stria_job_t *job = calloc(1, sizeof(*job));
    *retryable = false;
    if (job == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    job->client = client;
    job->spec = *spec; /* the caller's label and documents are read during the submission only */
    job->exclude = blamed;
    job->n_exclude = *n_blamed;
    stria_status_t st = stria__submit(client, job, false, progress, progress_arg);
    job->exclude = NULL;
    job->n_exclude = 0;
    job->spec.label = NULL;
    job->spec.cu_seqlens = NULL;
    job->spec.n_cu_seqlens = 0;
    job->spec.placement_hosts = NULL;
    job->spec.placement_devices = NULL;
    if (st != STRIA_OK)
        return stria__try_fail(job, st, retryable, blamed, n_blamed);
    stria__job_link(job);
    local->queued_s += stria_time_now() - t0;
    memset(&ph, 0, sizeof(ph));
    ph.in[0] = in[0];
    ph.in[1] = in[1];
    ph.in[2] = in[2];
    ph.n_in = 3;
    ph.out[0] = o;
    ph.n_out = 1;
    ph.lse_out = lse;
    st = stria__run_call(job, &ph, progress, progress_arg, local);
    if (st != STRIA_OK)
        return stria__try_fail(job, st, retryable, blamed, n_blamed);
    job->forward_done = true;
    *job_out = job;
    return STRIA_OK;
}

/* How many times a forward that failed retryably is submitted again. */
int stria__retries(const stria_client_t *c)
{
    int n = c->params.forward_retries;
    return n == 0 ? STRIA__DEFAULT_RETRIES : n < 0 ? 0 : n;
}

stria_status_t stria_client_forward(stria_client_t *client, const stria_job_spec_t *spec,
                                    const void *q, const void *k, const void *v, void *o,
                                    float *lse, stria_progress_cb progress, void *progress_arg,
                                    stria_call_stats_t *stats, stria_job_t **job_out)
{
    stria_job_spec_t sp;
    stria_call_stats_t local = STRIA_CALL_STATS_INIT;
    uint64_t blamed[STRIA__MAX_BLAMED];
    size_t n_blamed = 0, used = 0;
    char reasons[1024];
    bool retryable = false;
    stria_status_t st;
    int tries = 0;

    if (client == NULL || job_out == NULL || spec == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_client_forward: NULL argument");
    if ((st = stria__read_spec(spec, &sp)) != STRIA_OK ||
        (st = stria__check_stats(stats)) != STRIA_OK)
        return st;
    if (q == NULL || k == NULL || v == NULL || o == NULL || lse == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_forward: q, k, v, o and lse are required");
    const void *const in[3] = {q, k, v};
    reasons[0] = '\0';
    for (;;) {
        st = stria__forward_try(client, &sp, in, o, lse, progress, progress_arg, &local, job_out,
                                blamed, &n_blamed, &retryable);
        tries++;
        if (st == STRIA_OK)
            break;
        /* every try's reason, each cut to fit */
        int w =
            snprintf(reasons + used, sizeof(reasons) - used, "%stry %d: %.300s%s", used ? "; " : "",
                     tries, stria_error_msg(), strlen(stria_error_msg()) > 300 ? "..." : "");
        if (w > 0)
            used = used + (size_t)w < sizeof(reasons) ? used + (size_t)w : sizeof(reasons) - 1;
        /* A retry refused as busy once workers were excluded keeps the
         * earlier tries' verdict: the ring is short only for now (workers
         * restart, drained ones come back), so the trainer may try again. */
        if (!retryable && st == STRIA_ERR_BUSY && tries > 1 && n_blamed > 0) {
            retryable = true;
            stria_error_set_retryable(true);
            break;
        }
        if (!retryable || tries > stria__retries(client))
            break;
    }
    local.retries = (uint32_t)(tries - 1);
    if (stats != NULL)
        stria__abi_write_stats(stats, &local);
    if (st != STRIA_OK && tries > 1) {
        stria_error_set(st, "forward failed in %d tries (%s): %s", tries,
                        !retryable             ? "not retryable"
                        : st == STRIA_ERR_BUSY ? "retryable: too few workers left for now"
                                               : "retryable, retries exhausted",
                        reasons);
        stria_error_set_retryable(retryable);
    }
    return st;
}

stria_status_t stria_client_backward(stria_job_t *job, const void *d_o, void *dq, void *dk,
                                     void *dv, stria_progress_cb progress, void *progress_arg,
                                     stria_call_stats_t *stats)
{
    stria__phase_t ph;
    stria_call_stats_t local = STRIA_CALL_STATS_INIT;

    if (job == NULL || d_o == NULL || dq == NULL || dk == NULL || dv == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_backward: job, d_o, dq, dk and dv are required");
    stria_status_t st = stria__check_stats(stats);
    if (st != STRIA_OK)
        return st;
    if (!job->forward_done)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job %llu: backward needs a successful forward pass first",
                               (unsigned long long)job->id);
    memset(&ph, 0, sizeof(ph));
    ph.backward = true;
    ph.in[0] = d_o;
    ph.n_in = 1;
    ph.out[0] = dq;
    ph.out[1] = dk;
    ph.out[2] = dv;
    ph.n_out = 3;
    job->retryable = false;
    job->n_blamed = 0;
    st = stria__run_call(job, &ph, progress, progress_arg, &local);
    if (stats != NULL)
        stria__abi_write_stats(stats, &local);
    if (st != STRIA_OK) { /* not retried here; the coordinator's verdict stands */
        char msg[1024];
        stria__failure_msg(job, msg, sizeof(msg));
        stria_error_set(st, "%s", msg);
        stria_error_set_retryable(job->retryable);
    }
    return st;
}

stria_status_t stria_client_release(stria_job_t *job)
{
    stria_status_t st = STRIA_OK;
    if (job == NULL)
        return STRIA_OK;
    stria_client_t *c = job->client;
    uint32_t *ranks = calloc((size_t)job->n_ranks + 1, sizeof(*ranks));
    size_t n_used = 0;
    /* Free the workers' memory right away (of a sharded job: the ranks this
     * handle ran, which no pass can complete without); the coordinator also
     * tells them. Then the shared memory goes. */
    for (int i = 0; i < job->n_ranks; i++) {
        stria__rank_t *r = &job->ranks[i];
        if (job->sharded && !r->used)
            continue;
        stria__rank_drop(job, r);
        if (ranks != NULL)
            ranks[n_used++] = (uint32_t)i;
    }
    for (int i = 0; i < job->n_ranks; i++)
        stria__shm_detach(&job->ranks[i].shm);
    if (job->id != 0 && (!job->sharded || n_used > 0)) {
        Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
        stria_rpc_reply_t reply;
        req.job_id = job->id;
        if (job->sharded) { /* the job ends when every rank has released */
            req.ranks = ranks;
            req.n_ranks = n_used;
        }
        memset(&reply, 0, sizeof(reply));
        st = stria__coord_call_ex(c, STRIA_RPC_COORDINATOR_RELEASE_JOB, &req.base, job, &reply,
                                  !job->release_once);
        stria_rpc_reply_free(&reply);
    }
    free(ranks);
    stria__job_unlink(job);
    stria__job_free(job);
    return st;
}

uint64_t stria_job_id(const stria_job_t *job)
{
    return job ? job->id : 0;
}

int stria_job_ring_size(const stria_job_t *job)
{
    return job ? job->n_ranks : 0;
}

stria_layout_kind_t stria_job_layout(const stria_job_t *job)
{
    return job ? job->layout.kind : STRIA_LAYOUT_STRIPED;
}
