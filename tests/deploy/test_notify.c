/* sd_notify as systemd sees it, through a NOTIFY_SOCKET this suite binds:
 * the coordinator is READY once listening; a worker only once registered
 * (started before its coordinator, it stays not-ready until the coordinator
 * comes up); STATUS= lines; WATCHDOG=1 with WATCHDOG_USEC; STOPPING=1 on
 * SIGTERM, then exit status 0. */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy_util.h"

#define SUITE_TIMEOUT 120

static char log_buf[16384];

Test(notify, coordinator_ready_status_stopping, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_notify_t n;
    dc_init(&c);
    dc_notify_open(&n, &c, "coordinator");
    char *env[] = {n.env, NULL};
    dc_opts_t o = {.env = env};
    dc_start_coordinator(&c, &o);
    /* "listening" was printed; READY=1 comes with a STATUS= line */
    log_buf[0] = '\0';
    cr_expect(dc_notify_wait(&n, "READY=1", 10, log_buf, sizeof(log_buf)),
              "no READY=1 from the coordinator: %s", log_buf);
    cr_expect(strstr(log_buf, "STATUS=serving on port ") != NULL, "%s", log_buf);
    /* a worker joining changes the STATUS line */
    dc_start_worker(&c, 0, NULL);
    cr_expect(dc_notify_wait(&n,
                             "STATUS=workers: 1 in the ring, 0 draining, 0 dead, 0 left; jobs: "
                             "0 active, 0 pending",
                             10, log_buf, sizeof(log_buf)),
              "no STATUS= update when a worker joined: %s", log_buf);
    int st = test_proc_stop(c.workers[0], SIGTERM, 15);
    c.workers[0] = NULL;
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %#x", st);
    cr_expect(dc_notify_wait(&n,
                             "STATUS=workers: 0 in the ring, 0 draining, 0 dead, 1 left; jobs: "
                             "0 active, 0 pending",
                             10, log_buf, sizeof(log_buf)),
              "no STATUS= update when the worker left: %s", log_buf);

    kill(test_proc_pid(c.coord), SIGTERM);
    cr_expect(dc_notify_wait(&n, "STOPPING=1", 10, log_buf, sizeof(log_buf)),
              "no STOPPING=1 on SIGTERM: %s", log_buf);
    st = test_proc_wait(c.coord, 10);
    c.coord = NULL;
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "coordinator status %#x", st);
    dc_notify_close(&n);
    dc_stop(&c);
}

Test(notify, worker_ready_only_once_registered, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_notify_t n;
    dc_init(&c);
    dc_notify_open(&n, &c, "worker");
    /* the worker starts first, pointed at a coordinator that is not up yet */
    int port = dc_free_port();
    snprintf(c.coord_addr, sizeof(c.coord_addr), "127.0.0.1:%d", port);
    char *env[] = {n.env, NULL};
    dc_opts_t o = {.env = env};
    dc_start_worker(&c, 0, &o);
    log_buf[0] = '\0';
    cr_expect(dc_notify_wait(&n, "STATUS=registering with the coordinator ", 10, log_buf,
                             sizeof(log_buf)),
              "no STATUS= while registering: %s", log_buf);
    cr_expect(!dc_notify_wait(&n, "READY=1", 1.5, log_buf, sizeof(log_buf)),
              "READY=1 before the worker registered: %s", log_buf);

    /* the coordinator comes up on that port: the worker registers, then READY */
    char listen[64], line[256], clog[256];
    snprintf(listen, sizeof(listen), "--listen=127.0.0.1:%d", port);
    snprintf(clog, sizeof(clog), "%s/coordinator.log", c.dir);
    char *argv[] = {STRIA_COORDINATOR_BIN, listen, "--heartbeat-period=0.2", NULL};
    char *cenv[] = {"STRIA_LOG_LEVEL=info", NULL};
    c.coord = test_proc_start(argv, clog, cenv);
    cr_assert(
        test_proc_wait_line(c.coord, "stria-coordinator listening on ", 15, line, sizeof(line)),
        "the coordinator did not start on port %d", port);
    cr_expect(dc_notify_wait(&n, "READY=1", 10, log_buf, sizeof(log_buf)),
              "no READY=1 after the coordinator came up: %s", log_buf);
    cr_expect(strstr(log_buf, "STATUS=worker 1 serving ") != NULL, "%s", log_buf);
    char *out = NULL;
    cr_expect_eq(dc_striactl(&c, NULL, &out, NULL, "--json", "status", NULL), 0);
    cr_expect_eq(dc_json_number(out, "workers_healthy"), 1, "%s", out);
    free(out);

    kill(test_proc_pid(c.workers[0]), SIGTERM);
    cr_expect(dc_notify_wait(&n, "STOPPING=1", 10, log_buf, sizeof(log_buf)),
              "no STOPPING=1 on SIGTERM: %s", log_buf);
    int st = test_proc_wait(c.workers[0], 10);
    c.workers[0] = NULL;
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %#x", st);
    dc_notify_close(&n);
    dc_stop(&c);
}

/* Counts WATCHDOG=1 datagrams within `seconds`. */
static int count_watchdogs(dc_notify_t *n, double seconds)
{
    int count = 0;
    double left = seconds;
    while (left > 0) {
        double t0 = stria_time_now();
        log_buf[0] = '\0';
        if (dc_notify_wait(n, "WATCHDOG=1", left, log_buf, sizeof(log_buf)))
            count++;
        left -= stria_time_now() - t0;
    }
    return count;
}

Test(notify, watchdog_pings_with_watchdog_usec, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_notify_t nc, nw;
    dc_init(&c);
    dc_notify_open(&nc, &c, "coordinator");
    dc_notify_open(&nw, &c, "worker");
    /* 400 ms: a ping every 200 ms */
    char *cenv[] = {nc.env, "WATCHDOG_USEC=400000", NULL};
    char *wenv[] = {nw.env, "WATCHDOG_USEC=400000", NULL};
    dc_opts_t co = {.env = cenv}, wo = {.env = wenv};
    dc_start_coordinator(&c, &co);
    dc_start_worker(&c, 0, &wo);
    int n_coord = count_watchdogs(&nc, 1.2), n_worker = count_watchdogs(&nw, 1.2);
    cr_expect(n_coord >= 3, "the coordinator sent %d WATCHDOG=1 in 1.2 s (WATCHDOG_USEC=400000)",
              n_coord);
    cr_expect(n_worker >= 3, "the worker sent %d WATCHDOG=1 in 1.2 s (WATCHDOG_USEC=400000)",
              n_worker);

    /* WATCHDOG_PID naming another process: no pings */
    char *oenv[] = {nw.env, "WATCHDOG_USEC=400000", "WATCHDOG_PID=1", NULL};
    dc_opts_t oo = {.env = oenv};
    int st = test_proc_stop(c.workers[0], SIGTERM, 15);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %#x", st);
    c.workers[0] = NULL;
    count_watchdogs(&nw, 0.3); /* what the old one sent last */
    dc_start_worker(&c, 0, &oo);
    cr_expect_eq(count_watchdogs(&nw, 1.0), 0, "pings although WATCHDOG_PID is another process");
    dc_notify_close(&nc);
    dc_notify_close(&nw);
    dc_stop(&c);
}
