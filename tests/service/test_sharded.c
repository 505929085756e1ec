/* Sharded jobs, placement and the co-located shared-memory path, with real
 * processes on loopback: a coordinator, four workers (hosts hA, hA, hB, hB;
 * instances 0, 1, 0, 1; each with a runtime directory, so a Unix socket),
 * and trainer ranks as processes of their own (shard_rank). Results must
 * equal the in-process ring bit for bit over either path; a missing rank,
 * a rank killed mid-upload and a wrong secret must fail clearly; placement
 * must follow the spec or refuse. */
#include <criterion/criterion.h>

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proc.h"
#include "ref.h"
#include "stria.pb-c.h"
#include "stria_client.h"
#include "stria_ring.h"
#include "stria_rpc.h"
#include "stria_shm.h"

#define N_WORKERS   4 /* the ranks of the jobs; a cluster may have a spare */
#define MAX_WORKERS 5
#define HELPER_S    180 /* a helper's deadline (the sanitizer build is slow) */

static struct {
    test_proc_t *coord;
    char coord_addr[256];
    test_proc_t *workers[MAX_WORKERS]; /* NULL: killed */
    char rpc[MAX_WORKERS][64];         /* their RPC addresses */
    int n, alive;
    char dir[128];
} cl;

static char *const env[] = {"UCX_HANDLE_ERRORS=none", "UCX_TLS=tcp,sm,self", "STRIA_LOG_LEVEL=info",
                            NULL};

static void wait_healthy(void);

/* Worker i of the cluster (0 and 1 on host hA, the others on hB); with
 * `shm`, it offers its clients shared memory. */
static void start_worker(int i, bool shm)
{
    static const char *const hosts[MAX_WORKERS] = {"hA", "hA", "hB", "hB", "hB"};
    static const char *const inst[MAX_WORKERS] = {"0", "1", "0", "1", "2"};
    char log[256], line[256];
    snprintf(log, sizeof(log), "%s/worker%d.log", cl.dir, i);
    char *argv[] = {STRIA_WORKER_BIN,
                    "--coordinator",
                    cl.coord_addr,
                    "--threads",
                    "1",
                    "--step-timeout",
                    "5",
                    "--memory",
                    "1G",
                    "--host",
                    (char *)hosts[i],
                    "--instance",
                    (char *)inst[i],
                    "--listen",
                    "127.0.0.1:0",
                    "--ucx-listen",
                    "127.0.0.1:0",
                    "--metrics-listen",
                    "127.0.0.1:0",
                    shm ? "--runtime-dir" : NULL, /* without shm the list ends here */
                    cl.dir,
                    NULL};
    cl.workers[i] = test_proc_start(argv, log, env);
    cr_assert(
        test_proc_wait_line(cl.workers[i], "stria-worker listening rpc=", 10, line, sizeof(line)),
        "worker %d did not start (see %s)", i, log);
    sscanf(line + strlen("stria-worker listening rpc="), "%63s", cl.rpc[i]);
    cl.n = i + 1 > cl.n ? i + 1 : cl.n;
    cl.alive++;
}

/* n workers: 2 on host hA, then hB's (a fifth is a spare on hB). */
static void start_cluster_n(int n)
{
    char log[256], line[256], cmd[300];
    memset(&cl, 0, sizeof(cl));
    snprintf(cl.dir, sizeof(cl.dir), "/tmp/stria_sharded_%d", (int)getpid());
    snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", cl.dir, cl.dir);
    cr_assert_eq(system(cmd), 0);
    snprintf(log, sizeof(log), "%s/coordinator.log", cl.dir);
    /* 0.5 s heartbeats: dead after 1.5 s of silence, which a loaded
     * machine's scheduler can cause at 0.2 s */
    char *cargv[] = {STRIA_COORDINATOR_BIN, "--listen", "127.0.0.1:0",
                     "--heartbeat-period",  "0.5",      NULL};
    cl.coord = test_proc_start(cargv, log, env);
    cr_assert(
        test_proc_wait_line(cl.coord, "stria-coordinator listening on ", 10, line, sizeof(line)));
    snprintf(cl.coord_addr, sizeof(cl.coord_addr), "%s",
             line + strlen("stria-coordinator listening on "));
    for (int i = 0; i < n; i++)
        start_worker(i, true);
    wait_healthy();
}

static void start_cluster(void)
{
    start_cluster_n(N_WORKERS);
}

static stria_status_t coord_call(uint32_t method, const ProtobufCMessage *req,
                                 stria_rpc_reply_t *rep);

/* Waits until the coordinator counts every worker healthy. */
static void wait_healthy(void)
{
    unsigned got = 0;
    for (int i = 0; i < 300 && got != (unsigned)cl.alive; i++) {
        Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
        stria_rpc_reply_t rep;
        cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, &rep), STRIA_OK);
        got = ((Stria__V1__GetStatusReply *)rep.msg)->workers_healthy;
        stria_rpc_reply_free(&rep);
        if (got != (unsigned)cl.alive)
            usleep(50000);
    }
    cr_assert_eq(got, (unsigned)cl.alive, "%u healthy workers", got);
}

static void stop_cluster(void)
{
    for (int i = 0; i < cl.n; i++) {
        if (cl.workers[i] == NULL)
            continue;
        int st = test_proc_stop(cl.workers[i], SIGTERM, 15);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d: status %#x", i, st);
    }
    int st = test_proc_stop(cl.coord, SIGTERM, 10);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "coordinator: status %#x", st);
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", cl.dir);
    if (getenv("STRIA_TEST_KEEP") == NULL) /* the logs, for a look */
        (void)!system(cmd);
}

static stria_rpc_client_t *coord_rpc(void)
{
    stria_rpc_client_params_t p = {.address = cl.coord_addr,
                                   .service = &stria__v1__coordinator__descriptor,
                                   .connect_timeout_s = 5};
    stria_rpc_client_t *c = NULL;
    cr_assert_eq(stria_rpc_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

static stria_status_t coord_call(uint32_t method, const ProtobufCMessage *req,
                                 stria_rpc_reply_t *rep)
{
    stria_rpc_client_t *c = coord_rpc();
    stria_rpc_request_t rq = {.method = method, .request = req, .timeout_s = 10};
    memset(rep, 0, sizeof(*rep));
    stria_status_t st = stria_rpc_client_call(c, &rq, rep);
    stria_rpc_client_close(c);
    return st;
}

/* Waits until every worker is healthy and reports no memory in use. */
static bool workers_idle(double timeout_s)
{
    double until = stria_time_now() + timeout_s;
    do {
        Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
        stria_rpc_reply_t rep;
        if (coord_call(STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &rep) == STRIA_OK) {
            const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)rep.msg;
            size_t idle = 0;
            for (size_t i = 0; i < r->n_workers; i++)
                idle += r->workers[i]->state == STRIA__V1__WORKER_STATE__WORKER_STATE_HEALTHY &&
                        r->workers[i]->memory_in_use_bytes == 0 && r->workers[i]->n_job_ids == 0;
            stria_rpc_reply_free(&rep);
            if (idle == (size_t)cl.alive)
                return true;
        }
        usleep(100000);
    } while (stria_time_now() < until);
    return false;
}

/* Memory a worker reports in use (after two heartbeats, so it is current). */
static uint64_t worker_in_use(uint64_t worker_id)
{
    Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
    stria_rpc_reply_t rep;
    uint64_t used = UINT64_MAX;
    usleep(1200000);
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &rep), STRIA_OK);
    const Stria__V1__ListWorkersReply *r = (const Stria__V1__ListWorkersReply *)rep.msg;
    for (size_t i = 0; i < r->n_workers; i++)
        if (r->workers[i]->worker_id == worker_id)
            used = r->workers[i]->memory_in_use_bytes;
    stria_rpc_reply_free(&rep);
    return used;
}

static stria_client_t *client(stria_data_path_t path)
{
    stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT;
    stria_client_t *c = NULL;
    p.coordinator = cl.coord_addr;
    p.client_name = "test_sharded";
    p.data_path = path;
    cr_assert_eq(stria_client_connect(&p, &c), STRIA_OK, "%s", stria_error_msg());
    return c;
}

/* ---- a case: its spec, inputs, and the in-process ring's outputs ------------- */

typedef struct {
    stria_job_spec_t spec;
    uint64_t seed;
    size_t nq, nk, nl, es;
    void *q, *k, *v, *g; /* full inputs, storage dtype */
    void *ref[5];        /* in-process O, LSE, dQ, dK, dV */
    void *got[5];        /* gathered from the ranks */
    size_t bytes[5];
    float *qf, *kf, *vf, *gf;
} case_t;

static void *full_tensor(size_t n, uint64_t seed, stria_dtype_t dt, float **f_out)
{
    float *f = malloc(n * 4);
    void *x = malloc(n * stria_dtype_size(dt));
    ref_fill(f, n, seed, 1.0f, dt);
    ref_to_dtype(f, n, dt, x);
    *f_out = f;
    return x;
}

static void case_init(case_t *c, int64_t B, int64_t S, int64_t H, int64_t Hkv, stria_dtype_t dt,
                      bool causal, stria_layout_kind_t layout, uint64_t seed)
{
    const int64_t D = 32;
    memset(c, 0, sizeof(*c));
    c->spec = (stria_job_spec_t)STRIA_JOB_SPEC_INIT;
    c->spec.batch = B;
    c->spec.seq_len = S;
    c->spec.heads = H;
    c->spec.kv_heads = Hkv;
    c->spec.head_dim = D;
    c->spec.dtype = dt;
    c->spec.causal = causal;
    c->spec.layout = layout;
    c->spec.ring_size = N_WORKERS;
    c->spec.step_timeout_s = 5;
    c->seed = seed;
    c->es = stria_dtype_size(dt);
    c->nq = (size_t)(B * S * H * D);
    c->nk = (size_t)(B * S * Hkv * D);
    c->nl = (size_t)(B * H * S);
    c->q = full_tensor(c->nq, seed, dt, &c->qf);
    c->k = full_tensor(c->nk, seed + 1, dt, &c->kf);
    c->v = full_tensor(c->nk, seed + 2, dt, &c->vf);
    c->g = full_tensor(c->nq, seed + 3, dt, &c->gf);
    size_t b[5] = {c->nq * c->es, c->nl * 4, c->nq * c->es, c->nk * c->es, c->nk * c->es};
    for (int i = 0; i < 5; i++) {
        c->bytes[i] = b[i];
        c->ref[i] = calloc(1, b[i]);
        c->got[i] = calloc(1, b[i]);
    }
    stria_ring_shape_t shape = {.batch = B,
                                .seq = S,
                                .heads = H,
                                .kv_heads = Hkv,
                                .head_dim = D,
                                .causal = causal,
                                .dtype = dt};
    stria_ring_local_opts_t lo = {
        .layout = layout, .n_ranks = N_WORKERS, .passes = STRIA_RING_PASS_FWD_BWD};
    stria_ring_local_io_t io = {.q = c->q,
                                .k = c->k,
                                .v = c->v,
                                .o = c->ref[0],
                                .o_dtype = dt,
                                .lse = c->ref[1],
                                .d_o = c->g,
                                .dq = c->ref[2],
                                .dk = c->ref[3],
                                .dv = c->ref[4],
                                .grad_dtype = dt};
    cr_assert_eq(stria_ring_run_local(&shape, &lo, &io, NULL), STRIA_OK, "%s", stria_error_msg());
}

static void case_free(case_t *c)
{
    free(c->q), free(c->k), free(c->v), free(c->g);
    free(c->qf), free(c->kf), free(c->vf), free(c->gf);
    for (int i = 0; i < 5; i++)
        free(c->ref[i]), free(c->got[i]);
}

/* The in-process ring's outputs against the fp64 reference (the tolerance
 * rule of the kernels, loosened by the rounding to the storage dtype). */
static void case_check_reference(const case_t *c)
{
    const stria_job_spec_t *s = &c->spec;
    ref_shape_t rs = {s->batch,
                      s->seq_len,
                      s->seq_len,
                      s->heads,
                      s->kv_heads,
                      s->head_dim,
                      1.0 / sqrt((double)s->head_dim),
                      s->causal,
                      NULL,
                      NULL};
    ref_out_t r64, r32;
    ref_f64_run(&rs, c->qf, c->kf, c->vf, c->gf, &r64);
    ref_f32_run(&rs, c->qf, c->kf, c->vf, c->gf, &r32);
    const double *want64[5] = {r64.o, r64.lse, r64.dq, r64.dk, r64.dv};
    const double *want32[5] = {r32.o, r32.lse, r32.dq, r32.dk, r32.dv};
    size_t n[5] = {c->nq, c->nl, c->nq, c->nk, c->nk};
    for (int i = 0; i < 5; i++) {
        stria_dtype_t dt = i == 1 ? STRIA_DTYPE_F32 : s->dtype;
        float *f = malloc(n[i] * 4);
        stria_dtype_convert(dt, c->got[i], STRIA_DTYPE_F32, f, n[i]);
        double err = ref_max_err_f32(f, want64[i], n[i]);
        double naive = ref_max_err_f64(want32[i], want64[i], n[i]);
        double mag = ref_max_abs(want64[i], n[i]);
        double round = dt == STRIA_DTYPE_BF16 ? 1.0 / 256 : 0;
        cr_expect(err <= 2 * naive + 2e-6 * (1 + mag) + round * mag,
                  "output %d: error %.3g against fp64", i, err);
        free(f);
    }
    ref_out_free(&r64);
    ref_out_free(&r32);
}

/* Reads the ranks' output files into full tensors (each rank's tokens at
 * their positions). */
static void case_gather(case_t *c, stria_job_t *job)
{
    static const char *const names[5] = {"o", "lse", "dq", "dk", "dv"};
    const stria_job_spec_t *s = &c->spec;
    for (int r = 0; r < N_WORKERS; r++) {
        int64_t T = stria_job_shard_tokens(job, r);
        int64_t *pos = malloc((size_t)T * sizeof(int64_t));
        cr_assert_eq(stria_job_positions(job, r, pos), STRIA_OK);
        for (int i = 0; i < 5; i++) {
            int64_t outer = i == 1 ? s->batch * s->heads : s->batch;
            size_t row = i == 1 ? 4 : c->bytes[i] / (size_t)(s->batch * s->seq_len);
            size_t len = (size_t)(outer * T) * row;
            char path[300], *shard = malloc(len);
            snprintf(path, sizeof(path), "%s/rank%d.%s", cl.dir, r, names[i]);
            FILE *f = fopen(path, "rb");
            cr_assert_not_null(f, "rank %d wrote no %s", r, names[i]);
            cr_assert_eq(fread(shard, 1, len, f), len, "rank %d: short %s", r, names[i]);
            fclose(f);
            unlink(path);
            for (int64_t o = 0; o < outer; o++)
                for (int64_t t = 0; t < T; t++)
                    memcpy((char *)c->got[i] + (size_t)(o * s->seq_len + pos[t]) * row,
                           shard + (size_t)(o * T + t) * row, row);
            free(shard);
        }
        free(pos);
    }
}

/* Starts rank r's process. */
static test_proc_t *start_rank(const case_t *c, stria_job_t *job, int r, const char *path,
                               const char *mode)
{
    uint8_t exp[STRIA_JOB_EXPORT_BYTES];
    size_t len = 0;
    char hex[2 * STRIA_JOB_EXPORT_BYTES + 1], a[8][32], log[256];
    cr_assert_eq(stria_job_export(job, exp, sizeof(exp), &len), STRIA_OK, "%s", stria_error_msg());
    for (size_t i = 0; i < len; i++)
        snprintf(hex + 2 * i, 3, "%02x", exp[i]);
    const stria_job_spec_t *s = &c->spec;
    snprintf(a[0], 32, "%d", r);
    snprintf(a[1], 32, "%lld", (long long)s->batch);
    snprintf(a[2], 32, "%lld", (long long)s->seq_len);
    snprintf(a[3], 32, "%lld", (long long)s->heads);
    snprintf(a[4], 32, "%lld", (long long)s->kv_heads);
    snprintf(a[5], 32, "%lld", (long long)s->head_dim);
    snprintf(a[6], 32, "%d", (int)s->dtype);
    snprintf(a[7], 32, "%llu", (unsigned long long)c->seed);
    snprintf(log, sizeof(log), "%s/rank%d.log", cl.dir, r);
    char *argv[] = {SHARD_RANK_BIN, cl.coord_addr, hex,  a[0], (char *)path,
                    (char *)mode,   cl.dir,        a[1], a[2], a[3],
                    a[4],           a[5],          a[6], a[7], NULL};
    test_proc_t *p = test_proc_start(argv, log, env);
    cr_assert_not_null(p);
    return p;
}

/* The rank's last line ("shard_rank: ok ..." or "...: error ..."); waits for
 * its exit. */
static void rank_result(test_proc_t *p, char *line, size_t len)
{
    line[0] = '\0';
    test_proc_wait_line(p, "shard_rank: ", HELPER_S, line, len);
    test_proc_wait(p, 30);
}

/* Four rank processes over `path` (mode run or inplace): every rank
 * succeeds on the path it should, and the gathered outputs are the
 * in-process ring's, bit for bit. */
static void run_sharded(stria_client_t *sub, case_t *c, const char *path, const char *mode,
                        const char *want_path)
{
    stria_job_t *job = NULL;
    test_proc_t *p[N_WORKERS];
    char line[1024];
    cr_assert_eq(stria_client_submit(sub, &c->spec, &job), STRIA_OK, "%s", stria_error_msg());
    for (int r = 0; r < N_WORKERS; r++)
        p[r] = start_rank(c, job, r, path, mode);
    for (int r = 0; r < N_WORKERS; r++) {
        rank_result(p[r], line, sizeof(line));
        cr_expect(strncmp(line, "shard_rank: ok", 14) == 0, "rank %d (%s, %s): %s", r, path, mode,
                  line);
        cr_expect(strstr(line, want_path) != NULL, "rank %d took the wrong path: %s", r, line);
    }
    memset(c->got[0], 0xff, c->bytes[0]);
    case_gather(c, job);
    static const char *const names[5] = {"O", "LSE", "dQ", "dK", "dV"};
    for (int i = 0; i < 5; i++)
        cr_expect_eq(memcmp(c->got[i], c->ref[i], c->bytes[i]), 0,
                     "%s over %s (%s, %s layout, S=%lld) differs from the in-process ring",
                     names[i], path, mode, stria_layout_kind_name(c->spec.layout),
                     (long long)c->spec.seq_len);
    /* the ranks released their handles: the job is over */
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = stria_job_id(job);
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    cr_expect_eq(((Stria__V1__GetJobReply *)rep.msg)->job->state,
                 STRIA__V1__JOB_STATE__JOB_STATE_RELEASED,
                 "every rank released, the job should be released");
    stria_rpc_reply_free(&rep);
    stria_client_release(job); /* the submitter ran no rank: nothing more */
}

Test(sharded, four_rank_processes_equal_the_in_process_ring, .timeout = 900)
{
    start_cluster();
    stria_client_t *sub = client(STRIA_DATA_PATH_AUTO);
    case_t c;
    /* striped, S=101 (not a multiple of 2N: padded shards, so the shared
     * buffers have a batch stride), GQA, bf16: TCP, then shared memory
     * filled and read in place; the same bits */
    case_init(&c, 2, 101, 4, 2, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_STRIPED, 11);
    run_sharded(sub, &c, "tcp", "run", "path=tcp");
    void *tcp_o = malloc(c.bytes[0]);
    memcpy(tcp_o, c.got[0], c.bytes[0]);
    run_sharded(sub, &c, "shm", "inplace", "path=shm");
    cr_expect_eq(memcmp(tcp_o, c.got[0], c.bytes[0]), 0, "shm and tcp differ");
    case_check_reference(&c);
    free(tcp_o);
    case_free(&c);
    /* contiguous, fp32, non-causal, copied through the shared buffers */
    case_init(&c, 1, 77, 2, 1, STRIA_DTYPE_F32, false, STRIA_LAYOUT_CONTIGUOUS, 21);
    run_sharded(sub, &c, "shm", "run", "path=shm");
    case_free(&c);
    /* zigzag, S=90 (90 % 8 = 2), fp32: auto takes shared memory here */
    case_init(&c, 1, 90, 4, 4, STRIA_DTYPE_F32, true, STRIA_LAYOUT_ZIGZAG, 31);
    run_sharded(sub, &c, "auto", "run", "path=shm");
    case_check_reference(&c);
    case_free(&c);
    stria_client_close(sub);
    cr_expect(workers_idle(10), "memory still held after every job ended");
    stop_cluster();
}

/* The whole-sequence calls over shared memory and over TCP: the same bits,
 * the in-process ring's. */
Test(sharded, whole_sequence_calls_over_shm_and_tcp, .timeout = 600)
{
    start_cluster();
    case_t c;
    case_init(&c, 2, 70, 4, 1, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_ZIGZAG, 41);
    for (int path = STRIA_DATA_PATH_TCP; path <= STRIA_DATA_PATH_SHM; path++) {
        stria_client_t *cli = client((stria_data_path_t)path);
        stria_job_t *job = NULL;
        cr_assert_eq(stria_client_forward(cli, &c.spec, c.q, c.k, c.v, c.got[0], c.got[1], NULL,
                                          NULL, NULL, &job),
                     STRIA_OK, "%s", stria_error_msg());
        for (int r = 0; r < N_WORKERS; r++)
            cr_expect_eq(stria_job_data_path(job, r), (stria_data_path_t)path, "rank %d", r);
        cr_assert_eq(
            stria_client_backward(job, c.g, c.got[2], c.got[3], c.got[4], NULL, NULL, NULL),
            STRIA_OK, "%s", stria_error_msg());
        for (int i = 0; i < 5; i++)
            cr_expect_eq(memcmp(c.got[i], c.ref[i], c.bytes[i]), 0, "path %d: output %d differs",
                         path, i);
        cr_expect_eq(stria_client_release(job), STRIA_OK, "%s", stria_error_msg());
        stria_client_close(cli);
    }
    case_free(&c);
    cr_expect(workers_idle(10), "memory still held after the jobs");
    stop_cluster();
}

/* The job's failure text at the coordinator. */
static void job_failure(uint64_t id, Stria__V1__JobState *state, char *out, size_t len)
{
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = id;
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    *state = j->state;
    snprintf(out, len, "%s", j->failure);
    stria_rpc_reply_free(&rep);
}

Test(sharded, a_missing_rank_fails_the_job_naming_it, .timeout = 600)
{
    start_cluster();
    stria_client_t *sub = client(STRIA_DATA_PATH_AUTO);
    case_t c;
    case_init(&c, 1, 64, 2, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 51);
    c.spec.arrival_timeout_s = 1.5;
    stria_job_t *job = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.spec, &job), STRIA_OK, "%s", stria_error_msg());
    test_proc_t *p[3];
    char line[1024], failure[600];
    double t0 = stria_time_now();
    for (int r = 0; r < 3; r++) /* rank 3 never comes */
        p[r] = start_rank(&c, job, r, r == 1 ? "tcp" : "shm", "run");
    for (int r = 0; r < 3; r++) {
        rank_result(p[r], line, sizeof(line));
        cr_expect(strstr(line, "error STRIA_ERR_TIMEOUT") != NULL &&
                      strstr(line, "rank 3 did not arrive for the forward pass") != NULL,
                  "rank %d: %s", r, line);
    }
    cr_expect_lt(stria_time_now() - t0, 60.0);
    Stria__V1__JobState state;
    job_failure(stria_job_id(job), &state, failure, sizeof(failure));
    cr_expect_eq(state, STRIA__V1__JOB_STATE__JOB_STATE_FAILED);
    cr_expect(strstr(failure, "rank 3 did not arrive") != NULL &&
                  strstr(failure, "ranks 0, 1, 2 had their inputs in") != NULL,
              "%s", failure);
    stria_client_release(job);
    cr_expect(workers_idle(10), "the failed job's memory is still held");
    case_free(&c);
    stria_client_close(sub);
    stop_cluster();
}

Test(sharded, a_rank_killed_mid_upload_fails_the_job_and_frees_its_memory, .timeout = 600)
{
    static const char *const paths[2] = {"tcp", "shm"};
    start_cluster();
    stria_client_t *sub = client(STRIA_DATA_PATH_AUTO);
    for (int k = 0; k < 2; k++) {
        case_t c;
        case_init(&c, 1, 512, 4, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_ZIGZAG, 61 + k);
        cr_assert(workers_idle(10), "workers busy before the job");
        stria_job_t *job = NULL;
        cr_assert_eq(stria_client_submit(sub, &c.spec, &job), STRIA_OK, "%s", stria_error_msg());
        test_proc_t *p[N_WORKERS];
        char line[1024], failure[600], dying[64];
        for (int r = 0; r < N_WORKERS; r++)
            p[r] = start_rank(&c, job, r, paths[k], r == 2 ? (k ? "die-shm" : "die-tcp") : "run");
        for (int r = 0; r < N_WORKERS; r++) {
            rank_result(p[r], r == 2 ? dying : line, r == 2 ? sizeof(dying) : sizeof(line));
            /* a rank hears that rank 2 failed the job, or (when its worker
             * dropped the failed job before this rank's first request) that
             * the job is gone */
            if (r != 2)
                cr_expect(strstr(line, "shard_rank: error") != NULL &&
                              (strstr(line, "rank 2") != NULL ||
                               strstr(line, "is not held by this worker") != NULL),
                          "%s: rank %d: %s", paths[k], r, line);
        }
        Stria__V1__JobState state;
        job_failure(stria_job_id(job), &state, failure, sizeof(failure));
        cr_expect_eq(state, STRIA__V1__JOB_STATE__JOB_STATE_FAILED, "%s: %s", paths[k], failure);
        cr_expect(strstr(failure, k ? "closed its shared-memory connection"
                                    : "connection was lost in the middle of an upload") != NULL,
                  "%s: %s", paths[k], failure);
        cr_expect(workers_idle(10), "%s: the workers' memory did not return to its level",
                  paths[k]);
        stria_client_release(job);
        case_free(&c);
    }
    stria_client_close(sub);
    stop_cluster();
}

/* Releases a whole job (as its submitter would with ReleaseJob alone),
 * proving its secret (from the job's export). */
static void release_whole(const stria_job_t *job)
{
    uint8_t ex[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    stria_job_secret_t secret;
    cr_assert_eq(stria_job_export(job, ex, sizeof(ex), &len), STRIA_OK, "%s", stria_error_msg());
    memcpy(secret.bytes, ex + 16, sizeof(secret.bytes));
    Stria__V1__ReleaseJobRequest req = STRIA__V1__RELEASE_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep = {0};
    req.job_id = stria_job_id(job);
    stria_rpc_client_t *c = coord_rpc();
    stria_rpc_request_t rq = {.method = STRIA_RPC_COORDINATOR_RELEASE_JOB,
                              .request = &req.base,
                              .timeout_s = 10,
                              .job_secret = &secret,
                              .job_id = req.job_id};
    cr_assert_eq(stria_rpc_client_call(c, &rq, &rep), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    stria_rpc_client_close(c);
}

static Stria__V1__JobState job_state(uint64_t id)
{
    char failure[600];
    Stria__V1__JobState state;
    job_failure(id, &state, failure, sizeof(failure));
    return state;
}

/* A raw attach to a worker's socket; returns the status and closes any
 * memfd received (*got_fd says whether one came). */
static stria_status_t raw_attach(const char *sock_path, uint64_t worker_id, uint64_t job_id,
                                 uint32_t rank, const uint8_t *secret, size_t secret_len,
                                 bool *got_fd, char *msg, size_t len)
{
    int s = -1, fd = -1;
    ProtobufCMessage *m = NULL;
    cr_assert_eq(stria_shm_connect(sock_path, &s), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ATTACH;
    req.worker_id = worker_id;
    req.job_id = job_id;
    req.rank = rank;
    req.secret.data = (uint8_t *)secret;
    req.secret.len = secret_len;
    cr_assert_eq(stria_shm_send(s, &req.base, -1), STRIA_OK);
    cr_assert_eq(stria_shm_recv(s, &stria__v1__shm_reply__descriptor, 10, &m, &fd), STRIA_OK, "%s",
                 stria_error_msg());
    const Stria__V1__ShmReply *r = (const Stria__V1__ShmReply *)m;
    stria_status_t st = (stria_status_t)r->status;
    snprintf(msg, len, "%s", r->message);
    *got_fd = fd >= 0;
    if (fd >= 0)
        close(fd);
    protobuf_c_message_free_unpacked(m, NULL);
    close(s);
    return st;
}

Test(sharded, the_secret_guards_jobs_and_their_shared_memory, .timeout = 300)
{
    start_cluster();
    stria_client_t *sub = client(STRIA_DATA_PATH_AUTO);
    case_t c;
    case_init(&c, 1, 64, 2, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 71);
    stria_job_t *a = NULL, *b = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.spec, &a), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_client_submit(sub, &c.spec, &b), STRIA_OK, "%s", stria_error_msg());
    uint8_t ea[STRIA_JOB_EXPORT_BYTES], eb[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    cr_assert_eq(stria_job_export(a, ea, sizeof(ea), &len), STRIA_OK);
    cr_assert_eq(stria_job_export(b, eb, sizeof(eb), &len), STRIA_OK);
    cr_expect_neq(memcmp(ea + 16, eb + 16, 32), 0, "two jobs with one secret");
    const uint8_t *sb = eb + 16;
    uint8_t made_up[32];
    char msg[600];
    for (int i = 0; i < 32; i++)
        made_up[i] = (uint8_t)(0x11 * i);
    /* rank 0 of job a: its worker's socket, from the coordinator */
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = stria_job_id(a);
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    const Stria__V1__Assignment *as = ((Stria__V1__GetJobReply *)rep.msg)->job->assignment;
    char sock[STRIA_SHM_MAX_PATH];
    snprintf(sock, sizeof(sock), "%s", as->ranks[0]->shm_socket);
    uint64_t wid = as->ranks[0]->worker_id;
    stria_rpc_reply_free(&rep);
    cr_assert(sock[0] != '\0', "the assignment advertises no socket");
    /* another client of this host: no secret, b's secret, a made-up one */
    const uint8_t *bad[3] = {sb, sb, made_up};
    const size_t bad_len[3] = {0, 32, 32};
    for (int i = 0; i < 3; i++) {
        bool fd = true;
        stria_status_t st =
            raw_attach(sock, wid, stria_job_id(a), 0, bad[i], bad_len[i], &fd, msg, sizeof(msg));
        cr_expect_eq(st, STRIA_ERR_AUTH, "secret %d: %s (%s)", i, stria_status_name(st), msg);
        cr_expect(!fd, "secret %d: the worker passed the memory", i);
    }
    cr_expect_eq(worker_in_use(wid), 0, "a refused attach made the worker allocate the job");
    /* b's rank 0 with b's secret maps b's memory (and b fails when this
     * client goes without releasing it) */
    gq.job_id = stria_job_id(b);
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    as = ((Stria__V1__GetJobReply *)rep.msg)->job->assignment;
    bool fd = false;
    cr_expect_eq(raw_attach(as->ranks[0]->shm_socket, as->ranks[0]->worker_id, stria_job_id(b), 0,
                            sb, 32, &fd, msg, sizeof(msg)),
                 STRIA_OK, "%s", msg);
    cr_expect(fd, "attach with the secret passed no memory");
    stria_rpc_reply_free(&rep);
    /* an export whose secret was altered does not import */
    stria_client_t *other = client(STRIA_DATA_PATH_SHM);
    stria_job_t *x = NULL;
    ea[20] ^= 1;
    cr_expect_eq(stria_job_import(other, ea, sizeof(ea), &x), STRIA_ERR_AUTH, "%s",
                 stria_error_msg());
    ea[20] ^= 1;
    cr_expect_eq(stria_job_import(other, ea, 7, &x), STRIA_ERR_FORMAT);
    cr_assert_eq(stria_job_import(other, ea, sizeof(ea), &x), STRIA_OK, "%s", stria_error_msg());
    stria_shard_buffer_t buf = STRIA_SHARD_BUFFER_INIT;
    cr_expect_eq(stria_job_shard_buffer(x, 0, STRIA_TENSOR_Q, &buf), STRIA_OK, "%s",
                 stria_error_msg());
    cr_expect_eq(stria_client_backward_shard(x, 0, buf.data, buf.data, buf.data, buf.data),
                 STRIA_ERR_INVALID_ARG, "backward before forward");
    stria_client_release(x); /* the importer ran no rank: a stays */
    stria_client_close(other);
    cr_expect_eq(job_state(stria_job_id(a)), STRIA__V1__JOB_STATE__JOB_STATE_LOADING);
    release_whole(a);
    release_whole(b);
    stria_client_release(a);
    stria_client_release(b);
    cr_expect(workers_idle(10), "memory still held");
    stria_client_close(sub);
    case_free(&c);
    stop_cluster();
}

/* Attaches to rank 0 of a job with its secret (from its export) as a client
 * of this host would, and maps the memory the worker passes; *sock_out
 * stays open (closing it without a release fails the job). */
static unsigned char *map_rank0(const stria_job_t *job, int *sock_out, size_t *size_out)
{
    uint8_t ex[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    cr_assert_eq(stria_job_export(job, ex, sizeof(ex), &len), STRIA_OK, "%s", stria_error_msg());
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    gq.job_id = stria_job_id(job);
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
    const Stria__V1__RankAssignment *ra =
        ((Stria__V1__GetJobReply *)rep.msg)->job->assignment->ranks[0];
    Stria__V1__ShmRequest req = STRIA__V1__SHM_REQUEST__INIT;
    req.op = STRIA__V1__SHM_REQUEST__OP__OP_ATTACH;
    req.worker_id = ra->worker_id;
    req.job_id = gq.job_id;
    req.secret.data = ex + 16;
    req.secret.len = 32;
    int s = -1, fd = -1;
    ProtobufCMessage *m = NULL;
    cr_assert_eq(stria_shm_connect(ra->shm_socket, &s), STRIA_OK, "%s", stria_error_msg());
    stria_rpc_reply_free(&rep);
    cr_assert_eq(stria_shm_send(s, &req.base, -1), STRIA_OK);
    cr_assert_eq(stria_shm_recv(s, &stria__v1__shm_reply__descriptor, 10, &m, &fd), STRIA_OK, "%s",
                 stria_error_msg());
    const Stria__V1__ShmReply *r = (const Stria__V1__ShmReply *)m;
    cr_assert_eq(r->status, 0, "%s", r->message);
    cr_assert_geq(fd, 0, "the worker passed no memory");
    *size_out = (size_t)r->size;
    protobuf_c_message_free_unpacked(m, NULL);
    void *mem = mmap(NULL, *size_out, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(mem, MAP_FAILED);
    close(fd);
    *sock_out = s;
    return mem;
}

/* Shared memory is fresh for every job: a client that kept the mapping of
 * an ended job sees none of a later job's bytes, and a new job's memory
 * holds none of an earlier job's (its own, or one that came over TCP into
 * the workers' pools). */
Test(sharded, no_job_maps_another_jobs_bytes, .timeout = 300)
{
    start_cluster();
    stria_client_t *sub = client(STRIA_DATA_PATH_AUTO);
    case_t c;
    case_init(&c, 1, 64, 2, 2, STRIA_DTYPE_F32, false, STRIA_LAYOUT_STRIPED, 81);
    /* job A: a client of this host maps rank 0, fills it, and goes */
    stria_job_t *a = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.spec, &a), STRIA_OK, "%s", stria_error_msg());
    int sock;
    size_t size_a;
    unsigned char *ma = map_rank0(a, &sock, &size_a);
    memset(ma, 0xa5, size_a);
    close(sock); /* A fails: its client left without releasing it */
    cr_expect(workers_idle(10), "job A's memory is still held");
    stria_client_release(a);
    /* job B over TCP: its bytes go into the workers' pools */
    stria_client_t *tcp = client(STRIA_DATA_PATH_TCP);
    stria_job_t *b = NULL;
    cr_assert_eq(
        stria_client_forward(tcp, &c.spec, c.q, c.k, c.v, c.got[0], c.got[1], NULL, NULL, NULL, &b),
        STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(memcmp(c.got[0], c.ref[0], c.bytes[0]), 0, "job B's output");
    stria_client_release(b);
    stria_client_close(tcp);
    /* job C: its rank 0 memory holds zeros only */
    stria_job_t *cj = NULL;
    cr_assert_eq(stria_client_submit(sub, &c.spec, &cj), STRIA_OK, "%s", stria_error_msg());
    size_t size_c;
    unsigned char *mc = map_rank0(cj, &sock, &size_c);
    size_t nonzero = 0;
    for (size_t i = 0; i < size_c; i++)
        nonzero += mc[i] != 0;
    cr_expect_eq(nonzero, 0, "a new job's shared memory holds %zu bytes of earlier jobs", nonzero);
    /* ... and A's old mapping is A's bytes still */
    size_t changed = 0;
    for (size_t i = 0; i < size_a; i++)
        changed += ma[i] != 0xa5;
    cr_expect_eq(changed, 0, "%zu bytes of an ended job's mapping changed under a later job",
                 changed);
    munmap(ma, size_a);
    munmap(mc, size_c);
    close(sock);
    release_whole(cj);
    stria_client_release(cj);
    cr_expect(workers_idle(10), "memory still held");
    stria_client_close(sub);
    case_free(&c);
    stop_cluster();
}

/* striactl job ID, its stdout. */
static void striactl_job(uint64_t id, char *out, size_t len)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s --coordinator %s job %llu", STRIACTL_BIN, cl.coord_addr,
             (unsigned long long)id);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    size_t n = fread(out, 1, len - 1, f);
    out[n] = '\0';
    pclose(f);
}

Test(sharded, placement_by_host_and_device_index, .timeout = 300)
{
    start_cluster();
    stria_client_t *sub = client(STRIA_DATA_PATH_AUTO);
    stria_job_spec_t s = STRIA_JOB_SPEC_INIT;
    s.batch = 1;
    s.seq_len = 64;
    s.heads = s.kv_heads = 2;
    s.head_dim = 16;
    s.ring_size = 4;
    const char *hosts[4] = {"hB", "hA", "hB", "hA"};
    /* the device indexes one way, then the other: a placement blind to
     * them matches at most one of the two */
    const int orders[2][4] = {{1, 0, 0, 1}, {0, 1, 1, 0}};
    const int *devs = orders[0];
    stria_job_t *job = NULL;
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    s.placement_hosts = hosts;
    for (int o = 1; o >= 0; o--) {
        devs = orders[o];
        s.placement_devices = devs;
        cr_assert_eq(stria_client_submit(sub, &s, &job), STRIA_OK, "%s", stria_error_msg());
        gq.job_id = stria_job_id(job);
        cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK);
        const Stria__V1__Assignment *as = ((Stria__V1__GetJobReply *)rep.msg)->job->assignment;
        for (int r = 0; r < 4; r++) {
            cr_expect_str_eq(as->ranks[r]->host, hosts[r], "rank %d", r);
            cr_expect(as->ranks[r]->has_device_index &&
                          as->ranks[r]->device_index == (uint32_t)devs[r],
                      "order %d: rank %d on device %u, placed on %d", o, r,
                      as->ranks[r]->device_index, devs[r]);
            cr_expect(!as->ranks[r]->placement_fallback);
        }
        stria_rpc_reply_free(&rep);
        if (o == 1) { /* the first order's job goes; the second's is checked further */
            release_whole(job);
            stria_client_release(job);
        }
    }
    char out[8192];
    striactl_job(stria_job_id(job), out, sizeof(out));
    cr_expect(strstr(out, "PLACED ON") != NULL && strstr(out, "hB/1") != NULL &&
                  strstr(out, "hA/0") != NULL && strstr(out, "placed by the spec") != NULL,
              "striactl job does not show the placement:\n%s", out);
    release_whole(job);
    stria_client_release(job);

    /* a host without workers: refused naming the rank and the host */
    const char *nowhere[4] = {"hA", "hC", "hB", "hB"};
    s.placement_hosts = nowhere;
    s.placement_devices = NULL;
    cr_expect_eq(stria_client_submit(sub, &s, &job), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "rank 1 is placed on host 'hC'") != NULL, "%s",
              stria_error_msg());
    /* three ranks on a host of two workers */
    const char *crowded[4] = {"hA", "hA", "hA", "hB"};
    s.placement_hosts = crowded;
    cr_expect_eq(stria_client_submit(sub, &s, &job), STRIA_ERR_BUSY);
    cr_expect(strstr(stria_error_msg(), "rank 2 is placed on host 'hA', whose 2 worker(s)") != NULL,
              "%s", stria_error_msg());
    /* ... unless the spec allows a fallback: rank 1 goes elsewhere */
    s.placement_hosts = nowhere;
    s.placement_fallback = true;
    cr_assert_eq(stria_client_submit(sub, &s, &job), STRIA_OK, "%s", stria_error_msg());
    striactl_job(stria_job_id(job), out, sizeof(out));
    cr_expect(strstr(out, "hC (fallback)") != NULL, "no fallback shown:\n%s", out);
    release_whole(job);
    stria_client_release(job);
    stria_client_close(sub);
    cr_expect(workers_idle(10));
    stop_cluster();
}

Test(sharded, sharded_specs_are_checked, .timeout = 300)
{
    start_cluster();
    stria_client_t *cli = client(STRIA_DATA_PATH_AUTO);
    stria_job_spec_t s = STRIA_JOB_SPEC_INIT;
    stria_job_t *job = NULL;
    s.batch = 1;
    s.seq_len = 64;
    s.heads = s.kv_heads = 2;
    s.head_dim = 16;
    cr_expect_eq(stria_client_submit(cli, &s, &job), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "ring_size is required") != NULL, "%s", stria_error_msg());
    s.ring_size = 4;
    s.layout = STRIA_LAYOUT_AUTO;
    cr_expect_eq(stria_client_submit(cli, &s, &job), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "must name its layout") != NULL, "%s", stria_error_msg());
    /* the coordinator refuses it too (a client of another library) */
    Stria__V1__JobSpec spec = STRIA__V1__JOB_SPEC__INIT;
    Stria__V1__SubmitJobRequest req = STRIA__V1__SUBMIT_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    spec.batch = 1;
    spec.seq_len = 64;
    spec.heads = spec.kv_heads = 2;
    spec.head_dim = 16;
    spec.sharded = true;
    spec.ring_size = 4;
    spec.layout = STRIA__V1__LAYOUT__LAYOUT_AUTO;
    req.spec = &spec;
    cr_expect_eq(coord_call(STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, &rep),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "must name its layout") != NULL, "%s", stria_error_msg());
    spec.layout = STRIA__V1__LAYOUT__LAYOUT_STRIPED;
    spec.ring_size = 0;
    cr_expect_eq(coord_call(STRIA_RPC_COORDINATOR_SUBMIT_JOB, &req.base, &rep),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "needs ring_size") != NULL, "%s", stria_error_msg());
    /* more memory per rank than a worker offers: refused at submission,
     * naming the need and the offer (no rank ever uploads) */
    s.layout = STRIA_LAYOUT_STRIPED;
    s.batch = 64;
    s.seq_len = 16384;
    s.heads = s.kv_heads = 8;
    s.head_dim = 128;
    uint64_t need = 0;
    cr_assert_eq(stria_rank_memory(64, 16384 / 4, 8, 8, 128, STRIA_DTYPE_F32, &need), STRIA_OK);
    char want[96];
    snprintf(want, sizeof(want), "needs %llu MiB per rank", (unsigned long long)(need >> 20));
    cr_expect_eq(stria_client_submit(cli, &s, &job), STRIA_ERR_NO_MEMORY, "%s", stria_error_msg());
    cr_expect(strstr(stria_error_msg(), want) != NULL &&
                  strstr(stria_error_msg(), "offer 1024 MiB") != NULL,
              "the refusal names the need ('%s') and the offer: %s", want, stria_error_msg());
    s.batch = 1;
    s.seq_len = 64;
    s.heads = s.kv_heads = 2;
    s.head_dim = 16;
    /* a whole-sequence job cannot be exported nor run by shard */
    float x[64 * 2 * 16] = {0}, lse[64 * 2];
    cr_assert_eq(stria_client_forward(cli, &s, x, x, x, x, lse, NULL, NULL, NULL, &job), STRIA_OK,
                 "%s", stria_error_msg());
    uint8_t e[STRIA_JOB_EXPORT_BYTES];
    size_t len;
    cr_expect_eq(stria_job_export(job, e, sizeof(e), &len), STRIA_ERR_INVALID_ARG);
    cr_expect_eq(stria_client_forward_shard(job, 0, x, x, x, x, lse), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "not sharded") != NULL, "%s", stria_error_msg());
    stria_client_release(job);
    stria_client_close(cli);
    stop_cluster();
}

/* ---- a lost worker's rank moves to a spare ---------------------------------- */

typedef struct {
    Stria__V1__JobState state;
    char failure[600];
    uint64_t replaced_by, replaces;
    char rank_rpc[64]; /* the worker of the rank asked for */
} jinfo_t;

static jinfo_t job_info(uint64_t id, int rank)
{
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    jinfo_t out;
    memset(&out, 0, sizeof(out));
    gq.job_id = id;
    cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep), STRIA_OK, "%s",
                 stria_error_msg());
    const Stria__V1__JobInfo *j = ((Stria__V1__GetJobReply *)rep.msg)->job;
    out.state = j->state;
    out.replaced_by = j->replaced_by;
    out.replaces = j->replaces;
    snprintf(out.failure, sizeof(out.failure), "%s", j->failure);
    snprintf(out.rank_rpc, sizeof(out.rank_rpc), "%s", j->assignment->ranks[rank]->rpc_address);
    stria_rpc_reply_free(&rep);
    return out;
}

/* The cluster's index of the worker at an RPC address. */
static int worker_index(const char *rpc)
{
    for (int i = 0; i < cl.n; i++)
        if (strcmp(cl.rpc[i], rpc) == 0)
            return i;
    cr_assert_fail("no worker of the cluster at %s", rpc);
    return -1;
}

/* The cluster's worker that job x has no rank on. */
static int spare_of(uint64_t x)
{
    bool used[MAX_WORKERS] = {false};
    for (int r = 0; r < N_WORKERS; r++)
        used[worker_index(job_info(x, r).rank_rpc)] = true;
    for (int i = 0; i < cl.n; i++)
        if (!used[i])
            return i;
    cr_assert_fail("job %llu uses every worker", (unsigned long long)x);
    return -1;
}

/* A case of a cluster with a spare worker: the job (x) of case c submitted
 * on it, the indexes of the worker to lose and of the spare, the ranks'
 * processes. */
typedef struct {
    case_t c;
    stria_client_t *sub;
    stria_job_t *job;
    uint64_t x;
    int lost, spare;
    test_proc_t *p[N_WORKERS];
} spare_case_t;

/* Starts k's cluster and submits k->c's job; the worker to lose is rank
 * `lost_rank`'s. With `mode`, every rank's process starts in it, rank r
 * over paths[r]. */
static void spare_case_start(spare_case_t *k, int lost_rank, const char *const *paths,
                             const char *mode)
{
    k->job = NULL;
    start_cluster_n(MAX_WORKERS);
    k->sub = client(STRIA_DATA_PATH_AUTO);
    cr_assert_eq(stria_client_submit(k->sub, &k->c.spec, &k->job), STRIA_OK, "%s",
                 stria_error_msg());
    k->x = stria_job_id(k->job);
    k->lost = worker_index(job_info(k->x, lost_rank).rank_rpc);
    k->spare = spare_of(k->x);
    for (int r = 0; mode != NULL && r < N_WORKERS; r++)
        k->p[r] = start_rank(&k->c, k->job, r, paths[r], mode);
}

static void spare_case_end(spare_case_t *k)
{
    stria_client_release(k->job);
    case_free(&k->c);
    stria_client_close(k->sub);
    stop_cluster();
}

static void kill_worker(int i)
{
    test_proc_stop(cl.workers[i], SIGKILL, 10);
    cl.workers[i] = NULL;
    cl.alive--;
}

/* Kills worker `lost` and waits (30 s at most) for job x's replacement. */
static uint64_t kill_and_replace(uint64_t x, int lost)
{
    uint64_t y = 0;
    kill_worker(lost);
    for (int i = 0; i < 300 && (y = job_info(x, 0).replaced_by) == 0; i++)
        usleep(100000);
    cr_assert_neq(y, 0, "job %llu was not replaced", (unsigned long long)x);
    return y;
}

/* Creates the file NAME in the cluster's folder (what shard_rank waits for). */
static void touch(const char *name)
{
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "touch %s/%s", cl.dir, name);
    cr_assert_eq(system(cmd), 0);
}

/* Waits for every rank's "rank R: ..." line, which must say `what`. */
static void ranks_say(test_proc_t **p, const char *what)
{
    char line[256];
    for (int r = 0; r < N_WORKERS; r++)
        cr_assert(test_proc_wait_line(p[r], "rank ", HELPER_S, line, sizeof(line)) &&
                      strstr(line, what) != NULL,
                  "rank %d: %s (waiting for \"%s\")", r, line, what);
}

/* Once every rank's first forward is done (a -pause mode), kills the worker
 * to lose, waits for the replacement (returned) and lets the ranks go on. */
static uint64_t lose_between_passes(spare_case_t *k)
{
    ranks_say(k->p, "forward done");
    uint64_t y = kill_and_replace(k->x, k->lost);
    touch("go");
    return y;
}

/* Every rank succeeded, the gathered outputs are the in-process ring's bit
 * for bit, and job x was replaced by a job of the same ranks but `lost_rank`
 * on the spare, which its ranks released (`rebuilt`: x's record was rebuilt
 * from the replacement's after a coordinator restart). */
static void expect_replaced(spare_case_t *k, int lost_rank, bool rebuilt)
{
    case_t *c = &k->c;
    test_proc_t **p = k->p;
    char line[1024];
    for (int r = 0; r < N_WORKERS; r++) {
        rank_result(p[r], line, sizeof(line));
        cr_expect(strncmp(line, "shard_rank: ok", 14) == 0, "rank %d: %s", r, line);
    }
    memset(c->got[0], 0xff, c->bytes[0]);
    case_gather(c, k->job);
    static const char *const names[5] = {"O", "LSE", "dQ", "dK", "dV"};
    for (int i = 0; i < 5; i++)
        cr_expect_eq(memcmp(c->got[i], c->ref[i], c->bytes[i]), 0,
                     "%s of the replaced job differs from the in-process ring", names[i]);
    jinfo_t x = job_info(k->x, lost_rank);
    cr_expect_eq(x.state, STRIA__V1__JOB_STATE__JOB_STATE_FAILED);
    cr_assert_neq(x.replaced_by, 0, "not replaced: %s", x.failure);
    char want[128];
    if (rebuilt)
        snprintf(want, sizeof(want),
                 "replaced by job %llu (this record was rebuilt from the replacement's",
                 (unsigned long long)x.replaced_by);
    else
        snprintf(want, sizeof(want), "replaced by job %llu: rank %d on worker",
                 (unsigned long long)x.replaced_by, lost_rank);
    cr_expect(strstr(x.failure, want) != NULL, "%s", x.failure);
    jinfo_t y = job_info(x.replaced_by, lost_rank);
    cr_expect_eq(y.state, STRIA__V1__JOB_STATE__JOB_STATE_RELEASED, "every rank released it");
    cr_expect_eq(y.replaces, k->x);
    cr_expect_str_eq(y.rank_rpc, cl.rpc[k->spare], "the spare takes the lost worker's rank");
    cr_expect(workers_idle(10), "memory still held after the replaced job ended");
}

/* A worker dies while ranks 0, 1 and 3 wait for rank 2 (inputs in, one in
 * place in shared memory): the coordinator's verdict replaces the job, the
 * waiting ranks follow and send their stripes again, and rank 2, coming
 * late, imports the old job's export and lands on the replacement. */
Test(sharded, a_lost_workers_rank_moves_to_a_spare_and_every_rank_follows, .timeout = 900)
{
    static const char *const paths[N_WORKERS] = {"tcp", "shm", "auto", "shm"};
    spare_case_t k;
    case_init(&k.c, 1, 203, 4, 2, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 71);
    spare_case_start(&k, 2, paths, NULL);
    for (int r = 0; r < N_WORKERS; r++)
        if (r != 2)
            k.p[r] = start_rank(&k.c, k.job, r, paths[r], r == 3 ? "inplace" : "run");
    /* their workers hold the job (their ranks arrived, or soon will) */
    for (int r = 0; r < N_WORKERS; r++) {
        if (r == 2)
            continue;
        jinfo_t ji = job_info(k.x, r);
        uint64_t used = 0;
        for (int i = 0; i < 40 && used == 0; i++) {
            Stria__V1__ListWorkersRequest req = STRIA__V1__LIST_WORKERS_REQUEST__INIT;
            stria_rpc_reply_t rep;
            cr_assert_eq(coord_call(STRIA_RPC_COORDINATOR_LIST_WORKERS, &req.base, &rep), STRIA_OK);
            const Stria__V1__ListWorkersReply *lw = (const Stria__V1__ListWorkersReply *)rep.msg;
            for (size_t i = 0; i < lw->n_workers; i++)
                if (strcmp(lw->workers[i]->rpc_address, ji.rank_rpc) == 0)
                    used = lw->workers[i]->memory_in_use_bytes;
            stria_rpc_reply_free(&rep);
            if (used == 0)
                usleep(250000);
        }
        cr_expect_gt(used, 0, "rank %d's worker never held the job", r);
    }
    kill_and_replace(k.x, k.lost);
    k.p[2] = start_rank(&k.c, k.job, 2, paths[2], "run");
    expect_replaced(&k, 2, false);
    spare_case_end(&k);
}

/* A worker is killed mid-pass: its ring peers fail the pass at once, the
 * job waits for the verdict on the worker and is replaced; every rank's
 * forward sends its stripe again inside the call (had the kill come after
 * the forward, the backward fails retryably and the rank, as a trainer
 * would, runs both again). */
Test(sharded, a_worker_killed_mid_pass_is_replaced_inside_the_call, .timeout = 900)
{
    static const char *const paths[N_WORKERS] = {"shm", "tcp", "shm", "tcp"};
    spare_case_t k;
    case_init(&k.c, 1, 4096, 2, 1, STRIA_DTYPE_F32, true, STRIA_LAYOUT_ZIGZAG, 81);
    spare_case_start(&k, 1, paths, "run-again");
    Stria__V1__JobState s = STRIA__V1__JOB_STATE__JOB_STATE_LOADING;
    for (int i = 0; i < 60000 && s < STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD; i++) {
        s = job_info(k.x, 1).state;
        usleep(2000);
    }
    cr_assert(s >= STRIA__V1__JOB_STATE__JOB_STATE_RUNNING_FORWARD &&
                  s < STRIA__V1__JOB_STATE__JOB_STATE_DONE,
              "the job never ran (state %d)", (int)s);
    kill_worker(k.lost);
    double killed = stria_time_now();
    expect_replaced(&k, 1, false);
    double took = stria_time_now() - killed;
    fprintf(stderr, "test_sharded: killed in state %d; every rank done %.2f s after the kill\n",
            (int)s, took);
    /* about 3 s here (the verdict takes 1.5 s); far more means a rank sat
     * out one of the library's waits (30 s and more) instead of following */
    cr_expect_lt(took, 20.0, "the ranks took %.1f s to follow the replacement", took);
    spare_case_end(&k);
}

/* A worker dies between the forward and the backward: every rank's backward
 * fails, retryable, its handle on the replacement, and the rank runs
 * forward and backward again there (as a trainer would); the ranks'
 * releases reach the replacement, whose memory goes back. */
Test(sharded, a_worker_lost_before_the_backward_moves_the_handles, .timeout = 900)
{
    static const char *const paths[N_WORKERS] = {"tcp", "shm", "shm", "tcp"};
    spare_case_t k;
    case_init(&k.c, 2, 130, 2, 2, STRIA_DTYPE_BF16, true, STRIA_LAYOUT_STRIPED, 91);
    spare_case_start(&k, 3, paths, "run-again-pause");
    lose_between_passes(&k);
    expect_replaced(&k, 3, false);
    spare_case_end(&k);
}

/* A rank that filled its inputs in place, in its worker's shared memory,
 * loses that worker to a spare that offers no shared memory (on another
 * host, as far as the rank can tell): its buffers cannot follow, and its
 * retry says so instead of sending the old job's memory. */
Test(sharded, in_place_buffers_do_not_follow_to_a_spare_without_shared_memory, .timeout = 900)
{
    static const char *const paths[N_WORKERS] = {"auto", "tcp", "tcp", "tcp"};
    spare_case_t k;
    char line[1024];
    case_init(&k.c, 1, 128, 2, 1, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 99);
    k.c.spec.arrival_timeout_s = 3; /* the other ranks give up on rank 0 soon */
    start_cluster_n(N_WORKERS);
    k.sub = client(STRIA_DATA_PATH_AUTO);
    cr_assert_eq(stria_client_submit(k.sub, &k.c.spec, &k.job), STRIA_OK, "%s", stria_error_msg());
    k.x = stria_job_id(k.job);
    k.lost = worker_index(job_info(k.x, 0).rank_rpc);
    start_worker(MAX_WORKERS - 1, false); /* the spare: TCP only */
    wait_healthy();
    for (int r = 0; r < N_WORKERS; r++)
        k.p[r] =
            start_rank(&k.c, k.job, r, paths[r], r ? "run-again-pause" : "inplace-again-pause");
    lose_between_passes(&k);
    rank_result(k.p[0], line, sizeof(line));
    cr_expect(strstr(line, "shard_rank: error STRIA_ERR_UNSUPPORTED") != NULL &&
                  strstr(line, "shared memory of the job this one replaced") != NULL &&
                  strstr(line, "pass buffers of your own") != NULL,
              "rank 0: %s", line);
    for (int r = 1; r < N_WORKERS; r++)
        rank_result(k.p[r], line, sizeof(line)); /* they end without rank 0 */
    spare_case_end(&k);
}

/* Kills the coordinator and starts another on its address; it rebuilds its
 * jobs from the workers' reports (a recovery window of 10 s). */
static void restart_coordinator(void)
{
    char log[256], line[256];
    test_proc_stop(cl.coord, SIGKILL, 10);
    snprintf(log, sizeof(log), "%s/coordinator-restarted.log", cl.dir);
    char *cargv[] = {STRIA_COORDINATOR_BIN, "--listen", cl.coord_addr, "--heartbeat-period", "0.5",
                     "--recovery-window",   "10",       NULL};
    cl.coord = test_proc_start(cargv, log, env);
    cr_assert(
        test_proc_wait_line(cl.coord, "stria-coordinator listening on ", 10, line, sizeof(line)),
        "the coordinator did not start again (see %s)", log);
    wait_healthy();
}

/* The coordinator restarts while the ranks hold a replacement: the rebuilt
 * replacement links the replaced job again (its record went with the
 * restart), so a rank process that starts over from the old job's export
 * lands on the replacement, and the ranks' releases end it. */
Test(sharded, a_replacement_keeps_its_link_across_a_coordinator_restart, .timeout = 900)
{
    static const char *const paths[N_WORKERS] = {"shm", "tcp", "tcp", "shm"};
    spare_case_t k;
    case_init(&k.c, 1, 150, 2, 1, STRIA_DTYPE_F32, true, STRIA_LAYOUT_STRIPED, 97);
    spare_case_start(&k, 0, paths, "run-again-pause-hold");
    uint64_t x = k.x, y = lose_between_passes(&k);
    ranks_say(k.p, "holding the job"); /* they ran again on the replacement */

    restart_coordinator();
    /* the replacement is back once its four workers described it */
    Stria__V1__GetJobRequest gq = STRIA__V1__GET_JOB_REQUEST__INIT;
    stria_rpc_reply_t rep;
    stria_status_t st = STRIA_ERR_NOT_FOUND;
    gq.job_id = y;
    for (int i = 0; i < 200 && st != STRIA_OK; i++) {
        if ((st = coord_call(STRIA_RPC_COORDINATOR_GET_JOB, &gq.base, &rep)) == STRIA_OK)
            stria_rpc_reply_free(&rep);
        else
            usleep(100000);
    }
    cr_assert_eq(st, STRIA_OK, "job %llu was not rebuilt: %s", (unsigned long long)y,
                 stria_error_msg());
    jinfo_t xi = job_info(x, 0);
    cr_expect_eq(xi.state, STRIA__V1__JOB_STATE__JOB_STATE_FAILED);
    cr_expect_eq(xi.replaced_by, y, "the rebuilt job %llu names no replacement: %s",
                 (unsigned long long)x, xi.failure);
    cr_expect_eq(job_info(y, 0).replaces, x);

    /* a rank starting over from the old export follows the link */
    uint8_t exp[STRIA_JOB_EXPORT_BYTES];
    size_t len = 0;
    stria_job_t *again = NULL;
    cr_assert_eq(stria_job_export(k.job, exp, sizeof(exp), &len), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_job_import(k.sub, exp, len, &again), STRIA_OK, "%s", stria_error_msg());
    cr_expect_eq(stria_job_id(again), y, "the old job's export imported job %llu",
                 (unsigned long long)stria_job_id(again));
    stria_client_release(again);

    touch("release");
    expect_replaced(&k, 0, true);
    spare_case_end(&k);
}
