/* Ring engine suite, non-finite inputs: a NaN, +inf or -inf in Q, K, V or
 * dO of the global sequence, through the in-process ring of N = 1..4 ranks
 * in every layout, causal, with and without documents and a window, fp32
 * and bf16, on every kernel variant this CPU runs: the ring's merges of
 * partial outputs and LSE, and the dK/dV that travel it, hide nothing. Each
 * output that depends on the value is non-finite; outputs of the other
 * batch row and kv head group are unchanged (tests/kernels/nonfinite.h). */
#include <criterion/criterion.h>

#include "cpu_expect.h"
#include "nonfinite.h"
#include "ring_test_util.h"

static void ring_nf_report(void *ctx, const char *msg)
{
    (void)ctx;
    cr_expect(false, "%s", msg);
}

static const int64_t ring_nf_cu[] = {0, 37, 37, 60, 96};

/* Puts value at the spot of both copies of the inputs (fp32 values and the
 * dtype's storage). */
static void ring_nf_put(const rcase_t *c, rdata_t *d, const nf_spot_t *s, float value)
{
    const nf_dims_t dims = {c->B, c->S, c->S, c->H, c->Hkv, c->D};
    float *f[NF_N_TENSORS] = {d->q, d->k, d->v, d->g};
    void *st[NF_N_TENSORS] = {d->qs, d->ks, d->vs, d->gs};
    const size_t at = nf_index(&dims, s);
    f[s->t][at] = value;
    stria_dtype_store(c->dtype, st[s->t], at, value);
}

/* Copies of the ring's outputs (the next run overwrites them). */
static nf_outs_t ring_nf_copy(const rdata_t *d)
{
    float *o = malloc(d->nq * 4), *lse = malloc(d->nl * 4), *dq = malloc(d->nq * 4);
    float *dk = malloc(d->nk * 4), *dv = malloc(d->nk * 4);
    memcpy(o, d->o, d->nq * 4), memcpy(lse, d->lse, d->nl * 4), memcpy(dq, d->dq, d->nq * 4);
    memcpy(dk, d->dk, d->nk * 4), memcpy(dv, d->dv, d->nk * 4);
    return (nf_outs_t){o, lse, dq, dk, dv};
}

static void ring_nf_free(nf_outs_t *o)
{
    free((void *)o->o), free((void *)o->lse), free((void *)o->dq), free((void *)o->dk);
    free((void *)o->dv);
}

/* Every value at one spot of tensor t (a query or key the mask lets some
 * query see), for one ring case and masks. */
static void ring_nf_case(const rcase_t *c, const ref_masks_t *m, nf_tensor_t t, const char *what)
{
    rdata_t d;
    const nf_dims_t dims = {c->B, c->S, c->S, c->H, c->Hkv, c->D};
    ref_shape_t rs = ref_shape(c);
    const bool qside = t == NF_Q || t == NF_DO;
    data_init(c, &d, 5);
    cr_assert_eq(ring_run_masks(c, m, &d, NULL), STRIA_OK, "%s", stria_error_msg());
    nf_outs_t clean = ring_nf_copy(&d);
    int64_t tok = nf_token(&rs, m, qside, true, qside ? c->S * 2 / 3 : c->S / 5);
    cr_assert(tok >= 0);
    nf_spot_t s = {t, 1, tok, 1, 3, 0.0f};
    float *f[NF_N_TENSORS] = {d.q, d.k, d.v, d.g};
    const float keep = f[t][nf_index(&dims, &s)];
    for (size_t vi = 0; vi < sizeof(nf_values) / sizeof(nf_values[0]); vi++) {
        char label[256];
        ref_out_t ref;
        s.value = nf_values[vi];
        snprintf(label, sizeof(label), "%s N=%d %s %s %s: %s %s at token %lld",
                 stria_kernels_variant(), c->n, stria_layout_kind_name(c->layout),
                 stria_dtype_name(c->dtype), what, nf_tensor_names[t], nf_value_names[vi],
                 (long long)tok);
        ring_nf_put(c, &d, &s, s.value);
        cr_assert_eq(ring_run_masks(c, m, &d, NULL), STRIA_OK, "%s: %s", label, stria_error_msg());
        nf_ref_run(&rs, m, d.q, d.k, d.v, d.g, &ref);
        const nf_outs_t got = {d.o, d.lse, d.dq, d.dk, d.dv};
        nf_check(&dims, &s, true, &got, &clean, &ref, label, ring_nf_report, NULL);
        ref_out_free(&ref);
        ring_nf_put(c, &d, &s, keep);
    }
    ring_nf_free(&clean);
    data_free(&d);
}

/* Tensor t's spots on every variant, ring size, layout, mask and dtype. */
static void ring_nf_all(nf_tensor_t t)
{
    const char *const *names = stria_kernels_variant_names();
    const char *expected[CPU_EXPECT_MAX];
    size_t n_expected = cpu_expected_simd(expected), simd_ran = 0;
    const ref_masks_t docs_window = {ring_nf_cu, 5, true, 20, 0};
    for (size_t i = 0; names[i] != NULL; i++) {
        if (!stria_kernels_variant_available(names[i])) {
            cr_log_info("variant %s not supported by this CPU: skipped", names[i]);
            continue;
        }
        cr_assert_eq(stria_kernels_set_variant(names[i]), STRIA_OK, "%s", stria_error_msg());
        for (int n = 1; n <= 4; n++)
            for (size_t l = 0; l < 3; l++)
                for (int dt = 0; dt < 2; dt++) {
                    rcase_t c = {n,
                                 all_layouts[l],
                                 true,
                                 2,
                                 96,
                                 4,
                                 2,
                                 32,
                                 dt ? STRIA_DTYPE_BF16 : STRIA_DTYPE_F32};
                    ring_nf_case(&c, NULL, t, "causal");
                    ring_nf_case(&c, &docs_window, t, "causal, documents, window (20, 0)");
                }
        simd_ran += cpu_name_in(expected, names[i]);
    }
    cr_assert_eq(simd_ran, n_expected, "%zu of the %zu SIMD variants this CPU supports ran",
                 simd_ran, n_expected);
}

NF_TESTS_PER_TENSOR(ring_nonfinite, ring_nf_all)
