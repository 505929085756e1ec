/* Kernel suite, the API: bad arguments get clear errors, and the choice of
 * a SIMD variant, by call or by STRIA_KERNEL. */
#include <criterion/criterion.h>

#include <errno.h>

#include "kernels_int.h"
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

/* A small forward with STRIA_KERNEL=name: its status (the variant is chosen
 * on this first kernel call). */
static stria_status_t fwd_with_env(const char *name)
{
    float buf[4 * 32] = {0}, o[4 * 32], lse[4];
    stria_attn_params_t p;
    cr_assert_eq(setenv("STRIA_KERNEL", name, 1), 0);
    block_params(&p, 4, 4, 1, 32);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 1, 32);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 4, 1, 32);
    return stria_attn_fwd(&p, &t, &t, &t, &to, lse, false);
}

Test(kernels, env_unknown_variant_is_a_clear_error)
{
    expect_error(fwd_with_env("sse9"), STRIA_ERR_NOT_FOUND, "STRIA_KERNEL=sse9");
    cr_expect_str_eq(stria_kernels_variant(), "none");
}

/* The amx variant is offered only with AVX512-BF16, AMX-BF16 and AMX-TILE
 * (CPUID) and the tile state granted by the kernel; each refusal names its
 * reason (the verdict from what was found, checked here with every case). */
Test(kernels, amx_verdict_names_its_reason)
{
    cr_expect_null(stria__amx_verdict(true, true, true, 0));
    const char *why = stria__amx_verdict(false, true, true, 0);
    cr_expect(why != NULL && strstr(why, "AVX512-BF16") != NULL, "%s", why ? why : "(null)");
    why = stria__amx_verdict(true, false, true, 0);
    cr_expect(why != NULL && strstr(why, "AMX-BF16") != NULL && strstr(why, "CPUID") != NULL, "%s",
              why ? why : "(null)");
    why = stria__amx_verdict(true, true, false, 0);
    cr_expect(why != NULL && strstr(why, "CPUID") != NULL, "%s", why ? why : "(null)");
    why = stria__amx_verdict(true, true, true, EPERM);
    cr_expect(why != NULL && strstr(why, "ARCH_REQ_XCOMP_PERM") != NULL &&
                  strstr(why, strerror(EPERM)) != NULL,
              "%s", why ? why : "(null)");
}

/* STRIA_KERNEL=amx where the CPU (or the kernel) cannot run it is an error
 * naming the reason; where it can, amx is the default and runs bf16 on its
 * tiles. */
Test(kernels, env_amx_is_chosen_honestly)
{
    const char *expected[CPU_EXPECT_MAX];
    cpu_expected_simd(expected);
    const bool have = cpu_name_in(expected, "amx");
    bool built = false;
    for (const char *const *n = stria_kernels_variant_names(); *n != NULL; n++)
        built = built || strcmp(*n, "amx") == 0;
    if (!built) {
        cr_log_info("this build has no amx variant (the compiler lacks -mamx-tile): skipped");
        return;
    }
    cr_expect_eq(stria_kernels_variant_available("amx"), have);
    if (have) {
        cr_expect_str_eq(stria_kernels_variant(), "amx", "the default where AMX runs");
        cr_expect(stria_kernels_variant_bf16_dot("amx"));
        return;
    }
    const char *why = stria__amx_why_not();
    cr_assert_not_null(why);
    expect_error(fwd_with_env("amx"), STRIA_ERR_UNSUPPORTED, "STRIA_KERNEL=amx");
    cr_expect(strstr(stria_error_msg(), why) != NULL, "'%s' lacks the reason '%s'",
              stria_error_msg(), why);
    cr_log_info("refused as it must be: %s", stria_error_msg());
    expect_error(stria_kernels_set_variant("amx"), STRIA_ERR_UNSUPPORTED, why);
}
