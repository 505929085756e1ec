/* Test-only (Criterion): a pass's outputs against the fp64 reference
 * attention (tests/common/ref.h) with the kernels' tolerance rule: the
 * error may be twice that of the same computation done naively in fp32,
 * plus 2e-6 (1 + max |reference|), plus the rounding of an output stored
 * in bf16 (2^-8) or fp16 (2^-11) times its magnitude. */
#ifndef STRIA_TEST_TCHECK_H
#define STRIA_TEST_TCHECK_H

#include <stdbool.h>

#include "stria_client.h"
#include "stria_ring.h"
#include "tjob.h"

typedef struct {
    const stria_job_spec_t *spec; /* shape, dtype, causality, documents and window */
    const float *q, *k, *v, *d_o; /* fp32 inputs (the values the service saw) */
    const void *out[TJ_N_OUT];    /* O, dQ, dK, dV in spec->dtype, LSE fp32 */
    bool backward;                /* also dQ, dK, dV (with d_o) */
    /* bf16 outputs of workers that run every product on the bf16 dot product
     * (ref_bf16_dot_default()): at least the kernels' bf16 bar, twice the
     * error of the computation done in bf16 */
    bool bf16_dot;
    const char *what; /* names the pass in the failures */
} tcheck_t;

/* One cr_expect() an output (O and LSE; dQ, dK, dV too with backward). */
void tcheck_reference(const tcheck_t *c);

/* tcheck_reference() of a job's inputs and outputs. */
void tcheck_job(const tjob_t *j, bool backward, bool bf16_dot, const char *what);

/* The job's outputs against the in-process ring's over the job's shape
 * (tjob_ring_shape()) with lo (lo->passes: forward only, or forward and
 * backward): the ring must run, and one cr_expect() an output that it
 * computed, bit for bit. */
void tcheck_in_process(const tjob_t *j, const stria_ring_local_opts_t *lo, const char *what);

#endif
