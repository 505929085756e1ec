/* UCX link suite.
 *
 * In-process tests run several contexts in one process (one thread per rank)
 * to check the link's semantics: tags, early arrivals, length checks,
 * cancel, abort, deadlines, the handshake. Process tests start real ranks
 * (ucx_ring_rank) on loopback, or in two network namespaces joined by a veth
 * pair, and check ring passes, a killed rank, a stopped rank, a cut cable
 * and a restart on the same port. Every child dies with the test process
 * (test_proc_child_setup) and is killed at the end of each test. */
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

static int rm_cb(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void kill_children(void)
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

static void setup(void)
{
    setenv("UCX_HANDLE_ERRORS", "none", 1);
    snprintf(workdir, sizeof(workdir), "/tmp/stria-ucx-test.XXXXXX");
    cr_assert_not_null(mkdtemp(workdir), "mkdtemp: %s", strerror(errno));
}

static void teardown(void)
{
    kill_children();
    if (workdir[0] != '\0')
        nftw(workdir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    workdir[0] = '\0';
}

/* Starts argv (argv[0] is a path or a name in PATH); stderr goes to a file of
 * the work directory named after `tag`. */
static pid_t spawn(char *const argv[], const char *tag)
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
static int reap(pid_t pid, double timeout_s)
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

static result_t read_result(int rank)
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
static const char *rank_log(int rank)
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

static bool file_exists(const char *name, int rank)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/%s.%d", workdir, name, rank);
    return access(path, F_OK) == 0;
}

static result_t wait_result(int rank, double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    result_t r;
    while (!(r = read_result(rank)).present && stria_time_now() < until)
        usleep(2000);
    return r;
}

static void wait_file(const char *name, int rank, double timeout_s)
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
} rank_args_t;

static pid_t spawn_rank(int rank, int size, const rank_args_t *a)
{
    char s_rank[16], s_size[16], s_bytes[32], s_passes[16], s_dur[32], s_step[32], s_port[16],
        s_next_port[16], s_late[16], s_hb[32], s_stall[32], tag[16];
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
    argv[n] = NULL;
    snprintf(tag, sizeof(tag), "%d", rank);
    return spawn(argv, tag);
}

/* Transport choices of parameterized tests (Criterion copies parameters
 * into another process, so they hold no pointers). */
enum { TLS_TCP = 0, TLS_SHM = 1, TLS_DEFAULT = 2 };
static const char *const tls_names[] = {"tcp", "posix,cma,tcp", NULL};
static const char *const tls_labels[] = {"tcp", "posix,cma,tcp", "UCX's default transports"};

/* ---- ring passes between processes --------------------------------------- */

typedef struct {
    int size;
    int tls;
    size_t bytes;
    int late_recv_ms;
} ring_case_t;

ParameterizedTestParameters(ucx, process_ring)
{
    static ring_case_t cases[] = {
        {2, TLS_TCP, 300000, 0},     {3, TLS_TCP, 300000, 0},  {4, TLS_TCP, 300000, 0},
        {2, TLS_SHM, 300000, 0},     {3, TLS_SHM, 300000, 0},  {4, TLS_SHM, 300000, 0},
        {3, TLS_TCP, 1000, 0},       {2, TLS_TCP, 300000, 50}, {2, TLS_SHM, 1000, 50},
        {3, TLS_DEFAULT, 300000, 0},
    };
    return cr_make_param_array(ring_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(ring_case_t *c, ucx, process_ring, .init = setup, .fini = teardown, .timeout = 60)
{
    pid_t pids[8];
    rank_args_t a = {
        .tls = tls_names[c->tls], .bytes = c->bytes, .passes = 3, .late_recv_ms = c->late_recv_ms};
    for (int r = 0; r < c->size; r++)
        pids[r] = spawn_rank(r, c->size, &a);
    for (int r = 0; r < c->size; r++) {
        int status = reap(pids[r], 40);
        result_t res = read_result(r);
        cr_assert(res.present, "ring of %d over %s: rank %d wrote no result (status %d); log:\n%s",
                  c->size, tls_labels[c->tls], r, status, rank_log(r));
        cr_expect(res.ok, "ring of %d over %s, %zu bytes: rank %d: %s: %s", c->size,
                  tls_labels[c->tls], c->bytes, r, res.status, res.msg);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "rank %d exit status %d", r, status);
    }
}

/* ---- the ring engine over UCX -------------------------------------------- */

typedef struct {
    int size;
    int tls;
    int64_t seq, heads, kv_heads, head_dim;
    int causal;
    stria_dtype_t dtype;
    stria_layout_kind_t layout;
} engine_test_t;

ParameterizedTestParameters(ucx, engine_matches_inproc)
{
    static engine_test_t cases[] = {
        {2, TLS_TCP, 64, 2, 2, 32, 1, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED},
        {3, TLS_TCP, 100, 4, 2, 32, 1, STRIA_DTYPE_BF16, STRIA_LAYOUT_STRIPED},
        {4, TLS_TCP, 90, 2, 1, 16, 1, STRIA_DTYPE_F32, STRIA_LAYOUT_ZIGZAG},
        {2, TLS_SHM, 77, 2, 2, 32, 0, STRIA_DTYPE_F32, STRIA_LAYOUT_CONTIGUOUS},
        {3, TLS_SHM, 96, 4, 4, 16, 1, STRIA_DTYPE_F16, STRIA_LAYOUT_STRIPED},
        {4, TLS_SHM, 128, 2, 2, 32, 1, STRIA_DTYPE_F32, STRIA_LAYOUT_STRIPED},
    };
    return cr_make_param_array(engine_test_t, cases, sizeof(cases) / sizeof(cases[0]));
}

static void *read_all(const char *path, size_t want)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    void *buf = malloc(want + 1);
    size_t got = fread(buf, 1, want + 1, f);
    fclose(f);
    cr_assert_eq(got, want, "%s has %zu bytes, expected %zu", path, got, want);
    return buf;
}

static void expect_same(const char *what, const float *ucx, const float *ref, size_t n,
                        const engine_test_t *t)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&ucx[i], &ref[i], sizeof(float)) != 0) {
            cr_expect(false,
                      "%s differs from the in-process ring at element %zu of %zu: %.9g vs %.9g "
                      "(ring of %d over %s, %s %s)",
                      what, i, n, (double)ucx[i], (double)ref[i], t->size, tls_labels[t->tls],
                      stria_layout_kind_name(t->layout), stria_dtype_name(t->dtype));
            return;
        }
}

/* Forward and backward passes of the ring engine between processes over
 * UCX give the same bits as the in-process link on the same inputs. */
ParameterizedTest(engine_test_t *t, ucx, engine_matches_inproc, .init = setup, .fini = teardown,
                  .timeout = 120)
{
    engine_case_t c = {.batch = 1,
                       .seq = t->seq,
                       .heads = t->heads,
                       .kv_heads = t->kv_heads,
                       .head_dim = t->head_dim,
                       .causal = t->causal,
                       .dtype = t->dtype,
                       .layout = t->layout,
                       .seed = 11};
    char spec[200];
    engine_case_format(&c, spec, sizeof(spec));
    rank_args_t a = {.tls = tls_names[t->tls], .mode = "engine", .engine = spec, .passes = 1};
    pid_t pids[8];
    for (int r = 0; r < t->size; r++)
        pids[r] = spawn_rank(r, t->size, &a);

    /* The same problem on the in-process link, meanwhile. */
    stria_ring_shape_t shape = engine_case_shape(&c);
    engine_inputs_t in;
    engine_inputs_make(&c, &in);
    size_t nq = (size_t)(c.seq * c.heads * c.head_dim),
           nk = (size_t)(c.seq * c.kv_heads * c.head_dim);
    size_t nl = (size_t)(c.heads * c.seq);
    float *ref[5] = {malloc(nq * 4), malloc(nl * 4), malloc(nq * 4), malloc(nk * 4),
                     malloc(nk * 4)};
    stria_ring_local_opts_t lo = {
        .layout = c.layout, .n_ranks = t->size, .passes = STRIA_RING_PASS_FWD_BWD};
    stria_ring_local_io_t io = {.q = in.q,
                                .k = in.k,
                                .v = in.v,
                                .o = ref[0],
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = ref[1],
                                .d_o = in.d_o,
                                .dq = ref[2],
                                .dk = ref[3],
                                .dv = ref[4],
                                .grad_dtype = STRIA_DTYPE_F32};
    cr_assert_eq(stria_ring_run_local(&shape, &lo, &io, NULL), STRIA_OK, "%s", stria_error_msg());

    for (int r = 0; r < t->size; r++) {
        int status = reap(pids[r], 90);
        result_t res = read_result(r);
        cr_assert(res.present, "rank %d wrote no result (status %d); log:\n%s", r, status,
                  rank_log(r));
        cr_assert(res.ok, "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "rank %d exit status %d; log:\n%s", r, status, rank_log(r));
    }
    stria_layout_t lay;
    cr_assert_eq(stria_layout_init(c.layout, t->size, c.seq, &lay), STRIA_OK);
    size_t L = (size_t)lay.shard_tokens;
    size_t sq = L * (size_t)(c.heads * c.head_dim), sk = L * (size_t)(c.kv_heads * c.head_dim);
    size_t sl = L * (size_t)c.heads;
    float *full[5] = {malloc(nq * 4), malloc(nl * 4), malloc(nq * 4), malloc(nk * 4),
                      malloc(nk * 4)};
    for (int r = 0; r < t->size; r++) {
        char path[400];
        snprintf(path, sizeof(path), "%s/out.%d", workdir, r);
        float *shard = read_all(path, (2 * sq + sl + 2 * sk) * 4);
        const float *part[5] = {shard, shard + sq, shard + sq + sl, shard + 2 * sq + sl,
                                shard + 2 * sq + sl + sk};
        const size_t row[5] = {
            (size_t)(c.heads * c.head_dim) * 4, 4, (size_t)(c.heads * c.head_dim) * 4,
            (size_t)(c.kv_heads * c.head_dim) * 4, (size_t)(c.kv_heads * c.head_dim) * 4};
        const int64_t outer[5] = {1, c.heads, 1, 1, 1};
        for (int i = 0; i < 5; i++)
            cr_assert_eq(stria_layout_gather(&lay, r, outer[i], row[i], part[i], full[i]),
                         STRIA_OK);
        free(shard);
    }
    const char *names[5] = {"O", "LSE", "dQ", "dK", "dV"};
    const size_t counts[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        expect_same(names[i], full[i], ref[i], counts[i], t);
        free(full[i]);
        free(ref[i]);
    }
    engine_inputs_free(&in);
}

/* ---- failures between processes ----------------------------------------- */

typedef struct {
    int size;
    int victim;
    int tls;
    int sig;
    int engine; /* ring engine passes instead of plain exchanges */
    /* Heartbeat period and stall time injected into the ranks, and the step
     * deadline of stopped-rank cases; 0: the defaults (0.1 s, 0.5 s, 1 s). */
    double heartbeat_s, stall_s, step_timeout_s;
} fail_case_t;

/* Starts a ring looping passes, waits until every rank has finished one,
 * signals the victim and returns the time of the signal. */
static double start_and_hit(const fail_case_t *c, double step_timeout, pid_t *pids)
{
    engine_case_t ec = {.batch = 1,
                        .seq = 512,
                        .heads = 4,
                        .kv_heads = 4,
                        .head_dim = 64,
                        .causal = 1,
                        .dtype = STRIA_DTYPE_F32,
                        .layout = STRIA_LAYOUT_STRIPED,
                        .seed = 3};
    char spec[200];
    engine_case_format(&ec, spec, sizeof(spec));
    rank_args_t a = {.tls = tls_names[c->tls],
                     .bytes = 200000,
                     .duration_s = 30,
                     .step_timeout_s = step_timeout,
                     .heartbeat_s = c->heartbeat_s,
                     .stall_s = c->stall_s,
                     .mode = c->engine ? "engine" : NULL,
                     .engine = c->engine ? spec : NULL};
    for (int r = 0; r < c->size; r++)
        pids[r] = spawn_rank(r, c->size, &a);
    for (int r = 0; r < c->size; r++)
        wait_file("ready", r, 30);
    usleep(100000);
    double t0 = stria_time_now();
    cr_assert_eq(kill(pids[c->victim], c->sig), 0);
    return t0;
}

ParameterizedTestParameters(ucx, killed_rank)
{
    static fail_case_t cases[] = {{3, 1, TLS_TCP, SIGKILL, 0, 0, 0, 0},
                                  {4, 2, TLS_SHM, SIGKILL, 0, 0, 0, 0},
                                  {2, 0, TLS_TCP, SIGKILL, 0, 0, 0, 0},
                                  {3, 1, TLS_TCP, SIGKILL, 1, 0, 0, 0},
                                  {4, 3, TLS_SHM, SIGKILL, 1, 0, 0, 0}};
    return cr_make_param_array(fail_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

/* kill -9 mid-pass: every other rank returns an error naming the dead rank
 * within 2 s and exits cleanly. The step deadline (30 s) cannot be what
 * ends the pass. */
ParameterizedTest(fail_case_t *c, ucx, killed_rank, .init = setup, .fini = teardown, .timeout = 90)
{
    pid_t pids[8];
    double t0 = start_and_hit(c, 30.0, pids);
    char name[32];
    snprintf(name, sizeof(name), "rank %d", c->victim);
    for (int r = 0; r < c->size; r++) {
        if (r == c->victim)
            continue;
        result_t res = wait_result(r, 10);
        double dt = stria_time_now() - t0;
        cr_assert(res.present, "rank %d did not report the death of rank %d; its log:\n%s", r,
                  c->victim, rank_log(r));
        cr_expect(!res.ok, "rank %d reported success after rank %d died", r, c->victim);
        cr_expect(dt < 2.0, "rank %d took %.2f s to report the death of rank %d", r, dt, c->victim);
        cr_expect(strcmp(res.status, "STRIA_ERR_PEER") == 0, "rank %d: %s: %s", r, res.status,
                  res.msg);
        cr_expect(strstr(res.msg, name) != NULL, "rank %d's error does not name %s: %s", r, name,
                  res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

ParameterizedTestParameters(ucx, stopped_rank)
{
    static fail_case_t cases[] = {{3, 1, TLS_TCP, SIGSTOP, 0, 0, 0, 0},
                                  {4, 0, TLS_SHM, SIGSTOP, 0, 0, 0, 0},
                                  {3, 2, TLS_TCP, SIGSTOP, 1, 0, 0, 0},
                                  {4, 1, TLS_SHM, SIGSTOP, 1, 0, 0, 0},
                                  /* faster heartbeats, a shorter deadline */
                                  {3, 1, TLS_TCP, SIGSTOP, 0, 0.05, 0.2, 0.4}};
    return cr_make_param_array(fail_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

/* SIGSTOP: UCX sees nothing wrong; the per-step deadline (1 s) ends the pass
 * on the neighbours, and the others hear of it, all naming the stopped rank
 * as stalled: its neighbours find it silent for longer than the stall time
 * (0.5 s by default), the others hear so from the heartbeats. A deadline
 * that merely names the rank is not enough: a stall time above the
 * deadline would blame it as "alive but slow". */
ParameterizedTest(fail_case_t *c, ucx, stopped_rank, .init = setup, .fini = teardown, .timeout = 90)
{
    pid_t pids[8];
    double step = c->step_timeout_s > 0 ? c->step_timeout_s : 1.0;
    double t0 = start_and_hit(c, step, pids);
    char name[32], stalled[48];
    snprintf(name, sizeof(name), "rank %d", c->victim);
    snprintf(stalled, sizeof(stalled), "rank %d is stalled", c->victim);
    for (int r = 0; r < c->size; r++) {
        if (r == c->victim)
            continue;
        result_t res = wait_result(r, 15);
        double dt = stria_time_now() - t0;
        cr_assert(res.present, "rank %d did not report the stopped rank %d; its log:\n%s", r,
                  c->victim, rank_log(r));
        cr_expect(!res.ok, "rank %d reported success", r);
        /* The engine's deadline is cumulative over the steps of a pass
         * (step s must end by start + (s + 1) * timeout): allow every step
         * of a forward and a backward pass, plus the link's grace. */
        double bound = step * (c->engine ? 2 * c->size + 1 : 1) + 3.0;
        cr_expect(dt < bound, "rank %d took %.2f s (bound %.1f s)", r, dt, bound);
        cr_expect(strcmp(res.status, "STRIA_ERR_TIMEOUT") == 0 ||
                      strcmp(res.status, "STRIA_ERR_PEER") == 0,
                  "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(strstr(res.msg, "deadline") != NULL && strstr(res.msg, name) != NULL,
                  "rank %d's error is not a deadline naming %s: %s", r, name, res.msg);
        cr_expect(strstr(res.msg, stalled) != NULL, "rank %d's error does not say \"%s\": %s", r,
                  stalled, res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

/* A rank that stalled and resumed is not blamed for a later deadline: the
 * heartbeats' report of it dies out once its neighbours hear from it again
 * (it must not echo between the live ranks), so a receive that nobody sends,
 * with every rank alive, ends in a deadline that blames no stalled rank. */
Test(ucx, a_resumed_rank_is_not_blamed_later, .init = setup, .fini = teardown, .timeout = 60)
{
    enum { N = 3, VICTIM = 2 };
    rank_args_t a = {.tls = "tcp", .step_timeout_s = 0.5, .mode = "idle"};
    pid_t pids[N];
    /* The ranks log a stall as a warning when they first see it. */
    setenv("STRIA_LOG_LEVEL", "warn", 1);
    for (int r = 0; r < N; r++)
        pids[r] = spawn_rank(r, N, &a);
    for (int r = 0; r < N; r++)
        wait_file("ready", r, 30);
    cr_assert_eq(kill(pids[VICTIM], SIGSTOP), 0);
    usleep(1500000); /* the neighbours report it stalled (after 0.5 s) */
    /* First: the stall was seen at all, by both live ranks, or what follows
     * proves nothing about a report dying out. */
    for (int r = 0; r < N; r++)
        if (r != VICTIM)
            cr_assert(strstr(rank_log(r), "rank 2 looks stalled") != NULL,
                      "rank %d did not report the stopped rank 2 as stalled within 1.5 s; its "
                      "log:\n%s",
                      r, rank_log(r));
    cr_assert_eq(kill(pids[VICTIM], SIGCONT), 0);
    usleep(3000000); /* a report dies out a second per hop after its source stops */
    for (int r = 0; r < N; r++) {
        char path[400];
        snprintf(path, sizeof(path), "%s/go.%d", workdir, r);
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f, "%s: %s", path, strerror(errno));
        fclose(f);
    }
    for (int r = 0; r < N; r++) {
        result_t res = wait_result(r, 15);
        cr_assert(res.present, "rank %d reported nothing; its log:\n%s", r, rank_log(r));
        cr_expect(!res.ok, "rank %d received a message nobody sent", r);
        cr_expect(strstr(res.msg, "deadline") != NULL, "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(strstr(res.msg, "stalled") == NULL,
                  "rank %d blames a stalled rank though every rank is alive: %s", r, res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

/* A free TCP port on loopback for tests that need a fixed one, taken
 * below the kernel's ephemeral range so that no client socket of a test
 * running alongside can take it before the rank binds it. */
static int free_port(void)
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

/* A killed rank leaves connections in TIME_WAIT on its port; a new process
 * must be able to listen there at once. */
Test(ucx, restart_listens_on_same_port, .init = setup, .fini = teardown, .timeout = 60)
{
    int port = free_port();
    pid_t pids[2];
    rank_args_t a0 = {.tls = "tcp", .bytes = 100000, .duration_s = 30, .port = port};
    rank_args_t a1 = {.tls = "tcp", .bytes = 100000, .duration_s = 30};
    pids[0] = spawn_rank(0, 2, &a0);
    pids[1] = spawn_rank(1, 2, &a1);
    wait_file("ready", 0, 30);
    wait_file("ready", 1, 30);
    kill(pids[0], SIGKILL);
    reap(pids[0], 5);
    cr_assert(wait_result(1, 10).present);
    reap(pids[1], 5);
    char path[400];
    snprintf(path, sizeof(path), "%s/result.0", workdir);
    remove(path);
    rank_args_t again = {.tls = "tcp", .port = port, .mode = "listen"};
    pid_t p = spawn_rank(0, 2, &again);
    int status = reap(p, 20);
    result_t res = read_result(0);
    cr_assert(res.present && res.ok, "listening again on port %d failed: %s: %s", port, res.status,
              res.msg);
    cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* ---- two hosts: network namespaces (tests/common/netns.h) ----------------- */

static test_hosts_t net;

static void netns_teardown(void)
{
    kill_children();
    test_hosts_destroy(&net);
    teardown();
}

/* Called first in the test body (a skip from a fixture is not reported). */
static void netns_setup(void)
{
    const char *why = test_hosts_create(&net, 2);
    if (why != NULL) {
        netns_teardown();
        cr_skip_test("two-host tests skipped: network namespaces cannot be made here (%s)", why);
    }
}

static void spawn_netns_ring(double duration_s, double step_timeout_s, pid_t pids[2])
{
    for (int r = 0; r < 2; r++) {
        rank_args_t a = {.netns = net.ns[r],
                         .tls = "tcp",
                         .net_devices = net.dev[r],
                         .listen_host = net.addr[r],
                         .next_host = net.addr[1 - r],
                         .bytes = 300000,
                         .passes = 3,
                         .duration_s = duration_s,
                         .step_timeout_s = step_timeout_s};
        pids[r] = spawn_rank(r, 2, &a);
    }
}

/* Ranks in two namespaces, each listening on its own veth address. */
Test(ucx, two_hosts_ring, .init = setup, .fini = netns_teardown, .timeout = 60)
{
    netns_setup();
    pid_t pids[2];
    spawn_netns_ring(0, 10, pids);
    for (int r = 0; r < 2; r++) {
        int status = reap(pids[r], 40);
        result_t res = read_result(r);
        cr_assert(res.present, "rank %d wrote no result (status %d); log:\n%s", r, status,
                  rank_log(r));
        cr_expect(res.ok, "rank %d: %s: %s", r, res.status, res.msg);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "rank %d exit status %d", r, status);
    }
}

/* The cable is cut (veth down) mid-pass: a clear error on both sides, no
 * hang. */
Test(ucx, two_hosts_cut_link, .init = setup, .fini = netns_teardown, .timeout = 60)
{
    netns_setup();
    pid_t pids[2];
    spawn_netns_ring(30, 1.0, pids);
    wait_file("ready", 0, 30);
    wait_file("ready", 1, 30);
    double t0 = stria_time_now();
    cr_assert_eq(test_hosts_link(&net, 1, false), 0);
    for (int r = 0; r < 2; r++) {
        result_t res = wait_result(r, 15);
        double dt = stria_time_now() - t0;
        cr_assert(res.present, "rank %d did not report the cut link", r);
        cr_expect(!res.ok);
        cr_expect(dt < 5.0, "rank %d took %.2f s", r, dt);
        cr_expect(strstr(res.msg, "rank ") != NULL, "rank %d: unclear error: %s: %s", r, res.status,
                  res.msg);
        int status = reap(pids[r], 5);
        cr_expect(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank %d did not exit cleanly (status %d)", r, status);
    }
}

/* ---- in-process rings (one thread per rank) ---------------------------- */

#define MAX_RING 4

typedef struct {
    int n;
    stria_ucx_ctx_t *ctx[MAX_RING];
    stria_link_t *link[MAX_RING];
} ring_t;

typedef struct {
    stria_ucx_ctx_t *ctx;
    stria_ucx_link_params_t p;
    stria_link_t *link;
    stria_status_t st;
    char msg[512];
} connect_arg_t;

static void *connect_main(void *arg)
{
    connect_arg_t *c = arg;
    c->st = stria_link_ucx_connect(c->ctx, &c->p, &c->link);
    snprintf(c->msg, sizeof(c->msg), "%s", stria_error_msg());
    return NULL;
}

static stria_ucx_ctx_t *ctx_new(const char *tls)
{
    stria_ucx_ctx_params_t p = {.listen_host = "127.0.0.1", .tls = tls};
    stria_ucx_ctx_t *ctx = NULL;
    stria_status_t st = stria_ucx_ctx_create(&p, &ctx);
    cr_assert_eq(st, STRIA_OK, "ctx: %s", stria_error_msg());
    cr_assert_neq(stria_ucx_ctx_port(ctx), 0);
    return ctx;
}

/* Connects args[i] concurrently (every connect waits for its neighbours). */
static void connect_all(connect_arg_t *args, int n)
{
    pthread_t th[MAX_RING * 2];
    for (int i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, connect_main, &args[i]), 0);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
}

static void ring_open(ring_t *ring, int n, const char *tls, uint64_t ring_id)
{
    connect_arg_t args[MAX_RING];
    memset(ring, 0, sizeof(*ring));
    ring->n = n;
    for (int r = 0; r < n; r++)
        ring->ctx[r] = ctx_new(tls);
    for (int r = 0; r < n; r++)
        args[r] = (connect_arg_t){.ctx = ring->ctx[r],
                                  .p = {.job_id = 7,
                                        .ring_id = ring_id,
                                        .rank = r,
                                        .size = n,
                                        .next_host = "127.0.0.1",
                                        .next_port = stria_ucx_ctx_port(ring->ctx[(r + 1) % n]),
                                        .connect_timeout_s = 10}};
    connect_all(args, n);
    for (int r = 0; r < n; r++) {
        cr_assert_eq(args[r].st, STRIA_OK, "rank %d connect: %s", r, args[r].msg);
        ring->link[r] = args[r].link;
        cr_assert_eq(stria_link_rank(ring->link[r]), r);
        cr_assert_eq(stria_link_size(ring->link[r]), n);
    }
}

static void ring_close(ring_t *ring)
{
    for (int r = 0; r < ring->n; r++)
        stria_link_destroy(ring->link[r]);
    for (int r = 0; r < ring->n; r++)
        stria_ucx_ctx_destroy(ring->ctx[r]);
}

static void fill(uint8_t *b, size_t n, unsigned seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        b[i] = (uint8_t)x;
    }
}

/* Sends are posted before the receives (early arrivals, eager and
 * rendezvous), tags use all 64 bits, receives are posted out of order. */
Test(ucx, tags_early_arrivals_and_order, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, "tcp", 1);
    const size_t sizes[4] = {1, 1000, 70000, 1 << 20};
    const uint64_t tags[4] = {0, 0xFFFFFFFFFFFFFFFFull, 0x8000000000000001ull, 42};
    uint8_t *src[4], *dst[4];
    stria_link_req_t *sq[4], *rq[4];
    for (int i = 0; i < 4; i++) {
        src[i] = malloc(sizes[i]);
        dst[i] = calloc(1, sizes[i]);
        fill(src[i], sizes[i], (unsigned)i + 1);
        cr_assert_eq(stria_link_isend(ring.link[0], tags[i], src[i], sizes[i], &sq[i]), STRIA_OK);
    }
    usleep(200000); /* let everything arrive unexpected */
    for (int i = 3; i >= 0; i--)
        cr_assert_eq(stria_link_irecv(ring.link[1], tags[i], dst[i], sizes[i], &rq[i]), STRIA_OK);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(stria_link_wait(ring.link[1], rq[i], 10), STRIA_OK, "recv %d: %s", i,
                     stria_error_msg());
        cr_assert_eq(stria_link_wait(ring.link[0], sq[i], 10), STRIA_OK, "send %d: %s", i,
                     stria_error_msg());
        cr_expect(memcmp(src[i], dst[i], sizes[i]) == 0, "block %d (%zu bytes) differs", i,
                  sizes[i]);
    }
    /* Same tag twice: matched in posting order. */
    uint32_t a = 1, b = 2, ra = 0, rb = 0;
    cr_assert_eq(stria_link_isend(ring.link[1], 5, &a, 4, &sq[0]), STRIA_OK);
    cr_assert_eq(stria_link_isend(ring.link[1], 5, &b, 4, &sq[1]), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[0], 5, &ra, 4, &rq[0]), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[0], 5, &rb, 4, &rq[1]), STRIA_OK);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(stria_link_wait(ring.link[1], sq[i], 10), STRIA_OK);
        cr_assert_eq(stria_link_wait(ring.link[0], rq[i], 10), STRIA_OK);
    }
    cr_expect(ra == 1 && rb == 2, "same-tag messages out of order: %u %u", ra, rb);
    ring_close(&ring);
    for (int i = 0; i < 4; i++) {
        free(src[i]);
        free(dst[i]);
    }
}

/* Two rings over the same pair of contexts, with the same tags: each link
 * gets only its own ring's messages. */
Test(ucx, rings_sharing_a_context_stay_apart, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    connect_arg_t args[4];
    for (int g = 0; g < 2; g++)
        for (int r = 0; r < 2; r++)
            args[2 * g + r] =
                (connect_arg_t){.ctx = r == 0 ? c0 : c1,
                                .p = {.job_id = 3,
                                      .ring_id = (uint64_t)(10 + g),
                                      .rank = r,
                                      .size = 2,
                                      .next_host = "127.0.0.1",
                                      .next_port = stria_ucx_ctx_port(r == 0 ? c1 : c0),
                                      .connect_timeout_s = 10}};
    connect_all(args, 4);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(args[i].st, STRIA_OK, "link %d: %s", i, args[i].msg);
    uint64_t out[2] = {111, 222}, in[2] = {0, 0};
    stria_link_req_t *sq[2], *rq[2];
    for (int g = 0; g < 2; g++)
        cr_assert_eq(stria_link_isend(args[2 * g].link, 9, &out[g], 8, &sq[g]), STRIA_OK);
    usleep(100000);
    for (int g = 1; g >= 0; g--)
        cr_assert_eq(stria_link_irecv(args[2 * g + 1].link, 9, &in[g], 8, &rq[g]), STRIA_OK);
    for (int g = 0; g < 2; g++) {
        cr_assert_eq(stria_link_wait(args[2 * g + 1].link, rq[g], 10), STRIA_OK);
        cr_assert_eq(stria_link_wait(args[2 * g].link, sq[g], 10), STRIA_OK);
    }
    cr_expect(in[0] == 111 && in[1] == 222, "rings mixed up: %llu %llu", (unsigned long long)in[0],
              (unsigned long long)in[1]);
    for (int i = 0; i < 4; i++)
        stria_link_destroy(args[i].link);
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

Test(ucx, length_mismatch_fails_both_sides, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, "tcp", 1);
    static uint8_t src[100000], dst[90000];
    stria_link_req_t *sq, *rq;
    cr_assert_eq(stria_link_irecv(ring.link[1], 1, dst, sizeof(dst), &rq), STRIA_OK);
    cr_assert_eq(stria_link_isend(ring.link[0], 1, src, sizeof(src), &sq), STRIA_OK);
    cr_expect_eq(stria_link_wait(ring.link[1], rq, 10), STRIA_ERR_PROTOCOL);
    cr_expect(strstr(stria_error_msg(), "100000") != NULL, "%s", stria_error_msg());
    stria_status_t st = stria_link_wait(ring.link[0], sq, 10);
    if (st == STRIA_OK) {
        /* The send completed before the receiver's notice came back (a
         * loaded machine): the sender's link still fails, at its next wait. */
        uint8_t b;
        stria_link_req_t *rq2;
        st = stria_link_irecv(ring.link[0], 2, &b, 1, &rq2);
        if (st == STRIA_OK)
            st = stria_link_wait(ring.link[0], rq2, 10);
    }
    cr_expect(st != STRIA_OK, "the sender was not told");
    cr_expect(strstr(stria_error_msg(), "rank 1") != NULL, "the sender's error: %s",
              stria_error_msg());
    ring_close(&ring);
}

/* A receive no data has matched is cancelled cleanly; the link goes on. */
Test(ucx, cancel_unmatched_receive_is_clean, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, "tcp", 1);
    uint8_t *buf = malloc(1 << 20);
    stria_link_req_t *rq, *sq;
    cr_assert_eq(stria_link_irecv(ring.link[1], 77, buf, 1 << 20, &rq), STRIA_OK);
    usleep(50000);
    stria_link_cancel(ring.link[1], rq);
    free(buf); /* the buffer is ours again */
    uint64_t x = 5, y = 0;
    cr_assert_eq(stria_link_isend(ring.link[0], 78, &x, 8, &sq), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[1], 78, &y, 8, &rq), STRIA_OK);
    cr_assert_eq(stria_link_wait(ring.link[0], sq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_link_wait(ring.link[1], rq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(y, 5);
    ring_close(&ring);
}

/* Cancelling a send in flight releases it at once, tears the link down and
 * tells the peer, whose pending receive fails naming this rank. */
Test(ucx, cancel_send_in_flight_tears_down, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 2, tls_names[TLS_SHM], 1);
    size_t n = 4 << 20;
    uint8_t *src = malloc(n), *dst = malloc(n);
    stria_link_req_t *sq, *rq;
    cr_assert_eq(stria_link_isend(ring.link[0], 1, src, n, &sq), STRIA_OK);
    cr_assert_eq(stria_link_irecv(ring.link[1], 2, dst, n, &rq), STRIA_OK);
    /* In flight: the progress thread has taken the send from the queue (a
     * send cancelled while still queued is withdrawn quietly, and the peer
     * rightly hears nothing; on a loaded machine that takes more than a
     * moment). */
    for (int i = 0; i < 1000 && __atomic_load_n(&sq->state, __ATOMIC_ACQUIRE) == STRIA__REQ_QUEUED;
         i++)
        usleep(10000);
    cr_assert_neq(__atomic_load_n(&sq->state, __ATOMIC_ACQUIRE), STRIA__REQ_QUEUED,
                  "the send was not posted within 10 s");
    usleep(50000);
    double t0 = stria_time_now();
    stria_link_cancel(ring.link[0], sq);
    cr_expect_lt(stria_time_now() - t0, 2.0);
    free(src);
    stria_status_t st = stria_link_wait(ring.link[1], rq, 5);
    cr_expect_eq(st, STRIA_ERR_PEER, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "rank 0") != NULL, "%s", stria_error_msg());
    free(dst);
    uint8_t x = 0;
    cr_expect_eq(stria_link_isend(ring.link[0], 3, &x, 1, &sq), STRIA_ERR_CANCELLED,
                 "a torn-down link accepted a send");
    ring_close(&ring);
}

/* An abort reaches every rank of the ring, not only the neighbours. */
Test(ucx, abort_reaches_every_rank, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 4, "tcp", 1);
    uint64_t in[4];
    stria_link_req_t *rq[4];
    for (int r = 1; r < 4; r++)
        cr_assert_eq(stria_link_irecv(ring.link[r], 1, &in[r], 8, &rq[r]), STRIA_OK);
    double t0 = stria_time_now();
    stria_link_abort(ring.link[0], STRIA_ERR_INTERNAL, "kernel failed");
    for (int r = 1; r < 4; r++) {
        stria_status_t st = stria_link_wait(ring.link[r], rq[r], 10);
        cr_expect_eq(st, STRIA_ERR_PEER, "rank %d: %s", r, stria_error_msg());
        cr_expect(strstr(stria_error_msg(), "rank 0 aborted") != NULL &&
                      strstr(stria_error_msg(), "kernel failed") != NULL,
                  "rank %d: %s", r, stria_error_msg());
    }
    cr_expect_lt(stria_time_now() - t0, 2.0);
    ring_close(&ring);
}

Test(ucx, deadline_names_the_silent_rank, .init = setup, .fini = teardown, .timeout = 60)
{
    ring_t ring;
    ring_open(&ring, 3, "tcp", 1);
    uint64_t x;
    stria_link_req_t *rq;
    cr_assert_eq(stria_link_irecv(ring.link[1], 1, &x, 8, &rq), STRIA_OK);
    double t0 = stria_time_now();
    stria_status_t st = stria_link_wait(ring.link[1], rq, 0.3);
    double dt = stria_time_now() - t0;
    cr_expect_eq(st, STRIA_ERR_TIMEOUT);
    cr_expect(dt >= 0.29 && dt < 2.0, "waited %.2f s", dt);
    cr_expect(strstr(stria_error_msg(), "rank 0") != NULL, "%s", stria_error_msg());
    /* The other ranks hear of it. */
    usleep(200000);
    st = stria_link_irecv(ring.link[2], 1, &x, 8, &rq);
    if (st == STRIA_OK)
        st = stria_link_wait(ring.link[2], rq, 5);
    cr_expect_eq(st, STRIA_ERR_PEER, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), "deadline") != NULL, "%s", stria_error_msg());
    ring_close(&ring);
}

Test(ucx, handshake_rejects_wrong_ring_size, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    connect_arg_t args[2] = {
        {.ctx = c0,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 0,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c1),
               .connect_timeout_s = 5}},
        {.ctx = c1,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 1,
               .size = 3,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c0),
               .connect_timeout_s = 5}},
    };
    double t0 = stria_time_now();
    connect_all(args, 2);
    cr_expect_lt(stria_time_now() - t0, 4.0, "a mismatch must not wait for the timeout");
    for (int r = 0; r < 2; r++) {
        cr_expect_eq(args[r].st, STRIA_ERR_PROTOCOL, "rank %d: %s", r, args[r].msg);
        cr_expect(strstr(args[r].msg, "of 3") != NULL, "rank %d: %s", r, args[r].msg);
    }
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

Test(ucx, handshake_wrong_job_times_out_clearly, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp"), *c1 = ctx_new("tcp");
    connect_arg_t args[2] = {
        {.ctx = c0,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 0,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c1),
               .connect_timeout_s = 1}},
        {.ctx = c1,
         .p = {.job_id = 2,
               .ring_id = 1,
               .rank = 1,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = stria_ucx_ctx_port(c0),
               .connect_timeout_s = 1}},
    };
    connect_all(args, 2);
    for (int r = 0; r < 2; r++) {
        cr_expect_eq(args[r].st, STRIA_ERR_TIMEOUT, "rank %d: %s", r, args[r].msg);
        cr_expect(strstr(args[r].msg, "did not accept the handshake") != NULL, "rank %d: %s", r,
                  args[r].msg);
    }
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

/* The successor starts listening only after its predecessor began
 * connecting: the connect is retried until the timeout. */
Test(ucx, connect_waits_for_a_late_successor, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp");
    int port = free_port();
    connect_arg_t args[2] = {
        {.ctx = c0,
         .p = {.job_id = 1,
               .ring_id = 1,
               .rank = 0,
               .size = 2,
               .next_host = "127.0.0.1",
               .next_port = (uint16_t)port,
               .connect_timeout_s = 10}},
    };
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, connect_main, &args[0]), 0);
    usleep(700000);
    stria_ucx_ctx_params_t p1 = {
        .listen_host = "127.0.0.1", .listen_port = (uint16_t)port, .tls = "tcp"};
    stria_ucx_ctx_t *c1 = NULL;
    cr_assert_eq(stria_ucx_ctx_create(&p1, &c1), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_ucx_ctx_port(c1), port);
    args[1] = (connect_arg_t){.ctx = c1,
                              .p = {.job_id = 1,
                                    .ring_id = 1,
                                    .rank = 1,
                                    .size = 2,
                                    .next_host = "127.0.0.1",
                                    .next_port = stria_ucx_ctx_port(c0),
                                    .connect_timeout_s = 10}};
    connect_main(&args[1]);
    pthread_join(th, NULL);
    cr_assert_eq(args[0].st, STRIA_OK, "%s", args[0].msg);
    cr_assert_eq(args[1].st, STRIA_OK, "%s", args[1].msg);
    stria_link_destroy(args[0].link);
    stria_link_destroy(args[1].link);
    stria_ucx_ctx_destroy(c0);
    stria_ucx_ctx_destroy(c1);
}

/* A connect whose cancel flag is set gives up at once, not at its timeout
 * (the worker sets it when it drops the job of a pass still connecting). */
Test(ucx, a_cancelled_connect_ends_before_its_timeout, .init = setup, .fini = teardown,
     .timeout = 60)
{
    stria_ucx_ctx_t *c0 = ctx_new("tcp");
    bool cancel = false;
    connect_arg_t arg = {.ctx = c0,
                         .p = {.job_id = 1,
                               .ring_id = 1,
                               .rank = 0,
                               .size = 2,
                               .next_host = "127.0.0.1",
                               .next_port = (uint16_t)free_port(),
                               .connect_timeout_s = 20,
                               .cancel = &cancel}};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, connect_main, &arg), 0);
    usleep(300000);
    double t0 = stria_time_now();
    __atomic_store_n(&cancel, true, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    double took = stria_time_now() - t0;
    cr_expect_eq(arg.st, STRIA_ERR_CANCELLED, "%s", arg.msg);
    cr_expect(strstr(arg.msg, "connect cancelled") != NULL, "%s", arg.msg);
    cr_expect_lt(took, 1.0, "the connect ended %.2f s after the cancel", took);
    stria_ucx_ctx_destroy(c0);
}

Test(ucx, ring_of_one, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c = ctx_new("tcp");
    stria_ucx_link_params_t p = {.job_id = 1,
                                 .ring_id = 1,
                                 .rank = 0,
                                 .size = 1,
                                 .next_host = "127.0.0.1",
                                 .next_port = stria_ucx_ctx_port(c),
                                 .connect_timeout_s = 10};
    stria_link_t *link = NULL;
    cr_assert_eq(stria_link_ucx_connect(c, &p, &link), STRIA_OK, "%s", stria_error_msg());
    stria_link_t *dup = NULL;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &dup), STRIA_ERR_BUSY);
    uint8_t out[200000], in[200000];
    fill(out, sizeof(out), 9);
    stria_link_req_t *sq, *rq;
    cr_assert_eq(stria_link_isend(link, 1, out, sizeof(out), &sq), STRIA_OK);
    cr_assert_eq(stria_link_irecv(link, 1, in, sizeof(in), &rq), STRIA_OK);
    cr_assert_eq(stria_link_wait(link, rq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_link_wait(link, sq, 10), STRIA_OK, "%s", stria_error_msg());
    cr_expect(memcmp(in, out, sizeof(in)) == 0);
    stria_link_destroy(link);
    stria_ucx_ctx_destroy(c);
}

Test(ucx, invalid_arguments, .init = setup, .fini = teardown, .timeout = 60)
{
    stria_ucx_ctx_t *c = NULL;
    stria_ucx_ctx_params_t bad_host = {.listen_host = "no.such.host.invalid"};
    cr_expect_eq(stria_ucx_ctx_create(&bad_host, &c), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "no.such.host.invalid") != NULL, "%s", stria_error_msg());
    stria_ucx_ctx_params_t empty_tls = {.tls = ""};
    cr_expect_eq(stria_ucx_ctx_create(&empty_tls, &c), STRIA_ERR_INVALID_ARG);
    stria_ucx_ctx_params_t long_poll = {.poll_us = 1000000};
    cr_expect_eq(stria_ucx_ctx_create(&long_poll, &c), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_ucx_ctx_create(NULL, &c), STRIA_ERR_INVALID_ARG);

    c = ctx_new("tcp");
    stria_ucx_ctx_params_t same = {
        .listen_host = "127.0.0.1", .listen_port = stria_ucx_ctx_port(c), .tls = "tcp"};
    stria_ucx_ctx_t *c2 = NULL;
    cr_expect_eq(stria_ucx_ctx_create(&same, &c2), STRIA_ERR_BUSY, "%s", stria_error_msg());

    stria_link_t *link = NULL;
    stria_ucx_link_params_t p = {.rank = 2, .size = 2, .next_host = "127.0.0.1", .next_port = 1};
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.rank = 0;
    p.size = 0;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.size = 2;
    p.next_port = 0;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.next_port = 1;
    p.next_host = NULL;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    p.next_host = "127.0.0.1";
    p.connect_timeout_s = -1;
    cr_expect_eq(stria_link_ucx_connect(c, &p, &link), STRIA_ERR_INVALID_ARG);
    cr_expect_null(link);
    stria_ucx_ctx_destroy(c);
}
