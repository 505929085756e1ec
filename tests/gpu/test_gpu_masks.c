/* GPU suite, documents and sliding windows (part of test_gpu, same tolerance
 * rule and skip without a GPU): the CUDA device against the portable CPU
 * kernels and the fp64 reference of tests/common (ref_f64_run_masks) over the
 * mask matrix of tests/kernels: random documents (shorter than a tile and a
 * grain, empty ones, boundaries at every phase) in every layout; causal
 * windows of left 0, 1, 63, 64, 65, S - 1, S and more; windows that are not
 * causal; windows with documents; documents [0, S] and window (-1, -1) bit for
 * bit equal to no mask; the forward and backward passes of the device layer
 * with masks over several K/V blocks; bad masks refused with the CPU's
 * messages. Tensor-core kernels (bf16/fp16, head_dim 64/128) and SIMT
 * kernels (fp32) alike. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_case.h"
#include "ref.h"

/* Random documents covering [0, S): lengths drawn from short ones (under 16
 * and 64), empty ones and ones near the tile sizes, so that boundaries fall
 * at every phase of a 16-token grain. Ends with an empty document. Returns
 * the entry count (at most cap). */
static size_t random_docs(int64_t S, uint32_t seed, int64_t *cu, size_t cap)
{
    static const int64_t lens[] = {0,  1,  3,  5,   7, 9, 11, 13, 15, 16, 17, 0, 31, 33, 47,
                                   63, 64, 65, 100, 2, 4, 6,  8,  10, 12, 14, 0, 21, 129};
    const size_t nl = sizeof(lens) / sizeof(lens[0]);
    size_t n = 1;
    cu[0] = 0;
    while (cu[n - 1] < S && n + 2 < cap) {
        seed = seed * 1664525u + 1013904223u;
        int64_t len = lens[(seed >> 16) % nl];
        cu[n] = cu[n - 1] + len < S ? cu[n - 1] + len : S;
        n++;
    }
    cu[n - 1] = S;
    cu[n++] = S;
    return n;
}

enum { LAYOUT_CONTIGUOUS, LAYOUT_STRIPED, LAYOUT_ZIGZAG, N_LAYOUTS };

/* Positions of rank r's block of a sequence of S tokens over N ranks. */
static size_t layout_runs(int layout, int64_t S, int64_t N, int64_t r, stria_pos_run_t *runs)
{
    const int64_t T = S / N, C = S / (2 * N);
    switch (layout) {
    case LAYOUT_STRIPED:
        runs[0] = (stria_pos_run_t){r, N, T};
        return 1;
    case LAYOUT_ZIGZAG:
        runs[0] = (stria_pos_run_t){r * C, 1, C};
        runs[1] = (stria_pos_run_t){(2 * N - 1 - r) * C, 1, C};
        return 2;
    default:
        runs[0] = (stria_pos_run_t){r * T, 1, T};
        return 1;
    }
}

/* The kernels a case runs on: tensor cores at bf16 d128 and fp16 d64, SIMT
 * at fp32 d64. */
static const struct {
    stria_dtype_t dtype;
    int64_t D;
} kinds[] = {{STRIA_DTYPE_BF16, 128}, {STRIA_DTYPE_F16, 64}, {STRIA_DTYPE_F32, 64}};

/* The query block of rank r against the key block of rank j, 2 query heads
 * over 1 K/V head. */
static gcase_t layout_case(int layout, int64_t S, int64_t N, int64_t r, int64_t j, bool causal,
                           size_t kind)
{
    gcase_t c = {.B = 1,
                 .Tq = S / N,
                 .Tk = S / N,
                 .H = 2,
                 .Hkv = 1,
                 .D = kinds[kind].D,
                 .causal = causal,
                 .dtype = kinds[kind].dtype};
    c.n_qruns = layout_runs(layout, S, N, r, c.qruns);
    c.n_kruns = layout_runs(layout, S, N, j, c.kruns);
    return c;
}

Test(gpu_masks, documents_in_every_layout)
{
    enum { S = 384, N = 2 };
    int64_t cu[S + 4];
    static const int64_t pairs[][2] = {{1, 0}, {1, 1}, {0, 1}};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t pr = 0; pr < 3; pr++)
            for (int causal = 0; causal < 2; causal++)
                for (size_t kd = 0; kd < 3; kd++) {
                    gcase_t c = layout_case(layout, S, N, pairs[pr][0], pairs[pr][1], causal, kd);
                    c.n_cu = random_docs(S, (uint32_t)(7 * layout + 3 * pr + causal + 1), cu,
                                         sizeof(cu) / sizeof(cu[0]));
                    c.cu = cu;
                    run_case(&c);
                }
}

Test(gpu_masks, documents_shorter_than_a_grain_and_empty)
{
    /* every document 0..15 tokens long: every tile straddles many */
    enum { S = 300 };
    int64_t cu[S + 2];
    size_t n = 1;
    cu[0] = 0;
    for (int64_t len = 0; cu[n - 1] < S; len = (len + 7) % 16) {
        cu[n] = cu[n - 1] + len < S ? cu[n - 1] + len : S;
        n++;
    }
    for (int causal = 0; causal < 2; causal++)
        for (size_t kd = 0; kd < 3; kd++) {
            gcase_t c = layout_case(LAYOUT_CONTIGUOUS, S, 1, 0, 0, causal, kd);
            c.cu = cu;
            c.n_cu = n;
            run_case(&c);
        }
}

Test(gpu_masks, causal_windows)
{
    enum { S = 384, N = 2 };
    static const int64_t lefts[] = {0, 1, 63, 64, 65, S - 1, S, S + 7, -1};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(lefts) / sizeof(lefts[0]); w++) {
            gcase_t c = layout_case(layout, S, N, 1, (int64_t)(w % 2), true, (w + layout) % 3);
            c.has_window = true;
            c.left = lefts[w];
            c.right = w % 3 == 0 ? -1 : 0;
            run_case(&c);
        }
}

Test(gpu_masks, noncausal_windows)
{
    enum { S = 384, N = 2 };
    static const int64_t rights[] = {0, 5, S, -1};
    static const int64_t lefts[] = {-1, 0, 65, S + 1};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(rights) / sizeof(rights[0]); w++)
            for (size_t lw = 0; lw < sizeof(lefts) / sizeof(lefts[0]); lw++) {
                gcase_t c = layout_case(layout, S, N, (int64_t)(lw % 2), (int64_t)(w % 2), false,
                                        (w + lw) % 3);
                c.has_window = true;
                c.left = lefts[lw];
                c.right = rights[w];
                run_case(&c);
            }
}

Test(gpu_masks, windows_with_documents)
{
    enum { S = 384, N = 2 };
    int64_t cu[S + 4];
    static const int64_t wins[][3] = {/* causal, left, right */
                                      {1, 5, 0},  {1, 64, -1}, {1, 0, 0},  {0, 17, 5},
                                      {0, -1, 0}, {0, 0, -1},  {0, 65, 65}};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(wins) / sizeof(wins[0]); w++)
            for (size_t kd = 0; kd < 3; kd++) {
                gcase_t c = layout_case(layout, S, N, 1, (int64_t)(w % 2), wins[w][0] != 0, kd);
                c.n_cu =
                    random_docs(S, (uint32_t)(11 * layout + w + 5), cu, sizeof(cu) / sizeof(cu[0]));
                c.cu = cu;
                c.has_window = true;
                c.left = wins[w][1];
                c.right = wins[w][2];
                run_case(&c);
            }
}

static void expect_same_bits(const char *what, const char *mask, const gcase_t *c, const float *a,
                             const float *b, size_t n)
{
    cr_expect(memcmp(a, b, n * sizeof(float)) == 0,
              "%s: %s dtype %s D=%lld causal=%d: differs from no mask in its bits", what, mask,
              stria_dtype_name(c->dtype), (long long)c->D, c->causal);
}

/* Documents [0, S) and window (-1, -1) mask nothing: every output keeps the
 * bits of the call without them, forward and backward. */
Test(gpu_masks, masks_that_mask_nothing_are_bit_identical)
{
    enum { S = 320, N = 2 };
    static const int64_t whole[] = {0, S}, longer[] = {0, S + 50};
    static const char *const what[] = {"cu_seqlens [0, S]", "window (-1, -1)", "both",
                                       "cu_seqlens [0, S + 50]"};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (int causal = 0; causal < 2; causal++)
            for (size_t kd = 0; kd < 3; kd++) {
                if (layout == LAYOUT_ZIGZAG && !causal)
                    continue; /* the same tiles as contiguous without a causal mask */
                gcase_t c = layout_case(layout, S, N, 1, causal, causal, kd);
                gpu_outs_t plain;
                run_case_out(&c, &plain);
                for (int m = 0; m < 4; m++) {
                    gcase_t cm = c;
                    if (m == 0 || m == 2) {
                        cm.cu = whole;
                        cm.n_cu = 2;
                    }
                    if (m == 3) {
                        cm.cu = longer;
                        cm.n_cu = 2;
                    }
                    if (m == 1 || m == 2) {
                        cm.has_window = true;
                        cm.left = -1;
                        cm.right = -1;
                    }
                    gpu_outs_t got;
                    run_case_out(&cm, &got);
                    expect_same_bits("O", what[m], &c, got.o, plain.o, plain.nq);
                    expect_same_bits("LSE", what[m], &c, got.lse, plain.lse, plain.nl);
                    expect_same_bits("dQ", what[m], &c, got.dq, plain.dq, plain.nq);
                    expect_same_bits("dK", what[m], &c, got.dk, plain.dk, plain.nk);
                    expect_same_bits("dV", what[m], &c, got.dv, plain.dv, plain.nk);
                    gpu_outs_free(&got);
                }
                gpu_outs_free(&plain);
            }
}

/* max |a - b| over n values and max |b| */
static double max_diff(const float *a, const float *b, size_t n, double *maxabs)
{
    double d = 0.0;
    *maxabs = 0.0;
    for (size_t i = 0; i < n; i++) {
        double x = fabs((double)a[i] - (double)b[i]);
        if (isinf(a[i]) || isinf(b[i]))
            x = a[i] == b[i] ? 0.0 : INFINITY;
        d = x > d || x != x ? x : d;
        *maxabs = isinf(b[i]) || fabs(b[i]) <= *maxabs ? *maxabs : fabs(b[i]);
    }
    return d;
}

/* The ring's use: one query block against 4 K/V blocks through the device
 * layer's passes (documents and a causal window), equal to the CPU kernels
 * on all keys at once. The backward starts from the CPU's LSE and D. */
Test(gpu_masks, masks_through_the_passes)
{
    enum { Tq = 256, Tk = 256, NB = 4, H = 2, TB = Tk / NB };
    static const int64_t cu[] = {0, 1, 17, 64, 64, 100, 192, 256};
    for (size_t kd = 0; kd < 3; kd++) {
        const stria_dtype_t dt = kinds[kd].dtype;
        const int64_t D = kinds[kd].D;
        const size_t nq = (size_t)(Tq * H * D), nk = (size_t)(Tk * D), nl = (size_t)(H * Tq);
        const size_t es = stria_dtype_size(dt), nin = 2 * nq + 2 * nk;
        /* outputs, CPU and GPU alike: o, lse, dq, dk, dv */
        const size_t off[] = {0, nq, nq + nl, 2 * nq + nl, 2 * nq + nl + nk}, nout = off[4] + nk;
        const size_t len[] = {nq, nl, nq, nk, nk};
        gcase_t gc = {.B = 1,
                      .Tq = Tq,
                      .Tk = Tk,
                      .H = H,
                      .Hkv = 1,
                      .D = D,
                      .causal = true,
                      .dtype = dt,
                      .cu = cu,
                      .n_cu = sizeof(cu) / sizeof(cu[0]),
                      .has_window = true,
                      .left = 40};
        float *x = malloc(nin * sizeof(float)), *cpu = calloc(nout + nl, sizeof(float));
        char *xs = malloc(nin * es);
        cr_assert(x != NULL && xs != NULL && cpu != NULL);
        float *delta = cpu + nout;
        ref_fill(x, nin, 40 + (uint64_t)kd, 1.0f, dt);
        ref_to_dtype(x, nin, dt, xs);
        stria_attn_params_t p = case_params(&gc);
        stria_tensor_t tq = stria_tensor_contiguous(xs, dt, Tq, H, D);
        stria_tensor_t tg = stria_tensor_contiguous(xs + nq * es, dt, Tq, H, D);
        stria_tensor_t tk = stria_tensor_contiguous(xs + 2 * nq * es, dt, Tk, 1, D);
        stria_tensor_t tv = stria_tensor_contiguous(xs + (2 * nq + nk) * es, dt, Tk, 1, D);
        stria_tensor_t to = stria_tensor_contiguous(cpu, STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tdq = stria_tensor_contiguous(cpu + off[2], STRIA_DTYPE_F32, Tq, H, D);
        stria_tensor_t tdk = stria_tensor_contiguous(cpu + off[3], STRIA_DTYPE_F32, Tk, 1, D);
        stria_tensor_t tdv = stria_tensor_contiguous(cpu + off[4], STRIA_DTYPE_F32, Tk, 1, D);
        float *lse = cpu + off[1];
        cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK);
        cr_assert_eq(stria_attn_fwd(&p, &tq, &tk, &tv, &to, lse, false), STRIA_OK, "%s",
                     stria_error_msg());
        cr_assert_eq(stria_attn_bwd_delta(&p, &to, &tg, delta), STRIA_OK, "%s", stria_error_msg());
        cr_assert_eq(stria_attn_bwd(&p, &tq, &tk, &tv, &tg, lse, delta, &tdq, &tdk, &tdv), STRIA_OK,
                     "%s", stria_error_msg());

        stria_device_t *dev = gpu_open();
        char *gin = gpu_upload(dev, xs, nin * es);
        float *glse_cpu = gpu_upload(dev, lse, nl * 4), *gdelta = gpu_upload(dev, delta, nl * 4);
        float *gout = NULL;
        cr_assert_eq(stria_device_alloc(dev, nout * 4, (void **)&gout), STRIA_OK);
        cr_assert_eq(stria_device_zero(dev, STRIA_STREAM_COMPUTE, gout, nout * 4), STRIA_OK);
        stria_tensor_t gq = tq, gg = tg, go = to, gdq = tdq;
        gq.data = gin, gg.data = gin + nq * es, go.data = gout, gdq.data = gout + off[2];
        stria_device_fwd_pass_t *fp = NULL;
        stria_device_bwd_pass_t *bp = NULL;
        cr_assert_eq(stria_device_attn_partial_init(dev, &p, &go, gout + off[1]), STRIA_OK);
        cr_assert_eq(stria_device_attn_fwd_begin(dev, &p, &gq, &fp), STRIA_OK, "%s",
                     stria_error_msg());
        cr_assert_eq(stria_device_attn_bwd_begin(dev, &p, &gq, &gg, glse_cpu, gdelta, &gdq, &bp),
                     STRIA_OK, "%s", stria_error_msg());
        for (int64_t b = NB - 1; b >= 0; b--) { /* the ring's order: own block last */
            stria_pos_run_t krun = {b * TB, 1, TB};
            stria_attn_params_t pb = p;
            pb.kv_tokens = TB;
            pb.kv_pos.runs = &krun;
            pb.kv_pos.n_runs = 1;
            stria_tensor_t kb =
                stria_tensor_contiguous(gin + (2 * nq + (size_t)(b * TB * D)) * es, dt, TB, 1, D);
            stria_tensor_t vb = kb;
            vb.data = (char *)kb.data + nk * es;
            stria_tensor_t dkb = stria_tensor_contiguous(gout + off[3] + (size_t)(b * TB * D),
                                                         STRIA_DTYPE_F32, TB, 1, D);
            stria_tensor_t dvb = dkb;
            dvb.data = (float *)dkb.data + nk;
            cr_assert_eq(stria_device_attn_fwd_block(fp, &pb, &kb, &vb, &go, gout + off[1], true),
                         STRIA_OK, "%s", stria_error_msg());
            cr_assert_eq(stria_device_attn_bwd_block(bp, &pb, &kb, &vb, &dkb, &dvb), STRIA_OK, "%s",
                         stria_error_msg());
        }
        stria_device_attn_fwd_end(fp);
        cr_assert_eq(stria_device_attn_bwd_end(bp, true), STRIA_OK, "%s", stria_error_msg());
        float *got = malloc(nout * sizeof(float));
        cr_assert(got != NULL);
        gpu_download(dev, got, gout, nout * 4);
        static const char *const names[] = {"O", "LSE", "dQ", "dK", "dV"};
        for (int i = 0; i < 5; i++) {
            double maxabs, d = max_diff(got + off[i], cpu + off[i], len[i], &maxabs);
            double tol = (2e-5 + 4.0 * dtype_term(&gc)) * (1.0 + maxabs);
            cr_expect(d <= tol, "%s dtype %s: the passes differ from the CPU by %.3g > %.3g",
                      names[i], stria_dtype_name(dt), d, tol);
        }
        free(got);
        stria_device_free(dev, gin), stria_device_free(dev, gout);
        stria_device_free(dev, glse_cpu), stria_device_free(dev, gdelta);
        stria_device_close(dev);
        free(x), free(xs), free(cpu);
    }
}

/* Bad documents and windows: the CUDA device refuses them like the CPU
 * kernels, before anything runs. */
Test(gpu_masks, bad_masks_match_cpu)
{
    static const int64_t cu_short[] = {0, 2, 3}, cu_dec[] = {0, 3, 2, 4};
    static const struct {
        const int64_t *cu;
        size_t n;
        bool has_window;
        int64_t left, right;
        const char *msg;
    } bad[] = {
        {cu_short, 3, false, 0, 0, "params.cu_seqlens ends at 3"},
        {cu_dec, 4, false, 0, 0, "params: cu_seqlens must not decrease (entry 2"},
        {NULL, 0, true, -2, 0, "params: window.left must be >= -1"},
        {NULL, 0, true, 4, 1, "params: window.right must be 0 or -1 with causal attention"},
    };
    stria_device_t *dev = gpu_open();
    float *buf = NULL, *lse = NULL, *o = NULL, *g = NULL;
    gcase_t gc = {.B = 1,
                  .Tq = 4,
                  .Tk = 4,
                  .H = 2,
                  .Hkv = 2,
                  .D = 32,
                  .causal = true,
                  .dtype = STRIA_DTYPE_F32};
    cr_assert_eq(stria_device_alloc(dev, 4 * 2 * 32 * 4, (void **)&buf), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, 4 * 2 * 32 * 4, (void **)&o), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, 4 * 2 * 32 * 4, (void **)&g), STRIA_OK);
    cr_assert_eq(stria_device_alloc(dev, 8 * 4, (void **)&lse), STRIA_OK);
    stria_tensor_t t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 4, 2, 32);
    stria_tensor_t tg = stria_tensor_contiguous(g, STRIA_DTYPE_F32, 4, 2, 32);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        stria_attn_params_t p = case_params(&gc);
        p.cu_seqlens = bad[i].cu;
        p.n_cu_seqlens = bad[i].n;
        p.has_window = bad[i].has_window;
        p.window_left = bad[i].left;
        p.window_right = bad[i].right;
        cr_expect_eq(stria_device_attn_fwd(dev, &p, &t, &t, &t, &to, lse, false),
                     STRIA_ERR_INVALID_ARG, "%s", bad[i].msg);
        cr_expect(strstr(stria_error_msg(), bad[i].msg) != NULL, "%s: got \"%s\"", bad[i].msg,
                  stria_error_msg());
        cr_expect_eq(stria_device_attn_bwd(dev, &p, &t, &t, &t, &t, lse, lse, &to, &tg, &t),
                     STRIA_ERR_INVALID_ARG, "%s", bad[i].msg);
        cr_expect(strstr(stria_error_msg(), bad[i].msg) != NULL, "%s: got \"%s\"", bad[i].msg,
                  stria_error_msg());
    }
    stria_device_free(dev, buf), stria_device_free(dev, o), stria_device_free(dev, lse);
    stria_device_free(dev, g);
    stria_device_close(dev);
}
