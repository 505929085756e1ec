/*
 * What the daemons keep of a JobSpec beyond its scalar fields: the documents
 * and the window, copied out of a decoded message (whose memory goes with
 * the RPC call) into memory the job owns.
 */
#ifndef STRIA_SPEC_H
#define STRIA_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria.pb-c.h"
#include "stria_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t *cu_seqlens; /* owned; NULL when n_cu_seqlens is 0 */
    size_t n_cu_seqlens;
    bool has_window;
    int64_t window_left, window_right;
} stria_job_masks_t;

/* Copies the documents and window of a validated spec into *m (zeroed
 * first). Returns false when out of memory (*m then holds nothing). */
bool stria_job_masks_copy(const Stria__V1__JobSpec *s, stria_job_masks_t *m);
/* Frees what stria_job_masks_copy() allocated and zeroes *m. */
void stria_job_masks_free(stria_job_masks_t *m);

/* ---- a session call's shape ----------------------------------------------
 *
 * One record of what a call computes, checked by one function at each door
 * (libstria before it sends, the worker before it reads the payload) and
 * converted to and from the protocol's CallShape by one pair of functions.
 */
#define STRIA_CALL_MAX_CU_SEQLENS 65536

typedef struct {
    int64_t batch;
    int64_t seq_len; /* global tokens */
    bool causal;
    float scale;               /* 0: 1/sqrt(head_dim) */
    const int64_t *cu_seqlens; /* borrowed */
    size_t n_cu_seqlens;
    bool has_window;
    int64_t window_left, window_right;
} stria_call_shape_t;

/* What a session fixes that a call is checked against. */
typedef struct {
    int64_t max_batch, max_seq_len; /* a call's batch <= max_batch, batch * seq_len <= product */
    int n_ranks;
    int layout; /* stria_layout_kind_t */
} stria_call_bounds_t;

/* Checks a call against a session's bounds: STRIA_ERR_INVALID_ARG with a
 * message naming the field or the bound. */
stria_status_t stria_call_shape_check(const stria_call_shape_t *c, const stria_call_bounds_t *b);
/* The documents and window of a call against its seq_len and causal flag
 * (the part of stria_call_shape_check() a job's spec shares at every door:
 * libstria, the coordinator, the worker): STRIA_ERR_INVALID_ARG naming the
 * field ("cu_seqlens must end at seq_len (1024) (got 1000)"). */
stria_status_t stria_call_masks_check(const stria_call_shape_t *c);
/* The protocol's form: pb and win are filled (win used when the call has a
 * window); the documents are borrowed from c. */
void stria_call_shape_to_pb(const stria_call_shape_t *c, Stria__V1__CallShape *pb,
                            Stria__V1__JobSpec__Window *win);
/* The C record of a decoded message (documents borrowed from it). */
void stria_call_shape_from_pb(const Stria__V1__CallShape *pb, stria_call_shape_t *c);
/* A job is one call: the record of a JobSpec's batch, seq_len, causal,
 * scale, documents and window (documents borrowed from s), and those fields
 * of a JobSpec from the record (documents borrowed from c; win used when the
 * call has a window). */
void stria_call_shape_from_spec(const Stria__V1__JobSpec *s, stria_call_shape_t *c);
void stria_call_shape_to_spec(const stria_call_shape_t *c, Stria__V1__JobSpec *s,
                              Stria__V1__JobSpec__Window *win);
/* A digest of a call (its shape, number and direction) that ranks compare. */
uint64_t stria_call_shape_digest(const stria_call_shape_t *c, uint64_t call, bool backward);
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
} stria_call_place_t;
/* The place of a decoded request, and the request's fields from a place. */
void stria_call_place_from_pb(const Stria__V1__SessionCallRequest *req, stria_call_place_t *p);
void stria_call_place_to_pb(const stria_call_place_t *p, Stria__V1__SessionCallRequest *req);
/* The bytes of a SessionCall its proof binds (stria_rpc_request_t.proof_extra):
 * the call's number, link epoch, shape digest (and direction), arena
 * places, piece and held forward, so that an attacker on the path can change
 * none of them. */
#define STRIA_CALL_BINDING_BYTES 57
void stria_call_binding(const stria_call_shape_t *c, const stria_call_place_t *p,
                        uint8_t out[STRIA_CALL_BINDING_BYTES]);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_SPEC_H */
