/* A ring-engine problem shared by the UCX suite and its rank program: the
 * shape, layout and seed travel on the command line as one spec string, and
 * both sides build the same full inputs from it. */
#ifndef STRIA_TEST_UCX_ENGINE_CASE_H
#define STRIA_TEST_UCX_ENGINE_CASE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "stria_ring.h"

typedef struct {
    int64_t batch, seq, heads, kv_heads, head_dim;
    int causal;
    stria_dtype_t dtype;
    stria_layout_kind_t layout;
    unsigned seed;
} engine_case_t;

/* Full inputs in the storage dtype, [batch, seq, heads|kv_heads, head_dim];
 * free each with free(). */
typedef struct {
    void *q, *k, *v, *d_o;
} engine_inputs_t;

/* "batch:seq:heads:kv_heads:head_dim:causal:dtype:layout:seed" */
static inline void engine_case_format(const engine_case_t *c, char *out, size_t n)
{
    snprintf(out, n, "%lld:%lld:%lld:%lld:%lld:%d:%s:%s:%u", (long long)c->batch, (long long)c->seq,
             (long long)c->heads, (long long)c->kv_heads, (long long)c->head_dim, c->causal,
             stria_dtype_name(c->dtype), stria_layout_kind_name(c->layout), c->seed);
}

static inline int engine_case_parse(const char *s, engine_case_t *c)
{
    long long b, seq, h, hkv, d;
    int causal;
    unsigned seed;
    char dtype[16], layout[16];
    if (sscanf(s, "%lld:%lld:%lld:%lld:%lld:%d:%15[^:]:%15[^:]:%u", &b, &seq, &h, &hkv, &d, &causal,
               dtype, layout, &seed) != 9)
        return -1;
    c->batch = b, c->seq = seq, c->heads = h, c->kv_heads = hkv, c->head_dim = d;
    c->causal = causal;
    c->seed = seed;
    if (stria_dtype_parse(dtype, &c->dtype) != STRIA_OK ||
        stria_layout_kind_parse(layout, &c->layout) != STRIA_OK)
        return -1;
    return 0;
}

static inline stria_ring_shape_t engine_case_shape(const engine_case_t *c)
{
    stria_ring_shape_t s = {
        .call = {.batch = c->batch, .seq_len = c->seq, .causal = c->causal != 0},
        .heads = c->heads,
        .kv_heads = c->kv_heads,
        .head_dim = c->head_dim,
        .dtype = c->dtype};
    return s;
}

static inline void *engine_fill(size_t n, uint64_t seed, float amp, stria_dtype_t dtype)
{
    float *f = malloc(n * sizeof(float));
    void *out = malloc(n * stria_dtype_size(dtype));
    if (f != NULL && out != NULL) {
        ref_fill(f, n, seed, amp, dtype);
        ref_to_dtype(f, n, dtype, out);
    }
    free(f);
    return out;
}

static inline void engine_inputs_make(const engine_case_t *c, engine_inputs_t *in)
{
    size_t nq = (size_t)(c->batch * c->seq * c->heads * c->head_dim);
    size_t nk = (size_t)(c->batch * c->seq * c->kv_heads * c->head_dim);
    in->q = engine_fill(nq, (uint64_t)c->seed * 4 + 1, 2.0f, c->dtype);
    in->k = engine_fill(nk, (uint64_t)c->seed * 4 + 2, 2.0f, c->dtype);
    in->v = engine_fill(nk, (uint64_t)c->seed * 4 + 3, 1.0f, c->dtype);
    in->d_o = engine_fill(nq, (uint64_t)c->seed * 4 + 4, 1.0f, c->dtype);
}

static inline void engine_inputs_free(engine_inputs_t *in)
{
    free(in->q);
    free(in->k);
    free(in->v);
    free(in->d_o);
    memset(in, 0, sizeof(*in));
}

#endif
