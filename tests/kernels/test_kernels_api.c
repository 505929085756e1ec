/* Kernel suite, the API: bad arguments get clear errors, and the choice of
 * a SIMD variant, by call or by STRIA_KERNEL. */
#include <criterion/criterion.h>

#include "kernels_test_util.h"

/* ---- bad arguments --------------------------------------------------------- */

Test(kernels, bad_arguments_get_clear_errors)
{
    float buf[4 * 2 * 32] = {0}, lse[8];
    stria_attn_params_t p;
    block_params(&p, 4, 4, 2, 32);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
    stria_tensor_t o = t;
    float obuf[4 * 2 * 32];
    o.data = obuf;

    expect_error(stria_attn_fwd(NULL, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG, "params");
    expect_error(stria_attn_fwd(&p, NULL, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "tensor q is NULL");
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &o, NULL, false), STRIA_ERR_INVALID_ARG, "lse");

    stria_attn_params_t bad = p;
    bad.q_tokens = 0;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "q_tokens=0");
    bad = p;
    bad.heads = 3;
    bad.kv_heads = 2;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "multiple of kv_heads");
    bad = p;
    bad.head_dim = 20;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_UNSUPPORTED,
                 "head_dim 20");
    bad.head_dim = 264;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_UNSUPPORTED,
                 "head_dim 264");
    bad = p;
    bad.scale = -1.0f;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG, "scale");
    bad = p;
    stria_pos_run_t run = {0, 1, 3}; /* 3 positions for 4 tokens */
    bad.q_pos.runs = &run;
    bad.q_pos.n_runs = 1;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "cover 3 tokens");
    stria_pos_run_t neg = {-5, 1, 4};
    bad.q_pos.runs = &neg;
    expect_error(stria_attn_fwd(&bad, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG, "leaves");

    stria_tensor_t tb = t;
    tb.dtype = STRIA_DTYPE_BF16;
    expect_error(stria_attn_fwd(&p, &t, &tb, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                 "share one dtype");
    stria_tensor_t o16 = o;
    o16.dtype = STRIA_DTYPE_F16;
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &o16, lse, false), STRIA_ERR_INVALID_ARG,
                 "must be fp32");
    expect_error(stria_attn_bwd(&p, &t, &t, &t, &t, lse, lse, &o, &o, &o), STRIA_ERR_INVALID_ARG,
                 "alias");
    expect_error(stria_attn_merge(&p, &o, lse, NULL, lse), STRIA_ERR_INVALID_ARG, "o_b");
    expect_error(stria_kernels_set_variant("sse9"), STRIA_ERR_NOT_FOUND, "sse9");
}

Test(kernels, variant_selection)
{
    const char *const *names = stria_kernels_variant_names();
    cr_assert_str_eq(names[0], "portable");
    cr_assert(stria_kernels_variant_available("portable"));
    cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK);
    cr_assert_str_eq(stria_kernels_variant(), "portable");
    /* the bf16 dot product: where the CPU has it, in avx512 only */
    for (size_t i = 0; names[i] != NULL; i++)
        cr_expect_eq(stria_kernels_variant_bf16_dot(names[i]), ref_bf16_dot(names[i]),
                     "variant %s: bf16 dot product %d, the CPU's flags say %d", names[i],
                     stria_kernels_variant_bf16_dot(names[i]), ref_bf16_dot(names[i]));
    cr_expect(!stria_kernels_variant_bf16_dot("sse9"));
}

/* STRIA_KERNEL=avx512-nobf16 forces avx512 without the bf16 dot product. */
Test(kernels, env_forces_avx512_without_bf16_dot)
{
    if (!stria_kernels_variant_available("avx512")) {
        cr_log_info("no avx512 on this CPU: nothing to check");
        return;
    }
    setenv("STRIA_KERNEL", "avx512-nobf16", 1);
    cr_assert_str_eq(stria_kernels_variant(), "avx512-nobf16");
    cr_expect(!stria_kernels_variant_bf16_dot(stria_kernels_variant()));
}

/* STRIA_KERNEL forces a variant on first use (each Criterion test runs in a
 * fresh process, so the choice has not been made yet). */
Test(kernels, env_forces_variant)
{
    const char *const *names = stria_kernels_variant_names();
    const char *last = NULL;
    for (size_t i = 0; names[i] != NULL; i++)
        if (stria_kernels_variant_available(names[i]) && strcmp(names[i], "portable") != 0)
            last = names[i];
    /* force the portable one even where a SIMD variant would be the default */
    cr_assert_eq(setenv("STRIA_KERNEL", "portable", 1), 0);
    cr_assert_str_eq(stria_kernels_variant(), "portable");
    if (last != NULL)
        cr_log_info("default would have been %s", last);
}

Test(kernels, env_unknown_variant_is_a_clear_error)
{
    float buf[4 * 32] = {0}, o[4 * 32], lse[4];
    stria_attn_params_t p;
    cr_assert_eq(setenv("STRIA_KERNEL", "sse9", 1), 0);
    block_params(&p, 4, 4, 1, 32);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 1, 32);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 4, 1, 32);
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &to, lse, false), STRIA_ERR_NOT_FOUND,
                 "STRIA_KERNEL=sse9");
    cr_expect_str_eq(stria_kernels_variant(), "none");
}
