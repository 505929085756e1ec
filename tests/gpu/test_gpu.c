/* GPU suite: the CUDA device (stria_device_open("cuda:0")) against the
 * portable CPU kernels and the fp64 reference of tests/common, over the shape
 * and mask matrix of tests/kernels: causal and not; contiguous, striped (with
 * the diagonal included and excluded) and zigzag positions; lengths that are
 * not multiples of any tile; GQA; batch > 1; fp32, bf16, fp16; head_dim 64
 * and 128 (tensor-core kernels) and others (SIMT kernels); strided views,
 * aligned (tensor cores) and not (SIMT). Documents and windows:
 * test_gpu_masks.c; the harness (one case against the CPU and the fp64
 * reference): gpu_case.c.
 *
 * Tolerance: the rule of tests/kernels (error against fp64 within 2x the error
 * of a plain fp32 implementation, plus a floor relative to the values), and
 * for the tensor-core kernels one more term for the rounding of P and dS to
 * the storage dtype before their products (as every tensor-core attention
 * does): 8 units of that dtype's rounding error times the largest value
 * (bf16 2^-6, fp16 2^-9). The CPU kernels keep P in fp32, so the GPU is also
 * held to within its tolerance plus the CPU's own error of the CPU result.
 *
 * Without CUDA in the build, or without a visible GPU, main() prints one line
 * and exits 77 (ctest: skipped). The GPU is probed in a child process: a
 * process that has initialised CUDA cannot fork, and Criterion forks every
 * test. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_case.h"
#include "ref.h"

/* ---- the matrix ---------------------------------------------------------------- */

Test(gpu, head_dims_dtypes_causal_gqa_batch)
{
    static const int64_t dims[] = {64, 128, 16, 48, 256};
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++)
        for (size_t t = 0; t < 3; t++) {
            gcase_t c = {.B = 2,
                         .Tq = 150,
                         .Tk = 150,
                         .H = 4,
                         .Hkv = 2,
                         .D = dims[d],
                         .causal = true,
                         .dtype = all_dtypes[t]};
            run_case(&c);
        }
}

Test(gpu, multi_tile_causal_and_noncausal)
{
    static const int64_t dims[] = {64, 128};
    for (int causal = 0; causal < 2; causal++)
        for (size_t d = 0; d < 2; d++)
            for (size_t t = 0; t < 3; t++) {
                gcase_t c = {.B = 1,
                             .Tq = 157,
                             .Tk = 203,
                             .H = 2,
                             .Hkv = 1,
                             .D = dims[d],
                             .causal = causal,
                             .dtype = all_dtypes[t]};
                c.qruns[0] = (stria_pos_run_t){46, 1, 157}; /* the last 157 keys */
                c.n_qruns = 1;
                run_case(&c);
            }
}

/* Striped attention, ring of 4, rank 1: the K/V block of rank j holds
 * positions j, j+4, ...; the diagonal is included iff j <= 1. */
Test(gpu, striped_diagonal_included_and_excluded)
{
    for (int64_t j = 0; j < 4; j++)
        for (int mma = 0; mma < 2; mma++) {
            gcase_t c = {.B = 1,
                         .Tq = 300,
                         .Tk = 300,
                         .H = 2,
                         .Hkv = 2,
                         .D = mma ? 128 : 64,
                         .causal = true,
                         .dtype = mma ? STRIA_DTYPE_BF16 : STRIA_DTYPE_F32};
            c.qruns[0] = (stria_pos_run_t){1, 4, 300};
            c.n_qruns = 1;
            c.kruns[0] = (stria_pos_run_t){j, 4, 300};
            c.n_kruns = 1;
            run_case(&c);
        }
}

/* Zigzag: two runs per block, positions far from zero. */
Test(gpu, zigzag_runs_and_offsets)
{
    for (size_t t = 0; t < 3; t++) {
        gcase_t c = {.B = 1,
                     .Tq = 200,
                     .Tk = 200,
                     .H = 2,
                     .Hkv = 1,
                     .D = 64,
                     .causal = true,
                     .dtype = all_dtypes[t]};
        c.qruns[0] = (stria_pos_run_t){1000100, 1, 100};
        c.qruns[1] = (stria_pos_run_t){1000700, 1, 100};
        c.n_qruns = 2;
        c.kruns[0] = (stria_pos_run_t){1000000, 1, 100};
        c.kruns[1] = (stria_pos_run_t){1000750, 1, 100};
        c.n_kruns = 2;
        run_case(&c);
    }
}

/* Rows that see no key get LSE = -inf, zero output and zero gradients. */
Test(gpu, rows_without_visible_keys)
{
    for (size_t t = 0; t < 3; t++) {
        gcase_t c = {.B = 1,
                     .Tq = 70,
                     .Tk = 30,
                     .H = 2,
                     .Hkv = 1,
                     .D = 64,
                     .causal = true,
                     .dtype = all_dtypes[t],
                     .scale = 0.3f};
        c.kruns[0] = (stria_pos_run_t){50, 1, 30}; /* queries 0..49 see nothing */
        c.n_kruns = 1;
        run_case(&c);
    }
}

/* Several CTAs and many tiles per CTA, causal and GQA, both kernel families. */
Test(gpu, longer_blocks)
{
    gcase_t a = {.B = 1,
                 .Tq = 700,
                 .Tk = 900,
                 .H = 4,
                 .Hkv = 1,
                 .D = 128,
                 .causal = true,
                 .dtype = STRIA_DTYPE_BF16};
    a.qruns[0] = (stria_pos_run_t){200, 1, 700};
    a.n_qruns = 1;
    gcase_t b = a;
    b.dtype = STRIA_DTYPE_F16;
    b.D = 64;
    b.causal = false;
    run_case(&a);
    run_case(&b);
}

/* Strided views: head rows padded by 8 (aligned: tensor cores) and by 4
 * (16-bit rows no longer 16-byte aligned: SIMT); the padding must stay intact. */
Test(gpu, strided_views)
{
    for (int64_t pad = 4; pad <= 8; pad += 4)
        for (size_t t = 1; t < 3; t++) {
            gcase_t c = {.B = 2,
                         .Tq = 130,
                         .Tk = 170,
                         .H = 2,
                         .Hkv = 1,
                         .D = 64,
                         .causal = true,
                         .dtype = all_dtypes[t],
                         .pad = pad};
            c.qruns[0] = (stria_pos_run_t){40, 1, 130};
            c.n_qruns = 1;
            run_case(&c);
        }
}

/* ---- accumulate, init, merge, finalize ------------------------------------------ */

/* Forward over K/V split in blocks, merged by accumulate and by merge in
 * reverse order, against the CPU doing the same. */
Test(gpu, accumulate_and_merge_match_cpu)
{
    static const int64_t dims[] = {128, 64, 32};
    for (size_t dd = 0; dd < 3; dd++) {
        const int64_t Tq = 150, Tk = 260, H = 2, D = dims[dd];
        const stria_dtype_t dt = dd == 2 ? STRIA_DTYPE_F32 : STRIA_DTYPE_BF16;
        size_t nq = (size_t)(Tq * H * D), nk = (size_t)(Tk * H * D), nl = (size_t)(H * Tq);
        size_t es = stria_dtype_size(dt);
        float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
        void *qs = malloc(nq * es), *ks = malloc(nk * es), *vs = malloc(nk * es);
        float *o = malloc(nq * 4), *l = malloc(nl * 4), *ob = malloc(nq * 4), *lb = malloc(nl * 4);
        float *go = malloc(nq * 4), *gl = malloc(nl * 4);
        stria_pos_run_t qrun = {110, 1, Tq}; /* queries 110..259, keys 0..259 */
        stria_device_t *dev = gpu_open();
        gcase_t gc = {
            .B = 1, .Tq = Tq, .Tk = Tk, .H = H, .Hkv = H, .D = D, .causal = true, .dtype = dt};

        ref_fill(q, nq, 31, 2.0f, dt);
        ref_fill(k, nk, 32, 2.0f, dt);
        ref_fill(v, nk, 33, 1.0f, dt);
        ref_to_dtype(q, nq, dt, qs);
        ref_to_dtype(k, nk, dt, ks);
        ref_to_dtype(v, nk, dt, vs);
        stria_attn_params_t p = case_params(&gc);
        p.q_pos.runs = &qrun;
        p.q_pos.n_runs = 1;
        stria_tensor_t tq = stria_tensor_contiguous(qs, dt, Tq, H, D);
        stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tob = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t gq = tq, gk = stria_tensor_contiguous(NULL, dt, Tk, H, D), gv = gk;
        stria_tensor_t gpo = to, gpob = tob;
        float *glse = NULL, *glb = NULL;
        gq.data = gpu_upload(dev, qs, nq * es);
        gk.data = gpu_upload(dev, ks, nk * es);
        gv.data = gpu_upload(dev, vs, nk * es);
        cr_assert_eq(stria_device_alloc(dev, nq * 4, &gpo.data), STRIA_OK);
        cr_assert_eq(stria_device_alloc(dev, nq * 4, &gpob.data), STRIA_OK);
        cr_assert_eq(stria_device_alloc(dev, nl * 4, (void **)&glse), STRIA_OK);
        cr_assert_eq(stria_device_alloc(dev, nl * 4, (void **)&glb), STRIA_OK);
        cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK);

        for (int nb = 1; nb <= 4; nb++) {
            cr_assert_eq(stria_attn_partial_init(&p, &to, l), STRIA_OK);
            cr_assert_eq(stria_device_attn_partial_init(dev, &p, &gpo, glse), STRIA_OK, "%s",
                         stria_error_msg());
            for (int blk = nb - 1; blk >= 0; blk--) {
                int64_t k0 = Tk * blk / nb, k1 = Tk * (blk + 1) / nb;
                stria_pos_run_t krun = {k0, 1, k1 - k0};
                stria_attn_params_t pb = p;
                pb.kv_tokens = k1 - k0;
                pb.kv_pos.runs = &krun;
                pb.kv_pos.n_runs = 1;
                stria_tensor_t tkb =
                    stria_tensor_contiguous((char *)ks + (size_t)(k0 * H * D) * es, dt, Tk, H, D);
                stria_tensor_t tvb =
                    stria_tensor_contiguous((char *)vs + (size_t)(k0 * H * D) * es, dt, Tk, H, D);
                stria_tensor_t gkb = gk, gvb = gv;
                gkb.data = (char *)gk.data + (size_t)(k0 * H * D) * es;
                gvb.data = (char *)gv.data + (size_t)(k0 * H * D) * es;
                if (blk % 2 == 0) {
                    cr_assert_eq(stria_attn_fwd(&pb, &tq, &tkb, &tvb, &to, l, true), STRIA_OK);
                    cr_assert_eq(stria_device_attn_fwd(dev, &pb, &gq, &gkb, &gvb, &gpo, glse, true),
                                 STRIA_OK, "%s", stria_error_msg());
                } else {
                    cr_assert_eq(stria_attn_fwd(&pb, &tq, &tkb, &tvb, &tob, lb, false), STRIA_OK);
                    cr_assert_eq(stria_attn_merge(&p, &to, l, &tob, lb), STRIA_OK);
                    cr_assert_eq(
                        stria_device_attn_fwd(dev, &pb, &gq, &gkb, &gvb, &gpob, glb, false),
                        STRIA_OK, "%s", stria_error_msg());
                    cr_assert_eq(stria_device_attn_merge(dev, &p, &gpo, glse, &gpob, glb), STRIA_OK,
                                 "%s", stria_error_msg());
                }
            }
            gpu_download(dev, go, gpo.data, nq * 4);
            gpu_download(dev, gl, glse, nl * 4);
            double maxo = 0.0, erro = 0.0, errl = 0.0;
            for (size_t i = 0; i < nq; i++) {
                maxo = fabs(o[i]) > maxo ? fabs(o[i]) : maxo;
                double d = fabs((double)go[i] - (double)o[i]);
                erro = d > erro || d != d ? d : erro;
            }
            for (size_t i = 0; i < nl; i++) {
                double d = fabs((double)gl[i] - (double)l[i]);
                errl = d > errl || d != d ? d : errl;
            }
            double tol = 2e-5 + 4.0 * (uses_mma(&gc) ? dtype_term(&gc) : 0.0);
            cr_expect(erro <= tol * (1.0 + maxo), "D=%lld blocks=%d: O differs from CPU by %.3g",
                      (long long)D, nb, erro);
            cr_expect(errl <= 2e-5 * 16.0, "D=%lld blocks=%d: LSE differs from CPU by %.3g",
                      (long long)D, nb, errl);
        }
        stria_device_free(dev, gq.data), stria_device_free(dev, gk.data);
        stria_device_free(dev, gv.data), stria_device_free(dev, gpo.data);
        stria_device_free(dev, gpob.data), stria_device_free(dev, glse);
        stria_device_free(dev, glb);
        stria_device_close(dev);
        free(q), free(k), free(v), free(qs), free(ks), free(vs), free(o), free(l), free(ob);
        free(lb), free(go), free(gl);
    }
}

/* LSE gaps of +-1e4 and -inf rows: GPU merge equals the CPU merge. */
Test(gpu, merge_extreme_lse_and_empty_rows)
{
    const int64_t T = 6, D = 16;
    float oa[6 * 16], ob[6 * 16], ca[6 * 16], got[6 * 16], gl[6];
    float la[6] = {1e4f, -1e4f, -INFINITY, -INFINITY, 5.0f, 2.0f};
    float lb[6] = {-1e4f, 1e4f, 3.0f, -INFINITY, 5.0f, -INFINITY};
    float cl[6];
    stria_attn_params_t p;
    gcase_t gc = {.B = 1, .Tq = T, .Tk = 1, .H = 1, .Hkv = 1, .D = D, .dtype = STRIA_DTYPE_F32};
    stria_device_t *dev = gpu_open();
    p = case_params(&gc);
    for (int i = 0; i < T * D; i++) {
        oa[i] = 1.0f + (float)(i % 5);
        ob[i] = 2.0f - (float)(i % 3);
    }
    for (int d = 0; d < D; d++) /* -inf rows hold zero partials */
        oa[2 * D + d] = oa[3 * D + d] = ob[3 * D + d] = ob[5 * D + d] = 0.0f;
    memcpy(ca, oa, sizeof(oa));
    memcpy(cl, la, sizeof(la));
    stria_tensor_t ta = stria_tensor_contiguous(ca, STRIA_DTYPE_F32, T, 1, D);
    stria_tensor_t tb = stria_tensor_contiguous(ob, STRIA_DTYPE_F32, T, 1, D);
    cr_assert_eq(stria_attn_merge(&p, &ta, cl, &tb, lb), STRIA_OK, "%s", stria_error_msg());
    stria_tensor_t ga = ta, gb = tb;
    ga.data = gpu_upload(dev, oa, sizeof(oa));
    gb.data = gpu_upload(dev, ob, sizeof(ob));
    float *gla = gpu_upload(dev, la, sizeof(la)), *glb = gpu_upload(dev, lb, sizeof(lb));
    cr_assert_eq(stria_device_attn_merge(dev, &p, &ga, gla, &gb, glb), STRIA_OK, "%s",
                 stria_error_msg());
    gpu_download(dev, got, ga.data, sizeof(got));
    gpu_download(dev, gl, gla, sizeof(gl));
    for (int i = 0; i < T * D; i++)
        cr_expect(fabsf(got[i] - ca[i]) <= 1e-6f * (1.0f + fabsf(ca[i])), "O[%d]: GPU %g, CPU %g",
                  i, got[i], ca[i]);
    for (int i = 0; i < T; i++)
        cr_expect(gl[i] == cl[i] || fabsf(gl[i] - cl[i]) <= 1e-6f * (1.0f + fabsf(cl[i])),
                  "LSE[%d]: GPU %g, CPU %g", i, gl[i], cl[i]);
    stria_device_free(dev, ga.data), stria_device_free(dev, gb.data);
    stria_device_free(dev, gla), stria_device_free(dev, glb);
    stria_device_close(dev);
}

/* partial_init zeroes exactly the view's rows; finalize rounds like the CPU
 * (bit for bit) into a strided bf16/fp16/fp32 view. */
Test(gpu, partial_init_and_finalize)
{
    const int64_t B = 2, T = 33, H = 3, D = 40, pad = 8;
    size_t n = (size_t)(B * T * H * D), nl = (size_t)(B * H * T);
    float *vals = malloc(n * 4), *lse = malloc(nl * 4), *back = malloc(n * 4);
    gcase_t gc = {.B = B, .Tq = T, .Tk = 1, .H = H, .Hkv = 1, .D = D, .dtype = STRIA_DTYPE_F32};
    stria_attn_params_t p = case_params(&gc);
    stria_device_t *dev = gpu_open();

    ref_fill(vals, n, 77, 3.0f, STRIA_DTYPE_F32);
    hview_t ho = hview_make(vals, STRIA_DTYPE_F32, B, T, H, D, pad, FILLER);
    stria_tensor_t go = dview(dev, &ho);
    float *glse = NULL;
    cr_assert_eq(stria_device_alloc(dev, nl * 4, (void **)&glse), STRIA_OK);
    for (int t = 0; t < 3; t++) {
        const stria_dtype_t dt = all_dtypes[t];
        size_t es = stria_dtype_size(dt);
        uint16_t *want16 = malloc(n * 2);
        hview_t hout = hview_make(NULL, dt, B, T, H, D, pad, FILLER);
        stria_tensor_t gout = dview(dev, &hout);
        stria_tensor_t tp = stria_tensor_contiguous(vals, STRIA_DTYPE_F32, T, H, D);
        stria_tensor_t tw = stria_tensor_contiguous(want16, dt, T, H, D);
        void *want = dt == STRIA_DTYPE_F32 ? (void *)vals : (void *)want16;
        if (dt != STRIA_DTYPE_F32)
            cr_assert_eq(stria_attn_finalize(&p, &tp, &tw), STRIA_OK, "%s", stria_error_msg());
        cr_assert_eq(stria_device_attn_finalize(dev, &p, &go, &gout), STRIA_OK, "%s",
                     stria_error_msg());
        gpu_download(dev, hout.host, gout.data, hout.bytes);
        for (int64_t r = 0; r < B * T * H; r++) {
            cr_expect(memcmp((char *)hout.host + (size_t)(r * (D + pad)) * es,
                             (char *)want + (size_t)(r * D) * es, (size_t)D * es) == 0,
                      "finalize to %s: row %lld differs from the CPU's rounding",
                      stria_dtype_name(dt), (long long)r);
            for (int64_t d = D; d < D + pad; d++)
                cr_expect_eq(stria_dtype_load(dt, hout.host, (size_t)(r * (D + pad) + d)), FILLER,
                             "finalize to %s: padding of row %lld overwritten",
                             stria_dtype_name(dt), (long long)r);
        }
        stria_device_free(dev, gout.data);
        free(hout.host);
        free(want16);
    }
    cr_assert_eq(stria_device_attn_partial_init(dev, &p, &go, glse), STRIA_OK, "%s",
                 stria_error_msg());
    gpu_download(dev, ho.host, go.data, ho.bytes);
    gpu_download(dev, lse, glse, nl * 4);
    hview_read(&ho, B, T, H, D, pad, FILLER, back, "partial_init");
    for (size_t i = 0; i < n; i++)
        cr_expect_eq(back[i], 0.0f, "partial_init: O[%zu] = %g", i, back[i]);
    for (size_t i = 0; i < nl; i++)
        cr_expect(isinf(lse[i]) && lse[i] < 0, "partial_init: LSE[%zu] = %g", i, lse[i]);
    stria_device_free(dev, go.data), stria_device_free(dev, glse);
    stria_device_close(dev);
    free(ho.host), free(vals), free(lse), free(back);
}

/* Invalid calls get the same errors as on the CPU, before anything runs. */
Test(gpu, bad_arguments_match_cpu)
{
    stria_device_t *dev = gpu_open();
    float *buf = NULL, *lse = NULL, *o = NULL;
    stria_attn_params_t p;
    gcase_t gc = {.B = 1,
                  .Tq = 4,
                  .Tk = 4,
                  .H = 2,
                  .Hkv = 2,
                  .D = 32,
                  .causal = true,
                  .dtype = STRIA_DTYPE_F32};
    p = case_params(&gc);
    cr_assert_eq(stria_device_alloc(dev, 4 * 2 * 32 * 4, (void **)&buf), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, 4 * 2 * 32 * 4, (void **)&o), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, 8 * 4, (void **)&lse), STRIA_OK);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 4, 2, 32);
    stria_attn_params_t bad = p;
    bad.head_dim = 20;
    cr_expect_eq(stria_device_attn_fwd(dev, &bad, &t, &t, &t, &to, lse, false),
                 STRIA_ERR_UNSUPPORTED);
    cr_expect(strstr(stria_error_msg(), "head_dim 20") != NULL, "%s", stria_error_msg());
    bad = p;
    stria_pos_run_t run = {0, 1, 3};
    bad.q_pos.runs = &run;
    bad.q_pos.n_runs = 1;
    cr_expect_eq(stria_device_attn_fwd(dev, &bad, &t, &t, &t, &to, lse, false),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "cover 3 tokens") != NULL, "%s", stria_error_msg());
    cr_expect_eq(stria_device_attn_bwd(dev, &p, &t, &t, &t, &t, lse, lse, &to, &to, &to),
                 STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "alias") != NULL, "%s", stria_error_msg());
    stria_device_free(dev, buf), stria_device_free(dev, o), stria_device_free(dev, lse);
    stria_device_close(dev);
}

/* ---- main: skip without a GPU ------------------------------------------------- */

/* Number of GPUs, asked in a child process so that this one never initialises
 * CUDA (Criterion forks the tests). */
static int gpu_count_in_child(void)
{
    pid_t pid;
    int status = 0;
    if (!stria_cuda_built())
        return 0;
    pid = fork();
    if (pid < 0)
        return 0;
    if (pid == 0) {
        int n = stria_cuda_device_count();
        _exit(n > 100 ? 100 : n);
    }
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
        return 0;
    return WEXITSTATUS(status);
}

int main(int argc, char *argv[])
{
    struct criterion_test_set *tests;
    int result = 0;

    if (gpu_count_in_child() == 0) {
        printf("no CUDA GPU visible: skipping the gpu suite\n");
        return 77;
    }
    tests = criterion_initialize();
    if (criterion_handle_args(argc, argv, true))
        result = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    return result;
}
