/* A coordinator restart with real processes on loopback: a job submitted
 * before the restart (SIGTERM or SIGKILL of the coordinator, a new one on
 * the same address) is rebuilt from its workers' reports, `striactl jobs`
 * of the new coordinator shows it, and the same client handle runs its
 * backward and another forward with results bit for bit those of the
 * in-process ring; a job whose worker died meanwhile fails after the
 * recovery window with a reason naming the missing rank. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "deploy_util.h"
#include "fault_util.h"
#include "stria_layout.h"

#define WINDOW_S "3" /* the coordinator's --recovery-window in these tests */

/* Credentials (made by the coordinator) of the tests that use them:
 * client, worker, admin; "" : none. */
static char g_tok[3][300];

static void make_creds(const dcluster_t *c)
{
    static const char *const names[3] = {"client-token", "worker-token", "admin-token"};
    char dir[300];
    snprintf(dir, sizeof(dir), "%s/credentials", c->dir);
    char *argv[] = {STRIA_COORDINATOR_BIN, "--gen-credentials", dir, NULL};
    char *err = NULL;
    cr_assert_eq(dc_run(argv, NULL, 30, NULL, &err), 0, "--gen-credentials: %s", err);
    free(err);
    for (int i = 0; i < 3; i++)
        snprintf(g_tok[i], sizeof(g_tok[i]), "%.200s/%s", dir, names[i]);
}

static const char *admin_token(void)
{
    return g_tok[2][0] ? g_tok[2] : NULL;
}

static stria_client_t *connect_client(const dcluster_t *c)
{
    return dc_client(c, g_tok[0][0] ? g_tok[0] : NULL, "test_restart", 0);
}

/* Polls the new coordinator until it knows job `id` in a state other than
 * `not_state` (NULL: any); returns its JSON and the seconds it took. */
static char *wait_job(const dcluster_t *c, uint64_t id, const char *not_state, double timeout_s,
                      double *took)
{
    double t0 = stria_time_now();
    char *js = NULL;
    while (stria_time_now() - t0 < timeout_s) {
        js = dc_job_json(c, admin_token(), id);
        if (js != NULL && (not_state == NULL || strstr(js, not_state) == NULL))
            break;
        free(js);
        js = NULL;
        usleep(20000);
    }
    *took = stria_time_now() - t0;
    return js;
}

/* The ids `striactl --json workers` gives workers 0 .. n-1 (0: not listed). */
static void worker_ids(const dcluster_t *c, int n, uint64_t *ids)
{
    char *out = NULL, *err = NULL;
    cr_assert_eq(dc_striactl(c, admin_token(), &out, &err, "--json", "workers", NULL), 0, "%s",
                 err);
    for (int i = 0; i < n; i++) {
        char key[300];
        snprintf(key, sizeof(key), "\"rpc_address\":\"%s\"", c->worker_rpc[i]);
        const char *at = strstr(out, key), *id = NULL;
        for (const char *p = out; at != NULL && (p = strstr(p, "{\"id\":")) != NULL && p < at; p++)
            id = p;
        ids[i] = id != NULL ? strtoull(id + 6, NULL, 10) : 0;
    }
    free(out);
    free(err);
}

static void restart_keeps_the_job(int sig, bool creds)
{
    dcluster_t c;
    char *cargs[] = {"--recovery-window=" WINDOW_S, NULL};
    dc_opts_t o = {.coord_args = cargs};
    memset(g_tok, 0, sizeof(g_tok));
    dc_init(&c);
    if (creds) {
        make_creds(&c);
        o.token_file = g_tok[0];
        o.worker_token_file = g_tok[1];
        o.admin_token_file = g_tok[2];
    }
    dc_start_coordinator(&c, &o);
    /* a worker that comes and goes first: the others' ids do not start at 1,
     * as a restarted coordinator's own numbering would */
    dc_start_worker(&c, 3, &o);
    dc_wait_healthy(&c, 1, admin_token());
    cr_assert_eq(test_proc_stop(c.workers[3], SIGTERM, 10), 0);
    c.workers[3] = NULL;
    for (int i = 0; i < 3; i++)
        dc_start_worker(&c, i, &o);
    dc_wait_healthy(&c, 3, admin_token());
    uint64_t ids_before[3], ids_after[3];
    worker_ids(&c, 3, ids_before);
    stria_client_t *cl = connect_client(&c);

    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 96, 2, 2, 16, STRIA_DTYPE_F32, true, 21));
    j.spec.ring_size = 3;
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    uint64_t id = stria_job_id(job);

    double t0 = stria_time_now();
    dc_restart_coordinator(&c, &o, sig, 0.3);
    double took = 0;
    char *js = wait_job(&c, id, NULL, 10, &took);
    cr_assert_not_null(js, "the restarted coordinator did not rebuild job %llu (see %s)",
                       (unsigned long long)id, c.coord_log);
    cr_expect(strstr(js, "\"state\":\"forward-done\""), "%s", js);
    /* every worker keeps its id */
    worker_ids(&c, 3, ids_after);
    for (int i = 0; i < 3; i++) {
        cr_expect_gt(ids_before[i], 1, "worker %d: id %llu", i, (unsigned long long)ids_before[i]);
        cr_expect_eq(ids_after[i], ids_before[i],
                     "worker %d: id %llu before the restart, %llu after", i,
                     (unsigned long long)ids_before[i], (unsigned long long)ids_after[i]);
    }
    fprintf(stderr,
            "restart (%s%s): job %llu rebuilt %.3f s after the new coordinator listened "
            "(%.3f s after the stop)\n",
            sig == SIGKILL ? "SIGKILL" : "SIGTERM", creds ? ", credentials" : "",
            (unsigned long long)id, took, stria_time_now() - t0);
    free(js);

    /* striactl jobs on the new coordinator shows it */
    char *out = NULL, ids[32];
    snprintf(ids, sizeof(ids), "%llu", (unsigned long long)id);
    cr_assert_eq(dc_striactl(&c, admin_token(), &out, NULL, "jobs", NULL), 0);
    cr_expect(strstr(out, ids) != NULL, "striactl jobs does not list %s:\n%s", ids, out);
    free(out);

    /* the same handle: backward, checked against the in-process ring */
    cr_assert_eq(stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    char why[256];
    cr_expect(fu_ring_equal(&j, 3, stria_job_layout(job), true, why, sizeof(why)), "%s", why);

    /* the same client: another forward and backward */
    fu_job_t k;
    cr_assert(fu_job_init(&k, 2, 64, 4, 2, 16, STRIA_DTYPE_F32, false, 22));
    k.spec.ring_size = 2;
    stria_job_t *job2 = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &k.spec, k.q, k.k, k.v, k.o, k.lse, NULL, NULL, NULL, &job2),
        STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_client_backward(job2, k.g, k.dq, k.dk, k.dv, NULL, NULL, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    cr_expect(fu_ring_equal(&k, 2, stria_job_layout(job2), true, why, sizeof(why)), "%s", why);

    cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_client_release(job2), STRIA_OK, "%s", stria_error_msg());
    js = dc_job_json(&c, admin_token(), id);
    cr_expect(js != NULL && strstr(js, "\"state\":\"released\""), "%s", js ? js : "(none)");
    free(js);
    stria_client_close(cl);
    fu_job_free(&k);
    fu_job_free(&j);
    dc_stop(&c);
    memset(g_tok, 0, sizeof(g_tok));
}

Test(restart, sigterm_keeps_the_job, .timeout = 300)
{
    restart_keeps_the_job(SIGTERM, false);
}

Test(restart, sigkill_keeps_the_job, .timeout = 300)
{
    restart_keeps_the_job(SIGKILL, false);
}

Test(restart, sigkill_keeps_the_job_with_credentials, .timeout = 300)
{
    restart_keeps_the_job(SIGKILL, true);
}

Test(restart, job_whose_worker_died_meanwhile_fails_after_the_window, .timeout = 300)
{
    dcluster_t c;
    char *cargs[] = {"--recovery-window=" WINDOW_S, NULL};
    dc_opts_t o = {.coord_args = cargs};
    dc_start(&c, 3, &o);
    stria_client_t *cl = connect_client(&c);
    fu_job_t j;
    cr_assert(fu_job_init(&j, 1, 96, 2, 2, 16, STRIA_DTYPE_F32, true, 23));
    j.spec.ring_size = 3;
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &j.spec, j.q, j.k, j.v, j.o, j.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());
    uint64_t id = stria_job_id(job);

    /* the coordinator goes; so does a worker (each holds a rank) */
    test_proc_stop(c.coord, SIGKILL, 5);
    c.coord = NULL;
    test_proc_stop(c.workers[1], SIGKILL, 5);
    c.workers[1] = NULL;
    dc_restart_coordinator(&c, &o, 0, 0);

    /* after the window: failed, naming the missing rank, retryable */
    double took = 0;
    char *js = wait_job(&c, id, NULL, 15, &took);
    cr_assert_not_null(js, "job %llu unknown after the window (see %s)", (unsigned long long)id,
                       c.coord_log);
    cr_expect(strstr(js, "\"state\":\"failed\""), "%s", js);
    cr_expect(strstr(js, "recovery window"), "%s", js);
    cr_expect(strstr(js, "\"failure_retryable\":true"), "%s", js);
    cr_expect(took >= 2.0, "failed %.2f s after the start, before the window of " WINDOW_S " s",
              took);
    fprintf(stderr, "restart with a lost worker: job %llu failed %.3f s after the start\n",
            (unsigned long long)id, took);
    free(js);

    /* the caller hears it: the backward fails, retryable, saying why */
    stria_status_t st = stria_client_backward(job, j.g, j.dq, j.dk, j.dv, NULL, NULL, NULL);
    cr_expect_neq(st, STRIA_OK);
    cr_expect(stria_error_retryable(), "%s", stria_error_msg());
    stria_client_release(job);
    stria_client_close(cl);
    fu_job_free(&j);
    dc_stop(&c);
}

typedef struct {
    stria_client_t *cl;
    fu_job_t *j;
    stria_job_t *job;
    stria_status_t st;
    char err[512];
} queued_t;

static void *forward_thread(void *arg)
{
    queued_t *q = arg;
    fu_job_t *j = q->j;
    q->st = stria_client_forward(q->cl, &j->spec, j->q, j->k, j->v, j->o, j->lse, NULL, NULL, NULL,
                                 &q->job);
    snprintf(q->err, sizeof(q->err), "%s", q->st == STRIA_OK ? "" : stria_error_msg());
    return NULL;
}

Test(restart, queued_job_is_submitted_again, .timeout = 300)
{
    dcluster_t c;
    char *cargs[] = {"--recovery-window=" WINDOW_S, NULL};
    /* room for one job of this shape per worker: 1.5 times its admission
     * (a job holds one call: max_held 1) */
    uint64_t need = 0;
    cr_assert_eq(stria_session_rank_memory(1, 32, 2, 2, 16, STRIA_DTYPE_F32, 1, &need), STRIA_OK);
    char mem[32];
    snprintf(mem, sizeof(mem), "%llu", (unsigned long long)(need + need / 2));
    dc_opts_t o = {.coord_args = cargs, .worker_memory = mem};
    dc_start(&c, 3, &o);
    stria_client_t *cl = connect_client(&c), *cl2 = connect_client(&c);
    fu_job_t a, b;
    cr_assert(fu_job_init(&a, 1, 96, 2, 2, 16, STRIA_DTYPE_F32, true, 31));
    cr_assert(fu_job_init(&b, 1, 96, 2, 2, 16, STRIA_DTYPE_F32, true, 32));
    a.spec.ring_size = b.spec.ring_size = 3;
    stria_job_t *job = NULL;
    cr_assert_eq(
        stria_client_forward(cl, &a.spec, a.q, a.k, a.v, a.o, a.lse, NULL, NULL, NULL, &job),
        STRIA_OK, "%s", stria_error_msg());

    /* b waits in the queue behind a, on another client */
    queued_t q = {.cl = cl2, .j = &b};
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, forward_thread, &q), 0);
    double end = stria_time_now() + 10;
    char *out = NULL;
    while (stria_time_now() < end) {
        free(out);
        out = NULL;
        cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "--json", "status", NULL), 0);
        if (dc_json_number(out, "jobs_pending") == 1)
            break;
        usleep(20000);
    }
    cr_assert(dc_json_number(out, "jobs_pending") == 1, "b is not queued: %s", out);
    free(out);

    /* the restart loses the queued job (no worker held it): libstria
     * submits it again, and it queues behind the rebuilt a */
    dc_restart_coordinator(&c, &o, SIGKILL, 0.2);
    double took = 0;
    char *js = wait_job(&c, stria_job_id(job), NULL, 10, &took);
    cr_assert_not_null(js, "a was not rebuilt (see %s)", c.coord_log);
    free(js);
    end = stria_time_now() + 20;
    out = NULL;
    while (stria_time_now() < end) {
        free(out);
        out = NULL;
        cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "--json", "status", NULL), 0);
        if (dc_json_number(out, "jobs_pending") == 1)
            break;
        usleep(50000);
    }
    cr_expect(dc_json_number(out, "jobs_pending") == 1, "b was not submitted again: %s", out);
    free(out);

    /* a goes on (backward, checked), is released, and b runs */
    cr_assert_eq(stria_client_backward(job, a.g, a.dq, a.dk, a.dv, NULL, NULL, NULL), STRIA_OK,
                 "%s", stria_error_msg());
    char why[256];
    cr_expect(fu_ring_equal(&a, 3, stria_job_layout(job), true, why, sizeof(why)), "%s", why);
    cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
    pthread_join(t, NULL);
    cr_assert_eq(q.st, STRIA_OK, "%s", q.err);
    cr_expect(fu_ring_equal(&b, 3, stria_job_layout(q.job), false, why, sizeof(why)), "%s", why);
    cr_expect_eq(stria_client_release(q.job), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl2);
    stria_client_close(cl);
    fu_job_free(&b);
    fu_job_free(&a);
    dc_stop(&c);
}
