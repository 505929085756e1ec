/* Test-only: a job's tensors. Inputs of [batch, seq, heads|kv_heads,
 * head_dim] uniform in [-1, 1), rounded to the storage dtype and kept both
 * as fp32 values (for the fp64 reference) and in the dtype (for the
 * service); outputs in the dtype (LSE in fp32), zeroed. No Criterion here:
 * helper processes use it too. */
#ifndef STRIA_TEST_TJOB_H
#define STRIA_TEST_TJOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_client.h"
#include "stria_ring.h"

/* The outputs of a pass, in this order wherever they come as an array. */
enum { TJ_O, TJ_LSE, TJ_DQ, TJ_DK, TJ_DV, TJ_N_OUT };
extern const char *const tjob_out_names[TJ_N_OUT]; /* "O", "LSE", "dQ", "dK", "dV" */

typedef struct {
    stria_job_spec_t spec;    /* STRIA_JOB_SPEC_INIT with the shape, dtype, causality */
    size_t nq, nk, nl, es;    /* elements of Q (and dO, O), K, LSE; bytes of an element */
    float *qf, *kf, *vf, *gf; /* fp32 values of the inputs (rounded to dtype) */
    void *q, *k, *v, *g;      /* inputs in spec.dtype (g: dO) */
    void *o, *dq, *dk, *dv;   /* outputs in spec.dtype */
    float *lse;
} tjob_t;

/* Inputs from seed, seed + 1, seed + 2, seed + 3 (Q, K, V, dO); the spec's
 * other fields zero (ring_size, layout, step_timeout_s: set them after).
 * Returns false, nothing allocated, when out of memory. */
bool tjob_init(tjob_t *j, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
               int64_t head_dim, stria_dtype_t dtype, bool causal, uint64_t seed);
void tjob_free(tjob_t *j);

/* The job's outputs as an array (TJ_O ..) and their sizes in bytes. */
void tjob_outputs(const tjob_t *j, void *out[TJ_N_OUT], size_t bytes[TJ_N_OUT]);

/* The ring shape of the job's spec: dimensions, dtype, causality, the
 * spec's documents and window (borrowed), the default scale. */
stria_ring_shape_t tjob_ring_shape(const tjob_t *j);

#endif
