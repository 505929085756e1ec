/* The coordinator: job math, the job state machine and its queue, heartbeat
 * and TTL timers, start and stop. Reply building and metrics are in
 * coord_reply.c, the service's handlers in coord_workers.c and
 * coord_clients.c. Everything runs on the RPC loop thread. */
#include "coord_int.h"
#include "stria_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t stria__coord_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

const char *stria__state_name(Stria__V1__JobState s)
{
    static const char *const names[] = {
        "unspecified",  "pending",          "loading", "running forward",
        "forward done", "running backward", "done",    "failed",
        "cancelled",    "released",         "expired"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "unknown";
}

/* ---- job math ---------------------------------------------------------- */

/* The documents and window of a spec (checked after seq_len and causal). */
static stria_status_t stria__spec_check_masks(const Stria__V1__JobSpec *s)
{
    const int64_t *cu = s->cu_seqlens;
    size_t n = s->n_cu_seqlens;
    if (n > STRIA_COORD_MAX_CU_SEQLENS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "cu_seqlens has %zu entries, more than the limit of %d", n,
                               STRIA_COORD_MAX_CU_SEQLENS);
    if (n > 0 && cu[0] != 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "cu_seqlens must start at 0 (got %lld)",
                               (long long)cu[0]);
    for (size_t i = 1; i < n; i++)
        if (cu[i] < cu[i - 1])
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "cu_seqlens must not decrease (entry %zu is %lld after %lld)", i,
                                   (long long)cu[i], (long long)cu[i - 1]);
    if (n > 0 && (cu[n - 1] < 0 || (uint64_t)cu[n - 1] != s->seq_len))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "cu_seqlens must end at seq_len (%llu) (got %lld)",
                               (unsigned long long)s->seq_len, (long long)cu[n - 1]);
    if (s->window == NULL)
        return STRIA_OK;
    if (s->window->left < -1 || s->window->right < -1)
        return stria_error_set(
            STRIA_ERR_INVALID_ARG, "window.%s must be >= -1 (-1: unbounded) (got %lld)",
            s->window->left < -1 ? "left" : "right",
            (long long)(s->window->left < -1 ? s->window->left : s->window->right));
    if (s->causal && s->window->right > 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "window.right must be 0 or -1 with causal attention (got %lld)",
                               (long long)s->window->right);
    return STRIA_OK;
}

/* Sharded jobs, their arrival deadline and placement. */
static stria_status_t stria__spec_check_sharded(const Stria__V1__JobSpec *s)
{
    if (!isfinite(s->arrival_timeout_s) || s->arrival_timeout_s < 0 ||
        s->arrival_timeout_s > STRIA_COORD_MAX_TTL_S)
        return stria_error_set(
            STRIA_ERR_INVALID_ARG, "arrival_timeout_s must be in [0, %u] seconds (0: %g) (got %g)",
            STRIA_COORD_MAX_TTL_S, STRIA__DEFAULT_ARRIVAL_S, s->arrival_timeout_s);
    if (s->sharded && s->ring_size == 0)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "a sharded job needs ring_size: the trainer's world size");
    if (s->sharded && s->layout == STRIA__V1__LAYOUT__LAYOUT_AUTO)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "a sharded job must name its layout (striped, contiguous or "
                               "zigzag), not auto: its ranks bring their tokens in that order");
    if (s->n_placement > 0 && s->n_placement != s->ring_size)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "placement has %zu entries; it needs one per rank (ring_size %u)",
                               s->n_placement, s->ring_size);
    for (size_t r = 0; r < s->n_placement; r++) {
        const char *h = s->placement[r]->host;
        if (h[0] == '\0' || strlen(h) >= STRIA__COORD_STR)
            return stria_error_set(STRIA_ERR_INVALID_ARG,
                                   "placement[%zu].host must be 1..%d bytes (got %zu)", r,
                                   STRIA__COORD_STR - 1, strlen(h));
    }
    return STRIA_OK;
}

/* Checks a submitted spec; the message names the field. */
stria_status_t stria__spec_check(const Stria__V1__JobSpec *s)
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
    if ((unsigned)s->layout > STRIA__V1__LAYOUT__LAYOUT_AUTO)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "layout %d is none of striped (0), contiguous (1), zigzag (2), "
                               "auto (3)",
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
    stria_status_t st = stria__spec_check_masks(s);
    return st != STRIA_OK ? st : stria__spec_check_sharded(s);
}

/* ---- job state ----------------------------------------------------------- */

void stria__job_reserve(stria__cjob_t *j)
{
    for (uint32_t r = 0; r < j->n_ranks; r++)
        j->ranks[r].worker->reserved += j->mem_per_rank;
    j->reserved = true;
}

void stria__job_unreserve(stria__cjob_t *j)
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

static void stria__cjob_free(stria_coord_t *co, stria__cjob_t *j)
{
    stria__job_unreserve(j);
    stria__timeline_drop(co, j);
    for (uint32_t r = 0; r < j->n_ranks; r++)
        free(j->ranks[r].place_host);
    stria_job_masks_free(&j->masks);
    stria__index_del(&co->job_ids, j->id, 0);
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        stria__cworker_t *w = j->ranks[r].worker;
        if (--w->job_refs == 0 && w->forgotten)
            free(w);
    }
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
        if (drop > 0 && stria__terminal(j->state) && !stria__replace_live(co, j)) {
            stria__cjob_free(co, j);
            drop--;
        } else {
            co->jobs[k++] = j;
        }
    }
    co->n_jobs = k;
}

/* Moves a job to a terminal state and frees its reservation. */
bool stria__job_finish(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state,
                       const char *fmt, ...)
{
    if (stria__terminal(j->state))
        return false;
    if (fmt != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->failure, sizeof(j->failure), fmt, ap);
        va_end(ap);
    }
    j->failed_in = j->state;
    j->state = state;
    j->times.finished_ms = stria__coord_wall_ms();
    stria__job_unreserve(j);
    for (uint32_t r = 0; r < j->n_ranks; r++)
        stria__index_del(&co->members, j->id, j->ranks[r].worker->id);
    stria__cmet_count_finished(co, state);
    if (state != S_RELEASED)
        co->jobs_failed++;
    if (state == S_RELEASED)
        stria_log_info("job %llu released", (unsigned long long)j->id);
    else
        stria_log_warn("job %llu %s: %s", (unsigned long long)j->id, stria__state_name(state),
                       j->failure);
    return true;
}

void stria__job_retryable(stria__cjob_t *j, const stria__cworker_t *w)
{
    j->failure_retryable = j->state == S_FAILED;
    j->blamed_worker = w != NULL ? w->id : 0;
}

static void stria__job_start(stria__cjob_t *j)
{
    stria__job_reserve(j);
    j->state = S_LOADING;
    j->times.started_ms = stria__coord_wall_ms();
    /* Time in the queue does not count against the client. */
    j->last_activity = stria_time_now();
    if (j->replaces != 0) { /* its ranks follow now, or the job is over */
        j->arrival_pass = 1;
        j->arrival_deadline = j->last_activity + j->spec.arrival_timeout_s;
    }
    stria_log_info("job %llu starts on %u workers", (unsigned long long)j->id, j->n_ranks);
}

void stria__job_adopt(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state)
{
    (void)co;
    stria__job_reserve(j);
    j->state = state;
    j->times.started_ms = stria__coord_wall_ms();
    j->last_activity = stria_time_now();
}

static bool stria__fits_now(const stria__cjob_t *j)
{
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        const stria__cworker_t *w = j->ranks[r].worker;
        if (w->dead || w->blocked || w->awaiting_jobs || w->memory_bytes < w->reserved ||
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
void stria__schedule(stria_coord_t *co)
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
            if (stria__job_finish(co, j, S_FAILED,
                                  gone->dead ? "worker %llu (%s) died while the job was queued"
                                             : "worker %llu (%s) was drained while the job was "
                                               "queued: submit it again (new jobs skip draining "
                                               "workers)",
                                  (unsigned long long)gone->id, gone->rpc_address))
                stria__job_retryable(j, gone);
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

bool stria__job_arrive(stria__cjob_t *j, uint32_t r, uint32_t pass, bool backward)
{
    uint32_t mark = pass + 1;
    bool all = true, all_now = true;
    if (!j->spec.sharded)
        return true;
    if (j->ranks[r].arrived < mark)
        j->ranks[r].arrived = mark;
    if (j->arrival_pass < mark) {
        j->arrival_pass = mark;
        j->arrival_deadline = stria_time_now() + j->spec.arrival_timeout_s;
        j->arrival_backward = backward;
    }
    for (uint32_t k = 0; k < j->n_ranks; k++) {
        all = all && j->ranks[k].arrived >= mark;
        all_now = all_now && j->ranks[k].arrived >= j->arrival_pass;
    }
    if (all_now)
        j->arrival_deadline = 0;
    return all;
}

/* "rank 3" or "ranks 0, 2, 3": the ranks that arrived at the pass of the
 * arrival round (arrived) or not; returns how many. */
void stria__rank_list_add(char *out, size_t len, size_t *used, uint32_t *n, uint32_t r)
{
    if (*n == 0)
        out[0] = '\0';
    if (*used + 16 < len)
        *used += (size_t)snprintf(out + *used, len - *used, "%s%u", *n ? ", " : "", r);
    else if (*used + 5 < len && out[*used - 1] != '.')
        *used += (size_t)snprintf(out + *used, len - *used, ", ...");
    (*n)++;
}

static uint32_t stria__rank_list(const stria__cjob_t *j, bool arrived, char *out, size_t len)
{
    uint32_t n = 0;
    size_t used = 0;
    out[0] = '\0';
    for (uint32_t r = 0; r < j->n_ranks; r++)
        if ((j->ranks[r].arrived >= j->arrival_pass) == arrived)
            stria__rank_list_add(out, len, &used, &n, r);
    return n;
}

/* A sharded job whose ranks did not all arrive in time fails, naming them. */
static bool stria__arrival_expired(stria_coord_t *co, stria__cjob_t *j, double now)
{
    char missing[200], waiting[200];
    if (j->arrival_deadline <= 0 || now <= j->arrival_deadline || stria__terminal(j->state))
        return false;
    uint32_t n_missing = stria__rank_list(j, false, missing, sizeof(missing));
    uint32_t n_waiting = stria__rank_list(j, true, waiting, sizeof(waiting));
    /* Whether a missing rank's worker died decides the class: wait until
     * each has been heard of since the deadline or is marked dead (at most
     * 3 heartbeat periods; a death fails the job, retryable, by itself). */
    const stria__cworker_t *gone = NULL;
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        const stria__cworker_t *w = j->ranks[r].worker;
        if (j->ranks[r].arrived >= j->arrival_pass)
            continue;
        if (!w->dead && w->last_seen < j->arrival_deadline)
            return false;
        if (w->dead && gone == NULL)
            gone = w;
    }
    if (n_waiting == 0) /* a replacement no rank moved to */
        stria__job_finish(co, j, S_FAILED,
                          "no rank came to this replacement of job %llu within %g s "
                          "(arrival_timeout_s) of its start%s",
                          (unsigned long long)j->replaces, j->spec.arrival_timeout_s,
                          gone != NULL ? " (a rank's worker is dead)" : "");
    else
        stria__job_finish(co, j, S_FAILED,
                          "rank%s %s did not arrive for the %s pass within %g s "
                          "(arrival_timeout_s) of the first; rank%s %s had their inputs in and "
                          "waited%s",
                          n_missing == 1 ? "" : "s", missing,
                          j->arrival_backward ? "backward" : "forward", j->spec.arrival_timeout_s,
                          n_waiting == 1 ? "" : "s", waiting,
                          gone != NULL ? " (a missing rank's worker is dead)" : "");
    if (gone != NULL)
        stria__job_retryable(j, gone);
    j->arrival_deadline = 0;
    j->failure_status = STRIA_ERR_TIMEOUT;
    return true;
}

/* Fails every unfinished job that uses worker w. */
void stria__fail_jobs_of(stria_coord_t *co, stria__cworker_t *w, const char *why)
{
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state))
            continue;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            if (j->ranks[r].worker == w) {
                if (stria__job_finish(co, j, S_FAILED, "rank %u (worker %llu at %s) %s", r,
                                      (unsigned long long)w->id, w->rpc_address, why))
                    stria__job_retryable(j, w);
                break;
            }
        }
    }
}

stria__cjob_t *stria__job_find(stria_coord_t *co, uint64_t id)
{
    return stria__index_get(&co->job_ids, id, 0);
}

stria__cworker_t *stria__worker_find(stria_coord_t *co, uint64_t id)
{
    return stria__index_get(&co->worker_ids, id, 0);
}

int stria__job_rank_of(const stria_coord_t *co, const stria__cjob_t *j, const stria__cworker_t *w)
{
    uintptr_t r = (uintptr_t)stria__index_get(&co->members, j->id, w->id);
    return r == 0 ? -1 : (int)(r - 1);
}

void stria__worker_forget(stria_coord_t *co, stria__cworker_t *w, const char *why)
{
    uint32_t k = 0;
    stria_log_info("worker %llu (%s, %s) forgotten: %s", (unsigned long long)w->id, w->host,
                   w->rpc_address, why);
    for (uint32_t i = 0; i < co->n_workers; i++)
        if (co->workers[i] != w)
            co->workers[k++] = co->workers[i];
    co->n_workers = k;
    stria__index_del(&co->worker_ids, w->id, 0);
    stria__cmet_worker_forget(co, w);
    stria__recover_worker_gone(co, w);
    w->forgotten = true;
    if (w->job_refs == 0)
        free(w);
}

/* ---- periodic work ------------------------------------------------------- */

/* The loop's own stall since the last tick, in seconds (0 when the tick came
 * within a tick period of its time). A stalled loop (a slow handler, a
 * stopped process, an overloaded host) has the heartbeats that arrived
 * meanwhile still unread when this tick runs, so worker and job deadlines
 * move by the stall. A stall of a heartbeat period or more is logged and
 * counted. */
/* The period of the coordinator's tick: a quarter heartbeat period. */
static double stria__tick_period(const stria_coord_t *co)
{
    return co->heartbeat_period_s / 4;
}

static double stria__tick_stall(stria_coord_t *co, double now)
{
    double tick = stria__tick_period(co), late = now - co->last_tick - tick;
    co->last_tick = now;
    if (late <= tick)
        return 0;
    if (late >= co->heartbeat_period_s) {
        stria_log_warn("the coordinator's loop stalled for %.3f s: worker and job deadlines "
                       "move by as much",
                       late);
        stria__cmet_count_stall(co, late);
    }
    return late;
}

/* Workers silent past their deadline are dead; dead and departed ones
 * silent past the retention are forgotten. */
static bool stria__tick_workers(stria_coord_t *co, double now, double stall)
{
    double dead_after = STRIA__DEAD_PERIODS * co->heartbeat_period_s;
    bool changed = false;

    /* Every death of this tick first, then their jobs: a replacement must
     * not take a worker that died in the same tick. A worker whose deadline
     * falls before the next tick dies with them: workers that went silent
     * together (a host going down) are replaced in one go, not one tick
     * apart. */
    bool any = false;
    for (int round = 0; round < 2; round++) {
        double after = round == 0 ? dead_after : dead_after - stria__tick_period(co);
        for (uint32_t i = 0; i < co->n_workers && (round == 0 || any); i++) {
            stria__cworker_t *w = co->workers[i];
            if (round == 0 && stall > 0 && !w->dead)
                w->last_seen = w->last_seen + stall < now ? w->last_seen + stall : now;
            if (w->dead || now - w->last_seen <= after)
                continue;
            w->dead = w->died_now = true;
            w->current_job = 0;
            w->in_use = 0;
            any = true;
        }
    }
    for (uint32_t i = 0; i < co->n_workers; i++) {
        stria__cworker_t *w = co->workers[i];
        char why[128];
        if (!w->died_now)
            continue;
        w->died_now = false;
        snprintf(why, sizeof(why), "missed %d heartbeats (silent for %.1f s)", STRIA__DEAD_PERIODS,
                 now - w->last_seen);
        stria_log_warn("worker %llu (%s, %s) is dead: %s", (unsigned long long)w->id, w->host,
                       w->rpc_address, why);
        stria__cmet_count_error(co, STRIA__E_WORKER_DEAD);
        stria__fail_jobs_of(co, w, why);
        stria__replace_lost(co, w);
        stria__recover_worker_gone(co, w);
        changed = true;
    }
    for (uint32_t i = 0; i < co->n_workers;) {
        stria__cworker_t *w = co->workers[i];
        if (w->dead && now - w->last_seen > co->worker_retention_s) {
            char why[96];
            snprintf(why, sizeof(why), "%s %.0f s ago", w->left ? "left" : "last heard of",
                     now - w->last_seen);
            stria__worker_forget(co, w, why); /* the next one moves to i */
            changed = true;
        } else {
            i++;
        }
    }
    return changed;
}

static void stria__coord_on_tick(void *arg)
{
    stria_coord_t *co = arg;
    double now = stria_time_now();
    double stall = stria__tick_stall(co, now);
    bool changed = stria__tick_workers(co, now, stall);
    changed = stria__recover_tick(co, now) || changed;
    changed = stria__replace_tick(co, now) || changed;

    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (stall > 0 && !stria__terminal(j->state)) {
            j->last_activity = j->last_activity + stall < now ? j->last_activity + stall : now;
            if (j->arrival_deadline > 0) /* the late tick's own stall is no rank's lateness */
                j->arrival_deadline += stall;
        }
        changed = stria__arrival_expired(co, j, now) || changed;
        if (stria__terminal(j->state) || now - j->last_activity <= j->spec.ttl_s)
            continue;
        stria__job_finish(co, j, S_EXPIRED, "abandoned: no client activity for %u s (its TTL)",
                          j->spec.ttl_s);
        changed = true;
    }
    if (changed)
        stria__schedule(co);
    /* Only here: handlers may hold pointers to finished jobs. */
    stria__jobs_prune(co);
    stria__cmet_update(co);
}

/* ---- lifecycle ----------------------------------------------------------- */

stria_status_t stria__coord_start(const stria_coord_params_t *p, bool no_thread,
                                  stria_coord_t **coord_out)
{
    /* Every request but a job spec (documents: up to about 600 KiB) and a
     * heartbeat (STRIA_COORD_MAX_HEARTBEAT_BYTES) is small: larger ones are
     * refused before they are read. */
#define STRIA__SMALL .max_pb_bytes = STRIA__COORD_SMALL_REQUEST
    static const stria_rpc_method_t methods[STRIA_RPC_COORDINATOR_N_METHODS] = {
        STRIA_RPC_SERVE(COORDINATOR_REGISTER_WORKER, .handler = stria__on_register,
                        .flags = STRIA_RPC_METHOD_WORKER, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_HEARTBEAT, .handler = stria__on_heartbeat,
                        .flags = STRIA_RPC_METHOD_WORKER,
                        .max_pb_bytes = STRIA_COORD_MAX_HEARTBEAT_BYTES),
        STRIA_RPC_SERVE(COORDINATOR_REPORT_JOB, .handler = stria__on_report,
                        .flags = STRIA_RPC_METHOD_WORKER, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_SUBMIT_JOB, .handler = stria__on_submit,
                        .flags = STRIA_RPC_METHOD_CLIENT),
        /* Any role: the handler tells owners, admins and workers apart. */
        STRIA_RPC_SERVE(COORDINATOR_GET_JOB, .handler = stria__on_get_job, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_RELEASE_JOB, .handler = stria__on_release,
                        .flags = STRIA_RPC_METHOD_CLIENT, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_CANCEL_JOB, .handler = stria__on_cancel,
                        .flags = STRIA_RPC_METHOD_ADMIN, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_GET_STATUS, .handler = stria__on_status, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_GET_RING, .handler = stria__on_ring, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_LIST_WORKERS, .handler = stria__on_list_workers, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_LIST_JOBS, .handler = stria__on_list_jobs,
                        .flags = STRIA_RPC_METHOD_ADMIN, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_DRAIN_WORKER, .handler = stria__on_drain,
                        .flags = STRIA_RPC_METHOD_ADMIN, STRIA__SMALL),
        STRIA_RPC_SERVE(COORDINATOR_DEREGISTER_WORKER, .handler = stria__on_deregister,
                        .flags = STRIA_RPC_METHOD_WORKER, STRIA__SMALL),
    };
#undef STRIA__SMALL
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
    if (!(p->max_step_timeout_s >= 0 && p->max_step_timeout_s <= STRIA_COORD_MAX_STEP_TIMEOUT_S))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: the largest step timeout must be in (0, %u] seconds",
                               STRIA_COORD_MAX_STEP_TIMEOUT_S);
    if (!(p->worker_retention_s >= 0 && p->worker_retention_s <= 365 * 86400.0))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: worker retention must be in (0, 1 year]");
    if (!(p->recovery_window_s <= 3600.0) || isnan(p->recovery_window_s))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: the recovery window must be at most 3600 s (got %g)",
                               p->recovery_window_s);
    if (stria__v1__coordinator__descriptor.n_methods != STRIA_RPC_COORDINATOR_N_METHODS)
        return stria_error_set(STRIA_ERR_INTERNAL, "coordinator: service has %u methods, not %d",
                               stria__v1__coordinator__descriptor.n_methods,
                               STRIA_RPC_COORDINATOR_N_METHODS);
    bool has_client = p->token != NULL && p->token[0] != '\0';
    bool has_worker = p->worker_token != NULL && p->worker_token[0] != '\0';
    bool has_admin = p->admin_token != NULL && p->admin_token[0] != '\0';
    if ((has_client || has_worker || has_admin) && !(has_client && has_worker)) {
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "coordinator: with credentials, both the client and the worker "
                               "credential are needed (missing: %s)",
                               !has_client && !has_worker ? "client, worker"
                               : !has_client              ? "client"
                                                          : "worker");
    }
    co = calloc(1, sizeof(*co));
    if (co == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "coordinator: out of memory");
    co->heartbeat_period_s = p->heartbeat_period_s > 0 ? p->heartbeat_period_s : 1.0;
    co->job_ttl_s = p->job_ttl_s > 0 ? p->job_ttl_s : 600.0;
    co->max_workers = p->max_workers ? p->max_workers : 4096;
    co->max_jobs = p->max_jobs ? p->max_jobs : 4096;
    co->history = p->history ? p->history : 1024;
    co->max_jobs_per_client = p->max_jobs_per_client ? p->max_jobs_per_client : 256;
    co->max_sessions_per_client = p->max_sessions_per_client ? p->max_sessions_per_client : 64;
    co->max_session_bytes_per_client = p->max_session_bytes_per_client;
    co->max_step_timeout_ms =
        (uint32_t)ceil(1000.0 * (p->max_step_timeout_s > 0 ? p->max_step_timeout_s : 600.0));
    co->worker_retention_s = p->worker_retention_s > 0 ? p->worker_retention_s : 3600.0;
    co->recovery_window_s = p->recovery_window_s > 0    ? p->recovery_window_s
                            : p->recovery_window_s == 0 ? 3 * co->heartbeat_period_s
                                                        : 0;
    stria__index_init(&co->worker_ids);
    stria__index_init(&co->job_ids);
    stria__index_init(&co->members);
    co->auth_required = has_client;
    co->metrics = p->metrics;
    co->notify_status = p->notify_status;
    stria__cmet_init(co);
    co->started_at = stria_time_now();
    co->last_tick = co->started_at;
    co->started_ms = stria__coord_wall_ms();
    co->recover_until = co->recovery_window_s > 0 ? co->started_at + co->recovery_window_s : 0;
    co->missing.dead = true;
    snprintf(co->missing.rpc_address, sizeof(co->missing.rpc_address), "(not reported)");
    snprintf(co->missing.host, sizeof(co->missing.host), "(not reported)");
    co->next_worker_id = 1;
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
    sp.worker_token = p->worker_token;
    sp.admin_token = p->admin_token;
    sp.tick = stria__coord_on_tick;
    /* Dead workers are noticed within a quarter period of the deadline. */
    sp.tick_period_s = stria__tick_period(co);
    sp.name = "coordinator";
    sp.no_thread = no_thread;
    st = stria_rpc_server_start(&sp, &co->server);
    if (st != STRIA_OK) {
        free(co->workers);
        free(co);
        return st;
    }
    if (co->auth_required && !has_admin)
        stria_log_warn("coordinator: no admin credential: nobody may drain, cancel or list jobs");
    else if (!co->auth_required)
        stria_log_warn("coordinator: no credentials: every connection is client, worker and "
                       "admin");
    *coord_out = co;
    return STRIA_OK;
}

stria_status_t stria_coord_start(const stria_coord_params_t *p, stria_coord_t **coord_out)
{
    return stria__coord_start(p, false, coord_out);
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
    /* The loop thread is gone: the tables are ours. The workers keep their
     * jobs for a coordinator started again (it rebuilds them); say in the
     * log which jobs this one leaves. */
    for (uint32_t i = 0; i < co->n_jobs; i++)
        if (stria__job_finish(co, co->jobs[i], S_FAILED,
                              "the coordinator shut down (its workers keep the job for a "
                              "restarted coordinator)"))
            stria__job_retryable(co->jobs[i], NULL);
    stria__recover_free(co);
    for (uint32_t i = 0; i < co->n_workers; i++) { /* the others go with their last job */
        co->workers[i]->forgotten = true;
        if (co->workers[i]->job_refs == 0)
            free(co->workers[i]);
    }
    for (uint32_t i = 0; i < co->n_jobs; i++)
        stria__cjob_free(co, co->jobs[i]);
    free(co->jobs);
    free(co->workers);
    stria__index_free(&co->worker_ids);
    stria__index_free(&co->job_ids);
    stria__index_free(&co->members);
    free(co);
}
