/*
 * stria-bench service: the same causal forward+backward job through the
 * service (a coordinator and N worker processes on loopback, data over RPC,
 * ring over UCX) and through the in-process ring engine with the same ranks,
 * side by side in one run. Reports both times and their ratio.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "bench_daemons.h"
#include "bench_util.h"
#include "stria_client.h"
#include "stria_common.h"

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
        STRIA_OPTION("ranks", INT, &ranks_arg, "N", "workers (and in-process ranks)", .dflt = "4",
                     .min = 1, .max = STRIA_BENCH_MAX_WORKERS),
        STRIA_OPTION("seq", INT, &c->seq, "S", "tokens", .dflt = "32768", .min = 1, .max = 1e15),
        STRIA_OPTION("heads", INT, &c->heads, "H", "query heads", .dflt = "8", .min = 1,
                     .max = 1e9),
        STRIA_OPTION("kv-heads", INT, &c->kv_heads, "K", "key/value heads", .dflt = "8", .min = 1,
                     .max = 1e9),
        STRIA_OPTION("head-dim", INT, &c->head_dim, "D", "head dimension", .dflt = "128", .min = 1,
                     .max = 1e9),
        STRIA_OPTION("dtype", CUSTOM, &c->dtype, "fp32|bf16|fp16", "storage dtype", .dflt = "bf16",
                     .parse = svc_parse_dtype),
        STRIA_OPTION("reps", INT, &reps_arg, "R", "runs of each, medians reported", .dflt = "3",
                     .min = 1, .max = 100),
        STRIA_OPTION("threads-per-rank", INT, &tpr_arg, "T", "kernel threads of each rank",
                     .dflt = "1", .min = 1, .max = 256),
        STRIA_OPTION("json", FLAG, &c->json, NULL, "one JSON object"),
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
    int ranks = c->ranks, reps = c->reps;
    stria_bench_job_t t = {.batch = 1,
                           .seq = c->seq,
                           .heads = c->heads,
                           .kv_heads = c->kv_heads,
                           .head_dim = c->head_dim,
                           .dtype = c->dtype};
    if (stria_bench_job_alloc(&t, true) != 0)
        return 1;
    stria_client_t *client = NULL;
    stria_status_t st = stria_bench_client(coord, "stria-bench", STRIA_DATA_PATH_AUTO, &client);
    stria_job_spec_t spec = stria_bench_job_spec(&t, true, ranks, "stria-bench service");
    double *svc_s = calloc((size_t)reps, sizeof(double)), *svc_pass = calloc((size_t)reps, 8);
    double *loc_s = calloc((size_t)reps, sizeof(double));
    for (int r = 0; r < reps && st == STRIA_OK; r++) {
        /* (a) through the service */
        stria_call_stats_t fs = STRIA_CALL_STATS_INIT, bs = STRIA_CALL_STATS_INIT;
        st = stria_bench_service_fwd_bwd(client, &spec, &t, &svc_s[r], &fs, &bs);
        if (st != STRIA_OK)
            break;
        svc_pass[r] = fs.pass_s + bs.pass_s;
        /* (b) the in-process ring engine */
        st = stria_bench_local_fwd_bwd(&t, true, ranks, c->tpr, &loc_s[r]);
        if (!c->json)
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
    stria_bench_job_free(&t);
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
    if (stria_bench_daemons_start("service", c.ranks, c.tpr, coord, sizeof(coord)) != 0)
        return 1;
    int rc = svc_measure(&c, coord);
    stria_bench_daemons_stop();
    return rc;
}
