/* Test-only: start real daemons, read the lines they print, stop them.
 * Every process started here is killed (SIGKILL) at exit if still alive, so a
 * failing test never leaves daemons behind. */
#ifndef STRIA_TEST_PROC_H
#define STRIA_TEST_PROC_H

#include <stdbool.h>
#include <sys/types.h>

typedef struct test_proc test_proc_t;

/* Starts argv[0] (a path) with argv; stdout is read by test_proc_wait_line(),
 * stderr goes to `log_path` (NULL: inherited). env: NULL-terminated
 * "NAME=value" entries added to the environment, or NULL. */
test_proc_t *test_proc_start(char *const argv[], const char *log_path, char *const env[]);

/* Waits up to timeout_s for a stdout line starting with `prefix`; copies the
 * line (without newline) to out. Returns false on timeout or exit. */
bool test_proc_wait_line(test_proc_t *p, const char *prefix, double timeout_s, char *out,
                         size_t out_len);

pid_t test_proc_pid(const test_proc_t *p);

/* Sends `sig` and waits up to timeout_s for the exit; SIGKILL after that.
 * Returns the exit status as from waitpid (or -1). Frees p. */
int test_proc_stop(test_proc_t *p, int sig, double timeout_s);

/* Waits for the process to exit by itself (up to timeout_s; then SIGKILL).
 * Returns the waitpid status; frees p. */
int test_proc_wait(test_proc_t *p, double timeout_s);

/* Whether the process is still running. */
bool test_proc_alive(test_proc_t *p);

#endif
