/* Test-only helpers of the fault suites (test_faults, test_restart,
 * test_session, test_netns, test_chaos and the chaos_client helper): a
 * job's random inputs in any dtype (tests/support/tjob.h), and the check
 * that a job's outputs are bit for bit those of the in-process ring of the
 * size and layout that finally ran it (tests/support/tref.h). No Criterion
 * here: chaos_client is a process of its own. */
#ifndef STRIA_TEST_FAULT_UTIL_H
#define STRIA_TEST_FAULT_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria_client.h"
#include "tjob.h"

typedef tjob_t fu_job_t;

/* A job of [batch, seq, heads|kv_heads, head_dim] with inputs uniform in
 * [-1, 1) from `seed` (tjob_init() from seed * 4 + 1); the spec's other
 * fields zero (ring_size, layout: set them after). Returns false when out
 * of memory. */
bool fu_job_init(fu_job_t *j, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, stria_dtype_t dtype, bool causal, uint64_t seed);
void fu_job_free(fu_job_t *j);

/* Whether the job's outputs (O and LSE; dQ, dK, dV too with `backward`)
 * equal those of stria_ring_run_local() with n_ranks ranks in `layout`, bit
 * for bit; else false with what differs in why[0 .. len). */
bool fu_ring_equal(const fu_job_t *j, int n_ranks, stria_layout_kind_t layout, bool backward,
                   char *why, size_t len);
/* Head group g of G's part of a whole call's tensors (inputs and outputs,
 * fp32 copies too) into *gj: heads / G and kv_heads / G of every row, LSE
 * by its head rows. False when out of memory. */
bool fu_group_job(const fu_job_t *j, int g, int G, fu_job_t *gj);
/* A head-grouped call's outputs, group by group, are those of each group's
 * heads on an in-process ring of R ranks in `layout`, bit for bit (why
 * names the first group and output that differ). */
bool fu_groups_equal(const fu_job_t *j, int G, int R, stria_layout_kind_t layout, bool backward,
                     char *why, size_t len);

#endif
