/* The per-ISA operations of the kernel module (kernels_int.h), each SIMD
 * variant against the portable one: GEMM shapes and tails, the softmax passes
 * (exp accuracy, -inf, large negative scores, empty columns), and exact dtype
 * conversions. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_expect.h"
#include "kernels_int.h"
#include "ref.h"

static const stria_kern_ops_t *ops_of(const char *name)
{
    cr_assert_eq(stria_kernels_set_variant(name), STRIA_OK, "%s", stria_error_msg());
    const stria_kern_ops_t *ops = stria__kern_ops();
    cr_assert_not_null(ops);
    cr_assert_str_eq(ops->name, name);
    return ops;
}

/* Calls fn for every SIMD variant this CPU runs; returns how many. Fails
 * unless every variant the CPU supports (cpu_expect.h) ran: a check that
 * skips every variant checks nothing. */
static int for_each_simd(void (*fn)(const stria_kern_ops_t *simd, const stria_kern_ops_t *port))
{
    const char *const *names = stria_kernels_variant_names();
    const stria_kern_ops_t *port = ops_of("portable");
    const char *expected[CPU_EXPECT_MAX], *ran_names[8];
    size_t n_expected = cpu_expected_simd(expected);
    int ran = 0;
    for (size_t i = 0; names[i] != NULL; i++) {
        if (strcmp(names[i], "portable") == 0 || strcmp(names[i], "amx-emu") == 0)
            continue; /* amx-emu: the portable operations, but its bf16 product (below) */
        if (!stria_kernels_variant_available(names[i])) {
            cr_log_info("variant %s not supported by this CPU: skipped", names[i]);
            continue;
        }
        fn(ops_of(names[i]), port);
        if (ran < 7)
            ran_names[ran] = names[i];
        ran++;
    }
    ran_names[ran < 7 ? ran : 7] = NULL;
    for (size_t e = 0; e < n_expected; e++)
        cr_assert(cpu_name_in(ran_names, expected[e]),
                  "the CPU supports variant %s, but it was not checked", expected[e]);
    return ran;
}

/* ---- GEMM ------------------------------------------------------------------ */

static void gemm_case(const stria_kern_ops_t *simd, const stria_kern_ops_t *port, int m, int n,
                      int k, bool trans_a, bool accumulate, bool with_scale)
{
    ptrdiff_t lda = (trans_a ? m : k) + 3, ldb = n + 16, ldc = n + 32;
    size_t na = (size_t)lda * (size_t)(trans_a ? k : m) + 1;
    size_t nb = (size_t)ldb * (size_t)k + 1, nc = (size_t)ldc * (size_t)m + 1;
    float *a = malloc(na * 4), *b = malloc(nb * 4), *cs = malloc((size_t)m * 4 + 4);
    float *c1 = malloc(nc * 4), *c2 = malloc(nc * 4);

    ref_fill(a, na, (uint64_t)(m * 131 + k), 1.0f, STRIA_DTYPE_F32);
    ref_fill(b, nb, (uint64_t)(n * 17 + k), 1.0f, STRIA_DTYPE_F32);
    ref_fill(c1, nc, 5, 2.0f, STRIA_DTYPE_F32);
    ref_fill(cs, (size_t)m + 1, 6, 1.0f, STRIA_DTYPE_F32);
    memcpy(c2, c1, nc * 4);
    port->gemm(m, n, k, a, lda, trans_a, b, ldb, c1, ldc, with_scale ? cs : NULL, accumulate);
    simd->gemm(m, n, k, a, lda, trans_a, b, ldb, c2, ldc, with_scale ? cs : NULL, accumulate);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < ldc; j++) {
            size_t x = (size_t)i * (size_t)ldc + (size_t)j;
            if (j >= n) { /* beyond n: untouched */
                cr_assert_eq(c2[x], c1[x], "%s gemm wrote C[%d][%d] beyond n=%d", simd->name, i, j,
                             n);
                continue;
            }
            /* sums of k products of values in [-1, 1]: rounding differs by order */
            double tol = 1e-6 * (k + 4);
            cr_assert(fabs((double)c2[x] - (double)c1[x]) <= tol,
                      "%s gemm m=%d n=%d k=%d trans=%d acc=%d scale=%d: C[%d][%d] = %.9g, "
                      "portable %.9g",
                      simd->name, m, n, k, trans_a, accumulate, with_scale, i, j, c2[x], c1[x]);
        }
    free(a), free(b), free(cs), free(c1), free(c2);
}

static void gemm_all(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    static const int ms[] = {1, 2, 5, 6, 7, 12, 13, 64};
    static const int ns[] = {16, 32, 48, 64, 80, 144};
    static const int ks[] = {0, 1, 7, 64, 70};
    for (size_t im = 0; im < sizeof(ms) / sizeof(ms[0]); im++)
        for (size_t in = 0; in < sizeof(ns) / sizeof(ns[0]); in++)
            for (size_t ik = 0; ik < sizeof(ks) / sizeof(ks[0]); ik++)
                for (int mode = 0; mode < 6; mode++)
                    gemm_case(simd, port, ms[im], ns[in], ks[ik], mode & 1, mode >= 2, mode >= 4);
}

Test(kernel_ops, gemm_shapes_tails_and_modes)
{
    int ran = for_each_simd(gemm_all);
    cr_log_info("%d SIMD variant(s) checked", ran);
}

/* ---- softmax passes ------------------------------------------------------- */

/* Relative error in units of the float spacing at the reference value. */
static double ulps(float got, double want)
{
    if (want == 0.0)
        return got == 0.0f ? 0.0 : INFINITY;
    int e;
    frexp(want, &e);
    return fabs((double)got - want) / ldexp(1.0, e - 24);
}

static void exp_accuracy(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { R = 8, C = 64 };
    float st[R * C], m[C], l[C], alpha[C];
    const float lse[C] = {0};
    double worst = 0.0;
    (void)port;
    /* x = scale * s - lse over [-87, 0.5]: the range the passes see */
    for (int rep = 0; rep < 400; rep++) {
        for (int i = 0; i < R * C; i++)
            st[i] = -87.0f + 87.5f * (float)((rep * R * C + i) % 100003) / 100003.0f;
        float in[R * C];
        memcpy(in, st, sizeof(in));
        simd->softmax_bwd_p(st, R, C, C, 1.0f, lse);
        for (int i = 0; i < R * C; i++) {
            double u = ulps(st[i], exp((double)in[i]));
            worst = u > worst ? u : worst;
        }
    }
    cr_expect(worst <= 4.0, "%s exp: worst error %.2f ulp", simd->name, worst);
    cr_log_info("%s exp: worst error %.2f ulp over [-87, 0.5]", simd->name, worst);

    /* special values: -inf and anything below ln(FLT_MIN) give exactly 0;
     * +inf lse (rows without keys) gives 0 */
    float sp[2 * C], lse2[C];
    for (int i = 0; i < C; i++) {
        sp[i] = i % 4 == 0 ? -INFINITY : i % 4 == 1 ? -1e30f : i % 4 == 2 ? -90.0f : -1.0f;
        sp[C + i] = 3.0f;
        lse2[i] = i % 2 ? INFINITY : 0.0f;
    }
    simd->softmax_bwd_p(sp, 2, C, C, 1.0f, lse2);
    for (int i = 0; i < C; i++) {
        if (i % 2 == 1) {
            cr_expect_eq(sp[i], 0.0f, "%s: exp(x - inf) = %g", simd->name, sp[i]);
            cr_expect_eq(sp[C + i], 0.0f, "%s: exp(3 - inf) = %g", simd->name, sp[C + i]);
        } else if (i % 4 == 2 || i % 4 == 0) {
            cr_expect_eq(sp[i], 0.0f, "%s: exp(%s) = %g, want 0", simd->name,
                         i % 4 == 0 ? "-inf" : "-90", sp[i]);
        } else {
            cr_expect(ulps(sp[i], exp(-1.0)) <= 2.0, "%s: exp(-1) = %.9g", simd->name, sp[i]);
            cr_expect(ulps(sp[C + i], exp(3.0)) <= 4.0, "%s: exp(3) = %.9g", simd->name, sp[C + i]);
        }
    }
    /* NaN propagates instead of turning into a silent 0 */
    for (int i = 0; i < C; i++)
        sp[i] = i == 5 ? NAN : -1.0f;
    simd->softmax_bwd_p(sp, 1, C, C, 1.0f, lse);
    cr_expect(isnan(sp[5]), "%s: exp(NaN) = %g", simd->name, sp[5]);
    (void)m, (void)l, (void)alpha;
}

Test(kernel_ops, exp_accuracy_and_special_values)
{
    for_each_simd(exp_accuracy);
}

/* softmax_fwd over a sequence of tiles, with masked (-inf) entries, columns
 * that see nothing for a while, and a huge jump of the running max. */
static void softmax_fwd_steps(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { R = 37, C = 48 };
    float s1[R * C], s2[R * C], in[R * C], m1[C], m2[C], l1[C], l2[C], a1[C], a2[C];
    for (int i = 0; i < C; i++) {
        m1[i] = m2[i] = -INFINITY;
        l1[i] = l2[i] = 0.0f;
    }
    for (int step = 0; step < 4; step++) {
        ref_fill(s1, R * C, (uint64_t)(40 + step), 8.0f, STRIA_DTYPE_F32);
        for (int j = 0; j < R; j++)
            for (int i = 0; i < C; i++) {
                float *x = &s1[j * C + i];
                if (i < 8 && step < 2) /* columns 0..7 see no key in steps 0, 1 */
                    *x = -INFINITY;
                else if ((i + j) % 3 == 0) /* causal-like holes */
                    *x = -INFINITY;
                else if (i >= 40 && step == 3) /* running max jumps by ~1000 */
                    *x += 1000.0f;
            }
        memcpy(s2, s1, sizeof(s1));
        memcpy(in, s1, sizeof(s1));
        port->softmax_fwd(s1, R, C, C, 0.3f, m1, l1, a1);
        simd->softmax_fwd(s2, R, C, C, 0.3f, m2, l2, a2);
        for (int i = 0; i < C; i++) {
            cr_expect(m2[i] == m1[i], "%s step %d col %d: m %g vs %g", simd->name, step, i, m2[i],
                      m1[i]);
            cr_expect(fabsf(l2[i] - l1[i]) <= 2e-5f * fabsf(l1[i]),
                      "%s step %d col %d: l %.9g vs %.9g", simd->name, step, i, l2[i], l1[i]);
            cr_expect(fabsf(a2[i] - a1[i]) <= 1e-6f * fabsf(a1[i]) + 1e-37f,
                      "%s step %d col %d: alpha %.9g vs %.9g", simd->name, step, i, a2[i], a1[i]);
        }
        for (int x = 0; x < R * C; x++) {
            cr_assert(!isnan(s2[x]), "%s step %d: NaN probability at %d", simd->name, step, x);
            /* the portable pass rounds scale * s before subtracting; the
             * SIMD ones fuse it: the exponent differs by up to |scale s| 2^-24 */
            if (in[x] == -INFINITY) {
                cr_expect(s2[x] == 0.0f, "%s step %d: masked p[%d] = %g", simd->name, step, x,
                          s2[x]);
                continue;
            }
            float rel = 1e-6f + fabsf(0.3f * in[x]) * 1.2e-7f;
            cr_expect(fabsf(s2[x] - s1[x]) <= rel * fabsf(s1[x]) + 1e-37f,
                      "%s step %d: p[%d] %.9g vs %.9g", simd->name, step, x, s2[x], s1[x]);
        }
        if (step < 2)
            for (int i = 0; i < 8; i++)
                cr_expect(m2[i] == -INFINITY && l2[i] == 0.0f && s2[i] == 0.0f,
                          "%s: an empty column got m=%g l=%g p=%g", simd->name, m2[i], l2[i],
                          s2[i]);
    }
}

Test(kernel_ops, softmax_fwd_online_steps)
{
    for_each_simd(softmax_fwd_steps);
}

/* bf16 value of element (j, i) of a tile stored in pairs of rows. */
static float pair_at(const uint16_t *pb, ptrdiff_t ldp, int j, int i)
{
    return stria_bf16_to_f32(pb[(j / 2) * ldp + 2 * i + j % 2]);
}

/* Whether x is got rounded to bf16, to nearest (a bf16 ulp of slack: the
 * probabilities themselves differ by a few fp32 ulps). */
static bool bf16_of(float got, float x)
{
    return fabsf(got - x) <= fabsf(x) * 0x1p-8f + 1e-37f;
}

/* The bf16 path's softmax step (odd rows, masked entries, empty columns,
 * a jump of the running max) against the portable fp32 step: the same
 * statistics, P as its bf16 rounding in pairs of rows, the odd row's partner
 * 0. */
static void softmax_fwd_bf16_steps(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { R = 37, C = 48 };
    float s1[R * C], s2[R * C], m1[C], m2[C], l1[C], l2[C], a1[C], a2[C];
    uint16_t pb[(R + 1) * C];
    if (simd->softmax_fwd_bf16 == NULL || !simd->gemm_bf16_ok()) {
        cr_log_info("variant %s: no bf16 softmax step", simd->name);
        return;
    }
    for (int i = 0; i < C; i++) {
        m1[i] = m2[i] = -INFINITY;
        l1[i] = l2[i] = 0.0f;
    }
    for (int step = 0; step < 4; step++) {
        ref_fill(s1, R * C, (uint64_t)(60 + step), 8.0f, STRIA_DTYPE_F32);
        for (int j = 0; j < R; j++)
            for (int i = 0; i < C; i++) {
                float *x = &s1[j * C + i];
                if ((i < 8 && step < 2) || (i + j) % 3 == 0)
                    *x = -INFINITY;
                else if (i >= 40 && step == 3)
                    *x += 1000.0f;
            }
        memcpy(s2, s1, sizeof(s1));
        memset(pb, 0xff, sizeof(pb));
        port->softmax_fwd(s1, R, C, C, 0.3f, m1, l1, a1);
        simd->softmax_fwd_bf16(s2, R, C, C, 0.3f, m2, l2, a2, pb, 2 * C);
        for (int i = 0; i < C; i++) {
            cr_expect(m2[i] == m1[i], "%s step %d col %d: m %g vs %g", simd->name, step, i, m2[i],
                      m1[i]);
            cr_expect(fabsf(l2[i] - l1[i]) <= 2e-5f * fabsf(l1[i]),
                      "%s step %d col %d: l %.9g vs %.9g", simd->name, step, i, l2[i], l1[i]);
            cr_expect(fabsf(a2[i] - a1[i]) <= 1e-6f * fabsf(a1[i]) + 1e-37f,
                      "%s step %d col %d: alpha %.9g vs %.9g", simd->name, step, i, a2[i], a1[i]);
            cr_expect(pair_at(pb, 2 * C, R, i) == 0.0f, "%s: odd row's partner %g", simd->name,
                      pair_at(pb, 2 * C, R, i));
            for (int j = 0; j < R; j++)
                cr_expect(bf16_of(pair_at(pb, 2 * C, j, i), s1[j * C + i]),
                          "%s step %d: p[%d][%d] %.9g, want bf16 of %.9g", simd->name, step, j, i,
                          pair_at(pb, 2 * C, j, i), s1[j * C + i]);
        }
    }
}

Test(kernel_ops, softmax_fwd_bf16_pairs)
{
    for_each_simd(softmax_fwd_bf16_steps);
}

/* The bf16 path's dS pass against the portable fp32 one: P^T and dS^T as
 * bf16 rows and dS^T in pairs of rows (odd row's partner 0). */
static void softmax_ds_bf16(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { R = 13, C = 32 };
    float p[R * C], g1[R * C], g2[R * C], delta[C];
    uint16_t pr[R * C], dr[R * C], d2[(R + 1) * C];
    if (simd->softmax_bwd_ds_bf16 == NULL || !simd->gemm_bf16_ok()) {
        cr_log_info("variant %s: no bf16 dS pass", simd->name);
        return;
    }
    ref_fill(p, R * C, 52, 1.0f, STRIA_DTYPE_F32);
    ref_fill(g1, R * C, 53, 3.0f, STRIA_DTYPE_F32);
    ref_fill(delta, C, 54, 2.0f, STRIA_DTYPE_F32);
    memcpy(g2, g1, sizeof(g1));
    port->softmax_bwd_ds(p, g1, R, C, C, delta, 0.125f);
    simd->softmax_bwd_ds_bf16(p, g2, R, C, C, delta, 0.125f, pr, dr, d2);
    for (int j = 0; j < R; j++)
        for (int i = 0; i < C; i++) {
            float ds = g1[j * C + i];
            cr_expect(stria_bf16_to_f32(pr[j * C + i]) ==
                          stria_bf16_to_f32(stria_f32_to_bf16(p[j * C + i])),
                      "%s: P row %d col %d", simd->name, j, i);
            cr_expect(bf16_of(stria_bf16_to_f32(dr[j * C + i]), ds),
                      "%s: dS row %d col %d: %g vs %g", simd->name, j, i,
                      stria_bf16_to_f32(dr[j * C + i]), ds);
            cr_expect(pair_at(d2, 2 * C, j, i) == stria_bf16_to_f32(dr[j * C + i]),
                      "%s: dS pair %d %d", simd->name, j, i);
            if (j == R - 1)
                cr_expect(pair_at(d2, 2 * C, R, i) == 0.0f, "%s: odd row's partner", simd->name);
        }
}

Test(kernel_ops, softmax_ds_bf16_rows_and_pairs)
{
    for_each_simd(softmax_ds_bf16);
}

static void softmax_ds(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { R = 13, C = 32 };
    float p[R * C], g1[R * C], g2[R * C], delta[C];
    ref_fill(p, R * C, 50, 1.0f, STRIA_DTYPE_F32);
    ref_fill(g1, R * C, 51, 3.0f, STRIA_DTYPE_F32);
    ref_fill(delta, C, 52, 1.0f, STRIA_DTYPE_F32);
    memcpy(g2, g1, sizeof(g1));
    port->softmax_bwd_ds(p, g1, R, C, C, delta, 0.125f);
    simd->softmax_bwd_ds(p, g2, R, C, C, delta, 0.125f);
    for (int x = 0; x < R * C; x++)
        cr_expect_eq(g2[x], g1[x], "%s ds[%d]: %.9g vs %.9g", simd->name, x, g2[x], g1[x]);
}

Test(kernel_ops, softmax_bwd_ds_matches)
{
    for_each_simd(softmax_ds);
}

/* The softmax passes on a column range of a wider tile (rows ld apart, as
 * the driver runs them on sub-blocks): same results as on a packed copy, and
 * the columns outside the range untouched. */
static void softmax_strided(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { R = 21, C = 16, LD = 64, I0 = 32 };
    const stria_kern_ops_t *both[2] = {port, simd};
    float wide[2][R * LD], pk[R * C], dp[2][R * LD], dpk[R * C];
    float m[2][C], l[2][C], a[2][C], mp[C], lp[C], ap[C], lse[C], delta[C];
    float orig_w[R * LD], orig_g[R * LD];

    ref_fill(lse, C, 60, 1.0f, STRIA_DTYPE_F32);
    ref_fill(delta, C, 61, 1.0f, STRIA_DTYPE_F32);
    for (int v = 0; v < 2; v++) {
        const stria_kern_ops_t *ops = both[v];
        ref_fill(wide[v], R * LD, 62, 4.0f, STRIA_DTYPE_F32);
        ref_fill(dp[v], R * LD, 63, 2.0f, STRIA_DTYPE_F32);
        for (int j = 0; j < R; j++)
            for (int i = 0; i < C; i++) {
                if (i > j) /* a causal triangle */
                    wide[v][j * LD + I0 + i] = -INFINITY;
                pk[j * C + i] = wide[v][j * LD + I0 + i];
                dpk[j * C + i] = dp[v][j * LD + I0 + i];
            }
        for (int i = 0; i < C; i++) {
            m[v][i] = mp[i] = i % 2 ? 0.5f : -INFINITY;
            l[v][i] = lp[i] = i % 2 ? 2.0f : 0.0f;
        }
        memcpy(orig_w, wide[v], sizeof(orig_w));
        memcpy(orig_g, dp[v], sizeof(orig_g));
        ops->softmax_fwd(wide[v] + I0, R, C, LD, 0.3f, m[v], l[v], a[v]);
        ops->softmax_fwd(pk, R, C, C, 0.3f, mp, lp, ap);
        ops->softmax_bwd_ds(wide[v] + I0, dp[v] + I0, R, C, LD, delta, 0.125f);
        ops->softmax_bwd_ds(pk, dpk, R, C, C, delta, 0.125f);
        for (int i = 0; i < C; i++)
            cr_expect(m[v][i] == mp[i] && l[v][i] == lp[i] && a[v][i] == ap[i],
                      "%s strided softmax_fwd column %d differs", ops->name, i);
        for (int j = 0; j < R; j++)
            for (int i = 0; i < LD; i++) {
                float w = wide[v][j * LD + i], g = dp[v][j * LD + i];
                if (i < I0 || i >= I0 + C) {
                    cr_expect(w == orig_w[j * LD + i] && g == orig_g[j * LD + i],
                              "%s strided softmax wrote [%d][%d] outside its columns", ops->name, j,
                              i);
                    continue;
                }
                cr_expect(w == pk[j * C + i - I0] && g == dpk[j * C + i - I0],
                          "%s strided softmax row %d column %d differs", ops->name, j, i);
            }
        /* softmax_bwd_p on the range: probabilities, columns outside kept */
        float before[R * LD];
        ref_fill(wide[v], R * LD, 64, 4.0f, STRIA_DTYPE_F32);
        memcpy(before, wide[v], sizeof(before));
        for (int j = 0; j < R; j++)
            for (int i = 0; i < C; i++)
                pk[j * C + i] = wide[v][j * LD + I0 + i];
        ops->softmax_bwd_p(wide[v] + I0, R, C, LD, 0.3f, lse);
        ops->softmax_bwd_p(pk, R, C, C, 0.3f, lse);
        for (int j = 0; j < R; j++)
            for (int i = 0; i < LD; i++) {
                bool in = i >= I0 && i < I0 + C;
                float want = in ? pk[j * C + i - I0] : before[j * LD + i];
                cr_expect(wide[v][j * LD + i] == want, "%s strided softmax_bwd_p [%d][%d]",
                          ops->name, j, i);
            }
    }
    /* the SIMD variant against the portable one on the strided calls */
    for (int i = 0; i < C; i++)
        cr_expect(m[1][i] == m[0][i] && fabsf(l[1][i] - l[0][i]) <= 2e-5f * fabsf(l[0][i]),
                  "%s strided softmax_fwd column %d: m %g/%g l %g/%g", simd->name, i, m[1][i],
                  m[0][i], l[1][i], l[0][i]);
}

Test(kernel_ops, softmax_on_column_ranges)
{
    for_each_simd(softmax_strided);
}

/* transpose32 moves 32-bit elements bit for bit (NaN payloads included),
 * honours both strides and writes nothing outside the transposed block. */
static void transpose_case(const stria_kern_ops_t *ops, int rows, int cols)
{
    const ptrdiff_t lds = cols + 8, ldd = rows + 16;
    size_t ns = (size_t)rows * (size_t)lds, nd = (size_t)cols * (size_t)ldd;
    uint32_t *src = malloc(ns * 4), *dst = malloc(nd * 4);
    for (size_t x = 0; x < ns; x++)
        src[x] = (uint32_t)(x * 2654435761u) | (x % 7 == 0 ? 0x7f800001u : 0u); /* NaNs */
    for (size_t x = 0; x < nd; x++)
        dst[x] = 0xdeadbeefu;
    ops->transpose32(src, lds, dst, ldd, rows, cols);
    for (int j = 0; j < cols; j++)
        for (ptrdiff_t i = 0; i < ldd; i++) {
            uint32_t want = i < rows ? src[i * lds + j] : 0xdeadbeefu;
            cr_assert_eq(dst[j * ldd + i], want, "%s transpose32 %dx%d: [%d][%td] = %08x, not %08x",
                         ops->name, rows, cols, j, i, dst[j * ldd + i], want);
        }
    free(src), free(dst);
}

static void transpose_all(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    static const int sizes[] = {8, 16, 40, 64, 128};
    for (size_t a = 0; a < 5; a++)
        for (size_t b = 0; b < 5; b++) {
            transpose_case(port, sizes[a], sizes[b]);
            transpose_case(simd, sizes[a], sizes[b]);
        }
}

Test(kernel_ops, transpose32_exact)
{
    for_each_simd(transpose_all);
}

/* ---- conversions ----------------------------------------------------------- */

/* Every 16-bit pattern, as bf16 and as fp16, converts exactly (NaN stays
 * NaN), and lengths that are not a multiple of the vector width write
 * exactly n elements. */
static void conversions(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { N = 65536 };
    uint16_t *h = malloc(N * 2 + 64);
    float *a = malloc(N * 4 + 64), *b = malloc(N * 4 + 64);
    static const stria_dtype_t dts[] = {STRIA_DTYPE_BF16, STRIA_DTYPE_F16};
    for (int i = 0; i < N; i++)
        h[i] = (uint16_t)i;
    for (size_t d = 0; d < 2; d++) {
        port->row_load(dts[d], h, a, N);
        simd->row_load(dts[d], h, b, N);
        for (int i = 0; i < N; i++)
            cr_assert(memcmp(&a[i], &b[i], 4) == 0 || (isnan(a[i]) && isnan(b[i])),
                      "%s %s 0x%04x: %.9g vs %.9g", simd->name, stria_dtype_name(dts[d]), i, b[i],
                      a[i]);
    }
    for (int n = 8; n <= 72; n += 8)
        for (size_t d = 0; d < 3; d++) {
            stria_dtype_t dt = d == 2 ? STRIA_DTYPE_F32 : dts[d];
            for (int i = 0; i < n + 16; i++)
                b[i] = -7.0f;
            simd->row_load(dt, dt == STRIA_DTYPE_F32 ? (const void *)a : (const void *)(h + 100), b,
                           n);
            port->row_load(dt, dt == STRIA_DTYPE_F32 ? (const void *)a : (const void *)(h + 100),
                           a + N - 100, n);
            for (int i = 0; i < n; i++)
                cr_assert(memcmp(&b[i], &a[N - 100 + i], 4) == 0 ||
                              (isnan(b[i]) && isnan(a[N - 100 + i])),
                          "%s %s n=%d element %d differs", simd->name, stria_dtype_name(dt), n, i);
            for (int i = n; i < n + 16; i++)
                cr_assert_eq(b[i], -7.0f, "%s %s n=%d wrote element %d", simd->name,
                             stria_dtype_name(dt), n, i);
        }
    free(h), free(a), free(b);
}

Test(kernel_ops, conversions_exact)
{
    for_each_simd(conversions);
}

/* row_store against stria_dtype_store(), bit for bit: every bf16 and fp16
 * rounding case (values halfway between two of the dtype, overflow to inf,
 * fp16 subnormals and below, NaNs of any payload and sign, infinities), and
 * lengths that are not a multiple of the vector width write exactly n
 * elements. */
static void stores(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    enum { N = 4096 };
    float *x = malloc(N * 4);
    uint16_t *h1 = malloc(N * 4 + 64), *h2 = malloc(N * 4 + 64);
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        uint32_t u = s;
        if (i % 4 == 0) /* halfway cases of bf16 and fp16 */
            u = (u & 0xffff0000u) | (i % 8 ? 0x8000u : 0x1000u);
        if (i % 16 == 1) /* NaNs, infinities, zeros and tiny values */
            u = (u & 0x80000000u) |
                (uint32_t[]){0x7f800001u, 0x7fc00000u, 0x7f800000u, 0x0u,
                             0x00000001u, 0x33800000u, 0x387fe000u, 0x477ff000u}[(i / 16) % 8];
        memcpy(&x[i], &u, 4);
        if (i % 5 == 2) /* ordinary values of fp16 range */
            x[i] = (float)((int)(s >> 16) - 32768) / 256.0f;
    }
    static const stria_dtype_t dts[] = {STRIA_DTYPE_BF16, STRIA_DTYPE_F16, STRIA_DTYPE_F32};
    for (size_t d = 0; d < 3; d++) {
        const size_t es = stria_dtype_size(dts[d]);
        for (int n = 8; n <= 72; n += 8)
            for (int at = 0; at + n <= N; at += 503) {
                memset(h1, 0x5a, (size_t)(n + 16) * es);
                memset(h2, 0x5a, (size_t)(n + 16) * es);
                port->row_store(dts[d], x + at, h1, n);
                simd->row_store(dts[d], x + at, h2, n);
                cr_assert(memcmp(h1, h2, (size_t)(n + 16) * es) == 0,
                          "%s row_store %s n=%d from %d differs from stria_dtype_store()",
                          simd->name, stria_dtype_name(dts[d]), n, at);
            }
    }
    free(x), free(h1), free(h2);
}

Test(kernel_ops, row_store_exact)
{
    for_each_simd(stores);
}

static void accumulate_rows(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    float src[272], d1[272], d2[272];
    ref_fill(src, 272, 60, 1.0f, STRIA_DTYPE_F32);
    for (int n = 8; n <= 256; n += 8) {
        ref_fill(d1, 272, 61, 1.0f, STRIA_DTYPE_F32);
        memcpy(d2, d1, sizeof(d1));
        port->row_acc(d1, src, n);
        simd->row_acc(d2, src, n);
        for (int i = 0; i < 272; i++)
            cr_assert_eq(d2[i], d1[i], "%s row_acc n=%d element %d: %g vs %g", simd->name, n, i,
                         d2[i], d1[i]);
    }
}

Test(kernel_ops, row_acc_matches)
{
    for_each_simd(accumulate_rows);
}

/* The causal mask of every variant against the rule itself, bit for bit:
 * every block shape a straddling sub-block may have, positions that are not
 * monotonic, equal, and past 2^32 (an int64 compare, not an int32 one);
 * unmasked elements keep their bits (a NaN payload included) and nothing
 * outside the block changes. */
static void mask_blocks(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    const stria_kern_ops_t *ops[2] = {port, simd};
    enum { LD = 24, ROWS = 18 };
    float st[ROWS * LD], out[ROWS * LD];
    int64_t kpos[16], qpos[16];
    uint32_t seed = 12345;
    ref_fill(st, ROWS * LD, 64, 2.0f, STRIA_DTYPE_F32);
    st[3] = NAN;
    for (int t = 0; t < 40; t++) {
        for (int i = 0; i < 16; i++) {
            seed = seed * 1664525u + 1013904223u;
            int64_t base = t % 2 ? ((int64_t)1 << 33) : 0; /* differ only above bit 32 */
            qpos[i] = base + (int64_t)(seed >> 27);
            seed = seed * 1664525u + 1013904223u;
            kpos[i] = base + (int64_t)(seed >> 27);
        }
        for (int v = 0; v < 2; v++)
            for (int rows = 1; rows <= 16; rows += t % 5 + 1)
                for (int cols = 1; cols <= 16; cols++) {
                    memcpy(out, st, sizeof(out));
                    ops[v]->mask_causal(out + LD + 1, rows, cols, LD, kpos, qpos);
                    for (int x = 0; x < ROWS * LD; x++) {
                        int j = x / LD - 1, i = x % LD - 1;
                        bool in = j >= 0 && j < rows && i >= 0 && i < cols;
                        uint32_t got, want;
                        float w = in && kpos[j] > qpos[i] ? -INFINITY : st[x];
                        memcpy(&got, &out[x], sizeof(got));
                        memcpy(&want, &w, sizeof(want));
                        cr_assert_eq(got, want,
                                     "%s mask_causal rows=%d cols=%d element (%d, %d): "
                                     "%#x, want %#x",
                                     ops[v]->name, rows, cols, j, i, got, want);
                    }
                }
    }
}

Test(kernel_ops, mask_causal_exact)
{
    for_each_simd(mask_blocks);
}

/* The bounds mask (documents, windows) of every variant against the rule
 * itself, bit for bit, like mask_causal above: random bounds per query
 * (empty ones included, lo > hi), positions past 2^32. */
static void mask_bound_blocks(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    const stria_kern_ops_t *ops[2] = {port, simd};
    enum { LD = 24, ROWS = 18 };
    float st[ROWS * LD], out[ROWS * LD];
    int64_t kpos[16], qlo[16], qhi[16];
    uint32_t seed = 777;
    ref_fill(st, ROWS * LD, 65, 2.0f, STRIA_DTYPE_F32);
    st[5] = NAN;
    for (int t = 0; t < 40; t++) {
        int64_t base = t % 2 ? ((int64_t)1 << 33) : 0; /* differ only above bit 32 */
        for (int i = 0; i < 16; i++) {
            seed = seed * 1664525u + 1013904223u;
            kpos[i] = base + (int64_t)(seed >> 27);
            seed = seed * 1664525u + 1013904223u;
            qlo[i] = base + (int64_t)(seed >> 27);
            seed = seed * 1664525u + 1013904223u;
            qhi[i] = base + (int64_t)(seed >> 27);
        }
        for (int v = 0; v < 2; v++)
            for (int rows = 1; rows <= 16; rows += t % 5 + 1)
                for (int cols = 1; cols <= 16; cols++) {
                    memcpy(out, st, sizeof(out));
                    ops[v]->mask_bounds(out + LD + 1, rows, cols, LD, kpos, qlo, qhi);
                    for (int x = 0; x < ROWS * LD; x++) {
                        int j = x / LD - 1, i = x % LD - 1;
                        bool in = j >= 0 && j < rows && i >= 0 && i < cols;
                        uint32_t got, want;
                        float w = in && (kpos[j] < qlo[i] || kpos[j] > qhi[i]) ? -INFINITY : st[x];
                        memcpy(&got, &out[x], sizeof(got));
                        memcpy(&want, &w, sizeof(want));
                        cr_assert_eq(got, want,
                                     "%s mask_bounds rows=%d cols=%d element (%d, %d): "
                                     "%#x, want %#x",
                                     ops[v]->name, rows, cols, j, i, got, want);
                    }
                }
    }
}

Test(kernel_ops, mask_bounds_exact)
{
    for_each_simd(mask_bound_blocks);
}

/* row_merge of every variant (the portable one included) against the same
 * formula in fp64, both modes, every length a head may have. */
static void merge_rows(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    const stria_kern_ops_t *ops[2] = {port, simd};
    float src[272], dst[272], out[272];
    ref_fill(src, 272, 62, 3.0f, STRIA_DTYPE_F32);
    ref_fill(dst, 272, 63, 3.0f, STRIA_DTYPE_F32);
    for (int v = 0; v < 2; v++)
        for (int acc = 0; acc < 2; acc++)
            for (int n = 8; n <= 256; n += 8) {
                const float inv = 0.37f, wa = 0.81f, wb = 0.19f;
                memcpy(out, dst, sizeof(out));
                ops[v]->row_merge(out, src, inv, wa, wb, acc != 0, n);
                for (int i = 0; i < 272; i++) {
                    double t = (double)src[i] * inv;
                    double want = i >= n ? dst[i] : acc ? (double)wa * dst[i] + wb * t : t;
                    double tol = 4e-7 * (fabs((double)wa * dst[i]) + fabs(t)) + 1e-30;
                    cr_assert(fabs(out[i] - want) <= tol,
                              "%s row_merge accumulate=%d n=%d element %d: %.9g, want %.9g",
                              ops[v]->name, acc, n, i, out[i], want);
                }
            }
}

Test(kernel_ops, row_merge_matches)
{
    for_each_simd(merge_rows);
}

/* The bf16 GEMM (where a variant has one and the CPU runs it) against an
 * fp64 sum of the same bf16 products: products of bf16 are exact in fp32,
 * so only the fp32 additions round. A in rows and in pairs along k (trans_a),
 * C written, accumulated and scaled per row. */
static void bf16_gemm(const stria_kern_ops_t *simd, const stria_kern_ops_t *port)
{
    static const int ms[] = {1, 5, 6, 7, 64};
    static const int ns[] = {16, 48, 64, 80};
    static const int ks[] = {2, 16, 48, 128, 256};
    (void)port;
    if (simd->gemm_bf16 == NULL || !simd->gemm_bf16_ok()) {
        cr_log_info("variant %s: no bf16 GEMM (none in the variant, or no AVX512-BF16)",
                    simd->name);
        return;
    }
    for (size_t im = 0; im < sizeof(ms) / sizeof(ms[0]); im++)
        for (size_t in = 0; in < sizeof(ns) / sizeof(ns[0]); in++)
            for (size_t ik = 0; ik < sizeof(ks) / sizeof(ks[0]); ik++)
                for (int mode = 0; mode < 4; mode++) {
                    /* mode 0: A rows, C written; 1: A pairs, C scaled and
                     * accumulated; 2: A rows, C accumulated; 3: A rows, C
                     * scaled and accumulated */
                    int m = ms[im], n = ns[in], k = ks[ik];
                    bool trans_a = mode == 1;
                    ptrdiff_t lda = trans_a ? 2 * m + 6 : k + 8, ldb = 2 * n + 32, ldc = n + 16;
                    size_t na = trans_a ? (size_t)(k / 2 * lda) : (size_t)(m * lda);
                    size_t nb = (size_t)(k / 2 * ldb), nc = (size_t)(m * ldc);
                    float *af = malloc((size_t)(m * k) * 4), *bf = malloc((size_t)(k * n) * 4);
                    uint16_t *a = calloc(na, 2), *b = calloc(nb, 2);
                    float *c = malloc(nc * 4), *beta = malloc((size_t)m * 4);
                    ref_fill(af, (size_t)(m * k), (uint64_t)(m + 7 * k), 2.0f, STRIA_DTYPE_BF16);
                    ref_fill(bf, (size_t)(k * n), (uint64_t)(n + 3 * k), 2.0f, STRIA_DTYPE_BF16);
                    for (int i = 0; i < m; i++) {
                        beta[i] = 0.25f * (float)(i % 5);
                        for (int p = 0; p < k; p++)
                            a[trans_a ? (p / 2) * lda + 2 * i + p % 2 : i * lda + p] =
                                stria_f32_to_bf16(af[i * k + p]);
                    }
                    for (int p = 0; p < k; p++)
                        for (int j = 0; j < n; j++)
                            b[(p / 2) * ldb + 2 * j + p % 2] = stria_f32_to_bf16(bf[p * n + j]);
                    for (size_t i = 0; i < nc; i++)
                        c[i] = -7.0f;
                    simd->gemm_bf16(m, n, k, a, lda, trans_a, b, ldb, c, ldc,
                                    mode % 2 ? beta : NULL, mode != 0);
                    for (int i = 0; i < m; i++)
                        for (int j = 0; j < ldc; j++) {
                            float got = c[i * ldc + j];
                            if (j >= n) {
                                cr_assert_eq(got, -7.0f, "%s bf16 gemm wrote C[%d][%d] beyond n=%d",
                                             simd->name, i, j, n);
                                continue;
                            }
                            double want = mode == 0 ? 0.0 : mode % 2 ? -7.0 * beta[i] : -7.0;
                            double mag = fabs(want);
                            for (int p = 0; p < k; p++) {
                                double x = (double)af[i * k + p] * (double)bf[p * n + j];
                                want += x;
                                mag += fabs(x);
                            }
                            cr_assert(fabs((double)got - want) <= 1.2e-7 * (k + 2) * mag + 1e-30,
                                      "%s bf16 gemm mode %d m=%d n=%d k=%d C[%d][%d] = %.9g, "
                                      "want %.9g",
                                      simd->name, mode, m, n, k, i, j, got, want);
                        }
                    free(af), free(bf), free(a), free(b), free(c), free(beta);
                }
}

Test(kernel_ops, bf16_gemm_exact_products)
{
    for_each_simd(bf16_gemm);
    /* the amx variant's tile product (emulated tiles) on any CPU */
    bf16_gemm(ops_of("amx-emu"), ops_of("portable"));
}

Test(kernel_ops, f32_add_every_variant_and_length)
{
    const char *const *names = stria_kernels_variant_names();
    static float dst[3000], src[3000], want[3000];
    const char *expected[CPU_EXPECT_MAX];
    size_t n_expected = cpu_expected_simd(expected), checked = 0;
    for (size_t v = 0; names[v] != NULL; v++) {
        if (!stria_kernels_variant_available(names[v]))
            continue;
        ops_of(names[v]);
        checked += cpu_name_in(expected, names[v]);
        for (size_t n = 0; n <= 2999; n = n < 40 ? n + 1 : n * 3 + 1) {
            for (size_t i = 0; i < 3000; i++) {
                dst[i] = (float)i * 0.37f - 11.0f;
                src[i] = 1.0f / (float)(i + 1) - (float)(i % 7);
                want[i] = i < n ? dst[i] + src[i] : dst[i];
            }
            stria_f32_add(dst, src, n);
            cr_assert_eq(memcmp(dst, want, sizeof(dst)), 0, "variant %s, n %zu", names[v], n);
        }
    }
    cr_assert_eq(checked, n_expected, "%zu of the %zu SIMD variants this CPU supports checked",
                 checked, n_expected);
    stria_kernels_set_variant(names[0]);
}

/* The emulated tiles follow TDPBF16PS (Intel SDM): subnormal bf16 inputs
 * count as zero, subnormal sums are flushed, 0 x inf is NaN and a NaN
 * spreads to its row and column of C only. Through the amx variant's
 * product on a 16 x 16 x 32 block, which is one tile product. */
Test(kernel_ops, amx_emu_tiles_follow_tdpbf16ps)
{
    const stria_kern_ops_t *emu = ops_of("amx-emu");
    uint16_t a[16 * 32], b[16 * 32]; /* A rows along k; B in pairs along k */
    float c[16 * 16];
    for (int i = 0; i < 16 * 32; i++)
        a[i] = b[i] = 0x3f80; /* 1.0 */
    a[0] = 0x0001;            /* A[0][0]: a subnormal bf16 */
    b[0] = 0x7f00;            /* B[0][0]: 2^127, would make the subnormal 2^-6 */
    emu->gemm_bf16(16, 16, 32, a, 32, false, b, 32, c, 16, NULL, false);
    cr_expect_eq(c[0], 31.0f, "a subnormal input counts as zero: %g", c[0]);
    cr_expect_eq(c[1], 31.0f, "row 0 of A holds the subnormal: %g", c[1]);
    cr_expect_eq(c[17], 32.0f, "row 1 of A does not: %g", c[17]);
    /* a sum that falls below FLT_MIN is flushed to zero */
    for (int i = 0; i < 16 * 32; i++)
        a[i] = b[i] = 0;
    a[0] = 0x0100; /* 2^-125 */
    b[0] = 0x3e80; /* 0.25: the product 2^-127 is subnormal */
    emu->gemm_bf16(16, 16, 32, a, 32, false, b, 32, c, 16, NULL, false);
    cr_expect_eq(c[0], 0.0f, "a subnormal sum is flushed: %g", c[0]);
    /* 0 x inf is NaN, in row 2 and column 3 of C only */
    a[2 * 32 + 4] = 0;                /* A[2][4] = 0 */
    b[(4 / 2) * 32 + 2 * 3] = 0x7f80; /* B[4][3] = +inf */
    emu->gemm_bf16(16, 16, 32, a, 32, false, b, 32, c, 16, NULL, false);
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++)
            cr_expect(isnan(c[i * 16 + j]) == (j == 3), "C[%d][%d] = %g", i, j, c[i * 16 + j]);
}
