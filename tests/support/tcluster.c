#include "tcluster.h"

#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define COORD_LINE  "stria-coordinator listening on "
#define WORKER_LINE "stria-worker listening rpc="

void tcl_init(tcluster_t *c, const char *name, char *const *env)
{
    char cmd[300];
    memset(c, 0, sizeof(*c));
    c->env = env;
    snprintf(c->dir, sizeof(c->dir), "/tmp/stria_%s_%d", name, (int)getpid());
    snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", c->dir, c->dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

void tcl_start_coordinator(tcluster_t *c, char *const argv[])
{
    char log[256], line[256];
    snprintf(log, sizeof(log), "%s/coordinator.log", c->dir);
    c->coord = test_proc_start(argv, log, c->env);
    cr_assert_not_null(c->coord);
    cr_assert(test_proc_wait_line(c->coord, COORD_LINE, 10, line, sizeof(line)),
              "the coordinator did not start (see %s)", log);
    snprintf(c->coord_addr, sizeof(c->coord_addr), "%s", line + strlen(COORD_LINE));
}

void tcl_start_worker(tcluster_t *c, int i, char *const argv[])
{
    char log[256], line[256];
    cr_assert(i >= 0 && i < TCL_MAX_WORKERS && c->workers[i] == NULL, "worker %d", i);
    snprintf(log, sizeof(log), "%s/worker%d.log", c->dir, i);
    c->workers[i] = test_proc_start(argv, log, c->env);
    cr_assert_not_null(c->workers[i]);
    cr_assert(test_proc_wait_line(c->workers[i], WORKER_LINE, 10, line, sizeof(line)),
              "worker %d did not start (see %s)", i, log);
    char *rpc = line + strlen(WORKER_LINE);
    rpc[strcspn(rpc, " ")] = '\0';
    snprintf(c->worker_rpc[i], sizeof(c->worker_rpc[i]), "%s", rpc);
    c->n = i + 1 > c->n ? i + 1 : c->n;
    c->alive++;
}

void tcl_kill_worker(tcluster_t *c, int i)
{
    cr_assert_not_null(c->workers[i], "worker %d is not running", i);
    test_proc_stop(c->workers[i], SIGKILL, 10);
    c->workers[i] = NULL;
    c->alive--;
}

void tcl_stop(tcluster_t *c)
{
    char cmd[300];
    for (int i = 0; i < c->n; i++) {
        if (c->workers[i] == NULL)
            continue;
        int st = test_proc_stop(c->workers[i], SIGTERM, 20);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "worker %d did not exit cleanly on SIGTERM (status %#x)", i, st);
        c->workers[i] = NULL;
    }
    c->alive = 0;
    if (c->coord != NULL) {
        int st = test_proc_stop(c->coord, SIGTERM, 20);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "the coordinator did not exit cleanly on SIGTERM (status %#x)", st);
        c->coord = NULL;
    }
    snprintf(cmd, sizeof(cmd), "rm -rf %s", c->dir);
    if (getenv("STRIA_TEST_KEEP") == NULL) /* the logs, for a look */
        cr_expect_eq(system(cmd), 0, "%s", cmd);
}
