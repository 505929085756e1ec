/* Kernel suite, non-finite inputs: a NaN, +inf or -inf in Q, K, V or dO, at
 * a position the mask lets queries see and at one it hides, with causal
 * masks, striped blocks without their diagonal, documents and windows, in
 * every dtype and on every variant, forward and backward. Each output that
 * depends on the value is non-finite; outputs of the other batch rows and
 * kv head groups are unchanged (nonfinite.h). */
#include <criterion/criterion.h>

#include <stdio.h>

#include "kernels_test_util.h"
#include "nonfinite.h"

/* The cases' masks and positions. */
enum { CFG_CAUSAL, CFG_STRIPED_DOCS, CFG_WINDOW_DOCS, CFG_NONCAUSAL_WINDOW, N_CFGS };
static const char *const cfg_names[] = {"causal", "striped without diagonal, documents",
                                        "causal window, documents", "non-causal window"};
static const int64_t cfg_cu[] = {0, 37, 37, 130, 200}; /* striped: positions 0..199 */
static const int64_t cfg_cu_short[] = {0, 37, 37, 100};

static kcase_t nf_case(int cfg, stria_dtype_t dtype)
{
    kcase_t c = {.B = 2,
                 .Tq = 100,
                 .Tk = 100,
                 .H = 4,
                 .Hkv = 2,
                 .D = cfg == CFG_WINDOW_DOCS ? 48 : 32,
                 .causal = cfg != CFG_NONCAUSAL_WINDOW,
                 .dtype = dtype,
                 .threads = cfg == CFG_STRIPED_DOCS ? 2 : 1};
    switch (cfg) {
    case CFG_STRIPED_DOCS: /* queries 0, 2, ..., keys 1, 3, ...: query 0 sees nothing */
        c.qruns[0] = (stria_pos_run_t){0, 2, 100};
        c.kruns[0] = (stria_pos_run_t){1, 2, 100};
        c.n_qruns = c.n_kruns = 1;
        c.cu = cfg_cu;
        c.n_cu = 5;
        break;
    case CFG_WINDOW_DOCS:
        c.cu = cfg_cu_short;
        c.n_cu = 4;
        c.has_window = true;
        c.left = 20;
        c.right = 0;
        break;
    case CFG_NONCAUSAL_WINDOW: /* keys 30..129 against queries 0..99 */
        c.kruns[0] = (stria_pos_run_t){30, 1, 100};
        c.n_kruns = 1;
        c.has_window = true;
        c.left = 5;
        c.right = 12;
        break;
    default:
        break;
    }
    return c;
}

static void nf_cr_report(void *ctx, const char *msg)
{
    (void)ctx;
    cr_expect(false, "%s", msg);
}

typedef struct {
    float *f[NF_N_TENSORS]; /* Q, K, V, dO as fp32 values of the dtype */
    size_t n[NF_N_TENSORS];
} nf_inputs_t;

static void nf_inputs(const kcase_t *c, nf_inputs_t *in)
{
    in->n[NF_Q] = in->n[NF_DO] = (size_t)(c->B * c->Tq * c->H * c->D);
    in->n[NF_K] = in->n[NF_V] = (size_t)(c->B * c->Tk * c->Hkv * c->D);
    for (int t = 0; t < NF_N_TENSORS; t++) {
        in->f[t] = malloc(in->n[t] * sizeof(float));
        ref_fill(in->f[t], in->n[t], 90 + (uint64_t)t, t == NF_Q || t == NF_K ? 2.0f : 1.0f,
                 c->dtype);
    }
}

static void nf_outs_free(nf_outs_t *o)
{
    free((void *)o->o), free((void *)o->lse), free((void *)o->dq), free((void *)o->dk);
    free((void *)o->dv);
}

/* Forward, delta and backward of the case on the current variant. */
static void nf_run(const kcase_t *c, const nf_inputs_t *in, nf_outs_t *out)
{
    const size_t es = stria_dtype_size(c->dtype), nq = in->n[NF_Q], nk = in->n[NF_K];
    const size_t nl = (size_t)(c->B * c->H * c->Tq);
    void *st[NF_N_TENSORS];
    float *o = malloc(nq * 4), *lse = malloc(nl * 4), *delta = malloc(nl * 4);
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
    stria_pool_t *pool = NULL;
    for (int t = 0; t < NF_N_TENSORS; t++) {
        st[t] = malloc(in->n[t] * es);
        ref_to_dtype(in->f[t], in->n[t], c->dtype, st[t]);
    }
    if (c->threads > 1)
        cr_assert_eq(stria_pool_create(c->threads, &pool), STRIA_OK);
    const outs_t o4 = {o, lse, dq, dk, dv};
    case_fwd_bwd(c, pool, st[NF_Q], st[NF_K], st[NF_V], st[NF_DO], &o4, delta);
    stria_pool_destroy(pool);
    for (int t = 0; t < NF_N_TENSORS; t++)
        free(st[t]);
    free(delta);
    *out = (nf_outs_t){o, lse, dq, dk, dv};
}

/* Every value and placement of one tensor's spot, for one case on the
 * current variant. */
static void nf_tensor_cases(const kcase_t *c, int cfg, nf_tensor_t t, const char *variant)
{
    const bool qside = t == NF_Q || t == NF_DO;
    nf_inputs_t in;
    nf_outs_t clean;
    ref_masks_t masks;
    int64_t *qpos = expand(c->qruns, c->n_qruns, c->Tq),
            *kpos = expand(c->kruns, c->n_kruns, c->Tk);
    const nf_dims_t dims = {c->B, c->Tq, c->Tk, c->H, c->Hkv, c->D};

    (void)case_params(c, NULL, &masks);
    ref_shape_t rs = {c->B,      c->Tq, c->Tk, c->H, c->Hkv, c->D, 1.0 / sqrt((double)c->D),
                      c->causal, qpos,  kpos};
    nf_inputs(c, &in);
    nf_run(c, &in, &clean);
    for (int visible = 1; visible >= 0; visible--) {
        int64_t tok = nf_token(&rs, &masks, qside, visible, qside ? 70 : 20);
        if (tok < 0)
            continue;
        for (size_t vi = 0; vi < sizeof(nf_values) / sizeof(nf_values[0]); vi++) {
            nf_spot_t s = {t, 1, tok, 1, 5, nf_values[vi]};
            size_t at = nf_index(&dims, &s);
            float keep = in.f[t][at];
            char label[256];
            nf_outs_t got;
            ref_out_t ref;
            snprintf(label, sizeof(label), "%s %s %s: %s %s at %s token %lld", variant,
                     stria_dtype_name(c->dtype), cfg_names[cfg], nf_tensor_names[t],
                     nf_value_names[vi], visible ? "visible" : "hidden", (long long)tok);
            in.f[t][at] = s.value;
            nf_run(c, &in, &got);
            nf_ref_run(&rs, &masks, in.f[NF_Q], in.f[NF_K], in.f[NF_V], in.f[NF_DO], &ref);
            nf_check(&dims, &s, visible, &got, &clean, &ref, label, nf_cr_report, NULL);
            in.f[t][at] = keep;
            ref_out_free(&ref);
            nf_outs_free(&got);
        }
    }
    nf_outs_free(&clean);
    for (int x = 0; x < NF_N_TENSORS; x++)
        free(in.f[x]);
    free(qpos), free(kpos);
}

/* The tensor's spots in every case, dtype and variant this CPU runs. */
static void nf_tensor_all(nf_tensor_t t)
{
    const char *const *names = stria_kernels_variant_names();
    const char *expected[CPU_EXPECT_MAX];
    size_t n_expected = cpu_expected_simd(expected), simd_ran = 0;
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i])) {
            cr_log_info("variant %s not supported by this CPU: skipped", names[i]);
            continue;
        }
        cr_assert_eq(stria_kernels_set_variant(names[i]), STRIA_OK, "%s", stria_error_msg());
        for (int cfg = 0; cfg < N_CFGS; cfg++)
            for (size_t d = 0; d < 3; d++) {
                kcase_t c = nf_case(cfg, all_dtypes[d]);
                nf_tensor_cases(&c, cfg, t, names[i]);
            }
        simd_ran += cpu_name_in(expected, names[i]);
    }
    cr_assert_eq(simd_ran, n_expected, "%zu of the %zu SIMD variants this CPU supports ran",
                 simd_ran, n_expected);
}

NF_TESTS_PER_TENSOR(kernels_nonfinite, nf_tensor_all)

/* A call whose inputs are all NaN leaves NaN in every workspace and scratch
 * buffer it used; the next call, reusing them (kernels/workspace.c), must
 * not read any of it: a query chunk that sees no key of its first key tile
 * but keys of a later one (the window) starts its output afresh. Every
 * output of the clean call is finite, on every variant and dtype. */
Test(kernels_nonfinite, a_poisoned_call_leaves_nothing_behind)
{
    const char *const *names = stria_kernels_variant_names();
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i]))
            continue;
        cr_assert_eq(stria_kernels_set_variant(names[i]), STRIA_OK, "%s", stria_error_msg());
        for (size_t d = 0; d < 3; d++) {
            kcase_t c = nf_case(CFG_WINDOW_DOCS, all_dtypes[d]);
            nf_inputs_t in;
            nf_outs_t bad, good;
            nf_inputs(&c, &in);
            for (int t = 0; t < NF_N_TENSORS; t++)
                for (size_t x = 0; x < in.n[t]; x++)
                    in.f[t][x] = t == NF_DO ? in.f[t][x] : NAN;
            nf_run(&c, &in, &bad);
            nf_outs_free(&bad);
            for (int t = 0; t < NF_N_TENSORS; t++)
                free(in.f[t]);
            nf_inputs(&c, &in);
            nf_run(&c, &in, &good);
            const float *outs[] = {good.o, good.dq, good.dk, good.dv};
            const size_t ns[] = {in.n[NF_Q], in.n[NF_Q], in.n[NF_K], in.n[NF_K]};
            size_t bad_n = 0;
            for (int o = 0; o < 4; o++)
                for (size_t x = 0; x < ns[o]; x++)
                    bad_n += !isfinite(outs[o][x]);
            cr_expect(bad_n == 0, "%s %s: %zu non-finite outputs of a clean call after a NaN one",
                      names[i], stria_dtype_name(c.dtype), bad_n);
            nf_outs_free(&good);
            for (int t = 0; t < NF_N_TENSORS; t++)
                free(in.f[t]);
        }
    }
}
