/* The coordinator: worker registry, ring order, job admission and queue, job
 * state machine, heartbeat and TTL timers, and the handlers of the
 * stria.v1.Coordinator service. Everything runs on the RPC loop thread. */
#include "coord_int.h"
#include "stria_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define S_PENDING          STRIA__V1__JOB_STATE__JOB_STATE_PENDING
#define S_LOADING          STRIA__V1__JOB_STATE__JOB_STATE_LOADING
#define S_RUNNING_FORWARD  STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD
#define S_FORWARD_DONE     STRIA__V1__JOB_STATE__JOB_STATE_FORWARD_DONE
#define S_RUNNING_BACKWARD STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_BACKWARD
#define S_DONE             STRIA__V1__JOB_STATE__JOB_STATE_DONE
#define S_FAILED           STRIA__V1__JOB_STATE__JOB_STATE_FAILED
#define S_CANCELLED        STRIA__V1__JOB_STATE__JOB_STATE_CANCELLED
#define S_RELEASED         STRIA__V1__JOB_STATE__JOB_STATE_RELEASED
#define S_EXPIRED          STRIA__V1__JOB_STATE__JOB_STATE_EXPIRED

uint64_t stria__coord_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static bool stria__terminal(Stria__V1__JobState s)
{
    return s >= S_FAILED;
}

static const char *stria__state_name(Stria__V1__JobState s)
{
    static const char *const names[] = {
        "unspecified",  "pending",          "loading", "running forward",
        "forward done", "running backward", "done",    "failed",
        "cancelled",    "released",         "expired"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "unknown";
}

/* ---- job math ---------------------------------------------------------- */

/* Checks a submitted spec; the message names the field. */
static stria_status_t stria__spec_check(const Stria__V1__JobSpec *s)
{
    if (s->batch < 1 || s->batch > STRIA_COORD_MAX_BATCH)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "batch must be 1..%d (got %u)",
                               STRIA_COORD_MAX_BATCH, s->batch);
    if (s->seq_len < 1 || s->seq_len > STRIA_COORD_MAX_SEQ)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "seq_len must be 1..%llu (got %llu)",
                               (unsigned long long)STRIA_COORD_MAX_SEQ,
                               (unsigned long long)s->seq_len);
    if (s->heads < 1 || s->heads > STRIA_COORD_MAX_HEADS)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "heads must be 1..%d (got %u)",
                               STRIA_COORD_MAX_HEADS, s->heads);
    if (s->kv_heads < 1 || s->kv_heads > s->heads)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "kv_heads must be 1..heads (%u) (got %u)",
                               s->heads, s->kv_heads);
    if (s->heads % s->kv_heads != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "heads (%u) must be a multiple of kv_heads (%u)", s->heads,
                               s->kv_heads);
    if (s->head_dim < STRIA_HEAD_DIM_MIN || s->head_dim > STRIA_HEAD_DIM_MAX ||
        s->head_dim % 8 != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "head_dim must be a multiple of 8 in %d..%d (got %u)",
                               STRIA_HEAD_DIM_MIN, STRIA_HEAD_DIM_MAX, s->head_dim);
    if ((unsigned)s->dtype > STRIA__V1__DTYPE__DTYPE_FP16)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "dtype %d is none of fp32 (0), bf16 (1), fp16 (2)", (int)s->dtype);
    if ((unsigned)s->layout > STRIA__V1__LAYOUT__LAYOUT_ZIGZAG)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "layout %d is none of striped (0), contiguous (1), zigzag (2)",
                               (int)s->layout);
    if (s->ring_size > STRIA_COORD_MAX_RING)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ring_size must be 0..%d (got %u)",
                               STRIA_COORD_MAX_RING, s->ring_size);
    if (!isfinite(s->scale) || s->scale < 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "scale must be finite and >= 0 (0: 1/sqrt(head_dim)) (got %g)",
                               (double)s->scale);
    if (s->ttl_s > STRIA_COORD_MAX_TTL_S)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "ttl_s must be at most %u (got %u)",
                               STRIA_COORD_MAX_TTL_S, s->ttl_s);
    if (strlen(s->label) > STRIA_COORD_MAX_LABEL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "label is longer than %d bytes",
                               STRIA_COORD_MAX_LABEL);
    return STRIA_OK;
}

/* ---- reply building ------------------------------------------------------ */

/* Nested reply messages live in this scratch list until the reply is
 * serialised. */
typedef struct stria__bchunk {
    union {
        struct stria__bchunk *next;
        max_align_t align;
    } h;
} stria__bchunk_t;

typedef struct {
    stria__bchunk_t *chunks;
    bool oom;
} stria__b_t;

static void *stria__b_alloc(stria__b_t *b, size_t n)
{
    stria__bchunk_t *c = calloc(1, sizeof(*c) + n);
    if (c == NULL) {
        b->oom = true;
        return NULL;
    }
    c->h.next = b->chunks;
    b->chunks = c;
    return c + 1;
}

static void stria__b_free(stria__b_t *b)
{
    while (b->chunks != NULL) {
        stria__bchunk_t *next = b->chunks->h.next;
        free(b->chunks);
        b->chunks = next;
    }
}

/* Replies, or fails the call when building ran out of memory. */
static void stria__b_reply(stria__b_t *b, stria_rpc_call_t *call, const ProtobufCMessage *msg)
{
    if (b->oom)
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "the coordinator ran out of memory");
    else
        stria_rpc_call_reply(call, msg, NULL, 0, NULL, NULL);
    stria__b_free(b);
}

static int stria__ring_cmp(const void *a, const void *b)
{
    const stria__cworker_t *x = *(stria__cworker_t *const *)a;
    const stria__cworker_t *y = *(stria__cworker_t *const *)b;
    int c = strcmp(x->host, y->host);
    return c != 0 ? c : strcmp(x->rpc_address, y->rpc_address);
}

/* The ring: healthy, non-draining workers by (host, RPC address). `out` has
 * room for every worker. */
static uint32_t stria__ring_build(const stria_coord_t *co, stria__cworker_t **out)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < co->n_workers; i++)
        if (!co->workers[i]->dead && !co->workers[i]->draining)
            out[n++] = co->workers[i];
    qsort(out, n, sizeof(*out), stria__ring_cmp);
    return n;
}

/* Workers in ring order, then draining, then dead ones (each by host and
 * address); *n_ring_out of them form the ring. NULL when out of memory. */
static stria__cworker_t **stria__workers_ordered(const stria_coord_t *co, uint32_t *n_ring_out)
{
    stria__cworker_t **all = malloc((co->n_workers + 1) * sizeof(*all));
    uint32_t n, k;
    if (all == NULL)
        return NULL;
    n = stria__ring_build(co, all);
    *n_ring_out = n;
    k = n;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t first = k;
        for (uint32_t i = 0; i < co->n_workers; i++) {
            stria__cworker_t *w = co->workers[i];
            if ((pass == 0 && !w->dead && w->draining) || (pass == 1 && w->dead))
                all[k++] = w;
        }
        qsort(all + first, k - first, sizeof(*all), stria__ring_cmp);
    }
    return all;
}

static Stria__V1__WorkerState stria__worker_state(const stria__cworker_t *w)
{
    if (w->left)
        return STRIA__V1__WORKER_STATE__WORKER_STATE_LEFT;
    if (w->dead)
        return STRIA__V1__WORKER_STATE__WORKER_STATE_DEAD;
    return w->draining ? STRIA__V1__WORKER_STATE__WORKER_STATE_DRAINING
                       : STRIA__V1__WORKER_STATE__WORKER_STATE_HEALTHY;
}

static bool stria__job_has_worker(const stria__cjob_t *j, const stria__cworker_t *w)
{
    for (uint32_t r = 0; r < j->n_ranks; r++)
        if (j->ranks[r].worker == w)
            return true;
    return false;
}

static void stria__fill_worker(stria__b_t *b, const stria_coord_t *co, stria__cworker_t *w,
                               int ring_index, Stria__V1__WorkerInfo *out)
{
    double now = stria_time_now();
    double age_ms = (now - w->last_seen) * 1000.0;
    uint32_t n = 0;

    stria__v1__worker_info__init(out);
    out->worker_id = w->id;
    out->state = stria__worker_state(w);
    out->host = w->host;
    out->device = w->device;
    out->rpc_address = w->rpc_address;
    out->ucx_address = w->ucx_address;
    out->memory_bytes = w->memory_bytes;
    out->memory_reserved_bytes = w->reserved;
    out->memory_in_use_bytes = w->in_use;
    out->heartbeat_age_ms = age_ms > UINT32_MAX ? UINT32_MAX : (uint32_t)age_ms;
    out->software_version = w->version;
    out->kernel_variant = w->kernel_variant;
    out->current_job_id = w->current_job;
    out->step = w->step;
    out->steps_total = w->steps_total;
    out->ring_index = ring_index;
    out->draining = w->draining;
    out->registered_ms = w->registered_ms;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (j->reserved && stria__job_has_worker(j, w))
            n++;
    }
    if (n == 0)
        return;
    out->job_ids = stria__b_alloc(b, n * sizeof(uint64_t));
    if (out->job_ids == NULL)
        return;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (j->reserved && stria__job_has_worker(j, w))
            out->job_ids[out->n_job_ids++] = j->id;
    }
}

static void stria__fill_spec(const stria__cjob_t *j, Stria__V1__JobSpec *s)
{
    stria__v1__job_spec__init(s);
    s->batch = j->batch;
    s->seq_len = j->seq_len;
    s->heads = j->heads;
    s->kv_heads = j->kv_heads;
    s->head_dim = j->head_dim;
    s->dtype = j->dtype;
    s->causal = j->causal;
    s->layout = j->layout;
    s->ring_size = j->n_ranks;
    s->scale = j->scale;
    s->ttl_s = j->ttl_s;
    s->step_timeout_ms = j->step_timeout_ms;
    s->no_queue = j->no_queue;
    s->label = (char *)j->label;
}

static Stria__V1__Assignment *stria__fill_assignment(stria__b_t *b, const stria__cjob_t *j)
{
    Stria__V1__Assignment *a = stria__b_alloc(b, sizeof(*a));
    Stria__V1__JobSpec *spec = stria__b_alloc(b, sizeof(*spec));
    Stria__V1__RankAssignment **ranks = stria__b_alloc(b, j->n_ranks * sizeof(*ranks));

    if (a == NULL || spec == NULL || ranks == NULL)
        return NULL;
    stria__v1__assignment__init(a);
    stria__fill_spec(j, spec);
    a->job_id = j->id;
    a->spec = spec;
    a->max_tokens_per_rank = j->shard_tokens;
    a->memory_per_rank_bytes = j->mem_per_rank;
    a->ranks = ranks;
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        const stria__crank_t *cr = &j->ranks[r];
        Stria__V1__RankAssignment *ra = stria__b_alloc(b, sizeof(*ra));
        Stria__V1__PositionRun **runs = stria__b_alloc(b, (cr->n_runs + 1) * sizeof(*runs));
        if (ra == NULL || runs == NULL)
            return NULL;
        stria__v1__rank_assignment__init(ra);
        ra->rank = r;
        ra->worker_id = cr->worker->id;
        ra->host = (char *)cr->worker->host;
        ra->device = (char *)cr->worker->device;
        ra->rpc_address = (char *)cr->worker->rpc_address;
        ra->ucx_address = (char *)cr->worker->ucx_address;
        ra->tokens = cr->tokens;
        ra->runs = runs;
        for (size_t k = 0; k < cr->n_runs; k++) {
            Stria__V1__PositionRun *pr = stria__b_alloc(b, sizeof(*pr));
            if (pr == NULL)
                return NULL;
            stria__v1__position_run__init(pr);
            pr->first = (uint64_t)cr->runs[k].first;
            pr->stride = (uint64_t)cr->runs[k].stride;
            pr->count = (uint64_t)cr->runs[k].count;
            runs[ra->n_runs++] = pr;
        }
        ranks[a->n_ranks++] = ra;
    }
    return a;
}

static uint32_t stria__queue_position(const stria_coord_t *co, const stria__cjob_t *j)
{
    uint32_t pos = 0;
    if (j->state != S_PENDING)
        return 0;
    for (uint32_t i = 0; i < co->n_jobs && co->jobs[i] != j; i++)
        if (co->jobs[i]->state == S_PENDING)
            pos++;
    return pos + 1;
}

static Stria__V1__JobInfo *stria__fill_job(stria__b_t *b, const stria_coord_t *co,
                                           const stria__cjob_t *j)
{
    Stria__V1__JobInfo *info = stria__b_alloc(b, sizeof(*info));
    Stria__V1__JobTimings *t = stria__b_alloc(b, sizeof(*t));
    uint64_t idle_ms;

    if (info == NULL || t == NULL)
        return NULL;
    stria__v1__job_info__init(info);
    stria__v1__job_timings__init(t);
    info->job_id = j->id;
    info->state = j->state;
    info->assignment = stria__fill_assignment(b, j);
    info->timings = t;
    info->failure = (char *)j->failure;
    info->queue_position = stria__queue_position(co, j);
    t->submitted_ms = j->submitted_ms;
    t->started_ms = j->started_ms;
    t->forward_started_ms = j->forward_started_ms;
    t->forward_done_ms = j->forward_done_ms;
    t->backward_started_ms = j->backward_started_ms;
    t->backward_done_ms = j->backward_done_ms;
    t->finished_ms = j->finished_ms;
    idle_ms = (uint64_t)((stria_time_now() - j->last_activity) * 1000.0);
    t->last_activity_ms = stria__coord_wall_ms() - idle_ms;
    if (j->state == S_RUNNING_FORWARD || j->state == S_RUNNING_BACKWARD) {
        info->step = UINT32_MAX;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            if (j->ranks[r].step < info->step)
                info->step = j->ranks[r].step;
            if (j->ranks[r].steps_total > info->steps_total)
                info->steps_total = j->ranks[r].steps_total;
        }
    }
    return info->assignment != NULL ? info : NULL;
}

/* ---- metrics ------------------------------------------------------------- */

/* Errors the coordinator counts, by kind (stria_coordinator_errors_total). */
typedef enum {
    STRIA__E_SUBMIT_INVALID = 0, /* a spec outside the limits */
    STRIA__E_SUBMIT_NO_WORKERS,  /* fewer ring workers than the job asks for */
    STRIA__E_SUBMIT_NO_MEMORY,   /* no window of workers can ever hold the job */
    STRIA__E_SUBMIT_BUSY,        /* job limit reached, or no_queue and no room now */
    STRIA__E_PASS_FAILED,        /* a worker reported a failed pass */
    STRIA__E_WORKER_DEAD,        /* a worker missed its heartbeats */
    STRIA__E_WORKER_RESTARTED,   /* a worker came back as a new process */
    STRIA__E_BAD_REQUEST,        /* a malformed worker request */
    STRIA__E_COUNT,
} stria__error_kind_t;

static const char *const stria__error_kinds[STRIA__E_COUNT] = {
    "submit_invalid", "submit_no_workers", "submit_no_memory", "submit_busy",
    "pass_failed",    "worker_dead",       "worker_restarted", "bad_request"};

/* Prometheus-friendly state names ("running_forward"). */
static void stria__state_label(Stria__V1__JobState s, char *out, size_t len)
{
    size_t n = 0;
    for (const char *p = stria__state_name(s); *p && n + 1 < len; p++)
        out[n++] = *p == ' ' ? '_' : *p;
    out[n] = '\0';
}

static stria_metric_t *stria__m_labeled(stria_coord_t *co, stria_metric_kind_t kind,
                                        const char *name, const char *help, const char *key,
                                        const char *value)
{
    char labels[96];
    snprintf(labels, sizeof(labels), "%s=\"%s\"", key, value);
    return stria_metrics_get(co->metrics, kind, name, help, labels, NULL, 0);
}

static void stria__count_error(stria_coord_t *co, stria__error_kind_t kind)
{
    if (co->metrics == NULL)
        return;
    stria_metric_add(stria__m_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_errors_total",
                                      "Errors seen by the coordinator, by kind.", "kind",
                                      stria__error_kinds[kind]),
                     1);
}

static void stria__count_finished(stria_coord_t *co, Stria__V1__JobState state)
{
    char name[32];
    if (co->metrics == NULL)
        return;
    stria__state_label(state, name, sizeof(name));
    stria_metric_add(
        stria__m_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_jobs_finished_total",
                         "Jobs that reached a terminal state, by that state.", "state", name),
        1);
}

static stria_metric_t *stria__m_passes(stria_coord_t *co, bool backward)
{
    return stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER, "stria_coordinator_passes_total",
                             "Ring passes completed by every rank of a job.",
                             backward ? "pass=\"backward\"" : "pass=\"forward\"", NULL, 0);
}

static stria_metric_t *stria__m_pass_seconds(stria_coord_t *co, bool backward)
{
    static const double buckets[] = {0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120, 600};
    return stria_metrics_get(co->metrics, STRIA_METRIC_HISTOGRAM, "stria_coordinator_pass_seconds",
                             "Wall time of a job's ring pass, from its first rank starting to its "
                             "last rank done.",
                             backward ? "pass=\"backward\"" : "pass=\"forward\"", buckets,
                             sizeof(buckets) / sizeof(buckets[0]));
}

/* A pass completed on every rank; times in Unix milliseconds. */
static void stria__count_pass(stria_coord_t *co, bool backward, uint64_t started_ms,
                              uint64_t done_ms)
{
    if (co->metrics == NULL)
        return;
    stria_metric_add(stria__m_passes(co, backward), 1);
    if (started_ms != 0 && done_ms >= started_ms)
        stria_metric_observe(stria__m_pass_seconds(co, backward),
                             (double)(done_ms - started_ms) / 1000.0);
}

/* Series that exist from the start, so that rates and alerts see zeros. */
static void stria__metrics_init(stria_coord_t *co)
{
    static const Stria__V1__JobState finished[] = {S_FAILED, S_CANCELLED, S_RELEASED, S_EXPIRED};
    if (co->metrics == NULL)
        return;
    for (int k = 0; k < STRIA__E_COUNT; k++)
        stria__m_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_errors_total",
                         "Errors seen by the coordinator, by kind.", "kind", stria__error_kinds[k]);
    for (size_t k = 0; k < sizeof(finished) / sizeof(finished[0]); k++) {
        char name[32];
        stria__state_label(finished[k], name, sizeof(name));
        stria__m_labeled(co, STRIA_METRIC_COUNTER, "stria_coordinator_jobs_finished_total",
                         "Jobs that reached a terminal state, by that state.", "state", name);
    }
    stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER, "stria_coordinator_jobs_submitted_total",
                      "Jobs admitted since start.", NULL, NULL, 0);
    for (int b = 0; b < 2; b++) {
        stria__m_passes(co, b == 1);
        stria__m_pass_seconds(co, b == 1);
    }
}

/* A short summary for `systemctl status` (STATUS=). */
static void stria__notify_status(stria_coord_t *co, const uint32_t nw[4], uint32_t active,
                                 uint32_t pending)
{
    char status[sizeof(co->last_status)];
    if (!co->notify_status)
        return;
    snprintf(status, sizeof(status),
             "STATUS=workers: %u in the ring, %u draining, %u dead, %u left; jobs: %u active, "
             "%u pending",
             nw[0], nw[1], nw[2], nw[3], active, pending);
    if (strcmp(status, co->last_status) == 0)
        return;
    snprintf(co->last_status, sizeof(co->last_status), "%s", status);
    stria_notify(status);
}

static void stria__metrics_update(stria_coord_t *co)
{
    static const char *const wstates[] = {"healthy", "draining", "dead", "left"};
    uint32_t nw[4] = {0, 0, 0, 0};
    uint32_t nj[S_EXPIRED + 1] = {0};
    uint32_t active = 0;
    double now = stria_time_now();

    for (uint32_t i = 0; i < co->n_workers; i++)
        nw[stria__worker_state(co->workers[i]) - 1]++;
    for (uint32_t i = 0; i < co->n_jobs; i++)
        nj[co->jobs[i]->state]++;
    for (int s = S_LOADING; s <= S_DONE; s++)
        active += nj[s];
    stria__notify_status(co, nw, active, nj[S_PENDING]);
    if (co->metrics == NULL)
        return;
    for (int k = 0; k < 4; k++)
        stria_metric_set(stria__m_labeled(co, STRIA_METRIC_GAUGE, "stria_coordinator_workers",
                                          "Registered workers by state.", "state", wstates[k]),
                         nw[k]);
    for (int s = S_PENDING; s <= S_DONE; s++) {
        char name[32];
        stria__state_label((Stria__V1__JobState)s, name, sizeof(name));
        stria_metric_set(stria__m_labeled(co, STRIA_METRIC_GAUGE, "stria_coordinator_jobs",
                                          "Pending and active jobs by state.", "state", name),
                         nj[s]);
    }
    for (uint32_t i = 0; i < co->n_workers; i++) {
        const stria__cworker_t *w = co->workers[i];
        char addr[2 * STRIA__COORD_STR], host[2 * STRIA__COORD_STR], labels[5 * STRIA__COORD_STR];
        stria_metrics_escape(w->rpc_address, addr, sizeof(addr));
        stria_metrics_escape(w->host, host, sizeof(host));
        snprintf(labels, sizeof(labels), "worker=\"%llu\",address=\"%s\",host=\"%s\"",
                 (unsigned long long)w->id, addr, host);
        stria_metric_set(stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                           "stria_coordinator_worker_heartbeat_age_seconds",
                                           "Seconds since each worker's last heartbeat.", labels,
                                           NULL, 0),
                         now - w->last_seen);
        stria_metric_set(stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                           "stria_coordinator_worker_memory_in_use_bytes",
                                           "Memory each worker reports in use by its jobs.", labels,
                                           NULL, 0),
                         (double)w->in_use);
        stria_metric_set(stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                           "stria_coordinator_worker_memory_reserved_bytes",
                                           "Memory the coordinator reserved on each worker for "
                                           "active jobs.",
                                           labels, NULL, 0),
                         (double)w->reserved);
    }
    stria_metric_set(stria_metrics_get(co->metrics, STRIA_METRIC_GAUGE,
                                       "stria_coordinator_uptime_seconds",
                                       "Seconds since the coordinator started.", NULL, NULL, 0),
                     now - co->started_at);
}

/* ---- job state ----------------------------------------------------------- */

static void stria__job_reserve(stria__cjob_t *j)
{
    for (uint32_t r = 0; r < j->n_ranks; r++)
        j->ranks[r].worker->reserved += j->mem_per_rank;
    j->reserved = true;
}

static void stria__job_unreserve(stria__cjob_t *j)
{
    if (!j->reserved)
        return;
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        stria__cworker_t *w = j->ranks[r].worker;
        w->reserved -= j->mem_per_rank;
        if (w->current_job == j->id) {
            w->current_job = 0;
            w->step = w->steps_total = 0;
        }
    }
    j->reserved = false;
}

static void stria__job_free(stria__cjob_t *j)
{
    free(j->ranks);
    free(j);
}

/* Drops the oldest finished jobs beyond the history size. */
static void stria__jobs_prune(stria_coord_t *co)
{
    uint32_t finished = 0, drop, k = 0;
    for (uint32_t i = 0; i < co->n_jobs; i++)
        finished += stria__terminal(co->jobs[i]->state);
    if (finished <= co->history)
        return;
    drop = finished - co->history;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (drop > 0 && stria__terminal(j->state)) {
            stria__job_free(j);
            drop--;
        } else {
            co->jobs[k++] = j;
        }
    }
    co->n_jobs = k;
}

static void stria__job_finish(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state,
                              const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Moves a job to a terminal state and frees its reservation. */
static void stria__job_finish(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state,
                              const char *fmt, ...)
{
    if (stria__terminal(j->state))
        return;
    if (fmt != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->failure, sizeof(j->failure), fmt, ap);
        va_end(ap);
    }
    j->state = state;
    j->finished_ms = stria__coord_wall_ms();
    stria__job_unreserve(j);
    stria__count_finished(co, state);
    if (state != S_RELEASED)
        co->jobs_failed++;
    if (state == S_RELEASED)
        stria_log_info("job %llu released", (unsigned long long)j->id);
    else
        stria_log_warn("job %llu %s: %s", (unsigned long long)j->id, stria__state_name(state),
                       j->failure);
}

static void stria__job_start(stria__cjob_t *j)
{
    stria__job_reserve(j);
    j->state = S_LOADING;
    j->started_ms = stria__coord_wall_ms();
    /* Time in the queue does not count against the client. */
    j->last_activity = stria_time_now();
    stria_log_info("job %llu starts on %u workers", (unsigned long long)j->id, j->n_ranks);
}

static bool stria__fits_now(const stria__cjob_t *j)
{
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        const stria__cworker_t *w = j->ranks[r].worker;
        if (w->dead || w->blocked || w->memory_bytes < w->reserved ||
            w->memory_bytes - w->reserved < j->mem_per_rank)
            return false;
    }
    return true;
}

/* Starts the queued jobs that fit, in submission order: a job that must wait
 * blocks its workers for every later job, so no job is overtaken forever.
 * A queued job on a dead or draining worker fails: its workers were bound at
 * submission, and a drained worker must run down, so the client hears it
 * now and can submit again (new jobs skip draining workers). */
static void stria__schedule(stria_coord_t *co)
{
    for (uint32_t i = 0; i < co->n_workers; i++)
        co->workers[i]->blocked = false;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        stria__cworker_t *gone = NULL;
        if (j->state != S_PENDING)
            continue;
        for (uint32_t r = 0; r < j->n_ranks && gone == NULL; r++)
            if (j->ranks[r].worker->dead || j->ranks[r].worker->draining)
                gone = j->ranks[r].worker;
        if (gone != NULL) {
            stria__job_finish(co, j, S_FAILED,
                              gone->dead ? "worker %llu (%s) died while the job was queued"
                                         : "worker %llu (%s) was drained while the job was "
                                           "queued: submit it again (new jobs skip draining "
                                           "workers)",
                              (unsigned long long)gone->id, gone->rpc_address);
            continue;
        }
        if (stria__fits_now(j)) {
            stria__job_start(j);
            continue;
        }
        for (uint32_t r = 0; r < j->n_ranks; r++)
            j->ranks[r].worker->blocked = true;
    }
}

/* Fails every unfinished job that uses worker w. */
static void stria__fail_jobs_of(stria_coord_t *co, stria__cworker_t *w, const char *why)
{
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state))
            continue;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            if (j->ranks[r].worker == w) {
                stria__job_finish(co, j, S_FAILED, "rank %u (worker %llu at %s) %s", r,
                                  (unsigned long long)w->id, w->rpc_address, why);
                break;
            }
        }
    }
}

static stria__cjob_t *stria__job_find(stria_coord_t *co, uint64_t id)
{
    for (uint32_t i = 0; i < co->n_jobs; i++)
        if (co->jobs[i]->id == id)
            return co->jobs[i];
    return NULL;
}

static stria__cworker_t *stria__worker_find(stria_coord_t *co, uint64_t id)
{
    for (uint32_t i = 0; i < co->n_workers; i++)
        if (co->workers[i]->id == id)
            return co->workers[i];
    return NULL;
}

/* ---- periodic work ------------------------------------------------------- */

static void stria__on_tick(void *arg)
{
    stria_coord_t *co = arg;
    double now = stria_time_now();
    double dead_after = STRIA__DEAD_PERIODS * co->heartbeat_period_s;
    bool changed = false;

    for (uint32_t i = 0; i < co->n_workers; i++) {
        stria__cworker_t *w = co->workers[i];
        char why[128];
        if (w->dead || now - w->last_seen <= dead_after)
            continue;
        w->dead = true;
        w->current_job = 0;
        w->in_use = 0;
        snprintf(why, sizeof(why), "missed %d heartbeats (silent for %.1f s)", STRIA__DEAD_PERIODS,
                 now - w->last_seen);
        stria_log_warn("worker %llu (%s, %s) is dead: %s", (unsigned long long)w->id, w->host,
                       w->rpc_address, why);
        stria__count_error(co, STRIA__E_WORKER_DEAD);
        stria__fail_jobs_of(co, w, why);
        changed = true;
    }
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state) || now - j->last_activity <= j->ttl_s)
            continue;
        stria__job_finish(co, j, S_EXPIRED, "abandoned: no client activity for %u s (its TTL)",
                          j->ttl_s);
        changed = true;
    }
    if (changed)
        stria__schedule(co);
    /* Only here: handlers may hold pointers to finished jobs. */
    stria__jobs_prune(co);
    stria__metrics_update(co);
}

/* ---- handlers: workers --------------------------------------------------- */

#define STRIA__REQ(type, call) ((const type *)stria_rpc_call_request(call))

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

static void stria__on_register(void *ctx, stria_rpc_call_t *call)
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
        stria__count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "RegisterWorker: %s", stria_error_msg());
        return;
    }
    if (req->host[0] == '\0' || req->device[0] == '\0' || req->memory_bytes == 0) {
        stria__count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "RegisterWorker: host, device and memory_bytes are required");
        return;
    }
    if (!stria__copy_str(tmp.rpc_address, req->rpc_address) ||
        !stria__copy_str(tmp.ucx_address, req->ucx_address) ||
        !stria__copy_str(tmp.host, req->host) || !stria__copy_str(tmp.device, req->device) ||
        !stria__copy_str(tmp.version, req->software_version) ||
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
            stria__count_error(co, STRIA__E_WORKER_RESTARTED);
            stria__fail_jobs_of(co, w, "restarted and lost the job");
        }
        tmp.id = w->id;
        tmp.reserved = w->reserved;
        tmp.draining = w->draining;
        tmp.registered_ms = w->registered_ms;
        stria_log_info(
            "worker %llu (%s, %s) %s", (unsigned long long)w->id, req->host, req->rpc_address,
            w->left   ? "is back after its shutdown"
            : w->dead ? "rejoins"
                      : (w->incarnation != req->incarnation ? "restarted" : "registers again"));
    } else {
        if (co->n_workers >= co->max_workers) {
            stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                                "RegisterWorker: the coordinator already knows %u workers",
                                co->max_workers);
            return;
        }
        w = calloc(1, sizeof(*w));
        if (w == NULL) {
            stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "RegisterWorker: out of memory");
            return;
        }
        co->workers[co->n_workers++] = w;
        tmp.id = co->next_worker_id++;
        tmp.registered_ms = stria__coord_wall_ms();
        stria_log_info("worker %llu registered: %s, %s, device %s, %llu MiB",
                       (unsigned long long)tmp.id, req->host, req->rpc_address, req->device,
                       (unsigned long long)(req->memory_bytes >> 20));
    }
    tmp.memory_bytes = req->memory_bytes;
    tmp.incarnation = req->incarnation;
    tmp.last_seen = stria_time_now();
    *w = tmp;
    rep.worker_id = w->id;
    rep.heartbeat_period_ms = (uint32_t)ceil(co->heartbeat_period_s * 1000.0);
    rep.rejoined = rejoined;
    stria__schedule(co);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void stria__on_heartbeat(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__HeartbeatRequest *req = STRIA__REQ(Stria__V1__HeartbeatRequest, call);
    Stria__V1__HeartbeatReply rep = STRIA__V1__HEARTBEAT_REPLY__INIT;
    stria__cworker_t *w = stria__worker_find(co, req->worker_id);
    double now = stria_time_now();
    uint64_t *drop;

    if (w == NULL || w->incarnation != req->incarnation || w->left) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND,
                            "Heartbeat: worker %llu (incarnation %llu) is not registered here; "
                            "register again",
                            (unsigned long long)req->worker_id,
                            (unsigned long long)req->incarnation);
        return;
    }
    drop = calloc(req->n_jobs + 1, sizeof(*drop));
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
    w->current_job = 0;
    w->step = w->steps_total = 0;
    for (size_t i = 0; i < req->n_jobs; i++) {
        const Stria__V1__WorkerJobStatus *js = req->jobs[i];
        stria__cjob_t *j = stria__job_find(co, js->job_id);
        bool member = false;
        if (j != NULL && !stria__terminal(j->state)) {
            for (uint32_t r = 0; r < j->n_ranks; r++) {
                if (j->ranks[r].worker != w)
                    continue;
                member = true;
                j->ranks[r].step = js->step;
                j->ranks[r].steps_total = js->steps_total;
            }
        }
        if (!member) {
            drop[rep.n_drop_job_ids++] = js->job_id;
            continue;
        }
        if (js->phase == S_RUNNING_FORWARD || js->phase == S_RUNNING_BACKWARD) {
            w->current_job = j->id;
            w->step = js->step;
            w->steps_total = js->steps_total;
        }
        if (js->idle_ms < 1000.0 * (now - j->last_activity))
            j->last_activity = now - js->idle_ms / 1000.0;
    }
    rep.drop_job_ids = drop;
    rep.heartbeat_period_ms = (uint32_t)ceil(co->heartbeat_period_s * 1000.0);
    rep.draining = w->draining;
    if (rep.rejoined)
        stria__schedule(co);
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
    free(drop);
}

static void stria__on_report(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__ReportJobRequest *req = STRIA__REQ(Stria__V1__ReportJobRequest, call);
    Stria__V1__ReportJobReply rep = STRIA__V1__REPORT_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__job_find(co, req->job_id);
    stria__crank_t *cr;
    stria__cworker_t *w;
    bool all = true;

    if (j == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "ReportJob: job %llu is unknown",
                            (unsigned long long)req->job_id);
        return;
    }
    if (req->rank >= j->n_ranks || j->ranks[req->rank].worker->id != req->worker_id) {
        stria__count_error(co, STRIA__E_BAD_REQUEST);
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
        stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
        return;
    }
    j->last_activity = stria_time_now();
    cr->step = req->step;
    cr->steps_total = req->steps_total;
    switch (req->event) {
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_LOADED:
        cr->loaded = true;
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_STARTED:
        if (j->state != S_RUNNING_FORWARD) {
            j->state = S_RUNNING_FORWARD;
            j->forward_started_ms = stria__coord_wall_ms();
            j->forward_done_ms = 0;
            for (uint32_t r = 0; r < j->n_ranks; r++)
                j->ranks[r].fwd_done = false;
        }
        w->current_job = j->id;
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FORWARD_DONE:
        cr->fwd_done = true;
        if (w->current_job == j->id)
            w->current_job = 0;
        for (uint32_t r = 0; r < j->n_ranks; r++)
            all = all && j->ranks[r].fwd_done;
        if (all && j->state == S_RUNNING_FORWARD) {
            j->state = S_FORWARD_DONE;
            j->forward_done_ms = stria__coord_wall_ms();
            stria__count_pass(co, false, j->forward_started_ms, j->forward_done_ms);
        }
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_STARTED:
        if (j->state == S_LOADING) {
            stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                                "ReportJob: job %llu cannot run backward before forward",
                                (unsigned long long)j->id);
            return;
        }
        if (j->state != S_RUNNING_BACKWARD) {
            if (j->forward_done_ms == 0)
                j->forward_done_ms = stria__coord_wall_ms();
            j->state = S_RUNNING_BACKWARD;
            j->backward_started_ms = stria__coord_wall_ms();
            j->backward_done_ms = 0;
            for (uint32_t r = 0; r < j->n_ranks; r++)
                j->ranks[r].bwd_done = false;
        }
        w->current_job = j->id;
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_BACKWARD_DONE:
        cr->bwd_done = true;
        if (w->current_job == j->id)
            w->current_job = 0;
        for (uint32_t r = 0; r < j->n_ranks; r++)
            all = all && j->ranks[r].bwd_done;
        if (all && j->state == S_RUNNING_BACKWARD) {
            j->state = S_DONE;
            j->backward_done_ms = stria__coord_wall_ms();
            stria__count_pass(co, true, j->backward_started_ms, j->backward_done_ms);
        }
        break;
    case STRIA__V1__REPORT_JOB_REQUEST__EVENT__EVENT_FAILED:
        stria__count_error(co, STRIA__E_PASS_FAILED);
        stria__job_finish(co, j, S_FAILED, "rank %u (worker %llu at %s): %.400s", req->rank,
                          (unsigned long long)w->id, w->rpc_address,
                          req->message[0] ? req->message : "failed without a reason");
        stria__schedule(co);
        break;
    default:
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "ReportJob: unknown event %d",
                            (int)req->event);
        return;
    }
    rep.state = j->state;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- handlers: clients --------------------------------------------------- */

static uint32_t stria__count_unfinished(const stria_coord_t *co)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < co->n_jobs; i++)
        n += !stria__terminal(co->jobs[i]->state);
    return n;
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

/* Chooses n consecutive ring workers for a job needing `need` bytes each:
 * the first window that can start now, else the least loaded one that has
 * the capacity. Returns the window's start, or -1 when no window has the
 * capacity (*best_cap_out: the largest per-rank capacity of any window). */
static int64_t stria__choose_window(stria_coord_t *co, stria__cworker_t **ring, uint32_t count,
                                    uint32_t n, uint64_t need, bool *now_out,
                                    uint64_t *best_cap_out)
{
    int64_t best = -1;
    uint64_t best_load = UINT64_MAX, best_cap = 0;

    /* Free memory is what is not reserved and not promised to queued jobs. */
    for (uint32_t i = 0; i < co->n_workers; i++) {
        co->workers[i]->queued_demand = 0;
        co->workers[i]->blocked = false;
    }
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (j->state != S_PENDING)
            continue;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            j->ranks[r].worker->queued_demand += j->mem_per_rank;
            j->ranks[r].worker->blocked = true;
        }
    }
    for (uint32_t s = 0; s + n <= count; s++) {
        uint64_t cap = UINT64_MAX, load = 0;
        bool fits = true;
        for (uint32_t k = s; k < s + n; k++) {
            stria__cworker_t *w = ring[k];
            if (w->memory_bytes < cap)
                cap = w->memory_bytes;
            load += w->reserved + w->queued_demand;
            if (w->blocked || w->memory_bytes < w->reserved || w->memory_bytes - w->reserved < need)
                fits = false;
        }
        if (cap > best_cap)
            best_cap = cap;
        if (cap < need)
            continue;
        if (fits) {
            *now_out = true;
            return s;
        }
        if (load < best_load) {
            best_load = load;
            best = s;
        }
    }
    *now_out = false;
    *best_cap_out = best_cap;
    return best;
}

static void stria__on_submit(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__SubmitJobRequest *req = STRIA__REQ(Stria__V1__SubmitJobRequest, call);
    const Stria__V1__JobSpec *s = req->spec;
    Stria__V1__SubmitJobReply rep = STRIA__V1__SUBMIT_JOB_REPLY__INIT;
    stria__cworker_t **ring = NULL;
    uint32_t count, n, healthy, draining, dead, left;
    stria_layout_t layout;
    uint64_t need = 0, best_cap = 0;
    stria__cjob_t *j = NULL;
    bool now = false;
    int64_t start;
    stria__b_t b = {0};

    if (s == NULL) {
        stria__count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "SubmitJob: the spec is missing");
        return;
    }
    if (stria__spec_check(s) != STRIA_OK) {
        stria__count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "SubmitJob: %s", stria_error_msg());
        return;
    }
    if (stria__count_unfinished(co) >= co->max_jobs) {
        stria__count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: %u jobs are pending or active, the coordinator's limit",
                            co->max_jobs);
        return;
    }
    ring = malloc((co->n_workers + 1) * sizeof(*ring));
    if (ring == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "SubmitJob: out of memory");
        return;
    }
    count = stria__ring_build(co, ring);
    stria__count_workers(co, &healthy, &draining, &dead, &left);
    n = s->ring_size ? s->ring_size : count;
    if (count == 0 || n > count) {
        stria__count_error(co, STRIA__E_SUBMIT_NO_WORKERS);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: the job needs %u workers but %u are available (%u "
                            "healthy, %u draining, %u dead, %u left)",
                            n ? n : 1, count, healthy, draining, dead, left);
        goto free_ring;
    }
    if (stria_layout_init((stria_layout_kind_t)s->layout, (int)n, (int64_t)s->seq_len, &layout) !=
        STRIA_OK) {
        stria__count_error(co, STRIA__E_SUBMIT_INVALID);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG, "SubmitJob: %s", stria_error_msg());
        goto free_ring;
    }
    for (uint32_t r = 0; r < n; r++) {
        if (stria_layout_shard_valid(&layout, (int)r) < 1) {
            stria__count_error(co, STRIA__E_SUBMIT_INVALID);
            stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                                "SubmitJob: seq_len %llu leaves rank %u of a %u-rank ring "
                                "without tokens; use a longer sequence or a smaller ring_size",
                                (unsigned long long)s->seq_len, r, n);
            goto free_ring;
        }
    }
    if (stria_rank_memory(s->batch, layout.shard_tokens, s->heads, s->kv_heads, s->head_dim,
                          (stria_dtype_t)s->dtype, &need) != STRIA_OK) {
        stria__count_error(co, STRIA__E_SUBMIT_NO_MEMORY);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY,
                            "SubmitJob: the job needs more memory per rank than any worker has "
                            "(%s)",
                            stria_error_msg());
        goto free_ring;
    }
    start = stria__choose_window(co, ring, count, n, need, &now, &best_cap);
    if (start < 0) {
        stria__count_error(co, STRIA__E_SUBMIT_NO_MEMORY);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY,
                            "SubmitJob: the job needs %llu MiB per rank (%u ranks of %lld tokens) "
                            "but the workers of the best ring of %u offer %llu MiB each; use a "
                            "larger ring, a smaller batch or a shorter sequence",
                            (unsigned long long)(need >> 20), n, (long long)layout.shard_tokens, n,
                            (unsigned long long)(best_cap >> 20));
        goto free_ring;
    }
    if (!now && s->no_queue) {
        stria__count_error(co, STRIA__E_SUBMIT_BUSY);
        stria_rpc_call_fail(call, STRIA_ERR_BUSY,
                            "SubmitJob: not enough free memory on the workers now (the job needs "
                            "%llu MiB per rank) and no_queue is set",
                            (unsigned long long)(need >> 20));
        goto free_ring;
    }
    if (co->n_jobs == co->cap_jobs) {
        uint32_t cap = co->cap_jobs ? 2 * co->cap_jobs : 64;
        stria__cjob_t **jobs = realloc(co->jobs, cap * sizeof(*jobs));
        if (jobs == NULL) {
            stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "SubmitJob: out of memory");
            goto free_ring;
        }
        co->jobs = jobs;
        co->cap_jobs = cap;
    }
    j = calloc(1, sizeof(*j));
    if (j != NULL)
        j->ranks = calloc(n, sizeof(*j->ranks));
    if (j == NULL || j->ranks == NULL) {
        free(j);
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "SubmitJob: out of memory");
        goto free_ring;
    }
    j->id = co->next_job_id++;
    j->batch = s->batch;
    j->seq_len = s->seq_len;
    j->heads = s->heads;
    j->kv_heads = s->kv_heads;
    j->head_dim = s->head_dim;
    j->dtype = s->dtype;
    j->layout = s->layout;
    j->causal = s->causal;
    j->no_queue = s->no_queue;
    j->scale = s->scale > 0 ? s->scale : (float)(1.0 / sqrt((double)s->head_dim));
    j->ttl_s = s->ttl_s ? s->ttl_s : (uint32_t)ceil(co->job_ttl_s);
    j->step_timeout_ms = s->step_timeout_ms;
    snprintf(j->label, sizeof(j->label), "%s", s->label);
    j->n_ranks = n;
    j->shard_tokens = (uint64_t)layout.shard_tokens;
    j->mem_per_rank = need;
    for (uint32_t r = 0; r < n; r++) {
        stria__crank_t *cr = &j->ranks[r];
        cr->worker = ring[start + r];
        cr->n_runs = stria_layout_shard_runs(&layout, (int)r, false, cr->runs);
        cr->tokens = (uint64_t)stria_layout_shard_valid(&layout, (int)r);
    }
    j->submitted_ms = stria__coord_wall_ms();
    j->last_activity = stria_time_now();
    j->state = S_PENDING;
    co->jobs[co->n_jobs++] = j;
    co->jobs_submitted++;
    if (co->metrics != NULL)
        stria_metric_add(stria_metrics_get(co->metrics, STRIA_METRIC_COUNTER,
                                           "stria_coordinator_jobs_submitted_total",
                                           "Jobs admitted since start.", NULL, NULL, 0),
                         1);
    stria_log_info("job %llu submitted: batch %u, seq %llu, heads %u/%u, dim %u, %s, %u ranks "
                   "from worker %llu, %llu MiB per rank%s",
                   (unsigned long long)j->id, j->batch, (unsigned long long)j->seq_len, j->heads,
                   j->kv_heads, j->head_dim, stria_dtype_name((stria_dtype_t)j->dtype), n,
                   (unsigned long long)ring[start]->id, (unsigned long long)(need >> 20),
                   now ? "" : ", queued");
    stria__schedule(co);
    rep.state = j->state;
    rep.assignment = stria__fill_assignment(&b, j);
    rep.queue_position = stria__queue_position(co, j);
    stria__b_reply(&b, call, &rep.base);
free_ring:
    free(ring);
}

static void stria__on_get_job(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__GetJobRequest *req = STRIA__REQ(Stria__V1__GetJobRequest, call);
    Stria__V1__GetJobReply rep = STRIA__V1__GET_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__job_find(co, req->job_id);
    stria__b_t b = {0};

    if (j == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "GetJob: job %llu is unknown",
                            (unsigned long long)req->job_id);
        return;
    }
    if (!stria__terminal(j->state))
        j->last_activity = stria_time_now();
    rep.job = stria__fill_job(&b, co, j);
    if (rep.job == NULL)
        b.oom = true;
    stria__b_reply(&b, call, &rep.base);
}

static void stria__on_release(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__ReleaseJobRequest *req = STRIA__REQ(Stria__V1__ReleaseJobRequest, call);
    Stria__V1__ReleaseJobReply rep = STRIA__V1__RELEASE_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__job_find(co, req->job_id);

    if (j == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "ReleaseJob: job %llu is unknown",
                            (unsigned long long)req->job_id);
        return;
    }
    if (!stria__terminal(j->state)) {
        stria__job_finish(co, j, S_RELEASED, NULL);
        stria__schedule(co);
    }
    rep.state = j->state;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

static void stria__on_cancel(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__CancelJobRequest *req = STRIA__REQ(Stria__V1__CancelJobRequest, call);
    Stria__V1__CancelJobReply rep = STRIA__V1__CANCEL_JOB_REPLY__INIT;
    stria__cjob_t *j = stria__job_find(co, req->job_id);

    if (j == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "CancelJob: job %llu is unknown",
                            (unsigned long long)req->job_id);
        return;
    }
    if (!stria__terminal(j->state)) {
        stria__job_finish(co, j, S_CANCELLED, "cancelled by an admin from %s%s%.300s",
                          stria_rpc_call_peer(call), req->reason[0] ? ": " : "", req->reason);
        stria__schedule(co);
    }
    rep.state = j->state;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- handlers: status ---------------------------------------------------- */

static void stria__on_status(void *ctx, stria_rpc_call_t *call)
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
    rep.auth_required = co->auth_required;
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* Ring (as_members) or worker list: every worker in ring order, then the
 * draining and dead ones. */
static void stria__on_workers(stria_coord_t *co, stria_rpc_call_t *call, bool as_members)
{
    Stria__V1__GetRingReply ring_rep = STRIA__V1__GET_RING_REPLY__INIT;
    Stria__V1__ListWorkersReply list_rep = STRIA__V1__LIST_WORKERS_REPLY__INIT;
    uint32_t n_ring = 0;
    stria__cworker_t **all = stria__workers_ordered(co, &n_ring);
    stria__b_t b = {0};
    size_t n = co->n_workers;
    Stria__V1__RingMember **members = NULL;
    Stria__V1__WorkerInfo **infos = NULL;

    if (all == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "out of memory");
        return;
    }
    infos = stria__b_alloc(&b, (n + 1) * sizeof(*infos));
    if (as_members)
        members = stria__b_alloc(&b, (n + 1) * sizeof(*members));
    for (size_t i = 0; i < n && !b.oom; i++) {
        int idx = i < n_ring ? (int)i : -1;
        infos[i] = stria__b_alloc(&b, sizeof(**infos));
        if (infos[i] == NULL)
            break;
        stria__fill_worker(&b, co, all[i], idx, infos[i]);
        if (as_members) {
            members[i] = stria__b_alloc(&b, sizeof(**members));
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
        stria__b_reply(&b, call, &ring_rep.base);
    } else {
        list_rep.n_workers = n;
        list_rep.workers = infos;
        stria__b_reply(&b, call, &list_rep.base);
    }
}

static void stria__on_ring(void *ctx, stria_rpc_call_t *call)
{
    stria__on_workers(ctx, call, true);
}

static void stria__on_list_workers(void *ctx, stria_rpc_call_t *call)
{
    stria__on_workers(ctx, call, false);
}

static void stria__on_list_jobs(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__ListJobsRequest *req = STRIA__REQ(Stria__V1__ListJobsRequest, call);
    Stria__V1__ListJobsReply rep = STRIA__V1__LIST_JOBS_REPLY__INIT;
    stria__b_t b = {0};
    Stria__V1__JobInfo **jobs = stria__b_alloc(&b, (co->n_jobs + 1) * sizeof(*jobs));

    for (uint32_t i = 0; i < co->n_jobs && jobs != NULL; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state) && !req->include_finished)
            continue;
        jobs[rep.n_jobs] = stria__fill_job(&b, co, j);
        if (jobs[rep.n_jobs] == NULL) {
            b.oom = true;
            break;
        }
        rep.n_jobs++;
    }
    rep.jobs = jobs;
    stria__b_reply(&b, call, &rep.base);
}

static void stria__on_drain(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__DrainWorkerRequest *req = STRIA__REQ(Stria__V1__DrainWorkerRequest, call);
    Stria__V1__DrainWorkerReply rep = STRIA__V1__DRAIN_WORKER_REPLY__INIT;
    Stria__V1__WorkerInfo info;
    stria__cworker_t *w = stria__worker_find(co, req->worker_id);
    stria__cworker_t **ring;
    int idx = -1;
    uint32_t n;
    stria__b_t b = {0};

    if (w == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND, "DrainWorker: worker %llu is unknown",
                            (unsigned long long)req->worker_id);
        return;
    }
    if (w->draining != req->drain) {
        w->draining = req->drain;
        stria_log_info("worker %llu (%s) %s by %s", (unsigned long long)w->id, w->rpc_address,
                       req->drain ? "drained" : "undrained", stria_rpc_call_peer(call));
        stria__schedule(co);
    }
    ring = malloc((co->n_workers + 1) * sizeof(*ring));
    if (ring == NULL) {
        stria_rpc_call_fail(call, STRIA_ERR_NO_MEMORY, "DrainWorker: out of memory");
        return;
    }
    n = stria__ring_build(co, ring);
    for (uint32_t i = 0; i < n; i++)
        if (ring[i] == w)
            idx = (int)i;
    free(ring);
    stria__fill_worker(&b, co, w, idx, &info);
    rep.worker = &info;
    stria__b_reply(&b, call, &rep.base);
}

/* A worker shutting down: out of the ring now, not after missed heartbeats,
 * and its jobs fail at once with a reason an operator understands. */
static void stria__on_deregister(void *ctx, stria_rpc_call_t *call)
{
    stria_coord_t *co = ctx;
    const Stria__V1__DeregisterWorkerRequest *req =
        STRIA__REQ(Stria__V1__DeregisterWorkerRequest, call);
    Stria__V1__DeregisterWorkerReply rep = STRIA__V1__DEREGISTER_WORKER_REPLY__INIT;
    stria__cworker_t *w = stria__worker_find(co, req->worker_id);
    char why[600];

    if (w == NULL || w->incarnation != req->incarnation) {
        stria_rpc_call_fail(call, STRIA_ERR_NOT_FOUND,
                            "DeregisterWorker: worker %llu (incarnation %llu) is not registered "
                            "here",
                            (unsigned long long)req->worker_id,
                            (unsigned long long)req->incarnation);
        return;
    }
    if (strlen(req->reason) > 256) {
        stria__count_error(co, STRIA__E_BAD_REQUEST);
        stria_rpc_call_fail(call, STRIA_ERR_INVALID_ARG,
                            "DeregisterWorker: reason is longer than 256 bytes");
        return;
    }
    if (!w->left) {
        snprintf(why, sizeof(why), "worker %llu (%s) %.256s", (unsigned long long)w->id,
                 w->rpc_address, req->reason[0] ? req->reason : "shut down");
        for (uint32_t i = 0; i < co->n_jobs; i++) {
            stria__cjob_t *j = co->jobs[i];
            if (stria__terminal(j->state) || !stria__job_has_worker(j, w))
                continue;
            stria__job_finish(co, j, S_FAILED, "%s", why);
            rep.jobs_failed++;
        }
        w->left = true;
        w->dead = true;
        w->current_job = 0;
        w->step = w->steps_total = 0;
        w->in_use = 0;
        stria_log_info("worker %llu (%s, %s) left the ring: %s; %u unfinished job(s) failed",
                       (unsigned long long)w->id, w->host, w->rpc_address,
                       req->reason[0] ? req->reason : "shut down", rep.jobs_failed);
        stria__schedule(co);
    }
    stria_rpc_call_reply(call, &rep.base, NULL, 0, NULL, NULL);
}

/* ---- lifecycle ----------------------------------------------------------- */

stria_status_t stria_coord_start(const stria_coord_params_t *p, stria_coord_t **coord_out)
{
    static const stria_rpc_method_t methods[STRIA_RPC_COORDINATOR_N_METHODS] = {
        STRIA_RPC_SERVE(COORDINATOR_REGISTER_WORKER, .handler = stria__on_register),
        STRIA_RPC_SERVE(COORDINATOR_HEARTBEAT, .handler = stria__on_heartbeat),
        STRIA_RPC_SERVE(COORDINATOR_REPORT_JOB, .handler = stria__on_report),
        STRIA_RPC_SERVE(COORDINATOR_SUBMIT_JOB, .handler = stria__on_submit),
        STRIA_RPC_SERVE(COORDINATOR_GET_JOB, .handler = stria__on_get_job),
        STRIA_RPC_SERVE(COORDINATOR_RELEASE_JOB, .handler = stria__on_release),
        STRIA_RPC_SERVE(COORDINATOR_CANCEL_JOB, .handler = stria__on_cancel,
                        .flags = STRIA_RPC_METHOD_ADMIN),
        STRIA_RPC_SERVE(COORDINATOR_GET_STATUS, .handler = stria__on_status),
        STRIA_RPC_SERVE(COORDINATOR_GET_RING, .handler = stria__on_ring),
        STRIA_RPC_SERVE(COORDINATOR_LIST_WORKERS, .handler = stria__on_list_workers),
        STRIA_RPC_SERVE(COORDINATOR_LIST_JOBS, .handler = stria__on_list_jobs),
        STRIA_RPC_SERVE(COORDINATOR_DRAIN_WORKER, .handler = stria__on_drain,
                        .flags = STRIA_RPC_METHOD_ADMIN),
        STRIA_RPC_SERVE(COORDINATOR_DEREGISTER_WORKER, .handler = stria__on_deregister),
    };
    stria_rpc_server_params_t sp;
    stria_coord_t *co;
    stria_status_t st;

    if (p == NULL || coord_out == NULL || p->listen == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "coordinator: a listen address is required");
    if (p->heartbeat_period_s < 0 || p->heartbeat_period_s > 3600 ||
        !isfinite(p->heartbeat_period_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: heartbeat period must be in (0, 3600] seconds");
    if (p->job_ttl_s < 0 || p->job_ttl_s > STRIA_COORD_MAX_TTL_S || !isfinite(p->job_ttl_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: job TTL must be in (0, %u] seconds",
                               STRIA_COORD_MAX_TTL_S);
    if (stria__v1__coordinator__descriptor.n_methods != STRIA_RPC_COORDINATOR_N_METHODS)
        return stria_error_set(STRIA_ERR_INTERNAL, "coordinator: service has %u methods, not %d",
                               stria__v1__coordinator__descriptor.n_methods,
                               STRIA_RPC_COORDINATOR_N_METHODS);
    co = calloc(1, sizeof(*co));
    if (co == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "coordinator: out of memory");
    co->heartbeat_period_s = p->heartbeat_period_s > 0 ? p->heartbeat_period_s : 1.0;
    co->job_ttl_s = p->job_ttl_s > 0 ? p->job_ttl_s : 600.0;
    co->max_workers = p->max_workers ? p->max_workers : 4096;
    co->max_jobs = p->max_jobs ? p->max_jobs : 4096;
    co->history = p->history ? p->history : 1024;
    co->auth_required = p->token != NULL && p->token[0] != '\0';
    co->metrics = p->metrics;
    co->notify_status = p->notify_status;
    stria__metrics_init(co);
    co->started_at = stria_time_now();
    co->started_ms = stria__coord_wall_ms();
    co->next_worker_id = 1;
    co->next_job_id = 1;
    co->workers = calloc(co->max_workers, sizeof(*co->workers));
    if (co->workers == NULL) {
        free(co);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "coordinator: out of memory");
    }

    memset(&sp, 0, sizeof(sp));
    sp.listen = p->listen;
    sp.service = &stria__v1__coordinator__descriptor;
    sp.methods = methods;
    sp.ctx = co;
    sp.token = p->token;
    sp.admin_token = p->admin_token;
    sp.tick = stria__on_tick;
    /* Dead workers are noticed within a quarter period of the deadline. */
    sp.tick_period_s = co->heartbeat_period_s / 4;
    sp.name = "coordinator";
    st = stria_rpc_server_start(&sp, &co->server);
    if (st != STRIA_OK) {
        free(co->workers);
        free(co);
        return st;
    }
    if (co->auth_required && (p->admin_token == NULL || p->admin_token[0] == '\0'))
        stria_log_warn("coordinator: no admin token: every token holder may drain and cancel");
    *coord_out = co;
    return STRIA_OK;
}

uint16_t stria_coord_port(const stria_coord_t *co)
{
    return stria_rpc_server_port(co->server);
}

const stria_rpc_server_t *stria_coord_server(const stria_coord_t *co)
{
    return co->server;
}

void stria_coord_stop(stria_coord_t *co)
{
    if (co == NULL)
        return;
    stria_rpc_server_stop(co->server);
    /* The loop thread is gone: the tables are ours. Nothing survives a
     * restart, so say in the log which jobs end here and why. */
    for (uint32_t i = 0; i < co->n_jobs; i++)
        stria__job_finish(co, co->jobs[i], S_FAILED, "the coordinator shut down");
    for (uint32_t i = 0; i < co->n_jobs; i++)
        stria__job_free(co->jobs[i]);
    free(co->jobs);
    for (uint32_t i = 0; i < co->n_workers; i++)
        free(co->workers[i]);
    free(co->workers);
    free(co);
}
