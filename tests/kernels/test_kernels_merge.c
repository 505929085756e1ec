/* Kernel suite, merge and finalize: merging the partial outputs of key
 * blocks (associativity, extreme and empty rows, near overflow), and the
 * rounding of the final output to its storage dtype. */
#include <criterion/criterion.h>

#include "kernels_test_util.h"

/* ---- merge ----------------------------------------------------------------- */

/* Splitting K/V into k blocks and merging equals one big block, k = 1..8. */
Test(kernels, merge_associativity)
{
    const int64_t Tq = 96, Tk = 160, H = 2, D = 32;
    size_t nq = (size_t)(Tq * H * D), nk = (size_t)(Tk * H * D), nl = (size_t)(H * Tq);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
    float *o1 = malloc(nq * 4), *l1 = malloc(nl * 4), *o2 = malloc(nq * 4), *l2 = malloc(nl * 4);
    float *ob = malloc(nq * 4), *lb = malloc(nl * 4);
    stria_pos_run_t qrun = {64, 1, Tq}; /* queries at 64..159, keys at 0..159 */
    stria_attn_params_t p;

    ref_fill(q, nq, 11, 2.0f, STRIA_DTYPE_F32);
    ref_fill(k, nk, 12, 2.0f, STRIA_DTYPE_F32);
    ref_fill(v, nk, 13, 1.0f, STRIA_DTYPE_F32);
    block_params(&p, Tq, Tk, H, D);
    p.q_pos.runs = &qrun;
    p.q_pos.n_runs = 1;
    stria_tensor_t tq = stria_tensor_contiguous(q, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t to1 = stria_tensor_contiguous(o1, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t to2 = stria_tensor_contiguous(o2, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tob = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, Tq, H, D);
    stria_tensor_t tk = stria_tensor_contiguous(k, STRIA_DTYPE_F32, Tk, H, D);
    stria_tensor_t tv = stria_tensor_contiguous(v, STRIA_DTYPE_F32, Tk, H, D);
    cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to1, l1, false), STRIA_OK, "%s",
                 stria_error_msg());

    for (int nb = 1; nb <= 8; nb++) {
        /* via accumulate, and via explicit merge, in reverse block order */
        cr_assert_eq(stria_attn_partial_init(&p, &to2, l2), STRIA_OK);
        for (int blk = nb - 1; blk >= 0; blk--) {
            int64_t k0 = Tk * blk / nb, k1 = Tk * (blk + 1) / nb;
            stria_pos_run_t krun = {k0, 1, k1 - k0};
            stria_attn_params_t pb = p;
            pb.kv_tokens = k1 - k0;
            pb.kv_pos.runs = &krun;
            pb.kv_pos.n_runs = 1;
            stria_tensor_t tkb = tk, tvb = tv;
            tkb.data = k + k0 * H * D;
            tvb.data = v + k0 * H * D;
            if (blk % 2 == 0) {
                cr_assert_eq(stria_attn_fwd(&pb, &tq, &tkb, &tvb, &to2, l2, true), STRIA_OK, "%s",
                             stria_error_msg());
            } else {
                cr_assert_eq(stria_attn_fwd(&pb, &tq, &tkb, &tvb, &tob, lb, false), STRIA_OK);
                cr_assert_eq(stria_attn_merge(&p, &to2, l2, &tob, lb), STRIA_OK);
            }
        }
        for (size_t i = 0; i < nq; i++)
            cr_assert_float_eq(o2[i], o1[i], 2e-5, "k=%d: O[%zu] %g vs %g", nb, i, o2[i], o1[i]);
        for (size_t i = 0; i < nl; i++)
            cr_assert_float_eq(l2[i], l1[i], 2e-5, "k=%d: LSE[%zu] %g vs %g", nb, i, l2[i], l1[i]);
    }
    free(q), free(k), free(v), free(o1), free(l1), free(o2), free(l2), free(ob), free(lb);
}

/* LSE gaps of +-1e4 and -inf rows merge without overflow or NaN. */
Test(kernels, merge_extreme_lse_and_empty_rows)
{
    const int64_t T = 4, D = 16;
    float oa[4 * 16], ob[4 * 16];
    float la[4] = {1e4f, -1e4f, -INFINITY, -INFINITY};
    float lb[4] = {-1e4f, 1e4f, 3.0f, -INFINITY};
    stria_attn_params_t p;
    block_params(&p, T, 1, 1, D);
    for (int i = 0; i < T * D; i++) {
        oa[i] = 1.0f;
        ob[i] = 2.0f;
    }
    for (int d = 0; d < D; d++) /* -inf rows hold zero partials */
        oa[2 * D + d] = oa[3 * D + d] = ob[3 * D + d] = 0.0f;
    stria_tensor_t ta = stria_tensor_contiguous(oa, STRIA_DTYPE_F32, T, 1, D);
    stria_tensor_t tb = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, T, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &ta, la, &tb, lb), STRIA_OK, "%s", stria_error_msg());
    for (int d = 0; d < D; d++) {
        cr_expect_float_eq(oa[0 * D + d], 1.0f, 1e-6);
        cr_expect_float_eq(oa[1 * D + d], 2.0f, 1e-6);
        cr_expect_float_eq(oa[2 * D + d], 2.0f, 1e-6);
        cr_expect_eq(oa[3 * D + d], 0.0f);
    }
    cr_expect_float_eq(la[0], 1e4f, 1e-2);
    cr_expect_float_eq(la[1], 1e4f, 1e-2);
    cr_expect_float_eq(la[2], 3.0f, 1e-6);
    cr_expect(isinf(la[3]) && la[3] < 0);
    /* equal LSEs: weights 1/2 each, lse + log 2 */
    float oc[16], od[16], lc = 5.0f, ld = 5.0f;
    for (int d = 0; d < D; d++) {
        oc[d] = 1.0f;
        od[d] = 3.0f;
    }
    block_params(&p, 1, 1, 1, D);
    stria_tensor_t tc = stria_tensor_contiguous(oc, STRIA_DTYPE_F32, 1, 1, D);
    stria_tensor_t td = stria_tensor_contiguous(od, STRIA_DTYPE_F32, 1, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &tc, &lc, &td, &ld), STRIA_OK);
    cr_expect_float_eq(oc[0], 2.0f, 1e-6);
    cr_expect_float_eq(lc, 5.0f + logf(2.0f), 1e-6);
}

/* Merges of partials whose LSEs sit at and beyond the point where expf
 * overflows in fp32 (88.72), against the merge computed in fp64: a form that
 * exponentiates an LSE itself instead of a difference gives inf or NaN. And
 * K/V blocks whose scores reach a few hundred, split and merged as ring
 * steps do, against one block and the fp64 reference. */
Test(kernels, merge_near_overflow)
{
    enum { D = 16, R = 7 };
    static const float la0[R] = {88.0f, 88.72f, 89.0f, 300.0f, 1e4f, -87.0f, -200.0f};
    static const float lb0[R] = {88.7f, 88.72f, -89.0f, 299.5f, 1e4f - 1.0f, -88.5f, -200.25f};
    float oa[R * D], ob[R * D], la[R], lb[R];
    stria_attn_params_t p;
    block_params(&p, R, 1, 1, D);
    for (int i = 0; i < R; i++) {
        la[i] = la0[i];
        lb[i] = lb0[i];
        for (int d = 0; d < D; d++) {
            oa[i * D + d] = 0.25f * (float)(d + 1);
            ob[i * D + d] = -0.5f * (float)(d % 5) + (float)i;
        }
    }
    stria_tensor_t ta = stria_tensor_contiguous(oa, STRIA_DTYPE_F32, R, 1, D);
    stria_tensor_t tb = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, R, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &ta, la, &tb, lb), STRIA_OK, "%s", stria_error_msg());
    for (int i = 0; i < R; i++) {
        double a = la0[i], b = lb0[i], mx = a > b ? a : b;
        double lse = mx + log(exp(a - mx) + exp(b - mx));
        double wa = exp(a - lse), wb = exp(b - lse);
        /* An fp32 LSE is known to half an ulp of its size: the weights
         * derived from it carry that absolute error. */
        double rel = 1e-6 + 4 * FLT_EPSILON * fabs(mx);
        cr_expect(isfinite(la[i]), "row %d: LSE %g from %g and %g", i, la[i], a, b);
        cr_expect(fabs(la[i] - lse) <= 4e-7 * fabs(lse) + 1e-6, "row %d: LSE %.9g, want %.9g", i,
                  la[i], lse);
        for (int d = 0; d < D; d++) {
            double want = wa * (0.25 * (d + 1)) + wb * (-0.5 * (d % 5) + i);
            cr_expect(fabs(oa[i * D + d] - want) <= rel * (1.0 + fabs(want)),
                      "row %d col %d: O %.9g, want %.9g (LSEs %g, %g)", i, d, oa[i * D + d], want,
                      a, b);
        }
    }
    /* Scores beyond 88.72 through the kernels: three key tiles merged
     * online inside a pass, against the fp64 reference. */
    for (size_t t = 0; t < 3; t++) {
        kcase_t c = {.B = 1,
                     .Tq = 150,
                     .Tk = 150,
                     .H = 2,
                     .Hkv = 2,
                     .D = 64,
                     .causal = true,
                     .dtype = all_dtypes[t],
                     .threads = 1,
                     .scale = 12.0f};
        for_each_variant(&c);
    }
}

Test(kernels, finalize_rounds_to_storage_dtype)
{
    float part[2 * 16];
    uint16_t out[2 * 16];
    stria_attn_params_t p;
    block_params(&p, 2, 1, 1, 16);
    for (int i = 0; i < 32; i++)
        part[i] = 1.0f + (float)i / 7.0f;
    stria_tensor_t tp = stria_tensor_contiguous(part, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tb = stria_tensor_contiguous(out, STRIA_DTYPE_BF16, 2, 1, 16);
    cr_assert_eq(stria_attn_finalize(&p, &tp, &tb), STRIA_OK);
    for (int i = 0; i < 32; i++)
        cr_expect_eq(out[i], stria_f32_to_bf16(part[i]));
    stria_tensor_t th = stria_tensor_contiguous(out, STRIA_DTYPE_F16, 2, 1, 16);
    cr_assert_eq(stria_attn_finalize(&p, &tp, &th), STRIA_OK);
    for (int i = 0; i < 32; i++)
        cr_expect_eq(out[i], stria_f32_to_f16(part[i]));
}
