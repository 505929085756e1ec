/* Test-only: the in-process reference run. The same inputs through
 * stria_ring_run_local() (every rank a thread of this process), whose
 * outputs a distributed run must equal bit for bit when it had the same
 * ring size, layout and dtype. No Criterion here: helper processes use it
 * too. */
#ifndef STRIA_TEST_TREF_H
#define STRIA_TEST_TREF_H

#include <stdbool.h>
#include <stddef.h>

#include "stria_ring.h"
#include "tjob.h"

/* stria_ring_run_local() over full tensors: q, k, v, d_o in shape->dtype
 * (d_o only read by a backward pass), out[] as TJ_O .. TJ_DV (O, dQ, dK,
 * dV in shape->dtype, LSE fp32). stats: NULL or as for
 * stria_ring_run_local(). */
stria_status_t tref_ring_run(const stria_ring_shape_t *shape, const stria_ring_local_opts_t *lo,
                             const void *q, const void *k, const void *v, const void *d_o,
                             void *const out[TJ_N_OUT], stria_ring_local_stats_t *stats);

/* Runs j's inputs through the in-process ring (`shape`: the job's, or one
 * with the masks and scale of a call; lo->passes says whether the backward
 * runs) and compares its outputs with j's: returns the set of those that
 * differ (bit 1 << TJ_O ..; dQ, dK, dV only after a backward), or -1 when
 * the ring could not run, with why in why[0 .. len). */
int tref_job_diff(const tjob_t *j, const stria_ring_shape_t *shape,
                  const stria_ring_local_opts_t *lo, char *why, size_t len);

/* Whether tref_job_diff() finds j's outputs all equal; else false with
 * what differs first (or why the ring could not run) in why[0 .. len). */
bool tref_job_equal(const tjob_t *j, const stria_ring_shape_t *shape,
                    const stria_ring_local_opts_t *lo, char *why, size_t len);

#endif
