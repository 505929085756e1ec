#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct test_proc {
    pid_t pid;
    int out_fd;
    char buf[8192];
    size_t len;
    bool exited;
    int status;
    struct test_proc *next;
};

static test_proc_t *all_procs;
static bool atexit_set;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs when the program loads, while it has one thread (setenv is not
 * thread-safe), and in the Criterion runner before it starts the per-test
 * processes: every test of a suite run by hand then shares one made-up id. */
__attribute__((constructor)) static void ensure_run_id(void)
{
    const char *id = getenv(TEST_RUN_ENV);
    if (id != NULL && id[0] != '\0')
        return;
    char made[64];
    snprintf(made, sizeof(made), "manual-%d-%lld", (int)getpid(), (long long)time(NULL));
    setenv(TEST_RUN_ENV, made, 1);
}

const char *test_proc_run_id(void)
{
    const char *id = getenv(TEST_RUN_ENV);
    return id != NULL ? id : "";
}

void test_proc_child_setup(pid_t parent)
{
    /* SIGKILL: a daemon that is stopped, wedged or busy draining must not
     * outlive the test. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
        _exit(126);
    /* The parent may have died between fork() and prctl(): the signal then
     * never comes, and we have been reparented. */
    if (getppid() != parent)
        _exit(126);
}

static void kill_all(void)
{
    for (test_proc_t *p = all_procs; p != NULL; p = p->next)
        if (!p->exited && p->pid > 0) {
            kill(p->pid, SIGCONT);
            kill(p->pid, SIGKILL);
            waitpid(p->pid, NULL, 0);
        }
}

test_proc_t *test_proc_start(char *const argv[], const char *log_path, char *const env[])
{
    int pipefd[2];
    test_proc_t *p = calloc(1, sizeof(*p));
    if (p == NULL || pipe(pipefd) != 0) {
        free(p);
        return NULL;
    }
    if (!atexit_set) {
        atexit(kill_all);
        atexit_set = true;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(pipefd[0]);
        close(pipefd[1]);
        free(p);
        return NULL;
    }
    if (pid == 0) {
        test_proc_child_setup(parent);
        dup2(pipefd[1], 1);
        close(pipefd[0]);
        close(pipefd[1]);
        if (log_path != NULL) {
            int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (fd >= 0) {
                dup2(fd, 2);
                close(fd);
            }
        }
        for (size_t i = 0; env != NULL && env[i] != NULL; i++)
            putenv(env[i]);
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(pipefd[1]);
    p->pid = pid;
    p->out_fd = pipefd[0];
    p->next = all_procs;
    all_procs = p;
    return p;
}

pid_t test_proc_pid(const test_proc_t *p)
{
    return p->pid;
}

bool test_proc_wait_line(test_proc_t *p, const char *prefix, double timeout_s, char *out,
                         size_t out_len)
{
    double end = now_s() + timeout_s;
    size_t plen = strlen(prefix);
    for (;;) {
        /* complete lines already buffered */
        char *nl;
        while ((nl = memchr(p->buf, '\n', p->len)) != NULL) {
            size_t line_len = (size_t)(nl - p->buf);
            bool match = line_len >= plen && memcmp(p->buf, prefix, plen) == 0;
            if (match && out != NULL && out_len > 0) {
                size_t n = line_len < out_len - 1 ? line_len : out_len - 1;
                memcpy(out, p->buf, n);
                out[n] = '\0';
            }
            memmove(p->buf, nl + 1, p->len - line_len - 1);
            p->len -= line_len + 1;
            if (match)
                return true;
        }
        double left = end - now_s();
        if (left <= 0 || p->out_fd < 0)
            return false;
        struct pollfd pfd = {p->out_fd, POLLIN, 0};
        int rc = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (rc <= 0)
            continue;
        ssize_t n = read(p->out_fd, p->buf + p->len, sizeof(p->buf) - 1 - p->len);
        if (n <= 0) {
            close(p->out_fd);
            p->out_fd = -1;
            return false;
        }
        p->len += (size_t)n;
        if (p->len == sizeof(p->buf) - 1) /* an over-long line: drop it */
            p->len = 0;
    }
}

bool test_proc_alive(test_proc_t *p)
{
    if (p->exited)
        return false;
    if (waitpid(p->pid, &p->status, WNOHANG) == p->pid) {
        p->exited = true;
        return false;
    }
    return true;
}

static void unlink_proc(test_proc_t *p)
{
    test_proc_t **pp = &all_procs;
    while (*pp != NULL && *pp != p)
        pp = &(*pp)->next;
    if (*pp == p)
        *pp = p->next;
}

bool test_proc_wait_exit(test_proc_t *p, double timeout_s)
{
    double end = now_s() + timeout_s;
    /* What it prints now is read and dropped: a process blocked writing to
     * a full stdout pipe (lines nobody waited for) could not exit. */
    while (test_proc_alive(p) && now_s() < end) {
        struct pollfd pfd = {p->out_fd, POLLIN, 0};
        if (poll(&pfd, 1, 10) > 0 && p->out_fd >= 0) {
            char sink[4096];
            if (read(p->out_fd, sink, sizeof(sink)) <= 0) {
                close(p->out_fd);
                p->out_fd = -1;
            }
        }
    }
    return p->exited;
}

int test_proc_wait(test_proc_t *p, double timeout_s)
{
    test_proc_wait_exit(p, timeout_s);
    if (!p->exited) {
        kill(p->pid, SIGCONT);
        kill(p->pid, SIGKILL);
        waitpid(p->pid, &p->status, 0);
        p->exited = true;
    }
    int status = p->status;
    if (p->out_fd >= 0)
        close(p->out_fd);
    unlink_proc(p);
    free(p);
    return status;
}

bool test_proc_dump_stacks(test_proc_t *p, const char *path)
{
    if (p->exited || access("/usr/bin/gdb", X_OK) != 0)
        return false;
    char cmd[600];
    snprintf(cmd, sizeof(cmd),
             "/usr/bin/gdb -p %d -batch -nx -ex 'thread apply all bt' > '%.400s' 2>&1 < /dev/null",
             (int)p->pid, path);
    return system(cmd) == 0;
}

int test_proc_stop(test_proc_t *p, int sig, double timeout_s)
{
    if (!p->exited) {
        kill(p->pid, SIGCONT); /* a stopped process must run to handle sig */
        kill(p->pid, sig);
    }
    return test_proc_wait(p, timeout_s);
}
