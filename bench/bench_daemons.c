/* What the service benchmarks share (bench_daemons.h). */
#include "bench_daemons.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "stria.pb-c.h"
#include "stria_ring.h"
#include "stria_rpc.h"

typedef struct {
    pid_t pid;
    FILE *out;
} stria__bproc_t;

/* [0]: the coordinator, then the workers */
static stria__bproc_t stria__procs[2 * (STRIA_BENCH_MAX_WORKERS + 1)]; /* two services at most */
static int stria__n_procs;
/* The workers' runtime directory (their Unix sockets for the shared-memory
 * path); "" when none was made. */
static char stria__run_dir[64];

void stria_bench_daemons_stop(void)
{
    for (int i = 0; i < stria__n_procs; i++)
        if (stria__procs[i].pid > 0)
            kill(stria__procs[i].pid, SIGTERM);
    for (int i = 0; i < stria__n_procs; i++) {
        if (stria__procs[i].pid <= 0)
            continue;
        int st;
        for (int t = 0; t < 100 && waitpid(stria__procs[i].pid, &st, WNOHANG) == 0; t++)
            usleep(50000);
        if (waitpid(stria__procs[i].pid, &st, WNOHANG) == 0) {
            kill(stria__procs[i].pid, SIGKILL);
            waitpid(stria__procs[i].pid, &st, 0);
        }
        if (stria__procs[i].out)
            fclose(stria__procs[i].out);
        stria__procs[i].pid = 0;
        stria__procs[i].out = NULL;
    }
    stria__n_procs = 0;
    if (stria__run_dir[0] != '\0') { /* the sockets the workers left, then the folder */
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", stria__run_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "stria-bench: could not remove %s\n", stria__run_dir);
        stria__run_dir[0] = '\0';
    }
}

static void stria__bench_on_signal(int sig)
{
    stria_bench_daemons_stop();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* stria_bench_daemons_logs(): where the daemons' stderr goes ("": /dev/null)
 * and their --log-level. */
static char stria__log_dir[512];
static char stria__log_level[32] = "--log-level=error";

void stria_bench_daemons_logs(const char *dir, const char *level)
{
    snprintf(stria__log_dir, sizeof(stria__log_dir), "%s", dir != NULL ? dir : "");
    snprintf(stria__log_level, sizeof(stria__log_level), "--log-level=%s",
             level != NULL ? level : "error");
}

/* Starts argv with stdout on a pipe and stderr to /dev/null (or appended to
 * LOG_DIR/name.log); reads lines until one starts with `prefix` and copies it
 * into line. */
static int stria__start_proc(char *const argv[], const char *name, const char *prefix, char *line,
                             size_t len)
{
    char log[600] = "/dev/null";
    if (stria__log_dir[0] != '\0')
        snprintf(log, sizeof(log), "%s/%s.log", stria__log_dir, name);
    int fds[2];
    if (stria__n_procs >= (int)(sizeof(stria__procs) / sizeof(stria__procs[0])) || pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        /* nothing else of this process: the other daemons' pipes, the
         * benchmark's client connections and files stay out of the daemon
         * (they would count among its descriptors and keep connections open) */
        long max_fd = sysconf(_SC_OPEN_MAX);
        for (int fd = 3; fd < (max_fd > 0 && max_fd < 65536 ? max_fd : 65536); fd++)
            close(fd);
        FILE *err = freopen(log, "a", stderr);
        (void)err;
        execv(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    stria__bproc_t *p = &stria__procs[stria__n_procs++];
    p->pid = pid;
    p->out = fdopen(fds[0], "r");
    while (fgets(line, (int)len, p->out) != NULL) {
        if (strncmp(line, prefix, strlen(prefix)) == 0) {
            line[strcspn(line, "\n")] = '\0';
            return 0;
        }
    }
    return -1;
}

static stria_status_t stria__bench_coord_call(const char *coord, const char *token, uint32_t method,
                                              const ProtobufCMessage *req, stria_rpc_reply_t *reply)
{
    stria_rpc_client_params_t p;
    stria_rpc_client_t *c = NULL;
    memset(&p, 0, sizeof(p));
    p.address = coord;
    p.service = &stria__v1__coordinator__descriptor;
    p.client_name = "stria-bench";
    p.connect_timeout_s = 5;
    p.token = token;
    stria_status_t st = stria_rpc_client_connect(&p, &c);
    if (st != STRIA_OK)
        return st;
    stria_rpc_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.method = method;
    rq.request = req;
    rq.timeout_s = 5;
    memset(reply, 0, sizeof(*reply));
    st = stria_rpc_client_call(c, &rq, reply);
    stria_rpc_client_close(c);
    return st;
}

/* Waits up to 10 s for n healthy workers. */
static bool stria__wait_healthy(const char *coord, const char *token, unsigned n)
{
    for (int i = 0; i < 200; i++) {
        Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
        stria_rpc_reply_t reply;
        if (stria__bench_coord_call(coord, token, STRIA_RPC_COORDINATOR_GET_STATUS, &req.base,
                                    &reply) == STRIA_OK) {
            unsigned got = ((Stria__V1__GetStatusReply *)reply.msg)->workers_healthy;
            stria_rpc_reply_free(&reply);
            if (got >= n)
                return true;
        }
        usleep(50000);
    }
    return false;
}

int stria_bench_daemons_start(const char *cmd, int n, int tpr, char *coord, size_t coord_len)
{
    return stria_bench_daemons_start_creds(cmd, n, tpr, NULL, coord, coord_len);
}

/* The first line of a token file into tok (len bytes); false when unreadable. */
static bool stria__read_token(const char *path, char *tok, size_t len)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    bool ok = fgets(tok, (int)len, f) != NULL;
    fclose(f);
    tok[strcspn(tok, "\r\n")] = '\0';
    return ok;
}

/* What a worker's start needs again when stria_bench_worker_restart() starts
 * it anew: the last service started's coordinator, binary and flags. */
static struct {
    char bin[4200], coord[512], threads[16], rundir[96], ctok[4200], wtok[4200];
    bool creds;
} stria__wcfg;

/* Starts a worker of the last service started into procs slot `slot` (a new
 * slot when slot == stria__n_procs). Returns 0 or -1. */
static int stria__bench_start_worker(int slot)
{
    char line[512], name[32];
    snprintf(name, sizeof(name), "worker%d", slot - 1);
    /* the runtime directory first: without one, its place repeats the log level */
    char *wargv[] = {stria__wcfg.bin,
                     "--coordinator",
                     stria__wcfg.coord,
                     "--threads",
                     stria__wcfg.threads,
                     stria__log_level,
                     stria__wcfg.rundir[0] ? stria__wcfg.rundir : stria__log_level,
                     stria__wcfg.creds ? stria__wcfg.ctok : NULL,
                     stria__wcfg.wtok,
                     NULL};
    if (slot == stria__n_procs)
        return stria__start_proc(wargv, name, "stria-worker listening", line, sizeof(line));
    /* an existing slot: start into a new one, then move it there */
    int n = stria__n_procs;
    if (stria__start_proc(wargv, name, "stria-worker listening", line, sizeof(line)) != 0) {
        if (stria__n_procs > n) { /* started but never said it listens */
            kill(stria__procs[n].pid, SIGKILL);
            waitpid(stria__procs[n].pid, NULL, 0);
            if (stria__procs[n].out)
                fclose(stria__procs[n].out);
            stria__n_procs = n;
        }
        return -1;
    }
    stria__procs[slot] = stria__procs[n];
    stria__n_procs = n;
    return 0;
}

int stria_bench_daemons_start_creds(const char *cmd, int n, int tpr,
                                    const stria_bench_creds_t *creds, char *coord, size_t coord_len)
{
    char self[4096], dir[4096], coord_bin[4200];
    ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0) {
        fprintf(stderr, "stria-bench %s: cannot find this program's folder\n", cmd);
        return 1;
    }
    self[len] = '\0';
    snprintf(dir, sizeof(dir), "%s", self);
    *strrchr(dir, '/') = '\0';
    snprintf(coord_bin, sizeof(coord_bin), "%s/stria-coordinator", dir);
    snprintf(stria__wcfg.bin, sizeof(stria__wcfg.bin), "%s/stria-worker", dir);
    if (access(coord_bin, X_OK) != 0 || access(stria__wcfg.bin, X_OK) != 0) {
        fprintf(stderr, "stria-bench %s: %s and %s are needed (build them)\n", cmd, coord_bin,
                stria__wcfg.bin);
        return 1;
    }
    signal(SIGINT, stria__bench_on_signal);
    signal(SIGTERM, stria__bench_on_signal);
    setenv("UCX_HANDLE_ERRORS", "none", 0);

    char line[512], token[256] = "";
    char *ctok = stria__wcfg.ctok, *wtok = stria__wcfg.wtok;
    ctok[0] = wtok[0] = '\0';
    stria__wcfg.creds = creds != NULL;
    if (creds != NULL) {
        snprintf(ctok, sizeof(stria__wcfg.ctok), "--client-token-file=%s",
                 creds->client_token_file);
        snprintf(wtok, sizeof(stria__wcfg.wtok), "--worker-token-file=%s",
                 creds->worker_token_file);
        if (!stria__read_token(creds->client_token_file, token, sizeof(token))) {
            fprintf(stderr, "stria-bench %s: cannot read %s\n", cmd, creds->client_token_file);
            return 1;
        }
    }
    /* Heartbeats every 2 s: a worker is taken for dead after 6 s of silence,
     * which a loaded machine does not reach by starving it for a moment. */
    char *cargv[] = {coord_bin,
                     "--listen",
                     "127.0.0.1:0",
                     "--heartbeat-period",
                     STRIA_BENCH_HEARTBEAT_S,
                     stria__log_level,
                     creds ? ctok : NULL,
                     wtok,
                     NULL};
    if (stria__start_proc(cargv, "coordinator", "stria-coordinator listening on ", line,
                          sizeof(line)) != 0) {
        fprintf(stderr, "stria-bench %s: the coordinator did not start\n", cmd);
        stria_bench_daemons_stop();
        return 1;
    }
    snprintf(coord, coord_len, "%s", line + strlen("stria-coordinator listening on "));
    snprintf(stria__wcfg.coord, sizeof(stria__wcfg.coord), "%s", coord);
    snprintf(stria__wcfg.threads, sizeof(stria__wcfg.threads), "%d", tpr);
    stria__wcfg.rundir[0] = '\0';
    if (stria__run_dir[0] == '\0') {
        snprintf(stria__run_dir, sizeof(stria__run_dir), "/tmp/stria-bench-XXXXXX");
        if (mkdtemp(stria__run_dir) == NULL)
            stria__run_dir[0] = '\0'; /* no shared-memory path then */
    }
    if (stria__run_dir[0] != '\0')
        snprintf(stria__wcfg.rundir, sizeof(stria__wcfg.rundir), "--runtime-dir=%s",
                 stria__run_dir);
    for (int i = 0; i < n; i++) {
        if (stria__bench_start_worker(stria__n_procs) != 0) {
            fprintf(stderr, "stria-bench %s: worker %d did not start\n", cmd, i);
            stria_bench_daemons_stop();
            return 1;
        }
    }
    if (!stria__wait_healthy(coord, creds ? token : NULL, (unsigned)n)) {
        fprintf(stderr, "stria-bench %s: the %d workers did not register within 10 s\n", cmd, n);
        stria_bench_daemons_stop();
        return 1;
    }
    return 0;
}

int stria_bench_daemons_count(void)
{
    return stria__n_procs;
}

pid_t stria_bench_daemon_pid(int i)
{
    return i >= 0 && i < stria__n_procs ? stria__procs[i].pid : 0;
}

int stria_bench_worker_kill(int i)
{
    stria__bproc_t *p = i >= 0 && i + 1 < stria__n_procs ? &stria__procs[i + 1] : NULL;
    if (p == NULL || p->pid <= 0)
        return -1;
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    if (p->out)
        fclose(p->out);
    p->pid = 0;
    p->out = NULL;
    return 0;
}

int stria_bench_worker_restart(int i)
{
    if (i < 0 || i + 1 >= stria__n_procs || stria__procs[i + 1].pid > 0)
        return -1;
    return stria__bench_start_worker(i + 1);
}

long long stria_bench_worker_minflt(int i)
{
    char path[64], buf[1024];
    if (i < 0 || i + 1 >= stria__n_procs)
        return -1;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)stria__procs[i + 1].pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* after the command's ")": state ppid pgrp session tty tpgid flags minflt */
    char *p = strrchr(buf, ')');
    long long v[8];
    if (p == NULL || sscanf(p + 1, " %*c %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2],
                            &v[3], &v[4], &v[5], &v[6]) != 7)
        return -1;
    return v[6];
}

stria_status_t stria_bench_pools(const char *coord, stria_bench_pools_t *out)
{
    Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    memset(out, 0, sizeof(*out));
    stria_status_t st =
        stria__bench_coord_call(coord, NULL, STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &reply);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)reply.msg;
    for (size_t i = 0; i < r->n_workers; i++) {
        /* a dead worker's last heartbeat is not memory in use anywhere */
        if (r->workers[i]->state == STRIA__V1__WORKER_STATE__WORKER_STATE_DEAD ||
            r->workers[i]->state == STRIA__V1__WORKER_STATE__WORKER_STATE_LEFT)
            continue;
        out->reserved += r->workers[i]->pool_reserved_bytes;
        out->in_use += r->workers[i]->pool_in_use_bytes;
        out->high_water += r->workers[i]->pool_high_water_bytes;
        out->committed += r->workers[i]->pool_committed_bytes;
    }
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

stria_status_t stria_bench_coord_status(const char *coord, stria_bench_coord_status_t *out)
{
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    stria_rpc_reply_t reply;
    memset(out, 0, sizeof(*out));
    stria_status_t st =
        stria__bench_coord_call(coord, NULL, STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, &reply);
    if (st != STRIA_OK)
        return st;
    const Stria__V1__GetStatusReply *r = (const Stria__V1__GetStatusReply *)reply.msg;
    out->workers_healthy = r->workers_healthy;
    out->workers_dead = r->workers_dead;
    out->jobs_pending = r->jobs_pending;
    out->jobs_active = r->jobs_active;
    out->jobs_submitted = r->jobs_submitted;
    out->jobs_failed = r->jobs_failed;
    stria_rpc_reply_free(&reply);
    return STRIA_OK;
}

stria_status_t stria_bench_client(const char *coord, const char *name, stria_data_path_t path,
                                  stria_client_t **out)
{
    stria_client_params_t cp = STRIA_CLIENT_PARAMS_INIT;
    cp.coordinator = coord;
    cp.client_name = name;
    cp.data_path = path;
    return stria_client_connect(&cp, out);
}

int stria_bench_job_alloc(stria_bench_job_t *t, bool backward)
{
    size_t es = stria_dtype_size(t->dtype);
    size_t nq = (size_t)(t->batch * t->seq * t->heads * t->head_dim);
    size_t nk = (size_t)(t->batch * t->seq * t->kv_heads * t->head_dim);
    t->q = stria_malloc_aligned(nq * es);
    t->k = stria_malloc_aligned(nk * es);
    t->v = stria_malloc_aligned(nk * es);
    t->o = stria_malloc_aligned(nq * es);
    t->lse = stria_malloc_aligned((size_t)(t->batch * t->heads * t->seq) * sizeof(float));
    if (backward) {
        t->g = stria_malloc_aligned(nq * es);
        t->dq = stria_malloc_aligned(nq * es);
        t->dk = stria_malloc_aligned(nk * es);
        t->dv = stria_malloc_aligned(nk * es);
    }
    if (t->q == NULL || t->k == NULL || t->v == NULL || t->o == NULL || t->lse == NULL ||
        (backward && (t->g == NULL || t->dq == NULL || t->dk == NULL || t->dv == NULL))) {
        fprintf(stderr, "stria-bench: out of memory for the job's tensors\n");
        stria_bench_job_free(t);
        return 1;
    }
    stria_bench_fill(t->q, t->dtype, nq, 1);
    stria_bench_fill(t->k, t->dtype, nk, 2);
    stria_bench_fill(t->v, t->dtype, nk, 3);
    /* outputs too: their pages are the caller's, faulted in before timing */
    memset(t->o, 0, nq * es);
    memset(t->lse, 0, (size_t)(t->batch * t->heads * t->seq) * sizeof(float));
    if (backward) {
        stria_bench_fill(t->g, t->dtype, nq, 4);
        memset(t->dq, 0, nq * es);
        memset(t->dk, 0, nk * es);
        memset(t->dv, 0, nk * es);
    }
    return 0;
}

void stria_bench_job_free(stria_bench_job_t *t)
{
    stria_free(t->q), stria_free(t->k), stria_free(t->v), stria_free(t->g), stria_free(t->o);
    stria_free(t->dq), stria_free(t->dk), stria_free(t->dv), stria_free(t->lse);
    t->q = t->k = t->v = t->g = t->o = t->dq = t->dk = t->dv = NULL;
    t->lse = NULL;
}

stria_job_spec_t stria_bench_job_spec(const stria_bench_job_t *t, bool causal, int ranks,
                                      const char *label)
{
    stria_job_spec_t spec = STRIA_JOB_SPEC_INIT;
    spec.batch = t->batch;
    spec.seq_len = t->seq;
    spec.heads = t->heads;
    spec.kv_heads = t->kv_heads;
    spec.head_dim = t->head_dim;
    spec.dtype = t->dtype;
    spec.causal = causal;
    spec.layout = STRIA_LAYOUT_STRIPED;
    spec.ring_size = ranks;
    spec.label = label;
    return spec;
}

stria_status_t stria_bench_service_fwd_bwd(stria_client_t *client, const stria_job_spec_t *spec,
                                           stria_bench_job_t *t, double *seconds,
                                           stria_call_stats_t *fwd, stria_call_stats_t *bwd)
{
    stria_job_t *job = NULL;
    double t0 = stria_time_now();
    stria_status_t st =
        stria_client_forward(client, spec, t->q, t->k, t->v, t->o, t->lse, NULL, NULL, fwd, &job);
    if (st == STRIA_OK)
        st = stria_client_backward(job, t->g, t->dq, t->dk, t->dv, NULL, NULL, bwd);
    *seconds = stria_time_now() - t0;
    stria_client_release(job);
    return st;
}

stria_status_t stria_bench_local_fwd_bwd(stria_bench_job_t *t, bool causal, int ranks, int tpr,
                                         double *seconds)
{
    stria_ring_shape_t shape = {.call = {.batch = t->batch, .seq_len = t->seq, .causal = causal},
                                .heads = t->heads,
                                .kv_heads = t->kv_heads,
                                .head_dim = t->head_dim,
                                .dtype = t->dtype};
    const stria_ring_local_opts_t ro = {.layout = STRIA_LAYOUT_STRIPED,
                                        .n_ranks = ranks,
                                        .passes = STRIA_RING_PASS_FWD_BWD,
                                        .threads_per_rank = tpr};
    const stria_ring_local_io_t io = {.q = t->q,
                                      .k = t->k,
                                      .v = t->v,
                                      .o = t->o,
                                      .o_dtype = t->dtype,
                                      .lse = t->lse,
                                      .d_o = t->g,
                                      .dq = t->dq,
                                      .dk = t->dk,
                                      .dv = t->dv,
                                      .grad_dtype = t->dtype};
    stria_ring_local_stats_t ls;
    memset(&ls, 0, sizeof(ls));
    double t0 = stria_time_now();
    stria_status_t st = stria_ring_run_local(&shape, &ro, &io, &ls);
    *seconds = stria_time_now() - t0;
    return st;
}
