/* Coordinator suite, jobs: the job state machine through the workers'
 * reports, TTL and renewal by the owner only, random ids and per-job
 * secrets, the admin's cancel and drain, and the pass timelines. */
#include <criterion/criterion.h>

#include "coord_test_util.h"

/* ---- the job state machine ----------------------------------------------- */

Test(coord, job_lifecycle_through_reports, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    Stria__V1__JobState st = 0;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));

    cr_expect_eq(report(&fx, b, job, 0, EV(LOADED), NULL, &st), STRIA_ERR_INVALID_ARG,
                 "b is rank 1, not rank 0");
    cr_expect(strstr(stria_error_msg(), "is not rank 0") != NULL, "%s", stria_error_msg());
    cr_expect_eq(report(&fx, a, 777, 0, EV(LOADED), NULL, &st), STRIA_ERR_NOT_FOUND);
    cr_expect_eq(report(&fx, a, job, 0, EV(BACKWARD_STARTED), NULL, &st), STRIA_ERR_INVALID_ARG,
                 "backward before forward");
    cr_expect_eq(report(&fx, a, job, 0, 42, NULL, &st), STRIA_ERR_INVALID_ARG);

    cr_expect_eq(report(&fx, a, job, 0, EV(LOADED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(LOADING));
    cr_expect_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RUNNING_FORWARD));
    cr_expect_eq(report(&fx, b, job, 1, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(report(&fx, a, job, 0, EV(FORWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RUNNING_FORWARD), "one rank done is not the job done");
    cr_expect_eq(report(&fx, b, job, 1, EV(FORWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(FORWARD_DONE));
    cr_expect_eq(report(&fx, a, job, 0, EV(BACKWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RUNNING_BACKWARD));
    cr_expect_eq(report(&fx, a, job, 0, EV(BACKWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(report(&fx, b, job, 1, EV(BACKWARD_DONE), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(DONE));
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect_gt(info->timings->submitted_ms, 0);
    cr_expect_geq(info->timings->forward_started_ms, info->timings->started_ms);
    cr_expect_geq(info->timings->forward_done_ms, info->timings->forward_started_ms);
    cr_expect_geq(info->timings->backward_done_ms, info->timings->backward_started_ms);
    cr_expect_eq(info->timings->finished_ms, 0);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(release(&fx, job), STRIA_OK);
    cr_expect_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    cr_expect_eq(st, JS(RELEASED), "a report on a finished job tells the worker to drop it");

    /* A failure names the rank, the worker and the reason. */
    uint64_t job2 = submit_ok(&fx, &s, JS(LOADING));
    cr_expect_eq(report(&fx, b, job2, 1, EV(FAILED), "step 3: peer timed out", &st), STRIA_OK);
    cr_expect_eq(st, JS(FAILED));
    info = get_job(&fx, job2, &rep);
    cr_expect(strstr(info->failure, "rank 1 (worker") != NULL, "%s", info->failure);
    cr_expect(strstr(info->failure, "step 3: peer timed out") != NULL, "%s", info->failure);
    cr_expect_gt(info->timings->finished_ms, 0);
    cr_expect(!info->failure_retryable, "the worker did not judge it retryable");
    stria_rpc_reply_free(&rep);

    Stria__V1__ListJobsRequest lj = STRIA__V1__LIST_JOBS_REQUEST__INIT;
    cr_assert_eq(fx_call(fx.cl, M_LIST_JOBS, &lj.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__ListJobsReply *)rep.msg)->n_jobs, 0, "both jobs are finished");
    stria_rpc_reply_free(&rep);
    lj.include_finished = true;
    cr_assert_eq(fx_call(fx.cl, M_LIST_JOBS, &lj.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__ListJobsReply *)rep.msg)->n_jobs, 2);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

Test(coord, abandoned_jobs_expire, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 0.1, 0.4, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t idle = submit_ok(&fx, &s, JS(LOADING));
    uint64_t busy = submit_ok(&fx, &s, JS(LOADING));
    /* `busy` is in use on the worker (heartbeats say it was used just now);
     * `idle` is not. The TTL is whole seconds: 0.4 rounds up to 1. */
    double t0 = stria_time_now(), end = t0 + 10;
    bool expired = false;
    while (stria_time_now() < end && !expired) {
        heartbeat(&fx, a, &busy, 1, 0, NULL, NULL, NULL);
        expired = job_state_quiet(&fx, idle) == JS(EXPIRED);
        usleep(20000);
    }
    cr_assert(expired, "the abandoned job never expired");
    cr_expect_geq(stria_time_now() - t0, 0.95, "expired before its TTL");
    cr_expect_eq(job_state_quiet(&fx, busy), JS(LOADING), "a job in use must not expire");
    Stria__V1__JobInfo *info = get_job(&fx, idle, &rep);
    cr_expect(strstr(info->failure, "abandoned") != NULL, "%s", info->failure);
    stria_rpc_reply_free(&rep);
    /* The worker is told to drop the expired job. */
    uint64_t both[2] = {idle, busy}, drop[8];
    size_t n_drop = 0;
    cr_assert_eq(heartbeat(&fx, a, both, 2, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1);
    cr_expect_eq(drop[0], idle);
    fx_stop(&fx);
}

/* A job stays alive for its owner only: GetJob proving the job's secret
 * renews its TTL; a view without the secret (an admin's, a worker's) does
 * not, so nobody but the owner can keep another client's job (and its
 * memory on the workers) alive. */
Test(coord, only_the_owner_renews_a_job, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 0.1, 0.4, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t owned = submit_ok(&fx, &s, JS(LOADING));
    uint64_t viewed = submit_ok(&fx, &s, JS(LOADING));
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    double end = stria_time_now() + 10;
    bool expired = false;
    while (stria_time_now() < end && !expired) {
        heartbeat(&fx, a, NULL, 0, 0, NULL, NULL, NULL); /* alive, holding nothing */
        req.job_id = owned;
        cr_assert_eq(fx_call_job(fx.cl, M_GET_JOB, &req.base, owned, secret_of(owned), &rep),
                     STRIA_OK, "%s", stria_error_msg());
        stria_rpc_reply_free(&rep);
        req.job_id = viewed;
        cr_assert_eq(fx_call_job(fx.cl, M_GET_JOB, &req.base, viewed, NULL, &rep), STRIA_OK,
                     "a view without the secret (every role here): %s", stria_error_msg());
        stria_rpc_reply_free(&rep);
        expired = job_state_quiet(&fx, viewed) == JS(EXPIRED);
        usleep(20000);
    }
    cr_expect(expired, "views without the secret kept a job alive");
    cr_expect_eq(job_state_quiet(&fx, owned), JS(LOADING), "the owner's GetJob renews its job");
    /* A wrong secret is refused even where a view is allowed. */
    stria_job_secret_t wrong = *secret_of(owned);
    wrong.bytes[0] ^= 1;
    req.job_id = owned;
    cr_expect_eq(fx_call_job(fx.cl, M_GET_JOB, &req.base, owned, &wrong, &rep), STRIA_ERR_AUTH);
    fx_stop(&fx);
}

/* Job ids say nothing: random, unique, not consecutive, exact in JSON
 * (below 2^53); each job has its own secret. */
Test(coord, job_ids_are_random_and_each_job_has_its_own_secret, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    reg_worker(&fx, "h", 7000, 1ull << 40);
    Stria__V1__JobSpec s = spec_default();
    uint64_t ids[40];
    for (int i = 0; i < 40; i++) {
        ids[i] = submit_ok(&fx, &s, JS(LOADING));
        cr_expect(ids[i] > 0 && ids[i] < (1ull << 53), "id %llu", (unsigned long long)ids[i]);
        for (int k = 0; k < i; k++) {
            cr_expect_neq(ids[i], ids[k]);
            cr_expect(memcmp(secret_of(ids[i]), secret_of(ids[k]), sizeof(stria_job_secret_t)),
                      "two jobs with one secret");
        }
        if (i > 0)
            cr_expect(ids[i] != ids[i - 1] + 1, "consecutive ids %llu, %llu",
                      (unsigned long long)ids[i - 1], (unsigned long long)ids[i]);
    }
    /* The high bits vary: not a counter from a random start. */
    uint64_t or_bits = 0, and_bits = ~0ull;
    for (int i = 0; i < 40; i++)
        or_bits |= ids[i], and_bits &= ids[i];
    cr_expect_geq(__builtin_popcountll(or_bits & ~and_bits), 48, "bits that vary: %llx",
                  (unsigned long long)(or_bits & ~and_bits));
    fx_stop(&fx);
}

/* ---- admin --------------------------------------------------------------- */

Test(coord, cancel_and_drain_need_the_admin_token, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    stria_status_t st;
    uint64_t ids[8];
    fx_start(&fx, 1.0, 60, "user", "admin");
    cr_expect(stria_rpc_client_admin(fx.cl));
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));

    stria_rpc_client_t *user = fx_connect(&fx, "user", &st);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_null(fx_connect(&fx, "wrong", &st));
    cr_expect_eq(st, STRIA_ERR_AUTH);
    cr_expect_null(fx_connect(&fx, NULL, &st));
    cr_expect_eq(st, STRIA_ERR_AUTH);

    Stria__V1__CancelJobRequest cj = STRIA__V1__CANCEL_JOB_REQUEST__INIT;
    cj.job_id = job;
    cj.reason = (char *)"maintenance";
    cr_expect_eq(fx_call(user, M_CANCEL, &cj.base, &rep), STRIA_ERR_AUTH);
    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dw.worker_id = b.id;
    dw.drain = true;
    cr_expect_eq(fx_call(user, M_DRAIN, &dw.base, &rep), STRIA_ERR_AUTH);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);

    cr_assert_eq(fx_call(fx.cl, M_CANCEL, &cj.base, &rep), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(((Stria__V1__CancelJobReply *)rep.msg)->state, JS(CANCELLED));
    stria_rpc_reply_free(&rep);
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect_eq(info->state, JS(CANCELLED));
    cr_expect(strstr(info->failure, "cancelled by an admin") != NULL, "%s", info->failure);
    cr_expect(strstr(info->failure, "maintenance") != NULL, "%s", info->failure);
    stria_rpc_reply_free(&rep);
    uint64_t drop[8];
    size_t n_drop = 0;
    cr_assert_eq(heartbeat(&fx, a, &job, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1, "the worker is told to drop the cancelled job");

    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__WorkerInfo *wi = ((Stria__V1__DrainWorkerReply *)rep.msg)->worker;
    cr_expect_eq(wi->state, WST(DRAINING));
    cr_expect_eq(wi->ring_index, -1);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 1);
    uint64_t j1 = submit_ok(&fx, &s, JS(LOADING));
    info = get_job(&fx, j1, &rep);
    cr_expect_eq(info->assignment->n_ranks, 1, "a draining worker takes no new job");
    cr_expect_eq(info->assignment->ranks[0]->worker_id, a.id);
    stria_rpc_reply_free(&rep);
    dw.drain = false;
    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(ring_ids(&fx, ids, 8, NULL), 2);
    dw.worker_id = 4242;
    cr_expect_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_ERR_NOT_FOUND);
    stria_rpc_client_close(user);
    fx_stop(&fx);
}

/* ---- pass timelines ---------------------------------------------------------- */

/* A rank's timeline of `steps` steps: one entry per step with spans, or
 * (summarised) one group; `bad` breaks it (entries out of order). */
static void timeline_of(Stria__V1__PassTimeline *t, Stria__V1__StepTimes *e,
                        Stria__V1__StepTimes **ptrs, uint64_t *spans, uint32_t rank, uint32_t pass,
                        bool backward, uint32_t steps, bool summarised, bool bad)
{
    stria__v1__pass_timeline__init(t);
    t->rank = rank;
    t->pass = pass;
    t->backward = backward;
    t->steps = steps;
    t->summarised = summarised;
    t->seconds_us = 1000u * steps;
    t->n_entries = summarised ? 1 : steps;
    t->entries = ptrs;
    for (uint32_t s = 0; s < t->n_entries; s++) {
        stria__v1__step_times__init(&e[s]);
        ptrs[s] = &e[s];
        e[s].first_step = summarised ? 0 : (bad && s == 1 ? 0 : s);
        e[s].steps = summarised ? steps : 1;
        e[s].begin_us = 1000u * s;
        e[s].end_us = summarised ? 1000u * steps : 1000u * (s + 1);
        e[s].compute_us = 600;
        e[s].wait_us = 300;
        e[s].computed = 1;
        if (!summarised) {
            spans[4 * s] = e[s].begin_us;
            spans[4 * s + 1] = e[s].begin_us + 600;
            spans[4 * s + 2] = e[s].begin_us + 600;
            spans[4 * s + 3] = e[s].begin_us + 900;
            e[s].compute_spans = &spans[4 * s];
            e[s].n_compute_spans = 2;
            e[s].wait_spans = &spans[4 * s + 2];
            e[s].n_wait_spans = 2;
        }
    }
}

static stria_status_t report_tl(const fx_t *fx, wk_t w, uint64_t job, uint32_t rank, int event,
                                Stria__V1__PassTimeline *t)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.worker_id = w.id;
    req.job_id = job;
    req.rank = rank;
    req.event = event;
    req.message = (char *)"";
    req.timeline = t;
    stria_status_t st = fx_call(fx->cl, M_REPORT, &req.base, &rep);
    stria_rpc_reply_free(&rep);
    return st;
}

/* The timelines of a job as (backward << 8 | rank) codes, sorted by arrival
 * in the reply; returns their number. */
static size_t job_timelines(const fx_t *fx, uint64_t id, bool include, uint32_t *codes,
                            uint32_t *passes, uint32_t *entries)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = id;
    req.include_timelines = include;
    cr_assert_eq(fx_call(fx->cl, M_GET_JOB, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    size_t n = j->n_timelines;
    for (size_t i = 0; i < n && i < 8; i++) {
        codes[i] = (j->timelines[i]->backward ? 256u : 0u) | j->timelines[i]->rank;
        passes[i] = j->timelines[i]->pass;
        entries[i] = (uint32_t)j->timelines[i]->n_entries;
    }
    stria_rpc_reply_free(&rep);
    return n;
}

Test(coord, pass_timelines_are_checked_kept_and_replaced, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    Stria__V1__PassTimeline t;
    Stria__V1__StepTimes e[2], *ptrs[2];
    uint64_t spans[8];
    uint32_t codes[8], passes[8], entries[8];
    Stria__V1__JobState st = 0;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7100, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7101, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));
    cr_assert_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);

    /* rank 0: a well-formed timeline of 2 steps; rank 1: entries out of
     * order (ignored, but its FORWARD_DONE counts) */
    timeline_of(&t, e, ptrs, spans, 0, 0, false, 2, false, false);
    cr_assert_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    timeline_of(&t, e, ptrs, spans, 1, 0, false, 2, false, true);
    cr_assert_eq(report_tl(&fx, b, job, 1, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_state(&fx, job), JS(FORWARD_DONE), "a bad timeline still reports the event");
    cr_expect_eq(job_timelines(&fx, job, false, codes, passes, entries), 0,
                 "only asked for, they stay out of GetJob");
    cr_assert_eq(job_timelines(&fx, job, true, codes, passes, entries), 1);
    cr_expect_eq(codes[0], 0u);
    cr_expect_eq(entries[0], 2u);

    /* a timeline naming another rank than the reporter's, or more steps than
     * ranks, is ignored too */
    timeline_of(&t, e, ptrs, spans, 0, 0, false, 2, false, false);
    t.rank = 1;
    cr_expect_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    t.rank = 0;
    t.steps = 3;
    cr_expect_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_timelines(&fx, job, true, codes, passes, entries), 1);

    /* backward timelines (summarised) sit beside the forward ones */
    cr_assert_eq(report(&fx, a, job, 0, EV(BACKWARD_STARTED), NULL, &st), STRIA_OK);
    timeline_of(&t, e, ptrs, spans, 1, 1, true, 2, true, false);
    cr_assert_eq(report_tl(&fx, b, job, 1, EV(BACKWARD_DONE), &t), STRIA_OK);
    cr_assert_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);
    cr_expect_eq(codes[1], 256u | 1u);
    cr_expect_eq(entries[1], 1u);
    /* spans in a summarised entry are refused */
    timeline_of(&t, e, ptrs, spans, 0, 1, true, 2, false, false);
    t.summarised = true;
    cr_expect_eq(report_tl(&fx, a, job, 0, EV(BACKWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);

    /* a newer forward pass replaces the older one's timelines */
    cr_assert_eq(report(&fx, a, job, 0, EV(FORWARD_STARTED), NULL, &st), STRIA_OK);
    timeline_of(&t, e, ptrs, spans, 1, 2, false, 2, false, false);
    cr_assert_eq(report_tl(&fx, b, job, 1, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_assert_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);
    cr_expect_eq(codes[0], 1u, "rank 0's pass 0 is gone, rank 1's pass 2 is there");
    cr_expect_eq(passes[0], 2u);
    /* ... and a late report of the older pass does not bring it back */
    timeline_of(&t, e, ptrs, spans, 0, 0, false, 2, false, false);
    cr_assert_eq(report_tl(&fx, a, job, 0, EV(FORWARD_DONE), &t), STRIA_OK);
    cr_expect_eq(job_timelines(&fx, job, true, codes, passes, entries), 2);
    fx_stop(&fx);
}
