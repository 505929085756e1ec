/* libstria: the job API (see stria_client.h) over sessions. A job is a
 * session opened with the job's shape as its bounds and one held forward:
 * its forward is a call whose Q, K, V, O and LSE the workers keep (or, with
 * an arena, that stay in this process's shared memory), its backward the
 * next call, which brings only dO; releasing it closes the session. The
 * coordinator follows a job through its states from its workers' reports.
 * A whole-sequence forward that failed retryably is tried again on a new
 * job without the workers the try was blamed on; a sharded rank's call
 * follows a replacement (client_session.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

#define SPEC_V1_SIZE STRIA__V1_END(stria_job_spec_t, label)

struct stria_job {
    stria_client_t *client;
    stria_job_t *next; /* client->jobs */
    stria_session_t *s;
    stria_job_spec_t spec; /* as assigned: defaults filled in; documents ours */
    stria_call_shape_t call;
    bool sharded;
    bool forward_done;   /* whole-sequence: its forward is held */
    uint64_t held;       /* whole-sequence: the held forward */
    bool *rank_fwd;      /* sharded: per rank, this handle's forward is held */
    uint64_t *rank_held; /* sharded: per rank, its held forward */
};

/* ---- specs ---------------------------------------------------------------------- */

static stria_status_t check_spec(const stria_job_spec_t *s)
{
    if (s->batch < 1 || s->seq_len < 1 || s->heads < 1 || s->kv_heads < 1 || s->head_dim < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job spec: batch, seq_len, heads, kv_heads and head_dim must be "
                               ">= 1");
    if (s->batch > UINT32_MAX || s->heads > UINT32_MAX || s->kv_heads > UINT32_MAX ||
        s->head_dim > UINT32_MAX || s->ring_size < 0 || s->step_timeout_s < 0 || s->ttl_s < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec: a field is out of range");
    if (stria_dtype_size(s->dtype) == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec: unknown dtype");
    const stria_call_shape_t call = stria__labi_job_call(s);
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

static stria_status_t read_spec(const stria_job_spec_t *in, stria_job_spec_t *out)
{
    if (in == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job spec is NULL");
    stria_status_t st = stria__labi_read(out, sizeof(*out), SPEC_V1_SIZE, in, "stria_job_spec_t",
                                         "STRIA_JOB_SPEC_INIT");
    return st != STRIA_OK ? st : check_spec(out);
}

/* The session spec of a job: its shape as the bounds. */
static stria_session_spec_t bounds_of(const stria_job_spec_t *js, bool sharded)
{
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = js->batch;
    sp.max_seq_len = js->seq_len;
    sp.heads = js->heads;
    sp.kv_heads = js->kv_heads;
    sp.head_dim = js->head_dim;
    sp.dtype = js->dtype;
    sp.layout = js->layout;
    sp.ring_size = js->ring_size;
    sp.sharded = sharded;
    sp.idle_timeout_s = js->ttl_s;
    sp.step_timeout_s = js->step_timeout_s;
    sp.arrival_timeout_s = js->arrival_timeout_s;
    sp.max_held = 1;
    sp.head_groups = js->head_groups;
    sp.head_group_rings = js->head_group_rings;
    return sp;
}

/* ---- handles ---------------------------------------------------------------------- */

static void job_free(stria_job_t *job)
{
    if (job == NULL)
        return;
    free((void *)job->spec.cu_seqlens);
    free(job->rank_fwd);
    free(job->rank_held);
    free(job);
}

/* A handle of session s (owned from here) with the caller's spec: what the
 * assignment filled in, the documents copied (a backward brings them). */
static stria_status_t job_new(stria_client_t *c, stria_session_t *s, const stria_job_spec_t *sp,
                              bool sharded, stria_job_t **out)
{
    stria_job_t *job = calloc(1, sizeof(*job));
    int64_t *cu = sp->n_cu_seqlens > 0 ? malloc(sp->n_cu_seqlens * sizeof(int64_t)) : NULL;
    const int ranks = stria_session_ranks(s); /* a head-grouped one's: each ring's */
    bool *fwd = calloc((size_t)ranks + 1, sizeof(bool));
    uint64_t *held = calloc((size_t)ranks + 1, sizeof(uint64_t));
    if (job == NULL || (sp->n_cu_seqlens > 0 && cu == NULL) || fwd == NULL || held == NULL) {
        free(job);
        free(cu);
        free(fwd);
        free(held);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate job");
    }
    if (cu != NULL)
        memcpy(cu, sp->cu_seqlens, sp->n_cu_seqlens * sizeof(int64_t));
    job->client = c;
    job->s = s;
    job->sharded = sharded;
    job->rank_fwd = fwd;
    job->rank_held = held;
    job->spec = *sp;
    job->spec.cu_seqlens = cu;
    job->spec.label = NULL;
    job->spec.placement_hosts = NULL;
    job->spec.placement_devices = NULL;
    job->spec.ring_size = stria_session_ring_size(s);
    job->spec.layout = s->layout;
    job->spec.head_groups = s->n_groups > 0 ? (uint32_t)s->n_groups : 0;
    job->call = stria__labi_job_call(&job->spec);
    *out = job;
    return STRIA_OK;
}

static void job_link(stria_job_t *job)
{
    job->next = job->client->jobs;
    job->client->jobs = job;
}

static void job_unlink(stria_job_t *job)
{
    stria_job_t **pp = &job->client->jobs;
    while (*pp != NULL && *pp != job)
        pp = &(*pp)->next;
    if (*pp == job)
        *pp = job->next;
}

/* ---- whole-sequence jobs ----------------------------------------------------------- */

/* One try of a whole-sequence forward, on a ring without the workers in
 * blamed[0 .. *n_blamed) (to which a failed try adds its own). */
static stria_status_t forward_try(stria_client_t *c, const stria_job_spec_t *sp,
                                  const stria__lio_t *io, stria_progress_cb progress, void *arg,
                                  stria_call_stats_t *local, uint64_t *blamed, size_t *n_blamed,
                                  bool *retryable, stria_job_t **job_out)
{
    const stria__lopen_t o = {.js = *sp,
                              .session = false,
                              .max_held = 1,
                              .exclude = blamed,
                              .n_exclude = n_blamed,
                              .blame = true,
                              .retries = 0};
    stria_session_spec_t bounds = bounds_of(sp, false);
    stria_status_t st = STRIA_OK;
    if (bounds.head_groups == STRIA_HEAD_GROUPS_AUTO &&
        (st = stria__lgroup_auto(c, &bounds)) != STRIA_OK) {
        *retryable = stria_error_retryable();
        return st;
    }
    const bool grouped = bounds.head_groups > 1;
    stria_session_t *s = NULL;
    double t0 = stria_time_now();
    st = grouped ? stria__lgroup_open(c, &o, &bounds, &s)
                 : stria__lsess_open(c, &o, &bounds, progress, arg, &s);
    local->queued_s += stria_time_now() - t0;
    if (st == STRIA_OK) {
        const stria_call_shape_t call = stria__labi_job_call(sp);
        const stria__lreq_t r = {.shape = &call,
                                 .rank = -1,
                                 .hold = true,
                                 .io = io,
                                 .retries = 0,
                                 .progress = progress,
                                 .progress_arg = arg,
                                 .stats = local};
        uint64_t held = 0;
        double q = local->queued_s;
        st = grouped ? stria__lgroup_call(s, "stria_client_forward", &r, &held)
                     : stria__lsess_call(s, "stria_client_forward", &r, &held);
        local->queued_s = q;
        if (st == STRIA_OK && (st = job_new(c, s, sp, false, job_out)) == STRIA_OK) {
            (*job_out)->forward_done = true;
            (*job_out)->held = held;
            return STRIA_OK;
        }
    }
    *retryable = stria_error_retryable();
    for (int g = 0; s != NULL && g < (s->n_groups > 0 ? s->n_groups : 1); g++) {
        const stria_session_t *x = s->n_groups > 0 ? s->groups[g] : s; /* a ring's blamed */
        for (size_t i = 0; i < x->n_blamed; i++) {
            bool known = false;
            for (size_t k = 0; k < *n_blamed && !known; k++)
                known = blamed[k] == x->blamed[i];
            if (!known && *n_blamed < STRIA__MAX_BLAMED)
                blamed[(*n_blamed)++] = x->blamed[i];
        }
    }
    if (s != NULL) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        stria__lsess_close(s);
        stria_error_set(st, "%s", msg);
        stria_error_set_retryable(*retryable);
    }
    return st;
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
    char reasons[1024] = "";
    bool retryable = false;
    stria_status_t st;
    int tries = 0;

    if (client == NULL || job_out == NULL || spec == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_client_forward: NULL argument");
    if ((st = read_spec(spec, &sp)) != STRIA_OK ||
        (st = stria__labi_check_stats(stats)) != STRIA_OK)
        return st;
    if (q == NULL || k == NULL || v == NULL || o == NULL || lse == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_forward: q, k, v, o and lse are required");
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    for (;;) {
        stria_job_t *job = NULL;
        st = forward_try(client, &sp, &io, progress, progress_arg, &local, blamed, &n_blamed,
                         &retryable, &job);
        tries++;
        if (st == STRIA_OK) {
            job_link(job);
            *job_out = job;
            break;
        }
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
        if (!retryable || tries > stria__lsess_retries(client))
            break;
    }
    local.retries = (uint32_t)(tries - 1);
    if (stats != NULL)
        stria__labi_write_stats(stats, &local);
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
    if (job == NULL || d_o == NULL || dq == NULL || dk == NULL || dv == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_backward: job, d_o, dq, dk and dv are required");
    stria_status_t st = stria__labi_check_stats(stats);
    if (st != STRIA_OK)
        return st;
    if (job->sharded || !job->forward_done)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "job %llu: backward needs a successful forward pass first%s",
                               (unsigned long long)job->s->id,
                               job->sharded ? " (a sharded job's ranks run theirs)" : "");
    /* never retried: its forward is held on the workers of this job */
    const stria__lio_t io = {.in = {NULL, NULL, NULL, NULL, NULL, d_o}, .out = {dq, dk, dv}};
    const stria__lreq_t r = {.shape = &job->call,
                             .rank = -1,
                             .backward = true,
                             .use_held = true,
                             .held = job->held,
                             .io = &io,
                             .retries = 0,
                             .progress = progress,
                             .progress_arg = progress_arg,
                             .stats = stats};
    st = job->s->n_groups > 0 ? stria__lgroup_call(job->s, "stria_client_backward", &r, NULL)
                              : stria__lsess_call(job->s, "stria_client_backward", &r, NULL);
    if (st == STRIA_OK)
        job->forward_done = false; /* its held forward is used */
    return st;
}

stria_status_t stria_client_release(stria_job_t *job)
{
    if (job == NULL)
        return STRIA_OK;
    job_unlink(job);
    stria_status_t st = stria__lsess_close(job->s);
    job_free(job);
    return st;
}

uint64_t stria_job_id(const stria_job_t *job)
{
    return job ? stria_session_id(job->s) : 0;
}

int stria_job_ring_size(const stria_job_t *job)
{
    return job ? stria_session_ring_size(job->s) : 0;
}

stria_layout_kind_t stria_job_layout(const stria_job_t *job)
{
    return job ? job->s->layout : STRIA_LAYOUT_STRIPED;
}

/* ---- sharded jobs ------------------------------------------------------------------ */

stria_status_t stria_client_submit(stria_client_t *client, const stria_job_spec_t *spec,
                                   stria_job_t **job_out)
{
    stria_job_spec_t sp;
    stria_status_t st;
    if (client == NULL || spec == NULL || job_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_client_submit: NULL argument");
    if ((st = read_spec(spec, &sp)) != STRIA_OK)
        return st;
    if (sp.ring_size < 1)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_submit: ring_size is required: the trainer's world "
                               "size");
    if (sp.head_groups > 1)
        return stria_error_set(STRIA_ERR_UNSUPPORTED,
                               "stria_client_submit: a sharded job takes head_groups 0 or 1 (got "
                               "%u; its export is STRIA_JOB_EXPORT_BYTES): open a sharded "
                               "session with head groups instead",
                               sp.head_groups);
    if (sp.layout == STRIA_LAYOUT_AUTO)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_submit: a sharded job must name its layout (striped, "
                               "contiguous or zigzag), not auto: each rank brings its tokens in "
                               "that layout's order");
    const stria__lopen_t o = {.js = sp, .session = false, .sharded = true, .max_held = 1};
    const stria_session_spec_t bounds = bounds_of(&sp, true);
    stria_session_t *s = NULL;
    if ((st = stria__lsess_open(client, &o, &bounds, NULL, NULL, &s)) != STRIA_OK)
        return st;
    stria_job_t *job = NULL;
    if ((st = job_new(client, s, &sp, true, &job)) != STRIA_OK) {
        stria__lsess_close(s);
        return st;
    }
    job_link(job);
    *job_out = job;
    return STRIA_OK;
}

stria_status_t stria_job_export(const stria_job_t *job, void *out, size_t cap, size_t *len_out)
{
    if (job == NULL || out == NULL || len_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_job_export: NULL argument");
    if (!job->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_job_export: job %llu is not sharded (only a job of "
                               "stria_client_submit can be shared)",
                               (unsigned long long)job->s->id);
    return stria_session_export(job->s, out, cap, len_out);
}

stria_status_t stria_job_import(stria_client_t *client, const void *bytes, size_t len,
                                stria_job_t **job_out)
{
    stria_session_t *s = NULL;
    if (job_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_job_import: NULL argument");
    stria_status_t st = stria__lsess_import(client, bytes, len, true, &s);
    if (st != STRIA_OK)
        return st;
    /* what an importer knows of the job: its record at the coordinator */
    stria__linfo_t info;
    stria_rpc_reply_t reply;
    st = stria__lcoord_info(client, s->id, &s->secret, true, &info, &reply);
    stria_job_spec_t sp = STRIA_JOB_SPEC_INIT;
    if (st == STRIA_OK) {
        const Stria__V1__JobSpec *p = ((Stria__V1__GetJobReply *)reply.msg)->job->assignment->spec;
        sp.batch = p->batch;
        sp.seq_len = (int64_t)p->seq_len;
        sp.heads = p->heads;
        sp.kv_heads = p->kv_heads;
        sp.head_dim = p->head_dim;
        sp.dtype = (stria_dtype_t)p->dtype;
        sp.causal = p->causal;
        sp.layout = (stria_layout_kind_t)p->layout;
        sp.scale = p->scale;
        sp.step_timeout_s = p->step_timeout_ms / 1000.0;
        sp.ttl_s = p->ttl_s;
        sp.arrival_timeout_s = p->arrival_timeout_s;
        sp.cu_seqlens = p->cu_seqlens;
        sp.n_cu_seqlens = p->n_cu_seqlens;
        sp.has_window = p->window != NULL;
        sp.window_left = p->window != NULL ? p->window->left : 0;
        sp.window_right = p->window != NULL ? p->window->right : 0;
    }
    stria_job_t *job = NULL;
    if (st == STRIA_OK)
        st = job_new(client, s, &sp, true, &job);
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK) {
        s->release_once = true; /* nothing of it ran here: no rank is released */
        stria__lsess_close(s);
        return stria_error_wrap(st, "stria_job_import");
    }
    job_link(job);
    *job_out = job;
    return STRIA_OK;
}

int64_t stria_job_shard_tokens(const stria_job_t *job, int rank)
{
    int64_t n;
    if (job == NULL || job->s->id == 0 ||
        stria__lcall_positions("stria_job_shard_tokens", job->s->layout, job->s->n_ranks,
                               &job->call, rank, &n, NULL) != STRIA_OK)
        return -1;
    return n;
}

stria_status_t stria_job_positions(const stria_job_t *job, int rank, int64_t *positions_out)
{
    if (job == NULL || positions_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_job_positions: NULL argument");
    return stria__lcall_positions("stria_job_positions", job->s->layout, job->s->n_ranks,
                                  &job->call, rank, NULL, positions_out);
}

static stria_status_t shard_rank(const stria_job_t *job, int rank, const char *fn)
{
    if (job == NULL || !job->sharded)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: %s", fn,
                               job == NULL ? "NULL job"
                                           : "the job is not sharded (stria_client_submit)");
    if (rank < 0 || rank >= job->s->n_ranks)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "%s: rank %d is not a rank of job %llu", fn,
                               rank, (unsigned long long)job->s->id);
    return STRIA_OK;
}

stria_status_t stria_client_forward_shard(stria_job_t *job, int rank, const void *q, const void *k,
                                          const void *v, void *o, float *lse)
{
    static const char fn[] = "stria_client_forward_shard";
    stria_status_t st = shard_rank(job, rank, fn);
    if (st != STRIA_OK)
        return st;
    if (job->rank_fwd[rank]) { /* a forward again: its held one goes first */
        stria_session_release_held(job->s, rank, job->rank_held[rank]);
        job->rank_fwd[rank] = false;
    }
    const stria__lio_t io = {.in = {q, k, v}, .out = {o, lse}};
    const stria__lreq_t r = {
        .shape = &job->call, .rank = rank, .hold = true, .io = &io, .retries = -1};
    uint64_t held = 0;
    st = stria__lsess_call(job->s, fn, &r, &held);
    if (st == STRIA_OK) {
        job->rank_fwd[rank] = true;
        job->rank_held[rank] = held;
    }
    return st;
}

stria_status_t stria_client_backward_shard(stria_job_t *job, int rank, const void *d_o, void *dq,
                                           void *dk, void *dv)
{
    static const char fn[] = "stria_client_backward_shard";
    stria_status_t st = shard_rank(job, rank, fn);
    if (st != STRIA_OK)
        return st;
    if (!job->rank_fwd[rank])
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "%s: job %llu rank %d: backward needs a successful forward first",
                               fn, (unsigned long long)job->s->id, rank);
    const stria__lio_t io = {.in = {NULL, NULL, NULL, NULL, NULL, d_o}, .out = {dq, dk, dv}};
    const stria__lreq_t r = {.shape = &job->call,
                             .rank = rank,
                             .backward = true,
                             .use_held = true,
                             .held = job->rank_held[rank],
                             .io = &io,
                             .retries = 0};
    st = stria__lsess_call(job->s, fn, &r, NULL);
    if (st == STRIA_OK || job->s->held_mask == 0)
        job->rank_fwd[rank] = false; /* used, or gone with a replaced session */
    return st;
}

stria_status_t stria_job_shard_buffer(stria_job_t *job, int rank, stria_tensor_id_t tensor,
                                      stria_shard_buffer_t *out)
{
    static const char fn[] = "stria_job_shard_buffer";
    stria_status_t st = shard_rank(job, rank, fn);
    if (st != STRIA_OK)
        return st;
    return stria__lsess_buffer(job->s, fn, &job->call, rank, tensor, out);
}

stria_data_path_t stria_job_data_path(const stria_job_t *job, int rank)
{
    if (job == NULL || rank < 0 || rank >= job->s->n_ranks || !job->s->ranks[rank].path_done)
        return STRIA_DATA_PATH_AUTO;
    const stria__lrank_t *r = &job->s->ranks[rank];
    return r->arena != NULL && r->arena_sock >= 0 ? STRIA_DATA_PATH_SHM : STRIA_DATA_PATH_TCP;
}
