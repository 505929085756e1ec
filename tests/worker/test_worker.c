/* The worker library in one process: a coordinator and 2-3 workers
 * (stria_worker_start) on loopback with in-process ring links, driven over
 * raw RPC: a job's lifecycle against the in-process ring, refusals, drops
 * during transfers, and stopping a worker that holds a job or runs a pass. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tref.h"
#include "worker_fixture.h"

#define TEST_TIMEOUT_S 60

static void start(wf_t *f, int n, double step_timeout_s)
{
    cr_assert_eq(wf_start(f, n, step_timeout_s), STRIA_OK, "%s", stria_error_msg());
}

/* Compares rank `rank`'s compact shard of a tensor with the full reference:
 * `rows_of` is 1 for [batch, seq, heads, dim], else LSE [batch, heads, seq]. */
static void expect_shard(const wf_job_t *job, int rank, const float *got, uint64_t len,
                         const float *ref, int64_t heads, bool lse, const char *what)
{
    int64_t v = job->valid[rank], d = job->shape.head_dim, seq = job->shape.call.seq_len;
    uint64_t want = (uint64_t)(job->shape.call.batch * v * heads * (lse ? 1 : d)) * sizeof(float);
    cr_assert_eq(len, want, "%s rank %d: %llu bytes, want %llu", what, rank,
                 (unsigned long long)len, (unsigned long long)want);
    for (int64_t h = 0; h < (lse ? heads : 1); h++)
        for (int64_t i = 0; i < v; i++) {
            int64_t pos = stria_layout_position(&job->layout, rank, i);
            size_t n = lse ? 1 : (size_t)(heads * d);
            const float *g = lse ? got + h * v + i : got + i * (int64_t)n;
            const float *r = lse ? ref + h * seq + pos : ref + pos * (int64_t)n;
            for (size_t e = 0; e < n; e++)
                cr_assert(fabsf(g[e] - r[e]) <= 1e-4f * (1.0f + fabsf(r[e])),
                          "%s rank %d token %lld: %g, want %g", what, rank, (long long)pos,
                          (double)g[e], (double)r[e]);
        }
}

/* A pass of one rank on a thread of its own. */
typedef struct {
    wf_t *f;
    const wf_job_t *job;
    int rank;
    pthread_t th;
    stria_status_t st;
    char msg[512];
} pass_bg_t;

static void *pass_bg_main(void *arg)
{
    pass_bg_t *bg = arg;
    stria_rpc_client_t *cl = wf_client(bg->f, bg->job->widx[bg->rank]);
    bg->st = cl != NULL ? wf_pass_on(cl, bg->job, bg->rank, false) : STRIA_ERR_IO;
    stria_rpc_client_close(cl);
    snprintf(bg->msg, sizeof(bg->msg), "%s", stria_error_msg());
    return NULL;
}

static void pass_bg_start(pass_bg_t *bg, wf_t *f, const wf_job_t *job, int rank)
{
    memset(bg, 0, sizeof(*bg));
    bg->f = f;
    bg->job = job;
    bg->rank = rank;
    cr_assert_eq(pthread_create(&bg->th, NULL, pass_bg_main, bg), 0);
}

static bool wait_running(wf_t *f, int widx, uint32_t n)
{
    stria_worker_usage_t u;
    for (int i = 0; i < 1000; i++) {
        stria_worker_usage(f->w[widx], &u);
        if (u.running_passes == n)
            return true;
        usleep(2000);
    }
    return false;
}

Test(worker, job_lifecycle_matches_the_local_ring, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    start(&f, 3, 5.0);
    cr_assert_eq(wf_submit(&f, 96, 0, &job), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(job.n, 3);
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    float *d_o = wf_tensor(&job, 2, 4);
    size_t nq = (size_t)(job.shape.call.seq_len * 2 * 16), nk = nq / 2;
    float *o = calloc(nq, 4), *lse = calloc((size_t)(2 * job.shape.call.seq_len), 4);
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
    stria_ring_local_opts_t lo = {
        .layout = STRIA_LAYOUT_STRIPED, .n_ranks = job.n, .passes = STRIA_RING_PASS_FWD_BWD};
    void *const out[TJ_N_OUT] = {o, lse, dq, dk, dv};
    cr_assert_eq(tref_ring_run(&job.shape, &lo, q, k, v, d_o, out, NULL), STRIA_OK, "%s",
                 stria_error_msg());

    cr_assert_eq(wf_put_all(&f, &job, q, k, v, d_o), STRIA_OK, "%s", stria_error_msg());
    stria_worker_usage_t u;
    stria_worker_usage(f.w[0], &u);
    cr_expect_eq(u.jobs, 1);
    cr_expect_gt(u.memory_in_use_bytes, 0);
    /* two forwards: the second runs on the job's kept pass object */
    for (int pass = 0; pass < 2; pass++)
        cr_assert_eq(wf_pass_all(&f, &job, false), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_pass_all(&f, &job, true), STRIA_OK, "%s", stria_error_msg());
    static const struct {
        Stria__V1__Tensor t;
        int heads;
        bool lse;
        const char *name;
    } outs[] = {{STRIA__V1__TENSOR__TENSOR_O, 2, false, "O"},
                {STRIA__V1__TENSOR__TENSOR_LSE, 2, true, "LSE"},
                {STRIA__V1__TENSOR__TENSOR_DQ, 2, false, "dQ"},
                {STRIA__V1__TENSOR__TENSOR_DK, 1, false, "dK"},
                {STRIA__V1__TENSOR__TENSOR_DV, 1, false, "dV"}};
    const float *refs[] = {o, lse, dq, dk, dv};
    for (int r = 0; r < job.n; r++)
        for (int i = 0; i < 5; i++) {
            void *got;
            uint64_t len;
            cr_assert_eq(wf_get(&f, &job, r, outs[i].t, &got, &len), STRIA_OK, "%s",
                         stria_error_msg());
            expect_shard(&job, r, got, len, refs[i], outs[i].heads, outs[i].lse, outs[i].name);
            free(got);
        }
    cr_assert_eq(wf_release(&f, &job), STRIA_OK, "%s", stria_error_msg());
    for (int i = 0; i < f.n; i++)
        cr_expect(wf_wait_usage(&f, i, 0, 0, 5.0), "worker %d keeps the released job", i);
    free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
    wf_stop(&f);
}

Test(worker, refusals_name_the_problem, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job, ghost;
    start(&f, 2, 5.0);
    cr_assert_eq(wf_submit(&f, 64, 0, &job), STRIA_OK, "%s", stria_error_msg());
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    void *out;
    uint64_t len;

    ghost = job;
    ghost.id = job.id + 1000;
    cr_expect_eq(wf_pass(&f, &ghost, 0, false), STRIA_ERR_NOT_FOUND);
    cr_expect(strstr(stria_error_msg(), "not held by this worker") != NULL, "%s",
              stria_error_msg());
    cr_expect_eq(wf_get(&f, &ghost, 0, STRIA__V1__TENSOR__TENSOR_O, &out, &len),
                 STRIA_ERR_NOT_FOUND);

    /* rank 0's inputs, then rank 1's sent to rank 0's worker */
    uint64_t sl;
    void *s = wf_shard(&job, 0, q, 2, &sl);
    cr_assert_eq(wf_put(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_Q, s, sl, 0, sl), STRIA_OK, "%s",
                 stria_error_msg());
    wf_job_t wrong = job;
    wrong.widx[1] = job.widx[0];
    cr_expect_eq(wf_put(&f, &wrong, 1, STRIA__V1__TENSOR__TENSOR_Q, s, sl, 0, sl),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "holds rank 0, not 1") != NULL, "%s", stria_error_msg());
    free(s);

    /* K complete, V half: the forward is refused naming V */
    s = wf_shard(&job, 0, k, 1, &sl);
    cr_assert_eq(wf_put(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_K, s, sl, 0, sl), STRIA_OK);
    free(s);
    s = wf_shard(&job, 0, v, 1, &sl);
    cr_assert_eq(wf_put(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_V, s, sl, 0, sl / 2), STRIA_OK);
    free(s);
    cr_expect_eq(wf_pass(&f, &job, 0, false), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "input V incomplete") != NULL, "%s", stria_error_msg());
    cr_expect_eq(wf_pass(&f, &job, 0, true), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "input Q") == NULL, "%s", stria_error_msg());
    cr_expect_eq(wf_get(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_O, &out, &len),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "not ready") != NULL, "%s", stria_error_msg());

    /* a pass while one runs: rank 0 alone waits for rank 1 */
    cr_assert_eq(wf_put_all(&f, &job, q, k, v, NULL), STRIA_OK, "%s", stria_error_msg());
    pass_bg_t bg;
    pass_bg_start(&bg, &f, &job, 0);
    cr_assert(wait_running(&f, job.widx[0], 1), "rank 0's pass did not start");
    cr_expect_eq(wf_pass(&f, &job, 0, false), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "already running") != NULL, "%s", stria_error_msg());
    s = wf_shard(&job, 0, q, 2, &sl);
    cr_expect_eq(wf_put(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_Q, s, sl, 0, sl), STRIA_ERR_BUSY);
    free(s);
    /* rank 1 joins: both complete */
    cr_expect_eq(wf_pass(&f, &job, 1, false), STRIA_OK, "%s", stria_error_msg());
    pthread_join(bg.th, NULL);
    cr_expect_eq(bg.st, STRIA_OK, "%s", bg.msg);
    free(q), free(k), free(v);
    wf_stop(&f);
}

/* PutInput of a large Q on a thread of its own. */
typedef struct {
    wf_t *f;
    const wf_job_t *job;
    const void *shard;
    uint64_t len;
    stria_status_t st;
} put_bg_t;

static void *put_bg_main(void *arg)
{
    put_bg_t *p = arg;
    stria_rpc_client_t *cl = wf_client(p->f, p->job->widx[0]);
    Stria__V1__PutInputRequest req = STRIA__V1__PUT_INPUT_REQUEST__INIT;
    req.job_id = p->job->id;
    req.tensor = STRIA__V1__TENSOR__TENSOR_Q;
    req.total_bytes = p->len;
    p->st = cl != NULL ? wf_call_job(cl, STRIA_RPC_WORKER_PUT_INPUT, &req.base, p->shard, p->len,
                                     p->job, NULL)
                       : STRIA_ERR_IO;
    stria_rpc_client_close(cl);
    return NULL;
}

Test(worker, drop_during_a_transfer_frees_the_job_after_it, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    uint64_t sl;
    start(&f, 2, 5.0);
    int w0;

    /* between two chunks: freed at once; the next chunk is refused or
     * starts the job afresh, never lands in freed memory */
    cr_assert_eq(wf_submit(&f, 64, 0, &job), STRIA_OK, "%s", stria_error_msg());
    w0 = job.widx[0];
    float *q = wf_tensor(&job, 2, 1);
    void *s = wf_shard(&job, 0, q, 2, &sl);
    cr_assert_eq(wf_put(&f, &job, 0, STRIA__V1__TENSOR__TENSOR_Q, s, sl, 0, sl / 2), STRIA_OK);
    cr_assert_eq(wf_drop(&f, w0, &job), STRIA_OK);
    cr_expect(wf_wait_usage(&f, w0, 0, 0, 2.0), "the dropped job's memory is still held");
    free(s), free(q);

    /* during a large PutInput: the job goes once the transfer ends */
    wf_job_t big;
    cr_assert_eq(wf_submit(&f, 32768, 0, &big), STRIA_OK, "%s", stria_error_msg());
    q = wf_tensor(&big, 2, 5);
    s = wf_shard(&big, 0, q, 2, &sl);
    put_bg_t p = {&f, &big, s, sl, STRIA_OK};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, put_bg_main, &p), 0);
    stria_worker_usage_t u;
    for (int i = 0; i < 2000; i++) { /* the job exists once the payload starts */
        stria_worker_usage(f.w[w0], &u);
        if (u.jobs > 0)
            break;
        usleep(500);
    }
    cr_expect_eq(wf_drop(&f, w0, &big), STRIA_OK);
    pthread_join(th, NULL);
    cr_expect(wf_wait_usage(&f, w0, 0, 0, 2.0), "the dropped job's memory is still held");
    free(s), free(q);

    /* the worker keeps serving: a fresh job runs */
    wf_job_t again;
    cr_assert_eq(wf_submit(&f, 64, 0, &again), STRIA_OK, "%s", stria_error_msg());
    float *a = wf_tensor(&again, 2, 6), *k = wf_tensor(&again, 1, 7), *v = wf_tensor(&again, 1, 8);
    cr_assert_eq(wf_put_all(&f, &again, a, k, v, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(wf_pass_all(&f, &again, false), STRIA_OK, "%s", stria_error_msg());
    free(a), free(k), free(v);
    wf_stop(&f);
}

/* A job dropped while its pass still connects its ring link: the pass ends
 * at once (the link's connect is cancelled) instead of at the connect
 * timeout (20 s here; a chaos run saw such a pass keep dialling a worker
 * that was shutting down). UCX links; rank 1 never runs its pass, so rank
 * 0's handshake waits. */
Test(worker, a_drop_cancels_a_pass_still_connecting, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t job;
    wf_opts_t o = {.step_timeout_s = 5, .connect_timeout_s = 20, .ucx = true};
    cr_assert_eq(wf_start_with(&f, 2, &o), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_submit(&f, 64, 0, &job), STRIA_OK, "%s", stria_error_msg());
    float *q = wf_tensor(&job, 2, 1), *k = wf_tensor(&job, 1, 2), *v = wf_tensor(&job, 1, 3);
    cr_assert_eq(wf_put_all(&f, &job, q, k, v, NULL), STRIA_OK, "%s", stria_error_msg());
    pass_bg_t bg;
    pass_bg_start(&bg, &f, &job, 0);
    cr_assert(wait_running(&f, job.widx[0], 1), "rank 0's pass did not start");
    usleep(300000); /* connecting */
    double t0 = stria_time_now();
    cr_assert_eq(wf_drop(&f, job.widx[0], &job), STRIA_OK, "%s", stria_error_msg());
    pthread_join(bg.th, NULL);
    double took = stria_time_now() - t0;
    cr_expect_eq(bg.st, STRIA_ERR_CANCELLED, "%s", bg.msg);
    cr_expect(strstr(bg.msg, "connect cancelled") != NULL, "%s", bg.msg);
    cr_expect_lt(took, 2.0, "the pass ended %.2f s after the drop", took);
    cr_expect(wf_wait_usage(&f, job.widx[0], 0, 0, 5), "rank 0's worker still holds the job");
    free(q), free(k), free(v);
    wf_stop(&f);
}

Test(worker, stop_with_a_job_held_and_a_pass_running, .timeout = TEST_TIMEOUT_S)
{
    wf_t f;
    wf_job_t held, lone;
    start(&f, 2, 0.3);
    cr_assert_eq(wf_submit(&f, 64, 0, &held), STRIA_OK, "%s", stria_error_msg());
    float *q = wf_tensor(&held, 2, 1), *k = wf_tensor(&held, 1, 2), *v = wf_tensor(&held, 1, 3);
    cr_assert_eq(wf_put_all(&f, &held, q, k, v, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_pass_all(&f, &held, false), STRIA_OK, "%s", stria_error_msg());
    /* a second job whose rank 0 runs alone: the shutdown gives it one step
     * deadline (1 s), by which it failed or is aborted */
    cr_assert_eq(wf_submit(&f, 64, 1000, &lone), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(wf_put_all(&f, &lone, q, k, v, NULL), STRIA_OK, "%s", stria_error_msg());
    pass_bg_t bg;
    pass_bg_start(&bg, &f, &lone, 0);
    int w0 = lone.widx[0];
    cr_assert(wait_running(&f, w0, 1), "rank 0's pass did not start");
    stria_worker_usage_t u;
    stria_worker_usage(f.w[w0], &u);
    cr_expect_eq(u.jobs, 2);
    double t0 = stria_time_now();
    int still = stria_worker_shutdown(f.w[w0], "shut down (test)");
    cr_expect_eq(still, 0, "a pass survived the abort");
    cr_expect_lt(stria_time_now() - t0, 10.0);
    pthread_join(bg.th, NULL);
    cr_expect_neq(bg.st, STRIA_OK);
    /* new work is refused while the server still answers */
    cr_expect_eq(wf_pass(&f, &held, 0, false), STRIA_ERR_BUSY);
    stria_worker_stop(f.w[w0]);
    f.w[w0] = NULL;
    stria_rpc_client_close(f.wc[w0]);
    f.wc[w0] = NULL;
    free(q), free(k), free(v);
    wf_stop(&f); /* the other worker, with its copy of the held job */
}
