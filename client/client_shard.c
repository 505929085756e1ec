/* libstria: sharded jobs. One trainer rank submits the job, exports it as a
 * few bytes (its id and secret) for its peers, who import them; each rank
 * then runs its own part of the forward and backward passes with only its
 * tokens, and releases the ranks it ran. */
#include "client_int.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define STRIA__EXPORT_MAGIC "STRIAJB2"
_Static_assert(STRIA_JOB_EXPORT_BYTES == 16 + sizeof(stria_job_secret_t),
               "an export: magic, job id, secret");

stria_status_t stria_client_submit(stria_client_t *client, const stria_job_spec_t *spec,
                                   stria_job_t **job_out)
{
    stria_job_spec_t sp;
    stria_status_t st;
    if (client == NULL || spec == NULL || job_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_client_submit: NULL argument");
    if ((st = stria__read_spec(spec, &sp)) != STRIA_OK)
        return st;
    if (sp.ring_size < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_submit: ring_size is required: the trainer's world "
                               "size");
    if (sp.layout == STRIA_LAYOUT_AUTO)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_submit: a sharded job must name its layout (striped, "
                               "contiguous or zigzag), not auto: each rank brings its tokens in "
                               "that layout's order");
    stria_job_t *job = calloc(1, sizeof(*job));
    if (job == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    job->client = client;
    job->spec = sp;
    st = stria__submit(client, job, true, NULL, NULL);
    /* the caller's strings and arrays are read during the submission only */
    job->spec.label = NULL;
    job->spec.cu_seqlens = NULL;
    job->spec.n_cu_seqlens = 0;
    job->spec.placement_hosts = NULL;
    job->spec.placement_devices = NULL;
    if (st != STRIA_OK) {
        if (job->id != 0) { /* admitted, then failed: the whole job goes */
            char msg[1024];
            bool retryable = stria_error_retryable();
            snprintf(msg, sizeof(msg), "%s", stria_error_msg());
            job->sharded = false;
            stria__job_link(job);
            stria_client_release(job);
            stria_error_set(st, "%s", msg);
            stria_error_set_retryable(retryable); /* the release's calls cleared it */
            return st;
        }
        stria__job_free(job);
        return st;
    }
    stria__job_link(job);
    *job_out = job;
    return STRIA_OK;
}

stria_status_t stria_job_export(const stria_job_t *job, void *out, size_t cap, size_t *len_out)
{
    uint8_t *b = out;
    if (job == NULL || out == NULL || len_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_job_export: NULL argument");
    if (!job->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_job_export: job %llu is not sharded (only a job of "
                               "stria_client_submit can be shared)",
                               (unsigned long long)job->id);
    if (cap < STRIA_JOB_EXPORT_BYTES)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_job_export: %zu bytes of room, %d needed", cap,
                               STRIA_JOB_EXPORT_BYTES);
    memcpy(b, STRIA__EXPORT_MAGIC, 8);
    stria_put_le64(b + 8, job->id);
    memcpy(b + 16, job->secret.bytes, sizeof(job->secret.bytes));
    *len_out = STRIA_JOB_EXPORT_BYTES;
    return STRIA_OK;
}

/* Our spec of the assignment's (what an importer knows of the job). */
static void stria__spec_from_proto(const Stria__V1__JobSpec *s, stria_job_spec_t *out)
{
    memset(out, 0, sizeof(*out));
    out->struct_size = sizeof(*out);
    out->batch = s->batch;
    out->seq_len = (int64_t)s->seq_len;
    out->heads = s->heads;
    out->kv_heads = s->kv_heads;
    out->head_dim = s->head_dim;
    out->dtype = (stria_dtype_t)s->dtype;
    out->causal = s->causal;
    out->layout = (stria_layout_kind_t)s->layout;
    out->ring_size = (int)s->ring_size;
    out->scale = s->scale;
    out->step_timeout_s = s->step_timeout_ms / 1000.0;
    out->ttl_s = s->ttl_s;
    out->arrival_timeout_s = s->arrival_timeout_s;
    out->has_window = s->window != NULL;
}

/* The job of an export from the coordinator's record (GetJob checks the
 * proof of the secret). */
static stria_status_t stria__import(stria_client_t *c, stria_job_t *job, uint64_t id,
                                    Stria__V1__JobState *state_out, uint32_t *qpos_out)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    req.job_id = id;
    job->id = id;
    memset(&reply, 0, sizeof(reply));
    stria_status_t st = stria__coord_call(c, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, job, &reply);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "stria_job_import");
    const Stria__V1__JobInfo *info = ((const Stria__V1__GetJobReply *)reply.msg)->job;
    if (info == NULL || info->assignment == NULL || info->assignment->spec == NULL)
        st = stria_error_set(STRIA_ERR_PROTOCOL,
                             "stria_job_import: job %llu came without its "
                             "assignment",
                             (unsigned long long)id);
    else if (!info->assignment->spec->sharded)
        st = stria_error_set(STRIA_ERR_INVALID_ARG, "stria_job_import: job %llu is not sharded",
                             (unsigned long long)id);
    else if (info->state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED)
        st = stria_error_set(STRIA_ERR_CANCELLED, "stria_job_import: job %llu is over: %s",
                             (unsigned long long)id,
                             info->failure && info->failure[0] ? info->failure : "released");
    if (st == STRIA_OK) {
        stria__spec_from_proto(info->assignment->spec, &job->spec);
        job->session = info->assignment->spec->session;
        st = stria__job_from_assignment(job, info->assignment);
        *state_out = info->state;
        *qpos_out = info->queue_position;
    }
    stria_rpc_reply_free(&reply);
    return st;
}

/* ---- replacement: a sharded job that lost a worker ------------------------
 *
 * The coordinator replaces such a job by one of the same ranks and secret,
 * the lost worker's rank on a spare (JobInfo.replaced_by; it waits a few
 * heartbeat periods for the verdict on a worker first: replacement_pending).
 * A rank's call that failed follows the link: its handle becomes the
 * replacement's, and a forward sends its stripe again. */

/* The coordinator's heartbeat period (its verdicts take 3), or 1 s. */
static double stria__heartbeat_period(stria_client_t *c)
{
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    double period = 1.0;
    memset(&reply, 0, sizeof(reply));
    if (stria__coord_call(c, STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, NULL, &reply) ==
        STRIA_OK) {
        uint32_t ms = ((const Stria__V1__GetStatusReply *)reply.msg)->heartbeat_period_ms;
        period = ms > 0 ? ms / 1000.0 : period;
        stria_rpc_reply_free(&reply);
    }
    return period;
}

/* The job that replaces job `id`, at the end of its chain, waiting while the
 * coordinator waits for a verdict (and, with `lost`: the caller's worker
 * was lost, while the job is still on, for the coordinator to see it); 0
 * when none. Overwrites the thread's error. */
static uint64_t stria__replacement_of(stria_job_t *job, uint64_t id, bool lost)
{
    uint64_t saved = job->id, found = 0;
    /* The waits scale with the coordinator's: a verdict takes 3 heartbeat
     * periods, and a failed sharded pass waits 6 for one. */
    double period = lost ? stria__heartbeat_period(job->client) : 1.0;
    double now = stria_time_now();
    double give_up = now + fmax(STRIA__REPLACE_WAIT_S, 10 * period);
    double on_until = lost ? now + fmax(STRIA__VERDICT_WAIT_S, 5 * period) : 0;
    for (int hops = 0; hops < 16;) {
        Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
        stria_rpc_reply_t reply;
        memset(&reply, 0, sizeof(reply));
        req.job_id = id;
        job->id = id; /* what the proof of the secret names */
        if (stria__coord_call(job->client, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, job, &reply) !=
            STRIA_OK)
            break;
        const Stria__V1__JobInfo *info = ((const Stria__V1__GetJobReply *)reply.msg)->job;
        uint64_t next = info != NULL ? info->replaced_by : 0;
        bool pending = info != NULL && info->replacement_pending;
        if (found == 0 && info != NULL && info->state < STRIA__V1__JOB_STATE__JOB_STATE_FAILED &&
            stria_time_now() < on_until)
            pending = true; /* the coordinator has not seen the loss yet */
        stria_rpc_reply_free(&reply);
        if (next != 0) {
            found = id = next;
            hops++;
            continue;
        }
        if (!pending || stria_time_now() >= give_up)
            break;
        struct timespec ts = {0, (long)(STRIA__POLL_S * 1e9)};
        nanosleep(&ts, NULL);
    }
    job->id = saved;
    return found;
}

/* Gives up the ranks of a replaced job: their connections closed, their
 * shared memory kept mapped (retired) until the handle is released, since
 * the caller may hold pointers into it (stria_job_shard_buffer()). */
static void stria__ranks_retire(stria_job_t *job)
{
    for (int i = 0; i < job->n_ranks; i++) {
        stria__rank_t *r = &job->ranks[i];
        stria_rpc_client_close(r->conn);
        stria_free(r->stage);
        if (r->shm.sock >= 0)
            close(r->shm.sock);
        r->shm.sock = -1;
        if (r->shm.base == NULL)
            continue;
        stria__retired_t *more = realloc(job->retired, (job->n_retired + 1) * sizeof(*more));
        if (more == NULL) /* out of memory: the mapping stays for good */
            continue;
        more[job->n_retired].rank = r->rank;
        more[job->n_retired++].shm = r->shm;
        job->retired = more;
    }
    free(job->ranks);
    job->ranks = NULL;
    job->n_ranks = 0;
}

/* After a failed call: whether the coordinator replaced the job (*followed:
 * the handle is the replacement's now, its ranks not connected yet). An
 * error only when following failed. */
static stria_status_t stria__shard_follow(stria_job_t *job, bool lost, bool *followed)
{
    uint64_t old = job->id;
    Stria__V1__JobState state = STRIA__V1__JOB_STATE__JOB_STATE_UNSPECIFIED;
    uint32_t qpos = 0;
    *followed = false;
    uint64_t y = stria__replacement_of(job, old, lost);
    if (y == 0)
        return STRIA_OK;
    /* The replacement into a handle of its own first: a failure leaves this
     * one as it was (its ranks, to release). */
    stria_job_t *nj = calloc(1, sizeof(*nj));
    if (nj == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    nj->client = job->client;
    nj->sharded = true;
    nj->secret = job->secret;
    stria_status_t st = stria__import(job->client, nj, y, &state, &qpos);
    if (st == STRIA_OK)
        st = stria__wait_queued(job->client, nj, state, qpos, NULL, NULL);
    if (st == STRIA_OK && nj->n_ranks != job->n_ranks)
        st = stria_error_set(STRIA_ERR_PROTOCOL, "the replacement has %d ranks, not %d",
                             nj->n_ranks, job->n_ranks);
    if (st != STRIA_OK) {
        stria__job_free(nj);
        return stria_error_wrap(st, "job %llu, which replaces job %llu", (unsigned long long)y,
                                (unsigned long long)old);
    }
    /* The ranks this handle owned it owns there too (its release releases
     * them, even if it never reaches their new workers). */
    for (int i = 0; i < nj->n_ranks; i++)
        nj->ranks[i].used = job->ranks[i].used;
    stria__ranks_retire(job);
    job->id = nj->id;
    job->spec = nj->spec;
    job->layout = nj->layout;
    job->pass_timeout_s = nj->pass_timeout_s;
    job->n_ranks = nj->n_ranks;
    job->ranks = nj->ranks;
    job->retryable = false; /* the old job's verdict is not the new one's */
    job->n_blamed = 0;
    nj->ranks = NULL;
    nj->n_ranks = 0;
    stria__job_free(nj);
    *followed = true;
    stria_log_info("job %llu was replaced by job %llu (a worker was lost): this handle follows",
                   (unsigned long long)old, (unsigned long long)y);
    return STRIA_OK;
}

stria_status_t stria_job_import(stria_client_t *client, const void *bytes, size_t len,
                                stria_job_t **job_out)
{
    const uint8_t *b = bytes;
    Stria__V1__JobState state = STRIA__V1__JOB_STATE__JOB_STATE_UNSPECIFIED;
    uint32_t qpos = 0;
    if (client == NULL || bytes == NULL || job_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_job_import: NULL argument");
    if (len != STRIA_JOB_EXPORT_BYTES || memcmp(b, STRIA__EXPORT_MAGIC, 8) != 0)
        return stria_error_set(STRIA_ERR_FORMAT,
                               "stria_job_import: %zu bytes that are no job export (one is %d "
                               "bytes from stria_job_export)",
                               len, STRIA_JOB_EXPORT_BYTES);
    stria_job_t *job = calloc(1, sizeof(*job));
    if (job == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    job->client = client;
    job->sharded = true;
    memcpy(job->secret.bytes, b + 16, sizeof(job->secret.bytes));
    uint64_t id = stria_get_le64(b + 8);
    stria_status_t st = stria__import(client, job, id, &state, &qpos);
    if (st == STRIA_ERR_CANCELLED) { /* over: replaced, perhaps */
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        uint64_t y = stria__replacement_of(job, id, false);
        st = y != 0 ? stria__import(client, job, y, &state, &qpos) : stria_error_set(st, "%s", msg);
    }
    if (st == STRIA_OK)
        st = stria__wait_queued(client, job, state, qpos, NULL, NULL);
    if (st != STRIA_OK) {
        stria__job_free(job);
        return st;
    }
    stria__job_link(job);
    *job_out = job;
    return STRIA_OK;
}

int64_t stria_job_shard_tokens(const stria_job_t *job, int rank)
{
    if (job == NULL || rank < 0 || rank >= job->n_ranks)
        return -1;
    return job->ranks[rank].tokens;
}

stria_status_t stria_job_positions(const stria_job_t *job, int rank, int64_t *positions_out)
{
    if (job == NULL || positions_out == NULL || rank < 0 || rank >= job->n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_job_positions: NULL argument or rank %d out of range", rank);
    for (int64_t i = 0; i < job->ranks[rank].tokens; i++)
        positions_out[i] = stria_layout_position(&job->layout, rank, i);
    return STRIA_OK;
}

/* While a rank's calls run: asks the coordinator every STRIA__WATCH_S
 * whether the job is still on, and gives up on the rank's calls once it
 * ended (its worker cut off or stopped would never answer them). */
typedef struct {
    stria_job_t *job;
    stria__rank_t *r;
    pthread_mutex_t lock;
    pthread_cond_t cv;
    bool stop, ended, retryable;
    char why[512];
} stria__shard_watch_t;

static void *stria__shard_watch(void *arg)
{
    stria__shard_watch_t *w = arg;
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += (time_t)STRIA__WATCH_S;
        pthread_cond_timedwait(&w->cv, &w->lock, &ts);
        if (w->stop)
            break;
        pthread_mutex_unlock(&w->lock);
        char why[512];
        bool retryable = false;
        bool ended = stria__job_ended(w->job, why, sizeof(why), &retryable);
        pthread_mutex_lock(&w->lock);
        if (ended && !w->stop) { /* a live worker answers within the grace */
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += (time_t)STRIA__ABANDON_S;
            while (!w->stop && pthread_cond_timedwait(&w->cv, &w->lock, &ts) == 0)
                ;
            if (w->stop)
                break;
            w->ended = true;
            w->retryable = retryable;
            snprintf(w->why, sizeof(w->why), "%s", why);
            stria_rpc_client_abort(__atomic_load_n(&w->r->conn, __ATOMIC_ACQUIRE));
            break;
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* One rank's pass: its inputs, the pass (every rank's), its outputs. */
static stria_status_t stria__shard_pass(stria_job_t *job, int rank, bool backward,
                                        const void *const *in, void *const *out, int n_out)
{
    static const stria_tensor_id_t fwd_in[3] = {STRIA_TENSOR_Q, STRIA_TENSOR_K, STRIA_TENSOR_V};
    static const stria_tensor_id_t fwd_out[2] = {STRIA_TENSOR_O, STRIA_TENSOR_LSE};
    static const stria_tensor_id_t bwd_out[3] = {STRIA_TENSOR_DQ, STRIA_TENSOR_DK, STRIA_TENSOR_DV};
    const char *what = backward ? "backward pass" : "forward pass";
    stria__rank_t *r = &job->ranks[rank];
    double arrival = job->spec.arrival_timeout_s > 0 ? job->spec.arrival_timeout_s : 60.0;
    stria__shard_watch_t w = {.job = job, .r = r};
    pthread_t th;
    pthread_mutex_init(&w.lock, NULL);
    pthread_cond_init(&w.cv, NULL);
    bool watching = pthread_create(&th, NULL, stria__shard_watch, &w) == 0;

    stria_status_t st = stria__rank_connect(job, r);
    if (st == STRIA_OK) {
        what = "upload";
        for (int i = 0; i < (backward ? 1 : 3) && st == STRIA_OK; i++)
            st = stria__rank_put(job, r, backward ? STRIA_TENSOR_DO : fwd_in[i], in[i]);
    }
    if (st == STRIA_OK) {
        what = backward ? "backward pass" : "forward pass";
        st = stria__rank_run(job, r, backward, arrival);
    }
    if (st == STRIA_OK) {
        what = "download";
        for (int i = 0; i < n_out && st == STRIA_OK; i++)
            st = stria__rank_get(job, r, backward ? bwd_out[i] : fwd_out[i], out[i]);
    }
    if (watching) {
        pthread_mutex_lock(&w.lock);
        w.stop = true;
        pthread_cond_signal(&w.cv);
        pthread_mutex_unlock(&w.lock);
        pthread_join(th, NULL);
    }
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.lock);
    if (w.ended) { /* the connection was given up on: good for nothing now */
        stria_rpc_client_close(r->conn);
        r->conn = NULL;
    }
    if (st != STRIA_OK && w.ended) { /* a lost worker: a peer's failure; else cancelled */
        st = w.retryable ? STRIA_ERR_PEER : STRIA_ERR_CANCELLED;
        stria_error_set(st, "job %llu rank %d (worker %s), %s: no answer; given up on, as %s",
                        (unsigned long long)job->id, rank, r->rpc_address, what, w.why);
        stria_error_set_retryable(w.retryable);
        return st;
    }
    if (st != STRIA_OK) { /* a lost worker is retryable (for the trainer) */
        bool retryable = stria_error_retryable() || stria__rank_lost(r, st);
        char msg[1024];
        stria__failure_msg(job, msg, sizeof(msg));
        retryable = retryable || job->retryable;
        stria_error_set(st, "job %llu rank %d (worker %s), %s: %s", (unsigned long long)job->id,
                        rank, r->rpc_address, what, msg);
        stria_error_set_retryable(retryable);
        return st;
    }
    return STRIA_OK;
}

static stria_status_t stria__shard_check(const stria_job_t *job, int rank, const char *fn)
{
    if (job == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: job is NULL", fn);
    if (!job->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: job %llu is not sharded (submit it with stria_client_submit)",
                               fn, (unsigned long long)job->id);
    if (rank < 0 || rank >= job->n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: rank %d of a ring of %d", fn, rank,
                               job->n_ranks);
    return STRIA_OK;
}

stria_status_t stria_client_forward_shard(stria_job_t *job, int rank, const void *q, const void *k,
                                          const void *v, void *o, float *lse)
{
    stria_status_t st = stria__shard_check(job, rank, "stria_client_forward_shard");
    if (st != STRIA_OK)
        return st;
    if (q == NULL || k == NULL || v == NULL || o == NULL || lse == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_forward_shard: q, k, v, o and lse are required");
    const void *in[3] = {q, k, v};
    void *out[2] = {o, lse};
    int tries = 1 + stria__retries(job->client);
    char reasons[2048] = "";
    size_t used = 0;
    for (int t = 1;; t++) {
        uint64_t id = job->id;
        st = stria__shard_pass(job, rank, false, in, out, 2);
        if (st == STRIA_OK) {
            job->ranks[rank].fwd_done = true;
            return STRIA_OK;
        }
        char msg[1024];
        bool retryable = stria_error_retryable(), followed = false;
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria_status_t fst = stria__shard_follow(job, retryable, &followed);
        if (fst != STRIA_OK || !followed) {
            if (fst != STRIA_OK) /* the replacement's own failure */
                snprintf(msg + strlen(msg), sizeof(msg) - strlen(msg), "; %s", stria_error_msg());
            stria_error_set(st, "%s%s", reasons, msg);
            stria_error_set_retryable(retryable);
            return st;
        }
        if (used < sizeof(reasons))
            used += (size_t)snprintf(reasons + used, sizeof(reasons) - used,
                                     "try %d (job %llu): %s; ", t, (unsigned long long)id, msg);
        if (t >= tries) {
            stria_error_set(st,
                            "%sjob %llu replaces it, but no try is left (forward_retries): call "
                            "stria_client_forward_shard again",
                            reasons, (unsigned long long)job->id);
            stria_error_set_retryable(true);
            return st;
        }
    }
}

stria_status_t stria_client_backward_shard(stria_job_t *job, int rank, const void *d_o, void *dq,
                                           void *dk, void *dv)
{
    stria_status_t st = stria__shard_check(job, rank, "stria_client_backward_shard");
    if (st != STRIA_OK)
        return st;
    if (d_o == NULL || dq == NULL || dk == NULL || dv == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_backward_shard: d_o, dq, dk and dv are required");
    if (!job->ranks[rank].fwd_done)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job %llu rank %d: backward needs the rank's forward pass first",
                               (unsigned long long)job->id, rank);
    const void *in[1] = {d_o};
    void *out[3] = {dq, dk, dv};
    uint64_t id = job->id;
    st = stria__shard_pass(job, rank, true, in, out, 3);
    if (st == STRIA_OK)
        return STRIA_OK;
    /* The forward's inputs were the caller's, read during that call only:
     * a replaced job needs the forward again, on its new ring. */
    char msg[1024];
    bool retryable = stria_error_retryable(), followed = false;
    snprintf(msg, sizeof(msg), "%s", stria_error_msg());
    stria_status_t fst = stria__shard_follow(job, retryable, &followed);
    if (fst == STRIA_OK && followed) {
        stria_error_set(st,
                        "%s; job %llu replaces job %llu (a worker was lost): run "
                        "stria_client_forward_shard again, then the backward pass",
                        msg, (unsigned long long)job->id, (unsigned long long)id);
        retryable = true;
    } else {
        char also[600] = "";
        if (fst != STRIA_OK)
            snprintf(also, sizeof(also), "; %s", stria_error_msg());
        stria_error_set(st, "%s%s", msg, also);
    }
    stria_error_set_retryable(retryable);
    return st;
}
