/* A pass's step times as the PassTimeline the worker reports with the pass
 * (ReportJob): the ring engine's records (stria_ring_step_times_t) in
 * microseconds since this rank's pass start, one entry per step, or per
 * group of steps when the ring is large enough that per-step entries of
 * every rank would not fit a reply. */
#include "worker_int.h"

#include <stdlib.h>
#include <string.h>

/* About 6 MiB of a reply shared by the ring's ranks, 2..64 KiB each; an entry
 * with its spans takes about 120 bytes, a group about 48. */
#define STRIA__TL_SHARE   (6u << 20)
#define STRIA__TL_MIN     (2u << 10)
#define STRIA__TL_MAX     (64u << 10)
#define STRIA__TL_DETAIL  120u
#define STRIA__TL_SUMMARY 48u

static uint64_t us(double s)
{
    return s <= 0 ? 0 : (uint64_t)(s * 1e6 + 0.5);
}

/* The byte budget of one rank's timeline in a ring of n. */
static size_t tl_budget(int n)
{
    size_t b = STRIA__TL_SHARE / (size_t)(n > 0 ? n : 1);
    return b < STRIA__TL_MIN ? STRIA__TL_MIN : b > STRIA__TL_MAX ? STRIA__TL_MAX : b;
}

void stria__wtimeline_free(stria__wtimeline_t *tl)
{
    free(tl->entries);
    free(tl->ptrs);
    free(tl->spans);
    memset(tl, 0, sizeof(*tl));
}

/* One step's spans: (begin, end) pairs in microseconds. */
static void step_spans(const stria_ring_step_times_t *t, Stria__V1__StepTimes *e, uint64_t **cur)
{
    e->compute_spans = *cur;
    for (int i = 0; i < t->n_spans; i++)
        if (t->spans[i].kind == STRIA_RING_SPAN_COMPUTE) {
            e->compute_spans[e->n_compute_spans++] = us(t->spans[i].begin);
            e->compute_spans[e->n_compute_spans++] = us(t->spans[i].end);
        }
    *cur += e->n_compute_spans;
    e->wait_spans = *cur;
    for (int i = 0; i < t->n_spans; i++)
        if (t->spans[i].kind == STRIA_RING_SPAN_WAIT) {
            e->wait_spans[e->n_wait_spans++] = us(t->spans[i].begin);
            e->wait_spans[e->n_wait_spans++] = us(t->spans[i].end);
        }
    *cur += e->n_wait_spans;
    e->send_spans = *cur;
    if (t->send_begin >= 0 && t->send_end >= t->send_begin) {
        e->send_spans[e->n_send_spans++] = us(t->send_begin);
        e->send_spans[e->n_send_spans++] = us(t->send_end);
    }
    if (t->sum_send_begin >= 0 && t->sum_send_end >= t->sum_send_begin) {
        e->send_spans[e->n_send_spans++] = us(t->sum_send_begin);
        e->send_spans[e->n_send_spans++] = us(t->sum_send_end);
    }
    *cur += e->n_send_spans;
}

stria_status_t stria__wtimeline_build(int rank, int n_ranks, const stria_ring_pass_t *rp,
                                      uint32_t pass, bool backward, stria__wtimeline_t *tl)
{
    size_t n = 0;
    const stria_ring_step_stats_t *ss = stria_ring_pass_stats(rp, &n);
    const int steps = stria_ring_pass_steps(rp);
    memset(tl, 0, sizeof(*tl));
    stria__v1__pass_timeline__init(&tl->msg);
    if (ss == NULL || steps < 1 || (size_t)steps > n || ss[0].times.origin == 0.0)
        return STRIA_ERR_NOT_FOUND; /* nothing recorded (recording off, or no step ran) */
    const size_t budget = tl_budget(n_ranks);
    const bool detail = (size_t)steps * STRIA__TL_DETAIL <= budget;
    const size_t groups = detail ? (size_t)steps : budget / STRIA__TL_SUMMARY;
    const size_t per = ((size_t)steps + groups - 1) / groups;
    const size_t n_entries = ((size_t)steps + per - 1) / per;
    tl->entries = calloc(n_entries, sizeof(*tl->entries));
    tl->ptrs = calloc(n_entries, sizeof(*tl->ptrs));
    tl->spans =
        detail ? calloc((size_t)steps * (2 * STRIA_RING_STEP_SPANS + 4), sizeof(uint64_t)) : NULL;
    if (tl->entries == NULL || tl->ptrs == NULL || (detail && tl->spans == NULL)) {
        stria__wtimeline_free(tl);
        return STRIA_ERR_NO_MEMORY;
    }
    uint64_t *cur = tl->spans;
    for (size_t g = 0; g < n_entries; g++) {
        Stria__V1__StepTimes *e = &tl->entries[g];
        const int first = (int)(g * per),
                  last = (int)((g + 1) * per < (size_t)steps ? (g + 1) * per : (size_t)steps) - 1;
        double compute = 0, wait = 0;
        stria__v1__step_times__init(e);
        tl->ptrs[g] = e;
        e->first_step = (uint32_t)first;
        e->steps = (uint32_t)(last - first + 1);
        e->begin_us = us(ss[first].times.begin);
        e->end_us = us(ss[last].times.end);
        for (int s = first; s <= last; s++) {
            compute += ss[s].compute_wall_s;
            wait += ss[s].wait_s;
            e->computed += ss[s].computed;
        }
        e->compute_us = us(compute);
        e->wait_us = us(wait);
        if (detail)
            step_spans(&ss[first].times, e, &cur);
    }
    tl->msg.rank = (uint32_t)rank;
    tl->msg.pass = pass;
    tl->msg.backward = backward;
    tl->msg.steps = (uint32_t)steps;
    tl->msg.seconds_us = us(ss[steps - 1].times.end);
    tl->msg.summarised = !detail;
    tl->msg.n_entries = n_entries;
    tl->msg.entries = tl->ptrs;
    return STRIA_OK;
}
