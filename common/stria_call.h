/*
 * stria call shapes: the one record of what a call computes (a session's
 * call, or a job, which is one call) and the one book of its mask rules.
 *
 * Every layer builds its shape from this record: libstria from its public
 * structs (stria_job_spec_t, stria_call_t), the protocol's CallShape and
 * JobSpec by proto/stria_spec.h's conversions, the ring engine's
 * stria_ring_shape_t embeds it, and the kernels' stria_attn_params_t is made
 * from that. Every door (libstria, the coordinator's admission, the worker,
 * the ring engine) checks it with the functions below; the kernels check
 * their lists with the same rules and keep only the checks on positions.
 *
 * Lengths, named alike everywhere:
 *   seq_len        the global sequence: real tokens of one batch row, the
 *                  same on every rank (this record, stria_layout_t)
 *   seq_padded     seq_len padded to the layout's unit (stria_layout_t)
 *   shard_tokens   rows of every rank's shard, padding included
 *                  (stria_layout_t; L in comments)
 *   valid          real tokens of one rank's shard
 *                  (stria_layout_shard_valid())
 *   q_tokens, kv_tokens  rows of one kernel call's query and key/value
 *                  block (stria_attn_params_t)
 * Positions are global, in [0, seq_len) for real tokens: padding lies at or
 * beyond seq_len, and no mask rule reads it.
 */
#ifndef STRIA_CALL_H
#define STRIA_CALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most documents entries a call may carry (every door refuses more). */
#define STRIA_CALL_MAX_CU_SEQLENS 65536

/* What a call computes over the global sequence, whatever its heads, head
 * dimension and dtype (a session's or job's, fixed apart). The documents are
 * borrowed (a view of the caller's array, a decoded message's, or a ring
 * pass's) unless the record was made by stria_call_shape_copy(). */
typedef struct {
    int64_t batch;
    int64_t seq_len; /* global real tokens (see above) */
    bool causal;     /* a key at position k is seen by a query at p iff k <= p */
    float scale;     /* softmax scale; 0: 1/sqrt(head_dim) */
    /* Documents (flash_attn varlen's cu_seqlens), one list for every batch
     * row: n_cu_seqlens entries, starting at 0, non-decreasing, ending at
     * seq_len; document d holds positions [cu_seqlens[d], cu_seqlens[d + 1])
     * and a query sees keys of its own document only. 0 entries: one
     * document. */
    const int64_t *cu_seqlens;
    size_t n_cu_seqlens;
    /* Sliding window: with has_window a query at position p sees keys in
     * [p - window_left, p + window_right] (-1: that side unbounded); causal
     * takes window_right 0 or -1 only. Without has_window both are 0. */
    bool has_window;
    int64_t window_left, window_right;
} stria_call_shape_t;

/* What a session fixes that a call is checked against. */
typedef struct {
    int64_t max_batch, max_seq_len; /* a call's batch <= max_batch, batch * seq_len <= product */
    int n_ranks;
    int layout; /* stria_layout_kind_t */
} stria_call_bounds_t;

/* ---- the rule book: STRIA_ERR_INVALID_ARG with a message naming the field */

/* A documents list on its own: n entries (0: one document), not NULL when
 * n > 0, starting at 0, non-decreasing ("cu_seqlens must not decrease (entry
 * 2 is 17 after 300)"). Where it must end is the caller's rule: at seq_len
 * for a call (stria_call_masks_check()), past every position for a kernel
 * call. */
stria_status_t stria_call_docs_check(const int64_t *cu_seqlens, size_t n);
/* A window: without has_window, left and right are 0; with it, each is
 * >= -1, and causal attention takes right 0 or -1 only. */
stria_status_t stria_call_window_check(bool has_window, int64_t left, int64_t right, bool causal);
/* The masks of a call: at most STRIA_CALL_MAX_CU_SEQLENS documents entries,
 * stria_call_docs_check() and the list ending at seq_len ("cu_seqlens must
 * end at seq_len (1024) (got 1000)"), stria_call_window_check(). */
stria_status_t stria_call_masks_check(const stria_call_shape_t *c);
/* A call against a session's bounds: batch, seq_len (at least 1, the
 * product within the bounds'), scale (finite, >= 0), then its masks (the
 * message prefixed with "call: "). */
stria_status_t stria_call_shape_check(const stria_call_shape_t *c, const stria_call_bounds_t *b);

/* ---- the record --------------------------------------------------------- */

/* Whether two records describe the same call (the documents compared by
 * value). */
bool stria_call_shape_equal(const stria_call_shape_t *a, const stria_call_shape_t *b);
/* An owning copy of src in *dst: its documents copied into memory *dst
 * owns, freed by stria_call_shape_free(). STRIA_ERR_NO_MEMORY leaves *dst
 * unchanged. */
stria_status_t stria_call_shape_copy(const stria_call_shape_t *src, stria_call_shape_t *dst);
/* Frees the documents of a record made by stria_call_shape_copy() (or a
 * zeroed one) and zeroes it. */
void stria_call_shape_free(stria_call_shape_t *c);

/* The softmax scale a call computes with: scale, or for 0 (the default)
 * 1/sqrt(head_dim), rounded to float alike everywhere. The one statement of
 * that rule: the coordinator records jobs with it, and ranks compare their
 * calls' digests with it applied, so a rank that passes 0 and one that
 * passes the value it stands for make the same call. */
float stria_call_scale(float scale, int64_t head_dim);

/* A digest of a call (its shape, the layout it runs under, number and
 * direction) that ranks compare; a packed call's also covers the document
 * plan's version (STRIA_DOCPLAN_VERSION), so ranks that would place its
 * tokens differently never run it together. */
uint64_t stria_call_shape_digest(const stria_call_shape_t *c, int layout, uint64_t call,
                                 bool backward);
/* Where a SessionCall's tensors are and what it asks beyond its shape: the
 * request's fields other than the shape and the ids. */
typedef struct {
    uint64_t call, link_epoch;
    bool backward;
    bool arena; /* inputs at arena_in, outputs at arena_out of the client's arena */
    uint64_t arena_in, arena_out;
    bool more; /* a piece of the inputs at piece_offset; more follow */
    uint64_t piece_offset;
    bool hold;     /* a forward kept for its backward */
    bool use_held; /* the backward of held call held_call */
    uint64_t held_call;
    /* part `part` of `parts` of the rank's inputs, from one trainer rank
     * each (SessionCallRequest.parts; 0: the whole shard) */
    uint32_t part, parts;
} stria_call_place_t;
/* Most parts one rank's call comes in (one per head group). */
#define STRIA_CALL_MAX_PARTS 64
/* The bytes of a SessionCall its proof binds (stria_rpc_request_t.proof_extra):
 * the call's number, link epoch, shape digest (and direction), arena
 * places, piece, held forward and part, so that an attacker on the path can
 * change none of them. */
#define STRIA_CALL_BINDING_BYTES 61
void stria_call_binding(const stria_call_shape_t *c, int layout, const stria_call_place_t *p,
                        uint8_t out[STRIA_CALL_BINDING_BYTES]);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_CALL_H */
