/* Test-only helpers of the session suites (test_session,
 * test_session_failures): calls, session specs, and a call checked against
 * the in-process ring of the session's size and layout. */
#ifndef STRIA_TEST_SESSION_UTIL_H
#define STRIA_TEST_SESSION_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fault_util.h"
#include "stria_client.h"

#define T_TIMEOUT 120

stria_call_t se_call_of(int64_t batch, int64_t seq, bool causal);
stria_session_spec_t se_spec_of(int64_t max_batch, int64_t max_seq, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, stria_dtype_t dtype, stria_layout_kind_t layout,
                                int ring);
/* stria_session_open(), or the test fails. */
stria_session_t *se_open_session(stria_client_t *cl, const stria_session_spec_t *spec);
/* Inputs of one call: [batch, seq, heads|kv_heads, head_dim] in the
 * session's dtype, from `seed`; outputs zeroed. */
void se_call_tensors(fu_job_t *j, const stria_session_spec_t *sp, const stria_call_t *c,
                     uint64_t seed);
/* Whether j's outputs (O and LSE; with backward dQ, dK, dV too) are the
 * in-process ring's (n_ranks in `layout`) for call c, bit for bit. */
bool se_ref_equal(const fu_job_t *j, const stria_call_t *c, int n_ranks, stria_layout_kind_t layout,
                  bool backward, char *why, size_t len);
/* One call on a whole-sequence session (forward, then backward when asked)
 * with fresh inputs from `seed`, checked against the in-process ring of the
 * session's size and layout. */
void se_check_call(stria_session_t *s, const stria_session_spec_t *sp, const stria_call_t *c,
                   bool backward, uint64_t seed, const char *what);

/* A head-grouped call's outputs (forward and backward), head group by head
 * group, are those of that group's heads on an in-process ring of R ranks
 * in `layout`, bit for bit (a failed expectation names the group). */
void se_groups_equal(const fu_job_t *j, const stria_call_t *c, int G, int R,
                     stria_layout_kind_t layout, const char *what);
/* One call (forward and backward) with fresh inputs from `seed` on a
 * session of G head groups x rings of R, checked by se_groups_equal(). */
void se_check_groups_call(stria_session_t *s, const stria_session_spec_t *sp, const stria_call_t *c,
                          uint64_t seed, int G, int R, const char *what);

/* ---- sharded calls ---- */
/* One trainer rank of a sharded call: its session handle and rank, the
 * call's full tensors (it cuts its own tokens out of them, at
 * stria_call_positions() of stria_session_ranks() ranks, and writes its
 * outputs back there), and its outcome. */
typedef struct {
    stria_session_t *s;
    int rank;
    fu_job_t *j;       /* full tensors: inputs read, outputs written at the rank's positions */
    stria_call_t call; /* this rank's call */
    bool backward;
    bool held; /* the forward held for its backward (forward_held, backward_held) */
    /* a tensor-parallel rank's heads: it calls ring `group` of a session of
     * `groups` head groups (stria_session_head_group) with heads / groups
     * of them; groups 0: every head, on s itself */
    int group, groups;
    stria_status_t st;
    bool retryable;
    char msg[1024];
} se_rank_t;

/* A sharded session for n trainer ranks: opened through cl[0] from sp,
 * exported and imported through cl[1 .. n) (or the test fails), into
 * h[0 .. n); the export's length in *len_out (may be NULL). */
void se_open_sharded(stria_client_t **cl, int n, const stria_session_spec_t *sp,
                     stria_session_t **h, size_t *len_out);
/* One call on every rank at once, each on a thread of its own (rank i on
 * h[i] with calls[i]; forward, then backward when asked); outcomes in r[]. */
void se_sharded_call(stria_session_t **h, int n, fu_job_t *j, const stria_call_t *calls,
                     bool backward, se_rank_t *r);
/* The same with the forward held for its backward (forward_held, then
 * backward_held on the handle it gave). */
void se_sharded_call_held(stria_session_t **h, int n, fu_job_t *j, const stria_call_t *calls,
                          se_rank_t *r);
/* The same for a tensor-parallel trainer of n x G ranks on a session of G
 * head groups: rank i (h[i], r[i]) is ring rank i % n of head group i / n,
 * calling that group's ring (stria_session_head_group) with its heads. */
void se_sharded_call_tp(stria_session_t **h, int n, int G, fu_job_t *j, const stria_call_t *calls,
                        bool backward, se_rank_t *r);

#endif
