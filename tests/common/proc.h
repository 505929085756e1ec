/* Test-only: start real daemons, read the lines they print, stop them.
 *
 * A failing test must never leave daemons behind, however it dies:
 *  - it returns or fails an assertion: every process started here is killed
 *    (SIGKILL) at exit if still alive;
 *  - it is killed (Criterion's per-test .timeout SIGKILLs the test process, a
 *    crash or a sanitizer abort skips atexit): each child has a parent-death
 *    signal (test_proc_child_setup), so it dies with the test process;
 *  - ctest's timeout: ctest (3.25) stops and SIGKILLs the suite's whole
 *    process tree itself; when only the suite runner is killed instead (e.g.
 *    `timeout -s KILL`), Criterion's per-test workers die with it (BoxFort
 *    gives them a parent-death signal too), and our children with them.
 * tests/common/test_reap.c checks each of these.
 *
 * A parent-death signal fires when the *thread* that forked exits, not the
 * process: start a daemon only from a thread that lives as long as the
 * daemon should (the test's own thread does; a helper thread that returns
 * kills the daemons it started).
 *
 * As a last resort every process of a test run carries TEST_RUN_ENV in its
 * environment, the run's id, by which tests/reap.sh finds and kills what
 * survived (tests/run.sh does after the tests). The id is inherited from the
 * environment (tests/run.sh sets one per run) or made up when the first
 * process of a suite starts. */
#ifndef STRIA_TEST_PROC_H
#define STRIA_TEST_PROC_H

#include <stdbool.h>
#include <sys/types.h>

typedef struct test_proc test_proc_t;

/* The environment variable that marks the processes of one test run. */
#define TEST_RUN_ENV "STRIA_TEST_RUN"

/* This run's id (the value of TEST_RUN_ENV, never NULL). */
const char *test_proc_run_id(void);

/* For any child a test forks, first thing after fork(): the child gets
 * SIGKILL when the thread that forked it exits, and exits at once (126) if
 * `parent` (getpid() before the fork) is already gone. */
void test_proc_child_setup(pid_t parent);

/* Starts argv[0] (a path) with argv in a child set up by
 * test_proc_child_setup(); stdout is read by test_proc_wait_line(), stderr
 * goes to `log_path` (NULL: inherited). env: NULL-terminated "NAME=value"
 * entries added to the environment, or NULL. */
test_proc_t *test_proc_start(char *const argv[], const char *log_path, char *const env[]);

/* Waits up to timeout_s for a stdout line starting with `prefix`; copies the
 * line (without newline) to out. Returns false on timeout or exit. */
bool test_proc_wait_line(test_proc_t *p, const char *prefix, double timeout_s, char *out,
                         size_t out_len);

pid_t test_proc_pid(const test_proc_t *p);

/* Sends `sig` and waits up to timeout_s for the exit; SIGKILL after that.
 * Returns the exit status as from waitpid (or -1). Frees p. */
int test_proc_stop(test_proc_t *p, int sig, double timeout_s);

/* Waits up to timeout_s for the process to exit, reading and dropping what
 * it prints meanwhile; returns whether it exited (it is not killed). */
bool test_proc_wait_exit(test_proc_t *p, double timeout_s);

/* Waits for the process to exit by itself (up to timeout_s; then SIGKILL).
 * Returns the waitpid status; frees p. */
int test_proc_wait(test_proc_t *p, double timeout_s);

/* Writes every thread's stack of a running process to `path` with gdb, for a
 * daemon that does not stop when asked (a hang to diagnose after the run).
 * Returns false when gdb is missing or cannot attach. */
bool test_proc_dump_stacks(test_proc_t *p, const char *path);

/* Whether the process is still running. */
bool test_proc_alive(test_proc_t *p);

#endif
