/* Daemons started by a test die with it, however it dies (tests/common/proc.h),
 * and tests/reap.sh finds and kills what a run left behind by its marker.
 *
 * Each test starts a real stria-coordinator. Two tests run this very suite
 * again as a second Criterion run (the reap_inner tests, skipped unless
 * REAP_INNER_ENV names a pid file) with a marker of its own, then kill it the
 * way a harness does: SIGKILL to the runner (as `timeout -s KILL` does; ctest's
 * own timeout kills the whole tree, which takes the daemons too) or
 * Criterion's per-test timeout, which SIGKILLs the test's process, and
 * nothing else. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proc.h"

#ifndef STRIA_COORDINATOR_BIN
#error "STRIA_COORDINATOR_BIN must name the stria-coordinator program"
#endif
#ifndef STRIA_REAP_SH
#error "STRIA_REAP_SH must name tests/reap.sh"
#endif

/* Where a reap_inner test writes its daemon's pid; unset: not an inner run. */
#define REAP_INNER_ENV "STRIA_REAP_INNER_PIDFILE"
#define LISTENING      "stria-coordinator listening on "

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* A coordinator on an ephemeral port, up and listening; NULL if it is not.
 * env: extra "NAME=value" entries or NULL. */
static test_proc_t *start_coordinator(char *const env[])
{
    char *argv[] = {STRIA_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--log-level", "error", NULL};
    test_proc_t *p = test_proc_start(argv, "/dev/null", env);
    if (p == NULL)
        return NULL;
    if (!test_proc_wait_line(p, LISTENING, 10.0, NULL, 0)) {
        test_proc_stop(p, SIGKILL, 1.0);
        return NULL;
    }
    return p;
}

/* /proc/PID/NAME into buf, NUL-terminated; its length, or -1 if it cannot be
 * read (the process is gone). */
static long read_proc(pid_t pid, const char *name, char *buf, size_t cap)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, name);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[n] = '\0';
    return (long)n;
}

/* Whether pid is gone (or a zombie nobody reaps: it runs no more). */
static bool gone(pid_t pid)
{
    char stat[512];
    if (read_proc(pid, "stat", stat, sizeof(stat)) < 0)
        return true;
    const char *end = strrchr(stat, ')'); /* "PID (COMM) STATE ..." */
    return end == NULL || end[1] == '\0' || end[2] == 'Z' || end[2] == 'X';
}

static bool gone_within(pid_t pid, double timeout_s)
{
    double end = now_s() + timeout_s;
    while (!gone(pid)) {
        if (now_s() >= end)
            return false;
        sleep_s(0.01);
    }
    return true;
}

/* Whether the environment of pid holds exactly "TEST_RUN_ENV=id". */
static bool marked(pid_t pid, const char *id)
{
    static char env[1 << 16];
    char want[256];
    snprintf(want, sizeof(want), "%s=%s", TEST_RUN_ENV, id);
    long n = read_proc(pid, "environ", env, sizeof(env));
    for (long i = 0; i < n; i += (long)strlen(env + i) + 1)
        if (strcmp(env + i, want) == 0)
            return true;
    return false;
}

/* Runs tests/reap.sh MODE ID (with REAP_GRACE_S=grace); its stdout and
 * stderr in out; returns its exit code (-1 if it did not exit). */
static int reap_sh(const char *mode, const char *id, const char *grace, char *out, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "REAP_GRACE_S=%s '%s' %s '%s' 2>&1", grace, STRIA_REAP_SH, mode, id);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f, "popen: %s", strerror(errno));
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int status = pclose(f);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Whether reap.sh's output lists pid as the first word of a line. */
static bool lists(const char *out, pid_t pid)
{
    char want[32];
    int len = snprintf(want, sizeof(want), "%d ", (int)pid);
    for (const char *l = out; l != NULL; l = strchr(l, '\n') != NULL ? strchr(l, '\n') + 1 : NULL)
        if (strncmp(l, want, (size_t)len) == 0)
            return true;
    return false;
}

/* Reads a decimal pid from fd, up to a newline or EOF, waiting up to
 * timeout_s for it. A newline, since the writer's daemon holds the write end
 * open too. */
static pid_t read_pid(int fd, double timeout_s)
{
    char buf[32];
    size_t len = 0;
    double end = now_s() + timeout_s;
    while (len < sizeof(buf) - 1 && memchr(buf, '\n', len) == NULL) {
        double left = end - now_s();
        struct pollfd pfd = {fd, POLLIN, 0};
        if (left <= 0 || poll(&pfd, 1, (int)(left * 1000) + 1) <= 0)
            break;
        ssize_t n = read(fd, buf + len, sizeof(buf) - 1 - len);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    return (pid_t)atoi(buf);
}

/* ---- the inner run: each holds a daemon until something kills the test ---- */

/* Starts a coordinator, publishes its pid, and waits to be killed. */
static void hold_a_daemon(void)
{
    const char *pidfile = getenv(REAP_INNER_ENV);
    if (pidfile == NULL)
        cr_skip_test("run by the reap tests, in a run of their own");
    test_proc_t *p = start_coordinator(NULL);
    cr_assert_not_null(p, "the coordinator did not start");
    char tmp[512];
    snprintf(tmp, sizeof(tmp), "%s.tmp", pidfile);
    FILE *f = fopen(tmp, "w");
    cr_assert_not_null(f);
    fprintf(f, "%d", (int)test_proc_pid(p));
    fclose(f);
    cr_assert_eq(rename(tmp, pidfile), 0); /* the reader sees all of it or nothing */
    for (;;)
        pause();
}

Test(reap_inner, holds_a_daemon)
{
    hold_a_daemon();
}

Test(reap_inner, times_out_holding_a_daemon, .timeout = 3)
{
    hold_a_daemon();
}

/* Runs the test reap_inner/`test` of this executable as a Criterion run of
 * its own, with a run id of its own (written to id), and waits for the pid of
 * the daemon it holds; *runner is the runner's pid. */
static pid_t start_inner_run(const char *test, char *id, size_t id_len, pid_t *runner)
{
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    cr_assert_gt(n, 0, "readlink: %s", strerror(errno));
    exe[n] = '\0';
    char pidfile[256], filter_arg[256], id_entry[600], pidfile_entry[300];
    snprintf(id, id_len, "%s-%s-%d", test_proc_run_id(), test, (int)getpid());
    snprintf(pidfile, sizeof(pidfile), "/tmp/stria-reap-%s-%d.pid", test, (int)getpid());
    snprintf(filter_arg, sizeof(filter_arg), "--filter=reap_inner/%s", test);
    snprintf(id_entry, sizeof(id_entry), "%s=%s", TEST_RUN_ENV, id);
    snprintf(pidfile_entry, sizeof(pidfile_entry), "%s=%s", REAP_INNER_ENV, pidfile);
    /* The environment is built here: setenv() in a child of a threaded
     * process may deadlock. BoxFort's BXFI_* variables would make the new
     * runner take itself for one of its test processes. */
    extern char **environ;
    size_t n_env = 0;
    while (environ[n_env] != NULL)
        n_env++;
    char **envp = calloc(n_env + 3, sizeof(*envp));
    cr_assert_not_null(envp);
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++)
        if (strncmp(environ[i], TEST_RUN_ENV "=", strlen(TEST_RUN_ENV "=")) != 0 &&
            strncmp(environ[i], "BXFI_", 5) != 0)
            envp[k++] = environ[i];
    envp[k++] = id_entry;
    envp[k++] = pidfile_entry;
    char *argv[] = {exe, filter_arg, "--jobs=1", NULL};
    unlink(pidfile);
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        test_proc_child_setup(parent);
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 1);
            dup2(null, 2);
        }
        execve(exe, argv, envp);
        _exit(127);
    }
    free(envp);
    *runner = pid;

    pid_t daemon = 0;
    double end = now_s() + 15.0;
    int fd;
    while ((fd = open(pidfile, O_RDONLY)) < 0 && now_s() < end)
        sleep_s(0.02);
    if (fd >= 0) {
        daemon = read_pid(fd, 0.1);
        close(fd);
        unlink(pidfile);
    }
    if (daemon <= 0) {
        char out[4096];
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        reap_sh("--kill", id, "0", out, sizeof(out));
        cr_assert_fail("the inner run did not start a coordinator");
    }
    return daemon;
}

/* After the inner run is gone: its daemon is gone too (killed here if not,
 * so that a failure leaves nothing behind), and reap.sh finds nothing of
 * that run, Criterion's runner and worker included. */
static void expect_nothing_left(pid_t daemon, const char *id)
{
    bool daemon_gone = gone_within(daemon, 2.0);
    if (!daemon_gone)
        kill(daemon, SIGKILL);
    cr_expect(daemon_gone, "the daemon (pid %d) outlived the test that started it", (int)daemon);
    char out[4096];
    int rc = 0;
    double end = now_s() + 2.0;
    while ((rc = reap_sh("--list", id, "0", out, sizeof(out))) == 1 && now_s() < end)
        sleep_s(0.05);
    cr_expect_eq(rc, 0, "processes of the killed run survive:\n%s", out);
    if (rc != 0)
        reap_sh("--kill", id, "0", out, sizeof(out));
}

/* ---- the tests ---------------------------------------------------------- */

Test(reap, daemon_dies_with_the_process_that_started_it)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t parent = getpid();
    pid_t holder = fork();
    cr_assert_geq(holder, 0);
    if (holder == 0) {
        test_proc_child_setup(parent);
        close(fds[0]);
        test_proc_t *p = start_coordinator(NULL);
        char buf[32];
        int len = snprintf(buf, sizeof(buf), "%d\n", p != NULL ? (int)test_proc_pid(p) : 0);
        if (write(fds[1], buf, (size_t)len) != len)
            _exit(1);
        close(fds[1]);
        for (;;)
            pause();
    }
    close(fds[1]);
    pid_t daemon = read_pid(fds[0], 15.0);
    close(fds[0]);
    if (daemon <= 0) {
        kill(holder, SIGKILL);
        waitpid(holder, NULL, 0);
        cr_assert_fail("the holder did not start a coordinator");
    }

    /* The marker is what reap.sh goes by: the daemon carries this run's. */
    cr_expect(marked(daemon, test_proc_run_id()), "the daemon does not carry %s=%s", TEST_RUN_ENV,
              test_proc_run_id());
    char out[1 << 14];
    cr_expect_eq(reap_sh("--list", test_proc_run_id(), "0", out, sizeof(out)), 1);
    cr_expect(lists(out, daemon), "reap.sh --list does not show the daemon %d:\n%s", (int)daemon,
              out);

    /* No atexit, no cleanup: only the parent-death signal can take it. */
    cr_assert_eq(kill(holder, SIGKILL), 0);
    cr_assert_eq(waitpid(holder, NULL, 0), holder);
    bool daemon_gone = gone_within(daemon, 2.0);
    if (!daemon_gone)
        kill(daemon, SIGKILL);
    cr_expect(daemon_gone, "the daemon (pid %d) outlived its killed holder", (int)daemon);
}

Test(reap, kill_mode_kills_exactly_the_marked_run)
{
    char id[320], other[256], env_entry[400];
    snprintf(other, sizeof(other), "%s-kill-%d", test_proc_run_id(), (int)getpid());
    /* A prefix of the daemon's id: must not match. */
    snprintf(id, sizeof(id), "%s-victim", other);
    snprintf(env_entry, sizeof(env_entry), "%s=%s", TEST_RUN_ENV, id);
    char *env[] = {env_entry, NULL};
    test_proc_t *p = start_coordinator(env);
    cr_assert_not_null(p, "the coordinator did not start");
    pid_t daemon = test_proc_pid(p);

    char out[4096];
    cr_expect_eq(reap_sh("--kill", other, "0.2", out, sizeof(out)), 0, "%s", out);
    cr_expect_str_empty(out, "a clean run must print nothing");
    cr_expect(test_proc_alive(p), "reap.sh killed a process of another run");

    cr_expect_eq(reap_sh("--kill", id, "0.2", out, sizeof(out)), 1);
    cr_expect(lists(out, daemon), "reap.sh --kill did not name the daemon %d:\n%s", (int)daemon,
              out);
    cr_expect(strstr(out, STRIA_COORDINATOR_BIN) != NULL, "no command line:\n%s", out);
    int status = test_proc_wait(p, 2.0);
    cr_expect(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
              "the daemon was not killed by reap.sh (status 0x%x)", status);
    cr_expect_eq(reap_sh("--list", id, "0", out, sizeof(out)), 0, "%s", out);
}

Test(reap, daemon_dies_when_the_suite_runner_is_killed)
{
    char id[512], out[4096];
    pid_t runner;
    pid_t daemon = start_inner_run("holds_a_daemon", id, sizeof(id), &runner);
    cr_expect_eq(reap_sh("--list", id, "0", out, sizeof(out)), 1);
    cr_expect(lists(out, daemon), "reap.sh --list does not show the daemon %d:\n%s", (int)daemon,
              out);

    /* Only the runner, as `timeout -s KILL` does: its per-test worker and the
     * daemon have to follow on their own. */
    cr_assert_eq(kill(runner, SIGKILL), 0);
    cr_assert_eq(waitpid(runner, NULL, 0), runner);
    expect_nothing_left(daemon, id);
}

Test(reap, daemon_dies_when_criterion_times_the_test_out)
{
    char id[512];
    pid_t runner;
    pid_t daemon = start_inner_run("times_out_holding_a_daemon", id, sizeof(id), &runner);
    int status = 0;
    double end = now_s() + 20.0;
    pid_t w;
    while ((w = waitpid(runner, &status, WNOHANG)) == 0 && now_s() < end)
        sleep_s(0.02);
    if (w != runner) {
        kill(runner, SIGKILL);
        waitpid(runner, NULL, 0);
    }
    cr_expect_eq(w, runner, "the inner run did not end after its test timed out");
    /* The inner test failed by its timeout; it never returns otherwise. */
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) != 0, "inner run status 0x%x", status);
    expect_nothing_left(daemon, id);
}
