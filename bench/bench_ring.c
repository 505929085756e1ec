/* stria-bench ring: load balance of the ring layouts, measured side by side.
 *
 * Runs the in-process ring (one thread per rank, single-threaded kernels) for
 * the contiguous layout (Ring Attention with causal block skipping, the
 * baseline) and for the striped and zigzag layouts, on the same inputs. Each
 * rank records the thread CPU time of its kernel calls in every step, so that
 * N ranks sharing fewer cores still give each rank's own compute time. The
 * critical path of a pass is the sum over steps of the slowest rank's compute
 * in that step: what the pass would take with one device per rank and free
 * communication. Its ratio to the contiguous one is the layout's speedup; the
 * ideal for causal attention is 2 - 1/N.
 *
 * The wall time of each pass (first rank's start to last rank's end) is
 * reported too; it measures the real parallel speedup only when every rank
 * has a core of its own (N = 2 on a two-core machine). Figures are medians of
 * --reps runs. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "bench_util.h"
#include "sim.h"
#include "stria_common.h"
#include "stria_kernels.h"
#include "stria_ring.h"
#include "ring_int.h" /* white box: the step-time recorders, timed on their own */

#define STRIA__RB_MAX_LIST 16

typedef struct {
    int64_t ranks[STRIA__RB_MAX_LIST];
    size_t n_ranks;
    int64_t seqs[STRIA__RB_MAX_LIST];
    size_t n_seqs;
    bool layout_on[5]; /* by stria_layout_kind_t (3, auto, unused) */
    bool do_fwd, do_bwd;
    int64_t batch, heads, kv_heads, head_dim;
    stria_dtype_t dtype;
    bool causal;
    int reps;
    bool json;
    bool serialize;     /* one rank works at a time (all but its link waits) */
    bool no_step_times; /* record no step times (measuring what they cost) */
    bool times_cost;    /* --step-times-cost */
    int cpus;           /* online CPUs: wall times are measured for ranks <= cpus */
    /* --documents lognormal:MEDIAN[:SIGMA] (median 0: none); --window */
    int64_t doc_median;
    double doc_sigma;
    bool has_window;
    int64_t window_left, window_right;
    const char *timeline; /* --timeline FILE.svg (NULL: none) */
} stria__rb_opts_t;

/* Results per layout kind, and the contiguous ring without hop skipping
 * (measured beside it when a window is set) in the row of auto. Packed
 * (row 4) is measured with documents only. */
#define STRIA__RB_FULL 3
#define STRIA__RB_ROWS 5

static const char stria__rb_description[] =
    "Runs the in-process ring for the contiguous layout (the baseline) and the\n"
    "striped and zigzag layouts on the same inputs, and reports per layout the\n"
    "critical path (sum over steps of the slowest rank's compute, each rank's\n"
    "compute measured as thread CPU time), the speedup over contiguous, the ideal\n"
    "2 - 1/N (causal), and the wall time of the pass. Medians of --reps runs.";

static const char stria__rb_epilog[] =
    "Wall times come from separate runs with the ranks computing in parallel, made\n"
    "only when every rank has a core of its own (ranks <= online CPUs; for example\n"
    "--ranks 2 on two cores): they show the real parallel speedup.";

/* --layout and --pass, after parsing. */
static int stria__rb_choices(stria__rb_opts_t *o, const char *layout, const char *pass)
{
    stria_layout_kind_t k;
    if (strcmp(layout, "all") == 0) {
        o->layout_on[0] = o->layout_on[1] = o->layout_on[2] = true;
        o->layout_on[STRIA_LAYOUT_PACKED] = true; /* with documents */
    } else if (stria_layout_kind_parse(layout, &k) == STRIA_OK && k != STRIA_LAYOUT_AUTO) {
        o->layout_on[k] = true;
    } else {
        return stria_bench_usage_error(
            "ring", "--layout '%s': expected striped, contiguous, zigzag, packed or all", layout);
    }
    o->do_fwd = strcmp(pass, "fwd") == 0 || strcmp(pass, "both") == 0;
    o->do_bwd = strcmp(pass, "bwd") == 0 || strcmp(pass, "both") == 0;
    if (!o->do_fwd && !o->do_bwd)
        return stria_bench_usage_error("ring", "--pass '%s': expected fwd, bwd or both", pass);
    return -1;
}

/* --documents and --window, after parsing. */
static int stria__rb_masks(stria__rb_opts_t *o, const char *docs, const stria_int_list_t *win)
{
    stria_bench_masks_t m;
    int rc = stria_bench_masks("ring", o->causal, docs, win, &m);
    o->doc_median = m.doc_median;
    o->doc_sigma = m.doc_sigma;
    o->has_window = m.has_window;
    o->window_left = m.window_left;
    o->window_right = m.window_right;
    return rc;
}

/* Returns -1 to continue, else an exit code. */
static int stria__rb_parse(int argc, char **argv, stria__rb_opts_t *o)
{
    stria_int_list_t ranks = {0}, seqs = {0}, win = {0};
    const char *layout = NULL, *pass = NULL, *docs = NULL;
    int64_t reps = 0;
    bool serialize = true;
    const stria_option_t own[] = {
        STRIA_OPTION("ranks", INTS, &ranks, "N[,N...]", "ring sizes", .dflt = "4", .min = 1,
                     .max = 64, .max_items = STRIA__RB_MAX_LIST),
        STRIA_OPTION("seq", INTS, &seqs, "S[,S...]", "global sequence lengths", .dflt = "16384",
                     .min = 1, .max = 1 << 20, .max_items = STRIA__RB_MAX_LIST),
        STRIA_OPTION(
            "layout", STRING, &layout, "L",
            "striped | contiguous | zigzag | all (the contiguous baseline is always measured)",
            .dflt = "all"),
        STRIA_OPTION("pass", STRING, &pass, "P", "fwd | bwd | both", .dflt = "both"),
        STRIA_OPTION("batch", INT, &o->batch, "B", "batch size", .dflt = "1", .min = 1,
                     .max = 1024),
        STRIA_OPTION("causal", FLAG, &o->causal, NULL, "causal mask (the default)"),
        STRIA_OPTION("no-causal", UNFLAG, &o->causal, NULL,
                     "no mask (every layout is balanced; ideal speedup 1)"),
        STRIA_OPTION("reps", INT, &reps, "R", "runs per layout, median reported", .dflt = "3",
                     .min = 1, .max = 100),
        STRIA_OPTION("no-serialize", UNFLAG, &serialize, NULL,
                     "let the ranks compute concurrently while their compute is measured (default: "
                     "one rank works at a time, everything but its link waits, so that rank "
                     "threads sharing cores and caches do not slow each other down)"),
        STRIA_OPTION("json", FLAG, &o->json, NULL,
                     "one JSON object per (layout, ranks, seq, pass) per line"),
        STRIA_OPTION("documents", STRING, &docs, "lognormal:MEDIAN[:SIGMA]",
                     "packed documents (cu_seqlens) with lengths drawn log-normal around MEDIAN "
                     "tokens (SIGMA of the log, default 1), fixed seed; the last one cut at S"),
        STRIA_OPTION("timeline", STRING, &o->timeline, "FILE.svg",
                     "after measuring, run each layout's passes once more with the ranks computing "
                     "at once and draw their recorded step times: one panel per (layout, pass) on "
                     "a shared time axis, a row per rank (one --ranks and one --seq only)"),
        STRIA_OPTION("step-times-cost", FLAG, &o->times_cost, NULL,
                     "instead of the layouts: what recording the step times costs, striped forward "
                     "and backward passes with and without them, interleaved (process CPU time per "
                     "pass, medians of 2 x --reps runs)"),
        STRIA_OPTION("window", INTS, &win, "LEFT[,RIGHT]",
                     "sliding window (RIGHT default 0); the contiguous ring is then also measured "
                     "with every hop (\"contiguous-all-hops\") beside its hop-skipping forward",
                     .min = -1, .max = (double)((int64_t)1 << 40), .max_items = 2),
    };
    stria_option_t opts[sizeof(own) / sizeof(own[0]) + STRIA_BENCH_SHAPE_OPTS + 1] = {{0}};
    stria_bench_shape_t shape = {0};
    memcpy(opts, own, sizeof(own));
    stria_bench_shape_options(opts + sizeof(own) / sizeof(own[0]), &shape, 1024);
    const stria_command_t cmd = {.name = "ring",
                                 .description = stria__rb_description,
                                 .epilog = stria__rb_epilog,
                                 .options = opts};
    stria_cli_t cli;

    memset(o, 0, sizeof(*o));
    o->causal = true;
    o->cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    int rc = stria_bench_parse(&cmd, argc, argv, &cli);
    if (rc < 0) {
        o->n_ranks = ranks.n;
        memcpy(o->ranks, ranks.v, ranks.n * sizeof(int64_t));
        o->n_seqs = seqs.n;
        memcpy(o->seqs, seqs.v, seqs.n * sizeof(int64_t));
        o->reps = (int)reps;
        o->serialize = serialize;
        rc = stria__rb_choices(o, layout, pass);
        if (rc < 0)
            rc = stria__rb_masks(o, docs, &win);
    }
    stria_cli_free(&cli);
    if (rc >= 0)
        return rc;
    if (stria_bench_shape_check("ring", &shape) >= 0)
        return 2;
    if (o->timeline != NULL && (o->n_ranks != 1 || o->n_seqs != 1))
        return stria_bench_usage_error("ring",
                                       "--timeline draws one ring: give one --ranks and "
                                       "one --seq (got %zu and %zu)",
                                       o->n_ranks, o->n_seqs);
    if (o->timeline != NULL && o->timeline[0] == '\0')
        return stria_bench_usage_error("ring", "--timeline: empty file name");
    o->heads = shape.heads;
    o->kv_heads = shape.kv_heads;
    o->head_dim = shape.head_dim;
    o->dtype = shape.dtype;
    return -1;
}

/* ---- measurement ---------------------------------------------------------- */

/* Full tensors of one (S) configuration, shared by every run. */
typedef struct {
    int64_t seq;
    size_t nq, nk, nl;
    void *q, *k, *v, *d_o, *o;
    float *lse;
    float *dq, *dk, *dv;
    int64_t *cu; /* documents (NULL: none) */
    size_t n_cu;
} stria__rb_data_t;

static void stria__rb_data_free(stria__rb_data_t *d)
{
    void *all[] = {d->q, d->k, d->v, d->d_o, d->o, d->lse, d->dq, d->dk, d->dv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        stria_free(all[i]);
    free(d->cu);
    memset(d, 0, sizeof(*d));
}

static stria_status_t stria__rb_data_init(const stria__rb_opts_t *o, int64_t seq,
                                          stria__rb_data_t *d)
{
    size_t es = stria_dtype_size(o->dtype);
    memset(d, 0, sizeof(*d));
    d->seq = seq;
    d->nq = (size_t)(o->batch * seq * o->heads * o->head_dim);
    d->nk = (size_t)(o->batch * seq * o->kv_heads * o->head_dim);
    d->nl = (size_t)(o->batch * o->heads * seq);
    d->q = stria_malloc_aligned(d->nq * es);
    d->k = stria_malloc_aligned(d->nk * es);
    d->v = stria_malloc_aligned(d->nk * es);
    d->d_o = stria_malloc_aligned(d->nq * es);
    d->o = stria_malloc_aligned(d->nq * es);
    d->lse = stria_malloc_aligned(d->nl * sizeof(float));
    d->dq = stria_malloc_aligned(d->nq * sizeof(float));
    d->dk = stria_malloc_aligned(d->nk * sizeof(float));
    d->dv = stria_malloc_aligned(d->nk * sizeof(float));
    if (d->q == NULL || d->k == NULL || d->v == NULL || d->d_o == NULL || d->o == NULL ||
        d->lse == NULL || d->dq == NULL || d->dk == NULL || d->dv == NULL) {
        stria__rb_data_free(d);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the tensors of S=%lld",
                               (long long)seq);
    }
    stria_bench_fill(d->q, o->dtype, d->nq, 1);
    stria_bench_fill(d->k, o->dtype, d->nk, 2);
    stria_bench_fill(d->v, o->dtype, d->nk, 3);
    stria_bench_fill(d->d_o, o->dtype, d->nq, 4);
    if (o->doc_median > 0 &&
        (d->cu = stria_bench_documents(o->doc_median, o->doc_sigma, seq, &d->n_cu)) == NULL) {
        stria__rb_data_free(d);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the documents");
    }
    return STRIA_OK;
}

typedef struct {
    double critical_s; /* sum over steps of the slowest rank's compute */
    double total_s;    /* sum over ranks and steps */
    double wall_s;
    int steps;      /* steps in which some rank computed or moved bytes */
    uint64_t bytes; /* sent over the ring, all ranks */
} stria__rb_run_t;

/* The ring shape of the job the options and data describe. */
static stria_ring_shape_t stria__rb_shape(const stria__rb_opts_t *o, const stria__rb_data_t *d)
{
    stria_ring_shape_t shape = {.call = {.batch = o->batch,
                                         .seq_len = d->seq,
                                         .causal = o->causal,
                                         .cu_seqlens = d->cu,
                                         .n_cu_seqlens = d->n_cu,
                                         .has_window = o->has_window,
                                         .window_left = o->window_left,
                                         .window_right = o->window_right},
                                .heads = o->heads,
                                .kv_heads = o->kv_heads,
                                .head_dim = o->head_dim,
                                .dtype = o->dtype};
    return shape;
}

/* Row k of the results: a layout kind, or STRIA__RB_FULL (contiguous with
 * every hop). */
static stria_status_t stria__rb_run(const stria__rb_opts_t *o, stria__rb_data_t *d, int n, int row,
                                    bool bwd, bool serialize, double *compute, stria__rb_run_t *out,
                                    stria_ring_step_stats_t *keep)
{
    stria_ring_shape_t shape = stria__rb_shape(o, d);
    /* No deadline: a loaded machine must not turn a long step into an error. */
    stria_ring_local_opts_t lo = {.layout = row == STRIA__RB_FULL ? STRIA_LAYOUT_CONTIGUOUS
                                                                  : (stria_layout_kind_t)row,
                                  .all_hops = row == STRIA__RB_FULL,
                                  .n_ranks = n,
                                  .passes = bwd ? STRIA_RING_PASS_BWD : STRIA_RING_PASS_FWD,
                                  .step_timeout_s = -1.0,
                                  .serialize_compute = serialize,
                                  .no_step_times = o->no_step_times};
    stria_ring_local_io_t io = {.q = d->q,
                                .k = d->k,
                                .v = d->v,
                                .o = d->o,
                                .o_dtype = o->dtype,
                                .lse = d->lse,
                                .d_o = d->d_o,
                                .dq = d->dq,
                                .dk = d->dk,
                                .dv = d->dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    stria_ring_step_stats_t *steps = calloc((size_t)(n * n), sizeof(*steps));
    stria_ring_local_stats_t stats = {0};
    stria_status_t st;

    if (steps == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    if (bwd)
        stats.bwd_steps = steps;
    else
        stats.fwd_steps = steps;
    st = stria_ring_run_local(&shape, &lo, &io, &stats);
    if (st == STRIA_OK) {
        memset(out, 0, sizeof(*out));
        for (int s = 0; s < n; s++) {
            double mx = 0;
            for (int r = 0; r < n; r++) {
                const stria_ring_step_stats_t *ss = &steps[r * n + s];
                double c = ss->compute_s;
                if (compute != NULL)
                    compute[r * n + s] = c;
                mx = c > mx ? c : mx;
                out->total_s += c;
                out->bytes += ss->bytes_sent;
                if (ss->computed || ss->bytes_sent > 0 || ss->bytes_recv > 0)
                    out->steps = s + 1 > out->steps ? s + 1 : out->steps;
            }
            out->critical_s += mx;
        }
        out->wall_s = bwd ? stats.bwd_wall_s : stats.fwd_wall_s;
        if (keep != NULL)
            memcpy(keep, steps, (size_t)(n * n) * sizeof(*steps));
    }
    free(steps);
    return st;
}

typedef struct {
    double critical_s;      /* from the median compute of every (rank, step) */
    double critical_best_s; /* from the fastest compute of every (rank, step) */
    double critical_run_s;  /* median over runs of each run's critical path */
    double total_s;
    /* runs with the ranks computing at once (ranks <= cpus only; else < 0) */
    double wall_s, wall_min_s; /* median and best wall time */
    double par_critical_s;     /* critical path of their CPU times */
    double max_mean;           /* busiest rank's work over the mean rank's (measured time) */
    double max_mean_counted;   /* the same of the score elements the kernels compute */
    int steps;                 /* of the last run */
    uint64_t bytes;
} stria__rb_result_t;

/* Whether results row k is measured (contiguous always: the baseline). */
static bool stria__rb_row_on(const stria__rb_opts_t *o, int k)
{
    if (k == STRIA__RB_FULL)
        return o->has_window || o->doc_median > 0;
    if (k == STRIA_LAYOUT_PACKED)
        return o->layout_on[k] && o->doc_median > 0;
    return o->layout_on[k] || k == STRIA_LAYOUT_CONTIGUOUS;
}

/* Whether this run measures wall times: only with a core per rank. */
static bool stria__rb_wall(const stria__rb_opts_t *o, int n)
{
    return n <= o->cpus;
}

/* Critical path and total from the median over runs of every (rank, step)
 * of comp[rep][rank][step], and (best_out, when not NULL) the critical path
 * from the fastest run of every (rank, step): interference from other
 * processes only ever adds time, so the fastest run is the closest to a
 * rank's own cost, and the maximum over ranks of medians still carries the
 * noise that remains in each median. */
static void stria__rb_crit(const double *comp, int reps, int n, double *crit_out, double *total_out,
                           double *best_out, double *max_mean_out)
{
    size_t nn = (size_t)n * (size_t)n;
    double tmp[100], crit = 0, total = 0, best = 0, busiest = 0;
    for (int r = 0; r < n && max_mean_out != NULL; r++) {
        double work = 0;
        for (int s = 0; s < n; s++) {
            for (int rep = 0; rep < reps; rep++)
                tmp[rep] = comp[(size_t)rep * nn + (size_t)(r * n + s)];
            work += stria_bench_median(tmp, reps);
        }
        busiest = work > busiest ? work : busiest;
    }
    for (int s = 0; s < n; s++) {
        double mx = 0, mx_best = 0;
        for (int r = 0; r < n; r++) {
            for (int rep = 0; rep < reps; rep++)
                tmp[rep] = comp[(size_t)rep * nn + (size_t)(r * n + s)];
            double med = stria_bench_median(tmp, reps); /* sorts tmp */
            mx = med > mx ? med : mx;
            mx_best = tmp[0] > mx_best ? tmp[0] : mx_best;
            total += med;
        }
        crit += mx;
        best += mx_best;
    }
    *crit_out = crit;
    *total_out = total;
    if (max_mean_out != NULL)
        *max_mean_out = total > 0 ? busiest / (total / n) : 1.0;
    if (best_out != NULL)
        *best_out = best;
}

static stria_status_t stria__rb_counted(const stria__rb_opts_t *o, const stria__rb_data_t *d, int n,
                                        int row, bool bwd, double *max_mean_out);

/* Runs every selected layout --reps times, interleaved (so that a change in
 * the machine's load touches every layout alike), and takes medians.
 *
 * The critical path is taken from the median compute time of every
 * (rank, step) over the runs: the maximum over ranks of single noisy
 * samples would favour layouts where fewer ranks are busy in a step (the
 * contiguous one), since the maximum of more samples of the same noise is
 * larger. The median over runs of each run's own critical path is reported
 * beside it. With serialised compute, wall times come from extra runs
 * without it, whose CPU times give a second critical path: both ranks
 * computing at once on their own cores, as in the wall time, but free of
 * the time other processes take from those cores. */
static stria_status_t stria__rb_measure(const stria__rb_opts_t *o, stria__rb_data_t *d, int n,
                                        bool bwd, stria__rb_result_t res[STRIA__RB_ROWS])
{
    size_t nn = (size_t)n * (size_t)n, per_layout = (size_t)o->reps * nn;
    double crit[STRIA__RB_ROWS][100], wall[STRIA__RB_ROWS][100], unused;
    double *comp = calloc(2 * STRIA__RB_ROWS * per_layout, sizeof(double));
    double *comp_par = comp + STRIA__RB_ROWS * per_layout;
    bool want_wall = stria__rb_wall(o, n);
    stria_status_t st = STRIA_OK;

    if (comp == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    /* rep -1 warms up: the first kernel calls of a process fault in their
     * workspaces, which would be charged to whichever layout runs first */
    for (int rep = -1; rep < o->reps && st == STRIA_OK; rep++)
        for (int k = 0; k < STRIA__RB_ROWS && st == STRIA_OK; k++) {
            stria__rb_run_t run;
            size_t at = (size_t)k * per_layout + (size_t)(rep < 0 ? 0 : rep) * nn;
            if (!stria__rb_row_on(o, k))
                continue;
            st = stria__rb_run(o, d, n, k, bwd, o->serialize, rep < 0 ? NULL : comp + at, &run,
                               NULL);
            if (st != STRIA_OK || rep < 0)
                continue;
            res[k].steps = run.steps;
            res[k].bytes = run.bytes;
            crit[k][rep] = run.critical_s;
            wall[k][rep] = run.wall_s;
            if (!o->serialize)
                memcpy(comp_par + at, comp + at, nn * sizeof(double));
            else if (want_wall)
                st = stria__rb_run(o, d, n, k, bwd, false, comp_par + at, &run, NULL);
            wall[k][rep] = run.wall_s;
        }
    for (int k = 0; k < STRIA__RB_ROWS && st == STRIA_OK; k++) {
        if (!stria__rb_row_on(o, k))
            continue;
        stria__rb_crit(comp + (size_t)k * per_layout, o->reps, n, &res[k].critical_s,
                       &res[k].total_s, &res[k].critical_best_s, &res[k].max_mean);
        res[k].critical_run_s = stria_bench_median(crit[k], o->reps);
        st = stria__rb_counted(o, d, n, k, bwd, &res[k].max_mean_counted);
        res[k].wall_s = res[k].wall_min_s = res[k].par_critical_s = -1.0;
        if (want_wall) {
            stria__rb_crit(comp_par + (size_t)k * per_layout, o->reps, n, &res[k].par_critical_s,
                           &unused, NULL, NULL);
            res[k].wall_s = stria_bench_median(wall[k], o->reps); /* sorts wall[k] */
            res[k].wall_min_s = wall[k][0];
        }
    }
    free(comp);
    return st;
}

/* The busiest rank's work over the mean rank's, counted: the (query, key)
 * score elements the kernels compute under the masks with their own tiles
 * and sub-blocks (stria_sim_table, no kernel runs), summed over the rank's
 * steps of the pass. Deterministic, so the balance of a layout shows apart
 * from the noise of a shared machine. */
static stria_status_t stria__rb_counted(const stria__rb_opts_t *o, const stria__rb_data_t *d, int n,
                                        int row, bool bwd, double *max_mean_out)
{
    stria_ring_shape_t shape = stria__rb_shape(o, d);
    stria_layout_kind_t layout =
        row == STRIA__RB_FULL ? STRIA_LAYOUT_CONTIGUOUS : (stria_layout_kind_t)row;
    stria_sim_table_t t;
    stria_status_t st = stria_sim_table(&shape, layout, n, 0, 0, &t);
    if (st != STRIA_OK)
        return st;
    int steps = bwd ? n : t.fwd_steps;
    double busiest = 0, total = 0;
    for (int r = 0; r < n; r++) {
        double work = 0;
        for (int s = 0; s < steps; s++) {
            const stria_sim_cell_t *c = &t.cells[r * n + s];
            if (c->computed)
                work += (double)(c->full_elems + c->partial_elems);
        }
        busiest = work > busiest ? work : busiest;
        total += work;
    }
    *max_mean_out = total > 0 ? busiest / (total / n) : 1.0;
    stria_sim_table_free(&t);
    return STRIA_OK;
}

/* ---- single blocks ------------------------------------------------------- */

/* Thread CPU time of one kernel call on one shard-sized block pair, alone
 * and warm, for the block kinds of a causal ring: a fully visible block, a
 * contiguous diagonal block, and the two striped ones (diagonal included,
 * j <= r, or excluded, j > r). They bound what any schedule can reach with
 * this kernel, apart from the ring itself. */
typedef struct {
    double full, diag, incl, excl;
} stria__rb_blocks_t;

static stria_status_t stria__rb_blocks(const stria__rb_opts_t *o, const stria__rb_data_t *d, int n,
                                       bool bwd, stria__rb_blocks_t *out)
{
    const int64_t B = o->batch, S = d->seq, H = o->heads, Hkv = o->kv_heads, D = o->head_dim;
    const int64_t L = (S + n - 1) / n;
    const size_t nq = (size_t)(B * L * H * D), nk = (size_t)(B * L * Hkv * D);
    const size_t nl = (size_t)(B * H * L);
    float *buf = stria_calloc_aligned((2 * nq + 2 * nk + 2 * nl) * sizeof(float));
    stria_status_t st = STRIA_OK;
    double times[100];

    if (buf == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    float *o_ = buf, *dq = buf + nq, *dk = dq + nq, *dv = dk + nk, *lse = dv + nk;
    float *delta = lse + nl;
    /* the first L tokens of every batch row of the full tensors */
    stria_tensor_t tq = {d->q, o->dtype, S * H * D, H * D, D};
    stria_tensor_t tg = {d->d_o, o->dtype, S * H * D, H * D, D};
    stria_tensor_t tk = {d->k, o->dtype, S * Hkv * D, Hkv * D, D};
    stria_tensor_t tv = {d->v, o->dtype, S * Hkv * D, Hkv * D, D};
    stria_tensor_t to = stria_tensor_contiguous(o_, STRIA_DTYPE_F32, L, H, D);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, L, H, D);
    stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, L, Hkv, D);
    stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, L, Hkv, D);
    const struct {
        stria_pos_run_t q, k;
        double *out;
    } cases[4] = {
        {{L, 1, L}, {0, 1, L}, &out->full},
        {{0, 1, L}, {0, 1, L}, &out->diag},
        {{1, n, L}, {0, n, L}, &out->incl},
        {{0, n, L}, {1, n, L}, &out->excl},
    };

    for (int c = 0; c < 4 && st == STRIA_OK; c++) {
        stria_ring_shape_t shape = {.call = {.batch = B, .seq_len = L, .causal = true},
                                    .heads = H,
                                    .kv_heads = Hkv,
                                    .head_dim = D,
                                    .dtype = o->dtype};
        stria_attn_params_t p = stria_ring_shape_attn_params(&shape);
        p.q_pos.runs = &cases[c].q;
        p.q_pos.n_runs = 1;
        p.kv_pos.runs = &cases[c].k;
        p.kv_pos.n_runs = 1;
        if (bwd && ((st = stria_attn_fwd(&p, &tq, &tk, &tv, &to, lse, false)) != STRIA_OK ||
                    (st = stria_attn_bwd_delta(&p, &to, &tg, delta)) != STRIA_OK))
            break;
        for (int rep = -1; rep < o->reps && st == STRIA_OK; rep++) {
            double c0 = stria_time_thread_cpu();
            st = bwd ? stria_attn_bwd(&p, &tq, &tk, &tv, &tg, lse, delta, &tdq, &tdk, &tdv)
                     : stria_attn_fwd(&p, &tq, &tk, &tv, &to, lse, false);
            if (rep >= 0)
                times[rep] = stria_time_thread_cpu() - c0;
        }
        if (st == STRIA_OK)
            *cases[c].out = stria_bench_median(times, o->reps);
    }
    stria_free(buf);
    return st;
}

/* The striped speedup these block costs allow: contiguous pays a diagonal
 * block and N - 1 full ones on its slowest rank; striped rank r pays r + 1
 * blocks with the diagonal and N - 1 - r without. */
static double stria__rb_block_limit(const stria__rb_blocks_t *b, int n)
{
    double worst = 0;
    for (int r = 0; r < n; r++) {
        double t = (r + 1) * b->incl + (n - 1 - r) * b->excl;
        worst = t > worst ? t : worst;
    }
    return (b->diag + (n - 1) * b->full) / worst;
}

static const char *stria__rb_row_name(int k)
{
    return k == STRIA__RB_FULL ? "contiguous-all-hops" : stria_layout_kind_name(k);
}

static void stria__rb_report(const stria__rb_opts_t *o, int n, const stria__rb_data_t *d, bool bwd,
                             const stria__rb_result_t res[STRIA__RB_ROWS],
                             const stria__rb_blocks_t *blocks)
{
    const int64_t seq = d->seq;
    char masks[128] = "";
    double limit = o->causal ? stria__rb_block_limit(blocks, n) : 1.0;
    const char *pass = bwd ? "bwd" : "fwd";
    /* 2 - 1/N is the ideal of a plain causal mask; documents and windows
     * have their own (1 shown). */
    const bool masked = o->has_window || o->doc_median > 0;
    double ideal = o->causal && !masked ? 2.0 - 1.0 / n : 1.0;
    const stria__rb_result_t *base = &res[STRIA_LAYOUT_CONTIGUOUS];
    static const int order[STRIA__RB_ROWS] = {STRIA_LAYOUT_CONTIGUOUS, STRIA__RB_FULL,
                                              STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_ZIGZAG,
                                              STRIA_LAYOUT_PACKED};

    if (d->cu != NULL)
        snprintf(masks, sizeof(masks), ", %zu documents (log-normal, median %lld)", d->n_cu - 1,
                 (long long)o->doc_median);
    if (o->has_window)
        snprintf(masks + strlen(masks), sizeof(masks) - strlen(masks), ", window (%lld, %lld)",
                 (long long)o->window_left, (long long)o->window_right);
    if (!o->json) {
        printf("stria-bench ring: N=%d S=%lld B=%lld H=%lld/%lld D=%lld %s %s%s, %s pass, "
               "kernel %s, %s compute, median of %d\n",
               n, (long long)seq, (long long)o->batch, (long long)o->heads, (long long)o->kv_heads,
               (long long)o->head_dim, o->causal ? "causal" : "non-causal",
               stria_dtype_name(o->dtype), masks, pass, stria_kernels_variant(),
               o->serialize ? "serialised" : "concurrent", o->reps);
        printf("  %-19s %12s %13s %7s %8s %8s %5s %9s %7s %8s %6s %8s %6s %6s %6s\n", "layout",
               "critical (s)", "total cpu (s)", "balance", "max/mean", "counted", "steps",
               "MiB sent", "speedup", "of ideal", "run x", "wall (s)", "wall x", "min x", "par x");
    }
    for (int i = 0; i < STRIA__RB_ROWS; i++) {
        int k = order[i];
        const stria__rb_result_t *r = &res[k];
        char wall[32], wall_x[32], wall_min_x[32], par_x[32], block_json[256] = "";
        if (k == STRIA__RB_FULL || k == STRIA_LAYOUT_PACKED ? !stria__rb_row_on(o, k)
                                                            : !o->layout_on[k])
            continue;
        if (o->causal)
            snprintf(block_json, sizeof(block_json),
                     "\"block_full_s\":%.6f,\"block_diag_s\":%.6f,\"block_striped_incl_s\":%.6f,"
                     "\"block_striped_excl_s\":%.6f,\"block_limited_striped_speedup\":%.4f,",
                     blocks->full, blocks->diag, blocks->incl, blocks->excl, limit);
        double speedup = base->critical_s / r->critical_s;
        char window_json[64] = "null";
        if (o->has_window)
            snprintf(window_json, sizeof(window_json), "[%lld,%lld]", (long long)o->window_left,
                     (long long)o->window_right);
        /* balance: mean rank compute over the critical path (1 = no idling) */
        double balance = r->total_s / (n * r->critical_s);
        if (r->wall_s > 0 && base->wall_s > 0) {
            snprintf(wall, sizeof(wall), "%.4f", r->wall_s);
            snprintf(wall_x, sizeof(wall_x), "%.3f", base->wall_s / r->wall_s);
            snprintf(wall_min_x, sizeof(wall_min_x), "%.3f", base->wall_min_s / r->wall_min_s);
            snprintf(par_x, sizeof(par_x), "%.3f", base->par_critical_s / r->par_critical_s);
        } else {
            const char *none = o->json ? "null" : "-";
            snprintf(wall, sizeof(wall), "%s", none);
            snprintf(wall_x, sizeof(wall_x), "%s", none);
            snprintf(wall_min_x, sizeof(wall_min_x), "%s", none);
            snprintf(par_x, sizeof(par_x), "%s", none);
        }
        if (o->json)
            printf("{\"layout\":\"%s\",\"ranks\":%d,\"seq\":%lld,\"pass\":\"%s\",\"batch\":%lld,"
                   "\"heads\":%lld,\"kv_heads\":%lld,\"head_dim\":%lld,\"dtype\":\"%s\","
                   "\"causal\":%s,\"kernel\":\"%s\",\"serialized\":%s,\"reps\":%d,"
                   "\"critical_path_s\":%.6f,\"critical_path_run_median_s\":%.6f,"
                   "\"critical_path_best_s\":%.6f,\"best_speedup_vs_contiguous\":%.4f,"
                   "\"run_median_speedup_vs_contiguous\":%.4f,"
                   "\"total_compute_s\":%.6f,\"balance\":%.4f,"
                   "\"speedup_vs_contiguous\":%.4f,\"ideal_speedup\":%.4f,"
                   "\"fraction_of_ideal\":%.4f,%s\"wall_s\":%s,"
                   "\"wall_speedup_vs_contiguous\":%s,\"wall_min_speedup_vs_contiguous\":%s,"
                   "\"parallel_cpu_speedup_vs_contiguous\":%s,\"max_mean_rank_work\":%.4f,"
                   "\"max_mean_rank_work_counted\":%.4f,"
                   "\"steps\":%d,\"bytes_sent\":%llu,\"documents\":%zu,\"window\":%s}\n",
                   stria__rb_row_name(k), n, (long long)seq, pass, (long long)o->batch,
                   (long long)o->heads, (long long)o->kv_heads, (long long)o->head_dim,
                   stria_dtype_name(o->dtype), o->causal ? "true" : "false",
                   stria_kernels_variant(), o->serialize ? "true" : "false", o->reps, r->critical_s,
                   r->critical_run_s, r->critical_best_s,
                   base->critical_best_s / r->critical_best_s,
                   base->critical_run_s / r->critical_run_s, r->total_s, balance, speedup, ideal,
                   speedup / ideal, block_json, wall, wall_x, wall_min_x, par_x, r->max_mean,
                   r->max_mean_counted, r->steps, (unsigned long long)r->bytes,
                   d->cu != NULL ? d->n_cu - 1 : 0, window_json);
        else
            printf("  %-19s %12.4f %13.4f %7.3f %8.3f %8.3f %5d %9.1f %7.3f %7.1f%% %6.3f %8s %6s "
                   "%6s %6s\n",
                   stria__rb_row_name(k), r->critical_s, r->total_s, balance, r->max_mean,
                   r->max_mean_counted, r->steps, (double)r->bytes / (1 << 20), speedup,
                   100.0 * speedup / ideal, base->critical_run_s / r->critical_run_s, wall, wall_x,
                   wall_min_x, par_x);
    }
    if (!o->json) {
        printf("  ideal speedup over contiguous: %.3f%s; critical path from the median compute\n"
               "  of every (rank, step); run x: speedup of the median per-run critical paths;\n"
               "  wall x / min x: speedup of the median / best wall time of runs with every rank\n"
               "  on its own core; par x: speedup of those runs' CPU-time critical paths;\n"
               "  max/mean: the busiest rank's compute time over the mean rank's; counted: the\n"
               "  same of the score elements the kernels compute (counted, no timing noise)\n",
               ideal,
               masked      ? " (documents or a window: the ideal depends on the masks)"
               : o->causal ? " (2 - 1/N)"
                           : " (non-causal: every layout is balanced)");
        printf("  from the fastest run of every (rank, step):");
        for (int i = 2; i < STRIA__RB_ROWS; i++) {
            const stria__rb_result_t *r = &res[order[i]];
            if (!o->layout_on[order[i]] || !stria__rb_row_on(o, order[i]))
                continue;
            double x = base->critical_best_s / r->critical_best_s;
            printf(" %s %.3f (%.1f%% of ideal)", stria_layout_kind_name(order[i]), x,
                   100.0 * x / ideal);
        }
        printf("\n");
        if (o->causal)
            printf("  one block of %lld tokens alone: full %.4f s, contiguous diagonal %.4f s,\n"
                   "  striped %.4f s (diagonal in) / %.4f s (out): these costs allow a striped\n"
                   "  speedup of %.3f (%.1f%% of ideal)\n",
                   (long long)((seq + n - 1) / n), blocks->full, blocks->diag, blocks->incl,
                   blocks->excl, limit, 100.0 * limit / ideal);
    }
    fflush(stdout);
}

/* ---- what the step times cost ----------------------------------------------- */

/* What the step-time recorders cost on their own: the calls a pass of n
 * steps makes (a step start, compute and wait spans, a send posted and seen
 * complete per step, then the pass's finish), each with a clock read of its
 * own (a pass shares the clock reads of its compute and wait accounting, so
 * this is an upper bound), repeated; seconds per pass's records. */
static double stria__rb_recorder_cost(int n, long *records_out)
{
    stria_ring_pass_t p;
    memset(&p, 0, sizeof(p));
    p.stats = calloc((size_t)n, sizeof(*p.stats));
    if (p.stats == NULL)
        return -1;
    p.steps_run = n;
    stria_link_req_t *fake = (stria_link_req_t *)&p; /* never dereferenced */
    const int reps = 2000;
    long records = 0;
    double t0 = stria_time_now();
    for (int r = 0; r < reps; r++) {
        memset(p.stats, 0, (size_t)n * sizeof(*p.stats));
        p.t_start = stria_time_now();
        for (int s = 0; s < n; s++) {
            stria_ring_step_stats_t *ss = &p.stats[s];
            stria__times_step(&p, s, stria_time_now());
            stria__times_send(&p, fake, ss, false, stria_time_now());
            double a = stria_time_now();
            stria__times_span(&p, ss, STRIA_RING_SPAN_COMPUTE, a, stria_time_now());
            double b = stria_time_now();
            stria__times_span(&p, ss, STRIA_RING_SPAN_WAIT, b, stria_time_now());
            stria__times_waited(&p, fake, stria_time_now());
            records += 5;
        }
        stria__times_finish(&p);
    }
    double per_pass = (stria_time_now() - t0) / reps;
    free(p.stats);
    *records_out = records / reps;
    return per_pass;
}

/* Striped forward + backward passes with and without step times, runs
 * interleaved; the process's CPU time per run (every rank's thread) and its
 * wall time, medians. The step records each rank made say how many there
 * were. */
static stria_status_t stria__rb_times_cost(const stria__rb_opts_t *o, stria__rb_data_t *d, int n)
{
    double cpu[2][100], wall[2][100];
    stria_ring_step_stats_t *st = calloc((size_t)(n * n), sizeof(*st));
    stria_status_t rc =
        st == NULL ? stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory") : STRIA_OK;
    long records = 0;
    for (int rep = -1; rep < o->reps && rc == STRIA_OK; rep++)
        for (int off = 0; off < 2 && rc == STRIA_OK; off++) {
            stria__rb_opts_t oo = *o;
            stria__rb_run_t run;
            oo.no_step_times = off == 1;
            double c0 = stria_bench_process_cpu(), t0 = stria_time_now();
            rc = stria__rb_run(&oo, d, n, STRIA_LAYOUT_STRIPED, false, false, NULL, &run, NULL);
            if (rc == STRIA_OK)
                rc = stria__rb_run(&oo, d, n, STRIA_LAYOUT_STRIPED, true, false, NULL, &run, st);
            if (rep < 0 || rc != STRIA_OK)
                continue;
            cpu[off][rep] = stria_bench_process_cpu() - c0;
            wall[off][rep] = stria_time_now() - t0;
            for (int i = 0; off == 0 && rep == 0 && i < n * n; i++) /* the backward's */
                records += 2 + st[i].times.n_spans + (st[i].times.send_begin >= 0) +
                           (st[i].times.sum_send_begin >= 0);
        }
    long rec_calls = 0;
    double rec_s = rc == STRIA_OK ? stria__rb_recorder_cost(n, &rec_calls) : 0;
    if (rec_s < 0)
        rc = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    if (rc == STRIA_OK) {
        double on = stria_bench_median(cpu[0], o->reps), off = stria_bench_median(cpu[1], o->reps);
        double won = stria_bench_median(wall[0], o->reps);
        double woff = stria_bench_median(wall[1], o->reps);
        /* the recorders' share: every record of forward and backward (about
         * twice the backward's) at the cost of one call measured alone */
        double per_call = rec_s / (double)rec_calls, frac = 2.0 * (double)records * per_call / off;
        if (o->json)
            printf("{\"ranks\":%d,\"seq\":%lld,\"heads\":%lld,\"reps\":%d,"
                   "\"cpu_on_s\":%.6f,\"cpu_off_s\":%.6f,\"cpu_ratio\":%.4f,"
                   "\"wall_on_s\":%.6f,\"wall_off_s\":%.6f,\"wall_ratio\":%.4f,"
                   "\"records_bwd\":%ld,\"recorder_ns_per_call\":%.1f,"
                   "\"recorder_fraction\":%.3e}\n",
                   n, (long long)d->seq, (long long)o->heads, o->reps, on, off, on / off, won, woff,
                   won / woff, records, per_call * 1e9, frac);
        else
            printf("stria-bench ring --step-times-cost: N=%d S=%lld H=%lld, striped forward + "
                   "backward, median of %d\n  process CPU per run: %.4f s with step times, %.4f "
                   "s without (x%.4f); wall %.4f s / %.4f s (x%.4f); %ld step records in the "
                   "backward pass\n  the recorders alone, timed on their own: %.1f ns a call "
                   "with its clock read; for twice the backward's records (forward + backward) "
                   "%.2e of the CPU time without\n",
                   n, (long long)d->seq, (long long)o->heads, o->reps, on, off, on / off, won, woff,
                   won / woff, records, per_call * 1e9, frac);
        fflush(stdout);
    }
    free(st);
    return rc;
}

/* ---- timelines ------------------------------------------------------------ */

/* The job's shape, for titles. */
static void stria__rb_shape_text(const stria__rb_opts_t *o, int n, const stria__rb_data_t *d,
                                 char *out, size_t cap)
{
    int at = snprintf(out, cap, "N=%d ranks, S=%lld, B=%lld, H=%lld/%lld, D=%lld, %s, %s", n,
                      (long long)d->seq, (long long)o->batch, (long long)o->heads,
                      (long long)o->kv_heads, (long long)o->head_dim, stria_dtype_name(o->dtype),
                      o->causal ? "causal" : "non-causal");
    if (d->n_cu > 0 && at > 0 && (size_t)at < cap)
        at += snprintf(out + at, cap - (size_t)at, ", %zu documents", d->n_cu - 1);
    if (o->has_window && at > 0 && (size_t)at < cap)
        snprintf(out + at, cap - (size_t)at, ", window (%lld, %lld)", (long long)o->window_left,
                 (long long)o->window_right);
}

/* A panel of one pass from its recorded step times ([rank][step]). Ranks
 * share the process's clock: each rank's times move by its pass start
 * (origin) minus the earliest rank's. */
static stria_status_t stria__rb_panel(stria_timeline_t *tl, const char *name, int n,
                                      const stria_ring_step_stats_t *st)
{
    double t0 = 0, end = 0, busy = 0;
    char note[128];
    int panel;
    stria_status_t rc;
    for (int r = 0; r < n; r++)
        if (r == 0 || st[r * n].times.origin < t0)
            t0 = st[r * n].times.origin;
    for (int r = 0; r < n; r++)
        for (int s = 0; s < n; s++) {
            const stria_ring_step_times_t *t = &st[r * n + s].times;
            double off = t->origin - t0;
            if (t->origin == 0.0) /* a step the pass did not run */
                continue;
            end = t->end >= 0 && t->end + off > end ? t->end + off : end;
            busy += st[r * n + s].compute_wall_s;
        }
    snprintf(note, sizeof(note), "%.4f s, ranks busy %.0f%% of it", end,
             end > 0 ? 100.0 * busy / (n * end) : 0.0);
    if ((rc = stria_timeline_panel(tl, name, note, n, &panel)) != STRIA_OK)
        return rc;
    stria_timeline_panel_end(tl, panel, end);
    for (int r = 0; r < n && rc == STRIA_OK; r++)
        for (int s = 0; s < n && rc == STRIA_OK; s++) {
            const stria_ring_step_times_t *t = &st[r * n + s].times;
            const double off = t->origin - t0;
            if (t->origin == 0.0)
                continue;
            for (int i = 0; i < t->n_spans && rc == STRIA_OK; i++)
                rc = stria_timeline_span(tl, panel, r,
                                         t->spans[i].kind == STRIA_RING_SPAN_COMPUTE
                                             ? STRIA_TIMELINE_COMPUTE
                                             : STRIA_TIMELINE_WAIT,
                                         t->spans[i].begin + off, t->spans[i].end + off);
            if (rc == STRIA_OK && t->send_begin >= 0 && t->send_end >= t->send_begin)
                rc = stria_timeline_span(tl, panel, r, STRIA_TIMELINE_SEND, t->send_begin + off,
                                         t->send_end + off);
            if (rc == STRIA_OK && t->sum_send_begin >= 0 && t->sum_send_end >= t->sum_send_begin)
                rc = stria_timeline_span(tl, panel, r, STRIA_TIMELINE_SEND, t->sum_send_begin + off,
                                         t->sum_send_end + off);
        }
    return rc;
}

/* One more pass of every layout measured (and direction), the ranks
 * computing at once, drawn from their step times. */
static stria_status_t stria__rb_timeline(const stria__rb_opts_t *o, stria__rb_data_t *d, int n)
{
    static const int order[] = {STRIA_LAYOUT_CONTIGUOUS, STRIA__RB_FULL, STRIA_LAYOUT_STRIPED,
                                STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_PACKED};
    char title[256], sub[256], name[64];
    stria_ring_step_stats_t *st = calloc((size_t)(n * n), sizeof(*st));
    stria_timeline_t *tl = NULL;
    stria_status_t rc;

    if (st == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    stria__rb_shape_text(o, n, d, title, sizeof(title));
    snprintf(sub, sizeof(sub),
             "recorded step times of one run per pass: %d rank threads computing at once on %d "
             "cores (%s kernels), one clock, from the first rank's start",
             n, o->cpus, stria_kernels_variant());
    rc = stria_timeline_create(title, sub, &tl);
    for (int b = 0; b < 2 && rc == STRIA_OK; b++) {
        if ((b == 0 && !o->do_fwd) || (b == 1 && !o->do_bwd))
            continue;
        for (size_t i = 0; i < sizeof(order) / sizeof(order[0]) && rc == STRIA_OK; i++) {
            stria__rb_run_t run;
            if (!stria__rb_row_on(o, order[i]))
                continue;
            rc = stria__rb_run(o, d, n, order[i], b == 1, false, NULL, &run, st);
            snprintf(name, sizeof(name), "%s, %s", stria__rb_row_name(order[i]),
                     b ? "backward" : "forward");
            if (rc == STRIA_OK)
                rc = stria__rb_panel(tl, name, n, st);
        }
    }
    if (rc == STRIA_OK)
        rc = stria_timeline_write_svg(tl, o->timeline);
    if (rc == STRIA_OK && !o->json)
        printf("timeline: %s\n", o->timeline);
    stria_timeline_destroy(tl);
    free(st);
    return rc;
}

int stria_bench_ring(int argc, char **argv)
{
    stria__rb_opts_t o;
    int rc = stria__rb_parse(argc, argv, &o);
    stria_status_t st = STRIA_OK;

    if (rc >= 0)
        return rc;
    for (size_t si = 0; si < o.n_seqs && st == STRIA_OK; si++) {
        stria__rb_data_t d;
        st = stria__rb_data_init(&o, o.seqs[si], &d);
        if (st != STRIA_OK)
            break;
        for (size_t ni = 0; ni < o.n_ranks && st == STRIA_OK; ni++) {
            int n = (int)o.ranks[ni];
            if (o.times_cost) {
                st = stria__rb_times_cost(&o, &d, n);
                continue;
            }
            stria__rb_result_t res[STRIA__RB_ROWS];
            memset(res, 0, sizeof(res));
            stria__rb_blocks_t blocks;
            memset(&blocks, 0, sizeof(blocks));
            if (o.do_fwd) {
                st = stria__rb_measure(&o, &d, n, false, res);
                if (st == STRIA_OK && o.causal)
                    st = stria__rb_blocks(&o, &d, n, false, &blocks);
                if (st == STRIA_OK)
                    stria__rb_report(&o, n, &d, false, res, &blocks);
            } else {
                /* the backward pass needs O and LSE: one untimed forward */
                stria__rb_run_t run;
                st = stria__rb_run(&o, &d, n, STRIA_LAYOUT_STRIPED, false, false, NULL, &run, NULL);
            }
            if (st == STRIA_OK && o.do_bwd) {
                memset(res, 0, sizeof(res));
                st = stria__rb_measure(&o, &d, n, true, res);
                if (st == STRIA_OK && o.causal)
                    st = stria__rb_blocks(&o, &d, n, true, &blocks);
                if (st == STRIA_OK)
                    stria__rb_report(&o, n, &d, true, res, &blocks);
            }
            if (st == STRIA_OK && o.timeline != NULL)
                st = stria__rb_timeline(&o, &d, n);
        }
        stria__rb_data_free(&d);
    }
    return stria_cli_exit("stria-bench ring", st);
}
