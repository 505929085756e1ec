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
    /* per (query, key) element x head x dim of the holes of partial pairs (16 x
     * 16 sub-blocks inside a chunk's hull, fully masked: set, not computed;
     * counted apart from PART, which has them out): documents make many */
    STRIA_SIM_HOLE,
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
    int64_t hole_elems;                /* of partial_elems, in holes (kernels' tiles only) */
    int64_t tokens;                    /* query + key tokens of the call, when computed */
    uint64_t dkv_bytes;                /* backward: the dK/dV sum sent on in this step (0: none) */
} stria_sim_cell_t;

/* What the engine does in both directions of a pass of a shape: its plan and
 * the work of every computed (rank, step). */
typedef struct {
    stria_ring_shape_t shape;
    stria_layout_kind_t layout;
    int n, fwd_steps;
    stria_sim_cell_t *cells; /* [rank][step], n x n */
    int64_t *valid;          /* real tokens per rank */
    /* The bytes the engine counts (stria_ring_plan_step()), taken apart: the
     * K/V message of each rank's block ([n]: a packed block's travelling rows
     * only), the closing agreement's per rank, and the largest K/V message
     * and dK/dV sum of any block. */
    uint64_t *kv_bytes;
    uint64_t agree_bytes, msg_bytes, dkv_bytes;
    /* totals over the counted (rank, step)s, per (batch row, head) */
    int64_t full_tiles, partial_tiles, subblocks, full_elems, partial_elems;
    int memo_keys;                 /* distinct block pairs classified */
    int count_stride;              /* 1: every computed (rank, step) counted; see below */
    int64_t cells_counted;         /* computed (rank, step)s whose work was classified */
    size_t docs_kept, docs_spread; /* packed: the document plan's */
    double plan_s;                 /* the engine's plan's wall time (packed: a docplan) */
} stria_sim_table_t;

/* With documents no two block pairs are alike, and classifying every
 * computed (rank, step) costs N^2 tile loops: about 10 s at N = 1024 with
 * shards of 8192 tokens. Past this many tile pairs (about a second), the
 * table counts step 0 of every rank, every count_stride-th step, and the
 * steps on either side of the rank's causal diagonal (its block from the
 * last rank before it and from the first after it); every other computed
 * step takes the work of the nearest counted one of the same rank on the
 * same side of the diagonal. Sources, computed steps, tokens and bytes stay
 * the engine's for every cell. */
#define STRIA_SIM_EXACT_PAIRS ((int64_t)1 << 29)

/* Builds the table (shape->call.cu_seqlens borrowed) from the engine's plan
 * of the layout (packed: the call's document plan, whose kept documents are
 * computed whole at step 0 and whose spread rows alone travel after it).
 * Block pairs that are the same up to a shift of positions (no documents),
 * or up to an order-preserving relabelling of contiguous runs (no
 * documents, no window), are classified once: the kernels' classes depend
 * only on that. With documents every computed pair is classified, by one
 * kernel plan per block side; see STRIA_SIM_EXACT_PAIRS for large rings. */
stria_status_t stria_sim_table(const stria_ring_shape_t *shape, stria_layout_kind_t layout, int n,
                               int64_t tile_q, int64_t tile_k, stria_sim_table_t *t);
/* The same with another bound than STRIA_SIM_EXACT_PAIRS (>= 1). */
stria_status_t stria_sim_table_bounded(const stria_ring_shape_t *shape, stria_layout_kind_t layout,
                                       int n, int64_t tile_q, int64_t tile_k, int64_t exact_pairs,
                                       stria_sim_table_t *t);
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
    /* bytes_sent taken apart: its K/V messages, its dK/dV sums (backward),
     * the closing agreement */
    uint64_t kv_sent, dkv_sent, agree_sent;
} stria_sim_result_t;

/* Spans of a simulated pass, for timelines: kind as stria_timeline_kind_t. */
typedef void (*stria_sim_span_cb)(void *ctx, int rank, int kind, double begin, double end);

/* Simulates one pass (bwd: backward) of the table. */
stria_status_t stria_sim_pass(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                              const stria_sim_link_t *link, bool bwd, stria_sim_result_t *res,
                              stria_sim_span_cb span, void *span_ctx);

/* The same for a ring whose rank 0 sits at ring-order position `first` of
 * the machine (ring rank j on host (first + j) / devices_per_host): its
 * links inside a host or between hosts by those positions. */
stria_status_t stria_sim_pass_at(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                                 const stria_sim_link_t *link, int first, bool bwd,
                                 stria_sim_result_t *res, stria_sim_span_cb span, void *span_ctx);

/* Head groups: `groups` rings of the table's t->n ranks at once (the table
 * built for heads / G and kv_heads / G), ring g at ring-order positions
 * g * t->n + j (the coordinator gives group g the next t->n workers of its
 * ring order). The rings share no link: the model has one link into each
 * rank and no host-wide NIC, so rings on the same hosts do not contend.
 * pass_s, critical_s, steps and bytes: the slowest ring's (the rings are
 * the same table, so bytes and critical path are every ring's); compute_s
 * and waited_s: summed over every rank of every ring. */
stria_status_t stria_sim_groups(const stria_sim_table_t *t, const stria_sim_costs_t *costs,
                                const stria_sim_link_t *link, int groups, bool bwd,
                                stria_sim_result_t *res);

/* Least-squares fit of non-negative coefficients: rows of x (n_rows x
 * STRIA_SIM_NCOEF) against y, each row weighted by 1 / y (relative error).
 * Features that are zero in every row get 0. Returns the RMS relative
 * error of the fit. */
double stria_sim_fit(const double *x, const double *y, int n_rows, double *coef);

#ifdef __cplusplus
}
#endif

#endif
