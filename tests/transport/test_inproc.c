/* The in-process ring link: matching, copies, deadlines, cancel, abort and
 * injected faults. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stria_transport.h"

typedef struct {
    stria_inproc_hub_t *hub;
    stria_link_t *links[16];
    int n;
} ring_t;

static void ring_open(ring_t *r, int n)
{
    r->n = n;
    cr_assert_eq(stria_inproc_hub_create(n, &r->hub), STRIA_OK, "%s", stria_error_msg());
    for (int i = 0; i < n; i++)
        cr_assert_eq(stria_inproc_link_create(r->hub, i, &r->links[i]), STRIA_OK, "%s",
                     stria_error_msg());
}

static void ring_close(ring_t *r)
{
    /* links and the hub may go in any order */
    stria_inproc_hub_release(r->hub);
    for (int i = 0; i < r->n; i++)
        stria_link_destroy(r->links[i]);
}

Test(inproc, neighbours_and_matching_by_tag_in_any_order)
{
    ring_t r;
    ring_open(&r, 3);
    stria_link_t *a = r.links[0], *b = r.links[1];
    cr_expect_eq(stria_link_next(a), 1);
    cr_expect_eq(stria_link_prev(a), 2);
    cr_expect_str_eq(a->ops->name, "inproc");

    int x1 = 11, x2 = 22, y1 = 0, y2 = 0;
    stria_link_req_t *s1, *s2, *q1, *q2;
    /* receive of tag 2 posted first, sends of tags 1 and 2, then receive 1 */
    cr_assert_eq(stria_link_irecv(b, 2, &y2, sizeof(y2), &q2), STRIA_OK);
    cr_assert_eq(stria_link_isend(a, 1, &x1, sizeof(x1), &s1), STRIA_OK);
    cr_assert_eq(stria_link_isend(a, 2, &x2, sizeof(x2), &s2), STRIA_OK);
    cr_assert_eq(y2, 22, "the send met the posted receive at once");
    cr_assert_eq(stria_link_wait(a, s2, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_irecv(b, 1, &y1, sizeof(y1), &q1), STRIA_OK);
    cr_assert_eq(stria_link_wait(b, q1, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_wait(b, q2, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_wait(a, s1, 1.0), STRIA_OK);
    cr_expect_eq(y1, 11);
    ring_close(&r);
}

Test(inproc, ring_of_one_sends_to_itself)
{
    ring_t r;
    ring_open(&r, 1);
    char msg[] = "self", got[5] = {0};
    stria_link_req_t *s, *q;
    cr_assert_eq(stria_link_isend(r.links[0], 9, msg, 5, &s), STRIA_OK);
    cr_assert_eq(stria_link_irecv(r.links[0], 9, got, 5, &q), STRIA_OK);
    cr_assert_eq(stria_link_wait(r.links[0], q, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_wait(r.links[0], s, 1.0), STRIA_OK);
    cr_expect_str_eq(got, "self");
    ring_close(&r);
}

Test(inproc, length_mismatch_fails_both_sides)
{
    ring_t r;
    ring_open(&r, 2);
    char buf[16] = {0};
    stria_link_req_t *s, *q;
    cr_assert_eq(stria_link_irecv(r.links[1], 5, buf, 8, &q), STRIA_OK);
    cr_assert_eq(stria_link_isend(r.links[0], 5, buf, 16, &s), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[1], q, 1.0), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "16 bytes") && strstr(stria_error_msg(), "expects 8"), "%s",
              stria_error_msg());
    cr_expect_eq(stria_link_wait(r.links[0], s, 1.0), STRIA_ERR_PROTOCOL);
    ring_close(&r);
    /* Shorter than the receive too: a receive that completed with its tail
     * stale would hand the engine half a block of the previous step. */
    ring_open(&r, 2);
    cr_assert_eq(stria_link_irecv(r.links[1], 6, buf, 16, &q), STRIA_OK);
    cr_assert_eq(stria_link_isend(r.links[0], 6, buf, 8, &s), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[1], q, 1.0), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "8 bytes") && strstr(stria_error_msg(), "expects 16"), "%s",
              stria_error_msg());
    cr_expect_eq(stria_link_wait(r.links[0], s, 1.0), STRIA_ERR_PROTOCOL);
    ring_close(&r);
}

Test(inproc, deadlines_name_the_peer)
{
    ring_t r;
    ring_open(&r, 3);
    int v = 0;
    stria_link_req_t *q, *s;
    double t0 = stria_time_now();
    cr_assert_eq(stria_link_irecv(r.links[2], 3, &v, sizeof(v), &q), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[2], q, 0.2), STRIA_ERR_TIMEOUT);
    double dt = stria_time_now() - t0;
    cr_expect(dt >= 0.19 && dt < 2.0, "waited %.3f s", dt);
    cr_expect(strstr(stria_error_msg(), "from rank 1"), "%s", stria_error_msg());
    /* a send nobody receives */
    cr_assert_eq(stria_link_isend(r.links[2], 4, &v, sizeof(v), &s), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[2], s, 0.05), STRIA_ERR_TIMEOUT);
    cr_expect(strstr(stria_error_msg(), "rank 0 did not take"), "%s", stria_error_msg());
    ring_close(&r);
}

Test(inproc, cancelled_receive_never_matches)
{
    ring_t r;
    ring_open(&r, 2);
    int a = 1, b = 0, c = 0;
    stria_link_req_t *q1, *q2, *s;
    cr_assert_eq(stria_link_irecv(r.links[1], 7, &b, sizeof(b), &q1), STRIA_OK);
    stria_link_cancel(r.links[1], q1);
    cr_assert_eq(stria_link_irecv(r.links[1], 7, &c, sizeof(c), &q2), STRIA_OK);
    cr_assert_eq(stria_link_isend(r.links[0], 7, &a, sizeof(a), &s), STRIA_OK);
    cr_assert_eq(stria_link_wait(r.links[1], q2, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_wait(r.links[0], s, 1.0), STRIA_OK);
    cr_expect_eq(b, 0);
    cr_expect_eq(c, 1);
    /* cancelling a send that is still queued */
    cr_assert_eq(stria_link_isend(r.links[0], 8, &a, sizeof(a), &s), STRIA_OK);
    stria_link_cancel(r.links[0], s);
    cr_assert_eq(stria_link_irecv(r.links[1], 8, &c, sizeof(c), &q1), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[1], q1, 0.05), STRIA_ERR_TIMEOUT);
    stria_link_cancel(r.links[0], NULL);
    ring_close(&r);
}

typedef struct {
    stria_link_t *link;
    stria_status_t st;
    char msg[512];
    double waited;
} waiter_t;

static void *wait_forever(void *arg)
{
    waiter_t *w = arg;
    int v;
    stria_link_req_t *q;
    double t0 = stria_time_now();
    w->st = stria_link_irecv(w->link, 1, &v, sizeof(v), &q);
    if (w->st == STRIA_OK)
        w->st = stria_link_wait(w->link, q, -1.0);
    w->waited = stria_time_now() - t0;
    snprintf(w->msg, sizeof(w->msg), "%s", stria_error_msg());
    return NULL;
}

Test(inproc, abort_wakes_every_waiter_and_reset_clears_it)
{
    ring_t r;
    ring_open(&r, 4);
    waiter_t w[3];
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        w[i] = (waiter_t){.link = r.links[i]};
        cr_assert_eq(pthread_create(&th[i], NULL, wait_forever, &w[i]), 0);
    }
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    /* a deadline is a link's failure: the others report a peer's */
    stria_link_abort(r.links[3], STRIA_ERR_TIMEOUT, "rank 3 gave up");
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(w[i].st, STRIA_ERR_PEER, "%s", stria_status_name(w[i].st));
        cr_expect(strstr(w[i].msg, "rank 3 aborted the pass (STRIA_ERR_TIMEOUT): rank 3 gave up"),
                  "%s", w[i].msg);
    }
    cr_expect_eq(stria_inproc_hub_aborted_by(r.hub), 3);
    /* later operations fail at once; a second abort does not replace the first */
    stria_link_abort(r.links[0], STRIA_ERR_IO, "other");
    stria_link_req_t *q;
    int v = 0;
    cr_expect_eq(stria_link_isend(r.links[1], 1, &v, sizeof(v), &q), STRIA_ERR_PEER);
    cr_expect(strstr(stria_error_msg(), "rank 3 aborted"), "%s", stria_error_msg());
    /* the aborting rank's own operations give its reason */
    cr_expect_eq(stria_link_isend(r.links[3], 1, &v, sizeof(v), &q), STRIA_ERR_TIMEOUT);
    stria_inproc_hub_reset(r.hub);
    stria_link_req_t *s;
    cr_assert_eq(stria_link_isend(r.links[1], 1, &v, sizeof(v), &s), STRIA_OK);
    cr_assert_eq(stria_link_irecv(r.links[2], 1, &v, sizeof(v), &q), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[2], q, 1.0), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[1], s, 1.0), STRIA_OK);
    ring_close(&r);
}

/* Failures by kind: an abort for a rank's own reason gives every other
 * rank that reason's status, the message naming the rank; a link's
 * failure (or an abort for one) gives STRIA_ERR_PEER. */
Test(inproc, an_abort_gives_the_others_its_kind)
{
    static const stria_status_t reasons[] = {
        STRIA_ERR_INVALID_ARG, STRIA_ERR_CANCELLED, STRIA_ERR_NO_MEMORY, STRIA_ERR_INTERNAL,
        STRIA_ERR_TRANSPORT,   STRIA_ERR_PROTOCOL,  STRIA_ERR_CLOSED,    STRIA_OK};
    for (size_t k = 0; k < sizeof(reasons) / sizeof(reasons[0]); k++) {
        ring_t r;
        ring_open(&r, 3);
        stria_status_t own = reasons[k] == STRIA_OK ? STRIA_ERR_CANCELLED : reasons[k];
        stria_status_t kind = stria_link_abort_status(reasons[k]);
        bool link_kind =
            own == STRIA_ERR_TRANSPORT || own == STRIA_ERR_PROTOCOL || own == STRIA_ERR_CLOSED;
        cr_expect_eq(kind, link_kind ? STRIA_ERR_PEER : own, "%s", stria_status_name(own));
        waiter_t w = {.link = r.links[0]};
        pthread_t th;
        cr_assert_eq(pthread_create(&th, NULL, wait_forever, &w), 0);
        stria_link_abort(r.links[2], reasons[k], "bad input");
        pthread_join(th, NULL);
        cr_expect_eq(w.st, kind, "%s: %s", stria_status_name(own), stria_status_name(w.st));
        cr_expect(strstr(w.msg, "rank 2 aborted the pass") && strstr(w.msg, "bad input"), "%s",
                  w.msg);
        stria_link_req_t *q;
        int v = 0;
        cr_expect_eq(stria_link_irecv(r.links[1], 1, &v, sizeof(v), &q), kind);
        cr_expect_eq(stria_link_isend(r.links[2], 1, &v, sizeof(v), &q), own);
        ring_close(&r);
    }
}

Test(inproc, injected_failure_and_stall)
{
    ring_t r;
    ring_open(&r, 3);
    int v = 5, got = 0;
    stria_link_req_t *s, *q;

    /* rank 1 dies at its third operation */
    cr_assert_eq(stria_inproc_fault_inject(r.hub, 1, STRIA_INPROC_FAULT_FAIL, 2), STRIA_OK);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(stria_link_isend(r.links[1], 10 + (uint64_t)i, &v, sizeof(v), &s), STRIA_OK);
        stria_link_cancel(r.links[1], s);
    }
    cr_expect_eq(stria_link_isend(r.links[1], 12, &v, sizeof(v), &s), STRIA_ERR_TRANSPORT);
    cr_expect(strstr(stria_error_msg(), "injected"), "%s", stria_error_msg());
    cr_expect_eq(stria_link_irecv(r.links[2], 12, &got, sizeof(got), &q), STRIA_ERR_PEER);
    cr_expect(strstr(stria_error_msg(), "rank 1 failed"), "%s", stria_error_msg());

    /* rank 0 hangs after one operation: its second send never arrives */
    stria_inproc_hub_reset(r.hub);
    cr_assert_eq(stria_inproc_fault_inject(r.hub, 0, STRIA_INPROC_FAULT_STALL, 1), STRIA_OK);
    cr_assert_eq(stria_link_isend(r.links[0], 20, &v, sizeof(v), &s), STRIA_OK);
    cr_assert_eq(stria_link_irecv(r.links[1], 20, &got, sizeof(got), &q), STRIA_OK);
    cr_assert_eq(stria_link_wait(r.links[1], q, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_wait(r.links[0], s, 1.0), STRIA_OK);
    cr_assert_eq(stria_link_isend(r.links[0], 21, &v, sizeof(v), &s), STRIA_OK);
    cr_assert_eq(stria_link_irecv(r.links[1], 21, &got, sizeof(got), &q), STRIA_OK);
    cr_expect_eq(stria_link_wait(r.links[1], q, 0.1), STRIA_ERR_TIMEOUT);
    cr_expect_eq(stria_link_wait(r.links[0], s, 0.05), STRIA_ERR_TIMEOUT);
    ring_close(&r);
}

Test(inproc, bad_arguments)
{
    stria_inproc_hub_t *hub;
    stria_link_t *l, *l2;
    cr_expect_eq(stria_inproc_hub_create(0, &hub), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "ring size 0"), "%s", stria_error_msg());
    cr_assert_eq(stria_inproc_hub_create(2, &hub), STRIA_OK);
    cr_expect_eq(stria_inproc_link_create(hub, 2, &l), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "rank 2"), "%s", stria_error_msg());
    cr_assert_eq(stria_inproc_link_create(hub, 1, &l), STRIA_OK);
    cr_expect_eq(stria_inproc_link_create(hub, 1, &l2), STRIA_ERR_BUSY);
    cr_expect_eq(stria_inproc_fault_inject(hub, 5, STRIA_INPROC_FAULT_FAIL, 0),
                 STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_inproc_fault_inject(hub, 0, (stria_inproc_fault_t)9, 0),
                 STRIA_ERR_INVALID_ARG);
    stria_link_req_t *q;
    cr_expect_eq(stria_link_irecv(l, 1, NULL, 4, &q), STRIA_ERR_INVALID_ARG);
    stria_link_destroy(l);
    /* the rank is free again */
    cr_assert_eq(stria_inproc_link_create(hub, 1, &l), STRIA_OK);
    stria_link_destroy(l);
    stria_inproc_hub_release(hub);
}

/* Eight threads pass messages of varying sizes around the ring, many steps,
 * with receives and sends posted in both orders. */
typedef struct {
    stria_link_t *link;
    int steps;
    int errors;
} pump_t;

static void *pump(void *arg)
{
    pump_t *p = arg;
    int rank = stria_link_rank(p->link), n = stria_link_size(p->link);
    for (int s = 0; s < p->steps; s++) {
        size_t len = 1 + (size_t)((s * 37) % 5000);
        unsigned char *out = malloc(len), *in = malloc(len);
        for (size_t i = 0; i < len; i++)
            out[i] = (unsigned char)(rank * 31 + s + (int)i);
        stria_link_req_t *sr, *rr;
        stria_status_t a, b;
        if ((s + rank) % 2) {
            a = stria_link_isend(p->link, (uint64_t)s, out, len, &sr);
            b = stria_link_irecv(p->link, (uint64_t)s, in, len, &rr);
        } else {
            b = stria_link_irecv(p->link, (uint64_t)s, in, len, &rr);
            a = stria_link_isend(p->link, (uint64_t)s, out, len, &sr);
        }
        if (a != STRIA_OK || b != STRIA_OK || stria_link_wait(p->link, rr, 10.0) != STRIA_OK ||
            stria_link_wait(p->link, sr, 10.0) != STRIA_OK) {
            p->errors++;
        } else {
            int prev = (rank + n - 1) % n;
            for (size_t i = 0; i < len; i++)
                if (in[i] != (unsigned char)(prev * 31 + s + (int)i)) {
                    p->errors++;
                    break;
                }
        }
        free(out);
        free(in);
    }
    return NULL;
}

Test(inproc, eight_threads_many_steps)
{
    ring_t r;
    pthread_t th[8];
    pump_t p[8];
    ring_open(&r, 8);
    for (int i = 0; i < 8; i++) {
        p[i] = (pump_t){.link = r.links[i], .steps = 300};
        cr_assert_eq(pthread_create(&th[i], NULL, pump, &p[i]), 0);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(p[i].errors, 0, "rank %d: %d errors", i, p[i].errors);
    }
    ring_close(&r);
}
