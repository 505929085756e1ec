#include "tjob.h"

#include <stdlib.h>
#include <string.h>

#include "ref.h"

const char *const tjob_out_names[TJ_N_OUT] = {"O", "LSE", "dQ", "dK", "dV"};

bool tjob_init(tjob_t *j, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
               int64_t head_dim, stria_dtype_t dtype, bool causal, uint64_t seed)
{
    memset(j, 0, sizeof(*j));
    j->spec = (stria_job_spec_t)STRIA_JOB_SPEC_INIT;
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
    float **f[4] = {&j->qf, &j->kf, &j->vf, &j->gf};
    void **x[4] = {&j->q, &j->k, &j->v, &j->g};
    const size_t n[4] = {j->nq, j->nk, j->nk, j->nq};
    bool ok = true;
    for (int i = 0; i < 4 && ok; i++) {
        *f[i] = malloc(n[i] * sizeof(float));
        *x[i] = malloc(n[i] * j->es);
        ok = *f[i] != NULL && *x[i] != NULL;
        if (ok) {
            ref_fill(*f[i], n[i], seed + (uint64_t)i, 1.0f, dtype);
            ref_to_dtype(*f[i], n[i], dtype, *x[i]);
        }
    }
    j->o = calloc(j->nq, j->es);
    j->dq = calloc(j->nq, j->es);
    j->dk = calloc(j->nk, j->es);
    j->dv = calloc(j->nk, j->es);
    j->lse = calloc(j->nl, sizeof(float));
    if (!ok || !j->o || !j->dq || !j->dk || !j->dv || !j->lse) {
        tjob_free(j);
        return false;
    }
    return true;
}

void tjob_free(tjob_t *j)
{
    free(j->qf), free(j->kf), free(j->vf), free(j->gf);
    free(j->q), free(j->k), free(j->v), free(j->g);
    free(j->o), free(j->dq), free(j->dk), free(j->dv), free(j->lse);
    memset(j, 0, sizeof(*j));
}

void tjob_outputs(const tjob_t *j, void *out[TJ_N_OUT], size_t bytes[TJ_N_OUT])
{
    out[TJ_O] = j->o, out[TJ_LSE] = j->lse, out[TJ_DQ] = j->dq;
    out[TJ_DK] = j->dk, out[TJ_DV] = j->dv;
    if (bytes != NULL) {
        bytes[TJ_O] = bytes[TJ_DQ] = j->nq * j->es;
        bytes[TJ_LSE] = j->nl * sizeof(float);
        bytes[TJ_DK] = bytes[TJ_DV] = j->nk * j->es;
    }
}

stria_ring_shape_t tjob_ring_shape(const tjob_t *j)
{
    const stria_job_spec_t *s = &j->spec;
    return (stria_ring_shape_t){.call = {.batch = s->batch,
                                         .seq_len = s->seq_len,
                                         .causal = s->causal,
                                         .cu_seqlens = s->cu_seqlens,
                                         .n_cu_seqlens = s->n_cu_seqlens,
                                         .has_window = s->has_window,
                                         .window_left = s->has_window ? s->window_left : 0,
                                         .window_right = s->has_window ? s->window_right : 0},
                                .heads = s->heads,
                                .kv_heads = s->kv_heads,
                                .head_dim = s->head_dim,
                                .dtype = s->dtype};
}
