#include "fault_util.h"

#include "tref.h"

bool fu_job_init(fu_job_t *j, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, stria_dtype_t dtype, bool causal, uint64_t seed)
{
    return tjob_init(j, batch, seq, heads, kv_heads, head_dim, dtype, causal, seed * 4 + 1);
}

void fu_job_free(fu_job_t *j)
{
    tjob_free(j);
}

bool fu_ring_equal(const fu_job_t *j, int n_ranks, stria_layout_kind_t layout, bool backward,
                   char *why, size_t len)
{
    const stria_ring_shape_t shape = tjob_ring_shape(j);
    const stria_ring_local_opts_t lo = {.layout = layout,
                                        .n_ranks = n_ranks,
                                        .passes = backward ? STRIA_RING_PASS_FWD_BWD
                                                           : STRIA_RING_PASS_FWD};
    return tref_job_equal(j, &shape, &lo, why, len);
}
