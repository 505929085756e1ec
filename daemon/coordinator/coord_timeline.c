/* The step times of a job's passes (ReportJob.timeline) and of a session's
 * sampled calls (WorkerJobStatus.timeline in heartbeats; pass is the call's
 * number), kept with the job for `striactl job|session ID --timeline`: per
 * direction the latest pass, one packed
 * PassTimeline per rank, checked on arrival (a malformed one is dropped with
 * a warning; the report's event still counts); all jobs together hold at
 * most STRIA__TIMELINE_BUDGET bytes, the oldest jobs' timelines going first.
 * Everything runs on the RPC loop thread. */
#include "coord_int.h"

#include <stdlib.h>
#include <string.h>

/* What a rank's timeline may hold (the worker's share is at most 64 KiB). */
#define STRIA__TL_MAX_BYTES   ((size_t)96 << 10)
#define STRIA__TL_MAX_SPANS   32 /* values per span list of one entry */
#define STRIA__TL_MAX_ENTRIES 65536

static void stria__tl_clear(stria_coord_t *co, stria__cjob_t *j, int d)
{
    for (uint32_t r = 0; j->tl[d].buf != NULL && r < j->n_ranks; r++) {
        co->timeline_bytes -= j->tl[d].len[r];
        free(j->tl[d].buf[r]);
    }
    free(j->tl[d].buf);
    free(j->tl[d].len);
    j->tl[d].buf = NULL;
    j->tl[d].len = NULL;
}

void stria__timeline_drop(stria_coord_t *co, stria__cjob_t *j)
{
    stria__tl_clear(co, j, 0);
    stria__tl_clear(co, j, 1);
}

static bool stria__tl_spans(size_t n, const uint64_t *v, uint64_t lo, uint64_t hi)
{
    if (n % 2 != 0 || n > STRIA__TL_MAX_SPANS)
        return false;
    for (size_t i = 0; i < n; i += 2)
        if (v[i] > v[i + 1] || v[i] < lo || v[i + 1] > hi)
            return false;
    return true;
}

/* Why the timeline of a report is malformed, or NULL. */
static const char *stria__tl_check(const stria__cjob_t *j, uint32_t rank,
                                   const Stria__V1__PassTimeline *t)
{
    uint32_t next = 0;
    if (t->rank != rank)
        return "its rank is not the reporting rank";
    if (t->steps < 1 || t->steps > j->n_ranks)
        return "its step count is outside 1..ring size";
    if (t->n_entries < 1 || t->n_entries > STRIA__TL_MAX_ENTRIES || t->n_entries > t->steps)
        return "it has no entries or more entries than steps";
    if (stria__v1__pass_timeline__get_packed_size(t) > STRIA__TL_MAX_BYTES)
        return "it is larger than 96 KiB";
    for (size_t i = 0; i < t->n_entries; i++) {
        const Stria__V1__StepTimes *e = t->entries[i];
        if (e->first_step != next || e->steps < 1 || e->steps > t->steps - next)
            return "its entries do not cover the steps in order";
        next += e->steps;
        if (e->begin_us > e->end_us || e->computed > e->steps)
            return "an entry ends before it begins or computes more steps than it has";
        bool spans = e->n_compute_spans + e->n_wait_spans + e->n_send_spans > 0;
        if (spans && (e->steps != 1 || t->summarised))
            return "a summarised entry carries spans";
        if (!stria__tl_spans(e->n_compute_spans, e->compute_spans, 0, UINT64_MAX) ||
            !stria__tl_spans(e->n_wait_spans, e->wait_spans, 0, UINT64_MAX) ||
            !stria__tl_spans(e->n_send_spans, e->send_spans, 0, UINT64_MAX))
            return "a span list is odd, too long or has a span ending before it begins";
    }
    if (next != t->steps)
        return "its entries do not cover every step";
    return NULL;
}

/* Frees the timelines of the oldest jobs (never `keep`'s) until the budget
 * holds. */
static void stria__tl_evict(stria_coord_t *co, const stria__cjob_t *keep)
{
    for (uint32_t i = 0; i < co->n_jobs && co->timeline_bytes > STRIA__TIMELINE_BUDGET; i++)
        if (co->jobs[i] != keep)
            stria__timeline_drop(co, co->jobs[i]);
}

void stria__timeline_store(stria_coord_t *co, stria__cjob_t *j, uint32_t rank,
                           const Stria__V1__PassTimeline *t)
{
    const char *why = stria__tl_check(j, rank, t);
    const int d = t->backward ? 1 : 0;
    if (why != NULL) {
        stria_log_warn("job %llu rank %u: ignoring its pass timeline: %s",
                       (unsigned long long)j->id, rank, why);
        return;
    }
    if (j->tl[d].buf == NULL || j->tl[d].pass != t->pass) { /* a newer pass: start over */
        if (j->tl[d].buf != NULL && t->pass < j->tl[d].pass)
            return; /* a late report of an older pass */
        stria__tl_clear(co, j, d);
        j->tl[d].buf = calloc(j->n_ranks, sizeof(*j->tl[d].buf));
        j->tl[d].len = calloc(j->n_ranks, sizeof(*j->tl[d].len));
        if (j->tl[d].buf == NULL || j->tl[d].len == NULL) {
            stria__tl_clear(co, j, d);
            return;
        }
        j->tl[d].pass = t->pass;
    }
    size_t len = stria__v1__pass_timeline__get_packed_size(t);
    uint8_t *buf = malloc(len > 0 ? len : 1);
    if (buf == NULL)
        return;
    stria__v1__pass_timeline__pack(t, buf);
    co->timeline_bytes -= j->tl[d].len[t->rank];
    free(j->tl[d].buf[t->rank]);
    j->tl[d].buf[t->rank] = buf;
    j->tl[d].len[t->rank] = len;
    co->timeline_bytes += len;
    stria__tl_evict(co, j);
}

void stria__timeline_release(Stria__V1__PassTimeline **held, size_t n_held)
{
    for (size_t i = 0; i < n_held; i++)
        stria__v1__pass_timeline__free_unpacked(held[i], NULL);
    free(held);
}

bool stria__timeline_fill(stria__scratch_t *b, const stria__cjob_t *j, Stria__V1__JobInfo *info,
                          Stria__V1__PassTimeline ***held, size_t *n_held)
{
    size_t n = 0;
    for (int d = 0; d < 2; d++)
        for (uint32_t r = 0; j->tl[d].buf != NULL && r < j->n_ranks; r++)
            n += j->tl[d].buf[r] != NULL;
    *held = NULL;
    *n_held = 0;
    if (n == 0)
        return true;
    Stria__V1__PassTimeline **list = stria__scratch_alloc(b, n * sizeof(*list));
    if (list == NULL || (*held = calloc(n, sizeof(**held))) == NULL)
        return false;
    for (int d = 0; d < 2; d++)
        for (uint32_t r = 0; j->tl[d].buf != NULL && r < j->n_ranks; r++) {
            if (j->tl[d].buf[r] == NULL)
                continue;
            Stria__V1__PassTimeline *t =
                stria__v1__pass_timeline__unpack(NULL, j->tl[d].len[r], j->tl[d].buf[r]);
            if (t == NULL)
                return false;
            (*held)[(*n_held)++] = list[info->n_timelines++] = t;
        }
    info->timelines = list;
    return true;
}
