/* In-process runs of `stria-bench simulate` (sim_runs.c): calibration of the
 * simulator's costs and measured passes to check it against. */
#ifndef STRIA_BENCH_SIM_RUNS_H
#define STRIA_BENCH_SIM_RUNS_H

#include "sim.h"

/* Ranks of the calibration rings: three, so that the backward pass's first,
 * middle and last steps (query side, host sum, dQ home) come apart. */
#define STRIA_SIM_CAL_RANKS 3
#define STRIA_SIM_MAX_ROWS  512

/* Full tensors of one shape (random inputs), shared by the runs. */
typedef struct {
    void *q, *k, *v, *d_o, *o;
    float *lse, *dq, *dk, *dv;
} stria_sim_inputs_t;

stria_status_t stria_sim_inputs(const stria_ring_shape_t *shape, stria_sim_inputs_t *in);
void stria_sim_inputs_free(stria_sim_inputs_t *in);

/* What a measured pass did, counted (no timing): the K/V steps it ran, the
 * bytes its busiest rank sent, and the (rank, step)s whose source or
 * computed flag differ from a table's (0: the table is the pass's). */
typedef struct {
    int steps;
    uint64_t bytes_sent;
    int cells_differ;
} stria_sim_counted_t;

/* The fastest over reps of every (rank, step)'s compute (thread CPU time,
 * one rank working at a time) of a pass: fastest[rank * n + step]. A
 * backward pass runs its layout's forward first (untimed) for O and LSE.
 * With t and counted (both or neither), the last run's counts against the
 * table t of the same shape, layout and ring. */
stria_status_t stria_sim_measure(const stria_ring_shape_t *shape, stria_layout_kind_t layout, int n,
                                 bool bwd, int reps, stria_sim_inputs_t *in, double *fastest,
                                 const stria_sim_table_t *t, stria_sim_counted_t *counted);

/* Sum over steps of the slowest rank's compute ([rank][step], n x n). */
double stria_sim_critical(const double *comp, int n, int steps);

/* Calibration samples: features and measured compute per (rank, step). */
typedef struct {
    double xf[STRIA_SIM_MAX_ROWS * STRIA_SIM_NCOEF], yf[STRIA_SIM_MAX_ROWS];
    double xb[STRIA_SIM_MAX_ROWS * STRIA_SIM_NCOEF], yb[STRIA_SIM_MAX_ROWS];
    int nf, nb;
} stria_sim_fit_rows_t;

/* Measures rings of STRIA_SIM_CAL_RANKS ranks of every layout, causal, with
 * shards of `shard` tokens and, with `halves`, of `shard` / 2 too (the
 * shape's batch, heads, head_dim and dtype), fitted together, and fits the
 * kernels' costs (tiles 0 x 0) per unit of work; err_*: RMS relative error
 * of the fits per step. Without `halves` the costs are for blocks of `shard`
 * tokens only (per-token and per-call costs are not told apart). With
 * doc_median > 0 the same rings run again with documents drawn as the bench
 * draws them (stria_bench_documents(doc_median, doc_sigma)), packed among the
 * layouts: under causality alone a call's partial tiles are its diagonal's,
 * as many in every call, so their cost cannot be told from a call's; a call
 * with documents has many more, in other proportions. */
stria_status_t stria_sim_calibrate(const stria_ring_shape_t *shape, int64_t shard, bool halves,
                                   int64_t doc_median, double doc_sigma, int reps,
                                   stria_sim_costs_t *costs, double *err_fwd, double *err_bwd);

#endif
