/* Helpers of the UCX link suites (test_ucx_*): a work directory per test,
 * rank processes (ucx_ring_rank) with their results and logs, and a free
 * port. Every child dies with the test process (test_proc_child_setup) and
 * is killed at the end of each test. Static inline: each suite is one file. */
#ifndef STRIA_TEST_UCX_TEST_UTIL_H
#define STRIA_TEST_UCX_TEST_UTIL_H

#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "netns.h"
#include "proc.h"
#include "stria_transport.h"
#include "ucx_engine_case.h"
#include "ucx_int.h"

#ifndef STRIA_UCX_RING_RANK
#error "STRIA_UCX_RING_RANK must name the ucx_ring_rank helper"
#endif

#define MAX_CHILDREN 16

/* ---- child processes ---------------------------------------------------- */

static pid_t children[MAX_CHILDREN];
static int n_children;
static char workdir[256];

static inline int rm_cb(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static inline void kill_children(void)
{
    for (int i = 0; i < n_children; i++)
        if (children[i] > 0) {
            kill(children[i], SIGCONT);
            kill(children[i], SIGKILL);
            waitpid(children[i], NULL, 0);
            children[i] = 0;
        }
    n_children = 0;
}

static inline void setup(void)
{
    setenv("UCX_HANDLE_ERRORS", "none", 1);
    snprintf(workdir, sizeof(workdir), "/tmp/stria-ucx-test.XXXXXX");
    cr_assert_not_null(mkdtemp(workdir), "mkdtemp: %s", strerror(errno));
}

static inline void teardown(void)
{
    kill_children();
    if (workdir[0] != '\0')
        nftw(workdir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    workdir[0] = '\0';
}

/* Starts argv (argv[0] is a path or a name in PATH); stderr goes to a file of
 * the work directory named after `tag`. */
static inline pid_t spawn(char *const argv[], const char *tag)
{
    cr_assert_lt(n_children, MAX_CHILDREN);
    char log[400];
    snprintf(log, sizeof(log), "%s/stderr.%s", workdir, tag);
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        test_proc_child_setup(parent);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 2);
            dup2(fd, 1);
            close(fd);
        }
        execvp(argv[0], argv);
        _exit(127);
    }
    children[n_children++] = pid;
    return pid;
}

/* Waits for a child to exit; returns its waitpid status or -1 on timeout. */
static inline int reap(pid_t pid, double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    int status;
    while (stria_time_now() < until) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) {
            for (int i = 0; i < n_children; i++)
                if (children[i] == pid)
                    children[i] = 0;
            return status;
        }
        usleep(2000);
    }
    return -1;
}

typedef struct {
    bool present;
    bool ok;
    char status[64];
    char msg[1024];
} result_t;

static inline result_t read_result(int rank)
{
    result_t r = {0};
    char path[400], line[1100];
    snprintf(path, sizeof(path), "%s/result.%d", workdir, rank);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return r;
    r.present = true;
    if (fgets(line, sizeof(line), f) != NULL)
        r.ok = strncmp(line, "ok", 2) == 0;
    if (fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        snprintf(r.status, sizeof(r.status), "%.60s", line);
    }
    if (fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        snprintf(r.msg, sizeof(r.msg), "%.1000s", line);
    }
    fclose(f);
    return r;
}

/* The end of a rank's stderr, for failure messages. */
static inline const char *rank_log(int rank)
{
    static char text[1600];
    char path[400];
    snprintf(path, sizeof(path), "%s/stderr.%d", workdir, rank);
    text[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return text;
    if (fseek(f, 0, SEEK_END) == 0) {
        long end = ftell(f);
        fseek(f, end > (long)sizeof(text) - 1 ? end - (long)sizeof(text) + 1 : 0, SEEK_SET);
    }
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    text[n] = '\0';
    fclose(f);
    return text;
}

static inline bool file_exists(const char *name, int rank)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/%s.%d", workdir, name, rank);
    return access(path, F_OK) == 0;
}

static inline result_t wait_result(int rank, double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    result_t r;
    while (!(r = read_result(rank)).present && stria_time_now() < until)
        usleep(2000);
    return r;
}

static inline void wait_file(const char *name, int rank, double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    while (!file_exists(name, rank) && stria_time_now() < until)
        usleep(5000);
    cr_assert(file_exists(name, rank), "rank %d wrote no %s file within %.0f s; log:\n%s", rank,
              name, timeout_s, rank_log(rank));
}

/* Arguments of one rank process. */
typedef struct {
    const char *netns; /* run inside this network namespace */
    const char *tls;
    const char *net_devices;
    const char *listen_host;
    const char *next_host;
    int port, next_port;
    size_t bytes;
    int passes;
    double duration_s;
    double step_timeout_s;
    double heartbeat_s, stall_s; /* 0: the link's defaults */
    int late_recv_ms;
    const char *mode;
    const char *engine; /* --mode engine: the problem spec */
    int links;          /* --mode links: how many (0: the rank's default) */
} rank_args_t;

static inline pid_t spawn_rank(int rank, int size, const rank_args_t *a)
{
    char s_rank[16], s_size[16], s_bytes[32], s_passes[16], s_dur[32], s_step[32], s_port[16],
        s_next_port[16], s_late[16], s_hb[32], s_stall[32], s_links[16], tag[16];
    char *argv[64];
    int n = 0;
    if (a->netns != NULL) {
        argv[n++] = "ip";
        argv[n++] = "netns";
        argv[n++] = "exec";
        argv[n++] = (char *)a->netns;
    }
    snprintf(s_rank, sizeof(s_rank), "%d", rank);
    snprintf(s_size, sizeof(s_size), "%d", size);
    snprintf(s_bytes, sizeof(s_bytes), "%zu", a->bytes ? a->bytes : 4096);
    snprintf(s_passes, sizeof(s_passes), "%d", a->passes ? a->passes : 1);
    snprintf(s_dur, sizeof(s_dur), "%g", a->duration_s);
    snprintf(s_step, sizeof(s_step), "%g", a->step_timeout_s > 0 ? a->step_timeout_s : 10.0);
    snprintf(s_port, sizeof(s_port), "%d", a->port);
    snprintf(s_next_port, sizeof(s_next_port), "%d", a->next_port);
    snprintf(s_late, sizeof(s_late), "%d", a->late_recv_ms);
    argv[n++] = STRIA_UCX_RING_RANK;
    argv[n++] = "--rank";
    argv[n++] = s_rank;
    argv[n++] = "--size";
    argv[n++] = s_size;
    argv[n++] = "--dir";
    argv[n++] = workdir;
    argv[n++] = "--bytes";
    argv[n++] = s_bytes;
    argv[n++] = "--passes";
    argv[n++] = s_passes;
    argv[n++] = "--duration";
    argv[n++] = s_dur;
    argv[n++] = "--step-timeout";
    argv[n++] = s_step;
    argv[n++] = "--port";
    argv[n++] = s_port;
    argv[n++] = "--next-port";
    argv[n++] = s_next_port;
    argv[n++] = "--late-recv";
    argv[n++] = s_late;
    argv[n++] = "--connect-timeout";
    argv[n++] = "20";
    if (a->tls != NULL) {
        argv[n++] = "--tls";
        argv[n++] = (char *)a->tls;
    }
    if (a->net_devices != NULL) {
        argv[n++] = "--net-devices";
        argv[n++] = (char *)a->net_devices;
    }
    if (a->listen_host != NULL) {
        argv[n++] = "--listen-host";
        argv[n++] = (char *)a->listen_host;
    }
    if (a->next_host != NULL) {
        argv[n++] = "--next-host";
        argv[n++] = (char *)a->next_host;
    }
    if (a->heartbeat_s > 0) {
        snprintf(s_hb, sizeof(s_hb), "%g", a->heartbeat_s);
        argv[n++] = "--heartbeat";
        argv[n++] = s_hb;
    }
    if (a->stall_s > 0) {
        snprintf(s_stall, sizeof(s_stall), "%g", a->stall_s);
        argv[n++] = "--stall";
        argv[n++] = s_stall;
    }
    if (a->mode != NULL) {
        argv[n++] = "--mode";
        argv[n++] = (char *)a->mode;
    }
    if (a->engine != NULL) {
        argv[n++] = "--engine";
        argv[n++] = (char *)a->engine;
    }
    if (a->links > 0) {
        snprintf(s_links, sizeof(s_links), "%d", a->links);
        argv[n++] = "--links";
        argv[n++] = s_links;
    }
    argv[n] = NULL;
    snprintf(tag, sizeof(tag), "%d", rank);
    return spawn(argv, tag);
}

/* ---- contexts of this process ------------------------------------------- */

/* One connect, run on a thread of its own (every connect waits for its
 * neighbours). */
typedef struct {
    stria_ucx_ctx_t *ctx;
    stria_ucx_link_params_t p;
    stria_link_t *link;
    stria_status_t st;
    char msg[512];
} connect_arg_t;

static inline void *connect_main(void *arg)
{
    connect_arg_t *c = arg;
    c->st = stria_link_ucx_connect(c->ctx, &c->p, &c->link);
    snprintf(c->msg, sizeof(c->msg), "%s", stria_error_msg());
    return NULL;
}

/* A context on loopback over `tls`, or the test fails. */
static inline stria_ucx_ctx_t *ctx_new(const char *tls)
{
    stria_ucx_ctx_params_t p = {.listen_host = "127.0.0.1", .tls = tls};
    stria_ucx_ctx_t *ctx = NULL;
    stria_status_t st = stria_ucx_ctx_create(&p, &ctx);
    cr_assert_eq(st, STRIA_OK, "ctx: %s", stria_error_msg());
    cr_assert_neq(stria_ucx_ctx_port(ctx), 0);
    return ctx;
}

/* Transport choices of parameterized tests (Criterion copies parameters
 * into another process, so they hold no pointers). */
enum { TLS_TCP = 0, TLS_SHM = 1, TLS_DEFAULT = 2 };
static const char *const tls_names[] = {"tcp", "posix,cma,tcp", NULL};
static const char *const tls_labels[] = {"tcp", "posix,cma,tcp", "UCX's default transports"};

/* A free TCP port on loopback for tests that need a fixed one, taken
 * below the kernel's ephemeral range so that no client socket of a test
 * running alongside can take it before the rank binds it. */
static inline int free_port(void)
{
    int lo = 32768;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f != NULL) {
        if (fscanf(f, "%d", &lo) != 1)
            lo = 32768;
        fclose(f);
    }
    int base = lo > 12000 ? lo - 10000 : 2000;
    unsigned seed = (unsigned)getpid() ^ (unsigned)(stria_time_now() * 1e6);
    for (int attempt = 0; attempt < 200; attempt++) {
        int port = base + (int)(rand_r(&seed) % 9000u);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        cr_assert_geq(fd, 0);
        struct sockaddr_in a = {.sin_family = AF_INET,
                                .sin_port = htons((uint16_t)port),
                                .sin_addr.s_addr = htonl(INADDR_ANY)};
        int ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
        close(fd);
        if (ok)
            return port;
    }
    cr_assert_fail("no free port below the ephemeral range");
    return -1;
}

#endif
