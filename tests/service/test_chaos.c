/* Chaos: 6 workers, 4 client processes (chaos_client) running small jobs of
 * mixed sizes, layouts and dtypes (at least 48, for a minute), while a
 * driver SIGKILLs workers and restarts them, SIGSTOPs and SIGCONTs them, and
 * restarts the coordinator once (SIGKILL or SIGTERM), from a seed it prints
 * (STRIA_CHAOS_SEED=N repeats a run; STRIA_CHAOS_KEEP=DIR keeps the logs). At the end every job
 * returned results bit for bit those of the in-process ring that finally ran it, or a clear error
 * after its retries; no daemon died but the ones killed; no job is left active; the memory in use
 * of the workers never killed is back to its level before. Bounded to about two minutes. */
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

#define N_WORKERS 6
#define N_CLIENTS 4
#define JOBS_EACH 12
#define N_KEPT    2    /* workers 0 and 1 are stopped at times, never killed */
#define CHAOS_S   60.0 /* the clients run jobs and the driver acts this long */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* pool_in_use_bytes of the worker at `addr` in `striactl --json workers`
 * (-1: not listed). */
static double pool_in_use(const dcluster_t *c, const char *addr)
{
    char *out = NULL, key[300];
    if (dc_striactl(c, NULL, &out, NULL, "--json", "workers", NULL) != 0) {
        free(out);
        return -1;
    }
    snprintf(key, sizeof(key), "\"rpc_address\":\"%s\"", addr);
    const char *w = strstr(out, key);
    double v = w ? dc_json_number(w, "pool_in_use_bytes") : -1;
    free(out);
    return v;
}

static int active_jobs(const dcluster_t *c)
{
    char *out = NULL;
    int n = -1;
    if (dc_striactl(c, NULL, &out, NULL, "--json", "jobs", NULL) == 0) {
        n = 0;
        for (const char *p = out; (p = strstr(p, "\"state\":")) != NULL; p++)
            n++;
    }
    free(out);
    return n;
}

typedef struct {
    int ok, retried, errors, errors_retryable, mismatches, lines;
    int grouped; /* ok calls of head-grouped sessions */
} tally_t;

static void tally_file(const char *path, tally_t *t)
{
    char *text = dc_read(path);
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        t->lines++;
        if (strstr(line, " ok ") != NULL) {
            t->ok++;
            t->retried += strstr(line, " retries=0 ") == NULL;
            t->grouped += strstr(line, " head-groups=") != NULL;
        } else if (strstr(line, " error ") != NULL) {
            t->errors++;
            t->errors_retryable += strstr(line, " retryable=1 ") != NULL;
            fprintf(stderr, "chaos: %s\n", line);
        } else {
            t->mismatches++;
            fprintf(stderr, "chaos: %s\n", line);
        }
    }
    free(text);
}

Test(chaos, kills_stops_and_restarts_under_load, .timeout = 400)
{
    const char *env_seed = getenv("STRIA_CHAOS_SEED");
    uint64_t seed = env_seed ? strtoull(env_seed, NULL, 10) : (uint64_t)time(NULL);
    fprintf(stderr, "chaos seed: %llu (STRIA_CHAOS_SEED=%llu repeats it)\n",
            (unsigned long long)seed, (unsigned long long)seed);
    uint64_t s = seed * 2654435761u + 1;

    dcluster_t c;
    dc_opts_t o = {.heartbeat_period_s = 0.2, .step_timeout_s = 2};
    dc_start(&c, N_WORKERS, &o);
    double base[N_KEPT];
    for (int i = 0; i < N_KEPT; i++) {
        base[i] = pool_in_use(&c, c.worker_rpc[i]);
        cr_assert_geq(base[i], 0);
    }

    test_proc_t *clients[N_CLIENTS];
    char outs[N_CLIENTS][300];
    for (int i = 0; i < N_CLIENTS; i++) {
        char seed_s[32], n_s[16], secs[16], log[300];
        snprintf(seed_s, sizeof(seed_s), "%llu", (unsigned long long)(seed + (uint64_t)i));
        snprintf(n_s, sizeof(n_s), "%d", JOBS_EACH);
        snprintf(secs, sizeof(secs), "%g", CHAOS_S);
        snprintf(outs[i], sizeof(outs[i]), "%s/client%d.out", c.dir, i);
        snprintf(log, sizeof(log), "%s/client%d.log", c.dir, i);
        char *argv[] = {CHAOS_CLIENT_BIN, c.coord_addr, seed_s, n_s, secs, outs[i], NULL};
        clients[i] = test_proc_start(argv, log, NULL);
        cr_assert_not_null(clients[i]);
    }

    /* the driver: one action every 0.5 .. 2 s */
    bool stopped[N_WORKERS] = {false};
    double restart_at[N_WORKERS] = {0}, cont_at[N_WORKERS] = {0};
    int kills = 0, stops = 0, restarts = 0, coord_restarts = 0;
    double start = now_s(), next_act = start + 0.5;
    /* the coordinator goes down once, somewhere in the middle third */
    double coord_at = start + CHAOS_S / 3 + (double)(rng(&s) % 20000) / 1000.0;
    int coord_sig = rng(&s) % 2 ? SIGKILL : SIGTERM;
    for (;;) {
        double t = now_s();
        int running = 0;
        for (int i = 0; i < N_CLIENTS; i++)
            running += test_proc_alive(clients[i]);
        if (running == 0 || t - start > CHAOS_S + 60)
            break;
        for (int i = 0; i < N_WORKERS; i++) {
            if (stopped[i] && t >= cont_at[i]) {
                kill(test_proc_pid(c.workers[i]), SIGCONT);
                stopped[i] = false;
            }
            if (c.workers[i] == NULL && t >= restart_at[i]) {
                dc_start_worker(&c, i, &o);
                restarts++;
            }
        }
        if (coord_restarts == 0 && t >= coord_at) {
            fprintf(stderr, "chaos: the coordinator restarts (%s) at %.1f s\n",
                    coord_sig == SIGKILL ? "SIGKILL" : "SIGTERM", t - start);
            dc_restart_coordinator(&c, &o, coord_sig, 0.3);
            coord_restarts++;
            continue;
        }
        if (t >= next_act && t - start < CHAOS_S) {
            int alive = 0;
            for (int i = 0; i < N_WORKERS; i++)
                alive += c.workers[i] != NULL && !stopped[i];
            /* half kills (of the workers not kept), half stops (of any) */
            bool do_kill = rng(&s) % 2 == 0;
            int w = do_kill ? N_KEPT + (int)(rng(&s) % (N_WORKERS - N_KEPT))
                            : (int)(rng(&s) % N_WORKERS);
            if (c.workers[w] != NULL && !stopped[w] && alive > 4) {
                if (do_kill) {
                    test_proc_stop(c.workers[w], SIGKILL, 5);
                    c.workers[w] = NULL;
                    restart_at[w] = t + 1.0 + (double)(rng(&s) % 2000) / 1000.0;
                    kills++;
                } else {
                    kill(test_proc_pid(c.workers[w]), SIGSTOP);
                    stopped[w] = true;
                    cont_at[w] = t + 0.5 + (double)(rng(&s) % 1500) / 1000.0;
                    stops++;
                }
            }
            next_act = t + 0.5 + (double)(rng(&s) % 1500) / 1000.0;
        }
        usleep(50000);
    }
    for (int i = 0; i < N_WORKERS; i++)
        if (stopped[i])
            kill(test_proc_pid(c.workers[i]), SIGCONT);
    double took = now_s() - start;

    tally_t t = {0};
    for (int i = 0; i < N_CLIENTS; i++) {
        int st = test_proc_wait(clients[i], 5);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "client %d: status %#x (a job broke the rules; see %s)", i, st, outs[i]);
        tally_file(outs[i], &t);
    }
    fprintf(stderr,
            "chaos: %d jobs in %.1f s: %d ok (%d after retries, %d on head-grouped sessions), "
            "%d errors (%d retryable), %d mismatches; %d kills, %d restarts, %d stops, %d "
            "coordinator restart\n",
            t.lines, took, t.ok, t.retried, t.grouped, t.errors, t.errors_retryable, t.mismatches,
            kills, restarts, stops, coord_restarts);
    cr_expect_geq(t.lines, N_CLIENTS * JOBS_EACH, "every job reports");
    cr_expect_eq(t.mismatches, 0);
    cr_expect_geq(t.ok, t.lines / 2, "most jobs get through (%d of %d)", t.ok, t.lines);
    cr_expect_geq(kills, 3, "the driver killed too little");
    cr_expect_geq(stops, 3, "the driver stopped too little");
    cr_expect_eq(coord_restarts, 1, "the coordinator was not restarted");

    /* no daemon died but the killed ones */
    cr_expect(test_proc_alive(c.coord), "the coordinator died");
    for (int i = 0; i < N_WORKERS; i++)
        cr_expect(c.workers[i] == NULL || test_proc_alive(c.workers[i]), "worker %d died", i);

    /* nothing left active; the kept workers' memory back to its level */
    double end = now_s() + 20;
    int active = -1;
    while (now_s() < end && (active = active_jobs(&c)) != 0)
        usleep(200000);
    cr_expect_eq(active, 0, "jobs left active");
    for (int i = 0; i < N_KEPT; i++) {
        double v = -1;
        while (now_s() < end && (v = pool_in_use(&c, c.worker_rpc[i])) != base[i])
            usleep(200000);
        cr_expect_eq(v, base[i], "worker %d: %g bytes in use, %g before", i, v, base[i]);
    }
    if (getenv("STRIA_CHAOS_KEEP") != NULL) { /* the daemons' logs, for a look after */
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "cp -r %s %.400s", c.dir, getenv("STRIA_CHAOS_KEEP"));
        cr_expect_eq(system(cmd), 0);
    }
    dc_stop(&c);
}
