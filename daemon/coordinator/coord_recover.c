/* A restarted coordinator rebuilds its jobs from the workers' reports.
 *
 * The job table lives in the coordinator's memory only. After a restart the
 * workers, told their id is unknown, register again and describe the jobs
 * they hold in their next heartbeat (HeldJob: rank, spec, phase, the job's
 * secret and ring key sealed for the connection). For the recovery window
 * after start (recovery_window_s) the coordinator collects these by job id;
 * a job whose every rank was described is rebuilt at once (same id, secret
 * and ring key, its workers in rank order, its memory reserved) and its
 * owner's next call works. At the end of the window a job with ranks that
 * nobody described fails, naming them (retryable: their workers died or
 * lost the job), and the workers holding its other ranks drop it.
 *
 * Every description is checked: the spec as at submission, the rank, the
 * phase, and the keys must open. The first description of a job id fixes
 * its spec and keys; a later one that disagrees (or a second worker for the
 * same rank) is refused with a warning, counted, and its worker told to drop
 * the job. A worker holds the secret of its jobs anyway (it checks the
 * clients' proofs), so a rebuilt job opens for its owner only.
 *
 * A rebuilt replacement (HeldJob.replaces) links its replaced job again:
 * that job's record went with the restart (its workers had dropped it), so
 * it comes back failed, naming the replacement in replaced_by, with the
 * replacement's spec and secret (a replacement keeps its job's secret); the
 * ranks still on the old job follow as before the restart.
 *
 * New jobs (submitted, or replacements) draw their ids and keys here too
 * (stria__recover_new_keys): the id of a job being rebuilt is taken until
 * its window ends, which the job table alone does not know. */
#include "coord_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct stria__rjob {
    uint64_t id;
    Stria__V1__JobSpec *spec; /* unpacked copy, owned */
    uint8_t *spec_pb;         /* packed: what later descriptions must match */
    size_t spec_len;
    stria_job_secret_t secret;
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES];
    stria_layout_t layout;
    uint64_t need;
    uint32_t n_ranks, found;
    stria__cworker_t **workers; /* by rank; NULL: not described yet */
    Stria__V1__JobState *phase;
    uint32_t *passes;
    uint64_t replaces; /* HeldJob.replaces, .generation */
    uint32_t generation;
};

bool stria__recover_active(const stria_coord_t *co)
{
    return co->recover_until > 0 && stria_time_now() < co->recover_until;
}

double stria__recover_left(const stria_coord_t *co)
{
    double left = co->recover_until - stria_time_now();
    return co->recover_until > 0 && left > 0 ? left : 0;
}

static void stria__rjob_free(stria__rjob_t *rj)
{
    if (rj == NULL)
        return;
    if (rj->spec != NULL)
        stria__v1__job_spec__free_unpacked(rj->spec, NULL);
    stria_auth_wipe(&rj->secret, sizeof(rj->secret));
    stria_auth_wipe(rj->ring_key, sizeof(rj->ring_key));
    free(rj->spec_pb);
    free(rj->workers);
    free(rj->phase);
    free(rj->passes);
    free(rj);
}

static stria__rjob_t *stria__rjob_find(const stria_coord_t *co, uint64_t id, uint32_t *at)
{
    for (uint32_t i = 0; i < co->n_rjobs; i++) {
        if (co->rjobs[i]->id == id) {
            if (at != NULL)
                *at = i;
            return co->rjobs[i];
        }
    }
    return NULL;
}

bool stria__recover_pending(const stria_coord_t *co, uint64_t id)
{
    return stria__rjob_find(co, id, NULL) != NULL;
}

/* A new job's id, secret and ring key: the id random and unique among the
 * jobs kept, so that an id says nothing about the others (the secret, not
 * the id, is what opens a job); 53 bits, not 0, so that JSON readers that
 * hold numbers as doubles (jq, JavaScript) keep it exact. The keys come
 * from the system's generator. */
stria_status_t stria__recover_new_keys(stria_coord_t *co, stria__cjob_t *j, bool keep_secret)
{
    stria_status_t st = STRIA_OK;
    do {
        uint8_t raw[8];
        st = stria_auth_random(raw, sizeof(raw));
        j->id = stria_get_le64(raw) >> 11;
    } while (st == STRIA_OK && (j->id == 0 || stria__cjob_find(co, j->id) != NULL ||
                                stria__recover_pending(co, j->id)));
    if (st == STRIA_OK && !keep_secret)
        st = stria_job_secret_generate(&j->secret);
    if (st == STRIA_OK)
        st = stria_auth_random(j->ring_key, sizeof(j->ring_key));
    return st;
}

static void stria__rjob_remove(stria_coord_t *co, uint32_t at)
{
    stria__rjob_free(co->rjobs[at]);
    co->rjobs[at] = co->rjobs[--co->n_rjobs];
}

/* The checks of a description against the limits of a submission; the
 * layout and memory of its ranks. */
static stria_status_t stria__held_check(const stria_coord_t *co, const Stria__V1__HeldJob *h,
                                        stria_layout_t *layout, uint64_t *need)
{
    const Stria__V1__JobSpec *s = h->spec;
    if (h->job_id == 0 || h->job_id >= ((uint64_t)1 << 53))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "job id %llu is not one a coordinator makes",
                               (unsigned long long)h->job_id);
    if (s == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "the spec is missing");
    if (stria__cjob_spec_check(s) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "the spec");
    if (s->ring_size == 0 || h->rank >= s->ring_size)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "rank %u of a ring of %u", h->rank,
                               s->ring_size);
    if (s->step_timeout_ms > co->max_step_timeout_ms)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "step_timeout_ms %u is above the coordinator's limit %u",
                               s->step_timeout_ms, co->max_step_timeout_ms);
    if (h->phase < S_LOADING || h->phase > S_DONE)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "phase %d is not one of LOADING .. DONE",
                               (int)h->phase);
    if ((h->replaces == 0) != (h->generation == 0) || h->replaces == h->job_id ||
        h->replaces >= ((uint64_t)1 << 53) || h->generation > STRIA__MAX_GENERATIONS)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "replaces job %llu as generation %u (a replacement names another "
                               "job and a generation of 1 .. %d; a first job neither)",
                               (unsigned long long)h->replaces, h->generation,
                               STRIA__MAX_GENERATIONS);
    if (h->job_secret.len != STRIA_AUTH_SEALED_BYTES || h->ring_key.len != STRIA_AUTH_SEALED_BYTES)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "the sealed keys are missing");
    if (stria_layout_init(
            stria_layout_kind_resolve((stria_layout_kind_t)s->layout, s->window != NULL, false),
            (int)s->ring_size, (int64_t)s->seq_len, layout) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "the layout");
    for (uint32_t r = 0; r < s->ring_size; r++)
        if (stria_layout_shard_valid(layout, (int)r) < 1)
            return stria_error_set(STRIA_ERR_INVALID_ARG, "rank %u has no tokens", r);
    if (stria_session_rank_memory(s->batch, layout->shard_tokens, s->heads, s->kv_heads,
                                  s->head_dim, (stria_dtype_t)s->dtype, s->max_held,
                                  need) != STRIA_OK)
        return stria_error_wrap(STRIA_ERR_INVALID_ARG, "the memory per rank");
    return STRIA_OK;
}

/* A new entry for a job's first description (keys opened already). */
static stria__rjob_t *stria__rjob_new(stria_coord_t *co, const Stria__V1__HeldJob *h,
                                      const stria_layout_t *layout, uint64_t need)
{
    uint32_t n = h->spec->ring_size;
    stria__rjob_t **a = stria_grow(co->rjobs, &co->cap_rjobs, co->n_rjobs + 1, sizeof(*a), 16);
    if (a == NULL)
        return NULL;
    co->rjobs = a;
    stria__rjob_t *rj = calloc(1, sizeof(*rj));
    if (rj == NULL)
        return NULL;
    rj->id = h->job_id;
    rj->replaces = h->replaces;
    rj->generation = h->generation;
    rj->n_ranks = n;
    rj->layout = *layout;
    rj->need = need;
    rj->spec_len = stria__v1__job_spec__get_packed_size(h->spec);
    rj->spec_pb = malloc(rj->spec_len + 1);
    rj->workers = calloc(n, sizeof(*rj->workers));
    rj->phase = calloc(n, sizeof(*rj->phase));
    rj->passes = calloc(n, sizeof(*rj->passes));
    if (rj->spec_pb == NULL || rj->workers == NULL || rj->phase == NULL || rj->passes == NULL) {
        stria__rjob_free(rj);
        return NULL;
    }
    stria__v1__job_spec__pack(h->spec, rj->spec_pb);
    rj->spec = stria__v1__job_spec__unpack(NULL, rj->spec_len, rj->spec_pb);
    if (rj->spec == NULL) {
        stria__rjob_free(rj);
        return NULL;
    }
    co->rjobs[co->n_rjobs++] = rj;
    return rj;
}

/* Whether a later description agrees with the first (spec, link and keys). */
static bool stria__rjob_agrees(const stria__rjob_t *rj, const Stria__V1__HeldJob *h,
                               const stria_job_secret_t *secret, const uint8_t *ring_key)
{
    size_t len = stria__v1__job_spec__get_packed_size(h->spec);
    uint8_t *pb = len == rj->spec_len ? malloc(len + 1) : NULL;
    bool same = pb != NULL;
    if (same) {
        stria__v1__job_spec__pack(h->spec, pb);
        same = memcmp(pb, rj->spec_pb, len) == 0;
    }
    free(pb);
    same = same && h->replaces == rj->replaces && h->generation == rj->generation;
    /* both compared whatever the first says (constant time) */
    bool keys = stria_auth_equal(secret->bytes, rj->secret.bytes, sizeof(rj->secret.bytes));
    keys = stria_auth_equal(ring_key, rj->ring_key, sizeof(rj->ring_key)) && keys;
    return same && keys;
}

/* The job of an entry, into the job table, as job `id` (the entry's, or
 * the job it replaces): every rank's worker, or co->missing for the ranks
 * nobody described (every rank with `none`). NULL when out of memory. */
static stria__cjob_t *stria__rjob_add(stria_coord_t *co, const stria__rjob_t *rj, uint64_t id,
                                      bool none)
{
    stria__cworker_t **ring = calloc(rj->n_ranks, sizeof(*ring));
    bool *fallback = calloc(rj->n_ranks, sizeof(*fallback));
    stria__cjob_t keys, *j = NULL;
    if (ring != NULL && fallback != NULL) {
        for (uint32_t r = 0; r < rj->n_ranks; r++)
            ring[r] = rj->workers[r] != NULL && !none ? rj->workers[r] : &co->missing;
        memset(&keys, 0, sizeof(keys));
        keys.id = id;
        keys.secret = rj->secret;
        memcpy(keys.ring_key, rj->ring_key, sizeof(keys.ring_key));
        j = stria__cjob_add(co, rj->spec, &rj->layout, ring, fallback, rj->n_ranks, rj->need, "",
                            &keys);
        stria_auth_wipe(&keys, sizeof(keys));
    }
    free(ring);
    free(fallback);
    if (j == NULL) {
        stria_log_error("job %llu: cannot rebuild it: out of memory", (unsigned long long)id);
    } else if (id == rj->id) {
        j->replaces = rj->replaces;
        j->generation = rj->generation;
    }
    return j;
}

/* A rebuilt replacement y: the job it replaces fails (if it came back
 * itself) or comes back failed, naming y, so its ranks follow to y. */
static void stria__rjob_relink(stria_coord_t *co, const stria__rjob_t *rj, stria__cjob_t *y)
{
    uint32_t at = 0;
    if (rj->replaces == 0)
        return;
    /* a replacement has its job's secret: a link to another job is refused */
    stria__rjob_t *xr = stria__rjob_find(co, rj->replaces, &at);
    stria__cjob_t *x = stria__cjob_find(co, rj->replaces);
    const stria_job_secret_t *xs = x != NULL ? &x->secret : xr != NULL ? &xr->secret : NULL;
    if (xs != NULL && !stria_auth_equal(xs->bytes, rj->secret.bytes, sizeof(xs->bytes))) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_log_warn("job %llu: not linked to job %llu, which it says it replaces: their "
                       "secrets differ",
                       (unsigned long long)y->id, (unsigned long long)rj->replaces);
        return;
    }
    /* ranks of it some workers still described: the replacement says it failed */
    if (xr != NULL)
        stria__rjob_remove(co, at);
    if (x == NULL && (x = stria__rjob_add(co, rj, rj->replaces, true)) == NULL)
        return;
    if (stria__cjob_finish(co, x, S_FAILED,
                           "a worker was lost; replaced by job %llu (this record was rebuilt from "
                           "the replacement's after a coordinator restart)",
                           (unsigned long long)y->id))
        stria__cjob_retryable(x, NULL);
    x->replaced_by = y->id;
    x->replace_until = -1;
    x->generation = rj->generation - 1;
    stria_log_info("job %llu: linked to its replacement, job %llu, again",
                   (unsigned long long)x->id, (unsigned long long)y->id);
}

/* Every rank described: the job is back, in the state of its slowest rank. */
static void stria__rjob_complete(stria_coord_t *co, const stria__rjob_t *rj)
{
    stria__cjob_t *j = stria__rjob_add(co, rj, rj->id, false);
    if (j == NULL)
        return;
    Stria__V1__JobState state = S_DONE;
    for (uint32_t r = 0; r < rj->n_ranks; r++) {
        stria__crank_t *cr = &j->ranks[r];
        Stria__V1__JobState ph = rj->phase[r];
        if (ph < state)
            state = ph;
        cr->loaded = ph > S_LOADING;
        cr->fwd_done = ph >= S_FORWARD_DONE;
        cr->bwd_done = ph == S_DONE;
        cr->arrived = rj->passes[r]; /* 1 + the last pass it started */
    }
    stria__cjob_adopt(co, j, state);
    stria__rjob_relink(co, rj, j);
    co->jobs_recovered++;
    stria_log_info("job %llu rebuilt from its %u workers' reports (%s, %.1f s after start)",
                   (unsigned long long)j->id, j->n_ranks, stria__state_name(state),
                   stria_time_now() - co->started_at);
}

bool stria__recover_held(stria_coord_t *co, stria_rpc_call_t *call, stria__cworker_t *w,
                         const Stria__V1__HeldJob *h, bool *describe)
{
    stria__cjob_t *known = stria__cjob_find(co, h->job_id);
    stria_job_secret_t secret;
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES];
    stria_layout_t layout;
    uint64_t need = 0;
    const char *why = NULL;
    char msg[400];

    if (known != NULL) /* the heartbeat's status of the job says the rest */
        return !stria__terminal(known->state) && stria__cjob_rank_of(co, known, w) == (int)h->rank;
    if (!stria__recover_active(co) || h->phase >= S_FAILED) /* a failed rank: reported as such */
        return false;
    if (stria__held_check(co, h, &layout, &need) != STRIA_OK) {
        snprintf(msg, sizeof(msg), "%s", stria_error_msg());
        why = msg;
    } else if (stria_auth_open(stria_rpc_call_session(call), "held job secret", h->job_id,
                               h->job_secret.data, h->job_secret.len, secret.bytes) != STRIA_OK ||
               stria_auth_open(stria_rpc_call_session(call), "held ring key", h->job_id,
                               h->ring_key.data, h->ring_key.len, ring_key) != STRIA_OK) {
        /* sealed for another connection of the worker: ask again */
        stria_log_warn("worker %llu (%s): the keys of job %llu do not open on this connection; "
                       "asking for them again",
                       (unsigned long long)w->id, w->rpc_address, (unsigned long long)h->job_id);
        *describe = true;
        return true;
    }
    stria__rjob_t *rj = why == NULL ? stria__rjob_find(co, h->job_id, NULL) : NULL;
    if (why == NULL && rj != NULL) {
        if (rj->n_ranks != h->spec->ring_size || !stria__rjob_agrees(rj, h, &secret, ring_key))
            why = "its spec or keys differ from another worker's description of the job";
        else if (rj->workers[h->rank] != NULL && rj->workers[h->rank] != w)
            why = "another worker described the same rank";
        for (uint32_t r = 0; why == NULL && r < rj->n_ranks; r++)
            if (r != h->rank && rj->workers[r] == w)
                why = "the worker described another rank of the job too";
    } else if (why == NULL) {
        rj = stria__rjob_new(co, h, &layout, need);
        if (rj == NULL) {
            why = "out of memory";
        } else {
            rj->secret = secret;
            memcpy(rj->ring_key, ring_key, sizeof(ring_key));
        }
    }
    stria_auth_wipe(&secret, sizeof(secret));
    stria_auth_wipe(ring_key, sizeof(ring_key));
    if (why != NULL) {
        stria__cmet_count_error(co, STRIA__E_BAD_REQUEST);
        stria_log_warn("worker %llu (%s): description of job %llu rank %u refused (the worker "
                       "drops it): %s",
                       (unsigned long long)w->id, w->rpc_address, (unsigned long long)h->job_id,
                       h->rank, why);
        return false;
    }
    if (rj->workers[h->rank] == NULL)
        rj->found++;
    rj->workers[h->rank] = w;
    rj->phase[h->rank] = h->phase;
    rj->passes[h->rank] = h->passes;
    if (rj->found == rj->n_ranks) {
        uint32_t at = 0;
        stria__rjob_complete(co, rj);
        stria__rjob_find(co, rj->id, &at);
        stria__rjob_remove(co, at);
    }
    return true;
}

void stria__recover_worker_gone(stria_coord_t *co, const stria__cworker_t *w)
{
    for (uint32_t i = 0; i < co->n_rjobs; i++) {
        stria__rjob_t *rj = co->rjobs[i];
        for (uint32_t r = 0; r < rj->n_ranks; r++) {
            if (rj->workers[r] == w) {
                rj->workers[r] = NULL;
                rj->found--;
            }
        }
    }
}

/* "rank 3" or "ranks 0, 2, ..." of the ranks nobody described. */
static void stria__missing_list(const stria__rjob_t *rj, char *out, size_t len)
{
    size_t used = 0;
    uint32_t n = 0;
    out[0] = '\0';
    for (uint32_t r = 0; r < rj->n_ranks; r++)
        if (rj->workers[r] == NULL)
            stria__cjob_rank_list_add(out, len, &used, &n, r);
}

bool stria__recover_tick(stria_coord_t *co, double now)
{
    if (co->recover_until <= 0 || now < co->recover_until)
        return false;
    co->recover_until = 0;
    for (uint32_t i = 0; i < co->n_workers; i++)
        co->workers[i]->awaiting_jobs = false;
    for (uint32_t i = 0; i < co->n_rjobs; i++) {
        stria__rjob_t *rj = co->rjobs[i];
        char missing[200];
        stria__missing_list(rj, missing, sizeof(missing));
        stria__cjob_t *j = stria__rjob_add(co, rj, rj->id, false);
        if (j == NULL)
            continue;
        if (stria__cjob_finish(co, j, S_FAILED,
                               "the coordinator restarted and no worker reported rank(s) %s of "
                               "the job within its recovery window of %g s (their workers died, "
                               "restarted or lost the job); %u of %u ranks were found",
                               missing, co->recovery_window_s, rj->found, rj->n_ranks))
            stria__cjob_retryable(j, NULL);
        co->jobs_unrecovered++;
    }
    for (uint32_t i = 0; i < co->n_rjobs; i++)
        stria__rjob_free(co->rjobs[i]);
    stria_log_info("recovery window over: %llu job(s) rebuilt, %u failed for missing ranks",
                   (unsigned long long)co->jobs_recovered, co->n_rjobs);
    co->n_rjobs = 0;
    return true;
}

void stria__recover_free(stria_coord_t *co)
{
    for (uint32_t i = 0; i < co->n_rjobs; i++)
        stria__rjob_free(co->rjobs[i]);
    free(co->rjobs);
    co->rjobs = NULL;
    co->n_rjobs = co->cap_rjobs = 0;
}
