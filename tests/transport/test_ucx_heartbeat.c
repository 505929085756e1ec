/*
 * The UCX link's heartbeat logic (transport/ucx_heartbeat.c) without UCX: who
 * a link believes stalled, what its heartbeats pass on, and when a report
 * dies out. Rank 2 of a ring of 5: predecessor 1, successor 3. Times are
 * binary fractions so that the boundaries are exact.
 */
#include <criterion/criterion.h>

#include "ucx_int.h"

enum { N = 5, ME = 2, PREV = 1, NEXT = 3 };
#define STALE 0.5

/* Both neighbours connected and heard at time t. */
static stria__ucx_hb_link_t connected(double t)
{
    stria__ucx_hb_link_t hb;
    stria__ucx_hb_init(&hb, ME, N, STALE);
    for (int side = 0; side < 2; side++) {
        hb.nb[side].up = true;
        stria__ucx_hb_heard(&hb, side, t);
    }
    return hb;
}

static void heard_both(stria__ucx_hb_link_t *hb, double t)
{
    stria__ucx_hb_heard(hb, STRIA__FROM_PREV, t);
    stria__ucx_hb_heard(hb, STRIA__FROM_NEXT, t);
}

static int suspect(const stria__ucx_hb_link_t *hb, double now, int *reporter)
{
    double silence;
    return stria__ucx_hb_suspect(hb, now, -1, reporter, &silence);
}

/* What the heartbeat passing on reports from `from` carries. */
static int ping(const stria__ucx_hb_link_t *hb, double now, int from, int32_t *silence_ms)
{
    int reporter;
    return stria__ucx_hb_ping(hb, now, from, &reporter, silence_ms);
}

Test(ucx_heartbeat, a_silent_neighbour_is_suspected_after_the_stall_time_not_before)
{
    stria__ucx_hb_link_t hb = connected(10.0);
    int reporter = -1;
    stria__ucx_hb_heard(&hb, STRIA__FROM_NEXT, 10.25);
    cr_expect_eq(suspect(&hb, 10.0 + STALE - 1.0 / 64, &reporter), -1,
                 "the predecessor is suspected before the stall time");
    stria__ucx_hb_heard(&hb, STRIA__FROM_NEXT, 10.5);
    double silence = 0;
    cr_expect_eq(stria__ucx_hb_suspect(&hb, 10.0 + STALE, -1, &reporter, &silence), PREV,
                 "the predecessor, silent for the stall time, is not the suspect");
    cr_expect_eq(reporter, ME, "a first-hand suspicion is reported by rank %d", reporter);
    cr_expect_float_eq(silence, STALE, 1e-9);
    /* The successor in its turn. */
    stria__ucx_hb_link_t hb2 = connected(10.0);
    stria__ucx_hb_heard(&hb2, STRIA__FROM_PREV, 10.5);
    cr_expect_eq(suspect(&hb2, 10.5 - 1.0 / 64, &reporter), -1);
    cr_expect_eq(suspect(&hb2, 10.5, &reporter), NEXT,
                 "the successor, silent for the stall time, is not the suspect");
}

Test(ucx_heartbeat, a_report_is_passed_on_only_in_the_direction_it_came)
{
    int32_t ms = -1;
    /* From the predecessor: rank 0 stalled, seen by rank 1, 0.75 s ago. */
    stria__ucx_hb_link_t hb = connected(10.0);
    cr_assert(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.0, 0, PREV, PREV, 750));
    heard_both(&hb, 10.25);
    cr_expect_eq(ping(&hb, 10.25, STRIA__FROM_PREV, &ms), 0,
                 "the heartbeat to the successor does not pass on the predecessor's report");
    cr_expect(ms >= 999 && ms <= 1001, "silence %d ms, expected 1000 (0.75 s + 0.25 s)", ms);
    cr_expect_eq(ping(&hb, 10.25, STRIA__FROM_NEXT, &ms), -1,
                 "the predecessor's report is sent back to the predecessor");
    cr_expect_eq(ms, 0);

    /* From the successor: rank 4 stalled. */
    stria__ucx_hb_link_t hb2 = connected(10.0);
    cr_assert(stria__ucx_hb_report(&hb2, STRIA__FROM_NEXT, 10.0, 4, NEXT, NEXT, 600));
    heard_both(&hb2, 10.25);
    cr_expect_eq(ping(&hb2, 10.25, STRIA__FROM_NEXT, &ms), 4,
                 "the heartbeat to the predecessor does not pass on the successor's report");
    cr_expect_eq(ping(&hb2, 10.25, STRIA__FROM_PREV, &ms), -1,
                 "the successor's report is sent back to the successor");
    int reporter = -1;
    cr_expect_eq(suspect(&hb2, 10.25, &reporter), 4);
    cr_expect_eq(reporter, NEXT, "the report's first-hand reporter is lost: %d", reporter);
}

Test(ucx_heartbeat, a_report_about_ourselves_is_ignored)
{
    int reporter = -1;
    int32_t ms;
    stria__ucx_hb_link_t hb = connected(10.0);
    cr_expect_not(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.0, ME, PREV, PREV, 800),
                  "a report naming this rank is kept");
    cr_expect_eq(suspect(&hb, 10.25, &reporter), -1, "this rank suspects itself");
    cr_expect_eq(ping(&hb, 10.25, STRIA__FROM_PREV, &ms), -1, "this rank passes on its own name");
    /* Nor our own report come round the ring (reporter = this rank). */
    cr_expect_not(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.0, 4, ME, PREV, 800),
                  "this rank's own report, come round, is kept");
    cr_expect_eq(suspect(&hb, 10.25, &reporter), -1);
    /* A valid report is kept: the two above were refused for what they named. */
    cr_expect(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.0, 4, PREV, PREV, 800));
    cr_expect_eq(suspect(&hb, 10.25, &reporter), 4);
}

Test(ucx_heartbeat, a_report_dies_out_two_stall_times_after_its_source_stops)
{
    int reporter = -1;
    stria__ucx_hb_link_t hb = connected(10.0);
    cr_assert(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.25, 0, PREV, PREV, 500));
    /* The neighbours stay alive; the report is not repeated. */
    heard_both(&hb, 11.0);
    cr_expect_eq(suspect(&hb, 10.25 + 2 * STALE - 1.0 / 64, &reporter), 0,
                 "the report died out before two stall times");
    heard_both(&hb, 11.25);
    cr_expect_eq(suspect(&hb, 10.25 + 2 * STALE, &reporter), -1,
                 "the report outlives two stall times after its last copy");
    int32_t ms;
    cr_expect_eq(ping(&hb, 10.25 + 2 * STALE, STRIA__FROM_PREV, &ms), -1,
                 "a dead report is still passed on");
    /* A repeated report lives on. */
    cr_assert(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 11.0, 0, PREV, PREV, 1250));
    cr_expect_eq(suspect(&hb, 11.25, &reporter), 0);
}

Test(ucx_heartbeat, the_most_recent_of_two_reports_wins)
{
    int reporter = -1;
    stria__ucx_hb_link_t hb = connected(10.0);
    cr_assert(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.25, 0, PREV, PREV, 500));
    cr_assert(stria__ucx_hb_report(&hb, STRIA__FROM_NEXT, 10.5, 4, NEXT, NEXT, 500));
    heard_both(&hb, 10.5);
    cr_expect_eq(suspect(&hb, 10.5, &reporter), 4, "the older report wins");
    cr_expect_eq(reporter, NEXT);
    /* And the other way round. */
    cr_assert(stria__ucx_hb_report(&hb, STRIA__FROM_PREV, 10.75, 0, PREV, PREV, 500));
    heard_both(&hb, 10.75);
    cr_expect_eq(suspect(&hb, 10.75, &reporter), 0, "the older report wins");
    cr_expect_eq(reporter, PREV);
}

Test(ucx_heartbeat, a_neighbour_that_said_goodbye_is_never_suspected)
{
    int reporter = -1;
    int32_t ms;
    stria__ucx_hb_link_t hb = connected(10.0);
    hb.nb[STRIA__FROM_PREV].bye = true;
    for (double t = 10.25; t <= 100.0; t += 0.25) {
        stria__ucx_hb_heard(&hb, STRIA__FROM_NEXT, t);
        cr_assert_eq(suspect(&hb, t, &reporter), -1,
                     "the predecessor, gone with a goodbye, is suspected at %.2f s", t);
    }
    cr_expect_eq(ping(&hb, 100.0, STRIA__FROM_PREV, &ms), -1);
    cr_expect_eq(ping(&hb, 100.0, STRIA__FROM_NEXT, &ms), -1);
    stria__ucx_hb_link_t hb2 = connected(10.0);
    hb2.nb[STRIA__FROM_NEXT].bye = true;
    stria__ucx_hb_heard(&hb2, STRIA__FROM_PREV, 100.0);
    cr_expect_eq(suspect(&hb2, 100.0, &reporter), -1,
                 "the successor, gone with a goodbye, is suspected");
    /* The same silence without a goodbye is suspected. */
    hb2.nb[STRIA__FROM_NEXT].bye = false;
    cr_expect_eq(suspect(&hb2, 100.0, &reporter), NEXT);
}

Test(ucx_heartbeat, a_stall_is_logged_once_when_first_seen_and_when_it_ends)
{
    int s, reporter, before;
    double silence;
    stria__ucx_hb_link_t hb = connected(10.0);
    stria__ucx_hb_heard(&hb, STRIA__FROM_NEXT, 10.5);
    cr_expect_not(stria__ucx_hb_log_due(&hb, 10.25, &s, &reporter, &silence, &before));
    cr_expect(stria__ucx_hb_log_due(&hb, 10.5, &s, &reporter, &silence, &before),
              "a new stall is not logged");
    cr_expect_eq(s, PREV);
    cr_expect_eq(before, -1);
    stria__ucx_hb_heard(&hb, STRIA__FROM_NEXT, 10.75);
    cr_expect_not(stria__ucx_hb_log_due(&hb, 10.75, &s, &reporter, &silence, &before),
                  "the same stall is logged twice");
    heard_both(&hb, 11.0);
    cr_expect(stria__ucx_hb_log_due(&hb, 11.0, &s, &reporter, &silence, &before),
              "the end of a stall is not logged");
    cr_expect_eq(s, -1);
    cr_expect_eq(before, PREV);
}

Test(ucx_heartbeat, heartbeat_and_stall_times_are_checked)
{
    double ping_s = 0, stale_s = 0;
    cr_expect_eq(stria__ucx_hb_config(0, 0, &ping_s, &stale_s), STRIA_OK);
    cr_expect_float_eq(ping_s, 0.1, 1e-12);
    cr_expect_float_eq(stale_s, 0.5, 1e-12);
    cr_expect_eq(stria__ucx_hb_config(0.25, 0.5, &ping_s, &stale_s), STRIA_OK);
    cr_expect_float_eq(stale_s, 0.5, 1e-12);
    cr_expect_eq(stria__ucx_hb_config(0.25, 0.49, &ping_s, &stale_s), STRIA_ERR_INVALID_ARG,
                 "a stall time under two heartbeat periods is accepted");
    cr_expect_eq(stria__ucx_hb_config(-1, 0, &ping_s, &stale_s), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria__ucx_hb_config(11, 30, &ping_s, &stale_s), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria__ucx_hb_config(0, 61, &ping_s, &stale_s), STRIA_ERR_INVALID_ARG);
}
