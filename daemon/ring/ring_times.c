/* The step times of a pass (stria_ring_step_times_t): what the primitives of
 * ring_prims.c record at compute, waits, sends and step starts. Times are
 * absolute (stria_time_now()) while the call runs and relative to its start
 * after stria__times_finish(). */
#include "ring_int.h"

#include <string.h>

/* Spans of one kind closer than this are one span: the host work between
 * them (posting, a hook) is below what a timeline can show. */
#define STRIA__SPAN_JOIN_S 20e-6

void stria__times_span(const stria_ring_pass_t *p, stria_ring_step_stats_t *ss,
                       stria_ring_span_kind_t kind, double t0, double t1)
{
    stria_ring_step_times_t *t = &ss->times;
    stria_ring_span_t *last = t->n_spans > 0 ? &t->spans[t->n_spans - 1] : NULL;
    if (p->hooks.no_step_times)
        return;
    /* The last span goes on when this one is of its kind and close, or when
     * room runs short (the agreement's N - 1 waits). */
    if (last != NULL && last->kind == kind &&
        (t0 - last->end < STRIA__SPAN_JOIN_S || t->n_spans >= STRIA_RING_STEP_SPANS - 2)) {
        last->end = t1 > last->end ? t1 : last->end;
        return;
    }
    if (t->n_spans == STRIA_RING_STEP_SPANS) {
        t->merged++;
        return;
    }
    t->spans[t->n_spans++] = (stria_ring_span_t){t0, t1, kind};
}

void stria__times_send(stria_ring_pass_t *p, stria_link_req_t *req, stria_ring_step_stats_t *ss,
                       bool sum, double t)
{
    const size_t n = sizeof(p->sends) / sizeof(p->sends[0]);
    if (p->hooks.no_step_times)
        return;
    if (sum)
        ss->times.sum_send_begin = t;
    else
        ss->times.send_begin = t;
    if (req == NULL) { /* completed at once */
        if (sum)
            ss->times.sum_send_end = t;
        else
            ss->times.send_end = t;
        return;
    }
    for (size_t i = 0; i < n; i++)
        if (p->sends[i].req == NULL) {
            p->sends[i].req = req;
            p->sends[i].ss = ss;
            p->sends[i].sum = sum;
            return;
        }
}

void stria__times_waited(stria_ring_pass_t *p, const stria_link_req_t *req, double t)
{
    const size_t n = sizeof(p->sends) / sizeof(p->sends[0]);
    for (size_t i = 0; i < n; i++)
        if (p->sends[i].req == req && req != NULL) {
            stria_ring_step_times_t *tt = &p->sends[i].ss->times;
            if (p->sends[i].sum)
                tt->sum_send_end = t;
            else
                tt->send_end = t;
            p->sends[i].req = NULL;
            return;
        }
}

void stria__times_step(stria_ring_pass_t *p, int step, double t)
{
    if (p->hooks.no_step_times)
        return;
    p->stats[step].times.begin = t;
    if (step > 0)
        p->stats[step - 1].times.end = t;
}

/* An absolute time as relative to the pass's start; 0 (never recorded) as
 * -1. */
static double stria__rel(double t, double t0)
{
    return t == 0.0 ? -1.0 : t - t0;
}

void stria__times_finish(stria_ring_pass_t *p)
{
    const double now = stria_time_now(), t0 = p->t_start;
    memset(p->sends, 0, sizeof(p->sends));
    if (p->hooks.no_step_times || p->stats[0].times.origin != 0.0)
        return; /* off, or this call failed before its records were reset */
    for (int s = 0; s < p->steps_run; s++) {
        stria_ring_step_times_t *t = &p->stats[s].times;
        if (s == p->steps_run - 1 && t->begin != 0.0)
            t->end = now;
        t->origin = t0;
        t->begin = s == 0 ? 0.0 : stria__rel(t->begin, t0);
        t->end = stria__rel(t->end, t0);
        t->send_begin = stria__rel(t->send_begin, t0);
        t->send_end = stria__rel(t->send_end, t0);
        t->sum_send_begin = stria__rel(t->sum_send_begin, t0);
        t->sum_send_end = stria__rel(t->sum_send_end, t0);
        for (int i = 0; i < t->n_spans; i++) {
            t->spans[i].begin -= t0;
            t->spans[i].end -= t0;
        }
    }
}
