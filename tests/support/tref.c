#include "tref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

stria_status_t tref_ring_run(const stria_ring_shape_t *shape, const stria_ring_local_opts_t *lo,
                             const void *q, const void *k, const void *v, const void *d_o,
                             void *const out[TJ_N_OUT], stria_ring_local_stats_t *stats)
{
    stria_ring_local_io_t io = {.q = q,
                                .k = k,
                                .v = v,
                                .o = out[TJ_O],
                                .o_dtype = shape->dtype,
                                .lse = out[TJ_LSE],
                                .d_o = d_o,
                                .dq = out[TJ_DQ],
                                .dk = out[TJ_DK],
                                .dv = out[TJ_DV],
                                .grad_dtype = shape->dtype};
    return stria_ring_run_local(shape, lo, &io, stats);
}

int tref_job_diff(const tjob_t *j, const stria_ring_shape_t *shape,
                  const stria_ring_local_opts_t *lo, char *why, size_t len)
{
    void *got[TJ_N_OUT], *mine[TJ_N_OUT];
    size_t bytes[TJ_N_OUT];
    tjob_outputs(j, got, bytes);
    bool ok = true;
    for (int i = 0; i < TJ_N_OUT; i++)
        ok &= (mine[i] = calloc(1, bytes[i])) != NULL;
    int diff = 0;
    if (!ok) {
        snprintf(why, len, "out of memory");
        diff = -1;
    } else if (tref_ring_run(shape, lo, j->q, j->k, j->v, j->g, mine, NULL) != STRIA_OK) {
        snprintf(why, len, "in-process ring: %s", stria_error_msg());
        diff = -1;
    } else {
        int n = (lo->passes & STRIA_RING_PASS_BWD) ? TJ_N_OUT : TJ_DQ;
        for (int i = 0; i < n; i++)
            if (memcmp(mine[i], got[i], bytes[i]) != 0)
                diff |= 1 << i;
    }
    for (int i = 0; i < TJ_N_OUT; i++)
        free(mine[i]);
    return diff;
}

bool tref_job_equal(const tjob_t *j, const stria_ring_shape_t *shape,
                    const stria_ring_local_opts_t *lo, char *why, size_t len)
{
    int diff = tref_job_diff(j, shape, lo, why, len);
    if (diff <= 0)
        return diff == 0;
    int first = __builtin_ctz((unsigned)diff);
    snprintf(why, len, "%s differs from the in-process ring of %d ranks (%s)",
             tjob_out_names[first], lo->n_ranks, stria_layout_kind_name(lo->layout));
    return false;
}
