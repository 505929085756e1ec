/* Kernel suite, documents and windows: the masks in every layout, short
 * and empty documents, causal and non-causal windows, masks that mask
 * nothing, and their bad arguments. */
#include <criterion/criterion.h>

#include "kernels_test_util.h"

/* ---- documents and windows ------------------------------------------------- */

/* Random documents covering [0, S): lengths drawn from short ones (under 16
 * and 64), empty ones, and ones near the tile and sub-block sizes, so that
 * boundaries fall at every phase of a 16-token sub-block. Returns the entry
 * count (at most cap). */
static size_t random_docs(int64_t S, uint32_t seed, int64_t *cu, size_t cap)
{
    static const int64_t lens[] = {0,  1,  3,  5,   7, 9, 11, 13, 15, 16, 17, 0, 31, 33, 47,
                                   63, 64, 65, 100, 2, 4, 6,  8,  10, 12, 14, 0, 21, 29};
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
    cu[n++] = S; /* an empty document at the end */
    return n;
}

enum { LAYOUT_CONTIGUOUS, LAYOUT_STRIPED, LAYOUT_ZIGZAG, N_LAYOUTS };
static const char *const layout_names[] = {"contiguous", "striped", "zigzag"};

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

/* A case of the query block of rank r against the key block of rank j. */
static kcase_t layout_case(int layout, int64_t S, int64_t N, int64_t r, int64_t j, bool causal,
                           stria_dtype_t dtype)
{
    kcase_t c = {.B = 1,
                 .Tq = S / N,
                 .Tk = S / N,
                 .H = 2,
                 .Hkv = 1,
                 .D = 32,
                 .causal = causal,
                 .dtype = dtype,
                 .threads = 1};
    c.n_qruns = layout_runs(layout, S, N, r, c.qruns);
    c.n_kruns = layout_runs(layout, S, N, j, c.kruns);
    return c;
}

Test(kernels, documents_in_every_layout)
{
    enum { S = 384, N = 2 };
    int64_t cu[S + 4];
    static const int64_t pairs[][2] = {{1, 0}, {1, 1}, {0, 1}, {0, 0}};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t pr = 0; pr < 4; pr++)
            for (int causal = 0; causal < 2; causal++)
                for (size_t t = 0; t < 3; t++) {
                    kcase_t c = layout_case(layout, S, N, pairs[pr][0], pairs[pr][1], causal,
                                            all_dtypes[t]);
                    c.n_cu = random_docs(S, (uint32_t)(7 * layout + 3 * pr + causal + 1), cu,
                                         sizeof(cu) / sizeof(cu[0]));
                    c.cu = cu;
                    c.threads = 1 + (int)(pr % 2);
                    cr_log_info("documents: %s r=%lld j=%lld causal=%d %zu entries",
                                layout_names[layout], (long long)pairs[pr][0],
                                (long long)pairs[pr][1], causal, c.n_cu);
                    for_each_variant(&c);
                }
}

Test(kernels, documents_shorter_than_a_subblock_and_empty)
{
    /* every document 0..15 tokens long: every sub-block straddles several */
    enum { S = 200 };
    int64_t cu[S + 2];
    size_t n = 1;
    cu[0] = 0;
    for (int64_t len = 0; cu[n - 1] < S; len = (len + 7) % 16) {
        cu[n] = cu[n - 1] + len < S ? cu[n - 1] + len : S;
        n++;
    }
    for (int causal = 0; causal < 2; causal++)
        for (size_t t = 0; t < 3; t++) {
            kcase_t c = layout_case(LAYOUT_CONTIGUOUS, S, 1, 0, 0, causal, all_dtypes[t]);
            c.cu = cu;
            c.n_cu = n;
            for_each_variant(&c);
        }
}

Test(kernels, causal_windows)
{
    enum { S = 256, N = 2 };
    static const int64_t lefts[] = {0, 1, 63, 64, 65, S - 1, S, S + 7, -1};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(lefts) / sizeof(lefts[0]); w++)
            for (size_t t = 0; t < 3; t++) {
                kcase_t c = layout_case(layout, S, N, 1, w % 2, true, all_dtypes[t]);
                c.has_window = true;
                c.left = lefts[w];
                c.right = w % 3 == 0 ? -1 : 0;
                for_each_variant(&c);
            }
}

Test(kernels, noncausal_windows)
{
    enum { S = 256, N = 2 };
    static const int64_t rights[] = {0, 5, S, S + 3, -1};
    static const int64_t lefts[] = {-1, 0, 1, 64, S + 1};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(rights) / sizeof(rights[0]); w++)
            for (size_t lw = 0; lw < sizeof(lefts) / sizeof(lefts[0]); lw++) {
                kcase_t c = layout_case(layout, S, N, (int64_t)(lw % 2), (int64_t)(w % 2), false,
                                        all_dtypes[(w + lw) % 3]);
                c.has_window = true;
                c.left = lefts[lw];
                c.right = rights[w];
                for_each_variant(&c);
            }
}

Test(kernels, windows_with_documents)
{
    enum { S = 384, N = 2 };
    int64_t cu[S + 4];
    static const int64_t wins[][3] = {/* causal, left, right */
                                      {1, 5, 0},  {1, 64, -1}, {1, 0, 0},  {0, 17, 5},
                                      {0, -1, 0}, {0, 0, -1},  {0, 65, 65}};
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (size_t w = 0; w < sizeof(wins) / sizeof(wins[0]); w++)
            for (size_t t = 0; t < 3; t++) {
                kcase_t c =
                    layout_case(layout, S, N, 1, (int64_t)(w % 2), wins[w][0] != 0, all_dtypes[t]);
                c.n_cu =
                    random_docs(S, (uint32_t)(11 * layout + w + 5), cu, sizeof(cu) / sizeof(cu[0]));
                c.cu = cu;
                c.has_window = true;
                c.left = wins[w][1];
                c.right = wins[w][2];
                for_each_variant(&c);
            }
}

static void expect_same_bits(const char *what, const char *variant, const char *mask,
                             const float *a, const float *b, size_t n)
{
    cr_expect(memcmp(a, b, n * sizeof(float)) == 0,
              "%s: variant %s: %s differs from no mask in its bits", what, variant, mask);
}

/* Documents [0, S) and window (-1, -1) mask nothing: every output keeps the
 * bits of the call without them, forward and backward, in every variant. */
Test(kernels, masks_that_mask_nothing_are_bit_identical)
{
    enum { S = 320, N = 2 };
    static const int64_t whole[] = {0, S};
    static const int64_t whole_longer[] = {0, S + 50};
    const char *const *names = stria_kernels_variant_names();
    for (int layout = 0; layout < N_LAYOUTS; layout++)
        for (int causal = 0; causal < 2; causal++)
            for (size_t t = 0; t < 3; t++)
                for (size_t v = 0; names[v] != NULL; v++) {
                    if (!stria_kernels_variant_available(names[v]))
                        continue;
                    kcase_t c = layout_case(layout, S, N, 1, causal, causal, all_dtypes[t]);
                    c.threads = 1 + causal;
                    size_t nq = (size_t)(c.B * c.Tq * c.H * c.D);
                    size_t nk = (size_t)(c.B * c.Tk * c.Hkv * c.D);
                    size_t nl = (size_t)(c.B * c.H * c.Tq);
                    outs_t plain;
                    run_outputs(&c, names[v], 3.0f, &plain);
                    for (int m = 0; m < 4; m++) {
                        kcase_t cm = c;
                        static const char *const what[] = {"cu_seqlens [0, S]", "window (-1, -1)",
                                                           "both", "cu_seqlens [0, S + 50]"};
                        if (m == 0 || m == 2) {
                            cm.cu = whole;
                            cm.n_cu = 2;
                        }
                        if (m == 3) {
                            cm.cu = whole_longer;
                            cm.n_cu = 2;
                        }
                        if (m == 1 || m == 2) {
                            cm.has_window = true;
                            cm.left = -1;
                            cm.right = -1;
                        }
                        outs_t got;
                        run_outputs(&cm, names[v], 3.0f, &got);
                        expect_same_bits("O", names[v], what[m], got.o, plain.o, nq);
                        expect_same_bits("LSE", names[v], what[m], got.lse, plain.lse, nl);
                        expect_same_bits("dQ", names[v], what[m], got.dq, plain.dq, nq);
                        expect_same_bits("dK", names[v], what[m], got.dk, plain.dk, nk);
                        expect_same_bits("dV", names[v], what[m], got.dv, plain.dv, nk);
                        outs_free(&got);
                    }
                    outs_free(&plain);
                }
}

/* A real mask must change the result: guards the checks above against a
 * kernel that ignores the new fields. */
Test(kernels, masks_change_results)
{
    enum { S = 128 };
    static const int64_t cu[] = {0, 40, 128};
    kcase_t c = layout_case(LAYOUT_CONTIGUOUS, S, 1, 0, 0, true, STRIA_DTYPE_F32);
    size_t nq = (size_t)(c.B * c.Tq * c.H * c.D);
    outs_t plain, docs, win;
    run_outputs(&c, "portable", 1.0f, &plain);
    c.cu = cu;
    c.n_cu = 3;
    run_outputs(&c, "portable", 1.0f, &docs);
    c.cu = NULL;
    c.n_cu = 0;
    c.has_window = true;
    c.left = 3;
    run_outputs(&c, "portable", 1.0f, &win);
    cr_expect(memcmp(plain.o, docs.o, nq * 4) != 0, "documents changed nothing");
    cr_expect(memcmp(plain.o, win.o, nq * 4) != 0, "the window changed nothing");
    /* rows before the document boundary see the same keys */
    cr_expect(memcmp(plain.o, docs.o, 40 * (size_t)(c.H * c.D) * 4) == 0,
              "rows of the first document changed");
    outs_free(&plain), outs_free(&docs), outs_free(&win);
}

Test(kernels, masks_bad_arguments_get_clear_errors)
{
    float buf[4 * 2 * 32] = {0}, g1[4 * 2 * 32] = {0}, g2[4 * 2 * 32] = {0}, lse[8];
    stria_attn_params_t p;
    stria_tensor_t t;
    int64_t cu_bad0[] = {1, 4}, cu_dec[] = {0, 3, 2, 4}, cu_short[] = {0, 2, 3}, cu_ok[] = {0, 4};
    struct {
        const int64_t *cu;
        size_t n;
        bool causal, has_window;
        int64_t left, right;
        const char *needle;
    } bad[] = {
        {NULL, 2, true, false, 0, 0, "params: cu_seqlens is NULL with 2 entries"},
        {cu_bad0, 2, true, false, 0, 0, "params: cu_seqlens must start at 0 (got 1)"},
        {cu_dec, 4, true, false, 0, 0,
         "params: cu_seqlens must not decrease (entry 2 is 2 after 3)"},
        {cu_short, 3, true, false, 0, 0, "params.cu_seqlens ends at 3"},
        {NULL, 0, true, true, -2, 0, "params: window.left must be >= -1 (-1: unbounded) (got -2)"},
        {NULL, 0, false, true, 0, -5,
         "params: window.right must be >= -1 (-1: unbounded) (got -5)"},
        {NULL, 0, true, true, 4, 1, "params: window.right must be 0 or -1 with causal attention"},
        {NULL, 0, true, false, 3, 0,
         "params: window_left/window_right are set (3, 0) but "
         "has_window is false"},
        {cu_ok, 2, false, false, 0, 7, "has_window is false"},
    };
    cr_assert_eq(stria_kernels_set_variant("portable"), STRIA_OK);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        block_params(&p, 4, 4, 2, 32);
        t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
        stria_tensor_t o = t;
        p.causal = bad[i].causal;
        p.cu_seqlens = bad[i].cu;
        p.n_cu_seqlens = bad[i].n;
        p.has_window = bad[i].has_window;
        p.window_left = bad[i].left;
        p.window_right = bad[i].right;
        expect_error(stria_attn_fwd(&p, &t, &t, &t, &o, lse, false), STRIA_ERR_INVALID_ARG,
                     bad[i].needle);
        stria_tensor_t dk = stria_tensor_contiguous(g1, STRIA_DTYPE_F32, 4, 2, 32);
        stria_tensor_t dv = stria_tensor_contiguous(g2, STRIA_DTYPE_F32, 4, 2, 32);
        expect_error(stria_attn_bwd(&p, &t, &t, &t, &t, lse, lse, &o, &dk, &dv),
                     STRIA_ERR_INVALID_ARG, bad[i].needle);
        expect_error(stria_attn_bwd(&p, &t, &t, &t, &t, lse, lse, &o, &dk, &dv),
                     STRIA_ERR_INVALID_ARG, "stria_attn_bwd: ");
    }
    /* the end must be past the key positions too */
    block_params(&p, 4, 4, 2, 32);
    stria_pos_run_t kr = {10, 1, 4};
    int64_t cu_q[] = {0, 8};
    p.kv_pos = (stria_positions_t){&kr, 1};
    p.cu_seqlens = cu_q;
    p.n_cu_seqlens = 2;
    t = stria_tensor_contiguous(buf, STRIA_DTYPE_F32, 4, 2, 32);
    expect_error(stria_attn_fwd(&p, &t, &t, &t, &t, lse, false), STRIA_ERR_INVALID_ARG,
                 "the key positions reach 13");
    /* a valid window is accepted */
    block_params(&p, 4, 4, 2, 32);
    p.has_window = true;
    p.window_left = 0;
    p.window_right = 0;
    cr_expect_eq(stria_attn_fwd(&p, &t, &t, &t, &t, lse, false), STRIA_OK, "%s", stria_error_msg());
}

/* A pass keeps its own copy of the documents, and its blocks must have the
 * same documents and window as its begin. */
Test(kernels, pass_blocks_must_match_masks)
{
    float q[2 * 16] = {0}, k[2 * 16] = {0}, o[2 * 16], lse[2], delta[2] = {0};
    float dk[2 * 16] = {0}, dv[2 * 16] = {0}, dq[2 * 16] = {0};
    int64_t cu[] = {0, 1, 2}, other[] = {0, 2, 2};
    stria_attn_params_t p = tiny_params();
    p.cu_seqlens = cu;
    p.n_cu_seqlens = 3;
    p.has_window = true;
    p.window_left = 1;
    p.window_right = 3;
    stria_tensor_t tq = stria_tensor_contiguous(q, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tk = stria_tensor_contiguous(k, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t to = stria_tensor_contiguous(o, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdk = stria_tensor_contiguous(dk, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdv = stria_tensor_contiguous(dv, STRIA_DTYPE_F32, 2, 1, 16);
    stria_tensor_t tdq = stria_tensor_contiguous(dq, STRIA_DTYPE_F32, 2, 1, 16);
    stria_attn_fwd_pass_t *fp = NULL;
    stria_attn_bwd_pass_t *bp = NULL;

    cr_assert_eq(stria_attn_fwd_begin(&p, &tq, &fp), STRIA_OK, "%s", stria_error_msg());
    cr_assert_eq(stria_attn_bwd_begin(&p, &tq, &tq, lse, delta, &bp), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_fwd_block(fp, &p, &tk, &tk, &to, lse, false), STRIA_OK, "%s",
                 stria_error_msg());
    /* each row sees only its own key (documents of one token): LSE = its
     * score, 0 for zero inputs */
    cr_expect(lse[0] == 0.0f && lse[1] == 0.0f, "LSE %g %g, want 0 0", lse[0], lse[1]);
    stria_attn_params_t bad = p;
    bad.cu_seqlens = other;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    expect_error(stria_attn_bwd_block(bp, &bad, &tk, &tk, &tdk, &tdv), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    bad = p;
    bad.n_cu_seqlens = 0;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    bad = p;
    bad.window_left = 2;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.window differs");
    expect_error(stria_attn_bwd_block(bp, &bad, &tk, &tk, &tdk, &tdv), STRIA_ERR_INVALID_ARG,
                 "params.window differs");
    bad = p;
    bad.has_window = false;
    bad.window_left = 0;
    bad.window_right = 0;
    expect_error(stria_attn_fwd_block(fp, &bad, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.window differs");
    /* the pass compares against its own copy: changing the caller's array
     * after begin is a mismatch, not a silent change of the pass */
    cu[1] = 2;
    expect_error(stria_attn_fwd_block(fp, &p, &tk, &tk, &to, lse, false), STRIA_ERR_INVALID_ARG,
                 "params.cu_seqlens differs");
    cu[1] = 1;
    cr_assert_eq(stria_attn_bwd_block(bp, &p, &tk, &tk, &tdk, &tdv), STRIA_OK, "%s",
                 stria_error_msg());
    cr_assert_eq(stria_attn_bwd_end(bp, &tdq), STRIA_OK, "%s", stria_error_msg());
    stria_attn_fwd_end(fp);
}
