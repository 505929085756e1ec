#include "fault_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "stria_common.h"
#include "stria_ring.h"

static void *fill(size_t n, uint64_t seed, stria_dtype_t dtype, size_t es)
{
    float *f = malloc(n * sizeof(float));
    void *out = malloc(n * es);
    if (f == NULL || out == NULL) {
        free(f);
        free(out);
        return NULL;
    }
    ref_fill(f, n, seed, 1.0f, dtype);
    ref_to_dtype(f, n, dtype, out);
    free(f);
    return out;
}

bool fu_job_init(fu_job_t *j, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, stria_dtype_t dtype, bool causal, uint64_t seed)
{
    memset(j, 0, sizeof(*j));
    j->spec.struct_size = sizeof(j->spec);
    j->spec.batch = batch;
    j->spec.seq_len = seq;
    j->spec.heads = heads;
    j->spec.kv_heads = kv_heads;
    j->spec.head_dim = head_dim;
    j->spec.dtype = dtype;
    j->spec.causal = causal;
    j->es = stria_dtype_size(dtype);
    j->nq = (size_t)(batch * seq * heads * head_dim);
    j->nk = (size_t)(batch * seq * kv_heads * head_dim);
    j->nl = (size_t)(batch * heads * seq);
    j->q = fill(j->nq, seed * 4 + 1, dtype, j->es);
    j->k = fill(j->nk, seed * 4 + 2, dtype, j->es);
    j->v = fill(j->nk, seed * 4 + 3, dtype, j->es);
    j->g = fill(j->nq, seed * 4 + 4, dtype, j->es);
    j->o = calloc(j->nq, j->es);
    j->dq = calloc(j->nq, j->es);
    j->dk = calloc(j->nk, j->es);
    j->dv = calloc(j->nk, j->es);
    j->lse = calloc(j->nl, sizeof(float));
    if (!j->q || !j->k || !j->v || !j->g || !j->o || !j->dq || !j->dk || !j->dv || !j->lse) {
        fu_job_free(j);
        return false;
    }
    return true;
}

void fu_job_free(fu_job_t *j)
{
    free(j->q), free(j->k), free(j->v), free(j->g);
    free(j->o), free(j->dq), free(j->dk), free(j->dv), free(j->lse);
    memset(j, 0, sizeof(*j));
}

bool fu_ring_equal(const fu_job_t *j, int n_ranks, stria_layout_kind_t layout, bool backward,
                   char *why, size_t len)
{
    const stria_job_spec_t *s = &j->spec;
    stria_ring_shape_t shape = {.batch = s->batch,
                                .seq = s->seq_len,
                                .heads = s->heads,
                                .kv_heads = s->kv_heads,
                                .head_dim = s->head_dim,
                                .causal = s->causal,
                                .dtype = s->dtype};
    stria_ring_local_opts_t lo = {.layout = layout,
                                  .n_ranks = n_ranks,
                                  .passes =
                                      backward ? STRIA_RING_PASS_FWD_BWD : STRIA_RING_PASS_FWD};
    fu_job_t r = *j; /* the same inputs, our own outputs */
    r.o = calloc(j->nq, j->es);
    r.dq = calloc(j->nq, j->es);
    r.dk = calloc(j->nk, j->es);
    r.dv = calloc(j->nk, j->es);
    r.lse = calloc(j->nl, sizeof(float));
    bool ok = r.o && r.dq && r.dk && r.dv && r.lse;
    if (!ok)
        snprintf(why, len, "out of memory");
    stria_ring_local_io_t io = {.q = j->q,
                                .k = j->k,
                                .v = j->v,
                                .o = r.o,
                                .o_dtype = s->dtype,
                                .lse = r.lse,
                                .d_o = j->g,
                                .dq = r.dq,
                                .dk = r.dk,
                                .dv = r.dv,
                                .grad_dtype = s->dtype};
    if (ok && stria_ring_run_local(&shape, &lo, &io, NULL) != STRIA_OK) {
        snprintf(why, len, "in-process ring: %s", stria_error_msg());
        ok = false;
    }
    const char *bad = NULL;
    if (ok && memcmp(r.o, j->o, j->nq * j->es) != 0)
        bad = "O";
    else if (ok && memcmp(r.lse, j->lse, j->nl * sizeof(float)) != 0)
        bad = "LSE";
    else if (ok && backward && memcmp(r.dq, j->dq, j->nq * j->es) != 0)
        bad = "dQ";
    else if (ok && backward && memcmp(r.dk, j->dk, j->nk * j->es) != 0)
        bad = "dK";
    else if (ok && backward && memcmp(r.dv, j->dv, j->nk * j->es) != 0)
        bad = "dV";
    if (bad != NULL) {
        snprintf(why, len, "%s differs from the in-process ring of %d ranks (%s)", bad, n_ranks,
                 stria_layout_kind_name(layout));
        ok = false;
    }
    free(r.o), free(r.dq), free(r.dk), free(r.dv), free(r.lse);
    return ok;
}
