/* The job table of the worker: lookup, references, drop and free, and the
 * creation of a job from its assignment (its memory admitted and allocated
 * in the worker's pools, worker_pool.c); the geometry of a job's tensors. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker_int.h"

/* ---- job table ------------------------------------------------------------ */

stria__wjob_t *stria__wjob_find(stria_worker_t *w, uint64_t id)
{
    for (stria__wjob_t *j = w->jobs; j != NULL; j = j->next)
        if (j->id == id)
            return j;
    return NULL;
}

static void stria__wjob_free(stria_worker_t *w, stria__wjob_t *j)
{
    stria__wpass_free(j); /* before the device it borrows */
    stria__wsess_free(w, j);
    if (j->memfd >= 0)
        stria__wjob_mem_free(j);
    else
        stria__wpool_tensors_free(w, j);
    for (int t = 0; t < STRIA__T_COUNT; t++) {
        stria_device_free(j->dev, j->dbuf[t]);
        stria_ranges_free(&j->received[t]);
    }
    stria_device_close(j->dev);
    stria_call_shape_free(&j->call);
    free(j->spec_pb);
    stria__wpool_retire(w, j);
    stria__wpool_publish(w);
    free(j);
}

/* Unlinks and frees a job, or marks it to be freed by its last user. Lock
 * held. */
void stria__wjob_drop_locked(stria_worker_t *w, stria__wjob_t *j)
{
    stria__wjob_t **pp = &w->jobs;
    while (*pp != NULL && *pp != j)
        pp = &(*pp)->next;
    if (*pp == j) {
        *pp = j->next;
        j->next = NULL;
    }
    __atomic_store_n(&j->connect_cancel, true, __ATOMIC_RELEASE);
    stria__wsess_stop_locked(j);
    if (j->link != NULL) {
        char reason[96];
        snprintf(reason, sizeof(reason),
                 "job %llu is over at the coordinator (cancelled, failed "
                 "or expired)",
                 (unsigned long long)j->id);
        stria_log_info("job %llu: aborting its running pass", (unsigned long long)j->id);
        stria_link_abort(j->link, STRIA_ERR_CANCELLED, reason);
    }
    if (j->refs > 0) {
        j->dropped = true;
        return;
    }
    stria__wjob_free(w, j);
}

void stria__wjob_fail_locked(stria_worker_t *w, stria__wjob_t *j, const char *message)
{
    stria__wfail_t *f = calloc(1, sizeof(*f));
    stria_log_warn("job %llu: %s", (unsigned long long)j->id, message);
    if (f != NULL) { /* else the job fails at the coordinator by its TTL */
        f->job_id = j->id;
        f->rank = j->rank;
        snprintf(f->message, sizeof(f->message), "%s", message);
        f->next = w->fails;
        w->fails = f;
        pthread_cond_broadcast(&w->cv); /* the heartbeat thread reports it */
    }
    stria__wjob_drop_locked(w, j);
}

void stria__wjob_unref(stria_worker_t *w, stria__wjob_t *j)
{
    pthread_mutex_lock(&w->lock);
    if (--j->refs == 0 && j->dropped)
        stria__wjob_free(w, j);
    pthread_mutex_unlock(&w->lock);
}

/* Element sizes and shapes of the tensors of a job. */
void stria__wjob_geometry(const stria__wjob_t *j, int t, int64_t *outer_out, size_t *row_out)
{
    size_t es = stria_dtype_size(j->dtype);
    switch (t) {
    case STRIA__T_K:
    case STRIA__T_V:
    case STRIA__T_DK:
    case STRIA__T_DV:
        *outer_out = j->batch;
        *row_out = (size_t)(j->kv_heads * j->head_dim) * es;
        return;
    case STRIA__T_LSE:
        *outer_out = j->batch * j->heads;
        *row_out = 4;
        return;
    default:
        *outer_out = j->batch;
        *row_out = (size_t)(j->heads * j->head_dim) * es;
        return;
    }
}

/* Bytes of the compact (real tokens only) form of a tensor: what clients send
 * and receive. */
uint64_t stria__wjob_compact_bytes(const stria__wjob_t *j, int t)
{
    int64_t outer;
    size_t row;
    stria__wjob_geometry(j, t, &outer, &row);
    return (uint64_t)outer * (uint64_t)j->valid * row;
}

/* Copies between a byte range of the compact form and the padded buffer. */
void stria__wjob_copy_range(const stria__wjob_t *j, int t, uint64_t off, uint64_t len,
                            void *compact, bool to_padded)
{
    int64_t outer;
    size_t row;
    stria__wjob_geometry(j, t, &outer, &row);
    uint64_t seg = (uint64_t)j->valid * row;                /* compact bytes per outer index */
    uint64_t pseg = (uint64_t)j->layout.shard_tokens * row; /* padded bytes per outer index */
    char *padded = j->buf[t];
    uint64_t done = 0;
    while (done < len) {
        uint64_t pos = off + done;
        uint64_t o = pos / seg, in = pos % seg;
        uint64_t n = seg - in < len - done ? seg - in : len - done;
        if (to_padded)
            memcpy(padded + o * pseg + in, (char *)compact + done, n);
        else
            memcpy((char *)compact + done, padded + o * pseg + in, n);
        done += n;
    }
}

/* Pointer to a compact range when it is contiguous in the padded buffer:
 * always without padding, else within one outer index. */
void *stria__wjob_direct_range(const stria__wjob_t *j, int t, uint64_t off, uint64_t len)
{
    int64_t outer;
    size_t row;
    stria__wjob_geometry(j, t, &outer, &row);
    uint64_t seg = (uint64_t)j->valid * row;
    uint64_t pseg = (uint64_t)j->layout.shard_tokens * row;
    if (len == 0)
        return NULL;
    if (seg == pseg)
        return (char *)j->buf[t] + off;
    if (off / seg != (off + len - 1) / seg)
        return NULL;
    return (char *)j->buf[t] + (off / seg) * pseg + off % seg;
}

/* Per-rank memory of a job: its tensors, plus the ring engine's buffers
 * (double-buffered K/V blocks, fp32 dK/dV, fp32 partials) and the kernels'
 * packed copies, estimated generously. */
static uint64_t stria__job_memory(const stria__wjob_t *j)
{
    uint64_t bytes = 0;
    /* the sizes were checked when the job was opened; a failure here means
     * an impossible size, which no worker can hold */
    if (stria_rank_memory(j->batch, j->layout.shard_tokens, j->heads, j->kv_heads, j->head_dim,
                          j->dtype, &bytes) != STRIA_OK)
        return UINT64_MAX;
    return bytes;
}

/* Opens the job's secret and ring key, sealed for the worker's connection to
 * the coordinator. */
static stria_status_t stria__job_keys(stria__wjob_t *j, uint64_t job_id,
                                      const stria_auth_session_t *session,
                                      const Stria__V1__GetJobReply *gr)
{
    if (stria_auth_open(session, "job secret", job_id, gr->job_secret.data, gr->job_secret.len,
                        j->secret.bytes) != STRIA_OK ||
        stria_auth_open(session, "ring key", job_id, gr->ring_key.data, gr->ring_key.len,
                        j->ring_key) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_AUTH,
                                "job %llu: the coordinator's assignment has no usable keys (does "
                                "this worker prove the worker credential?)",
                                (unsigned long long)job_id);
    return STRIA_OK;
}

/* Copies the job's rank and spec from its assignment. */
static stria_status_t stria__job_spec(stria__wjob_t *j, stria_worker_t *w, uint64_t job_id,
                                      uint32_t rank, const Stria__V1__Assignment *a)
{
    const Stria__V1__JobSpec *s = a->spec;
    j->memfd = -1;
    j->w = w;
    j->sharded = s->sharded;
    j->session = s->session;
    j->arrival_timeout_s = s->arrival_timeout_s > 0 ? s->arrival_timeout_s : 60.0;
    j->id = job_id;
    j->rank = (int)rank;
    j->n_ranks = (int)a->n_ranks;
    j->batch = s->batch;
    j->seq_len = (int64_t)s->seq_len;
    j->heads = s->heads;
    j->kv_heads = s->kv_heads;
    j->head_dim = s->head_dim;
    j->spec_len = stria__v1__job_spec__get_packed_size(s);
    j->spec_pb = malloc(j->spec_len + 1);
    /* the call record (the job's own copy), checked here as libstria and the
     * coordinator did */
    stria_call_shape_t call;
    stria_call_shape_from_spec(s, &call);
    if (j->spec_pb == NULL || stria_call_shape_copy(&call, &j->call) != STRIA_OK)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    const stria_call_bounds_t bounds = {.max_batch = j->batch,
                                        .max_seq_len = j->seq_len,
                                        .n_ranks = j->n_ranks,
                                        .layout = s->layout};
    if (stria_call_shape_check(&j->call, &bounds) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "job %llu's assignment",
                                (unsigned long long)job_id);
    stria__v1__job_spec__pack(s, j->spec_pb);
    j->dtype = (stria_dtype_t)s->dtype;
    j->layout_kind = (stria_layout_kind_t)s->layout;
    j->step_timeout_s = s->step_timeout_ms > 0 ? s->step_timeout_ms / 1000.0 : w->step_timeout_s;
    if (j->step_timeout_s > STRIA__MAX_STEP_TIMEOUT_S) /* whatever the coordinator allowed */
        j->step_timeout_s = STRIA__MAX_STEP_TIMEOUT_S;
    j->steps_total = (uint32_t)a->n_ranks;
    j->phase = STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
    j->last_activity = stria_time_now();
    return STRIA_OK;
}

/* Fetches a job's assignment from the coordinator and creates the job with
 * every buffer allocated (bounded memory: a job that does not fit is refused
 * here, never mid-pass). The job comes with a reference for the caller,
 * taken under the lock where the job became visible (or was found, made by
 * another request meanwhile), so a drop cannot free it first. Lock not
 * held. */
static stria_status_t stria__job_create(stria_worker_t *w, uint64_t job_id, uint32_t rank,
                                        bool shared, const stria_job_secret_t *secret,
                                        stria__wjob_t **job_out)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t reply;
    stria_status_t st;
    stria__wjob_t *j = NULL;

    req.job_id = job_id;
    st = stria__wcoord_call(w, STRIA_RPC_COORDINATOR_GET_JOB, &req.base, &reply);
    if (st != STRIA_OK)
        return stria_error_wrap(st, "job %llu", (unsigned long long)job_id);
    Stria__V1__GetJobReply *gr = (Stria__V1__GetJobReply *)reply.msg;
    const Stria__V1__JobInfo *info = gr->job;
    const Stria__V1__Assignment *a = info ? info->assignment : NULL;
    if (a == NULL || a->spec == NULL || rank >= a->n_ranks || a->ranks[rank] == NULL) {
        st = stria_error_set(STRIA_ERR_NOT_FOUND, "job %llu has no rank %u",
                             (unsigned long long)job_id, rank);
        goto out;
    }
    if (info->state >= STRIA__V1__JOB_STATE__JOB_STATE_FAILED) {
        st = stria_error_set(STRIA_ERR_CANCELLED, "job %llu is over (%s)",
                             (unsigned long long)job_id,
                             info->failure && info->failure[0] ? info->failure : "released");
        goto out;
    }
    if (a->ranks[rank]->worker_id != w->worker_id) {
        st = stria_error_set(STRIA_ERR_INVALID_ARG,
                             "job %llu rank %u belongs to worker %llu, not to this worker (%llu)",
                             (unsigned long long)job_id, rank,
                             (unsigned long long)a->ranks[rank]->worker_id,
                             (unsigned long long)w->worker_id);
        goto out;
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
        goto out;
    }
    if ((st = stria__job_keys(j, job_id, &reply.session, gr)) != STRIA_OK ||
        (st = stria__job_spec(j, w, job_id, rank, a)) != STRIA_OK)
        goto out;
    j->replaces = info->replaces;
    j->generation = info->generation;
    if (secret != NULL && !stria_auth_equal(secret->bytes, j->secret.bytes, sizeof(j->secret))) {
        st = stria_error_set(STRIA_ERR_AUTH, "job %llu: the secret is not the job's",
                             (unsigned long long)job_id);
        goto out;
    }
    const char *next = a->ranks[(rank + 1) % a->n_ranks]->ucx_address;
    if (stria_dtype_size(j->dtype) == 0 || next == NULL || strlen(next) >= sizeof(j->next_ucx)) {
        st = stria_error_set(STRIA_ERR_PROTOCOL, "job %llu: malformed assignment",
                             (unsigned long long)job_id);
        goto out;
    }
    snprintf(j->next_ucx, sizeof(j->next_ucx), "%s", next);
    st = stria_layout_init(j->layout_kind, j->n_ranks, j->seq_len, &j->layout);
    if (st != STRIA_OK)
        goto out;
    j->valid = stria_layout_shard_valid(&j->layout, j->rank);
    if ((int64_t)a->ranks[rank]->tokens != j->valid) {
        st = stria_error_set(STRIA_ERR_PROTOCOL,
                             "job %llu rank %u: the assignment says %llu tokens, the layout %lld",
                             (unsigned long long)job_id, rank,
                             (unsigned long long)a->ranks[rank]->tokens, (long long)j->valid);
        goto out;
    }
    uint64_t need = stria__job_memory(j);
    if (a->memory_per_rank_bytes > need)
        need = a->memory_per_rank_bytes;
    pthread_mutex_lock(&w->lock);
    stria__wjob_t *other = stria__wjob_find(w, job_id);
    if (other != NULL) { /* created meanwhile by another request */
        other->refs++;   /* taken under the lock: a drop cannot free it now */
        pthread_mutex_unlock(&w->lock);
        stria_call_shape_free(&j->call);
        free(j->spec_pb);
        free(j);
        j = NULL;
        *job_out = other;
        st = STRIA_OK;
        goto out;
    }
    /* admitted under the lock: two requests of one job never both do */
    if ((st = stria__wpool_admit(w, j, need)) != STRIA_OK) {
        pthread_mutex_unlock(&w->lock);
        goto out;
    }
    pthread_mutex_unlock(&w->lock);
    /* a session's buffers come with its open (worker_session.c) */
    st = shared ? stria__wjob_mem_alloc(j) : j->session ? STRIA_OK : stria__wpool_tensors(w, j);
    if (st != STRIA_OK) {
        pthread_mutex_lock(&w->lock);
        stria__wjob_free(w, j);
        pthread_mutex_unlock(&w->lock);
        j = NULL;
        goto out;
    }
    stria_log_info("job %llu rank %d/%d: %lld of %lld tokens (%s), %llu MiB reserved",
                   (unsigned long long)j->id, j->rank, j->n_ranks, (long long)j->valid,
                   (long long)j->seq_len, stria_layout_kind_name(j->layout_kind),
                   (unsigned long long)(j->bytes >> 20));
    pthread_mutex_lock(&w->lock);
    j->refs = 1; /* the caller's, taken before a drop can see the job */
    j->next = w->jobs;
    w->jobs = j;
    pthread_mutex_unlock(&w->lock);
    stria__wpool_publish(w);
    *job_out = j;
    j = NULL;
    st = STRIA_OK;
out:
    if (j != NULL) {
        stria_call_shape_free(&j->call);
        free(j->spec_pb);
    }
    free(j);
    stria_rpc_reply_free(&reply);
    return st;
}

stria_status_t stria__wjob_get_checked(stria_worker_t *w, stria_rpc_call_t *call, uint64_t id,
                                       uint32_t rank, bool create, stria__wjob_t **out)
{
    stria__wjob_t *j;
    stria_status_t st = stria__wjob_get(w, id, rank, create, &j);
    if (st != STRIA_OK)
        return st;
    st = stria_rpc_call_check_job(call, &j->secret, id);
    if (st != STRIA_OK) {
        stria__wjob_unref(w, j);
        return st;
    }
    *out = j;
    return STRIA_OK;
}

/* Finds or creates (its tensors shared: in a memfd) the job of a request
 * and takes a reference; with `secret`, it must be the job's. */
static stria_status_t stria__wjob_get_ex(stria_worker_t *w, uint64_t id, uint32_t rank, bool create,
                                         bool shared, const stria_job_secret_t *secret,
                                         stria__wjob_t **out)
{
    stria__wjob_t *j;
    pthread_mutex_lock(&w->lock);
    j = stria__wjob_find(w, id);
    if (j != NULL)
        j->refs++;
    bool stopping = w->stopping;
    pthread_mutex_unlock(&w->lock);
    if (stopping && j == NULL)
        return stria_error_set(STRIA_ERR_BUSY, "this worker is shutting down");
    if (j == NULL) {
        if (!create)
            return stria_error_set(STRIA_ERR_NOT_FOUND,
                                   "job %llu is not held by this worker (never loaded, released "
                                   "or expired)",
                                   (unsigned long long)id);
        stria_status_t st = stria__job_create(w, id, rank, shared, secret, &j);
        if (st != STRIA_OK)
            return st; /* else it comes with our reference */
    }
    if ((uint32_t)j->rank != rank) {
        stria__wjob_unref(w, j);
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job %llu: this worker holds rank %d, not %u",
                               (unsigned long long)id, j->rank, rank);
    }
    if (shared && j->session) {
        stria__wjob_unref(w, j);
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job %llu is a session: its tensors travel with its calls",
                               (unsigned long long)id);
    }
    if (secret != NULL && !stria_auth_equal(secret->bytes, j->secret.bytes, sizeof(j->secret))) {
        stria__wjob_unref(w, j);
        return stria_error_set(STRIA_ERR_AUTH, "job %llu: the secret is not the job's",
                               (unsigned long long)id);
    }
    if (shared && j->memfd < 0) {
        stria__wjob_unref(w, j);
        return stria_error_set(STRIA_ERR_BUSY,
                               "job %llu rank %u: its tensors already came over TCP, so they are "
                               "not in shared memory; a rank moves its tensors one way (set the "
                               "client's data_path)",
                               (unsigned long long)id, rank);
    }
    *out = j;
    return STRIA_OK;
}

stria_status_t stria__wjob_get(stria_worker_t *w, uint64_t id, uint32_t rank, bool create,
                               stria__wjob_t **out)
{
    return stria__wjob_get_ex(w, id, rank, create, false, NULL, out);
}

stria_status_t stria__wjob_get_shared(stria_worker_t *w, uint64_t id, uint32_t rank,
                                      const stria_job_secret_t *secret, stria__wjob_t **out)
{
    return stria__wjob_get_ex(w, id, rank, true, true, secret, out);
}
