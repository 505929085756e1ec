/* The in-process runs of `stria-bench simulate`: per-(rank, step) compute
 * of real passes, for calibrating the costs (--calibrate) and for checking
 * predictions against measured passes (--measure). */
#include "sim_runs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

void stria_sim_inputs_free(stria_sim_inputs_t *in)
{
    void *all[] = {in->q, in->k, in->v, in->d_o, in->o, in->lse, in->dq, in->dk, in->dv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        stria_free(all[i]);
    memset(in, 0, sizeof(*in));
}

stria_status_t stria_sim_inputs(const stria_ring_shape_t *shape, stria_sim_inputs_t *in)
{
    const size_t es = stria_dtype_size(shape->dtype);
    const size_t nq =
        (size_t)(shape->call.batch * shape->call.seq_len * shape->heads * shape->head_dim);
    const size_t nk =
        (size_t)(shape->call.batch * shape->call.seq_len * shape->kv_heads * shape->head_dim);
    memset(in, 0, sizeof(*in));
    in->q = stria_malloc_aligned(nq * es);
    in->d_o = stria_malloc_aligned(nq * es);
    in->o = stria_malloc_aligned(nq * es);
    in->k = stria_malloc_aligned(nk * es);
    in->v = stria_malloc_aligned(nk * es);
    in->lse =
        stria_malloc_aligned((size_t)(shape->call.batch * shape->heads * shape->call.seq_len) * 4);
    in->dq = stria_malloc_aligned(nq * sizeof(float));
    in->dk = stria_malloc_aligned(nk * sizeof(float));
    in->dv = stria_malloc_aligned(nk * sizeof(float));
    if (in->q == NULL || in->d_o == NULL || in->o == NULL || in->k == NULL || in->v == NULL ||
        in->lse == NULL || in->dq == NULL || in->dk == NULL || in->dv == NULL) {
        stria_sim_inputs_free(in);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate the tensors of S=%lld",
                               (long long)shape->call.seq_len);
    }
    stria_bench_fill(in->q, shape->dtype, nq, 1);
    stria_bench_fill(in->k, shape->dtype, nk, 2);
    stria_bench_fill(in->v, shape->dtype, nk, 3);
    stria_bench_fill(in->d_o, shape->dtype, nq, 4);
    return STRIA_OK;
}

/* One serialised pass; its per-(rank, step) compute into comp[n * n]. */
static stria_status_t stria__sim_run(const stria_ring_shape_t *shape, stria_layout_kind_t layout,
                                     int n, bool bwd, stria_sim_inputs_t *in,
                                     stria_ring_step_stats_t *steps, double *comp)
{
    stria_ring_local_opts_t lo = {.layout = layout,
                                  .n_ranks = n,
                                  .passes = bwd ? STRIA_RING_PASS_BWD : STRIA_RING_PASS_FWD,
                                  .step_timeout_s = -1.0,
                                  .serialize_compute = true};
    stria_ring_local_io_t io = {.q = in->q,
                                .k = in->k,
                                .v = in->v,
                                .o = in->o,
                                .o_dtype = shape->dtype,
                                .lse = in->lse,
                                .d_o = in->d_o,
                                .dq = in->dq,
                                .dk = in->dk,
                                .dv = in->dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    stria_ring_local_stats_t stats = {0};
    if (bwd)
        stats.bwd_steps = steps;
    else
        stats.fwd_steps = steps;
    stria_status_t st = stria_ring_run_local(shape, &lo, &io, &stats);
    for (int i = 0; st == STRIA_OK && comp != NULL && i < n * n; i++)
        comp[i] = steps[i].compute_s;
    return st;
}

/* The counts of a pass's statistics ([rank][step], n x n) against table t:
 * steps run (the last step in which a rank computed or posted anything),
 * the busiest rank's bytes, the cells that differ. */
static void stria__sim_counts(const stria_ring_step_stats_t *steps, int n, bool bwd,
                              const stria_sim_table_t *t, stria_sim_counted_t *out)
{
    memset(out, 0, sizeof(*out));
    for (int r = 0; r < n; r++) {
        uint64_t sent = 0;
        for (int s = 0; s < n; s++) {
            const stria_ring_step_stats_t *ss = &steps[r * n + s];
            const stria_sim_cell_t *c = &t->cells[r * n + s];
            sent += ss->bytes_sent;
            if (ss->computed || ss->bytes_sent > 0 || ss->bytes_recv > 0)
                out->steps = s + 1 > out->steps ? s + 1 : out->steps;
            if (s < (bwd ? n : t->fwd_steps) &&
                (ss->src_rank != c->src || ss->computed != c->computed))
                out->cells_differ++;
        }
        out->bytes_sent = sent > out->bytes_sent ? sent : out->bytes_sent;
    }
    if (n == 1)
        out->steps = 1;
}

stria_status_t stria_sim_measure(const stria_ring_shape_t *shape, stria_layout_kind_t layout, int n,
                                 bool bwd, int reps, stria_sim_inputs_t *in, double *fastest,
                                 const stria_sim_table_t *t, stria_sim_counted_t *counted)
{
    const size_t nn = (size_t)n * (size_t)n;
    stria_ring_step_stats_t *steps = calloc(nn, sizeof(*steps));
    double *comp = calloc(nn * (size_t)reps, sizeof(double));
    double tmp[64];
    stria_status_t st = STRIA_OK;

    if (steps == NULL || comp == NULL || reps < 1 || reps > 64) {
        free(steps);
        free(comp);
        return stria_error_set(STRIA_ERR_NO_MEMORY, "simulate: cannot measure %d reps", reps);
    }
    if (bwd) /* O and LSE of this layout's forward */
        st = stria__sim_run(shape, layout, n, false, in, steps, NULL);
    /* rep -1 warms up (workspaces fault in on the first calls) */
    for (int rep = -1; rep < reps && st == STRIA_OK; rep++)
        st = stria__sim_run(shape, layout, n, bwd, in, steps,
                            rep < 0 ? NULL : comp + (size_t)rep * nn);
    for (size_t i = 0; st == STRIA_OK && i < nn; i++) {
        for (int rep = 0; rep < reps; rep++)
            tmp[rep] = comp[(size_t)rep * nn + i];
        stria_bench_median(tmp, reps); /* sorts */
        fastest[i] = tmp[0];
    }
    if (st == STRIA_OK && t != NULL && counted != NULL)
        stria__sim_counts(steps, n, bwd, t, counted);
    free(steps);
    free(comp);
    return st;
}

double stria_sim_critical(const double *comp, int n, int steps)
{
    double crit = 0;
    for (int s = 0; s < steps; s++) {
        double mx = 0;
        for (int r = 0; r < n; r++)
            mx = comp[r * n + s] > mx ? comp[r * n + s] : mx;
        crit += mx;
    }
    return crit;
}

/* The samples of one calibration shape: every (rank, step) of every layout
 * (packed too with documents), forward and backward, appended to the rows of
 * fit. */
static stria_status_t stria__sim_cal_shape(const stria_ring_shape_t *shape, int n, int reps,
                                           stria_sim_fit_rows_t *fit)
{
    static const stria_layout_kind_t layouts[] = {STRIA_LAYOUT_CONTIGUOUS, STRIA_LAYOUT_STRIPED,
                                                  STRIA_LAYOUT_ZIGZAG, STRIA_LAYOUT_PACKED};
    const size_t n_layouts = shape->call.n_cu_seqlens > 0 ? 4 : 3;
    const size_t nn = (size_t)n * (size_t)n;
    double *med = calloc(nn, sizeof(double));
    stria_sim_inputs_t in;
    stria_status_t st = med == NULL ? stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory")
                                    : stria_sim_inputs(shape, &in);
    for (size_t li = 0; li < n_layouts && st == STRIA_OK; li++) {
        stria_sim_table_t t;
        if ((st = stria_sim_table(shape, layouts[li], n, 0, 0, &t)) != STRIA_OK)
            break;
        for (int b = 0; b < 2 && st == STRIA_OK; b++) {
            double *x = b ? fit->xb : fit->xf, *y = b ? fit->yb : fit->yf;
            int *rows = b ? &fit->nb : &fit->nf;
            st = stria_sim_measure(shape, layouts[li], n, b == 1, reps, &in, med, NULL, NULL);
            const int steps = b ? n : t.fwd_steps;
            for (int r = 0; st == STRIA_OK && r < n; r++)
                for (int s = 0; s < steps && *rows < STRIA_SIM_MAX_ROWS; s++, (*rows)++) {
                    stria_sim_features(&t, r, s, b == 1, x + (size_t)*rows * STRIA_SIM_NCOEF);
                    y[*rows] = med[r * n + s];
                }
        }
        stria_sim_table_free(&t);
    }
    if (med != NULL && st != STRIA_ERR_NO_MEMORY)
        stria_sim_inputs_free(&in);
    free(med);
    return st;
}

stria_status_t stria_sim_calibrate(const stria_ring_shape_t *shape, int64_t shard, bool halves,
                                   int64_t doc_median, double doc_sigma, int reps,
                                   stria_sim_costs_t *costs, double *err_fwd, double *err_bwd)
{
    stria_sim_fit_rows_t *fit = calloc(1, sizeof(*fit));
    stria_status_t st = STRIA_OK;
    if (fit == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
    /* half the length and the length, fitted together: per-element costs
     * grow with the square of a block, per-token ones with its length, so
     * two lengths tell them apart where one cannot. A prediction at the
     * calibrated length itself does not need them apart (its blocks are the
     * calibration's), and a cost per element that changes with the block's
     * size (the caches) would otherwise be averaged over the two lengths. */
    for (int run = halves ? 3 : 1; run >= 0 && st == STRIA_OK; run--) {
        const bool half = run >= 2, docs = run % 2 == 1;
        stria_ring_shape_t cal = *shape;
        int64_t *cu = NULL;
        if (docs && doc_median <= 0)
            continue;
        cal.call.seq_len = STRIA_SIM_CAL_RANKS * (half ? (shard + 1) / 2 : shard);
        cal.call.cu_seqlens = NULL; /* the work counts carry the masks; costs per unit of work */
        cal.call.n_cu_seqlens = 0;
        if (docs && (cu = stria_bench_documents(doc_median, doc_sigma, cal.call.seq_len,
                                                &cal.call.n_cu_seqlens)) == NULL)
            st = stria_error_set(STRIA_ERR_NO_MEMORY, "out of memory");
        cal.call.cu_seqlens = cu;
        cal.call.has_window = false;
        cal.call.window_left = cal.call.window_right = 0;
        cal.call.causal = true;
        if (st == STRIA_OK)
            st = stria__sim_cal_shape(&cal, STRIA_SIM_CAL_RANKS, reps, fit);
        free(cu);
    }
    if (st == STRIA_OK) {
        memset(costs, 0, sizeof(*costs));
        *err_fwd = stria_sim_fit(fit->xf, fit->yf, fit->nf, costs->fwd);
        *err_bwd = stria_sim_fit(fit->xb, fit->yb, fit->nb, costs->bwd);
    }
    free(fit);
    return st;
}
