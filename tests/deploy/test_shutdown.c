/* Graceful shutdown with real processes. SIGTERM to a worker holding a job:
 * it deregisters, leaves the ring at once (not after missed heartbeats), the
 * job fails with a reason naming it, and it exits 0 within seconds. SIGTERM
 * during a pass: the pass finishes (or, with a stalled peer, fails at its
 * step deadline) before the worker leaves. SIGTERM to the coordinator: its
 * unfinished jobs are failed with a reason, logged. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"

#define SUITE_TIMEOUT 120

/* Slow heartbeats: a dead worker would be noticed after 6 s, so whatever
 * happens within a second is the deregistration. Debug logs say when a ring
 * link is up. */
static char *const debug_env[] = {"STRIA_LOG_LEVEL=debug", NULL};
static const dc_opts_t slow_hb = {
    .heartbeat_period_s = 2.0, .step_timeout_s = 5.0, .env = debug_env};

static void expect_job(const dcluster_t *c, uint64_t id, const char *state, const char *needle)
{
    char ids[32], script[1024], *out = NULL, *err = NULL;
    snprintf(ids, sizeof(ids), "%llu", (unsigned long long)id);
    int rc = dc_striactl(c, NULL, &out, &err, "--json", "job", ids, NULL);
    cr_assert_eq(rc, 0, "striactl job %s: %s", ids, err);
    snprintf(script, sizeof(script),
             "import json, sys\n"
             "j = json.loads(sys.argv[1])\n"
             "assert j['id'] == %llu, j\n"
             "assert j['state'] == '%s', (j['state'], j['failure'])\n"
             "assert j['failure'] and %s in j['failure'], j['failure']\n",
             (unsigned long long)id, state, needle);
    char *perr = NULL;
    cr_expect_eq(dc_python(script, out, &perr), 0, "job %s: %s\n%s", ids, perr, out);
    free(perr);
    free(out);
    free(err);
}

/* Checks `striactl --json status`: `healthy` workers in the ring, and the
 * worker at `rpc` in state `state` outside it. */
static void expect_ring(const dcluster_t *c, int healthy, const char *rpc, const char *state)
{
    char script[2048], *out = NULL, *err = NULL;
    cr_assert_eq(dc_striactl(c, NULL, &out, &err, "--json", "status", NULL), 0, "%s", err);
    snprintf(script, sizeof(script),
             "import json, sys\n"
             "s = json.loads(sys.argv[1])\n"
             "assert s['workers_healthy'] == %d, s\n"
             "ranks = [m['rank'] for m in s['ring'] if m['rank'] >= 0]\n"
             "assert ranks == list(range(%d)), ranks\n"
             "w = [m for m in s['ring'] if m['worker']['rpc_address'] == '%.200s']\n"
             "assert len(w) == 1 and w[0]['rank'] == -1, w\n"
             "assert w[0]['worker']['state'] == '%s', w[0]\n",
             healthy, healthy, rpc, state);
    char *perr = NULL;
    cr_expect_eq(dc_python(script, out, &perr), 0, "%s\n%s", perr, out);
    free(perr);
    free(out);
    free(err);
}

Test(shutdown, sigterm_worker_holding_a_job, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, &slow_hb);
    dc_job_t j;
    dc_job_init(&j, &c, 96, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    uint64_t id = stria_job_id(j.job);

    /* after forward, before backward: SIGTERM rank 1's worker */
    int victim = 1;
    double t0 = stria_time_now();
    int st = test_proc_stop(c.workers[victim], SIGTERM, 10);
    double took = stria_time_now() - t0;
    c.workers[victim] = NULL;
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker exit status %#x", st);
    cr_expect(took < 5, "the worker took %.1f s to exit", took);

    /* at once: the job failed naming the worker, which left the ring */
    char needle[300];
    snprintf(needle, sizeof(needle), "'(%.200s) shut down (SIGTERM)'", c.worker_rpc[victim]);
    expect_job(&c, id, "failed", needle);
    expect_ring(&c, 2, c.worker_rpc[victim], "left");
    cr_expect(stria_time_now() - t0 < 5, "the ring did not shrink at once");
    char *log = dc_read(c.coord_log);
    cr_expect(strstr(log, "left the ring: shut down (SIGTERM); 1 unfinished job(s) failed") != NULL,
              "no log line of the departure:\n%s", log);
    free(log);

    /* the client learns it; the next job runs on the two that are left */
    cr_expect_neq(dc_job_backward(&j), STRIA_OK);
    cr_log_info("backward after the shutdown: %s", stria_error_msg());
    dc_job_free(&j);
    dc_job_init(&j, &c, 64, 2, 32, 0);
    cr_expect_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_job_ring_size(j.job), 2);
    cr_expect_eq(dc_job_backward(&j), STRIA_OK, "%s", stria_error_msg());
    dc_job_free(&j);

    /* back: the same address is not reused (port 0), so a new worker joins */
    dc_start_worker(&c, victim, &slow_hb);
    dc_wait_healthy(&c, 3, NULL);
    dc_stop(&c);
}

typedef struct {
    dcluster_t *c;
    int victim, stalled; /* stalled: a peer to SIGSTOP as well, or -1 */
    pid_t victim_pid, stalled_pid;
    char log_path[256];
    volatile bool give_up;
    bool sent;
    double sent_at, exited_at;
    pthread_t trigger;
} during_t;

static bool file_has(const char *path, const char *needle)
{
    char buf[65536];
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, needle) != NULL;
}

/* As soon as the victim's pass runs (its log says so), signal it (and stop
 * the stalled peer); then wait, without reaping it, for the victim to exit,
 * and let the stalled peer run again so that the client's calls to it end. */
static void *trigger_thread(void *arg)
{
    during_t *d = arg;
    /* the worker's debug line: the link is bound, the ring steps run */
    while (!d->give_up && !file_has(d->log_path, "(forward) runs its ring pass"))
        usleep(2000);
    if (d->give_up)
        return NULL;
    if (d->stalled_pid > 0)
        kill(d->stalled_pid, SIGSTOP);
    kill(d->victim_pid, SIGTERM);
    d->sent_at = stria_time_now();
    d->sent = true;
    siginfo_t info;
    memset(&info, 0, sizeof(info));
    waitid(P_PID, (id_t)d->victim_pid, &info, WEXITED | WNOWAIT);
    d->exited_at = stria_time_now();
    if (d->stalled_pid > 0)
        kill(d->stalled_pid, SIGCONT);
    return NULL;
}

/* The id of the only job the coordinator knows. */
static uint64_t only_job(const dcluster_t *c)
{
    char *out = NULL, *err = NULL;
    cr_assert_eq(dc_striactl(c, NULL, &out, &err, "--json", "jobs", "--all", NULL), 0, "%s", err);
    double id = dc_json_number(out, "id");
    cr_assert(id > 0, "no job in %s", out);
    int n = 0;
    for (const char *p = out; (p = strstr(p, "\"spec\":")) != NULL; p++)
        n++;
    cr_expect_eq(n, 1, "not exactly one job: %s", out);
    free(out);
    free(err);
    return (uint64_t)id;
}

/* A forward pass over every worker, long enough that the peers are still
 * computing when the victim's ring link is up (the sanitizer build computes
 * several times slower). `step_timeout_s` is also how long the victim lets
 * its pass run after SIGTERM before aborting it. */
static stria_status_t run_during_pass(dcluster_t *c, during_t *d, double step_timeout_s)
{
    dc_job_t j;
    dc_job_init(&j, c, STRIA_TEST_SANITIZE ? 4096 : 8192, 2, 64, c->n_workers);
    j.spec.step_timeout_s = step_timeout_s;
    d->victim_pid = test_proc_pid(c->workers[d->victim]);
    d->stalled_pid = d->stalled >= 0 ? test_proc_pid(c->workers[d->stalled]) : 0;
    snprintf(d->log_path, sizeof(d->log_path), "%s", c->worker_log[d->victim]);
    cr_assert_eq(pthread_create(&d->trigger, NULL, trigger_thread, d), 0);
    stria_status_t st = dc_job_forward(&j, NULL, NULL);
    cr_log_info("forward with a SIGTERM during the pass: %s",
                st == STRIA_OK ? "ok" : stria_error_msg());
    dc_job_free(&j);
    d->give_up = true;
    pthread_join(d->trigger, NULL);
    cr_assert(d->sent, "the victim's pass never started");
    return st;
}

Test(shutdown, sigterm_during_a_pass_lets_it_finish, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, &slow_hb);
    during_t d = {.c = &c, .victim = 0, .stalled = -1};
    run_during_pass(&c, &d, 60); /* ample: the pass must end on its own, even on a busy machine */
    int status = test_proc_wait(c.workers[d.victim], 15);
    c.workers[d.victim] = NULL;
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker exit status %#x", status);
    /* the worker finished its pass before leaving: its log says so */
    char *log = dc_read(c.worker_log[d.victim]);
    cr_expect(strstr(log, "forward pass done") != NULL && strstr(log, "pass failed") == NULL,
              "the pass did not finish cleanly after SIGTERM:\n%s", log);
    cr_expect(strstr(log, "deregistered from coordinator") != NULL, "%s", log);
    free(log);
    expect_job(&c, only_job(&c), "failed", "'shut down (SIGTERM)'");
    dc_stop(&c);
}

/* The cluster index of the worker at ring position `pos`. */
static int at_ring_index(const dcluster_t *c, int pos)
{
    char *out = NULL, *err = NULL;
    cr_assert_eq(dc_striactl(c, NULL, &out, &err, "--json", "workers", NULL), 0, "%s", err);
    int found = -1;
    for (int i = 0; i < c->n_workers; i++) {
        const char *p = strstr(out, c->worker_rpc[i]);
        cr_assert_not_null(p);
        p = strstr(p, "\"ring_index\":"); /* a field after the address, in the same object */
        cr_assert_not_null(p);
        if (atoi(p + strlen("\"ring_index\":")) == pos)
            found = i;
    }
    free(out);
    free(err);
    cr_assert(found >= 0, "no worker at ring position %d", pos);
    return found;
}

Test(shutdown, sigterm_with_a_stalled_peer_fails_the_step, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, &slow_hb);
    /* rank 1 of a ring of three; its predecessor, rank 0, stops: rank 1 waits
     * for data that does not come (a receive, which an abort cancels at once;
     * a send in flight to a stopped peer is another matter: the transport
     * waits for UCX to give its buffer back) */
    during_t d = {.c = &c, .victim = at_ring_index(&c, 1), .stalled = at_ring_index(&c, 0)};
    stria_status_t st = run_during_pass(&c, &d, 5);
    /* the pass cannot finish: after a step deadline (5 s) the worker aborts
     * it, the pass fails cleanly, and the worker leaves */
    int status = test_proc_wait(c.workers[d.victim], 15);
    c.workers[d.victim] = NULL;
    double took = d.exited_at - d.sent_at;
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker exit status %#x", status);
    cr_expect(took < 12, "the worker took %.1f s to exit with a stalled peer", took);
    cr_log_info("worker exit %.1f s after SIGTERM with a stalled peer", took);
    cr_expect_neq(st, STRIA_OK, "the forward pass succeeded with a stopped rank");
    expect_job(&c, only_job(&c), "failed", "''");
    char *log = dc_read(c.worker_log[d.victim]);
    cr_log_info("the pass %s", strstr(log, "aborting") != NULL ? "was aborted after a step deadline"
                                                               : "failed on its own deadline");
    cr_expect(strstr(log, "forward pass failed") != NULL &&
                  strstr(log, "still running at exit") == NULL,
              "%s", log);
    free(log);
    dc_stop(&c);
}

Test(shutdown, sigterm_coordinator_leaves_its_jobs_to_the_workers, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    dc_job_t j;
    dc_job_init(&j, &c, 64, 2, 32, 0);
    cr_assert_eq(dc_job_forward(&j, NULL, NULL), STRIA_OK, "%s", stria_error_msg());
    uint64_t id = stria_job_id(j.job);
    int st = test_proc_stop(c.coord, SIGTERM, 10);
    c.coord = NULL;
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "coordinator exit status %#x", st);
    char *log = dc_read(c.coord_log), want[96];
    snprintf(want, sizeof(want), "job %llu failed: the coordinator shut down",
             (unsigned long long)id);
    cr_expect(strstr(log, want) != NULL, "the log lacks '%s':\n%s", want, log);
    free(log);
    /* the workers still hold the job's data: the client may finish its
     * pass, or get a clear error, but must not hang */
    stria_status_t bst = dc_job_backward(&j);
    cr_log_info("backward without a coordinator: %s", bst == STRIA_OK ? "ok" : stria_error_msg());
    /* a coordinator started again rebuilds the job from its workers: the
     * release (tried again while none listens) reaches it */
    dc_restart_coordinator(&c, NULL, 0, 0);
    dc_job_free(&j);
    /* the workers keep running and stop cleanly */
    dc_stop(&c);
}
