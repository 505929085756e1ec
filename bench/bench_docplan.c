/* stria-bench docplan: packed documents placed by their work (the document
 * plan, common/stria_docplan.h) against striping and contiguous shards, all
 * counted: each layout's rank work (max/mean), the K/V steps a ring pass
 * needs, the rows that travel and the bytes a forward sends; and what a plan
 * costs to make and to find again in the cache. Counting needs no kernel
 * run, so the figures are the same on every machine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_util.h"
#include "stria_docplan.h"

static const char description[] =
    "Counts how each layout places a call's documents on a ring: the busiest rank's work over\n"
    "the mean (query-key pairs under the masks), the K/V steps a pass needs, the rows that\n"
    "travel and the MiB a forward sends (K and V of the travelling rows, once per step after\n"
    "the first), and the forward's critical path in pairs (the sum over steps of the busiest\n"
    "rank's pairs) over striped's; then times the document plan: made, and found in the cache.";
static const char epilog[] =
    "example: stria-bench docplan --ranks 8 --seq 65536 --heads 4 --head-dim 64 \\\n"
    "             --documents lognormal:1024";

typedef struct {
    const char *name;
    uint64_t most, total;
    int steps;
    int64_t travel;  /* rows that travel, all ranks */
    double mib;      /* forward K/V bytes sent */
    double critical; /* forward critical path in pairs; < 0: not counted */
} row_t;

/* Most ranks whose steps are counted (an N x N table). */
#define MAX_STEP_RANKS 1024

/* The critical path of a forward pass counted in pairs: the sum over steps
 * of the busiest rank's (query, key) pairs, rank r at step s computing its
 * queries against rank (r - s) mod N's block: whole at step 0, after it the
 * rows that travel (moves[p]: position p does). Without a window only (-1
 * otherwise, or for more than MAX_STEP_RANKS ranks). A plan balances each
 * rank's total; this shows how even each step is, which is what a ring
 * waits for. */
static double step_critical(const stria_call_shape_t *call, int n, const int32_t *rank_of,
                            const uint8_t *moves)
{
    if (call->has_window || n > MAX_STEP_RANKS)
        return -1.0;
    double *w = calloc((size_t)n * (size_t)n, sizeof(*w)), critical = 0;
    int64_t *all = calloc((size_t)n, sizeof(*all)), *trav = calloc((size_t)n, sizeof(*trav));
    const size_t n_docs = call->n_cu_seqlens > 1 ? call->n_cu_seqlens - 1 : 1;
    if (w == NULL || all == NULL || trav == NULL) {
        critical = -1.0;
        goto out;
    }
    for (size_t d = 0; d < n_docs; d++) {
        int64_t a = call->n_cu_seqlens > 1 ? call->cu_seqlens[d] : 0;
        int64_t z = call->n_cu_seqlens > 1 ? call->cu_seqlens[d + 1] : call->seq_len;
        memset(all, 0, (size_t)n * sizeof(*all));
        memset(trav, 0, (size_t)n * sizeof(*trav));
        /* causal: the keys up to the query; else the whole document's */
        for (int64_t p = a; p < z && !call->causal; p++)
            all[rank_of[p]]++, trav[rank_of[p]] += moves[p];
        for (int64_t p = a; p < z; p++) {
            const int r = rank_of[p];
            if (call->causal)
                all[r]++, trav[r] += moves[p];
            w[(size_t)r * (size_t)n] += (double)all[r];
            for (int s = 1; s < n && moves[p]; s++)
                w[(size_t)r * (size_t)n + (size_t)s] += (double)trav[(r - s + n) % n];
        }
    }
    for (int s = 0; s < n; s++) {
        double most = 0;
        for (int r = 0; r < n; r++)
            most = w[(size_t)r * (size_t)n + (size_t)s] > most
                       ? w[(size_t)r * (size_t)n + (size_t)s]
                       : most;
        critical += most;
    }
out:
    free(w);
    free(all);
    free(trav);
    return critical;
}

/* A layout's counts from a rank per position. */
static stria_status_t count_row(const stria_call_shape_t *call, int n, const int32_t *rank_of,
                                const uint8_t *moves, int64_t travel, double row_bytes, row_t *row)
{
    uint64_t *work = calloc((size_t)n, sizeof(*work));
    if (work == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    stria_status_t st = stria_docplan_count(call, n, rank_of, work, &row->steps);
    row->most = row->total = 0;
    for (int r = 0; r < n; r++) {
        row->most = work[r] > row->most ? work[r] : row->most;
        row->total += work[r];
    }
    row->travel = travel;
    row->mib = (double)(row->steps - 1) * (double)travel * 2.0 * row_bytes / (1 << 20);
    row->critical = step_critical(call, n, rank_of, moves);
    free(work);
    return st;
}

static stria_status_t layout_row(const stria_call_shape_t *call, int n, stria_layout_kind_t kind,
                                 int32_t *rank_of, uint8_t *moves, double row_bytes, row_t *row)
{
    stria_layout_t lay;
    stria_status_t st = stria_layout_init(kind, n, call->seq_len, &lay);
    for (int64_t p = 0; p < call->seq_len && st == STRIA_OK; p++) {
        int r;
        int64_t idx;
        st = stria_layout_locate(&lay, p, &r, &idx);
        rank_of[p] = r;
        moves[p] = 1;
    }
    row->name = stria_layout_kind_name(kind);
    /* a ring pass sends whole shards */
    return st == STRIA_OK ? count_row(call, n, rank_of, moves, lay.seq_padded, row_bytes, row) : st;
}

static stria_status_t plan_row(const stria_call_shape_t *call, const stria_docplan_t *p,
                               int32_t *rank_of, uint8_t *moves, double row_bytes, row_t *row)
{
    int64_t travel = 0;
    int64_t *pos = malloc((size_t)p->shard_tokens * sizeof(*pos));
    if (pos == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    for (int r = 0; r < p->n_ranks; r++) {
        stria_docplan_positions(p, r, pos);
        for (int64_t i = 0; i < p->valid[r]; i++) {
            rank_of[pos[i]] = r;
            moves[pos[i]] = i < p->travel[r];
        }
        travel += p->travel[r];
    }
    free(pos);
    row->name = "packed";
    return count_row(call, p->n_ranks, rank_of, moves, travel, row_bytes, row);
}

/* Plan times: made afresh `reps` times, and found in a cache. */
static stria_status_t plan_times(const stria_call_shape_t *call, int n, int64_t L, int reps,
                                 double *make_ms, double *hit_us, stria_docplan_cache_stats_t *cs)
{
    double *t = malloc((size_t)reps * sizeof(*t));
    stria_docplan_cache_t *cache = stria_docplan_cache_new(16);
    stria_status_t st = STRIA_OK;
    if (t == NULL || cache == NULL) {
        free(t);
        stria_docplan_cache_free(cache);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    }
    for (int i = 0; i < reps && st == STRIA_OK; i++) {
        stria_docplan_t *p;
        if ((st = stria_docplan_make(call, n, L, &p)) == STRIA_OK)
            t[i] = p->make_s * 1e3;
        stria_docplan_unref(p);
    }
    *make_ms = stria_bench_median(t, reps);
    for (int i = 0; i < reps && st == STRIA_OK; i++) {
        stria_docplan_t *p;
        double t0 = stria_time_now();
        st = stria_docplan_cache_get(cache, call, n, L, &p); /* the first one misses */
        t[i] = (stria_time_now() - t0) * 1e6;
        stria_docplan_unref(p);
    }
    *hit_us = reps > 1 ? stria_bench_median(t + 1, reps - 1) : t[0];
    stria_docplan_cache_stats(cache, cs);
    stria_docplan_cache_free(cache);
    free(t);
    return st;
}

static void print_rows(const row_t *rows, int n_rows, int n, bool json)
{
    const row_t *striped = &rows[1];
    for (int k = 0; k < n_rows; k++) {
        const row_t *r = &rows[k];
        double max_mean = r->total > 0 ? (double)r->most * n / (double)r->total : 1.0;
        double vs = striped->mib > 0 ? r->mib / striped->mib : 0.0;
        double crit =
            r->critical >= 0 && striped->critical > 0 ? r->critical / striped->critical : -1.0;
        if (json)
            printf("{\"layout\":\"%s\",\"ranks\":%d,\"max_mean_rank_work_counted\":%.4f,"
                   "\"steps\":%d,\"travel_rows\":%lld,\"fwd_mib_sent\":%.2f,"
                   "\"fwd_bytes_vs_striped\":%.4f,\"critical_path_pairs\":%.6g,"
                   "\"critical_path_vs_striped\":%.4f}\n",
                   r->name, n, max_mean, r->steps, (long long)r->travel, r->mib, vs, r->critical,
                   crit);
        else
            printf("%-12s %10.4f %6d %12lld %12.1f %10.3f %10.3f\n", r->name, max_mean, r->steps,
                   (long long)r->travel, r->mib, vs, crit);
    }
}

static int run(int n, int64_t seq, const stria_bench_masks_t *m, bool causal,
               const stria_bench_shape_t *shape, int reps, bool json)
{
    size_t n_cu = 0;
    int64_t *cu =
        m->doc_median > 0 ? stria_bench_documents(m->doc_median, m->doc_sigma, seq, &n_cu) : NULL;
    int32_t *rank_of = malloc((size_t)seq * sizeof(*rank_of));
    uint8_t *moves = malloc((size_t)seq);
    stria_call_shape_t call = {.batch = 1,
                               .seq_len = seq,
                               .causal = causal,
                               .cu_seqlens = cu,
                               .n_cu_seqlens = n_cu,
                               .has_window = m->has_window,
                               .window_left = m->window_left,
                               .window_right = m->window_right};
    const double row_bytes =
        (double)(shape->kv_heads * shape->head_dim) * (double)stria_dtype_size(shape->dtype);
    const int64_t L = (seq + n - 1) / n;
    stria_docplan_t *plan = NULL;
    stria_docplan_cache_stats_t cs;
    double make_ms = 0, hit_us = 0;
    row_t rows[3];
    stria_status_t st = rank_of == NULL || moves == NULL || (m->doc_median > 0 && cu == NULL)
                            ? stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory")
                            : STRIA_OK;
    if (st == STRIA_OK)
        st = stria_docplan_make(&call, n, L, &plan);
    if (st == STRIA_OK)
        st = plan_row(&call, plan, rank_of, moves, row_bytes, &rows[0]);
    if (st == STRIA_OK)
        st = layout_row(&call, n, STRIA_LAYOUT_STRIPED, rank_of, moves, row_bytes, &rows[1]);
    if (st == STRIA_OK)
        st = layout_row(&call, n, STRIA_LAYOUT_CONTIGUOUS, rank_of, moves, row_bytes, &rows[2]);
    if (st == STRIA_OK)
        st = plan_times(&call, n, L, reps, &make_ms, &hit_us, &cs);
    if (st != STRIA_OK) {
        fprintf(stderr, "stria-bench docplan: %s\n", stria_error_msg());
    } else {
        if (!json) {
            printf("S = %lld on %d ranks (shard %lld), %zu documents%s, %s, K/V rows of %.0f "
                   "bytes\n",
                   (long long)seq, n, (long long)L, n_cu > 1 ? n_cu - 1 : 1,
                   m->has_window ? ", a window" : "", causal ? "causal" : "not causal", row_bytes);
            printf("%-12s %10s %6s %12s %12s %10s %10s\n", "layout", "max/mean", "steps",
                   "travel rows", "fwd MiB", "vs striped", "critical");
        }
        print_rows(rows, 3, n, json);
        if (json)
            printf("{\"plan\":{\"ranks\":%d,\"seq\":%lld,\"kept\":%zu,\"spread\":%zu,\"rounds\":%d,"
                   "\"make_ms\":%.3f,\"cache_hit_us\":%.3f,\"plan_bytes\":%zu,"
                   "\"cache_entries\":%zu,\"cache_bytes\":%zu}}\n",
                   n, (long long)seq, plan->n_kept, plan->n_spread, plan->rounds, make_ms, hit_us,
                   plan->bytes, cs.entries, cs.bytes);
        else
            printf("plan: %zu documents kept, %zu spread, %d round(s); made in %.3f ms (median of "
                   "%d), found in the cache in %.2f us; %zu bytes (cache: %zu plan(s), %zu "
                   "bytes)\n\n",
                   plan->n_kept, plan->n_spread, plan->rounds, make_ms, reps, hit_us, plan->bytes,
                   cs.entries, cs.bytes);
    }
    stria_docplan_unref(plan);
    free(rank_of);
    free(moves);
    free(cu);
    return st == STRIA_OK ? 0 : 1;
}

int stria_bench_docplan(int argc, char **argv)
{
    stria_int_list_t ranks = {0}, seqs = {0}, win = {0};
    const char *docs = "lognormal:1024";
    int64_t reps = 5;
    bool causal = true, json = false;
    stria_bench_shape_t shape = {0};
    const stria_option_t own[] = {
        STRIA_OPTION("ranks", INTS, &ranks, "N[,N...]", "ring sizes", .dflt = "8", .min = 1,
                     .max = STRIA_LAYOUT_MAX_RANKS, .max_items = 16),
        STRIA_OPTION("seq", INTS, &seqs, "S[,S...]", "sequence lengths", .dflt = "65536", .min = 1,
                     .max = (double)((int64_t)1 << 30), .max_items = 16),
        STRIA_OPTION("documents", STRING, &docs, "lognormal:MEDIAN[:SIGMA]|none",
                     "documents with lengths drawn log-normal around MEDIAN tokens (as stria-bench "
                     "ring), or none",
                     .dflt = "lognormal:1024"),
        STRIA_OPTION("window", INTS, &win, "LEFT[,RIGHT]", "sliding window (RIGHT default 0)",
                     .min = -1, .max = (double)((int64_t)1 << 40), .max_items = 2),
        STRIA_OPTION("no-causal", UNFLAG, &causal, NULL, "no causal mask"),
        STRIA_OPTION("reps", INT, &reps, "R", "plans made (and cache lookups), median reported",
                     .dflt = "5", .min = 1, .max = 1000),
        STRIA_OPTION("json", FLAG, &json, NULL, "one JSON object per layout and one per plan"),
    };
    stria_option_t opts[sizeof(own) / sizeof(own[0]) + STRIA_BENCH_SHAPE_OPTS + 1] = {{0}};
    memcpy(opts, own, sizeof(own));
    stria_bench_shape_options(opts + sizeof(own) / sizeof(own[0]), &shape, 1024);
    const stria_command_t cmd = {
        .name = "docplan", .description = description, .epilog = epilog, .options = opts};
    stria_cli_t cli;
    stria_bench_masks_t m;
    int rc = stria_bench_parse(&cmd, argc, argv, &cli);
    if (rc >= 0)
        return rc;
    if (strcmp(docs, "none") == 0)
        docs = NULL;
    if ((rc = stria_bench_shape_check("docplan", &shape)) >= 0 ||
        (rc = stria_bench_masks("docplan", causal, docs, &win, &m)) >= 0) {
        stria_cli_free(&cli);
        return rc;
    }
    rc = 0;
    for (size_t i = 0; i < ranks.n && rc == 0; i++)
        for (size_t j = 0; j < seqs.n && rc == 0; j++)
            rc = run((int)ranks.v[i], seqs.v[j], &m, causal, &shape, (int)reps, json);
    stria_cli_free(&cli);
    return rc;
}
