/* Failure classes and automatic retries, with real processes on loopback: a
 * worker killed before or during a forward makes the forward fail
 * retryably, and libstria submits it again inside the call without the
 * lost worker (on fewer workers when the ring size is free, on a spare when
 * it is fixed), with results bit for bit those of the in-process ring that
 * finally ran; bad input, a cancellation and a refused credential are not
 * retryable. */
#include <criterion/criterion.h>

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "deploy_util.h"
#include "fault_util.h"

/* SIGKILL to worker i, reaped; the cluster forgets it. */
static void kill_worker(dcluster_t *c, int i)
{
    cr_assert_not_null(c->workers[i]);
    test_proc_stop(c->workers[i], SIGKILL, 5);
    c->workers[i] = NULL;
}

/* Forward (and backward) of j through the service; the results must be
 * those of the in-process ring the job finally ran on. */
static void run_and_check(stria_client_t *cl, fu_job_t *j, stria_call_stats_t *fs, int *ring_out)
{
    stria_job_t *job = NULL;
    stria_status_t st =
        stria_client_forward(cl, &j->spec, j->q, j->k, j->v, j->o, j->lse, NULL, NULL, fs, &job);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_client_backward(job, j->g, j->dq, j->dk, j->dv, NULL, NULL, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    int ring = stria_job_ring_size(job);
    stria_layout_kind_t layout = stria_job_layout(job);
    cr_assert_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    char why[256];
    cr_expect(fu_ring_equal(j, ring, layout, true, why, sizeof(why)), "%s", why);
    *ring_out = ring;
}

/* `striactl --json job ID`'s output (malloc'ed). */
static char *job_json(const dcluster_t *c, uint64_t id)
{
    char *js = dc_job_json(c, NULL, id);
    cr_assert_not_null(js, "striactl job %llu failed", (unsigned long long)id);
    return js;
}

/* The active jobs `striactl --json jobs` lists (it lists only unfinished
 * ones without --all). */
static int active_jobs(const dcluster_t *c)
{
    char *out = NULL;
    cr_assert_eq(dc_striactl(c, NULL, &out, NULL, "--json", "jobs", NULL), 0);
    int n = 0;
    for (const char *p = out; (p = strstr(p, "\"state\":")) != NULL; p++)
        n++;
    free(out);
    return n;
}

Test(faults, worker_killed_after_submit_retries_on_the_rest, .timeout = 300)
{
    dcluster_t c;
    /* heartbeats of 1 s: the coordinator still counts the killed worker
     * healthy for 3 s, so the forwards below are assigned to it */
    dc_opts_t o = {.heartbeat_period_s = 1.0};
    dc_start(&c, 4, &o);
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 96, 2, 2, 16, STRIA_DTYPE_F32, true, 7));
    kill_worker(&c, 3);

    /* without retries: the failure says so, names the worker, is retryable */
    stria_client_t *none = dc_client(&c, NULL, "test_faults", -1);
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    stria_job_t *job = NULL;
    stria_status_t st =
        stria_client_forward(none, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, &fs, &job);
    cr_assert_neq(st, STRIA_OK);
    cr_expect(stria_error_retryable(), "a lost worker is retryable: %s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), c.worker_rpc[3]) != NULL, "'%s' does not name %s",
              stria_error_msg(), c.worker_rpc[3]);
    cr_expect_eq(fs.retries, 0u);
    cr_expect_null(job);
    stria_client_close(none);

    /* with the default retries: the same forward succeeds on 3 workers; a
     * job the client holds open meanwhile stays its own (closing the client
     * releases it) */
    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);
    fu_job_t h;
    cr_assert(fu_job_init(&h, 1, 32, 2, 2, 16, STRIA_DTYPE_F32, true, 8));
    h.spec.ring_size = 1;
    stria_job_t *held = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &h.spec, h.q, h.k, h.v, h.o, h.lse, NULL, NULL, NULL, &held),
        STRIA_OK, "%s", stria_error_msg());
    stria_call_stats_t fs2 = STRIA_CALL_STATS_INIT;
    int ring = 0;
    run_and_check(cl, &j, &fs2, &ring);
    cr_expect_eq(fs2.retries, 1u, "one retry expected, %u", fs2.retries);
    cr_expect_eq(ring, 3);
    cr_expect_eq(active_jobs(&c), 1, "the held job");
    stria_client_close(cl);
    cr_expect_eq(active_jobs(&c), 0, "closing the client released the held job");
    fu_job_free(&h);
    fu_job_free(&j);
    dc_stop(&c);
}

/* A whole-sequence job of 2 head groups x rings of 2 (5 workers: a spare)
 * whose worker is killed after its submission: the open of the ring that
 * got it fails, and the job's next try goes without the worker that open
 * blamed, so one retry succeeds (the coordinator still counts the worker
 * healthy for 3 s); every group's outputs equal its in-process ring. The
 * victim is the first worker of the coordinator's ring order (host, then
 * RPC address), which head group 0's ring takes first. */
Test(faults, a_head_grouped_jobs_retry_goes_without_the_blamed_worker, .timeout = 300)
{
    dcluster_t c;
    dc_opts_t o = {.heartbeat_period_s = 1.0};
    dc_start(&c, 5, &o);
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 96, 4, 2, 16, STRIA_DTYPE_F32, true, 21));
    j.spec.ring_size = 4;
    j.spec.head_groups = 2;
    int victim = 0;
    for (int i = 1; i < c.n_workers; i++)
        if (strcmp(c.worker_rpc[i], c.worker_rpc[victim]) < 0)
            victim = i;
    kill_worker(&c, victim);

    /* without retries: the worker was assigned (the failure names it) */
    stria_client_t *none = dc_client(&c, NULL, "test_faults", -1);
    stria_job_t *job = NULL;
    stria_status_t st =
        stria_client_forward(none, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job);
    cr_assert_neq(st, STRIA_OK, "a job assigned a killed worker succeeded");
    cr_expect(stria_error_retryable(), "a lost worker is retryable: %s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), c.worker_rpc[victim]) != NULL, "'%s' does not name %s",
              stria_error_msg(), c.worker_rpc[victim]);
    stria_client_close(none);

    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    double t0 = stria_time_now();
    st = stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, &fs, &job);
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(fs.retries, 1u, "one retry expected, %u", fs.retries);
    cr_expect_lt(stria_time_now() - t0, 2.5, "the retry waited for the coordinator's verdict");
    cr_assert_eq(stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    cr_assert_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    for (int g = 0; g < 2; g++) {
        fu_job_t gj;
        char why[256];
        cr_assert(fu_group_job(&j, g, 2, &gj), "out of memory");
        cr_expect(fu_ring_equal(&gj, 2, STRIA_LAYOUT_STRIPED, true, why, sizeof(why)),
                  "head group %d: %s", g, why);
        fu_job_free(&gj);
    }
    stria_client_close(cl);
    fu_job_free(&j);
    dc_stop(&c);
}

/* The index of the worker at rpc address `addr`, -1 if none. */
static int worker_index(const dcluster_t *c, const char *addr, size_t len)
{
    for (int i = 0; i < c->n_workers; i++)
        if (strlen(c->worker_rpc[i]) == len && strncmp(c->worker_rpc[i], addr, len) == 0)
            return i;
    return -1;
}

Test(faults, fixed_ring_size_takes_a_spare_or_says_busy, .timeout = 300)
{
    dcluster_t c;
    dc_opts_t o = {.heartbeat_period_s = 1.0};
    dc_start(&c, 5, &o);
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 128, 2, 1, 16, STRIA_DTYPE_BF16, true, 11));
    j.spec.ring_size = 4;
    j.spec.layout = STRIA_LAYOUT_ZIGZAG;
    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);

    /* which worker the window of 4 starts with: that one is killed */
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    char *js = job_json(&c, stria_job_id(job));
    cr_assert_eq(stria_client_release(job), STRIA_OK);
    const char *ranks = strstr(js, "\"ranks\":");
    cr_assert_not_null(ranks, "%s", js);
    const char *a = strstr(ranks, "\"rpc_address\":\"");
    cr_assert_not_null(a);
    a += strlen("\"rpc_address\":\"");
    int victim = worker_index(&c, a, strcspn(a, "\""));
    cr_assert_geq(victim, 0, "rank 0's worker is none of ours: %s", js);
    free(js);
    kill_worker(&c, victim);

    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    int ring = 0;
    run_and_check(cl, &j, &fs, &ring);
    cr_expect_eq(fs.retries, 1u);
    cr_expect_eq(ring, 4, "the ring size stays as the spec fixed it");

    /* a ring of 5 has no spare left: the retry is refused as busy, and the
     * message has both tries' reasons; the library stops there, but the
     * failure stays retryable for the trainer (the worker may come back) */
    j.spec.ring_size = 5;
    stria_call_stats_t fs2 = STRIA_CALL_STATS_INIT;
    stria_status_t st =
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, &fs2, &job);
    cr_assert_eq(st, STRIA_ERR_BUSY, "%s", stria_error_msg());
    const char *msg = stria_error_msg();
    cr_expect(strstr(msg, "try 1: ") && strstr(msg, "try 2: ") && strstr(msg, "1 excluded"),
              "message: %s", msg);
    cr_expect(strstr(msg, "too few workers left for now"), "message: %s", msg);
    cr_expect(stria_error_retryable(), "busy after a lost worker is retryable: %s", msg);
    cr_expect_eq(fs2.retries, 1u);
    stria_client_close(cl);
    fu_job_free(&j);
    dc_stop(&c);
}

Test(faults, held_job_fails_retryable_when_its_worker_dies, .timeout = 300)
{
    dcluster_t c;
    dc_start(&c, 3, NULL);
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 64, 2, 2, 16, STRIA_DTYPE_F32, true, 3));
    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    kill_worker(&c, 1);

    /* the coordinator fails the job as retryable, blaming the worker */
    char *js = NULL;
    double end = stria_time_now() + 10;
    while (stria_time_now() < end) {
        free(js);
        js = job_json(&c, stria_job_id(job));
        if (strstr(js, "\"state\":\"failed\"") != NULL)
            break;
        usleep(100000);
    }
    cr_assert(strstr(js, "\"state\":\"failed\""), "%s", js);
    cr_expect(strstr(js, "\"failure_retryable\":true"), "%s", js);
    cr_expect(strstr(js, "\"blamed_worker_ids\":[]") == NULL, "no worker blamed: %s", js);
    free(js);
    char ids[32], *out = NULL;
    snprintf(ids, sizeof(ids), "%llu", (unsigned long long)stria_job_id(job));
    cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "job", ids, NULL), 0);
    cr_expect(strstr(out, "retryable: yes"), "%s", out);
    cr_expect(strstr(out, "blamed: worker "), "%s", out);
    free(out);

    /* the backward is not retried by the library: it fails retryable */
    stria_status_t st = stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL);
    cr_assert_neq(st, STRIA_OK);
    cr_expect(stria_error_retryable(), "%s", stria_error_msg());
    stria_client_release(job);
    stria_client_close(cl);
    fu_job_free(&j);
    dc_stop(&c);
}

typedef struct {
    dcluster_t *c;
    int victim;
    bool killed;
} kill_arg_t;

/* Kills the victim at the first progress report of the forward pass. */
static void kill_in_pass(void *arg, stria_phase_t phase, double done, double total)
{
    kill_arg_t *k = arg;
    (void)done, (void)total;
    if (phase == STRIA_PHASE_FORWARD && !k->killed) {
        kill(test_proc_pid(k->c->workers[k->victim]), SIGKILL);
        k->killed = true;
    }
}

Test(faults, worker_killed_during_the_pass_retries, .timeout = 600)
{
    dcluster_t c;
    dc_start(&c, 4, NULL);
    fu_job_t j;
    /* long enough a pass for a progress report (every 0.2 s), even when the
     * machine is busy with other suites */
    cr_assert(fu_job_init(&j, 1, 8192, 4, 2, 64, STRIA_DTYPE_F32, true, 5));
    j.spec.layout = STRIA_LAYOUT_STRIPED;
    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);
    kill_arg_t k = {.c = &c, .victim = 2};
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    stria_job_t *job = NULL;
    stria_status_t st =
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, kill_in_pass, &k, &fs, &job);
    cr_assert(k.killed, "the pass ended before its first progress report");
    test_proc_stop(c.workers[2], SIGKILL, 5);
    c.workers[2] = NULL;
    cr_assert_eq(st, STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(fs.retries, 1u);
    int ring = stria_job_ring_size(job);
    cr_expect_eq(ring, 3);
    char why[256];
    cr_expect(fu_ring_equal(&j, ring, stria_job_layout(job), false, why, sizeof(why)), "%s", why);
    stria_client_release(job);
    cr_expect_eq(active_jobs(&c), 0);
    stria_client_close(cl);
    fu_job_free(&j);
    dc_stop(&c);
}

Test(faults, bad_input_cancel_and_auth_are_not_retryable, .timeout = 300)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 64, 2, 2, 16, STRIA_DTYPE_F32, true, 9));
    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);

    /* bad input */
    fu_job_t bad = j;
    bad.spec.kv_heads = 3; /* heads 2 is no multiple */
    stria_call_stats_t fs = STRIA_CALL_STATS_INIT;
    stria_job_t *job = NULL;
    stria_status_t st =
        stria_client_forward(cl, &bad.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, &fs, &job);
    cr_expect_eq(st, STRIA_ERR_INVALID_ARG, "%s", stria_error_msg());
    cr_expect(!stria_error_retryable());
    cr_expect_eq(fs.retries, 0u);

    /* cancelled by an admin */
    cr_assert_eq(
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    char ids[32];
    snprintf(ids, sizeof(ids), "%llu", (unsigned long long)stria_job_id(job));
    cr_assert_eq(dc_striactl(&c, NULL, NULL, NULL, "cancel", ids, NULL), 0);
    st = stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL);
    cr_expect_neq(st, STRIA_OK);
    cr_expect(!stria_error_retryable(), "a cancellation: %s", stria_error_msg());
    char *js = job_json(&c, stria_job_id(job));
    cr_expect(strstr(js, "\"failure_retryable\":false"), "%s", js);
    free(js);
    stria_client_release(job);
    stria_client_close(cl);

    /* a credential the service does not prove back */
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    p.coordinator = c.coord_addr;
    p.token = "a-token-the-service-does-not-have";
    stria_client_t *auth = NULL;
    st = stria_client_connect(&p, &auth);
    cr_expect_eq(st, STRIA_ERR_AUTH, "%s", stria_error_msg());
    cr_expect(!stria_error_retryable());
    fu_job_free(&j);
    dc_stop(&c);
}

/* A sharded job whose rank 1 never arrives because its worker died: the
 * arrival deadline (or the death, whichever the coordinator sees first)
 * fails it as retryable, and rank 0's call says so. */
Test(faults, sharded_rank_whose_worker_died_is_retryable, .timeout = 300)
{
    dcluster_t c;
    dc_opts_t o = {.heartbeat_period_s = 0.5};
    dc_start(&c, 2, &o);
    stria_client_t *cl = dc_client(&c, NULL, "test_faults", 0);
    stria_job_spec_t spec = STRIA_JOB_SPEC_INIT;
    spec.batch = 1;
    spec.seq_len = 64;
    spec.heads = spec.kv_heads = 2;
    spec.head_dim = 16;
    spec.dtype = STRIA_DTYPE_F32;
    spec.layout = STRIA_LAYOUT_STRIPED;
    spec.ring_size = 2;
    spec.arrival_timeout_s = 1.0;
    stria_job_t *job = NULL;
    cr_assert_eq(stria_client_submit(cl, &spec, &job), STRIA_OK, "%s", stria_error_msg());
    char *js = job_json(&c, stria_job_id(job));
    const char *a = strstr(js, "\"rank\":1,");
    cr_assert_not_null(a, "%s", js);
    a = strstr(a, "\"rpc_address\":\"");
    cr_assert_not_null(a);
    a += strlen("\"rpc_address\":\"");
    int victim = worker_index(&c, a, strcspn(a, "\""));
    cr_assert_geq(victim, 0, "%s", js);
    free(js);
    kill_worker(&c, victim);

    int64_t n = stria_job_shard_tokens(job, 0) * spec.heads * spec.head_dim;
    float *buf = calloc((size_t)n * 4 + (size_t)(spec.heads * 64), sizeof(float));
    cr_assert_not_null(buf);
    stria_status_t st =
        stria_client_forward_shard(job, 0, buf, buf + n, buf + 2 * n, buf + 3 * n, buf + 4 * n);
    cr_expect_neq(st, STRIA_OK);
    cr_expect(stria_error_retryable(), "%s", stria_error_msg());
    js = job_json(&c, stria_job_id(job));
    cr_expect(strstr(js, "\"failure_retryable\":true"), "%s", js);
    free(js);
    free(buf);
    stria_client_release(job);
    stria_client_close(cl);
    dc_stop(&c);
}

/* stria-run says whether a failure is retryable, and retries by itself. */
Test(faults, stria_run_shows_the_class_and_retries, .timeout = 300)
{
    dcluster_t c;
    dc_opts_t o = {.heartbeat_period_s = 1.0};
    dc_start(&c, 3, &o);
    char q[300], k[300], v[300], out[300];
    const char *names[3] = {"q", "k", "v"};
    char *paths[3] = {q, k, v};
    for (int i = 0; i < 3; i++) {
        snprintf(paths[i], 300, "%s/%s.npy", c.dir, names[i]);
        char seed[8];
        snprintf(seed, sizeof(seed), "%d", i + 1);
        char *argv[] = {STRIA_RUN_BIN, "random", "--shape", "1,64,2,16", "--seed",
                        seed,          "--out",  paths[i],  NULL};
        cr_assert_eq(dc_run(argv, NULL, 30, NULL, NULL), 0);
    }
    snprintf(out, sizeof(out), "%s/out", c.dir);
    kill_worker(&c, 2);
    char *err = NULL, *sout = NULL;
    char *no_retry[] = {
        STRIA_RUN_BIN, "submit", "--coordinator", c.coord_addr, "--q",       q,   "--k", k,
        "--v",         v,        "--out",         out,          "--retries", "0", NULL};
    cr_expect_eq(dc_run(no_retry, NULL, 60, &sout, &err), 1);
    cr_expect(strstr(err, "the failure is retryable"), "stderr: %s", err);
    free(err), free(sout);
    char *retry[] = {
        STRIA_RUN_BIN, "submit", "--coordinator", c.coord_addr, "--q",     q,   "--k", k,
        "--v",         v,        "--out",         out,          "--check", NULL};
    cr_expect_eq(dc_run(retry, NULL, 60, &sout, &err), 0, "stderr: %s", err);
    cr_expect(strstr(sout, "after 1 retry"), "stdout: %s", sout);
    free(err), free(sout);
    dc_stop(&c);
}
