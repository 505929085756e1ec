/* Helpers of the kernel suites (test_kernels_*): a case (shape, positions,
 * masks) run on every CPU variant against an fp64 reference, with the
 * tolerance rule of the architecture: the error must stay within 2x the error
 * of a plain fp32 implementation on the same inputs, plus a small floor. A
 * variant that runs bf16 inputs on the bf16 dot product (P and dS rounded to
 * bf16, as FlashAttention does) is held to FlashAttention's bar instead for
 * O, dQ, dK and dV: 2x the error of the same computation done in bf16 by
 * PyTorch's math SDPA (ref_bf16_run_masks), plus the floor. Also the outputs
 * of one variant, block params and error checks that several suites use.
 * Static inline: each suite is one file. */
#ifndef STRIA_TEST_KERNELS_TEST_UTIL_H
#define STRIA_TEST_KERNELS_TEST_UTIL_H

#include <criterion/criterion.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_expect.h"
#include "ref.h"
#include "stria_kernels.h"

typedef struct {
    int64_t B, Tq, Tk, H, Hkv, D;
    bool causal;
    stria_dtype_t dtype;
    stria_pos_run_t qruns[4];
    size_t n_qruns;
    stria_pos_run_t kruns[4];
    size_t n_kruns;
    int threads;
    float scale; /* 0 = default */
    /* documents and window (stria_attn_params_t's fields; zero: none) */
    const int64_t *cu;
    size_t n_cu;
    bool has_window;
    int64_t left, right;
} kcase_t;

/* The case's masks on params p, and as the reference takes them. */
static inline void case_masks(const kcase_t *c, stria_attn_params_t *p, ref_masks_t *m)
{
    p->cu_seqlens = c->cu;
    p->n_cu_seqlens = c->n_cu;
    p->has_window = c->has_window;
    p->window_left = c->left;
    p->window_right = c->right;
    m->cu_seqlens = c->cu;
    m->n_cu = c->n_cu;
    m->has_window = c->has_window;
    m->left = c->left;
    m->right = c->right;
}

/* The kernels' parameters of case c (positions and masks from the case,
 * the masks' storage in *m), on `pool`. */
static inline stria_attn_params_t case_params(const kcase_t *c, stria_pool_t *pool, ref_masks_t *m)
{
    stria_attn_params_t p = {0};
    p.batch = c->B;
    p.q_tokens = c->Tq;
    p.kv_tokens = c->Tk;
    p.heads = c->H;
    p.kv_heads = c->Hkv;
    p.head_dim = c->D;
    p.scale = c->scale;
    p.causal = c->causal;
    p.q_pos.runs = c->n_qruns ? c->qruns : NULL;
    p.q_pos.n_runs = c->n_qruns;
    p.kv_pos.runs = c->n_kruns ? c->kruns : NULL;
    p.kv_pos.n_runs = c->n_kruns;
    p.pool = pool;
    case_masks(c, &p, m);
    return p;
}

static inline int64_t *expand(const stria_pos_run_t *runs, size_t n_runs, int64_t tokens)
{
    int64_t *pos = malloc((size_t)tokens * sizeof(int64_t));
    int64_t n = 0;
    if (n_runs == 0)
        for (int64_t i = 0; i < tokens; i++)
            pos[i] = i;
    for (size_t r = 0; r < n_runs; r++)
        for (int64_t i = 0; i < runs[r].count; i++)
            pos[n++] = runs[r].first + i * runs[r].stride;
    return pos;
}

typedef struct {
    double o, lse, dq, dk, dv;
} errs_t;

/* Floor of the tolerance rule: relative to the size of the values compared. */
#define FLOOR_REL 2e-6

static inline void check_err(const char *what, double err, double naive_err, double maxabs,
                             const char *variant, const kcase_t *c)
{
    double tol = 2.0 * naive_err + FLOOR_REL * (1.0 + maxabs);
    if (ref_bf16_dot(variant) && c->dtype == STRIA_DTYPE_BF16 && strcmp(what, "LSE") != 0)
        cr_log_info("bf16 bar: %s D=%lld Tq=%lld Tk=%lld: error %.3g = %.2f x the bf16 math error "
                    "%.3g",
                    what, (long long)c->D, (long long)c->Tq, (long long)c->Tk, err,
                    naive_err > 0 ? err / naive_err : 0.0, naive_err);
    cr_expect(err <= tol,
              "%s: variant %s dtype %s D=%lld Tq=%lld Tk=%lld H=%lld/%lld causal=%d threads=%d "
              "docs=%zu window=%d(%lld,%lld) q_first=%lld stride=%lld k_first=%lld stride=%lld: "
              "error %.3g > tolerance %.3g (yardstick error %.3g, max |ref| %.3g)",
              what, variant, stria_dtype_name(c->dtype), (long long)c->D, (long long)c->Tq,
              (long long)c->Tk, (long long)c->H, (long long)c->Hkv, c->causal, c->threads, c->n_cu,
              c->has_window, (long long)c->left, (long long)c->right, (long long)c->qruns[0].first,
              (long long)c->qruns[0].stride, (long long)c->kruns[0].first,
              (long long)c->kruns[0].stride, err, tol, naive_err, maxabs);
}

typedef struct {
    float *o, *lse, *dq, *dk, *dv;
} outs_t;

/* Forward, delta and backward of case c on the current variant, on `pool`:
 * inputs qs, ks, vs, gs stored in the case's dtype, contiguous; outputs into
 * out's arrays (dq, dk, dv zeroed by the caller) and delta. */
static inline void case_fwd_bwd(const kcase_t *c, stria_pool_t *pool, void *qs, void *ks, void *vs,
                                void *gs, const outs_t *out, float *delta)
{
    ref_masks_t unused;
    stria_attn_params_t p = case_params(c, pool, &unused);
    stria_tensor_t tq = stria_tensor_contiguous(qs, c->dtype, c->Tq, c->H, c->D);
    stria_tensor_t tk = stria_tensor_contiguous(ks, c->dtype, c->Tk, c->Hkv, c->D);
    stria_tensor_t tv = stria_tensor_contiguous(vs, c->dtype, c->Tk, c->Hkv, c->D);
    stria_tensor_t tg = stria_tensor_contiguous(gs, c->dtype, c->Tq, c->H, c->D);
    stria_tensor_t to = stria_tensor_contiguous(out->o, STRIA_DTYPE_F32, c->Tq, c->H, c->D);
    stria_tensor_t tdq = stria_tensor_contiguous(out->dq, STRIA_DTYPE_F32, c->Tq, c->H, c->D);
    stria_tensor_t tdk = stria_tensor_contiguous(out->dk, STRIA_DTYPE_F32, c->Tk, c->Hkv, c->D);
    stria_tensor_t tdv = stria_tensor_contiguous(out->dv, STRIA_DTYPE_F32, c->Tk, c->Hkv, c->D);
    cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to, out->lse, false), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_bwd_delta(&p, &to, &tg, delta), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd(&p, &tq, &tk, &tv, &tg, out->lse, delta, &tdq, &tdk, &tdv),
                 STRIA_OK, "%s", stria_error_msg());
}

static inline void run_case(const kcase_t *c, const char *variant)
{
    size_t nq = (size_t)(c->B * c->Tq * c->H * c->D);
    size_t nk = (size_t)(c->B * c->Tk * c->Hkv * c->D);
    size_t nl = (size_t)(c->B * c->H * c->Tq);
    size_t es = stria_dtype_size(c->dtype);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *g = malloc(nq * 4);
    void *qs = malloc(nq * es), *ks = malloc(nk * es), *vs = malloc(nk * es), *gs = malloc(nq * es);
    float *o = malloc(nq * 4), *lse = malloc(nl * 4), *delta = malloc(nl * 4);
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
    int64_t *qpos = expand(c->qruns, c->n_qruns, c->Tq);
    int64_t *kpos = expand(c->kruns, c->n_kruns, c->Tk);
    stria_pool_t *pool = NULL;

    cr_assert_eq(stria_kernels_set_variant(variant), STRIA_OK, "%s", stria_error_msg());
    if (c->threads > 1)
        cr_assert_eq(stria_pool_create(c->threads, &pool), STRIA_OK);
    ref_fill(q, nq, 1 + (uint64_t)c->D, 1.0f, c->dtype);
    ref_fill(k, nk, 2 + (uint64_t)c->Tk, 1.0f, c->dtype);
    ref_fill(v, nk, 3, 1.0f, c->dtype);
    ref_fill(g, nq, 4, 1.0f, c->dtype);
    ref_to_dtype(q, nq, c->dtype, qs);
    ref_to_dtype(k, nk, c->dtype, ks);
    ref_to_dtype(v, nk, c->dtype, vs);
    ref_to_dtype(g, nq, c->dtype, gs);

    ref_masks_t masks;
    (void)case_params(c, pool, &masks);
    const outs_t outs = {o, lse, dq, dk, dv};
    case_fwd_bwd(c, pool, qs, ks, vs, gs, &outs, delta);

    ref_shape_t rs = {c->B,
                      c->Tq,
                      c->Tk,
                      c->H,
                      c->Hkv,
                      c->D,
                      c->scale > 0 ? c->scale : 1.0 / sqrt((double)c->D),
                      c->causal,
                      qpos,
                      kpos};
    ref_out_t r64, r32, ry;
    ref_f64_run_masks(&rs, &masks, q, k, v, g, &r64);
    ref_f32_run_masks(&rs, &masks, q, k, v, g, &r32);
    /* the yardstick of O and the gradients: fp32, or bf16 math (see the top) */
    const bool bf16_dot = c->dtype == STRIA_DTYPE_BF16 && ref_bf16_dot(variant);
    if (bf16_dot)
        ref_bf16_run_masks(&rs, &masks, q, k, v, g, &ry);
    const ref_out_t *y = bf16_dot ? &ry : &r32;

    check_err("O", ref_max_err_f32(o, r64.o, nq), ref_max_err_f64(y->o, r64.o, nq),
              ref_max_abs(r64.o, nq), variant, c);
    check_err("LSE", ref_max_err_f32(lse, r64.lse, nl), ref_max_err_f64(r32.lse, r64.lse, nl),
              ref_max_abs(r64.lse, nl), variant, c);
    check_err("dQ", ref_max_err_f32(dq, r64.dq, nq), ref_max_err_f64(y->dq, r64.dq, nq),
              ref_max_abs(r64.dq, nq), variant, c);
    check_err("dK", ref_max_err_f32(dk, r64.dk, nk), ref_max_err_f64(y->dk, r64.dk, nk),
              ref_max_abs(r64.dk, nk), variant, c);
    check_err("dV", ref_max_err_f32(dv, r64.dv, nk), ref_max_err_f64(y->dv, r64.dv, nk),
              ref_max_abs(r64.dv, nk), variant, c);

    ref_out_free(&r64);
    ref_out_free(&r32);
    if (bf16_dot)
        ref_out_free(&ry);
    stria_pool_destroy(pool);
    free(q), free(k), free(v), free(g), free(qs), free(ks), free(vs), free(gs);
    free(o), free(lse), free(delta), free(dq), free(dk), free(dv), free(qpos), free(kpos);
}

/* Runs the case on every variant this CPU supports, and fails unless the
 * portable one and every SIMD variant the CPU has (cpu_expect.h) ran. */
static inline void for_each_variant(const kcase_t *c)
{
    const char *const *names = stria_kernels_variant_names();
    const char *expected[CPU_EXPECT_MAX];
    size_t n_expected = cpu_expected_simd(expected), simd_ran = 0;
    bool portable = false;
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i])) {
            cr_log_info("variant %s not supported by this CPU: skipped", names[i]);
            continue;
        }
        run_case(c, names[i]);
        portable |= strcmp(names[i], "portable") == 0;
        simd_ran += cpu_name_in(expected, names[i]);
    }
    cr_assert(portable, "the portable variant did not run");
    cr_assert_eq(simd_ran, n_expected, "%zu of the %zu SIMD variants this CPU supports ran",
                 simd_ran, n_expected);
}

static const stria_dtype_t all_dtypes[] = {STRIA_DTYPE_F32, STRIA_DTYPE_BF16, STRIA_DTYPE_F16};
/* Forward and backward of one case with one variant; inputs in amp-scaled
 * pseudo-random values so that scores span a wide range. */
static inline void run_outputs(const kcase_t *c, const char *variant, float amp, outs_t *out)
{
    size_t nq = (size_t)(c->B * c->Tq * c->H * c->D);
    size_t nk = (size_t)(c->B * c->Tk * c->Hkv * c->D);
    size_t nl = (size_t)(c->B * c->H * c->Tq);
    size_t es = stria_dtype_size(c->dtype);
    float *f = malloc(nq * 4);
    void *qs = malloc(nq * es), *ks = malloc(nk * es), *vs = malloc(nk * es), *gs = malloc(nq * es);
    float *delta = malloc(nl * 4);
    stria_pool_t *pool = NULL;

    out->o = malloc(nq * 4);
    out->lse = malloc(nl * 4);
    out->dq = calloc(nq, 4);
    out->dk = calloc(nk, 4);
    out->dv = calloc(nk, 4);
    cr_assert_eq(stria_kernels_set_variant(variant), STRIA_OK, "%s", stria_error_msg());
    if (c->threads > 1)
        cr_assert_eq(stria_pool_create(c->threads, &pool), STRIA_OK);
    ref_fill(f, nq, 21, amp, c->dtype);
    ref_to_dtype(f, nq, c->dtype, qs);
    ref_fill(f, nq, 22, 1.0f, c->dtype);
    ref_to_dtype(f, nq, c->dtype, gs);
    ref_fill(f, nk, 23, amp, c->dtype);
    ref_to_dtype(f, nk, c->dtype, ks);
    ref_fill(f, nk, 24, 1.0f, c->dtype);
    ref_to_dtype(f, nk, c->dtype, vs);

    case_fwd_bwd(c, pool, qs, ks, vs, gs, out, delta);
    stria_pool_destroy(pool);
    free(f), free(qs), free(ks), free(vs), free(gs), free(delta);
}

static inline void outs_free(outs_t *o)
{
    free(o->o), free(o->lse), free(o->dq), free(o->dk), free(o->dv);
}

static inline void block_params(stria_attn_params_t *p, int64_t Tq, int64_t Tk, int64_t H,
                                int64_t D)
{
    memset(p, 0, sizeof(*p));
    p->batch = 1;
    p->q_tokens = Tq;
    p->kv_tokens = Tk;
    p->heads = H;
    p->kv_heads = H;
    p->head_dim = D;
    p->causal = true;
}

static inline void expect_error(stria_status_t st, stria_status_t want, const char *needle)
{
    cr_expect_eq(st, want, "status %s, wanted %s (%s)", stria_status_name(st),
                 stria_status_name(want), stria_error_msg());
    cr_expect(strstr(stria_error_msg(), needle) != NULL, "message '%s' lacks '%s'",
              stria_error_msg(), needle);
}

/* One head of 16 dims, two query and two key tokens, no mask. */
static inline stria_attn_params_t tiny_params(void)
{
    stria_attn_params_t p = {0};
    p.batch = 1;
    p.q_tokens = 2;
    p.kv_tokens = 2;
    p.heads = 1;
    p.kv_heads = 1;
    p.head_dim = 16;
    return p;
}

#endif
