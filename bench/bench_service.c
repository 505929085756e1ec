/*
 * stria-bench service: the same causal forward+backward job through the
 * service (a coordinator and N worker processes on loopback, data over RPC,
 * ring over UCX) and through the in-process ring engine with the same ranks,
 * side by side in one run. Reports both times and their ratio.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bench_util.h"
#include "stria_client.h"
#include "stria_common.h"
#include "stria_ring.h"

#define SVC_MAX_WORKERS 64

static const char svc_description[] =
    "Runs the same causal striped forward+backward job (a) through the service: a\n"
    "coordinator and N worker processes started on loopback, inputs and outputs over\n"
    "RPC, the ring over UCX; and (b) through the in-process ring engine with N rank\n"
    "threads; alternately, R times each, and prints the median times and the ratio\n"
    "service / in-process. The daemons are found beside this program\n"
    "(stria-coordinator, stria-worker).";

static stria_status_t svc_parse_dtype(const char *text, void *dst)
{
    return stria_dtype_parse(text, dst);
}

/* What one run measures. */
typedef struct {
    int ranks, reps, tpr;
    int64_t seq, heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    bool json;
} svc_cfg_t;

/* Parses the options into c; returns -1 to go on, else the exit code. */
static int svc_parse(int argc, char **argv, svc_cfg_t *c)
{
    int64_t ranks_arg, reps_arg, tpr_arg;
    c->dtype = STRIA_DTYPE_BF16;
    c->json = false;
    const stria_option_t opts[] = {
        {.name = "ranks",
         .type = STRIA_OPT_INT,
         .dst = &ranks_arg,
         .dflt = "4",
         .min = 1,
         .max = SVC_MAX_WORKERS,
         .metavar = "N",
         .help = "workers (and in-process ranks)"},
        {.name = "seq",
         .type = STRIA_OPT_INT,
         .dst = &c->seq,
         .dflt = "32768",
         .min = 1,
         .max = 1e15,
         .metavar = "S",
         .help = "tokens"},
        {.name = "heads",
         .type = STRIA_OPT_INT,
         .dst = &c->heads,
         .dflt = "8",
         .min = 1,
         .max = 1e9,
         .metavar = "H",
         .help = "query heads"},
        {.name = "kv-heads",
         .type = STRIA_OPT_INT,
         .dst = &c->kv_heads,
         .dflt = "8",
         .min = 1,
         .max = 1e9,
         .metavar = "K",
         .help = "key/value heads"},
        {.name = "head-dim",
         .type = STRIA_OPT_INT,
         .dst = &c->head_dim,
         .dflt = "128",
         .min = 1,
         .max = 1e9,
         .metavar = "D",
         .help = "head dimension"},
        {.name = "dtype",
         .type = STRIA_OPT_CUSTOM,
         .dst = &c->dtype,
         .dflt = "bf16",
         .parse = svc_parse_dtype,
         .metavar = "fp32|bf16|fp16",
         .help = "storage dtype"},
        {.name = "reps",
         .type = STRIA_OPT_INT,
         .dst = &reps_arg,
         .dflt = "3",
         .min = 1,
         .max = 100,
         .metavar = "R",
         .help = "runs of each, medians reported"},
        {.name = "threads-per-rank",
         .type = STRIA_OPT_INT,
         .dst = &tpr_arg,
         .dflt = "1",
         .min = 1,
         .max = 256,
         .metavar = "T",
         .help = "kernel threads of each rank"},
        {.name = "json", .type = STRIA_OPT_FLAG, .dst = &c->json, .help = "one JSON object"},
        {.name = NULL},
    };
    const stria_command_t cmd = {
        .name = "service", .description = svc_description, .options = opts};
    stria_cli_t cli;
    int prc = stria_bench_parse(&cmd, argc, argv, &cli);
    stria_cli_free(&cli);
    c->ranks = (int)ranks_arg;
    c->reps = (int)reps_arg;
    c->tpr = (int)tpr_arg;
    return prc;
}

/* Starts a coordinator and `ranks` workers beside this program; writes the
 * coordinator's address. Returns 0, or 1 with a message. */
static int svc_start_daemons(int ranks, int tpr, char *coord, size_t coord_len)
{
    return stria_bench_start_service(ranks, tpr, NULL, coord, coord_len) == STRIA_OK ? 0 : 1;
}

/* Prints the medians: service, its ring passes alone, in-process. */
static void svc_report(const svc_cfg_t *c, double ms, double mp, double ml)
{
    int ranks = c->ranks, reps = c->reps, tpr = c->tpr;
    int64_t seq = c->seq, heads = c->heads, kv_heads = c->kv_heads, head_dim = c->head_dim;
    stria_dtype_t dtype = c->dtype;
    double flops = 2.0 * (double)seq * (double)seq * (double)head_dim * (double)heads * 3.5;
    if (c->json)
        printf("{\"name\":\"service\",\"ranks\":%d,\"seq\":%lld,\"heads\":%lld,"
               "\"kv_heads\":%lld,\"head_dim\":%lld,\"dtype\":\"%s\",\"reps\":%d,"
               "\"threads_per_rank\":%d,\"service_s\":%.6f,\"service_pass_s\":%.6f,"
               "\"inprocess_s\":%.6f,\"ratio\":%.4f,\"pass_ratio\":%.4f}\n",
               ranks, (long long)seq, (long long)heads, (long long)kv_heads, (long long)head_dim,
               stria_dtype_name(dtype), reps, tpr, ms, mp, ml, ms / ml, mp / ml);
    else
        printf("service vs in-process ring, causal striped fwd+bwd, %d ranks, S=%lld H=%lld "
               "(K/V %lld) D=%lld %s, median of %d:\n"
               "  service      %.3f s  (%.1f GFLOP/s; ring passes alone %.3f s)\n"
               "  in-process   %.3f s  (%.1f GFLOP/s)\n"
               "  ratio        %.3f  (passes alone %.3f)\n",
               ranks, (long long)seq, (long long)heads, (long long)kv_heads, (long long)head_dim,
               stria_dtype_name(dtype), reps, ms, flops / ms * 1e-9, mp, ml, flops / ml * 1e-9,
               ms / ml, mp / ml);
}

/* Runs the job through the service and in process, alternately, and
 * reports; returns the exit code. */
static int svc_measure(const svc_cfg_t *c, const char *coord)
{
    int ranks = c->ranks, reps = c->reps, tpr = c->tpr;
    int64_t seq = c->seq, heads = c->heads, kv_heads = c->kv_heads, head_dim = c->head_dim;
    stria_dtype_t dtype = c->dtype;
    bool json = c->json;
    size_t es = stria_dtype_size(dtype);
    size_t nq = (size_t)(seq * heads * head_dim), nk = (size_t)(seq * kv_heads * head_dim);
    void *q = malloc(nq * es), *k = malloc(nk * es), *v = malloc(nk * es), *g = malloc(nq * es);
    void *o = malloc(nq * es), *dq = malloc(nq * es), *dk = malloc(nk * es), *dv = malloc(nk * es);
    float *lse = malloc((size_t)(heads * seq) * 4);
    stria_bench_fill(q, dtype, nq, 1);
    stria_bench_fill(k, dtype, nk, 2);
    stria_bench_fill(v, dtype, nk, 3);
    stria_bench_fill(g, dtype, nq, 4);

    stria_client_params_t cp;
    stria_client_t *client = NULL;
    memset(&cp, 0, sizeof(cp));
    cp.struct_size = sizeof(cp);
    cp.coordinator = coord;
    cp.client_name = "stria-bench";
    stria_status_t st = STRIA_ERR_TIMEOUT;
    /* the workers register within a heartbeat or two */
    for (int i = 0; i < 100 && st != STRIA_OK; i++) {
        st = stria_client_connect(&cp, &client);
        if (st != STRIA_OK)
            usleep(100000);
    }
    stria_job_spec_t spec;
    memset(&spec, 0, sizeof(spec));
    spec.struct_size = sizeof(spec);
    spec.batch = 1;
    spec.seq_len = seq;
    spec.heads = heads;
    spec.kv_heads = kv_heads;
    spec.head_dim = head_dim;
    spec.dtype = dtype;
    spec.causal = true;
    spec.layout = STRIA_LAYOUT_STRIPED;
    spec.ring_size = ranks;
    spec.label = "stria-bench service";

    stria_ring_shape_t shape;
    memset(&shape, 0, sizeof(shape));
    shape.batch = 1;
    shape.seq = seq;
    shape.heads = heads;
    shape.kv_heads = kv_heads;
    shape.head_dim = head_dim;
    shape.causal = true;
    shape.dtype = dtype;
    stria_ring_local_opts_t ro;
    memset(&ro, 0, sizeof(ro));
    ro.layout = STRIA_LAYOUT_STRIPED;
    ro.n_ranks = ranks;
    ro.passes = STRIA_RING_PASS_FWD_BWD;
    ro.threads_per_rank = tpr;
    stria_ring_local_io_t io;
    memset(&io, 0, sizeof(io));
    io.q = q;
    io.k = k;
    io.v = v;
    io.o = o;
    io.o_dtype = dtype;
    io.lse = lse;
    io.d_o = g;
    io.dq = dq;
    io.dk = dk;
    io.dv = dv;
    io.grad_dtype = dtype;

    double *svc_s = calloc((size_t)reps, sizeof(double)), *svc_pass = calloc((size_t)reps, 8);
    double *loc_s = calloc((size_t)reps, sizeof(double));
    for (int r = 0; r < reps && st == STRIA_OK; r++) {
        /* (a) through the service */
        stria_job_t *job = NULL;
        stria_call_stats_t fs = STRIA_CALL_STATS_INIT, bs = STRIA_CALL_STATS_INIT;
        double t0 = stria_time_now();
        st = stria_client_forward(client, &spec, q, k, v, o, lse, NULL, NULL, &fs, &job);
        if (st == STRIA_OK)
            st = stria_client_backward(job, g, dq, dk, dv, NULL, NULL, &bs);
        double t1 = stria_time_now();
        stria_client_release(job);
        if (st != STRIA_OK)
            break;
        svc_s[r] = t1 - t0;
        svc_pass[r] = fs.pass_s + bs.pass_s;
        /* (b) the in-process ring engine */
        stria_ring_local_stats_t ls;
        memset(&ls, 0, sizeof(ls));
        t0 = stria_time_now();
        st = stria_ring_run_local(&shape, &ro, &io, &ls);
        loc_s[r] = stria_time_now() - t0;
        if (!json)
            fprintf(stderr, "  rep %d: service %.3f s (passes %.3f s), in-process %.3f s\n", r,
                    svc_s[r], svc_pass[r], loc_s[r]);
    }
    int rc = 0;
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-bench service: %s\n", stria_error_msg());
        rc = 1;
    } else {
        svc_report(c, stria_bench_median(svc_s, reps), stria_bench_median(svc_pass, reps),
                   stria_bench_median(loc_s, reps));
    }
    stria_client_close(client);
    free(q), free(k), free(v), free(g), free(o), free(dq), free(dk), free(dv), free(lse);
    free(svc_s), free(svc_pass), free(loc_s);
    return rc;
}

int stria_bench_service(int argc, char **argv)
{
    svc_cfg_t c;
    char coord[512];
    int prc = svc_parse(argc, argv, &c);
    if (prc >= 0)
        return prc;
    if (svc_start_daemons(c.ranks, c.tpr, coord, sizeof(coord)) != 0)
        return 1;
    int rc = svc_measure(&c, coord);
    stria_bench_stop_daemons();
    return rc;
}
