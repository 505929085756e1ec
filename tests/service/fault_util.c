#include "fault_util.h"

#include "tref.h"

#include <stdio.h>
#include <string.h>

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

/* Head group g's part of a [B, S, X, D] tensor (X = x heads, es bytes each
 * element) into [B, S, X / G, D], or of an LSE [B, H, S] into
 * [B, H / G, S]. */
static void group_slice(const void *full, void *part, int64_t outer, int64_t S, int64_t x,
                        int64_t D, size_t es, int g, int G, bool lse)
{
    const int64_t xg = x / G;
    for (int64_t b = 0; b < outer; b++) {
        if (lse) { /* [B][H][S]: the group's heads are one block of rows */
            memcpy((char *)part + (size_t)(b * xg * S) * es,
                   (const char *)full + (size_t)((b * x + g * xg) * S) * es, (size_t)(xg * S) * es);
            continue;
        }
        for (int64_t t = 0; t < S; t++)
            memcpy((char *)part + (size_t)((b * S + t) * xg * D) * es,
                   (const char *)full + (size_t)(((b * S + t) * x + g * xg) * D) * es,
                   (size_t)(xg * D) * es);
    }
}

bool fu_group_job(const fu_job_t *j, int g, int G, fu_job_t *gj)
{
    const stria_job_spec_t *sp = &j->spec;
    const int64_t B = sp->batch, S = sp->seq_len, H = sp->heads, Hkv = sp->kv_heads,
                  D = sp->head_dim;
    if (!fu_job_init(gj, B, S, H / G, Hkv / G, D, sp->dtype, sp->causal, 1))
        return false;
    gj->spec = *sp;
    gj->spec.heads = H / G;
    gj->spec.kv_heads = Hkv / G;
    const struct {
        const void *full;
        void *part;
        int64_t x;
        size_t es;
    } t[] = {{j->q, gj->q, H, j->es},     {j->k, gj->k, Hkv, j->es},   {j->v, gj->v, Hkv, j->es},
             {j->g, gj->g, H, j->es},     {j->o, gj->o, H, j->es},     {j->dq, gj->dq, H, j->es},
             {j->dk, gj->dk, Hkv, j->es}, {j->dv, gj->dv, Hkv, j->es}, {j->qf, gj->qf, H, 4},
             {j->kf, gj->kf, Hkv, 4},     {j->vf, gj->vf, Hkv, 4},     {j->gf, gj->gf, H, 4}};
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        group_slice(t[i].full, t[i].part, B, S, t[i].x, D, t[i].es, g, G, false);
    group_slice(j->lse, gj->lse, B, S, H, 1, 4, g, G, true);
    return true;
}

bool fu_groups_equal(const fu_job_t *j, int G, int R, stria_layout_kind_t layout, bool backward,
                     char *why, size_t len)
{
    for (int g = 0; g < G; g++) {
        fu_job_t gj;
        if (!fu_group_job(j, g, G, &gj)) {
            snprintf(why, len, "out of memory for head group %d", g);
            return false;
        }
        char one[200];
        bool ok = fu_ring_equal(&gj, R, layout, backward, one, sizeof(one));
        fu_job_free(&gj);
        if (!ok) {
            snprintf(why, len, "head group %d of %d (a ring of %d): %s", g, G, R, one);
            return false;
        }
    }
    return true;
}
