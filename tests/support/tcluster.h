/* Test-only (Criterion): a cluster of real daemons on loopback, started
 * from the argument lists a suite builds (its own flags, binaries and
 * layout), each waited for until it prints its "listening" line. Every
 * process is killed at exit if a test fails half-way (tests/common/proc.h). */
#ifndef STRIA_TEST_TCLUSTER_H
#define STRIA_TEST_TCLUSTER_H

#include "proc.h"

#define TCL_MAX_WORKERS 8

typedef struct {
    char dir[128];    /* scratch folder: logs, runtime directories */
    char *const *env; /* extra NAME=value entries of every daemon, or NULL */
    test_proc_t *coord;
    char coord_addr[256];
    test_proc_t *workers[TCL_MAX_WORKERS]; /* NULL: not started, stopped or killed */
    char worker_rpc[TCL_MAX_WORKERS][256]; /* their RPC addresses */
    int n;                                 /* workers started: the highest index + 1 */
    int alive;                             /* workers running */
} tcluster_t;

/* An empty cluster of a fresh scratch folder /tmp/stria_<name>_<pid>. */
void tcl_init(tcluster_t *c, const char *name, char *const *env);
/* Starts the coordinator (argv[0] its binary) with its log in the scratch
 * folder and waits (10 s) for its address. */
void tcl_start_coordinator(tcluster_t *c, char *const argv[]);
/* Starts worker i (argv[0] its binary) with its log in the scratch folder
 * and waits (10 s) for its RPC address. */
void tcl_start_worker(tcluster_t *c, int i, char *const argv[]);
/* Kills worker i at once (SIGKILL). */
void tcl_kill_worker(tcluster_t *c, int i);
/* SIGTERM to every daemon still running (each must exit 0 within 20 s),
 * then removes the scratch folder (kept, for its logs, when STRIA_TEST_KEEP
 * is set). */
void tcl_stop(tcluster_t *c);

#endif
