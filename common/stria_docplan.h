/*
 * stria document plans: where the tokens of a call with packed documents go
 * when they are placed by their work (the `packed` layout, planned).
 *
 * Striping balances documents well but spreads every document over every
 * rank, so every rank needs every other rank's keys. A document plan keeps
 * short documents whole on one rank, where they are computed at step 0 with
 * no traffic, and spreads only the rest (long documents, and those needed to
 * even out the ranks) round-robin, as striping would; only spread tokens
 * travel. The plan is a deterministic function of its inputs (the call's
 * documents, window and causality, the ring's size and the call's
 * shard_tokens) and of STRIA_DOCPLAN_VERSION, so libstria, every worker and
 * the Python package (through libstria) compute the same plan without
 * exchanging it; a change to the algorithm bumps the version.
 *
 * How a plan is made (stria_docplan_make):
 *  1. Every document's work is counted: the (query, key) pairs its masks let
 *     through (causal, window), one query at a time.
 *  2. Documents that fit a shard and whose work is at most the mean rank
 *     work (plus the tolerance) are kept by longest-processing-time
 *     placement on effective loads: a kept document brings its work and
 *     displaces the spread work its tokens would otherwise have taken (the
 *     spread documents' work per token of the room they fill). Largest in
 *     size first (ties: longer, then earlier); one that adds load goes to
 *     the rank of least load, one that lowers it to the rank of most, among
 *     the ranks with room for its tokens whose kept work stays under the cap.
 *     The others are spread.
 *  3. Spread documents' tokens, then the padding, are dealt in position order
 *     over the ranks in proportion to their room (rank r's k-th token is due
 *     at (2k + 1) / (2 room_r) of the deal; ties to the lower rank), so every
 *     rank holds exactly shard_tokens tokens and gets its share of every
 *     spread document. With nothing kept this is striping.
 *  4. Every rank's work is counted from its tokens. If the busiest rank's work
 *     is more than STRIA_DOCPLAN_TOLERANCE_PERMILLE thousandths over the
 *     mean, more documents are spread (the largest kept on every rank over
 *     the tolerance, or, where those keep none, the longest kept one, which
 *     frees the most room) and the plan is made again from step 2; after
 *     STRIA_DOCPLAN_MAX_ROUNDS rounds every document is spread (striping).
 *
 * A shard's rows, in order: its spread real tokens (increasing positions: the
 * prefix that travels, `travel` rows), its kept real tokens (increasing), its
 * padding (positions >= seq_len). Positions are not increasing across the
 * three parts.
 *
 * Ownership: stria_docplan_make() returns a plan with one reference;
 * stria_docplan_ref()/stria_docplan_unref() share it (atomically, from any
 * thread); the last unref frees it. A plan is never changed once made. A
 * cache (stria_docplan_cache_t) keeps recent plans by their inputs' digest
 * and is safe to use from many threads.
 */
#ifndef STRIA_DOCPLAN_H
#define STRIA_DOCPLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_call.h"
#include "stria_layout.h"
#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The algorithm's version: part of every plan's digest. */
#define STRIA_DOCPLAN_VERSION 1
/* How far over the mean the busiest rank's counted work may be, in
 * thousandths. */
#define STRIA_DOCPLAN_TOLERANCE_PERMILLE 30
/* Rounds of step 4 before falling back to striping. */
#define STRIA_DOCPLAN_MAX_ROUNDS 8

typedef struct stria_docplan {
    uint32_t version;        /* STRIA_DOCPLAN_VERSION */
    uint64_t digest;         /* of the inputs and the version (stria_docplan_digest()) */
    stria_call_shape_t call; /* the inputs' masks: an owning copy */
    int n_ranks;
    int64_t seq_len, shard_tokens;
    size_t n_docs;     /* cu_seqlens documents (entries - 1; 1 without documents) */
    size_t n_kept;     /* non-empty documents kept whole on one rank */
    size_t n_spread;   /* non-empty documents spread */
    int32_t *doc_rank; /* [n_docs]: the rank a document is kept on; -1 spread or empty */
    /* Rank r's shard: runs[run_start[r] .. run_start[r + 1]) in shard order,
     * all shard_tokens rows (padding included); its first travel_runs[r]
     * runs hold its travel[r] spread rows, then valid[r] - travel[r] kept
     * rows, then the padding. */
    size_t *run_start; /* [n_ranks + 1] */
    size_t *travel_runs;
    stria_layout_run_t *runs;
    int64_t *travel, *valid; /* [n_ranks] */
    uint64_t *work;          /* [n_ranks] (query, key) pairs of the rank's queries */
    double max_mean;         /* busiest rank's work over the mean (1 for no work) */
    /* K/V steps a pass needs: 1 + the farthest hop, forward along the ring,
     * from a rank holding spread keys to a rank whose spread queries may see
     * them. 1: no traffic at all. */
    int steps;
    int rounds;     /* rounds of step 4 it took */
    double make_s;  /* wall time stria_docplan_make() took */
    size_t bytes;   /* memory the plan holds */
    unsigned refs_; /* private: references (atomic) */
} stria_docplan_t;

/* The digest a plan of these inputs has (cache key, call digests). */
uint64_t stria_docplan_digest(const stria_call_shape_t *call, int n_ranks, int64_t shard_tokens);

/* Plans call's documents (call->cu_seqlens; none: one document) for n_ranks
 * ranks (1..STRIA_LAYOUT_MAX_RANKS) of shard_tokens rows each (at least
 * ceil(seq_len / n_ranks)). The call's masks must pass
 * stria_call_masks_check() (its message is returned otherwise).
 * STRIA_ERR_INVALID_ARG naming the bad input; STRIA_ERR_NO_MEMORY. */
stria_status_t stria_docplan_make(const stria_call_shape_t *call, int n_ranks, int64_t shard_tokens,
                                  stria_docplan_t **plan_out);
stria_docplan_t *stria_docplan_ref(stria_docplan_t *plan);
void stria_docplan_unref(stria_docplan_t *plan); /* NULL: nothing */

/* Global position of row `index` of `rank`'s shard (padding: >= seq_len);
 * -1 out of range. */
int64_t stria_docplan_position(const stria_docplan_t *plan, int rank, int64_t index);
/* Writes rank's shard_tokens positions, in shard order, into out. */
stria_status_t stria_docplan_positions(const stria_docplan_t *plan, int rank, int64_t *out);

/* The (query, key) pairs that one query at offset i of a document of len
 * tokens sees under the call's causality and window: the plan's unit of
 * work, exposed so that other layouts can be counted alike. */
int64_t stria_docplan_query_work(const stria_call_shape_t *call, int64_t i, int64_t len);

/* Counts a placement of a call's real tokens on n_ranks ranks (rank_of[p]:
 * the rank of position p, for p < seq_len): every rank's work (work_out,
 * n_ranks entries: the pairs stria_docplan_query_work() counts for its
 * queries) and the K/V steps a ring pass needs (*steps_out: 1 + the
 * farthest forward hop from a rank holding a document's keys to a rank
 * holding its queries that may see them, judged from the positions' bounds
 * per rank, so never too few). A plan's counts come from it, and so do the
 * other layouts' counts in the benchmark. */
stria_status_t stria_docplan_count(const stria_call_shape_t *call, int n_ranks,
                                   const int32_t *rank_of, uint64_t *work_out, int *steps_out);

/* Recent plans by their digest, least recently used dropped first. */
typedef struct stria_docplan_cache stria_docplan_cache_t;
typedef struct {
    uint64_t hits, misses;
    size_t entries, bytes; /* plans held and their memory */
    double make_s;         /* total time spent making plans */
} stria_docplan_cache_stats_t;

/* A cache of at most `capacity` plans (>= 1); NULL when out of memory. */
stria_docplan_cache_t *stria_docplan_cache_new(size_t capacity);
void stria_docplan_cache_free(stria_docplan_cache_t *cache); /* plans still referenced live on */
/* The plan of these inputs, made on a miss: a new reference (unref it). */
stria_status_t stria_docplan_cache_get(stria_docplan_cache_t *cache, const stria_call_shape_t *call,
                                       int n_ranks, int64_t shard_tokens,
                                       stria_docplan_t **plan_out);
void stria_docplan_cache_stats(stria_docplan_cache_t *cache, stria_docplan_cache_stats_t *out);

/* ---- a call's layout ------------------------------------------------------ */

/* Plans the process's layouts keep (stria_docplan_shared()). */
#define STRIA_DOCPLAN_SHARED_PLANS 32

/* The process's cache of plans, made on first use (thread-safe) and never
 * freed: what stria_docplan_layout() takes its plans from, so a model's
 * layers, which repeat their documents, plan them once. */
stria_docplan_cache_t *stria_docplan_shared(void);

/* The layout of `call` over n_ranks ranks of a session (or job) of layout
 * `kind`: the one rule libstria, the workers, the ring engine and the Python
 * package follow. Striped, contiguous and zigzag come from seq_len alone
 * (stria_layout_init()); packed with at least two documents from the call's
 * plan (stria_docplan_shared()'s, shard_tokens ceil(seq_len / n_ranks)),
 * whose reference *plan_out holds and the layout borrows (unref it after
 * the layout's last use); packed with one document is striping, with no
 * plan. *plan_out is NULL without a plan. */
stria_status_t stria_docplan_layout(stria_layout_kind_t kind, const stria_call_shape_t *call,
                                    int n_ranks, stria_layout_t *layout_out,
                                    stria_docplan_t **plan_out);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_DOCPLAN_H */
