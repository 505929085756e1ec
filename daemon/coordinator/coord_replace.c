/* Sharded jobs that lose a worker get a replacement ring.
 *
 * The ring size of a sharded job is the trainer's world size and must stay,
 * so a lost worker cannot simply be left out as a whole-sequence retry does.
 * Instead the coordinator makes a new job of the same spec, secret and
 * ranks, the lost worker's rank on a spare worker (coord_place.c), and the
 * failed job names it (JobInfo.replaced_by). The exports of the old job
 * prove the new one (same secret); every rank's forward_shard follows the
 * link and sends its stripe again inside the same call (client_session.c).
 * The new job has an id and ring key of its own, so nothing of the old
 * ring (its links, its buffers on the survivors) can mix with it.
 *
 * When: a worker's loss is known at its death verdict (3 missed heartbeats),
 * its leave or its restart; its unfinished jobs fail then and are replaced
 * at once. But a pass usually fails before that: the lost worker's ring
 * peers see their links break within milliseconds and report the job
 * failed. Such a failure waits (replace_until, a few heartbeat periods) for
 * a verdict on one of its members; the clients see replacement_pending and
 * ask again. A job whose wait ends without one (a link broke, every worker
 * alive) stays failed, retryable, as before.
 *
 * Queue place: a waiting job keeps its members' memory reserved, and its
 * replacement enters the job table right after it, so the scheduler, which
 * starts queued jobs in table order, gives the replacement the place of the
 * job it replaces: no job queued later starts in the room it needs.
 *
 * Not replaced: whole-sequence jobs (the client library retries them), a
 * job a rank already released, one replaced STRIA__MAX_GENERATIONS times,
 * and one without a spare (its failure says why). */
#include "coord_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Heartbeat periods a failed sharded job waits for a verdict: the 3 of a
 * death verdict, and slack for the tick and a late heartbeat. */
#define STRIA__REPLACE_WAIT_PERIODS 6

static bool stria__replaceable(const stria__cjob_t *j)
{
    if (!j->spec.sharded || j->state != S_FAILED || !j->failure_retryable || j->replaced_by != 0 ||
        j->replace_until < 0 || j->generation >= STRIA__MAX_GENERATIONS)
        return false;
    /* a job whose passes were both done has nothing left to run */
    if (j->failed_in == S_DONE)
        return false;
    for (uint32_t r = 0; r < j->n_ranks; r++)
        if (j->ranks[r].released)
            return false;
    return true;
}

void stria__replace_wait(stria_coord_t *co, stria__cjob_t *j)
{
    if (!stria__replaceable(j))
        return;
    j->replace_until = stria_time_now() + STRIA__REPLACE_WAIT_PERIODS * co->heartbeat_period_s;
    if (!j->reserved && j->failed_in != S_PENDING)
        stria__cjob_reserve(j);
}

bool stria__replace_pending(const stria__cjob_t *j)
{
    return j->replace_until > 0 && stria__replaceable(j);
}

bool stria__replace_tick(stria_coord_t *co, double now)
{
    bool freed = false;
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (j->replace_until > 0 && now > j->replace_until) {
            bool waited = stria__replaceable(j);
            j->replace_until = -1;
            if (waited)
                stria_log_info("job %llu: no worker of it was lost within %d heartbeat periods "
                               "of its failure: not replaced",
                               (unsigned long long)j->id, STRIA__REPLACE_WAIT_PERIODS);
        }
        /* over, or released by a rank meanwhile: its room goes to the queue */
        if (j->reserved && stria__terminal(j->state) && !stria__replace_pending(j)) {
            stria__cjob_unreserve(j);
            freed = true;
        }
    }
    return freed;
}

/* Appends to a job's failure (truncated if it must be). */
static void stria__failure_add(stria__cjob_t *j, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void stria__failure_add(stria__cjob_t *j, const char *fmt, ...)
{
    size_t at = strlen(j->failure);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->failure + at, sizeof(j->failure) - at, fmt, ap);
    va_end(ap);
}

/* The new job of j, ranks on ring[0 .. n) (fallback[r]: off its placed
 * host); NULL when out of memory. */
static stria__cjob_t *stria__replacement_add(stria_coord_t *co, stria__cjob_t *j,
                                             stria__cworker_t **ring, const bool *fallback)
{
    stria__scratch_t b = {0};
    stria_layout_t layout;
    stria__cjob_t keys, *y = NULL;
    Stria__V1__JobSpec spec = j->spec; /* its placement is the ranks' */
    bool placed = stria__cjob_placement(&b, j, &spec);
    memset(&keys, 0, sizeof(keys));
    keys.secret = j->secret; /* the old job's exports prove the new one */
    if (placed &&
        stria_layout_init((stria_layout_kind_t)j->spec.layout, (int)j->n_ranks,
                          (int64_t)j->spec.seq_len, &layout) == STRIA_OK &&
        stria__recover_new_keys(co, &keys, true) == STRIA_OK)
        y = stria__cjob_add(co, &spec, &layout, ring, fallback, j->n_ranks, j->mem_per_rank,
                            j->client, &keys);
    stria_auth_wipe(&keys, sizeof(keys));
    stria__scratch_free(&b);
    if (y == NULL)
        return NULL;
    y->spec.scale = j->spec.scale;
    y->replaces = j->id;
    y->generation = j->generation + 1;
    y->times.submitted_ms = j->times.submitted_ms;
    /* j's place in the queue: y, appended last, moves to just after it */
    for (uint32_t i = 0; i + 1 < co->n_jobs; i++) {
        if (co->jobs[i] == j) {
            memmove(&co->jobs[i + 2], &co->jobs[i + 1], (co->n_jobs - i - 2) * sizeof(*co->jobs));
            co->jobs[i + 1] = y;
            break;
        }
    }
    return y;
}

/* Replaces failed job j, whose dead members (w among them) each get a
 * spare; false when it could not be (said in its failure). */
static bool stria__replace(stria_coord_t *co, stria__cjob_t *j, const stria__cworker_t *w)
{
    stria__cworker_t **ring = calloc(j->n_ranks, sizeof(*ring));
    bool *fallback = calloc(j->n_ranks, sizeof(*fallback));
    stria__cworker_t *spares[8];
    uint32_t lost[8], n_lost = 0;
    char why[300] = "";
    bool ok = ring != NULL && fallback != NULL;

    for (uint32_t r = 0; ok && r < j->n_ranks; r++) {
        stria__crank_t *cr = &j->ranks[r];
        ring[r] = cr->worker;
        fallback[r] = cr->fallback;
        /* a draining member would fail the new job while it is queued */
        if (!cr->worker->dead && !cr->worker->draining && cr->worker != w)
            continue;
        if (n_lost == 8) {
            snprintf(why, sizeof(why), "more than 8 of its workers were lost");
            ok = false;
            break;
        }
        ring[r] = stria__place_spare(co, j, r, spares, n_lost, &fallback[r], why, sizeof(why));
        if (ring[r] == NULL) {
            ok = false;
            break;
        }
        spares[n_lost] = ring[r];
        lost[n_lost++] = r;
    }
    stria__cjob_t *y = ok ? stria__replacement_add(co, j, ring, fallback) : NULL;
    if (ok && y == NULL)
        snprintf(why, sizeof(why), "out of memory");
    free(ring);
    free(fallback);
    j->replace_until = -1;    /* tried: whatever comes, once */
    stria__cjob_unreserve(j); /* held while it waited: y's now, or the queue's */
    if (j->blamed_worker == 0)
        j->blamed_worker = w->id;
    if (y == NULL) {
        stria__failure_add(j, "; not replaced: %s", why);
        stria_log_warn("job %llu: not replaced: %s", (unsigned long long)j->id, why);
        return false;
    }
    j->replaced_by = y->id;
    stria__failure_add(j, "; replaced by job %llu:", (unsigned long long)y->id);
    for (uint32_t i = 0; i < n_lost; i++) {
        const stria__cworker_t *s = y->ranks[lost[i]].worker;
        stria__failure_add(j, "%s rank %u on worker %llu at %s", i ? "," : "", lost[i],
                           (unsigned long long)s->id, s->rpc_address);
        stria_log_info("job %llu: replaced by job %llu (generation %u), rank %u on worker %llu "
                       "(%s, %s)%s",
                       (unsigned long long)j->id, (unsigned long long)y->id, y->generation, lost[i],
                       (unsigned long long)s->id, s->host, s->rpc_address,
                       y->ranks[lost[i]].fallback ? ", off its placed host" : "");
    }
    return true;
}

bool stria__replace_lost(stria_coord_t *co, stria__cworker_t *w)
{
    bool any = false;
    /* A replacement joins the table right after its job and has no rank on
     * w (nor is it failed): the loop passes over it. */
    for (uint32_t i = 0; i < co->n_jobs; i++) {
        stria__cjob_t *j = co->jobs[i];
        if (!stria__replaceable(j) || !stria__cjob_has_worker(j, w))
            continue;
        /* failed just now for w (blamed on it; every path that does so
         * comes here), or waiting for a verdict */
        if (j->blamed_worker != w->id && j->replace_until <= 0)
            continue;
        any = stria__replace(co, j, w) || any;
    }
    return any;
}
