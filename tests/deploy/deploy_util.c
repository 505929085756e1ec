#include "deploy_util.h"

#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Every daemon logs at info level into its own file (the suites read them).
 * A daemon that crashes writes a backtrace there too: UCX's error handler,
 * as in production, except under the sanitizers, whose report is better. */
#if defined(__SANITIZE_ADDRESS__)
#define DC_UCX_ERRORS "UCX_HANDLE_ERRORS=none"
#else
#define DC_UCX_ERRORS "UCX_HANDLE_ERRORS=bt"
#endif
static char **daemon_env(const dc_opts_t *o)
{
    static char *base[] = {DC_UCX_ERRORS, "UCX_TLS=tcp,sm,self", "STRIA_LOG_LEVEL=info"};
    size_t n = 0, k = 0;
    while (o != NULL && o->env != NULL && o->env[n] != NULL)
        n++;
    char **env = calloc(n + 4, sizeof(*env));
    cr_assert_not_null(env);
    for (size_t i = 0; i < 3; i++)
        env[k++] = base[i];
    for (size_t i = 0; i < n; i++)
        env[k++] = o->env[i];
    return env;
}

/* argv[0 ..) of a daemon: `ip netns exec NS` first when o->netns is set;
 * returns how many entries it wrote. */
static int daemon_prefix(const dc_opts_t *o, char **argv)
{
    static const char *const ips[] = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"};
    if (o == NULL || o->netns == NULL)
        return 0;
    size_t i = 0;
    while (i < sizeof(ips) / sizeof(ips[0]) - 1 && access(ips[i], X_OK) != 0)
        i++;
    argv[0] = (char *)ips[i];
    argv[1] = "netns";
    argv[2] = "exec";
    argv[3] = (char *)o->netns;
    return 4;
}

/* "--FLAG=HOST:0" with the daemons' host (o->host, default 127.0.0.1). */
static void listen_flag(char *buf, size_t len, const char *flag, const dc_opts_t *o)
{
    snprintf(buf, len, "--%s=%s:0", flag, o && o->host ? o->host : "127.0.0.1");
}

void dc_init(dcluster_t *c)
{
    memset(c, 0, sizeof(*c));
    snprintf(c->dir, sizeof(c->dir), "/tmp/stria_deploy_%d", (int)getpid());
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", c->dir, c->dir);
    cr_assert_eq(system(cmd), 0);
}

/* The coordinator, listening on `addr` ("HOST:PORT"; NULL: a free port of
 * the test host). */
static void dc_coordinator_at(dcluster_t *c, const dc_opts_t *o, const char *addr)
{
    char hb[32], tok[300], wtok[300], adm[300], line[512], listen[300];
    char *argv[40];
    int n = daemon_prefix(o, argv);
    snprintf(hb, sizeof(hb), "%g", o && o->heartbeat_period_s > 0 ? o->heartbeat_period_s : 0.2);
    snprintf(c->coord_log, sizeof(c->coord_log), "%s/coordinator.log", c->dir);
    argv[n++] = STRIA_COORDINATOR_BIN;
    if (addr != NULL)
        snprintf(listen, sizeof(listen), "--listen=%s", addr);
    else
        listen_flag(listen, sizeof(listen), "listen", o);
    argv[n++] = listen;
    argv[n++] = "--metrics-listen=127.0.0.1:0";
    argv[n++] = "--heartbeat-period";
    argv[n++] = hb;
    if (o && o->token_file) {
        snprintf(tok, sizeof(tok), "--token-file=%s", o->token_file);
        argv[n++] = tok;
    }
    if (o && o->worker_token_file) {
        snprintf(wtok, sizeof(wtok), "--worker-token-file=%s", o->worker_token_file);
        argv[n++] = wtok;
    }
    if (o && o->admin_token_file) {
        snprintf(adm, sizeof(adm), "--admin-token-file=%s", o->admin_token_file);
        argv[n++] = adm;
    }
    for (size_t k = 0; o && o->coord_args && o->coord_args[k] && n < 39; k++)
        argv[n++] = o->coord_args[k];
    argv[n] = NULL;
    char **env = daemon_env(o);
    c->coord = test_proc_start(argv, c->coord_log, env);
    free(env);
    cr_assert_not_null(c->coord);
    cr_assert(
        test_proc_wait_line(c->coord, "stria-coordinator listening on ", 15, line, sizeof(line)),
        "the coordinator did not start (see %s)", c->coord_log);
    snprintf(c->coord_addr, sizeof(c->coord_addr), "%.200s",
             line + strlen("stria-coordinator listening on "));
    cr_assert(
        test_proc_wait_line(c->coord, "stria-coordinator metrics port ", 5, line, sizeof(line)));
    snprintf(c->coord_metrics, sizeof(c->coord_metrics), "127.0.0.1:%.200s",
             line + strlen("stria-coordinator metrics port "));
}

void dc_start_coordinator(dcluster_t *c, const dc_opts_t *o)
{
    dc_coordinator_at(c, o, NULL);
}

void dc_restart_coordinator(dcluster_t *c, const dc_opts_t *o, int sig, double down_s)
{
    char addr[256];
    snprintf(addr, sizeof(addr), "%s", c->coord_addr);
    if (c->coord != NULL) {
        int st = test_proc_stop(c->coord, sig, 10);
        c->coord = NULL;
        if (sig == SIGTERM)
            cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                      "the coordinator did not exit cleanly on SIGTERM (status %#x)", st);
    }
    char old[300];
    snprintf(old, sizeof(old), "%s.%d", c->coord_log, sig);
    (void)rename(c->coord_log, old); /* the first run's log stays */
    if (down_s > 0)
        usleep((useconds_t)(down_s * 1e6));
    dc_coordinator_at(c, o, addr);
}

void dc_start_worker(dcluster_t *c, int i, const dc_opts_t *o)
{
    char st[32], tok[300], wtok[300], line[512], mem[64], dev[64], listen[300], ucx[300];
    char *argv[48];
    int n = daemon_prefix(o, argv);
    cr_assert(i >= 0 && i < DC_MAX_WORKERS);
    snprintf(st, sizeof(st), "%g", o && o->step_timeout_s > 0 ? o->step_timeout_s : 5.0);
    char log[256];
    snprintf(log, sizeof(log), "%s/worker%d.log", c->dir, i);
    memcpy(c->worker_log[i], log, sizeof(log));
    argv[n++] = STRIA_WORKER_BIN;
    argv[n++] = "--coordinator";
    argv[n++] = c->coord_addr;
    argv[n++] = "--threads=1";
    if (o && o->host) {
        listen_flag(listen, sizeof(listen), "listen", o);
        listen_flag(ucx, sizeof(ucx), "ucx-listen", o);
        argv[n++] = listen;
        argv[n++] = ucx;
    }
    snprintf(mem, sizeof(mem), "--memory=%s",
             o && o->worker_memory ? o->worker_memory : "1000000000");
    argv[n++] = mem;
    argv[n++] = "--metrics-listen=127.0.0.1:0";
    argv[n++] = "--connect-timeout=5";
    argv[n++] = "--step-timeout";
    argv[n++] = st;
    if (o && o->token_file) {
        snprintf(tok, sizeof(tok), "--token-file=%s", o->token_file);
        argv[n++] = tok;
    }
    if (o && o->worker_token_file) {
        snprintf(wtok, sizeof(wtok), "--worker-token-file=%s", o->worker_token_file);
        argv[n++] = wtok;
    }
    if (o && o->worker_device) {
        snprintf(dev, sizeof(dev), "--device=%s", o->worker_device);
        argv[n++] = dev;
    }
    for (size_t k = 0; o && o->worker_args && o->worker_args[k] && n < 47; k++)
        argv[n++] = o->worker_args[k];
    argv[n] = NULL;
    char **env = daemon_env(o);
    c->workers[i] = test_proc_start(argv, c->worker_log[i], env);
    free(env);
    cr_assert_not_null(c->workers[i]);
    cr_assert(
        test_proc_wait_line(c->workers[i], "stria-worker listening rpc=", 15, line, sizeof(line)),
        "worker %d did not start (see %s)", i, c->worker_log[i]);
    char *rpc = line + strlen("stria-worker listening rpc=");
    char *metrics = strstr(line, " metrics=");
    cr_assert_not_null(metrics, "no metrics address in '%s'", line);
    snprintf(c->worker_metrics[i], sizeof(c->worker_metrics[i]), "%.200s",
             metrics + strlen(" metrics="));
    rpc[strcspn(rpc, " ")] = '\0';
    snprintf(c->worker_rpc[i], sizeof(c->worker_rpc[i]), "%.200s", rpc);
    if (i >= c->n_workers)
        c->n_workers = i + 1;
}

void dc_wait_healthy(dcluster_t *c, int n, const char *token_file)
{
    double got = NAN, end = now_s() + 10;
    while (now_s() < end) {
        char *out = NULL;
        int rc = dc_striactl(c, token_file, &out, NULL, "--json", "status", NULL);
        got = rc == 0 ? dc_json_number(out, "workers_healthy") : NAN;
        free(out);
        if (got == n)
            return;
        usleep(50000);
    }
    cr_assert_fail("the ring has %g healthy workers, expected %d", got, n);
}

void dc_start(dcluster_t *c, int n, const dc_opts_t *o)
{
    dc_init(c);
    dc_start_coordinator(c, o);
    for (int i = 0; i < n; i++)
        dc_start_worker(c, i, o);
    dc_wait_healthy(c, n, o ? o->token_file : NULL);
}

/* Stops one daemon with SIGTERM; a daemon still running after timeout_s
 * gets its threads' stacks written next to its log (LOG.stacks) before the
 * SIGKILL. Returns whether it exited cleanly (0); otherwise `how` says how it
 * ended and the log's last lines go to stderr (a CI machine's scratch folder
 * is gone once the run ends). */
static bool dc_stop_one(test_proc_t *p, const char *log, double timeout_s, char *how,
                        size_t how_len)
{
    kill(test_proc_pid(p), SIGCONT);
    kill(test_proc_pid(p), SIGTERM);
    bool hung = !test_proc_wait_exit(p, timeout_s);
    if (hung && log != NULL) {
        char stacks[300];
        snprintf(stacks, sizeof(stacks), "%s.stacks", log);
        if (test_proc_dump_stacks(p, stacks))
            fprintf(stderr, "still running %g s after SIGTERM; stacks in %s\n", timeout_s, stacks);
    }
    int st = test_proc_wait(p, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
        return true;
    if (hung)
        snprintf(how, how_len, "still running %g s after SIGTERM (killed)", timeout_s);
    else if (WIFSIGNALED(st))
        snprintf(how, how_len, "killed by signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
    else
        snprintf(how, how_len, "exit status %d", WEXITSTATUS(st));
    if (log != NULL) {
        char cmd[400];
        fprintf(stderr, "---- the last lines of %s (%s):\n", log, how);
        snprintf(cmd, sizeof(cmd), "tail -n 40 '%.300s' >&2", log);
        (void)system(cmd);
        fprintf(stderr, "----\n");
    }
    return false;
}

void dc_stop(dcluster_t *c)
{
    bool clean = true;
    for (int i = 0; i < c->n_workers; i++) {
        if (c->workers[i] == NULL)
            continue;
        char how[96] = "";
        bool ok = dc_stop_one(c->workers[i], c->worker_log[i], 15, how, sizeof(how));
        c->workers[i] = NULL;
        cr_expect(ok, "worker %d did not exit cleanly on SIGTERM: %s (see %s, kept)", i, how,
                  c->worker_log[i]);
        clean &= ok;
    }
    if (c->coord != NULL) {
        char how[96] = "";
        bool ok = dc_stop_one(c->coord, c->coord_log, 10, how, sizeof(how));
        c->coord = NULL;
        cr_expect(ok, "the coordinator did not exit cleanly on SIGTERM: %s (logs in %s, kept)", how,
                  c->dir);
        clean &= ok;
    }
    if (!clean)
        return; /* the logs stay for a look */
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", c->dir);
    (void)system(cmd);
}

/* ---- child processes ----------------------------------------------------- */

static void drain_fd(int *fd, char **buf, size_t *len, size_t *cap)
{
    char tmp[4096];
    ssize_t n = read(*fd, tmp, sizeof(tmp));
    if (n <= 0) {
        close(*fd);
        *fd = -1;
        return;
    }
    if (*len + (size_t)n + 1 > *cap) {
        *cap = 2 * (*len + (size_t)n + 1);
        *buf = realloc(*buf, *cap);
        cr_assert_not_null(*buf);
    }
    memcpy(*buf + *len, tmp, (size_t)n);
    *len += (size_t)n;
    (*buf)[*len] = '\0';
}

int dc_run(char *const argv[], char *const env[], double timeout_s, char **out, char **err)
{
    int po[2], pe[2];
    cr_assert_eq(pipe(po), 0);
    cr_assert_eq(pipe(pe), 0);
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        /* A short command, but one a test can die waiting for (a hung
         * striactl, a build under test_units). */
        test_proc_child_setup(parent);
        dup2(po[1], 1);
        dup2(pe[1], 2);
        close(po[0]);
        close(po[1]);
        close(pe[0]);
        close(pe[1]);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0)
            dup2(devnull, 0);
        for (size_t i = 0; env != NULL && env[i] != NULL; i++)
            putenv(env[i]);
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(po[1]);
    close(pe[1]);
    char *bufs[2] = {calloc(1, 1), calloc(1, 1)};
    size_t lens[2] = {0, 0}, caps[2] = {1, 1};
    int fds[2] = {po[0], pe[0]};
    double end = now_s() + timeout_s;
    bool killed = false;
    while (fds[0] >= 0 || fds[1] >= 0) {
        struct pollfd p[2];
        int np = 0, which[2];
        for (int k = 0; k < 2; k++)
            if (fds[k] >= 0) {
                p[np].fd = fds[k];
                p[np].events = POLLIN;
                which[np++] = k;
            }
        double left = end - now_s();
        if (left <= 0) {
            kill(pid, SIGKILL);
            killed = true;
            break;
        }
        int rc = poll(p, (nfds_t)np, (int)(left * 1000) + 1);
        for (int k = 0; rc > 0 && k < np; k++)
            if (p[k].revents != 0)
                drain_fd(&fds[which[k]], &bufs[which[k]], &lens[which[k]], &caps[which[k]]);
    }
    for (int k = 0; k < 2; k++)
        if (fds[k] >= 0)
            close(fds[k]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (out != NULL)
        *out = bufs[0];
    else
        free(bufs[0]);
    if (err != NULL)
        *err = bufs[1];
    else
        free(bufs[1]);
    cr_assert(!killed, "%s ran longer than %.0f s", argv[0], timeout_s);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int dc_striactl(const dcluster_t *c, const char *token_file, char **out, char **err, ...)
{
    char *argv[32], tok[256];
    int n = 0;
    va_list ap;
    argv[n++] = STRIACTL_BIN;
    argv[n++] = "--coordinator";
    argv[n++] = (char *)c->coord_addr;
    if (token_file != NULL) {
        snprintf(tok, sizeof(tok), "--token-file=%s", token_file);
        argv[n++] = tok;
    }
    va_start(ap, err);
    for (char *a; (a = va_arg(ap, char *)) != NULL && n < 31;)
        argv[n++] = a;
    va_end(ap);
    argv[n] = NULL;
    return dc_run(argv, NULL, 30, out, err);
}

int dc_python(const char *script, const char *arg, char **err)
{
    char *argv[] = {STRIA_SYSTEM_PYTHON, "-c", (char *)script, (char *)arg, NULL};
    char *out = NULL;
    int rc = dc_run(argv, NULL, 60, &out, err);
    if (out[0] != '\0')
        cr_log_info("python: %s", out);
    free(out);
    return rc;
}

void dc_write(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

char *dc_read(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return calloc(1, 1);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = calloc((size_t)n + 1, 1);
    cr_assert_not_null(buf);
    size_t got = fread(buf, 1, (size_t)n, f);
    buf[got] = '\0';
    fclose(f);
    return buf;
}

/* ---- HTTP, ports ----------------------------------------------------------- */

static int tcp_connect(const char *addr)
{
    char host[64];
    uint16_t port;
    cr_assert_eq(stria_addr_parse(addr, host, sizeof(host), &port), STRIA_OK, "%s", addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0, "connect %s: %s", addr,
                 strerror(errno));
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

int dc_http_get(const char *addr, const char *path, char **body)
{
    int fd = tcp_connect(addr);
    char req[256];
    int n = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", path, addr);
    cr_assert_eq(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    size_t len = 0, cap = 1 << 16;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    for (;;) {
        if (len + 4096 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            cr_assert_not_null(buf);
        }
        ssize_t got = recv(fd, buf + len, cap - len - 1, 0);
        if (got <= 0)
            break;
        len += (size_t)got;
    }
    close(fd);
    buf[len] = '\0';
    int code = 0;
    sscanf(buf, "HTTP/1.%*d %d", &code);
    char *sep = strstr(buf, "\r\n\r\n");
    *body = strdup(sep ? sep + 4 : "");
    free(buf);
    return code;
}

int dc_free_port(void)
{
    /* Below the kernel's ephemeral range, so that the port stays free while the
     * test starts processes: their port-0 listeners and outgoing connections
     * take ephemeral ports and can never land on it. */
    int lo = 32768, hi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f != NULL) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2)
            lo = 32768;
        fclose(f);
    }
    int top = lo - 1, bottom = lo > 12000 ? lo - 10000 : 1024;
    /* a seed of its own per call (two calls in one second, or two test
     * processes whose pid and second happen to mix alike, must not draw
     * the same port: a test's port freed a moment ago may still be held) */
    static unsigned calls;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    unsigned seed = (unsigned)getpid() * 2654435761u ^ (unsigned)now.tv_nsec ^
                    (unsigned)now.tv_sec * 40503u ^ __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    for (int attempt = 0; attempt < 1000 && top > bottom; attempt++) {
        int port = bottom + (int)(rand_r(&seed) % (unsigned)(top - bottom + 1));
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
        inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
        int ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
        close(fd);
        if (ok)
            return port;
    }
    cr_assert_fail("no free port below the ephemeral range %d-%d", lo, hi);
    return -1;
}

/* ---- the service manager's end of sd_notify -------------------------------- */

void dc_notify_open(dc_notify_t *n, const dcluster_t *c, const char *name)
{
    memset(n, 0, sizeof(*n));
    snprintf(n->path, sizeof(n->path), "%.80s/%.20s.sock", c->dir, name);
    snprintf(n->env, sizeof(n->env), "NOTIFY_SOCKET=%s", n->path);
    unlink(n->path);
    n->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    cr_assert(n->fd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", n->path);
    cr_assert_eq(bind(n->fd, (struct sockaddr *)&a, sizeof(a)), 0, "bind %s: %s", n->path,
                 strerror(errno));
}

static bool has_line(const char *msg, const char *needle)
{
    size_t nl = strlen(needle);
    bool prefix = nl > 0 && (needle[nl - 1] == '=' || needle[nl - 1] == ' ');
    for (const char *p = msg; *p;) {
        size_t ll = strcspn(p, "\n");
        if (prefix ? (ll >= nl && memcmp(p, needle, nl) == 0)
                   : (ll == nl && memcmp(p, needle, nl) == 0))
            return true;
        p += ll;
        if (*p == '\n')
            p++;
    }
    return false;
}

bool dc_notify_wait(dc_notify_t *n, const char *needle, double timeout_s, char *log, size_t log_len)
{
    double end = now_s() + timeout_s;
    for (;;) {
        double left = end - now_s();
        if (left <= 0)
            return false;
        struct pollfd p = {n->fd, POLLIN, 0};
        if (poll(&p, 1, (int)(left * 1000) + 1) <= 0)
            continue;
        char msg[4096];
        ssize_t got = recv(n->fd, msg, sizeof(msg) - 1, 0);
        if (got <= 0)
            continue;
        msg[got] = '\0';
        if (log != NULL) {
            size_t used = strlen(log);
            snprintf(log + used, log_len - used, "%s|", msg);
        }
        if (needle != NULL && has_line(msg, needle))
            return true;
    }
}

void dc_notify_close(dc_notify_t *n)
{
    close(n->fd);
    unlink(n->path);
}

/* ---- jobs ---------------------------------------------------------------------- */

static float *rand_f32(size_t n, unsigned seed)
{
    float *x = malloc(n * sizeof(float) + 1);
    cr_assert_not_null(x);
    uint64_t s = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = (float)((double)(s >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
    }
    return x;
}

void dc_job_init(dc_job_t *j, const dcluster_t *c, int64_t seq, int64_t heads, int64_t head_dim,
                 int ring_size)
{
    memset(j, 0, sizeof(*j));
    stria_client_params_t p;
    memset(&p, 0, sizeof(p));
    p.struct_size = sizeof(p);
    p.coordinator = c->coord_addr;
    p.client_name = "test_deploy";
    p.rpc_timeout_s = 30; /* a stopped worker must not hold a test for long */
    cr_assert_eq(stria_client_connect(&p, &j->client), STRIA_OK, "%s", stria_error_msg());
    j->spec.struct_size = sizeof(j->spec);
    j->spec.batch = 1;
    j->spec.seq_len = seq;
    j->spec.heads = heads;
    j->spec.kv_heads = heads;
    j->spec.head_dim = head_dim;
    j->spec.dtype = STRIA_DTYPE_F32;
    j->spec.causal = true;
    j->spec.ring_size = ring_size;
    j->spec.label = "deploy test";
    size_t n = (size_t)(seq * heads * head_dim);
    j->q = rand_f32(n, 1);
    j->k = rand_f32(n, 2);
    j->v = rand_f32(n, 3);
    j->g = rand_f32(n, 4);
    j->o = calloc(n, sizeof(float));
    j->dq = calloc(n, sizeof(float));
    j->dk = calloc(n, sizeof(float));
    j->dv = calloc(n, sizeof(float));
    j->lse = calloc((size_t)(heads * seq), sizeof(float));
    cr_assert(j->o && j->dq && j->dk && j->dv && j->lse);
}

stria_status_t dc_job_forward(dc_job_t *j, stria_progress_cb progress, void *arg)
{
    return stria_client_forward(j->client, &j->spec, j->q, j->k, j->v, j->o, j->lse, progress, arg,
                                NULL, &j->job);
}

stria_status_t dc_job_backward(dc_job_t *j)
{
    return stria_client_backward(j->job, j->g, j->dq, j->dk, j->dv, NULL, NULL, NULL);
}

void dc_job_free(dc_job_t *j)
{
    if (j->job != NULL)
        stria_client_release(j->job);
    j->job = NULL;
    stria_client_close(j->client);
    free(j->q), free(j->k), free(j->v), free(j->g), free(j->o);
    free(j->dq), free(j->dk), free(j->dv), free(j->lse);
    memset(j, 0, sizeof(*j));
}

double dc_json_number(const char *json, const char *key)
{
    char pat[96];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = json ? strstr(json, pat) : NULL;
    if (p == NULL)
        return NAN;
    char *end;
    double v = strtod(p + strlen(pat), &end);
    return end == p + strlen(pat) ? NAN : v;
}

stria_client_t *dc_client(const dcluster_t *c, const char *token_file, const char *name,
                          int forward_retries)
{
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *cl = NULL;
    p.coordinator = c->coord_addr;
    p.token_file = token_file;
    p.client_name = name;
    p.rpc_timeout_s = 60;
    p.forward_retries = forward_retries;
    cr_assert_eq(stria_client_connect(&p, &cl), STRIA_OK, "%s", stria_error_msg());
    return cl;
}

char *dc_job_json(const dcluster_t *c, const char *token_file, uint64_t id)
{
    char ids[32], *out = NULL;
    snprintf(ids, sizeof(ids), "%llu", (unsigned long long)id);
    if (dc_striactl(c, token_file, &out, NULL, "--json", "job", ids, NULL) != 0) {
        free(out);
        return NULL;
    }
    return out;
}
