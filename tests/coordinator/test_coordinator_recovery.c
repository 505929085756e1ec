/* Coordinator suite, recovery: failure classes and excluded workers, a
 * sharded job that lost a worker replaced on a spare, and a restarted
 * coordinator rebuilding its jobs from the workers' descriptions. */
#include <criterion/criterion.h>

#include "coord_test_util.h"

/* ---- failure classes and retries ------------------------------------------ */

/* A worker's FAILED report with its judgement; the reply's verdict. */
static bool report_failed(const fx_t *fx, wk_t w, uint64_t job, uint32_t rank, bool retryable)
{
    Stria__V1__ReportJobRequest req = STRIA__V1__REPORT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.worker_id = w.id;
    req.job_id = job;
    req.rank = rank;
    req.event = EV(FAILED);
    req.message = (char *)"ring link broke";
    req.retryable = retryable;
    cr_assert_eq(fx_call(fx->wk, M_REPORT, &req.base, &rep), STRIA_OK, "%s", stria_error_msg());
    const Stria__V1__ReportJobReply *r = (const Stria__V1__ReportJobReply *)rep.msg;
    cr_expect_eq(r->state, JS(FAILED));
    bool verdict = r->failure_retryable;
    stria_rpc_reply_free(&rep);
    return verdict;
}

Test(coord, the_first_failure_decides_the_class, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t a = reg_worker(&fx, "h", 7000, 1ull << 32);
    wk_t b = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t job = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(report_failed(&fx, a, job, 0, true), "the worker's judgement is recorded");
    /* a later report cannot change it: the first verdict stands */
    cr_expect(report_failed(&fx, b, job, 1, false));
    Stria__V1__JobInfo *info = get_job(&fx, job, &rep);
    cr_expect(info->failure_retryable);
    cr_expect_eq(info->n_blamed_worker_ids, 0, "a ring failure blames no worker in particular");
    stria_rpc_reply_free(&rep);
    uint64_t job2 = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(!report_failed(&fx, b, job2, 1, false));
    cr_expect(!report_failed(&fx, a, job2, 0, true));
    fx_stop(&fx);
}

/* SubmitJob with exclude_worker_ids; the reply's ranks' worker ids into
 * ids[] (at most 8). */
static stria_status_t submit_excluding(const fx_t *fx, Stria__V1__JobSpec *s, uint64_t *ex,
                                       size_t n_ex, uint64_t *ids, size_t *n_ids)
{
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.spec = s;
    req.exclude_worker_ids = ex;
    req.n_exclude_worker_ids = n_ex;
    stria_status_t st = fx_call(fx->user, M_SUBMIT, &req.base, &rep);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__Assignment *a = ((Stria__V1__SubmitJobReply *)rep.msg)->assignment;
    *n_ids = a->n_ranks;
    for (size_t i = 0; i < a->n_ranks && i < 8; i++)
        ids[i] = a->ranks[i]->worker_id;
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

Test(coord, a_submission_excludes_the_workers_it_names, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    fx_start(&fx, 1.0, 60, NULL, NULL);
    wk_t w[3];
    for (int i = 0; i < 3; i++)
        w[i] = reg_worker(&fx, "h", 7000 + i, 1ull << 32);
    Stria__V1__JobSpec s = spec_default();
    uint64_t ex[2] = {w[1].id, 424242 /* unknown: ignored */}, ids[8];
    size_t n = 0;
    /* ring_size 0: the healthy workers less the excluded */
    cr_assert_eq(submit_excluding(&fx, &s, ex, 2, ids, &n), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(n, 2);
    for (size_t i = 0; i < n; i++)
        cr_expect_neq(ids[i], w[1].id, "rank %zu is on the excluded worker", i);
    /* a fixed size that only the excluded worker could fill: busy, saying so */
    s.ring_size = 3;
    cr_expect_eq(submit_excluding(&fx, &s, ex, 1, ids, &n), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "1 excluded by the request") != NULL, "%s",
              stria_error_msg());
    /* a bounded list */
    uint64_t *many = calloc(1025, sizeof(*many));
    cr_assert_not_null(many);
    cr_expect_eq(submit_excluding(&fx, &s, many, 1025, ids, &n), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "exclude_worker_ids") != NULL, "%s", stria_error_msg());
    free(many);
    fx_stop(&fx);
}

/* ---- replacing a sharded job's lost worker --------------------------------- */

/* The replacement of a job proves the same secret. */
static void same_secret(uint64_t y, uint64_t x)
{
    cr_assert_lt(g_n_jobs, sizeof(g_jobs) / sizeof(g_jobs[0]));
    g_jobs[g_n_jobs].id = y;
    g_jobs[g_n_jobs].secret = *secret_of(x);
    g_n_jobs++;
}

static bool pred_replaced(const fx_t *fx, void *arg)
{
    stria_rpc_reply_t rep;
    bool done = get_job(fx, *(uint64_t *)arg, &rep)->replaced_by != 0;
    stria_rpc_reply_free(&rep);
    return done;
}

static bool pred_settled(const fx_t *fx, void *arg)
{
    stria_rpc_reply_t rep;
    Stria__V1__JobInfo *info = get_job(fx, *(uint64_t *)arg, &rep);
    bool done = info->replaced_by != 0 || !info->replacement_pending;
    stria_rpc_reply_free(&rep);
    return done;
}

static bool pred_failed(const fx_t *fx, void *arg)
{
    return job_state(fx, *(uint64_t *)arg) == JS(FAILED);
}

static Stria__V1__JobSpec spec_sharded(uint32_t ring_size)
{
    Stria__V1__JobSpec s = spec_default();
    s.sharded = true;
    s.ring_size = ring_size;
    s.layout = STRIA__V1__LAYOUT__LAYOUT_STRIPED;
    return s;
}

/* A coordinator with n workers on host "h" (room for one job each) and a
 * sharded job of ring_size ranks on them; its ranks' worker ids in was[]. */
static uint64_t sharded_on(fx_t *fx, wk_t *w, int n, uint32_t ring_size, uint64_t *was)
{
    stria_rpc_reply_t rep;
    uint64_t m = mem_default((int)ring_size);
    fx_start(fx, 0.2, 60, NULL, NULL);
    for (int i = 0; i < n; i++)
        w[i] = reg_worker(fx, "h", 7000 + i, m + m / 2);
    Stria__V1__JobSpec s = spec_sharded(ring_size);
    uint64_t x = submit_ok(fx, &s, JS(LOADING));
    Stria__V1__JobInfo *info = get_job(fx, x, &rep);
    for (uint32_t r = 0; r < ring_size; r++)
        was[r] = info->assignment->ranks[r]->worker_id;
    stria_rpc_reply_free(&rep);
    return x;
}

/* The job replacing x (which proves x's secret). */
static uint64_t replacement(const fx_t *fx, uint64_t x)
{
    stria_rpc_reply_t rep;
    uint64_t y = get_job(fx, x, &rep)->replaced_by;
    stria_rpc_reply_free(&rep);
    cr_assert_neq(y, 0, "job %llu was not replaced", (unsigned long long)x);
    same_secret(y, x);
    return y;
}

/* A pass fails at a ring peer's report (its link to the lost worker broke)
 * before the verdict on the worker; the job waits for it, and is replaced
 * when it comes: same ranks and spec, the lost rank on the spare. A rank
 * that never moved to the replacement releases it too. */
Test(coord, a_sharded_job_that_lost_a_worker_is_replaced, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[5];
    uint64_t was[4], spare = 0;
    uint64_t x = sharded_on(&fx, w, 5, 4, was);
    Stria__V1__JobSpec s = spec_sharded(4);
    Stria__V1__JobInfo *info;
    for (int i = 0; i < 5; i++)
        spare = was[0] != w[i].id && was[1] != w[i].id && was[2] != w[i].id && was[3] != w[i].id
                    ? w[i].id
                    : spare;
    cr_assert_neq(spare, 0);

    /* rank 1's link to rank 2 broke: failed, waiting for a verdict */
    wk_t lost = {0}, keep[4];
    size_t n_keep = 0;
    for (int i = 0; i < 5; i++) {
        if (w[i].id == was[2])
            lost = w[i];
        else
            keep[n_keep++] = w[i];
        if (w[i].id == was[1])
            cr_expect(report_failed(&fx, w[i], x, 1, true));
    }
    info = get_job(&fx, x, &rep);
    cr_expect_eq(info->state, JS(FAILED));
    cr_expect(info->failure_retryable);
    cr_expect(info->replacement_pending, "a sharded job waits for the verdict on its workers");
    cr_expect_eq(info->replaced_by, 0);
    stria_rpc_reply_free(&rep);

    /* rank 2's worker goes silent: dead after 0.6 s, and replaced */
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    info = get_job(&fx, x, &rep);
    uint64_t y = info->replaced_by;
    cr_expect(!info->replacement_pending);
    cr_expect(info->n_blamed_worker_ids == 1 && info->blamed_worker_ids[0] == lost.id);
    char want[96];
    snprintf(want, sizeof(want), "replaced by job %llu: rank 2 on worker %llu",
             (unsigned long long)y, (unsigned long long)spare);
    cr_expect(strstr(info->failure, want) != NULL, "%s", info->failure);
    stria_rpc_reply_free(&rep);
    same_secret(y, x);
    info = get_job(&fx, y, &rep);
    cr_expect_eq(info->state, JS(LOADING), "the spare had room: it starts at once");
    cr_expect_eq(info->replaces, x);
    cr_expect_eq(info->generation, 1);
    cr_expect(info->assignment->spec->sharded);
    cr_expect_eq(info->assignment->spec->seq_len, s.seq_len);
    cr_expect_eq(info->assignment->spec->layout, s.layout);
    for (int r = 0; r < 4; r++)
        cr_expect_eq(info->assignment->ranks[r]->worker_id, r == 2 ? spare : was[r],
                     "rank %d of the replacement", r);
    stria_rpc_reply_free(&rep);

    /* every rank releases the old handle: the replacement is released too */
    Stria__V1__ReleaseJobRequest rq = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    uint32_t ranks[4] = {0, 1, 2, 3};
    rq.job_id = x;
    rq.ranks = ranks;
    rq.n_ranks = 4;
    cr_assert_eq(fx_call_job(fx.user, M_RELEASE, &rq.base, x, secret_of(x), &rep), STRIA_OK, "%s",
                 stria_error_msg());
    stria_rpc_reply_free(&rep);
    cr_expect_eq(job_state(&fx, y), JS(RELEASED));
    fx_stop(&fx);
}

static bool pred_loading(const fx_t *fx, void *arg)
{
    return job_state(fx, *(uint64_t *)arg) == JS(LOADING);
}

/* The worker of job x's rank `rank` among w[0 .. n). */
static wk_t worker_of(const wk_t *w, int n, const uint64_t *was, int rank)
{
    for (int i = 0; i < n; i++)
        if (w[i].id == was[rank])
            return w[i];
    cr_assert_fail("no worker %llu", (unsigned long long)was[rank]);
    return w[0];
}

/* A job queued behind a failed sharded job does not take the room its
 * replacement needs while the failure waits for the verdict: the
 * replacement starts at once, in the failed job's place; a wait that ends
 * without a verdict gives the room to the queue. */
Test(coord, a_replacement_keeps_its_jobs_place_in_the_queue, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    wk_t w[5], keep[4];
    uint64_t was[4];
    size_t n_keep = 0;
    uint64_t x = sharded_on(&fx, w, 5, 4, was);
    Stria__V1__JobSpec s = spec_default();
    s.ring_size = 4;
    uint64_t q = submit_ok(&fx, &s, JS(PENDING)); /* no room on x's workers */
    wk_t lost = worker_of(w, 5, was, 2);
    for (int i = 0; i < 5; i++)
        if (w[i].id != lost.id)
            keep[n_keep++] = w[i];

    cr_expect(report_failed(&fx, worker_of(w, 5, was, 1), x, 1, true));
    cr_expect_eq(job_state(&fx, q), JS(PENDING), "the queued job took the failed job's room");
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    uint64_t y = replacement(&fx, x);
    cr_expect_eq(job_state(&fx, y), JS(LOADING), "the replacement waits behind a later job");
    cr_expect_neq(job_state(&fx, q), JS(LOADING));

    /* the replacement ends: the queued job (unless it was on the lost
     * worker) gets the room */
    cr_expect_eq(release(&fx, y), STRIA_OK);
    if (job_state(&fx, q) == JS(PENDING))
        cr_expect(wait_until(&fx, keep, n_keep, pred_loading, &q, 5), "the room never came free");
    fx_stop(&fx);

    /* no verdict: the wait's end frees the room */
    x = sharded_on(&fx, w, 5, 4, was);
    q = submit_ok(&fx, &s, JS(PENDING));
    cr_expect(report_failed(&fx, worker_of(w, 5, was, 1), x, 1, true));
    cr_expect_eq(job_state(&fx, q), JS(PENDING));
    cr_expect(wait_until(&fx, w, 5, pred_loading, &q, 10),
              "the failed job kept its room after its wait");
    fx_stop(&fx);
}

/* A failed sharded job without a lost worker stays failed once the wait is
 * over; a failure that is not retryable, and a whole-sequence job's, do not
 * wait; nor is a job replaced without a spare (it says why). */
Test(coord, a_sharded_job_is_replaced_only_for_a_lost_worker_with_a_spare,
     .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[2];
    fx_start(&fx, 0.2, 60, NULL, NULL);
    w[0] = reg_worker(&fx, "h", 7000, 1ull << 32);
    w[1] = reg_worker(&fx, "h", 7001, 1ull << 32);
    Stria__V1__JobSpec s = spec_sharded(2);
    uint64_t x = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(report_failed(&fx, w[0], x, 0, true));
    double t0 = stria_time_now();
    cr_assert(wait_until(&fx, w, 2, pred_settled, &x, 10));
    cr_expect_geq(stria_time_now() - t0, 5 * 0.2, "the wait is a few heartbeat periods");
    Stria__V1__JobInfo *info = get_job(&fx, x, &rep);
    cr_expect_eq(info->replaced_by, 0);
    cr_expect(info->failure_retryable);
    stria_rpc_reply_free(&rep);

    uint64_t x2 = submit_ok(&fx, &s, JS(LOADING));
    cr_expect(!report_failed(&fx, w[0], x2, 0, false));
    info = get_job(&fx, x2, &rep);
    cr_expect(!info->replacement_pending, "bad input is no lost worker");
    stria_rpc_reply_free(&rep);
    Stria__V1__JobSpec whole = spec_default();
    whole.ring_size = 2;
    uint64_t x3 = submit_ok(&fx, &whole, JS(LOADING));
    cr_expect(report_failed(&fx, w[0], x3, 0, true));
    info = get_job(&fx, x3, &rep);
    cr_expect(!info->replacement_pending, "the client library retries whole-sequence jobs");
    stria_rpc_reply_free(&rep);

    /* no spare: w[1] dies, and nothing can take its rank */
    uint64_t x4 = submit_ok(&fx, &s, JS(LOADING));
    cr_assert(wait_until(&fx, &w[0], 1, pred_failed, &x4, 10));
    info = get_job(&fx, x4, &rep);
    cr_expect_eq(info->state, JS(FAILED));
    cr_expect_eq(info->replaced_by, 0);
    cr_expect(info->failure_retryable, "the trainer may try again once a worker is back");
    cr_expect(strstr(info->failure, "not replaced: no healthy worker outside the job has") != NULL,
              "%s", info->failure);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* Every lost member gets a spare at once: two workers silent together die in
 * one tick (neither is the other's spare), and a draining member is moved
 * too (a queued job with a draining worker would fail). The two go silent
 * a moment apart, as two workers of a host that went down would: deaths
 * due within a tick of each other are one. */
Test(coord, lost_and_draining_members_all_get_spares, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[7];
    uint64_t was[3];
    uint64_t x = sharded_on(&fx, w, 7, 3, was);
    Stria__V1__JobInfo *info;
    Stria__V1__DrainWorkerRequest dw = STRIA__V1__DRAIN_WORKER_REQUEST__INIT;
    dw.worker_id = was[0];
    dw.drain = true;
    cr_assert_eq(fx_call(fx.cl, M_DRAIN, &dw.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    wk_t keep[7];
    size_t n_keep = 0;
    for (int i = 0; i < 7; i++)
        if (w[i].id != was[1] && w[i].id != was[2])
            keep[n_keep++] = w[i];
    for (int k = 1; k < 3; k++) /* their last words, 10 ms apart */
        for (int i = 0; i < 7; i++)
            if (w[i].id == was[k]) {
                cr_assert_eq(heartbeat(&fx, w[i], NULL, 0, 0, NULL, NULL, NULL), STRIA_OK);
                usleep(10000);
            }
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    info = get_job(&fx, replacement(&fx, x), &rep);
    cr_expect_eq(info->state, JS(LOADING), "%s", info->failure);
    cr_expect_eq(info->generation, 1, "both deaths in one replacement");
    for (int r = 0; r < 3; r++)
        for (int k = 0; k < 3; k++)
            cr_expect_neq(info->assignment->ranks[r]->worker_id, was[k],
                          "rank %d of the replacement is on a lost or draining worker", r);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* A placed rank's spare comes from its host; with none there, the job is
 * not replaced unless the spec allows another host. */
Test(coord, a_placed_ranks_spare_keeps_its_placement, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    stria_rpc_reply_t rep;
    wk_t w[5];
    uint64_t m = mem_default(2);
    fx_start(&fx, 0.2, 60, NULL, NULL);
    for (int i = 0; i < 5; i++) /* hA: 7000-7002, hB: 7003-7004 */
        w[i] = reg_worker(&fx, i < 3 ? "hA" : "hB", 7000 + i, m + m / 2);
    Stria__V1__JobSpec s = spec_sharded(2);
    Stria__V1__JobSpec__Placement pa = STRIA__V1__JOB_SPEC__PLACEMENT__INIT,
                                  pb = STRIA__V1__JOB_SPEC__PLACEMENT__INIT, *pl[2] = {&pa, &pb};
    pa.host = (char *)"hA";
    pb.host = (char *)"hB";
    s.placement = pl;
    s.n_placement = 2;
    uint64_t x = submit_ok(&fx, &s, JS(LOADING));
    Stria__V1__JobInfo *info = get_job(&fx, x, &rep);
    uint64_t r0 = info->assignment->ranks[0]->worker_id, r1 = info->assignment->ranks[1]->worker_id;
    stria_rpc_reply_free(&rep);
    cr_assert(r1 == w[3].id || r1 == w[4].id);
    wk_t keep[4], other = r1 == w[3].id ? w[4] : w[3];
    size_t n_keep = 0;
    for (int i = 0; i < 5; i++)
        if (w[i].id != r1)
            keep[n_keep++] = w[i];
    cr_assert(wait_until(&fx, keep, n_keep, pred_replaced, &x, 10), "never replaced");
    uint64_t y = replacement(&fx, x);
    info = get_job(&fx, y, &rep);
    cr_expect_eq(info->assignment->ranks[0]->worker_id, r0);
    cr_expect_eq(info->assignment->ranks[1]->worker_id, other.id,
                 "rank 1 is placed on hB: the spare there, not the idle ones of hA");
    cr_expect(!info->assignment->ranks[1]->placement_fallback);
    stria_rpc_reply_free(&rep);

    /* now hB has no worker left for it */
    n_keep = 0;
    for (int i = 0; i < 3; i++)
        keep[n_keep++] = w[i];
    cr_assert(wait_until(&fx, keep, n_keep, pred_failed, &y, 10));
    info = get_job(&fx, y, &rep);
    cr_expect_eq(info->replaced_by, 0);
    cr_expect(strstr(info->failure, "not replaced: no healthy worker on host 'hB'") != NULL, "%s",
              info->failure);
    stria_rpc_reply_free(&rep);
    fx_stop(&fx);
}

/* ---- restart: jobs rebuilt from the workers' descriptions ------------------ */

typedef struct {
    uint64_t id;
    stria_job_secret_t secret;
    uint8_t ring_key[STRIA_AUTH_KEY_BYTES];
    Stria__V1__JobSpec spec;
    uint64_t replaces; /* HeldJob.replaces, .generation */
    uint32_t generation;
} held_t;

static void held_init(held_t *h, uint64_t id, uint32_t ring)
{
    memset(h, 0, sizeof(*h));
    h->id = id;
    cr_assert_eq(stria_job_secret_generate(&h->secret), STRIA_OK);
    cr_assert_eq(stria_auth_random(h->ring_key, sizeof(h->ring_key)), STRIA_OK);
    h->spec = spec_default();
    h->spec.ring_size = ring;
    h->spec.ttl_s = 60;
}

/* A heartbeat of worker w describing rank `rank` of h (phase, purposes of
 * the seals as given: "held job secret" and "held ring key" are right);
 * the drops and describe_jobs come back. */
static stria_status_t heartbeat_held(const fx_t *fx, wk_t w, const held_t *h, uint32_t rank,
                                     Stria__V1__JobState phase, const char *secret_purpose,
                                     size_t *n_drop, bool *describe)
{
    Stria__V1__HeartbeatRequest req = STRIA__V1__HEARTBEAT_REQUEST__INIT;
    Stria__V1__GetStatusRequest sq = STRIA__V1__GET_STATUS_REQUEST__INIT;
    Stria__V1__WorkerJobStatus js = STRIA__V1__WORKER_JOB_STATUS__INIT, *jp = &js;
    Stria__V1__HeldJob hj = STRIA__V1__HELD_JOB__INIT, *hp = &hj;
    uint8_t sealed[2][STRIA_AUTH_SEALED_BYTES];
    stria_rpc_reply_t rep;
    /* the session of the workers' connection: what the keys are sealed in */
    cr_assert_eq(fx_call(fx->wk, M_STATUS, &sq.base, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_auth_session_t session = rep.session;
    stria_rpc_reply_free(&rep);
    cr_assert_eq(stria_auth_seal(&session, secret_purpose, h->id, h->secret.bytes, sealed[0]),
                 STRIA_OK);
    cr_assert_eq(stria_auth_seal(&session, "held ring key", h->id, h->ring_key, sealed[1]),
                 STRIA_OK);
    hj.job_id = h->id;
    hj.rank = rank;
    hj.spec = (Stria__V1__JobSpec *)&h->spec;
    hj.phase = phase;
    hj.replaces = h->replaces;
    hj.generation = h->generation;
    hj.job_secret.data = sealed[0];
    hj.job_secret.len = sizeof(sealed[0]);
    hj.ring_key.data = sealed[1];
    hj.ring_key.len = sizeof(sealed[1]);
    js.job_id = h->id;
    js.phase = phase;
    req.worker_id = w.id;
    req.incarnation = w.incarnation;
    req.n_jobs = 1;
    req.jobs = &jp;
    req.n_held_jobs = 1;
    req.held_jobs = &hp;
    stria_status_t st = fx_call(fx->wk, M_HEARTBEAT, &req.base, &rep);
    if (st != STRIA_OK)
        return st;
    Stria__V1__HeartbeatReply *r = (Stria__V1__HeartbeatReply *)rep.msg;
    *n_drop = r->n_drop_job_ids;
    *describe = r->describe_jobs;
    stria_rpc_reply_free(&rep);
    return STRIA_OK;
}

/* GetJob of h's id proving `secret`. */
static stria_status_t get_held(const fx_t *fx, const held_t *h, const stria_job_secret_t *secret,
                               Stria__V1__JobState *state, char *failure, size_t cap)
{
    Stria__V1__GetJobRequest req = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    req.job_id = h->id;
    stria_status_t st = fx_call_job(fx->user, M_GET_JOB, &req.base, h->id, secret, &rep);
    if (st == STRIA_OK) {
        const Stria__V1__JobInfo *info = ((Stria__V1__GetJobReply *)rep.msg)->job;
        *state = info->state;
        snprintf(failure, cap, "%s", info->failure);
    }
    stria_rpc_reply_free(&rep);
    return st;
}

Test(coord, restart_rebuilds_jobs_from_the_workers, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    size_t n_drop = 0;
    bool describe = false;
    char failure[512];
    Stria__V1__JobState state = 0;
    g_recovery_window_s = 1.5;
    fx_start(&fx, 1.0, 60, "client-secret", "admin-secret");
    g_recovery_window_s = -1;
    wk_t a = reg_worker(&fx, "h", 7100, 1ull << 30), b = reg_worker(&fx, "h", 7101, 1ull << 30);
    held_t h;
    held_init(&h, 123456789, 2);
    h.spec.label = (char *)"before the restart";

    /* rank 0 described: not known yet to clients (busy), kept by the worker */
    cr_assert_eq(
        heartbeat_held(&fx, a, &h, 0, JS(FORWARD_DONE), "held job secret", &n_drop, &describe),
        STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(n_drop, 0u);
    cr_expect_not(describe);
    cr_expect_eq(get_held(&fx, &h, &h.secret, &state, failure, sizeof(failure)), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "rebuilds its jobs") != NULL, "%s", stria_error_msg());

    /* rank 1 too: the job is back, in the state of its slowest rank */
    cr_assert_eq(heartbeat_held(&fx, b, &h, 1, JS(DONE), "held job secret", &n_drop, &describe),
                 STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(n_drop, 0u);
    cr_assert_eq(get_held(&fx, &h, &h.secret, &state, failure, sizeof(failure)), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(state, JS(FORWARD_DONE));
    stria_rpc_reply_t rep;
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    gq.job_id = h.id;
    cr_assert_eq(fx_call_job(fx.user, M_GET_JOB, &gq.base, h.id, &h.secret, &rep), STRIA_OK);
    const Stria__V1__Assignment *as = ((Stria__V1__GetJobReply *)rep.msg)->job->assignment;
    cr_expect_eq(as->n_ranks, 2u);
    cr_expect_eq(as->ranks[0]->worker_id, a.id);
    cr_expect_eq(as->ranks[1]->worker_id, b.id);
    cr_expect_str_eq(as->spec->label, "before the restart");
    stria_rpc_reply_free(&rep);

    /* only its secret opens it: another tenant's proof is refused */
    stria_job_secret_t other;
    cr_assert_eq(stria_job_secret_generate(&other), STRIA_OK);
    cr_expect_eq(get_held(&fx, &h, &other, &state, failure, sizeof(failure)), STRIA_ERR_AUTH);
    cr_expect_eq(get_held(&fx, &h, NULL, &state, failure, sizeof(failure)), STRIA_ERR_AUTH);

    /* the next heartbeats keep it; the owner releases it */
    uint64_t id = h.id, drop[8];
    cr_expect_eq(heartbeat(&fx, a, &id, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 0u);
    Stria__V1__ReleaseJobRequest rq = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    rq.job_id = h.id;
    cr_expect_eq(fx_call_job(fx.user, M_RELEASE, &rq.base, h.id, &h.secret, &rep), STRIA_OK);
    stria_rpc_reply_free(&rep);
    cr_expect_eq(heartbeat(&fx, a, &id, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1u, "released: dropped");
    fx_stop(&fx);
}

/* A rebuilt replacement links the job it replaces again: that job comes
 * back failed, naming it, and opens with the replacement's secret; a
 * replacement naming a known job of another secret links nothing. */
Test(coord, restart_links_a_replacement_to_its_job, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    size_t n_drop = 0;
    bool describe = false;
    char failure[512], want[64];
    Stria__V1__JobState state = 0;
    g_recovery_window_s = 1.5;
    fx_start(&fx, 1.0, 60, "client-secret", "admin-secret");
    g_recovery_window_s = -1;
    wk_t a = reg_worker(&fx, "h", 7300, 1ull << 30), b = reg_worker(&fx, "h", 7301, 1ull << 30);
    held_t y, x, other, forged;
    held_init(&y, 7770002, 2);
    y.replaces = 7770001;
    y.generation = 1;
    x = y; /* the replaced job: the replacement's secret */
    x.id = y.replaces;
    for (uint32_t r = 0; r < 2; r++)
        cr_assert_eq(heartbeat_held(&fx, r ? b : a, &y, r, JS(FORWARD_DONE), "held job secret",
                                    &n_drop, &describe),
                     STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(get_held(&fx, &x, &x.secret, &state, failure, sizeof(failure)), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(state, JS(FAILED));
    snprintf(want, sizeof(want), "replaced by job %llu", (unsigned long long)y.id);
    cr_expect(strstr(failure, want) != NULL, "%s", failure);
    cr_expect_eq(get_held(&fx, &y, &y.secret, &state, failure, sizeof(failure)), STRIA_OK);
    cr_expect_eq(state, JS(FORWARD_DONE));

    /* a known job of another secret is left alone */
    held_init(&other, 7770011, 2);
    held_init(&forged, 7770012, 2);
    forged.replaces = other.id;
    forged.generation = 1;
    for (uint32_t r = 0; r < 2; r++)
        cr_assert_eq(heartbeat_held(&fx, r ? b : a, &other, r, JS(LOADING), "held job secret",
                                    &n_drop, &describe),
                     STRIA_OK);
    for (uint32_t r = 0; r < 2; r++)
        cr_assert_eq(heartbeat_held(&fx, r ? b : a, &forged, r, JS(LOADING), "held job secret",
                                    &n_drop, &describe),
                     STRIA_OK);
    cr_assert_eq(get_held(&fx, &other, &other.secret, &state, failure, sizeof(failure)), STRIA_OK);
    cr_expect_eq(state, JS(LOADING), "a forged link failed job %llu: %s",
                 (unsigned long long)other.id, failure);
    fx_stop(&fx);
}

Test(coord, restart_refuses_bad_descriptions, .timeout = TEST_TIMEOUT_S)
{
    fx_t fx;
    size_t n_drop = 0;
    bool describe = false;
    char failure[512];
    Stria__V1__JobState state = 0;
    g_recovery_window_s = 1.0;
    fx_start(&fx, 1.0, 60, "client-secret", "admin-secret");
    g_recovery_window_s = -1;
    wk_t a = reg_worker(&fx, "h", 7200, 1ull << 30), b = reg_worker(&fx, "h", 7201, 1ull << 30),
         c = reg_worker(&fx, "h", 7202, 1ull << 30);
    held_t h, bad;
    held_init(&h, 5550001, 2);

    /* nonsense: the worker is told to drop it, the coordinator serves on */
    held_init(&bad, 5550002, 2);
    bad.spec.head_dim = 12;
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a bad spec is refused");
    held_init(&bad, 5550003, 2);
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 2, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "rank 2 of a ring of 2 is refused");
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(UNSPECIFIED), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a phase outside LOADING .. DONE is refused");
    held_init(&bad, 0, 2);
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "job id 0 is refused");
    held_init(&bad, 5550004, 2);
    bad.replaces = 5550001;
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a replacement of generation 0 is refused");
    bad.replaces = bad.id;
    bad.generation = 1;
    cr_assert_eq(
        heartbeat_held(&fx, a, &bad, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a job replacing itself is refused");
    /* keys sealed for something else: not opened, asked again */
    cr_assert_eq(heartbeat_held(&fx, a, &h, 0, JS(LOADING), "job secret", &n_drop, &describe),
                 STRIA_OK);
    cr_expect_eq(n_drop, 0u);
    cr_expect(describe, "keys that do not open are asked for again");

    /* the first description fixes spec and keys; a later one that differs,
     * or a second worker for a rank, is refused */
    cr_assert_eq(heartbeat_held(&fx, a, &h, 0, JS(LOADING), "held job secret", &n_drop, &describe),
                 STRIA_OK);
    cr_expect_eq(n_drop, 0u);
    cr_expect_not(describe);
    held_t forged = h;
    cr_assert_eq(stria_job_secret_generate(&forged.secret), STRIA_OK);
    cr_assert_eq(
        heartbeat_held(&fx, b, &forged, 1, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "another secret for the same job is refused");
    held_t other_spec = h;
    other_spec.spec.heads = 8;
    cr_assert_eq(
        heartbeat_held(&fx, b, &other_spec, 1, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u, "another spec for the same job is refused");
    cr_assert_eq(heartbeat_held(&fx, c, &h, 0, JS(LOADING), "held job secret", &n_drop, &describe),
                 STRIA_OK);
    cr_expect_eq(n_drop, 1u, "a second worker for rank 0 is refused");
    cr_expect_eq(get_held(&fx, &forged, &forged.secret, &state, failure, sizeof(failure)),
                 STRIA_ERR_BUSY, "the forged description did not make a job");

    /* rank 1 never comes: after the window the job fails, naming it, and
     * the worker of rank 0 is told to drop it */
    usleep(1300000);
    cr_assert_eq(get_held(&fx, &h, &h.secret, &state, failure, sizeof(failure)), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(state, JS(FAILED));
    cr_expect(strstr(failure, "rank(s) 1 ") != NULL && strstr(failure, "recovery window"), "%s",
              failure);
    uint64_t id = h.id, drop[8];
    cr_expect_eq(heartbeat(&fx, a, &id, 1, 0, drop, &n_drop, NULL), STRIA_OK);
    cr_expect_eq(n_drop, 1u);
    /* after the window a description is refused outright (dropped) */
    held_t late;
    held_init(&late, 5550009, 2);
    cr_assert_eq(
        heartbeat_held(&fx, a, &late, 0, JS(LOADING), "held job secret", &n_drop, &describe),
        STRIA_OK);
    cr_expect_eq(n_drop, 1u);
    cr_expect_eq(get_held(&fx, &late, &late.secret, &state, failure, sizeof(failure)),
                 STRIA_ERR_NOT_FOUND);
    fx_stop(&fx);
}
