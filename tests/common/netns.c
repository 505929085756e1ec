#include "netns.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int test_run_quiet(const char *cmd)
{
    char full[700];
    snprintf(full, sizeof(full), "%s >/dev/null 2>&1", cmd);
    int rc = system(full);
    return rc == -1 ? -1 : (WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void delete_all(const test_hosts_t *h)
{
    char cmd[100];
    for (int i = 0; i < h->n; i++) {
        snprintf(cmd, sizeof(cmd), "ip netns delete %s", h->ns[i]);
        test_run_quiet(cmd);
    }
}

/* A child that outlives the test process on purpose (no parent-death
 * signal) and deletes the namespaces once the pipe closes. */
static const char *start_guard(test_hosts_t *h)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0) /* daemons the test starts must not hold it */
        return "pipe failed";
    pid_t guard = fork();
    if (guard < 0)
        return "fork failed";
    if (guard == 0) {
        close(pfd[1]);
        char c;
        while (read(pfd[0], &c, 1) < 0 && errno == EINTR)
            ;
        delete_all(h);
        _exit(0);
    }
    close(pfd[0]);
    h->guard = guard;
    h->guard_fd = pfd[1];
    return NULL;
}

/* Host i (>= 1): a veth pair, its end in host i, the other on the bridge. */
static const char *add_host(const test_hosts_t *h, int i)
{
    char cmd[600];
    snprintf(cmd, sizeof(cmd),
             "ip link add %s netns %s type veth peer name %sp netns %s && "
             "ip -n %s link set %sp master %s && ip -n %s link set %sp up && "
             "ip -n %s addr add %s/24 dev %s && ip -n %s link set %s up && "
             "ip -n %s link set lo up",
             h->dev[i], h->ns[i], h->dev[i], h->ns[0], h->ns[0], h->dev[i], h->dev[0], h->ns[0],
             h->dev[i], h->ns[i], h->addr[i], h->dev[i], h->ns[i], h->dev[i], h->ns[i]);
    return test_run_quiet(cmd) == 0 ? NULL : "cannot create or configure a veth pair";
}

static const char *create(test_hosts_t *h)
{
    char cmd[600];
    if (geteuid() != 0)
        return "not running as root";
    if (test_run_quiet("ip -V") != 0)
        return "the ip command is not available";
    const char *why = start_guard(h);
    if (why != NULL)
        return why;
    for (int i = 0; i < h->n; i++) {
        snprintf(cmd, sizeof(cmd), "ip netns add %s", h->ns[i]);
        if (test_run_quiet(cmd) != 0)
            return "ip netns add failed (no permission or no namespace support)";
    }
    snprintf(cmd, sizeof(cmd),
             "ip -n %s link add %s type bridge && ip -n %s addr add %s/24 dev %s && "
             "ip -n %s link set %s up && ip -n %s link set lo up",
             h->ns[0], h->dev[0], h->ns[0], h->addr[0], h->dev[0], h->ns[0], h->dev[0], h->ns[0]);
    if (test_run_quiet(cmd) != 0)
        return "cannot create a bridge";
    for (int i = 1; i < h->n; i++)
        if ((why = add_host(h, i)) != NULL)
            return why;
    /* UCX only uses running interfaces; a new veth takes a moment. */
    for (int i = 1; i < h->n; i++) {
        snprintf(cmd, sizeof(cmd), "ip -n %s link show dev %s | grep -q 'state UP'", h->ns[i],
                 h->dev[i]);
        double until = mono_s() + 10;
        while (test_run_quiet(cmd) != 0 && mono_s() < until)
            usleep(20000);
        if (test_run_quiet(cmd) != 0)
            return "a veth pair does not come up";
    }
    return NULL;
}

const char *test_hosts_create(test_hosts_t *h, int n)
{
    memset(h, 0, sizeof(*h));
    if (n < 2 || n > TEST_HOSTS_MAX)
        return "2 to 4 hosts";
    h->n = n;
    int id = (int)getpid();
    for (int i = 0; i < n; i++) {
        snprintf(h->ns[i], sizeof(h->ns[i]), "stria-h%d-%c", id, 'a' + i);
        snprintf(h->dev[i], sizeof(h->dev[i]), "sh%d%c", id % 1000000, 'a' + i);
        snprintf(h->addr[i], sizeof(h->addr[i]), "10.79.0.%d", i + 1);
    }
    const char *why = create(h);
    if (why != NULL)
        test_hosts_destroy(h);
    return why;
}

void test_hosts_destroy(test_hosts_t *h)
{
    if (h->guard > 0) {
        delete_all(h);
        close(h->guard_fd);
        waitpid(h->guard, NULL, 0);
        h->guard = 0;
    }
}

int test_hosts_enter(const test_hosts_t *h, int i)
{
    char path[100];
    snprintf(path, sizeof(path), "/var/run/netns/%s", h->ns[i]);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc;
}

int test_hosts_link(const test_hosts_t *h, int i, bool up)
{
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "ip -n %s link set %s %s", h->ns[i], h->dev[i], up ? "up" : "down");
    return test_run_quiet(cmd);
}
