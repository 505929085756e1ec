/* Sessions through failures, with real processes on loopback (the helpers
 * of test_session): a worker killed or drained between calls costs the
 * next call a reopening, not a failure; so does an idle timeout; a
 * restarted coordinator is not on a call's path; closing a session frees
 * its memory at once, and so does a killed client's idle deadline; a
 * forked child gets a clear error and the parent goes on. */
#include <criterion/criterion.h>

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"
#include "fault_util.h"
#include "session_util.h"
#include "stria_common.h"
#include "stria_ring.h"

/* ---- failures between calls ------------------------------------------------------------- */

/* A worker killed in the middle of a call: stopped (SIGSTOP) before the
 * call starts, so that the call is under way on the others and waits for
 * it, then killed `after` seconds later from a thread of its own while the
 * test's thread is in the call. */
typedef struct {
    test_proc_t *p;
    double after;
    pthread_t th;
} killer_t;

static void *killer_main(void *arg)
{
    killer_t *k = arg;
    usleep((useconds_t)(k->after * 1e6));
    test_proc_stop(k->p, SIGKILL, 5);
    return NULL;
}

static void kill_in_the_call(dcluster_t *c, int victim, killer_t *k)
{
    cr_assert_eq(kill(test_proc_pid(c->workers[victim]), SIGSTOP), 0);
    *k = (killer_t){.p = c->workers[victim], .after = 0.5};
    c->workers[victim] = NULL;
    cr_assert_eq(pthread_create(&k->th, NULL, killer_main, k), 0);
}

/* The index of the worker serving rank `rank` of session s, from `striactl
 * --json job`; -1 when not found. */
static int worker_of_rank(const dcluster_t *c, stria_session_t *s, int rank)
{
    char *js = dc_job_json(c, NULL, stria_session_id(s));
    cr_assert_not_null(js, "striactl job %llu failed", (unsigned long long)stria_session_id(s));
    char key[32];
    snprintf(key, sizeof(key), "{\"rank\":%d,", rank);
    const char *at = strstr(js, key), *addr = at ? strstr(at, "\"rpc_address\":\"") : NULL;
    int found = -1;
    for (int i = 0; addr != NULL && i < c->n_workers; i++) {
        const char *a = addr + strlen("\"rpc_address\":\"");
        size_t n = strlen(c->worker_rpc[i]);
        if (strncmp(a, c->worker_rpc[i], n) == 0 && a[n] == '"')
            found = i;
    }
    cr_assert_geq(found, 0, "rank %d of session %llu not found in %s", rank,
                  (unsigned long long)stria_session_id(s), js);
    free(js);
    return found;
}

static void worker_killed_case(int workers, int ring)
{
    dcluster_t c;
    dc_start(&c, workers, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp =
        se_spec_of(1, 128, 4, 2, 16, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED, ring);
    stria_session_t *s = se_open_session(cl, &sp);
    int first_ring = stria_session_ring_size(s);
    cr_expect_eq(first_ring, ring ? ring : workers);
    stria_call_t call = se_call_of(1, 128, true);
    se_check_call(s, &sp, &call, true, 1300, "before the kill");
    uint64_t id = stria_session_id(s);
    int victim = worker_of_rank(&c, s, 1);
    test_proc_stop(c.workers[victim], SIGKILL, 5);
    c.workers[victim] = NULL;

    double t0 = stria_time_now();
    se_check_call(s, &sp, &call, true, 1310, "the first call after the kill");
    double took = stria_time_now() - t0;
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_geq(st.reopened, 1u, "the session was not reopened");
    cr_expect_geq(st.retries, 1u, "no retry counted");
    cr_expect_geq(st.generation, 2u);
    cr_expect_eq(st.failed, 0u, "%llu calls failed", (unsigned long long)st.failed);
    cr_expect_neq(stria_session_id(s), id, "a reopened session has a new id");
    cr_expect_eq(stria_session_ring_size(s), ring ? ring : workers - 1);
    cr_log_info("worker %d killed: the next call took %.3f s (%u opens, %llu retries)", victim,
                took, st.generation, (unsigned long long)st.retries);
    /* and on */
    stria_call_t call2 = se_call_of(1, 100, false);
    se_check_call(s, &sp, &call2, true, 1320, "the second call after the kill");
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, worker_killed_between_calls_fixed_ring_takes_the_spare, .timeout = T_TIMEOUT)
{
    worker_killed_case(3, 2);
}

Test(session, worker_killed_between_calls_free_ring_goes_on_with_the_rest, .timeout = T_TIMEOUT)
{
    worker_killed_case(3, 0);
}

/* A head-grouped session (2 groups x rings of 2, a fifth worker spare): a
 * worker of a group's ring killed between calls or (`mid`) in the middle
 * of one costs that ring a reopening inside the call, whose every output
 * is still each group's in-process ring's, bit for bit. */
static void groups_kill_case(bool mid)
{
    dcluster_t c;
    dc_start(&c, 5, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp =
        se_spec_of(1, 128, 4, 2, 16, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED, 4);
    sp.head_groups = 2;
    stria_session_t *s = se_open_session(cl, &sp);
    cr_expect_eq(stria_session_ring_size(s), 4);
    stria_call_t call = se_call_of(1, 128, true);
    se_check_groups_call(s, &sp, &call, 1400, 2, 2, "before the kill");
    int victim = worker_of_rank(&c, s, 1); /* head group 0's ring (the session's id) */
    killer_t killer;
    if (mid) {
        kill_in_the_call(&c, victim, &killer);
        se_check_groups_call(s, &sp, &call, 1405, 2, 2, "the call the kill lands in");
        pthread_join(killer.th, NULL);
    } else {
        test_proc_stop(c.workers[victim], SIGKILL, 5);
        c.workers[victim] = NULL;
    }
    for (int k = 0; k < 2; k++)
        se_check_groups_call(s, &sp, &call, 1410 + (uint64_t)k, 2, 2,
                             k ? "the second call after the kill"
                               : "the first call after the kill");
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_geq(st.reopened, 1u, "no ring was reopened");
    cr_expect_geq(st.retries, 1u, "no retry counted");
    cr_expect_eq(st.failed, 0u, "%llu calls failed", (unsigned long long)st.failed);
    cr_expect_eq(st.calls, mid ? 8u : 6u);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, worker_killed_in_a_head_grouped_session_is_retried_and_correct, .timeout = T_TIMEOUT)
{
    groups_kill_case(false);
}

Test(session, worker_killed_mid_call_in_a_head_grouped_session_is_retried_and_correct,
     .timeout = T_TIMEOUT)
{
    groups_kill_case(true);
}

/* One sharded call (forward and backward) of the n trainer ranks of a
 * session of G head groups x rings of R, checked head group by head
 * group. */
static void sharded_groups_call(stria_session_t **h, int n, int R, int G,
                                const stria_session_spec_t *sp, const stria_call_t *call,
                                uint64_t seed, const char *what)
{
    stria_call_t per[8];
    se_rank_t r[8];
    for (int i = 0; i < n; i++)
        per[i] = *call;
    fu_job_t j;
    se_call_tensors(&j, sp, call, seed);
    se_sharded_call(h, n, &j, per, true, r);
    bool all = true;
    for (int i = 0; i < n; i++) {
        cr_expect_eq(r[i].st, STRIA_OK, "%s, rank %d: %s: %s", what, i, stria_status_name(r[i].st),
                     r[i].msg);
        all &= r[i].st == STRIA_OK;
    }
    if (all)
        se_groups_equal(&j, call, G, R, sp->layout, what);
    fu_job_free(&j);
}

/* A worker killed in a sharded 2 x 2 session (`n` trainer ranks: 2, one
 * per ring rank, or 4, one per worker; a spare beside the four workers),
 * between calls or (`mid`) in the middle of one: its ring's ranks follow
 * the spare that takes its place and retry inside the call, bit for bit;
 * the other ring goes on as it was. */
static void sharded_groups_kill_case(int n, bool mid)
{
    dcluster_t c;
    dc_start(&c, 5, NULL);
    stria_client_t *cl[4];
    stria_session_t *h[4];
    for (int i = 0; i < n; i++)
        cl[i] = dc_client(&c, NULL, "test_session rank", 0);
    stria_session_spec_t sp =
        se_spec_of(1, 128, 4, 2, 16, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED, 4);
    sp.sharded = true;
    sp.head_groups = 2;
    sp.arrival_timeout_s = 15;
    sp.trainer_ranks = n == 4 ? 4 : 0;
    se_open_sharded(cl, n, &sp, h, NULL);
    stria_call_t call = se_call_of(1, 128, true);
    sharded_groups_call(h, n, 2, 2, &sp, &call, 1450, "before the kill");
    uint64_t id = stria_session_id(h[0]);
    int victim = worker_of_rank(&c, h[0], 1); /* head group 0's ring (the session's id) */
    killer_t killer;
    if (mid) {
        kill_in_the_call(&c, victim, &killer);
        sharded_groups_call(h, n, 2, 2, &sp, &call, 1455, "the call the kill lands in");
        pthread_join(killer.th, NULL);
    } else {
        test_proc_stop(c.workers[victim], SIGKILL, 5);
        c.workers[victim] = NULL;
    }
    for (int k = 0; k < 2; k++)
        sharded_groups_call(h, n, 2, 2, &sp, &call, 1460 + (uint64_t)k,
                            k ? "the second call after the kill" : "the first call after the kill");
    cr_expect_neq(stria_session_id(h[0]), id, "head group 0's ring was not replaced");
    for (int i = 1; i < n; i++)
        cr_expect_eq(stria_session_id(h[i]), stria_session_id(h[0]), "rank %d's rings differ", i);
    for (int i = 0; i < n; i++) {
        stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
        cr_assert_eq(stria_session_stats(h[i], &st), STRIA_OK, "%s", stria_error_msg());
        cr_expect_geq(st.retries, 1u, "rank %d: no retry counted", i);
        cr_expect_eq(st.failed, 0u, "rank %d: %llu calls failed", i, (unsigned long long)st.failed);
        cr_expect_eq(st.calls, mid ? 8u : 6u, "rank %d: %llu calls", i,
                     (unsigned long long)st.calls);
    }
    for (int i = n - 1; i >= 0; i--) {
        cr_expect_eq(stria_session_close(h[i]), STRIA_OK, "close on rank %d: %s", i,
                     stria_error_msg());
        stria_client_close(cl[i]);
    }
    dc_stop(&c);
}

Test(session, worker_killed_in_a_sharded_head_grouped_session_is_retried_and_correct,
     .timeout = T_TIMEOUT)
{
    sharded_groups_kill_case(2, false);
}

Test(session, worker_killed_mid_call_under_one_trainer_rank_per_worker_is_retried_and_correct,
     .timeout = T_TIMEOUT)
{
    sharded_groups_kill_case(4, true);
}

/* `striactl --json sessions`'s calls of the first session it lists, once
 * they reach `want` (the workers report them in their heartbeats); NAN when
 * they do not within 5 s. */
static double listed_calls(const dcluster_t *c, double want)
{
    double got = NAN;
    for (int t = 0; t < 100 && got != want; t++, usleep(50000)) {
        char *out = NULL;
        got = dc_striactl(c, NULL, &out, NULL, "--json", "sessions", NULL) == 0
                  ? dc_json_number(out, "calls")
                  : NAN;
        free(out);
    }
    return got;
}

Test(session, drained_worker_moves_at_the_next_call, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 3, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp = se_spec_of(1, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    stria_call_t call = se_call_of(1, 96, true);
    for (int i = 0; i < 5; i++)
        se_check_call(s, &sp, &call, true, 1600 + (uint64_t)i, "before the drain");
    cr_expect_eq(listed_calls(&c, 10), 10, "striactl sessions does not count the 10 calls");
    uint64_t id = stria_session_id(s);
    int victim = worker_of_rank(&c, s, 1);
    char *out = NULL, *err = NULL;
    cr_assert_eq(dc_striactl(&c, NULL, &out, &err, "drain", c.worker_rpc[victim], NULL), 0,
                 "striactl drain: %s", err);
    free(out), free(err);
    usleep(600000); /* heartbeats of 0.2 s tell the worker */
    se_check_call(s, &sp, &call, true, 1610, "the first call after the drain");
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_geq(st.reopened, 1u, "the session stayed on the drained worker");
    cr_expect_eq(st.failed, 0u);
    cr_expect_neq(stria_session_id(s), id);
    for (int r = 0; r < 2; r++)
        cr_expect_neq(worker_of_rank(&c, s, r), victim, "rank %d is still on the drained worker",
                      r);
    se_check_call(s, &sp, &call, true, 1620, "the second call after the drain");
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    out = NULL;
    cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "--json", "sessions", NULL), 0);
    cr_expect(strstr(out, "\"id\":") == NULL, "a closed session is listed as open: %s", out);
    free(out);
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, coordinator_restarted_between_calls, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp = se_spec_of(1, 128, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_ZIGZAG, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    stria_call_t call = se_call_of(1, 128, true);
    se_check_call(s, &sp, &call, true, 1400, "before the restart");
    uint64_t id = stria_session_id(s);
    dc_restart_coordinator(&c, NULL, SIGKILL, 0.3);
    se_check_call(s, &sp, &call, true, 1410, "right after the coordinator's restart");
    /* once the workers have re-registered (heartbeats of 0.2 s) */
    dc_wait_healthy(&c, 2, NULL);
    usleep(1000000);
    se_check_call(s, &sp, &call, true, 1420, "after the workers re-registered");
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(st.failed, 0u);
    cr_log_info("after the coordinator's restart: session %llu (was %llu), generation %u",
                (unsigned long long)stria_session_id(s), (unsigned long long)id, st.generation);
    char *js = dc_job_json(&c, NULL, stria_session_id(s));
    cr_expect_not_null(js, "the restarted coordinator does not know session %llu",
                       (unsigned long long)stria_session_id(s));
    free(js);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "close after the restart: %s",
                 stria_error_msg());
    /* a new session on the new coordinator */
    s = se_open_session(cl, &sp);
    se_check_call(s, &sp, &call, true, 1430, "a session opened after the restart");
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

Test(session, expired_session_is_opened_again_by_the_next_call, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp = se_spec_of(1, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    sp.idle_timeout_s = 1;
    stria_session_t *s = se_open_session(cl, &sp);
    stria_call_t call = se_call_of(1, 96, true);
    se_check_call(s, &sp, &call, true, 1450, "before the idle timeout");
    uint64_t id = stria_session_id(s);
    usleep(4000000); /* 4 idle timeouts */
    se_check_call(s, &sp, &call, true, 1460, "after the idle timeout");
    stria_session_stats_t st = STRIA_SESSION_STATS_INIT;
    cr_assert_eq(stria_session_stats(s, &st), STRIA_OK, "%s", stria_error_msg());
    cr_expect_geq(st.reopened, 1u,
                  "a session idle for 4 s of 1 s was not reopened (id %llu, "
                  "was %llu)",
                  (unsigned long long)stria_session_id(s), (unsigned long long)id);
    cr_expect_eq(st.failed, 0u);
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}

/* ---- closing ------------------------------------------------------------------------------ */

/* The unfinished jobs `striactl --json jobs` lists. */
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

Test(session, close_frees_the_sessions_memory, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_opts_t o = {.worker_memory = "64M"};
    dc_start(&c, 1, &o);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    /* bounds whose need is more than half of the worker's memory */
    int64_t seq = 64;
    uint64_t need = 0, cap = (uint64_t)64 << 20;
    for (;; seq += 64) {
        cr_assert_eq(stria_session_rank_memory(1, seq + 64, 4, 4, 64, STRIA_DTYPE_F32, 0, &need),
                     STRIA_OK);
        if (need > cap * 6 / 10)
            break;
    }
    cr_assert_eq(stria_session_rank_memory(1, seq, 4, 4, 64, STRIA_DTYPE_F32, 0, &need), STRIA_OK);
    cr_assert(2 * need > cap && need < cap);
    stria_session_spec_t sp =
        se_spec_of(1, seq, 4, 4, 64, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 1);
    sp.no_queue = true;
    stria_session_t *a = NULL, *b = NULL;
    cr_assert_eq(stria_session_open(cl, &sp, &a), STRIA_OK,
                 "a session of %lld tokens (%llu of %llu bytes): %s", (long long)seq,
                 (unsigned long long)need, (unsigned long long)cap, stria_error_msg());
    stria_call_t call = se_call_of(1, seq, true);
    se_check_call(a, &sp, &call, true, 1500, "the first session");
    cr_expect_eq(active_jobs(&c), 1, "the open session is an active job");
    stria_status_t st = stria_session_open(cl, &sp, &b);
    cr_expect(st == STRIA_ERR_BUSY || st == STRIA_ERR_NO_MEMORY,
              "a second session of more than half the memory: %s: %s", stria_status_name(st),
              stria_error_msg());
    cr_expect_null(b);
    if (b != NULL)
        stria_session_close(b), b = NULL;
    cr_expect_eq(stria_session_close(a), STRIA_OK, "%s", stria_error_msg());
    double t0 = stria_time_now();
    cr_expect_eq(active_jobs(&c), 0, "the closed session is still listed as active");
    while ((st = stria_session_open(cl, &sp, &b)) != STRIA_OK && stria_time_now() - t0 < 5)
        usleep(50000);
    cr_assert_eq(st, STRIA_OK, "no session opens after the close: %s", stria_error_msg());
    cr_log_info("a session of the whole memory opened %.3f s after the close",
                stria_time_now() - t0);
    cr_expect_lt(stria_time_now() - t0, 1.0, "the close freed the memory only %.3f s later",
                 stria_time_now() - t0);
    se_check_call(b, &sp, &call, true, 1510, "the session opened after the close");
    cr_expect_eq(stria_session_close(b), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_session_close(NULL), STRIA_OK);
    stria_client_close(cl);
    dc_stop(&c);
}

/* ---- a client that dies, a child that forks --------------------------------------- */

Test(session, a_killed_clients_session_is_freed_by_its_idle_deadline, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_session_spec_t sp = se_spec_of(1, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    sp.idle_timeout_s = 1;
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) { /* a trainer that opens a session, calls it once and dies */
        test_proc_child_setup(getppid());
        stria_client_t *cl = dc_client(&c, NULL, "test_session child", 0);
        stria_session_t *s = NULL;
        stria_call_t call = se_call_of(1, 96, true);
        static float q[96 * 2 * 16], o[96 * 2 * 16], lse[2 * 96];
        if (stria_session_open(cl, &sp, &s) != STRIA_OK ||
            stria_session_forward(s, &call, q, q, q, o, lse) != STRIA_OK)
            _exit(1);
        kill(getpid(), SIGKILL);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
              "the child did not open and call its session (status 0x%x)", status);
    cr_expect_eq(active_jobs(&c), 1, "the dead client's session is not listed");
    /* its idle deadline (1 s) and a heartbeat later, the workers dropped it */
    double t0 = stria_time_now();
    while (active_jobs(&c) > 0 && stria_time_now() - t0 < 10)
        usleep(200000);
    cr_expect_eq(active_jobs(&c), 0, "the session outlived its idle deadline by 10 s");
    char *out = NULL;
    cr_assert_eq(dc_striactl(&c, NULL, &out, NULL, "--json", "workers", NULL), 0);
    cr_expect(strstr(out, "\"memory_reserved_bytes\":0") != NULL,
              "a worker still reserves the session's memory: %s", out);
    free(out);
    dc_stop(&c);
}

Test(session, a_forked_child_gets_a_clear_error_and_the_parent_goes_on, .timeout = T_TIMEOUT)
{
    dcluster_t c;
    dc_start(&c, 2, NULL);
    stria_client_t *cl = dc_client(&c, NULL, "test_session", 0);
    stria_session_spec_t sp = se_spec_of(1, 96, 2, 2, 16, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED, 2);
    stria_session_t *s = se_open_session(cl, &sp);
    stria_call_t call = se_call_of(1, 96, true);
    se_check_call(s, &sp, &call, true, 1600, "before the fork");
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) { /* a DataLoader worker that touches its parent's session */
        static float q[96 * 2 * 16], o[96 * 2 * 16], lse[2 * 96];
        stria_status_t st = stria_session_forward(s, &call, q, q, q, o, lse);
        _exit(st == STRIA_ERR_INVALID_ARG && strstr(stria_error_msg(), "forked child") != NULL ? 0
                                                                                               : 1);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the child's call was not refused as a forked child's (status 0x%x)", status);
    se_check_call(s, &sp, &call, true, 1610, "after the child's refused call");
    cr_expect_eq(stria_session_close(s), STRIA_OK, "%s", stria_error_msg());
    stria_client_close(cl);
    dc_stop(&c);
}
