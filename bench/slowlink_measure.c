/* stria-bench slowlink's measuring (bench_slowlink.c makes the network and
 * starts the daemons): one session per layout and head groups (and with
 * --sharded a sharded one beside it, slowlink_sharded.c), a warm-up call
 * each, rounds with them alternated, the medians printed; the ring bytes
 * counted from the engine's plan; the first layout again with the rate
 * limit lifted. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_daemons.h"
#include "bench_util.h"
#include "slowlink.h"
#include "stria_client.h"
#include "stria_common.h"
#include "stria_ring.h"

static void sl_fail(sl_row_t *row, const char *what)
{
    row->ok = false;
    snprintf(row->msg, sizeof(row->msg), "%s: %s", what, stria_error_msg());
    stria_session_close(row->s);
    row->s = NULL;
}

/* One forward and its backward on row's session, rep r (r < 0: warm-up,
 * not recorded). */
static void sl_call(sl_row_t *row, const stria_call_t *call, stria_bench_job_t *t, int r)
{
    if (row->sharded)
        return sl__sharded_call(row, call, r);
    stria_session_stats_t ss = STRIA_SESSION_STATS_INIT;
    uint64_t b0 = sl__fabric_bytes();
    double t0 = stria_time_now();
    if (stria_session_forward(row->s, call, t->q, t->k, t->v, t->o, t->lse) != STRIA_OK)
        return sl_fail(row, "forward");
    double t1 = stria_time_now();
    uint64_t b1 = sl__fabric_bytes();
    stria_session_stats(row->s, &ss);
    double pf = ss.last_pass_s, rf = (double)ss.last_ring_bytes;
    if (stria_session_backward(row->s, call, t->q, t->k, t->v, t->o, t->lse, t->g, t->dq, t->dk,
                               t->dv) != STRIA_OK)
        return sl_fail(row, "backward");
    double t2 = stria_time_now();
    uint64_t b2 = sl__fabric_bytes();
    stria_session_stats(row->s, &ss);
    if (r < 0)
        return;
    row->fwd[r] = t1 - t0;
    row->fwd_bwd[r] = t2 - t0;
    row->pass_f[r] = pf;
    row->pass_b[r] = ss.last_pass_s;
    row->mib_f[r] = (double)(b1 - b0) / 1048576.0;
    row->mib_b[r] = (double)(b2 - b1) / 1048576.0;
    row->ring_f[r] = rf / 1048576.0;
    row->ring_b[r] = (double)ss.last_ring_bytes / 1048576.0;
}

/* Opens row's session: whole-sequence on `cl`, or sharded (its ranks'
 * clients at `coord`, their tokens of `call` cut from t). */
static int sl_open(sl_row_t *row, stria_client_t *cl, const sl_cfg_t *c, int n, const char *coord,
                   const stria_call_t *call, const stria_bench_job_t *t)
{
    stria_session_spec_t sp = STRIA_SESSION_SPEC_INIT;
    char label[64];
    snprintf(label, sizeof(label), "stria-bench slowlink %s", row->name);
    sp.max_batch = 1;
    sp.max_seq_len = c->seq;
    sp.heads = c->heads;
    sp.kv_heads = c->kv_heads;
    sp.head_dim = c->head_dim;
    sp.dtype = c->dtype;
    sp.layout = row->kind;
    sp.ring_size = n;
    sp.head_groups = (uint32_t)row->groups;
    sp.head_group_rings = row->across ? STRIA_GROUP_RINGS_ACROSS : STRIA_GROUP_RINGS_INSIDE;
    sp.trainer_ranks = row->per_worker ? n : 0;
    sp.idle_timeout_s = 3600;
    sp.step_timeout_s = c->step_timeout_s;
    sp.no_queue = true;
    sp.label = label;
    if (row->sharded)
        return sl__sharded_open(row, &sp, coord, call, t);
    row->ok = stria_session_open(cl, &sp, &row->s) == STRIA_OK;
    row->refused = !row->ok;
    if (!row->ok)
        snprintf(row->msg, sizeof(row->msg), "refused at open: %s", stria_error_msg());
    return row->ok ? 0 : -1;
}

static double sl_med(const double *v, int n)
{
    double tmp[SL_MAX_REPS];
    memcpy(tmp, v, (size_t)n * sizeof(double));
    return stria_bench_median(tmp, n);
}

/* The K/V bytes one rank sends per forward step (the block a ring step
 * moves) for striped, contiguous and zigzag shards. */
static double sl_block_bytes(const sl_cfg_t *c, int n)
{
    double shard = ceil((double)c->seq / n);
    return shard * (double)c->kv_heads * (double)c->head_dim * 2.0 *
           (double)stria_dtype_size(c->dtype);
}

static void sl_header(const sl_cfg_t *c, int n, size_t docs)
{
    double block = sl_block_bytes(c, n);
    printf("slow links: %d hosts x %d workers, each worker's interface %s%s, UCX over TCP\n"
           "causal S=%lld H=%lld (K/V %lld) D=%lld %s, medians of %d rounds\n",
           c->hosts, c->wph, c->rate_text, c->rate_bits > 0 ? " both ways" : " (no limit)",
           (long long)c->seq, (long long)c->heads, (long long)c->kv_heads, (long long)c->head_dim,
           stria_dtype_name(c->dtype), c->reps);
    if (docs > 0)
        printf("%zu documents (log-normal, median %lld tokens)\n", docs, (long long)c->doc_median);
    if (c->sharded)
        printf("sh: the same session sharded, its workers / G trainer ranks (a thread and client "
               "each) calling with their own tokens\n");
    if (c->sharded && c->per_worker)
        printf("sh/w: sharded, one trainer rank per worker (trainer_ranks), rank h G + l holding "
               "stripe l R + h\n");
    if (c->rate_bits > 0)
        printf("a ring step's K/V block (striped): %.2f MiB, %.0f ms at %s\n", block / 1048576.0,
               block * 8 / c->rate_bits * 1e3, c->rate_text);
    printf("%-20s %9s %9s %9s %9s %9s %9s  %s\n", "layout", "fwd s", "fwd+bwd s", "pass fwd",
           "pass bwd", "MiB fwd", "MiB bwd", "");
}

static void sl_print_row(const sl_cfg_t *c, const sl_row_t *row, int n, size_t docs)
{
    int reps = c->reps;
    if (c->json) {
        printf("{\"name\":\"slowlink\",\"layout\":\"%s\",\"head_groups\":%d,\"across\":%s,"
               "\"sharded\":%s,\"per_worker\":%s,"
               "\"status\":\"%s\",\"message\":",
               stria_layout_kind_name(row->kind), row->groups, row->across ? "true" : "false",
               row->sharded ? "true" : "false", row->per_worker ? "true" : "false",
               row->ok        ? "ok"
               : row->refused ? "refused"
                              : "failed");
        stria_bench_json_string(stdout, row->ok ? "" : row->msg);
        printf(",\"hosts\":%d,\"workers_per_host\":%d,\"ranks\":%d,\"rate\":\"%s\","
               "\"rate_bit_s\":%.0f,\"seq\":%lld,\"heads\":%lld,\"kv_heads\":%lld,"
               "\"head_dim\":%lld,\"dtype\":\"%s\",\"documents\":%zu,\"reps\":%d",
               c->hosts, c->wph, n, c->rate_text, c->rate_bits, (long long)c->seq,
               (long long)c->heads, (long long)c->kv_heads, (long long)c->head_dim,
               stria_dtype_name(c->dtype), docs, reps);
        if (row->ok)
            printf(",\"fwd_s\":%.6f,\"fwd_bwd_s\":%.6f,\"pass_fwd_s\":%.6f,\"pass_bwd_s\":%.6f,"
                   "\"link_mib_fwd\":%.3f,\"link_mib_bwd\":%.3f,\"ring_mib_fwd\":%.6f,"
                   "\"ring_mib_bwd\":%.6f",
                   sl_med(row->fwd, reps), sl_med(row->fwd_bwd, reps), sl_med(row->pass_f, reps),
                   sl_med(row->pass_b, reps), sl_med(row->mib_f, reps), sl_med(row->mib_b, reps),
                   sl_med(row->ring_f, reps), sl_med(row->ring_b, reps));
        printf("}\n");
    } else if (row->ok) {
        printf("%-20s %9.3f %9.3f %9.3f %9.3f %9.1f %9.1f\n", row->name, sl_med(row->fwd, reps),
               sl_med(row->fwd_bwd, reps), sl_med(row->pass_f, reps), sl_med(row->pass_b, reps),
               sl_med(row->mib_f, reps), sl_med(row->mib_b, reps));
    } else {
        printf("%-20s %s\n", row->name, row->msg);
    }
    fflush(stdout);
}

/* The first layout's calls again with the rate limit lifted, and how far
 * the limited pass is bound by the links (limited / unlimited). */
static int sl_baseline(const sl_cfg_t *c, sl_net_t *net, sl_row_t *row, const stria_call_t *call,
                       stria_bench_job_t *t)
{
    if (!sl__unshape(net)) {
        fprintf(stderr, "stria-bench slowlink: %s\n", net->why);
        return 1;
    }
    sl_row_t *base = calloc(1, sizeof(*base));
    if (base == NULL)
        return 1;
    *base = (sl_row_t){
        .kind = row->kind, .groups = row->groups, .name = row->name, .s = row->s, .ok = true};
    sl_call(base, call, t, -1);
    for (int r = 0; r < c->reps && base->ok; r++)
        sl_call(base, call, t, r);
    row->s = base->s; /* closed on a failure */
    int rc = 0;
    if (!base->ok) {
        fprintf(stderr, "stria-bench slowlink: %s without the rate limit: %s\n", row->name,
                base->msg);
        rc = 1;
    } else {
        int reps = c->reps;
        double f = sl_med(base->fwd, reps), fb = sl_med(base->fwd_bwd, reps);
        double bf = sl_med(row->fwd, reps) / f, bfb = sl_med(row->fwd_bwd, reps) / fb;
        if (c->json)
            printf("{\"name\":\"slowlink\",\"baseline\":\"%s\",\"unlimited_fwd_s\":%.6f,"
                   "\"unlimited_fwd_bwd_s\":%.6f,\"unlimited_pass_fwd_s\":%.6f,"
                   "\"unlimited_pass_bwd_s\":%.6f,\"bound_fwd\":%.3f,\"bound_fwd_bwd\":%.3f}\n",
                   row->name, f, fb, sl_med(base->pass_f, reps), sl_med(base->pass_b, reps), bf,
                   bfb);
        else
            printf("%-20s %9.3f %9.3f %9.3f %9.3f %9.1f %9.1f  (no rate limit)\n"
                   "the %s pass is %.2fx (fwd) and %.2fx (fwd+bwd) its time without the limit\n",
                   row->name, f, fb, sl_med(base->pass_f, reps), sl_med(base->pass_b, reps),
                   sl_med(base->mib_f, reps), sl_med(base->mib_b, reps), row->name, bf, bfb);
    }
    free(base);
    return rc;
}

/* The ring bytes one worker sends in a pass of the call, counted from the
 * engine's plan (the mean over a ring's ranks; *fwd and *bwd), for a ring
 * of n / G ranks over heads / G. */
static bool sl_counted(const sl_cfg_t *c, const stria_call_t *call, stria_layout_kind_t kind, int n,
                       int G, double *fwd, double *bwd)
{
    const int R = n / G;
    stria_ring_shape_t shape = {.call = {.batch = 1,
                                         .seq_len = c->seq,
                                         .causal = call->causal,
                                         .cu_seqlens = call->cu_seqlens,
                                         .n_cu_seqlens = call->n_cu_seqlens},
                                .heads = c->heads / G,
                                .kv_heads = c->kv_heads / G,
                                .head_dim = c->head_dim,
                                .dtype = c->dtype};
    stria_ring_plan_t *plan = NULL;
    if (stria_ring_plan_create(&shape, kind, R, false, &plan) != STRIA_OK)
        return false;
    double sum[2] = {0, 0};
    for (int b = 0; b < 2; b++)
        for (int r = 0; r < R; r++)
            for (int step = 0; step < stria_ring_plan_steps(plan, b); step++) {
                stria_ring_plan_step_t st;
                if (stria_ring_plan_step(plan, r, step, b, &st) == STRIA_OK)
                    sum[b] += (double)st.bytes_sent;
            }
    stria_ring_plan_destroy(plan);
    *fwd = sum[0] / R;
    *bwd = sum[1] / R;
    return true;
}

/* The counted ring bytes per worker per pass for G = 1, 2, 4 (those that
 * divide the workers and kv heads), against (R - 1) / (N - 1) of the 1-D
 * ring's forward and R / N of its backward. */
static void sl_print_counted(const sl_cfg_t *c, const stria_call_t *call, int n)
{
    stria_layout_kind_t kind = c->layouts[0];
    double f1, b1;
    if (c->json || !sl_counted(c, call, kind, n, 1, &f1, &b1) || f1 <= 0 || b1 <= 0)
        return;
    printf("counted ring bytes per worker per pass (%s, the engine's plan), against the 1-D "
           "ring of %d:\n",
           stria_layout_kind_name(kind), n);
    printf("  %-4s %10s %10s %9s %9s %12s %12s\n", "G", "MiB fwd", "MiB bwd", "fwd x", "bwd x",
           "(R-1)/(N-1)", "R/N");
    for (int G = 1; G <= 4 && G <= n; G *= 2) {
        double f, b;
        if (n % G != 0 || c->kv_heads % G != 0 || !sl_counted(c, call, kind, n, G, &f, &b))
            continue;
        const int R = n / G;
        printf("  %-4d %10.2f %10.2f %9.3f %9.3f %12.3f %12.3f\n", G, f / 1048576.0, b / 1048576.0,
               f / f1, b / b1, n > 1 ? (double)(R - 1) / (n - 1) : 1.0, (double)R / n);
    }
}

/* Opens a session per layout, warms each up, times them alternately,
 * prints; returns the exit code. */
int sl__measure(const sl_cfg_t *c, sl_net_t *net, const char *coord)
{
    int n = net->n, rc = 0;
    stria_bench_job_t t = {.batch = 1,
                           .seq = c->seq,
                           .heads = c->heads,
                           .kv_heads = c->kv_heads,
                           .head_dim = c->head_dim,
                           .dtype = c->dtype};
    size_t n_cu = 0;
    int64_t *cu = NULL;
    if (c->doc_median > 0 &&
        (cu = stria_bench_documents(c->doc_median, c->doc_sigma, c->seq, &n_cu)) == NULL) {
        fprintf(stderr, "stria-bench slowlink: out of memory for the documents\n");
        return 1;
    }
    sl_row_t *rows = calloc(SL_MAX_ROWS, sizeof(*rows));
    /* the rows: per layout, per head groups (G > 1 inside, and across with
     * --across), whole (and sharded with --sharded; a striped G > 1 also
     * by one trainer rank per worker with --per-worker) */
    int n_rows = 0;
    for (int l = 0; rows != NULL && l < c->n_layouts; l++)
        for (int g = 0; g < c->n_groups; g++)
            for (int a = 0; a < (c->across && c->groups[g] > 1 ? 2 : 1); a++) {
                const bool pw = c->sharded && c->per_worker && c->groups[g] > 1 &&
                                c->layouts[l] == STRIA_LAYOUT_STRIPED;
                for (int sh = 0; sh < (c->sharded ? 2 : 1) + (pw ? 1 : 0); sh++) {
                    sl_row_t *r = &rows[n_rows++];
                    r->kind = c->layouts[l];
                    r->groups = c->groups[g];
                    r->across = a == 1;
                    r->sharded = sh >= 1;
                    r->per_worker = sh == 2;
                    char gs[24] = "";
                    if (r->groups > 1)
                        snprintf(gs, sizeof(gs), " G=%d%s", r->groups, r->across ? " x" : "");
                    snprintf(r->name_buf, sizeof(r->name_buf), "%s%s%s", c->layout_names[l], gs,
                             r->per_worker ? " sh/w"
                             : r->sharded  ? " sh"
                                           : "");
                    r->name = r->name_buf;
                }
            }
    stria_client_t *cl = NULL;
    if (rows == NULL || stria_bench_job_alloc(&t, true) != 0) {
        free(rows), free(cu);
        return 1;
    }
    if (stria_bench_client(coord, "stria-bench slowlink", STRIA_DATA_PATH_TCP, &cl) != STRIA_OK) {
        fprintf(stderr, "stria-bench slowlink: %s\n", stria_error_msg());
        stria_bench_job_free(&t);
        free(rows), free(cu);
        return 1;
    }
    stria_call_t call = STRIA_CALL_INIT;
    call.batch = 1;
    call.seq_len = c->seq;
    call.causal = true;
    call.cu_seqlens = cu;
    call.n_cu_seqlens = n_cu;
    size_t docs = n_cu > 0 ? n_cu - 1 : 0;
    for (int i = 0; i < n_rows; i++) {
        if (sl_open(&rows[i], cl, c, n, coord, &call, &t) == 0)
            sl_call(&rows[i], &call, &t, -1);
        if (!c->json)
            fprintf(stderr, "  %s: %s\n", rows[i].name,
                    rows[i].ok ? "open, warmed up" : rows[i].msg);
    }
    for (int r = 0; r < c->reps; r++) {
        for (int i = 0; i < n_rows; i++)
            if (rows[i].ok)
                sl_call(&rows[i], &call, &t, r);
        if (!c->json) {
            fprintf(stderr, "  round %d:", r);
            for (int i = 0; i < n_rows; i++)
                if (rows[i].ok)
                    fprintf(stderr, " %s %.3f/%.3f s", rows[i].name, rows[i].fwd[r],
                            rows[i].fwd_bwd[r]);
            fprintf(stderr, "\n");
        }
    }
    if (!c->json) {
        sl_print_counted(c, &call, n);
        sl_header(c, n, docs);
    }
    int measured = 0;
    for (int i = 0; i < n_rows; i++) {
        sl_print_row(c, &rows[i], n, docs);
        measured += rows[i].ok;
        rc |= !rows[i].ok && !rows[i].refused; /* a refusal is a row, a failed call an error */
    }
    if (rows[0].ok && c->baseline && c->rate_bits > 0)
        rc |= sl_baseline(c, net, &rows[0], &call, &t);
    if (measured == 0) {
        fprintf(stderr, "stria-bench slowlink: no layout could be measured\n");
        rc = 1;
    }
    for (int i = 0; i < n_rows; i++) {
        stria_session_close(rows[i].s);
        sl__sharded_close(&rows[i]);
    }
    stria_client_close(cl);
    stria_bench_job_free(&t);
    free(rows), free(cu);
    return rc;
}
