/* Test-only: a session's rank reached over raw RPC, as a client that does
 * not go through libstria would: its open, and one call (in one request or
 * in pieces) with the proof that binds the call's fields. No Criterion
 * here. */
#ifndef STRIA_TEST_TSESS_H
#define STRIA_TEST_TSESS_H

#include <stdbool.h>
#include <stdint.h>

#include "stria.pb-c.h"
#include "stria_rpc.h"
#include "stria_spec.h"

typedef struct {
    stria_rpc_client_t *c; /* to the rank's worker (the caller's) */
    uint64_t id;
    uint32_t rank;
    stria_job_secret_t secret;
    double timeout_s; /* of each request; 0: 30 */
    int layout;       /* the session's stria_layout_kind_t (its calls' digests) */
} tsess_rank_t;

/* OpenSession of the rank (the worker fetches the assignment and binds the
 * ring link: every rank of the ring must open at once). */
stria_status_t tsess_open(const tsess_rank_t *r);

/* One request of a call: `len` bytes of inputs at `in` (the whole call's
 * inputs, or with place->more / place->piece_offset a piece of them); the
 * reply's payload into out[0 .. cap), its length in *out_len (may be NULL). */
stria_status_t tsess_call(const tsess_rank_t *r, const stria_call_shape_t *shape,
                          const stria_call_place_t *place, const void *in, uint64_t len, void *out,
                          uint64_t cap, uint64_t *out_len);

/* DropJob of the session (or, with held, of its held forward `held_call`). */
stria_status_t tsess_drop(const tsess_rank_t *r, bool held, uint64_t held_call);

#endif
