/* The coordinator's job table: every job (a session is a job whose spec has
 * `session` set) from its admission to its end and its time in the history.
 * Specs checked, jobs added and found (by id, by worker, by submission key),
 * the state machine (memory reserved, a job finished, failed for a worker
 * or adopted after a restart), the queue that starts jobs in submission
 * order, and a sharded job's arrival rounds. The rooms above (the handlers,
 * recovery, replacement, the tick) call down into it; it calls nothing of
 * theirs. Everything runs on the RPC loop thread. */
#include "coord_int.h"
#include "stria_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- specs --------------------------------------------------------------- */

/* The documents and window of a spec (checked after seq_len and causal), by
 * the function every door uses (libstria, the worker, a session's calls). */
_Static_assert(STRIA_COORD_MAX_CU_SEQLENS == STRIA_CALL_MAX_CU_SEQLENS,
               "the coordinator's documents limit is the call record's");
static stria_status_t stria__spec_check_masks(const Stria__V1__JobSpec *s)
{
    stria_call_shape_t c;
    stria_call_shape_from_spec(s, &c);
    return stria_call_masks_check(&c);
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
                               "a sharded job must name its layout (striped, contiguous, "
                               "zigzag or packed), not auto: its ranks bring their tokens in "
                               "that order");
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
stria_status_t stria__cjob_spec_check(const Stria__V1__JobSpec *s)
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
    if ((unsigned)s->layout > STRIA__V1__LAYOUT__LAYOUT_PACKED)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "layout %d is none of striped (0), contiguous (1), zigzag (2), "
                               "auto (3), packed (4)",
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
    if (s->max_held > STRIA_COORD_MAX_HELD)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "max_held must be at most %d forwards (got %u)",
                               STRIA_COORD_MAX_HELD, s->max_held);
    if (s->head_groups > STRIA_COORD_MAX_HEAD_GROUPS ||
        (s->head_groups > 0 && (s->head_group >= s->head_groups || s->head_group_tag == 0)))
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "head_group %u of head_groups %u (tag %llu): the groups are at "
                               "most %d, the group one of them, the tag nonzero",
                               s->head_group, s->head_groups, (unsigned long long)s->head_group_tag,
                               STRIA_COORD_MAX_HEAD_GROUPS);
    stria_status_t st = stria__spec_check_masks(s);
    return st != STRIA_OK ? st : stria__spec_check_sharded(s);
}

/* ---- the table ----------------------------------------------------------- */

stria__cjob_t *stria__cjob_find(stria_coord_t *co, uint64_t id)
{
    return stria__index_get(&co->job_ids, id, 0);
}

int stria__cjob_rank_of(const stria_coord_t *co, const stria__cjob_t *j, const stria__cworker_t *w)
{
    uintptr_t r = (uintptr_t)stria__index_get(&co->members, j->id, w->id);
    return r == 0 ? -1 : (int)(r - 1);
}

bool stria__cjob_has_worker(const stria__cjob_t *j, const stria__cworker_t *w)
{
    for (uint32_t r = 0; r < j->n_ranks; r++)
        if (j->ranks[r].worker == w)
            return true;
    return false;
}

/* The placement of a job's ranks (their strings copied); false when out of
 * memory. */
static bool stria__cjob_add_placement(stria__cjob_t *j, const Stria__V1__JobSpec *s,
                                      const bool *fallback)
{
    j->placed = s->n_placement > 0;
    for (uint32_t r = 0; r < j->n_ranks && j->placed; r++) {
        stria__crank_t *cr = &j->ranks[r];
        cr->fallback = fallback[r];
        cr->place_has_device = s->placement[r]->has_device_index;
        cr->place_device = s->placement[r]->device_index;
        if ((cr->place_host = strdup(s->placement[r]->host)) == NULL)
            return false;
    }
    return true;
}

/* Frees a job stria__cjob_add() could not complete. */
static void stria__cjob_add_undo(stria__cjob_t *j)
{
    if (j == NULL)
        return;
    for (uint32_t r = 0; j->ranks != NULL && r < j->n_ranks; r++)
        free(j->ranks[r].place_host);
    stria_call_shape_free(&j->call);
    free(j->ranks);
    free(j);
}

/* Appends an admitted job (state PENDING) on the workers ring[0 .. n) (the
 * ranks' workers in order; fallback[r]: rank r placed off its host) to the
 * job table, with the id, secret and ring key of `keys`; NULL when out of
 * memory. */
stria__cjob_t *stria__cjob_add(stria_coord_t *co, const Stria__V1__JobSpec *s,
                               const stria_layout_t *layout, stria__cworker_t **ring,
                               const bool *fallback, uint32_t n, uint64_t need, const char *client,
                               const stria__cjob_t *keys)
{
    stria__cjob_t *j;
    stria__cjob_t **jobs = stria_grow(co->jobs, &co->cap_jobs, co->n_jobs + 1, sizeof(*jobs), 64);
    if (jobs == NULL)
        return NULL;
    co->jobs = jobs;
    j = calloc(1, sizeof(*j));
    if (j != NULL)
        j->ranks = calloc(n, sizeof(*j->ranks));
    if (j != NULL && j->ranks != NULL)
        j->n_ranks = n;
    if (j != NULL) {
        j->id = keys->id;
        j->secret = keys->secret;
        memcpy(j->ring_key, keys->ring_key, sizeof(j->ring_key));
    }
    stria_call_shape_t call; /* its documents copied into the job */
    stria_call_shape_from_spec(s, &call);
    if (j == NULL || j->ranks == NULL || stria_call_shape_copy(&call, &j->call) != STRIA_OK ||
        !stria__cjob_add_placement(j, s, fallback) ||
        stria__index_put(&co->job_ids, j->id, 0, j) != STRIA_OK) {
        stria__cjob_add_undo(j);
        return NULL;
    }
    for (uint32_t r = 0; r < n; r++) {
        if (stria__index_put(&co->members, j->id, ring[r]->id, (void *)(uintptr_t)(r + 1)) !=
            STRIA_OK) {
            for (uint32_t k = 0; k < r; k++)
                stria__index_del(&co->members, j->id, ring[k]->id);
            stria__index_del(&co->job_ids, j->id, 0);
            stria__cjob_add_undo(j);
            return NULL;
        }
    }
    j->spec = *s; /* what it points to is replaced below */
    j->spec.base.n_unknown_fields = 0;
    j->spec.base.unknown_fields = NULL;
    j->spec.layout = (Stria__V1__Layout)layout->kind; /* auto resolved */
    j->spec.ring_size = n;
    j->spec.scale = stria_call_scale(s->scale, s->head_dim);
    /* a session's TTL is its idle deadline, kept by its workers' heartbeats */
    j->spec.ttl_s = s->ttl_s     ? s->ttl_s
                    : s->session ? STRIA__DEFAULT_SESSION_IDLE_S
                                 : (uint32_t)ceil(co->job_ttl_s);
    if (s->arrival_timeout_s <= 0)
        j->spec.arrival_timeout_s = STRIA__DEFAULT_ARRIVAL_S;
    snprintf(j->label, sizeof(j->label), "%s", s->label);
    j->spec.label = j->label;
    j->spec.cu_seqlens = (int64_t *)j->call.cu_seqlens;
    j->spec.n_cu_seqlens = j->call.n_cu_seqlens;
    j->spec.window = NULL;
    if (j->call.has_window) {
        stria__v1__job_spec__window__init(&j->window);
        j->window.left = j->call.window_left;
        j->window.right = j->call.window_right;
        j->spec.window = &j->window;
    }
    j->spec.placement = NULL;
    j->spec.n_placement = 0;
    j->n_ranks = n;
    j->shard_tokens = (uint64_t)layout->shard_tokens;
    j->mem_per_rank = need;
    snprintf(j->client, sizeof(j->client), "%s", client);
    for (uint32_t r = 0; r < n; r++) {
        stria__crank_t *cr = &j->ranks[r];
        cr->worker = ring[r];
        ring[r]->job_refs++;
        cr->n_runs = stria_layout_shard_runs(layout, (int)r, false, cr->runs);
        cr->tokens = (uint64_t)stria_layout_shard_valid(layout, (int)r);
    }
    stria__v1__job_timings__init(&j->times);
    j->times.submitted_ms = stria__coord_wall_ms();
    j->last_activity = stria_time_now();
    j->state = S_PENDING;
    co->jobs[co->n_jobs++] = j;
    co->jobs_submitted++;
    return j;
}

/* Frees a job of the table (taken out of the id index; its workers freed
 * with it when it was the last to name a forgotten one). */
void stria__cjob_free(stria_coord_t *co, stria__cjob_t *j)
{
    stria__cjob_unreserve(j);
    stria__timeline_drop(co, j);
    for (uint32_t r = 0; r < j->n_ranks; r++)
        free(j->ranks[r].place_host);
    stria_call_shape_free(&j->call);
    stria__index_del(&co->job_ids, j->id, 0);
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        stria__cworker_t *w = j->ranks[r].worker;
        if (--w->job_refs == 0 && w->forgotten)
            free(w);
    }
    free(j->ranks);
    free(j);
}

/* Whether a job replaced by a chain ending in an unfinished job (kept in
 * the history until that one ends: ranks still follow it). */
static bool stria__cjob_replaced_live(stria_coord_t *co, const stria__cjob_t *j)
{
    for (int hops = 0; j != NULL && j->replaced_by != 0 && hops <= STRIA__MAX_GENERATIONS; hops++) {
        j = stria__cjob_find(co, j->replaced_by);
        if (j != NULL && !stria__terminal(j->state))
            return true;
    }
    return false;
}

/* Drops the oldest finished jobs beyond the history size. */
void stria__cjob_prune(stria_coord_t *co)
{
    uint32_t finished = 0, drop, k = 0;
    for (uint32_t i = 0; i < co->n_jobs; i++)
        finished += stria__terminal(co->jobs[i]->state);
    if (finished <= co->history)
        return;
    drop = finished - co->history;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (drop > 0 && stria__terminal(j->state) && !stria__cjob_replaced_live(co, j)) {
            stria__cjob_free(co, j);
            drop--;
        } else {
            co->jobs[k++] = j;
        }
    }
    co->n_jobs = k;
}

/* ---- queries ------------------------------------------------------------- */

/* Pending and active jobs, of one client (its host address) or of all
 * (NULL). */
uint32_t stria__cjob_count_unfinished(const stria_coord_t *co, const char *client)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < co->n_jobs; i++)
        n += !stria__terminal(co->jobs[i]->state) &&
             (client == NULL || strcmp(co->jobs[i]->client, client) == 0);
    return n;
}

/* A client's open sessions (a job is one) and the memory they hold on the
 * workers: the one account of a client against its caps. */
uint32_t stria__cjob_count_sessions(const stria_coord_t *co, const char *client,
                                    uint64_t *bytes_out)
{
    uint32_t n = 0;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        const stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state) || strcmp(j->client, client) != 0)
            continue;
        n++;
        bytes += j->mem_per_rank * j->n_ranks;
    }
    *bytes_out = bytes;
    return n;
}

/* The unfinished job an earlier copy of a submission made (the same client
 * host and submit_key: its reply was lost with the connection), or NULL. */
stria__cjob_t *stria__cjob_submitted_before(const stria_coord_t *co, const char *client,
                                            const ProtobufCBinaryData *key)
{
    if (key->len != STRIA__SUBMIT_KEY_BYTES)
        return NULL;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (j->keyed && !stria__terminal(j->state) && strcmp(j->client, client) == 0 &&
            stria_auth_equal(j->submit_key, key->data, sizeof(j->submit_key)))
            return j;
    }
    return NULL;
}

uint32_t stria__cjob_queue_position(const stria_coord_t *co, const stria__cjob_t *j)
{
    uint32_t pos = 0;
    if (j->state != S_PENDING)
        return 0;
    for (uint32_t i = 0; i < co->n_jobs && co->jobs[i] != j; i++)
        if (co->jobs[i]->state == S_PENDING)
            pos++;
    return pos + 1;
}

/* The spec's placement, one entry per rank; false when out of memory. */
bool stria__cjob_placement(stria__scratch_t *b, const stria__cjob_t *j, Stria__V1__JobSpec *s)
{
    Stria__V1__JobSpec__Placement **pl;
    if (!j->placed)
        return true;
    if ((pl = stria__scratch_alloc(b, j->n_ranks * sizeof(*pl))) == NULL)
        return false;
    for (uint32_t r = 0; r < j->n_ranks; r++) {
        if ((pl[r] = stria__scratch_alloc(b, sizeof(**pl))) == NULL)
            return false;
        stria__v1__job_spec__placement__init(pl[r]);
        pl[r]->host = j->ranks[r].place_host;
        pl[r]->has_device_index = j->ranks[r].place_has_device;
        pl[r]->device_index = j->ranks[r].place_device;
    }
    s->placement = pl;
    s->n_placement = j->n_ranks;
    return true;
}

/* ---- job state ----------------------------------------------------------- */

void stria__cjob_reserve(stria__cjob_t *j)
{
    for (uint32_t r = 0; r < j->n_ranks; r++)
        j->ranks[r].worker->reserved += j->mem_per_rank;
    j->reserved = true;
}

void stria__cjob_unreserve(stria__cjob_t *j)
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

/* Moves a job to a terminal state and frees its reservation. */
bool stria__cjob_finish(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state,
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
    stria__cjob_unreserve(j);
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

void stria__cjob_retryable(stria__cjob_t *j, const stria__cworker_t *w)
{
    j->failure_retryable = j->state == S_FAILED;
    j->blamed_worker = w != NULL ? w->id : 0;
}

static void stria__cjob_start(stria__cjob_t *j)
{
    stria__cjob_reserve(j);
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

void stria__cjob_adopt(stria_coord_t *co, stria__cjob_t *j, Stria__V1__JobState state)
{
    (void)co;
    stria__cjob_reserve(j);
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
void stria__cjob_schedule(stria_coord_t *co)
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
            if (stria__cjob_finish(co, j, S_FAILED,
                                   gone->dead ? "worker %llu (%s) died while the job was queued"
                                              : "worker %llu (%s) was drained while the job was "
                                                "queued: submit it again (new jobs skip draining "
                                                "workers)",
                                   (unsigned long long)gone->id, gone->rpc_address))
                stria__cjob_retryable(j, gone);
            continue;
        }
        if (stria__fits_now(j)) {
            stria__cjob_start(j);
            continue;
        }
        for (uint32_t r = 0; r < j->n_ranks; r++)
            j->ranks[r].worker->blocked = true;
    }
}

/* Fails every unfinished job that uses worker w. */
void stria__cjob_fail_worker(stria_coord_t *co, stria__cworker_t *w, const char *why)
{
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (stria__terminal(j->state))
            continue;
        for (uint32_t r = 0; r < j->n_ranks; r++) {
            if (j->ranks[r].worker == w) {
                if (stria__cjob_finish(co, j, S_FAILED, "rank %u (worker %llu at %s) %s", r,
                                       (unsigned long long)w->id, w->rpc_address, why))
                    stria__cjob_retryable(j, w);
                break;
            }
        }
    }
}

/* ---- a sharded job's arrival --------------------------------------------- */

bool stria__cjob_arrive(stria__cjob_t *j, uint32_t r, uint32_t pass, bool backward)
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
void stria__cjob_rank_list_add(char *out, size_t len, size_t *used, uint32_t *n, uint32_t r)
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
            stria__cjob_rank_list_add(out, len, &used, &n, r);
    return n;
}

/* A sharded job whose ranks did not all arrive in time fails, naming them. */
bool stria__cjob_arrival_expired(stria_coord_t *co, stria__cjob_t *j, double now)
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
        stria__cjob_finish(co, j, S_FAILED,
                           "no rank came to this replacement of job %llu within %g s "
                           "(arrival_timeout_s) of its start%s",
                           (unsigned long long)j->replaces, j->spec.arrival_timeout_s,
                           gone != NULL ? " (a rank's worker is dead)" : "");
    else
        stria__cjob_finish(co, j, S_FAILED,
                           "rank%s %s did not arrive for the %s pass within %g s "
                           "(arrival_timeout_s) of the first; rank%s %s had their inputs in and "
                           "waited%s",
                           n_missing == 1 ? "" : "s", missing,
                           j->arrival_backward ? "backward" : "forward", j->spec.arrival_timeout_s,
                           n_waiting == 1 ? "" : "s", waiting,
                           gone != NULL ? " (a missing rank's worker is dead)" : "");
    if (gone != NULL)
        stria__cjob_retryable(j, gone);
    j->arrival_deadline = 0;
    j->failure_status = STRIA_ERR_TIMEOUT;
    return true;
}
