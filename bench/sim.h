/* The pass simulator of `stria-bench simulate`: what a ring pass of N ranks
 * would take, from the engine's own plan of every (rank, step) (the ring
 * plan: source block, computed or skipped, bytes), the kernels' own
 * classification of the tiles and sub-blocks each call computes (work
 * counts), a cost per unit of that work (calibrated on this machine or given
 * as a device's rate), and a model of the ring link and of the engine's
 * overlap of transfers with compute (double-buffered K/V, the dK/dV sum one
 * step behind, the closing agreement). */
#ifndef STRIA_BENCH_SIM_H
#define STRIA_BENCH_SIM_H

#include "stria_ring.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Cost coefficients of one direction, in seconds per unit of the features of
 * stria_sim_features(): a step's compute is their dot product. */
enum {
    STRIA_SIM_FULL = 0, /* per (query, key) element x head x dim in full tiles */
    STRIA_SIM_PART,     /* ... in computed sub-blocks (or whole tiles) of partial pairs */
    STRIA_SIM_TOK,      /* per (query + key) token x head x dim of a computed call */
    STRIA_SIM_CALL,     /* per computed call */
    STRIA_SIM_OPEN,     /* per query token x head x dim, step 0: the query side */
    STRIA_SIM_ADD,      /* backward: per dK/dV element added on the host (steps > 0) */
    STRIA_SIM_LAST,     /* backward: per query token x head x dim, last step: dQ home */
    STRIA_SIM_NCOEF
};

typedef struct {
    double fwd[STRIA_SIM_NCOEF], bwd[STRIA_SIM_NCOEF];
    /* tiles of the work counts: 0, 0 for the kernels' own (64 x 64 with 16 x 16
     * sub-blocks); else whole tiles of that size */
    int64_t tile_q, tile_k;
} stria_sim_costs_t;

/* The ring's links, in the coordinator's ring order (workers sorted by host,
 * so the devices of a host are neighbours and rank r sends to r + 1). */
typedef struct {
    int devices_per_host; /* 0: every rank on one host */
    double intra_Bps;     /* bytes/s of a link inside a host */
    double inter_Bps;     /* bytes/s of a link between hosts */
    double latency_s;     /* per message */
    double staging_Bps;   /* device <-> host copies (a GPU: the engine stages through
                           * pinned host memory); 0: the tensors are host memory */
} stria_sim_link_t;

/* One (rank, step) of a pass. */
typedef struct {
    int src;
    bool computed;
    int64_t full_elems, partial_elems; /* per (batch row, head) */
} stria_sim_cell_t;

/* What the engine does in both directions of a pass of a shape: its plan and
 * the work of every computed (rank, step). */
typedef struct {
    stria_ring_shape_t shape;
    stria_layout_kind_t layout;
    int n, fwd_steps;
    stria_sim_cell_t *cells; /* [rank][step], n x n */
    int64_t *valid;          /* real tokens per rank */
    uint64_t msg_bytes, dkv_bytes;
    /* totals over every computed (rank, step), per (batch row, head) */
    int64_t full_tiles, partial_tiles, subblocks, full_elems, partial_elems;
    int memo_keys; /* distinct block pairs classified */
} stria_sim_table_t;

/* Builds the table (shape->call.cu_seqlens borrowed). Block pairs that are the
 * same up to a shift of positions (no documents), or up to an
 * order-preserving relabelling of contiguous runs (no documents, no window),
 * are classified once: the kernels' classes depend only on that. */
stria_status_t stria_sim_table(const stria_ring_shape_t *shape, stria_layout_kind_t layout, int n,
                               int64_t tile_q, int64_t tile_k, stria_sim_table_t *t);
void stria_sim_table_free(stria_sim_table_t *t);

/* The features of step s of rank r (x[STRIA_SIM_NCOEF]). */
void stria_sim_features(const stria_sim_table_t *t, int r, int s, bool bwd, double *x);

typedef struct {
    double pass_s;     /* first rank's start to last rank's end */
    double critical_s; /* sum over steps of the slowest rank's compute */
    double compute_s;  /* all ranks' compute */
    double waited_s;   /* all ranks' time blocked on the link */
    int steps;
    uint64_t bytes_sent; /* by the busiest rank */
} stria_sim_result_t;

/* Spans of a simulated pass, for timelines: kind as stria_timeline_kind_t. */
typedef void (*stria_sim_span_cb)(void *ctx, int rank, int kind, double begin, double end);

/* Simulates one pass (bwd: backward) of the table. */
stria_status_t stria_sim_pass(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                              const stria_sim_link_t *link, bool bwd, stria_sim_result_t *res,
                              stria_sim_span_cb span, void *span_ctx);

/* Least-squares fit of non-negative coefficients: rows of x (n_rows x
 * STRIA_SIM_NCOEF) against y, each row weighted by 1 / y (relative error).
 * Features that are zero in every row get 0. Returns the RMS relative
 * error of the fit. */
double stria_sim_fit(const double *x, const double *y, int n_rows, double *coef);

#ifdef __cplusplus
}
#endif

#endif
