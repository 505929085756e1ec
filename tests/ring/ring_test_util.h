/* Helpers of the ring engine suites (test_ring_*): a case (ring size,
 * layout, shape, dtype) with its inputs, the ring run over in-process links,
 * and the check against single-process attention on the global sequence
 * with the tolerance rule of the kernel suite. Static inline: each suite is
 * one file. */
#ifndef STRIA_TEST_RING_TEST_UTIL_H
#define STRIA_TEST_RING_TEST_UTIL_H

#include <criterion/criterion.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref.h"
#include "stria_ring.h"

static const stria_layout_kind_t all_layouts[] = {STRIA_LAYOUT_STRIPED, STRIA_LAYOUT_CONTIGUOUS,
                                                  STRIA_LAYOUT_ZIGZAG};

typedef struct {
    int n;
    stria_layout_kind_t layout;
    bool causal;
    int64_t B, S, H, Hkv, D;
    stria_dtype_t dtype;
} rcase_t;

/* Inputs (fp32 values exactly representable in the dtype, and the dtype
 * storage) and the ring's fp32 outputs. */
typedef struct {
    size_t nq, nk, nl;
    float *q, *k, *v, *g;
    void *qs, *ks, *vs, *gs;
    float *o, *lse, *dq, *dk, *dv;
} rdata_t;

static inline void data_init(const rcase_t *c, rdata_t *d, uint64_t seed)
{
    size_t es = stria_dtype_size(c->dtype);
    memset(d, 0, sizeof(*d));
    d->nq = (size_t)(c->B * c->S * c->H * c->D);
    d->nk = (size_t)(c->B * c->S * c->Hkv * c->D);
    d->nl = (size_t)(c->B * c->H * c->S);
    d->q = malloc(d->nq * 4), d->g = malloc(d->nq * 4);
    d->k = malloc(d->nk * 4), d->v = malloc(d->nk * 4);
    d->qs = malloc(d->nq * es), d->gs = malloc(d->nq * es);
    d->ks = malloc(d->nk * es), d->vs = malloc(d->nk * es);
    d->o = malloc(d->nq * 4), d->dq = malloc(d->nq * 4);
    d->dk = malloc(d->nk * 4), d->dv = malloc(d->nk * 4);
    d->lse = malloc(d->nl * 4);
    ref_fill(d->q, d->nq, seed * 4 + 1, 2.0f, c->dtype);
    ref_fill(d->k, d->nk, seed * 4 + 2, 2.0f, c->dtype);
    ref_fill(d->v, d->nk, seed * 4 + 3, 1.0f, c->dtype);
    ref_fill(d->g, d->nq, seed * 4 + 4, 1.0f, c->dtype);
    ref_to_dtype(d->q, d->nq, c->dtype, d->qs);
    ref_to_dtype(d->k, d->nk, c->dtype, d->ks);
    ref_to_dtype(d->v, d->nk, c->dtype, d->vs);
    ref_to_dtype(d->g, d->nq, c->dtype, d->gs);
}

static inline void data_free(rdata_t *d)
{
    void *all[] = {d->q,  d->k, d->v,   d->g,  d->qs, d->ks, d->vs,
                   d->gs, d->o, d->lse, d->dq, d->dk, d->dv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        free(all[i]);
}

static inline stria_ring_shape_t shape_of(const rcase_t *c)
{
    stria_ring_shape_t s = {.call = {.batch = c->B, .seq_len = c->S, .causal = c->causal},
                            .heads = c->H,
                            .kv_heads = c->Hkv,
                            .head_dim = c->D,
                            .dtype = c->dtype};
    return s;
}

/* The case's shape with the masks m (NULL: none). */
static inline stria_ring_shape_t shape_with_masks(const rcase_t *c, const ref_masks_t *m)
{
    stria_ring_shape_t shape = shape_of(c);
    if (m != NULL) {
        shape.call.cu_seqlens = m->cu_seqlens;
        shape.call.n_cu_seqlens = m->n_cu;
        shape.call.has_window = m->has_window;
        shape.call.window_left = m->left;
        shape.call.window_right = m->right;
    }
    return shape;
}

/* The ring over in-process links, forward and backward, with the masks m
 * (NULL: none). */
static inline stria_status_t ring_run_masks(const rcase_t *c, const ref_masks_t *m, rdata_t *d,
                                            stria_ring_local_stats_t *stats)
{
    stria_ring_shape_t shape = shape_with_masks(c, m);
    stria_ring_local_opts_t opts = {.layout = c->layout,
                                    .n_ranks = c->n,
                                    .passes = STRIA_RING_PASS_FWD_BWD,
                                    .step_timeout_s = 60};
    stria_ring_local_io_t io = {.q = d->qs,
                                .k = d->ks,
                                .v = d->vs,
                                .o = d->o,
                                .o_dtype = STRIA_DTYPE_F32,
                                .lse = d->lse,
                                .d_o = d->gs,
                                .dq = d->dq,
                                .dk = d->dk,
                                .dv = d->dv,
                                .grad_dtype = STRIA_DTYPE_F32};
    return stria_ring_run_local(&shape, &opts, &io, stats);
}

static inline stria_status_t ring_run(const rcase_t *c, rdata_t *d, stria_ring_local_stats_t *stats)
{
    return ring_run_masks(c, NULL, d, stats);
}

typedef struct {
    double o, lse, dq, dk, dv;
} errs_t;

static inline errs_t errs_vs(const rdata_t *d, const ref_out_t *r)
{
    errs_t e = {ref_max_err_f32(d->o, r->o, d->nq), ref_max_err_f32(d->lse, r->lse, d->nl),
                ref_max_err_f32(d->dq, r->dq, d->nq), ref_max_err_f32(d->dk, r->dk, d->nk),
                ref_max_err_f32(d->dv, r->dv, d->nk)};
    return e;
}

static inline ref_shape_t ref_shape(const rcase_t *c)
{
    ref_shape_t rs = {c->B,      c->S, c->S, c->H, c->Hkv, c->D, 1.0 / sqrt((double)c->D),
                      c->causal, NULL, NULL};
    return rs;
}

#define FLOOR_REL 2e-6

static inline void check_err(const char *what, double err, double naive_err, double maxabs,
                             const rcase_t *c)
{
    double tol = 2.0 * naive_err + FLOOR_REL * (1.0 + maxabs);
    cr_expect(err <= tol,
              "%s: N=%d %s %s S=%lld B=%lld H=%lld/%lld D=%lld %s: error %.3g > tolerance %.3g "
              "(yardstick error %.3g, max |ref| %.3g)",
              what, c->n, stria_layout_kind_name(c->layout), c->causal ? "causal" : "non-causal",
              (long long)c->S, (long long)c->B, (long long)c->H, (long long)c->Hkv, (long long)c->D,
              stria_dtype_name(c->dtype), err, tol, naive_err, maxabs);
}

/* The ring against the fp64 reference of the global sequence, within the
 * kernel tolerance rule (2x the naive fp32 error plus a small floor; for O
 * and the gradients of bf16 inputs on the bf16 dot product, 2x the error of
 * the same computation done in bf16 by PyTorch's math SDPA, as in the
 * kernel suite). */
static inline void check_case(const rcase_t *c)
{
    rdata_t d;
    ref_out_t r64, r32, ry;
    ref_shape_t rs = ref_shape(c);
    const bool bf16_dot = c->dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(stria_kernels_variant());

    data_init(c, &d, (uint64_t)(c->S * 31 + c->n));
    cr_assert_eq(ring_run(c, &d, NULL), STRIA_OK, "N=%d %s S=%lld: %s", c->n,
                 stria_layout_kind_name(c->layout), (long long)c->S, stria_error_msg());
    ref_f64_run(&rs, d.q, d.k, d.v, d.g, &r64);
    ref_f32_run(&rs, d.q, d.k, d.v, d.g, &r32);
    if (bf16_dot)
        ref_bf16_run_masks(&rs, NULL, d.q, d.k, d.v, d.g, &ry);
    const ref_out_t *y = bf16_dot ? &ry : &r32;
    errs_t e = errs_vs(&d, &r64);
    check_err("O", e.o, ref_max_err_f64(y->o, r64.o, d.nq), ref_max_abs(r64.o, d.nq), c);
    check_err("LSE", e.lse, ref_max_err_f64(r32.lse, r64.lse, d.nl), ref_max_abs(r64.lse, d.nl), c);
    check_err("dQ", e.dq, ref_max_err_f64(y->dq, r64.dq, d.nq), ref_max_abs(r64.dq, d.nq), c);
    check_err("dK", e.dk, ref_max_err_f64(y->dk, r64.dk, d.nk), ref_max_abs(r64.dk, d.nk), c);
    check_err("dV", e.dv, ref_max_err_f64(y->dv, r64.dv, d.nk), ref_max_abs(r64.dv, d.nk), c);
    if (bf16_dot) {
        cr_log_info("bf16 bar: N=%d S=%lld: O %.2f dQ %.2f dK %.2f dV %.2f x the bf16 math error",
                    c->n, (long long)c->S, e.o / ref_max_err_f64(ry.o, r64.o, d.nq),
                    e.dq / ref_max_err_f64(ry.dq, r64.dq, d.nq),
                    e.dk / ref_max_err_f64(ry.dk, r64.dk, d.nk),
                    e.dv / ref_max_err_f64(ry.dv, r64.dv, d.nk));
        ref_out_free(&ry);
    }
    ref_out_free(&r64);
    ref_out_free(&r32);
    data_free(&d);
}

static inline bool same_bits(const void *a, const void *b, size_t n, const char *what, int rank,
                             const rcase_t *c)
{
    bool same = memcmp(a, b, n) == 0;
    cr_expect(same, "%s differs on rank %d: N=%d %s %s S=%lld H=%lld/%lld %s", what, rank, c->n,
              stria_layout_kind_name(c->layout), c->causal ? "causal" : "non-causal",
              (long long)c->S, (long long)c->H, (long long)c->Hkv, stria_dtype_name(c->dtype));
    return same;
}

#endif
