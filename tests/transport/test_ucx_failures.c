/* UCX link suite, failures between processes: a killed rank, a stopped
 * rank, a resumed rank that is not blamed later, and a restart on the same
 * port. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include "ucx_test_util.h"

/* ---- failures between processes ----------------------------------------- */

typedef struct {
    int size;
    int victim;
    int tls;
    int sig;
    int engine; /* ring engine passes instead of plain exchanges */
    /* Heartbeat period and stall time injected into the ranks, and the step
     * deadline of stopped-rank cases; 0: the defaults (0.1 s, 0.5 s, 1 s). */
    double heartbeat_s, stall_s, step_timeout_s;
} fail_case_t;

/* Starts a ring looping passes, waits until every rank has finished one,
 * signals the victim and returns the time of the signal. */
static double start_and_hit(const fail_case_t *c, double step_timeout, pid_t *pids)
{
    engine_case_t ec = {.batch = 1,
                        .seq = 512,
                        .heads = 4,
                        .kv_heads = 4,
                        .head_dim = 64,
                        .causal = 1,
                        .dtype = STRIA_DTYPE_F32,
                        .layout = STRIA_LAYOUT_STRIPED,
                        .seed = 3};
    char spec[200];
    engine_case_format(&ec, spec, sizeof(spec));
    rank_args_t a = {.tls = tls_names[c->tls],
                     .bytes = 200000,
                     .duration_s = 30,
                     .step_timeout_s = step_timeout,
                     .heartbeat_s = c->heartbeat_s,
                     .stall_s = c->stall_s,
                     .mode = c->engine ? "engine" : NULL,
                     .engine = c->engine ? spec : NULL};
    for (int r = 0; r < c->size; r++)
        pids[r] = spawn_rank(r, c->size, &a);
    for (int r = 0; r < c->size; r++)
        wait_file("ready", r, 30);
    usleep(100000);
    double t0 = stria_time_now();
    cr_assert_eq(kill(pids[c->victim], c->sig), 0);
    return t0;
}

ParameterizedTestParameters(ucx, killed_rank)
{
    static fail_case_t cases[] = {{3, 1, TLS_TCP, SIGKILL, 0, 0, 0, 0},
                                  {4, 2, TLS_SHM, SIGKILL, 0, 0, 0, 0},
                                  {2, 0, TLS_TCP, SIGKILL, 0, 0, 0, 0},
                                  {3, 1, TLS_TCP, SIGKILL, 1, 0, 0, 0},
                                  {4, 3, TLS_SHM, SIGKILL, 1, 0, 0, 0}};
    return cr_make_param_array(fail_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

/* kill -9 mid-pass: every other rank returns an error naming the dead rank
 * within 2 s and exits cleanly. The step deadline (30 s) cannot be what
 * ends the pass. */
ParameterizedTest(fail_case_t *c, ucx, killed_rank, .init = setup, .fini = teardown, .timeout = 90)
{
    pid_t pids[8];
    double t0 = start_and_hit(c, 30.0, pids);
    char name[32];
    snprintf(name, sizeof(name), "rank %d", c->victim);
    for (int r = 0; r < c->size; r++) {
        if (r == c->victim)
            continue;
        result_t res = wait_result(r, 10);
        double dt = stria_time_now() - t0;
        cr_assert(res.present, "rank %d did not report the death of rank %d; its log:\n%s", r,
                  c->victim, rank_log(r));
        cr_expect(!res.ok, "rank %d reported success after rank %d died", r, c->victim);
        cr_expect(dt < 2.0, "rank %d took %.2f s to report the death of rank %d", r, dt, c->victim);
        cr_expect(strcmp(res.status, "STRIA_ERR_PEER") == 0, "rank %d: %s: %s", r, res.status,
                  res.msg);
        cr_expect(strstr(res.msg, name) != NULL, "rank %d's error does not name %s: %s", r, name,
                  res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

ParameterizedTestParameters(ucx, stopped_rank)
{
    static fail_case_t cases[] = {{3, 1, TLS_TCP, SIGSTOP, 0, 0, 0, 0},
                                  {4, 0, TLS_SHM, SIGSTOP, 0, 0, 0, 0},
                                  {3, 2, TLS_TCP, SIGSTOP, 1, 0, 0, 0},
                                  {4, 1, TLS_SHM, SIGSTOP, 1, 0, 0, 0},
                                  /* faster heartbeats, a shorter deadline */
                                  {3, 1, TLS_TCP, SIGSTOP, 0, 0.05, 0.2, 0.4}};
    return cr_make_param_array(fail_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

/* SIGSTOP: UCX sees nothing wrong; the per-step deadline (1 s) ends the pass
 * on the neighbours, and the others hear of it, all naming the stopped rank
 * as stalled: its neighbours find it silent for longer than the stall time
 * (0.5 s by default), the others hear so from the heartbeats. A deadline
 * that merely names the rank is not enough: a stall time above the
 * deadline would blame it as "alive but slow". */
ParameterizedTest(fail_case_t *c, ucx, stopped_rank, .init = setup, .fini = teardown, .timeout = 90)
{
    pid_t pids[8];
    double step = c->step_timeout_s > 0 ? c->step_timeout_s : 1.0;
    double t0 = start_and_hit(c, step, pids);
    char name[32], stalled[48];
    snprintf(name, sizeof(name), "rank %d", c->victim);
    snprintf(stalled, sizeof(stalled), "rank %d is stalled", c->victim);
    for (int r = 0; r < c->size; r++) {
        if (r == c->victim)
            continue;
        result_t res = wait_result(r, 15);
        double dt = stria_time_now() - t0;
        cr_assert(res.present, "rank %d did not report the stopped rank %d; its log:\n%s", r,
                  c->victim, rank_log(r));
        cr_expect(!res.ok, "rank %d reported success", r);
        /* The engine's deadline is cumulative over the steps of a pass
         * (step s must end by start + (s + 1) * timeout): allow every step
         * of a forward and a backward pass, plus the link's grace. */
        double bound = step * (c->engine ? 2 * c->size + 1 : 1) + 3.0;
        cr_expect(dt < bound, "rank %d took %.2f s (bound %.1f s)", r, dt, bound);
        cr_expect(strcmp(res.status, "STRIA_ERR_TIMEOUT") == 0 ||
                      strcmp(res.status, "STRIA_ERR_PEER") == 0,
                  "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(strstr(res.msg, "deadline") != NULL && strstr(res.msg, name) != NULL,
                  "rank %d's error is not a deadline naming %s: %s", r, name, res.msg);
        cr_expect(strstr(res.msg, stalled) != NULL, "rank %d's error does not say \"%s\": %s", r,
                  stalled, res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

/* A rank that stalled and resumed is not blamed for a later deadline: the
 * heartbeats' report of it dies out once its neighbours hear from it again
 * (it must not echo between the live ranks), so a receive that nobody sends,
 * with every rank alive, ends in a deadline that blames no stalled rank. */
Test(ucx, a_resumed_rank_is_not_blamed_later, .init = setup, .fini = teardown, .timeout = 60)
{
    enum { N = 3, VICTIM = 2 };
    rank_args_t a = {.tls = "tcp", .step_timeout_s = 0.5, .mode = "idle"};
    pid_t pids[N];
    /* The ranks log a stall as a warning when they first see it. */
    setenv("STRIA_LOG_LEVEL", "warn", 1);
    for (int r = 0; r < N; r++)
        pids[r] = spawn_rank(r, N, &a);
    for (int r = 0; r < N; r++)
        wait_file("ready", r, 30);
    cr_assert_eq(kill(pids[VICTIM], SIGSTOP), 0);
    usleep(1500000); /* the neighbours report it stalled (after 0.5 s) */
    /* First: the stall was seen at all, by both live ranks, or what follows
     * proves nothing about a report dying out. */
    for (int r = 0; r < N; r++)
        if (r != VICTIM)
            cr_assert(strstr(rank_log(r), "rank 2 looks stalled") != NULL,
                      "rank %d did not report the stopped rank 2 as stalled within 1.5 s; its "
                      "log:\n%s",
                      r, rank_log(r));
    cr_assert_eq(kill(pids[VICTIM], SIGCONT), 0);
    usleep(3000000); /* a report dies out a second per hop after its source stops */
    for (int r = 0; r < N; r++) {
        char path[400];
        snprintf(path, sizeof(path), "%s/go.%d", workdir, r);
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f, "%s: %s", path, strerror(errno));
        fclose(f);
    }
    for (int r = 0; r < N; r++) {
        result_t res = wait_result(r, 15);
        cr_assert(res.present, "rank %d reported nothing; its log:\n%s", r, rank_log(r));
        cr_expect(!res.ok, "rank %d received a message nobody sent", r);
        cr_expect(strstr(res.msg, "deadline") != NULL, "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(strstr(res.msg, "stalled") == NULL,
                  "rank %d blames a stalled rank though every rank is alive: %s", r, res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

/* A killed rank leaves connections in TIME_WAIT on its port; a new process
 * must be able to listen there at once. */
Test(ucx, restart_listens_on_same_port, .init = setup, .fini = teardown, .timeout = 60)
{
    int port = free_port();
    pid_t pids[2];
    rank_args_t a0 = {.tls = "tcp", .bytes = 100000, .duration_s = 30, .port = port};
    rank_args_t a1 = {.tls = "tcp", .bytes = 100000, .duration_s = 30};
    pids[0] = spawn_rank(0, 2, &a0);
    pids[1] = spawn_rank(1, 2, &a1);
    wait_file("ready", 0, 30);
    wait_file("ready", 1, 30);
    kill(pids[0], SIGKILL);
    reap(pids[0], 5);
    cr_assert(wait_result(1, 10).present);
    reap(pids[1], 5);
    char path[400];
    snprintf(path, sizeof(path), "%s/result.0", workdir);
    remove(path);
    rank_args_t again = {.tls = "tcp", .port = port, .mode = "listen"};
    pid_t p = spawn_rank(0, 2, &again);
    int status = reap(p, 20);
    result_t res = read_result(0);
    cr_assert(res.present && res.ok, "listening again on port %d failed: %s: %s", port, res.status,
              res.msg);
    cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}
