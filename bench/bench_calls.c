/*
 * stria-bench calls: what one attention call costs through the service, by
 * path, beside the in-process ring in the same run.
 *
 * A coordinator and max(--ranks) workers (one kernel thread each) start on
 * loopback. For each shape, ring size and pass the same causal striped call
 * runs, alternately (a b c a b c ...), through
 *   (a) the job path: stria_client_forward() and release; for fwdbwd in the
 *       default (recompute) mode as a trainer's autograd uses it, forward and
 *       release, then forward, backward and release (the backward's job
 *       recomputes the forward: two forward passes on the workers); with
 *       --job-mode held, forward, backward and release of one job;
 *   (b) a session opened once for the shape's bounds: stria_session_forward(),
 *       for fwdbwd followed by stria_session_backward() with the forward's O
 *       and LSE (one forward pass);
 *   (c) the in-process ring (stria_ring_run_local(), one thread per rank, one
 *       kernel thread each);
 * after warm-up rounds, and reports the median wall time per call (a call:
 * the forward, or the forward and the backward), its overhead over the
 * in-process ring, the workers' minor page faults per call, and whether the
 * outputs equal the in-process ring's bit for bit; and, per shape and ring,
 * the median time to open a session (session_open_ms: admission, every
 * rank's buffers and ring link; each open closed before the next).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bench_daemons.h"
#include "bench_util.h"
#include "stria_client.h"
#include "stria_common.h"
#include "stria_kernels.h"
#include "stria_ring.h"

#define CALLS_MAX_SHAPES 16
#define CALLS_ARMS       3

static const char calls_description[] =
    "Starts a coordinator and max(--ranks) workers on loopback (one kernel thread\n"
    "each) and measures, for every shape (BATCHxSEQxHEADSxHEAD_DIM), ring size and\n"
    "pass (fwd: forward; fwdbwd: forward then backward), the wall time of one call\n"
    "(a) through the job path (stria_client_forward and release; fwdbwd in the\n"
    "default recompute mode: forward and release, then forward, backward and\n"
    "release; --job-mode held: forward, backward and release of one job), (b)\n"
    "through a session opened once (stria_session_forward, then\n"
    "stria_session_backward) and (c) through the in-process ring\n"
    "(stria_ring_run_local, one thread per rank), alternately after warm-up rounds;\n"
    "prints the medians, the overhead over the in-process ring, the workers' minor\n"
    "page faults per call and whether the outputs equal the in-process ring's, and\n"
    "the median time to open a session of each shape and ring (path session_open:\n"
    "admission, buffers and ring links; at least 11 opens), one JSON object per\n"
    "line with --json. Causal, striped; the daemons are found\n"
    "beside this program.";

typedef enum { CALLS_JOB = 0, CALLS_SESSION = 1, CALLS_INPROCESS = 2 } calls_arm_t;
static const char *const calls_arm_names[CALLS_ARMS] = {"job", "session", "inprocess"};

typedef struct {
    int64_t batch, seq, heads, head_dim;
    char name[64];
} calls_shape_t;

typedef struct {
    calls_shape_t shapes[CALLS_MAX_SHAPES];
    int n_shapes;
    stria_int_list_t ranks;
    stria_str_list_t passes, shape_text;
    int64_t reps, warmup;
    stria_dtype_t dtype;
    bool held; /* --job-mode held */
    bool json;
    bool sharded; /* --sharded: also a sharded session from one client process per rank */
    const char *job_mode;
    char coord[512];
} calls_cfg_t;

/* One shape's tensors: the inputs, and each arm's outputs. */
typedef struct {
    stria_bench_job_t t; /* inputs; the in-process ring's outputs */
    void *o[2], *dq[2], *dk[2], *dv[2];
    float *lse[2];
    size_t nq, nk, nl;
} calls_tensors_t;

static stria_status_t calls_parse_dtype(const char *text, void *dst)
{
    return stria_dtype_parse(text, dst);
}

static int calls_parse(int argc, char **argv, calls_cfg_t *c, stria_cli_t *cli)
{
    c->job_mode = "recompute";
    const stria_option_t opts[] = {
        STRIA_OPTION("shapes", STRINGS, &c->shape_text, "BxSxHxD,...",
                     "call shapes: batch x tokens x heads x head_dim",
                     .max_items = CALLS_MAX_SHAPES, .dflt = "1x256x4x64,1x2048x8x64,1x8192x8x128"),
        STRIA_OPTION("ranks", INTS, &c->ranks, "N,...", "ring sizes (workers: the largest)",
                     .dflt = "1,4", .min = 1, .max = STRIA_BENCH_MAX_WORKERS),
        STRIA_OPTION("passes", STRINGS, &c->passes, "fwd|fwdbwd,...", "passes of a call",
                     .dflt = "fwd,fwdbwd"),
        STRIA_OPTION("reps", INT, &c->reps, "R",
                     "measured calls of each arm (0: by shape, 41 below 2^18 token-dims, 7 below "
                     "2^22, else 2)",
                     .dflt = "0", .min = 0, .max = 100000),
        STRIA_OPTION("warmup", INT, &c->warmup, "W",
                     "warm-up calls of each arm first (-1: by shape, 3, 2 or 1)", .dflt = "-1",
                     .min = -1, .max = 1000),
        STRIA_OPTION("dtype", CUSTOM, &c->dtype, "fp32|bf16|fp16", "storage dtype", .dflt = "bf16",
                     .parse = calls_parse_dtype),
        STRIA_OPTION("job-mode", STRING, &c->job_mode, "recompute|held",
                     "the job path's fwdbwd: its backward on a new job that recomputes the "
                     "forward (the default of stria's Python package), or on the forward's job"),
        STRIA_OPTION("sharded", FLAG, &c->sharded, NULL,
                     "for rings of 2 or more, also a sharded session called by one client "
                     "process per rank, each with its own tokens (in its arena when the "
                     "workers offer one), against the same in-process ring"),
        STRIA_OPTION("json", FLAG, &c->json, NULL, "one JSON object per line"),
        {.name = NULL},
    };
    const stria_command_t cmd = {
        .name = "calls", .description = calls_description, .options = opts};
    int prc = stria_bench_parse(&cmd, argc, argv, cli);
    if (prc >= 0)
        return prc;
    if (strcmp(c->job_mode, "held") != 0 && strcmp(c->job_mode, "recompute") != 0)
        return stria_bench_usage_error("calls", "--job-mode %s: recompute or held", c->job_mode);
    c->held = strcmp(c->job_mode, "held") == 0;
    for (size_t i = 0; i < c->passes.n; i++)
        if (strcmp(c->passes.v[i], "fwd") != 0 && strcmp(c->passes.v[i], "fwdbwd") != 0)
            return stria_bench_usage_error("calls", "--passes: '%s' is neither fwd nor fwdbwd",
                                           c->passes.v[i]);
    c->n_shapes = (int)c->shape_text.n;
    for (int i = 0; i < c->n_shapes; i++) {
        calls_shape_t *s = &c->shapes[i];
        long long b, n, h, d;
        char end;
        if (sscanf(c->shape_text.v[i], "%lldx%lldx%lldx%lld%c", &b, &n, &h, &d, &end) != 4 ||
            b < 1 || n < 1 || h < 1 || d < STRIA_HEAD_DIM_MIN || d > STRIA_HEAD_DIM_MAX ||
            d % 8 != 0)
            return stria_bench_usage_error(
                "calls",
                "--shapes: '%s' is not BATCHxSEQxHEADSxHEAD_DIM (head_dim %d..%d, a "
                "multiple of 8)",
                c->shape_text.v[i], STRIA_HEAD_DIM_MIN, STRIA_HEAD_DIM_MAX);
        *s = (calls_shape_t){.batch = b, .seq = n, .heads = h, .head_dim = d};
        snprintf(s->name, sizeof(s->name), "%lldx%lldx%lldx%lld", b, n, h, d);
    }
    return -1;
}

/* Measured and warm-up calls of each arm for shape s. */
static void calls_reps(const calls_cfg_t *c, const calls_shape_t *s, int *reps, int *warmup)
{
    double size = (double)s->batch * (double)s->seq * (double)s->heads * (double)s->head_dim;
    int by_size = size < (double)(1 << 18) ? 0 : size < (double)(1 << 22) ? 1 : 2;
    static const int dflt_reps[3] = {41, 7, 2}, dflt_warm[3] = {3, 2, 1};
    *reps = c->reps > 0 ? (int)c->reps : dflt_reps[by_size];
    *warmup = c->warmup >= 0 ? (int)c->warmup : dflt_warm[by_size];
}

static int calls_tensors_alloc(calls_tensors_t *x, const calls_cfg_t *c, const calls_shape_t *s)
{
    memset(x, 0, sizeof(*x));
    x->t = (stria_bench_job_t){.batch = s->batch,
                               .seq = s->seq,
                               .heads = s->heads,
                               .kv_heads = s->heads,
                               .head_dim = s->head_dim,
                               .dtype = c->dtype};
    if (stria_bench_job_alloc(&x->t, true) != 0)
        return 1;
    size_t es = stria_dtype_size(c->dtype);
    x->nq = (size_t)(s->batch * s->seq * s->heads * s->head_dim);
    x->nk = x->nq;
    x->nl = (size_t)(s->batch * s->heads * s->seq);
    for (int a = 0; a < 2; a++) {
        /* zeroed: their pages faulted in here, not in a measured call */
        x->o[a] = stria_malloc_aligned(x->nq * es);
        x->dq[a] = stria_malloc_aligned(x->nq * es);
        x->dk[a] = stria_malloc_aligned(x->nk * es);
        x->dv[a] = stria_malloc_aligned(x->nk * es);
        x->lse[a] = stria_malloc_aligned(x->nl * sizeof(float));
        if (!x->o[a] || !x->dq[a] || !x->dk[a] || !x->dv[a] || !x->lse[a]) {
            fprintf(stderr, "stria-bench calls: out of memory for the %s tensors\n", s->name);
            return 1;
        }
        memset(x->o[a], 0, x->nq * es);
        memset(x->dq[a], 0, x->nq * es);
        memset(x->dk[a], 0, x->nk * es);
        memset(x->dv[a], 0, x->nk * es);
        memset(x->lse[a], 0, x->nl * sizeof(float));
    }
    return 0;
}

static void calls_tensors_free(calls_tensors_t *x)
{
    stria_bench_job_free(&x->t);
    for (int a = 0; a < 2; a++) {
        stria_free(x->o[a]), stria_free(x->dq[a]), stria_free(x->dk[a]), stria_free(x->dv[a]);
        stria_free(x->lse[a]);
    }
}

/* Whether arm a's outputs equal the in-process ring's (the last calls of both). */
static bool calls_equal(const calls_tensors_t *x, int a, bool backward, stria_dtype_t dtype)
{
    size_t es = stria_dtype_size(dtype);
    bool eq = memcmp(x->o[a], x->t.o, x->nq * es) == 0 &&
              memcmp(x->lse[a], x->t.lse, x->nl * sizeof(float)) == 0;
    if (backward)
        eq = eq && memcmp(x->dq[a], x->t.dq, x->nq * es) == 0 &&
             memcmp(x->dk[a], x->t.dk, x->nk * es) == 0 &&
             memcmp(x->dv[a], x->t.dv, x->nk * es) == 0;
    return eq;
}

/* The workers' minor page faults so far, summed; -1 when one is unknown. */
static long long calls_minflt(int workers)
{
    long long sum = 0;
    for (int i = 0; i < workers; i++) {
        long long v = stria_bench_worker_minflt(i);
        if (v < 0)
            return -1;
        sum += v;
    }
    return sum;
}

static double calls_loadavg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f != NULL) {
        if (fscanf(f, "%lf", &l) != 1)
            l = -1;
        fclose(f);
    }
    return l;
}

/* What one arm of a (shape, ring, pass) row needs. */
typedef struct {
    const calls_cfg_t *cfg;
    const calls_shape_t *shape;
    calls_tensors_t *x;
    stria_client_t *client;
    stria_session_t *session;
    stria_job_spec_t spec;
    stria_call_t call;
    int ranks, workers;
    bool backward;
} calls_row_t;

/* The job path: one call. */
static stria_status_t calls_job(calls_row_t *r)
{
    calls_tensors_t *x = r->x;
    const stria_bench_job_t *t = &x->t;
    stria_job_t *job = NULL;
    stria_status_t st = stria_client_forward(r->client, &r->spec, t->q, t->k, t->v, x->o[0],
                                             x->lse[0], NULL, NULL, NULL, &job);
    if (st == STRIA_OK && r->backward && !r->cfg->held) {
        /* the trainer's backward: a new job recomputes the forward */
        stria_client_release(job);
        job = NULL;
        st = stria_client_forward(r->client, &r->spec, t->q, t->k, t->v, x->o[0], x->lse[0], NULL,
                                  NULL, NULL, &job);
    }
    if (st == STRIA_OK && r->backward)
        st = stria_client_backward(job, t->g, x->dq[0], x->dk[0], x->dv[0], NULL, NULL, NULL);
    stria_status_t rst = stria_client_release(job);
    return st != STRIA_OK ? st : job != NULL ? rst : STRIA_OK;
}

static stria_status_t calls_session(calls_row_t *r)
{
    calls_tensors_t *x = r->x;
    const stria_bench_job_t *t = &x->t;
    stria_status_t st =
        stria_session_forward(r->session, &r->call, t->q, t->k, t->v, x->o[1], x->lse[1]);
    if (st == STRIA_OK && r->backward)
        st = stria_session_backward(r->session, &r->call, t->q, t->k, t->v, x->o[1], x->lse[1],
                                    t->g, x->dq[1], x->dk[1], x->dv[1]);
    return st;
}

static stria_status_t calls_inprocess(calls_row_t *r)
{
    stria_bench_job_t *t = &r->x->t;
    stria_ring_shape_t shape = {.call = {.batch = t->batch, .seq_len = t->seq, .causal = true},
                                .heads = t->heads,
                                .kv_heads = t->kv_heads,
                                .head_dim = t->head_dim,
                                .dtype = t->dtype};
    const stria_ring_local_opts_t ro = {.layout = STRIA_LAYOUT_STRIPED,
                                        .n_ranks = r->ranks,
                                        .passes = r->backward ? STRIA_RING_PASS_FWD_BWD
                                                              : STRIA_RING_PASS_FWD,
                                        .threads_per_rank = 1};
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
    return stria_ring_run_local(&shape, &ro, &io, NULL);
}

/* The results of a row, by arm. */
typedef struct {
    double ms[CALLS_ARMS];
    double minflt_per_call[CALLS_ARMS]; /* < 0: not measured */
    bool equal[CALLS_ARMS];
    double loadavg;
    int reps;
} calls_result_t;

static void calls_print(const calls_row_t *r, const calls_result_t *res)
{
    const calls_cfg_t *c = r->cfg;
    const char *pass = r->backward ? "fwdbwd" : "fwd";
    for (int a = 0; a < CALLS_ARMS; a++) {
        int fwd_passes = a == CALLS_JOB && r->backward && !c->held ? 2 : 1;
        double over = res->ms[a] - res->ms[CALLS_INPROCESS];
        if (c->json) {
            printf("{\"name\":\"calls\",\"path\":\"%s\",\"shape\":\"%s\",\"ranks\":%d,"
                   "\"pass\":\"%s\",\"mode\":\"whole\",\"dtype\":\"%s\",\"call_ms\":%.4f,"
                   "\"inprocess_ms\":%.4f,\"overhead_ms\":%.4f,",
                   calls_arm_names[a], r->shape->name, r->ranks, pass, stria_dtype_name(c->dtype),
                   res->ms[a], res->ms[CALLS_INPROCESS], over);
            if (res->minflt_per_call[a] >= 0)
                printf("\"worker_minflt_per_call\":%.1f,", res->minflt_per_call[a]);
            else
                printf("\"worker_minflt_per_call\":null,");
            printf("\"worker_forward_passes\":%d,\"job_mode\":\"%s\",\"equal_inprocess\":%s,"
                   "\"reps\":%d,\"loadavg\":%.2f}\n",
                   fwd_passes, c->job_mode, res->equal[a] ? "true" : "false", res->reps,
                   res->loadavg);
        } else {
            char flt[32] = "-";
            if (res->minflt_per_call[a] >= 0)
                snprintf(flt, sizeof(flt), "%.1f", res->minflt_per_call[a]);
            printf("%-10s %-14s %5d %-7s %10.3f %10.3f %10.3f %11s %6d %5s %5.2f\n",
                   calls_arm_names[a], r->shape->name, r->ranks, pass, res->ms[a],
                   res->ms[CALLS_INPROCESS], over, flt, fwd_passes, res->equal[a] ? "yes" : "NO",
                   res->loadavg);
        }
    }
    fflush(stdout);
}

/* Warm-up rounds, then reps rounds of the three arms, interleaved. */
static int calls_measure(calls_row_t *r, int reps, int warmup, calls_result_t *res)
{
    stria_status_t (*const arm[CALLS_ARMS])(calls_row_t *) = {calls_job, calls_session,
                                                              calls_inprocess};
    double *ms[CALLS_ARMS];
    double flt[CALLS_ARMS] = {0, 0, 0};
    for (int a = 0; a < CALLS_ARMS; a++)
        ms[a] = calloc((size_t)reps, sizeof(double));
    int rc = 0;
    for (int i = -warmup; i < reps && rc == 0; i++)
        for (int a = 0; a < CALLS_ARMS && rc == 0; a++) {
            long long f0 = a != CALLS_INPROCESS ? calls_minflt(r->workers) : -1;
            double t0 = stria_time_now();
            stria_status_t st = arm[a](r);
            double took = stria_time_now() - t0;
            long long f1 = a != CALLS_INPROCESS ? calls_minflt(r->workers) : -1;
            if (st != STRIA_OK) {
                fprintf(stderr, "stria-bench calls: %s, %s, %d ranks, %s: %s: %s\n",
                        calls_arm_names[a], r->shape->name, r->ranks,
                        r->backward ? "fwdbwd" : "fwd", stria_status_name(st), stria_error_msg());
                rc = 1;
                break;
            }
            if (i < 0)
                continue;
            ms[a][i] = took * 1e3;
            flt[a] = f0 >= 0 && f1 >= 0 && flt[a] >= 0 ? flt[a] + (double)(f1 - f0) : -1;
        }
    if (rc == 0) {
        res->reps = reps;
        res->loadavg = calls_loadavg();
        for (int a = 0; a < CALLS_ARMS; a++) {
            res->ms[a] = stria_bench_median(ms[a], reps);
            res->minflt_per_call[a] = a != CALLS_INPROCESS && flt[a] >= 0 ? flt[a] / reps : -1;
            res->equal[a] =
                a == CALLS_INPROCESS || calls_equal(r->x, a, r->backward, r->cfg->dtype);
        }
    }
    for (int a = 0; a < CALLS_ARMS; a++)
        free(ms[a]);
    return rc;
}

/* ---- a sharded session: one client process per rank ------------------------- */

/* Rank `rank`'s part, in a child process: its own client, the session
 * imported, its tokens built in the arena when it has one (else in buffers
 * of its own), warm-up and measured calls; rank 0 writes the medians (ms,
 * forward then forward+backward) to `out`. */
static int calls_rank_main(const calls_cfg_t *c, const calls_shape_t *s, const calls_tensors_t *x,
                           const uint8_t *ex, int rank, int reps, int warmup, int out)
{
    stria_client_t *cl = NULL;
    stria_session_t *ss = NULL;
    if (stria_bench_client(c->coord, "stria-bench calls rank", STRIA_DATA_PATH_AUTO, &cl) !=
            STRIA_OK ||
        stria_session_import(cl, ex, STRIA_SESSION_EXPORT_BYTES, &ss) != STRIA_OK) {
        fprintf(stderr, "stria-bench calls: rank %d: %s\n", rank, stria_error_msg());
        return 1;
    }
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = s->batch, call.seq_len = s->seq, call.causal = true;
    int64_t n = stria_session_shard_tokens(ss, s->seq, rank);
    int64_t *pos = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    stria_session_positions(ss, s->seq, rank, pos);
    size_t row = (size_t)(s->heads * s->head_dim) * stria_dtype_size(c->dtype);
    void *t[10] = {0}; /* by stria_tensor_id_t: in the arena, or our own */
    for (int id = STRIA_TENSOR_Q; id <= STRIA_TENSOR_DV; id++) {
        stria_shard_buffer_t b = STRIA_SHARD_BUFFER_INIT;
        size_t bytes =
            (size_t)(s->batch * n) * (id == STRIA_TENSOR_LSE ? 4 * (size_t)s->heads : row);
        t[id] = stria_session_buffer(ss, &call, rank, (stria_tensor_id_t)id, &b) == STRIA_OK
                    ? b.data
                    : calloc(1, bytes ? bytes : 1);
    }
    const void *full[5] = {NULL, x->t.q, x->t.k, x->t.v, x->t.g};
    for (int id = STRIA_TENSOR_Q; id <= STRIA_TENSOR_DO; id++)
        for (int64_t b = 0; b < s->batch; b++)
            for (int64_t i = 0; i < n; i++)
                memcpy((char *)t[id] + (size_t)(b * n + i) * row,
                       (const char *)full[id] + (size_t)(b * s->seq + pos[i]) * row, row);
    double *ms[2] = {calloc((size_t)reps, sizeof(double)), calloc((size_t)reps, sizeof(double))};
    int rc = 0;
    for (int pass = 0; pass < 2 && rc == 0; pass++)
        for (int i = -warmup; i < reps && rc == 0; i++) {
            double t0 = stria_time_now();
            stria_status_t st = stria_session_forward_shard(ss, &call, rank, t[STRIA_TENSOR_Q],
                                                            t[STRIA_TENSOR_K], t[STRIA_TENSOR_V],
                                                            t[STRIA_TENSOR_O], t[STRIA_TENSOR_LSE]);
            if (st == STRIA_OK && pass == 1)
                st = stria_session_backward_shard(
                    ss, &call, rank, t[STRIA_TENSOR_Q], t[STRIA_TENSOR_K], t[STRIA_TENSOR_V],
                    t[STRIA_TENSOR_O], t[STRIA_TENSOR_LSE], t[STRIA_TENSOR_DO], t[STRIA_TENSOR_DQ],
                    t[STRIA_TENSOR_DK], t[STRIA_TENSOR_DV]);
            if (st != STRIA_OK) {
                fprintf(stderr, "stria-bench calls: sharded rank %d: %s\n", rank,
                        stria_error_msg());
                rc = 1;
            } else if (i >= 0) {
                ms[pass][i] = (stria_time_now() - t0) * 1e3;
            }
        }
    if (rc == 0 && rank == 0) {
        char line[128];
        int len = snprintf(line, sizeof(line), "%.4f %.4f\n", stria_bench_median(ms[0], reps),
                           stria_bench_median(ms[1], reps));
        rc = write(out, line, (size_t)len) == len ? 0 : 1;
    }
    stria_session_close(ss);
    stria_client_close(cl);
    return rc;
}

/* The sharded session's row of a shape and ring: medians of rank 0's
 * calls, forward and forward+backward, beside the in-process ring's. */
static int calls_sharded(calls_row_t *r, int reps, int warmup, const double inproc_ms[2])
{
    const calls_shape_t *s = r->shape;
    const calls_cfg_t *c = r->cfg;
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    sp.max_batch = s->batch, sp.max_seq_len = s->seq;
    sp.heads = sp.kv_heads = s->heads, sp.head_dim = s->head_dim;
    sp.dtype = c->dtype, sp.layout = STRIA_LAYOUT_STRIPED, sp.ring_size = r->ranks;
    sp.sharded = true, sp.label = "stria-bench calls sharded";
    stria_session_t *ss = NULL;
    uint8_t ex[STRIA_SESSION_EXPORT_BYTES];
    size_t len;
    int fds[2];
    if (stria_session_open(r->client, &sp, &ss) != STRIA_OK ||
        stria_session_export(ss, ex, sizeof(ex), &len) != STRIA_OK || pipe(fds) != 0) {
        fprintf(stderr, "stria-bench calls: a sharded session of %s: %s\n", s->name,
                stria_error_msg());
        stria_session_close(ss);
        return 1;
    }
    fflush(NULL);
    pid_t pids[STRIA_BENCH_MAX_WORKERS];
    for (int k = 0; k < r->ranks; k++)
        if ((pids[k] = fork()) == 0) {
            close(fds[0]);
            _exit(calls_rank_main(c, s, r->x, ex, k, reps, warmup, fds[1]));
        }
    close(fds[1]);
    char line[128] = "";
    ssize_t got = read(fds[0], line, sizeof(line) - 1);
    close(fds[0]);
    int rc = 0;
    for (int k = 0; k < r->ranks; k++) {
        int status = 0;
        if (pids[k] < 0 || waitpid(pids[k], &status, 0) != pids[k] || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0)
            rc = 1;
    }
    stria_session_close(ss);
    double med[2] = {0, 0};
    if (rc != 0 || got <= 0 || sscanf(line, "%lf %lf", &med[0], &med[1]) != 2) {
        fprintf(stderr, "stria-bench calls: the sharded ranks of %s on %d failed\n", s->name,
                r->ranks);
        return 1;
    }
    for (int pass = 0; pass < 2; pass++) {
        if (c->json)
            printf("{\"name\":\"calls\",\"path\":\"session\",\"shape\":\"%s\",\"ranks\":%d,"
                   "\"pass\":\"%s\",\"mode\":\"sharded\",\"dtype\":\"%s\",\"call_ms\":%.4f,"
                   "\"inprocess_ms\":%.4f,\"overhead_ms\":%.4f,\"worker_forward_passes\":1,"
                   "\"reps\":%d,\"loadavg\":%.2f}\n",
                   s->name, r->ranks, pass ? "fwdbwd" : "fwd", stria_dtype_name(c->dtype),
                   med[pass], inproc_ms[pass], med[pass] - inproc_ms[pass], reps, calls_loadavg());
        else
            printf("%-10s %-14s %5d %-7s %10.3f %10.3f %10.3f %11s %6d %5s %5.2f\n", "sharded",
                   s->name, r->ranks, pass ? "fwdbwd" : "fwd", med[pass], inproc_ms[pass],
                   med[pass] - inproc_ms[pass], "-", 1, "-", calls_loadavg());
    }
    fflush(stdout);
    return 0;
}

/* The median wall time of opening a session of the row's shape and ring
 * (stria_session_open(): admission, every rank's buffers and ring link),
 * over `reps` opens, each closed before the next (the close not timed). */
static int calls_open_ms(const calls_row_t *r, const stria_session_spec_t *sp, int reps,
                         double *median_out)
{
    double *ms = calloc((size_t)reps, sizeof(double));
    int rc = ms == NULL;
    for (int i = 0; i < reps && rc == 0; i++) {
        stria_session_t *s = NULL;
        double t0 = stria_time_now();
        stria_status_t st = stria_session_open(r->client, sp, &s);
        ms[i] = (stria_time_now() - t0) * 1e3;
        if (st != STRIA_OK) {
            fprintf(stderr, "stria-bench calls: opening a session of %s on %d ranks: %s: %s\n",
                    r->shape->name, r->ranks, stria_status_name(st), stria_error_msg());
            rc = 1;
        }
        stria_session_close(s);
    }
    if (rc == 0)
        *median_out = stria_bench_median(ms, reps);
    free(ms);
    return rc;
}

static void calls_print_open(const calls_row_t *r, double open_ms, int reps)
{
    const calls_cfg_t *c = r->cfg;
    if (c->json)
        printf("{\"name\":\"calls\",\"path\":\"session_open\",\"shape\":\"%s\",\"ranks\":%d,"
               "\"dtype\":\"%s\",\"session_open_ms\":%.4f,\"reps\":%d,\"loadavg\":%.2f}\n",
               r->shape->name, r->ranks, stria_dtype_name(c->dtype), open_ms, reps,
               calls_loadavg());
    else
        printf("%-10s %-14s %5d %-7s %10.3f %10s %10s %11s %6s %5s %5.2f\n", "open", r->shape->name,
               r->ranks, "-", open_ms, "-", "-", "-", "-", "-", calls_loadavg());
    fflush(stdout);
}

/* Every ring and pass of one shape. */
static int calls_shape(const calls_cfg_t *c, const calls_shape_t *s, stria_client_t *client,
                       int workers)
{
    calls_tensors_t x;
    int reps, warmup, rc = calls_tensors_alloc(&x, c, s);
    calls_reps(c, s, &reps, &warmup);
    for (size_t ri = 0; ri < c->ranks.n && rc == 0; ri++) {
        int ranks = (int)c->ranks.v[ri];
        calls_row_t r = {
            .cfg = c, .shape = s, .x = &x, .client = client, .workers = workers, .ranks = ranks};
        r.spec = stria_bench_job_spec(&x.t, true, ranks, "stria-bench calls");
        r.call = (stria_call_t)STRIA_CALL_INIT;
        r.call.batch = s->batch;
        r.call.seq_len = s->seq;
        r.call.causal = true;
        stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
        sp.max_batch = s->batch;
        sp.max_seq_len = s->seq;
        sp.heads = sp.kv_heads = s->heads;
        sp.head_dim = s->head_dim;
        sp.dtype = c->dtype;
        sp.layout = STRIA_LAYOUT_STRIPED;
        sp.ring_size = ranks;
        sp.label = "stria-bench calls";
        double open_ms = 0;
        int open_reps = reps < 11 ? 11 : reps;
        if ((rc = calls_open_ms(&r, &sp, open_reps, &open_ms)) != 0)
            break;
        calls_print_open(&r, open_ms, open_reps);
        stria_status_t st = stria_session_open(client, &sp, &r.session);
        if (st != STRIA_OK) {
            fprintf(stderr, "stria-bench calls: opening a session of %s on %d ranks: %s: %s\n",
                    s->name, ranks, stria_status_name(st), stria_error_msg());
            rc = 1;
            break;
        }
        double inproc[2] = {0, 0};
        for (size_t p = 0; p < c->passes.n && rc == 0; p++) {
            r.backward = strcmp(c->passes.v[p], "fwdbwd") == 0;
            calls_result_t res;
            memset(&res, 0, sizeof(res));
            rc = calls_measure(&r, reps, warmup, &res);
            if (rc == 0)
                calls_print(&r, &res);
            inproc[r.backward] = res.ms[CALLS_INPROCESS];
        }
        stria_session_close(r.session);
        if (rc == 0 && c->sharded && ranks >= 2)
            rc = calls_sharded(&r, reps, warmup, inproc);
    }
    calls_tensors_free(&x);
    return rc;
}

int stria_bench_calls(int argc, char **argv)
{
    calls_cfg_t c;
    stria_cli_t cli;
    char coord[512];
    memset(&c, 0, sizeof(c));
    int prc = calls_parse(argc, argv, &c, &cli);
    if (prc >= 0) {
        stria_cli_free(&cli);
        return prc;
    }
    int workers = 1;
    for (size_t i = 0; i < c.ranks.n; i++)
        workers = (int)c.ranks.v[i] > workers ? (int)c.ranks.v[i] : workers;
    if (stria_bench_daemons_start("calls", workers, 1, coord, sizeof(coord)) != 0) {
        stria_cli_free(&cli);
        return 1;
    }
    snprintf(c.coord, sizeof(c.coord), "%s", coord);
    stria_client_t *client = NULL;
    stria_status_t st =
        stria_bench_client(coord, "stria-bench calls", STRIA_DATA_PATH_AUTO, &client);
    int rc = 0;
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-bench calls: connecting to %s: %s\n", coord, stria_error_msg());
        rc = 1;
    }
    if (rc == 0 && !c.json)
        printf("%-10s %-14s %5s %-7s %10s %10s %10s %11s %6s %5s %5s\n", "path", "shape", "ranks",
               "pass", "call_ms", "inproc_ms", "overhd_ms", "minflt/call", "fwd#", "equal", "load");
    for (int i = 0; i < c.n_shapes && rc == 0; i++)
        rc = calls_shape(&c, &c.shapes[i], client, workers);
    stria_client_close(client);
    stria_bench_daemons_stop();
    stria_cli_free(&cli);
    return rc;
}
